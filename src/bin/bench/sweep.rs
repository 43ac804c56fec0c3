//! The per-size timing loop (nccl-tests' method: check on fresh inputs, warm up, time `-n`
//! calls — by default as many as fill 10 ms — after a barrier; the calls in 5 windows, the
//! row's time the median window's mean per call, the slowest rank's), and the sweeps it runs:
//! once, with every algorithm (`--algo all`), or on both data paths (`--compare-paths`).

use std::io::{IsTerminal, Write};
use std::time::Instant;

use dspark::internals::plan::{Algorithm, Collective};
use dspark::path::PathPolicy;
use dspark::types::human_bytes;
use dspark::Communicator;

use crate::data::{prepare, verify, BenchElem};
use crate::header::{distance, gather_sharing, header, path_view};
use crate::runner::{Gpu, Runner};
use crate::sizes::{counts, engine_bytes, sizes};
use crate::summary::{footer, unsteady_lines, ThrottleWatch};
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
    let n = comm.world_size();
    let before = comm.forced_algorithm();
    let watch = ThrottleWatch::start();
    let mut runs: Vec<(Algorithm, Vec<Row>)> = Vec::new();
    // Per swept algorithm and size, the algorithm that ran (itself, or another it runs as
    // there), read while it was forced.
    let mut ran_as: Vec<Vec<Algorithm>> = Vec::new();
    let mut not_here = Vec::new();
    for &a in Algorithm::ALL.iter().filter(|a| a.supports(c)) {
        // Every rank switches together: the same list in the same order.
        comm.set_algorithm(Some(a)).map_err(|e| e.to_string())?;
        // Forced, an algorithm can still run as another (the hierarchical all_reduce as the
        // ring where hosts differ in size or interleave; one_shot with 3 ranks or more beyond
        // the shared slots): a column under its name would be the other's again. Swept when
        // it runs as itself at some size (the table marks the sizes it does not); every rank
        // computes the same (the layout is the job's).
        let ran: Vec<Algorithm> = sizes(args)
            .into_iter()
            .map(|b| comm.algorithm(c, engine_bytes(args.collective, b, T::DATA_TYPE.size(), n)))
            .collect();
        let runs_as = ran
            .iter()
            .copied()
            .find(|&r| r == a)
            .or(ran.last().copied())
            .unwrap_or(a);
        if runs_as != a {
            comm.set_algorithm(before).map_err(|e| e.to_string())?;
            let why = match a {
                Algorithm::Hierarchical => {
                    "; the hierarchical all_reduce needs every host to hold as many ranks, \
                     numbered contiguously"
                }
                Algorithm::OneShot => {
                    "; with 3 ranks or more, one_shot gives every rank the same result only \
                     through shared-memory slots, which no size of this sweep fits"
                }
                _ => "",
            };
            not_here.push(format!(
                "# {a}: runs as {runs_as} on this job's layout (not swept{why})"
            ));
            continue;
        }
        let rows = bench::<T>(args, comm, gpu, false);
        comm.set_algorithm(before).map_err(|e| e.to_string())?;
        runs.push((a, rows?));
        ran_as.push(ran);
    }
    let sharing = gather_sharing(comm);
    let throttled = watch.finish(comm);
    let transport = comm.info().transport;
    if comm.rank() == 0 && args.csv {
        let pv = path_view(args, comm, gpu)?;
        let label = |a: &Algorithm| format!("{}/algo={a}", args.label());
        // Only the sizes each algorithm ran as itself: another's time under its name is not.
        let own: Vec<(Algorithm, Vec<Row>)> = runs
            .iter()
            .zip(&ran_as)
            .map(|((a, rows), ran)| {
                let rows = rows
                    .iter()
                    .zip(ran)
                    .filter(|&(_, r)| r == a)
                    .map(|(row, _)| *row)
                    .collect();
                (*a, rows)
            })
            .collect();
        let rows = own
            .iter()
            .map(|(a, r)| (label(a), pv.column.as_str(), r.as_slice()));
        for l in table::side_csv(args, n, transport, rows) {
            println!("{l}");
        }
        // stdout stays CSV.
        for l in not_here.iter().chain(&throttled) {
            eprintln!("{l}");
        }
    } else if comm.rank() == 0 {
        let pv = path_view(args, comm, gpu)?;
        header(args, comm, T::DATA_TYPE.size(), &pv, &sharing);
        table::print_algorithm_table(args, comm, T::DATA_TYPE.size(), &runs, &ran_as);
        for l in not_here.iter().chain(&throttled) {
            println!("{l}");
        }
    }
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
/// (`-n` unset): long enough that one interruption of the machine (a vCPU taken away for
/// 50–130 µs, seen here) moves a window's mean by a few percent; longer ones land in one of
/// the [`WINDOWS`] windows ([`window_calls`]).
///
/// 10 ms, not the 2 ms it was: a VM's slow stretches last milliseconds (a host's other
/// work on the vCPU's core), so the five windows of a 2 ms row could all fall in one. Forty
/// fresh 2-rank runs at 64 KiB over shm read 6.54–8.97 µs (slowest ÷ median 1.23) with 2 ms,
/// thirty others with ~10 ms 6.97–7.65 (1.04); one process's rows of that one size spread
/// as fresh runs did (6.7–8.0 µs with 2 ms, one first row 10.5), so the spread was the
/// measurement's, not the state a fresh process starts in; the new default's sets of twelve
/// fresh runs read 1.06–1.13 (`benches/RESULTS.md`, "Issue 25, stop 42"). A sweep of 8 B–256
/// MiB takes some 0.1 s longer.
pub(crate) const MIN_ITERS: usize = 20;
pub(crate) const MIN_TIMED_US: f64 = 10_000.0;
const MAX_ITERS: usize = 100_000;

/// Timed iterations for calls that took `per_call_us` each in the warm-up (0: unknown).
fn auto_iters(per_call_us: f64) -> usize {
    if per_call_us.is_finite() && per_call_us > 0.0 {
        ((MIN_TIMED_US / per_call_us).ceil() as usize).clamp(MIN_ITERS, MAX_ITERS)
    } else {
        MIN_ITERS
    }
}

/// How many windows the timed calls of a size are split into ([`window_calls`]).
pub(crate) const WINDOWS: usize = 5;

/// A window's mean beyond this many times the median window's marks the size unsteady (the
/// footer names it). Windows of 0.4 ms (rows of 2 ms, before stop 42), on this VM with nothing
/// else running, differed by up to ~1.3x from the 50–200 µs interruptions it has several
/// times a second per core; the 2 ms windows of today's default differ less.
pub(crate) const UNSTEADY: f64 = 1.5;

/// The timed calls of a size in [`WINDOWS`] windows (fewer when there are fewer calls), as
/// even as whole calls allow: a core taken away from a rank for a few milliseconds (seen on
/// this 2-core VM with nothing else running: `benches/RESULTS.md`, "stop 30") then lands
/// in one window and moves the median window by nothing, where it moved a row's mean by up
/// to 4x; the footer names such a size instead.
pub(crate) fn window_calls(iters: usize) -> Vec<usize> {
    let iters = iters.max(1);
    let w = WINDOWS.min(iters);
    (0..w)
        .map(|i| iters / w + usize::from(i < iters % w))
        .collect()
}

/// One size's windows: the median window's mean per call (the row's time), the slowest
/// window's, and the mean over every timed call (nccl-tests' time).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Windows {
    pub(crate) median_us: f64,
    pub(crate) slowest_us: f64,
    pub(crate) mean_us: f64,
}

impl Windows {
    /// From each window's mean per call (`us`, the slowest rank's) and its calls.
    pub(crate) fn of(us: &[f64], calls: &[usize]) -> Windows {
        let total: usize = calls.iter().sum();
        let mean_us = if total == 0 {
            0.0
        } else {
            us.iter()
                .zip(calls)
                .map(|(t, &k)| t * k as f64)
                .sum::<f64>()
                / total as f64
        };
        Windows {
            median_us: median(us),
            slowest_us: us.iter().copied().fold(0.0, f64::max),
            mean_us,
        }
    }

    /// Whether the slowest window took more than [`UNSTEADY`] times the median one.
    pub(crate) fn unsteady(&self) -> bool {
        self.slowest_us > UNSTEADY * self.median_us
    }
}

/// The median of `v` (the mean of the middle two for an even count; 0 for none).
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Element by element, the largest of every rank's `v` (all ranks pass as many).
pub(crate) fn max_over_ranks_each(comm: &Communicator, v: &[f64]) -> dspark::Result<Vec<f64>> {
    let mut all = vec![0.0f64; v.len() * comm.world_size()];
    comm.all_gather(v, &mut all)?;
    Ok((0..v.len())
        .map(|i| {
            all.iter()
                .skip(i)
                .step_by(v.len().max(1))
                .fold(f64::MIN, |a, &b| a.max(b))
        })
        .collect())
}

/// The largest of every rank's `v` (the time of a step is its slowest rank's).
pub(crate) fn max_over_ranks(comm: &Communicator, v: f64) -> dspark::Result<f64> {
    Ok(max_over_ranks_each(comm, &[v])?[0])
}

/// The sum of every rank's `v`.
pub(crate) fn sum_over_ranks(comm: &Communicator, v: u64) -> dspark::Result<u64> {
    let mut all = vec![0u64; comm.world_size()];
    comm.all_gather(&[v], &mut all)?;
    Ok(all.iter().sum())
}

/// The sweep: per size, check once on fresh inputs, warm up, then time `-n` calls (by default
/// as many as fill 10 ms) after a barrier, in windows (the median window's mean per call, the
/// slowest rank's); rank 0 prints the header and each row as it comes when
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
    // Collective: `print` is the same on every rank (whatever flags they were given).
    let sharing = if print {
        gather_sharing(comm)
    } else {
        Vec::new()
    };
    if rank0 {
        if args.csv {
            println!("{}", table::CSV_HEADER);
            // The one header fact a script cannot get afterwards, on stderr (stdout stays CSV).
            if let Some(d) = distance() {
                eprintln!("# distance  : {d}");
            }
        } else {
            header(args, comm, esz, &pv, &sharing);
        }
    }
    // How long a CPU quota holds the ranks back over the sizes' runs (the footer's; the
    // sweeps of `--algo all` and `--compare-paths` watch theirs whole).
    let watch = print.then(ThrottleWatch::start);
    let mut rows = Vec::new();
    let mut unsteady = Vec::new();
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
        // The timed calls in windows, back to back (one barrier before the first): each
        // window's mean per call, the slowest rank's; the row's time is the median window's.
        let calls = window_calls(iters);
        let mut mine = Vec::with_capacity(calls.len());
        comm.barrier().map_err(|x| e("barrier", x))?;
        for &k in &calls {
            let t0 = Instant::now();
            for _ in 0..k {
                run.run(args, comm).map_err(|x| e("timed run", x))?;
            }
            mine.push(t0.elapsed().as_secs_f64() * 1e6 / k as f64);
        }
        drop(run);
        let windows = max_over_ranks_each(comm, &mine).map_err(|x| e("timing", x))?;
        let w = Windows::of(&windows, &calls);
        let time_us = w.median_us;
        if w.unsteady() {
            unsteady.push((shown_bytes, w));
        }
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
    // Collective, as `watch`: the same on every rank.
    let throttled = watch.map(|w| w.finish(comm));
    if rank0 && !args.csv {
        footer(&rows, coll.bus_factor(n), &unsteady);
    } else if comm.rank() == 0 && !unsteady.is_empty() {
        // `--csv` (stdout stays CSV) and the sweeps of `--algo all` and `--compare-paths`
        // (no footer of their own): the unsteady sizes on stderr, naming the sweep.
        let algo = comm
            .forced_algorithm()
            .map_or("the default algorithms".to_string(), |a| a.to_string());
        eprintln!("# sweep with {algo}, data path {}:", comm.data_path());
        for l in unsteady_lines(&unsteady) {
            eprintln!("{l}");
        }
    }
    if let (true, Some(lines)) = (rank0, &throttled) {
        // Under `--csv` on stderr: stdout stays CSV.
        for l in lines {
            if args.csv {
                eprintln!("{l}");
            } else {
                println!("{l}");
            }
        }
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
    let watch = ThrottleWatch::start();
    let mut results: Vec<(PathPolicy, Result<Vec<Row>, String>)> = Vec::new();
    // Per policy, the data path its calls took (the path column of `--csv`: which GPUDirect
    // mechanism, not the policy asked for).
    let mut columns: Vec<String> = Vec::new();
    for policy in [PathPolicy::GpuDirect, PathPolicy::HostStaged] {
        // Whether this path can be had is decided the same way init decides it.
        let before = comm.data_path();
        let (res, column) = match comm.set_data_path(policy) {
            Err(e) => (Err(e.to_string()), policy.to_string()),
            Ok(()) => {
                let column = path_view(args, comm, gpu).map_or(policy.to_string(), |v| v.column);
                (bench::<T>(args, comm, gpu, false), column)
            }
        };
        columns.push(column);
        // Every rank switches together (the same decision from the same facts).
        let _ = comm.set_data_path(before);
        results.push((policy, res));
    }
    let sharing = gather_sharing(comm);
    let throttled = watch.finish(comm);
    if rank0 && args.csv {
        let rows = results.iter().zip(&columns).filter_map(|((_, r), name)| {
            r.as_ref()
                .ok()
                .map(|r| (args.label(), name.as_str(), r.as_slice()))
        });
        for l in table::side_csv(args, n, comm.info().transport, rows) {
            println!("{l}");
        }
        // stdout stays CSV.
        for (policy, res) in &results {
            if let Err(e) = res {
                eprintln!("# {policy}: UNAVAILABLE — {e}");
            }
        }
        for l in &throttled {
            eprintln!("{l}");
        }
    } else if rank0 {
        let pv = path_view(args, comm, gpu)?;
        header(args, comm, T::DATA_TYPE.size(), &pv, &sharing);
        for l in table::path_table(factor, &results) {
            println!("{l}");
        }
        for l in &throttled {
            println!("{l}");
        }
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
    fn timed_calls_split_into_five_even_windows_or_one_per_call() {
        assert_eq!(window_calls(250), vec![50; 5]);
        assert_eq!(window_calls(22), vec![5, 5, 4, 4, 4]);
        assert_eq!(window_calls(3), vec![1, 1, 1]);
        assert_eq!(window_calls(0), vec![1], "at least one call");
        for n in [1, 7, 20, 101, 99_999] {
            assert_eq!(window_calls(n).iter().sum::<usize>(), n);
        }
    }

    #[test]
    fn the_median_of_odd_even_and_no_values() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn one_stalled_window_leaves_the_median_and_is_reported() {
        // Four windows of 50 calls at ~7 µs, one with a 5 ms stall in it (+100 µs a call).
        let w = Windows::of(&[7.0, 7.2, 107.1, 6.9, 7.1], &[50; 5]);
        assert_eq!(w.median_us, 7.1);
        assert_eq!(w.slowest_us, 107.1);
        assert!((w.mean_us - 27.06).abs() < 1e-9, "{}", w.mean_us);
        assert!(w.unsteady());
        let even = Windows::of(&[8.0, 9.0, 8.5, 8.2], &[3, 3, 2, 2]);
        assert_eq!(even.median_us, 8.35);
        assert!(!even.unsteady(), "9.0 is within 1.5x of 8.35");
        assert!(Windows::of(&[8.0, 12.1, 8.0], &[1; 3]).unsteady());
        assert!((even.mean_us - 8.44).abs() < 1e-9, "{}", even.mean_us);
    }

    #[test]
    fn the_default_count_fills_ten_ms_between_20_and_100_000_calls() {
        assert_eq!(auto_iters(0.25), 40_000);
        assert_eq!(auto_iters(8.0), 1250);
        assert_eq!(auto_iters(150.0), 67);
        assert_eq!(auto_iters(600.0), 20, "at least 20");
        assert_eq!(auto_iters(0.001), 100_000, "at most 100 000");
        assert_eq!(auto_iters(0.0), 20, "no warm-up");
        assert_eq!(auto_iters(f64::NAN), 20);
    }
}
