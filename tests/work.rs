//! Non-blocking operations (`Communicator::scope`, `Work`), abort, per-call deadlines and
//! `split`, with ranks as threads over the in-process `mem` transport (the children of a
//! split connect over TCP on 127.0.0.1). Results are checked against the independent
//! reference in `common`.

mod common;

use std::sync::Barrier;
use std::time::{Duration, Instant};

use common::{check, inputs, mem_config as config, reduced};
use dspark::internals::transport::mem::MemFabric;
use dspark::{Communicator, Config, Error, ReduceOp};

/// Ranks as threads over a fresh `mem` fabric of 2 frames per link.
fn run_ranks<R: Send>(world: usize, cfg: &Config, f: impl Fn(&Communicator) -> R + Sync) -> Vec<R> {
    common::run_mem_ranks(&MemFabric::new(world, 2), world, cfg, f)
}

/// Every rank's error, not only the first: a rank that fails first makes the others fail
/// with "peer closed", and its own error says why.
fn all_ok(res: Vec<Result<(), String>>, what: &str) {
    let errs: Vec<String> = res
        .into_iter()
        .enumerate()
        .filter_map(|(r, x)| x.err().map(|e| format!("rank {r}: {e}")))
        .collect();
    assert!(errs.is_empty(), "{what}:\n{}", errs.join("\n"));
}

/// Many operations of different collectives and sizes in flight at once, waited for in an
/// order other than the issue order; every result checked.
fn many_in_flight(comm: &Communicator, seed: u64) -> Result<(), String> {
    let n = comm.world_size();
    let r = comm.rank();
    let counts = [0usize, 1, 3, 7, 13, 1000, 65_537];
    let mut sums: Vec<Vec<f32>> = counts
        .iter()
        .map(|&c| inputs::<f32>(ReduceOp::Sum, seed, r, c))
        .collect();
    let mut maxes: Vec<Vec<i64>> = counts
        .iter()
        .map(|&c| inputs::<i64>(ReduceOp::Max, seed ^ 1, r, c))
        .collect();
    let gather_in = inputs::<u8>(ReduceOp::Sum, seed ^ 2, r, 11);
    let mut gather_out = vec![0u8; 11 * n];
    let rs_in = inputs::<f64>(ReduceOp::Sum, seed ^ 3, r, 5 * n);
    let mut rs_out = vec![0f64; 5];
    let mut bcast = if r == n - 1 {
        inputs::<u32>(ReduceOp::Sum, seed ^ 4, n - 1, 257)
    } else {
        vec![0u32; 257]
    };
    let a2a_in = inputs::<i32>(ReduceOp::Sum, seed ^ 5, r, 3 * n);
    let mut a2a_out = vec![0i32; 3 * n];
    comm.scope(|s| -> Result<(), String> {
        let e = |x: Error| x.to_string();
        let mut works = Vec::new();
        for (a, b) in sums.iter_mut().zip(maxes.iter_mut()) {
            works.push(s.all_reduce(a, ReduceOp::Sum).map_err(e)?);
            works.push(s.all_reduce(b, ReduceOp::Max).map_err(e)?);
        }
        works.push(s.all_gather(&gather_in, &mut gather_out).map_err(e)?);
        works.push(
            s.reduce_scatter(&rs_in, &mut rs_out, ReduceOp::Sum)
                .map_err(e)?,
        );
        works.push(s.broadcast(&mut bcast, n - 1).map_err(e)?);
        works.push(s.all_to_all(&a2a_in, &mut a2a_out).map_err(e)?);
        works.push(s.barrier().map_err(e)?);
        // Wait in reverse: completion does not depend on the order of waiting.
        for w in works.into_iter().rev() {
            w.wait().map_err(e)?;
        }
        Ok(())
    })?;
    for (i, &c) in counts.iter().enumerate() {
        check(
            "all_reduce sum",
            &sums[i],
            &reduced::<f32>(ReduceOp::Sum, seed, n, c),
        )?;
        check(
            "all_reduce max",
            &maxes[i],
            &reduced::<i64>(ReduceOp::Max, seed ^ 1, n, c),
        )?;
    }
    let want: Vec<u8> = (0..n)
        .flat_map(|q| inputs::<u8>(ReduceOp::Sum, seed ^ 2, q, 11))
        .collect();
    check("all_gather", &gather_out, &want)?;
    let full = reduced::<f64>(ReduceOp::Sum, seed ^ 3, n, 5 * n);
    check("reduce_scatter", &rs_out, &full[r * 5..(r + 1) * 5])?;
    check(
        "broadcast",
        &bcast,
        &inputs::<u32>(ReduceOp::Sum, seed ^ 4, n - 1, 257),
    )?;
    let want: Vec<i32> = (0..n)
        .flat_map(|j| inputs::<i32>(ReduceOp::Sum, seed ^ 5, j, 3 * n)[r * 3..(r + 1) * 3].to_vec())
        .collect();
    check("all_to_all", &a2a_out, &want)?;
    Ok(())
}

#[test]
fn in_flight_operations_of_different_collectives_and_sizes_complete_correctly_on_worlds_1_to_5() {
    for world in 1..=5 {
        let cfg = config(Duration::from_secs(60), 4096);
        let res = run_ranks(world, &cfg, |c| many_in_flight(c, 0x0a11 + world as u64));
        all_ok(res, &format!("world {world}"));
    }
}

#[test]
fn blocking_calls_interleave_with_in_flight_operations_in_issue_order() {
    let cfg = config(Duration::from_secs(60), 1024);
    let res = run_ranks(3, &cfg, |comm| -> Result<(), String> {
        let r = comm.rank();
        let mut a = inputs::<f32>(ReduceOp::Sum, 1, r, 10_001);
        let mut b = inputs::<f32>(ReduceOp::Sum, 2, r, 333);
        comm.scope(|s| -> Result<(), String> {
            let w = s
                .all_reduce(&mut a, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            // Issued after `w`: runs after it, on the caller's thread.
            comm.all_reduce(&mut b, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            if !w.test().map_err(|e| e.to_string())? {
                return Err(
                    "an operation issued earlier is not complete after a later blocking call"
                        .into(),
                );
            }
            Ok(())
        })?;
        check("a", &a, &reduced::<f32>(ReduceOp::Sum, 1, 3, 10_001))?;
        check("b", &b, &reduced::<f32>(ReduceOp::Sum, 2, 3, 333))
    });
    all_ok(res, "interleaved");
}

/// The driver role changes hands without the queue's lock when nobody else wants it, and
/// through the lock otherwise (src/comm/work.rs: `DRIVING`, `ATTENTION`). Here three threads
/// of each rank race for it: blocking calls, queued operations waited for at once, and queued
/// operations polled with `test` and short bounded waits. The calls are identical
/// all_reduces, so any interleaving pairs the ranks' k-th calls: every result must be the
/// world's sum, every thread must finish, and nothing may wait past the communicator's
/// deadline (a role given up without waking its waiter, or a queued operation nobody drives,
/// shows as a timeout here).
#[test]
fn threads_racing_for_the_driver_role_neither_hang_nor_mix_up_calls() {
    let world = 3;
    let cfg = config(Duration::from_secs(30), 1024);
    // A lost wake-up leaves a thread waiting for the role with no deadline of its own: the
    // watchdog turns that into a failure instead of a hung test.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(run_ranks(world, &cfg, race_for_the_role));
    });
    let res = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("threads racing for the driver role hung");
    all_ok(res, "racing for the driver role");
}

/// One rank's part of `threads_racing_for_the_driver_role_neither_hang_nor_mix_up_calls`.
fn race_for_the_role(comm: &Communicator) -> Result<(), String> {
    const CALLS: usize = 400;
    let world = comm.world_size();
    let want = vec![world as u32 * 7; 5];
    let check = |what: &str, v: &[u32]| {
        if v == want.as_slice() {
            Ok(())
        } else {
            Err(format!("{what}: {v:?}, want {want:?}"))
        }
    };
    let e = |x: Error| x.to_string();
    std::thread::scope(|ts| {
        let blocking = ts.spawn(|| -> Result<(), String> {
            for _ in 0..CALLS {
                let mut v = vec![7u32; 5];
                comm.all_reduce(&mut v, ReduceOp::Sum).map_err(e)?;
                check("blocking", &v)?;
            }
            Ok(())
        });
        let queued = ts.spawn(|| -> Result<(), String> {
            for _ in 0..CALLS {
                let mut v = vec![7u32; 5];
                comm.scope(|s| s.all_reduce(&mut v, ReduceOp::Sum)?.wait())
                    .map_err(e)?;
                check("queued", &v)?;
            }
            Ok(())
        });
        let polled = ts.spawn(|| -> Result<(), String> {
            for i in 0..CALLS {
                let mut v = vec![7u32; 5];
                comm.scope(|s| -> Result<(), String> {
                    let w = s.all_reduce(&mut v, ReduceOp::Sum).map_err(e)?;
                    while !w.test().map_err(e)? {
                        if i % 2 == 0 {
                            // Still in flight after 20 µs is no failure here.
                            let _ = w.wait_timeout(Duration::from_micros(20));
                        } else {
                            std::thread::yield_now();
                        }
                    }
                    Ok(())
                })?;
                check("polled", &v)?;
            }
            Ok(())
        });
        [blocking.join(), queued.join(), polled.join()]
            .into_iter()
            .try_for_each(|j| j.map_err(|_| "a thread panicked".to_string())?)
    })
}

#[test]
fn a_forgotten_work_still_completes_before_its_scope_returns() {
    let cfg = config(Duration::from_secs(60), 512);
    let res = run_ranks(2, &cfg, |comm| -> Result<(), String> {
        let r = comm.rank();
        let n = 50_000;
        let mut a = inputs::<f64>(ReduceOp::Sum, 3, r, n);
        comm.scope(|s| -> Result<(), String> {
            let w = s
                .all_reduce(&mut a, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            std::mem::forget(w);
            Ok(())
        })?;
        // The borrow of `a` ended with the scope: the library is done with it, and the
        // result is complete.
        check("forgotten", &a, &reduced::<f64>(ReduceOp::Sum, 3, 2, n))
    });
    all_ok(res, "forget");
}

#[test]
fn operations_progress_while_the_caller_does_not_wait() {
    // Rank 1 starts a receive and then only polls `test()`: the progress thread must move it.
    let cfg = config(Duration::from_secs(30), 4096);
    let res = run_ranks(2, &cfg, |comm| -> Result<(), String> {
        let data = inputs::<u32>(ReduceOp::Sum, 9, 0, 100_003);
        if comm.rank() == 0 {
            comm.send(&data, 1).map_err(|e| e.to_string())?;
            return Ok(());
        }
        let mut got = vec![0u32; data.len()];
        comm.scope(|s| -> Result<(), String> {
            let w = s.recv(&mut got, 0).map_err(|e| e.to_string())?;
            let t0 = Instant::now();
            while !w.test().map_err(|e| e.to_string())? {
                if t0.elapsed() > Duration::from_secs(20) {
                    return Err("a receive nobody waits for never completed".into());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        })?;
        check("received", &got, &data)
    });
    all_ok(res, "progress");
}

#[test]
fn abort_from_another_thread_ends_a_blocked_receive_within_a_second_and_peers_hear_of_it() {
    let cfg = config(Duration::from_secs(60), 4096);
    let go = Barrier::new(2);
    let res = run_ranks(3, &cfg, |comm| -> Result<(), String> {
        let r = comm.rank();
        let mut buf = vec![0f32; 1000];
        match r {
            0 => {
                // Blocked: rank 1 never sends.
                std::thread::scope(|t| {
                    t.spawn(|| {
                        go.wait();
                        std::thread::sleep(Duration::from_millis(300));
                        comm.abort();
                    });
                    go.wait();
                    let t0 = Instant::now();
                    let e = comm
                        .recv(&mut buf, 1)
                        .expect_err("recv must fail after abort");
                    let took = t0.elapsed();
                    if !matches!(e, Error::Aborted { by: 0, .. }) {
                        return Err(format!("expected Aborted by rank 0, got {e}"));
                    }
                    if took > Duration::from_millis(300) + Duration::from_secs(1) {
                        return Err(format!("abort took {took:?} to end the receive"));
                    }
                    // Later calls fail at once with the same error.
                    let t1 = Instant::now();
                    let e2 = comm.barrier().expect_err("a call after abort must fail");
                    if !matches!(e2, Error::Aborted { .. })
                        || t1.elapsed() > Duration::from_millis(200)
                    {
                        return Err(format!("after abort: {e2} in {:?}", t1.elapsed()));
                    }
                    Ok(())
                })
            }
            _ => {
                // The others wait for rank 0, which never sends: they must fail with an error
                // naming rank 0, long before their 60 s deadline.
                let t0 = Instant::now();
                let e = comm.recv(&mut buf, 0).expect_err("peers must fail");
                // Rank 0's abort frame, or its connection closing after it: either way the
                // error is about rank 0, and comes long before the deadline.
                let about_rank_0 = matches!(
                    e,
                    Error::Aborted { by: 0, .. } | Error::PeerLost { peer: 0, .. }
                );
                if !about_rank_0 || t0.elapsed() > Duration::from_secs(10) {
                    return Err(format!("peer error after {:?}: {e}", t0.elapsed()));
                }
                Ok(())
            }
        }
    });
    all_ok(res, "abort");
}

#[test]
fn abort_fails_in_flight_and_queued_operations_promptly() {
    let cfg = config(Duration::from_secs(60), 4096);
    let res = run_ranks(2, &cfg, |comm| -> Result<(), String> {
        if comm.rank() == 1 {
            // Never takes part; only waits to hear of the abort.
            let mut b = vec![0u8; 4];
            let e = comm.with_timeout(Duration::from_secs(20)).recv(&mut b, 0);
            return match e {
                Err(Error::Aborted { by: 0, .. }) => Ok(()),
                other => Err(format!("rank 1: expected Aborted by 0, got {other:?}")),
            };
        }
        let mut bufs = vec![vec![0f32; 100]; 4];
        comm.scope(|s| -> Result<(), String> {
            let works: Vec<_> = bufs
                .iter_mut()
                .map(|b| s.recv(b, 1).map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?;
            std::thread::sleep(Duration::from_millis(100));
            let t0 = Instant::now();
            comm.abort();
            for w in works {
                match w.wait() {
                    Err(Error::Aborted { .. }) => {}
                    other => return Err(format!("expected Aborted, got {other:?}")),
                }
                // `wait` borrows: the Work is still there after an error, waiting again
                // gives the same error, and a host operation never leaves device work.
                match (w.wait(), w.buffers_may_be_in_use()) {
                    (Err(Error::Aborted { .. }), false) => {}
                    other => return Err(format!("a second wait: expected Aborted, got {other:?}")),
                }
            }
            if t0.elapsed() > Duration::from_secs(1) {
                return Err(format!("queued operations took {:?} to fail", t0.elapsed()));
            }
            Ok(())
        })
    });
    all_ok(res, "abort queued");
}

#[test]
fn a_call_with_its_own_timeout_fails_by_that_deadline() {
    let cfg = config(Duration::from_secs(120), 4096);
    let res = run_ranks(2, &cfg, |comm| -> Result<(), String> {
        if comm.rank() == 1 {
            // Silent until rank 0 has timed out; then hears rank 0's failure.
            let mut b = vec![0u8; 1];
            let _ = comm.with_timeout(Duration::from_secs(20)).recv(&mut b, 0);
            return Ok(());
        }
        let mut b = vec![0u8; 8];
        let t0 = Instant::now();
        let e = comm
            .with_timeout(Duration::from_millis(300))
            .recv(&mut b, 1)
            .expect_err("must time out");
        let took = t0.elapsed();
        match e {
            Error::Timeout { peer: Some(1), .. }
                if took >= Duration::from_millis(300) && took < Duration::from_secs(5) =>
            {
                Ok(())
            }
            e => Err(format!(
                "expected a timeout after 300 ms, got {e} after {took:?}"
            )),
        }
    });
    all_ok(res, "per-call timeout");
}

#[test]
fn wait_timeout_reports_an_operation_still_in_flight_and_a_later_wait_gets_its_result() {
    let cfg = config(Duration::from_secs(60), 4096);
    let res = run_ranks(2, &cfg, |comm| -> Result<(), String> {
        let data = inputs::<i32>(ReduceOp::Sum, 4, 1, 77);
        let mut total = vec![comm.rank() as i64 + 1; 5];
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            comm.send(&data, 0).map_err(|e| e.to_string())?;
            comm.all_reduce(&mut total, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            return check("all_reduce after the receive", &total, &[3i64; 5]);
        }
        let mut got = vec![0i32; 77];
        comm.scope(|s| -> Result<(), String> {
            let w = s.recv(&mut got, 1).map_err(|e| e.to_string())?;
            let later = s
                .all_reduce(&mut total, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            // The wait's error says where the operation stands: the receive runs (once the
            // progress thread took it, within a millisecond or so), named as the flight
            // recorder names it; the all_reduce waits behind it.
            let t0 = Instant::now();
            loop {
                match w.wait_timeout(Duration::from_millis(50)) {
                    Err(Error::Timeout { ref detail, .. })
                        if detail.starts_with("it runs as recv #1 from rank 1 (for ") =>
                    {
                        break
                    }
                    // Before the progress thread took it, or while it moves from the queue
                    // into the engine.
                    Err(Error::Timeout { ref detail, .. })
                        if (detail.starts_with("it has not started")
                            || detail.starts_with("it is still in flight"))
                            && t0.elapsed().as_millis() < 1000 => {}
                    other => return Err(format!("expected a wait timeout, got {other:?}")),
                }
            }
            match later.wait_timeout(Duration::from_millis(20)) {
                Err(Error::Timeout { ref detail, .. })
                    if detail.starts_with(
                        "it has not started: it waits for recv #1 from rank 1, which has run \
                         for ",
                    ) => {}
                other => return Err(format!("expected a queued all_reduce, got {other:?}")),
            }
            // The same words without waiting, while in flight; none once it ended.
            match later.whereabouts() {
                Some(w) if w.starts_with("it has not started: it waits for recv #1") => {}
                other => return Err(format!("the queued all_reduce's whereabouts: {other:?}")),
            }
            w.wait().map_err(|e| e.to_string())?;
            // `wait` borrows: waiting again returns the same result.
            w.wait().map_err(|e| format!("a second wait: {e}"))?;
            if let Some(x) = w.whereabouts() {
                return Err(format!("a completed receive's whereabouts: {x}"));
            }
            later.wait().map_err(|e| e.to_string())?;
            match later.whereabouts() {
                None => Ok(()),
                Some(x) => Err(format!("a completed all_reduce's whereabouts: {x}")),
            }
        })?;
        check("late receive", &got, &data)?;
        check("all_reduce after the receive", &total, &[3i64; 5])
    });
    all_ok(res, "wait_timeout");
}

#[test]
fn a_failures_dump_lists_the_operations_queued_behind_the_failed_call() {
    let dir = std::env::temp_dir().join(format!("dspark-work-fr-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = config(Duration::from_secs(60), 4096);
    cfg.flight_dump = Some(dir.clone());
    let issued = Barrier::new(2);
    let res = run_ranks(2, &cfg, |comm| -> Result<(), String> {
        if comm.rank() == 1 {
            // Disagreeing, and only once rank 0's broadcast and barrier are queued behind
            // its all_reduce.
            issued.wait();
            let mut v = vec![1f32; 11];
            return match comm.all_reduce(&mut v, ReduceOp::Sum) {
                Err(Error::Mismatch { .. }) => Ok(()),
                other => Err(format!("expected a mismatch, got {other:?}")),
            };
        }
        let (mut v, mut b) = (vec![1f32; 10], vec![0u8; 3]);
        comm.scope(|s| -> Result<(), String> {
            let ws = [
                s.all_reduce(&mut v, ReduceOp::Sum),
                s.broadcast(&mut b, 1),
                s.barrier(),
            ];
            issued.wait();
            match ws.iter().map(|w| w.as_ref().map(|w| w.wait())).next() {
                Some(Ok(Err(Error::Mismatch { .. }))) => Ok(()),
                other => Err(format!("expected a mismatch, got {other:?}")),
            }
        })
    });
    all_ok(res, "a failure with operations queued");
    // Rank 0's dump, the first of this process's communicators to fail there.
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("rank0")
        })
        .unwrap_or_else(|| panic!("no dump of rank 0 in {}", dir.display()));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let entries = v["entries"].as_array().unwrap();
    let tail: Vec<(String, String, bool)> = entries
        .iter()
        .rev()
        .take(3)
        .rev()
        .map(|e| {
            (
                e["collective"].as_str().unwrap_or("?").to_string(),
                e["state"].as_str().unwrap_or("?").to_string(),
                e["seq"].is_null(),
            )
        })
        .collect();
    let want = |c: &str, s: &str, null: bool| (c.to_string(), s.to_string(), null);
    assert_eq!(
        tail,
        [
            want("all_reduce", "failed", false),
            want("broadcast", "queued", true),
            want("barrier", "queued", true)
        ],
        "{v}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn split_into_two_colours_runs_both_groups_at_once_with_their_own_mismatch_checks() {
    let cfg = config(Duration::from_secs(60), 4096);
    let res = run_ranks(5, &cfg, |comm| -> Result<(), String> {
        let r = comm.rank();
        // Colour by parity; keys reverse the order inside each group.
        let colour = (r % 2) as i32;
        let key = -(r as i32);
        let sub = comm
            .split(Some(colour), key)
            .map_err(|e| format!("split: {e}"))?
            .ok_or("a rank with a colour got no communicator")?;
        let members: Vec<usize> = (0..5).filter(|q| q % 2 == r % 2).rev().collect();
        let size = members.len();
        if sub.world_size() != size {
            return Err(format!("group of {} ranks, want {size}", sub.world_size()));
        }
        let want_rank = members.iter().position(|&q| q == r).unwrap();
        if sub.rank() != want_rank {
            return Err(format!("new rank {}, want {want_rank}", sub.rank()));
        }
        // Both groups at once, and the parent at the same time from another thread.
        let mut v = vec![r as u64 + 1; 1001];
        let mut p = vec![1u32; 99];
        let group = std::thread::scope(|t| -> Result<Result<(), Error>, String> {
            let h = t.spawn(|| comm.all_reduce(&mut p, ReduceOp::Sum));
            let group = sub.all_reduce(&mut v, ReduceOp::Sum);
            h.join()
                .unwrap()
                .map_err(|e| format!("parent: {e}"))
                .map(|()| group)
        })?;
        if p.iter().any(|&x| x != 5) {
            return Err(format!("parent sum {} want 5", p[0]));
        }
        // A mismatch inside the new communicator is found there: group rank 0 reduces 10
        // elements, the others 11. A rank whose part of the first group call is done but
        // that is still in it when a peer fails the second may report that failure for the
        // first (failures reach every rank at once, as they must for a rank waiting on a
        // third): a mismatch, never a wrong sum.
        let want: u64 = members.iter().map(|&q| q as u64 + 1).sum();
        match group {
            Ok(()) => {
                if v.iter().any(|&x| x != want) {
                    return Err(format!("group sum {} want {want}", v[0]));
                }
                let mut m = vec![1f32; if sub.rank() == 0 { 10 } else { 11 }];
                match sub.all_reduce(&mut m, ReduceOp::Sum) {
                    Err(Error::Mismatch { .. }) => {}
                    other => {
                        return Err(format!("expected a mismatch in the group, got {other:?}"))
                    }
                }
            }
            Err(Error::Mismatch { ref what, .. }) if what.contains("count 10") => {}
            Err(e) => return Err(format!("group all_reduce: {e}")),
        }
        // The parent is untouched by the group's failure.
        let mut q = vec![2i64; 3];
        comm.all_reduce(&mut q, ReduceOp::Sum)
            .map_err(|e| format!("parent after group mismatch: {e}"))?;
        if q != [10, 10, 10] {
            return Err(format!("parent {q:?}"));
        }
        Ok(())
    });
    all_ok(res, "split");
}

#[test]
fn a_rank_that_cannot_take_part_in_a_split_fails_it_on_every_rank_at_once() {
    // Rank 2 of 4 fails before the exchange (as when it cannot listen: EMFILE). With a
    // 60 s deadline, the others must hear it from the exchange, not wait for it.
    let cfg = config(Duration::from_secs(60), 4096);
    let res = run_ranks(4, &cfg, |comm| -> Result<(), String> {
        let r = comm.rank();
        let t0 = Instant::now();
        if r == 2 {
            dspark::internals::testing::fail_next_split_on_this_thread();
        }
        // Rank 3 opts out: it hears of the failure all the same.
        let colour = (r != 3).then_some(1);
        let got = comm.split(colour, 0);
        let took = t0.elapsed();
        match (r, &got) {
            (2, Err(Error::Io { op, .. })) if op.contains("injected") => {}
            (2, other) => return Err(format!("rank 2's own error expected, got {other:?}")),
            (
                _,
                Err(Error::Io {
                    peer: Some(2),
                    op,
                    source,
                    ..
                }),
            ) if op.starts_with("split #1 (rank 2 could not take part")
                && source.raw_os_error() == Some(24) /* EMFILE */ => {}
            (_, other) => return Err(format!("an I/O error of rank 2 in split #1, got {other:?}")),
        }
        if took > Duration::from_secs(20) {
            return Err(format!("the split failed only after {took:?}"));
        }
        // This communicator is as usable as before, and the next split pairs every rank's
        // second exchange (the failed one counted everywhere): it works.
        let mut x = vec![r as i32 + 1; 13];
        comm.all_reduce(&mut x, ReduceOp::Sum)
            .map_err(|e| format!("after the failed split: {e}"))?;
        if x != [10; 13] {
            return Err(format!("sum {x:?}"));
        }
        let sub = comm
            .split(Some((r % 2) as i32), 0)
            .map_err(|e| format!("the next split: {e}"))?
            .ok_or("no group")?;
        let mut y = vec![r as u64; 7];
        sub.all_reduce(&mut y, ReduceOp::Sum)
            .map_err(|e| format!("group: {e}"))?;
        let want = if r % 2 == 0 { 2 } else { 4 };
        if y != [want; 7] {
            return Err(format!("group sum {y:?}, want {want}"));
        }
        Ok(())
    });
    all_ok(res, "split with a failed rank");
}

#[test]
fn split_with_no_colour_opts_out_and_the_rest_form_a_group() {
    let cfg = config(Duration::from_secs(60), 4096);
    let res = run_ranks(4, &cfg, |comm| -> Result<(), String> {
        let r = comm.rank();
        let colour = match r {
            0 => None,
            1 => Some(-1),
            _ => Some(7),
        };
        let sub = comm.split(colour, 0).map_err(|e| e.to_string())?;
        match (r, sub) {
            (0 | 1, None) => Ok(()),
            (0 | 1, Some(_)) => Err("an opted-out rank got a communicator".into()),
            (_, None) => Err("a rank with a colour got none".into()),
            (_, Some(s)) => {
                let mut x = vec![r as i32; 5];
                s.all_reduce(&mut x, ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                if s.world_size() != 2 || s.rank() != r - 2 || x != [5; 5] {
                    return Err(format!("group {}:{} sum {x:?}", s.rank(), s.world_size()));
                }
                Ok(())
            }
        }
    });
    all_ok(res, "split opt-out");
}

#[test]
fn init_with_store_meets_through_the_store_twice_in_a_row_without_a_fixed_port() {
    use dspark::internals::bootstrap::store::MemStore;
    let store = MemStore::new();
    let world = 3;
    std::thread::scope(|t| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let store = &store;
                t.spawn(move || -> Result<(), String> {
                    for round in 0..2u64 {
                        let mut cfg = Config::new(0, 1, "");
                        cfg.timeout = Duration::from_secs(30);
                        let comm = Communicator::init_with_store(store, r, world, cfg)
                            .map_err(|e| format!("round {round}: {e}"))?;
                        let mut x = vec![r as u64 + round; 17];
                        comm.all_reduce(&mut x, ReduceOp::Sum)
                            .map_err(|e| e.to_string())?;
                        if x != vec![3 + 3 * round; 17] || !comm.info().rendezvous.contains("store")
                        {
                            return Err(format!(
                                "round {round}: {x:?} via {}",
                                comm.info().rendezvous
                            ));
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            if let Err(e) = h.join().unwrap() {
                panic!("rank {r}: {e}");
            }
        }
    });
}

/// #11 item 4: a registered buffer is owned by its registration, used through it in any
/// collective, and given back intact; on a transport without registrations (here the
/// in-process one) it is simply not registered.
#[test]
fn a_registered_buffer_is_used_through_its_registration_and_given_back() {
    let world = 3;
    let fabric = MemFabric::new(world, 4);
    let cfg = config(Duration::from_secs(30), 256);
    let res = common::run_mem_ranks(&fabric, world, &cfg, |c| {
        let mut reg = c.register_buffer(vec![c.rank() as u32 + 1; 1001]).unwrap();
        assert!(!reg.is_registered());
        assert_eq!(reg.bytes(), 1001 * 4);
        c.all_reduce(&mut reg, ReduceOp::Sum).unwrap();
        // As the source of another collective.
        let mut all = vec![0u32; 1001 * 3];
        c.all_gather(&reg, &mut all).unwrap();
        assert!(all.iter().all(|&x| x == 6), "rank {}", c.rank());
        reg.into_inner()
    });
    for (r, v) in res.into_iter().enumerate() {
        assert_eq!(v, vec![6u32; 1001], "rank {r}");
    }
}

/// Found by `dspark tune` (2026-12-02): a send and a receive to the same peer started together
/// in a scope, on both ranks (an exchange), time out once the message outgrows what the
/// transport buffers — shm from 4 MiB, tcp from 32 MiB, here `mem` with 4 frames of 4 KiB —
/// because the operations of a communicator run one at a time in issue order, so each rank's
/// send waits for a receive its peer has queued behind its own send. That is the documented
/// order (as NCCL's send and recv outside a group): an exchange is `send_recv` (the tests
/// below). Kept, ignored, as the record of the pattern.
#[test]
#[ignore = "by design: operations run in issue order; an exchange is send_recv (tested below)"]
fn an_exchange_of_a_send_and_a_receive_in_a_scope_completes_beyond_the_transports_buffering() {
    let world = 2;
    let fabric = MemFabric::new(world, 4);
    let cfg = config(Duration::from_secs(3), 4096);
    let n = 16 * 1024; // 64 KiB of f32: 16 segments against 4 buffered frames.
    let res = common::run_mem_ranks(&fabric, world, &cfg, |c| {
        let peer = 1 - c.rank();
        let out = vec![c.rank() as f32 + 1.0; n];
        let mut inb = vec![0.0f32; n];
        c.scope(|s| -> dspark::Result<()> {
            let w = s.send(&out, peer)?;
            let r = s.recv(&mut inb, peer)?;
            w.wait()?;
            r.wait()
        })
        .map(|()| inb.iter().all(|&x| x == peer as f32 + 1.0))
    });
    for (r, x) in res.into_iter().enumerate() {
        assert_eq!(x.map_err(|e| e.to_string()), Ok(true), "rank {r}");
    }
}

/// `send_recv` progresses its send and its receive together: a swap of 64 KiB (16 segments
/// against 4 buffered frames of 4 KiB), blocking and started in a scope, completes with the
/// peer's data, where a send and a receive wait on each other (the test above).
#[test]
fn send_recv_swaps_far_beyond_the_transports_buffering() {
    let world = 2;
    let fabric = MemFabric::new(world, 4);
    let cfg = config(Duration::from_secs(10), 4096);
    let n = 16 * 1024 + 3;
    let value = |rank: usize, i: usize| (rank * 1_000_003 + i) as f32;
    let res = common::run_mem_ranks(&fabric, world, &cfg, |c| -> Result<(), String> {
        let (me, peer) = (c.rank(), 1 - c.rank());
        let out: Vec<f32> = (0..n).map(|i| value(me, i)).collect();
        let expect: Vec<f32> = (0..n).map(|i| value(peer, i)).collect();
        let mut blocking = vec![0.0f32; n];
        c.send_recv(&out, peer, &mut blocking, peer)
            .map_err(|e| format!("blocking: {e}"))?;
        let mut started = vec![0.0f32; n];
        c.scope(|s| s.send_recv(&out, peer, &mut started, peer)?.wait())
            .map_err(|e| format!("in a scope: {e}"))?;
        for (what, got) in [("blocking", &blocking), ("in a scope", &started)] {
            if let Some(i) = (0..n).find(|&i| got[i] != expect[i]) {
                return Err(format!(
                    "{what}: element {i} is {} not {}",
                    got[i], expect[i]
                ));
            }
        }
        Ok(())
    });
    all_ok(res, "send_recv swap");
}

/// A ring shift of uneven messages (rank r sends a message of its own length to r + 1 and
/// receives r − 1's; rank 2 sends nothing, so rank 3 receives nothing), in i64 with values
/// that name sender and index: every rank gets exactly its left neighbour's message.
#[test]
fn send_recv_shifts_a_ring_of_uneven_messages() {
    let world = 5;
    let cfg = config(Duration::from_secs(10), 4096);
    let count = |r: usize| if r == 2 { 0 } else { 1007 * r + 1 };
    let value = |from: usize, i: usize| ((from as i64) << 32) | i as i64;
    let res = run_ranks(world, &cfg, |c| -> Result<(), String> {
        let r = c.rank();
        let (to, from) = ((r + 1) % world, (r + world - 1) % world);
        let out: Vec<i64> = (0..count(r)).map(|i| value(r, i)).collect();
        let mut got = vec![-1i64; count(from)];
        c.send_recv(&out, to, &mut got, from)
            .map_err(|e| e.to_string())?;
        let expect: Vec<i64> = (0..count(from)).map(|i| value(from, i)).collect();
        if got != expect {
            return Err(format!("wrong data from rank {from}"));
        }
        // The sequence numbers of both directions moved on: plain send/recv still pair.
        let mut after = [0i64; 3];
        if r % 2 == 0 && r + 1 < world {
            c.send(&[r as i64; 3], r + 1).map_err(|e| e.to_string())?;
        } else if r % 2 == 1 {
            c.recv(&mut after, r - 1).map_err(|e| e.to_string())?;
            if after != [(r - 1) as i64; 3] {
                return Err(format!("then a plain recv got {after:?}"));
            }
        }
        Ok(())
    });
    all_ok(res, "ring shift");
}

/// A `send_recv` pairs with a plain `recv` and `send` on the peer (the frames are those of a
/// send and a receive), and its arguments are checked as theirs are: another rank only.
#[test]
fn send_recv_pairs_with_a_plain_recv_and_send_and_refuses_itself() {
    let world = 2;
    let cfg = config(Duration::from_secs(10), 4096);
    let res = run_ranks(world, &cfg, |c| -> Result<(), String> {
        let (me, peer) = (c.rank(), 1 - c.rank());
        let mut buf = [0i32; 5];
        match c.send_recv(&[1i32; 5], me, &mut buf, peer) {
            Err(Error::InvalidArgument { .. }) => {}
            other => return Err(format!("an exchange with itself gave {other:?}")),
        }
        match c.send_recv(&[1i32; 5], peer, &mut buf, world) {
            Err(Error::InvalidArgument { .. }) => {}
            other => return Err(format!("an exchange with rank {world} gave {other:?}")),
        }
        let mine = [me as i32 + 10; 5];
        if me == 0 {
            c.send_recv(&mine, peer, &mut buf, peer)
                .map_err(|e| e.to_string())?;
        } else {
            c.recv(&mut buf, peer).map_err(|e| e.to_string())?;
            c.send(&mine, peer).map_err(|e| e.to_string())?;
        }
        if buf != [peer as i32 + 10; 5] {
            return Err(format!("got {buf:?}"));
        }
        Ok(())
    });
    all_ok(res, "send_recv against recv + send");
}

/// A receiver that expects another length than its source sends fails with a mismatch
/// naming both ranks, as a plain receive does.
#[test]
fn send_recv_of_another_length_is_a_mismatch() {
    let world = 2;
    let cfg = config(Duration::from_secs(10), 4096);
    let res = run_ranks(world, &cfg, |c| {
        let (me, peer) = (c.rank(), 1 - c.rank());
        let mut got = vec![0u32; 100 + me];
        c.send_recv(&[7u32; 100], peer, &mut got, peer)
    });
    // Rank 1 expects 101 elements and gets a 100-element frame.
    match &res[1] {
        Err(Error::Mismatch {
            rank: Some(1),
            peer: Some(0),
            what,
            ..
        }) => {
            assert!(
                what.contains("count 100") && what.contains("count 101"),
                "{what}"
            );
        }
        other => panic!("rank 1: {other:?}"),
    }
}
