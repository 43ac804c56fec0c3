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
//! never fill every slot with sends its peer cannot take.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::{byte_range, internal, Acc, Call, Desc, Engine, Pace, Pacer, Scratch, Sink};
use crate::error::{Error, Result};
use crate::plan::{Buf, Op, Program};
use crate::reduce;
use crate::transport::{DirectLayout, RegionAccess};
use crate::types::{DataType, ReduceOp};

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
    /// transport's ([`crate::transport::Transport::direct_base`]).
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

impl Engine {
    /// Runs `call` on device buffers through `dev` (the host-staged path). Same semantics,
    /// frames and errors as [`Engine::run`]; the peers cannot tell the difference.
    pub fn run_staged(&mut self, call: &Call, dev: &mut dyn StagedDevice) -> Result<()> {
        if dev.send_slots() == 0
            || (dev.recv_slots() == 0 && !dev.direct())
            || dev.slot_bytes() < self.opts.segment_bytes
        {
            return Err(internal(
                "staging device has no slots or slots smaller than a segment",
            ));
        }
        if dev.direct() {
            if dev.direct_base().is_none() || dev.direct_base() != self.transport.direct_base() {
                return Err(internal(&format!(
                    "the device's direct region ({:?}) is not the one registered with the \
                     transport ({:?}): the NIC would move other memory",
                    dev.direct_base(),
                    self.transport.direct_base()
                )));
            }
            match self.transport.direct_layout() {
                Some(l) if l.send_slots >= dev.send_slots() && l.slot_bytes >= dev.slot_bytes() => {
                }
                Some(l) => {
                    return Err(internal(&format!(
                        "the device's {} send slots of {} bytes do not fit the transport's \
                         direct region ({l:?})",
                        dev.send_slots(),
                        dev.slot_bytes()
                    )))
                }
                None => return Err(Error::invalid(
                    Some(self.rank),
                    "direct device collective",
                    "the transport has no direct region (GPUDirect RDMA was not set up at init)",
                )),
            }
        }
        let lens = dev.buffer_bytes();
        self.guarded(call, lens, |eng, prog, desc| {
            let full = call.op.unwrap_or(ReduceOp::Sum);
            eng.execute_staged(&prog, &desc, full, dev)
        })
    }

    fn execute_staged(
        &mut self,
        prog: &Program,
        desc: &Desc,
        full_op: ReduceOp,
        dev: &mut dyn StagedDevice,
    ) -> Result<()> {
        self.with_scratch(prog, |eng, s, start, deadline| {
            eng.drive_staged(prog, desc, full_op, dev, start, deadline, s)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn drive_staged(
        &mut self,
        prog: &Program,
        desc: &Desc,
        full_op: ReduceOp,
        dev: &mut dyn StagedDevice,
        start: Instant,
        deadline: Instant,
        s: &mut Scratch,
    ) -> Result<()> {
        let esz = desc.dtype.size();
        let op = full_op.step_op();
        let n = prog.steps.len();
        let mut send_state = vec![SendState::Idle; n];
        let mut free_send: Vec<usize> = (0..dev.send_slots()).rev().collect();
        let base = dev.send_slots();
        let mut free_recv: Vec<usize> = (base..base + dev.recv_slots()).rev().collect();
        let mut recv_slot: Vec<Option<usize>> = vec![None; self.world];
        let mut landing: VecDeque<(Held, u64)> = VecDeque::new();
        // Direct send slots posted but still being read by the NIC: (slot, peer, token).
        let mut draining: Vec<(usize, usize, u64)> = Vec::new();
        let direct = dev.direct();
        let layout = self.transport.direct_layout();
        if direct {
            for &p in &s.active {
                if !self.transport.direct_peer(p) {
                    return Err(Error::invalid(
                        Some(self.rank),
                        "direct device collective",
                        format!("rank {p} has no direct region: its connection is host-staged"),
                    ));
                }
            }
        }
        let mut pacer = Pacer::new(&self.opts, start, deadline);
        let ready = |done: &[bool], i: u32| prog.deps(i as usize).iter().all(|&d| done[d as usize]);

        loop {
            let mut moved = false;

            // Receive slots whose copy-in finished are free again (marks complete in order).
            while let Some(&(held, mark)) = landing.front() {
                if !dev.reached(mark)? {
                    break;
                }
                landing.pop_front();
                match held {
                    Held::Slot(slot) => free_recv.push(slot),
                    Held::Landing(p) => self.transport.release_direct(p)?,
                }
                moved = true;
            }
            let mut k = 0;
            while k < draining.len() {
                let (slot, p, token) = draining[k];
                if self.transport.direct_send_done(p, token)? {
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
                    let Some(slot) = free_send.pop() else { break };
                    dev.d2h(&dev_range(&src, esz), slot)?;
                    let mark = dev.mark()?;
                    send_state[iu] = SendState::Staging { slot, mark };
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
                        send_state[iu] = SendState::Ready { slot };
                    }
                    let hdr = desc.header(len);
                    let before = s.send_prog[p].written;
                    let fin = match (send_state[iu], layout) {
                        (SendState::Ready { slot }, Some(l)) if direct => self
                            .transport
                            .send_direct(p, &hdr, l.send(slot), &mut s.send_prog[p])?,
                        (SendState::Ready { slot }, _) => {
                            let data = &dev.slot(slot)[..len];
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
                    if let SendState::Ready { slot } = send_state[iu] {
                        match s.send_prog[p].token {
                            t if direct && t != 0 => draining.push((slot, p, t)),
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
                    if direct {
                        let before = (s.recv_prog[p].header.is_some(), s.recv_prog[p].got);
                        let landed = {
                            let mut sink = Sink {
                                rank: self.rank,
                                peer: p,
                                desc,
                                len,
                                dst: &mut [],
                                acc: Acc::None,
                                op,
                                esz,
                                done: 0,
                            };
                            self.transport
                                .recv_direct(p, &mut s.recv_prog[p], &mut sink)?
                        };
                        moved |= (s.recv_prog[p].header.is_some(), s.recv_prog[p].got) != before;
                        let Some(landed) = landed else { break };
                        if landed.len != len {
                            return Err(internal("a direct frame landed with the wrong length"));
                        }
                        if len > 0 {
                            let dr = byte_range(&dst, esz);
                            let acc = acc.map(|a| dev_range(&a, esz));
                            dev.land(landed.offset, dr, acc.as_ref(), desc.dtype, op)?;
                            landing.push_back((Held::Landing(p), dev.mark()?));
                        }
                        s.complete_recv(p, i);
                        moved = true;
                        continue;
                    }
                    if len > 0 && recv_slot[p].is_none() {
                        match free_recv.pop() {
                            Some(slot) => recv_slot[p] = Some(slot),
                            None => break,
                        }
                    }
                    let before = (s.recv_prog[p].header.is_some(), s.recv_prog[p].got);
                    let fin = {
                        let mut empty: [u8; 0] = [];
                        let buf: &mut [u8] = match recv_slot[p] {
                            Some(slot) => &mut dev.slot_mut(slot)[..len],
                            None => &mut empty,
                        };
                        let mut sink = Sink {
                            rank: self.rank,
                            peer: p,
                            desc,
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
                        match acc {
                            None => dev.h2d(slot, dr)?,
                            Some(a) => {
                                dev.h2d_reduce(slot, dr, &dev_range(&a, esz), desc.dtype, op)?
                            }
                        }
                        landing.push_back((Held::Slot(slot), dev.mark()?));
                    }
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
                for (held, _) in landing.drain(..) {
                    if let Held::Landing(p) = held {
                        self.transport.release_direct(p)?;
                    }
                }
                return Ok(());
            }
            match pacer.after_pass(moved) {
                Pace::Again => continue,
                Pace::TimedOut(waited) => return Err(self.timeout_error(prog, desc, s, waited)),
                Pace::Block => {}
            }
            // Device completions are not file descriptors, and copying one segment takes
            // microseconds: while device work is in flight, keep polling (yielding the CPU)
            // instead of sleeping in the transport.
            let device_busy = !landing.is_empty()
                || !draining.is_empty()
                || send_state
                    .iter()
                    .any(|st| matches!(st, SendState::Staging { .. }));
            if device_busy {
                std::thread::yield_now();
                continue;
            }
            s.collect_interest(prog);
            self.transport.wait(&s.interest, deadline)?;
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
        }
    }

    /// An emulated device in *direct* mode over a transport's host-memory direct region
    /// ([`Transport::direct_host_region`](crate::transport::Transport::direct_host_region)):
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
                    Some((r, l)) => r.write(l.send(slot), &data),
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
                    r.read(offset, &mut incoming);
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
        if r.end > len {
            return Err(internal(&format!("{what} range {r:?} beyond {len} bytes")));
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
    fn slot(&self, i: usize) -> &[u8] {
        &self.slots[i]
    }
    fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.slots[i]
    }
    fn d2h(&mut self, src: &DevRange, slot: usize) -> Result<()> {
        self.check(
            &src.bytes,
            if src.buf == Buf::Src {
                self.src.len()
            } else {
                self.dst.len()
            },
            "d2h",
        )?;
        self.queue.push_back(EmuOp::D2h {
            src: src.clone(),
            slot,
        });
        Ok(())
    }
    fn h2d(&mut self, slot: usize, dst: Range<usize>) -> Result<()> {
        self.check(&dst, self.dst.len(), "h2d")?;
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
        Ok(self.done_mark >= mark)
    }
    fn synchronize(&mut self, _deadline: Instant) -> Result<()> {
        while !self.queue.is_empty() {
            self.perform_one();
        }
        Ok(())
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
        match &self.region {
            Some((_, l)) if offset + dst.len() <= l.len() => {}
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
