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
    let b = |i: usize| dst_block(c, n, i % n);
    for step in 0..n - 1 {
        let send = b(r + n - step);
        let recv = b(r + 2 * n - step - 1);
        s.round().send(right, send).recv_reduce(left, recv, recv);
    }
    if fin {
        s.round().push(Op::Finalize { loc: b(r + 1) });
    }
    for step in 0..n - 1 {
        let send = b(r + 1 + n - step);
        let recv = b(r + n - step);
        s.round().send(right, send).recv_copy(left, recv);
    }
    s
}

/// Recursive doubling allreduce, in place: `p` = the largest power of two ≤ n. Ranks `p..n`
/// first hand their buffer to rank `r−p` (which reduces it in) and get the result back at the
/// end; ranks `0..p` exchange whole buffers with `r XOR mask` for mask = 1, 2, 4, ... and
/// reduce. Every rank of `0..p` computes the same operands in the same pairing, so results are
/// bitwise identical on every rank for commutative operators.
fn recursive_doubling_all_reduce(n: usize, r: Rank, c: usize, fin: bool) -> Schedule {
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
    let mut mask = 1;
    while mask < p {
        let partner = r ^ mask;
        s.round().send(partner, all).recv_reduce(partner, all, all);
        mask <<= 1;
    }
    if fin {
        s.round().push(Op::Finalize { loc: all });
    }
    if r < extra {
        s.round().send(r + p, all);
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
