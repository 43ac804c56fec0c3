//! Device ranks and host ranks in one small all_reduce over shared memory: the host ranks run
//! it one-shot through the transport's slots, so a device rank (the staged path, here on the
//! emulated device of `engine::staged`, whose copies complete late) must take part in the
//! same protocol. This test binary re-executes itself as rank processes (as tests/shm.rs);
//! the ranks listed in `DEVICE_RANKS` run every all_reduce through `run_staged`, the others
//! on host memory. Every type and operator at counts 1, 2, 7, 13, 1016, 1024 (f32 at the
//! one-shot bound, 4096 bytes), 1025 (just above: frames) and each type's own bound and one
//! past it,
//! against the independent reference of `tests/common`; staging slots smaller than a call
//! (copied in parts); other collectives between; the flight record says `one_shot` on the
//! `host-staged` path.

mod common;

use std::time::Duration;

use common::procs::{assert_all, rank_entry, say, spawn, vars, FAILED_AS_EXPECTED, OK};
use common::TestElem;
use dspark::internals::engine::staged::EmulatedDevice;
use dspark::internals::engine::Call;
use dspark::internals::plan::{Algorithm, Collective};
use dspark::internals::transport::TransportKind;
use dspark::{bf16, f16, Communicator, ReduceOp};

/// The one-shot bound over shared memory (bytes).
const BOUND: usize = 4096;
/// The segment size the ranks run with (`DSPARK_CHUNK_BYTES`): staging slots of 1, 2 or 4
/// KiB, so the calls near the bound are staged in several parts on some ranks.
const SEG: usize = 1024;

/// Entry point of a rank process. In a normal test run (no scenario set) it returns at once.
#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

fn run_scenario(s: &str) -> Result<i32, String> {
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    let got = comm.info().transport;
    if got != TransportKind::Shm {
        return Err(format!("transport {got}, expected shm"));
    }
    let device: Vec<usize> = std::env::var("DEVICE_RANKS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|r| r.parse().ok())
        .collect();
    match s {
        "mixed" => mixed(&comm, device.contains(&comm.rank())),
        "short" => short(&comm, device.contains(&comm.rank())),
        other => Err(format!("unknown scenario {other}")),
    }
}

fn mixed(comm: &Communicator, on_device: bool) -> Result<i32, String> {
    for bytes in [1, 8, 1000, BOUND] {
        let a = comm.algorithm(Collective::AllReduce, bytes);
        if a != Algorithm::OneShot {
            return Err(format!("{bytes} bytes run {a}, not one_shot"));
        }
    }
    let a = comm.algorithm(Collective::AllReduce, BOUND + 4);
    if a == Algorithm::OneShot {
        return Err(format!("{} bytes run one_shot", BOUND + 4));
    }
    let mut calls = 0u64;
    for op in ReduceOp::ALL {
        every_type(comm, on_device, op, &mut calls)?;
    }
    if on_device {
        let rec = comm.flight_record().ok_or("no flight record")?;
        let staged_one_shot = rec
            .entries
            .iter()
            .any(|e| e.algorithm == Some(Algorithm::OneShot) && e.path.name() == "host-staged");
        if !staged_one_shot {
            return Err("no one_shot call recorded on the host-staged path".into());
        }
    }
    Ok(OK)
}

/// A device rank whose buffer is one element short of the call fails it (as a host rank with
/// a short buffer would), and the failure reaches every rank at once: the host ranks, waiting
/// for its contribution in the slots, fail with its abort long before the 30 s deadline.
fn short(comm: &Communicator, on_device: bool) -> Result<i32, String> {
    let count = 13;
    let t0 = std::time::Instant::now();
    let res = if on_device {
        let mut d = EmulatedDevice::new(Vec::new(), vec![0; (count - 1) * 4], 1, 1, SEG, 3);
        let mut call = Call::new(Collective::AllReduce, Some(ReduceOp::Sum), count, 0, false);
        call.dtype = dspark::DataType::F32;
        comm.run_staged(call, &mut d)
    } else {
        let mut b = vec![1.0f32; count];
        comm.all_reduce(&mut b, ReduceOp::Sum)
    };
    let waited = t0.elapsed();
    match res {
        Ok(()) => Err("a call with a short device buffer succeeded".into()),
        Err(_) if waited > Duration::from_secs(10) => {
            Err(format!("the failure took {waited:?} to arrive"))
        }
        Err(e) => {
            say(&format!("FAILED after {waited:?}: {e}"));
            Ok(FAILED_AS_EXPECTED)
        }
    }
}

fn every_type(
    comm: &Communicator,
    on_device: bool,
    op: ReduceOp,
    calls: &mut u64,
) -> Result<(), String> {
    counts::<f32>(comm, on_device, op, calls)?;
    counts::<f64>(comm, on_device, op, calls)?;
    counts::<f16>(comm, on_device, op, calls)?;
    counts::<bf16>(comm, on_device, op, calls)?;
    counts::<i8>(comm, on_device, op, calls)?;
    counts::<u8>(comm, on_device, op, calls)?;
    counts::<i32>(comm, on_device, op, calls)?;
    counts::<u32>(comm, on_device, op, calls)?;
    counts::<i64>(comm, on_device, op, calls)?;
    counts::<u64>(comm, on_device, op, calls)
}

fn counts<T: TestElem>(
    comm: &Communicator,
    on_device: bool,
    op: ReduceOp,
    calls: &mut u64,
) -> Result<(), String> {
    let bound = BOUND / size_of::<T>();
    for count in [1, 2, 7, 13, 1016, 1024, 1025, bound, bound + 1] {
        *calls += 1;
        let seed = *calls ^ 0x5a;
        one::<T>(comm, on_device, op, count, seed)?;
        // Calls through the rings between, now and then: the slots' turns and the sequence
        // numbers stay in step across the two kinds of call.
        if calls.is_multiple_of(7) {
            let n = comm.world_size();
            let mut b = vec![comm.rank() as u32; 9];
            let root = (*calls as usize) % n;
            comm.broadcast(&mut b, root)
                .map_err(|e| format!("broadcast between: {e}"))?;
            common::check("broadcast between", &b, &[root as u32; 9])?;
        }
    }
    Ok(())
}

fn one<T: TestElem>(
    comm: &Communicator,
    on_device: bool,
    op: ReduceOp,
    count: usize,
    seed: u64,
) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let ctx = format!(
        "all_reduce {} {op} count {count} world {n} rank {r} on {}",
        T::DATA_TYPE,
        if on_device { "device" } else { "host" }
    );
    let input = common::inputs::<T>(op, seed, r, count);
    let got: Vec<T> = if on_device {
        let bytes: Vec<u8> = bytemuck::cast_slice(&input).to_vec();
        let slot = SEG << (r % 3);
        let mut d = EmulatedDevice::new(Vec::new(), bytes, 2, 2, slot, seed ^ r as u64);
        let mut call = Call::new(Collective::AllReduce, Some(op), count, 0, false);
        call.dtype = T::DATA_TYPE;
        comm.run_staged(call, &mut d)
            .map_err(|e| format!("{ctx}: {e}"))?;
        d.dst
            .chunks_exact(size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect()
    } else {
        let mut b = input;
        comm.all_reduce(&mut b, op)
            .map_err(|e| format!("{ctx}: {e}"))?;
        b
    };
    common::check(&ctx, &got, &common::reduced::<T>(op, seed, n, count))
}

fn run(world: usize, device_ranks: &str) {
    run_scenario_on(world, "mixed", device_ranks, OK);
}

fn run_scenario_on(world: usize, scenario: &str, device_ranks: &str, want: i32) {
    let seg = SEG.to_string();
    let outs = spawn(
        world,
        scenario,
        &|_| {
            vars(&[
                ("DSPARK_TRANSPORT", "auto"),
                ("DSPARK_CHUNK_BYTES", &seg),
                ("DSPARK_TIMEOUT", "30"),
                ("DEVICE_RANKS", device_ranks),
            ])
        },
        None,
    )
    .wait(Duration::from_secs(240));
    assert_all(
        &outs,
        want,
        &format!("{scenario}: world {world}, device ranks {device_ranks}"),
    );
}

#[test]
fn a_device_rank_and_a_host_rank_run_small_all_reduces_one_shot_together_exact() {
    run(2, "1");
}

#[test]
fn device_ranks_between_host_ranks_and_only_device_ranks_run_small_all_reduces_exact() {
    run(3, "0,2");
    run(2, "0,1");
}

#[test]
fn a_device_rank_that_cannot_run_a_one_shot_call_fails_every_rank_at_once() {
    run_scenario_on(3, "short", "1", FAILED_AS_EXPECTED);
}
