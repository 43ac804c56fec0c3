//! The doctor's CPU steadiness: whether this machine leaves a spinning rank on its core. A
//! thread pinned to each CPU this process may use spins on the clock for [`PROBE_MS`], all at
//! once, and counts the gaps (the times its core was taken from it: another process, a kernel
//! thread, the hypervisor running something else on the physical core); `/proc/stat`'s steal
//! time is read around it. A rank that loses its core stalls every collective it is in, for
//! every rank: its peers wait for it. On the 2-core VM this project is developed on, with
//! nothing else running, one core lost 1–8 ms sixteen times in 10 s (`benches/RESULTS.md`,
//! "stop 30"): fresh benchmark runs then differ by more than dspark does.

use std::time::{Duration, Instant};

use dspark::internals::cpus::{Held, Throttled};
use serde::Serialize;

use super::kv;

/// How long every CPU is watched.
pub(super) const PROBE_MS: u64 = 300;
/// A clock gap at least this long counts: the core was taken away.
const GAP_US: f64 = 10.0;
/// A gap this long is a stall of every collective the rank is in.
const LONG_US: f64 = 1000.0;
/// More of a CPU's time lost than this (percent) is reported unsteady (an idle 2-core VM
/// here loses 1–2.3% in 10–200 µs gaps: that is noise, not a verdict).
const LOST_PCT: f64 = 5.0;
/// More steal time than this (percent of all CPU time) is reported, when it is also at
/// least [`STEAL_MIN_JIFFIES`] (one jiffy of 2 CPUs × 300 ms is 1.6%).
const STEAL_PCT: f64 = 2.0;
const STEAL_MIN_JIFFIES: u64 = 3;
/// At most this many CPUs are watched (the first of the allowed set).
const MAX_CPUS: usize = 256;

/// What one CPU's spinning thread saw.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub(super) struct CpuGaps {
    pub(super) cpu: usize,
    /// Gaps of at least 10 µs.
    pub(super) gaps: u64,
    /// Of those, gaps of at least 1 ms.
    pub(super) long_gaps: u64,
    /// Percent of the watched time in gaps.
    pub(super) lost_pct: f64,
    pub(super) longest_us: f64,
    /// Why this CPU could not be watched (pinning refused), if so.
    pub(super) error: Option<String>,
}

impl CpuGaps {
    /// The summary of the clock gaps `gaps_us` (each ≥ [`GAP_US`]) seen over `span_us`.
    pub(super) fn from_gaps(cpu: usize, gaps_us: &[f64], span_us: f64) -> CpuGaps {
        let lost: f64 = gaps_us.iter().sum();
        CpuGaps {
            cpu,
            gaps: gaps_us.len() as u64,
            long_gaps: gaps_us.iter().filter(|&&g| g >= LONG_US).count() as u64,
            lost_pct: if span_us > 0.0 {
                100.0 * lost / span_us
            } else {
                0.0
            },
            longest_us: gaps_us.iter().copied().fold(0.0, f64::max),
            error: None,
        }
    }

    fn unsteady(&self) -> bool {
        self.long_gaps > 0 || self.lost_pct > LOST_PCT
    }
}

/// The section: every CPU's gaps, the steal time and the verdict.
#[derive(Debug, Serialize)]
pub(super) struct CpuSection {
    pub(super) probe_ms: u64,
    pub(super) cpus: Vec<CpuGaps>,
    /// Percent of all CPU time the hypervisor gave to others during the probe (`None`: no
    /// `/proc/stat`).
    pub(super) steal_pct: Option<f64>,
    /// Jiffies of steal during the probe.
    pub(super) steal_jiffies: Option<u64>,
    /// The verdict: `None` where nothing was measured.
    pub(super) steady: Option<bool>,
    pub(super) verdict: String,
    /// The CPUs' worth of time this process's cgroup quota allows (`None`: no quota).
    pub(super) quota_cpus: Option<f64>,
    /// How long the quota held this process's cgroup stopped during the probe, ms (its
    /// `cpu.stat`, summed by the kernel over the CPUs it stopped; `None`: no quota, or its
    /// `cpu.stat` could not be read).
    pub(super) throttled_ms: Option<f64>,
}

/// What a cgroup CPU quota of `cpus` means for `threads` spinning threads (the probe's, or a
/// job's ranks in the cgroup).
pub(super) fn quota_note(cpus: f64, threads: usize) -> String {
    let over = threads as f64 > cpus;
    format!(
        "{} per period for this process's cgroup (cpu.max or cpu.cfs_quota_us): ranks of a \
         job in it that need more are stopped together until the next period once they have \
         spent it{}",
        dspark::internals::cpus::cpus_text(cpus),
        if over {
            format!(
                "; the {threads} watching threads were more than it, so their gaps include that \
                 throttling"
            )
        } else {
            String::new()
        }
    )
}

/// Jiffies (steal, total) from the first line of `/proc/stat`'s text.
pub(super) fn parse_steal(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest, guest_nice are inside user/nice).
    let steal = *v.get(7)?;
    Some((steal, v.iter().take(8).sum()))
}

fn read_steal() -> Option<(u64, u64)> {
    parse_steal(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// Watches one CPU: pins this thread to it and spins on the clock until `until`.
fn watch(cpu: usize, until: Instant) -> CpuGaps {
    if let Err(e) = crate::bind::bind_to(&[cpu]) {
        return CpuGaps {
            cpu,
            error: Some(format!("cannot pin a thread to it: {e}")),
            ..CpuGaps::default()
        };
    }
    let start = Instant::now();
    let mut gaps = Vec::new();
    let mut prev = start;
    while prev < until {
        let now = Instant::now();
        let g = now.duration_since(prev).as_secs_f64() * 1e6;
        if g >= GAP_US {
            gaps.push(g);
        }
        prev = now;
    }
    CpuGaps::from_gaps(cpu, &gaps, prev.duration_since(start).as_secs_f64() * 1e6)
}

/// The section where nothing is measured, saying why.
pub(super) fn not_measured(why: &str) -> CpuSection {
    CpuSection {
        probe_ms: 0,
        cpus: Vec::new(),
        steal_pct: None,
        steal_jiffies: None,
        steady: None,
        verdict: format!("not measured ({why})"),
        quota_cpus: dspark::internals::cpus::quota().map(|q| q.cpus()),
        throttled_ms: None,
    }
}

/// The verdict line from the CPUs and the steal time (percent, jiffies): `None` where no
/// CPU could be watched.
pub(super) fn verdict(
    cpus: &[CpuGaps],
    steal: Option<(f64, u64)>,
    probe_ms: u64,
) -> (Option<bool>, String) {
    let watched: Vec<&CpuGaps> = cpus.iter().filter(|c| c.error.is_none()).collect();
    if watched.is_empty() {
        return (None, "not measured (no CPU could be watched)".into());
    }
    let bad: Vec<&&CpuGaps> = watched.iter().filter(|c| c.unsteady()).collect();
    let steal_pct = steal.map(|(p, _)| p);
    let steal_bad = steal.is_some_and(|(p, j)| p > STEAL_PCT && j >= STEAL_MIN_JIFFIES);
    let worst_lost = watched.iter().map(|c| c.lost_pct).fold(0.0, f64::max);
    let longest = watched.iter().map(|c| c.longest_us).fold(0.0, f64::max);
    if bad.is_empty() && !steal_bad {
        return (
            Some(true),
            format!(
                "steady: no CPU lost for 1 ms or more in {probe_ms} ms, at most {worst_lost:.1}% lost \
                 (longest gap {longest:.0} µs)"
            ),
        );
    }
    let mut why: Vec<String> = bad
        .iter()
        .map(|c| {
            format!(
                "cpu {} lost {:.1}%, longest gap {:.1} ms ({} of 1 ms or more)",
                c.cpu,
                c.lost_pct,
                c.longest_us / 1000.0,
                c.long_gaps
            )
        })
        .collect();
    if let Some(s) = steal_pct.filter(|_| steal_bad) {
        why.push(format!(
            "steal time {s:.1}% (the hypervisor ran something else)"
        ));
    }
    (
        Some(false),
        format!(
            "UNSTEADY in {probe_ms} ms: {}. A rank on such a CPU stalls every collective it is in \
             while it is off its core (its peers wait for it), and repeated benchmark runs differ \
             with it: give each rank a core with nothing else on it (fewer ranks, `--bind core`, \
             isolcpus), or on a VM dedicated vCPUs",
            why.join("; ")
        ),
    )
}

/// The CPUs this process may run on (at most [`MAX_CPUS`], the first of them).
pub(super) fn allowed_cpus() -> Vec<usize> {
    let mut v = crate::bind::allowed();
    v.truncate(MAX_CPUS);
    v
}

/// Watches every CPU of `allowed` at once for [`PROBE_MS`].
pub(super) fn probe_cpus(allowed: &[usize]) -> CpuSection {
    let throttled_before = Throttled::now();
    let before = read_steal();
    let until = Instant::now() + Duration::from_millis(PROBE_MS);
    let failed = |cpu: usize, what: String| CpuGaps {
        cpu,
        error: Some(what),
        ..CpuGaps::default()
    };
    let cpus: Vec<CpuGaps> = std::thread::scope(|s| {
        let handles: Vec<_> = allowed
            .iter()
            .map(|&c| {
                let h = std::thread::Builder::new()
                    .name(format!("watch-cpu{c}"))
                    .spawn_scoped(s, move || watch(c, until));
                (c, h)
            })
            .collect();
        handles
            .into_iter()
            .map(|(c, h)| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| failed(c, "the watching thread failed".into())),
                Err(e) => failed(c, format!("no thread to watch it: {e}")),
            })
            .collect()
    });
    let steal = match (before, read_steal()) {
        (Some((s0, t0)), Some((s1, t1))) if t1 > t0 => {
            let j = s1.saturating_sub(s0);
            Some((100.0 * j as f64 / (t1 - t0) as f64, j))
        }
        _ => None,
    };
    let throttled_ms = match Throttled::now().since(&throttled_before) {
        Held::Us(us) => Some(us as f64 / 1000.0),
        Held::NoQuota | Held::Unknown => None,
    };
    let (steady, mut verdict) = verdict(&cpus, steal, PROBE_MS);
    let quota_cpus = dspark::internals::cpus::quota().map(|q| q.cpus());
    if steady == Some(false) {
        if let Some(q) = quota_cpus {
            verdict += &quota_cause(q, cpus.len(), throttled_ms);
        }
    }
    CpuSection {
        probe_ms: PROBE_MS,
        cpus,
        steal_pct: steal.map(|(p, _)| p),
        steal_jiffies: steal.map(|(_, j)| j),
        steady,
        verdict,
        quota_cpus,
        throttled_ms,
    }
}

/// What an UNSTEADY verdict adds about a quota of `cpus` CPUs over `threads` spinning
/// threads that held the cgroup stopped `throttled_ms` during the probe: the cause where the
/// kernel says it throttled them, the likely cause where they were more than the quota but
/// its count cannot be read, nothing otherwise.
pub(super) fn quota_cause(cpus: f64, threads: usize, throttled_ms: Option<f64>) -> String {
    let quota = dspark::internals::cpus::cpus_text(cpus);
    let advice = "a container's CPU limit below its ranks' count throttles them all; raise it \
                  to the ranks' count or run fewer ranks";
    match throttled_ms {
        Some(ms) if ms > 0.0 => format!(
            ". Here the cause is this cgroup's CPU quota ({quota} for {threads} spinning \
             threads): it held them stopped {ms:.1} ms during the probe (cpu.stat, summed over \
             the CPUs); {advice}"
        ),
        None if threads as f64 > cpus => format!(
            ". Here the likely cause is this cgroup's CPU quota ({quota} for {threads} spinning \
             threads): {advice}"
        ),
        _ => String::new(),
    }
}

/// The human report's "CPU steadiness" section.
pub(super) fn render_cpus(o: &mut String, c: &CpuSection) {
    if c.probe_ms == 0 {
        o.push_str("\nCPU steadiness\n");
    } else {
        o.push_str(&format!(
            "\nCPU steadiness (a thread spinning on each CPU for {} ms)\n",
            c.probe_ms
        ));
    }
    for g in &c.cpus {
        let v = match &g.error {
            Some(e) => format!("not watched: {e}"),
            None => format!(
                "{} gaps of 10 µs or more, {} of 1 ms or more, {:.2}% lost, longest {:.0} µs",
                g.gaps, g.long_gaps, g.lost_pct, g.longest_us
            ),
        };
        kv(o, &format!("cpu {}", g.cpu), v);
    }
    if let Some(s) = c.steal_pct {
        kv(o, "steal time", format!("{s:.2}%"));
    }
    if let Some(q) = c.quota_cpus {
        let held = c.throttled_ms.map_or(String::new(), |ms| {
            format!("; held the cgroup stopped {ms:.1} ms during the probe (cpu.stat)")
        });
        kv(
            o,
            "CPU quota",
            format!("{}{held}", quota_note(q, c.cpus.len())),
        );
    }
    kv(o, "verdict", &c.verdict);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_are_summed_counted_and_the_long_ones_found() {
        let g = CpuGaps::from_gaps(1, &[12.0, 40.0, 1500.0, 8128.0], 300_000.0);
        assert_eq!((g.cpu, g.gaps, g.long_gaps), (1, 4, 2));
        assert!((g.lost_pct - 100.0 * 9680.0 / 300_000.0).abs() < 1e-9);
        assert_eq!(g.longest_us, 8128.0);
        assert!(g.unsteady());
        let quiet = CpuGaps::from_gaps(0, &[12.0, 219.0], 300_000.0);
        assert!(!quiet.unsteady());
        // An idle VM's 2.3% in short gaps is noise; 6% is not.
        assert!(!CpuGaps::from_gaps(0, &[100.0; 69], 300_000.0).unsteady());
        assert!(CpuGaps::from_gaps(0, &[100.0; 180], 300_000.0).unsteady());
        assert_eq!(CpuGaps::from_gaps(0, &[], 0.0).lost_pct, 0.0);
    }

    #[test]
    fn the_verdict_names_the_unsteady_cpus_and_the_steal_time() {
        let quiet = CpuGaps::from_gaps(0, &[12.0, 219.0], 300_000.0);
        let (ok, v) = verdict(std::slice::from_ref(&quiet), Some((0.2, 1)), 300);
        assert_eq!(ok, Some(true), "{v}");
        assert!(v.starts_with("steady: "), "{v}");
        assert!(v.contains("longest gap 219 µs"), "{v}");
        let bad = CpuGaps::from_gaps(1, &[1500.0, 8128.0], 300_000.0);
        let (ok, v) = verdict(&[quiet.clone(), bad], Some((0.2, 1)), 300);
        assert_eq!(ok, Some(false));
        assert!(
            v.contains("cpu 1 lost 3.2%, longest gap 8.1 ms (2 of 1 ms or more)"),
            "{v}"
        );
        assert!(!v.contains("cpu 0"), "{v}");
        assert!(!v.contains("steal"), "{v}");
        let (ok, v) = verdict(std::slice::from_ref(&quiet), Some((4.0, 5)), 300);
        assert_eq!(ok, Some(false));
        assert!(v.contains("steal time 4.0%"), "{v}");
        // One jiffy of steal over a short probe is a large percentage of nothing.
        let (ok, v) = verdict(std::slice::from_ref(&quiet), Some((1.6, 1)), 300);
        assert_eq!(ok, Some(true), "{v}");
        let refused = CpuGaps {
            error: Some("EINVAL".into()),
            ..CpuGaps::default()
        };
        let (ok, v) = verdict(&[refused], None, 300);
        assert_eq!(ok, None);
        assert!(v.starts_with("not measured"), "{v}");
    }

    #[test]
    fn a_quota_smaller_than_the_watching_threads_is_named_as_a_cause() {
        let n = quota_note(1.5, 2);
        assert!(n.starts_with("1.5 CPUs per period"), "{n}");
        assert!(
            n.contains("the 2 watching threads were more than it"),
            "{n}"
        );
        let n = quota_note(1.0, 1);
        assert!(
            n.starts_with("1 CPU per period") && !n.contains("watching"),
            "{n}"
        );
        let mut o = String::new();
        render_cpus(
            &mut o,
            &CpuSection {
                quota_cpus: Some(2.0),
                ..not_measured("test")
            },
        );
        assert!(
            o.contains("CPU quota") && o.contains("2 CPUs per period"),
            "{o}"
        );
        assert!(!o.contains("held the cgroup stopped"), "{o}");
        let mut o = String::new();
        render_cpus(
            &mut o,
            &CpuSection {
                quota_cpus: Some(1.0),
                throttled_ms: Some(142.5),
                ..not_measured("test")
            },
        );
        assert!(
            o.contains("; held the cgroup stopped 142.5 ms during the probe"),
            "{o}"
        );
        // The verdict: the cause where the kernel counted throttling, the likely cause where
        // the threads outnumber the quota but the count is unknown, else nothing.
        let c = quota_cause(1.0, 2, Some(142.5));
        assert!(
            c.starts_with(". Here the cause is this cgroup's CPU quota (1 CPU for 2 spinning")
                && c.contains("stopped 142.5 ms during the probe"),
            "{c}"
        );
        let c = quota_cause(1.0, 2, None);
        assert!(c.starts_with(". Here the likely cause"), "{c}");
        assert_eq!(quota_cause(4.0, 2, None), "");
        assert_eq!(quota_cause(1.0, 2, Some(0.0)), "");
    }

    #[test]
    fn steal_is_the_eighth_number_of_the_cpu_line() {
        let stat = "cpu  100 5 50 800 10 1 2 30 0 0\ncpu0 50 2 25 400 5 0 1 15 0 0\n";
        assert_eq!(parse_steal(stat), Some((30, 998)));
        assert_eq!(parse_steal("intr 1 2 3\n"), None);
        assert_eq!(parse_steal("cpu  1 2 x\n"), None);
        assert_eq!(parse_steal("cpu  1 2 3\n"), None, "no steal column");
    }
}
