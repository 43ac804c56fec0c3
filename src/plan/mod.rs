//! Collective schedules as data.
//!
//! A collective algorithm is a pure function from (world size, rank, element count, root) to a
//! [`Schedule`]: the list of [`Op`]s one rank performs — send this range to that peer, receive
//! from that peer and reduce into this range, receive and copy, copy locally, finalize (the
//! division of `Avg`). This module has **no networking code, no clock and no FFI**; it forbids
//! `unsafe`. The [`sim`] simulator runs every rank's schedule in one thread with a seeded choice
//! of which rank steps next, and checks results, bytes moved and the absence of deadlock.
//!
//! # Vocabulary
//!
//! * A rank's buffers are [`Buf::Src`] (the caller's read-only input, when the collective is
//!   out of place) and [`Buf::Dst`] (the output; in-place collectives use only `Dst`).
//!   [`Loc`] is a range of elements in one of them.
//! * A *block* is the part of the buffer one rank owns in ring algorithms (block `i` of a
//!   count-`c` buffer over `n` ranks is [`block_range`]`(c, n, i)`: the first `c % n` blocks
//!   hold one element more).
//! * A *round* groups ops that may proceed concurrently (a ring step's send and receive).
//! * A *segment* is the pipeline unit: [`compile`] cuts every op into segments of at most
//!   `seg_elems` elements and interleaves the segments of a round, so receiving segment k
//!   overlaps sending segment k+1 and reducing segment k-1.
//!
//! # Execution semantics (what the engine and the simulator both implement)
//!
//! A compiled [`Program`] is a list of [`Step`]s in program order. Each step lists the earlier
//! steps it depends on ([`Program::deps`]): read-after-write, write-after-read and
//! write-after-write on overlapping element ranges. Steps that talk to the same peer in the same
//! direction complete in program order (one FIFO stream per ordered pair of ranks); a send
//! step's frame is matched by the *k*-th receive step from that peer on the other rank.
//! Descriptor-only (empty) steps touch no elements but are ordered all the same: an empty
//! receive depends on the previous empty receive, and an empty send on the last empty receive
//! before it — that is what makes a barrier wait for its earlier rounds. A step may start
//! once all its dependencies are complete. Links buffer at least one frame, so a send may
//! complete before the matching receive starts. Every frame, even an empty one, carries the
//! collective's descriptor so that ranks which disagree about a call detect it.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

pub mod algo;
pub mod model;
pub mod sim;

/// A rank number.
pub type Rank = usize;

/// Which of a rank's two buffers a [`Loc`] refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buf {
    /// The read-only input of an out-of-place collective.
    Src,
    /// The output (and, for in-place collectives, the input).
    Dst,
}

/// A range of elements in one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    /// The buffer.
    pub buf: Buf,
    /// First element.
    pub start: usize,
    /// Number of elements.
    pub len: usize,
}

impl Loc {
    /// `len` elements of `buf` from `start`.
    pub const fn new(buf: Buf, start: usize, len: usize) -> Self {
        Loc { buf, start, len }
    }

    /// A range of `Dst`.
    pub const fn dst(range: Range<usize>) -> Self {
        Loc {
            buf: Buf::Dst,
            start: range.start,
            len: range.end - range.start,
        }
    }

    /// A range of `Src`.
    pub const fn src(range: Range<usize>) -> Self {
        Loc {
            buf: Buf::Src,
            start: range.start,
            len: range.end - range.start,
        }
    }

    /// The element range.
    pub const fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }

    /// The sub-range `[off, off + len)` of this location.
    pub const fn sub(&self, off: usize, len: usize) -> Loc {
        Loc {
            buf: self.buf,
            start: self.start + off,
            len,
        }
    }
}

/// One operation of a rank's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Send the elements at `src` to `peer`.
    Send {
        /// Destination rank.
        peer: Rank,
        /// What to send.
        src: Loc,
    },
    /// Receive `dst.len` elements from `peer`. With `acc: None` they are copied into `dst`;
    /// with `acc: Some(a)` the result is `dst = a ⊕ received` (`a` may equal `dst`: in-place
    /// reduction; `a.len == dst.len`).
    Recv {
        /// Source rank.
        peer: Rank,
        /// Where the result goes.
        dst: Loc,
        /// The accumulator to reduce with, if this is a reducing receive.
        acc: Option<Loc>,
    },
    /// Copy `src` into `dst` locally (same length).
    Copy {
        /// From.
        src: Loc,
        /// To.
        dst: Loc,
    },
    /// Apply the operator's final step to `loc` (`Avg`: divide by the world size; other
    /// operators: nothing).
    Finalize {
        /// The range to finalize.
        loc: Loc,
    },
}

impl Op {
    /// The peer this op talks to, if any.
    pub fn peer(&self) -> Option<Rank> {
        match *self {
            Op::Send { peer, .. } | Op::Recv { peer, .. } => Some(peer),
            _ => None,
        }
    }

    /// Number of elements the op moves or touches.
    pub fn len(&self) -> usize {
        match *self {
            Op::Send { src, .. } => src.len,
            Op::Recv { dst, .. } => dst.len,
            Op::Copy { src, .. } => src.len,
            Op::Finalize { loc } => loc.len,
        }
    }

    /// Whether the op touches no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same op restricted to elements `[off, off + len)` of it.
    pub fn sub(&self, off: usize, len: usize) -> Op {
        match *self {
            Op::Send { peer, src } => Op::Send {
                peer,
                src: src.sub(off, len),
            },
            Op::Recv { peer, dst, acc } => Op::Recv {
                peer,
                dst: dst.sub(off, len),
                acc: acc.map(|a| a.sub(off, len)),
            },
            Op::Copy { src, dst } => Op::Copy {
                src: src.sub(off, len),
                dst: dst.sub(off, len),
            },
            Op::Finalize { loc } => Op::Finalize {
                loc: loc.sub(off, len),
            },
        }
    }
}

/// One rank's schedule for one collective: ops in program order, grouped into rounds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// The ops, in program order.
    pub ops: Vec<Op>,
    /// `round_starts[i]` is the index in `ops` of the first op of round `i` (ascending; the
    /// first is 0 when there are ops).
    pub round_starts: Vec<usize>,
}

impl Schedule {
    /// An empty schedule.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a new round: ops pushed after this may not overlap ops of earlier rounds in the
    /// segment interleaving (they still overlap in time wherever dependencies allow).
    pub fn round(&mut self) -> &mut Self {
        if self.round_starts.last() != Some(&self.ops.len()) {
            self.round_starts.push(self.ops.len());
        }
        self
    }

    /// Appends an op to the current round. Zero-length `Copy` and `Finalize` ops are dropped;
    /// zero-length `Send`/`Recv` ops are kept (they carry a descriptor-only frame).
    pub fn push(&mut self, op: Op) -> &mut Self {
        if matches!(op, Op::Copy { .. } | Op::Finalize { .. }) && op.is_empty() {
            return self;
        }
        if self.round_starts.is_empty() {
            self.round_starts.push(0);
        }
        self.ops.push(op);
        self
    }

    /// `Send` to `peer`, skipped when `src` is empty.
    pub fn send(&mut self, peer: Rank, src: Loc) -> &mut Self {
        if src.len > 0 {
            self.push(Op::Send { peer, src });
        }
        self
    }

    /// Copying `Recv` from `peer`, skipped when `dst` is empty.
    pub fn recv_copy(&mut self, peer: Rank, dst: Loc) -> &mut Self {
        if dst.len > 0 {
            self.push(Op::Recv {
                peer,
                dst,
                acc: None,
            });
        }
        self
    }

    /// Reducing `Recv` from `peer` (`dst = acc ⊕ received`), skipped when `dst` is empty.
    pub fn recv_reduce(&mut self, peer: Rank, dst: Loc, acc: Loc) -> &mut Self {
        if dst.len > 0 {
            self.push(Op::Recv {
                peer,
                dst,
                acc: Some(acc),
            });
        }
        self
    }

    /// The ops grouped by round.
    pub fn rounds(&self) -> impl Iterator<Item = &[Op]> + '_ {
        let ends = self
            .round_starts
            .iter()
            .skip(1)
            .copied()
            .chain(std::iter::once(self.ops.len()));
        self.round_starts
            .iter()
            .zip(ends)
            .map(move |(&s, e)| &self.ops[s..e])
    }

    /// Payload elements this rank sends.
    pub fn elems_sent(&self) -> usize {
        self.ops
            .iter()
            .map(|op| {
                if let Op::Send { src, .. } = op {
                    src.len
                } else {
                    0
                }
            })
            .sum()
    }
}

/// The collectives, with their one-byte wire codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Collective {
    /// In-place allreduce.
    AllReduce,
    /// All-gather (recv = send × world, rank order).
    AllGather,
    /// Reduce-scatter (send = recv × world; rank r gets block r).
    ReduceScatter,
    /// Broadcast from a root.
    Broadcast,
    /// Reduce to a root.
    Reduce,
    /// All-to-all (block j of send goes to rank j).
    AllToAll,
    /// Point-to-point send / receive.
    SendRecv,
    /// Barrier.
    Barrier,
}

impl Collective {
    /// The one algorithm that implements this collective, the one-shot all_reduce aside
    /// (which the transport's slot size settles, never the model), or `None` where the cost
    /// model chooses among several (all_reduce, broadcast, reduce). Read from
    /// [`Algorithm::supports`], so that a new algorithm changes it.
    pub const fn sole_algorithm(self) -> Option<Algorithm> {
        const SOLE: [Option<Algorithm>; Collective::ALL.len()] = {
            let mut t = [None; Collective::ALL.len()];
            let mut i = 0;
            while i < Collective::ALL.len() {
                let c = Collective::ALL[i];
                let (mut n, mut j) = (0, 0);
                while j < Algorithm::ALL.len() {
                    let a = Algorithm::ALL[j];
                    if !matches!(a, Algorithm::OneShot) && a.supports(c) {
                        n += 1;
                        t[c as usize] = Some(a);
                    }
                    j += 1;
                }
                if n != 1 {
                    t[c as usize] = None;
                }
                i += 1;
            }
            t
        };
        SOLE[self as usize]
    }

    /// All collectives, in wire-code order.
    pub const ALL: [Collective; 8] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::AllToAll,
        Collective::SendRecv,
        Collective::Barrier,
    ];

    /// The name used in the API, the bench CLI and errors (`all_reduce`, `send_recv`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::AllToAll => "all_to_all",
            Collective::SendRecv => "send_recv",
            Collective::Barrier => "barrier",
        }
    }

    /// One-byte wire code.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The collective with wire code `code`.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }

    /// Whether the collective reduces (uses a [`crate::ReduceOp`]).
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        )
    }

    /// Whether the collective has a root.
    pub const fn rooted(self) -> bool {
        matches!(self, Collective::Broadcast | Collective::Reduce)
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The algorithms. Which one runs is chosen by [`choose`] from the cost model, or forced
/// (`DSPARK_ALGO`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring: reduce-scatter then all-gather around the ring (bandwidth-optimal: each rank
    /// sends 2(n−1)/n of the buffer for allreduce). Also all-gather and reduce-scatter alone.
    Ring,
    /// Recursive doubling: log2(n) exchanges of the whole buffer (one exchange for 2 ranks);
    /// non-powers of two fold the extra ranks in first and out last. For small messages.
    RecursiveDoubling,
    /// Pipelined chain (broadcast, reduce): root → root+1 → … ; segments stream down the
    /// chain, so the time approaches one buffer transfer for large messages.
    Chain,
    /// Binomial tree (broadcast, reduce): ⌈log2 n⌉ rounds, for small messages.
    BinomialTree,
    /// Pairwise exchange (all-to-all): in step s rank r sends to r+s and receives from r−s.
    Pairwise,
    /// Dissemination (barrier): in round k rank r signals r+2^k and waits for r−2^k.
    Dissemination,
    /// A single point-to-point transfer.
    Direct,
    /// Trees (`tree`). all_reduce: NCCL's double binary tree — two binary trees over the ranks
    /// in which no rank has children in both ([`algo::double_binary_tree`]); each reduces one
    /// half of the buffer towards its root and broadcasts it back down, segments pipelined so
    /// that early segments travel down while later ones still travel up: ⌊log2 n⌋ hops each
    /// way, at most 2·count + 1 elements sent per rank. broadcast, reduce: the binomial tree,
    /// the same schedules as [`Algorithm::BinomialTree`].
    Tree,
    /// Hierarchical all_reduce (`hier`) for several hosts with several ranks each
    /// ([`Request::per_host`]): a ring reduce-scatter among the ranks of each host (local rank
    /// `i` ends with block `i` of the host's sum), a ring allreduce of block `i` among the
    /// local ranks `i` of every host (one *rail* per local rank, all rails at once), and a
    /// ring all-gather within each host, pipelined in chunks so that the three phases overlap
    /// and the link between hosts does not wait for memory ([`algo::hierarchical_all_reduce`]).
    /// The same
    /// 2(n−1)/n of the buffer per rank as the ring, in 2(L−1) + 2(H−1) steps instead of
    /// 2(n−1) (L ranks per host, H hosts), with only 2(H−1)/(H·L) of the buffer per rank
    /// crossing between hosts, spread over every rank instead of the ring's few host-boundary
    /// links. Without a usable layout (no host information, uneven hosts, hosts whose ranks
    /// are not numbered contiguously) it runs the ring.
    Hierarchical,
    /// Rabenseifner's allreduce (`rabenseifner`): a reduce-scatter by recursive halving
    /// (log2 p exchanges of half, a quarter, ... of the buffer with `r XOR p/2`, `r XOR p/4`,
    /// ...; rank `r` ends owning block `r` of `p`) then an all-gather by recursive doubling
    /// (the same exchanges in reverse, copying); `p` is the largest power of two ≤ n and the
    /// ranks `p..n` fold in first and out last as in [`Algorithm::RecursiveDoubling`]. The
    /// ring's bytes (2(p−1)/p of the buffer per rank, plus the fold) in 2·log2 p steps instead
    /// of 2(n−1), each between a pair of ranks rather than around the whole ring.
    Rabenseifner,
    /// One-shot allreduce (`one_shot`), for small buffers: every rank hands its whole buffer
    /// to every other once and reduces the n contributions itself — one step, no dependent
    /// hops. Over shared memory ([`crate::transport::Slots`]) each rank writes it once into a
    /// slot of its own that every peer reads, and every rank reduces in rank order, so
    /// results are bitwise identical everywhere; the engine chooses it there for buffers that
    /// fit a slot. Elsewhere it runs as frames (n − 1 sends of the buffer per rank), its own
    /// contribution first, then the others in rank order.
    OneShot,
}

impl Algorithm {
    /// Every algorithm, in wire-code order.
    pub const ALL: [Algorithm; 11] = [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Chain,
        Algorithm::BinomialTree,
        Algorithm::Pairwise,
        Algorithm::Dissemination,
        Algorithm::Direct,
        Algorithm::Tree,
        Algorithm::Hierarchical,
        Algorithm::Rabenseifner,
        Algorithm::OneShot,
    ];

    /// Wire code (0..=10; fits in four bits).
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The algorithm with wire code `code`.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }

    /// Name used in `DSPARK_ALGO`, bench headers and logs.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::Chain => "chain",
            Algorithm::BinomialTree => "binomial_tree",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Dissemination => "dissemination",
            Algorithm::Direct => "direct",
            Algorithm::Tree => "tree",
            Algorithm::Hierarchical => "hier",
            Algorithm::Rabenseifner => "rabenseifner",
            Algorithm::OneShot => "one_shot",
        }
    }

    /// Parses a name as [`Algorithm::name`] prints it (also `rd`, `binomial`, `dbt`, ...).
    pub fn from_name(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ring" => Some(Algorithm::Ring),
            "recursive_doubling" | "rd" | "recursive-doubling" => {
                Some(Algorithm::RecursiveDoubling)
            }
            "chain" | "pipeline" => Some(Algorithm::Chain),
            "binomial_tree" | "binomial" | "binomial-tree" => Some(Algorithm::BinomialTree),
            "tree" | "double_binary_tree" | "double-binary-tree" | "dbt" => Some(Algorithm::Tree),
            "pairwise" => Some(Algorithm::Pairwise),
            "dissemination" => Some(Algorithm::Dissemination),
            "direct" => Some(Algorithm::Direct),
            "hier" | "hierarchical" => Some(Algorithm::Hierarchical),
            "rabenseifner" | "halving_doubling" | "halving-doubling" | "rhd" => {
                Some(Algorithm::Rabenseifner)
            }
            "one_shot" | "oneshot" | "one-shot" => Some(Algorithm::OneShot),
            _ => None,
        }
    }

    /// The collectives this algorithm implements, by name (`"broadcast, reduce"`).
    pub fn collectives(self) -> String {
        Collective::ALL
            .iter()
            .filter(|c| self.supports(**c))
            .map(|c| c.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Whether this algorithm implements `coll`.
    pub const fn supports(self, coll: Collective) -> bool {
        use Algorithm::*;
        use Collective::*;
        matches!(
            (self, coll),
            (Ring, AllReduce | AllGather | ReduceScatter)
                | (
                    RecursiveDoubling | Hierarchical | Rabenseifner | OneShot,
                    AllReduce
                )
                | (Chain | BinomialTree, Broadcast | Reduce)
                | (Tree, AllReduce | Broadcast | Reduce)
                | (Pairwise, AllToAll)
                | (Dissemination, Barrier)
                | (Direct, SendRecv)
        )
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The default algorithm for `coll` on `bytes` bytes (the whole buffer) over `world` ranks
/// with `per_host` ranks per host ([`Request::per_host`]): the one `model` predicts fastest
/// ([`model::CostModel::choose`]).
pub fn choose(
    coll: Collective,
    bytes: usize,
    world: usize,
    per_host: usize,
    model: &model::CostModel,
) -> Algorithm {
    model.choose(coll, bytes, world, per_host)
}

/// What one rank asks for: enough to build its schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The collective.
    pub coll: Collective,
    /// The algorithm (must support `coll`).
    pub algo: Algorithm,
    /// Number of ranks.
    pub world: usize,
    /// This rank.
    pub rank: Rank,
    /// Element count: the buffer length for all_reduce, broadcast, reduce; the per-rank
    /// block length for all_gather (send length), reduce_scatter (recv length) and all_to_all;
    /// the message length for send/recv; 0 for barrier.
    pub count: usize,
    /// The root of broadcast/reduce; for send/recv, the peer.
    pub root: Rank,
    /// For send/recv: true on the sending side.
    pub is_send: bool,
    /// Whether the reduction needs a final step (`Avg`).
    pub finalize: bool,
    /// The host layout, for [`Algorithm::Hierarchical`]: ranks `h·per_host .. (h+1)·per_host`
    /// share host `h` (every host the same number of ranks, numbered contiguously); 0 when the
    /// layout is unknown or not of that shape. Other algorithms ignore it.
    pub per_host: usize,
}

/// The host layout as [`Request::per_host`] wants it, from every rank's host identity: the
/// number of ranks per host when every host has the same number and each host's ranks are
/// numbered contiguously, else 0.
pub fn uniform_per_host<T: PartialEq>(hosts: &[T]) -> usize {
    let n = hosts.len();
    let Some(first) = hosts.first() else {
        return 0;
    };
    let l = hosts.iter().take_while(|h| *h == first).count();
    if l == 0 || !n.is_multiple_of(l) {
        return 0;
    }
    let uniform = (0..n).all(|r| hosts[r] == hosts[r - r % l]);
    let distinct = (0..n / l).all(|h| (0..h).all(|g| hosts[g * l] != hosts[h * l]));
    if uniform && distinct {
        l
    } else {
        0
    }
}

/// Whether the hierarchical allreduce pays on this layout: at least two hosts with at least
/// two ranks each ([`Request::per_host`]).
pub fn hierarchical_fits(world: usize, per_host: usize) -> bool {
    per_host >= 2 && world.is_multiple_of(per_host) && world / per_host >= 2
}

/// Builds this rank's schedule for `req`.
///
/// Returns `None` when `req.algo` does not implement `req.coll`. `world ≥ 1`,
/// `rank < world`, `root < world` are the caller's to check.
pub fn schedule(req: &Request) -> Option<Schedule> {
    if !req.algo.supports(req.coll) {
        return None;
    }
    Some(algo::build(req))
}

/// The range of block `i` when `count` elements are split over `n` blocks: the first
/// `count % n` blocks hold `count / n + 1` elements, the rest `count / n`.
pub fn block_range(count: usize, n: usize, i: usize) -> Range<usize> {
    let base = count / n;
    let extra = count % n;
    let start = i * base + i.min(extra);
    let len = base + usize::from(i < extra);
    start..start + len
}

/// One segment of one op, in program order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// The op restricted to this segment.
    pub op: Op,
    /// Index of the op in the schedule this step came from.
    pub op_index: u32,
    /// Range of this step's dependencies in [`Program::dep_list`].
    pub deps: (u32, u32),
}

/// A compiled schedule: segmented steps with their dependencies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Program {
    /// Steps in program order.
    pub steps: Vec<Step>,
    /// Flattened dependency lists (indices of earlier steps).
    pub dep_list: Vec<u32>,
}

impl Program {
    /// The steps `i` depends on (all earlier).
    pub fn deps(&self, i: usize) -> &[u32] {
        let (a, b) = self.steps[i].deps;
        &self.dep_list[a as usize..b as usize]
    }
}

/// Cuts each op of `s` into segments of at most `seg_elems` elements (≥ 1), interleaves the
/// segments of each round (segment 0 of every op of the round, then segment 1, ...), and
/// computes every step's dependencies on earlier steps (read-after-write, write-after-read,
/// write-after-write on overlapping ranges of the same buffer). Empty `Send`/`Recv` steps
/// (descriptor-only frames) are chained as if they read and wrote one token: an empty receive
/// depends on the previous empty receive, an empty send on the last empty receive before it.
///
/// Both ends of a link cut an op of the same length the same way, so frames match.
pub fn compile(s: &Schedule, seg_elems: usize) -> Program {
    let seg = seg_elems.max(1);
    let mut steps = Vec::new();
    for (r, round) in s.rounds().enumerate() {
        let base = s.round_starts[r];
        let nsegs: Vec<usize> = round
            .iter()
            .map(|op| op.len().div_ceil(seg).max(1))
            .collect();
        let most = nsegs.iter().copied().max().unwrap_or(0);
        for k in 0..most {
            for (j, op) in round.iter().enumerate() {
                if k >= nsegs[j] {
                    continue;
                }
                let off = k * seg;
                let len = op.len().saturating_sub(off).min(seg);
                steps.push(Step {
                    op: op.sub(off, len),
                    op_index: (base + j) as u32,
                    deps: (0, 0),
                });
            }
        }
    }
    let mut tracker = Hazards::default();
    let mut dep_list = Vec::new();
    let mut scratch = Vec::new();
    // The last empty (descriptor-only) receive: empty steps carry no data, so without this
    // token a barrier round could signal before it has heard from the previous round.
    let mut last_empty_recv: Option<u32> = None;
    for (i, step) in steps.iter_mut().enumerate() {
        let (reads, writes) = accesses(&step.op);
        scratch.clear();
        if step.op.is_empty() && step.op.peer().is_some() {
            scratch.extend(last_empty_recv);
            if matches!(step.op, Op::Recv { .. }) {
                last_empty_recv = Some(i as u32);
            }
        }
        for loc in reads.iter().flatten() {
            tracker.collect(*loc, false, &mut scratch);
        }
        for loc in writes.iter().flatten() {
            tracker.collect(*loc, true, &mut scratch);
        }
        scratch.sort_unstable();
        scratch.dedup();
        let a = dep_list.len() as u32;
        dep_list.extend(scratch.iter().copied().filter(|&d| d != i as u32));
        step.deps = (a, dep_list.len() as u32);
        for loc in reads.iter().flatten() {
            if !writes.iter().flatten().any(|w| w == loc) {
                tracker.record(*loc, i as u32, false);
            }
        }
        for loc in writes.iter().flatten() {
            tracker.record(*loc, i as u32, true);
        }
    }
    Program { steps, dep_list }
}

/// The locations an op reads and writes (empty locations omitted).
fn accesses(op: &Op) -> ([Option<Loc>; 2], [Option<Loc>; 1]) {
    let nz = |l: Loc| (l.len > 0).then_some(l);
    match *op {
        Op::Send { src, .. } => ([nz(src), None], [None]),
        Op::Recv { dst, acc, .. } => ([acc.and_then(nz), None], [nz(dst)]),
        Op::Copy { src, dst } => ([nz(src), None], [nz(dst)]),
        Op::Finalize { loc } => ([nz(loc), None], [nz(loc)]),
    }
}

/// Per-buffer interval map: for each maximal range, its last writer and the readers since.
#[derive(Default)]
struct Hazards {
    bufs: [BTreeMap<usize, Interval>; 2],
}

#[derive(Clone)]
struct Interval {
    end: usize,
    writer: Option<u32>,
    readers: Vec<u32>,
}

impl Hazards {
    fn map(&mut self, b: Buf) -> &mut BTreeMap<usize, Interval> {
        &mut self.bufs[b as usize]
    }

    /// Splits intervals so that `at` is a boundary (if it falls inside one).
    fn split(map: &mut BTreeMap<usize, Interval>, at: usize) {
        let Some((_, left)) = map.range_mut(..at).next_back() else {
            return;
        };
        if left.end > at {
            let mut right = left.clone();
            right.end = left.end;
            left.end = at;
            map.insert(at, right);
        }
    }

    /// Adds to `out` the steps an access to `loc` must wait for.
    fn collect(&mut self, loc: Loc, write: bool, out: &mut Vec<u32>) {
        let map = self.map(loc.buf);
        // Intervals are disjoint: only the last one starting at or before `loc.start` can
        // reach into `loc` from the left, so start there instead of at the buffer's start
        // (scanning from 0 made compile quadratic in the number of segments).
        let first = map
            .range(..=loc.start)
            .next_back()
            .map_or(loc.start, |(&s, _)| s);
        for (_, iv) in map.range(first..loc.start + loc.len) {
            if iv.end <= loc.start {
                continue;
            }
            out.extend(iv.writer);
            if write {
                out.extend(iv.readers.iter().copied());
            }
        }
    }

    /// Records that step `i` reads (or writes) `loc`.
    fn record(&mut self, loc: Loc, i: u32, write: bool) {
        let (a, b) = (loc.start, loc.start + loc.len);
        let map = self.map(loc.buf);
        Self::split(map, a);
        Self::split(map, b);
        // Fill gaps with fresh intervals so the whole range is covered.
        let mut cur = a;
        let existing: Vec<(usize, usize)> = map.range(a..b).map(|(&s, iv)| (s, iv.end)).collect();
        for (s, e) in existing {
            if s > cur {
                map.insert(
                    cur,
                    Interval {
                        end: s,
                        writer: None,
                        readers: Vec::new(),
                    },
                );
            }
            cur = e;
        }
        if cur < b {
            map.insert(
                cur,
                Interval {
                    end: b,
                    writer: None,
                    readers: Vec::new(),
                },
            );
        }
        for (_, iv) in map.range_mut(a..b) {
            if write {
                iv.writer = Some(i);
                iv.readers.clear();
            } else {
                iv.readers.push(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Wire codes round-trip and fit the header byte, which packs the collective in the low
    /// four bits and the algorithm in the high four (engine `coll_byte`).
    #[test]
    fn wire_codes_round_trip_and_fit_in_four_bits() {
        let mut seen = BTreeSet::new();
        for a in Algorithm::ALL {
            assert_eq!(Algorithm::from_code(a.code()), Some(a), "{a:?}");
            assert!(a.code() < 16, "{a:?} code {} does not fit 4 bits", a.code());
            assert!(seen.insert(a.code()), "{a:?} reuses code {}", a.code());
        }
        for code in 0..=u8::MAX {
            if !seen.contains(&code) {
                assert_eq!(
                    Algorithm::from_code(code),
                    None,
                    "unused algorithm code {code}"
                );
            }
        }
        let mut seen = BTreeSet::new();
        for c in Collective::ALL {
            assert_eq!(Collective::from_code(c.code()), Some(c), "{c:?}");
            assert!(c.code() < 16, "{c:?} code {} does not fit 4 bits", c.code());
            assert!(seen.insert(c.code()), "{c:?} reuses code {}", c.code());
        }
        for code in 0..=u8::MAX {
            if !seen.contains(&code) {
                assert_eq!(
                    Collective::from_code(code),
                    None,
                    "unused collective code {code}"
                );
            }
        }
        // Literal spot checks, independent of ALL's order.
        assert_eq!(Algorithm::Ring.code(), 0);
        assert_eq!(Algorithm::Direct.code(), 6);
        assert_eq!(Algorithm::Tree.code(), 7);
        assert_eq!(Algorithm::Hierarchical.code(), 8);
        assert_eq!(Algorithm::Rabenseifner.code(), 9);
        assert_eq!(Algorithm::OneShot.code(), 10);
        assert_eq!(Algorithm::from_code(11), None);
        assert_eq!(Algorithm::from_code(15), None);
        assert_eq!(Collective::AllReduce.code(), 0);
        assert_eq!(Collective::Barrier.code(), 7);
        assert_eq!(Collective::from_code(8), None);
    }

    /// The collectives without a choice are exactly those the model never chooses for: for
    /// them it answers their sole algorithm at every size, world and layout, whatever its
    /// constants (literal expectations, not read from `supports`).
    #[test]
    fn sole_algorithms_are_the_models_only_answer() {
        use Algorithm::*;
        use Collective::*;
        let expected = [
            (AllReduce, None),
            (AllGather, Some(Ring)),
            (ReduceScatter, Some(Ring)),
            (Broadcast, None),
            (Reduce, None),
            (AllToAll, Some(Pairwise)),
            (SendRecv, Some(Direct)),
            (Barrier, Some(Dissemination)),
        ];
        assert_eq!(expected.len(), Collective::ALL.len());
        let default = model::CostModel::default();
        let slow_hops = model::CostModel {
            costs: model::Costs {
                alpha_us: 1e6,
                ..default.costs
            },
            ..default
        };
        for (c, sole) in expected {
            assert_eq!(c.sole_algorithm(), sole, "{c:?}");
            let Some(sole) = sole else { continue };
            for m in [&default, &slow_hops] {
                for world in [2, 3, 4, 8, 64] {
                    for per_host in [0, 1, 2] {
                        for bytes in [0, 1, 64, 4096, 1 << 20, 256 << 20] {
                            assert_eq!(choose(c, bytes, world, per_host, m), sole, "{c:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn uniform_per_host_accepts_only_equal_contiguous_hosts() {
        assert_eq!(uniform_per_host(&["a", "a", "b", "b"]), 2);
        assert_eq!(uniform_per_host(&["a", "a", "a", "b", "b", "b"]), 3);
        assert_eq!(uniform_per_host(&["a", "b", "c"]), 1);
        assert_eq!(uniform_per_host(&["a", "a", "a"]), 3);
        assert_eq!(uniform_per_host(&["a", "a", "a", "b", "b"]), 0, "3+2");
        assert_eq!(uniform_per_host(&["a", "b", "a", "b"]), 0, "interleaved");
        assert_eq!(
            uniform_per_host(&["a", "a", "b", "b", "a", "a"]),
            0,
            "host twice"
        );
        assert_eq!(uniform_per_host::<&str>(&[]), 0);
        assert!(hierarchical_fits(4, 2) && hierarchical_fits(6, 3) && hierarchical_fits(6, 2));
        assert!(!hierarchical_fits(4, 1) && !hierarchical_fits(3, 3) && !hierarchical_fits(5, 0));
    }

    #[test]
    fn blocks_cover_the_buffer_with_larger_blocks_first() {
        for count in [0usize, 1, 2, 5, 7, 10, 97] {
            for n in 1..=9 {
                let mut next = 0;
                for i in 0..n {
                    let r = block_range(count, n, i);
                    assert_eq!(r.start, next);
                    let len = r.len();
                    assert!(len == count / n || len == count / n + 1);
                    if i > 0 {
                        assert!(block_range(count, n, i - 1).len() >= len);
                    }
                    next = r.end;
                }
                assert_eq!(next, count);
            }
        }
    }

    #[test]
    fn compile_interleaves_segments_of_a_round() {
        let mut s = Schedule::new();
        s.round()
            .send(1, Loc::dst(0..10))
            .recv_reduce(1, Loc::dst(10..20), Loc::dst(10..20));
        let p = compile(&s, 4);
        let kinds: Vec<char> = p
            .steps
            .iter()
            .map(|st| {
                if matches!(st.op, Op::Send { .. }) {
                    'S'
                } else {
                    'R'
                }
            })
            .collect();
        assert_eq!(kinds.iter().collect::<String>(), "SRSRSR");
        assert_eq!(
            p.steps[4].op,
            Op::Send {
                peer: 1,
                src: Loc::dst(8..10)
            }
        );
        // Disjoint ranges: no dependencies at all.
        assert!((0..p.steps.len()).all(|i| p.deps(i).is_empty()));
    }

    #[test]
    fn a_send_waits_for_the_receive_that_produced_its_data() {
        let mut s = Schedule::new();
        s.round().recv_reduce(0, Loc::dst(0..8), Loc::dst(0..8));
        s.round().send(2, Loc::dst(0..8));
        let p = compile(&s, 4);
        // steps: R[0..4], R[4..8], S[0..4], S[4..8]
        assert_eq!(p.deps(2), &[0]);
        assert_eq!(p.deps(3), &[1]);
    }

    #[test]
    fn a_receive_waits_for_earlier_sends_reading_its_destination() {
        // Recursive-doubling shape: send the buffer, then reduce the peer's copy into it.
        let mut s = Schedule::new();
        s.round()
            .send(1, Loc::dst(0..6))
            .recv_reduce(1, Loc::dst(0..6), Loc::dst(0..6));
        let p = compile(&s, 3);
        // steps: S[0..3], R[0..3], S[3..6], R[3..6]
        assert_eq!(p.deps(1), &[0]);
        assert_eq!(p.deps(3), &[2]);
    }

    #[test]
    fn unaligned_overlaps_are_tracked() {
        let mut s = Schedule::new();
        s.round().recv_copy(1, Loc::dst(0..10));
        s.round().send(2, Loc::dst(3..7));
        s.round().push(Op::Copy {
            src: Loc::src(0..5),
            dst: Loc::dst(5..10),
        });
        let p = compile(&s, 4);
        // R[0..4], R[4..8], R[8..10], S[3..7], C[5..9]<-src[0..4], C[9..10]<-src[4..5]
        assert_eq!(p.deps(3), &[0, 1]);
        // The copy writes dst 5..9: after receive 4..8 and 8..10 (WAW) and the send 3..7 (WAR).
        assert_eq!(p.deps(4), &[1, 2, 3]);
        assert_eq!(p.deps(5), &[2]);
    }

    #[test]
    fn an_empty_send_waits_for_every_earlier_empty_receive() {
        // Barrier shape: signal, wait, signal, wait, signal.
        let mut s = Schedule::new();
        let empty = Loc::dst(0..0);
        s.round().push(Op::Send {
            peer: 1,
            src: empty,
        });
        s.push(Op::Recv {
            peer: 3,
            dst: empty,
            acc: None,
        });
        s.round().push(Op::Send {
            peer: 2,
            src: empty,
        });
        s.push(Op::Recv {
            peer: 2,
            dst: empty,
            acc: None,
        });
        s.round().push(Op::Send {
            peer: 3,
            src: empty,
        });
        let p = compile(&s, 4);
        assert!(p.deps(0).is_empty() && p.deps(1).is_empty());
        assert_eq!(p.deps(2), &[1]);
        assert_eq!(p.deps(3), &[1]);
        assert_eq!(p.deps(4), &[3]);
    }

    #[test]
    fn empty_sends_make_one_descriptor_only_step() {
        let mut s = Schedule::new();
        s.round().push(Op::Send {
            peer: 1,
            src: Loc::dst(0..0),
        });
        let p = compile(&s, 16);
        assert_eq!(p.steps.len(), 1);
        assert_eq!(p.steps[0].op.len(), 0);
    }
}
