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
//! 2. The sender copies the 32-byte [`FrameHeader`] and the payload into staging slot
//!    `k % n` and writes it into the receiver's slot with one `RDMA_WRITE_WITH_IMM`; the
//!    immediate carries the frame length and the low bits of its sequence number. For a caller
//!    buffer registered with [`Transport::register_host`] the payload is gathered straight from
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
//!    process that dies closes them, and survivors report [`Error::PeerLost`] at once instead
//!    of waiting for the transport's retry budget.
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
//!    completed ([`Transport::direct_send_done`]).
//!
//! Work-completion errors become typed errors naming the peer, the operation and the
//! `ibv_wc_status` string. After [`Transport::abort`] every queue pair is in the ERR state:
//! nothing touches caller memory any more.
//!
//! # Tunables (environment)
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `DSPARK_IB_DEVICE` | device, optionally `:port` (`mlx5_0`, `mlx5_0:1`) | first ACTIVE port |
//! | `DSPARK_IB_GID_INDEX` | GID index (RoCE; global routing on IB) | the IPv4-mapped RoCE v2 GID |
//! | `DSPARK_IB_SLOTS` | slots per peer and direction | 8 |
//! | `DSPARK_IB_SLOT_BYTES` | payload bytes per slot (≥ `DSPARK_CHUNK_BYTES`) | the segment size |
//! | `DSPARK_IB_TIMEOUT` | ACK timeout exponent (4.096 µs × 2^t) | 16 (≈ 268 ms) |
//! | `DSPARK_IB_RETRY_CNT` | transport retries | 7 |
//! | `DSPARK_IB_RNR_RETRY` | RNR retries (0–6) | 6 |
//! | `DSPARK_IB_SPIN_US` | busy-poll of the CQ in `wait` before sleeping | 20 |
//! | `DSPARK_IB_ZERO_COPY_MIN` | smallest frame sent zero-copy from a registered buffer | 64 KiB |
//!
//! With the defaults a dead peer surfaces after about 8 × 268 ms ≈ 2 s of retries (or at once
//! through the closed bootstrap connection), not after the 30 s of common defaults.
//!
//! # Layout
//!
//! * `mod.rs`: the transport's state ([`VerbsTransport`], one `Peer` per connection) and the
//!   job-wide transport choice ([`select`]);
//! * `options.rs`: [`VerbsOptions`] and what they imply: slot sizes, pinned memory,
//!   [`direct_layout`], the memlock check;
//! * `device.rs`: device, port and GID selection; the dma-buf probe ([`probe_nic_dmabuf`]);
//! * `memory.rs`: the direct region ([`DirectSpec`] and its registration) and caller buffers
//!   registered for zero-copy sends;
//! * `connect.rs`: queue-pair setup and the connection exchange (prepare, connection
//!   information, connect, build);
//! * `protocol.rs`: the slot protocol (credits, frame writes, arrivals, re-advertised slots,
//!   completions) and the `Transport` implementation;
//! * `liveness.rs`: the liveness connections, waiting on completions and liveness together,
//!   goodbye and abort;
//! * [`ib`]: the safe layer over `dspark-sys`; [`qp`]: the queue-pair state machine as data;
//!   [`slots`]: slot and queue accounting of one connection; [`wire`]: connection
//!   information, CTS entries and immediates.
//!
//! [`FrameHeader`]: crate::transport::FrameHeader
//! [`RecvSink::consume`]: crate::transport::RecvSink::consume
//! [`RecvSink::direct`]: crate::transport::RecvSink::direct
//! [`Transport::abort`]: crate::transport::Transport::abort
//! [`Transport::direct_send_done`]: crate::transport::Transport::direct_send_done
//! [`Transport::register_host`]: crate::transport::Transport::register_host
//! [`Transport::wait`]: crate::transport::Transport::wait

pub mod ib;
pub mod qp;
pub mod slots;
pub mod wire;

mod connect;
mod device;
mod liveness;
mod memory;
mod options;
mod protocol;

use std::collections::VecDeque;
use std::net::TcpStream;
use std::time::Instant;

use dspark_sys as ffi;

use self::connect::prepare;
use self::ib::{Context, Cq, Lib, Memory, Mr, Pd, Qp};
use self::memory::{DirectOwn, UserMr};
use self::slots::{RecvSide, SendQueue, SendSide};
use self::wire::{Blob, DirectInfo, LinkLayer, QpInfo};
use crate::bootstrap::Bootstrap;
use crate::config::{Config, TransportChoice};
use crate::error::{Error, Result};

pub use self::device::{probe_nic_dmabuf, NicDmaBuf};
pub use self::memory::{DirectSpec, HostRegion};
pub use self::options::{direct_layout, memlock_shortfall, parse_device, VerbsOptions};
pub use crate::gpu::MemoryKind;

#[derive(Debug, Clone)]
enum PeerState {
    Open,
    /// The peer said goodbye (when it arrived: writes posted before it may still be
    /// waiting for their acknowledgement, see [`CLOSED_GRACE`](liveness::CLOSED_GRACE)).
    Closed(Instant),
    /// The connection failed, or the peer aborted: the error every later use returns.
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
    user_mrs: Vec<UserMr>,
    direct: Option<DirectOwn>,
    /// Every rank's direct region information (this rank's included).
    direct_infos: Vec<DirectInfo>,
    cq: Cq,
    pd: Pd,
    /// Kept open until everything above is released.
    _ctx: Context,
    lib: Lib,
    wc: Vec<ffi::ibv_wc>,
    opts: VerbsOptions,
    desc: String,
    next_mr_id: u64,
    /// `abort` or `close` ran.
    finished: bool,
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

/// What the transport negotiation decided.
#[derive(Debug)]
pub enum Selected {
    /// Verbs on every rank.
    Verbs(Box<VerbsTransport>),
    /// TCP on every rank, over these streams; `reason` says why not verbs (when there were
    /// peers to reach and verbs was not ruled out by `DSPARK_TRANSPORT=tcp`).
    Tcp {
        /// The bootstrap's data connections.
        streams: Vec<Option<TcpStream>>,
        /// Why verbs is not used.
        reason: Option<String>,
    },
}

fn mode_code(c: TransportChoice) -> u8 {
    match c {
        TransportChoice::Auto => 0,
        TransportChoice::Tcp => 1,
        TransportChoice::Verbs => 2,
    }
}

fn unavailable(reason: &str) -> Error {
    Error::unavailable("the verbs transport (DSPARK_TRANSPORT=verbs)", reason)
}

/// Agrees with every other rank on the transport, through the bootstrap (see
/// [`crate::comm::Communicator::init`]): verbs when every rank has a usable port and no rank
/// asks for TCP; otherwise TCP everywhere, or — when some rank asked for verbs —
/// [`Error::Unavailable`] on every rank, naming the rank and the reason.
///
/// # Errors
/// [`Error::Unavailable`], bootstrap errors ([`Error::Timeout`], [`Error::PeerLost`]),
/// [`Error::Config`] for bad `DSPARK_IB_*` settings.
pub fn select(
    boot: &mut Bootstrap,
    cfg: &Config,
    streams: Vec<Option<TcpStream>>,
    direct: &mut dyn FnMut(&VerbsOptions, &str) -> DirectSpec,
) -> Result<Selected> {
    let rank = cfg.rank;
    let world = cfg.world_size;
    let opts = VerbsOptions::from_lookup(cfg, |k| std::env::var(k).ok())?;
    if world == 1 {
        return match cfg.transport {
            TransportChoice::Verbs => {
                let prep = prepare(rank, world, opts, direct).map_err(|r| unavailable(&r))?;
                Ok(Selected::Verbs(Box::new(VerbsTransport::build(
                    rank,
                    world,
                    prep,
                    &[],
                    streams,
                ))))
            }
            _ => Ok(Selected::Tcp {
                streams,
                reason: None,
            }),
        };
    }
    // Round 1: requested mode + capability (+ connection information).
    let mut prep = None;
    let blob = if cfg.transport == TransportChoice::Tcp {
        Blob::Incapable {
            reason: "DSPARK_TRANSPORT=tcp".into(),
        }
    } else {
        match prepare(rank, world, opts, direct) {
            Ok(p) => {
                let b = p.blob();
                prep = Some(p);
                b
            }
            Err(reason) => Blob::Incapable { reason },
        }
    };
    let mut msg = vec![mode_code(cfg.transport)];
    msg.extend_from_slice(&blob.encode());
    let all = boot.all_gather(&msg)?;
    let mut modes = Vec::with_capacity(world);
    let mut blobs = Vec::with_capacity(world);
    for (r, m) in all.iter().enumerate() {
        let (mode, rest) = m.split_first().map_or((0, &[][..]), |(a, b)| (*a, b));
        modes.push(mode);
        blobs.push(Blob::decode(rest).unwrap_or_else(|w| Blob::Incapable {
            reason: format!("(rank {r}) {w}"),
        }));
    }
    let hosts: Vec<String> = boot.peers.iter().map(|p| p.host.clone()).collect();
    let host = |r: usize| hosts.get(r).map_or(String::new(), |h| format!(" on {h}"));
    let someone_wants_verbs = modes.contains(&mode_code(TransportChoice::Verbs));
    let mut why_not: Option<String> = None;
    for (r, b) in blobs.iter().enumerate() {
        if let Blob::Incapable { reason } = b {
            why_not = Some(format!("rank {r}{}: {reason}", host(r)));
            break;
        }
    }
    if why_not.is_none() {
        let links: Vec<(usize, LinkLayer)> = blobs
            .iter()
            .enumerate()
            .filter_map(|(r, b)| match b {
                Blob::Capable { port, .. } => Some((r, port.link)),
                Blob::Incapable { .. } => None,
            })
            .collect();
        if let Some(&(r, l)) = links.iter().find(|(_, l)| *l != links[0].1) {
            why_not = Some(format!(
                "rank 0's RDMA port is {} but rank {r}'s is {}: they cannot be connected",
                links[0].1.name(),
                l.name()
            ));
        }
    }
    if why_not.is_none() {
        // Both ends of a queue pair index the same slot ring: the slot layout must agree.
        let layout: Vec<(usize, u32, u32)> = blobs
            .iter()
            .enumerate()
            .filter_map(|(r, b)| match b {
                Blob::Capable {
                    slots, slot_bytes, ..
                } => Some((r, *slots, *slot_bytes)),
                Blob::Incapable { .. } => None,
            })
            .collect();
        if let Some(&(r, n, b)) = layout
            .iter()
            .find(|(_, n, b)| (*n, *b) != (layout[0].1, layout[0].2))
        {
            let msg = format!(
                "rank 0 uses {} slots of {} bytes per peer but rank {r}{} uses {n} of {b}: set the \
                 same DSPARK_IB_SLOTS, DSPARK_IB_SLOT_BYTES and DSPARK_CHUNK_BYTES on every rank",
                layout[0].1,
                layout[0].2,
                host(r)
            );
            return Err(Error::config("DSPARK_IB_SLOTS", msg));
        }
    }
    // Round 2 (only when round 1 found every rank capable): connect and agree it worked.
    if why_not.is_none() {
        let mut prep = prep
            .take()
            .ok_or_else(|| unavailable("internal: capable without resources"))?;
        let res = prep.connect(rank, &blobs);
        let mine = match &res {
            Ok(()) => vec![1u8],
            Err(w) => {
                let mut v = vec![0u8];
                v.extend_from_slice(w.as_bytes());
                v
            }
        };
        let all = boot.all_gather(&mine)?;
        for (r, m) in all.iter().enumerate() {
            if m.first() != Some(&1) {
                let w = String::from_utf8_lossy(m.get(1..).unwrap_or_default()).into_owned();
                why_not = Some(format!(
                    "rank {r}{}: connecting queue pairs failed: {w}",
                    host(r)
                ));
                break;
            }
        }
        if why_not.is_none() {
            let t = VerbsTransport::build(rank, world, prep, &blobs, streams);
            tracing::info!(rank, transport = %t.desc, "using RDMA verbs");
            return Ok(Selected::Verbs(Box::new(t)));
        }
    }
    let why = why_not.unwrap_or_default();
    if someone_wants_verbs {
        let who: Vec<String> = modes
            .iter()
            .enumerate()
            .filter(|(_, &m)| m == mode_code(TransportChoice::Verbs))
            .map(|(r, _)| r.to_string())
            .collect();
        return Err(unavailable(&format!(
            "{why} (DSPARK_TRANSPORT=verbs on rank(s) {})",
            who.join(", ")
        )));
    }
    let any_capable = blobs.iter().any(|b| matches!(b, Blob::Capable { .. }));
    let asked_tcp = modes.contains(&mode_code(TransportChoice::Tcp));
    if any_capable && !asked_tcp {
        // Some ranks could do RDMA but not all: the job silently runs slower. Say so.
        tracing::warn!(rank, reason = %why, "falling back to TCP on every rank: not every rank can use RDMA verbs");
    } else {
        tracing::info!(rank, reason = %why, "using TCP");
    }
    let reason = if cfg.transport == TransportChoice::Tcp
        && modes.iter().all(|&m| m == mode_code(TransportChoice::Tcp))
    {
        None
    } else {
        Some(format!("verbs unavailable: {why}"))
    };
    Ok(Selected::Tcp { streams, reason })
}
