//! The doctor's core-to-core distances: how long one cache line takes to go from a CPU to
//! another and back. Two threads, pinned to the two CPUs, pass a counter in one cache line
//! back and forth; a pair's round trip is the fastest of 15 samples of 1 000 round trips
//! (the distance, not the noise: a sample the scheduler interrupted is slower, never
//! faster), measured by `bench/distance.rs`, which dspark-bench's header shares. Every small
//! message between two ranks on one host over shared memory pays it: on the 2-vCPU VM this
//! project is developed on, the host moved the two vCPUs between cores sharing a cache
//! (0.045 µs) and cores on different dies (0.35 µs) within minutes, and dspark's 8-byte
//! all_reduce over shared memory took 0.16 and 0.34 µs with them (`benches/RESULTS.md`,
//! "stop 32"). On a VM that placement is the host's and can change between runs; on bare
//! metal it is the machine's topology (sockets, dies).

use serde::Serialize;

use super::kv;
use crate::distance::{self, FAR_US};

/// At most this many pairs: every pair of up to 8 CPUs, else the first CPU with each other.
const MAX_PAIRS: usize = 64;
/// Sorted round trips more than this factor apart are different distances.
const LEVEL_JUMP: f64 = 1.8;

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

/// One pair, measured ([`distance::measure`]).
fn measure(a: usize, b: usize) -> CorePair {
    let (round_trip_us, error) = match distance::measure(a, b) {
        Ok(us) => (Some(us), None),
        Err(e) => (None, Some(e)),
    };
    CorePair {
        a,
        b,
        round_trip_us,
        error,
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
    let missing = pairs.iter().filter(|p| p.round_trip_us.is_none()).count();
    let missing = if missing > 0 {
        format!(" ({missing} pair(s) not measured)")
    } else {
        String::new()
    };
    let vm = " (on a VM that is where the host put the vCPUs, and it can change from one run \
              to the next)";
    if near.round_trip_us >= FAR_US {
        format!(
            "every pair is far apart ({:.3} µs or more: likely no shared cache, different dies \
             or sockets){vm}{missing}: small messages between ranks on these CPUs pay it on \
             every step",
            near.round_trip_us
        )
    } else if far.round_trip_us >= FAR_US {
        format!(
            "{} distances, {:.3} to {:.3} µs; far pairs: {}{missing}: put ranks that talk most \
             on near CPUs (mpirun --bind-to, taskset, dspark-bench --bind){vm}",
            levels.len(),
            near.round_trip_us,
            far.round_trip_us,
            far_pairs.join(", ")
        )
    } else if levels.len() == 1 {
        format!(
            "near: every pair likely shares a cache ({:.3} µs){missing}",
            near.round_trip_us
        )
    } else {
        format!(
            "near: every pair likely shares a cache ({:.3} to {:.3} µs){missing}",
            near.round_trip_us, far.round_trip_us
        )
    }
}

/// Measures the pairs of the `allowed` CPUs one after the other.
pub(super) fn probe_cores(allowed: &[usize]) -> CoreSection {
    let pairs: Vec<CorePair> = pairs_of(allowed)
        .into_iter()
        .map(|(a, b)| measure(a, b))
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
        assert_eq!(v, "near: every pair likely shares a cache (0.045 µs)");
        let two = [pair(0, 1, Some(0.04)), pair(0, 2, Some(0.12))];
        let v = verdict(&two, &levels(&two));
        assert_eq!(
            v,
            "near: every pair likely shares a cache (0.040 to 0.120 µs)"
        );
        let part = [pair(0, 1, Some(0.04)), pair(0, 2, None)];
        let v = verdict(&part, &levels(&part));
        assert_eq!(
            v,
            "near: every pair likely shares a cache (0.040 µs) (1 pair(s) not measured)"
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
}
