//! **GPU-only code, never run in this repository's CI**: the CUDA side of the engine's *direct*
//! device path (GPUDirect RDMA) — a [`DirectRegion`] of GPU memory that the transport registers
//! with the NIC, and [`CudaDirectDevice`], the [`StagedDevice`] in direct mode over it.
//!
//! In direct mode payloads never pass through host memory: a send is a device-to-device copy of
//! the segment into a send slot of the region, which the NIC reads; a receive is the NIC writing
//! into a landing slot of the region, after which [`StagedDevice::land`] flushes those writes to
//! the GPU and copies (or reduces) the slot into the destination on the stream.
//!
//! Nothing here can run without an NVIDIA GPU and an RDMA NIC that can register GPU memory. The
//! protocol it serves (slot reuse, landing-slot release only after the consuming kernel ran) is
//! tested without a GPU on [`EmulatedDevice::direct`](crate::engine::staged::EmulatedDevice::direct)
//! (`tests/staged.rs`) and over Soft-RoCE with a host-memory region; `tests/gpu_device.rs` checks
//! this implementation's copies and reductions on one GPU, where a GPU is present, with the host
//! writing the landing slot in place of the NIC.
//!
//! ```no_run
//! # fn main() -> dspark::Result<()> {
//! use dspark::internals::gpu::{device, direct::{CudaDirectDevice, DirectRegion}};
//! use dspark::internals::transport::DirectLayout;
//! let ctx = device::open_context(0)?;
//! let reducer = device::GpuReducer::new(&ctx)?;
//! let stream = ctx.new_stream().map_err(|e| dspark::Error::Cuda { rank: None, op: "stream".into(), what: format!("{e:?}") })?;
//! let layout = DirectLayout { world: 2, slots: 4, slot_bytes: 1 << 20, send_slots: 4 };
//! let region = DirectRegion::new(&ctx, layout)?;
//! let (kinds, why_not) = region.registration_candidates(); // for the transport
//! let mut grads = stream.alloc_zeros::<f32>(1 << 20).unwrap();
//! // SAFETY: `dev` is a local, dropped at the end of the scope (never leaked).
//! let mut dev = unsafe { CudaDirectDevice::new::<f32, cudarc::driver::CudaSlice<f32>, _>(
//!     &reducer, &stream, None, Some(&mut grads), &region, 4)? };
//! // comm.run_staged(call, &mut dev)?; // (feature `testing`; the device collectives do this)
//! # Ok(()) }
//! ```

use std::ops::Range;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use super::cuda::driver::{
    self, cu_error_text, driver_err, require_driver_symbols, CUdevice_attribute,
};
use super::device::{
    flush_gpudirect_writes, flush_gpudirect_writes_prechecked, DeviceAllocation, GpuReducer,
};
use super::staged::{check_contexts, DevBuffers, Marks};
use super::sysfs::Sysfs;
use super::MemoryKind;
use crate::engine::staged::{DevRange, StagedDevice};
use crate::error::{Error, Result};
use crate::plan::Buf;
use crate::transport::DirectLayout;
use crate::types::{DataType, ReduceOp};

/// Driver functions used here besides those a context, a stream and the reducer already need.
const SYMBOLS: [&str; 6] = [
    "cuMemsetD8_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuStreamSynchronize",
    "cuFlushGPUDirectRDMAWrites",
];

/// Slot sizes must keep every slot aligned for the widest element (8 bytes), so that the
/// reduction kernels can read a landing slot of any type.
const SLOT_ALIGN: usize = 8;

fn bad(op: &str, what: impl Into<String>) -> Error {
    Error::invalid(None, format!("direct {op}"), what)
}

/// The size in bytes of a region with `layout`, after checking that it can live in GPU memory:
/// at least one send slot, non-empty slots aligned for every element type, no overflow.
fn region_bytes(layout: &DirectLayout) -> Result<usize> {
    if layout.send_slots == 0 || layout.slot_bytes == 0 {
        return Err(bad(
            "region",
            format!("{layout:?}: at least one send slot of at least one byte is needed"),
        ));
    }
    if !layout.slot_bytes.is_multiple_of(SLOT_ALIGN) {
        return Err(bad(
            "region",
            format!(
                "{layout:?}: slot_bytes must be a multiple of {SLOT_ALIGN} so that every slot \
                 is aligned for every element type"
            ),
        ));
    }
    layout
        .world
        .checked_mul(layout.slots)
        .and_then(|n| n.checked_add(layout.send_slots))
        .and_then(|n| n.checked_mul(layout.slot_bytes))
        .ok_or_else(|| bad("region", format!("{layout:?}: the region size overflows")))
}

/// One rank's direct region in GPU memory ([`DirectLayout`]: landing slots for every peer, then
/// the send slots), allocated with `cuMemAlloc` (page-rounded, the kind of memory dma-buf export
/// and nvidia-peermem accept) and zeroed once.
///
/// The transport registers `ptr()..ptr() + len()` with the NIC through one of
/// [`DirectRegion::registration_candidates`]; that registration must be dropped before the
/// region (the region does not know about it). The dma-buf descriptor, once exported, lives as
/// long as the region.
pub struct DirectRegion {
    // Dropped first: the dma-buf descriptor, before the memory it exports is freed.
    dmabuf: OnceLock<std::result::Result<OwnedFd, String>>,
    // CUDA events reused by the devices over this region, across collectives.
    events: Mutex<Vec<CudaEvent>>,
    layout: DirectLayout,
    ctx: Arc<CudaContext>,
    mem: DeviceAllocation,
    /// Set when a device's drop gave up waiting for its work: the memory is leaked (never
    /// freed) and every later device over the region is refused with this reason.
    stuck: OnceLock<String>,
}

impl DirectRegion {
    /// Why the region is leaked and refuses every device (work of an earlier call never
    /// finished), if it is.
    pub(crate) fn stuck(&self) -> Option<&str> {
        self.stuck.get().map(String::as_str)
    }
}

impl Drop for DirectRegion {
    fn drop(&mut self) {
        if self.stuck.get().is_some() {
            self.mem.leak();
        }
    }
}

impl std::fmt::Debug for DirectRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DirectRegion(GPU {}: {:#x}+{} B, {:?})",
            self.ctx.ordinal(),
            self.mem.ptr(),
            self.len(),
            self.layout
        )
    }
}

impl DirectRegion {
    /// Allocates and zeroes a region for `layout` on `ctx`'s GPU. Fails at once (instead of at
    /// the first received payload) when the driver cannot flush GPUDirect RDMA writes from the
    /// host (`cuFlushGPUDirectRDMAWrites`), which [`CudaDirectDevice::land`] relies on.
    pub fn new(ctx: &Arc<CudaContext>, layout: DirectLayout) -> Result<Self> {
        let len = region_bytes(&layout)?;
        require_driver_symbols(&SYMBOLS)?;
        flush_gpudirect_writes(ctx)?;
        let mem = DeviceAllocation::new(ctx, len)?;
        // Zeroed once so that nothing of a previous owner of the memory can leak to a peer;
        // correctness never depends on it (every byte read was written first).
        ctx.bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the symbol was checked, the context is current, and `mem` is a live
        // allocation of exactly `mem.len()` bytes in it.
        unsafe { driver::memset_d8(mem.ptr(), 0, mem.len()) }?;
        // The memset runs on the legacy default stream, which the library's non-blocking
        // streams do not wait for: finish it here.
        ctx.synchronize().map_err(driver_err("cuCtxSynchronize"))?;
        Ok(DirectRegion {
            dmabuf: OnceLock::new(),
            events: Mutex::new(super::staged::new_events(
                ctx,
                super::staged::DIRECT_MARK_EVENTS,
            )?),
            layout,
            ctx: ctx.clone(),
            mem,
            stuck: OnceLock::new(),
        })
    }

    /// The device address of the region's first byte.
    pub fn ptr(&self) -> u64 {
        self.mem.ptr()
    }

    /// The layout.
    pub fn layout(&self) -> DirectLayout {
        self.layout
    }

    /// The region's size in bytes (`layout().len()`; the allocation behind it is rounded up to
    /// whole pages).
    pub fn len(&self) -> usize {
        self.layout.len()
    }

    /// Always false (a region has at least one send slot).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The context of the GPU the region lives on.
    pub fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The ways the NIC could register this region, best first, and for every mechanism that
    /// is not among them, why:
    ///
    /// 1. dma-buf ([`MemoryKind::CudaDmaBuf`], offset 0) when the GPU reports
    ///    `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 1` and the export succeeds (the descriptor
    ///    is exported on the first call and kept, with the result, for the region's lifetime);
    /// 2. nvidia-peermem ([`MemoryKind::CudaPeerMem`]) when the module is loaded (detected as
    ///    NCCL does, [`Sysfs::peermem`]) and the GPU does not report
    ///    `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 0`.
    ///
    /// Reasons start with `dma-buf:` or `peermem:`. An empty candidate list means GPUDirect
    /// RDMA cannot be had on this GPU; the reasons say why.
    pub fn registration_candidates(&self) -> (Vec<MemoryKind>, Vec<String>) {
        use CUdevice_attribute as A;
        let mut kinds = Vec::new();
        let mut why_not = Vec::new();
        let gpu = self.ctx.ordinal();
        match self.ctx.attribute(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) {
            Err(e) => why_not.push(format!(
                "dma-buf: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED unknown to this driver for GPU \
                 {gpu} ({})",
                cu_error_text(e.0)
            )),
            Ok(0) => why_not.push(format!(
                "dma-buf: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0 for GPU {gpu} (needs the \
                 open-kernel-module NVIDIA driver >= 515 and a kernel with dma-buf support)"
            )),
            Ok(_) => {
                let export = self
                    .dmabuf
                    .get_or_init(|| self.mem.export_dmabuf().map_err(|e| e.to_string()));
                match export {
                    Ok(fd) => kinds.push(MemoryKind::CudaDmaBuf {
                        fd: fd.as_raw_fd(),
                        offset: 0,
                    }),
                    Err(e) => why_not.push(format!(
                        "dma-buf: cuMemGetHandleForAddressRange failed: {e}"
                    )),
                }
            }
        }
        let peermem = Sysfs::default().peermem();
        if !peermem.loaded {
            why_not.push(format!(
                "peermem: nvidia-peermem not loaded (none of {} exists; `modprobe \
                 nvidia-peermem`)",
                peermem.checked.join(", ")
            ));
        } else if let Ok(0) = self
            .ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)
        {
            why_not.push(format!(
                "peermem: nvidia-peermem is loaded ({}) but GPU {gpu} reports \
                 CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED=0",
                peermem.found.unwrap_or_default()
            ));
        } else {
            kinds.push(MemoryKind::CudaPeerMem);
        }
        (kinds, why_not)
    }

    /// Copies `src` into the region at `offset`, synchronously (the whole context is
    /// synchronised afterwards). For tests and diagnostics — standing in for the NIC — never
    /// in the data path.
    pub fn write_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_host_range("write_from_host", offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the symbol was checked at construction; `offset + src.len()` lies inside the
        // live allocation (checked) and `src` is readable for `src.len()` bytes.
        unsafe { driver::memcpy_htod(self.ptr() + offset as u64, src) }?;
        // A copy from pageable memory may still be in flight when the call returns.
        self.ctx
            .synchronize()
            .map_err(driver_err("cuCtxSynchronize"))
    }

    /// Copies `dst.len()` bytes of the region at `offset` into `dst`, after synchronising the
    /// whole context (so every stream's work on the region has finished). For tests and
    /// diagnostics, never in the data path.
    pub fn read_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_host_range("read_to_host", offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx
            .synchronize()
            .map_err(driver_err("cuCtxSynchronize"))?;
        // SAFETY: as in `write_from_host`; `dst` is writable for `dst.len()` bytes, and a copy
        // to pageable memory has completed when the call returns.
        unsafe { driver::memcpy_dtoh(dst, self.ptr() + offset as u64) }
    }

    fn check_host_range(&self, op: &str, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(bad(
                op,
                format!(
                    "{len} bytes at offset {offset} outside a {}-byte region",
                    self.len()
                ),
            )),
        }
    }

    fn take_events(&self) -> Vec<CudaEvent> {
        std::mem::take(&mut *self.events.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn give_events(&self, events: &mut Vec<CudaEvent>) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .append(events);
    }
}

/// Device buffers moved directly (GPUDirect RDMA) through a [`DirectRegion`], for the device
/// collectives (`Communicator::run_staged` with the `testing` feature) on a transport whose
/// direct region is that region.
///
/// Like [`CudaStagedDevice`](super::staged::CudaStagedDevice), it borrows the collective's
/// device buffers and the stream the work is ordered on for as long as the call runs; everything
/// is queued on that stream, and dropping the device waits for it.
pub struct CudaDirectDevice<'a> {
    reducer: &'a GpuReducer,
    stream: &'a Arc<CudaStream>,
    region: &'a DirectRegion,
    send_slots: usize,
    marks: Marks,
    events: Vec<CudaEvent>,
    // Last: cudarc's bookkeeping for the borrowed buffers, recorded when the device is dropped.
    bufs: DevBuffers<'a>,
}

impl std::fmt::Debug for CudaDirectDevice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl<'a> CudaDirectDevice<'a> {
    /// A direct device over `dst` (absent for a send) and `src` (when the collective has a
    /// separate input), using the first `send_slots` send slots of `region` (1 ..=
    /// `region.layout().send_slots`), ordered on `stream`, which must belong to the region's
    /// context, as must `reducer`.
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
        region: &'a DirectRegion,
        send_slots: usize,
    ) -> Result<Self>
    where
        T: DeviceRepr,
        S: DevicePtr<T>,
        D: DevicePtrMut<T>,
    {
        // The driver functions used here were checked when the region was created.
        check_contexts(
            "direct",
            "direct region",
            &region.ctx,
            stream,
            reducer,
            " (this rank registered the region's GPU with the NIC at init): set \
             DSPARK_CUDA_DEVICE (or the launcher's local rank) to the GPU this rank uses, or \
             DSPARK_DATA_PATH=host-staged",
        )?;
        if let Some(why) = region.stuck.get() {
            return Err(bad(
                "device",
                format!("the direct region is leaked and unusable: {why}"),
            ));
        }
        let layout = region.layout;
        if send_slots == 0 || send_slots > layout.send_slots {
            return Err(bad(
                "device",
                format!(
                    "{send_slots} send slots asked of a region with {}",
                    layout.send_slots
                ),
            ));
        }
        let bufs = DevBuffers::borrow("direct", stream, src, dst);
        Ok(CudaDirectDevice {
            reducer,
            stream,
            region,
            send_slots,
            marks: Marks::new(),
            events: region.take_events(),
            bufs,
        })
    }

    fn no_host_slots(op: &str) -> Error {
        bad(
            op,
            "a direct device has no host slots: payloads land in the direct region and are \
             consumed with land",
        )
    }
}

impl StagedDevice for CudaDirectDevice<'_> {
    fn send_slots(&self) -> usize {
        self.send_slots
    }

    fn recv_slots(&self) -> usize {
        0
    }

    fn slot_bytes(&self) -> usize {
        self.region.layout.slot_bytes
    }

    /// Unused in direct mode: empty.
    fn slot(&self, _i: usize) -> &[u8] {
        &[]
    }

    /// Unused in direct mode: empty.
    fn slot_mut(&mut self, _i: usize) -> &mut [u8] {
        &mut []
    }

    /// Enqueues a device-to-device copy of `src` into send slot `slot` of the region.
    fn d2h(&mut self, src: &DevRange, slot: usize) -> Result<()> {
        let n = src.bytes.len();
        let layout = self.region.layout;
        if slot >= self.send_slots || n > layout.slot_bytes {
            return Err(bad(
                "d2h",
                format!(
                    "send slot {slot} / {n} bytes outside {} send slots of {}",
                    self.send_slots, layout.slot_bytes
                ),
            ));
        }
        let s = self.bufs.ptr("d2h", src.buf, &src.bytes)?;
        if n == 0 {
            return Ok(());
        }
        let d = self.region.ptr() + layout.send(slot) as u64;
        // SAFETY: `s` covers `n` bytes of a borrowed device buffer and `d` `n` bytes of a send
        // slot of the live region (both checked); the engine hands the slot to the NIC only
        // after the mark following this copy, and reuses it only after the NIC read it; the
        // stream is synchronised before either buffer is released.
        unsafe { driver::memcpy_dtod_async(d, s, n, self.stream) }
    }

    fn h2d(&mut self, _slot: usize, _dst: Range<usize>) -> Result<()> {
        Err(Self::no_host_slots("h2d"))
    }

    fn h2d_reduce(
        &mut self,
        _slot: usize,
        _dst: Range<usize>,
        _acc: &DevRange,
        _dtype: DataType,
        _op: ReduceOp,
    ) -> Result<()> {
        Err(Self::no_host_slots("h2d_reduce"))
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
            .mark(&self.region.ctx, self.stream, &mut self.events)
    }

    fn reached(&mut self, mark: u64) -> Result<bool> {
        self.marks.reached(mark, &mut self.events)
    }

    fn synchronize(&mut self, deadline: Instant) -> Result<()> {
        self.marks.wait_all(
            &self.region.ctx,
            self.stream,
            &mut self.events,
            "direct synchronize",
            deadline,
        )
    }

    fn describe(&self) -> String {
        let layout = self.region.layout;
        format!(
            "CUDA device {} ({}): direct (GPUDirect RDMA), {} send slots of {} KiB and {} \
             landing slots per peer in GPU memory",
            self.region.ctx.ordinal(),
            self.reducer.arch(),
            self.send_slots,
            layout.slot_bytes / 1024,
            layout.slots
        )
    }

    fn buffer_bytes(&self) -> (usize, usize) {
        self.bufs.bytes()
    }

    fn direct(&self) -> bool {
        true
    }

    fn direct_base(&self) -> Option<u64> {
        Some(self.region.ptr())
    }

    /// Flushes the NIC's writes to the GPU (a host call, before anything is enqueued), then
    /// enqueues `Dst[dst] = region[offset..]` (a device-to-device copy) or `Dst[dst] = acc ⊕
    /// region[offset..]` (a reduction kernel reading the landing slot in place).
    fn land(
        &mut self,
        offset: usize,
        dst: Range<usize>,
        acc: Option<&DevRange>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let n = dst.len();
        match offset.checked_add(n) {
            Some(end) if end <= self.region.len() => {}
            _ => {
                return Err(bad(
                    "land",
                    format!(
                        "{n} bytes at landing offset {offset} outside the {}-byte region",
                        self.region.len()
                    ),
                ))
            }
        }
        let d = self.bufs.ptr("land", Buf::Dst, &dst)?;
        let a = match acc {
            Some(acc) => {
                if acc.bytes.len() != n || !n.is_multiple_of(dtype.size()) {
                    return Err(bad(
                        "land",
                        format!("{n} bytes into {dst:?} with acc {acc:?} of {dtype}"),
                    ));
                }
                Some(self.bufs.ptr("land", acc.buf, &acc.bytes)?)
            }
            None => None,
        };
        if n == 0 {
            return Ok(());
        }
        // The NIC's writes completed before the transport reported the payload; make them
        // visible to the copy or kernel enqueued next. (The region checked at creation that the
        // driver has the flush, so it is not looked up again per segment.)
        flush_gpudirect_writes_prechecked(&self.region.ctx)?;
        let incoming = self.region.ptr() + offset as u64;
        match a {
            // SAFETY: `d` covers `n` bytes of the borrowed destination and `incoming` `n` bytes
            // of the live region (both checked); the engine releases the landing slot to the
            // sender only after the mark following this copy is reached.
            None => unsafe { driver::memcpy_dtod_async(d, incoming, n, self.stream) },
            // SAFETY: `d` and `a` cover `n` bytes of borrowed device buffers, either the same
            // range (in place) or disjoint, as the engine uses them; `incoming` covers `n` bytes
            // of the region, disjoint from both; all on the reducer's context (checked at
            // construction); the landing slot is released only after the following mark.
            Some(a) => unsafe {
                self.reducer.reduce_into_raw(
                    self.stream,
                    dtype,
                    op,
                    d,
                    a,
                    incoming,
                    n / dtype.size(),
                )
            },
        }
    }
}

impl Drop for CudaDirectDevice<'_> {
    fn drop(&mut self) {
        // Copies into the send slots and reads of the landing slots must finish before the
        // region is used by the next collective; errors cannot be reported from Drop: past
        // the deadline the region is leaked and refuses every later device.
        if let Err(why) = self.marks.settle_for_drop(
            &self.region.ctx,
            self.stream,
            &mut self.events,
            "direct device drop",
        ) {
            tracing::error!(
                "{why}: leaking the direct region ({} B of GPU memory), which is never freed \
                 nor used again; direct device calls on this communicator fail from now on",
                self.region.len()
            );
            let _ = self.region.stuck.set(why);
        }
        self.region.give_events(&mut self.events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(world: usize, slots: usize, slot_bytes: usize, send_slots: usize) -> DirectLayout {
        DirectLayout {
            world,
            slots,
            slot_bytes,
            send_slots,
        }
    }

    #[test]
    fn a_region_can_be_shared_with_the_transports_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<DirectRegion>();
    }

    #[test]
    fn region_size_is_the_layouts_and_bad_layouts_are_typed_errors() {
        assert_eq!(region_bytes(&layout(2, 4, 1 << 20, 4)).unwrap(), 12 << 20);
        for l in [
            layout(2, 4, 1 << 20, 0),
            layout(2, 4, 0, 4),
            layout(2, 4, 1001, 4),
            layout(usize::MAX / 2, 4, 1 << 20, 4),
            layout(2, 4, usize::MAX - 7, 4),
        ] {
            match region_bytes(&l) {
                Err(Error::InvalidArgument { op, .. }) => assert_eq!(op, "direct region"),
                other => panic!("{l:?}: {other:?}"),
            }
        }
    }
}
