//! What goes over the wire besides frames: the connection information exchanged through the
//! bootstrap, the clear-to-send (CTS) entries receivers write into senders' rings, the
//! immediate values of `RDMA_WRITE_WITH_IMM`, and work-request ids. Plain data, little-endian,
//! no FFI.

#![forbid(unsafe_code)]

/// Magic number opening a verbs connection blob ("DSVB").
pub const BLOB_MAGIC: u32 = 0x4453_5642;
/// Version of the blob layout and of the verbs protocol (3: queue pairs listed by peer, only
/// for the peers connected at init; the others exchange theirs on first use).
pub const BLOB_VERSION: u8 = 3;

/// Size of one CTS entry in the sender's ring.
pub const CTS_LEN: usize = 32;

/// Link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID.
    Ethernet,
}

impl LinkLayer {
    fn code(self) -> u8 {
        match self {
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        match c {
            1 => Some(LinkLayer::InfiniBand),
            2 => Some(LinkLayer::Ethernet),
            _ => None,
        }
    }

    /// `InfiniBand` / `RoCE`.
    pub fn name(self) -> &'static str {
        match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "RoCE",
        }
    }
}

/// How a rank's port is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAddr {
    /// Link layer.
    pub link: LinkLayer,
    /// LID (InfiniBand).
    pub lid: u16,
    /// GID used for global routing (RoCE always; InfiniBand when a GID index is configured).
    pub gid: [u8; 16],
    /// GID index on the local port, or `None` when the GID is not used (plain IB LID routing).
    pub gid_index: Option<u8>,
    /// Active MTU as the `ibv_mtu` code (1 = 256 … 5 = 4096).
    pub mtu: u8,
}

/// Bytes of a path MTU code (`IBV_MTU_256` = 1 … `IBV_MTU_4096` = 5).
pub fn mtu_bytes(code: u8) -> u32 {
    match code {
        1..=5 => 128 << code,
        _ => 0,
    }
}

/// Path MTU of a connection: the smaller active MTU of the two ends.
pub fn path_mtu(a: u8, b: u8) -> u8 {
    a.min(b)
}

/// What one rank tells one peer so that the peer can connect its queue pair and write into
/// this rank's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct QpInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number of this rank's send queue.
    pub psn: u32,
    /// Remote key of the region below.
    pub rkey: u32,
    /// Address of the receive slots the peer writes frames into.
    pub rx_addr: u64,
    /// Address of the control slot (abort / goodbye frames).
    pub ctrl_addr: u64,
    /// Address of the CTS ring the peer writes clear-to-send entries into.
    pub cts_addr: u64,
}

/// Bytes of one [`Blob::Capable`] queue-pair entry: the peer's rank, then the [`QpInfo`].
const QP_ENTRY_LEN: usize = 4 + 4 * 3 + 8 * 3;

/// This rank's contribution to the connection round of the bootstrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Blob {
    /// Verbs cannot be used here: why.
    Incapable {
        /// The reason, for the other ranks' messages.
        reason: String,
    },
    /// Verbs is ready here.
    Capable {
        /// Device and port, for messages (`mlx5_0:1`).
        device: String,
        /// Port address.
        port: PortAddr,
        /// Receive slots per peer.
        slots: u32,
        /// Bytes per receive slot (header + payload).
        slot_bytes: u32,
        /// Bytes of the control slot.
        ctrl_bytes: u32,
        /// The queue pairs this rank made for its peers, as (peer rank, information): the
        /// peers connected at init, or the one peer of a connection made on first use.
        qps: Vec<(u32, QpInfo)>,
        /// This rank's direct region (GPUDirect RDMA), or why it has none.
        direct: DirectInfo,
    },
}

/// How a rank's direct region is registered (its GPUDirect mechanism).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectKind {
    /// Host memory standing in for GPU memory (tests).
    HostEmulated,
    /// GPU memory through dma-buf.
    DmaBuf,
    /// GPU memory through nvidia-peermem.
    PeerMem,
}

impl DirectKind {
    fn code(self) -> u8 {
        match self {
            DirectKind::HostEmulated => 0,
            DirectKind::DmaBuf => 1,
            DirectKind::PeerMem => 2,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(DirectKind::HostEmulated),
            1 => Some(DirectKind::DmaBuf),
            2 => Some(DirectKind::PeerMem),
            _ => None,
        }
    }
}

/// A rank's direct region as its peers see it: where their direct payloads land.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DirectInfo {
    /// No GPU memory involved (host-only communicator, or staging requested).
    None,
    /// Landing slots for peer `q` start at `addr + q × slots × slot_bytes`.
    Region {
        /// Registration mechanism.
        kind: DirectKind,
        /// Region start (the NIC's address space: virtual address, or the dma-buf iova).
        addr: u64,
        /// Remote key of the region.
        rkey: u32,
        /// Payload bytes per landing slot.
        slot_bytes: u32,
    },
    /// GPU memory could not be registered with the NIC here: why.
    Unavailable(String),
}

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        let b = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
        self.u16(b.len() as u16);
        self.0.extend_from_slice(b);
    }
}

struct R<'a>(&'a [u8]);

impl R<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "verbs connection blob is truncated ({} bytes short)",
                n - self.0.len()
            ));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(w))
    }
    fn str(&mut self) -> Result<String, String> {
        let n = self.u16()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
}

impl Blob {
    /// The queue pair this rank made for `peer`, if the blob lists one.
    pub fn qp_for(&self, peer: usize) -> Option<QpInfo> {
        match self {
            Blob::Capable { qps, .. } => qps
                .iter()
                .find(|(p, _)| *p as usize == peer)
                .map(|(_, q)| *q),
            Blob::Incapable { .. } => None,
        }
    }

    /// Serialises the blob.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::with_capacity(64));
        w.u32(BLOB_MAGIC);
        w.u8(BLOB_VERSION);
        match self {
            Blob::Incapable { reason } => {
                w.u8(0);
                w.str(reason);
            }
            Blob::Capable {
                device,
                port,
                slots,
                slot_bytes,
                ctrl_bytes,
                qps,
                direct,
            } => {
                w.u8(1);
                w.str(device);
                w.u8(port.link.code());
                w.u16(port.lid);
                w.0.extend_from_slice(&port.gid);
                w.u8(port.gid_index.map_or(0, |_| 1));
                w.u8(port.gid_index.unwrap_or(0));
                w.u8(port.mtu);
                w.u32(*slots);
                w.u32(*slot_bytes);
                w.u32(*ctrl_bytes);
                w.u32(qps.len() as u32);
                for (peer, q) in qps {
                    w.u32(*peer);
                    w.u32(q.qpn);
                    w.u32(q.psn);
                    w.u32(q.rkey);
                    w.u64(q.rx_addr);
                    w.u64(q.ctrl_addr);
                    w.u64(q.cts_addr);
                }
                match direct {
                    DirectInfo::None => w.u8(0),
                    DirectInfo::Region {
                        kind,
                        addr,
                        rkey,
                        slot_bytes,
                    } => {
                        w.u8(1);
                        w.u8(kind.code());
                        w.u64(*addr);
                        w.u32(*rkey);
                        w.u32(*slot_bytes);
                    }
                    DirectInfo::Unavailable(why) => {
                        w.u8(2);
                        w.str(why);
                    }
                }
            }
        }
        w.0
    }

    /// Parses a blob; `Err` says what is wrong.
    pub fn decode(b: &[u8]) -> Result<Blob, String> {
        let mut r = R(b);
        let magic = r.u32()?;
        if magic != BLOB_MAGIC {
            return Err(format!(
                "verbs connection blob has magic {magic:#010x}, expected {BLOB_MAGIC:#010x}"
            ));
        }
        let v = r.u8()?;
        if v != BLOB_VERSION {
            return Err(format!(
                "verbs protocol version {v}, this rank speaks {BLOB_VERSION}"
            ));
        }
        match r.u8()? {
            0 => Ok(Blob::Incapable { reason: r.str()? }),
            1 => {
                let device = r.str()?;
                let lc = r.u8()?;
                let link = LinkLayer::from_code(lc)
                    .ok_or_else(|| format!("unknown link layer code {lc}"))?;
                let lid = r.u16()?;
                let mut gid = [0u8; 16];
                gid.copy_from_slice(r.take(16)?);
                let has_gid = r.u8()? != 0;
                let gi = r.u8()?;
                let mtu = r.u8()?;
                let slots = r.u32()?;
                let slot_bytes = r.u32()?;
                let ctrl_bytes = r.u32()?;
                let n = r.u32()? as usize;
                if n > 1 << 20 || r.0.len() < n * QP_ENTRY_LEN {
                    return Err(format!(
                        "verbs connection blob is truncated: it claims {n} peers"
                    ));
                }
                let mut qps = Vec::with_capacity(n);
                for _ in 0..n {
                    let peer = r.u32()?;
                    qps.push((
                        peer,
                        QpInfo {
                            qpn: r.u32()?,
                            psn: r.u32()?,
                            rkey: r.u32()?,
                            rx_addr: r.u64()?,
                            ctrl_addr: r.u64()?,
                            cts_addr: r.u64()?,
                        },
                    ));
                }
                let port = PortAddr {
                    link,
                    lid,
                    gid,
                    gid_index: has_gid.then_some(gi),
                    mtu,
                };
                let direct = match r.u8()? {
                    0 => DirectInfo::None,
                    1 => {
                        let kc = r.u8()?;
                        DirectInfo::Region {
                            kind: DirectKind::from_code(kc)
                                .ok_or_else(|| format!("unknown direct region kind {kc}"))?,
                            addr: r.u64()?,
                            rkey: r.u32()?,
                            slot_bytes: r.u32()?,
                        }
                    }
                    2 => DirectInfo::Unavailable(r.str()?),
                    k => return Err(format!("unknown direct region tag {k}")),
                };
                Ok(Blob::Capable {
                    device,
                    port,
                    slots,
                    slot_bytes,
                    ctrl_bytes,
                    qps,
                    direct,
                })
            }
            k => Err(format!("unknown verbs blob kind {k}")),
        }
    }
}

/// The mark a rank sends, after its connection message, over a connection made on first use
/// once its queue pair is at RTS: the peer may write.
pub const READY: u8 = 0x52;
/// The largest connection message accepted on first use (one with one queue pair is ~100
/// bytes).
pub const MAX_FIRST_USE: usize = 64 * 1024;

/// A connection message on first use: `blob`'s length (u32, little-endian), then the blob.
pub fn first_use_message(blob: &Blob) -> Vec<u8> {
    let b = blob.encode();
    let mut out = (b.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&b);
    out
}

/// Takes a whole connection message from the front of `buf` (what arrived so far):
/// `Ok(None)` until all of it is there; `Err` for an oversized or undecodable message.
pub fn take_first_use(buf: &mut Vec<u8>) -> Result<Option<Blob>, String> {
    let Some(head) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if len > MAX_FIRST_USE {
        return Err(format!(
            "a {len}-byte connection message (at most {MAX_FIRST_USE})"
        ));
    }
    if buf.len() < 4 + len {
        return Ok(None);
    }
    let blob = Blob::decode(&buf[4..4 + len])?;
    buf.drain(..4 + len);
    Ok(Some(blob))
}

/// Takes the [`READY`] mark from the front of `buf`: `Ok(false)` while nothing is there;
/// `Err` for another byte.
pub fn take_ready(buf: &mut Vec<u8>) -> Result<bool, String> {
    match buf.first() {
        None => Ok(false),
        Some(&READY) => {
            buf.remove(0);
            Ok(true)
        }
        Some(b) => Err(format!(
            "{b:#04x} where the ready mark ({READY:#04x}) belongs"
        )),
    }
}

/// One clear-to-send entry: "write your next frame here". `seq` is written at both ends of the
/// entry; the sender only trusts an entry whose completion it has seen *and* whose two copies
/// of `seq` match the one it expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cts {
    /// Sequence number of this clear-to-send (0, 1, 2, … per direction).
    pub seq: u64,
    /// Where to write the frame.
    pub addr: u64,
    /// Remote key of that memory.
    pub rkey: u32,
    /// Bytes available there (header + payload).
    pub size: u32,
}

impl Cts {
    /// Serialises to the 32-byte ring entry.
    pub fn encode(&self) -> [u8; CTS_LEN] {
        let mut b = [0u8; CTS_LEN];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        b[20..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    /// Parses a ring entry; `None` when its two sequence copies differ (torn or stale).
    pub fn decode(b: &[u8; CTS_LEN]) -> Option<Cts> {
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let seq = u64_at(0);
        if u64_at(24) != seq {
            return None;
        }
        Some(Cts {
            seq,
            addr: u64_at(8),
            rkey: u32_at(16),
            size: u32_at(20),
        })
    }
}

/// The immediate value of a `RDMA_WRITE_WITH_IMM`: what just landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Imm {
    /// A frame of `len` bytes (header + payload) in the next receive slot; `seq` is the low 4
    /// bits of its sequence number.
    Data {
        /// Low bits of the frame's sequence number.
        seq: u8,
        /// Frame length.
        len: u32,
    },
    /// A clear-to-send entry with the low 30 bits of its sequence number.
    Cts {
        /// Low bits of the CTS sequence number.
        seq: u32,
    },
    /// An abort or goodbye frame of `len` bytes in the control slot.
    Ctrl {
        /// Frame length.
        len: u32,
    },
    /// A direct frame: its 32-byte header in the next receive slot, its payload (`len` bytes
    /// of header + payload in all) in the matching landing slot of the direct region.
    Direct {
        /// Low bits of the frame's sequence number.
        seq: u8,
        /// Frame length (header + payload).
        len: u32,
    },
}

/// Largest frame (header + payload) an immediate can describe: 64 MiB − 1.
pub const MAX_FRAME: u32 = (1 << 26) - 1;

impl Imm {
    /// The 32-bit immediate (host order; the caller converts to network order).
    pub fn encode(self) -> u32 {
        match self {
            Imm::Data { seq, len } => (u32::from(seq & 0xf) << 26) | (len & MAX_FRAME),
            Imm::Cts { seq } => (1 << 30) | (seq & 0x3fff_ffff),
            Imm::Ctrl { len } => (2 << 30) | (len & MAX_FRAME),
            Imm::Direct { seq, len } => {
                (3 << 30) | (u32::from(seq & 0xf) << 26) | (len & MAX_FRAME)
            }
        }
    }

    /// Parses an immediate. Total: the top two bits name one of the four kinds.
    pub fn decode(v: u32) -> Imm {
        let seq = ((v >> 26) & 0xf) as u8;
        let len = v & MAX_FRAME;
        match v >> 30 {
            0 => Imm::Data { seq, len },
            1 => Imm::Cts {
                seq: v & 0x3fff_ffff,
            },
            2 => Imm::Ctrl { len },
            _ => Imm::Direct { seq, len },
        }
    }
}

/// What a work request was, recovered from its `wr_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrKind {
    /// A frame written into a peer's receive slot.
    Data,
    /// A clear-to-send entry written into a peer's ring.
    Cts,
    /// An abort or goodbye frame.
    Ctrl,
    /// A receive (consumed by the peer's `WRITE_WITH_IMM`).
    Recv,
}

impl WrKind {
    /// Name in error messages.
    pub fn describe(self) -> &'static str {
        match self {
            WrKind::Data => "RDMA write of a frame",
            WrKind::Cts => "RDMA write of a clear-to-send entry",
            WrKind::Ctrl => "RDMA write of an abort/goodbye frame",
            WrKind::Recv => "receive of an RDMA write with immediate",
        }
    }
}

/// Bits of a `wr_id` that carry the peer: every rank of the largest world dspark accepts
/// (2^20; 16 bits sent the completions of peer r + 65 536 to peer r).
pub const PEER_BITS: u32 = 20;
/// Bits that carry the send-queue index: its low bits, which
/// [`SendQueue::complete`](super::slots::SendQueue::complete) widens again from the queue's
/// own count.
pub const INDEX_BITS: u32 = 64 - PEER_BITS - 2;
/// The most peers a `wr_id` can name.
pub const MAX_PEERS: usize = 1 << PEER_BITS;

/// Packs (peer, kind, send-queue index) into a `wr_id`: [`PEER_BITS`] of peer, 2 of kind,
/// the low [`INDEX_BITS`] of the index.
pub fn wr_id(peer: usize, kind: WrKind, index: u64) -> u64 {
    let k = match kind {
        WrKind::Data => 0,
        WrKind::Cts => 1,
        WrKind::Ctrl => 2,
        WrKind::Recv => 3,
    };
    let peer = peer as u64 & (MAX_PEERS as u64 - 1);
    (peer << (64 - PEER_BITS)) | (k << INDEX_BITS) | (index & ((1 << INDEX_BITS) - 1))
}

/// Unpacks a `wr_id` made by [`wr_id`]: the index is its low [`INDEX_BITS`].
pub fn split_wr_id(id: u64) -> (usize, WrKind, u64) {
    let kind = match (id >> INDEX_BITS) & 0b11 {
        0 => WrKind::Data,
        1 => WrKind::Cts,
        2 => WrKind::Ctrl,
        _ => WrKind::Recv,
    };
    (
        (id >> (64 - PEER_BITS)) as usize,
        kind,
        id & ((1 << INDEX_BITS) - 1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capable() -> Blob {
        Blob::Capable {
            device: "rxe0:1".into(),
            port: PortAddr {
                link: LinkLayer::Ethernet,
                lid: 0,
                gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 1],
                gid_index: Some(1),
                mtu: 3,
            },
            slots: 8,
            slot_bytes: 512 * 1024 + 32,
            ctrl_bytes: 4096,
            qps: vec![
                (0, QpInfo::default()),
                (
                    5,
                    QpInfo {
                        qpn: 17,
                        psn: 0xabcdef,
                        rkey: 0x1234,
                        rx_addr: 1 << 40,
                        ctrl_addr: 7,
                        cts_addr: u64::MAX,
                    },
                ),
            ],
            direct: DirectInfo::Region {
                kind: DirectKind::DmaBuf,
                addr: 0x7f12_3456_0000,
                rkey: 0xfeed,
                slot_bytes: 512 * 1024,
            },
        }
    }

    #[test]
    fn connection_blobs_round_trip() {
        let with = |direct: DirectInfo| match capable() {
            Blob::Capable {
                device,
                port,
                slots,
                slot_bytes,
                ctrl_bytes,
                qps,
                ..
            } => Blob::Capable {
                device,
                port,
                slots,
                slot_bytes,
                ctrl_bytes,
                qps,
                direct,
            },
            b => b,
        };
        for b in [
            capable(),
            with(DirectInfo::None),
            with(DirectInfo::Unavailable("nvidia-peermem not loaded".into())),
            with(DirectInfo::Region {
                kind: DirectKind::HostEmulated,
                addr: 1,
                rkey: 2,
                slot_bytes: 3,
            }),
            Blob::Incapable {
                reason: "no RDMA devices".into(),
            },
        ] {
            assert_eq!(Blob::decode(&b.encode()).unwrap(), b);
        }
    }

    #[test]
    fn a_blob_lists_queue_pairs_by_peer_and_only_those() {
        let b = capable();
        assert_eq!(b.qp_for(5).map(|q| q.qpn), Some(17));
        assert_eq!(b.qp_for(0), Some(QpInfo::default()));
        assert_eq!(b.qp_for(1), None);
        assert_eq!(Blob::Incapable { reason: "x".into() }.qp_for(0), None);
    }

    #[test]
    fn first_use_messages_are_taken_whole_then_the_ready_mark() {
        let b = capable();
        let m = first_use_message(&b);
        // Byte by byte: nothing until the last byte, then the blob; the mark after it.
        let mut buf = Vec::new();
        for (i, &x) in m.iter().enumerate() {
            buf.push(x);
            let got = take_first_use(&mut buf).unwrap();
            assert_eq!(got.is_some(), i + 1 == m.len(), "after {} bytes", i + 1);
            if let Some(got) = got {
                assert_eq!(got, b);
                assert!(buf.is_empty());
            }
        }
        assert_eq!(take_ready(&mut buf), Ok(false));
        // Message and mark in one read.
        let mut buf = m.clone();
        buf.push(READY);
        assert_eq!(take_first_use(&mut buf).unwrap(), Some(b));
        assert_eq!(take_ready(&mut buf), Ok(true));
        assert!(buf.is_empty());
    }

    #[test]
    fn first_use_messages_that_are_too_long_or_damaged_or_a_wrong_mark_are_refused() {
        let mut buf = ((MAX_FIRST_USE + 1) as u32).to_le_bytes().to_vec();
        assert!(take_first_use(&mut buf)
            .unwrap_err()
            .contains("connection message"));
        let mut buf = first_use_message(&capable());
        buf[4] ^= 1;
        assert!(take_first_use(&mut buf).unwrap_err().contains("magic"));
        let mut buf = vec![0u8];
        assert!(take_ready(&mut buf).unwrap_err().contains("ready mark"));
    }

    #[test]
    fn damaged_blobs_are_refused_with_a_reason() {
        let good = capable().encode();
        assert!(Blob::decode(&good[..good.len() - 1])
            .unwrap_err()
            .contains("truncated"));
        let mut bad = good.clone();
        bad[0] ^= 1;
        assert!(Blob::decode(&bad).unwrap_err().contains("magic"));
        let mut bad = good;
        bad[4] = BLOB_VERSION + 1;
        assert!(Blob::decode(&bad).unwrap_err().contains("version"));
    }

    #[test]
    fn cts_entries_round_trip_and_torn_entries_are_rejected() {
        let c = Cts {
            seq: 12345678901,
            addr: 0x7f00_dead_beef,
            rkey: 99,
            size: 524_320,
        };
        let b = c.encode();
        assert_eq!(b.len(), CTS_LEN);
        assert_eq!(Cts::decode(&b), Some(c));
        let mut torn = b;
        torn[24] ^= 1;
        assert_eq!(Cts::decode(&torn), None);
    }

    #[test]
    fn immediates_carry_kind_sequence_and_length() {
        for imm in [
            Imm::Data { seq: 0, len: 32 },
            Imm::Data {
                seq: 15,
                len: MAX_FRAME,
            },
            Imm::Cts { seq: 0x3fff_ffff },
            Imm::Cts { seq: 0 },
            Imm::Ctrl { len: 4096 },
            Imm::Direct { seq: 9, len: 32 },
            Imm::Direct {
                seq: 15,
                len: MAX_FRAME,
            },
        ] {
            assert_eq!(Imm::decode(imm.encode()), imm);
        }
        // Only the low 4 bits of a data sequence number travel.
        assert_eq!(
            Imm::decode(Imm::Data { seq: 17, len: 40 }.encode()),
            Imm::Data { seq: 1, len: 40 }
        );
    }

    #[test]
    fn work_request_ids_round_trip() {
        for (p, k, i) in [
            (0, WrKind::Data, 0),
            (65535, WrKind::Recv, (1 << INDEX_BITS) - 1),
            (65536, WrKind::Data, 7),
            (MAX_PEERS - 1, WrKind::Ctrl, 1 << 40),
            (3, WrKind::Cts, 99),
            (9, WrKind::Ctrl, 5),
        ] {
            assert_eq!(split_wr_id(wr_id(p, k, i)), (p, k, i));
        }
        // The index keeps its low bits only; the send queue widens them again.
        let (_, _, low) = split_wr_id(wr_id(1, WrKind::Data, (1 << INDEX_BITS) + 5));
        assert_eq!(low, 5);
    }

    #[test]
    fn path_mtu_is_the_smaller_end() {
        assert_eq!(path_mtu(5, 3), 3);
        assert_eq!(mtu_bytes(path_mtu(3, 5)), 1024);
        assert_eq!(mtu_bytes(1), 256);
        assert_eq!(mtu_bytes(5), 4096);
    }
}
