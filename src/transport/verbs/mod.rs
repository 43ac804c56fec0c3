//! The RDMA verbs transport: reliable-connected queue pairs, receiver-driven
//! `RDMA_WRITE_WITH_IMM`, as NCCL's IB transport does it.
//!
//! # Protocol
//!
//! Each ordered pair of ranks has `n` pre-registered receive *slots* at the receiver (header +
//! payload ≥ the engine's segment size), `n` staging slots at the sender and a ring of `n`
//! clear-to-send (CTS) entries in the sender's memory. One RC queue pair per pair of ranks
//! carries both directions.
//!
//! 1. The connection information (QP number, PSN, LID/GID, MTU, slot and ring addresses, rkey)
//!    travels through the bootstrap; all slots start free, so the first `n` frames need no CTS.
//!    Only the pairs the collectives' schedules use (the caller's `partners`, O(log n) per
//!    rank) get a queue pair and slot memory at init. Any other pair (all-to-all, send/recv)
//!    connects on first use ([`VerbsTransport::with_links`]): a TCP connection made through
//!    [`Links`] (the bootstrap's, with its token proofs) carries the two ends' connection
//!    information of a fresh queue pair, then a one-byte "ready" once each end is at RTS,
//!    and stays open as that pair's liveness connection. Until then a send or receive to
//!    that peer reports "not yet", and `wait` and `check_peers` advance the exchange.
//! 2. The sender copies the 32-byte [`FrameHeader`] and the payload into staging slot
//!    `k % n` and writes it into the receiver's slot with one `RDMA_WRITE_WITH_IMM`; the
//!    immediate carries the frame length and the low bits of its sequence number. For a caller
//!    buffer registered with [`Registering::register_host`] the payload is gathered straight from
//!    the caller's memory (zero-copy; the header comes from the staging slot).
//! 3. The receiver learns of the frame from the receive completion, hands the payload to
//!    [`RecvSink::consume`] straight out of the slot (reductions read the receive buffer) or
//!    copies it to [`RecvSink::direct`], then re-advertises the slot: a 32-byte CTS entry
//!    (address, rkey, size, sequence) RDMA-written into the sender's ring, also with an
//!    immediate so that a sender blocked in [`Transport::wait`] wakes up.
//! 4. Data and CTS writes are unsignalled except every `depth/2`-th, which retires the send
//!    queue; a CTS for frame `k + n` proves frame `k` landed, which frees its staging slot.
//!    Zero-copy writes are signalled: their completion releases the caller's buffer.
//! 5. Abort and goodbye frames go to a separate control slot (so they never wait for a
//!    clear-to-send). The bootstrap's TCP connections stay open as a liveness signal: a peer
//!    process that dies closes them (a node that loses power stops answering their TCP
//!    keepalive, ≈ 5 s), and survivors report [`Error::PeerLost`] when they next need that
//!    peer instead of waiting for the transport's retry budget or the deadline. What the peer
//!    delivered before still counts: its arrived frames are taken first, so a rank that
//!    finished a call and exited (no goodbye: `process::exit`, a crash) fails no survivor's
//!    same call. For that, a call returns only once its writes were acknowledged
//!    ([`Transport::flush`]). Likewise an abort frame carries the last collective its sender
//!    completed ([`Transport::collective_progress`]): a survivor that finished that
//!    collective and failed in the next one (it lost the rank that exited) fails the other
//!    survivors' next call, not the same collective they may still be finishing; the
//!    aborting rank's frames before the abort are still taken. A stopped process (`SIGSTOP`)
//!    is not noticed this way: its kernel answers keepalives and its NIC acknowledges writes;
//!    it meets the deadline.
//!
//! 6. *Direct frames* (GPUDirect RDMA): when both ranks registered a direct region at init
//!    ([`DirectSpec`]; GPU memory through dma-buf or nvidia-peermem, or host memory standing in
//!    for it in tests), frame `k`'s payload is RDMA-written from a send slot of the sender's
//!    region into landing slot `k % n` for that sender in the receiver's region, followed on
//!    the same queue pair by the 32-byte header into receive slot `k % n` with a
//!    `WRITE_WITH_IMM` whose immediate marks it direct. The receiver hands the landing offset
//!    to the engine and re-advertises the slot (CTS `k + n`) only when the engine released it —
//!    after the device consumed the payload; ordinary frames taken meanwhile wait behind it, so
//!    CTS stay in order. The sender's send slot is reusable once the signalled header write
//!    completed ([`DirectTransport::direct_send_done`]).
//!
//! Work-completion errors become typed errors naming the peer, the operation and the
//! `ibv_wc_status` string. After [`Transport::abort`] every queue pair is in the ERR state:
//! nothing touches caller memory any more.
//!
//! # Tunables (environment)
//!
//! Parsed by [`crate::Config::from_env`] into [`crate::config::IbSettings`] (bounds checked by
//! [`crate::Config::validate`]) and turned into [`VerbsOptions`] by the communicator's setup
//! (`VerbsOptions::from_config`, in `src/comm/setup.rs`); the transport itself reads no
//! environment and no configuration.
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `DSPARK_IB_DEVICE` | device, optionally `:port` (`mlx5_0`, `mlx5_0:1`) | first ACTIVE port |
//! | `DSPARK_IB_GID_INDEX` | GID index (RoCE; global routing on IB) | the IPv4-mapped RoCE v2 GID |
//! | `DSPARK_IB_SLOTS` | slots per peer and direction | 8 |
//! | `DSPARK_IB_SLOT_BYTES` | payload bytes per slot (≥ `DSPARK_CHUNK_BYTES`) | the segment size |
//! | `DSPARK_IB_TIMEOUT` | ACK timeout exponent (4.096 µs × 2^t, 1–31) | 20 (≈ 4.3 s) |
//! | `DSPARK_IB_RETRY_CNT` | transport retries (0–7) | 7 |
//! | `DSPARK_IB_RNR_RETRY` | RNR retries (0–6) | 6 |
//! | `DSPARK_IB_SL` | service level (0–15): the priority lossless RoCE maps it to | 0 |
//! | `DSPARK_IB_TC` | traffic class (0–255): RoCE v2's DSCP/ECN byte (DSCP 26 → 104) | 0 |
//! | `DSPARK_IB_SPIN_US` | busy-poll of the CQ in `wait` before sleeping | 20 |
//! | `DSPARK_IB_ZERO_COPY_MIN` | smallest frame sent zero-copy from a registered buffer | 64 KiB |
//!
//! With the defaults a queue pair gives up after about 8 × 4.3 s ≈ 34 s without
//! acknowledgements — NCCL's budget, so that congestion and PFC pauses do not fail a job. A
//! dead peer is found by the liveness connection instead: within about a second when its
//! process dies (the kernel closes the socket; frames it delivered still count), and after
//! about 5 s when its node does (keepalive and a user timeout on that socket).
//!
//! # Layout
//!
//! * `mod.rs`: the transport's state ([`VerbsTransport`], one `Peer` per connection);
//! * `options.rs`: [`VerbsOptions`] and what they imply: slot sizes, pinned memory,
//!   [`direct_layout`], the memlock check;
//! * `device.rs`: device, port and GID selection; the dma-buf probe ([`probe_nic_dmabuf`]);
//! * `memory.rs`: the direct region ([`DirectSpec`] and its registration) and caller buffers
//!   registered for zero-copy sends;
//! * `connect.rs`: queue-pair setup and the connection exchange: [`prepare`], the connection
//!   information of every rank ([`Prepared::blob`], [`why_not_connectable`]),
//!   [`Prepared::connect`], [`VerbsTransport::build`];
//! * `lazy.rs`: connections on first use ([`VerbsTransport::with_links`]);
//! * `protocol.rs`: the slot protocol (credits, frame writes, arrivals, re-advertised slots,
//!   completions) and the `Transport` implementation;
//! * `liveness.rs`: the liveness connections, waiting on completions and liveness together,
//!   goodbye and abort;
//! * [`ib`]: the safe layer over `dspark-sys`; [`qp`]: the queue-pair state machine as data;
//!   [`slots`]: slot and queue accounting of one connection; [`wire`]: connection
//!   information, CTS entries and immediates.
//!
//! [`FrameHeader`]: crate::transport::FrameHeader
//! [`Links`]: crate::transport::Links
//! [`RecvSink::consume`]: crate::transport::RecvSink::consume
//! [`RecvSink::direct`]: crate::transport::RecvSink::direct
//! [`Transport::abort`]: crate::transport::Transport::abort
//! [`Transport::collective_progress`]: crate::transport::Transport::collective_progress
//! [`DirectTransport::direct_send_done`]: crate::transport::DirectTransport::direct_send_done
//! [`Transport::flush`]: crate::transport::Transport::flush
//! [`Registering::register_host`]: crate::transport::Registering::register_host
//! [`Transport::wait`]: crate::transport::Transport::wait

pub mod ib;
pub mod qp;
pub mod slots;
pub mod wire;

mod connect;
mod device;
mod lazy;
mod liveness;
mod memory;
mod options;
mod protocol;

use std::collections::VecDeque;
use std::net::TcpStream;
use std::time::Instant;

use dspark_sys as ffi;

use self::ib::{Context, Cq, Lib, Memory, Mr, Pd, Qp};
use self::memory::{DirectOwn, UserMr};
use self::slots::{RecvSide, SendQueue, SendSide};
use self::wire::{DirectInfo, PortAddr, QpInfo};
use crate::error::Error;

pub use self::connect::{prepare, why_not_connectable, Prepared};
pub use self::device::{probe_nic_dmabuf, NicDmaBuf};
pub use self::memory::DirectSpec;
pub use self::options::{
    cap_ipc_lock_in, direct_layout, memlock_shortfall, parse_device, VerbsOptions,
};
pub use crate::gpu::MemoryKind;

#[derive(Debug, Clone)]
enum PeerState {
    Open,
    /// The peer said goodbye (when it arrived: writes posted before it may still be
    /// waiting for their acknowledgement, see [`CLOSED_GRACE`](liveness::CLOSED_GRACE)).
    Closed(Instant),
    /// The liveness connection closed without a goodbye (when that was seen, and what was
    /// seen): the process is gone. Frames it wrote before are still taken (they may be
    /// polled after the liveness signal, see [`GONE_GRACE`](liveness::GONE_GRACE)); what
    /// needs more from it fails.
    Gone {
        at: Instant,
        detail: String,
    },
    /// The peer aborted (when its abort frame arrived, and the last collective it had
    /// completed, as the frame says). The frames it wrote before are still taken (they
    /// precede the abort on the queue pair); what needs more from it fails with `error`. Every
    /// call of this rank fails with `error` too, except a collective the peer had completed
    /// (`done` ≥ its sequence number): the peer delivered its part of it and needs nothing
    /// more, so that call finishes and the next one reports the abort
    /// ([`VerbsTransport::abort_news`]).
    Aborted {
        error: Error,
        done: u64,
        at: Instant,
    },
    /// The connection failed: the error every later use returns.
    Failed(Error),
}

impl Peer {
    /// Records that a verb on this connection failed: the connection is failed from now on,
    /// and every later use returns the same error (naming the rank, the peer and the verb).
    fn fail_verb(&mut self, rank: usize, peer: usize, op: String, e: &ib::VerbError) -> Error {
        let err = Error::Transport {
            rank: Some(rank),
            peer: Some(peer),
            op,
            what: e.err.to_string(),
        };
        self.state = PeerState::Failed(err.clone());
        err
    }
}

/// One connection.
#[derive(Debug)]
struct Peer {
    // Field order is drop order: the QP goes first, then the MRs, then the memory.
    qp: Qp,
    remote_mr: Mr,
    local_mr: Mr,
    remote_mem: Memory,
    local_mem: Memory,
    /// Liveness: the bootstrap's TCP connection to the peer (closed when its process dies).
    stream: Option<TcpStream>,
    /// The peer's memory.
    theirs: QpInfo,
    their_slot_bytes: usize,
    their_ctrl_bytes: usize,
    send: SendSide,
    recv: RecvSide,
    sq: SendQueue,
    /// Lengths of arrived frames, by slot.
    rx_len: Vec<u32>,
    /// Whether the frame in each slot is direct (payload in the landing slot).
    rx_direct: Vec<bool>,
    /// Direct frames taken but not released (frame indices, oldest first).
    held: VecDeque<u64>,
    /// Where this rank's direct payloads land at the peer: (address of landing slot 0 for
    /// this rank, rkey, bytes per slot).
    their_landing: Option<(u64, u32, usize)>,
    state: PeerState,
    /// Bye/abort written by this rank (send-queue index of the write).
    farewell: Option<u64>,
    /// Connected on first use and the peer's "ready" has not come yet: its queue pair may
    /// still be in INIT, so this rank writes nothing to it (it may receive: the peer writes
    /// only once it has this rank's "ready").
    await_ready: bool,
}

impl Peer {
    fn is_open(&self) -> bool {
        matches!(self.state, PeerState::Open)
    }
}

/// The verbs transport of one rank.
pub struct VerbsTransport {
    rank: usize,
    world: usize,
    // Field order is drop order: connections and registrations, then CQ, PD, context, library.
    peers: Vec<Option<Peer>>,
    /// Connections on first use, and queue pairs in the making (None: only the peers
    /// connected at init are reachable).
    lazy: Option<lazy::Lazy>,
    user_mrs: Vec<UserMr>,
    direct: Option<DirectOwn>,
    /// Every rank's direct region information (this rank's included).
    direct_infos: Vec<DirectInfo>,
    cq: Cq,
    pd: Pd,
    /// The port in use and its address (for queue pairs made on first use).
    port: u8,
    addr: PortAddr,
    /// Device and port, for messages (`mlx5_0:1`).
    device: String,
    /// Kept open until everything above is released.
    _ctx: Context,
    lib: Lib,
    wc: Vec<ffi::ibv_wc>,
    opts: VerbsOptions,
    desc: String,
    next_mr_id: u64,
    /// `abort` or `close` ran.
    finished: bool,
    /// The collective the engine is running, and the last one it completed
    /// ([`Transport::collective_progress`](crate::transport::Transport::collective_progress));
    /// abort frames carry `coll_done`.
    coll_running: Option<u64>,
    coll_done: u64,
    /// Some peer is [`PeerState::Aborted`] (so that `progress` looks for the news only then).
    peer_aborted: bool,
    /// Frames sent straight from registered caller memory.
    zero_copy_frames: u64,
}

impl std::fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("desc", &self.desc)
            .finish()
    }
}

impl VerbsTransport {
    /// Every rank's direct region information, as exchanged at init (indexed by rank).
    pub fn direct_infos(&self) -> &[DirectInfo] {
        &self.direct_infos
    }

    /// The options in use.
    pub fn options(&self) -> &VerbsOptions {
        &self.opts
    }
}
