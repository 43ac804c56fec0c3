//! The CUDA driver (libcuda) calls of the crate: presence and symbol checks, error texts, the
//! device queries of the probe, allocation, copies, dma-buf export, the GPUDirect flush and the
//! stream wait of the doorbell — each a small function over one `cudarc::driver::sys` call,
//! returning the crate's [`Error`] (see [the layer's docs](super)).
//!
//! Every function below [`require_driver_symbols`] calls a driver function that the caller
//! must have checked with [`require_driver_symbols`] first (cudarc panics on a missing symbol;
//! the safe layer checks once, when it creates the object that makes the calls). Contexts are
//! made current by the callers, through cudarc, before the calls that need one.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::{sys, CudaStream, DriverError};

use crate::error::{Error, Result};

pub(crate) use sys::{
    CUdevice_attribute, CUdeviceptr, CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE,
};

/// Whether libcuda (the CUDA driver library) can be loaded on this machine.
pub fn libcuda_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's fixed list of names for the
        // driver library and closes what it opens; it is unsafe because loading a library runs
        // its initialisers, which for libcuda is the vendor's intended use.
        unsafe { sys::is_culib_present() }
    })
}

/// Why libcuda is missing, and what to do, in one sentence.
pub const NO_LIBCUDA: &str = "libcuda.so (the NVIDIA driver's CUDA library) could not be loaded: \
    no NVIDIA driver is installed, or the container does not expose it (--gpus / nvidia-container-toolkit)";

/// Checks that the driver exports every function in `names` (so that cudarc's loader cannot
/// panic on a missing symbol).
pub(crate) fn require_driver_symbols(names: &[&str]) -> Result<()> {
    if !libcuda_present() {
        return Err(Error::unavailable("CUDA", NO_LIBCUDA));
    }
    for name in names {
        // SAFETY: libcuda is present, so `culib()` loads it without panicking; looking a symbol up
        // only reads the library's symbol table and the returned pointer is dropped unused.
        let found = unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(name.as_bytes())
                .is_ok()
        };
        if !found {
            return Err(Error::unavailable(
                format!("CUDA driver function {name}"),
                "the installed NVIDIA driver is too old for this function: update the driver",
            ));
        }
    }
    Ok(())
}

/// Turns a driver result into `Result`, with the driver's error name in the message.
fn cu_check(op: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            rank: None,
            op: op.to_string(),
            what: cu_error_text(r),
        })
    }
}

/// `CUDA_ERROR_X: description` for a driver result (`e.0` of a cudarc [`DriverError`]).
pub(crate) fn cu_error_text(r: sys::CUresult) -> String {
    let mut desc: *const c_char = std::ptr::null();
    // SAFETY: only called after libcuda was found present (every caller went through
    // `require_driver_symbols`); cuGetErrorString writes a pointer to a static string or leaves it
    // null.
    let ok = unsafe { sys::cuGetErrorString(r, &mut desc) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !desc.is_null() {
        // SAFETY: non-null pointers from cuGetErrorString are static NUL-terminated strings.
        let d = unsafe { CStr::from_ptr(desc) }.to_string_lossy();
        format!("{r:?}: {d}")
    } else {
        format!("{r:?}")
    }
}

/// Maps a cudarc driver error to [`Error::Cuda`] naming `op` (for `map_err` on cudarc's safe
/// API).
pub(crate) fn driver_err(op: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Cuda {
        rank: None,
        op: op.to_string(),
        what: cu_error_text(e.0),
    }
}

/// `cuDriverGetVersion`: the driver API version as the driver encodes it (12080 for 12.8), or
/// `None` when the call fails.
pub(crate) fn driver_version() -> Option<c_int> {
    let mut version: c_int = 0;
    // SAFETY: the symbol exists (the caller checked); writes one int.
    (unsafe { sys::cuDriverGetVersion(&mut version) } == sys::CUresult::CUDA_SUCCESS)
        .then_some(version)
}

/// `cuInit(0)`. `Err`: the driver's reason as [`cu_error_text`] gives it (the callers word the
/// failure themselves: no device is not an error for the probe).
pub(crate) fn init() -> std::result::Result<(), String> {
    // SAFETY: the symbol exists (the caller checked); cuInit(0) is the documented first call and
    // may be called any number of times.
    let r = unsafe { sys::cuInit(0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(cu_error_text(r));
    }
    Ok(())
}

/// `cuDeviceGetCount` (after [`init`]).
pub(crate) fn device_count() -> Result<c_int> {
    let mut count: c_int = 0;
    // SAFETY: the driver is initialised; writes one int.
    cu_check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(count)
}

/// `cuDeviceGet`: the handle of device `ordinal` (`< device_count()`).
pub(crate) fn device_get(ordinal: c_int) -> Result<sys::CUdevice> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: the driver is initialised; writes one handle (an invalid ordinal is an error
    // result, not undefined behaviour).
    cu_check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
}

/// Bytes up to the first NUL of a C string buffer.
fn c_buf_text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `cuDeviceGetName`: the device's marketing name (at most 255 bytes).
pub(crate) fn device_name(dev: sys::CUdevice) -> Result<String> {
    let mut name = [0 as c_char; 256];
    // SAFETY: `name` has 256 bytes and the length passed is 255, so the result stays
    // NUL-terminated (the buffer starts zeroed).
    cu_check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), 255, dev)
    })?;
    Ok(c_buf_text(&name))
}

/// `cuDeviceGetPCIBusId`: the device's PCI address as the driver prints it, `None` when the
/// call fails.
pub(crate) fn device_pci_bus_id(dev: sys::CUdevice) -> Option<String> {
    let mut bus = [0 as c_char; 64];
    // SAFETY: `bus` has 64 bytes, the length passed is 63 (NUL kept).
    (unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 63, dev) } == sys::CUresult::CUDA_SUCCESS)
        .then(|| c_buf_text(&bus))
}

/// `cuDeviceTotalMem_v2`: the device's memory in bytes, `None` when the call fails.
pub(crate) fn device_total_mem(dev: sys::CUdevice) -> Option<usize> {
    let mut total: usize = 0;
    // SAFETY: writes one usize.
    (unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) } == sys::CUresult::CUDA_SUCCESS)
        .then_some(total)
}

/// `cuDeviceGetAttribute`: `None` when the call fails (an attribute unknown to an older driver).
pub(crate) fn device_attribute(dev: sys::CUdevice, attr: CUdevice_attribute) -> Option<i32> {
    let mut v: c_int = 0;
    // SAFETY: `dev` came from cuDeviceGet; the call writes one int. An attribute unknown to an
    // older driver returns CUDA_ERROR_INVALID_VALUE, reported as `None`.
    (unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) } == sys::CUresult::CUDA_SUCCESS)
        .then_some(v)
}

/// `cuMemAlloc_v2`: `bytes` of device memory in the current context.
pub(crate) fn mem_alloc(bytes: usize) -> Result<CUdeviceptr> {
    let mut ptr: CUdeviceptr = 0;
    // SAFETY: the symbol exists and the context is current (the caller's duties; a missing
    // context is an error result); the driver writes one pointer.
    cu_check("cuMemAlloc_v2", unsafe {
        sys::cuMemAlloc_v2(&mut ptr, bytes)
    })?;
    Ok(ptr)
}

/// `cuMemFree_v2`, errors ignored (callers free in `Drop`, which cannot report them, and a
/// failed free only leaks).
///
/// # Safety
/// `ptr` came from [`mem_alloc`] in the current context, is freed exactly once, and no queued
/// work still uses it.
pub(crate) unsafe fn mem_free(ptr: CUdeviceptr) {
    // SAFETY: the caller's contract: `ptr` came from cuMemAlloc_v2 in this context and is freed
    // exactly once.
    let _ = unsafe { sys::cuMemFree_v2(ptr) };
}

/// `cuMemGetHandleForAddressRange` with `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`: the range as a
/// new dma-buf descriptor. [`Error::Unavailable`] when the driver or the GPU cannot export.
///
/// # Safety
/// `ptr..ptr+len` must be device memory of the current context (cuMemAlloc / cudarc) that
/// stays allocated while the returned descriptor is in use.
pub(crate) unsafe fn dmabuf_fd_for_range(ptr: CUdeviceptr, len: usize) -> Result<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: the symbol exists; `fd` is a valid int for the driver to write the descriptor to
    // (the handle type DMA_BUF_FD returns an int); the range is device memory of the current
    // context by the caller's contract; flags must be 0.
    let r = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut c_int).cast::<c_void>(),
            ptr,
            len,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    match r {
        sys::CUresult::CUDA_SUCCESS if fd >= 0 => {
            // SAFETY: the driver returned a new descriptor that nothing else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
        sys::CUresult::CUDA_SUCCESS => {
            Err(Error::Cuda { rank: None, op: "cuMemGetHandleForAddressRange".into(), what: format!("returned fd {fd}") })
        }
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_INVALID_VALUE => Err(Error::unavailable(
            "dma-buf export of device memory",
            format!(
                "cuMemGetHandleForAddressRange: {} (needs an open-kernel-module NVIDIA driver >= 515, \
                 Turing or newer, and a Linux kernel with dma-buf support)",
                cu_error_text(r)
            ),
        )),
        other => Err(Error::Cuda { rank: None, op: "cuMemGetHandleForAddressRange".into(), what: cu_error_text(other) }),
    }
}

/// `cuFlushGPUDirectRDMAWrites` to the owner, for the current context.
pub(crate) fn flush_gpudirect_rdma_writes() -> Result<()> {
    // SAFETY: the symbol exists (checked by the caller's constructor) and a context is current;
    // the call takes two enum values.
    cu_check("cuFlushGPUDirectRDMAWrites", unsafe {
        sys::cuFlushGPUDirectRDMAWrites(
            sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
            sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
        )
    })
}

/// `cuMemsetD8_v2`: sets `bytes` bytes at `dst` to `value` (on the legacy default stream).
///
/// # Safety
/// `dst..dst+bytes` must be live device memory of the current context.
pub(crate) unsafe fn memset_d8(dst: CUdeviceptr, value: u8, bytes: usize) -> Result<()> {
    // SAFETY: the symbol was checked and the context is current; the range is live device
    // memory of it by the caller's contract.
    cu_check("cuMemsetD8_v2", unsafe {
        sys::cuMemsetD8_v2(dst, value, bytes)
    })
}

/// `cuMemcpyHtoD_v2`: copies `src` to device address `dst` (from pageable memory the copy may
/// still be in flight when this returns: synchronise the context before relying on it).
///
/// # Safety
/// `dst..dst+src.len()` must be live device memory of the current context.
pub(crate) unsafe fn memcpy_htod(dst: CUdeviceptr, src: &[u8]) -> Result<()> {
    // SAFETY: the symbol was checked at construction; the device range is live by the caller's
    // contract and `src` is readable for `src.len()` bytes.
    cu_check("cuMemcpyHtoD_v2", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
    })
}

/// `cuMemcpyDtoH_v2`: copies `dst.len()` bytes at device address `src` into `dst` (complete
/// when this returns).
///
/// # Safety
/// `src..src+dst.len()` must be live device memory of the current context, with no work
/// still writing it.
pub(crate) unsafe fn memcpy_dtoh(dst: &mut [u8], src: CUdeviceptr) -> Result<()> {
    // SAFETY: the device range is live by the caller's contract; `dst` is writable for
    // `dst.len()` bytes, and a copy to pageable memory has completed when the call returns.
    cu_check("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
    })
}

/// The one `cuMemcpyDtoDAsync_v2` call, its failure named `op`.
///
/// # Safety
/// As [`memcpy_dtod_async`].
unsafe fn dtod_async(
    op: &str,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: the symbol was checked; both ranges are device memory of the stream's context,
    // valid when the copy runs and disjoint, by the caller's contract.
    cu_check(op, unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream())
    })
}

/// `cuMemcpyDtoDAsync_v2`: queues a copy of `bytes` bytes from device address `src` to `dst`
/// on `stream`.
///
/// # Safety
/// Both ranges must be device memory of `stream`'s context, valid for those bytes until the
/// copy has run on the stream, and must not overlap.
pub(crate) unsafe fn memcpy_dtod_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: the caller's contract, passed on.
    unsafe { dtod_async("cuMemcpyDtoDAsync", dst, src, bytes, stream) }
}

/// Queues a copy of `bytes` bytes from device address `src` to `dst` on `stream`, checking
/// the driver function and making the stream's context current first (for callers outside
/// `gpu/` that hold no object which checked it).
///
/// # Safety
/// Both ranges must be device memory of `stream`'s context, valid for those bytes when the
/// copy runs on the stream, and must not overlap.
pub(crate) unsafe fn copy_dtod_async(
    stream: &CudaStream,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    require_driver_symbols(&["cuMemcpyDtoDAsync_v2"])?;
    stream
        .context()
        .bind_to_thread()
        .map_err(driver_err("cuCtxSetCurrent"))?;
    // SAFETY: the caller's contract; the symbol was checked above.
    unsafe { dtod_async("cuMemcpyDtoDAsync_v2", dst, src, bytes, stream) }
}

/// `cuMemcpyHtoDAsync_v2`: queues a copy of `bytes` bytes from pinned host memory at `src` to
/// device address `dst` on `stream`.
///
/// # Safety
/// `src` must be page-locked host memory readable for `bytes` bytes, and `dst..dst+bytes`
/// device memory of `stream`'s context, both valid and not written by anyone else until the
/// copy has run on the stream.
pub(crate) unsafe fn memcpy_htod_async(
    dst: CUdeviceptr,
    src: *const u8,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: the symbol was checked; both ranges are valid until the copy ran, by the caller's
    // contract.
    cu_check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream.cu_stream())
    })
}

/// `cuMemcpyDtoHAsync_v2`: queues a copy of `bytes` bytes from device address `src` to pinned
/// host memory at `dst` on `stream`.
///
/// # Safety
/// `dst` must be page-locked host memory writable for `bytes` bytes and `src..src+bytes`
/// device memory of `stream`'s context, both valid, and `dst` neither read nor written by
/// anyone else, until the copy has run on the stream.
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: the symbol was checked; both ranges are valid until the copy ran, by the caller's
    // contract.
    cu_check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream.cu_stream())
    })
}

/// `cuMemHostAlloc`: `bytes` of page-locked host memory of the current context, with `flags`
/// (0, or `CU_MEMHOSTALLOC_*`). Never null.
pub(crate) fn mem_host_alloc(bytes: usize, flags: c_uint) -> Result<*mut c_void> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: the symbol was checked by the caller and a context is current; the driver writes
    // one pointer.
    cu_check("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&mut p, bytes, flags)
    })?;
    if p.is_null() {
        return Err(Error::Cuda {
            rank: None,
            op: "cuMemHostAlloc".into(),
            what: "null pointer".into(),
        });
    }
    Ok(p)
}

/// `cuMemFreeHost`, errors ignored (callers free in `Drop`, which cannot report them, and a
/// failed free only leaks).
///
/// # Safety
/// `p` came from [`mem_host_alloc`], is freed exactly once, and no copy or stream still uses
/// it.
pub(crate) unsafe fn mem_free_host(p: *mut c_void) {
    // SAFETY: the caller's contract: `p` came from cuMemHostAlloc and is freed once, unused.
    let _ = unsafe { sys::cuMemFreeHost(p) };
}

/// `cuMemHostGetDevicePointer_v2`: the device address of device-mapped pinned host memory `p`
/// (from [`mem_host_alloc`] with `CU_MEMHOSTALLOC_DEVICEMAP`).
pub(crate) fn mem_host_get_device_pointer(p: *mut c_void) -> Result<CUdeviceptr> {
    let mut dev: CUdeviceptr = 0;
    // SAFETY: the driver only looks `p` up among its host allocations (memory it did not map is
    // an error result) and writes one address; flags must be 0.
    cu_check("cuMemHostGetDevicePointer_v2", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0)
    })?;
    Ok(dev)
}

/// `cuStreamWaitValue32_v2` with `CU_STREAM_WAIT_VALUE_GEQ`: `stream` waits (on the GPU) until
/// the 32-bit word at device address `addr` is `value` or after it (cyclically).
///
/// # Safety
/// `addr` must be a device-mapped word of `stream`'s context that stays allocated until every
/// wait queued on it has passed.
pub(crate) unsafe fn stream_wait_value32_geq(
    stream: &CudaStream,
    addr: CUdeviceptr,
    value: u32,
) -> Result<()> {
    // SAFETY: the symbol was checked by the caller; the stream belongs to the word's context and
    // the address is the device mapping of the live word, by the caller's contract.
    cu_check("cuStreamWaitValue32", unsafe {
        sys::cuStreamWaitValue32_v2(
            stream.cu_stream(),
            addr,
            value,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
    })
}
