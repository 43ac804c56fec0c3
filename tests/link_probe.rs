//! The link probe (issue 25, item 3): a communicator over several hosts measures the link
//! between them at init (rank 0 and the first rank of the next host), rank 0 broadcasts what
//! it measured, and every rank's cost model prices the hops between hosts with it. Hosts are
//! `DSPARK_HOST_ID`s on loopback (ranks run as processes of this test binary). Checked: every
//! rank holds the same link constants, bit for bit (gathered from every rank), plausible ones
//! (α under a second, a rate between 10 Mbit/s and 10 Tbit/s), the model line says them;
//! `DSPARK_LINK_PROBE=0` on rank 0 turns the probe off for every rank, whatever the others
//! say; one host has no link; and allreduce stays exact after the probe (it shares the
//! communicator's sequence with the user's calls).

mod common;

use std::time::Duration;

use common::procs::{assert_all, rank_entry, spawn, vars, OK};
use dspark::{Communicator, ReduceOp};

/// Entry point of a rank process. In a normal test run (no scenario set) it returns at once.
#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

fn run_scenario(s: &str) -> Result<i32, String> {
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    let want = std::env::var("WANT_LINK").unwrap_or_default();
    let link = comm.cost_model().link;
    let line = &comm.info().cost_model;
    match (want.as_str(), link) {
        ("yes", Some(l)) => {
            if !(l.alpha_us > 0.0 && l.alpha_us < 1e6) {
                return Err(format!("link α {} µs", l.alpha_us));
            }
            let gbit = l.gbit_per_s();
            if !(0.01..1e4).contains(&gbit) {
                return Err(format!("link rate {gbit} Gbit/s"));
            }
            if !line.contains("(probed)") || !line.contains("link: rank 0 ↔ rank") {
                return Err(format!("the model line does not say the link: {line}"));
            }
            // Every rank the same constants, bit for bit.
            let mine = [l.alpha_us.to_bits(), l.beta_us_per_byte.to_bits()];
            let n = comm.world_size();
            let mut all = vec![0u64; 2 * n];
            comm.all_gather(&mine, &mut all)
                .map_err(|e| format!("all_gather: {e}"))?;
            if all.chunks(2).any(|c| c != mine) {
                return Err(format!("ranks hold different links: {all:x?}"));
            }
        }
        ("no", None) => {
            if line.contains("probed") {
                return Err(format!("no link, yet the model line says one: {line}"));
            }
        }
        (w, l) => {
            return Err(format!(
                "WANT_LINK={w:?} but the model holds {l:?} ({line})"
            ))
        }
    }
    // The user's first calls after the probe: exact, on a prime count.
    let n = comm.world_size();
    let r = comm.rank();
    for count in [1usize, 1031, 300_007] {
        let mut v: Vec<f64> = (0..count)
            .map(|i| ((r + 1) * (i % 13 + 1)) as f64)
            .collect();
        comm.all_reduce(&mut v, ReduceOp::Sum)
            .map_err(|e| format!("all_reduce: {e}"))?;
        let scale = (n * (n + 1) / 2) as f64;
        if let Some(i) = (0..count).find(|&i| v[i] != scale * (i % 13 + 1) as f64) {
            return Err(format!(
                "{s}: all_reduce of {count}: element {i} is {}",
                v[i]
            ));
        }
    }
    Ok(OK)
}

/// Runs `world` ranks on the hosts `host(r)` with `extra(r)` variables, expecting `want`.
fn run(
    world: usize,
    host: &dyn Fn(usize) -> &'static str,
    extra: &dyn Fn(usize) -> Vec<(String, String)>,
    want: &str,
    what: &str,
) {
    let outs = spawn(
        world,
        "probe",
        &|r| {
            let mut v = vars(&[
                ("DSPARK_TRANSPORT", "auto"),
                ("DSPARK_HOST_ID", host(r)),
                ("DSPARK_TIMEOUT", "60"),
                ("WANT_LINK", want),
            ]);
            v.extend(extra(r));
            v
        },
        None,
    )
    .wait(Duration::from_secs(90));
    assert_all(&outs, OK, what);
}

#[test]
fn two_hosts_of_two_ranks_probe_the_link_and_every_rank_holds_rank_0s_constants() {
    run(
        4,
        &|r| if r < 2 { "a" } else { "b" },
        &|_| Vec::new(),
        "yes",
        "2 hosts x 2 ranks",
    );
}

#[test]
fn uneven_hosts_and_single_rank_hosts_probe_too() {
    // Hosts of 2, 1 and 2 ranks: rank 0 pairs with rank 2 (the first on another host).
    run(
        5,
        &|r| match r {
            0 | 1 => "a",
            2 => "b",
            _ => "c",
        },
        &|_| Vec::new(),
        "yes",
        "hosts of 2, 1 and 2 ranks",
    );
    // One rank per host, over TCP alone.
    run(
        3,
        &|r| ["a", "b", "c"][r],
        &|_| Vec::new(),
        "yes",
        "3 hosts x 1 rank",
    );
}

#[test]
fn rank_0s_link_probe_setting_decides_for_every_rank_and_one_host_has_no_link() {
    // Rank 0 says off, the others on: off everywhere.
    run(
        4,
        &|r| if r < 2 { "a" } else { "b" },
        &|r| vars(&[("DSPARK_LINK_PROBE", if r == 0 { "0" } else { "1" })]),
        "no",
        "DSPARK_LINK_PROBE=0 on rank 0",
    );
    // Rank 0 says on, another off: on everywhere.
    run(
        4,
        &|r| if r < 2 { "a" } else { "b" },
        &|r| vars(&[("DSPARK_LINK_PROBE", if r == 3 { "0" } else { "1" })]),
        "yes",
        "DSPARK_LINK_PROBE=0 on rank 3 only",
    );
    // One host: no link to probe.
    run(3, &|_| "a", &|_| Vec::new(), "no", "one host");
}
