//! What a call's frames carry and how a receive checks them: the [`Desc`]riptor every frame
//! header repeats (collective, algorithm, sequence number, type, op, count, root), and the
//! [`Sink`] a receive hands the transport, which compares an arriving header with the call's
//! before it copies or reduces a byte. Ranks that disagree about a call meet here, as an
//! [`Error::Mismatch`] that names both calls.

use crate::error::{Error, Result};
use crate::plan::{Algorithm, Collective};
use crate::reduce;
use crate::transport::{count_text, FrameHeader, FrameKind, RecvSink, COUNT_PER_PEER, NO_OP};
use crate::types::{DataType, ReduceOp};

/// The descriptors a drive loop checks frames against: the call's, for its sends and its
/// receives alike, except in an exchange ([`Call::recv_from`]), whose send and receive are
/// two calls with a sequence number and a count each.
///
/// [`Call::recv_from`]: super::Call::recv_from
#[derive(Clone, Copy)]
pub(super) struct Descs<'a> {
    pub(super) send: &'a Desc,
    pub(super) recv: &'a Desc,
    /// An all-to-all of counts per peer ([`super::Engine::run_all_to_all_v`]): the elements
    /// sent to and received from each peer (indexed by peer), which the frames between the
    /// two carry as their count, marked with [`COUNT_PER_PEER`], instead of the descriptor's.
    pub(super) per_peer: Option<(&'a [usize], &'a [usize])>,
}

impl Descs<'_> {
    /// The descriptor the frames from `peer` are checked against.
    pub(super) fn recv_from(&self, peer: usize) -> Desc {
        match self.per_peer {
            Some((_, from)) => Desc {
                count: COUNT_PER_PEER | from[peer] as u64,
                ..*self.recv
            },
            None => *self.recv,
        }
    }

    /// The header of a frame of `len` bytes to `peer`.
    pub(super) fn header_to(&self, peer: usize, len: usize) -> FrameHeader {
        let mut h = self.send.header(len);
        if let Some((to, _)) = self.per_peer {
            h.count = COUNT_PER_PEER | to[peer] as u64;
        }
        h
    }
}

/// The descriptor every frame of a call carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Desc {
    pub(super) coll: Collective,
    /// The algorithm: ranks that schedule one call differently would exchange frames of the
    /// same sizes and reduce them at the wrong offsets, so it is part of the descriptor.
    pub(super) algo: Algorithm,
    pub(super) seq: u64,
    pub(super) dtype: DataType,
    pub(super) op: u8,
    pub(super) count: u64,
    pub(super) root: u32,
}

impl Desc {
    pub(super) fn header(&self, len: usize) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data,
            coll: coll_byte(self.coll, self.algo),
            dtype: self.dtype.code(),
            op: self.op,
            root: self.root,
            len: len as u32,
            seq: self.seq,
            count: self.count,
        }
    }

    /// "all_reduce #7 (count 10, float, sum, ring)".
    fn describe(byte: u8, seq: u64, dtype: u8, op: u8, count: u64, root: u32) -> String {
        let (coll, algo) = (byte & 0x0f, byte >> 4);
        let coll_s = Collective::from_code(coll)
            .map_or(format!("collective #{coll}"), |c| c.name().to_string());
        let dtype_s =
            DataType::from_code(dtype).map_or(format!("type #{dtype}"), |d| d.to_string());
        let mut s = format!("{coll_s} #{seq} ({}, {dtype_s}", count_text(count));
        if op != NO_OP {
            s += &ReduceOp::from_code(op).map_or(format!(", op #{op}"), |o| format!(", {o}"));
        }
        if Collective::from_code(coll).is_some_and(Collective::rooted) {
            s += &format!(", root {root}");
        }
        s += &Algorithm::from_code(algo)
            .map_or(format!(", algorithm #{algo}"), |a| format!(", {a}"));
        s + ")"
    }

    /// "all_reduce #7", for errors.
    pub(super) fn op_name(&self) -> String {
        format!("{} #{}", self.coll.name(), self.seq)
    }

    fn describe_self(&self) -> String {
        Self::describe(
            coll_byte(self.coll, self.algo),
            self.seq,
            self.dtype.code(),
            self.op,
            self.count,
            self.root,
        )
    }
}

/// The header's collective byte: the collective in the low four bits, the algorithm in the
/// high four.
fn coll_byte(coll: Collective, algo: Algorithm) -> u8 {
    coll.code() | (algo.code() << 4)
}

/// Checks a header from `peer` against this rank's call `d` and the `len` payload bytes it
/// expects: ranks that disagree about a call meet here, as an [`Error::Mismatch`] naming both
/// calls.
pub(super) fn check_header(
    rank: usize,
    peer: usize,
    d: &Desc,
    h: &FrameHeader,
    len: usize,
) -> Result<()> {
    let same = h.coll == coll_byte(d.coll, d.algo)
        && h.seq == d.seq
        && h.dtype == d.dtype.code()
        && h.op == d.op
        && h.count == d.count
        && h.root == d.root;
    if !same {
        return Err(Error::Mismatch {
            rank: Some(rank),
            peer: Some(peer),
            op: d.coll.name().into(),
            what: format!(
                "rank {rank} called {} but rank {peer} called {}",
                d.describe_self(),
                Desc::describe(h.coll, h.seq, h.dtype, h.op, h.count, h.root)
            ),
        });
    }
    if h.len as usize != len {
        return Err(Error::Mismatch {
            rank: Some(rank),
            peer: Some(peer),
            op: d.coll.name().into(),
            what: format!(
                "rank {peer} sent a {}-byte frame of {} where rank {rank} expected {len} bytes: \
                 a frame was lost or the ranks cut messages into different segments",
                h.len,
                d.describe_self(),
            ),
        });
    }
    Ok(())
}

/// Where a reducing receive takes its other operand from.
pub(super) enum Acc<'a> {
    /// Copying receive.
    None,
    /// `dst = dst ⊕ received`.
    InPlace,
    /// `dst = acc ⊕ received`.
    From(&'a [u8]),
}

/// The receive side of one segment: checks the frame's header against the call's descriptor,
/// then copies or reduces its bytes into `dst` as the transport hands them over.
pub(super) struct Sink<'a> {
    pub(super) rank: usize,
    pub(super) peer: usize,
    pub(super) desc: &'a Desc,
    pub(super) len: usize,
    pub(super) dst: &'a mut [u8],
    pub(super) acc: Acc<'a>,
    pub(super) op: ReduceOp,
    pub(super) esz: usize,
    /// Bytes of the segment already consumed.
    pub(super) done: usize,
}

impl RecvSink for Sink<'_> {
    fn on_header(&mut self, h: &FrameHeader) -> Result<usize> {
        check_header(self.rank, self.peer, self.desc, h, self.len)?;
        Ok(self.len)
    }

    fn direct(&mut self) -> Option<&mut [u8]> {
        match self.acc {
            Acc::None => Some(&mut *self.dst),
            _ => None,
        }
    }

    fn granule(&self) -> usize {
        self.esz
    }

    fn consume(&mut self, bytes: &[u8]) -> Result<()> {
        let a = self.done;
        let b = a + bytes.len();
        let dtype = self.desc.dtype;
        match &self.acc {
            Acc::None => self.dst[a..b].copy_from_slice(bytes),
            Acc::InPlace => reduce::reduce_inplace(dtype, self.op, &mut self.dst[a..b], bytes),
            Acc::From(acc) => {
                reduce::reduce_into(dtype, self.op, &mut self.dst[a..b], &acc[a..b], bytes)
            }
        }
        self.done = b;
        Ok(())
    }
}
