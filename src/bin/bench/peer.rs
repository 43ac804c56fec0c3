//! `--peer-rows NAME`: the peer benchmarks' timing method and row format
//! (../shared/peers/README.md), so dspark's allreduce lines up with theirs.

use std::io::Write;
use std::time::Instant;

use dspark::{Collective, Communicator, ReduceOp};

use crate::sweep::{max_over_ranks, median, sum_over_ranks};
use crate::Args;

/// The peer benchmarks' sizes (../shared/peers/README.md).
pub(crate) const PEER_SIZES: [usize; 7] = [8, 1024, 65536, 1 << 20, 16 << 20, 64 << 20, 256 << 20];

/// The sizes `--peer-rows` times: `--sizes`, else those of the peers' list from `-b` to `-e`
/// (the defaults, 8 B to 256 MiB, take the whole list).
pub(crate) fn sizes(args: &Args) -> Vec<usize> {
    if !args.sizes.is_empty() {
        return args.sizes.clone();
    }
    PEER_SIZES
        .into_iter()
        .filter(|b| (args.min_bytes..=args.max_bytes).contains(b))
        .collect()
}

/// The peer benchmarks' method (../shared/peers/README.md): allreduce f32 sum, rank r's input
/// (r+1)*(i%97+1); per size 2 verified warm-up batches, then S samples (50 up to 64 KiB, 30 at
/// 1 MiB, 20 at 16 MiB, 10 above); a sample = barrier, K back-to-back allreduces
/// (K = clamp(4 MiB / bytes, 1, 50)), time / K, max over ranks; time = median of samples.
pub(crate) fn peer_rows(args: &Args, comm: &Communicator, peer: &str) -> Result<(), String> {
    let n = comm.world_size();
    let r = comm.rank();
    let list = sizes(args);
    let e = |err: dspark::Error| err.to_string();
    if r == 0 {
        // What the model believed (the rows on stdout stay the peers' format).
        eprintln!("# model     : {}", comm.info().cost_model);
        // And what each size runs with (the choice, or what DSPARK_ALGO forces), so a row
        // can be read against the forced algorithms' rows: two runs of one algorithm can
        // differ by more than two algorithms do.
        let runs: Vec<String> = list
            .iter()
            .filter(|&&b| b >= 4)
            .map(|&b| format!("{b}={}", comm.algorithm(Collective::AllReduce, b).name()))
            .collect();
        eprintln!("# algorithm : {}", runs.join(" "));
    }
    for &bytes in &list {
        // As the peers: a size under one element is no row (it divided by zero here).
        let count = bytes / 4;
        if count == 0 {
            continue;
        }
        let fill = |buf: &mut Vec<f32>| {
            for (i, x) in buf.iter_mut().enumerate() {
                *x = ((r + 1) * (i % 97 + 1)) as f32;
            }
        };
        let mut buf = vec![0f32; count];
        let scale = (n * (n + 1) / 2) as f32;
        for _ in 0..2 {
            fill(&mut buf);
            comm.all_reduce(&mut buf, ReduceOp::Sum).map_err(e)?;
            let bad = buf
                .iter()
                .enumerate()
                .filter(|(i, &v)| v != scale * (i % 97 + 1) as f32)
                .count();
            let bad = sum_over_ranks(comm, bad as u64).map_err(e)?;
            if bad > 0 {
                if r == 0 {
                    println!("{peer},{n},{bytes},0,0,0,0,0,0,0,WRONG");
                }
                return Err(format!("{bad} wrong elements at {bytes} bytes"));
            }
        }
        let samples = if bytes <= 65536 {
            50
        } else if bytes <= 1 << 20 {
            30
        } else if bytes <= 16 << 20 {
            20
        } else {
            10
        };
        let k = ((4 << 20) / bytes).clamp(1, 50);
        let mut times = Vec::with_capacity(samples);
        for _ in 0..samples {
            comm.barrier().map_err(e)?;
            let t0 = Instant::now();
            for _ in 0..k {
                comm.all_reduce(&mut buf, ReduceOp::Sum).map_err(e)?;
            }
            let t = t0.elapsed().as_secs_f64() * 1e6 / k as f64;
            times.push(max_over_ranks(comm, t).map_err(e)?);
        }
        times.sort_by(f64::total_cmp);
        let med = median(&times);
        let algbw = bytes as f64 / med / 1e3;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        if r == 0 {
            println!(
                "{peer},{n},{bytes},{samples},{k},{med:.2},{:.2},{:.2},{algbw:.4},{busbw:.4}",
                times[0],
                times[samples - 1]
            );
            let _ = std::io::stdout().flush();
        }
    }
    Ok(())
}
