//! What follows the table: the nccl-tests footer (wrong values, average bus bandwidth) and the
//! `--plot` SVG of this run's curves beside the peers'.

use std::time::Instant;

use dspark::internals::cpus::{Held, Throttled};
use dspark::Communicator;

use dspark::types::human_bytes;

use crate::sweep::Windows;
use crate::table::{bandwidths, Row};
use crate::{plot, Args};

/// `--plot`: this run's curves, and the peers' from `--plot-peers`, into an SVG.
pub(crate) fn write_plot(
    args: &Args,
    comm: &Communicator,
    file: &std::path::Path,
    runs: &[(String, Vec<Row>)],
) -> Result<(), String> {
    let n = comm.world_size();
    let factor = args.collective.bus_factor(n);
    let mut series: Vec<plot::Series> = runs
        .iter()
        .map(|(label, rows)| plot::Series {
            label: label.clone(),
            // A wrong result's time is no bandwidth.
            points: rows
                .iter()
                .filter(|r| r.wrong == 0)
                .map(|r| (r.bytes as f64, bandwidths(r, factor).1))
                .collect(),
        })
        .collect();
    if let Some(csv) = &args.plot_peers {
        let text = std::fs::read_to_string(csv)
            .map_err(|e| format!("--plot-peers {}: {e}", csv.display()))?;
        series.extend(
            plot::read_csv(&text, n).map_err(|e| format!("--plot-peers {}: {e}", csv.display()))?,
        );
    }
    let op = if args.collective.reduces() {
        format!(" {}", args.op.name())
    } else {
        String::new()
    };
    let title = format!(
        "{} {}{op}, {n} ranks, {} — bus bandwidth",
        args.label(),
        args.dtype.name(),
        comm.info().transport
    );
    std::fs::write(file, plot::svg(&title, &series))
        .map_err(|e| format!("--plot {}: {e}", file.display()))?;
    eprintln!("# plot: {} ({} curves)", file.display(), series.len());
    Ok(())
}

/// nccl-tests' footer: the wrong values over the sweep and the average bus bandwidth; then
/// the sizes whose windows disagreed ([`unsteady_lines`]).
pub(crate) fn footer(rows: &[Row], factor: f64, unsteady: &[(usize, Windows)]) {
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    let avg_bus = if rows.is_empty() {
        0.0
    } else {
        rows.iter().map(|r| bandwidths(r, factor).1).sum::<f64>() / rows.len() as f64
    };
    println!(
        "# Out of bounds values : {} {}",
        wrong,
        if wrong == 0 { "OK" } else { "FAILED" }
    );
    println!("# Avg bus bandwidth    : {avg_bus:.4} GB/s");
    for l in unsteady_lines(unsteady) {
        println!("{l}");
    }
}

/// What a CPU quota does to a run ([`ThrottleWatch::finish`] gathers it and words it).
pub(crate) struct ThrottleWatch {
    since: Throttled,
    t0: Instant,
}

impl ThrottleWatch {
    /// Takes this rank's snapshot before the runs.
    pub(crate) fn start() -> ThrottleWatch {
        ThrottleWatch {
            since: Throttled::now(),
            t0: Instant::now(),
        }
    }

    /// The footer's lines ([`throttle_lines`]) from every rank's [`Held`] since
    /// [`ThrottleWatch::start`], gathered to every rank. Collective: every rank calls it at
    /// the same point. Where the gather fails (a communicator a failed run poisoned), this
    /// rank's alone, saying so.
    pub(crate) fn finish(self, comm: &Communicator) -> Vec<String> {
        const NO_QUOTA: u64 = u64::MAX;
        const UNKNOWN: u64 = u64::MAX - 1;
        let wall = self.t0.elapsed().as_secs_f64();
        let mine = match Throttled::now().since(&self.since) {
            Held::NoQuota => NO_QUOTA,
            Held::Unknown => UNKNOWN,
            Held::Us(us) => us.min(UNKNOWN - 1),
        };
        let decode = |t: u64| match t {
            NO_QUOTA => Held::NoQuota,
            UNKNOWN => Held::Unknown,
            us => Held::Us(us),
        };
        let mut all = vec![0u64; comm.world_size()];
        match comm.all_gather(&[mine], &mut all) {
            Ok(()) => throttle_lines(&all.into_iter().map(decode).collect::<Vec<_>>(), wall),
            Err(e) => {
                let mut lines = throttle_lines(&[decode(mine)], wall);
                // Only rank 0 prints: its own, named as rank 0 above.
                lines.push(format!(
                    "#   (rank 0's alone: the other ranks' were not gathered: {e})"
                ));
                lines
            }
        }
    }
}

/// The footer's line on CPU quotas, where any rank runs under one (`held`: each rank's over
/// a run of `wall_s` seconds, [`ThrottleWatch::finish`]): how long the kernel held them
/// stopped, which the median windows do not show. Nothing where no rank has a quota.
pub(crate) fn throttle_lines(held: &[Held], wall_s: f64) -> Vec<String> {
    let under: Vec<usize> = (0..held.len())
        .filter(|&r| held[r] != Held::NoQuota)
        .collect();
    if under.is_empty() {
        return Vec::new();
    }
    let ranks = format!(
        "{} {} under a cgroup CPU quota",
        if under.len() == 1 { "rank" } else { "ranks" },
        dspark::internals::cpus::format_list(&under)
    );
    let most = held
        .iter()
        .filter_map(|h| match h {
            Held::Us(us) => Some(*us),
            _ => None,
        })
        .max();
    match most {
        None => vec![format!(
            "# Throttled            : unknown ({ranks}; its cpu.stat could not be read)"
        )],
        Some(0) => vec![format!(
            "# Throttled            : no ({ranks}, none held back during the {wall_s:.1} s of \
             the runs)"
        )],
        Some(us) => vec![
            format!(
                "# Throttled            : {:.1} ms (the most any rank's cgroup shows; {ranks}) \
                 during the {wall_s:.1} s of the runs",
                us as f64 / 1000.0
            ),
            "#   the kernel stopped the ranks once their cgroup had spent its quota for the \
             period (cpu.stat throttled time, summed over its CPUs): the median windows hide \
             it, the wall time does not. The header's ranks line says how many ranks share the \
             quota"
                .into(),
        ],
    }
}

/// The footer's lines for the sizes whose slowest window took more than
/// [`crate::sweep::UNSTEADY`] times the median one: what the row says, what the slowest window
/// and the mean of every call were, and what usually does it. Nothing when every size was
/// steady.
pub(crate) fn unsteady_lines(unsteady: &[(usize, Windows)]) -> Vec<String> {
    let x = crate::sweep::UNSTEADY;
    if unsteady.is_empty() {
        return vec![format!(
            "# Steady               : every size's windows within {x}x of its median window"
        )];
    }
    let mut out = vec![format!(
        "# Unsteady sizes       : {} (a window over {x}x the median window; the row shows the median)",
        unsteady.len()
    )];
    for (bytes, w) in unsteady {
        out.push(format!(
            "#   {:>10}: median window {:.2} us, slowest {:.2} us ({}), mean of all calls {:.2} us (each window's slowest rank)",
            human_bytes(*bytes as u64, false),
            w.median_us,
            w.slowest_us,
            if w.median_us > 0.0 {
                format!("{:.1}x", w.slowest_us / w.median_us)
            } else {
                "-".into()
            },
            w.mean_us
        ));
    }
    out.push(
        "#   a slow window: a rank off its core for a while (another process, the hypervisor, more \
         ranks than free cores) or a stall in dspark; `dspark doctor` (CPU steadiness) measures the first, DSPARK_TRACE=<prefix> shows the second"
            .into(),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_footer_says_how_long_a_cpu_quota_held_the_ranks() {
        use Held::{NoQuota, Unknown, Us};
        assert!(throttle_lines(&[NoQuota, NoQuota], 2.0).is_empty());
        assert_eq!(
            throttle_lines(&[Us(0), NoQuota, Us(0)], 2.04),
            vec![
                "# Throttled            : no (ranks 0,2 under a cgroup CPU quota, none held \
                 back during the 2.0 s of the runs)"
            ]
        );
        assert_eq!(
            throttle_lines(&[Unknown, NoQuota], 1.0),
            vec![
                "# Throttled            : unknown (rank 0 under a cgroup CPU quota; its \
                 cpu.stat could not be read)"
            ]
        );
        let l = throttle_lines(&[Us(1200), Us(312_400), Unknown, NoQuota], 1.94);
        assert_eq!(l.len(), 2, "{l:?}");
        assert_eq!(
            l[0],
            "# Throttled            : 312.4 ms (the most any rank's cgroup shows; ranks 0-2 \
             under a cgroup CPU quota) during the 1.9 s of the runs"
        );
        assert!(l[1].contains("median windows hide it"), "{}", l[1]);
    }

    #[test]
    fn the_footer_names_each_unsteady_size_with_its_windows() {
        assert_eq!(
            unsteady_lines(&[]),
            vec!["# Steady               : every size's windows within 1.5x of its median window"]
        );
        let w = Windows::of(&[7.0, 7.2, 107.1, 6.9, 7.1], &[50; 5]);
        let l = unsteady_lines(&[(65536, w)]);
        assert_eq!(l.len(), 3, "{l:?}");
        assert!(l[0].contains(": 1 (a window over 1.5x"), "{}", l[0]);
        assert_eq!(
            l[1],
            "#       64 KiB: median window 7.10 us, slowest 107.10 us (15.1x), mean of all calls 27.06 us (each window's slowest rank)"
        );
        assert!(l[2].contains("DSPARK_TRACE"), "{}", l[2]);
    }
}
