//! Overlap: compute on the caller's thread while non-blocking allreduces of gradient buckets
//! run, as a training framework overlaps the allreduce of bucket k with the backward pass
//! that produces bucket k + 1. Prints the time of the compute alone, of the communication
//! alone, and of both overlapped, with the ratio to their sum.
//!
//! ```text
//! cargo run --release --example overlap                  # 2 local ranks, 4 × 16 MiB buckets
//! cargo run --release --example overlap -- 8 4           # 8 buckets of 4 MiB
//! cargo run --release --example overlap -- 4 16 gpu      # "compute" waits as for a GPU
//! ```
//!
//! With `cpu` (the default) the compute is arithmetic on the caller's thread. Over TCP the
//! communication needs CPU time too (the kernel copies every byte), so it can only overlap
//! with computation when the machine has a core to spare per rank for it. With `gpu` the
//! caller's thread waits for the time the compute would take, as a training loop waits for
//! its GPU backward pass: the CPU is then free for communication, as on a GPU node.

#[path = "common/local.rs"]
mod local;

use std::hint::black_box;
use std::time::{Duration, Instant};

use dspark::{Communicator, ReduceOp};

/// Where the compute runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Cpu,
    Gpu,
}

/// Stand-in for the backward pass of one layer: arithmetic on a small working set (it
/// stays in cache, so it competes with the communication for CPU time, not for memory
/// bandwidth).
fn compute(iters: u64) -> f64 {
    let mut acc = [1.0f64; 8];
    for i in 0..iters {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = a.mul_add(1.000_000_1, (i as f64 + k as f64) * 1e-12);
        }
    }
    black_box(acc.iter().sum())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() -> dspark::Result<()> {
    if !local::as_rank() {
        return Ok(());
    }
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let kind = if std::env::args().any(|a| a == "gpu") {
        Kind::Gpu
    } else {
        Kind::Cpu
    };
    let buckets = args.first().copied().unwrap_or(4);
    let mib = args.get(1).copied().unwrap_or(16);
    let comm = Communicator::from_env()?;
    let mut grads: Vec<Vec<f32>> = (0..buckets).map(|_| vec![1.0; mib << 18]).collect();

    // Communication alone (blocking allreduces of every bucket).
    let comm_alone = |grads: &mut Vec<Vec<f32>>| -> dspark::Result<Duration> {
        comm.barrier()?;
        let t = Instant::now();
        for g in grads.iter_mut() {
            comm.all_reduce(g, ReduceOp::Avg)?;
        }
        Ok(t.elapsed())
    };
    let t_comm = median(
        (0..3)
            .map(|_| comm_alone(&mut grads))
            .collect::<dspark::Result<_>>()?,
    );
    // Calibrate one bucket's compute to take about as long as one bucket's allreduce.
    let per_bucket = t_comm / buckets as u32;
    let mut iters = 100_000u64;
    while kind == Kind::Cpu && iters > 0 {
        let t = Instant::now();
        compute(iters);
        let took = t.elapsed();
        if took >= per_bucket / 2 || iters > 1 << 34 {
            iters = (iters as f64 * per_bucket.as_secs_f64() / took.as_secs_f64()) as u64;
            break;
        }
        iters *= 2;
    }
    // Every rank computes the same amount.
    let mut it = [iters];
    comm.all_reduce(&mut it, ReduceOp::Max)?;
    let iters = it[0];

    let work = || match kind {
        Kind::Cpu => {
            compute(iters);
        }
        Kind::Gpu => std::thread::sleep(per_bucket),
    };
    let compute_alone = || {
        let t = Instant::now();
        for _ in 0..buckets {
            work();
        }
        t.elapsed()
    };
    let t_compute = median((0..3).map(|_| compute_alone()).collect());

    // Overlapped: bucket k's allreduce runs while bucket k + 1 is "computed".
    let overlapped = |grads: &mut Vec<Vec<f32>>| -> dspark::Result<Duration> {
        comm.barrier()?;
        let t = Instant::now();
        comm.scope(|s| -> dspark::Result<()> {
            let mut works = Vec::with_capacity(buckets);
            for g in grads.iter_mut() {
                work(); // produces bucket k ...
                works.push(s.all_reduce(g, ReduceOp::Avg)?); // ... whose allreduce starts now
            }
            works.into_iter().try_for_each(|w| w.wait())
        })?;
        Ok(t.elapsed())
    };
    let t_both = median(
        (0..3)
            .map(|_| overlapped(&mut grads))
            .collect::<dspark::Result<_>>()?,
    );
    if comm.rank() == 0 {
        let sum = t_compute + t_comm;
        println!(
            "{} ranks, {buckets} buckets of {mib} MiB over {}, {} compute: compute {:.1} ms, \
             allreduce {:.1} ms, sum {:.1} ms; overlapped {:.1} ms = {:.2} of the sum",
            comm.world_size(),
            comm.info().transport,
            if kind == Kind::Cpu { "cpu" } else { "gpu-like" },
            t_compute.as_secs_f64() * 1e3,
            t_comm.as_secs_f64() * 1e3,
            sum.as_secs_f64() * 1e3,
            t_both.as_secs_f64() * 1e3,
            t_both.as_secs_f64() / sum.as_secs_f64()
        );
    }
    Ok(())
}
