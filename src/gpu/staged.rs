//! **GPU-only code**: the CUDA implementation of the engine's host-staged device path
//! ([`StagedDevice`]): pinned host slots, asynchronous copies and reduction kernels on one
//! stream, CUDA events as progress marks.
//!
//! Nothing here can run without an NVIDIA GPU; the pipelining logic it serves is tested on
//! [`EmulatedDevice`](crate::engine::staged::EmulatedDevice), and `tests/gpu_device.rs` runs
//! this implementation in a two-rank all-reduce where a GPU is present.
//!
//! ```no_run
//! # fn main() -> dspark::Result<()> {
//! use dspark::internals::gpu::{device, staged::{CudaStagedDevice, StagingPool}};
//! let ctx = device::open_context(0)?;
//! let reducer = device::GpuReducer::new(&ctx)?;
//! let stream = ctx.new_stream().map_err(|e| dspark::Error::Cuda { rank: None, op: "stream".into(), what: format!("{e:?}") })?;
//! let mut grads = stream.alloc_zeros::<f32>(1 << 20).unwrap();
//! let mut pool = StagingPool::new(&ctx, 4, 4, 1 << 20)?;
//! // SAFETY: `dev` is a local, dropped at the end of the scope (never leaked).
//! let mut dev = unsafe { CudaStagedDevice::new::<f32, cudarc::driver::CudaSlice<f32>, _>(
//!     &reducer, &stream, None, Some(&mut grads), &mut pool)? };
//! // comm.run_staged(call, &mut dev)?; // (feature `testing`; the device collectives do this)
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop,
};

use super::cuda::driver::{self, driver_err, require_driver_symbols};
use super::device::{DeviceAllocation, GpuReducer};
use crate::engine::staged::{DevRange, StagedDevice};
use crate::error::{Error, Result};
use crate::plan::Buf;
use crate::types::{DataType, ReduceOp};

const SYMBOLS: [&str; 6] = [
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuStreamSynchronize",
];

fn bad(op: &str, what: String) -> Error {
    Error::invalid(None, format!("staged {op}"), what)
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop (errors ignored) unless
/// `leaked`.
struct Pinned {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
    /// Never freed: device work that may still use it did not finish within its deadline.
    leaked: bool,
}

// SAFETY: the pinned allocation is ordinary process memory that any thread may access; `Pinned`
// owns it exclusively (it is only reachable through `&mut StagingPool`), and freeing it from
// another thread is allowed by the driver (the context is bound first).
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // The symbol was checked by the caller and a context is current; flags 0 = plain
        // page-locked memory of this context.
        let p = driver::mem_host_alloc(len.max(1), 0)?;
        Ok(Pinned {
            ctx: ctx.clone(),
            ptr: p.cast(),
            len,
            leaked: false,
        })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if !self.leaked && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed once; the owner synchronised
            // its stream first, so no copy still uses it.
            unsafe { driver::mem_free_host(self.ptr.cast()) };
        }
    }
}

/// Device buffers staged through pinned host slots, for the device collectives
/// ([`Communicator::all_reduce_device`](crate::Communicator::all_reduce_device) and the rest;
/// `Communicator::run_staged` with the `testing` feature).
///
/// Borrows the collective's device buffers (`src` optional: in-place calls only have `dst`) and
/// the stream the work is ordered on, for as long as the call runs. Everything is queued on that
/// stream, so the collective starts after work already queued there, and work queued there
/// afterwards sees its result. Dropping the device waits for its stream.
pub struct CudaStagedDevice<'a> {
    reducer: &'a GpuReducer,
    stream: &'a Arc<CudaStream>,
    pool: &'a mut StagingPool,
    marks: Marks,
    /// Which slots a queued asynchronous copy may still touch; `slot`/`slot_mut` check it, so
    /// that safe code cannot see pinned memory a copy may still be writing or reading.
    busy: BusySlots,
    // Last: cudarc's bookkeeping for the borrowed buffers, recorded when the device is dropped.
    bufs: DevBuffers<'a>,
}

impl std::fmt::Debug for CudaStagedDevice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// How long dropping a device waits for its stream's work. Past it the device reports the
/// work still running and leaks the memory that work may use (the staging pool, the direct
/// region), which is never freed nor used again: memory safety forbids releasing it, and
/// nothing may wait without a deadline.
const DROP_WAIT: Duration = Duration::from_secs(10);

/// Checks that `stream` and `reducer` belong to `ours`, the context of the memory a `kind`
/// (`staged` or `direct`) device stages through (`memory`: a staging pool, a direct region);
/// `hint` follows the message when the GPUs differ.
pub(crate) fn check_contexts(
    kind: &str,
    memory: &str,
    ours: &Arc<CudaContext>,
    stream: &CudaStream,
    reducer: &GpuReducer,
    hint: &str,
) -> Result<()> {
    let bad = |what: String| Error::invalid(None, format!("{kind} device"), what);
    let theirs = stream.context();
    if theirs.ordinal() != ours.ordinal() {
        return Err(bad(format!(
            "the {memory} is on GPU {} but the collective runs on a stream of GPU {}{hint}",
            ours.ordinal(),
            theirs.ordinal()
        )));
    }
    if theirs.as_ref() != ours.as_ref() {
        return Err(bad(format!(
            "the stream belongs to another CUDA context of GPU {} than the {memory}",
            ours.ordinal()
        )));
    }
    if reducer.context().as_ref() != ours.as_ref() {
        return Err(bad(format!(
            "reduction kernels loaded on GPU {} used with the {memory} of GPU {}",
            reducer.context().ordinal(),
            ours.ordinal()
        )));
    }
    Ok(())
}

impl<'a> CudaStagedDevice<'a> {
    /// A staged device over `dst` (absent for a send) and `src` (when the collective has a
    /// separate input), staging through `pool` (of the stream's GPU), ordered on `stream` (of
    /// `reducer`'s context).
    ///
    /// # Safety
    /// The device must be dropped, never leaked (`mem::forget`, a reference cycle): its drop
    /// waits for the copies and kernels it queued — on the pool's pinned memory, the region
    /// and the borrowed device buffers — and records them with cudarc, so that none of that
    /// memory is freed or reused (or a slot shown to the host again) while the GPU may still
    /// read or write it. (Where that work is still running after `DROP_WAIT`, the drop leaks
    /// the pool or region instead, logs what it leaked, and later devices over it are
    /// refused.) [`crate::Communicator`]'s device collectives keep it a local.
    pub unsafe fn new<T, S, D>(
        reducer: &'a GpuReducer,
        stream: &'a Arc<CudaStream>,
        src: Option<&'a S>,
        dst: Option<&'a mut D>,
        pool: &'a mut StagingPool,
    ) -> Result<Self>
    where
        T: DeviceRepr,
        S: DevicePtr<T>,
        D: DevicePtrMut<T>,
    {
        // The driver functions used here were checked when the pool was created.
        check_contexts("staged", "staging pool", &pool.ctx, stream, reducer, "")?;
        if let Some(why) = &pool.stuck {
            return Err(bad(
                "device",
                format!("the staging pool is leaked and unusable: {why}"),
            ));
        }
        let bufs = DevBuffers::borrow("staged", stream, src, dst);
        let slots = pool.slots.len / pool.slot_bytes;
        Ok(CudaStagedDevice {
            reducer,
            stream,
            pool,
            marks: Marks::new(),
            busy: BusySlots::new(slots),
            bufs,
        })
    }

    fn slot_count(&self) -> usize {
        self.pool.slots.len / self.pool.slot_bytes
    }

    fn enqueued(&mut self, slot: usize) {
        self.busy.enqueued(slot, self.marks.next);
    }

    fn settled(&self, slot: usize) -> bool {
        self.busy.settled(slot, self.marks.done)
    }

    fn slot_ptr(&self, op: &str, slot: usize, len: usize) -> Result<*mut u8> {
        if slot >= self.slot_count() || len > self.pool.slot_bytes {
            return Err(bad(
                op,
                format!(
                    "slot {slot} / {len} bytes outside {} slots of {}",
                    self.slot_count(),
                    self.pool.slot_bytes
                ),
            ));
        }
        // SAFETY: `slot * slot_bytes + len <= slots.len` (checked above), inside one allocation.
        Ok(unsafe { self.pool.slots.ptr.add(slot * self.pool.slot_bytes) })
    }

    fn dev_ptr(&self, op: &str, buf: Buf, bytes: &Range<usize>) -> Result<u64> {
        self.bufs.ptr(op, buf, bytes)
    }
}

impl StagedDevice for CudaStagedDevice<'_> {
    fn send_slots(&self) -> usize {
        self.pool.send_slots
    }

    fn recv_slots(&self) -> usize {
        self.slot_count() - self.pool.send_slots
    }

    fn slot_bytes(&self) -> usize {
        self.pool.slot_bytes
    }

    /// Host view of slot `i`; empty while a copy into or out of it may still run (the engine
    /// polls the mark after the copy first, so it never sees that).
    fn slot(&self, i: usize) -> &[u8] {
        if !self.settled(i) {
            return &[];
        }
        match self.slot_ptr("slot", i, self.pool.slot_bytes) {
            // SAFETY: the slot lies inside the live pinned allocation, and the mark after the
            // last copy that touched it has been reached (`settled`): no copy runs on it, and
            // none can be enqueued while this borrow of `self` lives.
            Ok(p) => unsafe { std::slice::from_raw_parts(p, self.pool.slot_bytes) },
            Err(_) => &[],
        }
    }

    /// Mutable host view of slot `i`; empty while a copy into or out of it may still run.
    fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        if !self.settled(i) {
            return &mut [];
        }
        match self.slot_ptr("slot", i, self.pool.slot_bytes) {
            // SAFETY: as in `slot`; `&mut self` makes this the only borrow of the slots.
            Ok(p) => unsafe { std::slice::from_raw_parts_mut(p, self.pool.slot_bytes) },
            Err(_) => &mut [],
        }
    }

    fn d2h(&mut self, src: &DevRange, slot: usize) -> Result<()> {
        let n = src.bytes.len();
        let host = self.slot_ptr("d2h", slot, n)?;
        let dev = self.dev_ptr("d2h", src.buf, &src.bytes)?;
        if n == 0 {
            return Ok(());
        }
        self.enqueued(slot);
        // SAFETY: `host` has `n` bytes of pinned memory and `dev` `n` bytes of a borrowed device
        // buffer (both checked); the copy is ordered on the stream, which is synchronised
        // before either buffer is released.
        unsafe { driver::memcpy_dtoh_async(host, dev, n, self.stream) }
    }

    fn h2d(&mut self, slot: usize, dst: Range<usize>) -> Result<()> {
        let n = dst.len();
        let host = self.slot_ptr("h2d", slot, n)?;
        let dev = self.dev_ptr("h2d", Buf::Dst, &dst)?;
        if n == 0 {
            return Ok(());
        }
        self.enqueued(slot);
        // SAFETY: as in `d2h`, in the other direction.
        unsafe { driver::memcpy_htod_async(dev, host.cast_const(), n, self.stream) }
    }

    fn h2d_reduce(
        &mut self,
        slot: usize,
        dst: Range<usize>,
        acc: &DevRange,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let n = dst.len();
        if acc.bytes.len() != n || !n.is_multiple_of(dtype.size()) {
            return Err(bad(
                "h2d_reduce",
                format!("{n} bytes into {dst:?} with acc {acc:?} of {dtype}"),
            ));
        }
        let host = self.slot_ptr("h2d_reduce", slot, n)?;
        let d = self.dev_ptr("h2d_reduce", Buf::Dst, &dst)?;
        let a = self.dev_ptr("h2d_reduce", acc.buf, &acc.bytes)?;
        if n == 0 {
            return Ok(());
        }
        self.enqueued(slot);
        let scratch = self.pool.scratch.ptr();
        // SAFETY: the scratch allocation holds `slot_bytes >= n` bytes (checked by
        // `slot_ptr`); the slot holds `n` bytes; ordered on the stream before the kernel that
        // reads the scratch, and the next copy into the scratch is ordered after that kernel.
        unsafe { driver::memcpy_htod_async(scratch, host.cast_const(), n, self.stream) }?;
        // SAFETY: `d` and `a` cover `n` bytes of borrowed device buffers, `scratch` `n` bytes of
        // ours; `d` and `a` are either the same range (in place) or disjoint, as the engine
        // uses them; everything is on this reducer's context (the stream is checked).
        unsafe {
            self.reducer
                .reduce_into_raw(self.stream, dtype, op, d, a, scratch, n / dtype.size())
        }
    }

    fn copy(&mut self, src: &DevRange, dst: Range<usize>) -> Result<()> {
        self.bufs.enqueue_copy(self.stream, src, dst)
    }

    fn finalize(
        &mut self,
        dst: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
        world: usize,
    ) -> Result<()> {
        self.bufs
            .enqueue_finalize(self.reducer, self.stream, dst, dtype, op, world)
    }

    fn mark(&mut self) -> Result<u64> {
        self.marks
            .mark(&self.pool.ctx, self.stream, &mut self.pool.events)
    }

    fn reached(&mut self, mark: u64) -> Result<bool> {
        self.marks.reached(mark, &mut self.pool.events)
    }

    fn synchronize(&mut self, deadline: Instant) -> Result<()> {
        self.marks.wait_all(
            &self.pool.ctx,
            self.stream,
            &mut self.pool.events,
            "staged synchronize",
            deadline,
        )
    }

    fn describe(&self) -> String {
        format!(
            "CUDA device {} ({}): {} send + {} receive pinned slots of {} KiB",
            self.pool.ctx.ordinal(),
            self.reducer.arch(),
            self.pool.send_slots,
            self.pool.recv_slots,
            self.pool.slot_bytes / 1024
        )
    }

    fn buffer_bytes(&self) -> (usize, usize) {
        self.bufs.bytes()
    }
}

impl Drop for CudaStagedDevice<'_> {
    fn drop(&mut self) {
        // Copies into or out of the pinned slots and the scratch must finish before the pool
        // is used again; errors cannot be reported from Drop: past the deadline the pool is
        // leaked and refuses every later device.
        if let Err(why) = self.marks.settle_for_drop(
            &self.pool.ctx,
            self.stream,
            &mut self.pool.events,
            "staged device drop",
        ) {
            let pool = &mut *self.pool;
            tracing::error!(
                "{why}: leaking the staging pool ({} B of pinned host memory, {} B of device \
                 scratch), which is never freed nor used again",
                pool.slots.len,
                pool.scratch.len()
            );
            pool.slots.leaked = true;
            pool.scratch.leak();
            pool.stuck = Some(why);
        }
    }
}

/// The collective's device buffers as borrowed by a device implementation: raw addresses and
/// sizes, plus cudarc's per-buffer bookkeeping, which records the stream's work on the buffers
/// when dropped (keep it the last field of its owner, so that this happens after the owner's
/// `Drop` synchronised the stream).
pub(crate) struct DevBuffers<'a> {
    /// `staged` or `direct`: the prefix of the operation names in errors.
    kind: &'static str,
    src: Option<(u64, usize)>,
    dst: (u64, usize),
    _guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> DevBuffers<'a> {
    /// Borrows `src` (optional) and `dst` (absent for a send: every `Dst` access then fails the
    /// range check) for work ordered on `stream`.
    pub(crate) fn borrow<T, S, D>(
        kind: &'static str,
        stream: &'a Arc<CudaStream>,
        src: Option<&'a S>,
        dst: Option<&'a mut D>,
    ) -> Self
    where
        T: DeviceRepr,
        S: DevicePtr<T>,
        D: DevicePtrMut<T>,
    {
        let mut guards = Vec::new();
        let src = src.map(|s| {
            let (p, g) = s.device_ptr(stream);
            guards.push(g);
            (p, s.num_bytes())
        });
        let dst = match dst {
            Some(dst) => {
                let dst_bytes = dst.num_bytes();
                let (dp, g) = dst.device_ptr_mut(stream);
                guards.push(g);
                (dp, dst_bytes)
            }
            None => (0, 0),
        };
        DevBuffers {
            kind,
            src,
            dst,
            _guards: guards,
        }
    }

    /// Enqueues the device-to-device copy `src` → `Dst[dst]` on `stream`.
    pub(crate) fn enqueue_copy(
        &self,
        stream: &Arc<CudaStream>,
        src: &DevRange,
        dst: Range<usize>,
    ) -> Result<()> {
        let n = dst.len();
        if src.bytes.len() != n {
            return Err(bad("copy", format!("{src:?} into {dst:?}")));
        }
        let s = self.ptr("copy", src.buf, &src.bytes)?;
        let d = self.ptr("copy", Buf::Dst, &dst)?;
        if n == 0 || s == d {
            return Ok(());
        }
        // SAFETY: both ranges lie in borrowed device buffers (checked), ordered on the stream.
        unsafe { driver::memcpy_dtod_async(d, s, n, stream) }
    }

    /// Enqueues the final step of `op` (Avg: divide by `world`) on `Dst[dst]`.
    pub(crate) fn enqueue_finalize(
        &self,
        reducer: &GpuReducer,
        stream: &Arc<CudaStream>,
        dst: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
        world: usize,
    ) -> Result<()> {
        if op != ReduceOp::Avg {
            return Ok(());
        }
        let n = dst.len();
        if !n.is_multiple_of(dtype.size()) {
            return Err(bad("finalize", format!("{n} bytes of {dtype}")));
        }
        let d = self.ptr("finalize", Buf::Dst, &dst)?;
        // SAFETY: `d` covers `n` bytes of the borrowed destination (checked), on the reducer's
        // context.
        unsafe { reducer.finalize_raw(stream, dtype, d, n / dtype.size(), world) }
    }

    /// The device address of `bytes` of `buf`, checked against the buffer's size.
    pub(crate) fn ptr(&self, op: &str, buf: Buf, bytes: &Range<usize>) -> Result<u64> {
        let (base, len) = match buf {
            Buf::Dst => self.dst,
            Buf::Src => self.src.ok_or_else(|| {
                Error::invalid(
                    None,
                    format!("{} {op}", self.kind),
                    "no source buffer was given",
                )
            })?,
        };
        if bytes.start > bytes.end || bytes.end > len {
            return Err(Error::invalid(
                None,
                format!("{} {op}", self.kind),
                format!("range {bytes:?} outside a {len}-byte {buf:?} buffer"),
            ));
        }
        Ok(base + bytes.start as u64)
    }

    /// Sizes in bytes of `Src` (0 when absent) and `Dst`.
    pub(crate) fn bytes(&self) -> (usize, usize) {
        (self.src.map_or(0, |(_, n)| n), self.dst.1)
    }
}

/// Progress marks on one stream: CUDA events recorded in stream order, so they complete in
/// order; events are taken from and given back to a caller-owned spare list, so that
/// collectives reuse them instead of creating and destroying events per call.
/// Per slot, the mark that must be reached before the host may look at it: the first mark
/// recorded after the last copy into or out of it was enqueued (0: none pending).
#[derive(Debug)]
struct BusySlots(Vec<u64>);

impl BusySlots {
    fn new(slots: usize) -> Self {
        BusySlots(vec![0; slots])
    }

    /// A copy touching `slot` was just enqueued, after mark `last` (the latest recorded): the
    /// host may look at the slot again once mark `last + 1` is reached.
    fn enqueued(&mut self, slot: usize, last: u64) {
        if let Some(b) = self.0.get_mut(slot) {
            *b = last + 1;
        }
    }

    /// Whether no enqueued copy may still touch `slot`, given that marks up to `done` are
    /// reached. A slot that does not exist is never settled.
    fn settled(&self, slot: usize, done: u64) -> bool {
        self.0.get(slot).is_some_and(|&b| b <= done)
    }
}

pub(crate) struct Marks {
    pending: VecDeque<(u64, CudaEvent)>,
    next: u64,
    done: u64,
}

impl Marks {
    pub(crate) fn new() -> Self {
        Marks {
            pending: VecDeque::new(),
            next: 0,
            done: 0,
        }
    }

    /// Records a new mark at the current end of `stream` (an event of `ctx`).
    pub(crate) fn mark(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        spare: &mut Vec<CudaEvent>,
    ) -> Result<u64> {
        let ev = match spare.pop() {
            Some(ev) => ev,
            None if self.pending.is_empty() => {
                // Not reached with the events made with the pool (they come back as marks
                // are reached); said, since creating one can wait on a CUDA lock.
                tracing::warn!(
                    "no spare CUDA event for a device progress mark: making one while a call runs"
                );
                ctx.new_event(None).map_err(driver_err("cuEventCreate"))?
            }
            None => self.reuse_oldest(spare)?,
        };
        ev.record(stream).map_err(driver_err("cuEventRecord"))?;
        self.next += 1;
        self.pending.push_back((self.next, ev));
        Ok(self.next)
    }

    /// With no spare event, the oldest pending one once it completed, rather than a new one:
    /// creating an event takes a lock of the CUDA context that a thread blocked in a copy
    /// from a stream (a caller's `tensor.cpu()` behind a queued collective, `gpu::order`)
    /// holds until that stream moves, and it moves only once this collective is done.
    /// Events complete in stream order and this stream waits for nothing on the host, so the
    /// oldest completes; [`Error::Timeout`] if it has not within [`DROP_WAIT`] (the device
    /// work is stuck), never a new event.
    fn reuse_oldest(&mut self, spare: &mut Vec<CudaEvent>) -> Result<CudaEvent> {
        let oldest = self.pending.front().map_or(self.done, |(m, _)| *m);
        let deadline = crate::time::deadline(Instant::now(), DROP_WAIT);
        self.wait_reached(
            oldest,
            spare,
            "device progress mark (every CUDA event of this device pending)",
            deadline,
        )?;
        // Reached: its event (at least) went back to `spare`.
        spare.pop().ok_or_else(|| Error::Cuda {
            rank: None,
            op: "device progress mark".into(),
            what: "the oldest mark was reached but no CUDA event came back".into(),
        })
    }

    /// Whether `mark` has been reached (polls; never blocks).
    pub(crate) fn reached(&mut self, mark: u64, spare: &mut Vec<CudaEvent>) -> Result<bool> {
        // Events complete in stream order: pop every completed one from the front.
        while let Some((m, ev)) = self.pending.front() {
            let done = ev.try_is_complete().map_err(driver_err("cuEventQuery"))?;
            if !done {
                break;
            }
            self.done = *m;
            if let Some((_, ev)) = self.pending.pop_front() {
                spare.push(ev);
            }
        }
        Ok(self.done >= mark)
    }

    /// Marks the end of `stream` and polls (backing off to 1 ms) until it is reached, or
    /// `deadline` ([`Error::Timeout`] naming `op`; the engine rewrites it to name the call).
    pub(crate) fn wait_all(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        spare: &mut Vec<CudaEvent>,
        op: &str,
        deadline: Instant,
    ) -> Result<()> {
        let last = self.mark(ctx, stream, spare)?;
        self.wait_reached(last, spare, op, deadline)
    }

    /// Polls (backing off to 1 ms) until `mark` is reached, or `deadline`
    /// ([`Error::Timeout`] naming `op`; the engine rewrites it to name the call).
    fn wait_reached(
        &mut self,
        mark: u64,
        spare: &mut Vec<CudaEvent>,
        op: &str,
        deadline: Instant,
    ) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(5);
        while !self.reached(mark, spare)? {
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    // This layer does not know its rank: the engine names it
                    // (`Error::at_rank`) before the error leaves the call.
                    rank: 0,
                    peer: None,
                    op: op.into(),
                    waited: start.elapsed(),
                    detail: "device work still running at the deadline".into(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Gives every pending event back to `spare` (call after synchronising the stream).
    pub(crate) fn recycle(&mut self, spare: &mut Vec<CudaEvent>) {
        spare.extend(self.pending.drain(..).map(|(_, ev)| ev));
    }

    /// For a device's `Drop`: waits until everything enqueued on `stream` has finished, for
    /// at most [`DROP_WAIT`], then recycles the events. `Err` with the reason when the work is
    /// still running at that deadline (a call failed, typically with a timeout, while device
    /// work was in flight and the stream never drained): the caller must then leak the memory
    /// that work may use, and say so. The pending events are dropped, not recycled.
    pub(crate) fn settle_for_drop(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        spare: &mut Vec<CudaEvent>,
        op: &str,
    ) -> std::result::Result<(), String> {
        let deadline = crate::time::deadline(Instant::now(), DROP_WAIT);
        match self.wait_all(ctx, stream, spare, op, deadline) {
            Ok(()) => {
                self.recycle(spare);
                Ok(())
            }
            Err(e) => {
                self.pending.clear();
                Err(format!(
                    "{op}: device work on GPU {} did not finish within {DROP_WAIT:?} ({e})",
                    ctx.ordinal()
                ))
            }
        }
    }
}

/// CUDA events made with a staging pool, enough for the marks one collective has pending at
/// a time, so that none is created while it runs (see `Marks::reuse_oldest`).
pub(crate) const MARK_EVENTS: usize = 32;

/// The same for a direct region, whose landing slots (one set per peer) each hold a mark.
pub(crate) const DIRECT_MARK_EVENTS: usize = 128;

/// `n` new events of `ctx`.
pub(crate) fn new_events(ctx: &Arc<CudaContext>, n: usize) -> Result<Vec<CudaEvent>> {
    (0..n)
        .map(|_| ctx.new_event(None).map_err(driver_err("cuEventCreate")))
        .collect()
}

/// Pinned host slots, a device scratch buffer and CUDA events for the staged path on one GPU,
/// allocated once and reused by every collective: allocating and freeing pinned memory
/// synchronises the whole device, which would dominate gradient-bucket-sized calls.
pub struct StagingPool {
    ctx: Arc<CudaContext>,
    slots: Pinned,
    scratch: DeviceAllocation,
    send_slots: usize,
    recv_slots: usize,
    slot_bytes: usize,
    events: Vec<CudaEvent>,
    /// Set when a device's drop leaked the pool (see [`StagingPool::stuck`]).
    stuck: Option<String>,
}

impl std::fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StagingPool(GPU {}: {} + {} slots of {} B)",
            self.ctx.ordinal(),
            self.send_slots,
            self.recv_slots,
            self.slot_bytes
        )
    }
}

impl StagingPool {
    /// `send_slots` + `recv_slots` pinned slots of `slot_bytes` each (at least the engine's
    /// segment size) and one slot of device scratch, on `ctx`'s GPU.
    pub fn new(
        ctx: &Arc<CudaContext>,
        send_slots: usize,
        recv_slots: usize,
        slot_bytes: usize,
    ) -> Result<Self> {
        require_driver_symbols(&SYMBOLS)?;
        if send_slots == 0 || recv_slots == 0 || slot_bytes == 0 {
            return Err(bad(
                "device",
                "slot counts and size must be at least 1".into(),
            ));
        }
        let total = (send_slots + recv_slots)
            .checked_mul(slot_bytes)
            .ok_or_else(|| bad("device", "slot pool size overflows".into()))?;
        Ok(StagingPool {
            ctx: ctx.clone(),
            slots: Pinned::new(ctx, total)?,
            scratch: DeviceAllocation::new(ctx, slot_bytes)?,
            send_slots,
            recv_slots,
            slot_bytes,
            events: new_events(ctx, MARK_EVENTS)?,
            stuck: None,
        })
    }

    /// Why the pool is leaked and unusable (device work of an earlier call never finished),
    /// if it is: the caller makes a new one.
    pub fn stuck(&self) -> Option<&str> {
        self.stuck.as_deref()
    }

    /// Whether this pool serves `ctx`'s GPU with this slot configuration.
    pub fn fits(
        &self,
        ctx: &CudaContext,
        send_slots: usize,
        recv_slots: usize,
        slot_bytes: usize,
    ) -> bool {
        self.ctx.ordinal() == ctx.ordinal()
            && (self.send_slots, self.recv_slots, self.slot_bytes)
                == (send_slots, recv_slots, slot_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::BusySlots;

    /// #11 item 4: the bookkeeping behind `slot`/`slot_mut` — a slot is hidden from the host
    /// from the moment a copy on it is enqueued until the first mark recorded after that copy
    /// is reached, and never shown out of range. (The CUDA device itself is checked on a GPU:
    /// `a_staging_slot_is_hidden_while_a_copy_into_it_may_run` in tests/gpu_device.rs.)
    #[test]
    fn a_slot_is_hidden_from_its_copy_until_the_next_mark_is_reached() {
        let mut b = BusySlots::new(3);
        assert!(
            b.settled(0, 0) && b.settled(2, 0),
            "untouched slots are visible"
        );
        assert!(!b.settled(3, u64::MAX), "out of range is never visible");
        // Marks 1..=4 recorded so far, 2 reached; a copy into slot 1 is enqueued now.
        b.enqueued(1, 4);
        assert!(
            !b.settled(1, 2) && !b.settled(1, 4),
            "the copy runs until mark 5"
        );
        assert!(b.settled(0, 2), "other slots are unaffected");
        assert!(b.settled(1, 5) && b.settled(1, 9));
        // A second copy on the same slot after mark 7 hides it again until mark 8.
        b.enqueued(1, 7);
        assert!(!b.settled(1, 7) && b.settled(1, 8));
        b.enqueued(9, 1); // out of range: ignored, no panic
    }
}
