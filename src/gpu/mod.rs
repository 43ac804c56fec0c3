//! GPU memory support through cudarc: NVRTC reduction kernels, device probes, GPUDirect RDMA
//! facts.
//!
//! CUDA is loaded at run time (cudarc's `dynamic-loading`): the crate builds without a CUDA
//! toolkit and everything that does not touch a GPU works without one. cudarc panics when it is
//! asked to use a library that is missing, so every entry point here checks first
//! ([`libcuda_present`], [`nvrtc::libnvrtc_present`]) and reports absence as
//! [`Error::Unavailable`](crate::error::Error::Unavailable).
//!
//! - `cuda`: the one layer over CUDA's C APIs: every raw libcuda and libnvrtc call (through
//!   `cudarc::driver::sys` and `cudarc::nvrtc::sys`) is a small function there returning the
//!   crate's error, with the presence checks; the rest of `gpu/` calls only those.
//! - [`kernels`]: the CUDA C reduction kernels, their names, options and launch geometry (no GPU).
//! - [`nvrtc`]: run-time compilation with a process and disk cache (needs libnvrtc only).
//! - [`sysfs`]: nvidia-peermem detection, GPU↔NIC PCIe distance, RDMA port facts, read from
//!   sysfs under an injectable root (no CUDA at all).
//! - [`probe`]: the CUDA driver probe (driver version, devices, GPUDirect attributes).
//! - [`device`]: **GPU-only code**: kernel launches on a stream, dma-buf export. It cannot be
//!   exercised without a GPU; `tests/gpu/run_all.sh` runs it where one is present.
//! - [`staged`]: **GPU-only code**: the CUDA implementation of the engine's host-staged device
//!   path (pinned slots, async copies, reduction kernels, events as marks).
//! - `order`: **GPU-only code**: the doorbell that orders non-blocking device collectives on
//!   the caller's stream ([`crate::Communicator::enqueue`]).
//! - [`direct`]: **GPU-only code**: the GPUDirect RDMA device path: a region of GPU memory the
//!   NIC registers (dma-buf or nvidia-peermem), sends copied into it and payloads consumed from
//!   it on the device.
//!
//! `unsafe` in this module is FFI; every block carries a `// SAFETY:` comment. The raw calls are
//! all in `cuda`; the `unsafe` elsewhere is where soundness rests on device addresses and
//! host pointers that only the caller can vouch for.

pub(crate) mod cuda;
pub mod device;
pub mod direct;
pub mod kernels;
pub mod nvrtc;
pub(crate) mod order;
pub mod probe;
pub mod staged;
pub mod sysfs;

pub use nvrtc::libnvrtc_present;
pub use probe::libcuda_present;

/// What kind of memory a registration covers. Host memory is registered with `ibv_reg_mr`;
/// device memory comes with the GPU work: a dma-buf exported by the GPU driver
/// (`ibv_reg_dmabuf_mr`), or a device pointer that `ibv_reg_mr` accepts because
/// nvidia-peermem is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Ordinary process memory.
    Host,
    /// GPU memory exported as a dma-buf file descriptor; `offset` into it.
    CudaDmaBuf {
        /// The dma-buf file descriptor.
        fd: i32,
        /// Offset of the range inside the dma-buf.
        offset: u64,
    },
    /// A GPU device pointer registered through the nvidia-peermem kernel module.
    CudaPeerMem,
}
