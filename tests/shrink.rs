//! [`Communicator::shrink`] across processes, over TCP and shared memory: the survivors of a
//! killed rank (3 and 5 ranks; on 5 the killed one is rank 0, so the survivors' first rank,
//! which leads the shrink, is not the old rank 0), the ranks of an aborted communicator, a
//! live rank the others exclude, and a survivor naming another excluded set. The shrunk
//! communicators' results are checked against values computed here from the survivors' old
//! ranks (all_reduce of an odd count, an all_gather of fewer elements than ranks that shows
//! the survivors' order, a broadcast from the last new rank).
//!
//! This binary re-executes itself as rank processes (`rank_process` is a rank's entry point;
//! it does nothing in a normal test run).

mod common;

use std::time::Duration;

use common::procs::{assert_all, rank_entry, say, spawn, vars, FAILED_AS_EXPECTED, OK};
use dspark::{Communicator, Error, ReduceOp};

#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

fn env_usize(k: &str) -> Result<usize, String> {
    std::env::var(k)
        .map_err(|_| format!("{k} not set"))?
        .parse()
        .map_err(|e| format!("{k}: {e}"))
}

fn run_scenario(s: &str) -> Result<i32, String> {
    let comm = if std::env::var_os("SHRINK_UNTIMED").is_some() {
        // No practical limit (`Duration::MAX`), which the shrink's own deadline once
        // overflowed on (a panic in the caller's thread).
        let mut config = dspark::Config::from_env().map_err(|e| format!("config: {e}"))?;
        config.timeout = Duration::MAX;
        Communicator::init(config)
    } else {
        Communicator::from_env()
    }
    .map_err(|e| format!("init: {e}"))?;
    // Every rank runs one collective on the whole communicator first.
    let mut one = vec![1u64; 3];
    comm.all_reduce(&mut one, ReduceOp::Sum)
        .map_err(|e| format!("first all_reduce: {e}"))?;
    if one != vec![comm.world_size() as u64; 3] {
        return Err(format!("first all_reduce gave {one:?}"));
    }
    match s {
        "killed" => killed(&comm),
        "aborted" => aborted(&comm),
        "excluded_live" => excluded_live(&comm),
        "disagree" => disagree(&comm),
        other => Err(format!("unknown scenario {other}")),
    }
}

/// Runs collectives on the parent until it fails as a lost peer or an abort makes it fail.
fn until_failure(comm: &Communicator) -> Result<(), String> {
    let mut buf = vec![1.0f32; 4096];
    for _ in 0..100_000 {
        match comm.all_reduce(&mut buf, ReduceOp::Sum) {
            Ok(()) => {}
            Err(e @ (Error::PeerLost { .. } | Error::Aborted { .. } | Error::Timeout { .. })) => {
                say(&format!("PARENT FAILED: {e}"));
                return Ok(());
            }
            Err(e) => return Err(format!("the parent failed with an unexpected error: {e}")),
        }
    }
    Err("the parent never failed".into())
}

/// Checks a shrunk communicator of the old ranks `survivors`, on old rank `old`.
fn check_shrunk(new: &Communicator, old: usize, survivors: &[usize]) -> Result<(), String> {
    let n = survivors.len();
    let want_rank = survivors
        .iter()
        .position(|&r| r == old)
        .ok_or("not a survivor")?;
    if new.world_size() != n || new.rank() != want_rank {
        return Err(format!(
            "shrunk to rank {} of {}, expected {want_rank} of {n}",
            new.rank(),
            new.world_size()
        ));
    }
    if let Ok(want) = std::env::var("WANT_TRANSPORT") {
        if new.info().transport.name() != want {
            return Err(format!(
                "the shrunk communicator runs {}, expected {want}",
                new.info().transport.name()
            ));
        }
    }
    // An odd count, values that depend on the old rank and the index, exactly representable.
    let count = 1001;
    let value = |r: usize, i: usize| ((r + 1) * 1000 + i % 7) as f64;
    let mut buf: Vec<f64> = (0..count).map(|i| value(old, i)).collect();
    new.all_reduce(&mut buf, ReduceOp::Sum)
        .map_err(|e| format!("all_reduce on the shrunk communicator: {e}"))?;
    for (i, got) in buf.iter().enumerate() {
        let want: f64 = survivors.iter().map(|&r| value(r, i)).sum();
        if *got != want {
            return Err(format!(
                "all_reduce element {i}: got {got}, expected {want}"
            ));
        }
    }
    let mut max = vec![old as i32 * 3 - 7; 1];
    new.all_reduce(&mut max, ReduceOp::Max)
        .map_err(|e| format!("all_reduce max: {e}"))?;
    let want_max = survivors
        .iter()
        .map(|&r| r as i32 * 3 - 7)
        .max()
        .unwrap_or(0);
    if max != vec![want_max] {
        return Err(format!("all_reduce max gave {max:?}, expected {want_max}"));
    }
    let mine = [old as u32];
    let mut all = vec![0u32; n];
    new.all_gather(&mine, &mut all)
        .map_err(|e| format!("all_gather: {e}"))?;
    let order: Vec<u32> = survivors.iter().map(|&r| r as u32).collect();
    if all != order {
        return Err(format!("all_gather gave {all:?}, expected {order:?}"));
    }
    let mut b = vec![if new.rank() == n - 1 { 42u8 } else { 0 }; 5];
    new.broadcast(&mut b, n - 1)
        .map_err(|e| format!("broadcast: {e}"))?;
    if b != vec![42u8; 5] {
        return Err(format!("broadcast gave {b:?}"));
    }
    say(&format!(
        "SHRUNK old rank {old} -> rank {} of {n} over {}",
        new.rank(),
        new.info().transport
    ));
    Ok(())
}

/// Rank `SHRINK_VICTIM` kills itself (SIGKILL) while the others run collectives; they see
/// the failure, shrink without it and check the new communicator.
fn killed(comm: &Communicator) -> Result<i32, String> {
    let victim = env_usize("SHRINK_VICTIM")?;
    let me = comm.rank();
    if me == victim {
        std::thread::sleep(Duration::from_millis(300));
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        return Err("still alive after SIGKILL".into());
    }
    until_failure(comm)?;
    let new = comm.shrink(&[victim]).map_err(|e| format!("shrink: {e}"))?;
    let survivors: Vec<usize> = (0..comm.world_size()).filter(|&r| r != victim).collect();
    check_shrunk(&new, me, &survivors)?;
    // The shrunk communicator can shrink again (its own door): the last rank leaves.
    let last = new.world_size() - 1;
    if new.rank() != last {
        let again = new
            .shrink(&[last])
            .map_err(|e| format!("second shrink: {e}"))?;
        check_shrunk(&again, new.rank(), &(0..last).collect::<Vec<_>>())?;
    }
    Ok(OK)
}

/// Rank 1 shrinks with an abort first (`shrink_aborting`, NCCL's SHRINK_ABORT) while the
/// others run collectives: they see the parent fail and shrink too, all with nobody
/// excluded. First every rank's argument errors with the abort: refused before aborting,
/// they leave the parent usable (they aborted it first before).
fn aborted(comm: &Communicator) -> Result<i32, String> {
    let me = comm.rank();
    for bad in [vec![comm.world_size() + 4], vec![me]] {
        match comm.shrink_aborting(&bad) {
            Err(Error::InvalidArgument { .. }) => {}
            Err(e) => return Err(format!("shrink_aborting({bad:?}): {e}")),
            Ok(_) => return Err(format!("shrink_aborting({bad:?}) succeeded")),
        }
    }
    let mut x = vec![me as u32 + 1; 5];
    comm.all_reduce(&mut x, ReduceOp::Sum)
        .map_err(|e| format!("all_reduce after the refused shrinks: {e}"))?;
    let n = comm.world_size() as u32;
    if x != vec![n * (n + 1) / 2; 5] {
        return Err(format!("all_reduce after the refused shrinks gave {x:?}"));
    }
    let new = if me == 1 {
        std::thread::sleep(Duration::from_millis(200));
        comm.shrink_aborting(&[])
    } else {
        until_failure(comm)?;
        comm.shrink(&[])
    }
    .map_err(|e| format!("shrink: {e}"))?;
    let all: Vec<usize> = (0..comm.world_size()).collect();
    check_shrunk(&new, me, &all)?;
    Ok(OK)
}

/// Four ranks; the first three shrink without rank 3, which is alive: rank 3 naming itself
/// is refused at once, and rank 3 naming nobody is refused by the leader (rank 0, which is
/// waiting for ranks 1 and 2: they join once rank 3 tells them over the healthy parent),
/// while the others go on.
fn excluded_live(comm: &Communicator) -> Result<i32, String> {
    let me = comm.rank();
    if me == 3 {
        match comm.shrink(&[3]) {
            Err(e @ Error::InvalidArgument { .. }) if e.to_string().contains("excluded") => {
                say(&format!("REFUSED LOCALLY: {e}"));
            }
            other => {
                return Err(format!(
                    "shrink naming itself: expected InvalidArgument, got {other:?}"
                ))
            }
        }
        let res = match comm.shrink(&[]) {
            Err(e @ Error::InvalidArgument { .. })
                if e.to_string()
                    .contains("rank 3 is excluded by the shrink rank 0 leads") =>
            {
                say(&format!("REFUSED BY THE LEADER: {e}"));
                Ok(FAILED_AS_EXPECTED)
            }
            other => Err(format!("expected the leader's refusal, got {other:?}")),
        };
        // Now ranks 1 and 2 may join rank 0's shrink (the parent is healthy).
        for peer in [1, 2] {
            comm.send(&[1u8], peer)
                .map_err(|e| format!("telling rank {peer}: {e}"))?;
        }
        return res;
    }
    if me != 0 {
        // Rank 0 leads and waits for these two: rank 3 reaches it first.
        let mut go = [0u8; 1];
        comm.recv(&mut go, 3)
            .map_err(|e| format!("waiting for rank 3: {e}"))?;
    }
    let new = comm.shrink(&[3]).map_err(|e| format!("shrink: {e}"))?;
    check_shrunk(&new, me, &[0, 1, 2])?;
    Ok(OK)
}

/// Four ranks; rank 3 leaves. Ranks 0 and 1 exclude rank 3, rank 2 excludes ranks 1 and 3:
/// every survivor gets a Mismatch naming both sets, nobody a communicator. Then they agree
/// and shrink again.
fn disagree(comm: &Communicator) -> Result<i32, String> {
    let me = comm.rank();
    if me == 3 {
        return Ok(OK);
    }
    let mine: &[usize] = if me == 2 { &[1, 3] } else { &[3] };
    match comm.shrink(mine) {
        Err(e @ Error::Mismatch { .. })
            if e.to_string().contains("ranks 1, 3") && e.to_string().contains("names rank 3") =>
        {
            say(&format!("DISAGREEMENT: {e}"));
        }
        Ok(c) => {
            return Err(format!(
                "a disagreeing shrink made rank {} of {}",
                c.rank(),
                c.world_size()
            ))
        }
        Err(e) => return Err(format!("expected a Mismatch naming both sets, got {e}")),
    }
    let new = comm
        .shrink(&[3])
        .map_err(|e| format!("second shrink: {e}"))?;
    check_shrunk(&new, me, &[0, 1, 2])?;
    Ok(OK)
}

/// Runs `scenario` on `world` ranks over `transport` with `extra` variables, and checks
/// that every rank but `skip` exited with its expected code.
fn run(
    world: usize,
    scenario: &str,
    transport: &str,
    extra: &[(&str, &str)],
    want: &dyn Fn(usize) -> Option<i32>,
) {
    let mut v = vars(&[
        ("DSPARK_TRANSPORT", transport),
        ("WANT_TRANSPORT", transport),
        ("DSPARK_TIMEOUT", "20"),
    ]);
    v.extend(vars(extra));
    let ranks = spawn(world, scenario, &|_| v.clone(), None);
    let outs = ranks.wait(Duration::from_secs(90));
    for (r, o) in outs.iter().enumerate() {
        let Some(code) = want(r) else { continue };
        assert_all(
            std::slice::from_ref(o),
            code,
            &format!("{scenario} on {world} ranks over {transport}, rank {r}"),
        );
    }
}

fn killed_on(world: usize, victim: usize, transport: &str) {
    let v = victim.to_string();
    run(world, "killed", transport, &[("SHRINK_VICTIM", &v)], &|r| {
        (r != victim).then_some(OK)
    });
}

#[test]
fn three_ranks_shrink_after_a_killed_rank_over_tcp() {
    killed_on(3, 2, "tcp");
}

#[test]
fn three_ranks_shrink_after_a_killed_rank_over_shm() {
    killed_on(3, 2, "shm");
}

#[test]
fn five_ranks_shrink_after_rank_0_was_killed_over_tcp() {
    killed_on(5, 0, "tcp");
}

#[test]
fn five_ranks_shrink_after_a_killed_rank_over_shm() {
    killed_on(5, 0, "shm");
}

#[test]
fn every_rank_of_an_aborted_communicator_shrinks_over_tcp_and_shm() {
    for t in ["tcp", "shm"] {
        run(3, "aborted", t, &[], &|_| Some(OK));
    }
    run(3, "aborted", "shm", &[("SHRINK_UNTIMED", "1")], &|_| {
        Some(OK)
    });
}

#[test]
fn a_live_rank_the_others_exclude_is_refused_and_they_go_on() {
    run(4, "excluded_live", "tcp", &[], &|r| {
        Some(if r == 3 { FAILED_AS_EXPECTED } else { OK })
    });
}

#[test]
fn survivors_naming_different_sets_all_fail_then_agree() {
    run(4, "disagree", "tcp", &[], &|_| Some(OK));
}
