//! The closed forms of the cost model: the structure of every algorithm's schedule
//! ([`Volume`]: the critical path's hops and their bytes, the busiest rank's messages, bytes
//! and reductions, and the same summed over all ranks), counted in O(1) without building the
//! schedule, so that choosing an algorithm per call costs nanoseconds. The tests check every
//! count against the schedules themselves for every world up to 64.

use crate::plan::algo::hier_chunks;
use crate::plan::{hierarchical_fits, Algorithm, Collective};

/// The structure of one schedule, as the model counts it (elements, not bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Volume {
    /// Messages on the critical path (the longest chain in which each waits for the last).
    pub hops: usize,
    /// How many of those hops end in a reduction.
    pub reducing_hops: usize,
    /// Elements each hop carries (the largest, where they differ).
    pub hop_elems: usize,
    /// Most send operations of one rank (descriptor-only frames included).
    pub sends: usize,
    /// Most elements one rank sends.
    pub sent: usize,
    /// Most elements one rank receives.
    pub recvd: usize,
    /// Most elements one rank reduces.
    pub reduced: usize,
    /// Send operations of all ranks together.
    pub total_sends: usize,
    /// Elements all ranks send together.
    pub total_sent: usize,
    /// Elements all ranks reduce together.
    pub total_reduced: usize,
}

/// ⌊log2 n⌋ (0 for 0).
pub(super) fn floor_log2(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (usize::BITS - 1 - n.leading_zeros()) as usize
    }
}

/// ⌈log2 n⌉ (0 for 0 and 1).
fn ceil_log2(n: usize) -> usize {
    if n <= 1 {
        0
    } else {
        floor_log2(n - 1) + 1
    }
}

/// The structure of `algo`'s schedule for `coll` over `world` ranks and `count` elements
/// ([`super::Request::count`]'s meaning), with `per_host` ranks per host for the hierarchical
/// allreduce. `None` where `algo` does not implement `coll`. The counts are exact for the
/// schedules of [`super::schedule`] when `count ≥ world` (below that some blocks are empty and
/// their messages skipped); the hierarchical allreduce's per-rank bytes are the even split.
///
/// [`super::Request::count`]: crate::plan::Request::count
/// [`super::schedule`]: crate::plan::schedule
pub fn volume(
    coll: Collective,
    algo: Algorithm,
    world: usize,
    count: usize,
    per_host: usize,
) -> Option<Volume> {
    use Algorithm as A;
    use Collective as C;
    if !algo.supports(coll) {
        return None;
    }
    let (n, c) = (world.max(1), count);
    if n == 1 {
        return Some(Volume::default());
    }
    let v = match (coll, algo) {
        (C::AllReduce, A::Hierarchical) if hierarchical_fits(n, per_host) => {
            let (l, h) = (per_host, n / per_host);
            let rail = c.div_ceil(l);
            let each = (c - c / l)
                .saturating_mul(2)
                .saturating_add((rail - rail / h).saturating_mul(2));
            // Pipelined in chunks: every chunk sends its own messages (the bytes do not change).
            let chunks = hier_chunks(c, l, h);
            Volume {
                hops: 2 * (l - 1) + 2 * (h - 1),
                reducing_hops: (l - 1) + (h - 1),
                hop_elems: c.div_ceil(l),
                sends: chunks * (2 * (l - 1) + 2 * (h - 1)),
                sent: each.min(c.saturating_mul(2)),
                recvd: each.min(c.saturating_mul(2)),
                reduced: (c - c / l).saturating_add(rail - rail / h),
                total_sends: chunks * n * (2 * (l - 1) + 2 * (h - 1)),
                total_sent: (2 * (n - 1)).saturating_mul(c),
                total_reduced: (n - 1).saturating_mul(c),
            }
        }
        (C::AllReduce, A::Ring | A::Hierarchical) => {
            let (q, e) = (c / n, c % n);
            let pair = 2 * q + usize::from(e == n - 1);
            Volume {
                hops: 2 * (n - 1),
                reducing_hops: n - 1,
                hop_elems: c.div_ceil(n),
                sends: 2 * (n - 1),
                sent: c.saturating_mul(2).saturating_sub(pair),
                recvd: c.saturating_mul(2).saturating_sub(pair),
                reduced: c - q,
                total_sends: 2 * n * (n - 1),
                total_sent: (2 * (n - 1)).saturating_mul(c),
                total_reduced: (n - 1).saturating_mul(c),
            }
        }
        (C::AllReduce, A::Tree) => {
            let d = floor_log2(n);
            let (hi, lo) = (c.div_ceil(2), c / 2);
            let (sends, sent) = match n {
                2 => (2, c),
                3 => (3, hi.saturating_mul(2).saturating_add(lo)),
                _ => (4, hi.saturating_mul(3).saturating_add(lo)),
            };
            Volume {
                hops: 2 * d,
                reducing_hops: d,
                hop_elems: hi,
                sends,
                sent,
                recvd: sent,
                reduced: if n == 2 { hi } else { hi.saturating_mul(2) },
                total_sends: 4 * (n - 1),
                total_sent: (2 * (n - 1)).saturating_mul(c),
                total_reduced: (n - 1).saturating_mul(c),
            }
        }
        (C::AllReduce, A::Rabenseifner) => {
            let p = 1usize << floor_log2(n);
            let l = floor_log2(p);
            let x = n - p;
            let fold = usize::from(x > 0);
            // Blocks of p: the first c mod p hold one element more. Rank 0 sends, receives
            // and reduces the most: all but its block in the halving, its aligned groups of
            // 2, 4, ... p/2 blocks and its block in the doubling.
            let (q, e) = (c / p, c % p);
            let groups = (1..l).fold(0usize, |a, k| {
                a.saturating_add(q.saturating_mul(1 << k).saturating_add(e.min(1 << k)))
            });
            let own = q + usize::from(e > 0);
            Volume {
                hops: 2 * l + 2 * fold,
                reducing_hops: l + fold,
                hop_elems: c.div_ceil(2),
                sends: 2 * l + fold,
                sent: c.saturating_add(groups).saturating_add(fold * c),
                recvd: c.saturating_add(groups).saturating_add(fold * c),
                reduced: own.saturating_add(groups).saturating_add(fold * c),
                total_sends: 2 * p * l + 2 * x,
                total_sent: (2 * (n - 1)).saturating_mul(c),
                total_reduced: (n - 1).saturating_mul(c),
            }
        }
        (C::AllReduce, A::OneShot) => Volume {
            hops: 1,
            reducing_hops: 1,
            hop_elems: c,
            sends: n - 1,
            sent: (n - 1).saturating_mul(c),
            recvd: (n - 1).saturating_mul(c),
            reduced: (n - 1).saturating_mul(c),
            total_sends: n * (n - 1),
            total_sent: (n * (n - 1)).saturating_mul(c),
            total_reduced: (n * (n - 1)).saturating_mul(c),
        },
        (C::AllReduce, _) => {
            let p = 1usize << floor_log2(n);
            let l = floor_log2(p);
            let x = n - p;
            let fold = usize::from(x > 0);
            // A folded-in rank's data reaches rank r after one hop per bit in which their
            // numbers differ; the longest chain adds the fold-in's hop to the exchanges only
            // where a folded rank's complement folded too (2x > p), else the exchanges
            // overlap the fold-in and only the fold-out's hop adds.
            Volume {
                hops: l + fold + usize::from(2 * x > p),
                reducing_hops: l + fold,
                hop_elems: c,
                sends: l + fold,
                sent: (l + fold).saturating_mul(c),
                recvd: (l + fold).saturating_mul(c),
                reduced: (l + fold).saturating_mul(c),
                total_sends: p * l + 2 * x,
                total_sent: (p * l + 2 * x).saturating_mul(c),
                total_reduced: (p * l + x).saturating_mul(c),
            }
        }
        (C::AllGather | C::ReduceScatter, _) => {
            let red = coll == C::ReduceScatter;
            Volume {
                hops: n - 1,
                reducing_hops: if red { n - 1 } else { 0 },
                hop_elems: c,
                sends: n - 1,
                sent: (n - 1).saturating_mul(c),
                recvd: (n - 1).saturating_mul(c),
                reduced: if red { (n - 1).saturating_mul(c) } else { 0 },
                total_sends: n * (n - 1),
                total_sent: (n * (n - 1)).saturating_mul(c),
                total_reduced: if red {
                    (n * (n - 1)).saturating_mul(c)
                } else {
                    0
                },
            }
        }
        (C::Broadcast | C::Reduce, A::Chain) => {
            let red = coll == C::Reduce;
            Volume {
                hops: n - 1,
                reducing_hops: if red { n - 1 } else { 0 },
                hop_elems: c,
                sends: if n >= 3 { 2 } else { 1 },
                sent: c,
                recvd: c,
                reduced: if red { c } else { 0 },
                total_sends: 2 * (n - 1),
                total_sent: (n - 1).saturating_mul(c),
                total_reduced: if red { (n - 1).saturating_mul(c) } else { 0 },
            }
        }
        (C::Broadcast | C::Reduce, _) => {
            // The root has ⌈log2 n⌉ children, one after the other; the deepest rank is
            // ⌊log2 n⌋ hops away.
            let k = ceil_log2(n);
            let red = coll == C::Reduce;
            Volume {
                hops: floor_log2(n),
                reducing_hops: if red { floor_log2(n) } else { 0 },
                hop_elems: c,
                sends: k,
                sent: if red { c } else { k.saturating_mul(c) },
                recvd: if red { k.saturating_mul(c) } else { c },
                reduced: if red { k.saturating_mul(c) } else { 0 },
                total_sends: 2 * (n - 1),
                total_sent: (n - 1).saturating_mul(c),
                total_reduced: if red { (n - 1).saturating_mul(c) } else { 0 },
            }
        }
        (C::AllToAll, _) => Volume {
            hops: 1,
            reducing_hops: 0,
            hop_elems: c,
            sends: n - 1,
            sent: (n - 1).saturating_mul(c),
            recvd: (n - 1).saturating_mul(c),
            reduced: 0,
            total_sends: n * (n - 1),
            total_sent: (n * (n - 1)).saturating_mul(c),
            total_reduced: 0,
        },
        (C::Barrier, _) => {
            let k = ceil_log2(n);
            Volume {
                hops: k,
                sends: k,
                total_sends: n * k,
                ..Volume::default()
            }
        }
        (C::SendRecv, _) => Volume {
            hops: 1,
            reducing_hops: 0,
            hop_elems: c,
            sends: 1,
            sent: c,
            recvd: c,
            reduced: 0,
            total_sends: 1,
            total_sent: c,
            total_reduced: 0,
        },
    };
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{compile, schedule, Op, Request};
    use std::collections::HashMap;

    /// A public caller may ask about any size (`Communicator::algorithm(AllReduce,
    /// usize::MAX)`): the closed forms saturate rather than overflow (a panic in builds with
    /// overflow checks, a wrong answer without; saturated, the volumes are only large), and the
    /// model still chooses an algorithm of the collective.
    #[test]
    fn the_largest_counts_saturate() {
        let model = crate::plan::model::CostModel::default();
        for world in [2, 3, 4, 5, 6, 8, 12, 16] {
            for per_host in [0, 1, 2, 3, 4] {
                for count in [usize::MAX, usize::MAX / 2, usize::MAX / 3 + 1] {
                    for coll in Collective::ALL {
                        // The test profile checks overflow: reaching the end is the test.
                        for algo in Algorithm::ALL {
                            volume(coll, algo, world, count, per_host);
                        }
                        let a = crate::plan::choose(coll, count, world, per_host, &model);
                        assert!(a.supports(coll), "{coll:?} n={world}: {a:?}");
                    }
                }
            }
        }
    }

    /// What the schedules themselves say, counted independently of the closed forms: the
    /// critical path in messages (a receive completes one hop after its matching send; a step
    /// starts after its dependencies and after the previous step of its stream), and per rank
    /// the sends, elements sent, received and reduced.
    fn measure(coll: Collective, algo: Algorithm, n: usize, c: usize, per_host: usize) -> Volume {
        let req = |r: usize| Request {
            coll,
            algo,
            world: n,
            rank: r,
            count: c,
            root: 0,
            is_send: r == 0,
            finalize: true,
            per_host,
        };
        let progs: Vec<_> = (0..n)
            .map(|r| compile(&schedule(&req(r)).expect("supported"), usize::MAX))
            .collect();
        // Depth (in hops) at which each step completes; None until known.
        let mut depth: Vec<Vec<Option<usize>>> =
            progs.iter().map(|p| vec![None; p.steps.len()]).collect();
        // The k-th send from r to q matches the k-th receive on q from r.
        let mut send_index: HashMap<(usize, usize, usize), (usize, usize)> = HashMap::new();
        for (r, p) in progs.iter().enumerate() {
            let mut k: HashMap<usize, usize> = HashMap::new();
            for (i, st) in p.steps.iter().enumerate() {
                if let Op::Send { peer, .. } = st.op {
                    let e = k.entry(peer).or_default();
                    send_index.insert((r, peer, *e), (r, i));
                    *e += 1;
                }
            }
        }
        loop {
            let mut progress = false;
            let mut done = true;
            for (r, p) in progs.iter().enumerate() {
                let mut sent_to: HashMap<usize, (usize, Option<usize>)> = HashMap::new();
                let mut got_from: HashMap<usize, (usize, Option<usize>)> = HashMap::new();
                for (i, st) in p.steps.iter().enumerate() {
                    let mut t = Some(0usize);
                    for &d in p.deps(i) {
                        t = t.zip(depth[r][d as usize]).map(|(a, b)| a.max(b));
                    }
                    match st.op {
                        Op::Send { peer, .. } => {
                            let e = sent_to.entry(peer).or_insert((0, Some(0)));
                            t = t.zip(e.1).map(|(a, b)| a.max(b));
                            e.0 += 1;
                            e.1 = t;
                        }
                        Op::Recv { peer, .. } => {
                            let e = got_from.entry(peer).or_insert((0, Some(0)));
                            let (sr, si) = send_index[&(peer, r, e.0)];
                            let s = depth[sr][si].map(|d| d + 1);
                            t = t.zip(e.1).map(|(a, b)| a.max(b));
                            t = t.zip(s).map(|(a, b)| a.max(b));
                            e.0 += 1;
                            e.1 = t;
                        }
                        _ => {}
                    }
                    if depth[r][i].is_none() {
                        if t.is_some() {
                            depth[r][i] = t;
                            progress = true;
                        } else {
                            done = false;
                        }
                    }
                }
            }
            if done {
                break;
            }
            assert!(progress, "{coll} {algo} n={n}: the schedules deadlock");
        }
        let mut v = Volume {
            hops: depth.iter().flatten().flatten().copied().max().unwrap_or(0),
            ..Volume::default()
        };
        for r in 0..n {
            let s = schedule(&req(r)).expect("supported");
            let (mut sends, mut sent, mut recvd, mut reduced) = (0, 0, 0, 0);
            for op in &s.ops {
                match *op {
                    Op::Send { src, .. } => {
                        sends += 1;
                        sent += src.len;
                    }
                    Op::Recv { dst, acc, .. } => {
                        recvd += dst.len;
                        if acc.is_some() {
                            reduced += dst.len;
                        }
                    }
                    _ => {}
                }
            }
            v.sends = v.sends.max(sends);
            v.sent = v.sent.max(sent);
            v.recvd = v.recvd.max(recvd);
            v.reduced = v.reduced.max(reduced);
            v.total_sends += sends;
            v.total_sent += sent;
            v.total_reduced += reduced;
        }
        v
    }

    fn cases() -> Vec<(Collective, Algorithm)> {
        let mut v = Vec::new();
        for c in Collective::ALL {
            if c == Collective::SendRecv {
                continue;
            }
            for a in Algorithm::ALL {
                if a.supports(c) {
                    v.push((c, a));
                }
            }
        }
        v
    }

    #[test]
    fn closed_forms_count_what_the_schedules_do() {
        for n in 1..=64usize {
            for c in [n, n + 1, 2 * n - 1, 3 * n + 2, 1000 + 2 * n + 1] {
                for (coll, algo) in cases() {
                    if algo == Algorithm::Hierarchical {
                        continue;
                    }
                    let got = measure(coll, algo, n, c, 0);
                    let mut want = volume(coll, algo, n, c, 0).expect("supported");
                    // The schedules carry no hop_elems / reducing_hops to count directly.
                    want.hop_elems = 0;
                    want.reducing_hops = 0;
                    assert_eq!(got, want, "{coll} {algo} n={n} count={c}");
                }
            }
        }
    }

    #[test]
    fn hierarchical_closed_forms_match_its_schedules_up_to_rounding() {
        for (l, h) in [(2, 2), (2, 3), (3, 2), (4, 4), (3, 5), (8, 2), (2, 8)] {
            let n = l * h;
            for c in [n, 3 * n + 1, 4096 + 7] {
                let got = measure(Collective::AllReduce, Algorithm::Hierarchical, n, c, l);
                let want = volume(Collective::AllReduce, Algorithm::Hierarchical, n, c, l).unwrap();
                assert_eq!(got.hops, want.hops, "l={l} h={h} c={c}");
                assert_eq!(got.sends, want.sends, "l={l} h={h} c={c}");
                assert_eq!(got.total_sends, want.total_sends, "l={l} h={h} c={c}");
                assert_eq!(got.total_sent, want.total_sent, "l={l} h={h} c={c}");
                assert_eq!(got.total_reduced, want.total_reduced, "l={l} h={h} c={c}");
                let slack = want.hops + 2;
                for (g, w, what) in [
                    (got.sent, want.sent, "sent"),
                    (got.recvd, want.recvd, "recvd"),
                    (got.reduced, want.reduced, "reduced"),
                ] {
                    assert!(
                        g.abs_diff(w) <= slack,
                        "l={l} h={h} c={c} {what}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn pipelined_hierarchical_counts_every_chunks_messages_and_the_same_bytes() {
        for (l, h) in [(2, 2), (3, 2), (2, 3)] {
            let n = l * h;
            let c = crate::plan::algo::HIER_MIN_SUB_ELEMS * l * h * 3 + 5;
            assert_eq!(hier_chunks(c, l, h), 3);
            let got = measure(Collective::AllReduce, Algorithm::Hierarchical, n, c, l);
            let want = volume(Collective::AllReduce, Algorithm::Hierarchical, n, c, l).unwrap();
            assert_eq!(got.sends, want.sends, "l={l} h={h}");
            assert_eq!(got.total_sends, want.total_sends, "l={l} h={h}");
            assert_eq!(got.total_sent, want.total_sent, "l={l} h={h}");
            assert_eq!(got.total_reduced, want.total_reduced, "l={l} h={h}");
            for (g, w, what) in [
                (got.sent, want.sent, "sent"),
                (got.recvd, want.recvd, "recvd"),
                (got.reduced, want.reduced, "reduced"),
            ] {
                assert!(g.abs_diff(w) <= 16, "l={l} h={h} {what}: {g} vs {w}");
            }
        }
    }
}
