//! **GPU-only code**: contexts, reduction kernel launches on a caller's stream, dma-buf export,
//! GPUDirect write flush.
//!
//! Nothing in this file can run on a machine without an NVIDIA GPU, so none of it is exercised
//! by `cargo test` there. It is kept small, every driver call is checked for presence before use
//! (cudarc panics on missing symbols), and `tests/gpu_device.rs` driven by `tests/gpu/run_all.sh`
//! tests it on a machine with a GPU (kernels against a CPU reference, bandwidth, dma-buf export).
//!
//! Stream ordering: every launch goes on the stream the caller passes. Work already queued there
//! runs first and work queued after it sees the result; buffers last used on other streams are
//! waited for through cudarc's per-buffer events. No device-wide synchronisation.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::cuda::driver::{self, require_driver_symbols, CUdevice_attribute};
use super::kernels::{self, KernelBuild, KernelKind, BLOCK_THREADS};
use super::nvrtc::{self, DiskCache, GpuArch, ImageKind};
use crate::error::{Error, Result};
use crate::types::{DataType, Element, ReduceOp};

/// Driver functions cudarc calls for a context, a module, streams, events and launches.
const CONTEXT_SYMBOLS: [&str; 22] = [
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxSynchronize",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventDestroy_v2",
    "cuEventSynchronize",
    "cuGetErrorString",
];

pub(crate) use super::cuda::driver::driver_err;

/// Opens (retains) the primary context of GPU `ordinal`, checking first that the driver and the
/// device exist: [`Error::Unavailable`] instead of cudarc's panic.
pub fn open_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    require_driver_symbols(&CONTEXT_SYMBOLS)?;
    if let Err(reason) = driver::init() {
        return Err(Error::unavailable(
            "CUDA device",
            format!("cuInit failed: {reason}"),
        ));
    }
    let count = driver::device_count()?;
    if ordinal >= count.max(0) as usize {
        return Err(Error::unavailable(
            format!("CUDA device {ordinal}"),
            format!("the driver reports {count} device(s) (check CUDA_VISIBLE_DEVICES)"),
        ));
    }
    // One wrapper per GPU for the process: cudarc synchronizes a context when the first
    // stream of a wrapper is made, which would wait (without a deadline) for a stream parked
    // on another communicator's queued call if every communicator opened its own.
    static OPEN: PerProcess<CudaContext> = PerProcess::new();
    OPEN.get_or_make(ordinal, || {
        CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain"))
    })
}

/// One value per key for the whole process, made by the first caller that asks (under the
/// lock, so it is made once): the CUDA context wrappers and the loaded reduction kernels.
struct PerProcess<T>(std::sync::Mutex<Vec<(usize, Arc<T>)>>);

impl<T> PerProcess<T> {
    const fn new() -> Self {
        PerProcess(std::sync::Mutex::new(Vec::new()))
    }

    fn get_or_make(&self, key: usize, make: impl FnOnce() -> Result<Arc<T>>) -> Result<Arc<T>> {
        let mut all = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, v)) = all.iter().find(|(k, _)| *k == key) {
            return Ok(Arc::clone(v));
        }
        let v = make()?;
        all.push((key, Arc::clone(&v)));
        Ok(v)
    }
}

/// The reduction kernels loaded on one GPU, ready to launch on any stream of its context.
#[derive(Debug)]
pub struct GpuReducer {
    ctx: Arc<CudaContext>,
    functions: HashMap<String, CudaFunction>,
    sm_count: u32,
    build: KernelBuild,
}

impl GpuReducer {
    /// Compiles (or fetches from the cache) every kernel for the context's GPU and loads them.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        Self::with_cache(ctx, &DiskCache::FromEnv)
    }

    /// The reducer of `ctx` loaded once per process and shared by every communicator
    /// (made with [`GpuReducer::with_cache`] by the first to ask): a sub-communicator's first
    /// device call (torch's point-to-point groups, `new_group`) loads no module while calls
    /// of others may keep a stream waiting, and the kernels are compiled and loaded once.
    pub fn shared(ctx: &Arc<CudaContext>, disk: &DiskCache) -> Result<Arc<GpuReducer>> {
        static LOADED: PerProcess<GpuReducer> = PerProcess::new();
        // The context's handle names it (two wrappers of one primary context share it).
        LOADED.get_or_make(ctx.cu_ctx() as usize, || {
            Ok(Arc::new(GpuReducer::with_cache(ctx, disk)?))
        })
    }

    /// [`GpuReducer::new`] with an explicit disk cache choice.
    pub fn with_cache(ctx: &Arc<CudaContext>, disk: &DiskCache) -> Result<Self> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("cuDeviceGetAttribute"))?;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_err("cuDeviceGetAttribute"))?;
        let arch = kernels::choose_arch(
            (major.max(0) as u32, minor.max(0) as u32),
            &nvrtc::supported_archs()?,
        )?;
        let build = kernels::compile_all(arch, disk)?;
        if build.compiled.kind == ImageKind::Cubin && build.compiled.functions.is_empty() {
            tracing::warn!(
                "no ptxas report from NVRTC for {arch}: the reduction kernels' register spills are unknown"
            );
        }
        for f in build.compiled.spilling() {
            tracing::warn!(
                kernel = %f.name, stores = f.spill_store_bytes, loads = f.spill_load_bytes,
                "reduction kernel spills registers on {arch}"
            );
        }
        let image = build.compiled.image.to_vec();
        let module = ctx
            .load_module(Ptx::from_binary(image))
            .map_err(driver_err("cuModuleLoadData"))?;
        let mut functions = HashMap::new();
        for (_, _, _, name) in kernels::all_kernels() {
            let f = module
                .load_function(&name)
                .map_err(driver_err("cuModuleGetFunction"))?;
            // Loaded now, not at its first launch (CUDA's lazy loading, the default since
            // 12.2): a load is not a plain stream operation, and none should happen inside a
            // running collective, where a caller's stream may be waiting for it and another
            // thread may hold the context's locks (see `staged::Marks::reuse_oldest`).
            // Asking for an attribute loads the function.
            f.num_regs().map_err(driver_err("cuFuncGetAttribute"))?;
            functions.insert(name, f);
        }
        Ok(GpuReducer {
            ctx: ctx.clone(),
            functions,
            sm_count: sm_count.max(1) as u32,
            build,
        })
    }

    /// The context the kernels are loaded in (launches must use streams of it).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The architecture the kernels were compiled for (`sm_90`, or `compute_XX` PTX).
    pub fn arch(&self) -> GpuArch {
        self.build.compiled.arch
    }

    /// The compile result (log, per-kernel registers and spills, cache origin).
    pub fn build(&self) -> &KernelBuild {
        &self.build
    }

    /// Whether the module was loaded from a CUBIN (else PTX JIT-compiled by the driver).
    pub fn is_cubin(&self) -> bool {
        self.build.compiled.kind == ImageKind::Cubin
    }

    fn function(&self, kind: KernelKind, dtype: DataType, op: ReduceOp) -> Result<&CudaFunction> {
        let name = kernels::kernel_name(kind, dtype, op);
        self.functions.get(&name).ok_or_else(|| Error::Cuda {
            rank: None,
            op: "cuModuleGetFunction".into(),
            what: format!("{name} not loaded"),
        })
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        if stream.context().as_ref() != self.ctx.as_ref() {
            return Err(Error::invalid(
                None,
                "gpu reduce",
                "the stream belongs to another CUDA context",
            ));
        }
        Ok(())
    }

    fn config(&self, n: usize, dtype: DataType) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                kernels::grid_size(n as u64, dtype.size(), self.sm_count),
                1,
                1,
            ),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn check_aligned(ptrs: &[u64], dtype: DataType) -> Result<()> {
        if ptrs.iter().any(|p| !p.is_multiple_of(dtype.size() as u64)) {
            return Err(Error::invalid(
                None,
                "gpu reduce",
                format!(
                    "device pointer not aligned to the {}-byte element size of {dtype}",
                    dtype.size()
                ),
            ));
        }
        Ok(())
    }

    /// `dst[i] = dst[i] ⊕ src[i]` for `n` elements of `dtype`, queued on `stream`. `Avg` reduces
    /// as `Sum` (finish with [`GpuReducer::finalize_raw`]).
    ///
    /// # Safety
    /// `dst` and `src` must be device pointers of this context valid for `n` elements of
    /// `dtype` until the launch completes, and must not partially overlap.
    pub unsafe fn reduce_inplace_raw(
        &self,
        stream: &CudaStream,
        dtype: DataType,
        op: ReduceOp,
        dst: u64,
        src: u64,
        n: usize,
    ) -> Result<()> {
        self.check_stream(stream)?;
        Self::check_aligned(&[dst, src], dtype)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(KernelKind::ReduceInplace, dtype, op)?;
        let n64 = n as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&dst).arg(&src).arg(&n64);
        // SAFETY: the kernel takes (T*, const T*, unsigned long long) and T matches `dtype`
        // (the function was chosen by it); the caller guarantees both ranges are valid for `n`
        // elements on this context; the arguments live until `launch` returns.
        unsafe { b.launch(self.config(n, dtype)) }.map_err(driver_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// `dst[i] = a[i] ⊕ b[i]`, queued on `stream`.
    ///
    /// # Safety
    /// As [`GpuReducer::reduce_inplace_raw`], for all three pointers (`dst` may equal `a`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_into_raw(
        &self,
        stream: &CudaStream,
        dtype: DataType,
        op: ReduceOp,
        dst: u64,
        a: u64,
        b: u64,
        n: usize,
    ) -> Result<()> {
        self.check_stream(stream)?;
        Self::check_aligned(&[dst, a, b], dtype)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(KernelKind::ReduceInto, dtype, op)?;
        let n64 = n as u64;
        let mut l = stream.launch_builder(f);
        l.arg(&dst).arg(&a).arg(&b).arg(&n64);
        // SAFETY: kernel signature (T*, const T*, const T*, unsigned long long) with T = dtype;
        // validity of the ranges is the caller's contract; arguments outlive the call.
        unsafe { l.launch(self.config(n, dtype)) }.map_err(driver_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// `dst[i] = dst[i] / world` (Avg's final step; integers truncate toward zero), on `stream`.
    ///
    /// # Safety
    /// `dst` must be a device pointer of this context valid for `n` elements of `dtype` until
    /// the launch completes.
    pub unsafe fn finalize_raw(
        &self,
        stream: &CudaStream,
        dtype: DataType,
        dst: u64,
        n: usize,
        world: usize,
    ) -> Result<()> {
        self.check_stream(stream)?;
        Self::check_aligned(&[dst], dtype)?;
        if world == 0 {
            return Err(Error::invalid(None, "gpu finalize", "world size 0"));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(KernelKind::Finalize, dtype, ReduceOp::Avg)?;
        let (n64, w64) = (n as u64, world as u64);
        let mut l = stream.launch_builder(f);
        l.arg(&dst).arg(&n64).arg(&w64);
        // SAFETY: kernel signature (T*, unsigned long long, unsigned long long) with T = dtype;
        // validity of the range is the caller's contract.
        unsafe { l.launch(self.config(n, dtype)) }.map_err(driver_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// Typed, safe `dst ⊕= src` on cudarc buffers or views (equal lengths), queued on `stream`.
    pub fn reduce_inplace<T, D, S>(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut D,
        src: &S,
        op: ReduceOp,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        D: DevicePtrMut<T>,
        S: DevicePtr<T>,
    {
        if dst.len() != src.len() {
            return Err(Error::invalid(
                None,
                "gpu reduce",
                format!("lengths differ: dst {} src {}", dst.len(), src.len()),
            ));
        }
        let n = dst.len();
        let (s, _sg) = src.device_ptr(stream);
        let (d, _dg) = dst.device_ptr_mut(stream);
        // SAFETY: both pointers come from live cudarc allocations of `n` elements of T, borrowed
        // for this call (one mutably, so they cannot be the same buffer); the guards record the
        // launch on the buffers' events when dropped after it.
        unsafe { self.reduce_inplace_raw(stream, T::DATA_TYPE, op, d, s, n) }
    }

    /// Typed, safe `dst = a ⊕ b` (equal lengths), queued on `stream`.
    pub fn reduce_into<T, D, A, B>(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut D,
        a: &A,
        b: &B,
        op: ReduceOp,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        D: DevicePtrMut<T>,
        A: DevicePtr<T>,
        B: DevicePtr<T>,
    {
        if dst.len() != a.len() || dst.len() != b.len() {
            return Err(Error::invalid(
                None,
                "gpu reduce",
                format!(
                    "lengths differ: dst {} a {} b {}",
                    dst.len(),
                    a.len(),
                    b.len()
                ),
            ));
        }
        let n = dst.len();
        let (pa, _ga) = a.device_ptr(stream);
        let (pb, _gb) = b.device_ptr(stream);
        let (pd, _gd) = dst.device_ptr_mut(stream);
        // SAFETY: as in `reduce_inplace`: live allocations of `n` elements, dst exclusively
        // borrowed.
        unsafe { self.reduce_into_raw(stream, T::DATA_TYPE, op, pd, pa, pb, n) }
    }

    /// Typed, safe `dst /= world` (Avg's final division), queued on `stream`.
    pub fn finalize<T, D>(&self, stream: &Arc<CudaStream>, dst: &mut D, world: usize) -> Result<()>
    where
        T: Element + DeviceRepr,
        D: DevicePtrMut<T>,
    {
        let n = dst.len();
        let (pd, _gd) = dst.device_ptr_mut(stream);
        // SAFETY: a live allocation of `n` elements, exclusively borrowed.
        unsafe { self.finalize_raw(stream, T::DATA_TYPE, pd, n, world) }
    }
}

/// Device memory from `cuMemAlloc` (not a stream-ordered pool allocation), its size rounded up
/// to whole host pages: the kind of memory that dma-buf export and NIC registration accept.
/// Freed on drop (errors ignored: `Drop` cannot report them, and a failed free only leaks).
#[derive(Debug)]
pub struct DeviceAllocation {
    ctx: Arc<CudaContext>,
    ptr: u64,
    len: usize,
    /// Never freed: device work that may still use it did not finish within its deadline.
    leaked: bool,
}

impl DeviceAllocation {
    /// Allocates at least `len` bytes (rounded up to the page size) on `ctx`'s GPU.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        require_driver_symbols(&["cuMemAlloc_v2", "cuMemFree_v2"])?;
        let page = page_size() as usize;
        let len = len.max(1).div_ceil(page) * page;
        ctx.bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let ptr = driver::mem_alloc(len)?;
        Ok(DeviceAllocation {
            ctx: ctx.clone(),
            ptr,
            len,
            leaked: false,
        })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size in bytes (a multiple of the page size).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (allocations have at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the memory allocated for the rest of the process (dropping it frees nothing):
    /// for memory that device work which never finished may still use.
    pub(crate) fn leak(&mut self) {
        self.leaked = true;
    }

    /// Exports the whole allocation as a dma-buf (see [`export_dmabuf`]).
    pub fn export_dmabuf(&self) -> Result<OwnedFd> {
        // SAFETY: the range is exactly this live cuMemAlloc allocation of `ctx`, which outlives
        // the call; the descriptor keeps its own reference to the pages in the exporter.
        unsafe { export_dmabuf(&self.ctx, self.ptr, self.len) }
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        if !self.leaked && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc_v2 in this context and is freed exactly once.
            unsafe { driver::mem_free(self.ptr) };
        }
    }
}

fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map(|v| v as u64)
        .unwrap_or(4096)
}

/// Exports `[ptr, ptr+len)` of device memory as a dma-buf file descriptor
/// (`cuMemGetHandleForAddressRange`, `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`), to be registered
/// with the NIC through `ibv_reg_dmabuf_mr`. `ptr` and `len` must be multiples of the host page
/// size. [`Error::Unavailable`] when the driver or the GPU does not support dma-buf.
///
/// # Safety
/// `ptr..ptr+len` must be device memory allocated in `ctx` (cuMemAlloc / cudarc) that stays
/// allocated while the returned descriptor is in use.
pub unsafe fn export_dmabuf(ctx: &Arc<CudaContext>, ptr: u64, len: usize) -> Result<OwnedFd> {
    require_driver_symbols(&["cuMemGetHandleForAddressRange"])?;
    let page = page_size();
    if !ptr.is_multiple_of(page) || !(len as u64).is_multiple_of(page) || len == 0 {
        return Err(Error::invalid(
            None,
            "dma-buf export",
            format!(
                "range {ptr:#x}+{len} is not a non-empty multiple of the {page}-byte page size"
            ),
        ));
    }
    ctx.bind_to_thread()
        .map_err(driver_err("cuCtxSetCurrent"))?;
    // SAFETY: the range is device memory of `ctx`, now current, that stays allocated while the
    // descriptor is in use: the caller's contract.
    unsafe { driver::dmabuf_fd_for_range(ptr, len) }
}

/// Makes GPUDirect RDMA writes that the NIC has completed visible to work launched afterwards
/// in the current context (`cuFlushGPUDirectRDMAWrites`, to the owner). Call before a kernel
/// reads data a peer wrote into this GPU's memory, unless the transport flushes by other means
/// (an RDMA READ on a loop-back QP, as NCCL does).
pub fn flush_gpudirect_writes(ctx: &Arc<CudaContext>) -> Result<()> {
    require_driver_symbols(&["cuFlushGPUDirectRDMAWrites"])?;
    flush_gpudirect_writes_prechecked(ctx)
}

/// [`flush_gpudirect_writes`] without looking the driver function up again (a `dlsym`), for
/// the data path: only for callers that know `cuFlushGPUDirectRDMAWrites` was found (a
/// [`DirectRegion`](super::direct::DirectRegion) checks it when it is created); cudarc would
/// panic on a missing symbol.
pub(crate) fn flush_gpudirect_writes_prechecked(ctx: &Arc<CudaContext>) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(driver_err("cuCtxSetCurrent"))?;
    // The symbol exists (checked by the caller's constructor, see above) and a context is
    // current.
    driver::flush_gpudirect_rdma_writes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_a_context_without_a_driver_is_unavailable_not_a_panic() {
        if super::super::probe::libcuda_present() {
            eprintln!("skipped: libcuda is present (tests/gpu/run_all.sh covers this machine)");
            return;
        }
        let e = open_context(0).unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
        assert!(e.to_string().contains("libcuda"), "{e}");
        assert!(flush_gpudirect_writes_without_ctx_is_unavailable());
    }

    fn flush_gpudirect_writes_without_ctx_is_unavailable() -> bool {
        matches!(
            require_driver_symbols(&["cuFlushGPUDirectRDMAWrites"]),
            Err(Error::Unavailable { .. })
        )
    }
}
