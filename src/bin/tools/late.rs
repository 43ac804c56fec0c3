//! `dspark analyze`'s late-rank line: from the times the dumps record, which rank starts its
//! collectives last, and by how much. That is the rank the others wait for when nothing
//! fails but the job is slow (a straggler: data loading, a slower device, a loaded host).
//!
//! Clocks: a dump's times are its host's wall clock, and hosts disagree by their NTP
//! offset. A collective cannot end on any rank before every rank started it, so where the
//! others' calls end (by their clocks) before the late rank's start (by its clock), its
//! clock is ahead by at least the difference, and that much of its lateness is taken out.
//! What is left can still be off by as much as one call lasts (the offset is known only to
//! within it), so ranks on different hosts are said to be late with that caveat.

use std::collections::BTreeMap;

/// One collective of one rank: when it started and ended (unix ns, the rank's clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: u64,
    pub end: u64,
}

/// What [`late`] found: `rank` started last in `last_in` of the `of` collectives every
/// dump holds completed (`first`..=`last`), a median `median_ns` (at most `max_ns`) after the
/// median of the others' starts, clock offsets taken out; `clock_ns`: the median offset
/// taken out (0: none seen).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Late {
    pub rank: u64,
    pub last_in: usize,
    pub of: usize,
    pub first: u64,
    pub last: u64,
    pub median_ns: u64,
    pub max_ns: u64,
    pub clock_ns: u64,
}

/// Collectives needed before a rank is called late.
pub(crate) const MIN_CALLS: usize = 5;
/// The least lateness said: below it, scheduling noise, and where the hosts' clocks
/// disagree by more than a call lasts, the call's length (what taking out the offset the
/// end times show leaves of it).
pub(crate) const MIN_LATE_NS: u64 = 2_000_000;

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// The rank that started last in most of the collectives every rank's dump holds
/// completed (precisely stamped ones: `spans` leaves the one-shot calls out), where that
/// is more than half of at least [`MIN_CALLS`] and its median lateness is at least
/// [`MIN_LATE_NS`].
pub(crate) fn late(spans: &BTreeMap<u64, BTreeMap<u64, Span>>) -> Option<Late> {
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
    // Per collective: the last rank to start, how late (after the others' median start),
    // and how far the others' earliest end lies before its start (its clock's lead).
    let mut lasts: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
    for &s in &common {
        let at: Vec<(u64, Span)> = spans.iter().map(|(&r, m)| (r, m[&s])).collect();
        let Some(&(r, sp)) = at.iter().max_by_key(|(_, sp)| sp.start) else {
            continue;
        };
        let mut others: Vec<u64> = at
            .iter()
            .filter(|(q, _)| *q != r)
            .map(|(_, o)| o.start)
            .collect();
        let first_end = at
            .iter()
            .filter(|(q, _)| *q != r)
            .map(|(_, o)| o.end)
            .min()
            .unwrap_or(u64::MAX);
        let lead = sp.start.saturating_sub(first_end);
        let lateness = sp.start.saturating_sub(median(&mut others));
        lasts.entry(r).or_default().push((lateness, lead));
    }
    let (rank, seen) = lasts.into_iter().max_by_key(|(_, v)| v.len())?;
    if seen.len() * 2 <= common.len() {
        return None;
    }
    let mut late: Vec<u64> = seen
        .iter()
        .map(|&(l, lead)| l.saturating_sub(lead))
        .collect();
    let mut leads: Vec<u64> = seen.iter().map(|&(_, lead)| lead).collect();
    let median_ns = median(&mut late);
    if median_ns < MIN_LATE_NS {
        return None;
    }
    Some(Late {
        rank,
        last_in: seen.len(),
        of: common.len(),
        first: common[0],
        last: common[common.len() - 1],
        median_ns,
        max_ns: late.last().copied().unwrap_or(0),
        clock_ns: median(&mut leads),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// `world` ranks, `n` collectives 100 ms apart, each taking 1 ms once every rank is in;
    /// rank `slow` starts each `by` ns late; `skew(r)`: rank r's clock offset.
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
        let l = late(&job(4, 10, 2, 30 * MS, &|_| 0)).expect("a late rank");
        assert_eq!(
            (l.rank, l.last_in, l.of, l.first, l.last),
            (2, 10, 10, 1, 10)
        );
        assert!((29 * MS..=30 * MS).contains(&l.median_ns), "{l:?}");
        assert_eq!(l.clock_ns, 0);
    }

    #[test]
    fn a_clock_ahead_is_not_lateness() {
        // Rank 3's clock runs 50 ms ahead; nobody is late: its starts look 50 ms late, but
        // the others' calls end (by their clocks) before them.
        assert_eq!(
            late(&job(4, 10, 9, 0, &|r| if r == 3 {
                50 * MS as i64
            } else {
                0
            })),
            None
        );
        // Rank 1 is 20 ms late and its clock 50 ms ahead: 20 ms is said, 50 taken out.
        let l = late(&job(3, 8, 1, 20 * MS, &|r| {
            if r == 1 {
                50 * MS as i64
            } else {
                0
            }
        }))
        .expect("a late rank");
        assert_eq!(l.rank, 1);
        assert!((19 * MS..=21 * MS).contains(&l.median_ns), "{l:?}");
        assert!((49 * MS..=51 * MS).contains(&l.clock_ns), "{l:?}");
    }

    #[test]
    fn noise_few_calls_and_no_majority_are_not_a_late_rank() {
        // Under MIN_LATE_NS.
        assert_eq!(late(&job(3, 10, 1, MS, &|_| 0)), None);
        // Fewer calls than MIN_CALLS.
        assert_eq!(
            late(&job(3, MIN_CALLS as u64 - 1, 1, 30 * MS, &|_| 0)),
            None
        );
        // Last in turn: nobody most of the time.
        let mut spans = job(2, 10, 9, 0, &|_| 0);
        for s in 1..=10u64 {
            let r = s % 2;
            if let Some(sp) = spans.get_mut(&r).and_then(|m| m.get_mut(&s)) {
                sp.start += 30 * MS;
                sp.end += 30 * MS;
            }
        }
        assert_eq!(late(&spans), None);
        // One rank's dump alone.
        let one: BTreeMap<u64, BTreeMap<u64, Span>> =
            job(3, 10, 1, 30 * MS, &|_| 0).into_iter().take(1).collect();
        assert_eq!(late(&one), None);
    }
}
