//! The shared-memory transport, for ranks that are all on one host.
//!
//! # Segments
//!
//! Every rank creates one segment: an anonymous, sealed memory file (`memfd`), allocated in
//! full at init. Peers open it through `/proc/<pid>/fd/<n>` during the bootstrap, while its
//! owner waits for them, and map it; then the owner closes its descriptor. The segment has no
//! name in any filesystem, so nothing is left behind after any exit, SIGKILL included: the
//! kernel frees the memory with the last mapping. Layout (offsets in bytes, every shared word
//! on its own 64-byte line):
//!
//! | offset | what | written by |
//! | --- | --- | --- |
//! | 0 | magic, version, world, rank, ring size, nonce | owner, at init |
//! | 64 | `bell`: futex word, bumped to wake the owner | peers |
//! | 128 | `sleeping`: the owner is about to block on `bell` | owner |
//! | 192 | `status` (open, goodbye, abort), abort class, origin, message length | owner |
//! | 256 | abort message (up to 3840 bytes) | owner |
//! | 4096 + i × (256 + R) | ring *into* the owner from its i-th peer: `head` (+0, the sender's), `tail` (+128, the owner's), data (+256, R bytes) | |
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
//! A dead process writes no FIN into shared memory, so the bootstrap's TCP connection to
//! every peer stays open as a liveness descriptor: its kernel closes it when the process
//! exits, however it exits. A blocked wait sleeps at most [`LIVENESS_POLL`] at a time and
//! then polls those connections, so a killed peer surfaces within milliseconds as
//! [`Error::PeerLost`] — after whatever it had already written to the ring, which stays
//! readable (the memory outlives the writer). A stopped peer (SIGSTOP) keeps its connection
//! open and writes nothing: the caller's deadline reports it ([`Error::Timeout`]), as over
//! TCP. Goodbye and abort are the owner's `status` word (with the abort's class, origin and
//! message beside it), set once and followed by a wake of every peer: unlike an in-ring
//! frame it is deliverable even when a ring is full or a frame half written. As over TCP,
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

use super::{
    frame_len_mismatch, rdhup, AbortClass, FrameHeader, FrameKind, Interest, RecvProgress,
    RecvSink, SendProgress, Transport, TransportKind, HEADER_LEN,
};
use crate::error::{Error, Result};

mod seg;
pub use seg::Seg;
use seg::LINE;

/// Default bytes of each ring (per ordered pair of ranks).
pub const DEFAULT_RING_BYTES: usize = 2 << 20;
/// Smallest ring accepted.
pub const MIN_RING_BYTES: usize = 4096;
/// Largest ring accepted.
pub const MAX_RING_BYTES: usize = 1 << 30;
/// The longest a blocked wait sleeps before it looks at the peers' liveness connections: how
/// late, at most, a killed peer is noticed by a rank asleep on its `bell`.
pub const LIVENESS_POLL: Duration = Duration::from_millis(10);
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
const VERSION: u32 = 1;

// Segment layout (see the module docs).
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_WORLD: usize = 12;
const OFF_RANK: usize = 16;
const OFF_RING: usize = 24;
const OFF_NONCE: usize = 32;
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
    /// segment holds `world − 1` of them.
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

/// Bytes of one rank's segment for `world` ranks and rings of `ring` bytes.
fn seg_len(world: usize, ring: usize) -> usize {
    let raw = RINGS + world.saturating_sub(1) * (RING_DATA + ring);
    raw.div_ceil(4096) * 4096
}

/// `MemAvailable` of `/proc/meminfo` in bytes.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Whether the segments of `ranks` ranks on one host, `len` bytes each (a ring of `ring`
/// bytes for every ordered pair, allocated in full at init), fit in half of the host's
/// available memory `avail`: a ring per pair grows as ranks², and 128 ranks with 2 MiB rings
/// would take 32 GiB. `Err` says how much, and what to change.
fn fits_in_memory(
    ranks: usize,
    len: usize,
    ring: usize,
    avail: u64,
) -> std::result::Result<(), String> {
    let total = (ranks as u64).saturating_mul(len as u64);
    if total <= avail / 2 {
        return Ok(());
    }
    let h = |b: u64| crate::types::human_bytes(b, true);
    Err(format!(
        "{ranks} ranks' rings ({} per pair, one per ordered pair: {} in all) would take more \
         than half of this host's available memory ({}); smaller rings \
         (DSPARK_SHM_RING_BYTES, at least two DSPARK_CHUNK_BYTES segments) or fewer ranks \
         per host would fit",
        h(ring as u64),
        h(total),
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
    RINGS + ring_index(owner, sender) * (RING_DATA + ring)
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

/// Creates this rank's segment (`Err`: why shared memory cannot be used here).
pub fn prepare(
    rank: usize,
    world: usize,
    opts: ShmOptions,
) -> std::result::Result<Prepared, String> {
    prepare_group(rank, world, &(0..world).collect::<Vec<_>>(), opts)
}

/// Creates this rank's segment for shared memory with `members` only (the ranks of its host,
/// this rank included, in a `world`-rank job): one ring per member, none for the others.
/// `Err`: why shared memory cannot be used here.
pub fn prepare_group(
    rank: usize,
    world: usize,
    members: &[usize],
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
    if let Some(avail) = mem_available() {
        fits_in_memory(members.len(), len, ring, avail)?;
    }
    let file = seg::create(len, &format!("dspark-shm-rank{rank}"))?;
    let seg = Seg::map(&file, len)?;
    let nonce = seg::nonce();
    seg.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
    seg.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
    seg.u32_at(OFF_WORLD).store(world as u32, Ordering::Relaxed);
    seg.u32_at(OFF_RANK).store(rank as u32, Ordering::Relaxed);
    seg.u64_at(OFF_RING).store(ring as u64, Ordering::Relaxed);
    seg.u64_at(OFF_NONCE).store(nonce, Ordering::Release);
    Ok(Prepared {
        rank,
        world,
        members,
        ring,
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
    /// The bootstrap's connection to it, kept as a liveness descriptor.
    stream: TcpStream,
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
    peers: Vec<Option<Peer>>,
    desc: String,
    done: bool,
}

impl ShmTransport {
    /// The transport over this rank's segment, its peers' (`segs[r]`, from
    /// [`Prepared::connect`]) and the bootstrap's connections (`streams[r]`), kept as
    /// liveness descriptors. Once every peer has mapped this rank's segment (the caller's
    /// second bootstrap round), dropping `Prepared`'s descriptor is safe.
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
            file,
            seg: own,
            ..
        } = prep;
        drop(file);
        // Rings are laid out by position among the members.
        let pos = |r: usize| members.iter().position(|&m| m == r).unwrap_or(0);
        let mut peers = Vec::with_capacity(world);
        for (r, (s, st)) in segs.into_iter().zip(streams).enumerate() {
            if r != rank && !members.contains(&r) {
                // Reached through another transport; its stream is not this transport's.
                peers.push(None);
                continue;
            }
            match (s, st) {
                (Some(seg), Some(stream)) => {
                    stream.set_nonblocking(true).map_err(|e| {
                        Error::io(
                            Some(rank),
                            Some(r),
                            "configuring the liveness connection",
                            e,
                        )
                    })?;
                    let _ = stream.set_nodelay(true);
                    peers.push(Some(Peer {
                        seg,
                        stream,
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
                (None, _) if r == rank => peers.push(None),
                _ => {
                    return Err(Error::invalid(
                        Some(rank),
                        "shared-memory transport",
                        format!("no segment or connection for rank {r}"),
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
        let desc = format!(
            "shm ({among}memfd segments, {} KiB ring per pair, {} KiB mapped per rank, futex \
             wake-ups, liveness over the bootstrap connections)",
            ring / 1024,
            own.len() / 1024
        );
        Ok(ShmTransport {
            rank,
            world,
            ring,
            own,
            peers,
            desc,
            done: false,
        })
    }

    /// A transport for a world of one (no peers, no segment to share).
    pub fn single() -> Result<Self> {
        let prep = prepare(
            0,
            1,
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
        let mut b = [0u8; 256];
        let gone = loop {
            match p.stream.read(&mut b) {
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

    /// Whether `peer`'s receive ring holds bytes not yet taken.
    fn rx_pending(&self, p: &Peer) -> bool {
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
        let mut fds = Vec::with_capacity(self.world);
        let mut which = Vec::with_capacity(self.world);
        for (i, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            if p.state == PeerState::Open {
                fds.push(PollFd::new(p.stream.as_fd(), PollFlags::POLLIN | rdhup()));
                which.push(i);
            }
        }
        let mut flagged = Vec::new();
        if !fds.is_empty() {
            match nix::poll::poll(&mut fds, PollTimeout::ZERO) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(Error::io(Some(self.rank), None, "poll", io::Error::from(e)));
                }
            }
            for (fd, &i) in fds.iter().zip(&which) {
                if fd.revents().is_none_or(|r| !r.is_empty()) {
                    flagged.push(i);
                }
            }
        }
        drop(fds);
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
            if it.send {
                let tail = p.seg.u64_at(p.tx_base + RING_TAIL).load(Ordering::Acquire);
                if tail != p.tx_tail || p.tx_head.wrapping_sub(tail) < self.ring as u64 {
                    return true;
                }
            }
        }
        false
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn describe(&self) -> String {
        self.desc.clone()
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
        let (rx_base, state_open) = {
            let p = self.peer_ref(peer, OP)?;
            (p.rx_base, p.state == PeerState::Open)
        };
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
                let slice = (deadline - now).min(LIVENESS_POLL);
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
            let _ = p.stream.shutdown(Shutdown::Both);
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
            let _ = p.stream.shutdown(Shutdown::Write);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_that_would_take_more_than_half_the_available_memory_are_refused() {
        let ring = 2 << 20;
        // 8 ranks with 2 MiB rings: 8 segments of 7 rings, 112 MiB and a little.
        let len = seg_len(8, ring);
        assert!(fits_in_memory(8, len, ring, 1 << 30).is_ok());
        assert!(fits_in_memory(8, len, ring, 200 << 20).is_err());
        // 128 ranks: 128 × 127 rings of 2 MiB, about 32 GiB, refused on a 24 GiB machine.
        let len = seg_len(128, ring);
        let e = fits_in_memory(128, len, ring, 24 << 30).unwrap_err();
        assert!(
            e.contains("128 ranks") && e.contains("DSPARK_SHM_RING_BYTES"),
            "{e}"
        );
        assert!(fits_in_memory(128, len, ring, 80 << 30).is_ok());
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
        let me = prepare(0, 2, opts).unwrap();
        // A well-formed header for rank 1 of 2 in a segment of 4096 bytes: too small for
        // one ring of 8 KiB.
        let len = 4096;
        let file = seg::create(len, "dspark-shm-test-small").unwrap();
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
                    assert_eq!(b % LINE, 0);
                    assert!(b + RING_DATA + ring <= len);
                }
            }
        }
        assert_eq!(pad(33), 64);
        assert_eq!(pad(64), 64);
        assert_eq!(pad(0), 0);
    }
}
