//! Whether ranks share CPUs (`src/comm/setup/crowd.rs`), end to end: ranks are processes of
//! this test binary, each binding itself to the CPUs in `BIND_CPUS` before init, on
//! `DSPARK_HOST_ID` "hosts" of one kernel (loopback). Checked, on every rank:
//! - two ranks bound to one CPU are oversubscribed (their spin yields the CPU), also when
//!   they are two "hosts" over TCP (each host counts one rank; the kernel is the same);
//! - ranks bound to CPUs of their own are not (their spin does not yield);
//! - in one communicator, the ranks on a shared CPU are and the one alone is not;
//! - the words in `CommInfo::cpu_sharing` say it;
//! - allreduce is exact either way (against the closed-form sum);
//! - under a cgroup CPU quota (made here, as root) the description says how many ranks share
//!   it, and `dspark-bench`'s footer how long it held them stopped.
//!
//! Needs 2 CPUs this process may use for the cases with a CPU each; prints why it skips them
//! otherwise (`taskset -c 0,1 cargo test --test crowd` runs them on any machine with 2).

mod common;

use std::time::Duration;

use common::procs::{assert_all, rank_entry, spawn, vars, OK};
use dspark::{Communicator, ReduceOp};
use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// Entry point of a rank process. In a normal test run (no scenario set) it returns at once.
#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

fn run_scenario(_: &str) -> Result<i32, String> {
    if let Ok(procs) = std::env::var("CGROUP_PROCS") {
        std::fs::write(&procs, std::process::id().to_string())
            .map_err(|e| format!("joining {procs}: {e}"))?;
    }
    let cpus = dspark::internals::cpus::parse_list(&std::env::var("BIND_CPUS").unwrap_or_default());
    let mut set = CpuSet::new();
    for &c in &cpus {
        set.set(c).map_err(|e| format!("cpu {c}: {e}"))?;
    }
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|e| format!("binding to {cpus:?}: {e}"))?;
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    let info = comm.info();
    let want_shared = std::env::var("WANT_SHARED").unwrap_or_default() == "yes";
    let words = &info.cpu_sharing;
    if info.spin_yields != want_shared || words.contains("oversubscribed") != want_shared {
        return Err(format!(
            "rank {} on CPUs {cpus:?}: want shared={want_shared}, the spin yields={}, it says: \
             {words}",
            comm.rank(),
            info.spin_yields
        ));
    }
    if let Ok(want) = std::env::var("WANT_WORDS") {
        if !words.contains(&want) {
            return Err(format!(
                "rank {}: {words:?} does not say {want:?}",
                comm.rank()
            ));
        }
    }
    // Exact either way: every rank contributes rank + i, an odd count.
    let n = comm.world_size();
    let count = 1001;
    let mut v: Vec<f32> = (0..count).map(|i| (comm.rank() + i) as f32).collect();
    comm.all_reduce(&mut v, ReduceOp::Sum)
        .map_err(|e| format!("all_reduce: {e}"))?;
    let rank_sum = (n * (n - 1) / 2) as f32;
    for (i, x) in v.iter().enumerate() {
        let want = rank_sum + (n * i) as f32;
        if *x != want {
            return Err(format!("element {i}: {x}, want {want}"));
        }
    }
    Ok(OK)
}

/// Runs one rank per entry of `ranks` (host id, CPUs, whether it must find its CPUs shared,
/// words its description must hold).
fn run(ranks: &[(&'static str, &'static str, bool, &'static str)], what: &str) {
    run_in(ranks, None, what);
}

/// [`run`], every rank first moving itself into the cgroup whose `cgroup.procs` is `procs`.
fn run_in(
    ranks: &[(&'static str, &'static str, bool, &'static str)],
    procs: Option<&str>,
    what: &str,
) {
    let outs = spawn(
        ranks.len(),
        "crowd",
        &|r| {
            let (host, cpus, shared, words) = ranks[r];
            let mut v = vars(&[
                ("DSPARK_TRANSPORT", "auto"),
                ("DSPARK_HOST_ID", host),
                ("DSPARK_TIMEOUT", "60"),
                ("BIND_CPUS", cpus),
                ("WANT_SHARED", if shared { "yes" } else { "no" }),
            ]);
            if !words.is_empty() {
                v.extend(vars(&[("WANT_WORDS", words)]));
            }
            if let Some(p) = procs {
                v.extend(vars(&[("CGROUP_PROCS", p)]));
            }
            v
        },
        None,
    )
    .wait(Duration::from_secs(90));
    assert_all(&outs, OK, what);
}

/// A child of this process's CPU cgroup with a CPU quota, removed on drop; `Err`: why none
/// could be made (not root, a read-only cgroup tree, no CPU controller, cgroup v2 without
/// `cpu` delegated to this cgroup's children).
struct QuotaCgroup(std::path::PathBuf);

impl QuotaCgroup {
    /// A quota of `quota_us` per 100 ms (100 000: one CPU).
    fn new(quota_us: u64) -> Result<QuotaCgroup, String> {
        use dspark::internals::cpus::cpu_cgroups;
        let read = |p: &str| std::fs::read_to_string(p).map_err(|e| format!("{p}: {e}"));
        let cgs = cpu_cgroups(&read("/proc/self/cgroup")?, &read("/proc/self/mountinfo")?);
        let cg = cgs
            .first()
            .ok_or("no cgroup hierarchy with the CPU controller")?;
        let dir = cg.dir.join(format!(
            "dspark-crowd-test-{}-{quota_us}",
            std::process::id()
        ));
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let made = QuotaCgroup(dir.clone());
        let (file, value) = if cg.v1 {
            ("cpu.cfs_quota_us", quota_us.to_string())
        } else {
            ("cpu.max", format!("{quota_us} 100000"))
        };
        std::fs::write(dir.join(file), value)
            .map_err(|e| format!("writing {}: {e}", dir.join(file).display()))?;
        Ok(made)
    }

    fn procs(&self) -> String {
        self.0.join("cgroup.procs").display().to_string()
    }
}

impl Drop for QuotaCgroup {
    fn drop(&mut self) {
        // Its ranks have exited; an empty cgroup is removed with rmdir.
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `dspark-bench --ranks 2` with its ranks in a cgroup: its footer says how long the quota
/// held them stopped (the table's median windows hide it), and says no where the quota is
/// ample; a run under no quota has no such line. Needs a cgroup it can make (root).
#[test]
fn the_bench_footer_says_how_long_a_cpu_quota_held_its_ranks() {
    const BENCH: &str = env!("CARGO_BIN_EXE_dspark-bench");
    let bench = |procs: Option<&str>| {
        // A shell joins the cgroup, then becomes the bench: its ranks are born inside.
        let mut cmd = std::process::Command::new("sh");
        cmd.args([
            "-c",
            r#"[ -z "$1" ] || echo $$ > "$1" || exit 9; shift; exec "$@""#,
            "sh",
            procs.unwrap_or(""),
            BENCH,
        ])
        // Work that outlasts the quota's 5 ms per period on any machine: the runs take
        // tens of ms of two spinning ranks' CPU even where 4 MiB moves at 20 GB/s (an 8-byte
        // run of 20000 calls fit inside one period's 5 ms on a fast CI machine).
        .args(["--ranks", "2", "--transport", "shm", "-b", "4M", "-e", "4M"])
        .args(["-n", "100", "-w", "2"])
        .env("DSPARK_TIMEOUT", "60");
        let out = cmd.output().expect("sh");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{procs:?}: {}\n{text}", out.status);
        assert!(text.contains("Out of bounds values : 0 OK"), "{text}");
        text.lines()
            .find(|l| l.starts_with("# Throttled"))
            .map(str::to_string)
    };
    // Under no quota of its own (most machines): a run has no throttle line, and a quota
    // made here is the only one over its ranks.
    let free = dspark::internals::cpus::quota().is_none();
    if free {
        assert_eq!(bench(None), None, "no quota, yet a throttle line");
    }
    // 5 ms of CPU per 100 ms for two spinning ranks: held back most of the time.
    let tight = match QuotaCgroup::new(5_000) {
        Ok(cg) => cg,
        Err(why) => {
            println!("skipped: no cgroup with a CPU quota could be made here ({why}); as root on a machine with the CPU controller, cargo test --test crowd runs it");
            return;
        }
    };
    let line = bench(Some(&tight.procs())).expect("no throttle line under a 0.05-CPU quota");
    let ms: f64 = line
        .strip_prefix("# Throttled            : ")
        .and_then(|r| r.split(" ms ").next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no time in {line:?}"));
    assert!(ms > 10.0, "{line}");
    assert!(
        line.contains("ranks 0-1 under a cgroup CPU quota"),
        "{line}"
    );
    drop(tight);
    if !free {
        println!(
            "skipped the ample quota: a quota over this process already (a child's may not \
             exceed it, and it may hold the ranks back)"
        );
        return;
    }
    // Ten CPUs' worth for two ranks: never held back.
    let ample = QuotaCgroup::new(1_000_000).expect("a second cgroup");
    let line = bench(Some(&ample.procs())).expect("no throttle line under a quota");
    assert!(
        line.starts_with("# Throttled            : no (ranks 0-1 under"),
        "{line}"
    );
}

/// The first two CPUs this process may use, or why the test cannot run.
fn two_cpus() -> Option<(String, String)> {
    let cpus = dspark::internals::cpus::allowed();
    if cpus.len() < 2 {
        println!(
            "skipped: needs 2 CPUs this process may use, has {cpus:?} (taskset -c 0,1 cargo \
             test --test crowd on a machine with 2)"
        );
        return None;
    }
    Some((cpus[0].to_string(), cpus[1].to_string()))
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

#[test]
fn two_hosts_of_one_kernel_bound_to_one_cpu_share_it() {
    let cpu = leak(dspark::internals::cpus::allowed()[0].to_string());
    let words = leak(format!("2 ranks on CPU {cpu}: oversubscribed"));
    // Hosts "a" and "b": each counts one rank of its own; over TCP.
    run(
        &[("a", cpu, true, words), ("b", cpu, true, words)],
        "two hosts, one CPU",
    );
    // One host: shared memory.
    run(
        &[("a", cpu, true, words), ("a", cpu, true, words)],
        "one host, one CPU",
    );
}

#[test]
fn ranks_on_cpus_of_their_own_do_not_share_and_a_shared_cpu_is_told_apart() {
    let Some((c0, c1)) = two_cpus() else { return };
    let (c0, c1) = (leak(c0), leak(c1));
    let alone = leak(format!("no other rank on its CPUs ({c1})"));
    run(
        &[("a", c0, false, ""), ("b", c1, false, alone)],
        "two hosts, a CPU each",
    );
    // Ranks 0 and 1 on the first CPU, rank 2 alone on the second; two of them on host "b".
    run(
        &[
            ("a", c0, true, ""),
            ("b", c0, true, ""),
            ("b", c1, false, alone),
        ],
        "a shared CPU and one alone",
    );
}

/// Two ranks with a CPU each but under one cgroup quota of one CPU (a container's CPU limit):
/// not sharing CPUs by their masks, so their spin does not yield, but their description says
/// that they are more than the quota allows. Needs a cgroup it can make (root).
#[test]
fn ranks_under_a_cpu_quota_smaller_than_they_are_are_told() {
    let Some((c0, c1)) = two_cpus() else { return };
    let cg = match QuotaCgroup::new(100_000) {
        Ok(cg) => cg,
        Err(why) => {
            println!("skipped: no cgroup with a CPU quota could be made here ({why}); as root on a machine with the CPU controller, cargo test --test crowd runs it");
            return;
        }
    };
    let words = "; 2 ranks under a CPU quota of 1 CPU (cgroup): more than it allows";
    let procs = leak(cg.procs());
    run_in(
        &[("a", leak(c0), false, words), ("a", leak(c1), false, words)],
        Some(procs),
        "two ranks, one CPU of quota",
    );
}
