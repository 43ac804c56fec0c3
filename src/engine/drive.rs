//! The host drive loop. A call runs as one loop on the caller's thread: each pass runs the
//! local steps whose dependencies are done (copies, the final division of Avg) and, per
//! peer, the head send and the head receive of its queues, each making what progress the
//! transport allows without blocking; a receive reduces straight out of the transport's
//! buffer ([`Sink`]). [`Engine::end_pass`] paces the passes. The device path's loop is in
//! [`super::staged`]; both run on the reusable [`Scratch`] that [`Engine::with_scratch`]
//! prepares.

use std::time::Instant;

use super::frame::{Acc, Desc, Descs, Sink};
use super::pace::Pacer;
use super::scratch::Scratch;
use super::{trace, Engine};
use crate::error::{Error, Result};
use crate::plan::{Buf, Loc, Op, Program};
use crate::reduce;
use crate::types::{human_bytes, DataType, ReduceOp};

/// The bytes of `loc` in a buffer of `esz`-byte elements.
pub(super) fn byte_range(loc: &Loc, esz: usize) -> std::ops::Range<usize> {
    loc.start * esz..(loc.start + loc.len) * esz
}

impl Engine {
    /// Runs `prog` with the call's descriptor `desc` on host buffers.
    pub(super) fn execute(
        &mut self,
        prog: &Program,
        desc: &Desc,
        full_op: ReduceOp,
        op: ReduceOp,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        let n = prog.steps.len();
        if n == 0 {
            return Ok(());
        }
        let esz = desc.dtype.size();
        self.with_scratch(prog, |eng, s, start, deadline| {
            let descs = Descs {
                send: desc,
                recv: desc,
                per_peer: None,
            };
            eng.drive(prog, descs, full_op, op, src, dst, esz, start, deadline, s)
        })
    }

    /// Runs `drive` with the reusable scratch state prepared for `prog` and the call's start
    /// and deadline (shared by the host and device drive loops).
    pub(super) fn with_scratch(
        &mut self,
        prog: &Program,
        drive: impl FnOnce(&mut Self, &mut Scratch, Instant, Instant) -> Result<()>,
    ) -> Result<()> {
        let start = self.fl.t0.take().unwrap_or_else(Instant::now);
        let timeout = self.call_timeout.unwrap_or(self.opts.timeout);
        let deadline = crate::time::deadline(start, timeout);
        let mut s = std::mem::take(&mut self.scratch);
        s.prepare(self.world, prog);
        let res = drive(self, &mut s, start, deadline);
        if res.is_err() {
            self.flight_stall(prog, &s);
        }
        self.scratch = s;
        res?;
        // Delivered before the call returns: this rank may exit at once (#11 item 1).
        self.transport.flush(deadline)
    }

    /// The host drive loop: passes over the steps whose dependencies are done, local steps and
    /// the head send and receive of each peer, each making what progress the transport allows
    /// without blocking, until every step is done; [`Engine::end_pass`] paces it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn drive(
        &mut self,
        prog: &Program,
        descs: Descs<'_>,
        full_op: ReduceOp,
        op: ReduceOp,
        src: &[u8],
        dst: &mut [u8],
        esz: usize,
        start: Instant,
        deadline: Instant,
        s: &mut Scratch,
    ) -> Result<()> {
        let desc = descs.send;
        let mut pacer = Pacer::new(&self.opts, self.spin.now(), start, deadline);
        let ready = |done: &[bool], i: u32| prog.deps(i as usize).iter().all(|&d| done[d as usize]);
        loop {
            let mut moved = false;

            // Local steps: copies and the final division of Avg.
            let mut k = 0;
            while k < s.local.len() {
                let i = s.local[k];
                if ready(&s.done, i) {
                    run_local(
                        &prog.steps[i as usize].op,
                        desc.dtype,
                        full_op,
                        self.world,
                        esz,
                        src,
                        dst,
                    );
                    s.complete(i);
                    moved = true;
                    s.local.swap_remove(k);
                } else {
                    k += 1;
                }
            }

            for ai in 0..s.active.len() {
                let p = s.active[ai];
                // Sends to p, in order.
                while let Some(&i) = s.sendq[p].front() {
                    if !ready(&s.done, i) {
                        break;
                    }
                    let Op::Send { src: loc, .. } = prog.steps[i as usize].op else {
                        return Err(internal("non-send step in a send queue"));
                    };
                    let r = byte_range(&loc, esz);
                    let data = match loc.buf {
                        Buf::Src => &src[r],
                        Buf::Dst => &dst[r],
                    };
                    let hdr = descs.header_to(p, data.len());
                    if self.trace.is_some() && s.send_started[p].is_none() {
                        s.send_started[p] = Some(Instant::now());
                    }
                    let before = s.send_prog[p].written;
                    let fin = self.transport.send(p, &hdr, data, &mut s.send_prog[p])?;
                    moved |= s.send_prog[p].written != before;
                    if !fin {
                        break;
                    }
                    self.trace_send(s, p, i, data.len());
                    s.complete_send(p, i);
                    moved = true;
                }
                // Receives from p, in order.
                while let Some(&i) = s.recvq[p].front() {
                    if !ready(&s.done, i) {
                        break;
                    }
                    let Op::Recv { dst: dloc, acc, .. } = prog.steps[i as usize].op else {
                        return Err(internal("non-receive step in a receive queue"));
                    };
                    if self.trace.is_some() && s.recv_started[p].is_none() {
                        s.recv_started[p] = Some(Instant::now());
                    }
                    let before = (s.recv_prog[p].header.is_some(), s.recv_prog[p].got);
                    let done_bytes = s.recv_prog[p].got;
                    let dr = byte_range(&dloc, esz);
                    let len = dr.len();
                    let fin = {
                        let (dseg, acc) = match acc {
                            None => (&mut dst[dr], Acc::None),
                            Some(a) if a == dloc => (&mut dst[dr], Acc::InPlace),
                            Some(a) if a.buf == Buf::Src => {
                                (&mut dst[dr], Acc::From(&src[byte_range(&a, esz)]))
                            }
                            Some(a) => {
                                let (d, a) = split_disjoint(dst, dr, byte_range(&a, esz))
                                    .ok_or_else(|| internal("overlapping accumulator"))?;
                                (d, Acc::From(a))
                            }
                        };
                        let from = descs.recv_from(p);
                        let mut sink = Sink {
                            rank: self.rank,
                            peer: p,
                            desc: &from,
                            len,
                            dst: dseg,
                            acc,
                            op,
                            esz,
                            done: done_bytes,
                        };
                        self.transport.recv(p, &mut s.recv_prog[p], &mut sink)?
                    };
                    moved |= (s.recv_prog[p].header.is_some(), s.recv_prog[p].got) != before;
                    if !fin {
                        break;
                    }
                    self.trace_recv(s, p, i, len, acc.is_some());
                    s.complete_recv(p, i);
                    moved = true;
                }
            }

            if s.remaining == 0 {
                self.spin.learn(pacer.finish());
                return Ok(());
            }
            self.end_pass(&mut pacer, moved, prog, desc, s, false)?;
        }
    }

    /// Ends the trace span of the head send to `p` (step `i`, `len` bytes).
    pub(super) fn trace_send(&mut self, s: &mut Scratch, p: usize, i: u32, len: usize) {
        if let (Some(t), Some(t0)) = (self.trace.as_mut(), s.send_started[p].take()) {
            let name = format!("send {}", human_bytes(len as u64, false));
            let args = [("step", i.to_string()), ("bytes", len.to_string())];
            t.span(
                trace::Lane::Send(p),
                "send",
                &name,
                t0,
                Instant::now(),
                &args,
            );
        }
    }

    /// Ends the trace span of the head receive from `p` (step `i`, `len` bytes).
    pub(super) fn trace_recv(
        &mut self,
        s: &mut Scratch,
        p: usize,
        i: u32,
        len: usize,
        reduces: bool,
    ) {
        if let (Some(t), Some(t0)) = (self.trace.as_mut(), s.recv_started[p].take()) {
            let kind = if reduces { "recv+reduce" } else { "recv" };
            let name = format!("{kind} {}", human_bytes(len as u64, false));
            let args = [("step", i.to_string()), ("bytes", len.to_string())];
            t.span(trace::Lane::Recv(p), kind, &name, t0, Instant::now(), &args);
        }
    }
}

/// An internal error of the engine (a broken invariant), reported as a transport error.
pub(super) fn internal(what: &str) -> Error {
    Error::Transport {
        rank: None,
        peer: None,
        op: "engine".into(),
        what: format!("internal error: {what}"),
    }
}

/// Mutable `a` and shared `b` from one buffer, if the ranges are disjoint.
fn split_disjoint(
    buf: &mut [u8],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> Option<(&mut [u8], &[u8])> {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        Some((&mut lo[a], &hi[..b.len()]))
    } else if b.end <= a.start {
        let (lo, hi) = buf.split_at_mut(a.start);
        Some((&mut hi[..a.len()], &lo[b]))
    } else {
        None
    }
}

fn run_local(
    op: &Op,
    dtype: DataType,
    full_op: ReduceOp,
    world: usize,
    esz: usize,
    src: &[u8],
    dst: &mut [u8],
) {
    match *op {
        Op::Copy { src: s, dst: d } => {
            let dr = byte_range(&d, esz);
            match s.buf {
                Buf::Src => dst[dr].copy_from_slice(&src[byte_range(&s, esz)]),
                Buf::Dst => dst.copy_within(byte_range(&s, esz), dr.start),
            }
        }
        Op::Finalize { loc } => {
            reduce::finalize(dtype, full_op, &mut dst[byte_range(&loc, esz)], world)
        }
        Op::Send { .. } | Op::Recv { .. } => {}
    }
}
