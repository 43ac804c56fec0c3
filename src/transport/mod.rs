//! Transports: how frames move between ranks.
//!
//! The [`Transport`] trait is modelled on NCCL's net plugin interface: non-blocking, progress
//! driven by the caller, completion polled, a blocking [`Transport::wait`] with a deadline.
//! Transports know nothing about collectives: they move *frames* — a 32-byte [`FrameHeader`]
//! followed by a payload — over one FIFO stream per ordered pair of ranks. The engine
//! ([`crate::engine`]) decides which frame goes where and when.
//!
//! Implementations: [`mem`] (threads in one process, with fault injection, for tests),
//! [`tcp`] (the universal fallback and the CI path), [`shm`] (shared memory between the
//! ranks of one host), `verbs` (RDMA) and [`mixed`] (shm within each host, TCP between
//! hosts, routed per peer).
//!
//! # The progress contract
//!
//! * [`Transport::send`] is called repeatedly for one frame, with the same header and the same
//!   data each time, until it returns `Ok(true)`. The transport may keep a reference to the
//!   data's *address* between calls (zero-copy transports do), so the caller must neither
//!   modify nor free the data until the frame completes or the transport is
//!   [aborted](Transport::abort).
//! * [`Transport::recv`] is called repeatedly for the next frame from a peer until it returns
//!   `Ok(true)`. It hands the header to [`RecvSink::on_header`] (which validates it and says how
//!   many payload bytes to expect), then delivers the payload either straight into
//!   [`RecvSink::direct`] or, for reducing receives, in whole-element pieces to
//!   [`RecvSink::consume`], which reduces straight out of the transport's receive buffer.
//! * Frames from one peer arrive in the order that peer sent them.
//!
//! # Capabilities
//!
//! Every transport implements the core of [`Transport`]: moving frames, waiting, liveness,
//! abort and close, and the few general questions every transport answers (which transport
//! carries a peer, how many peers are connected, where the engine stands, flushing). What
//! only some transports can do is a trait of its own, which a transport states it supports
//! by answering `Some(self)` to the accessor the engine asks:
//!
//! * [`DirectTransport`] ([`Transport::direct`]): payloads that move between the ranks'
//!   direct regions (GPUDirect RDMA); `verbs`, and `mem` emulating it in host memory.
//! * [`Registering`] ([`Transport::registration`]): caller buffers registered for zero-copy
//!   sends; `verbs`.
//!
//! Where a transport answers `None`, the engine does what the capability's absence means:
//! no direct region (payloads are staged through host memory), no registration (`None`
//! ids, no zero-copy frames).

use std::fmt;
use std::time::Instant;

use crate::error::Result;

mod links;
pub mod mem;
pub mod mixed;
pub mod shm;
pub mod tcp;
pub mod verbs;

/// Connections a [`tcp::TcpTransport`] makes after init, on first use: to the peers it was not
/// given a stream for (all-to-all and send/recv partners, and any pair the init-time links
/// left out). The higher rank of a pair connects; both prove the job token. Implemented by
/// the bootstrap ([`crate::bootstrap::LazyLinks`]), which owns this rank's data listener.
/// The verbs transport uses them too, to exchange the information of a queue pair made on
/// first use ([`crate::transport::verbs::VerbsTransport::with_links`]).
pub trait Links: Send + fmt::Debug {
    /// Starts connecting to `peer` unless a connection to it is in the making. Either rank
    /// of a pair may start; when both do at once, the higher rank's connection is kept.
    ///
    /// # Errors
    /// [`Error::PeerLost`](crate::error::Error::PeerLost) when its listener refuses (it closed
    /// or died).
    fn start(&mut self, peer: usize) -> Result<()>;

    /// Advances, without waiting for a peer, the handshakes whose next message has arrived,
    /// and accepts connections from higher ranks: pushes the connections that completed onto
    /// `done`, also those that completed before an error (a failed handshake with one peer
    /// loses no other peer's connection).
    ///
    /// # Errors
    /// A rank of this job that proved itself and does not fit, or a failed handshake with a
    /// peer this rank was connecting to.
    fn progress(&mut self, done: &mut Vec<(usize, std::net::TcpStream)>) -> Result<()>;

    /// Descriptors to poll, each with the events that mean [`Links::progress`] has work
    /// (readable, or writable for a connection whose `connect` is in the making).
    fn fds(&self) -> Vec<nix::poll::PollFd<'_>>;

    /// Whether `e`, an error of [`Links::progress`], is a connection that the peer's host
    /// took but that the peer did not answer in time: a peer busy elsewhere (late to a
    /// collective) or stopped, not one that is lost. No by default.
    fn unanswered(&self, _e: &crate::error::Error) -> bool {
        false
    }
}

/// Size of a frame header on the wire.
pub const HEADER_LEN: usize = 32;

/// Magic number in every frame header ("DSPK"), to catch a desynchronised stream.
pub const FRAME_MAGIC: u32 = 0x4453_504b;

/// Which transport moves the data.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "cli", serde(rename_all = "lowercase"))]
pub enum TransportKind {
    /// In-process (tests).
    Mem,
    /// TCP sockets.
    Tcp,
    /// RDMA verbs (InfiniBand / RoCE).
    Verbs,
    /// Shared memory between the ranks of one host.
    Shm,
    /// Shared memory between the ranks of one host and TCP between hosts, in one
    /// communicator ([`mixed`]); [`Transport::peer_kind`] says which one a peer uses.
    #[cfg_attr(feature = "cli", serde(rename = "shm+tcp"))]
    ShmTcp,
}

impl TransportKind {
    /// Short name (`mem`, `tcp`, `verbs`, `shm`, `shm+tcp`).
    pub const fn name(self) -> &'static str {
        match self {
            TransportKind::Mem => "mem",
            TransportKind::Tcp => "tcp",
            TransportKind::Verbs => "verbs",
            TransportKind::Shm => "shm",
            TransportKind::ShmTcp => "shm+tcp",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Collective or point-to-point payload (possibly empty).
    Data = 1,
    /// The sender failed; the payload is its error message. `root` holds the failing rank.
    Abort = 2,
    /// The sender closed its communicator cleanly.
    Bye = 3,
}

/// The 32-byte header in front of every frame. Besides its length, it carries the full
/// descriptor of the call it belongs to, so ranks that disagree about a call find out from the
/// first frame they exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Frame kind.
    pub kind: FrameKind,
    /// [`crate::plan::Collective`] wire code.
    pub coll: u8,
    /// [`crate::DataType`] wire code.
    pub dtype: u8,
    /// [`crate::ReduceOp`] wire code, or [`NO_OP`].
    pub op: u8,
    /// Root of the collective (0 when it has none); for `Abort`, the failing rank.
    pub root: u32,
    /// Payload length in bytes.
    pub len: u32,
    /// Call sequence number: the communicator's collective counter, or the per-pair counter
    /// for send/recv.
    pub seq: u64,
    /// Element count of the call.
    pub count: u64,
}

/// `op` value of collectives that do not reduce.
pub const NO_OP: u8 = 0xff;

/// The high bit of a frame header's `count` in an all-to-all of counts per peer: the rest is
/// the number of elements of the block between the frame's two ranks (the engine's
/// `all_to_all_v`), where other calls' headers carry the call's count.
pub const COUNT_PER_PEER: u64 = 1 << 63;

/// A header's `count` in words: `count 12`, or `12 for this pair, counts per peer`.
pub fn count_text(count: u64) -> String {
    if count & COUNT_PER_PEER != 0 {
        format!("{} for this pair, counts per peer", count & !COUNT_PER_PEER)
    } else {
        format!("count {count}")
    }
}

impl FrameHeader {
    /// Serialises to little-endian bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind as u8;
        b[1] = self.coll;
        b[2] = self.dtype;
        b[3] = self.op;
        b[4..8].copy_from_slice(&self.root.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    /// Parses a header; `Err` names what is wrong (bad magic or kind), which means the stream
    /// is corrupt or the peer is not a dspark rank of this version.
    pub fn decode(b: &[u8; HEADER_LEN]) -> std::result::Result<Self, String> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let magic = u32_at(12);
        if magic != FRAME_MAGIC {
            return Err(format!(
                "frame header has magic {magic:#010x}, expected {FRAME_MAGIC:#010x} \
                 (corrupt stream or not a dspark peer)"
            ));
        }
        let kind = match b[0] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            3 => FrameKind::Bye,
            k => return Err(format!("unknown frame kind {k}")),
        };
        Ok(FrameHeader {
            kind,
            coll: b[1],
            dtype: b[2],
            op: b[3],
            root: u32_at(4),
            len: u32_at(8),
            seq: u64_at(16),
            count: u64_at(24),
        })
    }

    /// An abort frame header announcing that `rank` failed with an error of class `class`
    /// ([`AbortClass`]), followed by a `len`-byte message. `seq` is 0 here; the transports put
    /// there the last collective the sending rank completed
    /// ([`Transport::collective_progress`]; 0, as from a sender that predates it, lets the
    /// abort fail every call).
    pub fn abort(rank: usize, len: usize, class: AbortClass) -> Self {
        FrameHeader {
            kind: FrameKind::Abort,
            coll: class as u8,
            dtype: 0,
            op: NO_OP,
            root: rank as u32,
            len: len as u32,
            seq: 0,
            count: 0,
        }
    }

    /// A goodbye frame header.
    pub fn bye() -> Self {
        FrameHeader {
            kind: FrameKind::Bye,
            ..Self::abort(0, 0, AbortClass::Other)
        }
    }
}

/// What kind of failure an abort frame announces, so that survivors report the same kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum AbortClass {
    /// Anything else: survivors report [`Error::Aborted`](crate::error::Error::Aborted).
    Other = 0,
    /// Ranks disagree about a call: survivors report [`Error::Mismatch`](crate::error::Error::Mismatch)
    /// with the same description.
    Mismatch = 1,
}

impl AbortClass {
    /// The class of an error, and the text to send with it.
    pub fn of(e: &crate::error::Error) -> (Self, String) {
        match e {
            crate::error::Error::Mismatch { what, .. } => (AbortClass::Mismatch, what.clone()),
            crate::error::Error::Aborted { reason, .. } => (AbortClass::Other, reason.clone()),
            e => (AbortClass::Other, e.to_string()),
        }
    }

    /// The error a survivor (`rank`, in operation `op`) reports for an abort frame from
    /// `origin` of class `code` with message `reason`.
    pub fn error(
        code: u8,
        rank: usize,
        origin: usize,
        op: &str,
        reason: String,
    ) -> crate::error::Error {
        if code == AbortClass::Mismatch as u8 {
            crate::error::Error::Mismatch {
                rank: Some(rank),
                peer: Some(origin),
                op: op.into(),
                what: reason,
            }
        } else {
            crate::error::Error::Aborted {
                rank,
                by: origin,
                op: op.into(),
                reason,
            }
        }
    }
}

/// One-shot contributions in shared memory ([`Transport::slots`]): every rank writes its
/// whole input once, with the call's frame header, into a slot of its own that every peer
/// reads, and reduces the others' straight out of theirs; no frames, no acknowledgements.
///
/// Each rank has two slots and uses them in turn, one per one-shot call: a rank overwrites
/// the slot of call `j` at call `j + 2`, after it read every peer's contribution to call
/// `j + 1`, which each peer wrote after it had finished reading call `j`. So a slot is never
/// rewritten while a peer may still read it. The header's `seq` (the collective's sequence
/// number) is the flag: stored last, with release ordering, and loaded first, with acquire.
pub trait Slots {
    /// The largest payload of one contribution, in bytes.
    fn capacity(&self) -> usize;

    /// Writes this rank's contribution to the next one-shot call (`hdr`: the call's frame
    /// header, whose `seq` is the collective's; `data`: `hdr.len` bytes). The peers asleep
    /// are woken by [`Slots::settle`], which the caller owes before it blocks
    /// ([`Slots::wait_slots`] does it) and before the call returns.
    ///
    /// # Errors
    /// A payload over [`Slots::capacity`]; an abort heard already.
    fn publish(&mut self, hdr: &FrameHeader, data: &[u8]) -> Result<()>;

    /// `peer`'s contribution to the call last published, once there: its header (which the
    /// caller checks against its own call: a peer in another one-shot call at this sequence
    /// number shows here) and its payload, straight from shared memory. `None` while it is
    /// not there.
    ///
    /// # Errors
    /// The peer's abort, goodbye or loss, once it has not contributed (what it wrote before
    /// any of them is still taken); a mismatch where the peer sent a frame of this call.
    fn peek(&mut self, peer: usize, seq: u64) -> Result<Option<(FrameHeader, &[u8])>>;

    /// Blocks until one of `peers` may have contributed to call `seq`, a peer's status
    /// changed, the deadline passes or it is time to look at the peers' liveness; then
    /// looks at it ([`Transport::check_peers`]).
    ///
    /// # Errors
    /// As [`Transport::check_peers`].
    fn wait_slots(&mut self, peers: &[usize], seq: u64, deadline: Instant) -> Result<()>;

    /// Wakes the peers asleep on this rank's last contribution, once per publish (nothing
    /// after the first call). Deferred from [`Slots::publish`] so that the wake-up check's
    /// full fence does not stall on the contribution's cache line in flight.
    fn settle(&mut self);
}

/// Receives one frame's payload on behalf of the engine.
pub trait RecvSink {
    /// Called once per frame with its header (of kind `Data`). Returns the payload length the
    /// receiver expects, or the error (usually `Mismatch`) that ends the receive.
    fn on_header(&mut self, hdr: &FrameHeader) -> Result<usize>;

    /// The destination to place payload bytes into directly (copying receives), or `None`
    /// when the payload must be handed to [`RecvSink::consume`].
    fn direct(&mut self) -> Option<&mut [u8]>;

    /// Size of one element: `consume` always gets a multiple of it.
    fn granule(&self) -> usize;

    /// Takes the next payload bytes (a whole number of elements, in order).
    fn consume(&mut self, bytes: &[u8]) -> Result<()>;
}

/// What the engine is waiting for on one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interest {
    /// The peer.
    pub peer: usize,
    /// Waiting to receive from it.
    pub recv: bool,
    /// Waiting to send to it.
    pub send: bool,
}

/// Progress of one frame being sent: bytes of header and payload already handed over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendProgress {
    /// Bytes of header + payload written so far.
    pub written: usize,
    /// Transport-private token (e.g. a posted work request).
    pub token: u64,
}

/// Progress of the frame being received from one peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvProgress {
    /// Header of the frame being received, once read and accepted.
    pub header: Option<FrameHeader>,
    /// Payload bytes expected.
    pub expected: usize,
    /// Payload bytes delivered so far.
    pub got: usize,
}

/// The layout of one rank's *direct region*: memory registered with the transport at init
/// (GPU memory for GPUDirect RDMA, or host memory when the path is emulated in tests) into which
/// peers' payloads land without passing through host slots, followed by the send slots the
/// payloads leave from.
///
/// Landing slot `i` for frames from `peer` starts at `(peer × slots + i) × slot_bytes`; send
/// slot `j` at `(world × slots + j) × slot_bytes`. Direct frame `k` from a peer lands in that
/// peer's landing slot `k % slots` and stays there, untouched by the sender, until the receiver
/// [releases](DirectTransport::release_direct) it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectLayout {
    /// Ranks.
    pub world: usize,
    /// Landing slots per peer.
    pub slots: usize,
    /// Payload bytes per slot.
    pub slot_bytes: usize,
    /// Send slots.
    pub send_slots: usize,
}

impl DirectLayout {
    /// Offset of landing slot `i` for frames from `peer`.
    pub fn landing(&self, peer: usize, i: usize) -> usize {
        (peer * self.slots + i) * self.slot_bytes
    }

    /// Offset of send slot `j`.
    pub fn send(&self, j: usize) -> usize {
        (self.world * self.slots + j) * self.slot_bytes
    }

    /// Bytes of the whole region.
    pub fn len(&self) -> usize {
        (self.world * self.slots + self.send_slots) * self.slot_bytes
    }

    /// Whether the region is empty (no slots).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `POLLRDHUP` (peer shut down its sending side), which nix does not name.
pub(crate) fn rdhup() -> nix::poll::PollFlags {
    nix::poll::PollFlags::from_bits_retain(libc::POLLRDHUP)
}

/// Host access to a direct region that lives in host memory (the emulated path in tests):
/// copies only, because the NIC may be writing other parts of it at any time.
pub trait RegionAccess: Send + Sync + fmt::Debug {
    /// Copies `dst.len()` bytes from offset `off` into `dst`; `false`, copying nothing, when
    /// that range is not inside the region.
    fn read(&self, off: usize, dst: &mut [u8]) -> bool;
    /// Copies `src` to offset `off`; `false`, copying nothing, when that range is not inside
    /// the region.
    fn write(&self, off: usize, src: &[u8]) -> bool;
    /// The region's identity, equal to [`DirectTransport::direct_base`] of the transport that
    /// owns it (its address for a NIC).
    fn id(&self) -> u64;
}

/// Where a direct frame's payload is: `len` bytes at `offset` of this rank's direct region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Landed {
    /// Offset in the direct region.
    pub offset: usize,
    /// Payload bytes (0 for an empty frame, which holds no slot).
    pub len: usize,
}

/// The error for a frame whose payload travels the other way than the receiver expects (one
/// rank called a device collective, the other the host one).
pub fn direct_mismatch(rank: usize, peer: usize, direct_sent: bool) -> crate::error::Error {
    let (theirs, ours) = if direct_sent {
        ("device memory (direct)", "host memory")
    } else {
        ("host memory", "device memory (direct)")
    };
    crate::error::Error::Mismatch {
        rank: Some(rank),
        peer: Some(peer),
        op: "receive".into(),
        what: format!("rank {peer} sent from {theirs} while this rank receives into {ours}"),
    }
}

/// The error for a frame whose header announces `got` payload bytes where the receiver's
/// call expects `expected` (the ranks disagree about the call, or the frame is corrupt).
pub fn frame_len_mismatch(
    rank: usize,
    peer: usize,
    got: usize,
    expected: usize,
) -> crate::error::Error {
    crate::error::Error::Transport {
        rank: Some(rank),
        peer: Some(peer),
        op: "receive".into(),
        what: format!(
            "frame header from rank {peer} says {got} bytes where {expected} were expected"
        ),
    }
}

/// A way to move frames between the ranks of one communicator.
pub trait Transport: Send + fmt::Debug {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// Which transport carries the frames to and from `peer` (the same as
    /// [`Transport::kind`] except for composite transports such as [`mixed`]).
    fn peer_kind(&self, peer: usize) -> TransportKind {
        let _ = peer;
        self.kind()
    }

    /// How many peers have a connection now, for transports that connect some pairs on
    /// first use ([`tcp`], [`verbs`], [`shm`]); `None` where every pair is connected at init.
    fn connected_peers(&self) -> Option<usize> {
        None
    }

    /// One line for logs and the bench header: device, addresses, options.
    fn describe(&self) -> String;

    /// Pushes the frame `hdr` + `data` to `peer` as far as possible without blocking.
    /// Returns `Ok(true)` once the whole frame is handed over. See the module docs for the
    /// contract on `data`.
    fn send(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        data: &[u8],
        progress: &mut SendProgress,
    ) -> Result<bool>;

    /// Receives the next frame from `peer` as far as possible without blocking. Returns
    /// `Ok(true)` once its payload is fully delivered to `sink`.
    fn recv(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool>;

    /// The header of the next frame from `peer` if it has arrived, without taking it: the
    /// next [`Transport::recv`] from `peer` starts with that same frame. A receive from any
    /// source looks at every peer's next frame this way before it commits to one. Called
    /// between frames only (never while a frame from `peer` is half received). Errors as
    /// `recv`'s: an abort from `peer`, or `peer` gone with nothing more from it.
    fn peek(&mut self, peer: usize) -> Result<Option<FrameHeader>>;

    /// Blocks until one of `interest` may make progress, some other peer sent something
    /// unexpected (an abort, a closed connection), or `deadline` passes (then returns `Ok`;
    /// the caller checks the clock). Spurious wake-ups are allowed.
    fn wait(&mut self, interest: &[Interest], deadline: Instant) -> Result<()>;

    /// Checks, without blocking, every peer for an abort or a lost connection; returns the
    /// error if one fails the call in progress (see [`Transport::collective_progress`] for
    /// what does not).
    fn check_peers(&mut self) -> Result<()>;

    /// Best effort: tells every peer that rank `origin` (this rank, or the rank whose abort
    /// this rank is passing on) failed with an error of class `class` described by `reason`,
    /// and stops all transfers. After this no transfer touches caller memory again.
    fn abort(&mut self, origin: usize, class: AbortClass, reason: &str);

    /// Best effort: tells every peer this rank is leaving cleanly.
    fn close(&mut self);

    /// Where the engine stands among the collectives (numbered communicator-wide from 1):
    /// `running` is the collective in progress (`None` between collectives and during
    /// send/recv), `completed` the last one this rank completed (0: none). The engine calls
    /// it when a collective starts and when it ends.
    ///
    /// A peer that completed a collective has every frame it needed from this rank and has
    /// delivered every frame this rank needs from it, so its abort (for a failure in a later
    /// call, such as losing a third rank that exited right after that collective) must not
    /// fail this rank's same collective: that rank finishes it with what was delivered, and
    /// its next call reports the abort. A transport whose abort frames carry the aborting
    /// rank's `completed` can tell the two apart (TCP, shm and verbs do; mixed forwards to
    /// both sides); the default ignores this. Likewise, during a collective, a peer found gone
    /// fails only the send or receive that needs more from it.
    fn collective_progress(&mut self, running: Option<u64>, completed: u64) {
        let _ = (running, completed);
    }

    /// Waits until every frame handed over so far is delivered to its peer, or that peer is
    /// found gone or failed, or `deadline` passes; the engine calls it before a call returns.
    /// So a rank that exits (or crashes) right after a call does not take with it frames its
    /// peers still need for that call. Problems found here are not this call's: they are
    /// recorded and returned by the next call that needs the peer. The default does nothing
    /// (TCP's kernel keeps delivering a dead process's written bytes; `mem` is synchronous).
    fn flush(&mut self, deadline: Instant) -> Result<()> {
        let _ = deadline;
        Ok(())
    }

    /// The GPUDirect-region capability ([`DirectTransport`]): `Some` for transports that can
    /// be set up with a direct region (`verbs`, `mem`), whether or not this one has a region
    /// (then [`DirectTransport::direct_layout`] says `None`); `None` for the others (the
    /// default), where every payload goes through host memory.
    fn direct(&self) -> Option<&dyn DirectTransport> {
        None
    }

    /// [`Transport::direct`], for moving direct frames.
    fn direct_mut(&mut self) -> Option<&mut dyn DirectTransport> {
        None
    }

    /// The one-shot slot capability ([`Slots`]): `Some` where every peer can read this
    /// rank's contribution to a small all_reduce straight from shared memory (`shm`); `None`
    /// (the default) elsewhere, where [`crate::plan::Algorithm::OneShot`] runs as frames.
    fn slots(&mut self) -> Option<&mut dyn Slots> {
        None
    }

    /// The capability of registering caller memory for zero-copy sends ([`Registering`]):
    /// `Some` for RDMA transports (`verbs`); `None` (the default) for transports that always
    /// copy. A composite may answer here for a part that counts zero-copy frames without
    /// taking registrations itself (then [`Transport::registration_mut`] stays `None`).
    fn registration(&self) -> Option<&dyn Registering> {
        None
    }

    /// [`Transport::registration`], for registering and deregistering.
    fn registration_mut(&mut self) -> Option<&mut dyn Registering> {
        None
    }
}

/// The error of a direct operation `op` with `peer` asked of a transport without a direct
/// region capability ([`Transport::direct_mut`] is `None`): the same error every transport
/// gave when the direct methods were defaults of [`Transport`].
pub fn no_direct_region(op: &str, peer: usize) -> crate::error::Error {
    crate::error::Error::invalid(
        None,
        op,
        format!("this transport has no direct region for rank {peer}"),
    )
}

/// Capability of a transport that can move payloads straight between the ranks' *direct
/// regions* (GPUDirect RDMA over `verbs`; host memory standing in for it in `mem`), asked for
/// with [`Transport::direct`] / [`Transport::direct_mut`]. The engine's device collectives
/// use it; a transport without it stages every payload through host memory.
pub trait DirectTransport {
    /// The layout of this rank's direct region, when the transport was set up with one
    /// (`None`: every payload goes through host memory).
    fn direct_layout(&self) -> Option<DirectLayout>;

    /// The identity of this rank's direct region (its address as registered with the NIC), so
    /// that a device can be checked to use the very region the transport moves data in.
    fn direct_base(&self) -> Option<u64>;

    /// Host access to the direct region when it is host memory (emulation); `None` for GPU
    /// memory or no region.
    fn direct_host_region(&self) -> Option<std::sync::Arc<dyn RegionAccess>>;

    /// Whether payloads to and from `peer` can move directly (both ends have a region).
    fn direct_peer(&self, peer: usize) -> bool;

    /// Like [`Transport::send`], for a frame whose `hdr.len`-byte payload is at `offset` of
    /// this rank's direct region: it lands in `peer`'s region. Empty payloads travel as
    /// ordinary frames. `Ok(true)` means the frame is posted; when the transport still reads
    /// the payload after that, it leaves a non-zero `progress.token`, and the caller keeps
    /// the bytes unchanged until [`DirectTransport::direct_send_done`] says so.
    fn send_direct(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        offset: usize,
        progress: &mut SendProgress,
    ) -> Result<bool>;

    /// Like [`Transport::recv`] for a direct frame: validates its header through `sink`
    /// (`on_header` only) and returns where its payload landed. A non-empty payload keeps its
    /// landing slot until [`DirectTransport::release_direct`]; releases go in arrival order.
    fn recv_direct(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<Option<Landed>>;

    /// Whether the direct send to `peer` that left `token` finished reading its payload.
    fn direct_send_done(&mut self, peer: usize, token: u64) -> Result<bool>;

    /// Gives back the oldest landing slot still held from `peer`: its contents were consumed,
    /// the peer may write it again.
    fn release_direct(&mut self, peer: usize) -> Result<()>;
}

/// Capability of a transport that can send zero-copy from registered caller memory (RDMA
/// transports), asked for with [`Transport::registration`] /
/// [`Transport::registration_mut`].
pub trait Registering {
    /// Registers a caller buffer so that later sends from inside it can move zero-copy;
    /// returns an id for [`Registering::deregister`], or `None` when there is nothing to
    /// register (an empty buffer).
    ///
    /// The registration pins the buffer's pages *as they are now*. The caller must deregister
    /// before freeing or reallocating the buffer: a new allocation that reuses the address
    /// would otherwise be sent from the old, still pinned pages — silently wrong data.
    ///
    /// # Errors
    /// [`crate::error::Error::Transport`] naming the failed registration (e.g. memlock limit).
    fn register_host(&mut self, region: &[u8]) -> Result<Option<u64>>;

    /// Frames sent so far straight from registered caller memory (zero-copy).
    fn zero_copy_frames(&self) -> u64;

    /// Releases a registration made by [`Registering::register_host`] (unknown ids are
    /// ignored).
    fn deregister(&mut self, id: u64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_bad_magic() {
        let h = FrameHeader {
            kind: FrameKind::Data,
            coll: 3,
            dtype: 8,
            op: 2,
            root: 7,
            len: 1 << 20,
            seq: u64::MAX - 1,
            count: 123_456_789_012,
        };
        let b = h.encode();
        assert_eq!(FrameHeader::decode(&b).unwrap(), h);
        let mut bad = b;
        bad[13] ^= 0x40;
        assert!(FrameHeader::decode(&bad).unwrap_err().contains("magic"));
        let mut bad = b;
        bad[0] = 9;
        assert!(FrameHeader::decode(&bad).unwrap_err().contains("kind"));
    }
}
