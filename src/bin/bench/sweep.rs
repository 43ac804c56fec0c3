//! The per-size timing loop (nccl-tests' method: check on fresh inputs, warm up, time `-n`
//! calls — by default as many as fill 2 ms — after a barrier, the slowest rank's mean), and the sweeps it runs: once, with every
//! algorithm (`--algo all`), or on both data paths (`--compare-paths`).

use std::io::{IsTerminal, Write};
use std::time::Instant;

use dspark::internals::plan::{Algorithm, Collective};
use dspark::path::PathPolicy;
use dspark::types::human_bytes;
use dspark::Communicator;

use crate::data::{prepare, verify, BenchElem};
use crate::header::{header, path_view};
use crate::runner::{Gpu, Runner};
use crate::sizes::{counts, sizes};
use crate::summary::footer;
use crate::table::{self, Row};
use crate::Args;

/// The algorithms that implement `c`.
pub(crate) fn algorithms_of(c: Collective) -> Vec<&'static str> {
    Algorithm::ALL
        .iter()
        .filter(|a| a.supports(c))
        .map(|a| a.name())
        .collect()
}

/// `--algo all`: the same sweep with every algorithm that implements the collective, side by
/// side, with the fastest per size.
pub(crate) fn compare_algorithms<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    gpu: Option<&Gpu>,
) -> Result<Vec<(String, Vec<Row>)>, String> {
    let c = args.collective.collective();
    let before = comm.forced_algorithm();
    let mut runs: Vec<(Algorithm, Vec<Row>)> = Vec::new();
    for &a in Algorithm::ALL.iter().filter(|a| a.supports(c)) {
        // Every rank switches together: the same list in the same order.
        comm.set_algorithm(Some(a)).map_err(|e| e.to_string())?;
        let rows = bench::<T>(args, comm, gpu, false);
        comm.set_algorithm(before).map_err(|e| e.to_string())?;
        runs.push((a, rows?));
    }
    if comm.rank() == 0 {
        let pv = path_view(args, comm, gpu)?;
        header(args, comm, T::DATA_TYPE.size(), &pv);
        table::print_algorithm_table(args, comm, T::DATA_TYPE.size(), &runs);
    }
    let transport = comm.info().transport;
    Ok(runs
        .into_iter()
        .map(|(a, rows)| (format!("dspark {transport} {a}"), rows))
        .collect())
}

/// The algorithm the choice by size (nothing forced) picks for `bytes` of `c`.
pub(crate) fn default_algorithm(comm: &Communicator, c: Collective, bytes: usize) -> &'static str {
    comm.default_algorithm(c, bytes).name()
}

// The bench's own bookkeeping goes through all_gather, which has one algorithm: an algorithm
// forced for the timed collective (`--algo chain`) then never applies to it, nor warns.

/// The fewest timed iterations per size, and how long the default count fills at least
/// (`-n` unset): a window long enough that one interruption of the machine (a vCPU taken
/// away for 50–130 µs, seen here) moves the mean by a few percent, not by 2x.
pub(crate) const MIN_ITERS: usize = 20;
pub(crate) const MIN_TIMED_US: f64 = 2000.0;
const MAX_ITERS: usize = 100_000;

/// Timed iterations for calls that took `per_call_us` each in the warm-up (0: unknown).
fn auto_iters(per_call_us: f64) -> usize {
    if per_call_us.is_finite() && per_call_us > 0.0 {
        ((MIN_TIMED_US / per_call_us).ceil() as usize).clamp(MIN_ITERS, MAX_ITERS)
    } else {
        MIN_ITERS
    }
}

/// The largest of every rank's `v` (the time of a step is its slowest rank's).
pub(crate) fn max_over_ranks(comm: &Communicator, v: f64) -> dspark::Result<f64> {
    let mut all = vec![0.0f64; comm.world_size()];
    comm.all_gather(&[v], &mut all)?;
    Ok(all.into_iter().fold(f64::MIN, f64::max))
}

/// The sum of every rank's `v`.
pub(crate) fn sum_over_ranks(comm: &Communicator, v: u64) -> dspark::Result<u64> {
    let mut all = vec![0u64; comm.world_size()];
    comm.all_gather(&[v], &mut all)?;
    Ok(all.iter().sum())
}

/// The sweep: per size, check once on fresh inputs, warm up, then time `-n` calls (by default
/// as many as fill 2 ms) after a barrier (the slowest rank's mean); rank 0 prints the header and each row as it comes when
/// `print`, and the footer.
pub(crate) fn bench<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    gpu: Option<&Gpu>,
    print: bool,
) -> Result<Vec<Row>, String> {
    let n = comm.world_size();
    let esz = T::DATA_TYPE.size();
    let coll = args.collective;
    let rank0 = comm.rank() == 0 && print;
    let list = sizes(args);
    let tty = std::io::stderr().is_terminal();
    let pv = path_view(args, comm, gpu)?;
    if rank0 {
        if args.csv {
            println!("{}", table::CSV_HEADER);
        } else {
            header(args, comm, esz, &pv);
        }
    }
    let mut rows = Vec::new();
    let e = |what: &str, err: dspark::Error| format!("{what}: {err}");
    for (k, &bytes) in list.iter().enumerate() {
        let (send, recv, total) = counts(coll, bytes, esz, n);
        let shown_bytes = total * esz;
        if comm.rank() == 0 && (tty || bytes >= 64 << 20) {
            eprint!(
                "{}[{}/{}] {} ...{}",
                if tty { "\r" } else { "" },
                k + 1,
                list.len(),
                human_bytes(bytes as u64, false),
                if tty { "" } else { "\n" }
            );
            let _ = std::io::stderr().flush();
        }
        // Check first, on fresh inputs.
        let mut wrong = 0;
        if args.check != 0 {
            let mut run = Runner::new(args, comm, gpu, prepare::<T>(args, comm, send, recv))?;
            run.run(args, comm).map_err(|x| e("check", x))?;
            wrong = verify(args, comm, send, &run.output()?);
        }
        let mut run = Runner::new(args, comm, gpu, prepare::<T>(args, comm, send, recv))?;
        let mut warm = Vec::with_capacity(args.warmup);
        for _ in 0..args.warmup {
            let tw = Instant::now();
            run.run(args, comm).map_err(|x| e("warm-up", x))?;
            warm.push(tw.elapsed().as_secs_f64() * 1e6);
        }
        let iters = match args.iters {
            Some(n) => n.max(1),
            None => {
                // The median warm-up call (the first is cold), the slowest rank's: every rank
                // must run as many.
                warm.sort_by(f64::total_cmp);
                let pace = warm.get(warm.len() / 2).copied().unwrap_or(0.0);
                let pace = max_over_ranks(comm, pace).map_err(|x| e("warm-up timing", x))?;
                auto_iters(pace)
            }
        };
        comm.barrier().map_err(|x| e("barrier", x))?;
        let t0 = Instant::now();
        for _ in 0..iters {
            run.run(args, comm).map_err(|x| e("timed run", x))?;
        }
        let mine = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
        drop(run);
        let time_us = max_over_ranks(comm, mine).map_err(|x| e("timing", x))?;
        let wrong = if args.check != 0 {
            sum_over_ranks(comm, wrong).map_err(|x| e("check", x))?
        } else {
            0
        };
        let row = Row {
            bytes: shown_bytes,
            count: total,
            time_us,
            wrong,
        };
        if comm.rank() == 0 && tty {
            eprint!("\r\x1b[K");
        }
        if rank0 {
            table::print_row(args, comm, &row, &pv.column);
        }
        rows.push(row);
    }
    if rank0 && !args.csv {
        footer(&rows, coll.bus_factor(n));
    }
    Ok(rows)
}

/// `--compare-paths`: the same sweep on device memory over GPUDirect RDMA and host-staged,
/// side by side, with the ratio — the check that catches a silently staged cluster.
pub(crate) fn compare_paths<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    gpu: Option<&Gpu>,
) -> Result<Vec<(String, Vec<Row>)>, String> {
    let n = comm.world_size();
    let factor = args.collective.bus_factor(n);
    let rank0 = comm.rank() == 0;
    let mut results: Vec<(PathPolicy, Result<Vec<Row>, String>)> = Vec::new();
    for policy in [PathPolicy::GpuDirect, PathPolicy::HostStaged] {
        // Whether this path can be had is decided the same way init decides it.
        let before = comm.data_path();
        let res = match comm.set_data_path(policy) {
            Err(e) => Err(e.to_string()),
            Ok(()) => bench::<T>(args, comm, gpu, false),
        };
        // Every rank switches together (the same decision from the same facts).
        let _ = comm.set_data_path(before);
        results.push((policy, res));
    }
    if rank0 {
        let pv = path_view(args, comm, gpu)?;
        header(args, comm, T::DATA_TYPE.size(), &pv);
        table::print_path_table(factor, &results);
    }
    Ok(results
        .into_iter()
        .filter_map(|(policy, res)| res.ok().map(|rows| (policy.to_string(), rows)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_count_fills_two_ms_between_20_and_100_000_calls() {
        assert_eq!(auto_iters(0.25), 8000);
        assert_eq!(auto_iters(8.0), 250);
        assert_eq!(auto_iters(150.0), 20, "at least 20");
        assert_eq!(auto_iters(0.001), 100_000, "at most 100 000");
        assert_eq!(auto_iters(0.0), 20, "no warm-up");
        assert_eq!(auto_iters(f64::NAN), 20);
    }
}
