//! One-shot slots ([`Slots`]): a small all_reduce without frames. Each rank writes its whole
//! input once, behind a copy of the call's frame header, into one of the two slots of its own
//! segment, and every peer reduces it straight out of there; the header's `seq` word is the
//! flag (stored last with release ordering, loaded first with acquire), so a contribution of
//! up to 32 bytes is one cache line: written once by its owner, read once by each peer. No
//! ring counters, no acknowledgements, no system call while the peers run.
//!
//! The two slots take turns, one per one-shot call (`slot_calls`): the slot of call `j` is
//! rewritten at call `j + 2`, once this rank has read every peer's contribution to `j + 1`,
//! which each peer wrote after it had read everything of call `j`. So no slot is rewritten
//! while a peer may still read it, whatever other calls run between.
//!
//! Waiting and failures are the rings': a rank that finds a contribution missing spins in the
//! engine, then sleeps on its `bell` (the writer wakes it when `sleeping` is set: not in
//! [`Slots::publish`] but in [`Slots::settle`], before the writer blocks or ends the call, so
//! that the full fence the wake-up check needs is not paid while the flag's cache line is
//! still on its way: measured, that fence stalled `publish` for a whole line transfer); a contribution that is there is taken even from a peer that said goodbye, aborted
//! after completing this collective, or died since; one that is not there fails the call with
//! the peer's abort, goodbye or loss. A peer in another call at this sequence number shows:
//! here as its slot's header or the frame waiting in its ring, and on the frame side
//! (`take_header`) as its slot's header, which the engine's check names as a mismatch.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::sizing::pad;
use super::{
    out_of_bounds, seg, PeerState, ShmTransport, OFF_BELL, OFF_SLEEPING, OFF_SLOTS, OFF_STATUS,
    RING_DATA, RING_HEAD, SLOT_STRIDE, STATUS_OPEN,
};
use crate::error::{Error, Result};
use crate::plan::Collective;
use crate::transport::{FrameHeader, FrameKind, Slots, HEADER_LEN};

/// Offset of the flag (the header's `seq`) in a slot.
const SEQ: usize = 16;
/// A cache line (slots are line-aligned).
const LINE: usize = 64;
/// Payload bytes of one slot.
pub(crate) const SLOT_CAPACITY: usize = SLOT_STRIDE - HEADER_LEN;

impl ShmTransport {
    /// Offset of slot `parity` (0 or 1).
    fn slot_at(parity: u64) -> usize {
        OFF_SLOTS + (parity % 2) as usize * SLOT_STRIDE
    }

    /// The slot of the one-shot call last published.
    fn current_slot(&self) -> usize {
        Self::slot_at(self.slot_calls.wrapping_sub(1))
    }

    /// The flag of `peer`'s slot at `base` (0 where there is no such peer).
    fn flag(&self, peer: usize, base: usize) -> u64 {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .map_or(0, |p| p.seg.u64_at(base + SEQ).load(Ordering::Acquire))
    }

    /// The header and payload of `peer`'s slot at `base`, whose flag read `flag`.
    fn read_slot(&self, peer: usize, base: usize, flag: u64) -> Result<(FrameHeader, &[u8])> {
        let rank = self.rank;
        let p = self.peer_ref(peer, "one-shot slot")?;
        let mut b = [0u8; HEADER_LEN];
        p.seg
            .read(base, &mut b)
            .map_err(out_of_bounds(rank, peer))?;
        b[SEQ..SEQ + 8].copy_from_slice(&flag.to_le_bytes());
        let hdr = FrameHeader::decode(&b).map_err(|what| Error::Transport {
            rank: Some(rank),
            peer: Some(peer),
            op: "one-shot slot".into(),
            what,
        })?;
        let n = (hdr.len as usize).min(SLOT_CAPACITY);
        // SAFETY: the peer wrote these bytes before it stored the flag (release; loaded with
        // acquire above) and rewrites this slot only two one-shot calls later, after it has
        // read this rank's next contribution, which this rank writes after the slice is gone
        // (the module docs). That rests on two facts: a call completes only with every
        // peer's flag equal to its own sequence number (the flag read here goes into the
        // header, which the engine's check compares), so a peer cannot be two calls ahead;
        // and a rank never publishes again after a failed call (the engine is poisoned).
        let data =
            unsafe { p.seg.slice(base + HEADER_LEN, n) }.map_err(out_of_bounds(rank, peer))?;
        Ok((hdr, data))
    }

    /// The header of a slot of `peer`'s (either slot) that shows a one-shot contribution
    /// this rank, running collective `seq` as frames, has no counterpart to, if any: to
    /// `seq` itself (a peer that runs it one-shot), or to an earlier collective than `seq`
    /// but a later one than this rank's last contribution (a peer that ran it one-shot where
    /// this rank called it with no elements, or as frames: every rank that completed a
    /// one-shot collective published to it, so no peer's flag between the two is there
    /// otherwise).
    pub(super) fn slot_header_at(&self, peer: usize, seq: u64) -> Option<FrameHeader> {
        (0..2).map(Self::slot_at).find_map(|base| {
            let flag = self.flag(peer, base);
            (flag == seq || (flag > self.published_seq && flag < seq))
                .then(|| self.read_slot(peer, base, flag).ok().map(|(h, _)| h))
                .flatten()
        })
    }

    /// The header of a collective's data frame with sequence number `seq` or later waiting
    /// at the front of `peer`'s ring, if any: a peer that runs collective `seq` as frames
    /// where this rank runs it one-shot, or that took `seq` as an empty call (count 0, which
    /// moves nothing) and went on to a call that sends frames. Either way it never publishes
    /// a contribution to `seq` (a peer that did published it before any later frame).
    fn ring_frame_at(&self, peer: usize, seq: u64) -> Option<FrameHeader> {
        let p = self.peers.get(peer)?.as_ref()?;
        if !p.committed || p.rx_in_frame || !self.rx_pending(p) {
            return None;
        }
        let ring = self.ring as u64;
        let read = |at: u64, b: &mut [u8; HEADER_LEN]| {
            self.own
                .read(p.rx_base + RING_DATA + (at % ring) as usize, b)
                .ok()
        };
        let mut at = pad(p.rx_tail);
        let mut b = [0u8; HEADER_LEN];
        read(at, &mut b)?;
        if super::ring::is_wrap_marker(&b) {
            // The frame is at the start of the ring, once the peer's head says it is there
            // (skipping the marker as `next_header` does: a frame behind one was not seen,
            // and a mismatch became the deadline's timeout).
            at += ring - at % ring;
            let head = self
                .own
                .u64_at(p.rx_base + RING_HEAD)
                .load(Ordering::Acquire);
            if head < at + HEADER_LEN as u64 {
                return None;
            }
            read(at, &mut b)?;
        }
        let h = FrameHeader::decode(&b).ok()?;
        let p2p = Collective::from_code(h.coll & 0x0f) == Some(Collective::SendRecv);
        (h.kind == FrameKind::Data && h.seq >= seq && !p2p).then_some(h)
    }

    /// Whether a wait for `peer`'s contribution to call `seq` should end: it is there, or
    /// something else to look at (its status, its loss, a frame of this or a later
    /// collective in its ring: a mismatch). A send/recv frame waiting there is not news: the
    /// one-shot call does not take it, and counting it kept the wait from ever sleeping.
    fn slot_news(&self, peer: usize, seq: u64) -> bool {
        let Some(p) = self.peers.get(peer).and_then(Option::as_ref) else {
            return false;
        };
        p.state != PeerState::Open
            || p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) != STATUS_OPEN
            || self.flag(peer, self.current_slot()) >= seq
            || self.ring_frame_at(peer, seq).is_some()
    }
}

impl Slots for ShmTransport {
    fn capacity(&self) -> usize {
        SLOT_CAPACITY
    }

    fn publish(&mut self, hdr: &FrameHeader, data: &[u8]) -> Result<()> {
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        if data.len() > SLOT_CAPACITY || data.len() != hdr.len as usize {
            return Err(Error::invalid(
                Some(self.rank),
                "one-shot slot",
                format!(
                    "a contribution of {} bytes (header: {}) does not fit a {SLOT_CAPACITY}-byte \
                     slot",
                    data.len(),
                    hdr.len
                ),
            ));
        }
        self.slot_calls += 1;
        self.published_seq = hdr.seq;
        let base = self.current_slot();
        let rank = self.rank;
        let b = hdr.encode();
        let oob = out_of_bounds(rank, rank);
        self.own.write(base, &b[..SEQ]).map_err(oob)?;
        let oob = out_of_bounds(rank, rank);
        self.own.write(base + SEQ + 8, &b[SEQ + 8..]).map_err(oob)?;
        self.own
            .write(base + HEADER_LEN, data)
            .map_err(out_of_bounds(rank, rank))?;
        self.own
            .u64_at(base + SEQ)
            .store(hdr.seq, Ordering::Release);
        self.slot_tail = (HEADER_LEN + data.len()).saturating_sub(1) & !(LINE - 1);
        // The peers asleep are woken by `settle`, which the engine calls before it blocks and
        // when the call ends.
        self.wake_owed = true;
        Ok(())
    }

    fn settle(&mut self) {
        if !std::mem::take(&mut self.wake_owed) {
            return;
        }
        // Dekker with `sleep_on_bell`: the flag was stored before this fence, and a sleeper set
        // `sleeping` before its own fence (and membarrier, where this one is light) and its
        // look at the flag; so either it saw the flag or this load sees it asleep.
        super::fence::publisher(self.light_fence);
        for p in self.peers.iter().flatten() {
            if p.seg.u32_at(OFF_SLEEPING).load(Ordering::Relaxed) != 0 {
                p.seg.u32_at(OFF_BELL).fetch_add(1, Ordering::Release);
                seg::futex_wake(p.seg.u32_at(OFF_BELL));
            }
        }
    }

    fn peek(&mut self, peer: usize, seq: u64) -> Result<Option<(FrameHeader, &[u8])>> {
        const OP: &str = "receive";
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        if self.peer_ref(peer, OP)?.stream.is_none() {
            self.start_link(peer, OP)?;
        }
        let base = self.current_slot();
        // A peer's goodbye, abort or death counts once its slot is seen empty after the
        // news (it stores its flag before its `status`).
        let mut flag = self.flag(peer, base);
        if self.slot_tail != 0 {
            // The contribution's last line travels with its first (the flag's), in the same
            // poll: once the flag shows, the payload is here, not one more line transfer away
            // (a 64-byte all_reduce, two lines, took 0.157 µs against 0.126 for 8 bytes).
            if let Some(p) = self.peers.get(peer).and_then(Option::as_ref) {
                p.seg.prefetch(base + self.slot_tail);
            }
        }
        if flag < seq {
            if let Some(h) = self.ring_frame_at(peer, seq) {
                // A peer that published `seq` did so before it sent any later frame (its
                // ring's head, loaded with acquire, was stored after its flag): look again.
                flag = self.flag(peer, base);
                if flag >= seq {
                    return self.read_slot(peer, base, flag).map(Some);
                }
                let what = if h.seq == seq {
                    format!(
                        "rank {peer} sent a frame of collective #{seq} ({}, {} bytes) \
                         where rank {} runs it one-shot through shared memory (another \
                         collective, count or algorithm: DSPARK_ALGO differs between the \
                         ranks?)",
                        crate::transport::count_text(h.count),
                        h.len,
                        self.rank
                    )
                } else {
                    format!(
                        "rank {peer} sent a frame of collective #{} ({}, {} bytes) \
                         without a contribution to collective #{seq}, which rank {} runs \
                         one-shot through shared memory: rank {peer} called #{seq} with no \
                         elements, or another collective",
                        h.seq,
                        crate::transport::count_text(h.count),
                        h.len,
                        self.rank
                    )
                };
                return Err(Error::Mismatch {
                    rank: Some(self.rank),
                    peer: Some(peer),
                    op: "all_reduce".into(),
                    what,
                });
            }
            let p = self.peer_ref(peer, OP)?;
            let news = p.state != PeerState::Open
                || p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) != STATUS_OPEN;
            if !news {
                return Ok(None);
            }
            flag = self.flag(peer, base);
            if flag < seq {
                if let Some(e) = self.status_error(peer, OP) {
                    return Err(e);
                }
                if let Some(e) = self.gone_error(peer, OP) {
                    return Err(e);
                }
                return Ok(None);
            }
        }
        // `flag > seq`: a later call's contribution (ranks that disagree): the header says.
        self.read_slot(peer, base, flag).map(Some)
    }

    fn wait_slots(&mut self, peers: &[usize], seq: u64, deadline: Instant) -> Result<()> {
        self.settle();
        self.sleep_on_bell(deadline, |t| peers.iter().any(|&p| t.slot_news(p, seq)))
    }
}
