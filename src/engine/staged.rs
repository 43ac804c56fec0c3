//! The host-staged path: collectives on device memory through pinned host slots.
//!
//! This is what a broken GPUDirect setup degrades to, kept on purpose and made fair: every
//! segment is staged separately and the stages overlap. While segment k is on the wire,
//! segment k+1 is being copied device → host (sends are staged ahead of their turn), and
//! segment k−1, already received, is being copied host → device and reduced there by a
//! device kernel. All device work is ordered on one stream, so a step that only *enqueues*
//! device work is complete as far as later steps are concerned: a later copy-out of the same
//! range runs after it on the stream.
//!
//! The device side is the [`StagedDevice`] trait: CUDA implements it (see [`crate::gpu`]), and
//! [`EmulatedDevice`] implements it in host memory with deliberately late completions, so the
//! pipelining and ordering logic is tested on machines without a GPU.
//!
//! Memory: `send_slots + recv_slots` pinned buffers of one segment each, whatever the message
//! size. Send and receive slots are separate pools, so receives always progress and a rank can
//! never fill every slot with sends its peer cannot take. Within a pool, the last free slot is
//! kept for the earliest step of the program that is not done, so a later step waiting on one
//! peer never holds the slot an earlier step to another peer needs (with one slot per pool, a
//! rank stages its sends and its receives in program order).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::drive::{byte_range, internal};
use super::frame::{Acc, Descs, Sink};
use super::pace::Pacer;
use super::scratch::Scratch;
use super::trace::Lane;
use super::{Call, Engine};
use crate::error::{Error, Result};
use crate::plan::{Buf, Op, Program};
use crate::reduce;
use crate::transport::{no_direct_region, DirectLayout, DirectTransport, RegionAccess, Transport};
use crate::types::{human_bytes, DataType, ReduceOp};

/// A byte range of one of the device buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevRange {
    /// Which buffer.
    pub buf: Buf,
    /// Byte range in it.
    pub bytes: Range<usize>,
}

/// The device operations of the staged path. Everything is asynchronous and ordered on one
/// stream; [`StagedDevice::mark`] / [`StagedDevice::reached`] observe progress.
///
/// Slots `0..send_slots()` stage outgoing segments, `send_slots()..send_slots() +
/// recv_slots()` incoming ones; each holds [`StagedDevice::slot_bytes`] bytes of pinned host
/// memory. The engine reads a send slot only after the mark following its copy-out is
/// reached, and reuses a receive slot only after the mark following its copy-in is reached.
pub trait StagedDevice {
    /// Number of send slots (≥ 1).
    fn send_slots(&self) -> usize;
    /// Number of receive slots (≥ 1).
    fn recv_slots(&self) -> usize;
    /// Bytes per slot (≥ the engine's segment size).
    fn slot_bytes(&self) -> usize;
    /// Host view of slot `i`.
    fn slot(&self, i: usize) -> &[u8];
    /// Mutable host view of slot `i`.
    fn slot_mut(&mut self, i: usize) -> &mut [u8];
    /// Enqueues device `src` → slot `slot` (from its start).
    fn d2h(&mut self, src: &DevRange, slot: usize) -> Result<()>;
    /// Enqueues slot `slot` (first `dst.len()` bytes) → device `Dst[dst]`.
    fn h2d(&mut self, slot: usize, dst: Range<usize>) -> Result<()>;
    /// Enqueues `Dst[dst] = acc ⊕ slot` (copy-in to device scratch, then a reduction kernel).
    fn h2d_reduce(
        &mut self,
        slot: usize,
        dst: Range<usize>,
        acc: &DevRange,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()>;
    /// Enqueues a device-to-device copy `src` → `Dst[dst]`.
    fn copy(&mut self, src: &DevRange, dst: Range<usize>) -> Result<()>;
    /// Enqueues the final step of `op` (Avg: divide by `world`) on `Dst[dst]`.
    fn finalize(
        &mut self,
        dst: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
        world: usize,
    ) -> Result<()>;
    /// Marks the current end of the stream; returns the mark.
    fn mark(&mut self) -> Result<u64>;
    /// Whether everything enqueued before `mark` has completed (polls; never blocks).
    fn reached(&mut self, mark: u64) -> Result<bool>;
    /// Blocks until everything enqueued so far has completed, or `deadline`.
    fn synchronize(&mut self, deadline: Instant) -> Result<()>;
    /// One line for logs and the bench header.
    fn describe(&self) -> String;
    /// Sizes in bytes of the device `Src` and `Dst` buffers (checked against the call).
    fn buffer_bytes(&self) -> (usize, usize);

    /// Whether this device moves data *directly* (GPUDirect RDMA): its send slots are the send
    /// slots of the transport's direct region ([`crate::transport::DirectLayout`]) — `d2h`
    /// copies into them on the device, `slot`/`slot_mut` and the receive slots are unused —
    /// and payloads land in the region, consumed with [`StagedDevice::land`]. `false` (the
    /// default): pinned host slots, the host-staged path.
    fn direct(&self) -> bool {
        false
    }

    /// Direct mode: the identity of the region this device's slots live in, which must be the
    /// transport's ([`crate::transport::DirectTransport::direct_base`]).
    fn direct_base(&self) -> Option<u64> {
        None
    }

    /// Direct mode: enqueues `Dst[dst] = region[offset..]` (`acc` `None`) or `Dst[dst] = acc ⊕
    /// region[offset..]`, reading `dst.len()` bytes that the NIC wrote at `offset` of the
    /// direct region — after making those writes visible to the device (flush).
    fn land(
        &mut self,
        offset: usize,
        dst: Range<usize>,
        acc: Option<&DevRange>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let _ = (offset, dst, acc, dtype, op);
        Err(internal("this device has no direct region"))
    }
}

/// What frees up when a device mark is reached after a receive was consumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// A pinned receive slot (host-staged).
    Slot(usize),
    /// The oldest landing slot held from a peer (direct).
    Landing(usize),
}

/// How far ahead of its turn a send is staged (per peer).
const PREFETCH: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SendState {
    Idle,
    Staging { slot: usize, mark: u64 },
    Ready { slot: usize },
}

fn dev_range(loc: &crate::plan::Loc, esz: usize) -> DevRange {
    DevRange {
        buf: loc.buf,
        bytes: byte_range(loc, esz),
    }
}

/// The transport's direct-region capability for the direct operation `op` with `peer`, or
/// [`no_direct_region`]'s error when it has none.
fn direct_of<'t>(
    t: &'t mut dyn Transport,
    op: &str,
    peer: usize,
) -> Result<&'t mut dyn DirectTransport> {
    t.direct_mut().ok_or_else(|| no_direct_region(op, peer))
}

/// Whether the direct send to `peer` that left `token` finished reading its payload (at once
/// on a transport without direct regions, which leaves no such sends).
fn direct_send_done(t: &mut dyn Transport, peer: usize, token: u64) -> Result<bool> {
    t.direct_mut()
        .map_or(Ok(true), |d| d.direct_send_done(peer, token))
}

/// Gives back the oldest landing slot held from `peer` (nothing to give back on a transport
/// without direct regions).
fn release_direct(t: &mut dyn Transport, peer: usize) -> Result<()> {
    t.direct_mut().map_or(Ok(()), |d| d.release_direct(peer))
}

/// The staged path's per-call bookkeeping, kept in the engine's [`Scratch`] between calls so
/// that a collective allocates nothing once the vectors have grown to size.
#[derive(Debug, Default)]
pub(super) struct StagedScratch {
    /// Per step: how far its send slot is.
    send_state: Vec<SendState>,
    /// Steps of `send_state` in [`SendState::Staging`] (device copies in flight).
    staging: usize,
    free_send: Vec<usize>,
    free_recv: Vec<usize>,
    /// Per peer: the receive slot its head receive is landing in.
    recv_slot: Vec<Option<usize>>,
    /// What frees up when each device mark is reached, in mark order.
    landing: VecDeque<(Held, u64)>,
    /// Direct send slots posted but still being read by the NIC: (slot, peer, token).
    draining: Vec<(usize, usize, u64)>,
    /// While tracing: per step, when its copy-out was enqueued; per `landing` entry (same
    /// order), when its copy-in was enqueued, what it is and its bytes.
    d2h_started: Vec<Option<Instant>>,
    landing_t: VecDeque<(Instant, &'static str, usize)>,
    /// A one-shot all_reduce's host copy of the device buffer ([`super::staged_oneshot`]).
    pub(super) one_shot_host: Vec<u8>,
}

impl StagedScratch {
    /// Resets for a call of `steps` steps on a device with the given slot pools.
    fn reset(&mut self, steps: usize, send_slots: usize, recv_slots: usize, world: usize) {
        self.send_state.clear();
        self.send_state.resize(steps, SendState::Idle);
        self.staging = 0;
        self.free_send.clear();
        self.free_send.extend((0..send_slots).rev());
        self.free_recv.clear();
        self.free_recv
            .extend((send_slots..send_slots + recv_slots).rev());
        self.recv_slot.clear();
        self.recv_slot.resize(world, None);
        self.landing.clear();
        self.draining.clear();
        self.d2h_started.clear();
        self.d2h_started.resize(steps, None);
        self.landing_t.clear();
    }
}

impl Engine {
    /// Runs `call` on device buffers through `dev` (the host-staged path). Same semantics,
    /// frames and errors as [`Engine::run`]; the peers cannot tell the difference.
    pub fn run_staged(&mut self, call: &Call, dev: &mut dyn StagedDevice) -> Result<()> {
        // An earlier failure first, before anything about the device is judged.
        if let Some(e) = &self.poison {
            return Err(e.clone());
        }
        // A device that cannot run the call fails it here, on this rank, while the peers are
        // in it already: the same fail-and-tell path as a failure half-way, never a quiet
        // return that leaves them waiting out the deadline and this rank a call behind.
        let direct = match self.check_device(dev) {
            Ok(d) => d,
            Err(e) => return Err(self.fail_before_start(call, e)),
        };
        // A small all_reduce that the host ranks run one-shot through the transport's slots
        // runs so here too, on a host copy: the peers cannot tell (no frames either way).
        if self.runs_one_shot(call) {
            return self.run_staged_one_shot(call, dev, direct.is_some());
        }
        let lens = dev.buffer_bytes();
        let path = if direct.is_some() {
            super::flight::FlightPath::GpuDirect
        } else {
            super::flight::FlightPath::HostStaged
        };
        self.guarded(call, lens, path, |eng, prog, desc| {
            let full = call.op.unwrap_or(ReduceOp::Sum);
            let descs = Descs {
                send: &desc,
                recv: &desc,
                per_peer: None,
            };
            eng.execute_staged(&prog, &descs, full, dev, direct)
        })
    }

    /// Whether `dev` can run a call: slots that hold a segment, and for a direct device, the
    /// transport's direct region (its layout is returned).
    pub(super) fn check_device(&self, dev: &dyn StagedDevice) -> Result<Option<DirectLayout>> {
        if dev.send_slots() == 0
            || (dev.recv_slots() == 0 && !dev.direct())
            || dev.slot_bytes() < self.opts.segment_bytes
        {
            return Err(internal(
                "staging device has no slots or slots smaller than a segment",
            ));
        }
        if dev.direct() {
            Ok(Some(self.direct_layout_for(dev)?))
        } else {
            Ok(None)
        }
    }

    /// The transport's direct region layout, checked to be the region `dev` (a direct device)
    /// stages into and to hold its send slots.
    fn direct_layout_for(&self, dev: &dyn StagedDevice) -> Result<DirectLayout> {
        let direct = self.transport.direct();
        let Some(l) = direct.and_then(|d| d.direct_layout()) else {
            return Err(Error::invalid(
                Some(self.rank),
                "direct device collective",
                "the transport has no direct region (GPUDirect RDMA was not set up at init)",
            ));
        };
        let base = direct.and_then(|d| d.direct_base());
        if dev.direct_base().is_none() || dev.direct_base() != base {
            return Err(internal(&format!(
                "the device's direct region ({:?}) is not the one registered with the \
                 transport ({:?}): the NIC would move other memory",
                dev.direct_base(),
                base
            )));
        }
        if l.send_slots < dev.send_slots() || l.slot_bytes < dev.slot_bytes() {
            return Err(internal(&format!(
                "the device's {} send slots of {} bytes do not fit the transport's \
                 direct region ({l:?})",
                dev.send_slots(),
                dev.slot_bytes()
            )));
        }
        Ok(l)
    }

    /// Runs `prog` on `dev`'s buffers; `descs` gives the frames' descriptors (per peer for an
    /// all_to_all_v, [`Engine::run_staged_all_to_all_v`]).
    pub(super) fn execute_staged(
        &mut self,
        prog: &Program,
        descs: &Descs<'_>,
        full_op: ReduceOp,
        dev: &mut dyn StagedDevice,
        direct: Option<DirectLayout>,
    ) -> Result<()> {
        self.with_scratch(prog, |eng, s, start, deadline| {
            let mut st = std::mem::take(&mut s.staged);
            st.reset(
                prog.steps.len(),
                dev.send_slots(),
                dev.recv_slots(),
                eng.world,
            );
            let res = eng.drive_staged(
                prog, descs, full_op, dev, direct, start, deadline, s, &mut st,
            );
            s.staged = st;
            res
        })
    }

    /// The staged drive loop; `direct` is the transport's direct layout when `dev` moves data
    /// directly (checked by [`Engine::run_staged`]), `None` for pinned host slots.
    #[allow(clippy::too_many_arguments)]
    fn drive_staged(
        &mut self,
        prog: &Program,
        descs: &Descs<'_>,
        full_op: ReduceOp,
        dev: &mut dyn StagedDevice,
        direct: Option<DirectLayout>,
        start: Instant,
        deadline: Instant,
        s: &mut Scratch,
        st: &mut StagedScratch,
    ) -> Result<()> {
        let desc = descs.send;
        let esz = desc.dtype.size();
        let op = full_op.step_op();
        let StagedScratch {
            send_state,
            staging,
            free_send,
            free_recv,
            recv_slot,
            landing,
            draining,
            d2h_started,
            landing_t,
            one_shot_host: _,
        } = st;
        let tracing = self.trace.is_some();
        if direct.is_some() {
            for &p in &s.active {
                if !self.transport.direct().is_some_and(|d| d.direct_peer(p)) {
                    return Err(Error::invalid(
                        Some(self.rank),
                        "direct device collective",
                        format!("rank {p} has no direct region: its connection is host-staged"),
                    ));
                }
            }
        }
        let mut pacer = Pacer::new(&self.opts, self.spin.now(), start, deadline);
        let ready = |done: &[bool], i: u32| prog.deps(i as usize).iter().all(|&d| done[d as usize]);

        loop {
            let mut moved = false;

            // Receive slots whose copy-in finished are free again (marks complete in order).
            while let Some(&(held, mark)) = landing.front() {
                if !dev.reached(mark)? {
                    break;
                }
                landing.pop_front();
                if let (Some(t), Some((t0, what, bytes))) =
                    (self.trace.as_mut(), landing_t.pop_front())
                {
                    let name = format!("{what} {}", human_bytes(bytes as u64, false));
                    let args = [("bytes", bytes.to_string())];
                    t.span(Lane::Device, what, &name, t0, Instant::now(), &args);
                }
                match held {
                    Held::Slot(slot) => free_recv.push(slot),
                    Held::Landing(p) => release_direct(&mut *self.transport, p)?,
                }
                moved = true;
            }
            let mut k = 0;
            while k < draining.len() {
                let (slot, p, token) = draining[k];
                if direct_send_done(&mut *self.transport, p, token)? {
                    draining.swap_remove(k);
                    free_send.push(slot);
                    moved = true;
                } else {
                    k += 1;
                }
            }

            // Local steps only enqueue device work.
            let mut k = 0;
            while k < s.local.len() {
                let i = s.local[k];
                if !ready(&s.done, i) {
                    k += 1;
                    continue;
                }
                match prog.steps[i as usize].op {
                    Op::Copy { src, dst } => {
                        dev.copy(&dev_range(&src, esz), byte_range(&dst, esz))?;
                    }
                    Op::Finalize { loc } => {
                        dev.finalize(byte_range(&loc, esz), desc.dtype, full_op, self.world)?;
                    }
                    _ => return Err(internal("transfer step in the local queue")),
                }
                s.complete(i);
                moved = true;
                s.local.swap_remove(k);
            }

            // The earliest send and receive steps not yet done, over every peer: the last free
            // slot of each pool is kept for them. Slots go to any ready step while more than
            // one is free, so sends and receives to several peers overlap; but a step later in
            // the program that took the last slot and then waited on its peer (who may be
            // waiting for this rank's earlier step, to another peer) would hold it forever:
            // with two slots, the double binary tree on 5 ranks deadlocked that way.
            let earliest =
                |q: &[VecDeque<u32>]| s.active.iter().filter_map(|&p| q[p].front()).min().copied();
            let (first_send, first_recv) = (earliest(&s.sendq), earliest(&s.recvq));
            for ai in 0..s.active.len() {
                let p = s.active[ai];

                // Stage the first sends of this peer's queue as soon as their data is final.
                for &i in s.sendq[p].iter().take(PREFETCH) {
                    let iu = i as usize;
                    let Op::Send { src, .. } = prog.steps[iu].op else {
                        return Err(internal("non-send step in a send queue"));
                    };
                    if send_state[iu] != SendState::Idle || src.len == 0 || !ready(&s.done, i) {
                        continue;
                    }
                    if free_send.len() == 1 && Some(i) != first_send {
                        break;
                    }
                    let Some(slot) = free_send.pop() else { break };
                    if tracing {
                        d2h_started[iu] = Some(Instant::now());
                    }
                    dev.d2h(&dev_range(&src, esz), slot)?;
                    let mark = dev.mark()?;
                    send_state[iu] = SendState::Staging { slot, mark };
                    *staging += 1;
                    moved = true;
                }

                // The head send goes out once its copy-out has landed.
                while let Some(&i) = s.sendq[p].front() {
                    let iu = i as usize;
                    if !ready(&s.done, i) {
                        break;
                    }
                    let Op::Send { src, .. } = prog.steps[iu].op else {
                        return Err(internal("non-send step in a send queue"));
                    };
                    let len = src.len * esz;
                    if let SendState::Staging { slot, mark } = send_state[iu] {
                        if !dev.reached(mark)? {
                            break;
                        }
                        if let (Some(t), Some(t0)) = (self.trace.as_mut(), d2h_started[iu].take()) {
                            let name = format!("d2h {}", human_bytes(len as u64, false));
                            let args = [("bytes", len.to_string()), ("step", i.to_string())];
                            t.span(Lane::Device, "d2h", &name, t0, Instant::now(), &args);
                        }
                        send_state[iu] = SendState::Ready { slot };
                        *staging = staging.saturating_sub(1);
                    }
                    let hdr = descs.header_to(p, len);
                    if tracing && s.send_started[p].is_none() {
                        s.send_started[p] = Some(Instant::now());
                    }
                    let before = s.send_prog[p].written;
                    let fin = match (send_state[iu], direct) {
                        (SendState::Ready { slot }, Some(l)) => direct_of(
                            &mut *self.transport,
                            "send_direct",
                            p,
                        )?
                        .send_direct(p, &hdr, l.send(slot), &mut s.send_prog[p])?,
                        (SendState::Ready { slot }, None) => {
                            let data = dev.slot(slot).get(..len).ok_or_else(|| {
                                internal("a send slot is smaller than its segment")
                            })?;
                            self.transport.send(p, &hdr, data, &mut s.send_prog[p])?
                        }
                        (SendState::Idle, _) if len == 0 => {
                            self.transport.send(p, &hdr, &[], &mut s.send_prog[p])?
                        }
                        _ => break, // waiting for a slot
                    };
                    moved |= s.send_prog[p].written != before;
                    if !fin {
                        break;
                    }
                    self.trace_send(s, p, i, len);
                    if let SendState::Ready { slot } = send_state[iu] {
                        match s.send_prog[p].token {
                            t if direct.is_some() && t != 0 => draining.push((slot, p, t)),
                            _ => free_send.push(slot),
                        }
                    }
                    s.complete_send(p, i);
                    moved = true;
                }

                // The head receive lands in a slot, then is copied in (and reduced) on device.
                while let Some(&i) = s.recvq[p].front() {
                    let iu = i as usize;
                    if !ready(&s.done, i) {
                        break;
                    }
                    let Op::Recv { dst, acc, .. } = prog.steps[iu].op else {
                        return Err(internal("non-receive step in a receive queue"));
                    };
                    let len = dst.len * esz;
                    if tracing && s.recv_started[p].is_none() {
                        s.recv_started[p] = Some(Instant::now());
                    }
                    if direct.is_some() {
                        let before = (s.recv_prog[p].header.is_some(), s.recv_prog[p].got);
                        let landed = {
                            let from = descs.recv_from(p);
                            let mut sink = Sink {
                                rank: self.rank,
                                peer: p,
                                desc: &from,
                                len,
                                dst: &mut [],
                                acc: Acc::None,
                                op,
                                esz,
                                done: 0,
                            };
                            direct_of(&mut *self.transport, "recv_direct", p)?.recv_direct(
                                p,
                                &mut s.recv_prog[p],
                                &mut sink,
                            )?
                        };
                        moved |= (s.recv_prog[p].header.is_some(), s.recv_prog[p].got) != before;
                        let Some(landed) = landed else { break };
                        if landed.len != len {
                            return Err(internal("a direct frame landed with the wrong length"));
                        }
                        if len > 0 {
                            let dr = byte_range(&dst, esz);
                            let acc = acc.map(|a| dev_range(&a, esz));
                            let what = if acc.is_some() { "land+reduce" } else { "land" };
                            let t0 = Instant::now();
                            dev.land(landed.offset, dr, acc.as_ref(), desc.dtype, op)?;
                            landing.push_back((Held::Landing(p), dev.mark()?));
                            if tracing {
                                landing_t.push_back((t0, what, len));
                            }
                        }
                        self.trace_recv(s, p, i, len, acc.is_some());
                        s.complete_recv(p, i);
                        moved = true;
                        continue;
                    }
                    if len > 0 && recv_slot[p].is_none() {
                        if free_recv.len() == 1 && Some(i) != first_recv {
                            break;
                        }
                        match free_recv.pop() {
                            Some(slot) => recv_slot[p] = Some(slot),
                            None => break,
                        }
                    }
                    let before = (s.recv_prog[p].header.is_some(), s.recv_prog[p].got);
                    let fin = {
                        let from = descs.recv_from(p);
                        let mut empty: [u8; 0] = [];
                        let buf: &mut [u8] = match recv_slot[p] {
                            Some(slot) => dev.slot_mut(slot).get_mut(..len).ok_or_else(|| {
                                internal("a receive slot is smaller than its segment")
                            })?,
                            None => &mut empty,
                        };
                        let mut sink = Sink {
                            rank: self.rank,
                            peer: p,
                            desc: &from,
                            len,
                            dst: buf,
                            acc: Acc::None,
                            op,
                            esz,
                            done: s.recv_prog[p].got,
                        };
                        self.transport.recv(p, &mut s.recv_prog[p], &mut sink)?
                    };
                    moved |= (s.recv_prog[p].header.is_some(), s.recv_prog[p].got) != before;
                    if !fin {
                        break;
                    }
                    if let Some(slot) = recv_slot[p].take() {
                        let dr = byte_range(&dst, esz);
                        if tracing {
                            let what = if acc.is_some() { "h2d+reduce" } else { "h2d" };
                            landing_t.push_back((Instant::now(), what, len));
                        }
                        match acc {
                            None => dev.h2d(slot, dr)?,
                            Some(a) => {
                                dev.h2d_reduce(slot, dr, &dev_range(&a, esz), desc.dtype, op)?
                            }
                        }
                        landing.push_back((Held::Slot(slot), dev.mark()?));
                    }
                    self.trace_recv(s, p, i, len, acc.is_some());
                    s.complete_recv(p, i);
                    moved = true;
                }
            }

            if s.remaining == 0 && draining.is_empty() {
                // Results in place and every slot free before returning.
                dev.synchronize(deadline).map_err(|e| match e {
                    Error::Timeout { .. } => Error::Timeout {
                        rank: self.rank,
                        peer: None,
                        op: format!("{} #{}", desc.coll.name(), desc.seq),
                        waited: start.elapsed(),
                        detail: "waiting for the device to finish the last copies".into(),
                    },
                    e => e,
                })?;
                // Everything was consumed: landing slots still held go back to their senders.
                if let Some(t) = self.trace.as_mut() {
                    let now = Instant::now();
                    for (t0, what, bytes) in landing_t.drain(..) {
                        let name = format!("{what} {}", human_bytes(bytes as u64, false));
                        let args = [("bytes", bytes.to_string())];
                        t.span(Lane::Device, what, &name, t0, now, &args);
                    }
                }
                for (held, _) in landing.drain(..) {
                    if let Held::Landing(p) = held {
                        release_direct(&mut *self.transport, p)?;
                    }
                }
                self.spin.learn(pacer.finish());
                return Ok(());
            }
            // Device completions are not file descriptors, and copying one segment takes
            // microseconds: while device work is in flight, keep polling (yielding the CPU)
            // instead of sleeping in the transport.
            let device_busy = !landing.is_empty() || !draining.is_empty() || *staging > 0;
            self.end_pass(&mut pacer, moved, prog, desc, s, device_busy)?;
        }
    }
}

/// Device operations in host memory, for testing the staged path without a GPU.
///
/// "Device" buffers are plain vectors; every operation is queued and performed late — a few
/// at a time, when the engine polls — so an engine that read a slot before its copy-out
/// completed, or reused a slot before its copy-in completed, would move wrong data.
#[derive(Debug)]
pub struct EmulatedDevice {
    /// Device input buffer (out-of-place collectives).
    pub src: Vec<u8>,
    /// Device output buffer.
    pub dst: Vec<u8>,
    slots: Vec<Vec<u8>>,
    send_slots: usize,
    slot_bytes: usize,
    queue: VecDeque<EmuOp>,
    next_mark: u64,
    done_mark: u64,
    rng: u64,
    /// Operations performed so far (for tests that check the pipeline really overlapped).
    pub performed: usize,
    /// Direct mode: the transport's region (host memory standing in for GPU memory).
    region: Option<(Arc<dyn RegionAccess>, DirectLayout)>,
    /// Direct mode: landed payloads consumed so far.
    pub landed: usize,
    /// A region access that failed in a deferred operation, reported by the next poll.
    fault: Option<String>,
}

#[derive(Debug)]
enum EmuOp {
    D2h {
        src: DevRange,
        slot: usize,
    },
    H2d {
        slot: usize,
        dst: Range<usize>,
    },
    H2dReduce {
        slot: usize,
        dst: Range<usize>,
        acc: DevRange,
        dtype: DataType,
        op: ReduceOp,
    },
    Copy {
        src: DevRange,
        dst: Range<usize>,
    },
    Finalize {
        dst: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
        world: usize,
    },
    Land {
        offset: usize,
        dst: Range<usize>,
        acc: Option<DevRange>,
        dtype: DataType,
        op: ReduceOp,
    },
    Mark(u64),
}

impl EmulatedDevice {
    /// An emulated device holding `src` and `dst`, with the given slot pools; `seed` drives
    /// how late operations complete.
    pub fn new(
        src: Vec<u8>,
        dst: Vec<u8>,
        send_slots: usize,
        recv_slots: usize,
        slot_bytes: usize,
        seed: u64,
    ) -> Self {
        EmulatedDevice {
            src,
            dst,
            slots: vec![vec![0xA5; slot_bytes]; send_slots + recv_slots],
            send_slots,
            slot_bytes,
            queue: VecDeque::new(),
            next_mark: 0,
            done_mark: 0,
            rng: seed | 1,
            performed: 0,
            region: None,
            landed: 0,
            fault: None,
        }
    }

    /// The failure of a deferred region access, if one happened.
    fn fault_check(&self) -> Result<()> {
        match &self.fault {
            Some(f) => Err(internal(&format!("emulated device: {f}"))),
            None => Ok(()),
        }
    }

    /// An emulated device in *direct* mode over a transport's host-memory direct region
    /// ([`DirectTransport::direct_host_region`]):
    /// the GPUDirect protocol without a GPU. Its `send_slots` send slots are the region's;
    /// operations complete late as in the staged mode, so releasing a landing slot before its
    /// consumer ran would let the sender overwrite data still to be read.
    pub fn direct(
        src: Vec<u8>,
        dst: Vec<u8>,
        region: Arc<dyn RegionAccess>,
        layout: DirectLayout,
        send_slots: usize,
        seed: u64,
    ) -> Self {
        let mut d = Self::new(
            src,
            dst,
            send_slots.min(layout.send_slots),
            0,
            layout.slot_bytes,
            seed,
        );
        d.slots.clear();
        d.region = Some((region, layout));
        d
    }

    fn read(&self, r: &DevRange) -> &[u8] {
        match r.buf {
            Buf::Src => &self.src[r.bytes.clone()],
            Buf::Dst => &self.dst[r.bytes.clone()],
        }
    }

    fn perform_one(&mut self) {
        let Some(op) = self.queue.pop_front() else {
            return;
        };
        self.performed += 1;
        match op {
            EmuOp::D2h { src, slot } => {
                let data = self.read(&src).to_vec();
                match &self.region {
                    Some((r, l)) => {
                        if !r.write(l.send(slot), &data) {
                            self.fault = Some(format!("send slot {slot} is outside the region"));
                        }
                    }
                    None => self.slots[slot][..data.len()].copy_from_slice(&data),
                }
            }
            EmuOp::Land {
                offset,
                dst,
                acc,
                dtype,
                op,
            } => {
                let mut incoming = vec![0u8; dst.len()];
                if let Some((r, _)) = &self.region {
                    if !r.read(offset, &mut incoming) {
                        self.fault = Some(format!(
                            "{} bytes at offset {offset} are outside the region",
                            incoming.len()
                        ));
                    }
                }
                self.landed += 1;
                match acc {
                    None => self.dst[dst].copy_from_slice(&incoming),
                    Some(a) => {
                        let a = self.read(&a).to_vec();
                        reduce::reduce_into(dtype, op, &mut self.dst[dst], &a, &incoming);
                    }
                }
            }
            EmuOp::H2d { slot, dst } => {
                let n = dst.len();
                let data = self.slots[slot][..n].to_vec();
                self.dst[dst].copy_from_slice(&data);
            }
            EmuOp::H2dReduce {
                slot,
                dst,
                acc,
                dtype,
                op,
            } => {
                let n = dst.len();
                let incoming = self.slots[slot][..n].to_vec();
                let a = self.read(&acc).to_vec();
                reduce::reduce_into(dtype, op, &mut self.dst[dst], &a, &incoming);
            }
            EmuOp::Copy { src, dst } => {
                let data = self.read(&src).to_vec();
                self.dst[dst].copy_from_slice(&data);
            }
            EmuOp::Finalize {
                dst,
                dtype,
                op,
                world,
            } => {
                reduce::finalize(dtype, op, &mut self.dst[dst], world);
            }
            EmuOp::Mark(m) => self.done_mark = m,
        }
    }

    fn lag(&mut self) -> usize {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % 3) as usize
    }

    fn check(&self, r: &Range<usize>, len: usize, what: &str) -> Result<()> {
        if r.start > r.end || r.end > len {
            return Err(internal(&format!("{what} range {r:?} beyond {len} bytes")));
        }
        Ok(())
    }

    /// Checks a range of a device buffer.
    fn check_dev(&self, r: &DevRange, what: &str) -> Result<()> {
        let len = match r.buf {
            Buf::Src => self.src.len(),
            Buf::Dst => self.dst.len(),
        };
        self.check(&r.bytes, len, what)
    }

    /// Checks that `len` bytes fit slot `slot`: a copy-out (`send`) in direct mode goes to a
    /// send slot of the region; everything else uses the pinned host slots (none in direct
    /// mode).
    fn check_slot(&self, slot: usize, len: usize, send: bool, what: &str) -> Result<()> {
        let fits = match &self.region {
            Some(_) if send => slot < self.send_slots && len <= self.slot_bytes,
            _ => self.slots.get(slot).is_some_and(|s| len <= s.len()),
        };
        if !fits {
            return Err(internal(&format!(
                "{what}: {len} bytes in slot {slot}, outside the device's slots"
            )));
        }
        Ok(())
    }

    /// Checks that an accumulator (or copy source) has as many bytes as its destination.
    fn check_same_len(&self, r: &DevRange, dst: &Range<usize>, what: &str) -> Result<()> {
        self.check_dev(r, what)?;
        if r.bytes.len() != dst.len() {
            return Err(internal(&format!("{what}: {r:?} does not match {dst:?}")));
        }
        Ok(())
    }
}

impl StagedDevice for EmulatedDevice {
    fn send_slots(&self) -> usize {
        self.send_slots
    }
    fn recv_slots(&self) -> usize {
        self.slots.len().saturating_sub(self.send_slots)
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    /// Empty for a slot that does not exist (as the CUDA devices do).
    fn slot(&self, i: usize) -> &[u8] {
        self.slots.get(i).map_or(&[], Vec::as_slice)
    }
    /// Empty for a slot that does not exist (as the CUDA devices do).
    fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        match self.slots.get_mut(i) {
            Some(s) => s,
            None => &mut [],
        }
    }
    fn d2h(&mut self, src: &DevRange, slot: usize) -> Result<()> {
        self.check_dev(src, "d2h")?;
        self.check_slot(slot, src.bytes.len(), true, "d2h")?;
        self.queue.push_back(EmuOp::D2h {
            src: src.clone(),
            slot,
        });
        Ok(())
    }
    fn h2d(&mut self, slot: usize, dst: Range<usize>) -> Result<()> {
        self.check(&dst, self.dst.len(), "h2d")?;
        self.check_slot(slot, dst.len(), false, "h2d")?;
        self.queue.push_back(EmuOp::H2d { slot, dst });
        Ok(())
    }
    fn h2d_reduce(
        &mut self,
        slot: usize,
        dst: Range<usize>,
        acc: &DevRange,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        self.check(&dst, self.dst.len(), "h2d_reduce")?;
        self.check_slot(slot, dst.len(), false, "h2d_reduce")?;
        self.check_same_len(acc, &dst, "h2d_reduce")?;
        self.queue.push_back(EmuOp::H2dReduce {
            slot,
            dst,
            acc: acc.clone(),
            dtype,
            op,
        });
        Ok(())
    }
    fn copy(&mut self, src: &DevRange, dst: Range<usize>) -> Result<()> {
        self.check(&dst, self.dst.len(), "copy")?;
        self.check_same_len(src, &dst, "copy")?;
        self.queue.push_back(EmuOp::Copy {
            src: src.clone(),
            dst,
        });
        Ok(())
    }
    fn finalize(
        &mut self,
        dst: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
        world: usize,
    ) -> Result<()> {
        self.check(&dst, self.dst.len(), "finalize")?;
        self.queue.push_back(EmuOp::Finalize {
            dst,
            dtype,
            op,
            world,
        });
        Ok(())
    }
    fn mark(&mut self) -> Result<u64> {
        self.next_mark += 1;
        self.queue.push_back(EmuOp::Mark(self.next_mark));
        Ok(self.next_mark)
    }
    fn reached(&mut self, mark: u64) -> Result<bool> {
        for _ in 0..self.lag() {
            self.perform_one();
        }
        self.fault_check()?;
        Ok(self.done_mark >= mark)
    }
    fn synchronize(&mut self, _deadline: Instant) -> Result<()> {
        while !self.queue.is_empty() {
            self.perform_one();
        }
        self.fault_check()
    }
    fn buffer_bytes(&self) -> (usize, usize) {
        (self.src.len(), self.dst.len())
    }
    fn direct(&self) -> bool {
        self.region.is_some()
    }
    fn direct_base(&self) -> Option<u64> {
        self.region.as_ref().map(|(r, _)| r.id())
    }
    fn land(
        &mut self,
        offset: usize,
        dst: Range<usize>,
        acc: Option<&DevRange>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        self.check(&dst, self.dst.len(), "land")?;
        if let Some(a) = acc {
            self.check_same_len(a, &dst, "land")?;
        }
        match &self.region {
            Some((_, l))
                if offset
                    .checked_add(dst.len())
                    .is_some_and(|end| end <= l.len()) => {}
            _ => {
                return Err(internal(&format!(
                    "landing offset {offset} outside the region"
                )))
            }
        }
        self.queue.push_back(EmuOp::Land {
            offset,
            dst,
            acc: acc.cloned(),
            dtype,
            op,
        });
        Ok(())
    }
    fn describe(&self) -> String {
        if let Some((_, l)) = &self.region {
            return format!(
                "emulated device, direct ({} send slots of {} KiB in the transport's region, {} \
                 landing slots per peer)",
                self.send_slots,
                self.slot_bytes / 1024,
                l.slots
            );
        }
        format!(
            "emulated device ({} send + {} receive slots of {} KiB)",
            self.send_slots,
            self.recv_slots(),
            self.slot_bytes / 1024
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Collective;
    use crate::transport::mem::MemFabric;

    fn range(buf: Buf, bytes: Range<usize>) -> DevRange {
        DevRange { buf, bytes }
    }

    #[test]
    fn a_bad_slot_or_range_is_an_error_not_a_panic() {
        let mut d = EmulatedDevice::new(vec![0; 64], vec![0; 64], 1, 1, 16, 7);
        assert!(d.d2h(&range(Buf::Src, 0..8), 2).is_err());
        assert!(d.d2h(&range(Buf::Src, 0..32), 0).is_err());
        assert!(d.h2d(9, 0..8).is_err());
        assert!(d.h2d(1, 0..32).is_err());
        assert!(d
            .h2d_reduce(
                5,
                0..8,
                &range(Buf::Src, 0..8),
                DataType::F32,
                ReduceOp::Sum
            )
            .is_err());
        assert!(d
            .h2d_reduce(
                1,
                0..8,
                &range(Buf::Src, 0..4),
                DataType::F32,
                ReduceOp::Sum
            )
            .is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 8..4;
        assert!(d.copy(&range(Buf::Src, 0..0), backwards).is_err());
        assert!(d.copy(&range(Buf::Src, 0..4), 0..8).is_err());
        assert!(d.slot(9).is_empty() && d.slot_mut(9).is_empty());
        // Valid operations still complete.
        d.d2h(&range(Buf::Src, 0..8), 0).unwrap();
        d.h2d(1, 0..8).unwrap();
        d.synchronize(Instant::now()).unwrap();
        assert_eq!(d.performed, 2);
    }

    #[test]
    fn a_direct_landing_offset_that_overflows_is_an_error() {
        let t = MemFabric::with_direct(1, 4, 2, 64, 2).transport(0);
        let (region, layout) = (t.direct_host_region().unwrap(), t.direct_layout().unwrap());
        let mut d = EmulatedDevice::direct(Vec::new(), vec![0; 64], region, layout, 2, 1);
        let e = d.land(usize::MAX, 0..8, None, DataType::F32, ReduceOp::Sum);
        assert!(e.is_err());
        assert!(d.h2d(0, 0..8).is_err(), "a direct device has no host slots");
    }

    /// A device that cannot run a call fails it before it starts, named with the number the
    /// peers know it by (they are in it already): the error said `all_reduce (engine)`.
    #[test]
    fn a_device_refused_before_the_start_is_named_with_the_calls_number() {
        let opts = super::super::EngineOptions {
            segment_bytes: 1 << 16,
            ..Default::default()
        };
        let mut eng = Engine::new(0, 1, Box::new(MemFabric::new(1, 4).transport(0)), opts);
        let mut call = Call::new(Collective::AllReduce, Some(ReduceOp::Sum), 8, 0, false);
        call.dtype = DataType::F32;
        // Slots of 16 bytes, smaller than a segment.
        let mut d = EmulatedDevice::new(vec![0; 32], vec![0; 32], 1, 1, 16, 7);
        let e = eng.run_staged(&call, &mut d).unwrap_err().to_string();
        assert!(e.contains("all_reduce #1"), "{e}");
    }

    #[test]
    fn a_direct_device_on_a_transport_without_a_region_is_told_so() {
        let other = MemFabric::with_direct(1, 4, 2, 1 << 16, 2).transport(0);
        let region = other.direct_host_region().unwrap();
        let layout = other.direct_layout().unwrap();
        let opts = super::super::EngineOptions {
            segment_bytes: 1 << 16,
            ..Default::default()
        };
        let mut eng = Engine::new(0, 1, Box::new(MemFabric::new(1, 4).transport(0)), opts);
        let mut d = EmulatedDevice::direct(Vec::new(), vec![0; 32], region, layout, 2, 1);
        let mut call = Call::new(Collective::AllReduce, Some(ReduceOp::Sum), 8, 0, false);
        call.dtype = DataType::F32;
        match eng.run_staged(&call, &mut d) {
            Err(Error::InvalidArgument { what, .. }) => {
                assert!(what.contains("no direct region"), "{what}")
            }
            other => panic!("expected an invalid-usage error, got {other:?}"),
        }
    }
}
