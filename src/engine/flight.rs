//! The flight recorder: the last N operations of a communicator, kept in a fixed ring that
//! the engine writes without allocating or locking, read by any thread at any time
//! ([`Recorder::snapshot`]), and dumped as one JSON file per rank when the communicator
//! fails (`DSPARK_FR_DUMP=DIR`) or on demand (`Communicator::flight_record`).
//!
//! Each entry holds what the call was (sequence number, collective, element type, count,
//! operator, root or peer, algorithm, transport, memory path), its state (`queued`,
//! `started`, `completed`, `failed`), its times, and for a failed call the kind of failure
//! and the progress the drive loop had made: the peer it was waiting for, the step (k of n)
//! and the bytes received of that step.
//!
//! The ring is a seqlock per slot: the engine (one writer at a time: it runs under the
//! communicator's engine lock) bumps a slot's version to odd, stores the words, bumps it to
//! even; a reader copies the words and keeps them only when the version was even and the
//! same before and after. Recording a call costs one clock read and a handful of stores
//! (`benches/comm.rs` measures it: `recorder`).
//!
//! Times: a call's start is read from the monotonic clock, except a one-shot all_reduce's
//! (the small calls over shared memory), which is read from the coarse clock
//! (`CLOCK_MONOTONIC_COARSE`: up to one kernel tick, 1–4 ms, early, at a quarter of the
//! cost; [`Recorder::coarse_stamp`]). A call that did not wait past its spin ends at its
//! start (its `duration_us` is 0); one that slept or failed ends at a clock read. No entry
//! starts before the end of the entry before it.
//!
//! # The dump format (`"format": "dspark-flight-record"`, `"version": 1`)
//!
//! One JSON object per communicator and rank: `format`, `version`, `rank`, `world`,
//! `communicator` (its index among this process's communicators), `communicator_id` (16
//! hex digits every rank of the communicator records alike: [`FlightRecord::communicator_id`];
//! the file of a process's k-th further communicator is `rank<r>.c<k>.<id>.json`), `pid`,
//! `host` (this rank's host as the rank table has it: its name, or `DSPARK_HOST_ID`; null
//! where unknown), `places` (where ranks run: `rank`, `host`, `addr` (the data listener) and
//! `pid` where known; every rank of a communicator of up to
//! [`FULL_PLACES`](super::places::FULL_PLACES) ranks, else this rank and those its entries
//! name), `capacity` (N),
//! `recorded` (calls recorded since init; the first `recorded - entries.len()` were
//! overwritten), `reason` (`timeout`, `peer_lost`, `mismatch`, `aborted`, `failed`,
//! `on_demand`), `error` (the error that failed the communicator, or null),
//! `dumped_at_unix_ns`, and `entries`, oldest first (the calls the ring holds, then the
//! operations issued and not started, `queued`, in a dump on failure as on demand): `seq` (collectives count from 1 across
//! the communicator; a send or receive counts per peer and direction; null for a queued
//! call), `collective` (`all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`, `reduce`,
//! `all_to_all`, `barrier`, `send`, `recv`, `send_recv`), `dtype`, `count` (elements, as
//! the engine counts them: per rank block for all_gather, reduce_scatter and all_to_all;
//! 18446744073709551615, `u64::MAX`, for an all_to_all of counts per peer, `all_to_all_v`),
//! `op`, `root`, `peer`, `recv_from` and `recv_seq` (an exchange), `algorithm`,
//! `transport`, `path` (`host`, `host-staged`, `gpu-direct`), `state`,
//! `started_unix_ns`, `ended_unix_ns`, `duration_us`, and `failure`: null, or `kind`,
//! `peer`, `progress` (`peer`, `direction` `recv`|`send`, `step`, `steps`, `steps_done`,
//! `bytes`, `of_bytes`). Readers ignore fields they do not know; a reader that meets a
//! higher `version` says so.

use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

mod dump;

pub use dump::file_name;
pub(crate) use dump::leaf_name;

use super::places::Place;
use super::scratch::Scratch;
use super::Engine;
use crate::error::{Error, Result};
use crate::plan::Program;
use crate::plan::{Algorithm, Collective};
use crate::transport::TransportKind;
use crate::types::{DataType, ReduceOp};

/// The dump's `format` field.
pub const FORMAT: &str = "dspark-flight-record";
/// The dump's `version` field.
pub const VERSION: u32 = 1;
/// Entries kept when `DSPARK_FR_ENTRIES` is not set (as torch's `TORCH_FR_BUFFER_SIZE`).
pub const DEFAULT_ENTRIES: usize = 2000;
/// The most entries a recorder keeps (`DSPARK_FR_ENTRIES` is checked against it).
pub const MAX_ENTRIES: usize = 1 << 20;

/// Communicators opened with a recorder in this process so far (dump file names).
static OPENED: AtomicUsize = AtomicUsize::new(0);

/// Where a recorded call stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FlightState {
    /// Issued (non-blocking), waiting behind earlier operations.
    Queued,
    /// Running.
    Started,
    /// Completed on this rank.
    Completed,
    /// Failed on this rank.
    Failed,
}

impl FlightState {
    /// Its name in the dump.
    pub const fn name(self) -> &'static str {
        match self {
            FlightState::Queued => "queued",
            FlightState::Started => "started",
            FlightState::Completed => "completed",
            FlightState::Failed => "failed",
        }
    }
}

/// The memory path of a recorded call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FlightPath {
    /// Host buffers.
    Host,
    /// Device buffers staged through host memory.
    HostStaged,
    /// Device buffers through the transport's direct region (GPUDirect RDMA).
    GpuDirect,
}

impl FlightPath {
    const ALL: [FlightPath; 3] = [
        FlightPath::Host,
        FlightPath::HostStaged,
        FlightPath::GpuDirect,
    ];

    /// Its name in the dump.
    pub const fn name(self) -> &'static str {
        match self {
            FlightPath::Host => "host",
            FlightPath::HostStaged => "host-staged",
            FlightPath::GpuDirect => "gpu-direct",
        }
    }
}

/// How far a failed call had got: what its schedule was waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlightProgress {
    /// The peer of the step it was waiting on.
    pub peer: usize,
    /// Waiting to send (the peer did not read) rather than to receive.
    pub sending: bool,
    /// That step, counted from 1.
    pub step: usize,
    /// Steps of the call's schedule.
    pub steps: usize,
    /// Steps done.
    pub steps_done: usize,
    /// Bytes of that step received so far (0 for a send).
    pub bytes: u64,
    /// Bytes of that step.
    pub of_bytes: u64,
}

/// Why a recorded call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureKind {
    /// Its deadline passed.
    Timeout,
    /// A peer closed its connection or died.
    PeerLost,
    /// Ranks disagreed about the call.
    Mismatch,
    /// A peer (or this rank) aborted the communicator.
    Aborted,
    /// Anything else (transport, I/O, arguments found half-way).
    Other,
}

impl FailureKind {
    const ALL: [FailureKind; 5] = [
        FailureKind::Timeout,
        FailureKind::PeerLost,
        FailureKind::Mismatch,
        FailureKind::Aborted,
        FailureKind::Other,
    ];

    /// The kind of `e`, and the peer it names.
    pub fn of(e: &Error) -> (FailureKind, Option<usize>) {
        match e {
            Error::Timeout { peer, .. } => (FailureKind::Timeout, *peer),
            Error::PeerLost { peer, .. } => (FailureKind::PeerLost, Some(*peer)),
            Error::Mismatch { peer, .. } => (FailureKind::Mismatch, *peer),
            Error::Aborted { by, .. } => (FailureKind::Aborted, Some(*by)),
            Error::Transport { peer, .. } | Error::Io { peer, .. } => (FailureKind::Other, *peer),
            _ => (FailureKind::Other, None),
        }
    }

    /// Its name in the dump.
    pub const fn name(self) -> &'static str {
        match self {
            FailureKind::Timeout => "timeout",
            FailureKind::PeerLost => "peer_lost",
            FailureKind::Mismatch => "mismatch",
            FailureKind::Aborted => "aborted",
            FailureKind::Other => "failed",
        }
    }
}

/// A failed call's failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlightFailure {
    /// What kind.
    pub kind: FailureKind,
    /// The peer the error names (the one waited for, lost, disagreeing, or aborting).
    pub peer: Option<usize>,
    /// How far the call had got, where its drive loop knew.
    pub progress: Option<FlightProgress>,
}

/// One recorded call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlightEntry {
    /// Its sequence number (see the module docs); `None` while queued.
    pub seq: Option<u64>,
    /// `all_reduce`, ..., `send`, `recv`, `send_recv`.
    pub collective: &'static str,
    /// Element type (`None` while queued).
    pub dtype: Option<DataType>,
    /// Elements.
    pub count: u64,
    /// Reduction operator.
    pub op: Option<ReduceOp>,
    /// Root of a broadcast or reduce.
    pub root: Option<usize>,
    /// Peer of a send or receive (the destination of an exchange).
    pub peer: Option<usize>,
    /// An exchange's source rank and the sequence number of its receive.
    pub recv_from: Option<(usize, u64)>,
    /// Its algorithm.
    pub algorithm: Option<Algorithm>,
    /// The communicator's transport.
    pub transport: TransportKind,
    /// The memory path.
    pub path: FlightPath,
    /// Where it stands.
    pub state: FlightState,
    /// When it started (or was queued), ns since the Unix epoch.
    pub started_unix_ns: u64,
    /// When it completed or failed, ns since the Unix epoch.
    pub ended_unix_ns: Option<u64>,
    /// Why it failed.
    pub failure: Option<FlightFailure>,
}

/// A communicator's flight record: its last operations, oldest first
/// (`Communicator::flight_record`); [`FlightRecord::to_json`] is the dump format.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FlightRecord {
    /// This rank.
    pub rank: usize,
    /// Ranks of the communicator.
    pub world: usize,
    /// The communicator's index among this process's communicators (0: the first).
    pub communicator: usize,
    /// What every rank of this communicator, and no other communicator's, records
    /// (`communicator_id`: a hash of where its ranks met; empty when unknown): the dumps of
    /// two colour groups of one split, or of ranks that number their communicators
    /// differently, are told apart by it, not by `communicator`.
    pub communicator_id: String,
    /// Entries the ring holds (`DSPARK_FR_ENTRIES`).
    pub capacity: usize,
    /// Calls recorded since init (older ones than the ring holds were overwritten).
    pub recorded: u64,
    /// The error that failed the communicator, if any.
    pub error: Option<String>,
    /// The entries, oldest first; queued operations last.
    pub entries: Vec<FlightEntry>,
    /// Where ranks run (the dump's `places`): every rank of a communicator of up to
    /// [`FULL_PLACES`](super::places::FULL_PLACES), else this rank and those the entries
    /// name; empty where unknown (a communicator over a given transport).
    pub places: Vec<(usize, Place)>,
}

// Words of a slot.
const W_SEQ: usize = 0;
const W_META: usize = 1;
const W_COUNT: usize = 2;
const W_PEERS: usize = 3;
const W_START: usize = 4;
const W_END: usize = 5;
const W_FAIL: usize = 6;
const W_STEPS: usize = 7;
const W_BYTES: usize = 8;
const W_OF: usize = 9;
/// The largest `of_bytes` a slot holds (48 bits; `steps_done` has the other 16).
const OF_BYTES_MAX: u64 = (1 << 48) - 1;
const W_RSEQ: usize = 10;
const W_INDEX: usize = 11;
const WORDS: usize = 12;

// META bits.
const NONE4: u64 = 0xF;
const NONE_U32: u64 = 0xFFFF_FFFF;

/// One entry: its seqlock version and its words, 104 bytes aligned to two cache lines (an
/// entry never shares a line with its neighbours, and never spans three).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Slot {
    ver: AtomicU64,
    w: [AtomicU64; WORDS],
}

/// What the engine knows about a call when it starts.
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug)]
pub struct Started {
    pub coll: Collective,
    pub is_send: bool,
    pub dtype: DataType,
    pub count: u64,
    pub op: Option<ReduceOp>,
    pub root: usize,
    pub recv_from: Option<(usize, u64)>,
    pub algo: Algorithm,
    pub path: FlightPath,
    pub seq: u64,
}

/// One communicator's recorder (shared by the engine, which writes, and its communicator,
/// which reads).
#[derive(Debug)]
pub struct Recorder {
    slots: Box<[Slot]>,
    /// Calls recorded so far (the next call's index).
    next: AtomicU64,
    /// The next call's slot (`next % capacity`, kept so that the writer never divides).
    wpos: AtomicUsize,
    epoch: Instant,
    /// `CLOCK_MONOTONIC` at `epoch`, in ns (for [`Recorder::coarse_stamp`]); `None` where
    /// that clock or the coarse one cannot be read (said once, at creation): the coarse
    /// stamps then come from the precise clock.
    epoch_mono_ns: Option<u64>,
    epoch_unix_ns: u64,
    /// The writer's latest stamp: no stamp is earlier (a coarse one may lag a precise one
    /// written before it by up to a tick).
    last_stamp: AtomicU64,
    rank: usize,
    world: usize,
    communicator: usize,
    communicator_id: String,
    transport: TransportKind,
    dump_dir: Option<PathBuf>,
    /// The communicator's error (set once, when it fails).
    error: Mutex<Option<String>>,
    /// Where each rank runs (empty where unknown).
    places: Vec<Place>,
    /// The operations issued and not started, for a dump on failure (set by the owner of
    /// the queue in front of the engine: [`Recorder::set_queued_source`]).
    queued: Queued,
}

/// [`Recorder::set_queued_source`]'s source, once set.
#[derive(Default)]
struct Queued(std::sync::OnceLock<QueuedSource>);

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "Queued(set)"
        } else {
            "Queued(unset)"
        })
    }
}

/// What [`Recorder::set_queued_source`] takes: the operations issued and not started (their
/// names and when each was issued), or `None` when they cannot be had without waiting.
pub type QueuedSource = Box<dyn Fn() -> Option<Vec<(&'static str, Instant)>> + Send + Sync>;

/// `CLOCK_MONOTONIC` now, for a recorder's epoch, when both it and the coarse clock can be
/// read; else `None`, said as a warning (its one-shot calls are then stamped by the precise
/// clock, at its cost).
fn coarse_epoch() -> Option<u64> {
    let epoch = crate::time::mono_ns().filter(|_| crate::time::coarse_ns().is_some());
    if epoch.is_none() {
        tracing::warn!(
            "flight recorder: CLOCK_MONOTONIC or CLOCK_MONOTONIC_COARSE cannot be read; \
             one-shot calls are stamped by the precise clock instead (~16 ns more per call)"
        );
    }
    epoch
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl Recorder {
    /// A recorder of `capacity` entries (at least 1) for `rank` of `world` over `transport`,
    /// dumping into `dump_dir` when the communicator fails; `numbered`: it is a
    /// communicator's (it takes the next number of the process's communicators, which
    /// names its dump file), not an engine's own default.
    pub fn new(
        capacity: usize,
        rank: usize,
        world: usize,
        transport: TransportKind,
        dump_dir: Option<PathBuf>,
        numbered: bool,
    ) -> Self {
        let cap = capacity.clamp(1, MAX_ENTRIES);
        Recorder {
            slots: (0..cap).map(|_| Slot::default()).collect(),
            next: AtomicU64::new(0),
            wpos: AtomicUsize::new(0),
            epoch: Instant::now(),
            epoch_mono_ns: coarse_epoch(),
            epoch_unix_ns: unix_ns(),
            last_stamp: AtomicU64::new(0),
            rank,
            world,
            communicator: if numbered {
                OPENED.fetch_add(1, Ordering::Relaxed)
            } else {
                0
            },
            communicator_id: String::new(),
            transport,
            dump_dir,
            error: Mutex::new(None),
            places: Vec::new(),
            queued: Queued::default(),
        }
    }

    /// Where a dump on failure finds the operations queued behind the engine (the
    /// communicator's queue; the engine itself knows nothing of them). Set once; never
    /// waited for: a source that cannot answer at once answers `None`, and the dump goes
    /// without them.
    pub fn set_queued_source(&self, f: QueuedSource) {
        let _ = self.queued.0.set(f);
    }

    /// This recorder with where each rank runs (the dumps' `host` and `places`).
    #[must_use]
    pub fn with_places(mut self, places: Vec<Place>) -> Self {
        self.places = places;
        self
    }

    /// This recorder with the communicator's id ([`FlightRecord::communicator_id`]).
    #[must_use]
    pub fn with_communicator_id(mut self, id: String) -> Self {
        self.communicator_id = id;
        self
    }

    /// Entries it holds.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn ns(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// The writer's stamp of `ns` since the epoch: never earlier than its previous stamp.
    fn stamp_ns(&self, ns: u64) -> u64 {
        let ns = ns.max(self.last_stamp.load(Ordering::Relaxed));
        self.last_stamp.store(ns, Ordering::Relaxed);
        ns
    }

    /// The stamp of `t`, for [`Recorder::start`], [`Recorder::complete`] and
    /// [`Recorder::fail`] (only the engine that writes this recorder stamps).
    pub fn stamp(&self, t: Instant) -> u64 {
        self.stamp_ns(self.ns(t))
    }

    /// A stamp of now from the coarse clock ([`crate::time::coarse_ns`]): up to a kernel
    /// tick (1–4 ms) early, at a quarter of a precise read's cost. The one-shot all_reduce
    /// stamps its calls so (and ends a call that did not sleep at its start).
    pub fn coarse_stamp(&self) -> u64 {
        let coarse = self
            .epoch_mono_ns
            .and_then(|epoch| Some(crate::time::coarse_ns()?.saturating_sub(epoch)));
        match coarse {
            Some(ns) => self.stamp_ns(ns),
            None => self.stamp(Instant::now()),
        }
    }

    fn slot(&self, index: u64) -> &Slot {
        &self.slots[(index % self.slots.len() as u64) as usize]
    }

    /// Writes `words` of slot `pos` under its version.
    #[inline]
    fn write(&self, pos: usize, words: &[(usize, u64)]) {
        let Some(s) = self.slots.get(pos) else {
            return;
        };
        let v = s.ver.load(Ordering::Relaxed);
        s.ver.store(v.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        for &(i, x) in words {
            s.w[i].store(x, Ordering::Relaxed);
        }
        s.ver.store(v.wrapping_add(2), Ordering::Release);
    }

    /// Records that call `c` started at stamp `t` ([`Recorder::stamp`]); returns its slot
    /// for [`Recorder::complete`] and [`Recorder::fail`].
    #[inline]
    pub fn start(&self, c: &Started, t: u64) -> usize {
        let index = self.next.load(Ordering::Relaxed);
        let pos = self.wpos.load(Ordering::Relaxed);
        let op = c.op.map_or(NONE4, |o| u64::from(o.code()));
        let meta = (c.coll as u64)
            | (u64::from(c.dtype.code()) << 4)
            | (op << 8)
            | ((c.algo as u64) << 12)
            | ((FlightState::Started as u64) << 20)
            | ((c.path as u64) << 23)
            | (u64::from(c.is_send) << 25)
            | (u64::from(c.recv_from.is_some()) << 26)
            | (NONE4 << 28);
        let from = c.recv_from.map_or(NONE_U32, |(p, _)| p as u64);
        self.write(
            pos,
            &[
                (W_SEQ, c.seq),
                (W_META, meta),
                (W_COUNT, c.count),
                (W_PEERS, (c.root as u64 & NONE_U32) | (from << 32)),
                (W_START, t),
                (W_END, u64::MAX),
                (W_RSEQ, c.recv_from.map_or(0, |(_, s)| s)),
                (W_INDEX, index),
            ],
        );
        let next = if pos + 1 == self.slots.len() {
            0
        } else {
            pos + 1
        };
        self.wpos.store(next, Ordering::Relaxed);
        self.next.store(index + 1, Ordering::Release);
        // Brings the next call's entry into this core's cache now, while the call runs: the
        // ring (2000 entries by default) does not stay in L1, and its stores missing there cost
        // an 8-byte one-shot all_reduce over shm a sixth of its time when taken at the next
        // call's start (measured: 0.35 µs against 0.29 µs with a 16-entry ring).
        if let Some(s) = self.slots.get(next) {
            let _ = s.ver.load(Ordering::Relaxed);
            let _ = s.w[WORDS - 1].load(Ordering::Relaxed);
        }
        pos
    }

    /// Records that the call in slot `pos` completed at stamp `t`.
    #[inline]
    pub fn complete(&self, pos: usize, t: u64) {
        let Some(s) = self.slots.get(pos) else {
            return;
        };
        let meta = s.w[W_META].load(Ordering::Relaxed);
        let meta = (meta & !(0x7 << 20)) | ((FlightState::Completed as u64) << 20);
        self.write(pos, &[(W_META, meta), (W_END, t)]);
    }

    /// Records that the call in slot `pos` failed at stamp `t` with `f`.
    pub(crate) fn fail(&self, pos: usize, t: u64, f: &FlightFailure) {
        let Some(s) = self.slots.get(pos) else {
            return;
        };
        let meta = s.w[W_META].load(Ordering::Relaxed);
        let kind = FailureKind::ALL
            .iter()
            .position(|&k| k == f.kind)
            .unwrap_or(4) as u64;
        let meta = (meta & !(0x7 << 20) & !(0xF << 28) & !(0x7 << 32))
            | ((FlightState::Failed as u64) << 20)
            | (kind << 28)
            | (u64::from(f.progress.is_some()) << 32)
            | (u64::from(f.progress.is_some_and(|p| p.sending)) << 33)
            | (u64::from(f.peer.is_some()) << 34);
        let p = f.progress.unwrap_or(FlightProgress {
            peer: 0,
            sending: false,
            step: 0,
            steps: 0,
            steps_done: 0,
            bytes: 0,
            of_bytes: 0,
        });
        let u32s = |a: usize, b: usize| (a as u64 & NONE_U32) | ((b as u64 & NONE_U32) << 32);
        self.write(
            pos,
            &[
                (W_META, meta),
                (W_END, t),
                (W_FAIL, u32s(f.peer.unwrap_or(0), p.peer)),
                (W_STEPS, u32s(p.step, p.steps)),
                (W_BYTES, p.bytes),
                // 48 bits of bytes, 16 of steps done: each saturates (65 535 steps of a
                // segment each: an 8 GiB ring all_reduce wrapped before).
                (
                    W_OF,
                    p.of_bytes.min(OF_BYTES_MAX) | ((p.steps_done.min(0xffff) as u64) << 48),
                ),
            ],
        );
    }

    /// Keeps the communicator's error for the record.
    pub(crate) fn set_error(&self, e: &Error) {
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(e.to_string());
        }
    }

    /// Reads slot `index` consistently; `None` if the writer lapped it meanwhile.
    fn read(&self, index: u64) -> Option<[u64; WORDS]> {
        let s = self.slot(index);
        for _ in 0..10_000 {
            let v1 = s.ver.load(Ordering::Acquire);
            if v1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let mut w = [0u64; WORDS];
            for (i, x) in w.iter_mut().enumerate() {
                *x = s.w[i].load(Ordering::Relaxed);
            }
            fence(Ordering::Acquire);
            if s.ver.load(Ordering::Relaxed) == v1 {
                return (w[W_INDEX] == index).then_some(w);
            }
        }
        None
    }

    fn entry(&self, w: &[u64; WORDS]) -> FlightEntry {
        let meta = w[W_META];
        let coll = Collective::ALL
            .get((meta & 0xF) as usize)
            .copied()
            .unwrap_or(Collective::Barrier);
        let is_send = meta >> 25 & 1 == 1;
        let exchange = meta >> 26 & 1 == 1;
        let root = (w[W_PEERS] & NONE_U32) as usize;
        let state = [
            FlightState::Queued,
            FlightState::Started,
            FlightState::Completed,
            FlightState::Failed,
        ]
        .get((meta >> 20 & 0x7) as usize)
        .copied()
        .unwrap_or(FlightState::Started);
        let collective = match coll {
            Collective::SendRecv if exchange => "send_recv",
            Collective::SendRecv if is_send => "send",
            Collective::SendRecv => "recv",
            c => c.name(),
        };
        let failure = (state == FlightState::Failed).then(|| {
            let kind = FailureKind::ALL
                .get((meta >> 28 & 0xF) as usize)
                .copied()
                .unwrap_or(FailureKind::Other);
            let progress = (meta >> 32 & 1 == 1).then(|| FlightProgress {
                peer: (w[W_FAIL] >> 32) as usize,
                sending: meta >> 33 & 1 == 1,
                step: (w[W_STEPS] & NONE_U32) as usize,
                steps: (w[W_STEPS] >> 32) as usize,
                steps_done: (w[W_OF] >> 48) as usize,
                bytes: w[W_BYTES],
                of_bytes: w[W_OF] & OF_BYTES_MAX,
            });
            FlightFailure {
                kind,
                peer: (meta >> 34 & 1 == 1).then_some((w[W_FAIL] & NONE_U32) as usize),
                progress,
            }
        });
        let op = meta >> 8 & 0xF;
        FlightEntry {
            seq: Some(w[W_SEQ]),
            collective,
            dtype: DataType::from_code((meta >> 4 & 0xF) as u8),
            count: w[W_COUNT],
            op: (op != NONE4)
                .then(|| ReduceOp::from_code(op as u8))
                .flatten(),
            root: coll.rooted().then_some(root),
            peer: (coll == Collective::SendRecv).then_some(root),
            recv_from: exchange.then_some(((w[W_PEERS] >> 32) as usize, w[W_RSEQ])),
            algorithm: Algorithm::from_code((meta >> 12 & 0xFF) as u8),
            transport: self.transport,
            path: FlightPath::ALL
                .get((meta >> 23 & 0x3) as usize)
                .copied()
                .unwrap_or(FlightPath::Host),
            state,
            started_unix_ns: self.epoch_unix_ns.saturating_add(w[W_START]),
            ended_unix_ns: (w[W_END] != u64::MAX)
                .then(|| self.epoch_unix_ns.saturating_add(w[W_END])),
            failure,
        }
    }

    /// The entry of the last call started (`None` before the first, or while the writer laps
    /// its slot).
    pub(crate) fn latest(&self) -> Option<FlightEntry> {
        let n = self.next.load(Ordering::Acquire);
        let w = self.read(n.checked_sub(1)?)?;
        Some(self.entry(&w))
    }

    /// Nanoseconds since the Unix epoch now, on the clock the entries' times are on.
    pub(crate) fn unix_now_ns(&self) -> u64 {
        self.epoch_unix_ns.saturating_add(self.ns(Instant::now()))
    }

    /// The record now: every entry the ring holds, oldest first, then `queued` (operations
    /// issued and not started: their collective names and when they were issued).
    pub fn snapshot(&self, queued: &[(&'static str, Instant)]) -> FlightRecord {
        let n = self.next.load(Ordering::Acquire);
        let first = n.saturating_sub(self.slots.len() as u64);
        let mut entries: Vec<FlightEntry> = (first..n)
            .filter_map(|i| self.read(i).map(|w| self.entry(&w)))
            .collect();
        for &(name, t) in queued {
            entries.push(FlightEntry {
                seq: None,
                collective: name,
                dtype: None,
                count: 0,
                op: None,
                root: None,
                peer: None,
                recv_from: None,
                algorithm: None,
                transport: self.transport,
                path: FlightPath::Host,
                state: FlightState::Queued,
                started_unix_ns: self.epoch_unix_ns.saturating_add(self.ns(t)),
                ended_unix_ns: None,
                failure: None,
            });
        }
        FlightRecord {
            rank: self.rank,
            world: self.world,
            communicator: self.communicator,
            communicator_id: self.communicator_id.clone(),
            capacity: self.slots.len(),
            recorded: n,
            error: self.error.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            places: super::places::dumped(&self.places, self.rank, self.world, &entries),
            entries,
        }
    }
}

impl FlightRecord {
    /// This rank's host, as the rank table has it (None where unknown).
    pub fn host(&self) -> Option<&str> {
        self.places
            .iter()
            .find(|(r, _)| *r == self.rank)
            .map(|(_, p)| p.host.as_str())
            .filter(|h| !h.is_empty())
    }

    /// The last collective (not send/recv) this rank completed, if the ring holds it.
    pub fn last_completed(&self) -> Option<&FlightEntry> {
        self.entries.iter().rev().find(|e| {
            e.state == FlightState::Completed
                && !e.collective.starts_with("send")
                && e.collective != "recv"
        })
    }
}

/// What the call in progress told the recorder.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    /// Its slot.
    index: Option<usize>,
    /// When it started (the drive loop's start, so that a call reads the clock once more).
    pub(super) t0: Option<Instant>,
    /// Its coarse start stamp ([`Engine::flight_start_coarse`]): its end too, unless
    /// [`InFlight::end_from_clock`].
    coarse: Option<u64>,
    /// Where its schedule stood when it failed (`of_bytes` in elements until it ends).
    pub(super) stall: Option<FlightProgress>,
}

impl InFlight {
    /// The call in progress ends at a clock read (it slept or failed), not at its start.
    pub(super) fn end_from_clock(&mut self) {
        self.t0 = None;
        self.coarse = None;
    }
}

/// Where `prog`'s schedule stands in `s`: the first peer whose head receive (else head send)
/// may progress, its step, and the bytes of it received; `of_bytes` counts elements.
pub(super) fn stall_point(prog: &Program, s: &Scratch) -> Option<FlightProgress> {
    let ready = |i: u32| prog.deps(i as usize).iter().all(|&d| s.done[d as usize]);
    let steps = prog.steps.len();
    let steps_done = s.done.iter().filter(|&&d| d).count();
    for sending in [false, true] {
        for &p in &s.active {
            let q = if sending { &s.sendq[p] } else { &s.recvq[p] };
            if let Some(&i) = q.front().filter(|&&i| ready(i)) {
                return Some(FlightProgress {
                    peer: p,
                    sending,
                    step: i as usize + 1,
                    steps,
                    steps_done,
                    bytes: if sending {
                        0
                    } else {
                        s.recv_prog[p].got as u64
                    },
                    of_bytes: prog.steps[i as usize].op.len() as u64,
                });
            }
        }
    }
    None
}

impl Engine {
    /// Records that call `c` starts (nothing when the recorder is off). Its clock read is
    /// the drive loop's too (the start of the call's deadline, [`Engine::with_scratch`]).
    #[inline]
    pub(super) fn flight_start(&mut self, c: &Started) {
        if let Some(r) = &self.flight {
            let t = Instant::now();
            self.fl.index = Some(r.start(c, r.stamp(t)));
            self.fl.t0 = Some(t);
            self.fl.coarse = None;
            self.fl.stall = None;
        }
    }

    /// [`Engine::flight_start`] stamped by the coarse clock ([`Recorder::coarse_stamp`]),
    /// for a call that reads the precise clock only if it waits: no `fl.t0`, and unless
    /// [`InFlight::end_from_clock`] the call ends at that stamp.
    pub(super) fn flight_start_coarse(&mut self, c: &Started) {
        if let Some(r) = &self.flight {
            let t = r.coarse_stamp();
            self.fl.index = Some(r.start(c, t));
            self.fl.t0 = None;
            self.fl.coarse = Some(t);
            self.fl.stall = None;
        }
    }

    /// Records how the call in progress ended (`esz`: its element size). One clock read,
    /// or none for a call that moved nothing (its start time is its end time: no drive loop
    /// took the start, [`Engine::with_scratch`]).
    #[inline]
    pub(super) fn flight_end(&mut self, result: &Result<()>, esz: usize) {
        let unused_start = self.fl.t0.take();
        let coarse = self.fl.coarse.take();
        let (Some(i), Some(r)) = (self.fl.index.take(), &self.flight) else {
            return;
        };
        let t = match (unused_start, coarse) {
            (Some(t), _) => r.stamp(t),
            (None, Some(t)) => t,
            (None, None) => r.stamp(Instant::now()),
        };
        match result {
            Ok(()) => r.complete(i, t),
            Err(e) => {
                let (kind, peer) = FailureKind::of(e);
                let progress = self.fl.stall.take().map(|mut p| {
                    p.of_bytes = p.of_bytes.saturating_mul(esz as u64);
                    p
                });
                r.fail(
                    i,
                    t,
                    &FlightFailure {
                        kind,
                        peer,
                        progress,
                    },
                );
            }
        }
    }

    /// Notes where the schedule stood when a drive loop failed (for the recorder).
    pub(super) fn flight_stall(&mut self, prog: &Program, s: &Scratch) {
        if self.fl.index.is_some() {
            self.fl.stall = stall_point(prog, s);
        }
    }

    /// Keeps the error that failed this engine in the record, and dumps the record when
    /// `DSPARK_FR_DUMP` asks.
    pub(super) fn flight_failed(&self, e: &Error) {
        if let Some(r) = &self.flight {
            r.set_error(e);
            r.dump_on_failure(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn started(seq: u64) -> Started {
        Started {
            coll: Collective::AllReduce,
            is_send: false,
            dtype: DataType::F32,
            count: 7,
            op: Some(ReduceOp::Max),
            root: 0,
            recv_from: None,
            algo: Algorithm::Ring,
            path: FlightPath::Host,
            seq,
        }
    }

    #[test]
    fn the_ring_keeps_the_last_entries_in_order() {
        let r = Recorder::new(4, 1, 3, TransportKind::Tcp, None, false);
        let t = r.stamp(Instant::now());
        for s in 1..=6 {
            let i = r.start(&started(s), t);
            r.complete(i, t);
        }
        let rec = r.snapshot(&[]);
        assert_eq!(rec.recorded, 6);
        let seqs: Vec<_> = rec.entries.iter().map(|e| e.seq.unwrap()).collect();
        assert_eq!(seqs, [3, 4, 5, 6]);
        let e = &rec.entries[3];
        assert_eq!(e.collective, "all_reduce");
        assert_eq!(e.dtype, Some(DataType::F32));
        assert_eq!(e.op, Some(ReduceOp::Max));
        assert_eq!(e.count, 7);
        assert_eq!(e.algorithm, Some(Algorithm::Ring));
        assert_eq!(e.state, FlightState::Completed);
        assert_eq!(e.root, None);
        assert!(e.ended_unix_ns.unwrap() >= e.started_unix_ns);
    }

    /// The one-shot path stamps calls with the coarse clock: its stamps must sit on the same
    /// axis as the precise ones (at most a tick behind the wall clock's reading of them) and
    /// never before an earlier entry's, so that the record's entries stay in time order.
    #[test]
    fn coarse_stamps_trail_the_clock_by_at_most_a_tick_and_never_go_back() {
        let r = Recorder::new(16, 0, 2, TransportKind::Shm, None, false);
        let mut prev = 0;
        for s in 1..=200u64 {
            let before = r.ns(Instant::now());
            let (t0, t1) = if s % 2 == 0 {
                (r.coarse_stamp(), r.stamp(Instant::now()))
            } else {
                (r.stamp(Instant::now()), r.coarse_stamp())
            };
            let after = r.ns(Instant::now());
            assert!(prev <= t0 && t0 <= t1, "stamps went back: {prev} {t0} {t1}");
            assert!(t1 <= after, "a stamp {t1} after the clock's {after}");
            assert!(
                before.saturating_sub(t0) < 50_000_000,
                "a coarse stamp {t0} ns far behind the clock's {before}"
            );
            let i = r.start(&started(s), t0);
            r.complete(i, t1);
            prev = t1;
        }
        let rec = r.snapshot(&[]);
        for w in rec.entries.windows(2) {
            assert!(w[0].ended_unix_ns.unwrap() <= w[1].started_unix_ns);
        }
    }

    /// Without the coarse clock, coarse stamps come from the precise one: still the time of
    /// the call, not the last stamp written.
    #[test]
    fn without_the_coarse_clock_coarse_stamps_are_precise_ones() {
        let mut r = Recorder::new(4, 0, 2, TransportKind::Shm, None, false);
        r.epoch_mono_ns = None;
        std::thread::sleep(std::time::Duration::from_millis(20));
        let before = r.ns(Instant::now());
        let t = r.coarse_stamp();
        let after = r.ns(Instant::now());
        assert!(before <= t && t <= after, "{before} <= {t} <= {after}");
    }

    #[test]
    fn a_failure_keeps_its_kind_peer_and_progress() {
        let r = Recorder::new(8, 0, 3, TransportKind::Shm, None, false);
        let now = Instant::now();
        let t = r.stamp(now);
        let i = r.start(&started(1), t);
        let p = FlightProgress {
            peer: 2,
            sending: false,
            step: 3,
            steps: 4,
            steps_done: 2,
            bytes: 5,
            of_bytes: 12,
        };
        let f = FlightFailure {
            kind: FailureKind::Timeout,
            peer: Some(2),
            progress: Some(p),
        };
        r.fail(i, t, &f);
        let rec = r.snapshot(&[("broadcast", now)]);
        assert_eq!(rec.entries[0].state, FlightState::Failed);
        assert_eq!(rec.entries[0].failure, Some(f));
        assert_eq!(rec.entries[1].state, FlightState::Queued);
        assert_eq!(rec.entries[1].collective, "broadcast");
        let j = rec.to_json();
        assert!(j.contains(r#""failure":{"kind":"timeout","peer":2,"progress":{"peer":2,"direction":"recv","step":3,"steps":4,"steps_done":2,"bytes":5,"of_bytes":12}}"#), "{j}");
        assert!(
            j.contains(r#""format":"dspark-flight-record","version":1"#),
            "{j}"
        );
    }

    #[test]
    fn readers_on_other_threads_never_see_a_torn_entry() {
        let r = std::sync::Arc::new(Recorder::new(2, 0, 2, TransportKind::Tcp, None, false));
        let w = std::sync::Arc::clone(&r);
        let writer = std::thread::spawn(move || {
            let t = w.stamp(Instant::now());
            for s in 1..=20_000u64 {
                let mut c = started(s);
                c.count = s * 3;
                let i = w.start(&c, t);
                w.complete(i, t);
            }
        });
        for _ in 0..2000 {
            for e in r.snapshot(&[]).entries {
                assert_eq!(e.count, e.seq.unwrap() * 3);
            }
        }
        writer.join().unwrap();
    }
}
