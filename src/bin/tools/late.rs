//! `dspark analyze`'s late-rank line: from the times the dumps record, which rank starts its
//! collectives last, and by how much. That is the rank the others wait for when nothing
//! fails but the job is slow (a straggler: data loading, a slower device, a loaded host).
//!
//! Two measures, for two cases:
//! - **One clock** (every rank on one host): start times compare directly. Per call, the
//!   rank that started last, and by how much after the median of the others' starts.
//! - **Several clocks** (ranks on different hosts, whose wall clocks differ by their NTP
//!   offset, which no end time bounds: an eager send ends before its peer starts): each
//!   rank's own clock only measures its own calls' lengths. A rank that comes late finds
//!   everyone ready and its call is short, while the others' calls last as long as they
//!   waited for it. Per call, the rank whose call was shortest, and by how much the median
//!   of the others' calls was longer.
//!
//! Only collectives whose every output needs every rank's input are counted (all_reduce,
//! all_gather, reduce_scatter, all_to_all, barrier; the caller filters): a broadcast's root
//! or a reduce's leaf may finish before a late rank starts, and waits for nobody.

use std::collections::BTreeMap;

/// One collective of one rank: when it started and ended (unix ns, the rank's clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: u64,
    pub end: u64,
}

impl Span {
    fn len(self) -> u64 {
        self.end.saturating_sub(self.start)
    }
}

/// What [`late`] found: `rank` came last in `last_in` of the `of` collectives every dump
/// holds (`first`..=`last`), by a median `median_ns` (at most `max_ns`); `by_start`: measured
/// by start times on one clock, else by how much longer the others' calls lasted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Late {
    pub rank: u64,
    pub last_in: usize,
    pub of: usize,
    pub first: u64,
    pub last: u64,
    pub median_ns: u64,
    pub max_ns: u64,
    pub by_start: bool,
}

/// Collectives needed before a rank is called late.
pub(crate) const MIN_CALLS: usize = 5;
/// The least lateness said: below it, scheduling noise.
pub(crate) const MIN_LATE_NS: u64 = 2_000_000;

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// The rank that came last in most of the collectives every rank's dump holds completed,
/// where that is more than half of at least [`MIN_CALLS`] and its median lateness is at
/// least [`MIN_LATE_NS`]; `one_clock`: every rank on one host (start times compare).
pub(crate) fn late(spans: &BTreeMap<u64, BTreeMap<u64, Span>>, one_clock: bool) -> Option<Late> {
    if spans.len() < 2 {
        return None;
    }
    let (_, first_rank) = spans.iter().next()?;
    let common: Vec<u64> = first_rank
        .keys()
        .copied()
        .filter(|s| spans.values().all(|m| m.contains_key(s)))
        .collect();
    if common.len() < MIN_CALLS {
        return None;
    }
    // Per collective: the rank that came last (a tie: nobody) and how late.
    let mut lasts: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for &s in &common {
        let at: Vec<(u64, Span)> = spans
            .iter()
            .filter_map(|(&r, m)| Some((r, *m.get(&s)?)))
            .collect();
        // The measure where larger is later: the start, or how much shorter the call was.
        let key = |sp: Span| {
            if one_clock {
                sp.start
            } else {
                u64::MAX - sp.len()
            }
        };
        let mut keys: Vec<u64> = at.iter().map(|&(_, sp)| key(sp)).collect();
        keys.sort_unstable();
        if keys.len() < 2 || keys[keys.len() - 1] == keys[keys.len() - 2] {
            continue;
        }
        let Some(&(r, sp)) = at.iter().max_by_key(|(_, sp)| key(*sp)) else {
            continue;
        };
        let mut others: Vec<u64> = at
            .iter()
            .filter(|(q, _)| *q != r)
            .map(|&(_, o)| if one_clock { o.start } else { o.len() })
            .collect();
        let m = median(&mut others);
        let lateness = if one_clock {
            sp.start.saturating_sub(m)
        } else {
            m.saturating_sub(sp.len())
        };
        lasts.entry(r).or_default().push(lateness);
    }
    let (rank, mut late) = lasts.into_iter().max_by_key(|(_, v)| v.len())?;
    if late.len() * 2 <= common.len() {
        return None;
    }
    let median_ns = median(&mut late);
    if median_ns < MIN_LATE_NS {
        return None;
    }
    Some(Late {
        rank,
        last_in: late.len(),
        of: common.len(),
        first: common[0],
        last: common[common.len() - 1],
        median_ns,
        max_ns: late.last().copied().unwrap_or(0),
        by_start: one_clock,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// `world` ranks, `n` collectives 100 ms apart, each ending 1 ms after the last rank is
    /// in; rank `slow` starts each `by` ns late (and, finding everyone ready, its call lasts
    /// 1 ms); `skew(r)`: rank r's clock offset.
    fn job(
        world: u64,
        n: u64,
        slow: u64,
        by: u64,
        skew: &dyn Fn(u64) -> i64,
    ) -> BTreeMap<u64, BTreeMap<u64, Span>> {
        (0..world)
            .map(|r| {
                let m = (1..=n)
                    .map(|s| {
                        let t0 = 1_000 * MS + s * 100 * MS;
                        let start = if r == slow { t0 + by } else { t0 + r * 10_000 };
                        let end = t0 + by + MS;
                        let c = |t: u64| (t as i64 + skew(r)) as u64;
                        (
                            s,
                            Span {
                                start: c(start),
                                end: c(end),
                            },
                        )
                    })
                    .collect();
                (r, m)
            })
            .collect()
    }

    #[test]
    fn the_rank_that_starts_last_is_named_with_its_lateness() {
        for one_clock in [true, false] {
            let l = late(&job(4, 10, 2, 30 * MS, &|_| 0), one_clock).expect("a late rank");
            assert_eq!(
                (l.rank, l.last_in, l.of, l.first, l.last),
                (2, 10, 10, 1, 10)
            );
            assert!((29 * MS..=30 * MS).contains(&l.median_ns), "{l:?}");
            assert_eq!(l.by_start, one_clock);
        }
    }

    #[test]
    fn a_clock_ahead_on_another_host_is_not_lateness() {
        let ahead = |r: u64| if r == 3 { 50 * MS as i64 } else { 0 };
        // Rank 3's clock runs 50 ms ahead and nobody is late: its starts look 50 ms late,
        // its calls are no shorter than the others'.
        assert_eq!(late(&job(4, 10, 9, 0, &ahead), false), None);
        // Compared as one clock, that would be blamed: why several clocks are not.
        assert_eq!(
            late(&job(4, 10, 9, 0, &ahead), true).map(|l| l.rank),
            Some(3)
        );
        // Rank 3 is 20 ms late and its clock 50 ms ahead: 20 ms is said.
        let l = late(&job(4, 8, 3, 20 * MS, &ahead), false).expect("a late rank");
        assert_eq!(l.rank, 3);
        assert!((19 * MS..=21 * MS).contains(&l.median_ns), "{l:?}");
    }

    #[test]
    fn noise_few_calls_and_no_majority_are_not_a_late_rank() {
        for one_clock in [true, false] {
            // Under MIN_LATE_NS.
            assert_eq!(late(&job(3, 10, 1, MS, &|_| 0), one_clock), None);
            // Fewer calls than MIN_CALLS.
            assert_eq!(
                late(&job(3, MIN_CALLS as u64 - 1, 1, 30 * MS, &|_| 0), one_clock),
                None
            );
            // Two ranks late in turn (each 30 ms late in its calls): nobody most of the time.
            let turns: BTreeMap<u64, BTreeMap<u64, Span>> = (0..3u64)
                .map(|r| {
                    let m = (1..=10u64)
                        .map(|s| {
                            let t0 = s * 100 * MS;
                            let start = if s % 2 == r {
                                t0 + 30 * MS
                            } else {
                                t0 + r * 10_000
                            };
                            (
                                s,
                                Span {
                                    start,
                                    end: t0 + 31 * MS,
                                },
                            )
                        })
                        .collect();
                    (r, m)
                })
                .collect();
            assert_eq!(late(&turns, one_clock), None);
            // With a majority (rank 0 late in 6 of 10), it is said.
            let mut six = turns.clone();
            for (r, m) in six.iter_mut() {
                for s in [3u64, 9] {
                    if let Some(sp) = m.get_mut(&s) {
                        let t0 = s * 100 * MS;
                        sp.start = if *r == 0 {
                            t0 + 30 * MS
                        } else {
                            t0 + r * 10_000
                        };
                    }
                }
            }
            assert_eq!(
                late(&six, one_clock).map(|l| (l.rank, l.last_in)),
                Some((0, 7))
            );
            // One rank's dump alone.
            let one: BTreeMap<u64, BTreeMap<u64, Span>> =
                job(3, 10, 1, 30 * MS, &|_| 0).into_iter().take(1).collect();
            assert_eq!(late(&one, one_clock), None);
        }
    }
}
