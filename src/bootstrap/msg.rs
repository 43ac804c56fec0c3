//! The bootstrap's messages: their layout, encoders and decoders.
//!
//! Every message travels as a `u32` little-endian length and then the message, whose first
//! byte is its kind. Integers are little-endian; a string or byte vector is a `u32` length
//! and the bytes. The decoders are total: any input gives a value or an error naming what is
//! wrong, never a panic, and they allocate nothing beyond the length of the message they read
//! (which the reader bounds before it allocates it).
//!
//! Version 2 (challenge-response) keeps version 1's hello as a prefix of its own, so that a
//! rank 0 of version 1 still reads the version of a version 2 rank and refuses it with that
//! reason, and the other way round. Version 3 appends the rank's process id to the hello and
//! to each rank table entry (the flight record says where a rank everyone waits for runs).

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};

use super::auth::{Nonce, TAG_LEN};
use super::PeerInfo;

/// Magic number opening every hello.
pub const MAGIC: u64 = 0x6473_7061_726b_0001; // "dspark" + 1
/// Bootstrap protocol version: 2 proves the job token by challenge-response; 3 carries each
/// rank's process id in its hello and the rank table.
pub const VERSION: u32 = 3;

pub(crate) const MSG_HELLO: u8 = 1;
pub(crate) const MSG_WELCOME: u8 = 2;
pub(crate) const MSG_REJECT: u8 = 3;
pub(crate) const MSG_PEER_HELLO: u8 = 4;
pub(crate) const MSG_PEER_ACK: u8 = 5;
pub(crate) const MSG_BLOB: u8 = 6;
pub(crate) const MSG_CHALLENGE: u8 = 7;
pub(crate) const MSG_PROOF: u8 = 8;
pub(crate) const MSG_PEER_CHALLENGE: u8 = 9;
pub(crate) const MSG_PEER_PROOF: u8 = 10;

pub(crate) const REJECT_MISMATCH: u8 = 1;
pub(crate) const REJECT_CONFIG: u8 = 2;

/// An authentication tag (HMAC-SHA256).
pub(crate) type Tag = [u8; TAG_LEN];

/// Little-endian message builder.
#[derive(Default, Debug, Clone)]
pub(crate) struct Msg(pub(crate) Vec<u8>);

impl Msg {
    pub(crate) fn new(kind: u8) -> Self {
        let mut m = Msg(Vec::with_capacity(64));
        m.0.push(kind);
        m
    }
    pub(crate) fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub(crate) fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn raw(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    pub(crate) fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    pub(crate) fn str(self, s: &str) -> Self {
        self.bytes(s.as_bytes())
    }
}

/// Little-endian message reader; every getter fails cleanly on a short message.
pub(crate) struct Rd<'a>(pub(crate) &'a [u8]);

type R<T> = Result<T, String>;

impl Rd<'_> {
    fn take(&mut self, n: usize) -> R<&[u8]> {
        if self.0.len() < n {
            return Err("truncated bootstrap message".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> R<u8> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u16(&mut self) -> R<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub(crate) fn u32(&mut self) -> R<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self) -> R<u64> {
        let b = self.take(8)?;
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        Ok(u64::from_le_bytes(w))
    }
    fn array<const N: usize>(&mut self) -> R<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn bytes(&mut self) -> R<Vec<u8>> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    pub(crate) fn str(&mut self) -> R<String> {
        String::from_utf8(self.bytes()?).map_err(|_| "bad string in bootstrap message".into())
    }
    fn flag(&mut self) -> R<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(format!("bad flag {b} in bootstrap message")),
        }
    }
    fn end(&self, what: &str) -> R<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} stray bytes after the {what}", self.0.len()))
        }
    }
}

/// Why a hello (to rank 0, or on a data connection) was not read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum HelloError {
    /// Not a dspark hello at all (another kind of message, a bad magic number).
    Foreign(String),
    /// A dspark rank speaking another protocol version.
    Version(u32),
    /// A hello of this version that is malformed.
    Malformed(String),
}

/// Reads kind, magic and version: the part every version shares.
fn greeting(r: &mut Rd<'_>, kind: u8) -> Result<(), HelloError> {
    let foreign = |w: String| HelloError::Foreign(w);
    let k = r.u8().map_err(foreign)?;
    if k != kind {
        return Err(HelloError::Foreign(format!(
            "bootstrap message of kind {k} where a hello (kind {kind}) belongs"
        )));
    }
    let magic = r.u64().map_err(foreign)?;
    if magic != MAGIC {
        return Err(HelloError::Foreign(format!(
            "not a dspark rank (magic {magic:#018x})"
        )));
    }
    let version = r.u32().map_err(foreign)?;
    if version != VERSION {
        return Err(HelloError::Version(version));
    }
    Ok(())
}

/// A rank's hello to rank 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    /// World size.
    pub world: u32,
    /// The rank.
    pub rank: u32,
    /// Hash of the launcher's job id (0 without one): catches ranks of another job.
    pub job: u64,
    /// Port of the rank's data listener.
    pub data_port: u16,
    /// Host name.
    pub host: String,
    /// Pipeline segment size.
    pub segment: u64,
    /// Whether the rank has a job token.
    pub token: bool,
    /// The rank's nonce: rank 0's proof covers it.
    pub nonce: Nonce,
    /// The rank's process id (version 3), for the rank table.
    pub pid: u32,
}

impl Hello {
    /// Version 1's fields in version 1's order, then the token flag and the nonce (version
    /// 2), then the process id (version 3).
    pub(crate) fn encode(&self) -> Msg {
        Msg::new(MSG_HELLO)
            .u64(MAGIC)
            .u32(VERSION)
            .u32(self.world)
            .u32(self.rank)
            .u64(self.job)
            .u16(self.data_port)
            .str(&self.host)
            .u64(self.segment)
            .u8(u8::from(self.token))
            .raw(&self.nonce)
            .u32(self.pid)
    }

    pub(crate) fn decode(m: &[u8]) -> Result<Hello, HelloError> {
        let mut r = Rd(m);
        greeting(&mut r, MSG_HELLO)?;
        let bad = HelloError::Malformed;
        let h = Hello {
            world: r.u32().map_err(bad)?,
            rank: r.u32().map_err(bad)?,
            job: r.u64().map_err(bad)?,
            data_port: r.u16().map_err(bad)?,
            host: r.str().map_err(bad)?,
            segment: r.u64().map_err(bad)?,
            token: r.flag().map_err(bad)?,
            nonce: r.array().map_err(bad)?,
            pid: r.u32().map_err(bad)?,
        };
        r.end("hello").map_err(bad)?;
        Ok(h)
    }
}

/// The hello that opens a data connection (from the higher rank to the lower).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PeerHello {
    /// Hash of the launcher's job id.
    pub job: u64,
    /// World size.
    pub world: u32,
    /// The connecting rank.
    pub from: u32,
    /// The rank it means to reach.
    pub to: u32,
    /// Whether the connecting rank has a job token.
    pub token: bool,
    /// The connecting rank's nonce.
    pub nonce: Nonce,
}

impl PeerHello {
    pub(crate) fn encode(&self) -> Msg {
        Msg::new(MSG_PEER_HELLO)
            .u64(MAGIC)
            .u32(VERSION)
            .u64(self.job)
            .u32(self.world)
            .u32(self.from)
            .u32(self.to)
            .u8(u8::from(self.token))
            .raw(&self.nonce)
    }

    pub(crate) fn decode(m: &[u8]) -> Result<PeerHello, HelloError> {
        let mut r = Rd(m);
        greeting(&mut r, MSG_PEER_HELLO)?;
        let bad = HelloError::Malformed;
        let h = PeerHello {
            job: r.u64().map_err(bad)?,
            world: r.u32().map_err(bad)?,
            from: r.u32().map_err(bad)?,
            to: r.u32().map_err(bad)?,
            token: r.flag().map_err(bad)?,
            nonce: r.array().map_err(bad)?,
        };
        r.end("peer hello").map_err(bad)?;
        Ok(h)
    }
}

/// Rank 0's refusal of a rank (or of the whole rendezvous).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reject {
    /// `REJECT_MISMATCH` or `REJECT_CONFIG` (any other value reads as a mismatch).
    pub class: u8,
    /// The variable to fix (for `REJECT_CONFIG`), or empty.
    pub var: String,
    /// Why.
    pub why: String,
}

impl Reject {
    pub(crate) fn encode(&self) -> Msg {
        Msg::new(MSG_REJECT)
            .u8(self.class)
            .str(&self.var)
            .str(&self.why)
    }

    /// Lenient, as version 1 was: whatever part of the reason arrived is kept.
    fn decode_body(r: &mut Rd<'_>) -> Reject {
        Reject {
            class: r.u8().unwrap_or(0),
            var: r.str().unwrap_or_default(),
            why: r.str().unwrap_or_else(|_| "no reason given".into()),
        }
    }
}

/// What a rank reads from rank 0 after its hello, or after its proof.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Rank 0's nonce: prove the token over it.
    Challenge(Nonce),
    /// Admitted: the rank table (in rank order), and rank 0's proof over it.
    Welcome {
        /// Every rank's data address and host name.
        peers: Vec<PeerInfo>,
        /// Length of the signed part (the message without its tag).
        signed: usize,
        /// Rank 0's proof.
        tag: Tag,
    },
    /// Refused.
    Reject(Reject),
}

/// The table part of a welcome (kind, then the entries); the tag follows it.
pub(crate) fn encode_welcome(peers: &[PeerInfo]) -> Msg {
    let mut m = Msg::new(MSG_WELCOME).u32(peers.len() as u32);
    for p in peers {
        m = m
            .u32(p.rank as u32)
            .str(&p.addr.ip().to_string())
            .u16(p.addr.port())
            .str(&p.host)
            .u32(p.pid);
    }
    m
}

impl Reply {
    pub(crate) fn encode_challenge(nonce: &Nonce) -> Msg {
        Msg::new(MSG_CHALLENGE).raw(nonce)
    }

    /// Decodes a reply of rank 0 to a rank of a `world`-rank job.
    pub(crate) fn decode(m: &[u8], world: usize) -> R<Reply> {
        let mut r = Rd(m);
        match r.u8()? {
            MSG_CHALLENGE => {
                let n = r.array()?;
                r.end("challenge")?;
                Ok(Reply::Challenge(n))
            }
            MSG_REJECT => Ok(Reply::Reject(Reject::decode_body(&mut r))),
            MSG_WELCOME => {
                let signed = m
                    .len()
                    .checked_sub(TAG_LEN)
                    .ok_or("truncated bootstrap message")?;
                let mut r = Rd(&m[1..signed.max(1)]);
                let tag: Tag = Rd(&m[signed..]).array()?;
                // The whole table, or (connections on first use) the entries of rank 0, the
                // rank itself and its init-time partners, in rank order; the others are
                // gathered from the ranks themselves over those connections.
                let n = r.u32()? as usize;
                if n > world || (n == 0 && world > 0) {
                    return Err(format!("rank table has {n} entries, world size is {world}"));
                }
                // Each entry takes at least 18 bytes: a table longer than the message is
                // refused before anything is allocated for it.
                if r.0.len() / 18 < n {
                    return Err("truncated bootstrap message".into());
                }
                let mut peers: Vec<PeerInfo> = Vec::with_capacity(n);
                for i in 0..n {
                    let rank = r.u32()? as usize;
                    let after = peers.last().map_or(0, |p: &PeerInfo| p.rank + 1);
                    if rank >= world || (i > 0 && rank < after) || (n == world && rank != i) {
                        return Err(format!("rank table entry {i} is for rank {rank}"));
                    }
                    let ip: IpAddr = r
                        .str()?
                        .parse()
                        .map_err(|_| "bad address in rank table".to_string())?;
                    let port = r.u16()?;
                    let host = r.str()?;
                    let pid = r.u32()?;
                    peers.push(PeerInfo {
                        rank,
                        host,
                        addr: SocketAddr::new(ip, port),
                        pid,
                    });
                }
                r.end("rank table")?;
                Ok(Reply::Welcome { peers, signed, tag })
            }
            k => Err(format!("unexpected bootstrap message {k}")),
        }
    }
}

/// A proof message (`MSG_PROOF` to rank 0, `MSG_PEER_PROOF` on a data connection).
pub(crate) fn encode_proof(kind: u8, tag: &Tag) -> Msg {
    Msg::new(kind).raw(tag)
}

/// The tag of a proof message of `kind`; a reject instead gives its reason.
pub(crate) fn decode_proof(m: &[u8], kind: u8) -> R<Result<Tag, Reject>> {
    let mut r = Rd(m);
    let k = r.u8()?;
    if k == MSG_REJECT {
        return Ok(Err(Reject::decode_body(&mut r)));
    }
    if k != kind {
        return Err(format!(
            "bootstrap message of kind {k} where a proof (kind {kind}) belongs"
        ));
    }
    let t = r.array()?;
    r.end("proof")?;
    Ok(Ok(t))
}

/// The acceptor's challenge on a data connection: its nonce and its own proof.
pub(crate) fn encode_peer_challenge(nonce: &Nonce, tag: &Tag) -> Msg {
    Msg::new(MSG_PEER_CHALLENGE).raw(nonce).raw(tag)
}

/// The acceptor's nonce and proof; a reject instead gives its reason.
pub(crate) fn decode_peer_challenge(m: &[u8]) -> R<Result<(Nonce, Tag), Reject>> {
    let mut r = Rd(m);
    match r.u8()? {
        MSG_REJECT => Ok(Err(Reject::decode_body(&mut r))),
        MSG_PEER_CHALLENGE => {
            let n = r.array()?;
            let t = r.array()?;
            r.end("peer challenge")?;
            Ok(Ok((n, t)))
        }
        k => Err(format!(
            "bootstrap message of kind {k} where a peer challenge belongs"
        )),
    }
}

/// The acknowledgement that ends a data connection's handshake; a reject gives its reason.
pub(crate) fn decode_peer_ack(m: &[u8]) -> R<Result<(), Reject>> {
    let mut r = Rd(m);
    match r.u8()? {
        MSG_REJECT => Ok(Err(Reject::decode_body(&mut r))),
        MSG_PEER_ACK => {
            r.end("acknowledgement")?;
            Ok(Ok(()))
        }
        _ => Err("peer did not acknowledge the connection".into()),
    }
}

/// One rank's blob for [`super::Bootstrap::all_gather`].
pub(crate) fn encode_blob(b: &[u8]) -> Msg {
    Msg::new(MSG_BLOB).bytes(b)
}

pub(crate) fn decode_blob(m: &[u8]) -> R<Vec<u8>> {
    let mut r = Rd(m);
    if r.u8()? != MSG_BLOB {
        return Err("expected a blob".into());
    }
    let b = r.bytes()?;
    r.end("blob")?;
    Ok(b)
}

/// Everybody's blobs, from rank 0.
pub(crate) fn encode_blobs(all: &[Vec<u8>]) -> Msg {
    let mut m = Msg::new(MSG_BLOB).u32(all.len() as u32);
    for b in all {
        m = m.bytes(b);
    }
    m
}

pub(crate) fn decode_blobs(m: &[u8], world: usize) -> R<Vec<Vec<u8>>> {
    let mut r = Rd(m);
    if r.u8()? != MSG_BLOB {
        return Err("expected a blob".into());
    }
    let n = r.u32()? as usize;
    if n != world {
        return Err(format!("{n} blobs for {world} ranks"));
    }
    // Each blob takes at least its 4-byte length.
    if r.0.len() / 4 < n {
        return Err("truncated bootstrap message".into());
    }
    let mut all = Vec::with_capacity(n);
    for _ in 0..n {
        all.push(r.bytes()?);
    }
    r.end("blobs")?;
    Ok(all)
}
