//! The shared-memory transport, for ranks that are all on one host.
//!
//! # Segments
//!
//! Every rank creates one segment: an anonymous, sealed memory file (`memfd`) with a place for
//! a ring from every peer. Peers open it through `/proc/<pid>/fd/<n>` during the bootstrap,
//! while its owner waits for them, and map it. The segment has no name in any filesystem, so
//! nothing is left behind after any exit, SIGKILL included: the kernel frees the memory with
//! the last mapping and the owner's descriptor (which it keeps, to commit rings later).
//!
//! Only what is used is committed (O(log n) per rank at init, not O(n)): at init the header
//! page and the rings from the *standing partners* ([`crate::plan::algo::standing_partners`],
//! the pairs the collectives' schedules use) are allocated (`fallocate`, so that memory that
//! cannot be had fails init with ENOMEM, not a later access with SIGBUS) and their page tables
//! populated on both sides (no first-touch page faults inside the first collectives); the
//! rest of the segment is reserved address space. The two rings of any other pair are
//! committed when the pair is first used (a send, a receive, or its liveness connection
//! arriving): each rank allocates the ring into its own segment and populates both rings'
//! pages in its mappings (`MADV_POPULATE_WRITE`, which allocates what the peer has not yet),
//! before the first byte moves. That memory is the kernel's to give then, as for any
//! allocation: short of memory (on the host or in a memory cgroup) it reclaims, and where it
//! cannot, either the allocation fails (ENOMEM or ENOSPC: the call that first used the pair
//! gets an error naming both ranks, not a SIGBUS later) or the OOM killer ends a process. A
//! job whose every pair talks commits every ring, n(n − 1) on the host.
//! Layout (offsets in bytes, every shared word on its own 64-byte line):
//!
//! | offset | what | written by |
//! | --- | --- | --- |
//! | 0 | magic, version, world, rank, ring size, nonce, pid | owner, at init |
//! | 64 | `bell`: futex word, bumped to wake the owner | peers |
//! | 128 | `sleeping`: the owner is about to block on `bell` | owner |
//! | 192 | `status` (open, goodbye, abort), abort class, origin, message length, and (+16) the last collective the owner completed when it aborted | owner |
//! | 256 | abort message (up to 3840 bytes) | owner |
//! | 4096, 12288 | the two one-shot slots: a frame header (its `seq` the flag, stored last) and up to 8160 payload bytes (the engine sends at most 4096) | owner |
//! | 20480 + i × S | ring *into* the owner from its i-th peer: `head` (+0, the sender's), `tail` (+128, the owner's), data (+256, R bytes); S = 256 + R rounded up to whole pages, so each ring is committed on pages of its own | |
//!
//! # Rings
//!
//! One single-producer single-consumer byte ring per ordered pair, in the *receiver's*
//! segment. Frames are the 32-byte header and the payload, each frame starting on a 64-byte
//! boundary (so a small frame is one cache line and payload elements never straddle the
//! wrap). `head` and `tail` are monotonically increasing byte counts: the sender copies
//! bytes into `[head, tail + R)` and publishes them with a release store of `head` (every
//! 64 KiB of a large frame, so the receiver starts before the sender finishes); the receiver
//! hands `[tail, head)` to the engine — copying receives copy out, reducing receives reduce
//! straight out of the peer-written ring into the destination (one copy in, one reduce out,
//! no staging) — and publishes its progress with a release store of `tail`.
//!
//! # Waiting
//!
//! The engine spins first; [`Transport::wait`] then blocks on this rank's `bell` with
//! FUTEX_WAIT (process-shared). The owner sets `sleeping`, fences, reads `bell`, re-checks
//! its rings and only then sleeps; a peer that publishes `head` or `tail` fences and reads
//! `sleeping`, and only when it is set bumps `bell` and calls FUTEX_WAKE. So the fast path
//! has no system call, and a sleeper is never missed (each side's store is ordered before its
//! load of the other's word).
//!
//! # Liveness, goodbye and abort
//!
//! A dead process writes no FIN into shared memory, so a TCP connection to each peer in use
//! stays open as a liveness descriptor: its kernel closes it when the process exits, however
//! it exits. The standing partners' are the bootstrap's, made at init; any other pair's is
//! made on first use through the bootstrap's [`Links`] (as the TCP transport's data
//! connections and the verbs transport's exchanges), by whichever end needs it first. A
//! first send to such a peer waits for it (so every pair that exchanged frames can tell a
//! goodbye from a death); a first receive starts it and goes on (what is in the ring is good
//! either way). Until it is made, the peer's process is watched through `/proc/<pid>/stat`
//! (gone, a zombie, or another process under its pid: lost), and a peer that died before is
//! refused at its listener at once. A blocked wait sleeps at most [`LIVENESS_POLL`] at a
//! time (1 ms while a connection is in the making, whose handshake advances when this rank
//! looks at it; a rank making one wakes its peer) and then polls those connections, so a
//! killed peer surfaces within milliseconds as [`Error::PeerLost`] — after whatever it had
//! already written to the ring, which stays readable (the memory outlives the writer). A
//! stopped peer (SIGSTOP) keeps its connection open and writes nothing: the caller's
//! deadline reports it ([`Error::Timeout`]), as over TCP. Goodbye and abort are the owner's
//! `status` word (with the abort's class, origin and message beside it), set once and
//! followed by a wake of every peer: unlike an in-ring frame it is deliverable even when a
//! ring is full or a frame half written. As over TCP,
//! a receive takes what the ring holds first and meets a goodbye only after it (so a
//! contribution a peer published before it aborted may still complete a call that has not
//! yet seen the abort: the values are whole); an abort
//! fails every survivor with [`Error::Aborted`] (or [`Error::Mismatch`] with the same text),
//! except a collective the aborting rank had completed (its `status` line says which,
//! [`Transport::collective_progress`]): a survivor still finishing that one finishes it, and
//! its next call fails. Likewise a peer found gone fails, during a collective, only the send
//! or receive that needs more from it (every rank takes part: a survivor that needs it fails
//! at once and its abort tells the others), and at once outside a collective. See "Nothing
//! hangs" in the README for the rule every transport follows.

//!
//! # Device memory (not implemented)
//!
//! Device buffers are staged through host memory over this transport, like over TCP
//! ([`crate::path::SHM_STAGED_REASON`]). GPU-to-GPU on one host (NCCL's P2P transport) would
//! plug in as a direct region ([`DirectTransport`](crate::transport::DirectTransport),
//! `send_direct`/`recv_direct`):
//! each rank exports its landing slots with `cuMemExportToShareableHandle` (a POSIX fd,
//! passed like the segment's: `/proc/<pid>/fd` or SCM_RIGHTS) or `cuIpcGetMemHandle`
//! (through the bootstrap), peers map them (`cuMemImportFromShareableHandle` / `cuIpcOpen`),
//! a direct send is a `cuMemcpyAsync` device-to-device into the peer's slot followed by an
//! event, and the ring carries only the frame header with the slot index once the copy's
//! event completed; `release_direct` returns the slot through the ring's `tail`. The path
//! report would say `cuda-ipc` (or `p2p`) per connection, with the reason where peer access
//! between the two GPUs is unavailable (`cuDeviceCanAccessPeer`).
//!
//! # Where things are
//!
//! | file | what |
//! | --- | --- |
//! | `sizing.rs` | the layout in bytes: ring strides, segment lengths, ring bases; whether init fits in memory |
//! | `setup.rs` | [`prepare`], [`prepare_group`], [`SegInfo`], [`Prepared::connect`], [`ShmTransport::new`] |
//! | `ring.rs` | the ring protocol: the bodies of `send` and `recv` |
//! | `liveness.rs` | liveness connections and processes, goodbye and abort, sleeping on the bell |
//! | `lazy.rs` | liveness connections and ring commits on first use ([`ShmTransport::with_links`]) |
//! | `slots.rs` | the one-shot slots of small all_reduces ([`super::Slots`]) |
//! | `seg.rs` | the memory file, its mapping, bounds-checked copies, futex calls |
//!
//! [`Links`]: super::Links

use std::net::TcpStream;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use super::{
    AbortClass, FrameHeader, Interest, RecvProgress, RecvSink, SendProgress, Transport,
    TransportKind,
};
use crate::error::{Error, Result};

mod fence;
#[cfg(feature = "testing")]
pub(crate) mod fuzz;
mod lazy;
mod liveness;
mod ring;
mod seg;
mod setup;
mod sizing;
mod slots;
pub(crate) use self::slots::SLOT_CAPACITY;

use self::lazy::Lazy;
pub use self::seg::Seg;
#[cfg(test)]
pub(crate) use self::setup::group_in_process;
pub use self::setup::{prepare, prepare_group, Prepared, SegInfo};
#[cfg(feature = "testing")]
pub(crate) use self::{liveness::parse_proc_stat, sizing::parse_mem_available};

/// Default bytes of each ring (per ordered pair of ranks).
pub const DEFAULT_RING_BYTES: usize = 2 << 20;
/// Smallest ring accepted.
pub const MIN_RING_BYTES: usize = 4096;
/// Largest ring accepted.
pub const MAX_RING_BYTES: usize = 1 << 30;
/// The longest a blocked wait sleeps before it looks at the peers' liveness connections: how
/// late, at most, a killed peer is noticed by a rank asleep on its `bell`.
pub const LIVENESS_POLL: Duration = Duration::from_millis(10);
/// The longest a blocked wait sleeps while a liveness connection made on first use is in the
/// making (its handshake advances when this rank looks at it).
const LINK_POLL: Duration = Duration::from_millis(1);
/// How often a blocked wait looks at the processes of peers whose liveness connection is
/// made: a peer that forked (torch's DataLoader workers, a multiprocessing pool) shares
/// that socket with its children, and its death closes it only once they end too.
const PROCESS_POLL: Duration = Duration::from_millis(100);

const MAGIC: u64 = 0x4453_504b_5f53_484d; // "DSPK_SHM"
const VERSION: u32 = 4;

// Segment layout (see the module docs).
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_WORLD: usize = 12;
const OFF_RANK: usize = 16;
const OFF_RING: usize = 24;
const OFF_NONCE: usize = 32;
const OFF_PID: usize = 40;
const OFF_BELL: usize = 64;
const OFF_SLEEPING: usize = 128;
const OFF_STATUS: usize = 192;
const OFF_CLASS: usize = 196;
const OFF_ORIGIN: usize = 200;
const OFF_MSG_LEN: usize = 204;
/// 1 when the owner's process registered for global expedited membarriers and issues one
/// when it goes to sleep, so that its peers may publish with a compiler fence only
/// ([`fence`]); 0 otherwise.
const OFF_ASYM: usize = 216;
/// The last collective an aborting owner completed (0 where none, or a segment that predates
/// the word: the abort then fails every call, as before).
const OFF_DONE: usize = 208;
const OFF_MSG: usize = 256;
const MSG_CAP: usize = seg::PAGE - OFF_MSG;
/// The owner's two one-shot slots ([`slots`]), two pages each: a 4 KiB contribution and
/// its header (a slot of one page held 4 064 bytes, so a 4 KiB all_reduce, the largest size
/// the one-shot path was chosen for, ran recursive doubling).
const OFF_SLOTS: usize = seg::PAGE;
const SLOT_STRIDE: usize = 2 * seg::PAGE;
const RINGS: usize = OFF_SLOTS + 2 * SLOT_STRIDE;
const RING_HEAD: usize = 0;
const RING_TAIL: usize = 128;
const RING_DATA: usize = 256;

const STATUS_OPEN: u32 = 0;
const STATUS_BYE: u32 = 1;
const STATUS_ABORT: u32 = 2;

/// Settings of the shared-memory transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmOptions {
    /// Bytes of each ring (rounded up to 64); one ring per ordered pair of ranks, so a rank's
    /// segment has room for `world − 1` of them (committed at init for the standing
    /// partners, on first use for the others).
    pub ring_bytes: usize,
    /// Whether to leave the full fence of the wake-up handshake to the sleepers'
    /// `membarrier(2)` where the kernel has it ([`fence`]; `DSPARK_SHM_MEMBARRIER`).
    pub membarrier: bool,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            ring_bytes: DEFAULT_RING_BYTES,
            membarrier: true,
        }
    }
}

/// The error for a ring whose counters a peer left inconsistent (`lo..hi` more than a ring
/// apart or backwards): never happens between dspark ranks; a corrupt segment must not make
/// this rank panic or read out of bounds.
fn corrupt(rank: usize, peer: usize, what: &str, lo: u64, hi: u64) -> Error {
    Error::Transport {
        rank: Some(rank),
        peer: Some(peer),
        op: "shared-memory ring".into(),
        what: format!("corrupt ring counters ({what}: {lo}..{hi})"),
    }
}

/// A copy outside a segment ([`seg::OutOfBounds`]) as the error of the connection to `peer`.
fn out_of_bounds(rank: usize, peer: usize) -> impl FnOnce(seg::OutOfBounds) -> Error {
    move |b| Error::Transport {
        rank: Some(rank),
        peer: Some(peer),
        op: "shared-memory ring".into(),
        what: format!("a copy refused: {b}"),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PeerState {
    Open,
    /// Its liveness connection closed without a goodbye: the process is gone. What it wrote
    /// to the ring is still taken; what needs more from it fails.
    Gone(String),
    /// Failed for good.
    Lost(String),
}

#[derive(Debug)]
struct Peer {
    /// The peer's segment (holds the ring this rank sends into).
    seg: Seg,
    /// The connection to it, kept as a liveness descriptor: the bootstrap's for the standing
    /// partners, made on first use for the others (`None` until then).
    stream: Option<TcpStream>,
    /// Its process, and when it started (`/proc/<pid>/stat`): how its death is noticed while
    /// its liveness connection is still in the making.
    pid: u32,
    started: Option<u64>,
    /// Whether the two rings of the pair are committed (allocated and populated on this
    /// rank's side): at init for the standing partners, on first use for the others.
    committed: bool,
    state: PeerState,
    /// Send ring (in the peer's segment): bytes published, last `tail` seen.
    tx_head: u64,
    tx_tail: u64,
    tx_in_frame: bool,
    /// Receive ring (in this rank's segment): bytes taken, last `head` seen.
    rx_tail: u64,
    rx_head: u64,
    rx_in_frame: bool,
    /// Offsets of the two rings' bases in their segments.
    tx_base: usize,
    rx_base: usize,
}

/// The shared-memory transport (see the module docs).
#[derive(Debug)]
pub struct ShmTransport {
    rank: usize,
    world: usize,
    ring: usize,
    own: Seg,
    /// This rank's segment file, kept to commit the rings into it on first use.
    file: std::fs::File,
    peers: Vec<Option<Peer>>,
    /// Bytes of this rank's segment committed at init.
    committed_at_init: usize,
    /// Peers connected at init (with a liveness connection).
    connected_at_init: usize,
    among: String,
    desc: String,
    done: bool,
    /// Liveness connections made on first use (None: every peer has one from init).
    lazy: Option<Lazy>,
    /// When the linked peers' processes were last looked at ([`PROCESS_POLL`]).
    procs_looked: Instant,
    /// The collective the engine runs and the last one it completed
    /// ([`Transport::collective_progress`]); an abort publishes `coll_done`.
    coll_running: Option<u64>,
    coll_done: u64,
    /// Some peer's abort was let through a collective it had completed (so that `send` and
    /// `recv` look for the news only then: [`ShmTransport::abort_news`]).
    peer_aborted: bool,
    /// One-shot contributions published so far ([`slots`]): the next goes to slot
    /// `slot_calls % 2`.
    slot_calls: u64,
    /// The sequence number of the last one-shot contribution this rank published (0: none):
    /// a peer's contribution to an earlier collective than the one this rank runs, but a
    /// later one than this, is to a collective this rank did not run one-shot (a mismatch:
    /// [`ShmTransport::slot_header_at`]).
    published_seq: u64,
    /// A contribution was published whose sleeping readers are not yet woken
    /// ([`crate::transport::Slots::settle`]).
    wake_owed: bool,
    /// Where in a slot the last line of this rank's last contribution starts (0: it ends in
    /// the header's line): a peer's contribution to the same call is as long, and
    /// [`crate::transport::Slots::peek`] fetches that line while it polls the flag.
    slot_tail: usize,
    /// Whether this rank's segment says it issues a membarrier before it sleeps
    /// (`OFF_ASYM`; [`fence`]).
    asym: bool,
    /// Whether this rank publishes with a compiler fence only before it looks for sleepers:
    /// it and every peer issue a membarrier before they sleep ([`fence`]).
    light_fence: bool,
}

impl ShmTransport {
    /// Bytes of this rank's segment committed at init: its header page and the rings from
    /// its standing partners (the others are committed on first use).
    pub fn committed_at_init(&self) -> usize {
        self.committed_at_init
    }

    /// Peers with a liveness connection now (this rank excluded).
    pub fn connected(&self) -> usize {
        self.peers
            .iter()
            .flatten()
            .filter(|p| p.stream.is_some())
            .count()
    }

    fn description(&self) -> String {
        let peers = self.peers.iter().flatten().count();
        let committed = self.peers.iter().flatten().filter(|p| p.committed).count();
        let liveness = if self.connected_at_init == peers {
            "liveness over the bootstrap connections".to_string()
        } else {
            format!(
                "liveness over TCP connections: {} of {peers} at init, the others on first use",
                self.connected_at_init
            )
        };
        let rings = if committed == peers {
            "the rings from every peer".to_string()
        } else {
            format!("the rings from {committed} of {peers} peers, the others on first use")
        };
        format!(
            "shm ({}memfd segments, {} KiB ring per pair, {} KiB reserved per rank, {} KiB \
             committed at init ({rings}), futex wake-ups{}, {liveness})",
            self.among,
            self.ring / 1024,
            self.own.len() / 1024,
            self.committed_at_init / 1024,
            if self.light_fence {
                " (membarrier fences)"
            } else {
                ""
            },
        )
    }

    fn lost(&self, peer: usize, op: &str, detail: impl Into<String>) -> Error {
        Error::PeerLost {
            rank: self.rank,
            peer,
            op: op.into(),
            detail: detail.into(),
        }
    }

    fn peer_ref(&self, p: usize, op: &str) -> Result<&Peer> {
        match self.peers.get(p).and_then(Option::as_ref) {
            Some(peer) => Ok(peer),
            None => Err(Error::invalid(
                Some(self.rank),
                op,
                format!("no connection to rank {p}"),
            )),
        }
    }

    /// Wakes `peer` if it is asleep on its bell (after this rank published something for it),
    /// behind the publisher's fence ([`fence::publisher`]; `light`: the transport's
    /// `light_fence`).
    fn notify(seg: &Seg, light: bool) {
        fence::publisher(light);
        if seg.u32_at(OFF_SLEEPING).load(Ordering::Relaxed) != 0 {
            seg.u32_at(OFF_BELL).fetch_add(1, Ordering::Release);
            seg::futex_wake(seg.u32_at(OFF_BELL));
        }
    }

    /// Unconditional wake-up of `seg`'s owner.
    fn ring_bell(seg: &Seg) {
        seg.u32_at(OFF_BELL).fetch_add(1, Ordering::Release);
        seg::futex_wake(seg.u32_at(OFF_BELL));
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }

    fn connected_peers(&self) -> Option<usize> {
        self.lazy.as_ref().map(|_| self.connected())
    }

    fn send(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        data: &[u8],
        progress: &mut SendProgress,
    ) -> Result<bool> {
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        self.send_frame(peer, hdr, data, progress)
    }

    fn recv(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool> {
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        self.recv_frame(peer, progress, sink)
    }

    fn peek(&mut self, peer: usize) -> Result<Option<FrameHeader>> {
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        self.peek_frame(peer)
    }

    fn wait(&mut self, interest: &[Interest], deadline: Instant) -> Result<()> {
        self.wait_on_bell(interest, deadline)
    }

    fn check_peers(&mut self) -> Result<()> {
        self.check_liveness()
    }

    fn abort(&mut self, origin: usize, class: AbortClass, reason: &str) {
        self.announce_abort(origin, class, reason);
    }

    fn close(&mut self) {
        self.say_goodbye();
    }

    fn slots(&mut self) -> Option<&mut dyn super::Slots> {
        if self.world > 1 {
            Some(self)
        } else {
            None
        }
    }

    fn collective_progress(&mut self, running: Option<u64>, completed: u64) {
        self.coll_running = running;
        self.coll_done = completed;
    }
}
