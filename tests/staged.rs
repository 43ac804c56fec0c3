//! The host-staged device path, on an emulated device whose copies and reductions complete
//! late (so the engine must wait for each stage before using a slot), over threads and the
//! `mem` transport: every collective, several types and every operator against the
//! independent reference, mixed host and device ranks, and tiny slot pools. The same matrix runs
//! in *direct* mode (the GPUDirect protocol: payloads land in the receiver's registered region
//! and stay there until the device consumed them), over the `mem` fabric's emulated regions.

mod common;

use std::time::{Duration, Instant};

use common::TestElem;
use dspark::internals::engine::staged::EmulatedDevice;
use dspark::internals::engine::Call;
use dspark::internals::plan::Collective;
use dspark::internals::transport::mem::MemFabric;
use dspark::{bf16, f16, Communicator, Config, ReduceOp};

fn bytes<T: TestElem>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn typed<T: TestElem>(b: &[u8]) -> Vec<T> {
    b.chunks_exact(size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

const SEG: usize = 48;

/// Slots of the emulated device: pinned host slots (send, receive), or direct mode with this
/// many send slots in the transport's region.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Staged(usize, usize),
    Direct(usize),
}

fn run_world<R: Send>(world: usize, f: impl Fn(&Communicator) -> R + Sync) -> Vec<R> {
    run_on(MemFabric::new(world, 1), world, f)
}

/// A world whose `mem` fabric has direct regions of `landing` slots per peer (one segment
/// each) and 3 send slots.
fn run_direct<R: Send>(
    world: usize,
    landing: usize,
    f: impl Fn(&Communicator) -> R + Sync,
) -> Vec<R> {
    run_on(MemFabric::with_direct(world, 4, landing, SEG, 3), world, f)
}

fn run_on<R: Send>(
    fabric: MemFabric,
    world: usize,
    f: impl Fn(&Communicator) -> R + Sync,
) -> Vec<R> {
    run_forced(fabric, world, None, f)
}

/// [`run_on`] with `algo` forced (`DSPARK_ALGO`), or the model's choice.
fn run_forced<R: Send>(
    fabric: MemFabric,
    world: usize,
    algo: Option<dspark::internals::plan::Algorithm>,
    f: impl Fn(&Communicator) -> R + Sync,
) -> Vec<R> {
    let mut cfg = Config::new(0, 1, "");
    cfg.timeout = Duration::from_secs(30);
    cfg.segment_bytes = SEG;
    cfg.algo = algo;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let t = fabric.transport(r);
                let (f, cfg) = (&f, &cfg);
                s.spawn(move || {
                    let comm = Communicator::from_transport(r, world, Box::new(t), cfg).unwrap();
                    f(&comm)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn call<T: TestElem>(
    coll: Collective,
    op: Option<ReduceOp>,
    count: usize,
    root: usize,
    is_send: bool,
) -> Call {
    let mut c = Call::new(coll, op, count, root, is_send);
    c.dtype = T::DATA_TYPE;
    c
}

/// Every collective on the emulated device; `host_ranks` use host memory instead, to show
/// that both paths speak the same wire protocol.
fn device_matrix<T: TestElem>(
    comm: &Communicator,
    op: ReduceOp,
    count: usize,
    seed: u64,
    host_ranks: &[usize],
    mode: Mode,
) -> Result<(), String> {
    let n = comm.world_size();
    let r = comm.rank();
    let on_host = host_ranks.contains(&r);
    let ctx = format!(
        "{} {op} count {count} world {n} rank {r} {mode:?}",
        T::DATA_TYPE
    );
    let dev = |src: Vec<u8>, dst: Vec<u8>| match mode {
        Mode::Staged(s, rv) => EmulatedDevice::new(src, dst, s, rv, SEG, seed ^ r as u64),
        Mode::Direct(s) => {
            let region = comm.direct_host_region().expect("a direct region");
            let layout = comm.direct_layout().expect("a direct layout");
            EmulatedDevice::direct(src, dst, region, layout, s, seed ^ r as u64)
        }
    };
    let e = |what: &str| {
        let what = format!("{what} {ctx}");
        move |err: dspark::Error| format!("{what}: {err}")
    };

    // all_reduce
    let input = common::inputs::<T>(op, seed, r, count);
    let got: Vec<T> = if on_host {
        let mut b = input.clone();
        comm.all_reduce(&mut b, op).map_err(e("all_reduce"))?;
        b
    } else {
        let mut d = dev(Vec::new(), bytes(&input));
        comm.run_staged(
            call::<T>(Collective::AllReduce, Some(op), count, 0, false),
            &mut d,
        )
        .map_err(e("all_reduce"))?;
        typed(&d.dst)
    };
    common::check(
        &format!("staged all_reduce {ctx}"),
        &got,
        &common::reduced::<T>(op, seed, n, count),
    )?;

    // reduce_scatter
    let send = common::inputs::<T>(op, seed ^ 1, r, count * n);
    let got: Vec<T> = if on_host {
        let mut out = vec![T::default(); count];
        comm.reduce_scatter(&send, &mut out, op)
            .map_err(e("reduce_scatter"))?;
        out
    } else {
        let mut d = dev(bytes(&send), vec![0; count * size_of::<T>()]);
        comm.run_staged(
            call::<T>(Collective::ReduceScatter, Some(op), count, 0, false),
            &mut d,
        )
        .map_err(e("reduce_scatter"))?;
        typed(&d.dst)
    };
    let full = common::reduced::<T>(op, seed ^ 1, n, count * n);
    common::check(
        &format!("staged reduce_scatter {ctx}"),
        &got,
        &full[r * count..(r + 1) * count],
    )?;

    // reduce to the last rank
    let root = n - 1;
    let input = common::inputs::<T>(op, seed ^ 2, r, count);
    let got: Vec<T> = if on_host {
        let mut b = input.clone();
        comm.reduce(&mut b, op, root).map_err(e("reduce"))?;
        b
    } else {
        let mut d = dev(Vec::new(), bytes(&input));
        comm.run_staged(
            call::<T>(Collective::Reduce, Some(op), count, root, false),
            &mut d,
        )
        .map_err(e("reduce"))?;
        typed(&d.dst)
    };
    if r == root {
        common::check(
            &format!("staged reduce {ctx}"),
            &got,
            &common::reduced::<T>(op, seed ^ 2, n, count),
        )?;
    }

    if op != ReduceOp::Sum {
        return Ok(());
    }
    // all_gather
    let mine = common::inputs::<T>(op, seed ^ 3, r, count);
    let got: Vec<T> = if on_host {
        let mut all = vec![T::default(); count * n];
        comm.all_gather(&mine, &mut all).map_err(e("all_gather"))?;
        all
    } else {
        let mut d = dev(bytes(&mine), vec![0; count * n * size_of::<T>()]);
        comm.run_staged(
            call::<T>(Collective::AllGather, None, count, 0, false),
            &mut d,
        )
        .map_err(e("all_gather"))?;
        typed(&d.dst)
    };
    let want: Vec<T> = (0..n)
        .flat_map(|q| common::inputs::<T>(op, seed ^ 3, q, count))
        .collect();
    common::check(&format!("staged all_gather {ctx}"), &got, &want)?;

    // broadcast from rank 0
    let input = if r == 0 {
        common::inputs::<T>(op, seed ^ 4, 0, count)
    } else {
        vec![T::default(); count]
    };
    let got: Vec<T> = if on_host {
        let mut b = input.clone();
        comm.broadcast(&mut b, 0).map_err(e("broadcast"))?;
        b
    } else {
        let mut d = dev(Vec::new(), bytes(&input));
        comm.run_staged(
            call::<T>(Collective::Broadcast, None, count, 0, false),
            &mut d,
        )
        .map_err(e("broadcast"))?;
        typed(&d.dst)
    };
    common::check(
        &format!("staged broadcast {ctx}"),
        &got,
        &common::inputs::<T>(op, seed ^ 4, 0, count),
    )?;

    // all_to_all
    let send = common::inputs::<T>(op, seed ^ 5, r, count * n);
    let got: Vec<T> = if on_host {
        let mut out = vec![T::default(); count * n];
        comm.all_to_all(&send, &mut out).map_err(e("all_to_all"))?;
        out
    } else {
        let mut d = dev(bytes(&send), vec![0; count * n * size_of::<T>()]);
        comm.run_staged(
            call::<T>(Collective::AllToAll, None, count, 0, false),
            &mut d,
        )
        .map_err(e("all_to_all"))?;
        typed(&d.dst)
    };
    let want: Vec<T> = (0..n)
        .flat_map(|j| {
            common::inputs::<T>(op, seed ^ 5, j, count * n)[r * count..(r + 1) * count].to_vec()
        })
        .collect();
    common::check(&format!("staged all_to_all {ctx}"), &got, &want)?;

    // send/recv: rank 0 → rank 1
    if n > 1 && r < 2 {
        let data = common::inputs::<T>(op, seed ^ 6, 0, count);
        if r == 0 {
            let mut d = dev(bytes(&data), Vec::new());
            comm.run_staged(
                call::<T>(Collective::SendRecv, None, count, 1, true),
                &mut d,
            )
            .map_err(e("send"))?;
        } else {
            let mut d = dev(Vec::new(), vec![0; count * size_of::<T>()]);
            comm.run_staged(
                call::<T>(Collective::SendRecv, None, count, 0, false),
                &mut d,
            )
            .map_err(e("recv"))?;
            common::check(&format!("staged recv {ctx}"), &typed::<T>(&d.dst), &data)?;
        }
    }
    Ok(())
}

fn all_types(comm: &Communicator, host_ranks: &[usize], slots: Mode) -> Result<(), String> {
    for count in [1, 5, 31, 100] {
        for op in ReduceOp::ALL {
            let seed = 77 ^ count as u64 ^ (op as u64) << 8;
            device_matrix::<f32>(comm, op, count, seed, host_ranks, slots)?;
            device_matrix::<f16>(comm, op, count, seed, host_ranks, slots)?;
            device_matrix::<bf16>(comm, op, count, seed, host_ranks, slots)?;
            device_matrix::<i32>(comm, op, count, seed, host_ranks, slots)?;
            device_matrix::<u8>(comm, op, count, seed, host_ranks, slots)?;
            device_matrix::<f64>(comm, op, count, seed, host_ranks, slots)?;
        }
    }
    Ok(())
}

/// Element k of the block rank `from` sends rank `to` in an all_to_all_v: the independent
/// reference both ends compute.
fn v_elem<T: TestElem>(from: usize, to: usize, k: usize) -> T {
    T::input(ReduceOp::Sum, 0xa2a0 ^ (from * 64 + to) as u64, from, k)
}

/// The elements rank `from` sends rank `to`: uneven, zero for some pairs, several segments
/// (of 48 bytes) for others, and `scale` shifting them call to call.
fn v_count(from: usize, to: usize, scale: usize) -> usize {
    (from * 5 + to * 11 + scale) % 9 * (1 + (from + to) % 3) * (scale % 4 + 1)
}

/// all_to_all_v on the emulated device (`host_ranks` on host memory: the same frames), with
/// uneven and empty blocks, against [`v_elem`]; several calls, so that the engine's kept
/// programs are reused and replaced.
fn device_all_to_all_v<T: TestElem>(
    comm: &Communicator,
    host_ranks: &[usize],
    mode: Mode,
    seed: u64,
) -> Result<(), String> {
    let (n, r) = (comm.world_size(), comm.rank());
    for scale in [0usize, 1, 2, 3, 1, 7] {
        let send_counts: Vec<usize> = (0..n).map(|j| v_count(r, j, scale)).collect();
        let recv_counts: Vec<usize> = (0..n).map(|i| v_count(i, r, scale)).collect();
        let send: Vec<T> = (0..n)
            .flat_map(|j| (0..send_counts[j]).map(move |k| v_elem::<T>(r, j, k)))
            .collect();
        let want: Vec<T> = (0..n)
            .flat_map(|i| (0..recv_counts[i]).map(move |k| v_elem::<T>(i, r, k)))
            .collect();
        let ctx = format!(
            "all_to_all_v {} scale {scale} world {n} rank {r} {mode:?}",
            T::DATA_TYPE
        );
        // Filled with other values, so that an element left unwritten shows.
        let mut got: Vec<T> = (0..want.len())
            .map(|k| T::input(ReduceOp::Sum, 0xdead, r, k))
            .collect();
        if host_ranks.contains(&r) {
            comm.all_to_all_v(&send, &send_counts, &mut got, &recv_counts)
                .map_err(|e| format!("{ctx}: {e}"))?;
        } else {
            let dst = bytes(&got);
            let mut d = match mode {
                Mode::Staged(s, rv) => {
                    EmulatedDevice::new(bytes(&send), dst, s, rv, SEG, seed ^ r as u64)
                }
                Mode::Direct(s) => {
                    let region = comm.direct_host_region().expect("a direct region");
                    let layout = comm.direct_layout().expect("a direct layout");
                    EmulatedDevice::direct(bytes(&send), dst, region, layout, s, seed ^ r as u64)
                }
            };
            comm.run_staged_all_to_all_v(T::DATA_TYPE, &send_counts, &recv_counts, &mut d)
                .map_err(|e| format!("{ctx}: {e}"))?;
            got = typed(&d.dst);
        }
        common::check(&ctx, &got, &want)?;
    }
    Ok(())
}

fn all_to_all_v_types(comm: &Communicator, host_ranks: &[usize], mode: Mode) -> Result<(), String> {
    device_all_to_all_v::<f32>(comm, host_ranks, mode, 3)?;
    device_all_to_all_v::<u8>(comm, host_ranks, mode, 4)?;
    device_all_to_all_v::<f64>(comm, host_ranks, mode, 5)?;
    device_all_to_all_v::<bf16>(comm, host_ranks, mode, 6)
}

/// all_to_all_v on device memory (MoE's expert exchange on CUDA tensors), staged and direct,
/// device ranks with host ranks (staged: the same frames; a host rank facing a direct one is
/// a mismatch by design), pools of one slot each way, worlds 1 to 4.
#[test]
fn staged_and_direct_all_to_all_v_match_the_reference_on_worlds_1_to_4() {
    for world in 1..=4 {
        let modes: [(&str, Vec<Result<(), String>>); 5] = [
            (
                "staged",
                run_world(world, |c| all_to_all_v_types(c, &[], Mode::Staged(2, 2))),
            ),
            (
                "one slot",
                run_world(world, |c| all_to_all_v_types(c, &[], Mode::Staged(1, 1))),
            ),
            (
                "with host rank 0",
                run_world(world, |c| all_to_all_v_types(c, &[0], Mode::Staged(2, 1))),
            ),
            (
                "direct",
                run_direct(world, 2, |c| all_to_all_v_types(c, &[], Mode::Direct(2))),
            ),
            (
                "direct, one send slot and one landing slot",
                run_direct(world, 1, |c| all_to_all_v_types(c, &[], Mode::Direct(1))),
            ),
        ];
        for (what, outs) in modes {
            for (r, res) in outs.into_iter().enumerate() {
                res.unwrap_or_else(|e| panic!("{what}, world {world} rank {r}: {e}"));
            }
        }
    }
}

/// A device rank whose counts disagree with its peer's gets a mismatch naming both sizes, as
/// on host memory, never data at the wrong offsets or a hang.
#[test]
fn a_staged_all_to_all_v_whose_counts_disagree_fails_with_a_mismatch() {
    let outs = run_world(2, |comm| {
        let r = comm.rank();
        // Rank 0 sends 5 elements to rank 1, which expects 4.
        let (send, recv) = if r == 0 {
            ([2, 5], [2, 3])
        } else {
            ([3, 2], [4, 2])
        };
        let total = |c: &[usize; 2]| c.iter().sum::<usize>() * 4;
        let mut d = EmulatedDevice::new(
            vec![0u8; total(&send)],
            vec![0u8; total(&recv)],
            2,
            2,
            SEG,
            9,
        );
        comm.run_staged_all_to_all_v(dspark::DataType::F32, &send, &recv, &mut d)
    });
    let e = outs[1]
        .as_ref()
        .expect_err("rank 1 expected 4 elements and got 5");
    let text = e.to_string();
    assert!(
        matches!(e, dspark::Error::Mismatch { .. })
            && text.contains("5 for this pair")
            && text.contains("4 for this pair"),
        "{text}"
    );
}

#[test]
fn staged_device_collectives_match_the_reference_on_worlds_1_to_4() {
    for world in 1..=4 {
        for (r, res) in run_world(world, |c| all_types(c, &[], Mode::Staged(2, 2)))
            .into_iter()
            .enumerate()
        {
            res.unwrap_or_else(|e| panic!("world {world} rank {r}: {e}"));
        }
    }
}

#[test]
fn host_and_device_ranks_interoperate() {
    for (r, res) in run_world(3, |c| all_types(c, &[1], Mode::Staged(3, 2)))
        .into_iter()
        .enumerate()
    {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn one_slot_each_way_is_enough() {
    for (r, res) in run_world(3, |c| all_types(c, &[], Mode::Staged(1, 1)))
        .into_iter()
        .enumerate()
    {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn direct_device_collectives_match_the_reference_on_worlds_1_to_4() {
    for world in 1..=4 {
        for (r, res) in run_direct(world, 2, |c| all_types(c, &[], Mode::Direct(2)))
            .into_iter()
            .enumerate()
        {
            res.unwrap_or_else(|e| panic!("world {world} rank {r}: {e}"));
        }
    }
}

/// Every allreduce schedule on the device paths, staged and direct: each algorithm forced
/// (the rest of the matrix runs its default under it) on worlds 3 (folded for doubling and
/// Rabenseifner), 4 and 5, where the model alone would pick doubling for these small counts,
/// with links of one frame and pools of one and of two slots. (Before the last free slot of
/// a pool was kept for the earliest step, the double binary tree on 5 ranks with two slots
/// and Rabenseifner's on 5 with links of one frame deadlocked until the deadline: a later
/// step to one peer held the slot an earlier step to another needed.)
#[test]
fn every_allreduce_algorithm_runs_on_the_staged_and_direct_device_paths() {
    use dspark::internals::plan::Algorithm;
    for algo in [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Tree,
        Algorithm::Rabenseifner,
    ] {
        for (world, slots) in [(3, 2), (4, 2), (5, 2), (5, 1)] {
            let staged = run_forced(MemFabric::new(world, 1), world, Some(algo), |c| {
                all_types(c, &[], Mode::Staged(slots, slots))
            });
            let direct = run_forced(
                MemFabric::with_direct(world, 1, slots, SEG, 3),
                world,
                Some(algo),
                |c| all_types(c, &[], Mode::Direct(slots)),
            );
            for (mode, res) in [("staged", staged), ("direct", direct)] {
                for (r, x) in res.into_iter().enumerate() {
                    x.unwrap_or_else(|e| {
                        panic!("{algo} {mode} world {world} {slots} slots rank {r}: {e}")
                    });
                }
            }
        }
    }
}

#[test]
fn one_landing_slot_and_one_send_slot_are_enough_for_direct() {
    for (r, res) in run_direct(3, 1, |c| all_types(c, &[], Mode::Direct(1)))
        .into_iter()
        .enumerate()
    {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn direct_payloads_really_land_in_the_region() {
    // 8 segments per rank of a 2-rank all-reduce: every received segment must be consumed
    // from the landing region by the device (none through host slots).
    let count = 8 * SEG / 4;
    let landed = run_direct(2, 2, |comm| {
        let r = comm.rank();
        let region = comm.direct_host_region().unwrap();
        let layout = comm.direct_layout().unwrap();
        let input = common::inputs::<f32>(ReduceOp::Sum, 9, r, count);
        let mut d = EmulatedDevice::direct(Vec::new(), bytes(&input), region, layout, 2, 5);
        comm.run_staged(
            call::<f32>(Collective::AllReduce, Some(ReduceOp::Sum), count, 0, false),
            &mut d,
        )
        .unwrap();
        common::check(
            "direct all_reduce",
            &typed::<f32>(&d.dst),
            &common::reduced::<f32>(ReduceOp::Sum, 9, 2, count),
        )
        .unwrap();
        d.landed
    });
    for (r, n) in landed.into_iter().enumerate() {
        assert!(n >= 8, "rank {r} consumed only {n} landed payloads");
    }
}

#[test]
fn a_host_rank_facing_a_direct_rank_gets_a_mismatch_not_a_hang() {
    let count = 40;
    let res = run_direct(2, 2, |comm| {
        let r = comm.rank();
        let input = common::inputs::<f32>(ReduceOp::Sum, 3, r, count);
        if r == 0 {
            let mut b = input;
            comm.all_reduce(&mut b, ReduceOp::Sum)
        } else {
            let region = comm.direct_host_region().unwrap();
            let layout = comm.direct_layout().unwrap();
            let mut d = EmulatedDevice::direct(Vec::new(), bytes(&input), region, layout, 2, 1);
            comm.run_staged(
                call::<f32>(Collective::AllReduce, Some(ReduceOp::Sum), count, 0, false),
                &mut d,
            )
        }
    });
    for (r, res) in res.into_iter().enumerate() {
        match res {
            Err(dspark::Error::Mismatch { what, .. }) => {
                assert!(what.contains("memory"), "rank {r}: {what}")
            }
            other => panic!("rank {r}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn a_device_over_another_region_is_refused_before_anything_moves() {
    use dspark::internals::transport::DirectTransport;
    let res = run_direct(1, 2, |comm| {
        let other = MemFabric::with_direct(1, 4, 2, SEG, 3).transport(0);
        let region = other.direct_host_region().unwrap();
        let layout = comm.direct_layout().unwrap();
        let input = common::inputs::<f32>(ReduceOp::Sum, 1, 0, 8);
        let mut d = EmulatedDevice::direct(Vec::new(), bytes(&input), region, layout, 2, 1);
        comm.run_staged(
            call::<f32>(Collective::AllReduce, Some(ReduceOp::Sum), 8, 0, false),
            &mut d,
        )
    });
    let e = res[0].as_ref().unwrap_err().to_string();
    assert!(e.contains("not the one registered"), "{e}");
}

/// #11 item 3: a device call that fails on one rank before its data moves (here: staging
/// slots smaller than a segment, or a direct device over a region the NIC does not know —
/// stand-ins for a failed staging allocation, a kernel compile error, a stream on the wrong
/// GPU) must fail through the same path as a failure mid-call: the communicator is poisoned
/// and the peers, which are in the call, fail promptly naming the rank — not at the deadline.
#[test]
fn a_device_call_failing_before_data_moves_fails_its_peers_promptly() {
    use dspark::internals::transport::DirectTransport;
    for direct in [false, true] {
        let start = Instant::now();
        let count = 40;
        let body = |comm: &Communicator| {
            let r = comm.rank();
            let mut b = common::inputs::<f32>(ReduceOp::Sum, 3, r, count);
            let first = if r == 0 {
                comm.all_reduce(&mut b, ReduceOp::Sum)
            } else {
                let c = call::<f32>(Collective::AllReduce, Some(ReduceOp::Sum), count, 0, false);
                if direct {
                    let other = MemFabric::with_direct(1, 4, 2, SEG, 3).transport(0);
                    let region = other.direct_host_region().unwrap();
                    let layout = comm.direct_layout().unwrap();
                    let mut d = EmulatedDevice::direct(Vec::new(), bytes(&b), region, layout, 2, 1);
                    comm.run_staged(c, &mut d)
                } else {
                    let mut d = EmulatedDevice::new(Vec::new(), bytes(&b), 2, 2, SEG / 2, 1);
                    comm.run_staged(c, &mut d)
                }
            };
            let at = start.elapsed();
            // No later call: a rank left one call behind would meet its peer's call there.
            (first, at, comm.poisoned())
        };
        let res = if direct {
            run_direct(2, 2, body)
        } else {
            run_world(2, body)
        };
        for (r, (first, at, later)) in res.iter().enumerate() {
            let e = first
                .as_ref()
                .expect_err(&format!("rank {r} (direct {direct}): the call must fail"))
                .to_string();
            assert!(e.contains("rank 1"), "rank {r} (direct {direct}): {e}");
            assert!(
                *at < Duration::from_secs(10),
                "rank {r} (direct {direct}) failed only after {at:?} (deadline 30 s)"
            );
            assert!(later.is_some(), "rank {r} (direct {direct}): not poisoned");
        }
    }
}

/// #10 ("seeing it"): on the staged path the trace's `device` lane shows the copies: every
/// segment sent was first copied out of the device (`d2h`), every segment received was
/// copied in, reduced exactly where the receive reduced.
#[test]
fn a_trace_of_a_staged_call_shows_every_device_copy() {
    let world = 2;
    let dir = std::env::temp_dir().join(format!("dspark-staged-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = MemFabric::new(world, 1);
    let mut cfg = Config::new(0, 1, "");
    cfg.timeout = Duration::from_secs(30);
    cfg.segment_bytes = SEG;
    cfg.trace = Some(dir.join("st"));
    std::thread::scope(|s| {
        for r in 0..world {
            let (t, cfg) = (fabric.transport(r), &cfg);
            s.spawn(move || {
                let comm = Communicator::from_transport(r, world, Box::new(t), cfg).unwrap();
                let input = vec![1.0f32 + r as f32; 100];
                let mut d = EmulatedDevice::new(Vec::new(), bytes(&input), 2, 2, SEG, 7);
                comm.run_staged(
                    call::<f32>(Collective::AllReduce, Some(ReduceOp::Sum), 100, 0, false),
                    &mut d,
                )
                .unwrap();
                assert_eq!(typed::<f32>(&d.dst)[99], 3.0);
            });
        }
    });
    for r in 0..world {
        let name = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .find(|n| n.starts_with(&format!("st.rank{r}.")))
            .expect("a trace file");
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        let events: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        let count = |cat: &str| events.iter().filter(|e| e["cat"] == cat).count();
        let sends = count("send");
        assert!(sends >= 2, "rank {r}: 400 B in 48 B segments: {text}");
        assert_eq!(count("d2h"), sends, "rank {r}: a copy-out per send");
        assert_eq!(
            count("h2d") + count("h2d+reduce"),
            count("recv") + count("recv+reduce"),
            "rank {r}: a copy-in per receive"
        );
        assert_eq!(count("h2d+reduce"), count("recv+reduce"), "rank {r}");
        assert!(count("h2d+reduce") > 0, "rank {r}: the all_reduce reduces");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
