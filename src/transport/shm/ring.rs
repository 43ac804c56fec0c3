//! The ring protocol (see "Rings" in the module docs of [`super`]): a sender writes frames
//! (the 32-byte header and the payload; the padding to the next line is taken as space by
//! the frame after) into the ring it owns in the
//! peer's segment and publishes them with `head`; the receiver finds each frame's header,
//! skips wrap markers, hands the payload to the engine's sink straight out of its own
//! segment and publishes its progress with `tail`. These are the bodies of
//! [`Transport::send`] and [`Transport::recv`]; the liveness connection and the commit of a
//! pair's rings on first use, which both wait for or start, live in [`super::lazy`].
//!
//! [`Transport::send`]: crate::transport::Transport::send
//! [`Transport::recv`]: crate::transport::Transport::recv

use std::sync::atomic::{AtomicU64, Ordering};

use super::seg::LINE;
use super::sizing::pad;
use super::{
    corrupt, out_of_bounds, Peer, PeerState, ShmTransport, OFF_STATUS, RING_DATA, RING_HEAD,
    RING_TAIL, STATUS_OPEN,
};
use crate::error::{Error, Result};
use crate::transport::{
    frame_len_mismatch, FrameHeader, FrameKind, RecvProgress, RecvSink, SendProgress, FRAME_MAGIC,
    HEADER_LEN,
};

/// A large frame's bytes are published at least every this many bytes.
const PUBLISH_STEP: usize = 64 * 1024;
/// Small frames stay in the first this many bytes of a ring: a sender at a frame boundary
/// past it starts again at the ring's beginning (after a wrap marker) when the frame fits
/// there, so that a stream of small messages reuses a few cache-hot lines instead of
/// walking the whole ring through memory.
const HOT_WINDOW: usize = 16 * 1024;
/// First byte of a wrap marker: "the next frame starts at the beginning of the ring".
const WRAP_KIND: u8 = 0x57;

/// Whether the header-sized bytes `b` at a frame's place in a ring are a wrap marker: the
/// frame is at the start of the ring instead.
pub(super) fn is_wrap_marker(b: &[u8; HEADER_LEN]) -> bool {
    b[0] == WRAP_KIND && b[12..16] == FRAME_MAGIC.to_le_bytes()
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

    /// Before a frame of `padded` bytes (none of it written yet) that fits in the ring's hot
    /// window ([`HOT_WINDOW`]) while the send position is past it: writes a wrap marker and
    /// moves the send position to the start of the ring, when the frame fits there.
    fn wrap_to_hot_window(
        &mut self,
        ring: u64,
        padded: usize,
        rank: usize,
        peer: usize,
    ) -> Result<()> {
        let tail_word = self.seg.u64_at(self.tx_base + RING_TAIL);
        let data_off = self.tx_base + RING_DATA;
        let hot = HOT_WINDOW as u64;
        let pos = self.tx_head % ring;
        if ring >= 4 * hot && pos >= hot && padded as u64 <= hot {
            // Back to the start of the ring when this frame fits there before the oldest
            // byte the receiver has not taken (`head − tail + frame ≤ pos`; frames start on a
            // line, so the marker fits before the end). The cached tail is older than the
            // real one, so it only errs on the safe side; it is re-read only when it says no.
            let fits = |tail: u64| self.tx_head - tail + padded as u64 <= pos;
            if !fits(self.tx_tail) {
                self.tx_tail = tail_word.load(Ordering::Acquire);
                if self.tx_tail > self.tx_head || self.tx_head - self.tx_tail > ring {
                    return Err(corrupt(
                        rank,
                        peer,
                        "send tail..head",
                        self.tx_tail,
                        self.tx_head,
                    ));
                }
            }
            if fits(self.tx_tail) {
                let mut mark = FrameHeader::bye().encode();
                mark[0] = WRAP_KIND;
                self.seg
                    .write(data_off + pos as usize, &mark)
                    .map_err(out_of_bounds(rank, peer))?;
                self.tx_head += ring - pos;
            }
        }
        Ok(())
    }
}

impl ShmTransport {
    /// Whether `peer`'s receive ring holds bytes not yet taken (never for a ring this rank has
    /// not used yet: its pages are not touched before).
    pub(super) fn rx_pending(&self, p: &Peer) -> bool {
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

    /// [`Transport::send`](crate::transport::Transport::send): writes as much of the frame
    /// (`hdr` and `data`, from `progress.written` on) as the ring to `peer` has room for.
    pub(super) fn send_frame(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        data: &[u8],
        progress: &mut SendProgress,
    ) -> Result<bool> {
        const OP: &str = "send";
        if !self.open_send(peer)? {
            return Ok(false);
        }
        let rank = self.rank;
        let ring = self.ring as u64;
        let total = HEADER_LEN + data.len();
        let padded = pad(total as u64) as usize;
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Err(Error::invalid(
                Some(self.rank),
                OP,
                format!("no connection to rank {peer}"),
            ));
        };
        let step = PUBLISH_STEP.min(self.ring / 4) as u64;
        let mut w = progress.written;
        let mut last_pub = p.tx_head;
        if w == 0 {
            // The padding of the frame before, to the line this one starts on: space,
            // nothing written, taken only now. A frame is complete at its last byte, so a
            // receiver that took it whole (and may have closed since) is never waited for.
            let gap = pad(p.tx_head) - p.tx_head;
            if gap > 0 {
                if ring - (p.tx_head - p.tx_tail) < gap {
                    p.tx_tail = p.seg.u64_at(p.tx_base + RING_TAIL).load(Ordering::Acquire);
                    if p.tx_tail > p.tx_head || p.tx_head - p.tx_tail > ring {
                        return Err(corrupt(rank, peer, "send tail..head", p.tx_tail, p.tx_head));
                    }
                    if ring - (p.tx_head - p.tx_tail) < gap {
                        return Ok(false);
                    }
                }
                p.tx_head += gap;
                last_pub = p.tx_head;
            }
            p.wrap_to_hot_window(ring, padded, rank, peer)?;
        }
        let tail_word = p.seg.u64_at(p.tx_base + RING_TAIL);
        let head_word = p.seg.u64_at(p.tx_base + RING_HEAD);
        let data_off = p.tx_base + RING_DATA;
        while w < total {
            let mut free = ring - (p.tx_head - p.tx_tail);
            let need = if w == 0 { LINE as u64 } else { 1 };
            if free < need.max((total - w).min(LINE) as u64) {
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
            } else {
                let n = (total - w)
                    .min(free as usize)
                    .min(contiguous)
                    .min(step as usize);
                let from = w - HEADER_LEN;
                p.seg
                    .write(data_off + pos, &data[from..from + n])
                    .map_err(out_of_bounds(rank, peer))?;
                n
            };
            w += n;
            p.tx_head += n as u64;
            if p.tx_head - last_pub >= step {
                head_word.store(p.tx_head, Ordering::Release);
                Self::notify(&p.seg, self.light_fence);
                last_pub = p.tx_head;
            }
        }
        if p.tx_head != last_pub {
            head_word.store(p.tx_head, Ordering::Release);
            Self::notify(&p.seg, self.light_fence);
        }
        if w == total {
            // Its padding to the next line is taken by the next frame.
            w = padded;
        }
        progress.written = w;
        p.tx_in_frame = w > 0 && w < padded;
        Ok(w == padded)
    }

    /// Whether frames may be written to `peer` now: its loss, goodbye or abort is the error;
    /// `false` while its liveness connection is in the making; the pair's rings are committed
    /// on first use.
    fn open_send(&mut self, peer: usize) -> Result<bool> {
        const OP: &str = "send";
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
        Ok(true)
    }

    /// [`Transport::recv`](crate::transport::Transport::recv): takes the next frame from
    /// `peer`'s ring into `sink`, as far as the ring holds it: its header (once), then its
    /// payload.
    pub(super) fn recv_frame(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool> {
        let (rx_base, state_open) = self.open_receive(peer)?;
        if progress.header.is_none() && !self.take_header(peer, rx_base, progress, sink)? {
            return Ok(false);
        }
        self.take_payload(peer, rx_base, state_open, progress, sink)
    }

    /// Readies `peer`'s receive ring: starts its liveness connection on first use (a failure
    /// to make it marks the peer gone: what it wrote before is still taken) and commits the
    /// pair's rings. Returns the ring's base and whether the peer was open before.
    fn open_receive(&mut self, peer: usize) -> Result<(usize, bool)> {
        const OP: &str = "receive";
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
            self.start_link(peer, OP)?;
        }
        if !committed {
            self.commit(peer)?;
        }
        Ok((rx_base, state_open))
    }

    /// Starts `peer`'s liveness connection on first use, as a receive does: a failure to make
    /// it marks the peer gone (what it wrote before is still taken, then its loss shows).
    pub(super) fn start_link(&mut self, peer: usize, op: &str) -> Result<()> {
        if let Err(e) = self.link(peer, false, op) {
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
        Ok(())
    }

    /// The header of the next frame from `peer`, left in its ring (for a receive from any
    /// source, which looks before it commits to a peer); `None` while there is none yet.
    pub(super) fn peek_frame(&mut self, peer: usize) -> Result<Option<FrameHeader>> {
        let (rx_base, _) = self.open_receive(peer)?;
        Ok(self.head_frame(peer, rx_base)?.map(|(h, _)| h))
    }

    /// The next frame's header in `peer`'s ring (at `rx_base`) and where it starts, checked
    /// but not taken; `None` while there is none yet.
    fn head_frame(&mut self, peer: usize, rx_base: usize) -> Result<Option<(FrameHeader, u64)>> {
        let rank = self.rank;
        let Some((b, start)) = self.next_header(peer, rx_base)? else {
            return Ok(None);
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
        Ok(Some((hdr, start)))
    }

    /// Takes the header of the next frame in `peer`'s ring (at `rx_base`), checks it and
    /// announces it to `sink`; `false` while there is none yet.
    fn take_header(
        &mut self,
        peer: usize,
        rx_base: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool> {
        let rank = self.rank;
        let Some((hdr, start)) = self.head_frame(peer, rx_base)? else {
            // A peer that runs this collective one-shot, or ran an earlier one one-shot
            // where this rank did not, shows in its slot: the sink names both calls.
            if let Some((seq, h)) = self
                .coll_running
                .and_then(|seq| Some((seq, self.slot_header_at(peer, seq)?)))
            {
                sink.on_header(&h)?;
                let what = if h.seq == seq {
                    format!(
                        "rank {peer} runs collective #{} ({}) one-shot through shared \
                         memory where rank {rank} sends frames (another collective, count or \
                         algorithm: DSPARK_ALGO differs between the ranks?)",
                        h.seq,
                        crate::transport::count_text(h.count)
                    )
                } else {
                    format!(
                        "rank {peer} runs collective #{} ({}) one-shot through shared \
                         memory, which rank {rank} called with no elements or ran as frames; \
                         rank {rank} is at #{seq}",
                        h.seq,
                        crate::transport::count_text(h.count)
                    )
                };
                return Err(Error::Mismatch {
                    rank: Some(rank),
                    peer: Some(peer),
                    op: "receive".into(),
                    what,
                });
            }
            return Ok(false);
        };
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
        Ok(true)
    }

    /// The bytes of the next frame header in `peer`'s ring and where it starts, past any wrap
    /// marker; `None` while the ring holds none. An empty ring is where the peer's goodbye,
    /// abort or death surfaces, as the error.
    fn next_header(
        &mut self,
        peer: usize,
        rx_base: usize,
    ) -> Result<Option<([u8; HEADER_LEN], u64)>> {
        const OP: &str = "receive";
        let ring = self.ring as u64;
        let rank = self.rank;
        let head_word = self.own.u64_at(rx_base + RING_HEAD);
        let data_off = rx_base + RING_DATA;
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(None);
        };
        // The next frame starts on the line after the last one (or at the start of the
        // ring, after a wrap marker).
        loop {
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
                return Ok(None);
            }
            let mut b = [0u8; HEADER_LEN];
            self.own
                .read(data_off + (start % ring) as usize, &mut b)
                .map_err(out_of_bounds(rank, peer))?;
            if is_wrap_marker(&b) {
                p.rx_tail = start + (ring - start % ring);
                continue;
            }
            return Ok(Some((b, start)));
        }
    }

    /// Hands the payload of the frame in progress to `sink` as far as `peer`'s ring holds it,
    /// publishing the ring's `tail` as it goes; `true` once the whole frame is taken. A peer
    /// that was gone already (`state_open` false) and left the frame unfinished is the error.
    fn take_payload(
        &mut self,
        peer: usize,
        rx_base: usize,
        state_open: bool,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool> {
        const OP: &str = "receive";
        let ring = self.ring as u64;
        let rank = self.rank;
        let head_word = self.own.u64_at(rx_base + RING_HEAD);
        let tail_word = self.own.u64_at(rx_base + RING_TAIL);
        let data_off = rx_base + RING_DATA;
        let g = sink.granule().max(1);
        loop {
            let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
                return Ok(false);
            };
            let want = progress.expected - progress.got;
            if want == 0 {
                tail_word.store(p.rx_tail, Ordering::Release);
                Self::notify(&p.seg, self.light_fence);
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
                Self::notify(&p.seg, self.light_fence);
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
                Self::notify(&p.seg, self.light_fence);
            }
        }
    }
}
