//! Queue-pair setup and the connection exchange: [`prepare`] opens the device, registers the
//! slot memory and the direct region and creates one queue pair per peer connected at init
//! (the caller's `partners`); its connection information ([`Prepared::blob`]) travels to
//! every other rank through the bootstrap; [`Prepared::connect`] moves every queue pair to
//! RTS towards its peer; and [`VerbsTransport::build`] turns the connected resources into the
//! transport. The other peers get their queue pair on first use (`lazy.rs`), from the same
//! [`Half::new`] and [`Peer::new`].

use std::collections::VecDeque;
use std::net::TcpStream;

use dspark_sys as ffi;

use super::device::{choose_port, gid_string, Local};
use super::ib::{self, Access, Cq, Lib, Memory, Mr, Pd, Qp};
use super::memory::{register_direct, DirectOwn, DirectSpec};
use super::options::{memlock_problem, reg_hint, timeout_ms, VerbsOptions, CTRL_BYTES};
use super::protocol::POLL_BATCH;
use super::slots::{RecvSide, SendQueue, SendSide};
use super::wire::{self, wr_id, Blob, DirectInfo, DirectKind, LinkLayer, PortAddr, QpInfo, WrKind};
use super::{Peer, PeerState, VerbsTransport};
use crate::error::{Error, Result};

/// This rank's memory and queue pair for one peer, before connecting.
pub(super) struct Half {
    pub(super) qp: Qp,
    pub(super) remote_mr: Mr,
    pub(super) local_mr: Mr,
    pub(super) remote_mem: Memory,
    pub(super) local_mem: Memory,
    pub(super) psn: u32,
}

impl Half {
    /// Creates the slot memory (registered) and a queue pair in INIT with its receives
    /// posted, for the connection of `rank` to `peer`; `dev` names the device in reasons.
    pub(super) fn new(
        pd: &Pd,
        cq: &Cq,
        port: u8,
        opts: &VerbsOptions,
        (rank, peer): (usize, usize),
        dev: &str,
    ) -> std::result::Result<Half, String> {
        let n = opts.slots;
        let (sq_depth, rq_depth) = queue_depths(n);
        let (remote_len, local_len) = opts.peer_memory();
        let (Some(remote_mem), Some(local_mem)) = (Memory::new(remote_len), Memory::new(local_len))
        else {
            return Err(format!(
                "{dev}: cannot allocate {} KiB of slot memory for rank {peer}",
                (remote_len + local_len) / 1024
            ));
        };
        // SAFETY: both ranges are owned by the `Half` together with their MRs, which are
        // dropped before the memory (field order of `Half` and `Peer`); Rust only forms
        // references to parts the protocol says the NIC is not writing at that moment.
        let remote_mr =
            unsafe { pd.register(remote_mem.as_ptr(), remote_len, Access::RemoteWrite) }
                .map_err(|e| format!("{dev}: {}", reg_hint(&e)))?;
        // SAFETY: as above.
        let local_mr = unsafe { pd.register(local_mem.as_ptr(), local_len, Access::LocalWrite) }
            .map_err(|e| format!("{dev}: {}", reg_hint(&e)))?;
        let mut qp = Qp::new(pd, cq, sq_depth, rq_depth).map_err(|e| format!("{dev}: {e}"))?;
        qp.to_init(port).map_err(|e| format!("{dev}: {e}"))?;
        for _ in 0..rq_depth {
            qp.post_recv(wr_id(peer, WrKind::Recv, 0))
                .map_err(|e| format!("{dev}: {e}"))?;
        }
        Ok(Half {
            qp,
            remote_mr,
            local_mr,
            remote_mem,
            local_mem,
            psn: psn_for(rank, peer),
        })
    }

    /// What the peer needs to write into this half's memory and connect to its queue pair.
    pub(super) fn info(&self, opts: &VerbsOptions) -> QpInfo {
        let n = opts.slots;
        let sb = opts.slot_bytes();
        let base = self.remote_mem.as_ptr() as u64;
        QpInfo {
            qpn: self.qp.qpn,
            psn: self.psn,
            rkey: self.remote_mr.rkey,
            rx_addr: base,
            ctrl_addr: base + (n * sb) as u64,
            cts_addr: base + (n * sb + CTRL_BYTES) as u64,
        }
    }

    /// Moves the queue pair to RTR towards `theirs` at the peer's port `port`, then to RTS.
    pub(super) fn connect(
        &mut self,
        local: (u8, &PortAddr),
        port: &PortAddr,
        theirs: &QpInfo,
        rel: &ib::Reliability,
    ) -> std::result::Result<(), String> {
        let (local_port, addr) = local;
        let remote = ib::Remote {
            qpn: theirs.qpn,
            psn: theirs.psn,
            lid: port.lid,
            gid: port.gid,
            sgid_index: match (addr.link, port.gid_index) {
                (LinkLayer::Ethernet, _) => addr.gid_index,
                (LinkLayer::InfiniBand, Some(_)) => addr.gid_index,
                (LinkLayer::InfiniBand, None) => None,
            },
            mtu: wire::path_mtu(addr.mtu, port.mtu),
        };
        self.qp
            .to_rtr(local_port, &remote, rel)
            .map_err(|e| e.to_string())?;
        self.qp.to_rts(self.psn, rel).map_err(|e| e.to_string())
    }
}

/// Send and receive queue depths of one queue pair with `n` slots per direction.
fn queue_depths(n: usize) -> (u32, u32) {
    ((2 * n + 8) as u32, (2 * n + 4) as u32)
}

/// Completion queue entries for `peers` queue pairs with `slots` slots per direction: room for
/// every work request they can have outstanding at once (at least 16).
pub(super) fn cq_entries(slots: usize, peers: usize) -> i32 {
    let (sq, rq) = queue_depths(slots);
    ((sq + rq) as usize)
        .saturating_mul(peers)
        .clamp(16, i32::MAX as usize) as i32
}

/// This rank's verbs resources, created by [`prepare`] before the connection round: the
/// device, protection domain, completion queue, one queue pair (in INIT, receives posted) and
/// the slot memory for every peer connected at init, and the direct region.
///
/// Field order is drop order, which verbs needs (`ibv_close_device` requires every object of
/// the context released first): the queue pairs and their memory, the direct region, the
/// completion queue, the protection domain, then the device and the library. A set that is
/// dropped unbuilt (a fall-back to TCP, a refused or failed connection round) released the
/// context first, and the rest through freed memory.
pub struct Prepared {
    halves: Vec<Option<Half>>,
    direct: Option<DirectOwn>,
    cq: Cq,
    pd: Pd,
    local: Local,
    lib: Lib,
    opts: VerbsOptions,
    world: usize,
    direct_info: DirectInfo,
    /// Why the completion queue could not be sized for the peers of init only, if it could
    /// not.
    cq_note: Option<String>,
}

fn psn_for(rank: usize, peer: usize) -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (t ^ ((rank as u32) << 12) ^ (peer as u32).wrapping_mul(0x9e37)) & 0x00ff_ffff
}

/// Opens this rank's RDMA device and port under `opts` and creates everything a connection
/// to each rank of `partners` (the peers connected at init; the others connect on first use,
/// see [`VerbsTransport::with_links`]) needs. The direct region comes after, once the caller
/// knows which device it is near ([`Prepared::device_name`], [`Prepared::register_direct`]);
/// until then the rank announces none.
///
/// The completion queue is sized for the queue pairs made at init and grows (`ibv_resize_cq`)
/// as peers connect on first use, so that its pinned entries are O(log n) like the rest
/// (`cq_entries`). Where the library or the provider cannot resize it (found at init by
/// growing it once), it is sized for a queue pair to every one of the other `world − 1`
/// ranks instead, and the transport's description says so.
///
/// # Errors
/// Why verbs cannot be used here, as a sentence naming the device (no library, no device,
/// no ACTIVE port, a memlock limit too small, a failed verb).
pub fn prepare(
    rank: usize,
    world: usize,
    partners: &[usize],
    opts: VerbsOptions,
) -> std::result::Result<Prepared, String> {
    let lib = ib::load()?;
    let local = choose_port(&lib, &opts)?;
    let dev = format!("{}:{}", local.ctx.name, local.port);
    let mut mine = vec![false; world];
    for &p in partners {
        if p < world && p != rank {
            mine[p] = true;
        }
    }
    let count = mine.iter().filter(|&&m| m).count();
    let need = (opts.pinned_per_peer() * count) as u64;
    if let Some(p) = memlock_problem(need) {
        return Err(format!("{dev}: {p}"));
    }
    let pd = Pd::new(&local.ctx).map_err(|e| format!("{dev}: {e}"))?;
    let every = cq_entries(opts.slots, world.saturating_sub(1));
    let (cq, cq_note) = if count + 1 >= world {
        let cq = Cq::new(&local.ctx, every).map_err(|e| format!("{dev}: {e}"))?;
        (cq, None)
    } else {
        // Sized for the peers of init, then grown by one peer's entries: a provider that
        // cannot resize says so now, not when a peer connects on first use.
        let mut cq = Cq::new(&local.ctx, cq_entries(opts.slots, count))
            .map_err(|e| format!("{dev}: {e}"))?;
        match cq.grow(cq_entries(opts.slots, count + 1)) {
            Ok(()) => (cq, None),
            Err(e) => {
                drop(cq);
                tracing::warn!(
                    rank,
                    "{dev}: the completion queue cannot grow ({e}); sized for all {} peers \
                     at init instead",
                    world - 1
                );
                let cq = Cq::new(&local.ctx, every).map_err(|e| format!("{dev}: {e}"))?;
                (
                    cq,
                    Some(format!(
                        "completion queue sized for all {} peers ({e})",
                        world - 1
                    )),
                )
            }
        }
    };
    let mut halves = Vec::with_capacity(world);
    for (peer, &m) in mine.iter().enumerate() {
        halves.push(if m {
            Some(Half::new(&pd, &cq, local.port, &opts, (rank, peer), &dev)?)
        } else {
            None
        });
    }
    Ok(Prepared {
        lib,
        local,
        pd,
        cq,
        halves,
        opts,
        world,
        direct: None,
        direct_info: DirectInfo::None,
        cq_note,
    })
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("device", &self.local.ctx.name)
            .field("port", &self.local.port)
            .field("direct", &self.direct_info)
            .finish_non_exhaustive()
    }
}

impl Prepared {
    /// The RDMA device this rank opened (for choosing the GPU memory near it).
    pub fn device_name(&self) -> &str {
        &self.local.ctx.name
    }

    /// The options it was prepared with.
    pub fn options(&self) -> &VerbsOptions {
        &self.opts
    }

    /// Registers this rank's direct region as `spec` describes it (replacing one registered
    /// before), so that its connection information announces it.
    pub fn register_direct(&mut self, spec: &DirectSpec) {
        self.direct = None;
        let (direct, info) = register_direct(&self.pd, self.world, &self.opts, spec);
        self.direct = direct;
        self.direct_info = info;
    }

    /// This rank's connection information, for every other rank: the port's address, the
    /// queue pairs and slot memory for each peer connected at init, and the direct region.
    pub fn blob(&self) -> Blob {
        let qps = self
            .halves
            .iter()
            .enumerate()
            .filter_map(|(p, h)| h.as_ref().map(|h| (p as u32, h.info(&self.opts))))
            .collect();
        Blob::Capable {
            device: format!("{}:{}", self.local.ctx.name, self.local.port),
            port: self.local.addr,
            slots: self.opts.slots as u32,
            slot_bytes: self.opts.slot_bytes() as u32,
            ctrl_bytes: CTRL_BYTES as u32,
            qps,
            direct: self.direct_info.clone(),
        }
    }

    /// Moves every queue pair to RTS towards its peer.
    pub fn connect(&mut self, rank: usize, blobs: &[Blob]) -> std::result::Result<(), String> {
        let rel = self.opts.reliability;
        for (peer, h) in self.halves.iter_mut().enumerate() {
            let Some(h) = h else { continue };
            let Some(Blob::Capable { port, .. }) = blobs.get(peer) else {
                return Err(format!("rank {peer} has no verbs connection information"));
            };
            let Some(theirs) = blobs[peer].qp_for(rank) else {
                return Err(format!(
                    "rank {peer} made no queue pair for rank {rank} (do the ranks agree on \
                     which pairs connect at init?)"
                ));
            };
            h.connect((self.local.port, &self.local.addr), port, &theirs, &rel)
                .map_err(|e| format!("queue pair to rank {peer}: {e}"))?;
        }
        Ok(())
    }
}

/// Where rank `rank`'s direct payloads land at a peer whose direct region is `theirs`:
/// (address of landing slot 0 for `rank`, rkey, bytes per slot), when both ranks have a
/// region of the same kind (host-emulated or GPU).
pub(super) fn landing(
    rank: usize,
    slots: usize,
    mine: Option<&DirectOwn>,
    theirs: &DirectInfo,
) -> Option<(u64, u32, usize)> {
    match (mine, theirs) {
        (
            Some(mine),
            DirectInfo::Region {
                kind,
                addr,
                rkey,
                slot_bytes,
            },
        ) if (mine.kind == DirectKind::HostEmulated) == (*kind == DirectKind::HostEmulated) => {
            let sb = *slot_bytes as usize;
            Some((addr + (rank * slots * sb) as u64, *rkey, sb))
        }
        _ => None,
    }
}

/// What a connection needs to know of the peer's end (from its blob or its message on first
/// use).
pub(super) struct TheirEnd {
    pub(super) qp: QpInfo,
    pub(super) slot_bytes: usize,
    pub(super) ctrl_bytes: usize,
    pub(super) landing: Option<(u64, u32, usize)>,
}

impl Peer {
    /// A connection from this rank's `half` (its queue pair at RTS) to the peer's end
    /// `theirs`, with the liveness connection `stream` (made non-blocking, with keepalive).
    pub(super) fn new(
        peer: usize,
        h: Half,
        theirs: TheirEnd,
        stream: Option<TcpStream>,
        slots: usize,
    ) -> Peer {
        if let Some(s) = &stream {
            let _ = s.set_nonblocking(true);
            if let Err(e) = super::liveness::keep_alive(s) {
                tracing::warn!(
                    peer,
                    error = %e,
                    "TCP keepalive on the liveness connection could not be set: a node \
                     that loses power is noticed only by the transport's retries or the \
                     deadline"
                );
            }
        }
        let n = slots;
        Peer {
            qp: h.qp,
            remote_mr: h.remote_mr,
            local_mr: h.local_mr,
            remote_mem: h.remote_mem,
            local_mem: h.local_mem,
            stream,
            theirs: theirs.qp,
            their_slot_bytes: theirs.slot_bytes,
            their_ctrl_bytes: theirs.ctrl_bytes,
            send: SendSide::new(n as u64),
            recv: RecvSide::new(n as u64),
            sq: SendQueue::new(queue_depths(n).0 as u64),
            rx_len: vec![0; n],
            rx_direct: vec![false; n],
            held: VecDeque::new(),
            their_landing: theirs.landing,
            state: PeerState::Open,
            farewell: None,
            await_ready: false,
        }
    }
}

impl VerbsTransport {
    /// The transport of rank `rank` of `world` from its connected resources (`prep` after
    /// [`Prepared::connect`], or unconnected in a world of one), every rank's connection
    /// information `blobs` (indexed by rank; empty in a world of one) and the bootstrap's
    /// TCP connections, kept as liveness signals (`streams`, indexed by peer). Only the peers
    /// `prep` made queue pairs for are connected; [`VerbsTransport::with_links`] connects
    /// the others on first use.
    pub fn build(
        rank: usize,
        world: usize,
        prep: Prepared,
        blobs: &[Blob],
        streams: Vec<Option<TcpStream>>,
    ) -> Self {
        let Prepared {
            lib,
            local,
            pd,
            cq,
            halves,
            opts,
            world: _,
            direct,
            direct_info,
            cq_note,
        } = prep;
        let mut direct_infos: Vec<DirectInfo> = (0..world)
            .map(|r| match blobs.get(r) {
                Some(Blob::Capable { direct, .. }) => direct.clone(),
                _ => DirectInfo::None,
            })
            .collect();
        if let Some(d) = direct_infos.get_mut(rank) {
            *d = direct_info;
        }
        let n = opts.slots;
        let mut streams = streams;
        streams.resize_with(world, || None);
        let mut peers = Vec::with_capacity(world);
        let mut mtus = Vec::new();
        for (peer, (h, stream)) in halves.into_iter().zip(streams).enumerate() {
            let Some(h) = h else {
                peers.push(None);
                continue;
            };
            let (theirs, their_slot_bytes, their_ctrl_bytes, their_mtu) = match &blobs[peer] {
                b @ Blob::Capable {
                    slot_bytes,
                    ctrl_bytes,
                    port,
                    ..
                } => (
                    b.qp_for(rank).unwrap_or_default(),
                    *slot_bytes as usize,
                    *ctrl_bytes as usize,
                    port.mtu,
                ),
                Blob::Incapable { .. } => (QpInfo::default(), 0, 0, 0),
            };
            mtus.push(wire::path_mtu(local.addr.mtu, their_mtu));
            let end = TheirEnd {
                qp: theirs,
                slot_bytes: their_slot_bytes,
                ctrl_bytes: their_ctrl_bytes,
                landing: landing(rank, n, direct.as_ref(), &direct_infos[peer]),
            };
            peers.push(Some(Peer::new(peer, h, end, stream, n)));
        }
        let a = &local.addr;
        let addressing = match a.gid_index {
            Some(gi) => format!("GID index {gi} {}", gid_string(&a.gid)),
            None => format!("LID {}", a.lid),
        };
        let path = match (mtus.iter().min(), mtus.iter().max()) {
            (Some(lo), Some(hi)) if lo == hi => format!(", path MTU {}", wire::mtu_bytes(*lo)),
            (Some(lo), Some(hi)) => {
                format!(
                    ", path MTU {}–{}",
                    wire::mtu_bytes(*lo),
                    wire::mtu_bytes(*hi)
                )
            }
            _ => String::new(),
        };
        let r = &opts.reliability;
        let desc = format!(
            "verbs {}:{} ({} {addressing}, active MTU {}{path}), RC, {} slots × {} KiB per peer \
             and direction, ACK timeout {} (~{:.0} ms) × {} retries, zero-copy sends from \
             registered buffers ≥ {} KiB",
            local.ctx.name,
            local.port,
            a.link.name(),
            wire::mtu_bytes(a.mtu),
            n,
            opts.slot_payload / 1024,
            r.timeout,
            timeout_ms(r.timeout),
            r.retry_cnt,
            opts.zero_copy_min / 1024,
        );
        let desc = match cq_note {
            Some(note) => format!("{desc}, {note}"),
            None => desc,
        };
        // SAFETY: all-zero is a valid ibv_wc (integers and a union of integers).
        let wc = vec![unsafe { std::mem::zeroed::<ffi::ibv_wc>() }; POLL_BATCH];
        VerbsTransport {
            rank,
            world,
            peers,
            lazy: None,
            user_mrs: Vec::new(),
            direct,
            direct_infos,
            cq,
            pd,
            port: local.port,
            addr: local.addr,
            device: format!("{}:{}", local.ctx.name, local.port),
            _ctx: local.ctx,
            lib,
            wc,
            opts,
            desc,
            next_mr_id: 1,
            finished: false,
            coll_running: None,
            coll_done: 0,
            peer_aborted: false,
            zero_copy_frames: 0,
        }
    }
}

/// Whether the connection information of every rank (`blobs`, indexed by rank) allows a queue
/// pair between every two ranks: `Ok(None)` when it does, `Ok(Some(why))` when a rank cannot
/// use verbs or two ranks' ports cannot be connected (their link layers differ). `host(r)`
/// names rank `r`'s host in the reasons (`" on node7"`, or nothing).
///
/// # Errors
/// [`Error::Config`] when the ranks' slot layouts differ: both ends of a queue pair index the
/// same slot ring, so that is a misconfiguration to fix, not a reason to fall back to TCP.
pub fn why_not_connectable(
    blobs: &[Blob],
    host: &dyn Fn(usize) -> String,
) -> Result<Option<String>> {
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
    Ok(why_not)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::verbs::options::test_options;

    #[test]
    fn missing_library_or_device_is_a_reason_not_a_panic() {
        // On machines without rdma-core this is the "cannot load" path; with it, the device
        // probe runs. Either way: a sentence, never a panic.
        let o = test_options(8);
        if let Err(reason) = prepare(0, 2, &[1], o) {
            assert!(!reason.is_empty());
        }
    }
}
