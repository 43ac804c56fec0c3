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
//! This file holds the simulator's types, its errors and the entry points that compile
//! requests; `exec.rs` the core that runs the programs and the checks it makes before and
//! during a run; `call.rs` [`Call`] and the results it expects.
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
//! use dspark::internals::plan::sim::{Call, SimConfig};
//! use dspark::{Algorithm, Collective};
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

use std::fmt;

use super::{compile, schedule, Buf, Loc, Op, Program, Rank, Request};

mod call;
mod exec;

pub use call::Call;
pub use exec::run_programs;

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
