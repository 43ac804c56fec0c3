//! The safe layer over `dspark-sys`: owned verbs objects that release themselves on drop,
//! errors that name the verb and the OS error, and the few `unsafe` calls, each with the
//! contract it relies on.
//!
//! Ownership: every object holds an `Arc` of the loaded library, so the library outlives all
//! of them. Objects are destroyed in the reverse order of their creation by the owner
//! ([`super::VerbsTransport`] declares its fields so that queue pairs and memory regions drop
//! before the completion queue, protection domain and context).

use std::ffi::CStr;
use std::io;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use dspark_sys as ffi;

use super::qp::{check_transition, AttrMask, QpState};

/// The loaded library, shared by every object made from it.
#[derive(Clone)]
pub struct Lib(Arc<ffi::IbvLib>);

impl std::fmt::Debug for Lib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(ffi::LIBIBVERBS)
    }
}

impl std::ops::Deref for Lib {
    type Target = ffi::IbvLib;
    fn deref(&self) -> &ffi::IbvLib {
        &self.0
    }
}

/// A failed verb: its name and the OS error (or a description).
#[derive(Debug)]
pub struct VerbError {
    /// The C call, e.g. `ibv_reg_mr`.
    pub verb: &'static str,
    /// What went wrong.
    pub err: io::Error,
}

impl std::fmt::Display for VerbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {}", self.verb, self.err)
    }
}

/// Result of a verb.
pub type VResult<T> = Result<T, VerbError>;

fn last(verb: &'static str) -> VerbError {
    VerbError {
        verb,
        err: io::Error::last_os_error(),
    }
}

fn code(verb: &'static str, rc: i32) -> VResult<()> {
    if rc == 0 {
        Ok(())
    } else {
        // Verbs return a positive errno (or -1 with errno set).
        let e = if rc > 0 {
            io::Error::from_raw_os_error(rc)
        } else {
            io::Error::last_os_error()
        };
        Err(VerbError { verb, err: e })
    }
}

/// Functions the transport cannot work without.
const REQUIRED: &[&str] = &[
    "ibv_get_device_list",
    "ibv_free_device_list",
    "ibv_get_device_name",
    "ibv_open_device",
    "ibv_close_device",
    "ibv_query_device",
    "ibv_query_port",
    "ibv_query_gid",
    "ibv_alloc_pd",
    "ibv_dealloc_pd",
    "ibv_reg_mr",
    "ibv_dereg_mr",
    "ibv_create_comp_channel",
    "ibv_destroy_comp_channel",
    "ibv_create_cq",
    "ibv_destroy_cq",
    "ibv_get_cq_event",
    "ibv_ack_cq_events",
    "ibv_create_qp",
    "ibv_modify_qp",
    "ibv_destroy_qp",
    "ibv_wc_status_str",
];

fn has(lib: &ffi::IbvLib, name: &str) -> bool {
    match name {
        "ibv_get_device_list" => lib.ibv_get_device_list.is_ok(),
        "ibv_free_device_list" => lib.ibv_free_device_list.is_ok(),
        "ibv_get_device_name" => lib.ibv_get_device_name.is_ok(),
        "ibv_open_device" => lib.ibv_open_device.is_ok(),
        "ibv_close_device" => lib.ibv_close_device.is_ok(),
        "ibv_query_device" => lib.ibv_query_device.is_ok(),
        "ibv_query_port" => lib.ibv_query_port.is_ok(),
        "ibv_query_gid" => lib.ibv_query_gid.is_ok(),
        "ibv_alloc_pd" => lib.ibv_alloc_pd.is_ok(),
        "ibv_dealloc_pd" => lib.ibv_dealloc_pd.is_ok(),
        "ibv_reg_mr" => lib.ibv_reg_mr.is_ok(),
        "ibv_dereg_mr" => lib.ibv_dereg_mr.is_ok(),
        "ibv_create_comp_channel" => lib.ibv_create_comp_channel.is_ok(),
        "ibv_destroy_comp_channel" => lib.ibv_destroy_comp_channel.is_ok(),
        "ibv_create_cq" => lib.ibv_create_cq.is_ok(),
        "ibv_destroy_cq" => lib.ibv_destroy_cq.is_ok(),
        "ibv_get_cq_event" => lib.ibv_get_cq_event.is_ok(),
        "ibv_ack_cq_events" => lib.ibv_ack_cq_events.is_ok(),
        "ibv_create_qp" => lib.ibv_create_qp.is_ok(),
        "ibv_modify_qp" => lib.ibv_modify_qp.is_ok(),
        "ibv_destroy_qp" => lib.ibv_destroy_qp.is_ok(),
        "ibv_wc_status_str" => lib.ibv_wc_status_str.is_ok(),
        _ => false,
    }
}

/// Loads `libibverbs.so.1` and checks that every required function is there. `Err` is a
/// sentence for the user.
pub fn load() -> Result<Lib, String> {
    // SAFETY: loading libibverbs runs its (well-behaved) initialisers; the generated loader
    // only resolves symbols and stores function pointers with the prototypes of verbs.h.
    let lib = unsafe { ffi::IbvLib::new(ffi::LIBIBVERBS) }.map_err(|e| {
        format!(
            "cannot load {} ({e}); install rdma-core's user-space library \
             (Debian/Ubuntu: apt-get install libibverbs1 ibverbs-providers)",
            ffi::LIBIBVERBS
        )
    })?;
    let missing: Vec<&str> = REQUIRED.iter().copied().filter(|n| !has(&lib, n)).collect();
    if !missing.is_empty() {
        return Err(format!(
            "{} lacks {} (rdma-core >= 44 is required)",
            ffi::LIBIBVERBS,
            missing.join(", ")
        ));
    }
    Ok(Lib(Arc::new(lib)))
}

/// Why dma-buf registration is impossible with an old libibverbs.
const NO_DMABUF_SYMBOL: &str = "this libibverbs has no ibv_reg_dmabuf_mr (rdma-core >= 34 needed)";

/// Whether the library has `ibv_reg_dmabuf_mr` (rdma-core ≥ 34); device memory registered
/// through dma-buf needs it.
pub fn has_dmabuf(lib: &ffi::IbvLib) -> bool {
    lib.ibv_reg_dmabuf_mr.is_ok()
}

/// `ibv_wc_status_str` plus the enum name, e.g. `transport retry counter exceeded
/// (IBV_WC_RETRY_EXC_ERR)`.
pub fn wc_status_string(lib: &ffi::IbvLib, status: u32) -> String {
    // SAFETY: ibv_wc_status_str returns a pointer to a static string for any value.
    let s = unsafe { lib.ibv_wc_status_str(status) };
    let text = if s.is_null() {
        "unknown status".to_string()
    } else {
        // SAFETY: non-null, NUL-terminated static string from the library.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    };
    format!("{text} ({}, status {status})", wc_status_name(status))
}

/// The `enum ibv_wc_status` name of a status.
pub fn wc_status_name(status: u32) -> &'static str {
    use ffi::ibv_wc_status as s;
    match status {
        s::IBV_WC_SUCCESS => "IBV_WC_SUCCESS",
        s::IBV_WC_LOC_LEN_ERR => "IBV_WC_LOC_LEN_ERR",
        s::IBV_WC_LOC_QP_OP_ERR => "IBV_WC_LOC_QP_OP_ERR",
        s::IBV_WC_LOC_EEC_OP_ERR => "IBV_WC_LOC_EEC_OP_ERR",
        s::IBV_WC_LOC_PROT_ERR => "IBV_WC_LOC_PROT_ERR",
        s::IBV_WC_WR_FLUSH_ERR => "IBV_WC_WR_FLUSH_ERR",
        s::IBV_WC_MW_BIND_ERR => "IBV_WC_MW_BIND_ERR",
        s::IBV_WC_BAD_RESP_ERR => "IBV_WC_BAD_RESP_ERR",
        s::IBV_WC_LOC_ACCESS_ERR => "IBV_WC_LOC_ACCESS_ERR",
        s::IBV_WC_REM_INV_REQ_ERR => "IBV_WC_REM_INV_REQ_ERR",
        s::IBV_WC_REM_ACCESS_ERR => "IBV_WC_REM_ACCESS_ERR",
        s::IBV_WC_REM_OP_ERR => "IBV_WC_REM_OP_ERR",
        s::IBV_WC_RETRY_EXC_ERR => "IBV_WC_RETRY_EXC_ERR",
        s::IBV_WC_RNR_RETRY_EXC_ERR => "IBV_WC_RNR_RETRY_EXC_ERR",
        s::IBV_WC_REM_ABORT_ERR => "IBV_WC_REM_ABORT_ERR",
        s::IBV_WC_FATAL_ERR => "IBV_WC_FATAL_ERR",
        s::IBV_WC_RESP_TIMEOUT_ERR => "IBV_WC_RESP_TIMEOUT_ERR",
        s::IBV_WC_GENERAL_ERR => "IBV_WC_GENERAL_ERR",
        _ => "IBV_WC_?",
    }
}

/// What registered memory may be used for; maps to `ibv_access_flags`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Peers RDMA-write into it (receive slots, CTS ring): local + remote write.
    RemoteWrite,
    /// Staging memory this rank writes and the NIC reads, and a caller's buffer that is the
    /// source of RDMA writes: local write. A read-only pin would be unsound in practice, as
    /// NCCL found: pinning never-written memory pins the shared zero page, and after a
    /// `fork` the process's next write moves to a copy — either way the NIC keeps sending
    /// the old page. Asking for write access makes the kernel break copy-on-write at
    /// registration, so the pinned pages are the ones the process writes.
    LocalWrite,
}

impl Access {
    /// The `ibv_access_flags` bits.
    pub fn flags(self) -> u32 {
        use ffi::ibv_access_flags as a;
        match self {
            Access::RemoteWrite => a::IBV_ACCESS_LOCAL_WRITE | a::IBV_ACCESS_REMOTE_WRITE,
            Access::LocalWrite => a::IBV_ACCESS_LOCAL_WRITE,
        }
    }
}

/// The `ibv_qp_attr_mask` bits of an [`AttrMask`] (the plain-data mirror uses the same bits).
pub fn qp_mask_bits(m: AttrMask) -> u32 {
    m.0
}

fn state_code(s: QpState) -> u32 {
    use ffi::ibv_qp_state as q;
    match s {
        QpState::Reset => q::IBV_QPS_RESET,
        QpState::Init => q::IBV_QPS_INIT,
        QpState::Rtr => q::IBV_QPS_RTR,
        QpState::Rts => q::IBV_QPS_RTS,
        QpState::Err => q::IBV_QPS_ERR,
    }
}

/// One port's facts.
#[derive(Clone, Copy, Debug)]
pub struct PortAttr {
    /// `IBV_PORT_ACTIVE` etc.
    pub state: u32,
    /// Active MTU code.
    pub active_mtu: u8,
    /// LID.
    pub lid: u16,
    /// `IBV_LINK_LAYER_*`.
    pub link_layer: u8,
    /// GID table length.
    pub gid_tbl_len: i32,
}

/// A GID table entry.
#[derive(Clone, Copy, Debug)]
pub struct GidEntry {
    /// The GID.
    pub gid: [u8; 16],
    /// `IBV_GID_TYPE_*`, or `None` when the library cannot say.
    pub gid_type: Option<u32>,
}

/// Names of the RDMA devices present (empty when there are none).
pub fn device_names(lib: &Lib) -> VResult<Vec<String>> {
    let mut n: i32 = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { lib.ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(last("ibv_get_device_list"));
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: `dev` is a device of the live list; the name is a NUL-terminated string
        // inside it.
        let name = unsafe { lib.ibv_get_device_name(dev) };
        if !name.is_null() {
            // SAFETY: non-null NUL-terminated string owned by the list.
            names.push(
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { lib.ibv_free_device_list(list) };
    Ok(names)
}

/// An open device context.
#[derive(Debug)]
pub struct Context {
    lib: Lib,
    ptr: NonNull<ffi::ibv_context>,
    /// Device name.
    pub name: String,
}

// SAFETY: libibverbs contexts may be used from any thread (verbs are thread-safe); the
// transport owns this one exclusively and never shares it between threads at once.
unsafe impl Send for Context {}

impl Context {
    /// Opens the device called `name`.
    pub fn open(lib: &Lib, name: &str) -> VResult<Context> {
        let mut n: i32 = 0;
        // SAFETY: as in `device_names`.
        let list = unsafe { lib.ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(last("ibv_get_device_list"));
        }
        let mut found = ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: `dev` belongs to the live list.
            let dn = unsafe { lib.ibv_get_device_name(dev) };
            // SAFETY: NUL-terminated name owned by the list.
            if !dn.is_null() && unsafe { CStr::from_ptr(dn) }.to_bytes() == name.as_bytes() {
                found = dev;
                break;
            }
        }
        let ctx = if found.is_null() {
            ptr::null_mut()
        } else {
            // SAFETY: `found` is a device of the live list; opening it before freeing the
            // list is what the man page prescribes.
            unsafe { lib.ibv_open_device(found) }
        };
        let err = io::Error::last_os_error();
        // SAFETY: freed once; the context stays valid after the list is freed.
        unsafe { lib.ibv_free_device_list(list) };
        if found.is_null() {
            return Err(VerbError {
                verb: "ibv_get_device_list",
                err: io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("no RDMA device named {name:?}"),
                ),
            });
        }
        let ptr = NonNull::new(ctx).ok_or(VerbError {
            verb: "ibv_open_device",
            err,
        })?;
        Ok(Context {
            lib: lib.clone(),
            ptr,
            name: name.to_string(),
        })
    }

    /// Raw pointer (for object creation).
    pub fn as_ptr(&self) -> *mut ffi::ibv_context {
        self.ptr.as_ptr()
    }

    /// Number of physical ports.
    pub fn port_count(&self) -> VResult<u8> {
        // SAFETY: all-zero is a valid ibv_device_attr (plain integers and arrays).
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context; `attr` is writable.
        code("ibv_query_device", unsafe {
            self.lib.ibv_query_device(self.as_ptr(), &mut attr)
        })?;
        Ok(attr.phys_port_cnt)
    }

    /// `ibv_query_port`.
    pub fn query_port(&self, port: u8) -> VResult<PortAttr> {
        // SAFETY: all-zero is a valid ibv_port_attr.
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context. The exported ibv_query_port fills the leading, compatible
        // part of `struct ibv_port_attr` (verbs.h casts the same way in ___ibv_query_port);
        // the buffer is a whole ibv_port_attr, so it is large enough.
        let rc = unsafe {
            self.lib.ibv_query_port(
                self.as_ptr(),
                port,
                (&mut attr as *mut ffi::ibv_port_attr).cast::<ffi::_compat_ibv_port_attr>(),
            )
        };
        code("ibv_query_port", rc)?;
        Ok(PortAttr {
            state: attr.state,
            active_mtu: attr.active_mtu as u8,
            lid: attr.lid,
            link_layer: attr.link_layer,
            gid_tbl_len: attr.gid_tbl_len,
        })
    }

    /// One GID table entry, with its type when the library can tell (`ibv_query_gid_ex`).
    pub fn query_gid(&self, port: u8, index: u32) -> VResult<GidEntry> {
        if self.lib._ibv_query_gid_ex.is_ok() {
            // SAFETY: all-zero is a valid ibv_gid_entry.
            let mut e: ffi::ibv_gid_entry = unsafe { std::mem::zeroed() };
            // SAFETY: live context, writable entry of the size passed.
            let rc = unsafe {
                self.lib._ibv_query_gid_ex(
                    self.as_ptr(),
                    u32::from(port),
                    index,
                    &mut e,
                    0,
                    size_of::<ffi::ibv_gid_entry>(),
                )
            };
            if rc == 0 {
                // SAFETY: `raw` is the byte view of the 16-byte union.
                let gid = unsafe { e.gid.raw };
                return Ok(GidEntry {
                    gid,
                    gid_type: Some(e.gid_type),
                });
            }
        }
        // SAFETY: all-zero is a valid ibv_gid.
        let mut g: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: live context, writable gid.
        let rc = unsafe {
            self.lib
                .ibv_query_gid(self.as_ptr(), port, index as i32, &mut g)
        };
        code("ibv_query_gid", rc)?;
        // SAFETY: byte view of the union.
        let gid = unsafe { g.raw };
        Ok(GidEntry {
            gid,
            gid_type: None,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object created from this context is dropped before it (field order of
        // the owner); the context is closed once.
        let rc = unsafe { self.lib.ibv_close_device(self.as_ptr()) };
        if rc != 0 {
            tracing::debug!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

/// A protection domain.
#[derive(Debug)]
pub struct Pd {
    lib: Lib,
    ptr: NonNull<ffi::ibv_pd>,
}

// SAFETY: see `Context`.
unsafe impl Send for Pd {}

impl Pd {
    /// `ibv_alloc_pd`.
    pub fn new(ctx: &Context) -> VResult<Pd> {
        // SAFETY: live context.
        let p = unsafe { ctx.lib.ibv_alloc_pd(ctx.as_ptr()) };
        let ptr = NonNull::new(p).ok_or_else(|| last("ibv_alloc_pd"))?;
        Ok(Pd {
            lib: ctx.lib.clone(),
            ptr,
        })
    }

    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    /// `addr..addr+len` must be mapped memory of this process that stays mapped (and, for
    /// write access, writable and not aliased by Rust references while the NIC may write it)
    /// until the returned region is dropped.
    pub unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> VResult<Mr> {
        // SAFETY: the caller guarantees the range; the PD is live.
        let p = unsafe {
            self.lib
                .ibv_reg_mr(self.ptr.as_ptr(), addr.cast(), len, access.flags() as i32)
        };
        self.registered(p, "ibv_reg_mr", addr as u64, len)
    }

    /// The region a registration verb returned (`p`, null on failure with errno set).
    fn registered(
        &self,
        p: *mut ffi::ibv_mr,
        verb: &'static str,
        addr: u64,
        len: usize,
    ) -> VResult<Mr> {
        let ptr = NonNull::new(p).ok_or_else(|| last(verb))?;
        // SAFETY: `p` is a registered MR; its keys are plain fields written by the verb.
        let (lkey, rkey) = unsafe { ((*p).lkey, (*p).rkey) };
        Ok(Mr {
            lib: self.lib.clone(),
            ptr,
            addr,
            len,
            lkey,
            rkey,
        })
    }

    /// Registers a dma-buf (device memory exported by a GPU driver).
    ///
    /// # Safety
    /// `fd` must be a dma-buf file descriptor whose `offset..offset+len` stays valid until the
    /// returned region is dropped.
    pub unsafe fn register_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> VResult<Mr> {
        if !has_dmabuf(&self.lib) {
            return Err(VerbError {
                verb: "ibv_reg_dmabuf_mr",
                err: io::Error::new(io::ErrorKind::Unsupported, NO_DMABUF_SYMBOL),
            });
        }
        // SAFETY: the symbol is present (checked); the caller guarantees the dma-buf.
        let p = unsafe {
            self.lib.ibv_reg_dmabuf_mr(
                self.ptr.as_ptr(),
                offset,
                len,
                iova,
                fd,
                access.flags() as i32,
            )
        };
        self.registered(p, "ibv_reg_dmabuf_mr", iova, len)
    }

    /// Asks the provider and the kernel driver whether they implement dma-buf registration,
    /// without any dma-buf: `ibv_reg_dmabuf_mr` with descriptor −1. A driver without the verb
    /// answers `EOPNOTSUPP` (rxe, siw, old kernels); one with it gets as far as looking up
    /// the descriptor and answers `EBADF` (or `EINVAL`). Any other answer leaves it unknown.
    /// Returns the verdict (`None`: unknown) and what was seen.
    pub fn probe_dmabuf(&self) -> (Option<bool>, String) {
        if !has_dmabuf(&self.lib) {
            return (Some(false), NO_DMABUF_SYMBOL.to_string());
        }
        // SAFETY: the symbol is present (checked) and the PD is live; descriptor −1 is never an
        // open file, so the kernel cannot register anything (a region that came back all the
        // same is deregistered at once).
        let p = unsafe {
            self.lib.ibv_reg_dmabuf_mr(
                self.ptr.as_ptr(),
                0,
                4096,
                0,
                -1,
                Access::LocalWrite.flags() as i32,
            )
        };
        if !p.is_null() {
            // SAFETY: `p` is the region just registered, deregistered once.
            unsafe { self.lib.ibv_dereg_mr(p) };
            return (
                Some(true),
                "ibv_reg_dmabuf_mr accepted descriptor -1 (unexpected)".to_string(),
            );
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT) => (
                Some(false),
                format!("ibv_reg_dmabuf_mr is not implemented by this provider or kernel driver ({e})"),
            ),
            Some(libc::EBADF | libc::EINVAL) => (
                Some(true),
                format!("ibv_reg_dmabuf_mr is implemented (a probe with descriptor -1 failed with: {e})"),
            ),
            _ => (
                None,
                format!("a probe of ibv_reg_dmabuf_mr with descriptor -1 failed with: {e}"),
            ),
        }
    }

    /// Raw pointer.
    pub fn as_ptr(&self) -> *mut ffi::ibv_pd {
        self.ptr.as_ptr()
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: all MRs and QPs of this PD are dropped before it (owner's field order).
        let rc = unsafe { self.lib.ibv_dealloc_pd(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::debug!(rc, "ibv_dealloc_pd failed");
        }
    }
}

/// A registered memory region.
#[derive(Debug)]
pub struct Mr {
    lib: Lib,
    ptr: NonNull<ffi::ibv_mr>,
    /// Start address (or IOVA).
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

// SAFETY: see `Context`.
unsafe impl Send for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: deregistered once; no work request using it is outstanding (the owner moves
        // or destroys its queue pairs first).
        let rc = unsafe { self.lib.ibv_dereg_mr(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::debug!(rc, "ibv_dereg_mr failed");
        }
    }
}

/// A completion queue with its completion channel (so that `poll(2)` can wait for it).
#[derive(Debug)]
pub struct Cq {
    lib: Lib,
    cq: NonNull<ffi::ibv_cq>,
    channel: NonNull<ffi::ibv_comp_channel>,
    unacked: u32,
    /// Capacity.
    pub depth: i32,
}

// SAFETY: see `Context`.
unsafe impl Send for Cq {}

impl Cq {
    /// A CQ of `depth` entries with a non-blocking completion channel.
    pub fn new(ctx: &Context, depth: i32) -> VResult<Cq> {
        // SAFETY: live context.
        let ch = unsafe { ctx.lib.ibv_create_comp_channel(ctx.as_ptr()) };
        let channel = NonNull::new(ch).ok_or_else(|| last("ibv_create_comp_channel"))?;
        // SAFETY: live context and channel.
        let cq = unsafe {
            ctx.lib
                .ibv_create_cq(ctx.as_ptr(), depth, ptr::null_mut(), ch, 0)
        };
        let Some(cq) = NonNull::new(cq) else {
            let e = last("ibv_create_cq");
            // SAFETY: the channel has no CQ yet and is destroyed once.
            unsafe { ctx.lib.ibv_destroy_comp_channel(ch) };
            return Err(e);
        };
        let me = Cq {
            lib: ctx.lib.clone(),
            cq,
            channel,
            unacked: 0,
            depth,
        };
        // SAFETY: `fd` is a plain field of the live channel.
        let fd = unsafe { (*ch).fd };
        let fl = nix::fcntl::fcntl(borrow_fd(fd), nix::fcntl::FcntlArg::F_GETFL).map_err(|e| {
            VerbError {
                verb: "fcntl(completion channel)",
                err: e.into(),
            }
        })?;
        let fl = nix::fcntl::OFlag::from_bits_retain(fl) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(borrow_fd(fd), nix::fcntl::FcntlArg::F_SETFL(fl)).map_err(|e| {
            VerbError {
                verb: "fcntl(completion channel)",
                err: e.into(),
            }
        })?;
        Ok(me)
    }

    /// Raw pointer (for QP creation).
    pub fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }

    /// Whether the library has `ibv_resize_cq` (older rdma-core and some providers do not).
    pub fn can_resize(&self) -> bool {
        self.lib.ibv_resize_cq.is_ok()
    }

    /// Grows the queue to at least `depth` entries with `ibv_resize_cq`, keeping the
    /// completions already in it; [`Cq::depth`] is then what the provider made (it may round
    /// up). Nothing to do when it holds that many already.
    ///
    /// # Errors
    /// The library or the provider cannot resize (`EOPNOTSUPP`), or the device's limit
    /// (`max_cqe`) is below `depth` (`EINVAL`).
    pub fn grow(&mut self, depth: i32) -> VResult<()> {
        if depth <= self.depth {
            return Ok(());
        }
        if !self.can_resize() {
            return Err(VerbError {
                verb: "ibv_resize_cq",
                err: io::Error::from_raw_os_error(libc::EOPNOTSUPP),
            });
        }
        // SAFETY: live CQ, the symbol is present (checked above); the provider keeps the
        // queued completions across the resize (verbs.h), and no other thread polls this CQ
        // (the transport is `&mut`).
        code("ibv_resize_cq", unsafe {
            self.lib.ibv_resize_cq(self.as_ptr(), depth)
        })?;
        // SAFETY: plain field of the live CQ, updated by the resize.
        self.depth = unsafe { (*self.as_ptr()).cqe }.max(depth);
        Ok(())
    }

    /// The completion channel's file descriptor (readable when an armed CQ got a completion).
    pub fn fd(&self) -> i32 {
        // SAFETY: plain field of the live channel.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    /// Polls up to `wc.len()` completions.
    pub fn poll(&mut self, wc: &mut [ffi::ibv_wc]) -> VResult<usize> {
        // SAFETY: live CQ; `wc` has `len` writable entries.
        let n = unsafe { ffi::ibv_poll_cq(self.as_ptr(), wc.len() as i32, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(VerbError {
                verb: "ibv_poll_cq",
                err: io::Error::from_raw_os_error(-n),
            });
        }
        Ok(n as usize)
    }

    /// Arms the channel for the next completion.
    pub fn arm(&mut self) -> VResult<()> {
        // SAFETY: live CQ.
        code("ibv_req_notify_cq", unsafe {
            ffi::ibv_req_notify_cq(self.as_ptr(), 0)
        })
    }

    /// Consumes the channel's pending events (non-blocking) and acknowledges them in batches.
    pub fn drain_events(&mut self) {
        loop {
            let mut cq: *mut ffi::ibv_cq = ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = ptr::null_mut();
            // SAFETY: live channel (non-blocking fd); out-pointers are valid.
            let rc = unsafe {
                self.lib
                    .ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx)
            };
            if rc != 0 {
                break;
            }
            self.unacked += 1;
        }
        if self.unacked >= 64 {
            self.ack();
        }
    }

    fn ack(&mut self) {
        if self.unacked > 0 {
            // SAFETY: acknowledges events returned by ibv_get_cq_event for this CQ.
            unsafe { self.lib.ibv_ack_cq_events(self.as_ptr(), self.unacked) };
            self.unacked = 0;
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.ack();
        // SAFETY: every QP using this CQ is destroyed first (owner's field order); all
        // events are acknowledged above; each object is destroyed once.
        unsafe {
            let rc = self.lib.ibv_destroy_cq(self.cq.as_ptr());
            if rc != 0 {
                tracing::debug!(rc, "ibv_destroy_cq failed");
            }
            let rc = self.lib.ibv_destroy_comp_channel(self.channel.as_ptr());
            if rc != 0 {
                tracing::debug!(rc, "ibv_destroy_comp_channel failed");
            }
        }
    }
}

fn borrow_fd(fd: i32) -> std::os::fd::BorrowedFd<'static> {
    // SAFETY: only used for the duration of an fcntl call on a descriptor owned by the live
    // completion channel.
    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
}

/// Everything `Init → Rtr → Rts` needs besides the local port.
#[derive(Clone, Copy, Debug)]
pub struct Remote {
    /// Remote QP number.
    pub qpn: u32,
    /// Remote initial PSN.
    pub psn: u32,
    /// Remote LID.
    pub lid: u16,
    /// Remote GID (used when `sgid_index` is set).
    pub gid: [u8; 16],
    /// Local GID index for global routing, or `None` for LID routing.
    pub sgid_index: Option<u8>,
    /// Path MTU code.
    pub mtu: u8,
}

/// Reliability settings of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reliability {
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout.
    pub timeout: u8,
    /// Transport retries (0–7).
    pub retry_cnt: u8,
    /// RNR retries (0–6; 7 means forever and is refused).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Service level of the address vector (lossless RoCE maps it to a priority).
    pub service_level: u8,
    /// Traffic class of the global route header (RoCE v2: the DSCP/ECN byte).
    pub traffic_class: u8,
}

/// A reliable-connected queue pair.
#[derive(Debug)]
pub struct Qp {
    lib: Lib,
    ptr: NonNull<ffi::ibv_qp>,
    /// Its number.
    pub qpn: u32,
    /// Current state as this code last set it.
    pub state: QpState,
}

// SAFETY: see `Context`.
unsafe impl Send for Qp {}

impl Qp {
    /// An RC QP on `pd` whose both queues complete to `cq`.
    pub fn new(pd: &Pd, cq: &Cq, send_wr: u32, recv_wr: u32) -> VResult<Qp> {
        // SAFETY: all-zero is a valid ibv_qp_init_attr (null pointers, zero caps).
        let mut a: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = cq.as_ptr();
        a.recv_cq = cq.as_ptr();
        a.cap.max_send_wr = send_wr;
        a.cap.max_recv_wr = recv_wr;
        a.cap.max_send_sge = 2;
        a.cap.max_recv_sge = 1;
        a.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        a.sq_sig_all = 0;
        // SAFETY: live PD and CQ; `a` is a valid init attribute.
        let p = unsafe { pd.lib.ibv_create_qp(pd.as_ptr(), &mut a) };
        let ptr = NonNull::new(p).ok_or_else(|| last("ibv_create_qp"))?;
        // SAFETY: plain field of the new QP.
        let qpn = unsafe { (*p).qp_num };
        Ok(Qp {
            lib: pd.lib.clone(),
            ptr,
            qpn,
            state: QpState::Reset,
        })
    }

    fn modify(&mut self, to: QpState, attr: &mut ffi::ibv_qp_attr, mask: AttrMask) -> VResult<()> {
        check_transition(self.state, to, mask).map_err(|w| VerbError {
            verb: "ibv_modify_qp",
            err: io::Error::new(io::ErrorKind::InvalidInput, w),
        })?;
        attr.qp_state = state_code(to);
        // SAFETY: live QP; `attr` holds every attribute named by `mask` (checked above).
        let rc = unsafe {
            self.lib
                .ibv_modify_qp(self.ptr.as_ptr(), attr, qp_mask_bits(mask) as i32)
        };
        code("ibv_modify_qp", rc)?;
        self.state = to;
        Ok(())
    }

    /// RESET → INIT on `port`, allowing remote writes.
    pub fn to_init(&mut self, port: u8) -> VResult<()> {
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.pkey_index = 0;
        a.port_num = port;
        a.qp_access_flags = Access::RemoteWrite.flags();
        let m = AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS;
        self.modify(QpState::Init, &mut a, m)
    }

    /// INIT → RTR towards `r`.
    pub fn to_rtr(&mut self, port: u8, r: &Remote, rel: &Reliability) -> VResult<()> {
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.path_mtu = u32::from(r.mtu);
        a.dest_qp_num = r.qpn;
        a.rq_psn = r.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = rel.min_rnr_timer;
        a.ah_attr.dlid = r.lid;
        a.ah_attr.sl = rel.service_level;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = port;
        if let Some(gi) = r.sgid_index {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = r.gid;
            a.ah_attr.grh.sgid_index = gi;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.flow_label = 0;
            a.ah_attr.grh.traffic_class = rel.traffic_class;
        }
        let m = AttrMask::STATE
            | AttrMask::AV
            | AttrMask::PATH_MTU
            | AttrMask::DEST_QPN
            | AttrMask::RQ_PSN
            | AttrMask::MAX_DEST_RD_ATOMIC
            | AttrMask::MIN_RNR_TIMER;
        self.modify(QpState::Rtr, &mut a, m)
    }

    /// RTR → RTS with this side's PSN and the reliability settings.
    pub fn to_rts(&mut self, psn: u32, rel: &Reliability) -> VResult<()> {
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.timeout = rel.timeout;
        a.retry_cnt = rel.retry_cnt;
        a.rnr_retry = rel.rnr_retry;
        a.sq_psn = psn;
        a.max_rd_atomic = 1;
        let m = AttrMask::STATE
            | AttrMask::TIMEOUT
            | AttrMask::RETRY_CNT
            | AttrMask::RNR_RETRY
            | AttrMask::SQ_PSN
            | AttrMask::MAX_QP_RD_ATOMIC;
        self.modify(QpState::Rts, &mut a, m)
    }

    /// Any state → ERR: outstanding work requests are flushed; the NIC stops touching the
    /// memory they reference.
    pub fn to_err(&mut self) -> VResult<()> {
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        self.modify(QpState::Err, &mut a, AttrMask::STATE)
    }

    /// Posts one `RDMA_WRITE_WITH_IMM` gathering `sges` into `remote_addr`.
    ///
    /// # Safety
    /// Every SGE must describe memory inside its registered region that stays valid and
    /// unchanged until the work request completes (or the QP is moved to ERR and flushed);
    /// `remote_addr..+len` must be inside the peer's region of `rkey`.
    pub unsafe fn post_write_imm(
        &mut self,
        wr_id: u64,
        sges: &mut [ffi::ibv_sge],
        remote_addr: u64,
        rkey: u32,
        imm: u32,
        signaled: bool,
    ) -> VResult<()> {
        // SAFETY: the caller's contract.
        unsafe { self.post_rdma_write(wr_id, sges, remote_addr, rkey, Some(imm), signaled) }
    }

    /// Posts one plain `RDMA_WRITE` (no immediate: the peer sees no completion; a later
    /// `WRITE_WITH_IMM` on the same queue pair tells it the data is there).
    ///
    /// # Safety
    /// As [`Qp::post_write_imm`].
    pub unsafe fn post_write(
        &mut self,
        wr_id: u64,
        sges: &mut [ffi::ibv_sge],
        remote_addr: u64,
        rkey: u32,
        signaled: bool,
    ) -> VResult<()> {
        // SAFETY: the caller's contract.
        unsafe { self.post_rdma_write(wr_id, sges, remote_addr, rkey, None, signaled) }
    }

    /// # Safety
    /// As [`Qp::post_write_imm`].
    unsafe fn post_rdma_write(
        &mut self,
        wr_id: u64,
        sges: &mut [ffi::ibv_sge],
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
        signaled: bool,
    ) -> VResult<()> {
        // SAFETY: all-zero is a valid ibv_send_wr (null next, zero fields).
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = sges.len() as i32;
        wr.opcode = match imm {
            Some(_) => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        };
        wr.send_flags = if signaled {
            ffi::ibv_send_flags::IBV_SEND_SIGNALED
        } else {
            0
        };
        if let Some(imm) = imm {
            wr.__bindgen_anon_1.imm_data = imm.to_be();
        }
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; `wr` and `sges` live across the call (the provider copies them
        // into the send queue); the memory contract is the caller's.
        let rc = unsafe { ffi::ibv_post_send(self.ptr.as_ptr(), &mut wr, &mut bad) };
        code("ibv_post_send", rc)
    }

    /// Posts one receive work request without scatter entries (it is consumed by a peer's
    /// `WRITE_WITH_IMM`, whose data lands where the peer writes it).
    pub fn post_recv(&mut self, wr_id: u64) -> VResult<()> {
        // SAFETY: all-zero is a valid ibv_recv_wr.
        let mut wr: ffi::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.num_sge = 0;
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: live QP; no memory is referenced by the request.
        let rc = unsafe { ffi::ibv_post_recv(self.ptr.as_ptr(), &mut wr, &mut bad) };
        code("ibv_post_recv", rc)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: destroyed once, before its CQ and PD (owner's field order).
        let rc = unsafe { self.lib.ibv_destroy_qp(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::debug!(qpn = self.qpn, rc, "ibv_destroy_qp failed");
        }
    }
}

/// Page-aligned, zeroed memory owned by the transport (slots, rings).
#[derive(Debug)]
pub struct Memory {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: plain owned memory.
unsafe impl Send for Memory {}

impl Memory {
    /// `len` zeroed bytes aligned to 4 KiB, or `None` when allocation fails.
    pub fn new(len: usize) -> Option<Memory> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(Memory {
            ptr: NonNull::new(p)?,
            layout,
        })
    }

    /// Start.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Whether the length is zero (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout; the MR covering it is dropped first (owner's
        // field order), so the NIC no longer uses it.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_map_to_the_verbs_bits() {
        use ffi::ibv_access_flags as a;
        assert_eq!(
            Access::RemoteWrite.flags(),
            a::IBV_ACCESS_LOCAL_WRITE | a::IBV_ACCESS_REMOTE_WRITE
        );
        // Caller buffers too: a read-only pin can hold the zero page or a pre-fork page.
        assert_eq!(Access::LocalWrite.flags(), a::IBV_ACCESS_LOCAL_WRITE);
        for acc in [Access::RemoteWrite, Access::LocalWrite] {
            assert_eq!(
                acc.flags() & a::IBV_ACCESS_REMOTE_READ,
                0,
                "{acc:?} never allows remote reads"
            );
        }
    }

    #[test]
    fn attribute_mask_mirror_matches_the_verbs_bits() {
        use ffi::ibv_qp_attr_mask as m;
        let pairs = [
            (AttrMask::STATE, m::IBV_QP_STATE),
            (AttrMask::ACCESS_FLAGS, m::IBV_QP_ACCESS_FLAGS),
            (AttrMask::PKEY_INDEX, m::IBV_QP_PKEY_INDEX),
            (AttrMask::PORT, m::IBV_QP_PORT),
            (AttrMask::AV, m::IBV_QP_AV),
            (AttrMask::PATH_MTU, m::IBV_QP_PATH_MTU),
            (AttrMask::TIMEOUT, m::IBV_QP_TIMEOUT),
            (AttrMask::RETRY_CNT, m::IBV_QP_RETRY_CNT),
            (AttrMask::RNR_RETRY, m::IBV_QP_RNR_RETRY),
            (AttrMask::RQ_PSN, m::IBV_QP_RQ_PSN),
            (AttrMask::MAX_QP_RD_ATOMIC, m::IBV_QP_MAX_QP_RD_ATOMIC),
            (AttrMask::MIN_RNR_TIMER, m::IBV_QP_MIN_RNR_TIMER),
            (AttrMask::SQ_PSN, m::IBV_QP_SQ_PSN),
            (AttrMask::MAX_DEST_RD_ATOMIC, m::IBV_QP_MAX_DEST_RD_ATOMIC),
            (AttrMask::DEST_QPN, m::IBV_QP_DEST_QPN),
        ];
        for (mine, theirs) in pairs {
            assert_eq!(qp_mask_bits(mine), theirs);
        }
    }

    #[test]
    fn qp_states_map_to_the_verbs_codes() {
        use ffi::ibv_qp_state as q;
        assert_eq!(state_code(QpState::Reset), q::IBV_QPS_RESET);
        assert_eq!(state_code(QpState::Init), q::IBV_QPS_INIT);
        assert_eq!(state_code(QpState::Rtr), q::IBV_QPS_RTR);
        assert_eq!(state_code(QpState::Rts), q::IBV_QPS_RTS);
        assert_eq!(state_code(QpState::Err), q::IBV_QPS_ERR);
    }

    #[test]
    fn status_names_cover_the_common_failures() {
        use ffi::ibv_wc_status as s;
        assert_eq!(
            wc_status_name(s::IBV_WC_RETRY_EXC_ERR),
            "IBV_WC_RETRY_EXC_ERR"
        );
        assert_eq!(
            wc_status_name(s::IBV_WC_WR_FLUSH_ERR),
            "IBV_WC_WR_FLUSH_ERR"
        );
        assert_eq!(wc_status_name(9999), "IBV_WC_?");
    }
}
