//! Memory the NIC reads or writes besides the slot memory of each connection: the direct region
//! (GPU memory registered for GPUDirect RDMA through dma-buf or nvidia-peermem, or host memory
//! emulating it in tests), announced to the other ranks at init, and caller buffers registered
//! for zero-copy sends.

use std::sync::Arc;

use super::ib::{Access, Memory, Mr, Pd};
use super::options::{direct_layout, reg_hint, VerbsOptions};
use super::wire::{DirectInfo, DirectKind};
use super::VerbsTransport;
use crate::error::{Error, Result};
use crate::gpu::MemoryKind;
use crate::transport::{DirectLayout, RegionAccess};

/// What this rank brings as its direct region (GPUDirect RDMA), decided before the transport
/// is set up: the region must be registered with the protection domain before the connection
/// information is exchanged.
#[derive(Debug, Clone, Default)]
pub enum DirectSpec {
    /// No device memory will move directly (host-only, or staging requested).
    #[default]
    None,
    /// Device memory cannot be registered here, and why (announced to the other ranks).
    Unavailable(String),
    /// Host memory allocated by the transport stands in for GPU memory: the GPUDirect protocol
    /// on machines without a GPU (tests). Reported as emulation, never as GPUDirect.
    HostEmulated {
        /// Send slots in the region.
        send_slots: usize,
    },
    /// GPU memory of [`direct_layout`]`.len()` bytes at `addr`, with the registrations to try
    /// in order (dma-buf first, then nvidia-peermem) and the reasons for mechanisms that were
    /// not even candidates.
    Device {
        /// Device address of the region.
        addr: u64,
        /// Send slots in the region.
        send_slots: usize,
        /// Registrations to try, in order.
        candidates: Vec<MemoryKind>,
        /// Why the other mechanisms are not candidates.
        reasons: Vec<String>,
    },
}

/// Host memory that a NIC writes into, accessed only by copies (the emulated direct region).
#[derive(Debug)]
pub(super) struct HostRegion {
    mem: Memory,
    /// Serialises the host's copies: `read` and `write` are safe methods reachable from any
    /// thread (the NIC's writes are kept apart by the protocol, not by this lock).
    copies: std::sync::Mutex<()>,
}

// SAFETY: the memory is plain process memory; host accesses are raw copies made under
// `copies`, and the NIC writes only ranges the protocol keeps apart from them.
unsafe impl Sync for HostRegion {}

impl RegionAccess for HostRegion {
    fn id(&self) -> u64 {
        self.mem.as_ptr() as u64
    }
    fn read(&self, off: usize, dst: &mut [u8]) -> bool {
        if off
            .checked_add(dst.len())
            .is_none_or(|e| e > self.mem.len())
        {
            return false;
        }
        let _copying = self.copies.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: in bounds (checked); the NIC finished writing this range (its completion
        // was polled) and does not write it again before the slot is released.
        unsafe {
            std::ptr::copy_nonoverlapping(self.mem.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
        true
    }
    fn write(&self, off: usize, src: &[u8]) -> bool {
        if off
            .checked_add(src.len())
            .is_none_or(|e| e > self.mem.len())
        {
            return false;
        }
        let _copying = self.copies.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: in bounds (checked); send slots are read by the NIC only between a post
        // and its completion, and the engine writes a slot only outside that window.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.mem.as_ptr().add(off), src.len())
        }
        true
    }
}

/// This rank's registered direct region.
#[derive(Debug)]
pub(super) struct DirectOwn {
    // Field order is drop order: the MR before the memory it covers.
    pub(super) mr: Mr,
    pub(super) host: Option<Arc<HostRegion>>,
    pub(super) kind: DirectKind,
    pub(super) layout: DirectLayout,
}

impl DirectOwn {
    /// The region as announced to the other ranks.
    fn info(&self) -> DirectInfo {
        DirectInfo::Region {
            kind: self.kind,
            addr: self.mr.addr,
            rkey: self.mr.rkey,
            slot_bytes: self.layout.slot_bytes as u32,
        }
    }

    fn announced(self) -> (Option<DirectOwn>, DirectInfo) {
        let info = self.info();
        (Some(self), info)
    }
}

pub(super) fn register_direct(
    pd: &Pd,
    world: usize,
    opts: &VerbsOptions,
    spec: &DirectSpec,
) -> (Option<DirectOwn>, DirectInfo) {
    match spec {
        DirectSpec::None => (None, DirectInfo::None),
        DirectSpec::Unavailable(why) => (None, DirectInfo::Unavailable(why.clone())),
        DirectSpec::HostEmulated { send_slots } => {
            let layout = direct_layout(world, opts, *send_slots);
            let Some(mem) = Memory::new(layout.len()) else {
                return (
                    None,
                    DirectInfo::Unavailable("cannot allocate the emulated region".into()),
                );
            };
            // SAFETY: the memory is owned by the `DirectOwn` (through the Arc), whose MR is
            // dropped first; accesses are copies (HostRegion).
            match unsafe { pd.register(mem.as_ptr(), layout.len(), Access::RemoteWrite) } {
                Ok(mr) => DirectOwn {
                    mr,
                    host: Some(Arc::new(HostRegion {
                        mem,
                        copies: std::sync::Mutex::new(()),
                    })),
                    kind: DirectKind::HostEmulated,
                    layout,
                }
                .announced(),
                Err(e) => (None, DirectInfo::Unavailable(reg_hint(&e))),
            }
        }
        DirectSpec::Device {
            addr,
            send_slots,
            candidates,
            reasons,
        } => {
            let layout = direct_layout(world, opts, *send_slots);
            let mut why = reasons.clone();
            for &kind in candidates {
                // SAFETY: the caller (the communicator) keeps the device allocation alive
                // until after the transport is dropped, and only moves data in it through
                // the engine's protocol.
                let r = unsafe {
                    match kind {
                        MemoryKind::CudaDmaBuf { fd, offset } => {
                            pd.register_dmabuf(fd, offset, layout.len(), *addr, Access::RemoteWrite)
                        }
                        MemoryKind::CudaPeerMem => {
                            pd.register(*addr as *mut u8, layout.len(), Access::RemoteWrite)
                        }
                        MemoryKind::Host => continue,
                    }
                };
                let dk = match kind {
                    MemoryKind::CudaDmaBuf { .. } => DirectKind::DmaBuf,
                    _ => DirectKind::PeerMem,
                };
                match r {
                    Ok(mr) => {
                        if dk == DirectKind::PeerMem && !why.is_empty() {
                            // The mechanism shows in the data path; why not dma-buf, here (a
                            // closed kernel module, an rdma-core without dma-buf: usual, and
                            // about as fast, so not a warning).
                            tracing::info!(
                                "GPU memory registered with the NIC through nvidia-peermem, \
                                 not dma-buf: {}",
                                why.join("; ")
                            );
                        }
                        return DirectOwn {
                            mr,
                            host: None,
                            kind: dk,
                            layout,
                        }
                        .announced();
                    }
                    Err(e) => {
                        let name = if dk == DirectKind::DmaBuf {
                            "dma-buf"
                        } else {
                            "peermem"
                        };
                        why.push(format!("{name}: {} failed: {}", e.verb, e.err));
                    }
                }
            }
            if why.is_empty() {
                why.push("no registration mechanism for GPU memory".into());
            }
            (None, DirectInfo::Unavailable(why.join("; ")))
        }
    }
}

/// A caller buffer registered for zero-copy sends.
#[derive(Debug)]
pub(super) struct UserMr {
    pub(super) id: u64,
    start: u64,
    end: u64,
    kind: MemoryKind,
    mr: Mr,
}

impl VerbsTransport {
    /// Gives up this rank's direct region: its registration is dropped (and, when emulated,
    /// its host memory), and no connection sends direct frames any more — from now on a
    /// direct frame is neither sent by this rank (`direct_peer` is false, `send_direct`
    /// fails) nor accepted (one that arrives breaks the protocol). The communicator's setup
    /// calls this on every rank at init when GPUDirect RDMA is not used job-wide, before the
    /// GPU memory under the registration is freed. Returns the bytes the region covered, or
    /// `None` when there was none.
    pub fn drop_direct_region(&mut self) -> Option<usize> {
        for p in self.peers.iter_mut().flatten() {
            p.their_landing = None;
        }
        self.direct.take().map(|d| d.layout.len())
    }
}

impl VerbsTransport {
    /// Registers memory of `kind` for zero-copy sends; returns its id for
    /// [`Registering::deregister`](crate::transport::Registering::deregister).
    ///
    /// # Safety
    /// `addr..addr+len` must stay mapped and hold the data to send until the registration is
    /// released with `deregister` (or the transport is dropped). Freeing the buffer while it
    /// is registered and reusing the address for a new allocation makes later sends from that
    /// address transmit the *old* pinned pages.
    ///
    /// # Errors
    /// [`Error::Transport`] naming the verb (`ibv_reg_mr`, `ibv_reg_dmabuf_mr`) and the OS error.
    pub unsafe fn register_raw(&mut self, kind: MemoryKind, addr: u64, len: usize) -> Result<u64> {
        let r = match kind {
            // SAFETY: the caller's contract.
            MemoryKind::Host | MemoryKind::CudaPeerMem => unsafe {
                self.pd.register(addr as *mut u8, len, Access::LocalWrite)
            },
            // SAFETY: the caller's contract covers the dma-buf range.
            MemoryKind::CudaDmaBuf { fd, offset } => unsafe {
                self.pd
                    .register_dmabuf(fd, offset, len, addr, Access::LocalWrite)
            },
        };
        let mr = r.map_err(|e| Error::Transport {
            rank: Some(self.rank),
            peer: None,
            op: e.verb.into(),
            what: format!(
                "registering {len} bytes of {kind:?} memory at {addr:#x}: {}",
                reg_hint(&e)
            ),
        })?;
        let id = self.next_mr_id;
        self.next_mr_id += 1;
        self.user_mrs.push(UserMr {
            id,
            start: addr,
            end: addr + len as u64,
            kind,
            mr,
        });
        Ok(id)
    }

    pub(super) fn lookup_mr(&self, data: &[u8]) -> Option<u32> {
        let a = data.as_ptr() as u64;
        let b = a + data.len() as u64;
        self.user_mrs
            .iter()
            .find(|m| m.kind == MemoryKind::Host && m.start <= a && b <= m.end)
            .map(|m| m.mr.lkey)
    }
}
