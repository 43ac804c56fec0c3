//! The fuzz target over what a peer writes into shared memory (`testing` feature only; run
//! as `shm_ring` by `tests/fuzz.rs`): the header words of its segment, checked when it is
//! mapped; the ring counters and frames it writes into this rank's segment; its `status`
//! words and abort message; the `tail` it publishes of the ring this rank sends into. Lives
//! here because it writes those words where the transport keeps them.
//!
//! An input is a control byte, a length byte and patches of 11 bytes each: a selector, a
//! 16-bit offset and a 64-bit value, written (or XORed) at that offset of one region. Two
//! real ranks (segments, mappings, transports) are made per input; rank 1 sends a few valid
//! frames to rank 0, then the patches land, then rank 0 receives, checks its peers and sends.

use std::sync::atomic::Ordering;

use super::seg::Seg;
use super::sizing::seg_len;
use super::{
    prepare, ShmOptions, ShmTransport, MAGIC, OFF_MAGIC, OFF_NONCE, OFF_RANK, OFF_STATUS,
    OFF_VERSION, OFF_WORLD, RINGS, RING_DATA, RING_TAIL, VERSION,
};
use crate::error::{Error, Result};
use crate::internals::fuzzing::Rng;
use crate::transport::{FrameHeader, FrameKind, RecvProgress, RecvSink, SendProgress, Transport};

/// Ring bytes of the target's ranks (the smallest ring: wraps come soon).
const RING: usize = 4096;
/// Bytes of one patch.
const PATCH: usize = 11;
/// The longest payload the receiver accepts.
const FRAME_CAP: usize = 16 << 10;

/// A receiver that records every frame.
struct Frames {
    header: Option<FrameHeader>,
    buf: Vec<u8>,
}

impl RecvSink for Frames {
    fn on_header(&mut self, hdr: &FrameHeader) -> Result<usize> {
        if hdr.len as usize > FRAME_CAP {
            return Err(Error::invalid(None, "fuzz receive", "unexpected length"));
        }
        self.header = Some(*hdr);
        self.buf.clear();
        Ok(hdr.len as usize)
    }
    fn direct(&mut self) -> Option<&mut [u8]> {
        None
    }
    fn granule(&self) -> usize {
        1
    }
    fn consume(&mut self, bytes: &[u8]) -> Result<()> {
        self.buf.extend_from_slice(bytes);
        Ok(())
    }
}

/// Writes (or XORs, `xor`) `v`'s little-endian bytes at `off` of `seg`, as far as they fit
/// before `end`.
fn patch(seg: &Seg, off: usize, end: usize, v: u64, xor: bool) {
    let n = end.saturating_sub(off).min(8);
    let mut b = [0u8; 8];
    if seg.read(off, &mut b[..n]).is_err() {
        return;
    }
    for (x, y) in b.iter_mut().zip(v.to_le_bytes()) {
        *x = if xor { *x ^ y } else { y };
    }
    let _ = seg.write(off, &b[..n]);
}

/// The patches of an input: (selector, offset, value).
fn patches(b: &[u8]) -> impl Iterator<Item = (u8, usize, u64)> + '_ {
    b.chunks_exact(PATCH).map(|p| {
        let mut v = [0u8; 8];
        v.copy_from_slice(&p[3..]);
        (
            p[0],
            usize::from(u16::from_le_bytes([p[1], p[2]])),
            u64::from_le_bytes(v),
        )
    })
}

/// The frames rank 1 sends first: `n` of them, the `i`-th with `(unit × (i + 1)) % 700`
/// payload bytes.
fn frames_to_send(n: usize, unit: u8) -> Vec<(FrameHeader, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let len = (usize::from(unit) * (i + 1)) % 700;
            let h = FrameHeader {
                kind: FrameKind::Data,
                coll: 1,
                dtype: 0,
                op: 0,
                root: 0,
                len: len as u32,
                seq: i as u64 + 1,
                count: len as u64,
            };
            (h, (0..len).map(|j| (j * 7 + i) as u8).collect())
        })
        .collect()
}

/// The target (see the module docs). Checks: no panic, no access outside a segment (every
/// copy is bounds-checked, every word's offset asserted); a segment is mapped exactly when its
/// header and announced size are those of the peer's; every call returns; a receive takes no
/// more frames than the ring can hold; without patches, rank 0 receives exactly what rank 1
/// sent.
pub fn shm_ring(data: &[u8]) {
    let ctrl = data.first().copied().unwrap_or(0);
    let unit = data.get(1).copied().unwrap_or(0);
    let rest = data.get(2..).unwrap_or(&[]);
    let opts = ShmOptions {
        ring_bytes: RING,
        ..ShmOptions::default()
    };
    let partners = |r: usize| vec![1 - r];
    let (Ok(p0), Ok(p1)) = (
        prepare(0, 2, &partners, opts),
        prepare(1, 2, &partners, opts),
    ) else {
        // Shared memory cannot be had here (no memfd): nothing to fuzz.
        return;
    };
    let mut info1 = p1.info();
    // The header of rank 1's segment and what it announces, as a confused or hostile peer
    // might have them, before rank 0 maps it.
    for (sel, off, v) in patches(rest) {
        match sel & 7 {
            3 => patch(&p1.seg, off % 64, 64, v, true),
            7 => match off % 3 {
                0 => info1.len ^= v,
                1 => info1.ring ^= v,
                _ => info1.nonce ^= v,
            },
            _ => {}
        }
    }
    let h = &p1.seg;
    let fits = h.u64_at(OFF_MAGIC).load(Ordering::Relaxed) == MAGIC
        && h.u32_at(OFF_VERSION).load(Ordering::Relaxed) == VERSION
        && h.u32_at(OFF_WORLD).load(Ordering::Relaxed) == 2
        && h.u32_at(OFF_RANK).load(Ordering::Relaxed) == 1
        && h.u64_at(OFF_NONCE).load(Ordering::Relaxed) == info1.nonce
        && info1.ring == RING as u64
        && info1.len == seg_len(2, RING) as u64;
    let info0 = p0.info();
    let segs0 = p0.connect(&[info0, info1]);
    assert_eq!(
        segs0.is_ok(),
        fits,
        "mapping a peer's segment: {segs0:?}, its header and announced size fit: {fits}"
    );
    let Ok(segs0) = segs0 else {
        return;
    };
    let segs1 = p1
        .connect(&[info0, p1.info()])
        .expect("rank 1 maps rank 0's segment");
    let (mut t0, mut t1) = match (
        ShmTransport::new(p0, segs0, vec![None, None]),
        ShmTransport::new(p1, segs1, vec![None, None]),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (a, b) => panic!(
            "transports over mapped segments: {:?} {:?}",
            a.err(),
            b.err()
        ),
    };
    // Rank 1 sends valid frames, as far as the ring takes them.
    let sent = frames_to_send(usize::from(ctrl >> 1 & 7), unit);
    let mut delivered = 0;
    for (h, payload) in &sent {
        let mut sp = SendProgress::default();
        match t1.send(0, h, payload, &mut sp) {
            Ok(true) => delivered += 1,
            Ok(false) => break,
            Err(e) => panic!("a valid send failed: {e}"),
        }
    }
    let mut patched = false;
    {
        let p = t0.peers[1].as_ref().expect("rank 0's peer");
        for (sel, off, v) in patches(rest) {
            let xor = sel & 8 != 0;
            match sel & 7 {
                // This rank's ring from the peer: head, tail, data.
                0 | 1 => {
                    let end = p.rx_base + RING_DATA + RING;
                    patch(&t0.own, p.rx_base + off % (RING_DATA + RING), end, v, xor);
                }
                // The peer's status, abort class, origin, message length, last collective,
                // message.
                2 | 5 => patch(
                    &p.seg,
                    OFF_STATUS + off % (RINGS - OFF_STATUS),
                    RINGS,
                    v,
                    xor,
                ),
                // The tail the peer publishes of the ring this rank sends into.
                4 => patch(
                    &p.seg,
                    p.tx_base + RING_TAIL,
                    p.tx_base + RING_TAIL + 8,
                    v,
                    xor,
                ),
                _ => continue,
            }
            patched = true;
        }
    }
    let mut sink = Frames {
        header: None,
        buf: Vec::new(),
    };
    let mut progress = RecvProgress::default();
    let mut got = Vec::new();
    let mut ended = None;
    for _ in 0..2 * (RING / 64) + 8 {
        match t0.recv(1, &mut progress, &mut sink) {
            Ok(true) => {
                let h = sink
                    .header
                    .take()
                    .expect("a frame completed without a header");
                assert_eq!(sink.buf.len(), h.len as usize, "a frame of another length");
                got.push((h, std::mem::take(&mut sink.buf)));
            }
            Ok(false) => {
                ended = Some(Ok(()));
                break;
            }
            Err(e) => {
                ended = Some(Err(e));
                break;
            }
        }
    }
    // Frames start on their own line of the ring, whose head is at most a ring ahead: the
    // receive cannot go on finding frames.
    assert!(
        ended.is_some(),
        "{} frames received from a ring of {RING} bytes",
        got.len()
    );
    if !patched {
        assert_eq!(got, sent[..delivered], "frames other than those sent");
        assert!(matches!(ended, Some(Ok(()))), "{ended:?}");
    }
    let _ = t0.check_peers();
    // Rank 0 sends into rank 1's ring, whose tail rank 1 publishes.
    for (h, payload) in sent.iter().take(3) {
        let mut sp = SendProgress::default();
        if !matches!(t0.send(1, h, payload, &mut sp), Ok(true)) {
            break;
        }
    }
}

/// A valid input of [`shm_ring`]: some frames, and now and then a patch that a real peer
/// could make (a head published a frame later, an abort status, a tail moved back).
pub(crate) fn shm_ring_sample(r: &mut dyn Rng) -> Vec<u8> {
    let mut out = vec![r.next_u64() as u8 & !1, r.next_u64() as u8];
    for _ in 0..r.below(3) {
        let (sel, off, v): (u8, u16, u64) = match r.below(6) {
            0 => (0, 0, r.below(4 * RING) as u64),
            1 => (0, RING_TAIL as u16, r.below(4 * RING) as u64),
            2 => (2, 0, 2 | (r.below(4) as u64) << 32),
            3 => (2, 12, r.below(5000) as u64),
            4 => (4, 0, r.below(2 * RING) as u64),
            _ => (
                3 | (r.below(2) as u8) << 2,
                r.below(64) as u16,
                1 << r.below(64),
            ),
        };
        out.push(sel);
        out.extend_from_slice(&off.to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}
