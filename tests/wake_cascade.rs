//! Two ranks that fell out of step once must not keep each other asleep. Where waking a
//! sleeping rank takes longer than the engine's spin (an idle vCPU: 40–500 µs measured on
//! this project's 2-core VM, against the default 50 µs spin), each rank used to sleep while
//! the other was being woken, for every later call: one fresh 8-byte run over shared memory
//! in twelve took 184 µs a call instead of 0.25. The spin now grows after a wait that slept
//! and ended soon after (`engine::pace::Spin`).
//!
//! The test forces the condition on any machine with a 1 µs spin: 400 one-shot all_reduces
//! of 8 bytes over shared memory on 2 ranks (exact against `tests/common`'s reference), rank
//! 1 stalling 20 ms once before call 20. It counts, not times: the sleeps (the `wait` spans
//! of each rank's `DSPARK_TRACE`) in calls 60–400 on both ranks together. Kept alone in its
//! binary so that no other test's ranks share the two cores while it runs: a rank preempted
//! for a whole time slice is rightly slept on, and a machine that busy makes sleeps without
//! any cascade. This test binary re-executes itself as the rank processes (as tests/shm.rs).

mod common;

use std::time::Duration;

use common::procs::{assert_all, rank_entry, spawn, vars, OK};
use dspark::internals::transport::TransportKind;
use dspark::{Communicator, ReduceOp};

/// Calls, and the one before which rank 1 stalls.
const CALLS: usize = 400;
const STALL_AT: usize = 20;

/// Entry point of a rank process. In a normal test run (no scenario set) it returns at once.
#[test]
fn rank_process() {
    rank_entry(|s| match s {
        "cascade" => cascade(),
        other => Err(format!("unknown scenario {other}")),
    });
}

fn cascade() -> Result<i32, String> {
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    if comm.info().transport != TransportKind::Shm {
        return Err(format!("transport {}, not shm", comm.info().transport));
    }
    let (r, n) = (comm.rank(), comm.world_size());
    for i in 0..CALLS {
        if r == 1 && i == STALL_AT {
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut buf = common::inputs::<f32>(ReduceOp::Sum, i as u64, r, 2);
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        common::check(
            "all_reduce",
            &buf,
            &common::reduced::<f32>(ReduceOp::Sum, i as u64, n, 2),
        )?;
    }
    Ok(OK)
}

/// Removes the traces' folder however the test ends.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Without the adaptation every call from the stall on slept on one rank or the other (341
/// sleeps in these 341 calls, every run); with it, 21–56 here, idle or beside a busy loop.
/// The bound, half the calls, leaves room for a machine that preempts the ranks now and
/// then.
#[test]
fn ranks_that_fell_out_of_step_once_do_not_keep_each_other_asleep() {
    let dir = std::env::temp_dir().join(format!("dspark-cascade-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = RemoveOnDrop(dir.clone());
    let prefix = dir.join("run").to_string_lossy().into_owned();
    let outs = spawn(
        2,
        "cascade",
        &|_| {
            vars(&[
                ("DSPARK_TRANSPORT", "shm"),
                ("DSPARK_SPIN_US", "1"),
                ("DSPARK_TRACE", &prefix),
                ("DSPARK_TIMEOUT", "60"),
            ])
        },
        None,
    )
    .wait(Duration::from_secs(120));
    assert_all(&outs, OK, "cascade");
    let settled = STALL_AT + 40;
    let mut slept = 0;
    for r in 0..2 {
        let text = std::fs::read_to_string(dir.join(format!("run.rank{r}.json")))
            .unwrap_or_else(|e| panic!("rank {r}'s trace: {e}"));
        let events: Vec<serde_json::Value> =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("rank {r}: not JSON ({e})"));
        let call = |k: usize| {
            events
                .iter()
                .find(|e| e["cat"] == "call" && e["name"] == format!("all_reduce #{k}"))
                .and_then(|e| e["ts"].as_f64())
                .unwrap_or_else(|| panic!("rank {r}: no all_reduce #{k} in its trace"))
        };
        let from = call(settled);
        call(CALLS);
        slept += events
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == "wait")
            .filter(|e| e["ts"].as_f64().is_some_and(|t| t >= from))
            .count();
    }
    let calls = CALLS - settled + 1;
    eprintln!("{slept} sleeps on the two ranks in the {calls} calls after the stall");
    assert!(
        slept <= calls / 2,
        "{slept} sleeps on the two ranks in the {calls} calls after the stall had passed: \
         the ranks keep each other asleep"
    );
}
