//! The slot protocol (see the module docs of [`super`]): claiming clear-to-send credits and
//! writing frames into the peer's receive slots (staged, zero-copy or direct), taking arrived
//! frames out of this rank's slots, re-advertising consumed slots, and the completion queue
//! that drives it all — the [`Transport`] implementation of [`VerbsTransport`].

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dspark_sys as ffi;

use super::ib;
use super::liveness::{CLOSED_GRACE, GONE_GRACE};
use super::options::{timeout_ms, CTRL_BYTES};
use super::qp;
use super::wire::{split_wr_id, wr_id, Cts, Imm, WrKind, CTS_LEN};
use super::{MemoryKind, Peer, PeerState, VerbsTransport};
use crate::error::{Error, Result};
use crate::transport::{
    direct_mismatch, frame_len_mismatch, AbortClass, DirectLayout, DirectTransport, FrameHeader,
    FrameKind, Interest, Landed, RecvProgress, RecvSink, RegionAccess, Registering, SendProgress,
    Transport, TransportKind, HEADER_LEN,
};

/// Completions polled per `ibv_poll_cq` call.
pub(super) const POLL_BATCH: usize = 32;

/// A clear-to-send credit claimed for one frame (see `VerbsTransport::claim`).
struct Claim {
    seq: u64,
    slot: usize,
    /// The peer's receive slot and its rkey.
    raddr: u64,
    rkey: u32,
    /// The staged header (inside `local_mr`).
    header_addr: u64,
}

impl VerbsTransport {
    fn peer_ref(&self, peer: usize, op: &str) -> Result<&Peer> {
        let rank = self.rank;
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::invalid(Some(rank), op, format!("no connection to rank {peer}")))
    }

    fn peer_mut(&mut self, peer: usize, op: &str) -> Result<&mut Peer> {
        let rank = self.rank;
        self.peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::invalid(Some(rank), op, format!("no connection to rank {peer}")))
    }

    fn peer_err(&self, peer: usize, op: &str) -> Option<Error> {
        let p = self.peers.get(peer).and_then(Option::as_ref);
        match p.map(|p| &p.state) {
            None => Some(Error::invalid(
                Some(self.rank),
                op,
                format!("no connection to rank {peer}"),
            )),
            Some(PeerState::Open) => None,
            Some(PeerState::Closed(_)) => Some(Error::PeerLost {
                rank: self.rank,
                peer,
                op: op.into(),
                detail: "peer closed its communicator".into(),
            }),
            Some(PeerState::Gone { detail, .. }) => Some(Error::PeerLost {
                rank: self.rank,
                peer,
                op: op.into(),
                detail: detail.clone(),
            }),
            Some(PeerState::Aborted { error, .. }) | Some(PeerState::Failed(error)) => {
                Some(error.clone())
            }
        }
    }

    /// The abort of a peer that fails this rank's call now, if any: every peer's abort,
    /// except during a collective that the peer had completed before it aborted. That peer
    /// delivered every frame this rank needs from it for the collective (its call returned
    /// only once its writes were acknowledged) and needs nothing more from this rank, so its
    /// failure in a later call (say, losing a third rank that exited right after this
    /// collective) must not fail this rank's same call: this rank finishes it with what was
    /// delivered, and the next call reports the abort. What needs more from the aborted peer
    /// still fails at once (`peer_err`).
    pub(super) fn abort_news(&self) -> Option<Error> {
        if !self.peer_aborted {
            return None;
        }
        self.peers.iter().flatten().find_map(|p| match &p.state {
            PeerState::Aborted { error, done, .. }
                if self.coll_running.is_none_or(|c| c > *done) =>
            {
                Some(error.clone())
            }
            _ => None,
        })
    }

    fn finished_err(&self, op: &str) -> Error {
        Error::Transport {
            rank: Some(self.rank),
            peer: None,
            op: op.into(),
            what: "the verbs transport was closed or aborted".into(),
        }
    }

    /// Drains the completion queue and re-advertises consumed slots. Returns the number of
    /// completions, or the first error they carried (after processing all of them).
    pub(super) fn progress(&mut self) -> Result<usize> {
        let mut total = 0;
        let mut first: Option<Error> = None;
        loop {
            let n = match self.cq.poll(&mut self.wc) {
                Ok(n) => n,
                Err(e) => {
                    return Err(Error::Transport {
                        rank: Some(self.rank),
                        peer: None,
                        op: e.verb.into(),
                        what: e.err.to_string(),
                    })
                }
            };
            for i in 0..n {
                let wc = self.wc[i];
                if let Err(e) = self.on_completion(&wc) {
                    first.get_or_insert(e);
                }
            }
            total += n;
            if n < self.wc.len() {
                break;
            }
        }
        if !self.finished {
            for peer in 0..self.peers.len() {
                if let Err(e) = self.flush_cts(peer) {
                    first.get_or_insert(e);
                }
            }
        }
        if let Some(e) = self.abort_news() {
            first.get_or_insert(e);
        }
        match first {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }

    fn protocol_error(&mut self, peer: usize, what: String) -> Error {
        let e = Error::Transport {
            rank: Some(self.rank),
            peer: Some(peer),
            op: "verbs protocol".into(),
            what: format!("rank {peer} broke the protocol: {what}"),
        };
        self.fail_peer(peer, e)
    }

    /// Fails the connection to `peer` with `e`: every later use returns it.
    fn fail_peer(&mut self, peer: usize, e: Error) -> Error {
        if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
            p.state = PeerState::Failed(e.clone());
        }
        e
    }

    fn on_completion(&mut self, wc: &ffi::ibv_wc) -> Result<()> {
        use ffi::ibv_wc_status as st;
        let rank = self.rank;
        let (peer, kind, idx) = split_wr_id(wc.wr_id);
        let finished = self.finished;
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        if wc.status != st::IBV_WC_SUCCESS {
            if kind != WrKind::Recv {
                p.sq.complete(idx);
            }
            // A frame that failed after the peer's goodbye never reached it: a peer leaves
            // only once it has every frame it needs, so the job's ranks disagree. Fail the
            // connection, so that the send waiting for this write reports it.
            // Likewise for a peer whose process is gone: it did not get that frame.
            if !finished && kind == WrKind::Data {
                let why = match &p.state {
                    PeerState::Closed(_) => Some("peer closed its communicator".to_string()),
                    PeerState::Gone { detail, .. } => Some(detail.clone()),
                    // It did not take that frame: nothing counts on this connection any more.
                    PeerState::Aborted { error, .. } => {
                        p.state = PeerState::Failed(error.clone());
                        return Ok(());
                    }
                    _ => None,
                };
                if let Some(why) = why {
                    let status = ib::wc_status_string(&self.lib, wc.status);
                    p.state = PeerState::Failed(Error::PeerLost {
                        rank,
                        peer,
                        op: kind.describe().into(),
                        detail: format!("{why}, and a frame to it then failed: {status}"),
                    });
                    return Ok(());
                }
            }
            // Flushes after this rank moved its QPs to ERR, and anything else from a peer
            // that already left or failed, are expected.
            if finished
                || !p.is_open()
                || wc.status == st::IBV_WC_WR_FLUSH_ERR && p.qp.state == qp::QpState::Err
            {
                return Ok(());
            }
            let status = ib::wc_status_string(&self.lib, wc.status);
            let r = &self.opts.reliability;
            let hint = match wc.status {
                st::IBV_WC_RETRY_EXC_ERR => format!(
                    ": no acknowledgement from rank {peer} within the retry budget (ACK timeout {} \
                     ≈ {:.0} ms × {} retries): its process died, its queue pair is gone or the \
                     link is down",
                    r.timeout,
                    timeout_ms(r.timeout),
                    r.retry_cnt
                ),
                st::IBV_WC_RNR_RETRY_EXC_ERR => format!(": rank {peer} had no receive posted"),
                st::IBV_WC_REM_ACCESS_ERR => {
                    format!(": rank {peer} refused the access (stale rkey?)")
                }
                _ => String::new(),
            };
            let detail = format!("{} failed: {status}{hint}", kind.describe());
            let e = match wc.status {
                st::IBV_WC_RETRY_EXC_ERR
                | st::IBV_WC_RNR_RETRY_EXC_ERR
                | st::IBV_WC_REM_ACCESS_ERR
                | st::IBV_WC_REM_OP_ERR
                | st::IBV_WC_REM_INV_REQ_ERR
                | st::IBV_WC_REM_ABORT_ERR
                | st::IBV_WC_RESP_TIMEOUT_ERR
                | st::IBV_WC_WR_FLUSH_ERR => Error::PeerLost {
                    rank,
                    peer,
                    op: "RDMA transfer".into(),
                    detail,
                },
                _ => Error::Transport {
                    rank: Some(rank),
                    peer: Some(peer),
                    op: kind.describe().into(),
                    what: detail,
                },
            };
            p.state = PeerState::Failed(e.clone());
            return Err(e);
        }
        if kind != WrKind::Recv {
            p.sq.complete(idx);
            return Ok(());
        }
        // A receive was consumed: replace it first (receives carry no buffer).
        if let Err(e) = p.qp.post_recv(wr_id(peer, WrKind::Recv, 0)) {
            return Err(p.fail_verb(rank, peer, e.verb.into(), &e));
        }
        // SAFETY: for RECV_RDMA_WITH_IMM completions the union holds the immediate.
        let raw = u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data });
        let imm = Imm::decode(raw);
        let landing_bytes = self.direct.as_ref().map_or(0, |d| d.layout.slot_bytes);
        match imm {
            Imm::Data { seq, len } | Imm::Direct { seq, len } => {
                let is_direct = matches!(imm, Imm::Direct { .. });
                let max = if is_direct {
                    HEADER_LEN + landing_bytes
                } else {
                    self.opts.slot_bytes()
                };
                let expect = (p.recv.arrived & 0xf) as u8;
                if !p.recv.may_arrive()
                    || seq != expect
                    || len as usize > max
                    || (len as usize) < HEADER_LEN
                    || (is_direct && landing_bytes == 0)
                {
                    let (a, c) = (p.recv.arrived, p.recv.cts_posted);
                    return Err(self.protocol_error(
                        peer,
                        format!("frame #{a} (seq bits {seq}, expected {expect}, {len} bytes) with {c} slots advertised"),
                    ));
                }
                let slot = (p.recv.arrived % p.recv.n) as usize;
                p.rx_len[slot] = len;
                p.rx_direct[slot] = is_direct;
                p.recv.arrived += 1;
            }
            Imm::Cts { seq } => {
                let expect = (p.send.cts_arrived & 0x3fff_ffff) as u32;
                if seq != expect {
                    return Err(self
                        .protocol_error(peer, format!("clear-to-send {seq}, expected {expect}")));
                }
                p.send.cts_arrived += 1;
            }
            Imm::Ctrl { len } => {
                let n = p.recv.n as usize;
                let sb = self.opts.slot_bytes();
                let len = (len as usize).min(CTRL_BYTES);
                if len < HEADER_LEN {
                    return Err(self.protocol_error(peer, format!("control frame of {len} bytes")));
                }
                let mut frame = vec![0u8; len];
                // SAFETY: the control slot lies inside `remote_mem` at this offset; the peer
                // wrote it once (its completion was just polled) and never writes it again.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        p.remote_mem.as_ptr().add(n * sb),
                        frame.as_mut_ptr(),
                        len,
                    );
                }
                let mut hb = [0u8; HEADER_LEN];
                hb.copy_from_slice(&frame[..HEADER_LEN]);
                let hdr = match FrameHeader::decode(&hb) {
                    Ok(h) => h,
                    Err(w) => return Err(self.protocol_error(peer, w)),
                };
                match hdr.kind {
                    FrameKind::Bye => p.state = PeerState::Closed(Instant::now()),
                    FrameKind::Abort => {
                        let end = (HEADER_LEN + hdr.len as usize).min(len);
                        let msg = String::from_utf8_lossy(&frame[HEADER_LEN..end]).into_owned();
                        let e = AbortClass::error(
                            hdr.coll,
                            rank,
                            hdr.root as usize,
                            "communicator",
                            msg,
                        );
                        // Reported by `progress` (`abort_news`), or by what needs this peer.
                        p.state = PeerState::Aborted {
                            error: e,
                            done: hdr.seq,
                            at: Instant::now(),
                        };
                        self.peer_aborted = true;
                    }
                    FrameKind::Data => {
                        return Err(
                            self.protocol_error(peer, "data frame in the control slot".into())
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes the clear-to-send entries of consumed slots to `peer`, as far as the send queue
    /// allows.
    fn flush_cts(&mut self, peer: usize) -> Result<()> {
        let rank = self.rank;
        let sb = self.opts.slot_bytes();
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        while let Some((seq, slot)) = p.recv.pending_cts() {
            if !p.is_open() || !p.sq.has_room() {
                break;
            }
            let n = p.recv.n as usize;
            let entry = Cts {
                seq,
                addr: p.remote_mem.as_ptr() as u64 + (slot * sb) as u64,
                rkey: p.remote_mr.rkey,
                size: sb as u32,
            }
            .encode();
            let src_off = n * sb + slot * CTS_LEN;
            // SAFETY: `cts_out[slot]` lies inside `local_mem`; its previous write (CTS
            // `seq − n`) completed, since the peer used it to send the frame just consumed.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    entry.as_ptr(),
                    p.local_mem.as_ptr().add(src_off),
                    CTS_LEN,
                );
            }
            let mut sge = [ffi::ibv_sge {
                addr: p.local_mem.as_ptr() as u64 + src_off as u64,
                length: CTS_LEN as u32,
                lkey: p.local_mr.lkey,
            }];
            let remote = p.theirs.cts_addr + (slot * CTS_LEN) as u64;
            let sig = p.sq.must_signal();
            let idx = p.sq.post(sig);
            let imm = Imm::Cts {
                seq: (seq & 0x3fff_ffff) as u32,
            }
            .encode();
            // SAFETY: the SGE is inside `local_mr` and stays unchanged until the peer consumes
            // this CTS; the remote range is entry `slot` of the peer's CTS ring (its rkey).
            let r = unsafe {
                p.qp.post_write_imm(
                    wr_id(peer, WrKind::Cts, idx),
                    &mut sge,
                    remote,
                    p.theirs.rkey,
                    imm,
                    sig,
                )
            };
            if let Err(e) = r {
                return Err(p.fail_verb(rank, peer, format!("{} (clear-to-send)", e.verb), &e));
            }
            p.recv.cts_posted += 1;
        }
        Ok(())
    }

    /// Frees the receive slots of `peer` that nothing holds any more (every slot before the
    /// oldest held landing slot) and re-advertises them.
    fn settle(&mut self, peer: usize, op: &str) -> Result<()> {
        let p = self.peer_mut(peer, op)?;
        let oldest = p.held.front().copied();
        p.recv.settle(oldest);
        if self.finished {
            return Ok(());
        }
        self.flush_cts(peer)
    }

    /// Whether the send-queue entry `token − 1` to `peer` (a signalled write) has completed,
    /// polling completions if it has not yet.
    ///
    /// A peer that said goodbye received every frame it needed, and acknowledged each write
    /// before it wrote the goodbye; but the acknowledgement's send completion and the
    /// goodbye's receive completion come from different parts of the provider and can be
    /// polled in either order. So a goodbye does not fail a posted write at once: its
    /// completion is awaited for [`CLOSED_GRACE`] more.
    fn retired(&mut self, peer: usize, token: u64, op: &str) -> Result<bool> {
        let polled = if self.peer_ref(peer, op)?.sq.retired >= token {
            Ok(0)
        } else {
            self.progress()
        };
        let rank = self.rank;
        let p = self.peer_ref(peer, op)?;
        // A failed connection wins even over a retired entry: a failed write retires too.
        if let PeerState::Failed(e) = &p.state {
            return Err(e.clone());
        }
        if p.sq.retired >= token {
            return Ok(true);
        }
        let late = match &p.state {
            // A peer that aborted after taking this write acknowledged it before: as after a
            // goodbye, its completion may still be on the way.
            PeerState::Aborted { error, at, .. } if at.elapsed() >= CLOSED_GRACE => {
                return Err(error.clone());
            }
            PeerState::Closed(at) if at.elapsed() >= CLOSED_GRACE => {
                Some(("peer closed its communicator", at))
            }
            PeerState::Gone { at, detail } if at.elapsed() >= GONE_GRACE => {
                Some((detail.as_str(), at))
            }
            _ => None,
        };
        if let Some((why, at)) = late {
            return Err(Error::PeerLost {
                rank,
                peer,
                op: op.into(),
                detail: format!(
                    "{why}, and our write to it was still unacknowledged {:.1} s later",
                    at.elapsed().as_secs_f64()
                ),
            });
        }
        polled.map(|_| false)
    }

    /// Claims the next clear-to-send credit to `peer` for a frame that puts `need` bytes into
    /// the peer's receive slot and takes `wrs` send-queue entries: stages `hdr` in the staging
    /// slot of that credit and says where the frame goes. `None` while there is no credit or
    /// no room in the send queue.
    fn claim(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        need: usize,
        wrs: u64,
        op: &str,
    ) -> Result<Option<Claim>> {
        let sb = self.opts.slot_bytes();
        {
            let p = self.peer_ref(peer, op)?;
            if p.send.next_credit().is_none() || !p.sq.has_room_for(wrs) {
                // Completions may have brought a clear-to-send or retired the queue.
                self.progress()?;
            }
        }
        if let Some(e) = self.peer_err(peer, op) {
            return Err(e);
        }
        let p = self.peer_mut(peer, op)?;
        let Some(seq) = p.send.next_credit() else {
            return Ok(None);
        };
        if !p.sq.has_room_for(wrs) {
            return Ok(None);
        }
        let slot = p.send.index(seq);
        let (raddr, rkey) = if p.send.cts_written_by_peer(seq) {
            let n = p.send.n as usize;
            // The ring lives in `remote_mem` after the receive slots and the control slot.
            let ring = n * sb + CTRL_BYTES + slot * CTS_LEN;
            // SAFETY: the ring entry lies inside `remote_mem`; its completion was polled, so
            // the peer's write is complete, and the peer does not rewrite it before this
            // frame is consumed. A volatile read keeps the compiler from caching it.
            let e: [u8; CTS_LEN] = unsafe {
                std::ptr::read_volatile(p.remote_mem.as_ptr().add(ring) as *const [u8; CTS_LEN])
            };
            fence(Ordering::Acquire);
            match Cts::decode(&e) {
                Some(c) if c.seq == seq && c.size as usize >= need => (c.addr, c.rkey),
                other => {
                    let w = format!("clear-to-send entry {seq} reads {other:?}");
                    return Err(self.protocol_error(peer, w));
                }
            }
        } else {
            (
                p.theirs.rx_addr + (slot * p.their_slot_bytes) as u64,
                p.theirs.rkey,
            )
        };
        let staging = slot * sb;
        // SAFETY: staging slot `slot` lies inside `local_mem` and is free: CTS `seq` proves
        // that the frame previously staged there (seq − n) landed.
        unsafe {
            std::ptr::copy_nonoverlapping(
                hdr.encode().as_ptr(),
                p.local_mem.as_ptr().add(staging),
                HEADER_LEN,
            );
        }
        Ok(Some(Claim {
            seq,
            slot,
            raddr,
            rkey,
            header_addr: p.local_mem.as_ptr() as u64 + staging as u64,
        }))
    }

    /// The next arrived frame from `peer`, not yet taken: (slot, length, direct?, header).
    fn next_header(
        &mut self,
        peer: usize,
        op: &str,
    ) -> Result<Option<(usize, usize, bool, FrameHeader)>> {
        if self.finished {
            return Err(self.finished_err(op));
        }
        let polled = self.progress();
        if let Some(p) = self.peers.get(peer).and_then(Option::as_ref) {
            if let PeerState::Failed(e) = &p.state {
                return Err(e.clone());
            }
        }
        polled?;
        let sb = self.opts.slot_bytes();
        let rank = self.rank;
        let p = self.peer_mut(peer, op)?;
        let Some(slot) = p.recv.next_frame() else {
            // Nothing more will come from a peer that left. Frames from a peer whose process
            // is gone may still be polled for a moment after its liveness connection closed.
            if let PeerState::Gone { at, detail } = &p.state {
                if at.elapsed() < GONE_GRACE {
                    return Ok(None);
                }
                return Err(Error::PeerLost {
                    rank,
                    peer,
                    op: op.into(),
                    detail: format!(
                        "{detail}; every frame it delivered was taken, and nothing more came \
                         in the {:.1} s after",
                        at.elapsed().as_secs_f64()
                    ),
                });
            }
            return self.peer_err(peer, op).map_or(Ok(None), Err);
        };
        let len = p.rx_len[slot] as usize;
        let is_direct = p.rx_direct[slot];
        let mut hb = [0u8; HEADER_LEN];
        // SAFETY: the header is the first HEADER_LEN bytes of receive slot `slot` inside
        // `remote_mem`; the frame's completion was polled and the peer does not write this
        // slot again before it is re-advertised.
        unsafe {
            std::ptr::copy_nonoverlapping(
                p.remote_mem.as_ptr().add(slot * sb),
                hb.as_mut_ptr(),
                HEADER_LEN,
            );
        }
        match FrameHeader::decode(&hb) {
            Ok(h) if h.kind == FrameKind::Data && HEADER_LEN + h.len as usize == len => {
                Ok(Some((slot, len, is_direct, h)))
            }
            Ok(h) => {
                let w = format!(
                    "a {len}-byte write carries a {:?} frame header of length {}",
                    h.kind, h.len
                );
                Err(self.protocol_error(peer, w))
            }
            Err(w) => Err(self.protocol_error(peer, w)),
        }
    }
}

impl Transport for VerbsTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }

    fn connected_peers(&self) -> Option<usize> {
        self.lazy_enabled().then(|| self.connected())
    }

    fn send(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        data: &[u8],
        progress: &mut SendProgress,
    ) -> Result<bool> {
        const OP: &str = "send";
        if self.finished {
            return Err(self.finished_err(OP));
        }
        let total = HEADER_LEN + data.len();
        if progress.token != 0 {
            // A zero-copy write is in flight: done once its signalled completion retired it.
            if !self.retired(peer, progress.token, OP)? {
                return Ok(false);
            }
            progress.written = total;
            progress.token = 0;
            return Ok(true);
        }
        if !self.link(peer, true)? {
            return Ok(false);
        }
        if let Some(e) = self.peer_err(peer, OP) {
            return Err(e);
        }
        let sb = self.opts.slot_bytes();
        {
            let p = self.peer_ref(peer, OP)?;
            if total > p.their_slot_bytes || total > sb {
                return Err(Error::Transport {
                    rank: Some(self.rank),
                    peer: Some(peer),
                    op: OP.into(),
                    what: format!(
                        "a {total}-byte frame does not fit rank {peer}'s {}-byte slots (set the \
                         same DSPARK_CHUNK_BYTES and DSPARK_IB_SLOT_BYTES on every rank)",
                        p.their_slot_bytes.min(sb)
                    ),
                });
            }
        }
        let zc_lkey = if data.len() >= self.opts.zero_copy_min {
            self.lookup_mr(data)
        } else {
            None
        };
        let rank = self.rank;
        let Some(c) = self.claim(peer, hdr, total, 1, OP)? else {
            return Ok(false);
        };
        let (seq, raddr, rkey, base) = (c.seq, c.raddr, c.rkey, c.header_addr);
        let staging = c.slot * sb;
        let p = self.peer_mut(peer, OP)?;
        let imm = Imm::Data {
            seq: (seq & 0xf) as u8,
            len: total as u32,
        }
        .encode();
        let (res, token) = if let Some(lkey) = zc_lkey {
            let mut sges = [
                ffi::ibv_sge {
                    addr: base,
                    length: HEADER_LEN as u32,
                    lkey: p.local_mr.lkey,
                },
                ffi::ibv_sge {
                    addr: data.as_ptr() as u64,
                    length: data.len() as u32,
                    lkey,
                },
            ];
            let idx = p.sq.post(true);
            // SAFETY: the header is in `local_mr`; the payload lies inside a caller
            // registration (looked up above) and the engine keeps it unchanged until this
            // send returns true, which waits for the completion; the remote range is the
            // slot the peer advertised.
            let r = unsafe {
                p.qp.post_write_imm(
                    wr_id(peer, WrKind::Data, idx),
                    &mut sges,
                    raddr,
                    rkey,
                    imm,
                    true,
                )
            };
            (r, idx + 1)
        } else {
            // SAFETY: the staging slot holds `sb ≥ total` bytes inside `local_mem`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr(),
                    p.local_mem.as_ptr().add(staging + HEADER_LEN),
                    data.len(),
                );
            }
            let mut sge = [ffi::ibv_sge {
                addr: base,
                length: total as u32,
                lkey: p.local_mr.lkey,
            }];
            let sig = p.sq.must_signal();
            let idx = p.sq.post(sig);
            // SAFETY: the SGE is the staging slot inside `local_mr`, untouched until CTS
            // `seq + n` proves the write landed; the remote range is the advertised slot.
            let r = unsafe {
                p.qp.post_write_imm(
                    wr_id(peer, WrKind::Data, idx),
                    &mut sge,
                    raddr,
                    rkey,
                    imm,
                    sig,
                )
            };
            (r, 0)
        };
        if let Err(e) = res {
            return Err(p.fail_verb(rank, peer, format!("{} (frame)", e.verb), &e));
        }
        p.send.sent += 1;
        if zc_lkey.is_some() {
            self.zero_copy_frames += 1;
        }
        if token == 0 {
            progress.written = total;
            return Ok(true);
        }
        progress.token = token;
        Ok(false)
    }

    fn recv(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool> {
        const OP: &str = "receive";
        if !self.link(peer, false)? {
            return Ok(false);
        }
        let Some((slot, len, is_direct, hdr)) = self.next_header(peer, OP)? else {
            return Ok(false);
        };
        let expected = sink.on_header(&hdr)?;
        // Classified by the frame, as `mem` does: a payload in a landing slot is a device
        // collective's, whatever this rank expected.
        if is_direct {
            return Err(direct_mismatch(self.rank, peer, true));
        }
        if expected != hdr.len as usize {
            let e = frame_len_mismatch(self.rank, peer, hdr.len as usize, expected);
            return Err(self.fail_peer(peer, e));
        }
        let sb = self.opts.slot_bytes();
        let p = self.peer_mut(peer, OP)?;
        // SAFETY: slot `slot` lies inside `remote_mem` and holds a `len`-byte frame (checked
        // against the slot size on arrival); its completion was polled and the peer writes
        // this slot again only after it is re-advertised below, after the last use of this
        // slice.
        let frame: &[u8] =
            unsafe { std::slice::from_raw_parts(p.remote_mem.as_ptr().add(slot * sb), len) };
        let payload = &frame[HEADER_LEN..HEADER_LEN + expected];
        if let Some(dst) = sink.direct() {
            let got = progress.got;
            let end = got + expected;
            if end > dst.len() {
                return Err(self.protocol_error(
                    peer,
                    format!("frame overruns the destination ({end} > {})", dst.len()),
                ));
            }
            dst[got..end].copy_from_slice(payload);
        } else if !payload.is_empty() {
            sink.consume(payload)?;
        }
        progress.header = None;
        progress.expected = expected;
        progress.got += expected;
        self.peer_mut(peer, OP)?.recv.taken += 1;
        self.settle(peer, OP)?;
        Ok(true)
    }

    fn peek(&mut self, peer: usize) -> Result<Option<FrameHeader>> {
        if !self.link(peer, false)? {
            return Ok(None);
        }
        Ok(self.next_header(peer, "receive")?.map(|(_, _, _, h)| h))
    }

    fn wait(&mut self, _interest: &[Interest], deadline: Instant) -> Result<()> {
        self.wait_events(deadline)
    }

    fn check_peers(&mut self) -> Result<()> {
        self.check_liveness()
    }

    fn abort(&mut self, origin: usize, class: AbortClass, reason: &str) {
        self.abort_connections(origin, class, reason);
    }

    fn close(&mut self) {
        self.close_connections();
    }

    fn collective_progress(&mut self, running: Option<u64>, completed: u64) {
        self.coll_running = running;
        self.coll_done = completed;
    }

    fn flush(&mut self, deadline: Instant) -> Result<()> {
        self.flush_writes(deadline)
    }

    fn direct(&self) -> Option<&dyn DirectTransport> {
        Some(self)
    }

    fn direct_mut(&mut self) -> Option<&mut dyn DirectTransport> {
        Some(self)
    }

    fn registration(&self) -> Option<&dyn Registering> {
        Some(self)
    }

    fn registration_mut(&mut self) -> Option<&mut dyn Registering> {
        Some(self)
    }
}

/// The GPUDirect region: payloads RDMA-written from this rank's registered region into the
/// peer's landing slots (the region is optional: without one, `direct_layout` is `None`).
impl DirectTransport for VerbsTransport {
    fn direct_layout(&self) -> Option<DirectLayout> {
        self.direct.as_ref().map(|d| d.layout)
    }

    fn direct_base(&self) -> Option<u64> {
        self.direct.as_ref().map(|d| d.mr.addr)
    }

    fn direct_host_region(&self) -> Option<Arc<dyn RegionAccess>> {
        let h = self.direct.as_ref()?.host.as_ref()?;
        Some(Arc::clone(h) as Arc<dyn RegionAccess>)
    }

    fn direct_peer(&self, peer: usize) -> bool {
        if self.direct.is_none() {
            return false;
        }
        match self.peers.get(peer).and_then(Option::as_ref) {
            Some(p) => p.their_landing.is_some(),
            // Not connected yet: it will be on first use, with the region exchanged at init.
            None => {
                self.lazy_enabled()
                    && peer < self.world
                    && peer != self.rank
                    && self.landing_of(peer).is_some()
            }
        }
    }

    fn send_direct(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        offset: usize,
        progress: &mut SendProgress,
    ) -> Result<bool> {
        const OP: &str = "send (direct)";
        if self.finished {
            return Err(self.finished_err(OP));
        }
        if !self.link(peer, true)? {
            return Ok(false);
        }
        if let Some(e) = self.peer_err(peer, OP) {
            return Err(e);
        }
        let rank = self.rank;
        let len = hdr.len as usize;
        let Some((base, lkey, layout)) = self
            .direct
            .as_ref()
            .map(|d| (d.mr.addr, d.mr.lkey, d.layout))
        else {
            return Err(Error::invalid(
                Some(rank),
                OP,
                "no direct region at this rank",
            ));
        };
        let Some((landing, lrkey, their_sb)) = self.peer_ref(peer, OP)?.their_landing else {
            return Err(Error::invalid(
                Some(rank),
                OP,
                format!("rank {peer} has no direct region"),
            ));
        };
        if len == 0 || len > their_sb || offset.checked_add(len).is_none_or(|e| e > layout.len()) {
            return Err(Error::invalid(
                Some(rank),
                OP,
                format!(
                    "a {len}-byte payload at offset {offset} does not fit (rank {peer}'s landing \
                     slots hold {their_sb} bytes; this rank's region is {} bytes)",
                    layout.len()
                ),
            ));
        }
        let Some(c) = self.claim(peer, hdr, HEADER_LEN, 2, OP)? else {
            return Ok(false);
        };
        let (seq, slot, raddr, rkey) = (c.seq, c.slot, c.raddr, c.rkey);
        let p = self.peer_mut(peer, OP)?;
        let mut payload = [ffi::ibv_sge {
            addr: base + offset as u64,
            length: len as u32,
            lkey,
        }];
        let idx = p.sq.post(false);
        // SAFETY: the payload lies inside this rank's registered direct region (checked
        // above) and the engine leaves it unchanged until `direct_send_done` says the
        // signalled write below — which follows this one on the same queue — completed; the
        // remote range is landing slot `slot` for this rank in the peer's region (frame
        // `seq − n`, the previous user of that slot, was released: CTS `seq` proves it).
        let r = unsafe {
            p.qp.post_write(
                wr_id(peer, WrKind::Data, idx),
                &mut payload,
                landing + (slot * their_sb) as u64,
                lrkey,
                false,
            )
        };
        if let Err(e) = r {
            return Err(p.fail_verb(rank, peer, format!("{} (direct payload)", e.verb), &e));
        }
        let mut head = [ffi::ibv_sge {
            addr: c.header_addr,
            length: HEADER_LEN as u32,
            lkey: p.local_mr.lkey,
        }];
        let idx = p.sq.post(true);
        let imm = Imm::Direct {
            seq: (seq & 0xf) as u8,
            len: (HEADER_LEN + len) as u32,
        }
        .encode();
        // SAFETY: the header is in the staging slot inside `local_mr`, untouched until CTS
        // `seq + n`; the remote range is the advertised receive slot.
        let r = unsafe {
            p.qp.post_write_imm(
                wr_id(peer, WrKind::Data, idx),
                &mut head,
                raddr,
                rkey,
                imm,
                true,
            )
        };
        if let Err(e) = r {
            return Err(p.fail_verb(rank, peer, format!("{} (direct frame)", e.verb), &e));
        }
        p.send.sent += 1;
        progress.written = HEADER_LEN + len;
        progress.token = idx + 1;
        Ok(true)
    }

    fn direct_send_done(&mut self, peer: usize, token: u64) -> Result<bool> {
        self.retired(peer, token, "send (direct)")
    }

    fn recv_direct(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<Option<Landed>> {
        const OP: &str = "receive (direct)";
        if !self.link(peer, false)? {
            return Ok(None);
        }
        let Some((slot, _len, is_direct, hdr)) = self.next_header(peer, OP)? else {
            return Ok(None);
        };
        let expected = sink.on_header(&hdr)?;
        if !is_direct && hdr.len > 0 {
            return Err(direct_mismatch(self.rank, peer, false));
        }
        if expected != hdr.len as usize {
            let e = frame_len_mismatch(self.rank, peer, hdr.len as usize, expected);
            return Err(self.fail_peer(peer, e));
        }
        let layout = self.direct.as_ref().map(|d| d.layout);
        let p = self.peer_mut(peer, OP)?;
        let frame = p.recv.taken;
        p.recv.taken += 1;
        let landed = match layout {
            Some(l) if is_direct => {
                p.held.push_back(frame);
                Landed {
                    offset: l.landing(peer, slot),
                    len: expected,
                }
            }
            _ => Landed { offset: 0, len: 0 },
        };
        progress.header = None;
        progress.expected = expected;
        progress.got = expected;
        self.settle(peer, OP)?;
        Ok(Some(landed))
    }

    fn release_direct(&mut self, peer: usize) -> Result<()> {
        const OP: &str = "release (direct)";
        let rank = self.rank;
        let p = self.peer_mut(peer, OP)?;
        if p.held.pop_front().is_none() {
            return Err(Error::invalid(
                Some(rank),
                OP,
                format!("no landing slot from rank {peer} is held"),
            ));
        }
        self.settle(peer, OP)
    }
}

/// Zero-copy sends from caller buffers registered with the NIC.
impl Registering for VerbsTransport {
    fn register_host(&mut self, region: &[u8]) -> Result<Option<u64>> {
        if region.is_empty() {
            return Ok(None);
        }
        // SAFETY: registration only pins and maps the pages for the NIC's reads; the contract
        // that the caller deregisters before freeing the buffer is documented on the trait.
        let id =
            unsafe { self.register_raw(MemoryKind::Host, region.as_ptr() as u64, region.len())? };
        Ok(Some(id))
    }

    fn deregister(&mut self, id: u64) {
        self.user_mrs.retain(|m| m.id != id);
    }

    fn zero_copy_frames(&self) -> u64 {
        self.zero_copy_frames
    }
}
