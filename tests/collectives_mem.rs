//! Many ranks as threads over the in-process `mem` transport: every collective, type and
//! operator against an independent reference, and fault injection (killed, silent, dropped,
//! delayed, mismatched).

mod common;

use std::sync::Barrier;
use std::time::{Duration, Instant};

use dspark::internals::transport::mem::{Fault, MemFabric};
use dspark::{Communicator, DataType, Error, ReduceOp};

use common::{mem_config as config, run_mem_ranks as run_ranks};

#[test]
fn every_collective_type_and_op_matches_the_reference_on_worlds_1_to_5() {
    // Small segments so that multi-segment pipelining is exercised at small counts.
    let counts = [0, 1, 2, 3, 5, 7, 13, 64, 257];
    for world in 1..=5 {
        for (seg, cap) in [(24, 1), (4096, 3)] {
            let fabric = MemFabric::new(world, cap);
            let cfg = config(Duration::from_secs(30), seg);
            let res = run_ranks(&fabric, world, &cfg, |c| common::run_matrix(c, &counts, 7));
            for (r, x) in res.into_iter().enumerate() {
                if let Err(e) = x {
                    panic!("world {world} segment {seg} rank {r}: {e}");
                }
            }
        }
    }
}

/// all_to_all_v through each way in: the blocking call, its `Timed` form, the raw one
/// started without blocking with the send blocks at the start of the buffer that receives
/// (sent from a copy), and the scoped one (a buffer one element off refused before anything starts);
/// worlds 1 to 4, blocks of 0 to 6 elements, 24-byte segments, exact.
#[test]
fn all_to_all_v_is_exact_blocking_timed_and_raw_with_overlapping_buffers() {
    for world in 1..=4 {
        let fabric = MemFabric::new(world, 3);
        let cfg = config(Duration::from_secs(30), 24);
        let res = run_ranks(&fabric, world, &cfg, |c| -> Result<(), String> {
            let (r, n) = (c.rank(), c.world_size());
            let count = |i: usize, j: usize| (i * 3 + j * 5 + 1) % 7;
            let block =
                |i: usize, j: usize| (0..count(i, j)).map(move |k| ((i * n + j) * 100 + k) as u32);
            let sc: Vec<usize> = (0..n).map(|j| count(r, j)).collect();
            let rc: Vec<usize> = (0..n).map(|i| count(i, r)).collect();
            let send: Vec<u32> = (0..n).flat_map(|j| block(r, j)).collect();
            let want: Vec<u32> = (0..n).flat_map(|i| block(i, r)).collect();
            let e2s = |e: Error| e.to_string();
            let mut recv = vec![0u32; want.len()];
            c.all_to_all_v(&send, &sc, &mut recv, &rc).map_err(e2s)?;
            if recv != want {
                return Err(format!("blocking: {recv:?}, want {want:?}"));
            }
            let mut recv = vec![0u32; want.len()];
            c.with_timeout(Duration::from_secs(20))
                .all_to_all_v(&send, &sc, &mut recv, &rc)
                .map_err(e2s)?;
            if recv != want {
                return Err(format!("timed: {recv:?}, want {want:?}"));
            }
            let mut buf = vec![0u32; send.len().max(want.len())];
            buf[..send.len()].copy_from_slice(&send);
            let p = buf.as_mut_ptr().cast::<u8>();
            // A rank whose own block differs both ways is refused at once, nothing started.
            let mut odd = rc.clone();
            odd[r] += 1;
            // SAFETY: refused before anything reads the buffers (checked below).
            match unsafe {
                c.start_raw_all_to_all_v(DataType::U32, (p.cast_const(), &sc), (p, &odd), None)
            } {
                Err(Error::InvalidArgument { what, .. }) if what.contains("to itself") => {}
                other => return Err(format!("own block differing: {other:?}")),
            }
            // SAFETY: `buf` lives past the wait below, and nothing else touches it meanwhile.
            let w = unsafe {
                c.start_raw_all_to_all_v(DataType::U32, (p.cast_const(), &sc), (p, &rc), None)
            }
            .map_err(e2s)?;
            w.wait().map_err(e2s)?;
            if buf[..want.len()] != want[..] {
                return Err(format!("raw: {:?}, want {want:?}", &buf[..want.len()]));
            }
            // Scoped, then the result sent back the same way: every rank ends with its own
            // blocks again.
            let mut recv = vec![0u32; want.len()];
            let mut back = vec![0u32; send.len()];
            // A receive buffer one element off is refused at once, nothing started.
            let mut off = vec![0u32; if want.is_empty() { 1 } else { want.len() - 1 }];
            let short = c.scope(|s| -> Result<Option<String>, String> {
                let w = s.all_to_all_v(&send, &sc, &mut recv, &rc).map_err(e2s)?;
                let refused = match s.all_to_all_v(&send, &sc, &mut off, &rc) {
                    Err(Error::InvalidArgument { .. }) => None,
                    other => Some(format!("a buffer one element off gave {other:?}")),
                };
                w.wait().map_err(e2s)?;
                Ok(refused)
            })?;
            if let Some(e) = short {
                return Err(e);
            }
            if recv != want {
                return Err(format!("scoped: {recv:?}, want {want:?}"));
            }
            c.scope(|s| s.all_to_all_v(&recv, &rc, &mut back, &sc)?.wait())
                .map_err(e2s)?;
            if back != send {
                return Err(format!("scoped back: {back:?}, want {send:?}"));
            }
            Ok(())
        });
        for (r, x) in res.into_iter().enumerate() {
            if let Err(e) = x {
                panic!("world {world} rank {r}: {e}");
            }
        }
    }
}

#[test]
fn forced_algorithms_give_the_same_results() {
    for algo in [
        "ring",
        "recursive_doubling",
        "chain",
        "binomial_tree",
        "tree",
        "rabenseifner",
    ] {
        for world in [2, 3, 5] {
            let fabric = MemFabric::new(world, 1);
            let mut cfg = config(Duration::from_secs(30), 40);
            cfg.algo = dspark::internals::plan::Algorithm::from_name(algo);
            let res = run_ranks(&fabric, world, &cfg, |c| {
                common::run_matrix(c, &[1, 6, 31], 11)
            });
            for (r, x) in res.into_iter().enumerate() {
                if let Err(e) = x {
                    panic!("{algo} world {world} rank {r}: {e}");
                }
            }
        }
    }
}

/// #10: `DSPARK_ALGO=tree` — the double binary tree all_reduce, and reduce and broadcast under
/// the same name — for every type and operator on worlds 1..=9 (odd and even: the second tree
/// is shifted or mirrored), counts below the world size and odd counts, segments of 40 bytes
/// (the halves of the larger counts pipeline over many segments) and of 4 KiB, links of one
/// and of three frames.
#[test]
fn double_binary_tree_matches_the_reference_for_every_type_and_op_on_worlds_1_to_9() {
    forced_all_reduce_matches_the_reference_on_worlds_1_to_9(
        dspark::internals::plan::Algorithm::Tree,
    );
}

/// #10: `DSPARK_ALGO=rabenseifner` — the halving reduce-scatter and doubling all-gather, with
/// the ranks beyond the largest power of two folded in and out (worlds 3, 5, 6, 7, 9) — for
/// every type and operator, as the tree above (reduce and broadcast run their defaults).
#[test]
fn rabenseifner_matches_the_reference_for_every_type_and_op_on_worlds_1_to_9() {
    forced_all_reduce_matches_the_reference_on_worlds_1_to_9(
        dspark::internals::plan::Algorithm::Rabenseifner,
    );
}

/// `DSPARK_ALGO=one_shot` over `mem`, which has no shared slots: on worlds 1 and 2 the frame
/// schedule (the buffer to the peer, reduced in), on worlds 3 to 9 what it runs as there,
/// recursive doubling (`a_forced_one_shot_gives_every_rank_the_same_bits`), for every type
/// and operator, as the tree above.
#[test]
fn a_forced_one_shot_matches_the_reference_for_every_type_and_op_on_worlds_1_to_9() {
    forced_all_reduce_matches_the_reference_on_worlds_1_to_9(
        dspark::internals::plan::Algorithm::OneShot,
    );
}

/// A forced one-shot all_reduce gives every rank the same bits. Without shared slots its
/// frames had each rank add its own contribution first, then the others: with 1e8, 1 and
/// -1e8 (f32, whose step at 1e8 is 8) ranks 0 and 1 got 0 and rank 2 got 1. With 3 ranks or
/// more it now runs recursive doubling there (and says so through `algorithm`); 2 ranks
/// keep the one-shot, whose two additions are the same in either order.
#[test]
fn a_forced_one_shot_gives_every_rank_the_same_bits() {
    use dspark::internals::plan::{Algorithm, Collective};
    for world in 2..=5 {
        let fabric = MemFabric::new(world, 3);
        let mut cfg = config(Duration::from_secs(30), 4096);
        cfg.algo = Some(Algorithm::OneShot);
        let got = run_ranks(&fabric, world, &cfg, |c| {
            let runs = c.algorithm(Collective::AllReduce, 12);
            let mine = |i: usize| match (c.rank() + i) % 3 {
                0 => 1.0e8f32,
                1 => 1.0 + i as f32,
                _ => -1.0e8,
            };
            let mut b: Vec<f32> = (0..3).map(mine).collect();
            c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
            let mut avg: Vec<f32> = (0..3).map(mine).collect();
            c.all_reduce(&mut avg, ReduceOp::Avg).unwrap();
            // Against the exact sum (f64): within a rounding of 1e8 (its f32 step is 8),
            // whatever the order.
            let exact: Vec<f64> = (0..3)
                .map(|i| {
                    (0..c.world_size())
                        .map(|r| match (r + i) % 3 {
                            0 => 1.0e8,
                            1 => 1.0 + i as f64,
                            _ => -1.0e8,
                        })
                        .sum()
                })
                .collect();
            for (i, (&got, &want)) in b.iter().zip(&exact).enumerate() {
                assert!(
                    (f64::from(got) - want).abs() <= 16.0,
                    "rank {} element {i}: {got} against {want}",
                    c.rank()
                );
            }
            let bits: Vec<u32> = b.iter().chain(&avg).map(|x| x.to_bits()).collect();
            (runs, bits)
        });
        let want = if world == 2 {
            Algorithm::OneShot
        } else {
            Algorithm::RecursiveDoubling
        };
        for (r, (runs, bits)) in got.iter().enumerate() {
            assert_eq!(*runs, want, "world {world} rank {r}");
            assert_eq!(bits, &got[0].1, "world {world}: rank {r} against rank 0");
        }
    }
}

/// Every type, operator and the counts below (0, below the world size, odd, primes) on worlds
/// 1..=9 with `algo` forced, segments of 40 bytes and of 4 KiB, links of one and of three
/// frames, checked against the reference.
fn forced_all_reduce_matches_the_reference_on_worlds_1_to_9(
    algo: dspark::internals::plan::Algorithm,
) {
    let counts = [0, 1, 2, 3, 5, 8, 13, 64, 257];
    for world in 1..=9 {
        for (seg, cap) in [(40, 1), (4096, 3)] {
            let fabric = MemFabric::new(world, cap);
            let mut cfg = config(Duration::from_secs(30), seg);
            cfg.algo = Some(algo);
            let res = run_ranks(&fabric, world, &cfg, |c| {
                common::run_tree_matrix(c, &counts, 0x7ee)
            });
            for (r, x) in res.into_iter().enumerate() {
                if let Err(e) = x {
                    panic!("{algo} world {world} segment {seg} rank {r}: {e}");
                }
            }
        }
    }
}

#[test]
fn killed_rank_makes_every_survivor_fail_fast_instead_of_hanging() {
    let world = 4;
    let fabric = MemFabric::new(world, 2);
    let cfg = config(Duration::from_secs(20), 1024);
    let gate = Barrier::new(world);
    let t0 = Instant::now();
    let res = run_ranks(&fabric, world, &cfg, |c| {
        let mut buf = vec![1.0f32; 100_000];
        c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        gate.wait();
        if c.rank() == 2 {
            fabric.kill(2);
            return Ok(());
        }
        c.all_reduce(&mut buf, ReduceOp::Sum)
    });
    let elapsed = t0.elapsed();
    for (r, x) in res.iter().enumerate() {
        if r == 2 {
            continue;
        }
        match x {
            // The error names the collective and its sequence number (the second all_reduce
            // of the communicator), not only the transport's "receive" (issue #11, item 10).
            Err(e @ Error::PeerLost { .. }) | Err(e @ Error::Aborted { .. }) => assert!(
                e.to_string().contains("all_reduce #2"),
                "rank {r}: {e} does not name all_reduce #2"
            ),
            other => panic!("rank {r}: expected PeerLost/Aborted, got {other:?}"),
        }
    }
    // The cause is named: the dead rank itself, or inside the abort of the survivor that
    // noticed it first.
    assert!(
        res.iter()
            .enumerate()
            .filter(|(r, _)| *r != 2)
            .any(|(_, x)| matches!(
                x,
                Err(e) if e.to_string().contains("rank 2")
            )),
        "no survivor names the killed rank 2: {res:?}"
    );
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}, deadline is 20 s"
    );
}

#[test]
fn silent_peer_times_out_instead_of_hanging() {
    let world = 3;
    let fabric = MemFabric::new(world, 1);
    let cfg = config(Duration::from_millis(800), 1024);
    let t0 = Instant::now();
    let res = run_ranks(&fabric, world, &cfg, |c| {
        if c.rank() == 1 {
            // Silent: alive, connected, never calls.
            std::thread::sleep(Duration::from_millis(2500));
            return Ok(());
        }
        let mut buf = vec![3u32; 1000];
        c.all_reduce(&mut buf, ReduceOp::Max)
    });
    let elapsed = t0.elapsed();
    for r in [0, 2] {
        match &res[r] {
            Err(e @ Error::Timeout { .. }) => {
                let s = e.to_string();
                assert!(
                    s.contains(&format!("rank {r}")) && s.contains("all_reduce"),
                    "{s}"
                );
            }
            // A survivor may hear of the other survivor's timeout first.
            Err(Error::Aborted { .. }) => {}
            other => panic!("rank {r}: expected Timeout, got {other:?}"),
        }
    }
    assert!(
        res.iter()
            .any(|x| matches!(x, Err(Error::Timeout { peer: Some(1), .. }))),
        "{res:?}"
    );
    assert!(elapsed < Duration::from_millis(2800), "took {elapsed:?}");
}

#[test]
fn dropped_frame_becomes_an_error_on_both_ranks_not_a_hang() {
    // 100 i64 in 8-element segments: 13 frames per direction, the last one 4 elements.
    for (nth, timeout_expected) in [(12, true), (0, false)] {
        let world = 2;
        let fabric = MemFabric::new(world, 4);
        fabric.inject(Fault::Drop {
            from: 1,
            to: 0,
            nth,
        });
        // Recursive doubling (each rank sends the buffer once), whatever the cost model
        // would choose for 8-element segments.
        let cfg = config(Duration::from_millis(500), 64)
            .algo(Some(dspark::internals::plan::Algorithm::RecursiveDoubling));
        let gate = Barrier::new(world);
        let res = run_ranks(&fabric, world, &cfg, |c| {
            let mut buf = vec![1i64; 100];
            let first = c.all_reduce(&mut buf, ReduceOp::Sum);
            // Keep both communicators open until both calls ended, then call again: a rank
            // whose own call happened to complete must learn of its peer's failure now.
            gate.wait();
            let second = c.barrier();
            (first, second)
        });
        let e = res[0].0.as_ref().unwrap_err();
        if timeout_expected {
            // The last frame never comes.
            assert!(matches!(e, Error::Timeout { peer: Some(1), .. }), "{e}");
        } else {
            // A later, shorter frame arrives where a full segment was due.
            assert!(
                matches!(e, Error::Mismatch { .. }) && e.to_string().contains("lost"),
                "{e}"
            );
        }
        assert!(
            res[1].1.is_err(),
            "rank 1 must hear that rank 0 failed: {:?}",
            res[1]
        );
    }
}

#[test]
fn delayed_frames_still_give_exact_results() {
    let world = 3;
    let fabric = MemFabric::new(world, 1);
    fabric.inject(Fault::Delay {
        from: 0,
        to: 1,
        by: Duration::from_millis(3),
    });
    fabric.inject(Fault::Delay {
        from: 2,
        to: 0,
        by: Duration::from_millis(2),
    });
    let cfg = config(Duration::from_secs(30), 256);
    let res = run_ranks(&fabric, world, &cfg, |c| {
        common::run_matrix(c, &[5, 300], 3)
    });
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

fn expect_mismatch_everywhere(res: &[dspark::Result<()>], needle: &str) {
    for (r, x) in res.iter().enumerate() {
        match x {
            Err(e @ Error::Mismatch { .. }) => {
                assert!(
                    e.to_string().contains(needle),
                    "rank {r}: {e} lacks {needle:?}"
                )
            }
            other => panic!("rank {r}: expected Mismatch, got {other:?}"),
        }
    }
}

#[test]
fn mismatched_counts_are_reported_on_every_rank() {
    let fabric = MemFabric::new(3, 1);
    let cfg = config(Duration::from_secs(5), 1024);
    let res = run_ranks(&fabric, 3, &cfg, |c| {
        let mut buf = vec![1.0f32; if c.rank() == 1 { 12 } else { 10 }];
        c.all_reduce(&mut buf, ReduceOp::Sum)
    });
    expect_mismatch_everywhere(&res, "count");
}

/// An empty call still takes its place in the sequence: a rank that calls all_reduce with
/// count 0 and then 1000, against one that calls it twice with 1000, is a mismatch on both
/// ranks at once, not a deadline's wait for the second rank (issue #11, item 2).
#[test]
fn an_empty_call_against_a_full_one_is_a_prompt_mismatch_on_every_rank() {
    let cfg = config(Duration::from_secs(20), 1024);
    // (An empty call as a rank's *last* call cannot be told from a full one without a round
    // trip per empty call; the others then learn of it when that rank closes or calls again.)
    for coll in ["all_reduce", "all_gather"] {
        let t0 = Instant::now();
        let res = run_ranks(&MemFabric::new(2, 1), 2, &cfg, |c| {
            let counts: [usize; 2] = if c.rank() == 0 {
                [0, 1000]
            } else {
                [1000, 1000]
            };
            let mut first_ok = Vec::new();
            for n in counts {
                let r = if coll == "all_reduce" {
                    c.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum)
                } else {
                    c.all_gather(&vec![1u8; n], &mut vec![0u8; 2 * n])
                };
                match r {
                    Ok(()) => first_ok.push(n),
                    Err(e) => return Err((e, first_ok)),
                }
            }
            Ok(first_ok)
        });
        let took = t0.elapsed();
        for (r, x) in res.iter().enumerate() {
            match x {
                Err((e @ Error::Mismatch { .. }, _)) => assert!(
                    e.to_string().contains(coll),
                    "{coll}: rank {r}: {e} does not name the collective"
                ),
                other => panic!("{coll}: rank {r}: expected a Mismatch, got {other:?}"),
            }
        }
        assert!(
            took < Duration::from_secs(10),
            "{coll}: the mismatch took {took:?}: it waited for the deadline"
        );
    }
}

#[test]
fn mismatched_types_ops_roots_and_collectives_are_reported() {
    let cfg = config(Duration::from_secs(5), 1024);
    // Type.
    let res = run_ranks(&MemFabric::new(2, 1), 2, &cfg, |c| {
        if c.rank() == 0 {
            c.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum)
        } else {
            c.all_reduce(&mut [1i32; 8], ReduceOp::Sum)
        }
    });
    expect_mismatch_everywhere(&res, "int32");
    // Operator.
    let res = run_ranks(&MemFabric::new(2, 1), 2, &cfg, |c| {
        let op = if c.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        c.all_reduce(&mut [1.0f64; 8], op)
    });
    expect_mismatch_everywhere(&res, "max");
    // Root: both ranks believe they are the root (data flows only one way).
    let res = run_ranks(&MemFabric::new(2, 1), 2, &cfg, |c| {
        c.broadcast(&mut [7u8; 8], c.rank())
    });
    expect_mismatch_everywhere(&res, "root");
    // Root: neither is.
    let res = run_ranks(&MemFabric::new(2, 1), 2, &cfg, |c| {
        c.reduce(&mut [7u8; 8], ReduceOp::Sum, 1 - c.rank())
    });
    expect_mismatch_everywhere(&res, "root");
    // Collective.
    let res = run_ranks(&MemFabric::new(2, 1), 2, &cfg, |c| {
        if c.rank() == 0 {
            c.all_reduce(&mut [1u64; 8], ReduceOp::Sum)
        } else {
            c.broadcast(&mut [1u64; 8], 0)
        }
    });
    expect_mismatch_everywhere(&res, "broadcast");
}

#[test]
fn the_first_error_poisons_and_argument_errors_do_not() {
    let fabric = MemFabric::new(2, 1);
    let cfg = config(Duration::from_millis(300), 1024);
    let done = Barrier::new(2);
    let res = run_ranks(&fabric, 2, &cfg, |c| {
        // An argument error is local and harmless.
        let e = c.all_gather(&[1u8; 3], &mut [0u8; 5]).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let e = c.broadcast(&mut [0u8; 3], 9).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let mut ok = [c.rank() as u32 + 1; 4];
        c.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
        assert_eq!(ok, [3; 4]);
        if c.rank() == 1 {
            // Alive but silent until rank 0 is done.
            done.wait();
            return (None, None);
        }
        // Rank 1 stopped participating: rank 0 times out, then stays failed.
        let first = c.all_reduce(&mut ok, ReduceOp::Sum).unwrap_err();
        let t = Instant::now();
        let second = c.barrier().unwrap_err();
        assert!(
            t.elapsed() < Duration::from_millis(50),
            "poisoned call waited"
        );
        done.wait();
        (Some(first), Some(second))
    });
    let (first, second) = &res[0];
    let (first, second) = (first.as_ref().unwrap(), second.as_ref().unwrap());
    assert!(matches!(first, Error::Timeout { .. }), "{first}");
    assert_eq!(first.to_string(), second.to_string());
}

#[test]
fn zero_counts_return_at_once_and_world_of_one_works() {
    let fabric = MemFabric::new(1, 1);
    let cfg = config(Duration::from_secs(1), 1024);
    run_ranks(&fabric, 1, &cfg, |c| {
        let mut v = [5i32, -7, 9];
        c.all_reduce(&mut v, ReduceOp::Avg).unwrap();
        assert_eq!(v, [5, -7, 9]);
        c.all_reduce::<f32>(&mut [], ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        let mut out = [0i32; 3];
        c.all_gather(&v, &mut out).unwrap();
        assert_eq!(out, v);
    });
}

#[test]
fn ranks_forced_to_different_algorithms_get_mismatch_not_wrong_data() {
    // With 2 ranks, ring and recursive doubling exchange frames of the same sizes: only the
    // algorithm in the descriptor tells them apart.
    let world = 2;
    let fabric = MemFabric::new(world, 4);
    let res: Vec<dspark::Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let t = fabric.transport(r);
                s.spawn(move || {
                    let mut cfg = config(Duration::from_secs(5), 1024);
                    cfg.algo = dspark::internals::plan::Algorithm::from_name(if r == 0 {
                        "ring"
                    } else {
                        "recursive_doubling"
                    });
                    let comm = Communicator::from_transport(r, world, Box::new(t), &cfg).unwrap();
                    let mut buf = vec![1.0f32; 512];
                    comm.all_reduce(&mut buf, ReduceOp::Sum)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    expect_mismatch_everywhere(&res, "recursive_doubling");
}

/// `Communicator::set_algorithm` (behind `dspark-bench --algo`): every rank switching together
/// runs the new algorithm with the right results; a rank that switches alone gets a mismatch,
/// as ranks forced differently at init do.
#[test]
fn switching_the_algorithm_on_every_rank_works_and_on_one_rank_is_a_mismatch() {
    use dspark::internals::plan::{Algorithm, Collective};
    let world = 3;
    let fabric = MemFabric::new(world, 4);
    let cfg = config(Duration::from_secs(5), 1024);
    let res = run_ranks(&fabric, world, &cfg, |c| {
        let mut seen = Vec::new();
        for a in [
            Some(Algorithm::Ring),
            Some(Algorithm::RecursiveDoubling),
            None,
        ] {
            c.set_algorithm(a).unwrap();
            let mut v: Vec<f64> = (0..101).map(|i| (i * (c.rank() + 1)) as f64).collect();
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            let want: Vec<f64> = (0..101).map(|i| (i * 6) as f64).collect();
            assert_eq!(v, want, "rank {} under {a:?}", c.rank());
            seen.push((
                c.forced_algorithm(),
                c.algorithm(Collective::AllReduce, 808),
            ));
        }
        // Only rank 1 switches now.
        if c.rank() == 1 {
            c.set_algorithm(Some(Algorithm::Ring)).unwrap();
        }
        let mut v = vec![1.0f32; 512];
        (seen, c.all_reduce(&mut v, ReduceOp::Sum))
    });
    let default = res[0].0[2].1;
    for (seen, _) in &res {
        assert_eq!(
            seen,
            &vec![
                (Some(Algorithm::Ring), Algorithm::Ring),
                (
                    Some(Algorithm::RecursiveDoubling),
                    Algorithm::RecursiveDoubling
                ),
                (None, default),
            ]
        );
    }
    assert_eq!(default, Algorithm::RecursiveDoubling, "808 B is small");
    let last: Vec<dspark::Result<()>> = res.into_iter().map(|(_, r)| r).collect();
    expect_mismatch_everywhere(&last, "ring");
}

#[test]
fn every_argument_rule_is_checked_before_anything_moves() {
    let fabric = MemFabric::new(3, 1);
    let cfg = config(Duration::from_secs(5), 1024);
    let res = run_ranks(&fabric, 3, &cfg, |c| {
        let me = c.rank();
        let other = (me + 1) % 3;
        let bad: Vec<(&str, Error)> = vec![
            (
                "recv has 5",
                c.all_gather(&[1u8; 2], &mut [0u8; 5]).unwrap_err(),
            ),
            (
                "send has 7",
                c.reduce_scatter(&[1u8; 7], &mut [0u8; 2], ReduceOp::Sum)
                    .unwrap_err(),
            ),
            (
                "multiple of the world size (3)",
                c.all_to_all(&[1u8; 4], &mut [0u8; 4]).unwrap_err(),
            ),
            (
                "same length",
                c.all_to_all(&[1u8; 3], &mut [0u8; 6]).unwrap_err(),
            ),
            (
                "root 3 is not a rank",
                c.broadcast(&mut [0u8; 3], 3).unwrap_err(),
            ),
            (
                "root 7 is not a rank",
                c.reduce(&mut [0u8; 3], ReduceOp::Max, 7).unwrap_err(),
            ),
            ("peer 3 is not a rank", c.send(&[1u8; 3], 3).unwrap_err()),
            (
                "cannot send to this rank",
                c.send(&[1u8; 3], me).unwrap_err(),
            ),
            (
                "cannot receive from this rank",
                c.recv(&mut [0u8; 3], me).unwrap_err(),
            ),
        ];
        for (want, e) in bad {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{want}: {e}");
            assert!(e.to_string().contains(want), "{want}: {e}");
        }
        // Empty calls are valid and move nothing; the world still works afterwards.
        c.all_gather::<u8>(&[], &mut []).unwrap();
        c.send::<u8>(&[], other).unwrap();
        let mut v = [me as u32 + 1; 3];
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [6; 3]);
    });
    assert_eq!(res.len(), 3);
}

/// #11 item 8: a panic inside a collective (a bug, a failed assertion in a dependency) leaves
/// half-sent frames and an advanced sequence on that rank. It must poison the communicator —
/// the call and every later one fail — and tell the peers, which fail promptly naming the
/// rank, not at the deadline; both for a blocking call (run on the caller's thread) and for a
/// non-blocking one that is only polled (so the progress thread runs it).
#[test]
fn a_panic_inside_a_collective_poisons_the_communicator_and_fails_every_peer_promptly() {
    let world = 3;
    for nonblocking in [false, true] {
        let fabric = MemFabric::new(world, 4);
        // Rank 1's second frame to rank 2, in the middle of a ring all_reduce.
        fabric.inject(Fault::Panic {
            from: 1,
            to: 2,
            nth: 1,
        });
        let mut cfg = config(Duration::from_secs(60), 64);
        cfg.algo = Some(dspark::internals::plan::Algorithm::Ring);
        let start = Instant::now();
        let res = run_ranks(&fabric, world, &cfg, |c| {
            let mut buf = vec![1.0f32; 1000];
            let first = if nonblocking {
                // Polled, never waited for: only the progress thread can have run it.
                c.scope(|s| {
                    let w = s.all_reduce(&mut buf, ReduceOp::Sum)?;
                    let give_up = Instant::now() + Duration::from_secs(120);
                    while !w.test()? {
                        assert!(Instant::now() < give_up, "the operation never completed");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Ok(())
                })
            } else {
                c.all_reduce(&mut buf, ReduceOp::Sum)
            };
            let at = start.elapsed();
            let second = c.all_reduce(&mut buf, ReduceOp::Sum);
            (first, at, second, c.poisoned())
        });
        for (r, (first, at, second, poisoned)) in res.iter().enumerate() {
            let e = first
                .as_ref()
                .expect_err(&format!("rank {r}: the call must fail"));
            let text = e.to_string();
            if r == 1 {
                assert!(
                    text.contains("panic") && text.contains("rank 1"),
                    "rank 1 (nonblocking {nonblocking}): {text}"
                );
            } else {
                assert!(
                    text.contains("rank 1"),
                    "rank {r} (nonblocking {nonblocking}) must name rank 1: {text}"
                );
            }
            // Far below the 60 s deadline: the peers were told, they did not wait it out.
            assert!(
                *at < Duration::from_secs(20),
                "rank {r} (nonblocking {nonblocking}) failed only after {at:?}"
            );
            assert!(
                second.is_err() && poisoned.is_some(),
                "rank {r} (nonblocking {nonblocking}): the communicator must stay poisoned: \
                 {second:?}"
            );
        }
    }
}

/// #10 (a forced algorithm must be said, not silently replaced): what `DSPARK_ALGO` forces,
/// and what it does not apply to, is visible to the bench header through the communicator.
#[test]
fn a_forced_algorithm_is_reported_with_the_collectives_it_applies_to() {
    use dspark::internals::plan::{Algorithm, Collective};
    let fabric = MemFabric::new(2, 4);
    let mut cfg = config(Duration::from_secs(30), 256);
    cfg.algo = Some(Algorithm::BinomialTree);
    let res = run_ranks(&fabric, 2, &cfg, |c| {
        let mut v = vec![1.0f32; 100];
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        (
            c.forced_algorithm(),
            c.algorithm(Collective::AllReduce, 400),
            c.algorithm(Collective::Broadcast, 1 << 20),
            v[0],
        )
    });
    for (forced, ar, bc, v) in res {
        assert_eq!(forced, Some(Algorithm::BinomialTree));
        assert_ne!(ar, Algorithm::BinomialTree, "all_reduce keeps its default");
        assert_eq!(bc, Algorithm::BinomialTree);
        assert_eq!(v, 2.0);
    }
    assert_eq!(Algorithm::BinomialTree.collectives(), "broadcast, reduce");
    assert_eq!(
        Algorithm::Ring.collectives(),
        "all_reduce, all_gather, reduce_scatter"
    );

    // `tree` used to name the binomial tree (broadcast and reduce only, so an all_reduce under
    // it ran its default); it now names the double binary tree, which all_reduce runs, while
    // broadcast and reduce keep the binomial tree's schedule under it.
    assert_eq!(Algorithm::from_name("tree"), Some(Algorithm::Tree));
    assert_eq!(
        Algorithm::from_name("binomial_tree"),
        Some(Algorithm::BinomialTree)
    );
    assert_eq!(
        Algorithm::Tree.collectives(),
        "all_reduce, broadcast, reduce"
    );
    cfg.algo = Some(Algorithm::Tree);
    let fabric = MemFabric::new(2, 4);
    let res = run_ranks(&fabric, 2, &cfg, |c| {
        let mut v = vec![1.0f32; 100];
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        c.broadcast(&mut v, 1).unwrap();
        (
            c.forced_algorithm(),
            c.algorithm(Collective::AllReduce, 400),
            c.algorithm(Collective::AllReduce, 64 << 20),
            c.algorithm(Collective::Broadcast, 1 << 20),
            c.algorithm(Collective::AllGather, 1 << 20),
            v[0],
        )
    });
    for (forced, small, large, bc, ag, v) in res {
        assert_eq!(forced, Some(Algorithm::Tree));
        assert_eq!(
            (small, large, bc),
            (Algorithm::Tree, Algorithm::Tree, Algorithm::Tree)
        );
        assert_eq!(ag, Algorithm::Ring, "all_gather keeps its default");
        assert_eq!(v, 2.0);
    }
}

std::thread_local! {
    static THREAD_LOG: std::cell::RefCell<Option<LogBuf>> = const { std::cell::RefCell::new(None) };
}

/// Sends what this thread logs at WARN and above into `log` (None: nowhere). One global
/// subscriber routes each event to its thread's buffer: per-thread `with_default` subscribers
/// in parallel rank threads let tracing's global level hint race (one CI run lost a rank's
/// warning that way).
fn capture_this_threads_log(log: Option<LogBuf>) {
    static GLOBAL: std::sync::Once = std::sync::Once::new();
    GLOBAL.call_once(|| {
        let sub = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(|| ThreadLog)
            .finish();
        tracing::subscriber::set_global_default(sub).expect("no other global subscriber");
    });
    THREAD_LOG.with(|l| *l.borrow_mut() = log);
}

/// The writer of that subscriber: into the calling thread's buffer, if it has one.
struct ThreadLog;

impl std::io::Write for ThreadLog {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        THREAD_LOG.with(|l| {
            if let Some(log) = &*l.borrow() {
                log.0.lock().unwrap().extend_from_slice(b);
            }
        });
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the rank logs: a `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct LogBuf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// #10: a forced algorithm that does not implement a collective is said in the log once per
/// collective (a warning per call would flood a training log), and not for collectives it
/// implements or that have no choice of algorithm.
#[test]
fn a_forced_algorithm_that_does_not_apply_is_warned_about_once_per_collective() {
    let fabric = MemFabric::new(2, 4);
    let mut cfg = config(Duration::from_secs(30), 256);
    cfg.algo = Some(dspark::internals::plan::Algorithm::BinomialTree);
    let logs = run_ranks(&fabric, 2, &cfg, |c| {
        let log = LogBuf::default();
        capture_this_threads_log(Some(log.clone()));
        let mut v = vec![1.0f32; 100];
        for _ in 0..3 {
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            c.broadcast(&mut v, 0).unwrap();
            c.barrier().unwrap();
        }
        let mut big = vec![1.0f32; 300_000];
        c.all_reduce(&mut big, ReduceOp::Sum).unwrap();
        capture_this_threads_log(None);
        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        text
    });
    for (r, text) in logs.iter().enumerate() {
        let said = text.matches("does not implement all_reduce").count();
        assert_eq!(said, 1, "rank {r} must warn once about all_reduce:\n{text}");
        assert!(
            text.contains("binomial_tree") && text.contains("broadcast, reduce"),
            "rank {r}: the warning names the algorithm and what it applies to:\n{text}"
        );
        assert_eq!(
            text.matches("does not implement").count(),
            1,
            "rank {r}: no warning for broadcast (implemented) or barrier (no choice):\n{text}"
        );
    }
}

/// #10 ("seeing it"): `DSPARK_TRACE` writes one Chrome / Perfetto trace per rank, with every
/// call and every segment the algorithm moved. Checked against what a ring all_reduce on 3
/// ranks must do (2(n−1) sends to the right neighbour, of which the first n−1 receives from
/// the left reduce), not against the engine's own bookkeeping.
#[test]
fn a_trace_shows_every_call_and_every_segment_each_rank_moved() {
    let world = 3;
    let dir = std::env::temp_dir().join(format!("dspark-trace-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = MemFabric::new(world, 4);
    // 3000 f32 = 3 blocks of 4000 B, each one segment.
    let mut cfg = config(Duration::from_secs(30), 4096);
    cfg.algo = Some(dspark::internals::plan::Algorithm::Ring);
    cfg.trace = Some(dir.join("run"));
    run_ranks(&fabric, world, &cfg, |c| {
        let mut v = vec![1.0f32; 3000];
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        assert_eq!(v[2999], 3.0);
    });
    for r in 0..world {
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(&format!("run.rank{r}.")) && n.ends_with(".json"))
            .collect();
        assert_eq!(files.len(), 1, "rank {r}: one trace file, got {files:?}");
        let text = std::fs::read_to_string(dir.join(&files[0])).unwrap();
        assert!(
            text.trim_end().ends_with(']'),
            "rank {r}: the file is closed"
        );
        let events: Vec<serde_json::Value> = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("rank {r}: not JSON ({e}):\n{text}"));
        let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        let call = |name: &str| {
            spans
                .iter()
                .find(|e| e["cat"] == "call" && e["name"] == name)
                .unwrap_or_else(|| panic!("rank {r}: no call {name} in\n{text}"))
        };
        let ar = call("all_reduce #1");
        assert_eq!(ar["args"]["algorithm"], "ring");
        assert_eq!(ar["args"]["bytes"], 12000);
        assert_eq!(ar["pid"], r);
        call("barrier #2");
        let (t0, t1) = (
            ar["ts"].as_f64().unwrap(),
            ar["ts"].as_f64().unwrap() + ar["dur"].as_f64().unwrap(),
        );
        let within = |e: &&&serde_json::Value| {
            let ts = e["ts"].as_f64().unwrap();
            ts >= t0 - 0.001 && ts + e["dur"].as_f64().unwrap() <= t1 + 0.001
        };
        let lane = |name: String| {
            events
                .iter()
                .find(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == name)
                .map(|e| e["tid"].clone())
                .unwrap_or_else(|| panic!("rank {r}: no lane {name:?}"))
        };
        let (right, left) = ((r + 1) % world, (r + world - 1) % world);
        let send_lane = lane(format!("send \u{2192} rank {right}"));
        let recv_lane = lane(format!("recv \u{2190} rank {left}"));
        let in_ar: Vec<_> = spans.iter().filter(within).collect();
        let sends: Vec<_> = in_ar.iter().filter(|e| e["cat"] == "send").collect();
        let recvs: Vec<_> = in_ar
            .iter()
            .filter(|e| e["cat"] == "recv" || e["cat"] == "recv+reduce")
            .collect();
        assert_eq!(sends.len(), 2 * (world - 1), "rank {r}: sends {sends:?}");
        assert!(sends
            .iter()
            .all(|e| e["tid"] == send_lane && e["args"]["bytes"] == 4000));
        assert_eq!(recvs.len(), 2 * (world - 1), "rank {r}: receives {recvs:?}");
        assert!(recvs
            .iter()
            .all(|e| e["tid"] == recv_lane && e["args"]["bytes"] == 4000));
        let reducing = recvs.iter().filter(|e| e["cat"] == "recv+reduce").count();
        assert_eq!(
            reducing,
            world - 1,
            "rank {r}: the reduce-scatter half reduces"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
