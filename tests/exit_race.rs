//! A peer's exit fails only what still needs that peer (#22 item 3), over TCP, shared memory
//! and shm+tcp. This test binary re-executes itself as rank processes (`rank_process` is a
//! rank's entry point; it does nothing in a normal test run).
//!
//! One *lifetime*: three fresh ranks run all_reduce #1 of 1 MiB; the last rank leaves by
//! `std::process::exit` the moment its call returns, without dropping its communicator (no
//! goodbye, no destructor: as a rank whose training loop ends and whose process exits at once,
//! or a crash right after the call). The survivors' all_reduce #1 must succeed with the right
//! result — the exited rank delivered everything they need from it, and the other survivor's
//! abort for a failure in a later call must not fail a call it had completed itself — and
//! their next call (all_reduce #2, or in half the lifetimes a receive from the exited rank:
//! that survivor then aborts as soon as it sees the end, often while the other one is still
//! in #1, more so as every other lifetime runs rank 0 at the lowest priority), which needs
//! the exited rank, must fail naming it:
//! [`Error::PeerLost`] of rank 2, or [`Error::Aborted`] by the other survivor, whose reason
//! names rank 2.
//!
//! `DSPARK_EXIT_RACE_LIFETIMES` lifetimes (default 200) per transport; every lifetime runs,
//! failures are counted by kind and printed (`--nocapture`), and any failure fails the test.
//! Each lifetime is short (a small world; a next call that wrongly waited would meet a 10 s
//! deadline), so the 600 lifetimes of the three tests take a few minutes on two cores.
//!
//! Shared memory without TCP for the exited rank's data is `shm`; `shm+tcp` runs rank 0 on
//! host id `a` and ranks 1 and 2 on host id `b` (`DSPARK_HOST_ID`, loopback), so the exited
//! rank is a shm peer of rank 1 and a TCP peer of rank 0.

mod common;

use std::time::{Duration, Instant};

use common::procs::{rank_entry, say, spawn, vars, OK};
use dspark::internals::transport::TransportKind;
use dspark::{Communicator, Error, ReduceOp};

/// Ranks of every lifetime; the last one exits.
const WORLD: usize = 3;
const VICTIM: usize = WORLD - 1;
/// Exit status of the rank that leaves by `process::exit`.
const VICTIM_EXIT: i32 = 42;
/// Elements of all_reduce #1: 1 MiB of f32.
const COUNT: usize = (1 << 20) / 4;

/// Entry point of a rank process. In a normal test run (no scenario set) it returns at once.
#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

fn run_scenario(s: &str) -> Result<i32, String> {
    match s {
        "exit_race" => exit_race(),
        other => Err(format!("unknown scenario {other}")),
    }
}

/// One lifetime, on one rank (see the module docs).
fn exit_race() -> Result<i32, String> {
    let life: u64 = std::env::var("DSPARK_TEST_LIFETIME")
        .map_err(|_| "DSPARK_TEST_LIFETIME not set".to_string())?
        .parse()
        .map_err(|e| format!("DSPARK_TEST_LIFETIME: {e}"))?;
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    let (r, n) = (comm.rank(), comm.world_size());
    if let Ok(want) = std::env::var("WANT_TRANSPORT") {
        let got = comm.info().transport;
        if got.name() != want {
            return Err(format!(
                "transport {got}, expected {want} ({:?})",
                comm.info().transport_reason
            ));
        }
    }
    let sum = ReduceOp::Sum;
    let seed = 0xe1e7 + life;
    let mut a = common::inputs::<f32>(sum, seed, r, COUNT);
    let first = comm.all_reduce(&mut a, sum);
    if r == VICTIM {
        first.map_err(|e| format!("all_reduce #1 (the exiting rank): {e}"))?;
        // Gone at once: no goodbye, no destructor, the communicator never closed.
        std::process::exit(VICTIM_EXIT);
    }
    first.map_err(|e| format!("all_reduce #1 failed on a survivor: {e}"))?;

    // The next call at once (the result of #1 is checked after it, so that this survivor
    // races on while the other may still be finishing #1): all_reduce #2, or a receive from
    // the exited rank (which fails, and aborts, as soon as its end is seen). It needs the
    // exited rank, so it must fail naming it, not succeed or wait.
    let t = Instant::now();
    let (what, res) = if life % 4 >= 2 {
        let mut b = vec![0u8; 64];
        ("recv from it", comm.recv(&mut b, VICTIM).map(|_| ()))
    } else {
        let mut b = vec![1.0f32; 1024];
        ("all_reduce #2", comm.all_reduce(&mut b, sum))
    };
    let next = match res {
        Ok(()) => Err(format!(
            "next call: {what} succeeded without the exited rank {VICTIM}"
        )),
        Err(Error::PeerLost { peer, detail, .. }) if peer == VICTIM => {
            say(&format!(
                "next call failed after {:.1?}: lost rank {peer}: {detail}",
                t.elapsed()
            ));
            Ok(OK)
        }
        Err(Error::Aborted { by, reason, .. })
            if by != VICTIM && reason.contains(&format!("rank {VICTIM}")) =>
        {
            say(&format!(
                "next call aborted by rank {by} after {:.1?}: {reason}",
                t.elapsed()
            ));
            Ok(OK)
        }
        Err(e) => Err(format!(
            "next call: {what} failed with the wrong error (want one naming rank {VICTIM}): {e}"
        )),
    };
    common::check(
        "all_reduce #1",
        &a,
        &common::reduced::<f32>(sum, seed, n, COUNT),
    )
    .map_err(|e| format!("all_reduce #1 failed on a survivor: {e}"))?;
    next
}

/// Lifetimes per transport: `DSPARK_EXIT_RACE_LIFETIMES`, default 200.
fn lifetimes() -> usize {
    std::env::var("DSPARK_EXIT_RACE_LIFETIMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

/// Runs the lifetimes over one transport; `env(rank)` gives a rank's own variables. Counts
/// and prints lifetimes whose survivor failed all_reduce #1, whose next call did not fail
/// naming the exited rank, and any other failure; asserts there were none.
fn run_lifetimes(name: &str, env: &dyn Fn(usize) -> Vec<(String, String)>) {
    let n = lifetimes();
    let t0 = Instant::now();
    let (mut first, mut next, mut other, mut failed) = (0usize, 0usize, 0usize, 0usize);
    // How the survivors' next calls failed: the exited rank lost, or the other survivor's
    // abort (which, arriving during all_reduce #1, must have been held for the next call).
    let (mut lost, mut aborted) = (0usize, 0usize);
    let mut shown = Vec::new();
    for life in 0..n {
        let life_env = |r: usize| {
            let mut v = vars(&[
                // A next call that wrongly waits for the exited rank meets this soon.
                ("DSPARK_TIMEOUT", "10"),
                ("DSPARK_TEST_LIFETIME", &life.to_string()),
            ]);
            v.extend(env(r));
            v
        };
        // Every other lifetime rank 0 runs at the lowest priority, so that on a busy machine
        // it is often still finishing #1 when rank 1, done with #1, has lost rank 2 in #2 and
        // aborted: the abort must be held for rank 0's next call.
        let wrap = |r: usize| {
            if r == 0 && life % 2 == 1 {
                ["nice", "-n", "19"].map(String::from).to_vec()
            } else {
                Vec::new()
            }
        };
        let outs = spawn(WORLD, "exit_race", &life_env, Some(&wrap)).wait(Duration::from_secs(60));
        let mut bad = Vec::new();
        let (mut f1, mut fnext, mut fother) = (false, false, false);
        for (r, o) in outs.iter().enumerate() {
            lost += o.out.matches("next call failed after").count();
            aborted += o.out.matches("next call aborted by").count();
            let want = if r == VICTIM { VICTIM_EXIT } else { OK };
            if o.code == Some(want) {
                continue;
            }
            let why = o
                .out
                .lines()
                .find(|l| l.contains("RANK ERROR"))
                .unwrap_or("(no RANK ERROR line)");
            if why.contains("all_reduce #1 failed on a survivor") {
                f1 = true;
            } else if why.contains("next call") {
                fnext = true;
            } else {
                fother = true;
            }
            bad.push(format!("rank {r} exited {:?}: {why}", o.code));
        }
        first += f1 as usize;
        next += fnext as usize;
        other += fother as usize;
        if !bad.is_empty() {
            failed += 1;
            let line = format!("{name} lifetime {life}: {}", bad.join("; "));
            eprintln!("{line}");
            if shown.len() < 5 {
                shown.push(line);
            }
        }
    }
    eprintln!(
        "exit race over {name}: {n} lifetimes in {:.1?}: {failed} failed: {first} with a survivor's all_reduce \
         #1 failed, {next} with a next call that did not fail naming rank {VICTIM}, {other} \
         with another failure; the survivors' next calls: {lost} lost rank {VICTIM}, {aborted} \
         aborted by the other survivor",
        t0.elapsed()
    );
    assert!(
        failed == 0,
        "exit race over {name}: {failed} of {n} lifetimes failed; the first:\n{}",
        shown.join("\n")
    );
}

#[test]
fn over_tcp_a_rank_exiting_after_a_call_fails_only_the_survivors_next_call() {
    run_lifetimes("tcp", &|_| {
        vars(&[("DSPARK_TRANSPORT", "tcp"), ("WANT_TRANSPORT", "tcp")])
    });
}

#[test]
fn over_shm_a_rank_exiting_after_a_call_fails_only_the_survivors_next_call() {
    run_lifetimes("shm", &|_| {
        vars(&[("DSPARK_TRANSPORT", "shm"), ("WANT_TRANSPORT", "shm")])
    });
}

#[test]
fn over_shm_and_tcp_a_rank_exiting_after_a_call_fails_only_the_survivors_next_call() {
    run_lifetimes("shm+tcp", &|r| {
        let (host, want) = if r == 0 {
            ("a", TransportKind::Tcp)
        } else {
            ("b", TransportKind::ShmTcp)
        };
        vars(&[
            ("DSPARK_TRANSPORT", "auto"),
            ("DSPARK_HOST_ID", host),
            ("WANT_TRANSPORT", want.name()),
        ])
    });
}
