//! Who everyone waits for (`dspark analyze`'s verdict): each failed rank's wait, the chain
//! those waits form, and where it ends.
//!
//! A wait is what a rank's failed call was blocked on: the rank it lost (`peer_lost`: that
//! rank died; where the schedule stood then is beside the point), the peer it timed out
//! receiving from or sending to, or, for a rank aborted by another's failure, the peer it
//! was waiting for at that moment. An aborted rank's wait is weak evidence (a snapshot of a
//! rank that may have been making progress), so a chain that reaches one ends there unless
//! the aborted ranks' waits from it lead to the cause: a rank without a wait (no dump, or no
//! failure: it never reached the call) or one behind its peer. Conversely, a rank whose peer had
//! done clearly more of the same schedule is not blocked by that peer: it is behind itself
//! (stopped, descheduled), and the chain ends at it. That is what finds a SIGSTOPped rank in
//! a ring, where the waits otherwise close a cycle.

use std::collections::{BTreeMap, BTreeSet};

/// One failed rank's wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Wait {
    /// The rank waited for.
    pub to: u64,
    /// How, in words ("rank 1 timed out in all_reduce #3 receiving from rank 0 ...").
    pub how: String,
    /// Aborted by another rank's failure (its wait is where it stood, not a cause).
    pub aborted: bool,
    /// The failed call's sequence number and its schedule's (steps, steps done), where the
    /// dump says.
    pub progress: Option<(Option<u64>, u64, u64)>,
}

/// Where a rank's chain of waits ends.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum End {
    /// A rank that waits for nobody (it hung, died, left no dump, or is behind).
    Rank(u64),
    /// Ranks that wait for one another: a cycle (send/recv order, a deadlock).
    Cycle(BTreeSet<u64>),
}

/// Steps of difference between two ranks' progress through the same schedule that count as
/// one being ahead: pipelined schedules let neighbours drift a few steps apart.
fn slack(steps: u64) -> u64 {
    (steps / 16).max(2)
}

/// Steps done by `a` and by `b`, where both failed in the same call of the same schedule
/// (a dump's numbers, which may be anything: a `steps_done` above `steps` is not progress).
fn both_done(waits: &BTreeMap<u64, Wait>, a: u64, b: u64) -> Option<(u64, u64, u64)> {
    let (sa, na, da) = waits.get(&a)?.progress?;
    let (sb, nb, db) = waits.get(&b)?.progress?;
    (sa.is_some() && sa == sb && na == nb && na > 0 && da <= na && db <= nb).then_some((na, da, db))
}

/// Whether `to` had done clearly more of the schedule than `r`, which waits for it: it has
/// sent what `r` needed, so `r` is not blocked by it.
fn ahead(waits: &BTreeMap<u64, Wait>, r: u64, to: u64) -> bool {
    both_done(waits, r, to).is_some_and(|(n, dr, dt)| dt > dr.saturating_add(slack(n)))
}

/// Where following aborted ranks' waits from aborted rank `from` finds the cause: a rank
/// that waits for nothing (silent: it left no dump, or its dump has no failure: it never
/// reached the call or went on), or one behind its peer; `None` when the aborted ranks lead
/// back to a rank that failed on its own, or around, without saying.
fn aborted_root(waits: &BTreeMap<u64, Wait>, from: u64) -> Option<u64> {
    let mut seen = vec![from];
    let mut a = from;
    loop {
        let w = waits.get(&a).filter(|w| w.aborted)?;
        if ahead(waits, a, w.to) {
            return Some(a);
        }
        match waits.get(&w.to) {
            None => return Some(w.to),
            Some(n) if n.aborted && !seen.contains(&w.to) => {
                a = w.to;
                seen.push(a);
            }
            Some(_) => return None,
        }
    }
}

/// Where the chain of waits that starts at `start` (a rank with a wait) ends.
///
/// From an aborted start, aborted ranks' waits are followed to the first rank that failed on
/// its own (or to a rank without a wait, or one behind its peer: the end). From there the
/// waits of ranks that failed on their own (timed out, lost a peer) are followed; an aborted
/// rank reached is the end, unless following the aborted ranks' waits from it finds the
/// cause ([`aborted_root`]): its wait is a snapshot of a rank that may have been making
/// progress, but one that leads to a silent or stopped rank is evidence. A rank without a
/// wait ends the chain, itself, and so does a rank whose peer is ahead of it (it is behind).
pub(crate) fn end(waits: &BTreeMap<u64, Wait>, start: u64) -> End {
    let mut seen = vec![start];
    let mut r = start;
    while let Some(w) = waits.get(&r).filter(|w| w.aborted) {
        if ahead(waits, r, w.to) {
            return End::Rank(r);
        }
        if seen.contains(&w.to) {
            // Aborted ranks that waited for one another: whoever aborted them left no wait
            // to follow; they are a cycle of their own.
            return End::Cycle(seen.into_iter().collect());
        }
        r = w.to;
        seen.push(r);
    }
    let mut path = vec![r];
    while let Some(w) = waits.get(&r) {
        if ahead(waits, r, w.to) {
            return End::Rank(r);
        }
        let next = w.to;
        if waits.get(&next).is_some_and(|n| n.aborted) {
            return End::Rank(aborted_root(waits, next).unwrap_or(next));
        }
        if let Some(i) = path.iter().position(|&x| x == next) {
            return End::Cycle(path[i..].iter().copied().collect());
        }
        r = next;
        path.push(r);
    }
    End::Rank(r)
}

/// Why the chain ended at `r` when it did because `r` is behind its peer: "rank 2 is
/// behind: it had done 61 of 88 steps of all_reduce #474, rank 1 77".
pub(crate) fn behind_note(waits: &BTreeMap<u64, Wait>, r: u64, call: &str) -> Option<String> {
    let w = waits.get(&r)?;
    let (n, dr, dt) = both_done(waits, r, w.to)?;
    (dt > dr.saturating_add(slack(n))).then(|| {
        format!(
            "rank {r} is behind, not waiting: it had done {dr} of {n} steps of {call}, rank {} \
             {dt}",
            w.to
        )
    })
}

/// The wait of the rank that aborted another, read from the aborted rank's error (`rank 0:
/// all_reduce #9 (communicator) aborted by rank 2: rank 2: lost rank 1 during ...`): the
/// aborting rank and the rank it lost or timed out waiting for, and whether it lost it.
/// `None` when the reason is anything else (a mismatch, an abort passed on, a user's abort).
pub(crate) fn aborters_wait(error: &str) -> Option<(u64, u64, bool)> {
    const BY: &str = " aborted by rank ";
    let rest = &error[error.find(BY)? + BY.len()..];
    let by = leading_number(rest)?;
    let reason = rest[by.to_string().len()..]
        .strip_prefix(": ")?
        .strip_prefix(&format!("rank {by}: "))?;
    if let Some(lost) = reason.strip_prefix("lost rank ") {
        return Some((by, leading_number(lost)?, true));
    }
    // `OP timed out after 5.0s waiting for rank P: detail` (OP has no colon).
    let head = &reason[..reason.find(": ").unwrap_or(reason.len())];
    let after = &head[head.find(" timed out after ")?..];
    const FOR: &str = " waiting for rank ";
    let peer = leading_number(&after[after.find(FOR)? + FOR.len()..])?;
    Some((by, peer, false))
}

fn leading_number(s: &str) -> Option<u64> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s[..end].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn wait(to: u64, aborted: bool, done: u64) -> Wait {
        Wait {
            to,
            how: String::new(),
            aborted,
            progress: Some((Some(474), 88, done)),
        }
    }

    /// Rank 2 SIGSTOPped inside a ring all_reduce of 3 ranks (a real run's numbers): rank 1
    /// timed out receiving from rank 0, which was receiving from rank 2 when rank 1 aborted
    /// it; rank 2, resumed later, was receiving from rank 1, which had long sent it. The
    /// waits close a cycle; the progress says rank 2 is behind.
    #[test]
    fn a_stopped_rank_in_a_ring_is_found_by_its_progress() {
        let waits = BTreeMap::from([
            (0, wait(2, true, 75)),
            (1, wait(0, false, 77)),
            (2, wait(1, true, 61)),
        ]);
        for r in 0..3 {
            assert_eq!(end(&waits, r), End::Rank(2), "from rank {r}");
        }
        let note = behind_note(&waits, 2, "all_reduce #474").unwrap();
        assert!(note.contains("61 of 88 steps"), "{note}");
        assert_eq!(behind_note(&waits, 0, "x"), None);
    }

    /// Without progress to tell, an aborted rank reached from a timeout is the one waited
    /// for, and aborted ranks lead to where the timeouts' chain ends.
    #[test]
    fn without_progress_an_aborted_rank_reached_is_the_end() {
        let mut waits = BTreeMap::from([
            (0, wait(2, true, 1)),
            (1, wait(0, true, 1)),
            (2, wait(1, false, 1)),
        ]);
        for w in waits.values_mut() {
            w.progress = None;
        }
        for r in 0..3 {
            assert_eq!(end(&waits, r), End::Rank(1), "from rank {r}");
        }
    }

    /// Rank 2 killed: rank 1 lost it; rank 0, aborted, was sending to rank 1 (a few steps
    /// apart, as neighbours in a ring are). One verdict: rank 2.
    #[test]
    fn an_aborted_rank_follows_to_the_lost_one() {
        let waits = BTreeMap::from([(0, wait(1, true, 83)), (1, wait(2, false, 80))]);
        assert_eq!(end(&waits, 0), End::Rank(2));
        assert_eq!(end(&waits, 1), End::Rank(2));
    }

    /// Rank 2 stopped and has not dumped yet: rank 1 timed out on rank 0, which was waiting
    /// for silent rank 2 when aborted. One verdict: rank 2.
    #[test]
    fn an_aborted_ranks_wait_for_a_silent_rank_is_followed() {
        let waits = BTreeMap::from([(0, wait(2, true, 75)), (1, wait(0, false, 77))]);
        assert_eq!(end(&waits, 1), End::Rank(2));
        assert_eq!(end(&waits, 0), End::Rank(2));
    }

    /// A ring of 4, rank 2 SIGSTOPped, rank 1 (two hops on) timing out first: each hop is a
    /// couple of steps apart, only rank 2's own neighbour clearly ahead of it. The chain
    /// goes through the aborted ranks 0 and 3 to rank 2, silent or dumped (a review's case:
    /// it once stopped at rank 0).
    #[test]
    fn a_timeout_two_hops_from_a_stopped_rank_reaches_it_through_aborted_ranks() {
        let mut waits = BTreeMap::from([
            (0, wait(3, true, 77)),
            (1, wait(0, false, 79)),
            (3, wait(2, true, 75)),
        ]);
        for r in [0, 1, 3] {
            assert_eq!(end(&waits, r), End::Rank(2), "silent, from rank {r}");
        }
        waits.insert(2, wait(1, true, 61));
        for r in 0..4 {
            assert_eq!(end(&waits, r), End::Rank(2), "dumped, from rank {r}");
        }
    }

    /// Rank 1 never started the call (its dump has no failure): rank 0 timed out on rank 2,
    /// which was aborted receiving from rank 1. The verdict is rank 1, not rank 2.
    #[test]
    fn a_rank_that_never_reached_the_call_is_the_end() {
        let waits = BTreeMap::from([(0, wait(2, false, 5)), (2, wait(1, true, 4))]);
        assert_eq!(end(&waits, 0), End::Rank(1));
        assert_eq!(end(&waits, 2), End::Rank(1));
    }

    /// A dump's numbers are untrusted: huge ones neither panic nor count as progress.
    #[test]
    fn absurd_progress_is_ignored() {
        let waits = BTreeMap::from([(0, wait(1, false, u64::MAX)), (1, wait(0, false, 3))]);
        assert_eq!(end(&waits, 0), End::Cycle(BTreeSet::from([0, 1])));
        assert_eq!(behind_note(&waits, 1, "x"), None);
    }

    #[test]
    fn timeouts_in_a_circle_are_a_cycle() {
        let waits: BTreeMap<u64, Wait> = (0..3).map(|r| (r, wait((r + 1) % 3, false, 5))).collect();
        assert_eq!(end(&waits, 0), End::Cycle(BTreeSet::from([0, 1, 2])));
    }

    /// The library's own words, as a survivor's error carries them.
    #[test]
    fn the_aborting_ranks_wait_is_read_from_the_library_error() {
        let lost = dspark::Error::PeerLost {
            rank: 2,
            peer: 1,
            op: "all_reduce #469 (receive)".into(),
            detail: "its process died: the liveness connection closed without a goodbye".into(),
        };
        let aborted = |reason: String| {
            dspark::Error::Aborted {
                rank: 0,
                by: 2,
                op: "all_reduce #469 (communicator)".into(),
                reason,
            }
            .to_string()
        };
        assert_eq!(
            aborters_wait(&aborted(lost.to_string())),
            Some((2, 1, true))
        );
        let timeout = dspark::Error::Timeout {
            rank: 2,
            peer: Some(3),
            op: "all_reduce #7".into(),
            waited: Duration::from_secs(5),
            detail: "waiting to receive from rank 3 (step 4 of 8)".into(),
        };
        assert_eq!(
            aborters_wait(&aborted(timeout.to_string())),
            Some((2, 3, false))
        );
        assert_eq!(
            aborters_wait(&aborted("user asked: rank 1: lost".into())),
            None
        );
        assert_eq!(aborters_wait(&lost.to_string()), None);
    }
}
