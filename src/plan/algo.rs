//! The algorithms: one function per (collective, algorithm) pair, each a pure function of a
//! [`Request`].
//!
//! Notation in the comments: `n` ranks, this rank `r`, `right = r+1`, `left = r−1` (mod n),
//! `B(i)` = block `i` of the buffer ([`block_range`]).

use super::{block_range, Algorithm, Buf, Collective, Loc, Op, Rank, Request, Schedule};

/// Builds the schedule for a request whose algorithm supports its collective.
pub(crate) fn build(req: &Request) -> Schedule {
    let n = req.world;
    let r = req.rank;
    let c = req.count;
    let fin = req.finalize;
    match (req.coll, req.algo) {
        (Collective::AllReduce, Algorithm::Ring) => ring_all_reduce(n, r, c, fin),
        (Collective::AllReduce, Algorithm::Tree) => double_binary_tree_all_reduce(n, r, c, fin),
        (Collective::AllReduce, Algorithm::Hierarchical) => {
            hierarchical_all_reduce(n, r, c, fin, req.per_host)
        }
        (Collective::AllReduce, Algorithm::Rabenseifner) => rabenseifner_all_reduce(n, r, c, fin),
        (Collective::AllReduce, Algorithm::OneShot) => one_shot_all_reduce(n, r, c, fin),
        (Collective::AllReduce, _) => recursive_doubling_all_reduce(n, r, c, fin),
        (Collective::AllGather, _) => ring_all_gather(n, r, c),
        (Collective::ReduceScatter, _) => ring_reduce_scatter(n, r, c, fin),
        (Collective::Broadcast, Algorithm::Chain) => chain_broadcast(n, r, c, req.root),
        (Collective::Broadcast, _) => tree_broadcast(n, r, c, req.root),
        (Collective::Reduce, Algorithm::Chain) => chain_reduce(n, r, c, req.root, fin),
        (Collective::Reduce, _) => tree_reduce(n, r, c, req.root, fin),
        (Collective::AllToAll, _) => pairwise_all_to_all(n, r, c),
        (Collective::Barrier, _) => dissemination_barrier(n, r),
        (Collective::SendRecv, _) => direct(c, req.root, req.is_send),
    }
}

fn dst_block(c: usize, n: usize, i: usize) -> Loc {
    Loc::dst(block_range(c, n, i))
}

/// Descriptor-only frame to `peer` (rooted collectives send one against the direction of the
/// data so that every rank sees every neighbour's view of the call).
fn empty_send(s: &mut Schedule, peer: Rank) {
    s.push(Op::Send {
        peer,
        src: Loc::new(Buf::Dst, 0, 0),
    });
}

fn empty_recv(s: &mut Schedule, peer: Rank) {
    s.push(Op::Recv {
        peer,
        dst: Loc::new(Buf::Dst, 0, 0),
        acc: None,
    });
}

/// Ring allreduce = ring reduce-scatter + ring all-gather, in place.
///
/// ```text
/// reduce-scatter, step s = 0..n-2:  send B(r−s) → right,   recv B(r−s−1) ← left, reduce
///   after it rank r owns B(r+1) fully reduced (finalized here for Avg)
/// all-gather,     step s = 0..n-2:  send B(r+1−s) → right, recv B(r−s) ← left, copy
/// ```
/// Each rank sends exactly 2(n−1) blocks: 2(n−1)/n of the buffer when n divides it.
fn ring_all_reduce(n: usize, r: Rank, c: usize, fin: bool) -> Schedule {
    let mut s = Schedule::new();
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    ring_pass(&mut s, n, r, right, left, |i| dst_block(c, n, i % n), fin);
    s
}

/// The ring allreduce's two passes over a ring of `n` members in which this one is at
/// position `pos`, sending to `right` and receiving from `left`; `block(k)` is block
/// `k mod n` of what the ring reduces. Used by [`ring_all_reduce`] (the ranks, the whole
/// buffer) and by the rail of [`hierarchical_all_reduce`] (the hosts, one block of it).
fn ring_pass(
    s: &mut Schedule,
    n: usize,
    pos: usize,
    right: Rank,
    left: Rank,
    block: impl Fn(usize) -> Loc,
    fin: bool,
) {
    for step in 0..n - 1 {
        let send = block(pos + n - step);
        let recv = block(pos + 2 * n - step - 1);
        s.round().send(right, send).recv_reduce(left, recv, recv);
    }
    if fin {
        s.round().push(Op::Finalize {
            loc: block(pos + 1),
        });
    }
    for step in 0..n - 1 {
        let send = block(pos + 1 + n - step);
        let recv = block(pos + n - step);
        s.round().send(right, send).recv_copy(left, recv);
    }
}

/// Hierarchical allreduce, in place, for `n` ranks on hosts of `l` ranks each (ranks
/// `h·l .. (h+1)·l` on host `h`, `H = n / l` hosts); this rank is local rank `i = r mod l` of
/// host `h = r / l`. Falls back to the ring ([`super::Algorithm::Ring`]) when the layout does not divide the
/// world (`l` = 0 included), so every rank of a job makes the same choice.
///
/// The buffer is cut into `C` = [`hier_chunks`]`(c, l, H)` chunks ([`block_range`]`(c, C, k)`),
/// each chunk into `l` blocks `A(j)`, and every chunk goes through three phases:
///
/// ```text
/// 1. reduce-scatter in the host ring (right = local i+1, left = local i−1), step s = 0..l-2:
///      send A(i−s−1) → right, recv A(i−s−2) ← left, reduce;  after it local i owns A(i)
///      summed over its host
/// 2. rail i = {local rank i of every host}: ring allreduce of A(i) among its H members
///      (A(i) cut into H sub-blocks; finalized on the rail's reduce-scatter owner, once)
/// 3. all-gather in the host ring, step s = 0..l-2:
///      send A(i−s) → right, recv A(i−s−1) ← left, copy
/// ```
///
/// The chunks are software-pipelined: in program order chunk `t`'s reduce-scatter comes
/// before chunk `t−1`'s rail and chunk `t−2`'s all-gather. The engine runs every step whose
/// data is ready, one FIFO per peer and direction, so the rail (its own peers' FIFOs) starts on
/// chunk 0 while the host still reduces chunk 1, and a host-ring FIFO holding an all-gather
/// that waits for its rail has the next two chunks' reduce-scatters already done ahead of it:
/// the link between hosts never waits for memory, and the host phases hide under the link.
///
/// Per rank: (l−1)/l of the buffer in each host phase and 2(H−1)/H of `A(i)` on the rail, in
/// total 2(n−1)/n of the buffer as the ring (exactly, when `n` divides it), but only the rail
/// part crosses hosts.
pub fn hierarchical_all_reduce(n: usize, r: Rank, c: usize, fin: bool, l: usize) -> Schedule {
    if l == 0 || !n.is_multiple_of(l) {
        return ring_all_reduce(n, r, c, fin);
    }
    hierarchical_all_reduce_in_chunks(n, r, c, fin, l, hier_chunks(c, l, n / l))
}

/// [`hierarchical_all_reduce`] with the number of chunks given (at least 1; chunks beyond the
/// count are empty and send nothing): the schedule the engine runs for `chunks` =
/// [`hier_chunks`], and for tests, any other. `l` must divide `n` (`l ≥ 1`).
pub fn hierarchical_all_reduce_in_chunks(
    n: usize,
    r: Rank,
    c: usize,
    fin: bool,
    l: usize,
    chunks: usize,
) -> Schedule {
    let mut s = Schedule::new();
    let l = l.max(1);
    let hosts = n / l;
    let chunks = chunks.max(1);
    let (h, i) = (r / l, r % l);
    let right = h * l + (i + 1) % l;
    let left = h * l + (i + l - 1) % l;
    let up = ((h + 1) % hosts) * l + i;
    let down = ((h + hosts - 1) % hosts) * l + i;
    let chunk = |k: usize| block_range(c, chunks, k);
    // Block j (mod l) of chunk k.
    let a = move |k: usize, j: usize| {
        let ck = chunk(k);
        let b = block_range(ck.len(), l, j % l);
        Loc::dst(ck.start + b.start..ck.start + b.end)
    };
    for t in 0..chunks + HIER_LAG * 2 {
        if t < chunks {
            for step in 0..l - 1 {
                let send = a(t, i + 2 * l - step - 1);
                let recv = a(t, i + 2 * l - step - 2);
                s.round().send(right, send).recv_reduce(left, recv, recv);
            }
        }
        if let Some(k) = t.checked_sub(HIER_LAG).filter(|&k| k < chunks) {
            // The rail: a ring over hosts on A(i) of chunk k, cut into `hosts` sub-blocks.
            let mine = a(k, i);
            let sub = |q: usize| {
                let b = block_range(mine.len, hosts, q % hosts);
                Loc::dst(mine.start + b.start..mine.start + b.end)
            };
            ring_pass(&mut s, hosts, h, up, down, sub, fin);
        }
        if let Some(k) = t.checked_sub(2 * HIER_LAG).filter(|&k| k < chunks) {
            for step in 0..l - 1 {
                let send = a(k, i + l - step);
                let recv = a(k, i + 2 * l - step - 1);
                s.round().send(right, send).recv_copy(left, recv);
            }
        }
    }
    s
}

/// How many chunks behind the reduce-scatter the rail runs, and the all-gather behind the rail,
/// in [`hierarchical_all_reduce`]'s program order.
const HIER_LAG: usize = 1;

/// The smallest rail sub-block a chunk of [`hierarchical_all_reduce`] is cut to, in elements:
/// below it the frames' fixed costs would outweigh the pipelining.
pub const HIER_MIN_SUB_ELEMS: usize = 64 * 1024;

/// The most chunks [`hierarchical_all_reduce`] cuts a buffer into: enough that filling and
/// draining the pipeline (one chunk's host phases) is a few percent of the call.
pub const HIER_MAX_CHUNKS: usize = 16;

/// The number of chunks [`hierarchical_all_reduce`] pipelines `c` elements in, with `l` ranks
/// on each of `hosts` hosts: one per [`HIER_MIN_SUB_ELEMS`] of every rail's sub-block, at
/// least 1 and at most [`HIER_MAX_CHUNKS`].
pub fn hier_chunks(c: usize, l: usize, hosts: usize) -> usize {
    let per_chunk = HIER_MIN_SUB_ELEMS
        .saturating_mul(l.max(1))
        .saturating_mul(hosts.max(1));
    (c / per_chunk).clamp(1, HIER_MAX_CHUNKS)
}

/// Recursive doubling allreduce, in place: `p` = the largest power of two ≤ n. Ranks `p..n`
/// first hand their buffer to rank `r−p` (which reduces it in) and get the result back at the
/// end; ranks `0..p` exchange whole buffers with `r XOR mask` for mask = 1, 2, 4, ... and
/// reduce. Every rank of `0..p` computes the same operands in the same pairing, so results are
/// bitwise identical on every rank for commutative operators.
fn recursive_doubling_all_reduce(n: usize, r: Rank, c: usize, fin: bool) -> Schedule {
    let all = Loc::dst(0..c);
    folded(n, r, c, |s, p| {
        let mut mask = 1;
        while mask < p {
            let partner = r ^ mask;
            s.round().send(partner, all).recv_reduce(partner, all, all);
            mask <<= 1;
        }
        if fin {
            s.round().push(Op::Finalize { loc: all });
        }
    })
}

/// One-shot allreduce as frames, in place: the buffer to every peer, then every peer's
/// reduced in, in rank order after this rank's own.
///
/// ```text
/// round 1:  send B → every peer;  recv ← rank 0, 1, ... (not r), reduce into B each
/// ```
/// Each rank sends n − 1 copies of the buffer. Over shared memory the engine runs it through
/// slots instead ([`crate::transport::Slots`]), reducing in plain rank order.
fn one_shot_all_reduce(n: usize, r: Rank, c: usize, fin: bool) -> Schedule {
    let mut s = Schedule::new();
    let all = Loc::dst(0..c);
    let round = s.round();
    for p in (0..n).filter(|&p| p != r) {
        round.send(p, all);
    }
    for p in (0..n).filter(|&p| p != r) {
        round.recv_reduce(p, all, all);
    }
    if fin {
        s.round().push(Op::Finalize { loc: all });
    }
    s
}

/// The fold of the allreduces that run on a power of two, `p` = the largest ≤ n: ranks
/// `p..n` hand their buffer to rank `r − p` (which reduces it in) and get the result back at
/// the end; `core(s, p)` writes what ranks `0..p` do between, on the `p` ranks alone.
fn folded(n: usize, r: Rank, c: usize, core: impl FnOnce(&mut Schedule, usize)) -> Schedule {
    let mut s = Schedule::new();
    let all = Loc::dst(0..c);
    let p = if n.is_power_of_two() {
        n
    } else {
        n.next_power_of_two() / 2
    };
    let extra = n - p;
    if r >= p {
        s.round().send(r - p, all);
        s.round().recv_copy(r - p, all);
        return s;
    }
    if r < extra {
        s.round().recv_reduce(r + p, all, all);
    }
    core(&mut s, p);
    if r < extra {
        s.round().send(r + p, all);
    }
    s
}

/// Rabenseifner's allreduce, in place: `p` = the largest power of two ≤ n, whose ranks own
/// the blocks `A(i)` = [`block_range`]`(c, p, i)`; `A[lo, hi)` = blocks `lo..hi` (contiguous).
///
/// ```text
/// fold in:   ranks p..n send the buffer to r−p, which reduces it in
/// halving,   mask = 1, 2, ..., p/2:  the range [lo, hi) (first [0, p)) splits at mid; the
///            rank whose bit `mask` is 0 keeps the lower half, its partner r XOR mask the
///            upper: send the other half → r XOR mask, recv the kept half ← r XOR mask,
///            reduce; after it rank r owns A(rev(r)) reduced, rev = r's log2 p bits
///            reversed (finalized here for Avg)
/// doubling,  mask = p/2, ..., 2, 1:  send the range → r XOR mask, recv the partner's (the
///            adjacent range of the same size) ← r XOR mask, copy
/// fold out:  rank r < n − p sends the buffer to r + p
/// ```
///
/// The halving goes from the nearest partner to the farthest (MPICH's order), so the largest
/// exchanges are with `r XOR 1`, `r XOR 2`: with ranks numbered host by host, on the same host.
/// Every block is reduced on one rank only and copied from there, so results are bitwise
/// identical on every rank. Partners differ by a power of two (the fold by `p`), so every link
/// is a standing partner ([`standing_partners`]).
fn rabenseifner_all_reduce(n: usize, r: Rank, c: usize, fin: bool) -> Schedule {
    folded(n, r, c, |s, p| {
        let span = |lo: usize, hi: usize| {
            Loc::dst(block_range(c, p, lo).start..block_range(c, p, hi - 1).end)
        };
        let (mut lo, mut hi) = (0, p);
        let mut mask = 1;
        while mask < p {
            let mid = lo + (hi - lo) / 2;
            let ((keep_lo, keep_hi), (give_lo, give_hi)) = if r & mask == 0 {
                ((lo, mid), (mid, hi))
            } else {
                ((mid, hi), (lo, mid))
            };
            let keep = span(keep_lo, keep_hi);
            s.round()
                .send(r ^ mask, span(give_lo, give_hi))
                .recv_reduce(r ^ mask, keep, keep);
            (lo, hi) = (keep_lo, keep_hi);
            mask *= 2;
        }
        if fin {
            s.round().push(Op::Finalize { loc: span(lo, hi) });
        }
        let mut mask = p / 2;
        while mask >= 1 {
            let w = hi - lo;
            let (their_lo, their_hi) = if r & mask == 0 {
                (hi, hi + w)
            } else {
                (lo - w, lo)
            };
            s.round()
                .send(r ^ mask, span(lo, hi))
                .recv_copy(r ^ mask, span(their_lo, their_hi));
            (lo, hi) = (lo.min(their_lo), hi.max(their_hi));
            mask /= 2;
        }
    })
}

/// One rank's place in one tree: its parent (`None` at the root) and its children (at most
/// two).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TreeLinks {
    /// The parent rank; `None` for the root.
    pub parent: Option<Rank>,
    /// The child ranks (zero, one or two).
    pub children: Vec<Rank>,
}

/// Parent and children of position `u` (1-based, `1 ≤ u ≤ n`) in the in-order binary tree
/// over positions `1..=n`.
///
/// The untruncated tree is the one in which position `u` with lowest set bit `b` has the
/// children `u − b/2` and `u + b/2`, and the parent `u + b` (when bit `2b` of `u` is clear)
/// or `u − b`: the odd positions are its leaves and the root is `P`, the largest power of
/// two `≤ n`, whose subtree covers `1..2P`. Truncation to `1..=n` keeps the left child (it
/// is always below `u`); a missing right child `u + b/2` is replaced by the first of
/// `u + b/4, u + b/8, …, u + 1` that exists (the only part of the missing child's subtree
/// that is `≤ n` is its leftmost spine), and a position whose parent is missing climbs to
/// the first ancestor that exists. Every position with an even number therefore has one or
/// two children and every odd one none; the depth is at most `⌊log2 n⌋`.
fn inorder_tree(n: usize, u: usize) -> (Option<usize>, Vec<usize>) {
    if u == 0 || u > n {
        return (None, Vec::new());
    }
    let b = u & u.wrapping_neg();
    let mut children = Vec::new();
    if b > 1 {
        children.push(u - b / 2);
        let mut h = b / 2;
        while h > 0 && u + h > n {
            h /= 2;
        }
        if h > 0 {
            children.push(u + h);
        }
    }
    let root = 1usize << (usize::BITS - 1 - n.leading_zeros());
    if u == root {
        return (None, children);
    }
    let (mut w, mut bw) = (u, b);
    loop {
        let p = if w & (2 * bw) == 0 { w + bw } else { w - bw };
        if p <= n {
            return (Some(p), children);
        }
        w = p;
        bw *= 2;
    }
}

/// The two trees of the double binary tree allreduce over `n ≥ 1` ranks, as seen from rank
/// `r`: `[first, second]`.
///
/// The first tree is the in-order binary tree over ranks `0..n` (rank `r` at position
/// `r + 1`, `inorder_tree`): the odd ranks have children, the even ranks are leaves. The
/// second is the first mirrored (rank `r` takes the place of rank `n − 1 − r`) when `n` is
/// even, and shifted by one (rank `r` takes the place of rank `r − 1`) when `n` is odd. As in
/// NCCL's double binary tree, no rank has children in both: with `n` even every rank has
/// children in exactly one tree (the even ranks in the second), with `n` odd every rank but
/// rank 0 does (ranks `2, 4, …, n − 1` in the second), and rank 0 is a leaf in both. Both
/// trees have depth at most `⌊log2 n⌋`. (Both are empty when `r` is not a rank of the world.)
pub fn double_binary_tree(n: usize, r: Rank) -> [TreeLinks; 2] {
    if r >= n {
        return Default::default();
    }
    let first = |v: Rank| {
        let (p, ch) = inorder_tree(n, v + 1);
        (
            p.map(|p| p - 1),
            ch.into_iter().map(|c| c - 1).collect::<Vec<_>>(),
        )
    };
    let (p, ch) = first(r);
    let a = TreeLinks {
        parent: p,
        children: ch,
    };
    // The second tree's position of rank v, and the rank at a position of the second tree.
    let even = n.is_multiple_of(2);
    let to = |v: Rank| if even { n - 1 - v } else { (v + n - 1) % n };
    let from = |v: Rank| if even { n - 1 - v } else { (v + 1) % n };
    let (p, ch) = first(to(r));
    let b = TreeLinks {
        parent: p.map(from),
        children: ch.into_iter().map(from).collect(),
    };
    [a, b]
}

/// The two halves of a count-`c` buffer that the two trees carry: `[0, ⌈c/2⌉)` and
/// `[⌈c/2⌉, c)`.
pub fn double_binary_tree_halves(c: usize) -> [Loc; 2] {
    let mid = c.div_ceil(2);
    [Loc::dst(0..mid), Loc::dst(mid..c)]
}

/// NCCL's double binary tree allreduce, in place: the first tree ([`double_binary_tree`])
/// reduces the first half of the buffer ([`double_binary_tree_halves`]) towards its root and
/// broadcasts the result back down, the second tree does the same with the second half.
///
/// ```text
/// up,   per tree t:  recv H(t) ← each child, reduce;  send H(t) → parent
/// root of t:         finalize H(t) (Avg)
/// down, per tree t:  recv H(t) ← parent, copy;         send H(t) → each child
/// ```
///
/// Everything is one round, in the order (up of the first tree, up of the second, the
/// finalizes, down of the first, down of the second), so that [`compile`](super::compile)
/// interleaves segment by segment: a rank's program goes segment 0 up in both trees, segment
/// 0 down in both, segment 1 up, … The dependencies are per segment (the down receive of
/// segment k waits only for the up send of segment k), so segment k travels down while
/// later segments still travel up, and the two trees run at the same time.
///
/// Frames on a link match in order. No rank has children in both trees, so a directed link
/// `r → q` carries the up frames of at most one tree (`q` is `r`'s parent in at most one) and
/// the down frames of at most one (`r` is `q`'s parent in at most one); both ends list up
/// before down and cut ops of the same lengths into the same segments, so the k-th frame sent
/// is the k-th frame expected. No deadlock: order the frames by (segment, up before down). An
/// up frame of segment k waits for the up frames of segment k from the sender's children in
/// its tree and for frames before it on its link (earlier segments); a down frame of segment
/// k waits for the up frames of segment k of its tree, the down frame of segment k from the
/// sender's parent, and frames before it on its link (the up frame of segment k, earlier
/// segments). Every wait points to an earlier class or, within a class, to a frame of the same
/// tree further from the root (up) or nearer to it (down), so no cycle can form.
///
/// Every rank sends, and receives, each half once per tree edge it has: `|H(t)|` times (1 if
/// it has a parent in `t` + its children in `t`), summed over both trees. It has children in
/// at most one tree, so it sends at most `3⌈c/2⌉ + ⌊c/2⌋ = 2c + (c mod 2)` elements; all ranks
/// together send `2(n−1)·c`, the same total as the ring.
fn double_binary_tree_all_reduce(n: usize, r: Rank, c: usize, fin: bool) -> Schedule {
    let mut s = Schedule::new();
    let trees = double_binary_tree(n, r);
    let halves = double_binary_tree_halves(c);
    s.round();
    for (t, &h) in trees.iter().zip(&halves) {
        for &ch in &t.children {
            s.recv_reduce(ch, h, h);
        }
        if let Some(p) = t.parent {
            s.send(p, h);
        }
    }
    if fin {
        for (t, &h) in trees.iter().zip(&halves) {
            if t.parent.is_none() {
                s.push(Op::Finalize { loc: h });
            }
        }
    }
    for (t, &h) in trees.iter().zip(&halves) {
        if let Some(p) = t.parent {
            s.recv_copy(p, h);
        }
        for &ch in &t.children {
            s.send(ch, h);
        }
    }
    s
}

/// Ring all-gather: rank r's block travels n−1 hops to the right. Step 0 sends straight from
/// `Src` while `Src` is copied into block r of `Dst`.
///
/// ```text
/// step s = 0..n-2:  send B(r−s) → right,  recv B(r−s−1) ← left, copy
/// ```
fn ring_all_gather(n: usize, r: Rank, c: usize) -> Schedule {
    let mut s = Schedule::new();
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    let b = |i: usize| Loc::dst((i % n) * c..(i % n) * c + c);
    s.round().push(Op::Copy {
        src: Loc::src(0..c),
        dst: b(r),
    });
    for step in 0..n - 1 {
        let send = if step == 0 {
            Loc::src(0..c)
        } else {
            b(r + n - step)
        };
        s.round()
            .send(right, send)
            .recv_copy(left, b(r + 2 * n - step - 1));
    }
    s
}

/// Ring reduce-scatter, out of place: `Src` holds n blocks of `c`, `Dst` (c elements) ends
/// with block r reduced over all ranks. `Dst` doubles as the accumulator that travels.
///
/// ```text
/// step 0:           send Src B(r−1) → right, recv ← left: Dst = Src B(r−2) ⊕ received
/// step s = 1..n-2:  send Dst → right,         recv ← left: Dst = Src B(r−s−2) ⊕ received
/// ```
/// After step n−2, `Dst` = block r.
fn ring_reduce_scatter(n: usize, r: Rank, c: usize, fin: bool) -> Schedule {
    let mut s = Schedule::new();
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    let src_block = |i: usize| Loc::src((i % n) * c..(i % n) * c + c);
    let dst = Loc::dst(0..c);
    if n == 1 {
        s.round().push(Op::Copy {
            src: src_block(0),
            dst,
        });
    }
    for step in 0..n.saturating_sub(1) {
        let send = if step == 0 { src_block(r + n - 1) } else { dst };
        s.round()
            .send(right, send)
            .recv_reduce(left, dst, src_block(r + 2 * n - step - 2));
    }
    if fin {
        s.round().push(Op::Finalize { loc: dst });
    }
    s
}

/// Position of rank `r` in a chain or tree rooted at `root`.
fn rel(n: usize, r: Rank, root: Rank) -> usize {
    (r + n - root) % n
}

fn abs(n: usize, v: usize, root: Rank) -> Rank {
    (v + root) % n
}

/// Pipelined chain broadcast: root → root+1 → … → root−1; each rank forwards segment k while
/// receiving segment k+1. Every non-root first sends a descriptor-only frame to its parent.
fn chain_broadcast(n: usize, r: Rank, c: usize, root: Rank) -> Schedule {
    let mut s = Schedule::new();
    let v = rel(n, r, root);
    let all = Loc::dst(0..c);
    let next = (v + 1 < n).then(|| abs(n, v + 1, root));
    if v > 0 {
        let prev = abs(n, v - 1, root);
        empty_send(s.round(), prev);
        s.round().recv_copy(prev, all);
    } else {
        s.round();
    }
    if let Some(next) = next {
        s.send(next, all);
        s.round();
        empty_recv(&mut s, next);
    }
    s
}

/// Children of relative position `v` in a binomial tree over `n` (largest subtree first), and
/// its parent.
fn binomial(n: usize, v: usize) -> (Option<usize>, Vec<usize>) {
    let mut mask = 1;
    let mut parent = None;
    while mask < n {
        if v & mask != 0 {
            parent = Some(v - mask);
            break;
        }
        mask <<= 1;
    }
    let mut children = Vec::new();
    mask >>= 1;
    while mask > 0 {
        if v + mask < n {
            children.push(v + mask);
        }
        mask >>= 1;
    }
    (parent, children)
}

/// Binomial-tree broadcast: ⌈log2 n⌉ rounds; a rank receives from its parent, then sends to
/// its children, largest subtree first.
fn tree_broadcast(n: usize, r: Rank, c: usize, root: Rank) -> Schedule {
    let mut s = Schedule::new();
    let v = rel(n, r, root);
    let all = Loc::dst(0..c);
    let (parent, children) = binomial(n, v);
    if let Some(p) = parent {
        let p = abs(n, p, root);
        empty_send(s.round(), p);
        s.round().recv_copy(p, all);
    }
    s.round();
    for &ch in &children {
        s.send(abs(n, ch, root), all);
    }
    for &ch in &children {
        empty_recv(s.round(), abs(n, ch, root));
    }
    s
}

/// Pipelined chain reduce towards the root: root−1 → … → root+1 → root; each rank reduces
/// segment k from its child into its buffer and forwards it while receiving segment k+1.
/// Every rank with a child first sends it a descriptor-only frame.
fn chain_reduce(n: usize, r: Rank, c: usize, root: Rank, fin: bool) -> Schedule {
    let mut s = Schedule::new();
    let v = rel(n, r, root);
    let all = Loc::dst(0..c);
    let child = (v + 1 < n).then(|| abs(n, v + 1, root));
    let parent = (v > 0).then(|| abs(n, v - 1, root));
    if let Some(ch) = child {
        empty_send(s.round(), ch);
    }
    s.round();
    if let Some(ch) = child {
        s.recv_reduce(ch, all, all);
    }
    if let Some(p) = parent {
        s.send(p, all);
        empty_recv(s.round(), p);
    } else if fin {
        s.round().push(Op::Finalize { loc: all });
    }
    s
}

/// Binomial-tree reduce: a rank reduces in each child's subtree result (smallest subtree
/// first), then sends to its parent. The root finalizes.
fn tree_reduce(n: usize, r: Rank, c: usize, root: Rank, fin: bool) -> Schedule {
    let mut s = Schedule::new();
    let v = rel(n, r, root);
    let all = Loc::dst(0..c);
    let (parent, mut children) = binomial(n, v);
    children.reverse();
    s.round();
    for &ch in &children {
        empty_send(&mut s, abs(n, ch, root));
    }
    for &ch in &children {
        s.round().recv_reduce(abs(n, ch, root), all, all);
    }
    if let Some(p) = parent {
        let p = abs(n, p, root);
        s.round().send(p, all);
        empty_recv(s.round(), p);
    } else if fin {
        s.round().push(Op::Finalize { loc: all });
    }
    s
}

/// Pairwise all-to-all: block r is copied locally; in step s = 1..n-1 rank r sends block r+s
/// to rank r+s and receives block r−s from rank r−s.
fn pairwise_all_to_all(n: usize, r: Rank, c: usize) -> Schedule {
    let mut s = Schedule::new();
    let blk = |i: usize| i * c..i * c + c;
    s.round().push(Op::Copy {
        src: Loc::src(blk(r)),
        dst: Loc::dst(blk(r)),
    });
    for step in 1..n {
        let to = (r + step) % n;
        let from = (r + n - step) % n;
        s.round()
            .send(to, Loc::src(blk(to)))
            .recv_copy(from, Loc::dst(blk(from)));
    }
    s
}

/// Pairwise all-to-all of blocks of any size, in [`pairwise_all_to_all`]'s rounds: rank `r` of
/// `n` copies its own block, then in step s = 1..n-1 sends its block for rank r+s and receives
/// rank r−s's block. Block j of `Src` is elements `send[j]..send[j + 1]`, block i of `Dst` is
/// `recv[i]..recv[i + 1]` (`send` and `recv` are the blocks' starts, `n + 1` each: prefix sums
/// of the counts). An empty block still moves a descriptor-only frame, so that every pair
/// exchanges one and a pair that disagrees about its block meets (the engine puts the block's
/// size in each frame's header). Each rank's schedule depends on its own counts only; rank
/// j's `recv[r + 1] - recv[r]` must be rank r's `send[j + 1] - send[j]` for the frames to
/// match.
pub fn pairwise_all_to_all_v(n: usize, r: Rank, send: &[usize], recv: &[usize]) -> Schedule {
    let mut s = Schedule::new();
    s.round().push(Op::Copy {
        src: Loc::src(send[r]..send[r + 1]),
        dst: Loc::dst(recv[r]..recv[r + 1]),
    });
    for step in 1..n {
        let to = (r + step) % n;
        let from = (r + n - step) % n;
        s.round()
            .push(Op::Send {
                peer: to,
                src: Loc::src(send[to]..send[to + 1]),
            })
            .push(Op::Recv {
                peer: from,
                dst: Loc::dst(recv[from]..recv[from + 1]),
                acc: None,
            });
    }
    s
}

/// Dissemination barrier: in round k rank r sends an empty frame to r+2^k and waits for one
/// from r−2^k; after ⌈log2 n⌉ rounds every rank has heard, transitively, from every other.
fn dissemination_barrier(n: usize, r: Rank) -> Schedule {
    let mut s = Schedule::new();
    let mut d = 1;
    while d < n {
        s.round();
        empty_send(&mut s, (r + d) % n);
        empty_recv(&mut s, (r + n - d) % n);
        d <<= 1;
    }
    s
}

/// Point-to-point: the sender sends `Src[0..c]`, the receiver copies into `Dst[0..c]`.
fn direct(c: usize, peer: Rank, is_send: bool) -> Schedule {
    let mut s = Schedule::new();
    if is_send {
        s.round().send(peer, Loc::src(0..c));
    } else {
        s.round().recv_copy(peer, Loc::dst(0..c));
    }
    s
}

/// The ranks `r` exchanges with in the schedules chosen by default or forced by
/// `DSPARK_ALGO` for every collective but all-to-all and send/recv, over `n` ranks: every
/// rank at a distance of a power of two either way round the ring (ring and chain neighbours
/// at 1; recursive doubling and its fold, binomial trees of any root and the dissemination
/// barrier at 2^k) and its parent and children in both trees of [`double_binary_tree`]:
/// at most 2⌈log2 n⌉ + 6 ranks, sorted, without `r`. The relation is symmetric, so the two
/// ends of every link agree that it exists. A transport connects these at init and every
/// other pair (all-to-all, send/recv, the hierarchical allreduce's rails) on first use.
pub fn standing_partners(n: usize, r: Rank) -> Vec<Rank> {
    if r >= n {
        return Vec::new();
    }
    let mut v = Vec::new();
    let mut d = 1;
    while d < n {
        v.push((r + d) % n);
        v.push((r + n - d) % n);
        d *= 2;
    }
    for t in double_binary_tree(n, r) {
        v.extend(t.parent);
        v.extend(t.children);
    }
    v.retain(|&p| p != r);
    v.sort_unstable();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{compile, Program};

    fn trees(n: usize) -> Vec<[TreeLinks; 2]> {
        (0..n).map(|r| double_binary_tree(n, r)).collect()
    }

    fn floor_log2(n: usize) -> usize {
        (usize::BITS - 1 - n.leading_zeros()) as usize
    }

    #[test]
    fn standing_partners_are_symmetric_few_and_cover_every_schedule_but_all_to_all() {
        for n in 1..=300usize {
            let all: Vec<Vec<Rank>> = (0..n).map(|r| standing_partners(n, r)).collect();
            let log = usize::BITS as usize - (n.max(2) - 1).leading_zeros() as usize;
            for (r, ps) in all.iter().enumerate() {
                assert!(
                    ps.len() <= 2 * log + 6,
                    "n {n} rank {r}: {} partners",
                    ps.len()
                );
                for &p in ps {
                    assert!(p < n && p != r);
                    assert!(all[p].contains(&r), "n {n}: {r} -> {p} but not back");
                }
            }
        }
        for n in 1..=64usize {
            for algo in Algorithm::ALL {
                // One-shot talks to every peer, as all-to-all does (over shared memory through
                // slots, not rings; as frames only where forced): connected on first use.
                if matches!(
                    algo,
                    Algorithm::Pairwise
                        | Algorithm::Direct
                        | Algorithm::Hierarchical
                        | Algorithm::OneShot
                ) {
                    continue;
                }
                for coll in Collective::ALL {
                    if !algo.supports(coll) {
                        continue;
                    }
                    let roots = if coll.rooted() { n } else { 1 };
                    for root in 0..roots {
                        for r in 0..n {
                            let req = Request {
                                coll,
                                algo,
                                world: n,
                                rank: r,
                                count: 2 * n + 3,
                                root,
                                is_send: false,
                                finalize: true,
                                per_host: 0,
                            };
                            let ps = standing_partners(n, r);
                            for op in build(&req).rounds().flatten() {
                                if let Some(p) = op.peer() {
                                    assert!(
                                        ps.contains(&p),
                                        "{algo} {} n {n} root {root}: rank {r} talks to {p}",
                                        coll.name()
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn double_binary_trees_are_two_spanning_binary_trees_in_which_no_rank_has_children_twice() {
        for n in 1..=2048 {
            let all = trees(n);
            for t in 0..2 {
                let roots: Vec<Rank> = (0..n).filter(|&r| all[r][t].parent.is_none()).collect();
                assert_eq!(roots.len(), 1, "n={n} tree {t}: roots {roots:?}");
                for (r, links) in all.iter().enumerate() {
                    let l = &links[t];
                    assert!(l.children.len() <= 2, "n={n} tree {t} rank {r}: {l:?}");
                    for &c in &l.children {
                        assert!(c < n && c != r, "n={n} tree {t} rank {r}: {l:?}");
                        assert_eq!(all[c][t].parent, Some(r), "n={n} tree {t} child {c} of {r}");
                    }
                    if let Some(p) = l.parent {
                        assert!(
                            all[p][t].children.contains(&r),
                            "n={n} tree {t}: {r}'s parent {p} does not list it"
                        );
                    }
                    // Climbing reaches the root within the depth bound (so there is no cycle).
                    let (mut v, mut depth) = (r, 0);
                    while let Some(p) = all[v][t].parent {
                        v = p;
                        depth += 1;
                        assert!(depth <= floor_log2(n), "n={n} tree {t}: rank {r} too deep");
                    }
                    assert_eq!(v, roots[0]);
                }
            }
            for (r, links) in all.iter().enumerate() {
                let interior = links.iter().filter(|l| !l.children.is_empty()).count();
                let want = if n == 1 || (n % 2 == 1 && r == 0) {
                    0
                } else {
                    1
                };
                assert_eq!(interior, want, "n={n} rank {r}: {links:?}");
            }
        }
    }

    #[test]
    fn double_binary_trees_of_eight_and_seven_ranks_are_mirrored_and_shifted() {
        let kids = |n: usize, t: usize| -> Vec<Vec<Rank>> {
            trees(n).iter().map(|l| l[t].children.clone()).collect()
        };
        // n = 8. First tree: 7 → 3 → {1, 5}, 1 → {0, 2}, 5 → {4, 6}; the second its mirror.
        assert_eq!(
            kids(8, 0),
            vec![
                vec![],
                vec![0, 2],
                vec![],
                vec![1, 5],
                vec![],
                vec![4, 6],
                vec![],
                vec![3]
            ]
        );
        assert_eq!(
            kids(8, 1),
            vec![
                vec![4],
                vec![],
                vec![3, 1],
                vec![],
                vec![6, 2],
                vec![],
                vec![7, 5],
                vec![]
            ]
        );
        assert_eq!(double_binary_tree(8, 7)[0].parent, None);
        assert_eq!(double_binary_tree(8, 0)[1].parent, None);
        // n = 7. First tree: 3 → {1, 5}, 1 → {0, 2}, 5 → {4, 6}; the second shifted by one:
        // 4 → {2, 6}, 2 → {1, 3}, 6 → {5, 0}. Rank 0 is a leaf in both.
        assert_eq!(
            kids(7, 0),
            vec![
                vec![],
                vec![0, 2],
                vec![],
                vec![1, 5],
                vec![],
                vec![4, 6],
                vec![]
            ]
        );
        assert_eq!(
            kids(7, 1),
            vec![
                vec![],
                vec![],
                vec![1, 3],
                vec![],
                vec![2, 6],
                vec![],
                vec![5, 0]
            ]
        );
        assert_eq!(double_binary_tree(7, 4)[1].parent, None);
        assert_eq!(
            double_binary_tree(1, 0),
            [TreeLinks::default(), TreeLinks::default()]
        );
    }

    /// Steps `i` depends on, directly or through other steps.
    fn ancestors(p: &Program, i: usize) -> Vec<bool> {
        let mut seen = vec![false; p.steps.len()];
        let mut stack = vec![i];
        while let Some(j) = stack.pop() {
            for &d in p.deps(j) {
                if !seen[d as usize] {
                    seen[d as usize] = true;
                    stack.push(d as usize);
                }
            }
        }
        seen
    }

    #[test]
    fn a_tree_segment_goes_down_while_later_segments_still_go_up() {
        // 8 ranks, 40 elements: each half is 20, 5 segments of 4.
        let (n, c, seg) = (8, 40, 4);
        let halves = double_binary_tree_halves(c);
        for r in 0..n {
            let s = double_binary_tree_all_reduce(n, r, c, true);
            let p = compile(&s, seg);
            for (t, links) in double_binary_tree(n, r).iter().enumerate() {
                let h = halves[t];
                let seg_of = |l: Loc| (l.start - h.start) / seg;
                let in_half = |l: Loc| l.start >= h.start && l.start < h.start + h.len;
                // The first step that moves segment 0 down: the receive from the parent, or
                // (at the root) the first send to a child.
                let first_down = p.steps.iter().position(|st| match st.op {
                    Op::Recv { peer, dst, .. } => {
                        Some(peer) == links.parent && in_half(dst) && seg_of(dst) == 0
                    }
                    Op::Send { peer, src } => {
                        links.parent.is_none()
                            && links.children.contains(&peer)
                            && in_half(src)
                            && seg_of(src) == 0
                    }
                    _ => false,
                });
                let Some(first_down) = first_down else {
                    assert!(links.parent.is_none() && links.children.is_empty());
                    continue;
                };
                let before = ancestors(&p, first_down);
                for (j, st) in p.steps.iter().enumerate() {
                    let up = match st.op {
                        Op::Recv { peer, dst, .. } => {
                            links.children.contains(&peer) && in_half(dst)
                        }
                        Op::Send { peer, src } => Some(peer) == links.parent && in_half(src),
                        _ => false,
                    };
                    let l = match st.op {
                        Op::Recv { dst, .. } => dst,
                        Op::Send { src, .. } => src,
                        _ => continue,
                    };
                    if up && seg_of(l) > 0 {
                        assert!(
                            !before[j],
                            "rank {r} tree {t}: segment 0 down waits for {:?}",
                            st.op
                        );
                        // ... and it comes after it in program order, so it is not a
                        // dependency merely by accident of order.
                        assert!(j > first_down, "rank {r} tree {t}: {:?}", st.op);
                    }
                }
            }
        }
    }
}
