//! The doctor's core-to-core distances: how long one cache line takes to go from a CPU to
//! another and back. Two threads, pinned to the two CPUs, pass a counter in one cache line
//! back and forth; a pair's round trip is the fastest of [`SAMPLES`] samples of [`TRIPS`]
//! round trips (the distance, not the noise: a sample the scheduler interrupted is slower,
//! never faster). Every small message between two ranks on one host over shared memory
//! pays it: on the 2-vCPU VM this project is developed on, the host moved the two vCPUs
//! between cores sharing a cache (0.045 µs) and cores on different dies (0.35 µs) within
//! minutes, and dspark's 8-byte all_reduce over shared memory took 0.16 and 0.3 µs with
//! them (`benches/RESULTS.md`, "stop 32"). On a VM that placement is the host's and can
//! change between runs; on bare metal it is the machine's topology (sockets, dies).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use serde::Serialize;

use super::kv;

/// Round trips per sample.
const TRIPS: u64 = 1000;
/// Samples per pair; the fastest is the pair's round trip.
const SAMPLES: u64 = 15;
/// A pair whose threads have not finished by then is reported as not measured.
const PAIR_DEADLINE: Duration = Duration::from_millis(200);
/// At most this many pairs: every pair of up to 8 CPUs, else the first CPU with each other.
const MAX_PAIRS: usize = 64;
/// Sorted round trips more than this factor apart are different distances.
const LEVEL_JUMP: f64 = 1.8;
/// A round trip at least this long (µs) is between CPUs that share no cache: different dies
/// or sockets (two cores sharing a cache take 0.04–0.15 µs).
const FAR_US: f64 = 0.2;

/// One pair's round trip.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(super) struct CorePair {
    pub(super) a: usize,
    pub(super) b: usize,
    pub(super) round_trip_us: Option<f64>,
    /// Why it was not measured, if so.
    pub(super) error: Option<String>,
}

/// Pairs measured at about the same distance.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(super) struct Level {
    /// The median round trip of the level's pairs.
    pub(super) round_trip_us: f64,
    pub(super) pairs: usize,
}

/// The section: every pair, the distances found, what they mean.
#[derive(Debug, Serialize)]
pub(super) struct CoreSection {
    pub(super) pairs: Vec<CorePair>,
    pub(super) levels: Vec<Level>,
    pub(super) verdict: String,
}

/// The pairs to measure among the `allowed` CPUs.
pub(super) fn pairs_of(allowed: &[usize]) -> Vec<(usize, usize)> {
    if allowed.len() <= 8 {
        let mut v = Vec::new();
        for (i, &a) in allowed.iter().enumerate() {
            for &b in &allowed[i + 1..] {
                v.push((a, b));
            }
        }
        return v;
    }
    allowed[1..]
        .iter()
        .take(MAX_PAIRS)
        .map(|&b| (allowed[0], b))
        .collect()
}

fn pin(cpu: usize) -> Result<(), String> {
    let mut set = CpuSet::new();
    set.set(cpu)
        .and_then(|()| sched_setaffinity(Pid::from_raw(0), &set))
        .map_err(|e| format!("cannot pin a thread to cpu {cpu}: {e}"))
}

/// Waits until `w` holds at least `v`; `false` once `stop` is set or `until` passed.
fn wait_for(w: &AtomicU64, v: u64, stop: &AtomicBool, until: Instant) -> bool {
    let mut spins = 0u32;
    while w.load(Ordering::Acquire) < v {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(4096) && (stop.load(Ordering::Relaxed) || Instant::now() > until) {
            return false;
        }
    }
    true
}

#[repr(align(128))]
struct Line(AtomicU64);

/// One pair's round trip, the fastest of `samples` samples of `trips`: this thread on `a`
/// starts each trip, a scoped thread on `b` answers it; both give up at `deadline`.
fn measure(a: usize, b: usize, trips: u64, samples: u64, deadline: Duration) -> CorePair {
    let line = Line(AtomicU64::new(0));
    let stop = AtomicBool::new(false);
    let until = Instant::now() + deadline;
    let total = trips * samples;
    let r = std::thread::scope(|s| {
        let answer = std::thread::Builder::new()
            .name(format!("core-pair-{b}"))
            .spawn_scoped(s, || {
                pin(b)?;
                for i in 0..total {
                    if !wait_for(&line.0, 2 * i + 1, &stop, until) {
                        return Err("no answer in time".to_string());
                    }
                    line.0.store(2 * i + 2, Ordering::Release);
                }
                Ok(())
            })
            .map_err(|e| format!("no thread for cpu {b}: {e}"))?;
        let mine = (|| {
            pin(a)?;
            let mut best = f64::MAX;
            for k in 0..samples {
                let t0 = Instant::now();
                for i in k * trips..(k + 1) * trips {
                    line.0.store(2 * i + 1, Ordering::Release);
                    if !wait_for(&line.0, 2 * i + 2, &stop, until) {
                        return Err(format!(
                            "cpu {b} did not answer within {} ms (busy?)",
                            deadline.as_millis()
                        ));
                    }
                }
                best = best.min(t0.elapsed().as_secs_f64() * 1e6 / trips as f64);
            }
            Ok(best)
        })();
        stop.store(true, Ordering::Relaxed);
        let theirs = answer
            .join()
            .unwrap_or_else(|_| Err("its thread failed".into()));
        let us = mine?;
        theirs.map(|()| us)
    });
    match r {
        Ok(us) => CorePair {
            a,
            b,
            round_trip_us: Some(us),
            error: None,
        },
        Err(e) => CorePair {
            a,
            b,
            round_trip_us: None,
            error: Some(e),
        },
    }
}

/// The distances among the measured pairs: sorted round trips split where one is more than
/// [`LEVEL_JUMP`] times the one before.
pub(super) fn levels(pairs: &[CorePair]) -> Vec<Level> {
    let mut rt: Vec<f64> = pairs.iter().filter_map(|p| p.round_trip_us).collect();
    rt.sort_by(f64::total_cmp);
    let mut groups: Vec<Vec<f64>> = Vec::new();
    for x in rt {
        match groups.last_mut() {
            Some(g) if g.last().is_some_and(|&l| x <= l * LEVEL_JUMP) => g.push(x),
            _ => groups.push(vec![x]),
        }
    }
    groups
        .into_iter()
        .map(|g| Level {
            round_trip_us: g[g.len() / 2],
            pairs: g.len(),
        })
        .collect()
}

/// The verdict line from the pairs and their levels.
pub(super) fn verdict(pairs: &[CorePair], levels: &[Level]) -> String {
    let (Some(near), Some(far)) = (levels.first(), levels.last()) else {
        return match pairs.first() {
            None => "not measured (fewer than 2 CPUs)".into(),
            Some(_) => "not measured (no pair answered)".into(),
        };
    };
    let far_pairs: Vec<String> = pairs
        .iter()
        .filter(|p| p.round_trip_us.is_some_and(|x| x >= FAR_US))
        .take(8)
        .map(|p| format!("{}-{}", p.a, p.b))
        .collect();
    let vm = " (on a VM that is where the host put the vCPUs, and it can change from one run \
              to the next)";
    if near.round_trip_us >= FAR_US {
        format!(
            "every pair is far apart ({:.3} µs or more: no shared cache, different dies or \
             sockets){vm}: small messages between ranks on these CPUs pay it on every step",
            near.round_trip_us
        )
    } else if far.round_trip_us >= FAR_US {
        format!(
            "{} distances, {:.3} to {:.3} µs; far pairs: {}: put ranks that talk most on near \
             CPUs (`--bind`, taskset){vm}",
            levels.len(),
            near.round_trip_us,
            far.round_trip_us,
            far_pairs.join(", ")
        )
    } else if levels.len() == 1 {
        format!(
            "near: every pair shares a cache ({:.3} µs)",
            near.round_trip_us
        )
    } else {
        format!(
            "near: every pair shares a cache ({:.3} to {:.3} µs)",
            near.round_trip_us, far.round_trip_us
        )
    }
}

/// Measures the pairs of the `allowed` CPUs one after the other.
pub(super) fn probe_cores(allowed: &[usize]) -> CoreSection {
    let pairs: Vec<CorePair> = pairs_of(allowed)
        .into_iter()
        .map(|(a, b)| measure(a, b, TRIPS, SAMPLES, PAIR_DEADLINE))
        .collect();
    let levels = levels(&pairs);
    let verdict = verdict(&pairs, &levels);
    CoreSection {
        pairs,
        levels,
        verdict,
    }
}

/// The section where nothing is measured, saying why.
pub(super) fn not_measured(why: &str) -> CoreSection {
    CoreSection {
        pairs: Vec::new(),
        levels: Vec::new(),
        verdict: format!("not measured ({why})"),
    }
}

/// The human report's "Core-to-core distance" section.
pub(super) fn render_cores(o: &mut String, c: &CoreSection) {
    o.push_str("\nCore-to-core distance (one cache line there and back)\n");
    for p in c.pairs.iter().take(16) {
        let v = match (p.round_trip_us, &p.error) {
            (Some(us), _) => format!("{us:.3} µs"),
            (None, e) => format!("not measured: {}", e.as_deref().unwrap_or("?")),
        };
        kv(o, &format!("cpu {} - cpu {}", p.a, p.b), v);
    }
    if c.pairs.len() > 16 {
        kv(
            o,
            "more pairs",
            format!("{} (in --json)", c.pairs.len() - 16),
        );
    }
    kv(o, "verdict", &c.verdict);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(a: usize, b: usize, us: Option<f64>) -> CorePair {
        CorePair {
            a,
            b,
            round_trip_us: us,
            error: us.is_none().then(|| "no answer in time".into()),
        }
    }

    #[test]
    fn small_sets_take_every_pair_and_large_ones_the_first_cpu_with_each() {
        assert_eq!(pairs_of(&[0]), vec![]);
        assert_eq!(pairs_of(&[0, 1]), vec![(0, 1)]);
        assert_eq!(pairs_of(&[2, 5, 7]), vec![(2, 5), (2, 7), (5, 7)]);
        assert_eq!(pairs_of(&(0..8).collect::<Vec<_>>()).len(), 28);
        let many: Vec<usize> = (0..200).collect();
        let p = pairs_of(&many);
        assert_eq!(p.len(), MAX_PAIRS);
        assert!(p
            .iter()
            .enumerate()
            .all(|(i, &(a, b))| a == 0 && b == i + 1));
    }

    #[test]
    fn distances_split_where_the_round_trip_jumps() {
        let p = [
            pair(0, 1, Some(0.045)),
            pair(0, 2, Some(0.35)),
            pair(1, 2, Some(0.05)),
            pair(0, 3, Some(0.36)),
            pair(1, 3, None),
        ];
        let l = levels(&p);
        assert_eq!(l.len(), 2, "{l:?}");
        assert_eq!((l[0].pairs, l[1].pairs), (2, 2));
        assert_eq!((l[0].round_trip_us, l[1].round_trip_us), (0.05, 0.36));
        let v = verdict(&p, &l);
        assert!(v.starts_with("2 distances, 0.050 to 0.360 µs"), "{v}");
        assert!(v.contains("far pairs: 0-2, 0-3"), "{v}");
        assert!(!v.contains("1-3"), "an unmeasured pair is not far: {v}");
    }

    #[test]
    fn the_verdict_says_near_far_or_not_measured() {
        let near = [pair(0, 1, Some(0.045))];
        let v = verdict(&near, &levels(&near));
        assert!(
            v.starts_with("near: every pair shares a cache (0.045"),
            "{v}"
        );
        let far = [pair(0, 1, Some(0.35))];
        let v = verdict(&far, &levels(&far));
        assert!(v.starts_with("every pair is far apart (0.350"), "{v}");
        assert!(v.contains("on a VM"), "{v}");
        let none = [pair(0, 1, None)];
        assert_eq!(
            verdict(&none, &levels(&none)),
            "not measured (no pair answered)"
        );
        assert_eq!(verdict(&[], &[]), "not measured (fewer than 2 CPUs)");
    }

    #[test]
    fn two_cpus_of_this_machine_answer_each_other() {
        let allowed = super::super::cpus::allowed_cpus();
        if allowed.len() < 2 {
            eprintln!("skipped: fewer than 2 CPUs allowed");
            return;
        }
        // Few trips and a long deadline: beside the other tests a round trip can wait for a
        // scheduler slice. The fastest sample must still be measured and plausible.
        let p = measure(allowed[0], allowed[1], 20, 5, Duration::from_secs(20));
        let us = p
            .round_trip_us
            .unwrap_or_else(|| panic!("not measured: {:?}", p.error));
        assert!(us > 0.0 && us < 5000.0, "{us} µs");
    }
}
