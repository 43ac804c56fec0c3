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
//! | 192 | `status` (open, goodbye, abort), abort class, origin, message length | owner |
//! | 256 | abort message (up to 3840 bytes) | owner |
//! | 4096 + i × S | ring *into* the owner from its i-th peer: `head` (+0, the sender's), `tail` (+128, the owner's), data (+256, R bytes); S = 256 + R rounded up to whole pages, so each ring is committed on pages of its own | |
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
//! a receive takes what the ring holds first and meets a goodbye only after it; an abort
//! fails every survivor with [`Error::Aborted`] (or [`Error::Mismatch`] with the same text).

//!
//! # Device memory (not implemented)
//!
//! Device buffers are staged through host memory over this transport, like over TCP
//! ([`crate::path::SHM_STAGED_REASON`]). GPU-to-GPU on one host (NCCL's P2P transport) would
//! plug in as a direct region ([`Transport::direct_layout`], `send_direct`/`recv_direct`):
//! each rank exports its landing slots with `cuMemExportToShareableHandle` (a POSIX fd,
//! passed like the segment's: `/proc/<pid>/fd` or SCM_RIGHTS) or `cuIpcGetMemHandle`
//! (through the bootstrap), peers map them (`cuMemImportFromShareableHandle` / `cuIpcOpen`),
//! a direct send is a `cuMemcpyAsync` device-to-device into the peer's slot followed by an
//! event, and the ring carries only the frame header with the slot index once the copy's
//! event completed; `release_direct` returns the slot through the ring's `tail`. The path
//! report would say `cuda-ipc` (or `p2p`) per connection, with the reason where peer access
//! between the two GPUs is unavailable (`cuDeviceCanAccessPeer`).

use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::Links;
use super::{
    frame_len_mismatch, rdhup, AbortClass, FrameHeader, FrameKind, Interest, RecvProgress,
    RecvSink, SendProgress, Transport, TransportKind, HEADER_LEN,
};
use crate::error::{Error, Result};

mod seg;
pub use seg::Seg;
use seg::{LINE, PAGE};

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
/// A large frame's bytes are published at least every this many bytes.
const PUBLISH_STEP: usize = 64 * 1024;
/// Small frames stay in the first this many bytes of a ring: a sender at a frame boundary
/// past it starts again at the ring's beginning (after a wrap marker) when the frame fits
/// there, so that a stream of small messages reuses a few cache-hot lines instead of
/// walking the whole ring through memory.
const HOT_WINDOW: usize = 16 * 1024;
/// First byte of a wrap marker: "the next frame starts at the beginning of the ring".
const WRAP_KIND: u8 = 0x57;

const MAGIC: u64 = 0x4453_504b_5f53_484d; // "DSPK_SHM"
const VERSION: u32 = 2;

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
const OFF_MSG: usize = 256;
const MSG_CAP: usize = RINGS - OFF_MSG;
const RINGS: usize = 4096;
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
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            ring_bytes: DEFAULT_RING_BYTES,
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

fn pad(n: u64) -> u64 {
    n.div_ceil(LINE as u64) * LINE as u64
}

/// Bytes of one ring's place in a segment: its counters' lines and its data, rounded up to
/// whole pages, so that each ring is committed on pages of its own.
fn ring_stride(ring: usize) -> usize {
    (RING_DATA + ring).div_ceil(PAGE) * PAGE
}

/// Bytes of one rank's segment for `world` ranks and rings of `ring` bytes (reserved, not
/// all committed: [`committed_len`]).
fn seg_len(world: usize, ring: usize) -> usize {
    RINGS + world.saturating_sub(1) * ring_stride(ring)
}

/// Bytes of a segment committed when the rings from `peers` peers are: the header page and
/// those rings.
fn committed_len(peers: usize, ring: usize) -> usize {
    RINGS + peers * ring_stride(ring)
}

/// `MemAvailable` of `/proc/meminfo` in bytes.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Whether the segments of `ranks` ranks on one host fit in half of the host's available
/// memory `avail`, counting what they commit at init: `committed` bytes in all (the header
/// pages and the rings from each rank's standing partners, O(log n) per rank; the other
/// rings are committed when their pair is first used). `Err` says how much, and what to
/// change.
fn fits_in_memory(
    ranks: usize,
    committed: u64,
    ring: usize,
    avail: u64,
) -> std::result::Result<(), String> {
    if committed <= avail / 2 {
        return Ok(());
    }
    let h = |b: u64| crate::types::human_bytes(b, true);
    Err(format!(
        "{ranks} ranks' segments would commit {} at init (rings of {} from each rank's \
         standing partners), more than half of this host's available memory ({}); smaller \
         rings (DSPARK_SHM_RING_BYTES, at least two DSPARK_CHUNK_BYTES segments) or fewer \
         ranks per host would fit",
        h(committed),
        h(ring as u64),
        h(avail)
    ))
}

/// Index of `sender`'s ring in `owner`'s segment.
fn ring_index(owner: usize, sender: usize) -> usize {
    if sender < owner {
        sender
    } else {
        sender - 1
    }
}

fn ring_base(owner: usize, sender: usize, ring: usize) -> usize {
    RINGS + ring_index(owner, sender) * ring_stride(ring)
}

/// This rank's segment, created before the ranks exchange where to find theirs.
#[derive(Debug)]
pub struct Prepared {
    rank: usize,
    world: usize,
    /// The ranks that share memory with this one (ascending, this rank included): every rank
    /// of the job, or the ranks of this host in a job that spans several hosts (then the
    /// other ranks are reached through another transport, see [`super::mixed`]). Rings are
    /// laid out by position in this list.
    members: Vec<usize>,
    ring: usize,
    /// The peers (members) whose rings are committed at init: the standing partners.
    partners: Vec<usize>,
    file: std::fs::File,
    seg: Seg,
    nonce: u64,
}

/// Where a rank's segment is, as announced to its peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegInfo {
    /// The owner's process id.
    pub pid: u32,
    /// Its descriptor of the segment.
    pub fd: u32,
    /// Segment bytes.
    pub len: u64,
    /// Ring bytes.
    pub ring: u64,
    /// The nonce written in the segment's header.
    pub nonce: u64,
}

impl SegInfo {
    /// Little-endian bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(32);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.fd.to_le_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        v.extend_from_slice(&self.ring.to_le_bytes());
        v.extend_from_slice(&self.nonce.to_le_bytes());
        v
    }

    /// Parses [`SegInfo::encode`]'s bytes.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != 32 {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        Some(SegInfo {
            pid: u32_at(0),
            fd: u32_at(4),
            len: u64_at(8),
            ring: u64_at(16),
            nonce: u64_at(24),
        })
    }
}

/// Creates this rank's segment (`Err`: why shared memory cannot be used here). `partners(r)`:
/// the peers of rank `r` whose rings are committed at init (a symmetric relation, as
/// [`crate::plan::algo::standing_partners`]); every other ring is reserved and committed when
/// its pair is first used.
pub fn prepare(
    rank: usize,
    world: usize,
    partners: &dyn Fn(usize) -> Vec<usize>,
    opts: ShmOptions,
) -> std::result::Result<Prepared, String> {
    prepare_group(rank, world, &(0..world).collect::<Vec<_>>(), partners, opts)
}

/// Creates this rank's segment for shared memory with `members` only (the ranks of its host,
/// this rank included, in a `world`-rank job): one ring per member, none for the others;
/// those of the members among `partners` (as in [`prepare`]) committed now. `Err`: why
/// shared memory cannot be used here.
pub fn prepare_group(
    rank: usize,
    world: usize,
    members: &[usize],
    partners: &dyn Fn(usize) -> Vec<usize>,
    opts: ShmOptions,
) -> std::result::Result<Prepared, String> {
    let mut members = members.to_vec();
    members.sort_unstable();
    members.dedup();
    if !members.contains(&rank) || members.iter().any(|&m| m >= world) {
        return Err(format!(
            "internal: shared-memory group {members:?} of a {world}-rank job without rank {rank}"
        ));
    }
    let ring = opts
        .ring_bytes
        .clamp(MIN_RING_BYTES, MAX_RING_BYTES)
        .div_ceil(LINE)
        * LINE;
    let len = seg_len(members.len(), ring);
    // The members among `r`'s partners: the rings committed in `r`'s segment at init.
    let at_init = |r: usize| -> Vec<usize> {
        let mut v: Vec<usize> = partners(r)
            .into_iter()
            .filter(|&p| p != r && members.binary_search(&p).is_ok())
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    if let Some(avail) = mem_available() {
        let total: u64 = members
            .iter()
            .map(|&m| committed_len(at_init(m).len(), ring) as u64)
            .sum();
        fits_in_memory(members.len(), total, ring, avail)?;
    }
    let mine = at_init(rank);
    let pos = |r: usize| members.binary_search(&r).unwrap_or(0);
    let stride = ring_stride(ring);
    let ranges: Vec<(usize, usize)> = std::iter::once((0, RINGS))
        .chain(
            mine.iter()
                .map(|&p| (ring_base(pos(rank), pos(p), ring), stride)),
        )
        .collect();
    let file = seg::create(len, &ranges, &format!("dspark-shm-rank{rank}"))?;
    let seg = Seg::map(&file, len)?;
    for &(off, n) in &ranges {
        seg.populate(off, n)?;
    }
    let nonce = seg::nonce();
    seg.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
    seg.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
    seg.u32_at(OFF_WORLD).store(world as u32, Ordering::Relaxed);
    seg.u32_at(OFF_RANK).store(rank as u32, Ordering::Relaxed);
    seg.u64_at(OFF_RING).store(ring as u64, Ordering::Relaxed);
    seg.u32_at(OFF_PID)
        .store(std::process::id(), Ordering::Relaxed);
    seg.u64_at(OFF_NONCE).store(nonce, Ordering::Release);
    Ok(Prepared {
        rank,
        world,
        members,
        ring,
        partners: mine,
        file,
        seg,
        nonce,
    })
}

impl Prepared {
    /// What peers need to map this segment.
    pub fn info(&self) -> SegInfo {
        SegInfo {
            pid: std::process::id(),
            fd: self.file.as_raw_fd() as u32,
            len: self.seg.len() as u64,
            ring: self.ring as u64,
            nonce: self.nonce,
        }
    }

    /// Maps every peer's segment (`infos[r]` for rank `r`), checking each one's header.
    /// `Err` says which peer's segment could not be had, and why.
    pub fn connect(&self, infos: &[SegInfo]) -> std::result::Result<Vec<Option<Seg>>, String> {
        let infos: Vec<Option<SegInfo>> = infos.iter().copied().map(Some).collect();
        self.connect_group(&infos)
    }

    /// [`Prepared::connect`] for a group ([`prepare_group`]): `infos[r]` is needed for the
    /// members only; the others get `None` in the result.
    pub fn connect_group(
        &self,
        infos: &[Option<SegInfo>],
    ) -> std::result::Result<Vec<Option<Seg>>, String> {
        let mut segs = Vec::with_capacity(self.world);
        for r in 0..self.world {
            if r == self.rank || !self.members.contains(&r) {
                segs.push(None);
                continue;
            }
            let Some(info) = infos.get(r).copied().flatten() else {
                return Err(format!("rank {r} announced no segment"));
            };
            if info.ring != self.ring as u64 {
                return Err(format!(
                    "rank {r} has rings of {} bytes, this rank {} (DSPARK_SHM_RING_BYTES differs)",
                    info.ring, self.ring
                ));
            }
            // Every offset this rank uses in a peer's segment (header words, its ring's
            // counters and data) follows from the group's size and the ring size: a segment
            // of another length is refused here, so that no later access can fall outside it.
            let want = seg_len(self.members.len(), self.ring);
            if info.len != want as u64 {
                return Err(format!(
                    "rank {r} announced a segment of {} bytes where {} ranks with rings of {} \
                     bytes need {want}",
                    info.len,
                    self.members.len(),
                    self.ring
                ));
            }
            let file = seg::open_peer(info.pid, info.fd, info.len as usize)
                .map_err(|w| format!("rank {r}'s segment: {w}"))?;
            let s = Seg::map(&file, info.len as usize)
                .map_err(|w| format!("rank {r}'s segment: {w}"))?;
            // Its header, and the ring this rank sends into when they are partners.
            let pos = |q: usize| self.members.binary_search(&q).unwrap_or(0);
            s.populate(0, RINGS)
                .map_err(|w| format!("rank {r}'s segment: {w}"))?;
            if self.partners.binary_search(&r).is_ok() {
                s.populate(
                    ring_base(pos(r), pos(self.rank), self.ring),
                    ring_stride(self.ring),
                )
                .map_err(|w| format!("rank {r}'s segment: {w}"))?;
            }
            let ok = s.u64_at(OFF_MAGIC).load(Ordering::Relaxed) == MAGIC
                && s.u32_at(OFF_VERSION).load(Ordering::Relaxed) == VERSION
                && s.u32_at(OFF_WORLD).load(Ordering::Relaxed) as usize == self.world
                && s.u32_at(OFF_RANK).load(Ordering::Relaxed) as usize == r
                && s.u64_at(OFF_NONCE).load(Ordering::Acquire) == info.nonce;
            if !ok {
                return Err(format!(
                    "rank {r}'s segment (pid {}, fd {}) has another header: not its segment",
                    info.pid, info.fd
                ));
            }
            segs.push(Some(s));
        }
        Ok(segs)
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

impl Peer {
    /// Re-reads the head of the ring `peer` sends into (`head`, published by it with release
    /// ordering): an error, not a wrapped count, when the counters a misbehaving or corrupted
    /// peer wrote say it is behind the tail or more than a ring ahead of it.
    fn refresh_head(
        &mut self,
        head: &AtomicU64,
        ring: u64,
        rank: usize,
        peer: usize,
    ) -> Result<()> {
        self.rx_head = head.load(Ordering::Acquire);
        if self.rx_head < self.rx_tail || self.rx_head - self.rx_tail > ring {
            return Err(corrupt(
                rank,
                peer,
                "receive tail..head",
                self.rx_tail,
                self.rx_head,
            ));
        }
        Ok(())
    }
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
}

/// Liveness connections on first use (the bootstrap's [`Links`], as TCP and verbs use them).
#[derive(Debug)]
struct Lazy {
    links: Box<dyn Links>,
    /// Peers this rank started connecting to.
    started: Vec<bool>,
    /// Peers whose connection on first use failed: the error every later use returns.
    failed: Vec<Option<Error>>,
    /// When the processes of the peers still being connected were last looked at.
    looked: Instant,
}

/// The state and start time (clock ticks after boot) of process `pid`, from
/// `/proc/<pid>/stat`; `None` when there is no such process.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold anything, so split after its last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    // starttime is the 22nd field; `rest` begins at the 3rd.
    let start = f.nth(18)?.parse().ok()?;
    Some((state, start))
}

impl ShmTransport {
    /// The transport over this rank's segment, its peers' (`segs[r]`, from
    /// [`Prepared::connect`]) and the bootstrap's connections (`streams[r]`), kept as
    /// liveness descriptors. A peer without a connection gets one on first use, through
    /// [`ShmTransport::with_links`]. Once every peer has mapped this rank's segment (the
    /// caller's second bootstrap round), peers open nothing of it any more.
    pub fn new(
        prep: Prepared,
        segs: Vec<Option<Seg>>,
        streams: Vec<Option<TcpStream>>,
    ) -> Result<Self> {
        let Prepared {
            rank,
            world,
            members,
            ring,
            partners,
            file,
            seg: own,
            ..
        } = prep;
        // Rings are laid out by position among the members.
        let pos = |r: usize| members.iter().position(|&m| m == r).unwrap_or(0);
        let mut peers = Vec::with_capacity(world);
        for (r, (s, st)) in segs.into_iter().zip(streams).enumerate() {
            if r != rank && !members.contains(&r) {
                // Reached through another transport; its stream is not this transport's.
                peers.push(None);
                continue;
            }
            match s {
                Some(seg) => {
                    if let Some(stream) = &st {
                        stream.set_nonblocking(true).map_err(|e| {
                            Error::io(
                                Some(rank),
                                Some(r),
                                "configuring the liveness connection",
                                e,
                            )
                        })?;
                        let _ = stream.set_nodelay(true);
                    }
                    let pid = seg.u32_at(OFF_PID).load(Ordering::Relaxed);
                    peers.push(Some(Peer {
                        seg,
                        stream: st,
                        pid,
                        started: proc_stat(pid).map(|(_, t)| t),
                        committed: partners.binary_search(&r).is_ok(),
                        state: PeerState::Open,
                        tx_head: 0,
                        tx_tail: 0,
                        tx_in_frame: false,
                        rx_tail: 0,
                        rx_head: 0,
                        rx_in_frame: false,
                        tx_base: ring_base(pos(r), pos(rank), ring),
                        rx_base: ring_base(pos(rank), pos(r), ring),
                    }));
                }
                None if r == rank => peers.push(None),
                None => {
                    return Err(Error::invalid(
                        Some(rank),
                        "shared-memory transport",
                        format!("no segment for rank {r}"),
                    ))
                }
            }
        }
        let among = if members.len() < world {
            let rs: Vec<String> = members.iter().map(usize::to_string).collect();
            format!("among ranks {}, ", rs.join(","))
        } else {
            String::new()
        };
        let connected_at_init = peers
            .iter()
            .flatten()
            .filter(|p| p.stream.is_some())
            .count();
        let mut t = ShmTransport {
            rank,
            world,
            ring,
            own,
            file,
            peers,
            committed_at_init: committed_len(partners.len(), ring),
            connected_at_init,
            among,
            desc: String::new(),
            done: false,
            lazy: None,
        };
        t.desc = t.description();
        Ok(t)
    }

    /// Connects the peers it has no liveness connection for on first use, through `links`
    /// (the bootstrap's, as the TCP and verbs transports do): the first send to such a peer
    /// reports "not yet" until the connection is made; a receive starts it and goes on.
    pub fn with_links(mut self, links: Box<dyn Links>) -> Self {
        let world = self.world;
        self.lazy = Some(Lazy {
            links,
            started: vec![false; world],
            failed: vec![None; world],
            looked: Instant::now(),
        });
        self.desc = self.description();
        self
    }

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
             committed at init ({rings}), futex wake-ups, {liveness})",
            self.among,
            self.ring / 1024,
            self.own.len() / 1024,
            self.committed_at_init / 1024,
        )
    }

    /// A transport for a world of one (no peers, no segment to share).
    pub fn single() -> Result<Self> {
        let prep = prepare(
            0,
            1,
            &|_| Vec::new(),
            ShmOptions {
                ring_bytes: MIN_RING_BYTES,
            },
        )
        .map_err(|w| Error::unavailable("the shared-memory transport", w))?;
        Self::new(prep, vec![None], vec![None])
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

    /// The error a peer's `status` word announces (goodbye or abort), if any.
    fn status_error(&self, peer: usize, op: &str) -> Option<Error> {
        let p = self.peers.get(peer)?.as_ref()?;
        match p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) {
            STATUS_OPEN => None,
            STATUS_BYE => Some(self.lost(peer, op, "peer closed its communicator")),
            _ => {
                let class = p.seg.u32_at(OFF_CLASS).load(Ordering::Relaxed) as u8;
                let origin = p.seg.u32_at(OFF_ORIGIN).load(Ordering::Relaxed) as usize;
                let n = (p.seg.u32_at(OFF_MSG_LEN).load(Ordering::Relaxed) as usize).min(MSG_CAP);
                let mut msg = vec![0u8; n];
                if let Err(b) = p.seg.read(OFF_MSG, &mut msg) {
                    return Some(out_of_bounds(self.rank, peer)(b));
                }
                let reason = String::from_utf8_lossy(&msg).into_owned();
                Some(AbortClass::error(class, self.rank, origin, op, reason))
            }
        }
    }

    /// Whether the peer aborted (not a goodbye).
    fn aborted_peer(&self, peer: usize) -> bool {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .is_some_and(|p| p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) == STATUS_ABORT)
    }

    /// Wakes `peer` if it is asleep on its bell (after this rank published something for it).
    fn notify(seg: &Seg) {
        fence(Ordering::SeqCst);
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

    /// Reads the liveness connection of `peer`: end of stream without a goodbye marks it
    /// gone.
    fn examine(&mut self, peer: usize) {
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return;
        };
        if p.state != PeerState::Open {
            return;
        }
        let Some(stream) = p.stream.as_mut() else {
            return;
        };
        let mut b = [0u8; 256];
        let gone = loop {
            match stream.read(&mut b) {
                // Nothing is sent on it in shm mode: discard bootstrap leftovers.
                Ok(0) => {
                    break Some(
                        "its process died: the liveness connection closed without a goodbye"
                            .to_string(),
                    )
                }
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break None,
                Err(e) => {
                    break Some(format!(
                        "its liveness connection failed: {e} (process died?)"
                    ))
                }
            }
        };
        if let Some(d) = gone {
            p.state = PeerState::Gone(d);
        }
    }

    /// Whether `peer`'s receive ring holds bytes not yet taken (never for a ring this rank has
    /// not used yet: its pages are not touched before).
    fn rx_pending(&self, p: &Peer) -> bool {
        if !p.committed {
            return false;
        }
        let head = self
            .own
            .u64_at(p.rx_base + RING_HEAD)
            .load(Ordering::Acquire);
        if p.rx_in_frame {
            head > p.rx_tail
        } else {
            head >= pad(p.rx_tail) + HEADER_LEN as u64
        }
    }

    /// The error of a peer found gone, for an operation that needs more from it (or
    /// `None` while what it wrote is still to be taken).
    fn gone_error(&self, peer: usize, op: &str) -> Option<Error> {
        let p = self.peers.get(peer)?.as_ref()?;
        match &p.state {
            PeerState::Open => None,
            PeerState::Lost(d) => Some(self.lost(peer, op, d.clone())),
            PeerState::Gone(d) => {
                if let Some(e) = self.status_error(peer, op) {
                    return Some(e);
                }
                Some(self.lost(peer, op, d.clone()))
            }
        }
    }

    /// Polls every open peer's liveness connection without blocking; returns the first
    /// failure that this rank cannot wait through: an abort, or a gone peer with nothing
    /// more to take from it.
    fn check_liveness(&mut self) -> Result<()> {
        self.look_at_linking();
        let mut fds = Vec::with_capacity(self.world);
        let mut which = Vec::with_capacity(self.world);
        for (i, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            let Some(stream) = p.stream.as_ref() else {
                continue;
            };
            if p.state == PeerState::Open {
                fds.push(PollFd::new(stream.as_fd(), PollFlags::POLLIN | rdhup()));
                which.push(i);
            }
        }
        // Connections in the making (a peer connecting to this rank, or answering it): their
        // links are advanced when one of their descriptors has something, or always where
        // the links have none of their own (shm+tcp's, which only hand over).
        let ours = fds.len();
        let mut pump = false;
        if let Some(l) = self.lazy.as_ref() {
            let link_fds = l.links.fds();
            pump = link_fds.is_empty();
            fds.extend(
                link_fds
                    .into_iter()
                    .map(|fd| PollFd::new(fd, PollFlags::POLLIN)),
            );
        }
        let mut flagged = Vec::new();
        if !fds.is_empty() {
            match nix::poll::poll(&mut fds, PollTimeout::ZERO) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(Error::io(Some(self.rank), None, "poll", io::Error::from(e)));
                }
            }
            for (fd, &i) in fds[..ours].iter().zip(&which) {
                if fd.revents().is_none_or(|r| !r.is_empty()) {
                    flagged.push(i);
                }
            }
            pump |= fds[ours..]
                .iter()
                .any(|f| f.revents().is_none_or(|r| !r.is_empty()));
        }
        drop(fds);
        if pump {
            self.pump_links()?;
        }
        for i in flagged {
            self.examine(i);
        }
        for i in 0..self.peers.len() {
            // An abort counts once everything the peer sent before it is taken, as over TCP
            // (where the abort frame queues behind the data): a rank still finishing a call
            // whose frames are all in the ring must not fail it for the peer's later failure.
            let pending = self.peers[i].as_ref().is_some_and(|p| self.rx_pending(p));
            if self.aborted_peer(i) && !pending {
                if let Some(e) = self.status_error(i, "communicator") {
                    return Err(e);
                }
            }
            let Some(p) = self.peers[i].as_ref() else {
                continue;
            };
            if let PeerState::Gone(_) = &p.state {
                // Like a TCP connection closed with nothing left to read: an error now,
                // unless it said goodbye (then only what needs it fails).
                let says_bye = p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) == STATUS_BYE;
                if !says_bye && !p.rx_in_frame && !self.rx_pending(p) {
                    if let Some(e) = self.gone_error(i, "communicator") {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether anything in `interest` may move now (or a peer changed its status).
    fn anything_ready(&self, interest: &[Interest]) -> bool {
        for it in interest {
            let Some(p) = self.peers.get(it.peer).and_then(Option::as_ref) else {
                continue;
            };
            if p.state != PeerState::Open
                || p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) != STATUS_OPEN
            {
                return true;
            }
            if it.recv && self.rx_pending(p) {
                return true;
            }
            if it.send && p.stream.is_none() && self.lazy.is_some() {
                // Its liveness connection is in the making (`wait` looks at it).
                continue;
            }
            if it.send {
                let tail = p.seg.u64_at(p.tx_base + RING_TAIL).load(Ordering::Acquire);
                if tail != p.tx_tail || p.tx_head.wrapping_sub(tail) < self.ring as u64 {
                    return true;
                }
            }
        }
        false
    }

    /// Commits the two rings between this rank and `peer` on this rank's side, on their
    /// first use: allocates the ring into this rank's segment (fallocate, as the owner) and
    /// populates the page tables of both (this rank's and the one it sends into in the
    /// peer's segment), so that no page is faulted in inside a transfer. A no-op once done.
    ///
    /// # Errors
    /// The memory could not be had (ENOMEM/ENOSPC: a memory cgroup's limit or the host's
    /// memory), naming the pair.
    fn commit(&mut self, peer: usize) -> Result<()> {
        let Some(p) = self.peers.get(peer).and_then(Option::as_ref) else {
            return Ok(());
        };
        if p.committed {
            return Ok(());
        }
        let stride = ring_stride(self.ring);
        seg::commit(&self.file, p.rx_base, stride)
            .and_then(|()| self.own.populate(p.rx_base, stride))
            .and_then(|()| p.seg.populate(p.tx_base, stride))
            .map_err(|w| Error::Transport {
                rank: Some(self.rank),
                peer: Some(peer),
                op: "committing a shared-memory ring on first use".into(),
                what: format!(
                    "the rings between ranks {} and {peer} ({} KiB each): {w}",
                    self.rank,
                    stride / 1024
                ),
            })?;
        tracing::debug!(rank = self.rank, peer, "rings committed on first use");
        if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
            p.committed = true;
        }
        Ok(())
    }

    /// Whether `peer` has its liveness connection; if not, starts or advances making it (on
    /// first use, through [`Links`]). A receive goes on meanwhile (`sending` false: what is
    /// in the ring is good whatever becomes of the connection); a send waits for it, so
    /// that every pair that exchanged frames can tell a goodbye from a death. Without links,
    /// `Ok(true)`.
    ///
    /// # Errors
    /// A connection on first use that failed (now or before), naming the peer: the peer's
    /// goodbye or abort where its segment says so.
    fn link(&mut self, peer: usize, sending: bool, op: &str) -> Result<bool> {
        if self.done
            || self
                .peers
                .get(peer)
                .and_then(Option::as_ref)
                .is_none_or(|p| p.stream.is_some())
        {
            return Ok(true);
        }
        let linked = |t: &Self| {
            t.peers
                .get(peer)
                .and_then(Option::as_ref)
                .is_some_and(|p| p.stream.is_some())
        };
        let Some(l) = self.lazy.as_ref() else {
            return Ok(true);
        };
        if let Some(e) = &l.failed[peer] {
            return Err(self.prefer_status(e.clone(), op));
        }
        // A connection the peer made may be waiting already (then there is nothing to start:
        // the peer may even have exited since, after its last frames).
        let mut res = self.pump_links();
        if res.is_ok() && !linked(self) {
            if let Some(l) = self.lazy.as_mut() {
                if !l.started[peer] {
                    l.started[peer] = true;
                    res = l.links.start(peer).inspect_err(|e| {
                        l.failed[peer] = Some(e.clone());
                    });
                    if res.is_ok() {
                        res = self.pump_links();
                    }
                }
            }
        }
        if let Err(e) = res {
            return Err(self.prefer_status(e, op));
        }
        Ok(linked(self) || !sending)
    }

    /// `e`, or the goodbye or abort of the peer it names, which says more.
    fn prefer_status(&self, e: Error, op: &str) -> Error {
        match e.peer() {
            Some(p) => self.status_error(p, op).unwrap_or(e),
            None => e,
        }
    }

    /// Installs the liveness connections [`Links`] completed, without waiting (commits the
    /// pair's rings too: the peer is about to use them), and wakes the peers whose connection
    /// is still in the making, so that they advance it.
    fn pump_links(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        let Some(l) = self.lazy.as_mut() else {
            return Ok(());
        };
        let got = match l.links.progress() {
            Ok(g) => g,
            Err(e) => {
                // A connection to a peer that failed: every later use of it fails alike.
                if let Some(p) = e.peer().filter(|&p| p < self.world) {
                    if l.started[p] && l.failed[p].is_none() {
                        l.failed[p] = Some(e.clone());
                    }
                }
                return Err(self.prefer_status(e, "connect on first use (shm)"));
            }
        };
        for (p, s) in got {
            let fresh = self
                .peers
                .get(p)
                .and_then(Option::as_ref)
                .is_some_and(|q| q.stream.is_none());
            if !fresh {
                return Err(Error::Transport {
                    rank: Some(self.rank),
                    peer: Some(p),
                    op: "connect on first use (shm)".into(),
                    what: format!("a second connection from rank {p}, or not a peer"),
                });
            }
            s.set_nonblocking(true).map_err(|e| {
                Error::io(
                    Some(self.rank),
                    Some(p),
                    "configuring the liveness connection",
                    e,
                )
            })?;
            let _ = s.set_nodelay(true);
            tracing::debug!(
                rank = self.rank,
                peer = p,
                "liveness connection made on first use"
            );
            if let Some(q) = self.peers[p].as_mut() {
                q.stream = Some(s);
            }
            self.commit(p)?;
        }
        if let Some(l) = self.lazy.as_ref() {
            for (p, q) in self.peers.iter().enumerate() {
                if let Some(q) = q {
                    if q.stream.is_none() && l.started[p] {
                        Self::notify(&q.seg);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether a liveness connection this rank started is still in the making.
    fn linking(&self) -> bool {
        self.lazy.as_ref().is_some_and(|l| {
            self.peers
                .iter()
                .enumerate()
                .any(|(p, q)| q.as_ref().is_some_and(|q| q.stream.is_none()) && l.started[p])
        })
    }

    /// Marks gone the peers whose liveness connection is still in the making and whose
    /// process has ended (no such process, a zombie, or another process under its pid): a
    /// peer that died before it took this rank's connection. At most every
    /// [`LIVENESS_POLL`].
    fn look_at_linking(&mut self) {
        let Some(l) = self.lazy.as_mut() else {
            return;
        };
        if l.looked.elapsed() < LIVENESS_POLL {
            return;
        }
        l.looked = Instant::now();
        let started = l.started.clone();
        for (i, p) in self.peers.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            if p.stream.is_some() || !started[i] || p.state != PeerState::Open {
                continue;
            }
            let alive = match proc_stat(p.pid) {
                Some((state, t)) => {
                    !matches!(state, 'Z' | 'X' | 'x') && p.started.is_none_or(|s| s == t)
                }
                None => false,
            };
            if !alive {
                p.state = PeerState::Gone(format!(
                    "its process {} ended before its liveness connection was made",
                    p.pid
                ));
            }
        }
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
        const OP: &str = "send";
        let rank = self.rank;
        let ring = self.ring as u64;
        let total = HEADER_LEN + data.len();
        let padded = pad(total as u64) as usize;
        let p = self.peer_ref(peer, OP)?;
        if p.state != PeerState::Open {
            if let Some(e) = self.gone_error(peer, OP) {
                return Err(e);
            }
        }
        if p.seg.u32_at(OFF_STATUS).load(Ordering::Relaxed) != STATUS_OPEN {
            if let Some(e) = self.status_error(peer, OP) {
                return Err(e);
            }
        }
        if p.stream.is_none() && !self.link(peer, true, OP)? {
            return Ok(false);
        }
        if !self.peer_ref(peer, OP)?.committed {
            self.commit(peer)?;
        }
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Err(Error::invalid(
                Some(self.rank),
                OP,
                format!("no connection to rank {peer}"),
            ));
        };
        let tail_word = p.seg.u64_at(p.tx_base + RING_TAIL);
        let head_word = p.seg.u64_at(p.tx_base + RING_HEAD);
        let data_off = p.tx_base + RING_DATA;
        let step = PUBLISH_STEP.min(self.ring / 4) as u64;
        let mut w = progress.written;
        let mut last_pub = p.tx_head;
        let hot = HOT_WINDOW as u64;
        let pos = p.tx_head % ring;
        if w == 0 && ring >= 4 * hot && pos >= hot && padded as u64 <= hot {
            // Back to the start of the ring when this frame fits there before the oldest
            // byte the receiver has not taken (`head − tail + frame ≤ pos`; frames start on a
            // line, so the marker fits before the end). The cached tail is older than the
            // real one, so it only errs on the safe side; it is re-read only when it says no.
            let fits = |tail: u64| p.tx_head - tail + padded as u64 <= pos;
            if !fits(p.tx_tail) {
                p.tx_tail = tail_word.load(Ordering::Acquire);
                if p.tx_tail > p.tx_head || p.tx_head - p.tx_tail > ring {
                    return Err(corrupt(rank, peer, "send tail..head", p.tx_tail, p.tx_head));
                }
            }
            if fits(p.tx_tail) {
                let mut mark = FrameHeader::bye().encode();
                mark[0] = WRAP_KIND;
                p.seg
                    .write(data_off + pos as usize, &mark)
                    .map_err(out_of_bounds(rank, peer))?;
                p.tx_head += ring - pos;
            }
        }
        while w < padded {
            let mut free = ring - (p.tx_head - p.tx_tail);
            let need = if w == 0 { LINE as u64 } else { 1 };
            if free < need.max((padded - w).min(LINE) as u64) {
                p.tx_tail = tail_word.load(Ordering::Acquire);
                if p.tx_tail > p.tx_head || p.tx_head - p.tx_tail > ring {
                    return Err(corrupt(rank, peer, "send tail..head", p.tx_tail, p.tx_head));
                }
                free = ring - (p.tx_head - p.tx_tail);
                if free < need {
                    break;
                }
            }
            let pos = (p.tx_head % ring) as usize;
            let contiguous = self.ring - pos;
            let n = if w < HEADER_LEN {
                // The header goes whole: frames start on a line, so it never wraps.
                let head = hdr.encode();
                p.seg
                    .write(data_off + pos, &head[w..])
                    .map_err(out_of_bounds(rank, peer))?;
                HEADER_LEN - w
            } else if w < total {
                let n = (total - w)
                    .min(free as usize)
                    .min(contiguous)
                    .min(step as usize);
                let from = w - HEADER_LEN;
                p.seg
                    .write(data_off + pos, &data[from..from + n])
                    .map_err(out_of_bounds(rank, peer))?;
                n
            } else {
                // Padding to the next line: space, nothing written (the receiver skips to
                // the line of the next header).
                (padded - w).min(free as usize)
            };
            w += n;
            p.tx_head += n as u64;
            if p.tx_head - last_pub >= step {
                head_word.store(p.tx_head, Ordering::Release);
                Self::notify(&p.seg);
                last_pub = p.tx_head;
            }
        }
        if p.tx_head != last_pub {
            head_word.store(p.tx_head, Ordering::Release);
            Self::notify(&p.seg);
        }
        progress.written = w;
        p.tx_in_frame = w > 0 && w < padded;
        Ok(w == padded)
    }

    fn recv(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool> {
        const OP: &str = "receive";
        let ring = self.ring as u64;
        let rank = self.rank;
        let (rx_base, state_open, linked, committed) = {
            let p = self.peer_ref(peer, OP)?;
            (
                p.rx_base,
                p.state == PeerState::Open,
                p.stream.is_some(),
                p.committed,
            )
        };
        if !linked {
            if let Err(e) = self.link(peer, false, OP) {
                // What the peer wrote before it went is still taken; then its loss shows.
                match (e.peer(), self.peers.get_mut(peer).and_then(Option::as_mut)) {
                    (Some(q), Some(p)) if q == peer => {
                        if p.state == PeerState::Open {
                            let why = match e {
                                Error::PeerLost { detail, .. } => detail,
                                e => e.to_string(),
                            };
                            p.state = PeerState::Gone(why);
                        }
                    }
                    _ => return Err(e),
                }
            }
        }
        if !committed {
            self.commit(peer)?;
        }
        let head_word = self.own.u64_at(rx_base + RING_HEAD);
        let tail_word = self.own.u64_at(rx_base + RING_TAIL);
        let data_off = rx_base + RING_DATA;
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(false);
        };
        if progress.header.is_none() {
            // The next frame starts on the line after the last one (or at the start of the
            // ring, after a wrap marker).
            let (b, start) = loop {
                let start = pad(p.rx_tail);
                if p.rx_head < start + HEADER_LEN as u64 {
                    p.refresh_head(head_word, ring, rank, peer)?;
                }
                if p.rx_head < start + HEADER_LEN as u64 {
                    // Nothing (more) from it: a goodbye, an abort or its death surface now —
                    // once the ring is seen empty *after* that news. A peer publishes its last
                    // frames (`head`, release) before it says goodbye or aborts (`status`,
                    // release): `head` read before `status` may predate frames that the
                    // goodbye follows, and those frames count.
                    let news = p.state != PeerState::Open
                        || p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) != STATUS_OPEN;
                    if news {
                        p.refresh_head(head_word, ring, rank, peer)?;
                        if p.rx_head >= start + HEADER_LEN as u64 {
                            continue;
                        }
                    }
                    if let Some(e) = self.status_error(peer, OP) {
                        return Err(e);
                    }
                    if let Some(e) = self.gone_error(peer, OP) {
                        return Err(e);
                    }
                    return Ok(false);
                }
                let mut b = [0u8; HEADER_LEN];
                self.own
                    .read(data_off + (start % ring) as usize, &mut b)
                    .map_err(out_of_bounds(rank, peer))?;
                if b[0] == WRAP_KIND && b[12..16] == super::FRAME_MAGIC.to_le_bytes() {
                    p.rx_tail = start + (ring - start % ring);
                    continue;
                }
                break (b, start);
            };
            let hdr = FrameHeader::decode(&b).map_err(|what| Error::Transport {
                rank: Some(rank),
                peer: Some(peer),
                op: "receive frame header".into(),
                what,
            })?;
            if hdr.kind != FrameKind::Data {
                return Err(Error::Transport {
                    rank: Some(rank),
                    peer: Some(peer),
                    op: "receive frame header".into(),
                    what: format!("unexpected {:?} frame in a shared-memory ring", hdr.kind),
                });
            }
            let expected = sink.on_header(&hdr)?;
            if expected != hdr.len as usize {
                return Err(frame_len_mismatch(rank, peer, hdr.len as usize, expected));
            }
            let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
                return Ok(false);
            };
            p.rx_tail = start + HEADER_LEN as u64;
            p.rx_in_frame = true;
            progress.header = Some(hdr);
            progress.expected = expected;
            progress.got = 0;
        }
        let g = sink.granule().max(1);
        loop {
            let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
                return Ok(false);
            };
            let want = progress.expected - progress.got;
            if want == 0 {
                tail_word.store(p.rx_tail, Ordering::Release);
                Self::notify(&p.seg);
                p.rx_in_frame = false;
                progress.header = None;
                return Ok(true);
            }
            if p.rx_head == p.rx_tail || (p.rx_head - p.rx_tail) < g as u64 {
                p.refresh_head(head_word, ring, rank, peer)?;
            }
            let avail = (p.rx_head - p.rx_tail) as usize;
            let pos = (p.rx_tail % ring) as usize;
            let mut n = want.min(avail).min(self.ring - pos);
            let direct = sink.direct().is_some();
            if !direct {
                n -= n % g;
            }
            if n == 0 {
                tail_word.store(p.rx_tail, Ordering::Release);
                Self::notify(&p.seg);
                if !state_open {
                    // Its process is gone in the middle of a frame: nothing more will come.
                    if let Some(e) = self.status_error(peer, OP) {
                        return Err(e);
                    }
                    if let Some(e) = self.gone_error(peer, OP) {
                        return Err(e);
                    }
                }
                return Ok(false);
            }
            match sink.direct() {
                Some(dst) => {
                    let got = progress.got;
                    self.own
                        .read(data_off + pos, &mut dst[got..got + n])
                        .map_err(out_of_bounds(rank, peer))?;
                }
                None => {
                    // SAFETY: `[rx_tail, rx_head)` of this ring was published by the sender
                    // (acquire load of `head`) and is not written again before this rank
                    // advances `tail` below, after the slice is gone.
                    let bytes = unsafe { self.own.slice(data_off + pos, n) }
                        .map_err(out_of_bounds(rank, peer))?;
                    sink.consume(bytes)?;
                }
            }
            progress.got += n;
            let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
                return Ok(false);
            };
            p.rx_tail += n as u64;
            if progress.got < progress.expected {
                tail_word.store(p.rx_tail, Ordering::Release);
                Self::notify(&p.seg);
            }
        }
    }

    fn wait(&mut self, interest: &[Interest], deadline: Instant) -> Result<()> {
        let now = Instant::now();
        if now < deadline {
            let sleeping = self.own.u32_at(OFF_SLEEPING);
            sleeping.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            let bell = self.own.u32_at(OFF_BELL);
            let v = bell.load(Ordering::Acquire);
            if !self.anything_ready(interest) {
                let poll = if self.linking() {
                    LINK_POLL
                } else {
                    LIVENESS_POLL
                };
                let slice = (deadline - now).min(poll);
                seg::futex_wait(bell, v, slice);
            }
            self.own.u32_at(OFF_SLEEPING).store(0, Ordering::Relaxed);
        }
        self.check_liveness()
    }

    fn check_peers(&mut self) -> Result<()> {
        self.check_liveness()
    }

    fn abort(&mut self, origin: usize, class: AbortClass, reason: &str) {
        if self.done {
            return;
        }
        self.done = true;
        let msg = reason.as_bytes();
        let msg = &msg[..msg.len().min(MSG_CAP)];
        if let Err(b) = self.own.write(OFF_MSG, msg) {
            tracing::warn!(
                rank = self.rank,
                "abort message not written to the segment: {b}"
            );
        }
        self.own
            .u32_at(OFF_MSG_LEN)
            .store(msg.len() as u32, Ordering::Relaxed);
        self.own
            .u32_at(OFF_CLASS)
            .store(class as u32, Ordering::Relaxed);
        self.own
            .u32_at(OFF_ORIGIN)
            .store(origin as u32, Ordering::Relaxed);
        self.own
            .u32_at(OFF_STATUS)
            .store(STATUS_ABORT, Ordering::Release);
        for p in self.peers.iter_mut().flatten() {
            Self::ring_bell(&p.seg);
            if let Some(s) = &p.stream {
                let _ = s.shutdown(Shutdown::Both);
            }
            p.state = PeerState::Lost("this rank aborted".into());
        }
    }

    fn close(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        self.own
            .u32_at(OFF_STATUS)
            .store(STATUS_BYE, Ordering::Release);
        for p in self.peers.iter_mut().flatten() {
            Self::ring_bell(&p.seg);
            if let Some(s) = &p.stream {
                let _ = s.shutdown(Shutdown::Write);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the segments of `n` ranks commit at init with the standing partners' rings.
    fn at_init(n: usize, ring: usize) -> u64 {
        (0..n)
            .map(|r| committed_len(crate::plan::algo::standing_partners(n, r).len(), ring) as u64)
            .sum()
    }

    #[test]
    fn segments_that_would_commit_more_than_half_the_available_memory_at_init_are_refused() {
        let ring = 2 << 20;
        // 8 ranks with 2 MiB rings: at most 8 × 7 rings, 112 MiB and a little.
        let c = at_init(8, ring);
        assert!(c <= 8 * committed_len(7, ring) as u64);
        assert!(fits_in_memory(8, c, ring, 1 << 30).is_ok());
        assert!(fits_in_memory(8, c, ring, 150 << 20).is_err());
        // 128 ranks: a ring per ordered pair would be 128 × 127 rings of 2 MiB, 32 GiB; the
        // standing partners' (at most 20 per rank) are at most 5 GiB and fit on a 24 GiB host.
        let c = at_init(128, ring);
        assert!(c <= 128 * committed_len(20, ring) as u64, "{c}");
        assert!(fits_in_memory(128, c, ring, 24 << 30).is_ok());
        let e = fits_in_memory(128, c, ring, c).unwrap_err();
        assert!(
            e.contains("128 ranks") && e.contains("DSPARK_SHM_RING_BYTES"),
            "{e}"
        );
        let all = 128 * seg_len(128, ring) as u64;
        assert!(fits_in_memory(128, all, ring, 24 << 30).is_err());
    }

    /// Bytes of `file` the kernel has allocated.
    fn allocated(file: &std::fs::File) -> u64 {
        use std::os::unix::fs::MetadataExt;
        file.metadata().unwrap().blocks() * 512
    }

    /// Three ranks in this process, of which only 0 and 1 are partners: each segment commits
    /// the header and its partners' rings at init, and a pair's rings on its first use.
    #[test]
    fn only_partner_rings_are_committed_at_init_and_the_others_on_first_use() {
        let ring = 64 * 1024;
        let partners = |r: usize| match r {
            0 => vec![1],
            1 => vec![0],
            _ => vec![],
        };
        let preps: Vec<Prepared> = (0..3)
            .map(|r| prepare(r, 3, &partners, ShmOptions { ring_bytes: ring }).unwrap())
            .collect();
        let stride = ring_stride(ring) as u64;
        let got: Vec<u64> = preps.iter().map(|p| allocated(&p.file)).collect();
        assert_eq!(
            got,
            vec![RINGS as u64 + stride, RINGS as u64 + stride, RINGS as u64]
        );
        let infos: Vec<SegInfo> = preps.iter().map(Prepared::info).collect();
        let segs: Vec<_> = preps.iter().map(|p| p.connect(&infos).unwrap()).collect();
        let mut ts: Vec<ShmTransport> = preps
            .into_iter()
            .zip(segs)
            .map(|(p, s)| ShmTransport::new(p, s, vec![None, None, None]).unwrap())
            .collect();
        assert_eq!(ts[0].committed_at_init(), RINGS + stride as usize);
        assert_eq!(ts[2].committed_at_init(), RINGS);
        assert!(
            ts[2].describe().contains("rings from 0 of 2 peers"),
            "{}",
            ts[2].describe()
        );
        // 2 sends to 0: 2 commits its ring in its own segment, and populates the one in 0's.
        let data = vec![7u8; 1000];
        let hdr = FrameHeader {
            kind: FrameKind::Data,
            coll: 0,
            dtype: 0,
            op: super::super::NO_OP,
            root: 0,
            len: data.len() as u32,
            seq: 1,
            count: data.len() as u64,
        };
        let mut sp = SendProgress::default();
        assert!(ts[2].send(0, &hdr, &data, &mut sp).unwrap());
        assert_eq!(allocated(&ts[2].file), RINGS as u64 + stride);
        // 0 has not used the pair yet: its ring from 2 holds the frame (2 populated it), and
        // its first receive commits it (a no-op for the pages 2 touched) and takes it.
        struct Take(Vec<u8>);
        impl RecvSink for Take {
            fn on_header(&mut self, hdr: &FrameHeader) -> Result<usize> {
                Ok(hdr.len as usize)
            }
            fn direct(&mut self) -> Option<&mut [u8]> {
                Some(&mut self.0)
            }
            fn granule(&self) -> usize {
                1
            }
            fn consume(&mut self, _: &[u8]) -> Result<()> {
                Ok(())
            }
        }
        let mut sink = Take(vec![0u8; 1000]);
        let mut rp = RecvProgress::default();
        assert!(ts[0].recv(2, &mut rp, &mut sink).unwrap());
        assert_eq!(sink.0, data);
        assert_eq!(allocated(&ts[0].file), RINGS as u64 + 2 * stride);
        assert!(ts[0].peers[2].as_ref().is_some_and(|p| p.committed));
    }

    /// Links that never connect anything (a peer that never answers).
    #[derive(Debug)]
    struct Silent;

    impl Links for Silent {
        fn start(&mut self, _: usize) -> Result<()> {
            Ok(())
        }
        fn progress(&mut self) -> Result<Vec<(usize, TcpStream)>> {
            Ok(Vec::new())
        }
        fn fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
            Vec::new()
        }
    }

    /// Until its liveness connection is made, a peer is watched through its process: one
    /// that ended (here a child process that exited: a zombie, then reaped) is reported
    /// lost, naming it, by the next check, long before any deadline.
    #[test]
    fn a_peer_whose_process_ended_before_its_connection_was_made_is_lost_not_waited_for() {
        let partners = |_: usize| Vec::new();
        let opts = ShmOptions { ring_bytes: 8192 };
        let preps: Vec<Prepared> = (0..2)
            .map(|r| prepare(r, 2, &partners, opts).unwrap())
            .collect();
        // Rank 1's process is a child that exits at once.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let t = Instant::now();
        while proc_stat(child.id()).is_some_and(|(s, _)| s != 'Z')
            && t.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        preps[1]
            .seg
            .u32_at(OFF_PID)
            .store(child.id(), Ordering::Relaxed);
        let infos: Vec<SegInfo> = preps.iter().map(Prepared::info).collect();
        let segs = preps[0].connect(&infos).unwrap();
        let mut it = preps.into_iter();
        let mut t0 = ShmTransport::new(it.next().unwrap(), segs, vec![None, None])
            .unwrap()
            .with_links(Box::new(Silent));
        assert_eq!(t0.connected_peers(), Some(0));
        assert!(t0
            .describe()
            .contains("liveness over TCP connections: 0 of 1 at init"));
        // A receive starts the connection and finds nothing yet.
        struct Nothing;
        impl RecvSink for Nothing {
            fn on_header(&mut self, _: &FrameHeader) -> Result<usize> {
                Ok(0)
            }
            fn direct(&mut self) -> Option<&mut [u8]> {
                None
            }
            fn granule(&self) -> usize {
                1
            }
            fn consume(&mut self, _: &[u8]) -> Result<()> {
                Ok(())
            }
        }
        let mut rp = RecvProgress::default();
        assert!(!t0.recv(1, &mut rp, &mut Nothing).unwrap());
        let interest = [Interest {
            peer: 1,
            recv: true,
            send: false,
        }];
        let lost = |t0: &mut ShmTransport| -> Option<Error> {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Err(e) = t0.wait(&interest, Instant::now() + LIVENESS_POLL) {
                    return Some(e);
                }
            }
            None
        };
        // The zombie counts as gone.
        let e = lost(&mut t0).expect("a zombie peer is lost");
        assert!(
            matches!(&e, Error::PeerLost { peer: 1, detail, .. } if detail.contains("ended")),
            "{e:?}"
        );
        child.wait().unwrap();
    }

    #[test]
    fn segment_info_round_trips_and_rejects_other_lengths() {
        let i = SegInfo {
            pid: 42,
            fd: 7,
            len: 1 << 22,
            ring: 1 << 21,
            nonce: 0xdead_beef_cafe_f00d,
        };
        assert_eq!(SegInfo::decode(&i.encode()), Some(i));
        assert_eq!(SegInfo::decode(&[0u8; 31]), None);
    }

    /// A peer (misbehaving, or of another build) whose segment is too small for the layout
    /// would make later ring accesses fall outside it: refused at connect, naming the rank.
    #[test]
    fn a_peer_segment_of_another_length_is_refused_at_connect() {
        use std::os::fd::AsRawFd;
        let opts = ShmOptions { ring_bytes: 8192 };
        let me = prepare(0, 2, &|_| Vec::new(), opts).unwrap();
        // A well-formed header for rank 1 of 2 in a segment of 4096 bytes: too small for
        // one ring of 8 KiB.
        let len = 4096;
        let file = seg::create(len, &[(0, len)], "dspark-shm-test-small").unwrap();
        let small = Seg::map(&file, len).unwrap();
        small.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
        small.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
        small.u32_at(OFF_WORLD).store(2, Ordering::Relaxed);
        small.u32_at(OFF_RANK).store(1, Ordering::Relaxed);
        small.u64_at(OFF_NONCE).store(7, Ordering::Relaxed);
        let theirs = SegInfo {
            pid: std::process::id(),
            fd: file.as_raw_fd() as u32,
            len: len as u64,
            ring: me.ring as u64,
            nonce: 7,
        };
        let e = me.connect(&[me.info(), theirs]).unwrap_err();
        assert!(e.contains("rank 1") && e.contains("4096 bytes"), "{e}");
        let right = SegInfo {
            len: seg_len(2, me.ring) as u64,
            ..theirs
        };
        let e = me.connect(&[me.info(), right]).unwrap_err();
        assert!(
            e.contains("rank 1's segment"),
            "a mis-sized file is still caught: {e}"
        );
    }

    #[test]
    fn rings_of_every_peer_fit_the_segment_on_their_own_lines() {
        for world in 1..8 {
            let ring = 8192;
            let len = seg_len(world, ring);
            for owner in 0..world {
                for sender in (0..world).filter(|&s| s != owner) {
                    let b = ring_base(owner, sender, ring);
                    assert_eq!(b % PAGE, 0, "rings are committed by the page");
                    assert!(b + RING_DATA + ring <= len);
                }
            }
        }
        assert_eq!(pad(33), 64);
        assert_eq!(pad(64), 64);
        assert_eq!(pad(0), 0);
    }
}
