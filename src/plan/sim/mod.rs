//! Deterministic simulator for compiled schedules.
//!
//! The simulator runs every rank's compiled [`Program`] in one thread, exactly under the
//! execution semantics of the [`plan`](super) module docs, with a seeded PRNG choosing which
//! executable step runs next. It has no I/O, no clock and no threads: the same programs, inputs
//! and [`SimConfig`] always give the same [`SimOutcome`].
//!
//! # Model
//!
//! * Every rank has a [`Buf::Src`] and a [`Buf::Dst`] buffer of `u64` *symbolic* values
//!   ([`Buffers`]). `Src` is read-only: a step that writes it is rejected before the run.
//! * Every ordered pair of ranks `a → b` has one FIFO link that holds at most
//!   [`SimConfig::link_capacity`] frames (the engine's transports guarantee at least one).
//! * Steps of one rank that talk to the same peer in the same direction run in program order:
//!   only the head of each per-(peer, direction) queue may run. Local steps (`Copy`,
//!   `Finalize`) may run as soon as their dependencies are complete.
//! * A step is *executable* when all its dependencies ([`Program::deps`]) are complete and, for
//!   a `Send`, the link has room, for a `Recv`, the link has a frame. The scheduler picks one
//!   executable step of any rank uniformly at random, runs it to completion, and repeats.
//! * A `Send` pushes a frame (the data, the sender, the length). A `Recv` pops the oldest frame
//!   of its link, checks that its length equals its own ([`SimError::LengthMismatch`]), then
//!   copies it (`acc: None`) or stores `acc ⊕ frame`.
//! * The reduction `⊕` is wrapping `u64` addition, so with random inputs a missing or doubled
//!   contribution is detected. `Finalize` multiplies by the odd constant [`FINALIZE_FACTOR`]
//!   (wrapping), so applying it zero or two times is detected: a finalized reduction must equal
//!   `FINALIZE_FACTOR · sum`.
//! * No executable step while a rank is unfinished is a [`SimError::Deadlock`] naming the stuck
//!   ranks and steps; frames left on a link when every rank is finished are
//!   [`SimError::UnconsumedFrames`].
//!
//! Frames also carry the set of ranks their sender has (transitively) heard from, so
//! [`SimOutcome::heard_from`] tells whether a barrier really waited for every rank.
//!
//! # Entry points
//!
//! * [`run_programs`]: any programs, including hand-made ones.
//! * [`run`]: one [`Request`] per rank, scheduled with [`schedule`] and compiled with
//!   [`compile`].
//! * [`Call`]: one collective call over a whole world — builds the per-rank requests
//!   ([`Call::requests`]), sized inputs ([`Call::random_inputs`]), runs them ([`Call::run`]) and
//!   computes the expected result from the definition of the collective alone
//!   ([`Call::expected`]), independent of any schedule.
//!
//! ```
//! use dspark::plan::sim::{Call, SimConfig};
//! use dspark::plan::{Algorithm, Collective};
//!
//! let call = Call::new(Collective::AllReduce, Algorithm::Ring, 4, 10).with_finalize(true);
//! let inputs = call.random_inputs(7);
//! let cfg = SimConfig { seed: 1, seg_elems: 3, link_capacity: 1 };
//! let out = call.run(inputs.clone(), &cfg).expect("no deadlock");
//! let want = call.expected(&inputs);
//! for (rank, want) in want.iter().enumerate() {
//!     assert_eq!(Some(&out.buffers[rank].dst), want.as_ref());
//! }
//! // Ring allreduce: every rank sends 2(n−1) blocks, 2(n−1)·count elements in all.
//! assert_eq!(out.elems_sent(), 2 * 3 * 10);
//! ```

use std::collections::VecDeque;
use std::fmt;

use super::{compile, schedule, Algorithm, Buf, Collective, Loc, Op, Program, Rank, Request};

/// The odd constant `Finalize` multiplies by (wrapping). A finalized reduction's expected
/// value is `FINALIZE_FACTOR.wrapping_mul(sum)`.
pub const FINALIZE_FACTOR: u64 = 0xD6E8_FEB8_6659_FD93;

/// Simulation parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Seed of the scheduler's PRNG: which executable step runs next.
    pub seed: u64,
    /// Segment size passed to [`compile`] by [`run`] and [`Call::run`] (ignored by
    /// [`run_programs`], whose programs are already compiled).
    pub seg_elems: usize,
    /// Frames a link buffers at most (≥ 1).
    pub link_capacity: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 0,
            seg_elems: 64,
            link_capacity: 1,
        }
    }
}

/// One rank's two buffers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Buffers {
    /// The read-only input of an out-of-place collective.
    pub src: Vec<u64>,
    /// The output (and the input of an in-place collective).
    pub dst: Vec<u64>,
}

impl Buffers {
    fn get(&self, b: Buf) -> &[u64] {
        match b {
            Buf::Src => &self.src,
            Buf::Dst => &self.dst,
        }
    }

    fn read(&self, loc: Loc) -> &[u64] {
        &self.get(loc.buf)[loc.range()]
    }
}

/// What one rank did during a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankStats {
    /// Payload elements sent.
    pub elems_sent: usize,
    /// Payload elements received.
    pub elems_received: usize,
    /// Frames sent (including descriptor-only frames).
    pub frames_sent: usize,
    /// Frames received.
    pub frames_received: usize,
    /// Steps executed.
    pub steps: usize,
}

/// The result of a successful run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimOutcome {
    /// Every rank's buffers at the end.
    pub buffers: Vec<Buffers>,
    /// Per-rank counters.
    pub stats: Vec<RankStats>,
    /// `heard_from[r][q]`: whether rank `r` has, through a chain of frames, heard from rank `q`
    /// by the end of its program (always true for `q == r`).
    pub heard_from: Vec<Vec<bool>>,
}

impl SimOutcome {
    /// Payload elements sent by all ranks together.
    pub fn elems_sent(&self) -> usize {
        self.stats.iter().map(|s| s.elems_sent).sum()
    }

    /// Frames sent by all ranks together.
    pub fn frames_sent(&self) -> usize {
        self.stats.iter().map(|s| s.frames_sent).sum()
    }
}

/// Why a step could not run when the simulator found no executable step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockReason {
    /// Its dependencies are complete, but the link to the peer is full.
    LinkFull,
    /// Its dependencies are complete, but no frame waits on the link from the peer.
    NoFrame,
    /// These dependencies (steps of the same rank) are not complete.
    Dependencies(Vec<usize>),
}

/// A step a stuck rank cannot run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    /// Index of the step in the rank's program.
    pub step: usize,
    /// The step's op.
    pub op: Op,
    /// Why it cannot run.
    pub reason: BlockReason,
}

/// A rank that has not finished its program in a deadlock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stuck {
    /// The rank.
    pub rank: Rank,
    /// Steps completed.
    pub done: usize,
    /// Steps in its program.
    pub total: usize,
    /// The head of each of its non-empty per-(peer, direction) queues, and its first
    /// unfinished local step, with the reason each cannot run.
    pub blocked: Vec<Blocked>,
}

/// Everything the simulator reports as wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SimError {
    /// The setup does not describe a world (no ranks, buffer count differs from program
    /// count, a request for the wrong rank, zero link capacity, an unsupported algorithm, ...).
    BadSetup(String),
    /// A step is malformed: its peer is out of range or itself, a range lies outside its
    /// buffer, it writes `Src`, its two ranges differ in length, or it depends on a step that
    /// is not earlier.
    BadStep {
        /// The rank whose program holds the step.
        rank: Rank,
        /// The step index.
        step: usize,
        /// The op.
        op: Op,
        /// What is wrong.
        reason: String,
    },
    /// A receive popped a frame whose length differs from its own.
    LengthMismatch {
        /// The rank that sent the frame.
        sender: Rank,
        /// The sender's step that produced it.
        send_step: usize,
        /// The receiving rank.
        receiver: Rank,
        /// The receiver's step.
        recv_step: usize,
        /// Elements in the frame.
        sent: usize,
        /// Elements the receive expected.
        expected: usize,
    },
    /// No step can run but some ranks are unfinished.
    Deadlock {
        /// The unfinished ranks.
        stuck: Vec<Stuck>,
    },
    /// Every rank finished but a link still holds frames nobody received.
    UnconsumedFrames {
        /// Sending rank.
        from: Rank,
        /// Receiving rank.
        to: Rank,
        /// Frames left.
        frames: usize,
        /// The sender's step that produced the oldest one.
        first_step: usize,
    },
}

fn loc_str(l: Loc) -> String {
    let b = match l.buf {
        Buf::Src => "Src",
        Buf::Dst => "Dst",
    };
    format!("{b}[{}..{}]", l.start, l.start + l.len)
}

/// A human-readable description of an op (`send Dst[0..4] to rank 1`).
pub fn describe(op: &Op) -> String {
    match *op {
        Op::Send { peer, src } => format!("send {} to rank {peer}", loc_str(src)),
        Op::Recv {
            peer,
            dst,
            acc: None,
        } => format!("recv {} from rank {peer}", loc_str(dst)),
        Op::Recv {
            peer,
            dst,
            acc: Some(a),
        } => {
            format!(
                "recv {} = {} + frame from rank {peer}",
                loc_str(dst),
                loc_str(a)
            )
        }
        Op::Copy { src, dst } => format!("copy {} to {}", loc_str(src), loc_str(dst)),
        Op::Finalize { loc } => format!("finalize {}", loc_str(loc)),
    }
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::BadSetup(s) => write!(f, "bad simulation setup: {s}"),
            SimError::BadStep {
                rank,
                step,
                op,
                reason,
            } => {
                write!(f, "rank {rank} step {step} ({}): {reason}", describe(op))
            }
            SimError::LengthMismatch {
                sender,
                send_step,
                receiver,
                recv_step,
                sent,
                expected,
            } => {
                write!(
                    f,
                    "length mismatch: rank {receiver} step {recv_step} expected {expected} \
                     elements from rank {sender}, whose step {send_step} sent {sent}"
                )
            }
            SimError::Deadlock { stuck } => {
                f.write_str("deadlock:")?;
                for s in stuck {
                    write!(f, " rank {} ({}/{} steps done):", s.rank, s.done, s.total)?;
                    for b in &s.blocked {
                        let why = match &b.reason {
                            BlockReason::LinkFull => "link full".to_string(),
                            BlockReason::NoFrame => "no frame".to_string(),
                            BlockReason::Dependencies(d) => format!("waits for steps {d:?}"),
                        };
                        write!(f, " [step {} {}: {why}]", b.step, describe(&b.op))?;
                    }
                    f.write_str(";")?;
                }
                Ok(())
            }
            SimError::UnconsumedFrames {
                from,
                to,
                frames,
                first_step,
            } => write!(
                f,
                "{frames} frame(s) from rank {from} to rank {to} never received (oldest sent \
                 by rank {from} step {first_step})"
            ),
        }
    }
}

impl std::error::Error for SimError {}

/// splitmix64: a tiny, well-mixed PRNG (no dependency, fully deterministic).
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform-enough value in `0..n` (`n ≥ 1`; the modulo bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// One frame on a link.
#[derive(Debug)]
struct Frame {
    sender: Rank,
    send_step: usize,
    data: Vec<u64>,
    heard: Vec<bool>,
}

const LOCAL: u32 = u32::MAX;

/// A per-(peer, direction) queue: steps in program order, the first not yet run at `head`.
#[derive(Debug, Default)]
struct Queue {
    steps: Vec<u32>,
    head: usize,
}

/// Scheduling state of one rank.
#[derive(Debug)]
struct RankRun<'a> {
    prog: &'a Program,
    /// Incomplete dependencies per step.
    pending: Vec<u32>,
    /// Reverse dependencies (CSR).
    rdep_start: Vec<u32>,
    rdeps: Vec<u32>,
    /// Queue index per step (`peer * 2 + dir`, dir 0 = send, 1 = recv) or `LOCAL`.
    queue_of: Vec<u32>,
    queues: Vec<Queue>,
    done: Vec<bool>,
    n_done: usize,
}

impl<'a> RankRun<'a> {
    fn new(prog: &'a Program, world: usize) -> Self {
        let len = prog.steps.len();
        let mut pending = vec![0u32; len];
        let mut counts = vec![0u32; len + 1];
        for (i, p) in pending.iter_mut().enumerate() {
            let deps = prog.deps(i);
            *p = deps.len() as u32;
            for &d in deps {
                counts[d as usize + 1] += 1;
            }
        }
        for i in 0..len {
            counts[i + 1] += counts[i];
        }
        let rdep_start = counts.clone();
        let mut fill = counts;
        let mut rdeps = vec![0u32; rdep_start[len] as usize];
        for i in 0..len {
            for &d in prog.deps(i) {
                let slot = &mut fill[d as usize];
                rdeps[*slot as usize] = i as u32;
                *slot += 1;
            }
        }
        let mut queues: Vec<Queue> = (0..world * 2).map(|_| Queue::default()).collect();
        let queue_of = prog
            .steps
            .iter()
            .enumerate()
            .map(|(i, st)| {
                let q = match st.op {
                    Op::Send { peer, .. } => peer * 2,
                    Op::Recv { peer, .. } => peer * 2 + 1,
                    _ => return LOCAL,
                };
                queues[q].steps.push(i as u32);
                q as u32
            })
            .collect();
        RankRun {
            prog,
            pending,
            rdep_start,
            rdeps,
            queue_of,
            queues,
            done: vec![false; len],
            n_done: 0,
        }
    }

    fn at_head(&self, i: usize) -> bool {
        match self.queue_of[i] {
            LOCAL => true,
            q => {
                let q = &self.queues[q as usize];
                q.steps.get(q.head) == Some(&(i as u32))
            }
        }
    }

    fn ready(&self, i: usize) -> bool {
        !self.done[i] && self.pending[i] == 0 && self.at_head(i)
    }

    /// Marks step `i` complete; appends the steps that became ready to `out`.
    fn complete(&mut self, i: usize, out: &mut Vec<u32>) {
        self.done[i] = true;
        self.n_done += 1;
        for k in self.rdep_start[i]..self.rdep_start[i + 1] {
            let j = self.rdeps[k as usize] as usize;
            self.pending[j] -= 1;
            if self.ready(j) {
                out.push(j as u32);
            }
        }
        if self.queue_of[i] != LOCAL {
            let q = &mut self.queues[self.queue_of[i] as usize];
            q.head += 1;
            if let Some(&j) = q.steps.get(q.head) {
                if self.ready(j as usize) {
                    out.push(j);
                }
            }
        }
    }
}

/// The set of executable steps, kept up to date incrementally so that picking one is O(1).
///
/// Each link `l = a·n + b` has at most one ready send (the head of `a`'s queue to `b`) and one
/// ready receive (the head of `b`'s queue from `a`); they are executable while the link has
/// room, respectively a frame. Ready local steps are always executable. Keys: `2l` is the send
/// of link `l`, `2l + 1` its receive, `2n² + g` local step `g` (steps numbered across ranks).
#[derive(Debug)]
struct Executable {
    world: usize,
    /// First global step number of each rank (and the total at the end).
    offsets: Vec<usize>,
    send_ready: Vec<Option<u32>>,
    recv_ready: Vec<Option<u32>>,
    items: Vec<u32>,
    pos: Vec<u32>,
}

impl Executable {
    fn new(world: usize, programs: &[Program]) -> Self {
        let mut offsets = vec![0];
        for p in programs {
            offsets.push(offsets.last().copied().unwrap_or(0) + p.steps.len());
        }
        let links = world * world;
        let keys = 2 * links + offsets[world];
        Executable {
            world,
            offsets,
            send_ready: vec![None; links],
            recv_ready: vec![None; links],
            items: Vec::new(),
            pos: vec![u32::MAX; keys],
        }
    }

    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    fn len(&self) -> usize {
        self.items.len()
    }

    fn insert(&mut self, key: usize) {
        if self.pos[key] == u32::MAX {
            self.pos[key] = self.items.len() as u32;
            self.items.push(key as u32);
        }
    }

    fn remove(&mut self, key: usize) {
        let p = self.pos[key];
        if p != u32::MAX {
            self.pos[key] = u32::MAX;
            self.items.swap_remove(p as usize);
            if let Some(&moved) = self.items.get(p as usize) {
                self.pos[moved as usize] = p;
            }
        }
    }

    /// Step `i` of rank `r` (op `op`) has its dependencies complete and heads its queue.
    fn became_ready(&mut self, r: Rank, i: usize, op: &Op, links: &[VecDeque<Frame>], cap: usize) {
        let n = self.world;
        match *op {
            Op::Send { peer, .. } => {
                let l = r * n + peer;
                self.send_ready[l] = Some(i as u32);
                self.link_changed(l, links, cap);
            }
            Op::Recv { peer, .. } => {
                let l = peer * n + r;
                self.recv_ready[l] = Some(i as u32);
                self.link_changed(l, links, cap);
            }
            _ => self.insert(2 * n * n + self.offsets[r] + i),
        }
    }

    /// Re-evaluates the ready send and receive of link `l` against its fill level.
    fn link_changed(&mut self, l: usize, links: &[VecDeque<Frame>], cap: usize) {
        if self.send_ready[l].is_some() && links[l].len() < cap {
            self.insert(2 * l);
        } else {
            self.remove(2 * l);
        }
        if self.recv_ready[l].is_some() && !links[l].is_empty() {
            self.insert(2 * l + 1);
        } else {
            self.remove(2 * l + 1);
        }
    }

    /// Removes the `k`-th executable step and returns its (rank, step).
    fn take(&mut self, k: usize) -> (Rank, usize) {
        let key = self.items[k] as usize;
        self.remove(key);
        let n = self.world;
        if key >= 2 * n * n {
            let g = key - 2 * n * n;
            let r = self.offsets.partition_point(|&o| o <= g) - 1;
            return (r, g - self.offsets[r]);
        }
        let l = key / 2;
        let (r, step) = if key.is_multiple_of(2) {
            (l / n, self.send_ready[l].take())
        } else {
            (l % n, self.recv_ready[l].take())
        };
        (
            r,
            step.expect("an executable link key has a ready step") as usize,
        )
    }
}

fn bad(rank: Rank, step: usize, op: Op, reason: impl Into<String>) -> SimError {
    SimError::BadStep {
        rank,
        step,
        op,
        reason: reason.into(),
    }
}

/// Checks every step of `prog` against the world and `bufs` before anything runs.
fn validate(rank: Rank, world: usize, prog: &Program, bufs: &Buffers) -> Result<(), SimError> {
    for (i, st) in prog.steps.iter().enumerate() {
        let op = st.op;
        let (a, b) = st.deps;
        if a > b || b as usize > prog.dep_list.len() {
            return Err(bad(
                rank,
                i,
                op,
                "dependency range outside the dependency list",
            ));
        }
        if let Some(&d) = prog.deps(i).iter().find(|&&d| d as usize >= i) {
            return Err(bad(
                rank,
                i,
                op,
                format!("depends on step {d}, which is not earlier"),
            ));
        }
        let inside = |l: Loc| -> Result<(), SimError> {
            let len = bufs.get(l.buf).len();
            match l.start.checked_add(l.len) {
                Some(end) if end <= len => Ok(()),
                _ => Err(bad(
                    rank,
                    i,
                    op,
                    format!("{} lies outside the buffer of {len} elements", loc_str(l)),
                )),
            }
        };
        let writable = |l: Loc| -> Result<(), SimError> {
            inside(l)?;
            if l.buf == Buf::Src {
                return Err(bad(rank, i, op, "writes the read-only Src buffer"));
            }
            Ok(())
        };
        if let Some(peer) = op.peer() {
            if peer >= world {
                return Err(bad(
                    rank,
                    i,
                    op,
                    format!("peer {peer} outside a world of {world}"),
                ));
            }
            if peer == rank {
                return Err(bad(rank, i, op, "talks to itself"));
            }
        }
        match op {
            Op::Send { src, .. } => inside(src)?,
            Op::Recv { dst, acc, .. } => {
                writable(dst)?;
                if let Some(acc) = acc {
                    inside(acc)?;
                    if acc.len != dst.len {
                        return Err(bad(
                            rank,
                            i,
                            op,
                            "accumulator and destination lengths differ",
                        ));
                    }
                }
            }
            Op::Copy { src, dst } => {
                inside(src)?;
                writable(dst)?;
                if src.len != dst.len {
                    return Err(bad(
                        rank,
                        i,
                        op,
                        "copy source and destination lengths differ",
                    ));
                }
            }
            Op::Finalize { loc } => writable(loc)?,
        }
    }
    Ok(())
}

/// Runs compiled programs, `programs[r]` on rank `r` with initial buffers `buffers[r]`.
///
/// `cfg.seg_elems` is ignored (the programs are already compiled). Every step is validated
/// first ([`SimError::BadStep`]); then steps run one at a time in a seeded random order that
/// respects the execution semantics (see the [module docs](self)).
pub fn run_programs(
    programs: &[Program],
    buffers: Vec<Buffers>,
    cfg: &SimConfig,
) -> Result<SimOutcome, SimError> {
    let world = programs.len();
    if world == 0 {
        return Err(SimError::BadSetup("a world needs at least one rank".into()));
    }
    if buffers.len() != world {
        return Err(SimError::BadSetup(format!(
            "{} programs but {} sets of buffers",
            world,
            buffers.len()
        )));
    }
    if cfg.link_capacity == 0 {
        return Err(SimError::BadSetup(
            "links must buffer at least one frame".into(),
        ));
    }
    for (r, p) in programs.iter().enumerate() {
        validate(r, world, p, &buffers[r])?;
    }
    let mut bufs = buffers;
    let mut ranks: Vec<RankRun<'_>> = programs.iter().map(|p| RankRun::new(p, world)).collect();
    let mut stats = vec![RankStats::default(); world];
    let mut heard: Vec<Vec<bool>> = (0..world)
        .map(|r| (0..world).map(|q| q == r).collect())
        .collect();
    let mut links: Vec<VecDeque<Frame>> = (0..world * world).map(|_| VecDeque::new()).collect();
    let mut rng = SplitMix64(cfg.seed);

    let total: usize = programs.iter().map(|p| p.steps.len()).sum();
    let mut exec = Executable::new(world, programs);
    let mut newly: Vec<u32> = Vec::new();
    for (r, rr) in ranks.iter().enumerate() {
        for i in 0..rr.prog.steps.len() {
            if rr.ready(i) {
                exec.became_ready(r, i, &programs[r].steps[i].op, &links, cfg.link_capacity);
            }
        }
    }
    let mut executed = 0;
    while executed < total {
        if exec.is_empty() {
            return Err(deadlock(&ranks, &links, world, cfg.link_capacity));
        }
        let (r, i) = exec.take(rng.below(exec.len()));
        match programs[r].steps[i].op {
            Op::Send { peer, src } => {
                let data = bufs[r].read(src).to_vec();
                stats[r].elems_sent += data.len();
                stats[r].frames_sent += 1;
                let frame = Frame {
                    sender: r,
                    send_step: i,
                    data,
                    heard: heard[r].clone(),
                };
                let l = r * world + peer;
                links[l].push_back(frame);
                exec.link_changed(l, &links, cfg.link_capacity);
            }
            Op::Recv { peer, dst, acc } => {
                let l = peer * world + r;
                let frame = links[l]
                    .pop_front()
                    .expect("executable: the link has a frame");
                debug_assert_eq!(frame.sender, peer);
                exec.link_changed(l, &links, cfg.link_capacity);
                if frame.data.len() != dst.len {
                    return Err(SimError::LengthMismatch {
                        sender: frame.sender,
                        send_step: frame.send_step,
                        receiver: r,
                        recv_step: i,
                        sent: frame.data.len(),
                        expected: dst.len,
                    });
                }
                stats[r].elems_received += dst.len;
                stats[r].frames_received += 1;
                let vals: Vec<u64> = match acc {
                    None => frame.data,
                    Some(a) => bufs[r]
                        .read(a)
                        .iter()
                        .zip(&frame.data)
                        .map(|(x, y)| x.wrapping_add(*y))
                        .collect(),
                };
                bufs[r].dst[dst.range()].copy_from_slice(&vals);
                for (h, f) in heard[r].iter_mut().zip(&frame.heard) {
                    *h |= *f;
                }
            }
            Op::Copy { src, dst } => {
                let vals = bufs[r].read(src).to_vec();
                bufs[r].dst[dst.range()].copy_from_slice(&vals);
            }
            Op::Finalize { loc } => {
                for v in &mut bufs[r].dst[loc.range()] {
                    *v = v.wrapping_mul(FINALIZE_FACTOR);
                }
            }
        }
        stats[r].steps += 1;
        executed += 1;
        newly.clear();
        ranks[r].complete(i, &mut newly);
        for &j in &newly {
            let j = j as usize;
            exec.became_ready(r, j, &programs[r].steps[j].op, &links, cfg.link_capacity);
        }
    }
    for (l, q) in links.iter().enumerate() {
        if let Some(f) = q.front() {
            return Err(SimError::UnconsumedFrames {
                from: l / world,
                to: l % world,
                frames: q.len(),
                first_step: f.send_step,
            });
        }
    }
    Ok(SimOutcome {
        buffers: bufs,
        stats,
        heard_from: heard,
    })
}

fn deadlock(
    ranks: &[RankRun<'_>],
    links: &[VecDeque<Frame>],
    world: usize,
    cap: usize,
) -> SimError {
    let mut stuck = Vec::new();
    for (r, rr) in ranks.iter().enumerate() {
        let total = rr.prog.steps.len();
        if rr.n_done == total {
            continue;
        }
        let mut heads: Vec<usize> = rr
            .queues
            .iter()
            .filter_map(|q| q.steps.get(q.head).map(|&i| i as usize))
            .collect();
        if let Some(i) = (0..total).find(|&i| !rr.done[i] && rr.queue_of[i] == LOCAL) {
            heads.push(i);
        }
        heads.sort_unstable();
        let blocked = heads
            .into_iter()
            .map(|i| {
                let op = rr.prog.steps[i].op;
                let missing: Vec<usize> = rr
                    .prog
                    .deps(i)
                    .iter()
                    .map(|&d| d as usize)
                    .filter(|&d| !rr.done[d])
                    .collect();
                let reason = if !missing.is_empty() {
                    BlockReason::Dependencies(missing)
                } else {
                    match op {
                        Op::Send { peer, .. } if links[r * world + peer].len() >= cap => {
                            BlockReason::LinkFull
                        }
                        _ => BlockReason::NoFrame,
                    }
                };
                Blocked {
                    step: i,
                    op,
                    reason,
                }
            })
            .collect();
        stuck.push(Stuck {
            rank: r,
            done: rr.n_done,
            total,
            blocked,
        });
    }
    SimError::Deadlock { stuck }
}

/// Schedules, compiles (with `cfg.seg_elems`) and runs one request per rank: `reqs[r]` must be
/// rank `r`'s request in a world of `reqs.len()` ranks.
pub fn run(
    reqs: &[Request],
    inputs: Vec<Buffers>,
    cfg: &SimConfig,
) -> Result<SimOutcome, SimError> {
    let reqs: Vec<Option<Request>> = reqs.iter().copied().map(Some).collect();
    run_requests(&reqs, inputs, cfg)
}

/// Like [`run`], but `None` ranks take no part (an empty program): send/recv pairs inside a
/// larger world.
pub fn run_requests(
    reqs: &[Option<Request>],
    inputs: Vec<Buffers>,
    cfg: &SimConfig,
) -> Result<SimOutcome, SimError> {
    let programs = compile_requests(reqs, cfg.seg_elems)?;
    run_programs(&programs, inputs, cfg)
}

fn compile_requests(reqs: &[Option<Request>], seg_elems: usize) -> Result<Vec<Program>, SimError> {
    let world = reqs.len();
    reqs.iter()
        .enumerate()
        .map(|(r, req)| {
            let Some(req) = req else {
                return Ok(Program::default());
            };
            if req.rank != r || req.world != world {
                return Err(SimError::BadSetup(format!(
                    "request #{r} is for rank {} of a world of {}, expected rank {r} of {world}",
                    req.rank, req.world
                )));
            }
            if req.root >= world {
                return Err(SimError::BadSetup(format!(
                    "rank {r}: root/peer {} outside a world of {world}",
                    req.root
                )));
            }
            let s = schedule(req).ok_or_else(|| {
                SimError::BadSetup(format!("{} does not implement {}", req.algo, req.coll))
            })?;
            Ok(compile(&s, seg_elems))
        })
        .collect()
}

/// One collective call over a whole world: what every rank asks for, in one value.
///
/// Buffer lengths ([`Call::buffer_lens`]) follow the [`Request`] conventions: `count` is the
/// buffer length of all_reduce, broadcast and reduce (in place: `Dst` only); the per-rank block
/// of all_gather (`Src` = count, `Dst` = count·n), reduce_scatter (`Src` = count·n,
/// `Dst` = count) and all_to_all (`Src` = `Dst` = count·n); the message of send/recv (the
/// sender's `Src`, the receiver's `Dst`; other ranks take no part); 0 for barrier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    /// The collective.
    pub coll: Collective,
    /// The algorithm every rank uses.
    pub algo: Algorithm,
    /// Number of ranks.
    pub world: usize,
    /// Element count (see the type docs).
    pub count: usize,
    /// Root of broadcast and reduce; the *sender* of send/recv; ignored otherwise.
    pub root: Rank,
    /// The *receiver* of send/recv; ignored otherwise.
    pub peer: Rank,
    /// Whether reductions end with `Finalize` (`Avg`); ignored by non-reducing collectives.
    pub finalize: bool,
    /// Ranks per host ([`Request::per_host`]; 0: unknown).
    pub per_host: usize,
}

impl Call {
    /// A call with root 0, send/recv from rank 0 to rank 1 (or 0 in a world of one), and no
    /// finalize.
    pub fn new(coll: Collective, algo: Algorithm, world: usize, count: usize) -> Self {
        Call {
            coll,
            algo,
            world,
            count,
            root: 0,
            peer: world.min(2).saturating_sub(1),
            finalize: false,
            per_host: 0,
        }
    }

    /// A send/recv of `count` elements from `sender` to `receiver` in a world of `world`.
    pub fn send_recv(world: usize, count: usize, sender: Rank, receiver: Rank) -> Self {
        Call {
            root: sender,
            peer: receiver,
            ..Call::new(Collective::SendRecv, Algorithm::Direct, world, count)
        }
    }

    /// The same call with another root.
    pub fn with_root(self, root: Rank) -> Self {
        Call { root, ..self }
    }

    /// The same call on hosts of `per_host` ranks each ([`Request::per_host`]).
    pub fn with_per_host(self, per_host: usize) -> Self {
        Call { per_host, ..self }
    }

    /// The same call with `finalize` set.
    pub fn with_finalize(self, finalize: bool) -> Self {
        Call { finalize, ..self }
    }

    fn check(&self) -> Result<(), SimError> {
        let n = self.world;
        if n == 0 {
            return Err(SimError::BadSetup("a world needs at least one rank".into()));
        }
        if !self.algo.supports(self.coll) {
            return Err(SimError::BadSetup(format!(
                "{} does not implement {}",
                self.algo, self.coll
            )));
        }
        if self.root >= n {
            return Err(SimError::BadSetup(format!(
                "root {} outside a world of {n}",
                self.root
            )));
        }
        if self.coll == Collective::SendRecv && (self.peer >= n || self.peer == self.root) {
            return Err(SimError::BadSetup(format!(
                "send/recv from rank {} to rank {} in a world of {n}",
                self.root, self.peer
            )));
        }
        Ok(())
    }

    /// The per-rank requests (`None`: the rank takes no part, as the non-participants of a
    /// send/recv).
    pub fn requests(&self) -> Result<Vec<Option<Request>>, SimError> {
        self.check()?;
        Ok((0..self.world)
            .map(|rank| {
                let base = Request {
                    coll: self.coll,
                    algo: self.algo,
                    world: self.world,
                    rank,
                    count: if self.coll == Collective::Barrier {
                        0
                    } else {
                        self.count
                    },
                    root: self.root,
                    is_send: false,
                    finalize: self.finalize && self.coll.reduces(),
                    per_host: self.per_host,
                };
                if self.coll != Collective::SendRecv {
                    Some(base)
                } else if rank == self.root {
                    Some(Request {
                        root: self.peer,
                        is_send: true,
                        ..base
                    })
                } else if rank == self.peer {
                    Some(Request {
                        root: self.root,
                        ..base
                    })
                } else {
                    None
                }
            })
            .collect())
    }

    /// `(Src, Dst)` lengths of `rank`'s buffers.
    pub fn buffer_lens(&self, rank: Rank) -> (usize, usize) {
        let (c, n) = (self.count, self.world);
        match self.coll {
            Collective::AllReduce | Collective::Broadcast | Collective::Reduce => (0, c),
            Collective::AllGather => (c, c * n),
            Collective::ReduceScatter => (c * n, c),
            Collective::AllToAll => (c * n, c * n),
            Collective::SendRecv if rank == self.root => (c, 0),
            Collective::SendRecv if rank == self.peer => (0, c),
            Collective::SendRecv | Collective::Barrier => (0, 0),
        }
    }

    /// Random inputs of the right lengths for every rank, from `seed`. `Dst` is filled with
    /// random values too, so an output element nobody writes is detected.
    pub fn random_inputs(&self, seed: u64) -> Vec<Buffers> {
        let mut rng = SplitMix64(seed ^ 0x5151_7E57_0000_0001);
        (0..self.world)
            .map(|r| {
                let (s, d) = self.buffer_lens(r);
                Buffers {
                    src: (0..s).map(|_| rng.next_u64()).collect(),
                    dst: (0..d).map(|_| rng.next_u64()).collect(),
                }
            })
            .collect()
    }

    /// Schedules and compiles every rank's program (empty for ranks that take no part).
    pub fn programs(&self, seg_elems: usize) -> Result<Vec<Program>, SimError> {
        compile_requests(&self.requests()?, seg_elems)
    }

    /// Runs the call on `inputs` (see [`Call::random_inputs`]).
    pub fn run(&self, inputs: Vec<Buffers>, cfg: &SimConfig) -> Result<SimOutcome, SimError> {
        run_programs(&self.programs(cfg.seg_elems)?, inputs, cfg)
    }

    /// The expected final `Dst` of every rank, computed from the definition of the collective
    /// alone (no schedule involved); `None` where the result is unspecified (the non-root ranks
    /// of reduce).
    ///
    /// all_reduce: the elementwise wrapping sum of every rank's input (× [`FINALIZE_FACTOR`]
    /// when finalizing); all_gather: the inputs concatenated in rank order; reduce_scatter:
    /// block `r` of the sum; broadcast: the root's input; reduce: the sum at the root;
    /// all_to_all: block `j` of rank `i`'s input is block `i` of rank `j`'s output; send/recv:
    /// the sender's message at the receiver; barrier: nothing.
    ///
    /// # Panics
    ///
    /// When `inputs` does not have [`Call::buffer_lens`] for every rank.
    pub fn expected(&self, inputs: &[Buffers]) -> Vec<Option<Vec<u64>>> {
        let (c, n) = (self.count, self.world);
        assert_eq!(inputs.len(), n, "one set of buffers per rank");
        for (r, b) in inputs.iter().enumerate() {
            assert_eq!(
                (b.src.len(), b.dst.len()),
                self.buffer_lens(r),
                "rank {r}'s buffers"
            );
        }
        let fin = |v: u64| {
            if self.finalize {
                v.wrapping_mul(FINALIZE_FACTOR)
            } else {
                v
            }
        };
        let sum = |buf: Buf, range: std::ops::Range<usize>| -> Vec<u64> {
            range
                .map(|e| {
                    fin(inputs
                        .iter()
                        .fold(0u64, |acc, b| acc.wrapping_add(b.get(buf)[e])))
                })
                .collect()
        };
        match self.coll {
            Collective::AllReduce => vec![Some(sum(Buf::Dst, 0..c)); n],
            Collective::AllGather => {
                let all: Vec<u64> = inputs.iter().flat_map(|b| b.src.iter().copied()).collect();
                vec![Some(all); n]
            }
            Collective::ReduceScatter => (0..n)
                .map(|r| Some(sum(Buf::Src, r * c..r * c + c)))
                .collect(),
            Collective::Broadcast => vec![Some(inputs[self.root].dst.clone()); n],
            Collective::Reduce => (0..n)
                .map(|r| (r == self.root).then(|| sum(Buf::Dst, 0..c)))
                .collect(),
            Collective::AllToAll => (0..n)
                .map(|j| {
                    Some(
                        (0..n)
                            .flat_map(|i| inputs[i].src[j * c..j * c + c].iter().copied())
                            .collect(),
                    )
                })
                .collect(),
            Collective::SendRecv => (0..n)
                .map(|r| {
                    Some(if r == self.peer {
                        inputs[self.root].src.clone()
                    } else {
                        Vec::new()
                    })
                })
                .collect(),
            Collective::Barrier => vec![Some(Vec::new()); n],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Schedule;

    fn two_rank(s0: &Schedule, s1: &Schedule, seg: usize) -> Vec<Program> {
        vec![compile(s0, seg), compile(s1, seg)]
    }

    fn bufs(dst_len: usize) -> Vec<Buffers> {
        (0..2)
            .map(|r| Buffers {
                src: vec![],
                dst: (0..dst_len as u64).map(|e| 100 * r + e).collect(),
            })
            .collect()
    }

    #[test]
    fn splitmix_matches_the_reference_sequence() {
        // First outputs of splitmix64 seeded with 1234567 (Vigna's reference implementation).
        let mut g = SplitMix64(1234567);
        assert_eq!(g.next_u64(), 6457827717110365317);
        assert_eq!(g.next_u64(), 3203168211198807973);
    }

    #[test]
    fn a_link_holds_at_most_link_capacity_frames() {
        // Each rank sends Dst[0..1] twice, then receives into Dst[0..1]: the receive must wait
        // for both sends (write-after-read), so both frames must fit on the link at once.
        let mut s = Schedule::new();
        s.round().send(1, Loc::dst(0..1));
        s.round().send(1, Loc::dst(0..1));
        s.round().recv_copy(1, Loc::dst(0..1));
        s.round().recv_copy(1, Loc::dst(0..1));
        let mut t = s.clone();
        for op in &mut t.ops {
            if let Op::Send { peer, .. } | Op::Recv { peer, .. } = op {
                *peer = 0;
            }
        }
        let progs = two_rank(&s, &t, 8);
        let cfg = SimConfig {
            seed: 3,
            seg_elems: 8,
            link_capacity: 1,
        };
        match run_programs(&progs, bufs(1), &cfg) {
            Err(SimError::Deadlock { stuck }) => {
                assert_eq!(stuck.len(), 2);
                for st in &stuck {
                    assert_eq!(st.done, 1);
                    assert!(st
                        .blocked
                        .iter()
                        .any(|b| b.step == 1 && b.reason == BlockReason::LinkFull));
                    assert!(st
                        .blocked
                        .iter()
                        .any(|b| b.step == 2 && b.reason == BlockReason::Dependencies(vec![1])));
                }
            }
            other => panic!("expected a deadlock, got {other:?}"),
        }
        let out = run_programs(
            &progs,
            bufs(1),
            &SimConfig {
                link_capacity: 2,
                ..cfg
            },
        )
        .unwrap();
        assert_eq!(out.buffers[0].dst, vec![100]);
        assert_eq!(out.buffers[1].dst, vec![0]);
        assert_eq!(out.frames_sent(), 4);
    }

    #[test]
    fn receive_reduces_frame_into_accumulator_with_wrapping_addition() {
        let mut s = Schedule::new();
        s.round().send(1, Loc::dst(0..2));
        let mut t = Schedule::new();
        t.round().recv_reduce(0, Loc::dst(0..2), Loc::dst(2..4));
        let progs = two_rank(&s, &t, 1);
        let inputs = vec![
            Buffers {
                src: vec![],
                dst: vec![u64::MAX, 5],
            },
            Buffers {
                src: vec![],
                dst: vec![0, 0, 2, 7],
            },
        ];
        let out = run_programs(&progs, inputs, &SimConfig::default()).unwrap();
        assert_eq!(out.buffers[1].dst, vec![1, 12, 2, 7]);
        assert_eq!(out.stats[0].frames_sent, 2);
        assert_eq!(out.stats[1].elems_received, 2);
        assert!(out.heard_from[1][0] && !out.heard_from[0][1]);
    }

    #[test]
    fn steps_that_write_src_or_leave_their_buffer_are_rejected_before_running() {
        let mut s = Schedule::new();
        s.round().push(Op::Copy {
            src: Loc::dst(0..1),
            dst: Loc::src(0..1),
        });
        let progs = vec![compile(&s, 4)];
        let inputs = vec![Buffers {
            src: vec![1],
            dst: vec![2],
        }];
        let err = run_programs(&progs, inputs, &SimConfig::default()).unwrap_err();
        assert!(
            matches!(
                err,
                SimError::BadStep {
                    rank: 0,
                    step: 0,
                    ..
                }
            ),
            "{err}"
        );

        let mut s = Schedule::new();
        s.round().push(Op::Finalize {
            loc: Loc::dst(1..3),
        });
        let err = run_programs(
            &[compile(&s, 4)],
            vec![Buffers {
                src: vec![],
                dst: vec![0; 2],
            }],
            &SimConfig::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("outside the buffer"), "{err}");
    }

    #[test]
    fn frames_nobody_receives_are_reported() {
        let mut s = Schedule::new();
        s.round().send(1, Loc::dst(0..1));
        let progs = two_rank(&s, &Schedule::new(), 4);
        let err = run_programs(&progs, bufs(1), &SimConfig::default()).unwrap_err();
        assert_eq!(
            err,
            SimError::UnconsumedFrames {
                from: 0,
                to: 1,
                frames: 1,
                first_step: 0
            }
        );
    }

    #[test]
    fn same_seed_same_run_and_different_seeds_explore_different_orders() {
        // A racy program: rank 1 copies Dst[0..1] to Dst[1..2] with no dependency on the
        // receive that writes Dst[0..1]. Hand-made, so the race is real.
        let mut s = Schedule::new();
        s.round().send(1, Loc::dst(0..1));
        let p0 = compile(&s, 4);
        let mut t = Schedule::new();
        t.round().recv_copy(0, Loc::dst(0..1));
        let mut p1 = compile(&t, 4);
        p1.steps.push(crate::plan::Step {
            op: Op::Copy {
                src: Loc::dst(0..1),
                dst: Loc::dst(1..2),
            },
            op_index: 1,
            deps: (0, 0),
        });
        let progs = vec![p0, p1];
        let inputs = || {
            vec![
                Buffers {
                    src: vec![],
                    dst: vec![7],
                },
                Buffers {
                    src: vec![],
                    dst: vec![1, 2],
                },
            ]
        };
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..32 {
            let cfg = SimConfig {
                seed,
                ..SimConfig::default()
            };
            let a = run_programs(&progs, inputs(), &cfg).unwrap();
            let b = run_programs(&progs, inputs(), &cfg).unwrap();
            assert_eq!(a, b);
            seen.insert(a.buffers[1].dst.clone());
        }
        let want: std::collections::BTreeSet<Vec<u64>> =
            [vec![7, 1], vec![7, 7]].into_iter().collect();
        assert_eq!(seen, want);
    }

    #[test]
    fn expected_all_to_all_transposes_blocks() {
        let call = Call::new(Collective::AllToAll, Algorithm::Pairwise, 2, 2);
        let inputs = vec![
            Buffers {
                src: vec![1, 2, 3, 4],
                dst: vec![0; 4],
            },
            Buffers {
                src: vec![5, 6, 7, 8],
                dst: vec![0; 4],
            },
        ];
        assert_eq!(
            call.expected(&inputs),
            vec![Some(vec![1, 2, 5, 6]), Some(vec![3, 4, 7, 8])]
        );
    }

    #[test]
    fn expected_finalized_reduction_is_factor_times_sum() {
        let call = Call::new(Collective::ReduceScatter, Algorithm::Ring, 2, 1).with_finalize(true);
        let inputs = vec![
            Buffers {
                src: vec![1, 2],
                dst: vec![0],
            },
            Buffers {
                src: vec![10, 20],
                dst: vec![0],
            },
        ];
        let k = FINALIZE_FACTOR;
        assert_eq!(
            call.expected(&inputs),
            vec![
                Some(vec![11u64.wrapping_mul(k)]),
                Some(vec![22u64.wrapping_mul(k)])
            ]
        );
    }
}
