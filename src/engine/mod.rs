//! Executes compiled schedules over a transport.
//!
//! The engine turns a call into a [`plan::Request`], compiles it (cached) into a
//! [`plan::Program`] of segments with dependencies, and drives the segments through the
//! [`Transport`] from the caller's thread: every segment whose dependencies are complete and
//! that is at the head of its per-peer queue makes as much progress as the transport allows
//! without blocking. When nothing moves it spins briefly (yielding the CPU when ranks
//! outnumber cores), then blocks in [`Transport::wait`] — never past the call's deadline.
//!
//! Receiving segment k overlaps reducing segment k−1 and sending: the transport hands
//! reducing receives to the [`reduce`](mod@crate::reduce) kernels straight out of its receive
//! buffer, and the kernel keeps receiving meanwhile. The engine allocates nothing per byte:
//! its extra memory per collective is the transports' per-peer buffers, never a copy of the
//! message.
//!
//! The engine does not know which transport it drives.
//!
//! Where things live: this file holds the call, the engine and its entry points (sequencing,
//! checking and poisoning); `options.rs` the options and the rules that settle a call's
//! algorithm and segment; `frame.rs` the descriptor every frame carries and
//! the receive sink that checks it; `cache.rs` the compiled programs; `drive.rs` the host
//! drive loop; `scratch.rs` its per-call bookkeeping; `pace.rs` the spin-then-block pacing,
//! the tail every pass of both drive loops ends with, and the timeout error; [`staged`] the
//! device path; [`trace`] `DSPARK_TRACE`.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::plan::model::CostModel;
use crate::plan::{self, Algorithm, Buf, Collective, Loc, Program, Request};

mod all_to_all_v;
mod any;
mod cache;
mod choice;
mod drive;
pub mod flight;
mod frame;
mod oneshot;
mod pace;
pub mod places;
pub use pace::{spin_adapts, ADAPTED_SPIN_MAX};
mod options;
mod scratch;
pub mod staged;
mod staged_oneshot;
pub mod trace;
use crate::transport::{AbortClass, Transport, TransportKind, NO_OP};

use crate::types::{DataType, ReduceOp};
pub(crate) use all_to_all_v::v_check;
pub(crate) use any::RECV_ANY;
use cache::CacheEntry;
use frame::{Desc, Descs};
use scratch::Scratch;

pub use options::{call_segment, EngineOptions, PAIR_SEGMENT, PAIR_SEGMENT_BELOW};

/// One call, as the engine sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    /// The collective.
    pub coll: Collective,
    /// Element type.
    pub dtype: DataType,
    /// Reduction operator, for reducing collectives.
    pub op: Option<ReduceOp>,
    /// Element count (see [`plan::Request::count`]).
    pub count: usize,
    /// Root of broadcast/reduce; peer of send/recv.
    pub root: usize,
    /// For send/recv: the sending side.
    pub is_send: bool,
    /// For an exchange ([`crate::Communicator::send_recv`]): the rank the output is received
    /// from while the input goes to `root` (`coll` is `SendRecv`, `is_send` is true and
    /// `count` counts the elements sent; the output's length is what is received).
    pub recv_from: Option<usize>,
}

impl Call {
    /// A call of `coll`; the element type is filled in by the communicator.
    pub fn new(
        coll: Collective,
        op: Option<ReduceOp>,
        count: usize,
        root: usize,
        is_send: bool,
    ) -> Self {
        Call {
            coll,
            dtype: DataType::U8,
            op,
            count,
            root,
            is_send,
            recv_from: None,
        }
    }
}

/// Executes collectives for one rank over one transport.
#[derive(Debug)]
pub struct Engine {
    rank: usize,
    world: usize,
    transport: Box<dyn Transport>,
    opts: EngineOptions,
    /// Collectives (bit per `Collective as usize`) already warned about a forced algorithm
    /// that does not implement them.
    forced_warned: u16,
    poison: Option<Error>,
    seq: u64,
    /// The sequence number of the last collective this rank completed (0: none yet); the
    /// transport hears of it ([`Transport::collective_progress`]) so that an abort this rank
    /// sends says how far it got.
    coll_done: u64,
    p2p_sent: Vec<u64>,
    p2p_received: Vec<u64>,
    cache: Vec<CacheEntry>,
    /// all_to_all_v's programs by counts, with the clock of their last use.
    v_cache: Vec<(u64, Arc<all_to_all_v::VProgram>)>,
    /// The cost model's choices for the last calls ([`Engine::chosen`]).
    choices: choice::Choices,
    clock: u64,
    scratch: Scratch,
    /// Raised by another thread to stop the call in progress ([`Engine::abort_flag`]).
    abort: Arc<AtomicBool>,
    /// The deadline of the next call, when it overrides [`EngineOptions::timeout`].
    call_timeout: Option<Duration>,
    /// `DSPARK_TRACE`: what this engine did, for Chrome / Perfetto.
    trace: Option<trace::Trace>,
    /// The flight recorder (`DSPARK_FR_ENTRIES`; `None`: off) and what the call in progress
    /// told it ([`flight`]).
    flight: Option<Arc<flight::Recorder>>,
    fl: flight::InFlight,
    /// This rank's contribution to a one-shot all_reduce (reused).
    one_shot_input: Vec<u8>,
    /// The spin time of the next wait, adapted to this machine's wake-ups ([`pace::Spin`]).
    spin: pace::Spin,
}

impl Engine {
    /// An engine for `rank` of `world` over `transport`.
    pub fn new(
        rank: usize,
        world: usize,
        transport: Box<dyn Transport>,
        opts: EngineOptions,
    ) -> Self {
        Engine {
            rank,
            world,
            spin: pace::Spin::new(opts.spin),
            opts,
            forced_warned: 0,
            poison: None,
            seq: 0,
            coll_done: 0,
            p2p_sent: vec![0; world],
            p2p_received: vec![0; world],
            cache: Vec::new(),
            v_cache: Vec::new(),
            choices: choice::Choices::default(),
            clock: 0,
            scratch: Scratch::default(),
            abort: Arc::new(AtomicBool::new(false)),
            call_timeout: None,
            flight: Some(Arc::new(flight::Recorder::new(
                flight::DEFAULT_ENTRIES,
                rank,
                world,
                transport.kind(),
                None,
                false,
            ))),
            fl: flight::InFlight::default(),
            trace: None,
            one_shot_input: Vec::new(),
            transport,
        }
    }

    /// Keeps the last `entries` operations in the flight recorder (0: none) and dumps them
    /// into `dump_dir` when this engine fails (`DSPARK_FR_ENTRIES`, `DSPARK_FR_DUMP`; see
    /// [`flight`]).
    /// `places`: where each rank runs (empty where unknown), for the dumps.
    pub fn configure_flight(
        &mut self,
        entries: usize,
        dump_dir: Option<std::path::PathBuf>,
        communicator_id: String,
        places: Vec<places::Place>,
    ) {
        self.flight = (entries > 0).then(|| {
            Arc::new(
                flight::Recorder::new(
                    entries,
                    self.rank,
                    self.world,
                    self.transport.kind(),
                    dump_dir,
                    true,
                )
                .with_communicator_id(communicator_id)
                .with_places(places),
            )
        });
    }

    /// The flight recorder, if on (readable from any thread).
    pub fn flight_recorder(&self) -> Option<Arc<flight::Recorder>> {
        self.flight.clone()
    }

    /// Starts writing a trace of this engine's calls to the file under `prefix`
    /// (`DSPARK_TRACE`, see [`trace`]); returns the file's path.
    ///
    /// # Errors
    /// [`Error::Config`] when the file cannot be created.
    pub(crate) fn start_trace(
        &mut self,
        prefix: &std::path::Path,
        communicator_id: &str,
    ) -> Result<std::path::PathBuf> {
        let t =
            trace::Trace::open(prefix, self.rank, self.world, communicator_id).map_err(|e| {
                Error::config(
                    "DSPARK_TRACE",
                    format!(
                        "cannot create the trace file of rank {} under {}: {e}",
                        self.rank,
                        prefix.display()
                    ),
                )
            })?;
        let path = t.path().to_path_buf();
        self.trace = Some(t);
        Ok(path)
    }

    /// Replaces the cost model that chooses the algorithms (at init, once the link probe has
    /// measured the link between hosts; every rank sets the same one before its first call).
    pub fn set_model(&mut self, model: CostModel) {
        self.opts.model = model;
        self.choices.clear();
    }

    /// Forces `algo` for later calls of the collectives it implements (`None`: the choice by
    /// size), as [`EngineOptions::force_algo`] at init.
    pub fn set_forced_algorithm(&mut self, algo: Option<Algorithm>) {
        self.opts.force_algo = algo;
        self.forced_warned = 0;
        self.choices.clear();
    }

    /// The flag another thread raises to make the call in progress (and every later one)
    /// fail with [`Error::Aborted`]: the drive loops look at it at least every 50 ms, also
    /// while blocked in the transport, and the failure tells every peer ([`Engine::fail`]).
    pub fn abort_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.abort)
    }

    /// Overrides the deadline of the calls that follow ([`EngineOptions::timeout`] when
    /// `None`).
    pub fn set_call_timeout(&mut self, timeout: Option<Duration>) {
        self.call_timeout = timeout;
    }

    /// The error of an abort requested through [`Engine::abort_flag`], for the operation `op`.
    pub fn aborted_error(&self, op: impl Into<String>) -> Error {
        Error::Aborted {
            rank: self.rank,
            by: self.rank,
            op: op.into(),
            reason: format!(
                "rank {} aborted its communicator (Communicator::abort)",
                self.rank
            ),
        }
    }

    /// Fails the engine as aborted if the abort flag is raised and it has not failed yet
    /// (then every peer is told).
    pub fn honour_abort(&mut self) {
        if self.abort.load(Ordering::Acquire) && self.poison.is_none() {
            let e = self.aborted_error("communicator");
            self.fail(e);
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The transport's kind.
    pub fn transport_kind(&self) -> TransportKind {
        self.transport.kind()
    }

    /// The transport's description.
    pub fn transport_description(&self) -> String {
        self.transport.describe()
    }

    /// The options.
    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// The error that poisoned this engine, if any.
    pub fn poisoned(&self) -> Option<&Error> {
        self.poison.as_ref()
    }

    /// The algorithm `call` runs with.
    pub fn algorithm(&self, coll: Collective, bytes: usize) -> Algorithm {
        self.opts.algorithm(self.world, coll, bytes)
    }

    /// Runs one call. `src` is the input of out-of-place collectives and of `send` (empty
    /// otherwise); `dst` the output (in place: input and output).
    ///
    /// The first fatal error poisons the engine: it tells every peer (so that they fail
    /// promptly too) and every later call returns the same error.
    pub fn run(&mut self, call: &Call, src: &[u8], dst: &mut [u8]) -> Result<()> {
        if let Some(from) = call.recv_from {
            return self.run_exchange(call, from, src, dst);
        }
        if self.runs_one_shot(call) {
            return self.run_one_shot(call, src, dst);
        }
        let lens = (src.len(), dst.len());
        self.guarded(call, lens, flight::FlightPath::Host, |eng, prog, desc| {
            let full = call.op.unwrap_or(ReduceOp::Sum);
            eng.execute(&prog, &desc, full, full.step_op(), src, dst)
        })
    }

    /// An exchange ([`Call::recv_from`]): sends `src` to `call.root` and receives `dst` from
    /// `from` in one drive loop, as MPI's `Sendrecv`. The two progress together, so ranks that
    /// send to each other complete whatever the size, where a send and then a receive on
    /// both would each wait for the other beyond what the transport buffers. The frames are
    /// exactly those of a send to `call.root` and a receive from `from` (each with its own
    /// sequence number), so a peer may answer with a plain `recv` and `send`.
    fn run_exchange(&mut self, call: &Call, from: usize, src: &[u8], dst: &mut [u8]) -> Result<()> {
        self.ready()?;
        let to = call.root;
        let name = Collective::SendRecv.name();
        for (what, p) in [("destination", to), ("source", from)] {
            let why = if p >= self.world {
                format!("{what} {p} is not a rank (world size {})", self.world)
            } else if p == self.rank {
                format!("the {what} is this rank itself")
            } else {
                continue;
            };
            return Err(Error::invalid(Some(self.rank), name, why));
        }
        let esz = call.dtype.size();
        let (sent, received) = (src.len() / esz, dst.len() / esz);
        let send = Call {
            count: sent,
            recv_from: None,
            ..*call
        };
        let recv = Call {
            count: received,
            root: from,
            is_send: false,
            recv_from: None,
            ..*call
        };
        let desc = |c: &Call, seq: u64| Desc {
            coll: Collective::SendRecv,
            algo: Algorithm::Direct,
            seq,
            dtype: c.dtype,
            op: NO_OP,
            count: c.count as u64,
            root: 0,
        };
        let send_desc = desc(&send, self.next_seq(&send));
        let recv_desc = desc(&recv, self.next_seq(&recv));
        let mut sched = plan::Schedule::new();
        let round = sched.round();
        if sent > 0 {
            round.send(to, Loc::src(0..sent));
        }
        if received > 0 {
            round.recv_copy(from, Loc::dst(0..received));
        }
        let prog = plan::compile(&sched, (self.opts.segment_bytes / esz).max(1));
        if prog.steps.is_empty() {
            return Ok(());
        }
        let op_name = format!(
            "{name} #{} to rank {to} / #{} from rank {from}",
            send_desc.seq, recv_desc.seq
        );
        self.flight_start(&flight::Started {
            coll: Collective::SendRecv,
            is_send: true,
            dtype: call.dtype,
            count: sent as u64,
            op: None,
            root: to,
            recv_from: Some((from, recv_desc.seq)),
            algo: Algorithm::Direct,
            path: flight::FlightPath::Host,
            seq: send_desc.seq,
        });
        let t0 = self.trace.is_some().then(Instant::now);
        let result = self
            .with_scratch(&prog, |eng, s, start, deadline| {
                let descs = Descs {
                    send: &send_desc,
                    recv: &recv_desc,
                    per_peer: None,
                };
                let sum = ReduceOp::Sum;
                eng.drive(&prog, descs, sum, sum, src, dst, esz, start, deadline, s)
            })
            .map_err(|e| e.in_op(&op_name).at_rank(self.rank));
        self.flight_end(&result, esz);
        if let Some(t0) = t0 {
            let args = vec![
                ("to", to.to_string()),
                ("from", from.to_string()),
                ("bytes sent", src.len().to_string()),
                ("bytes received", dst.len().to_string()),
            ];
            self.trace_call(&op_name, t0, args, &result);
        }
        if let Err(e) = &result {
            self.fail(e.clone());
        }
        result
    }

    /// Sequences, compiles and describes `call`, runs `body`, and poisons the engine (telling
    /// every peer) if `body` fails fatally.
    fn guarded(
        &mut self,
        call: &Call,
        (src_len, dst_len): (usize, usize),
        path: flight::FlightPath,
        body: impl FnOnce(&mut Self, Arc<Program>, Desc) -> Result<()>,
    ) -> Result<()> {
        self.ready()?;
        let peer_call = call.coll.rooted() || call.coll == Collective::SendRecv;
        if peer_call && call.root >= self.world {
            return Err(Error::invalid(
                Some(self.rank),
                call.coll.name(),
                format!(
                    "rank {} is not a rank (world size {})",
                    call.root, self.world
                ),
            ));
        }
        let esz = call.dtype.size();
        let bytes = call.count.saturating_mul(esz);
        let algo = self.chosen(call.coll, bytes);
        if let Some(f) = self.opts.force_algo {
            let bit = 1u16 << (call.coll as usize);
            // Only where there was a choice: a barrier has one algorithm whatever is forced.
            let has_choice = call.coll.sole_algorithm().is_none();
            if self.opts.forced_hier_is_ring(call.coll) && self.forced_warned & bit == 0 {
                self.forced_warned |= bit;
                tracing::warn!(
                    rank = self.rank,
                    "the forced algorithm hier (DSPARK_ALGO or set_algorithm) needs every host \
                     to hold as many ranks, numbered contiguously (ranks 0..k on one host, k..2k \
                     on the next, ...): this job's hosts differ in size or interleave their \
                     ranks, so all_reduce runs the ring"
                );
            }
            if self
                .opts
                .forced_one_shot_is_doubling(self.world, call.coll, bytes)
                && self.forced_warned & bit == 0
            {
                self.forced_warned |= bit;
                let slots = match self.opts.one_shot_slot_bytes {
                    0 => "which this transport has none of".to_string(),
                    b => format!("up to {b} bytes here"),
                };
                tracing::warn!(
                    rank = self.rank,
                    "the forced algorithm one_shot (DSPARK_ALGO or set_algorithm) gives every \
                     rank the same result only through shared-memory slots ({slots}): beyond \
                     them, with {} ranks, each rank would add the contributions in its own \
                     order, so all_reduce runs recursive_doubling",
                    self.world
                );
            }
            if has_choice && !f.supports(call.coll) && self.forced_warned & bit == 0 {
                self.forced_warned |= bit;
                tracing::warn!(
                    rank = self.rank,
                    "the forced algorithm {f} (DSPARK_ALGO or set_algorithm) does not \
                     implement {}: it runs {algo}, its default here ({f} applies to {})",
                    call.coll.name(),
                    f.collectives()
                );
            }
        }
        let req = Request {
            coll: call.coll,
            algo,
            world: self.world,
            rank: self.rank,
            count: call.count,
            root: call.root,
            is_send: call.is_send,
            finalize: call.op == Some(ReduceOp::Avg),
            per_host: self.opts.per_host,
        };
        let frame = Framed {
            recorded: call.count,
            algo,
            path,
            count: call.count as u64,
        };
        self.framed(call, frame, |eng, desc| {
            let c = eng.program(&req, esz)?;
            let (need_src, need_dst) = (c.extent[Buf::Src as usize], c.extent[Buf::Dst as usize]);
            if src_len / esz < need_src || dst_len / esz < need_dst {
                return Err(Error::invalid(
                    Some(eng.rank),
                    call.coll.name(),
                    format!(
                        "buffers hold {} and {} elements, the call needs {need_src} and \
                         {need_dst}",
                        src_len / esz,
                        dst_len / esz
                    ),
                ));
            }
            body(eng, c.prog, *desc)
        })
    }

    /// Acts on an abort requested from another thread, and returns the error that poisoned
    /// the engine, if one has: what every call checks before it takes a sequence number.
    pub(crate) fn ready(&mut self) -> Result<()> {
        self.honour_abort();
        match &self.poison {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The frame of every scheduled call, around its `body`: takes the call's sequence number
    /// and opens its recorder entry ([`Engine::start_call`]), describes it to the frames
    /// ([`Desc`]), runs `body`, names the call in its error and traces it (the name, "all_reduce
    /// #12", is formatted only there, never on the hot path), then ends it
    /// ([`Engine::end_call`]: a failure poisons the engine and tells every peer).
    fn framed(
        &mut self,
        call: &Call,
        frame: Framed,
        body: impl FnOnce(&mut Self, &Desc) -> Result<()>,
    ) -> Result<()> {
        let seq = self.start_call(call, frame.recorded, frame.algo, frame.path);
        let desc = Desc {
            coll: call.coll,
            algo: frame.algo,
            seq,
            dtype: call.dtype,
            op: call.op.map_or(NO_OP, ReduceOp::code),
            count: frame.count,
            root: if call.coll.rooted() {
                call.root as u32
            } else {
                0
            },
        };
        let t0 = self.trace.is_some().then(Instant::now);
        let result = body(self, &desc).map_err(|e| e.in_op(&desc.op_name()));
        if let Some(t0) = t0 {
            let args = call_trace_args(call, frame.algo);
            self.trace_call(&desc.op_name(), t0, args, &result);
        }
        let rank = self.rank;
        self.end_call(
            call,
            seq,
            result.map_err(|e| e.at_rank(rank)),
            call.dtype.size(),
        )
    }

    /// What every call does once it has its algorithm: takes its sequence number, tells the
    /// transport which collective runs and opens its flight-recorder entry. Returns the
    /// sequence number.
    fn start_call(
        &mut self,
        call: &Call,
        count: usize,
        algo: Algorithm,
        path: flight::FlightPath,
    ) -> u64 {
        let seq = self.start_call_unrecorded(call);
        self.flight_start(&started(call, count, algo, path, seq));
        seq
    }

    /// [`Engine::start_call`] without the flight-recorder entry, which the caller opens
    /// itself ([`Engine::flight_start`]) before the call ends: the one-shot path opens it
    /// after it has published its contribution, so that the recorder's clock read and stores
    /// overlap the wait for the peers instead of delaying them.
    fn start_call_unrecorded(&mut self, call: &Call) -> u64 {
        let seq = self.next_seq(call);
        if call.coll != Collective::SendRecv {
            self.transport
                .collective_progress(Some(seq), self.coll_done);
        }
        seq
    }

    /// Takes `call`'s sequence number and opens its flight-recorder entry.
    fn record_start(
        &mut self,
        call: &Call,
        count: usize,
        algo: Algorithm,
        path: flight::FlightPath,
    ) -> u64 {
        let seq = self.next_seq(call);
        self.flight_start(&started(call, count, algo, path, seq));
        seq
    }

    /// Closes call `seq` ([`Engine::start_call`]) with `result`: the flight record, the last
    /// completed collective and, on failure, the poison.
    fn end_call(&mut self, call: &Call, seq: u64, result: Result<()>, esz: usize) -> Result<()> {
        self.flight_end(&result, esz);
        if call.coll != Collective::SendRecv {
            if result.is_ok() {
                self.coll_done = seq;
            }
            self.transport.collective_progress(None, self.coll_done);
        }
        // Once the call has its sequence number, any failure — even an argument problem found
        // by a device or transport half-way — leaves this rank out of step with its peers
        // (and maybe half a frame on a wire): poison, and tell them.
        if let Err(e) = &result {
            self.fail(e.clone());
        }
        result
    }

    /// Fails `call` on this rank before it started (a device that cannot run it, a kernel
    /// that did not compile, a staging buffer that could not be had): the peers are in the
    /// call already, so this poisons the engine and tells them, as a failure half-way does.
    /// Returns the error, named after the call and this rank.
    pub fn fail_before_start(&mut self, call: &Call, e: Error) -> Error {
        if let Some(p) = &self.poison {
            return p.clone();
        }
        // The number the call would have taken: the peers are in it under that number.
        let name = self
            .last_seq(call)
            .map_or(call.coll.name().to_string(), |s| {
                format!("{} #{}", call.coll.name(), *s + 1)
            });
        let e = e.in_op(&name).at_rank(self.rank);
        self.fail(e.clone());
        e
    }

    /// The last sequence number taken by calls like `call`: communicator-wide for
    /// collectives, per peer and direction for send/recv (`None` for a peer out of range).
    fn last_seq(&mut self, call: &Call) -> Option<&mut u64> {
        match call.coll {
            Collective::SendRecv if call.is_send => self.p2p_sent.get_mut(call.root),
            Collective::SendRecv => self.p2p_received.get_mut(call.root),
            _ => Some(&mut self.seq),
        }
    }

    /// The sequence number of `call` ([`Engine::last_seq`], taken). Its peer was checked.
    fn next_seq(&mut self, call: &Call) -> u64 {
        self.last_seq(call).map_or(0, |ctr| {
            *ctr += 1;
            *ctr
        })
    }

    /// A call of no elements (other than a barrier): it moves nothing and sends nothing, but
    /// takes its sequence number like any call, so that ranks that disagree about it (count
    /// 0 here, N elsewhere) meet a mismatch at their next call that exchanges data, instead
    /// of one of them waiting for a deadline. Reports an earlier failure.
    pub fn skip_empty(&mut self, call: &Call) -> Result<()> {
        self.ready()?;
        // Nothing runs: the transport hears only that it completed.
        let algo = self.algorithm(call.coll, 0);
        let seq = self.record_start(call, 0, algo, flight::FlightPath::Host);
        self.flight_end(&Ok(()), 1);
        if call.coll != Collective::SendRecv {
            self.coll_done = seq;
            self.transport.collective_progress(None, seq);
        }
        Ok(())
    }

    /// Poisons the engine with `e` and tells every peer.
    pub fn fail(&mut self, e: Error) {
        if self.poison.is_some() {
            return;
        }
        let origin = match &e {
            Error::Aborted { by, .. } => *by,
            Error::Mismatch { .. } => self.rank,
            _ => self.rank,
        };
        let (class, text) = AbortClass::of(&e);
        tracing::debug!(rank = self.rank, error = %e, "communicator failed; telling peers");
        self.transport.abort(origin, class, &text);
        self.flight_failed(&e);
        self.poison = Some(e);
    }

    /// Registers a caller buffer with the transport (see
    /// [`Registering::register_host`](crate::transport::Registering::register_host));
    /// `Ok(None)` when the transport has no use for registrations.
    pub fn register_host(&mut self, region: &[u8]) -> Result<Option<u64>> {
        if let Some(e) = &self.poison {
            return Err(e.clone());
        }
        match self.transport.registration_mut() {
            Some(r) => r.register_host(region),
            None => Ok(None),
        }
    }

    /// The transport's direct region layout
    /// ([`DirectTransport::direct_layout`](crate::transport::DirectTransport::direct_layout));
    /// `None` when it has none or cannot have one.
    pub fn direct_layout(&self) -> Option<crate::transport::DirectLayout> {
        self.transport.direct().and_then(|d| d.direct_layout())
    }

    /// Host access to the transport's direct region ([`DirectTransport::direct_host_region`]).
    ///
    /// [`DirectTransport::direct_host_region`]:
    ///     crate::transport::DirectTransport::direct_host_region
    pub fn direct_host_region(&self) -> Option<Arc<dyn crate::transport::RegionAccess>> {
        self.transport.direct().and_then(|d| d.direct_host_region())
    }

    /// Frames the transport sent zero-copy from registered buffers (0 for transports that
    /// always copy).
    pub fn zero_copy_frames(&self) -> u64 {
        self.transport
            .registration()
            .map_or(0, |r| r.zero_copy_frames())
    }

    /// Releases a registration.
    pub fn deregister(&mut self, id: u64) {
        if let Some(r) = self.transport.registration_mut() {
            r.deregister(id);
        }
    }

    /// Closes the transport cleanly (goodbye to every peer).
    pub fn close(&mut self) {
        if self.poison.is_none() {
            self.transport.close();
        }
        if let Some(t) = self.trace.as_mut() {
            t.finish();
        }
    }

    /// Writes the trace span of one call that started at `t0`, with `args` and its error.
    fn trace_call(
        &mut self,
        name: &str,
        t0: Instant,
        mut args: Vec<(&str, String)>,
        result: &Result<()>,
    ) {
        if let Some(t) = self.trace.as_mut() {
            if let Err(e) = result {
                args.push(("error", trace::json_str(&e.to_string())));
            }
            t.span(trace::Lane::Calls, "call", name, t0, Instant::now(), &args);
            t.flush();
        }
    }
}

/// The arguments of a call's event in the `DSPARK_TRACE` file.
fn call_trace_args(call: &Call, algo: Algorithm) -> Vec<(&'static str, String)> {
    let bytes = call.count.saturating_mul(call.dtype.size());
    let mut args = vec![
        ("algorithm", trace::json_str(algo.name())),
        ("bytes", bytes.to_string()),
        ("count", call.count.to_string()),
        ("dtype", trace::json_str(call.dtype.name())),
    ];
    if let Some(op) = call.op {
        args.push(("op", trace::json_str(op.name())));
    }
    if call.coll.rooted() || call.coll == Collective::SendRecv {
        args.push(("root or peer", call.root.to_string()));
    }
    args
}

/// The flight-recorder entry of `call` started as collective or message `seq`.
fn started(
    call: &Call,
    count: usize,
    algo: Algorithm,
    path: flight::FlightPath,
    seq: u64,
) -> flight::Started {
    flight::Started {
        coll: call.coll,
        is_send: call.is_send,
        dtype: call.dtype,
        count: count as u64,
        op: call.op,
        root: call.root,
        recv_from: None,
        algo,
        path,
        seq,
    }
}

/// What [`Engine::framed`] records and describes of a call besides the [`Call`] itself.
struct Framed {
    /// The count its recorder entry keeps.
    recorded: usize,
    algo: Algorithm,
    path: flight::FlightPath,
    /// The count its frames' headers carry.
    count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::mem::{MemFabric, MemTransport};
    use crate::transport::{FrameHeader, Interest, RecvProgress, RecvSink, SendProgress};
    use std::sync::Mutex;

    /// A `mem` transport that records what the engine tells it about its collectives and
    /// its aborts, in order.
    #[derive(Debug)]
    struct Recording {
        inner: MemTransport,
        log: Arc<Mutex<Vec<String>>>,
        /// The kind it says it is (`mem`'s where `None`).
        kind: Option<TransportKind>,
        /// The largest data frame it was given to send.
        largest_frame: Arc<Mutex<u32>>,
    }

    impl Recording {
        fn note(&self, s: String) {
            self.log.lock().unwrap().push(s);
        }
    }

    impl Transport for Recording {
        fn kind(&self) -> TransportKind {
            self.kind.unwrap_or_else(|| self.inner.kind())
        }
        fn describe(&self) -> String {
            self.inner.describe()
        }
        fn send(
            &mut self,
            peer: usize,
            hdr: &FrameHeader,
            data: &[u8],
            progress: &mut SendProgress,
        ) -> Result<bool> {
            let mut largest = self.largest_frame.lock().unwrap();
            *largest = (*largest).max(hdr.len);
            drop(largest);
            self.inner.send(peer, hdr, data, progress)
        }
        fn recv(
            &mut self,
            peer: usize,
            progress: &mut RecvProgress,
            sink: &mut dyn RecvSink,
        ) -> Result<bool> {
            self.inner.recv(peer, progress, sink)
        }
        fn peek(&mut self, peer: usize) -> Result<Option<FrameHeader>> {
            self.inner.peek(peer)
        }
        fn wait(&mut self, interest: &[Interest], deadline: Instant) -> Result<()> {
            self.inner.wait(interest, deadline)
        }
        fn check_peers(&mut self) -> Result<()> {
            self.inner.check_peers()
        }
        fn abort(&mut self, origin: usize, class: AbortClass, reason: &str) {
            self.note(format!("abort from {origin}"));
            self.inner.abort(origin, class, reason);
        }
        fn close(&mut self) {
            self.inner.close();
        }
        fn collective_progress(&mut self, running: Option<u64>, completed: u64) {
            self.note(format!("running {running:?} completed {completed}"));
        }
    }

    fn engine(fabric: &MemFabric, rank: usize, world: usize) -> (Engine, Arc<Mutex<Vec<String>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let t = Recording {
            inner: fabric.transport(rank),
            log: Arc::clone(&log),
            kind: None,
            largest_frame: Arc::default(),
        };
        (
            Engine::new(rank, world, Box::new(t), EngineOptions::default()),
            log,
        )
    }

    fn taken(log: &Mutex<Vec<String>>) -> Vec<String> {
        std::mem::take(&mut *log.lock().unwrap())
    }

    #[test]
    fn the_transport_hears_which_collective_runs_and_which_completed_before_an_abort() {
        let fabric = MemFabric::new(2, 4);
        let (mut eng, log) = engine(&fabric, 0, 1);
        let sum = Some(ReduceOp::Sum);
        let mut buf = [1u8; 8];
        eng.run(
            &Call::new(Collective::AllReduce, sum, 8, 0, false),
            &[],
            &mut buf,
        )
        .unwrap();
        assert_eq!(
            taken(&log),
            ["running Some(1) completed 0", "running None completed 1"]
        );
        // A collective of no elements completes at once, with its own sequence number.
        eng.skip_empty(&Call::new(Collective::AllReduce, sum, 0, 0, false))
            .unwrap();
        assert_eq!(taken(&log), ["running None completed 2"]);
        // A collective that fails after it took its sequence number (two ranks: buffers too
        // small for the call): the abort that tells the peers comes after the transport
        // heard that #1 did not complete.
        let fabric = MemFabric::new(2, 4);
        let (mut eng, log) = engine(&fabric, 0, 2);
        let e = eng
            .run(
                &Call::new(Collective::AllReduce, sum, 16, 0, false),
                &[],
                &mut buf,
            )
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert_eq!(
            taken(&log),
            [
                "running Some(1) completed 0",
                "running None completed 0",
                "abort from 0"
            ]
        );
    }

    #[test]
    fn send_and_recv_are_no_collectives_to_the_transport() {
        let fabric = MemFabric::new(2, 4);
        let (mut eng, log) = engine(&fabric, 0, 2);
        eng.run(
            &Call::new(Collective::SendRecv, None, 4, 1, true),
            &[7u8; 4],
            &mut [],
        )
        .unwrap();
        assert_eq!(taken(&log), Vec::<String>::new());
    }

    /// Two ranks over TCP cut all_reduces under 16 MiB into 256 KiB segments; larger ones,
    /// point-to-point calls, other transports and other worlds take the communicator's 512
    /// KiB. The sums are right either way (odd element counts: the last segment is short).
    #[test]
    fn two_ranks_over_tcp_cut_all_reduces_under_16_mib_into_smaller_segments() {
        let big = PAIR_SEGMENT_BELOW / 4 + 3; // f32 elements: just over 16 MiB
        let cases = [
            (2, None, Collective::AllReduce, 262_147, 512 << 10),
            (
                2,
                Some(TransportKind::Tcp),
                Collective::AllReduce,
                262_147,
                256 << 10,
            ),
            (
                2,
                Some(TransportKind::Tcp),
                Collective::AllReduce,
                big,
                512 << 10,
            ),
            (
                2,
                Some(TransportKind::Tcp),
                Collective::SendRecv,
                262_147,
                512 << 10,
            ),
            (
                3,
                Some(TransportKind::Tcp),
                Collective::AllReduce,
                393_221,
                512 << 10,
            ),
        ];
        for (world, kind, coll, count, want) in cases {
            let fabric = MemFabric::new(world, 4);
            let largest: Vec<Arc<Mutex<u32>>> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..world)
                    .map(|r| {
                        let largest_frame = Arc::default();
                        let t = Recording {
                            inner: fabric.transport(r),
                            log: Arc::default(),
                            kind,
                            largest_frame: Arc::clone(&largest_frame),
                        };
                        let opts = EngineOptions {
                            force_algo: (coll == Collective::AllReduce).then_some(Algorithm::Ring),
                            ..EngineOptions::default()
                        };
                        let mut eng = Engine::new(r, world, Box::new(t), opts);
                        s.spawn(move || {
                            let mine: Vec<f32> = (0..count).map(|i| (i % 7 + r) as f32).collect();
                            let mut call = if coll == Collective::SendRecv {
                                Call::new(coll, None, count, 1 - r, r == 0)
                            } else {
                                Call::new(coll, Some(ReduceOp::Sum), count, 0, false)
                            };
                            call.dtype = DataType::F32;
                            // All_reduce in place (`dst` holds the input); the send's input
                            // in `src`.
                            let mut out = if coll == Collective::SendRecv {
                                vec![0f32; count]
                            } else {
                                mine.clone()
                            };
                            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
                            match (coll, r) {
                                (Collective::SendRecv, 0) => {
                                    eng.run(&call, bytemuck::cast_slice(&mine), &mut [])
                                }
                                _ => eng.run(&call, &[], dst),
                            }
                            .unwrap();
                            for (i, &x) in out.iter().enumerate() {
                                let want = match coll {
                                    Collective::SendRecv if r == 0 => 0.0,
                                    Collective::SendRecv => (i % 7) as f32,
                                    _ => (0..world).map(|q| (i % 7 + q) as f32).sum(),
                                };
                                assert_eq!(x, want, "rank {r} element {i}");
                            }
                            largest_frame
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let got = largest.iter().map(|l| *l.lock().unwrap()).max().unwrap();
            assert_eq!(
                got as usize, want,
                "{world} ranks over {kind:?}, {coll} of {count} f32"
            );
        }
    }
}
