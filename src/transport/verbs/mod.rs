//! The RDMA verbs transport: reliable-connected queue pairs, receiver-driven
//! `RDMA_WRITE_WITH_IMM`, as NCCL's IB transport does it.
//!
//! # Protocol
//!
//! Each ordered pair of ranks has `n` pre-registered receive *slots* at the receiver (header +
//! payload ≥ the engine's segment size), `n` staging slots at the sender and a ring of `n`
//! clear-to-send (CTS) entries in the sender's memory. One RC queue pair per pair of ranks
//! carries both directions.
//!
//! 1. The connection information (QP number, PSN, LID/GID, MTU, slot and ring addresses, rkey)
//!    travels through the bootstrap; all slots start free, so the first `n` frames need no CTS.
//! 2. The sender copies the 32-byte [`FrameHeader`] and the payload into staging slot
//!    `k % n` and writes it into the receiver's slot with one `RDMA_WRITE_WITH_IMM`; the
//!    immediate carries the frame length and the low bits of its sequence number. For a caller
//!    buffer registered with [`Transport::register_host`] the payload is gathered straight from
//!    the caller's memory (zero-copy; the header comes from the staging slot).
//! 3. The receiver learns of the frame from the receive completion, hands the payload to
//!    [`RecvSink::consume`] straight out of the slot (reductions read the receive buffer) or
//!    copies it to [`RecvSink::direct`], then re-advertises the slot: a 32-byte CTS entry
//!    (address, rkey, size, sequence) RDMA-written into the sender's ring, also with an
//!    immediate so that a sender blocked in [`Transport::wait`] wakes up.
//! 4. Data and CTS writes are unsignalled except every `depth/2`-th, which retires the send
//!    queue; a CTS for frame `k + n` proves frame `k` landed, which frees its staging slot.
//!    Zero-copy writes are signalled: their completion releases the caller's buffer.
//! 5. Abort and goodbye frames go to a separate control slot (so they never wait for a
//!    clear-to-send). The bootstrap's TCP connections stay open as a liveness signal: a peer
//!    process that dies closes them, and survivors report [`Error::PeerLost`] at once instead
//!    of waiting for the transport's retry budget.
//!
//! 6. *Direct frames* (GPUDirect RDMA): when both ranks registered a direct region at init
//!    ([`DirectSpec`]; GPU memory through dma-buf or nvidia-peermem, or host memory standing in
//!    for it in tests), frame `k`'s payload is RDMA-written from a send slot of the sender's
//!    region into landing slot `k % n` for that sender in the receiver's region, followed on
//!    the same queue pair by the 32-byte header into receive slot `k % n` with a
//!    `WRITE_WITH_IMM` whose immediate marks it direct. The receiver hands the landing offset
//!    to the engine and re-advertises the slot (CTS `k + n`) only when the engine released it —
//!    after the device consumed the payload; ordinary frames taken meanwhile wait behind it, so
//!    CTS stay in order. The sender's send slot is reusable once the signalled header write
//!    completed ([`Transport::direct_send_done`]).
//!
//! Work-completion errors become typed errors naming the peer, the operation and the
//! `ibv_wc_status` string. After [`Transport::abort`] every queue pair is in the ERR state:
//! nothing touches caller memory any more.
//!
//! # Tunables (environment)
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `DSPARK_IB_DEVICE` | device, optionally `:port` (`mlx5_0`, `mlx5_0:1`) | first ACTIVE port |
//! | `DSPARK_IB_GID_INDEX` | GID index (RoCE; global routing on IB) | the IPv4-mapped RoCE v2 GID |
//! | `DSPARK_IB_SLOTS` | slots per peer and direction | 8 |
//! | `DSPARK_IB_SLOT_BYTES` | payload bytes per slot (≥ `DSPARK_CHUNK_BYTES`) | the segment size |
//! | `DSPARK_IB_TIMEOUT` | ACK timeout exponent (4.096 µs × 2^t) | 16 (≈ 268 ms) |
//! | `DSPARK_IB_RETRY_CNT` | transport retries | 7 |
//! | `DSPARK_IB_RNR_RETRY` | RNR retries (0–6) | 6 |
//! | `DSPARK_IB_SPIN_US` | busy-poll of the CQ in `wait` before sleeping | 20 |
//! | `DSPARK_IB_ZERO_COPY_MIN` | smallest frame sent zero-copy from a registered buffer | 64 KiB |
//!
//! With the defaults a dead peer surfaces after about 8 × 268 ms ≈ 2 s of retries (or at once
//! through the closed bootstrap connection), not after the 30 s of common defaults.

pub mod ib;
pub mod qp;
pub mod slots;
pub mod wire;

use std::io;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use dspark_sys as ffi;
use nix::poll::{PollFd, PollFlags, PollTimeout};

use self::ib::{Access, Context, Cq, Lib, Memory, Mr, Pd, Qp};
use self::slots::{RecvSide, SendQueue, SendSide};
use self::wire::{
    split_wr_id, wr_id, Blob, Cts, DirectInfo, DirectKind, Imm, LinkLayer, PortAddr, QpInfo,
    WrKind, CTS_LEN,
};
use super::{
    direct_mismatch, AbortClass, DirectLayout, FrameHeader, FrameKind, Interest, Landed,
    RecvProgress, RecvSink, RegionAccess, SendProgress, Transport, TransportKind, HEADER_LEN,
};
use crate::bootstrap::Bootstrap;
use crate::config::{parse_size, Config, TransportChoice};
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::sync::Arc;

pub use crate::gpu::MemoryKind;

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

/// The direct region layout for `world` ranks under `opts`: one landing slot per receive slot
/// and peer, each as large as a receive slot's payload.
pub fn direct_layout(world: usize, opts: &VerbsOptions, send_slots: usize) -> DirectLayout {
    DirectLayout {
        world,
        slots: opts.slots,
        slot_bytes: opts.slot_payload,
        send_slots,
    }
}

/// Host memory that a NIC writes into, accessed only by copies (the emulated direct region).
#[derive(Debug)]
pub struct HostRegion {
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
struct DirectOwn {
    // Field order is drop order: the MR before the memory it covers.
    mr: Mr,
    host: Option<Arc<HostRegion>>,
    kind: DirectKind,
    layout: DirectLayout,
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

fn register_direct(
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
                        return DirectOwn {
                            mr,
                            host: None,
                            kind: dk,
                            layout,
                        }
                        .announced()
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

/// Bytes of the control slot (abort / goodbye frames).
const CTRL_BYTES: usize = 4096;
/// Completions polled per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;
/// How long `abort` and `close` wait for their frames to be acknowledged.
const FAREWELL: Duration = Duration::from_millis(200);
/// How long a write posted before a peer's goodbye may still wait for its completion (the
/// peer acknowledged it before saying goodbye, so this is polling order, not the network).
const CLOSED_GRACE: Duration = Duration::from_secs(2);

/// Settings of the verbs transport (see the module docs for the environment variables).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsOptions {
    /// Device name and optional port (`DSPARK_IB_DEVICE`).
    pub device: Option<(String, Option<u8>)>,
    /// GID index (`DSPARK_IB_GID_INDEX`).
    pub gid_index: Option<u32>,
    /// Slots per peer and direction.
    pub slots: usize,
    /// Payload bytes per slot.
    pub slot_payload: usize,
    /// Reliability of the queue pairs.
    pub reliability: ib::Reliability,
    /// Busy-poll time in `wait`.
    pub spin: Duration,
    /// Smallest payload sent zero-copy from a registered buffer.
    pub zero_copy_min: usize,
}

impl VerbsOptions {
    /// The options for `cfg`, with `DSPARK_IB_*` tunables read through `get`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable.
    pub fn from_lookup(cfg: &Config, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |name: &str, lo: u64, hi: u64, default: u64| -> Result<u64> {
            match get(name).filter(|v| !v.trim().is_empty()) {
                None => Ok(default),
                Some(v) => match v.trim().parse::<u64>() {
                    Ok(x) if (lo..=hi).contains(&x) => Ok(x),
                    _ => Err(Error::config(
                        name,
                        format!("{v:?}: expected an integer in {lo}..={hi}"),
                    )),
                },
            }
        };
        let device = match &cfg.ib_device {
            None => None,
            Some(spec) => {
                Some(parse_device(spec).map_err(|w| Error::config("DSPARK_IB_DEVICE", w))?)
            }
        };
        let slots = num("DSPARK_IB_SLOTS", 2, 256, 8)? as usize;
        let seg = cfg.segment_bytes.max(64);
        let slot_payload = match get("DSPARK_IB_SLOT_BYTES").filter(|v| !v.trim().is_empty()) {
            None => seg,
            Some(v) => {
                let b = parse_size(&v).ok_or_else(|| {
                    Error::config(
                        "DSPARK_IB_SLOT_BYTES",
                        format!("{v:?} is not a size (e.g. 1M)"),
                    )
                })?;
                if b < seg {
                    return Err(Error::config(
                        "DSPARK_IB_SLOT_BYTES",
                        format!(
                            "{b} bytes is smaller than the segment size {seg} (DSPARK_CHUNK_BYTES): \
                             a slot must hold a whole segment"
                        ),
                    ));
                }
                b
            }
        };
        if (slot_payload + HEADER_LEN) as u64 > u64::from(wire::MAX_FRAME) {
            return Err(Error::config(
                "DSPARK_CHUNK_BYTES",
                format!(
                    "verbs slots hold at most {} payload bytes; {slot_payload} is too large",
                    wire::MAX_FRAME as usize - HEADER_LEN
                ),
            ));
        }
        let reliability = ib::Reliability {
            timeout: num("DSPARK_IB_TIMEOUT", 1, 31, 16)? as u8,
            retry_cnt: num("DSPARK_IB_RETRY_CNT", 0, 7, 7)? as u8,
            rnr_retry: num("DSPARK_IB_RNR_RETRY", 0, 6, 6)? as u8,
            min_rnr_timer: 12,
        };
        let spin = Duration::from_micros(num("DSPARK_IB_SPIN_US", 0, 1_000_000, 20)?);
        let zero_copy_min = match get("DSPARK_IB_ZERO_COPY_MIN").filter(|v| !v.trim().is_empty()) {
            None => 64 * 1024,
            Some(v) => parse_size(&v).ok_or_else(|| {
                Error::config("DSPARK_IB_ZERO_COPY_MIN", format!("{v:?} is not a size"))
            })?,
        };
        Ok(VerbsOptions {
            device,
            gid_index: cfg.ib_gid_index,
            slots,
            slot_payload,
            reliability,
            spin,
            zero_copy_min,
        })
    }

    /// Bytes of one slot (header + payload, rounded up to 64).
    pub fn slot_bytes(&self) -> usize {
        (HEADER_LEN + self.slot_payload).div_ceil(64) * 64
    }

    /// Bytes of the two memories registered per peer: (remote, local). Remote: the receive
    /// slots, the control slot and the CTS ring the peer writes; local: the staging slots,
    /// the outgoing CTS entries and the outgoing control frame.
    fn peer_memory(&self) -> (usize, usize) {
        let (n, sb) = (self.slots, self.slot_bytes());
        (
            n * sb + CTRL_BYTES + n * CTS_LEN,
            n * sb + n * CTS_LEN + CTRL_BYTES,
        )
    }

    /// Bytes of memory this rank pins per peer.
    pub fn pinned_per_peer(&self) -> usize {
        let (remote, local) = self.peer_memory();
        remote + local
    }
}

/// Whether an RDMA device accepts dma-buf registrations (GPUDirect RDMA without
/// nvidia-peermem), as `dspark doctor` reports it: probed with [`ib::Pd::probe_dmabuf`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NicDmaBuf {
    /// The device (`mlx5_0`).
    pub device: String,
    /// `None` when the probe could not run (the library or the device cannot be opened).
    pub supported: Option<bool>,
    /// What the probe saw, or why it could not run.
    pub detail: String,
}

/// Opens `device`, allocates a protection domain and probes dma-buf registration on it.
pub fn probe_nic_dmabuf(device: &str) -> NicDmaBuf {
    let probe = || -> std::result::Result<(Option<bool>, String), String> {
        let lib = ib::load()?;
        let ctx = Context::open(&lib, device).map_err(|e| e.to_string())?;
        // Declared after the context, so dropped before it.
        let pd = Pd::new(&ctx).map_err(|e| e.to_string())?;
        Ok(pd.probe_dmabuf())
    };
    let (supported, detail) = probe().unwrap_or_else(|e| (None, format!("could not probe: {e}")));
    NicDmaBuf {
        device: device.to_string(),
        supported,
        detail,
    }
}

/// Parses `DSPARK_IB_DEVICE`: `name` or `name:port`.
pub fn parse_device(spec: &str) -> std::result::Result<(String, Option<u8>), String> {
    let s = spec.trim();
    let (name, port) = match s.rsplit_once(':') {
        Some((n, p)) => {
            let port: u8 =
                p.parse().ok().filter(|&p| p >= 1).ok_or_else(|| {
                    format!("{s:?}: {p:?} is not a port number (ports count from 1)")
                })?;
            (n, Some(port))
        }
        None => (s, None),
    };
    if name.is_empty() {
        return Err(format!("{s:?}: no device name"));
    }
    Ok((name.to_string(), port))
}

/// Why registering `need` bytes would fail under a memlock limit of `soft` bytes (`None`:
/// unlimited), unless the process has `CAP_IPC_LOCK`.
pub fn memlock_shortfall(soft: Option<u64>, need: u64, privileged: bool) -> Option<String> {
    let soft = soft?;
    if privileged || need <= soft {
        return None;
    }
    Some(format!(
        "RLIMIT_MEMLOCK is {} KiB but the verbs transport must pin {} KiB (slots and rings for \
         every peer); raise the limit: `ulimit -l unlimited` in the shell that starts the ranks, \
         `LimitMEMLOCK=infinity` for a systemd service, `--ulimit memlock=-1` for docker, or \
         `* - memlock unlimited` in /etc/security/limits.conf; or use fewer/smaller slots \
         (DSPARK_IB_SLOTS, DSPARK_CHUNK_BYTES)",
        soft / 1024,
        need.div_ceil(1024)
    ))
}

fn memlock_problem(need: u64) -> Option<String> {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    let (soft, _) = getrlimit(Resource::RLIMIT_MEMLOCK).ok()?;
    let soft = (soft != RLIM_INFINITY).then_some(soft);
    memlock_shortfall(soft, need, has_cap_ipc_lock())
}

/// Whether this process has `CAP_IPC_LOCK` (then the memlock limit does not apply).
fn has_cap_ipc_lock() -> bool {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

fn reg_hint(e: &ib::VerbError) -> String {
    let mut s = e.to_string();
    if matches!(
        e.err.raw_os_error(),
        Some(libc::ENOMEM) | Some(libc::EAGAIN) | Some(libc::EPERM)
    ) {
        s += "; memory registration pins pages: check RLIMIT_MEMLOCK (`ulimit -l`; set it to \
              unlimited for the ranks)";
    }
    s
}

fn is_ipv4_mapped(g: &[u8; 16]) -> bool {
    g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff
}

fn gid_string(g: &[u8; 16]) -> String {
    if is_ipv4_mapped(g) {
        return format!("::ffff:{}.{}.{}.{}", g[12], g[13], g[14], g[15]);
    }
    std::net::Ipv6Addr::from(*g).to_string()
}

fn port_state_name(s: u32) -> &'static str {
    use ffi::ibv_port_state as p;
    match s {
        p::IBV_PORT_DOWN => "DOWN",
        p::IBV_PORT_INIT => "INIT",
        p::IBV_PORT_ARMED => "ARMED",
        p::IBV_PORT_ACTIVE => "ACTIVE",
        p::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

/// The device, port and addressing this rank uses.
struct Local {
    ctx: Context,
    port: u8,
    addr: PortAddr,
}

fn choose_port(lib: &Lib, opts: &VerbsOptions) -> std::result::Result<Local, String> {
    let names = match ib::device_names(lib) {
        Ok(names) => names,
        // libibverbs says ENOSYS when the kernel has no RDMA support at all.
        Err(e) if e.err.raw_os_error() == Some(libc::ENOSYS) => {
            return Err("no RDMA devices: this kernel has no RDMA support \
                        (ibv_get_device_list: function not implemented; no InfiniBand/RoCE \
                        driver or ib_uverbs module)"
                .into())
        }
        Err(e) => return Err(e.to_string()),
    };
    if names.is_empty() {
        return Err(
            "no RDMA devices found (ibv_get_device_list returned none: no InfiniBand/RoCE \
                    NIC, or its kernel driver is not loaded)"
                .into(),
        );
    }
    let mut tried = Vec::new();
    let candidates: Vec<(String, Option<u8>)> = match &opts.device {
        Some((name, port)) => {
            if !names.contains(name) {
                return Err(format!(
                    "DSPARK_IB_DEVICE names {name:?}, which does not exist (devices: {})",
                    names.join(", ")
                ));
            }
            vec![(name.clone(), *port)]
        }
        None => names.iter().map(|n| (n.clone(), None)).collect(),
    };
    for (name, want_port) in candidates {
        let ctx = match Context::open(lib, &name) {
            Ok(c) => c,
            Err(e) => {
                tried.push(format!("{name}: {e}"));
                continue;
            }
        };
        let count = ctx.port_count().map_err(|e| format!("{name}: {e}"))?;
        let ports: Vec<u8> = match want_port {
            Some(p) if p > count => {
                return Err(format!(
                    "DSPARK_IB_DEVICE: {name} has {count} port(s), not port {p}"
                ));
            }
            Some(p) => vec![p],
            None => (1..=count).collect(),
        };
        for port in ports {
            let pa = match ctx.query_port(port) {
                Ok(a) => a,
                Err(e) => {
                    tried.push(format!("{name}:{port}: {e}"));
                    continue;
                }
            };
            if pa.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
                tried.push(format!("{name}:{port} is {}", port_state_name(pa.state)));
                continue;
            }
            return address(ctx, port, pa, opts).map_err(|w| format!("{name}:{port}: {w}"));
        }
    }
    Err(format!("no ACTIVE RDMA port ({})", tried.join("; ")))
}

fn address(
    ctx: Context,
    port: u8,
    pa: ib::PortAttr,
    opts: &VerbsOptions,
) -> std::result::Result<Local, String> {
    let link = if u32::from(pa.link_layer) == ffi::_bindgen_ty_13::IBV_LINK_LAYER_ETHERNET {
        LinkLayer::Ethernet
    } else {
        LinkLayer::InfiniBand
    };
    let mut gid = [0u8; 16];
    let gid_index = match (link, opts.gid_index) {
        (_, Some(gi)) => {
            let e = ctx
                .query_gid(port, gi)
                .map_err(|e| format!("DSPARK_IB_GID_INDEX={gi}: {e}"))?;
            if e.gid == [0; 16] {
                return Err(format!(
                    "DSPARK_IB_GID_INDEX={gi}: that GID table entry is empty"
                ));
            }
            gid = e.gid;
            Some(gi as u8)
        }
        (LinkLayer::InfiniBand, None) => {
            if pa.lid == 0 {
                return Err("InfiniBand port has LID 0 (is a subnet manager running?)".into());
            }
            None
        }
        (LinkLayer::Ethernet, None) => {
            let mut first_v2 = None;
            let mut pick = None;
            for i in 0..pa.gid_tbl_len.clamp(0, 256) as u32 {
                let Ok(e) = ctx.query_gid(port, i) else {
                    continue;
                };
                if e.gid == [0; 16] {
                    continue;
                }
                let v2 = e
                    .gid_type
                    .is_none_or(|t| t == ffi::ibv_gid_type::IBV_GID_TYPE_ROCE_V2);
                if !v2 {
                    continue;
                }
                if is_ipv4_mapped(&e.gid) {
                    pick = Some((i, e.gid));
                    break;
                }
                first_v2.get_or_insert((i, e.gid));
            }
            let (i, g) = pick.or(first_v2).ok_or_else(|| {
                "no RoCE v2 GID on this port (give the interface an IP address, or set \
                 DSPARK_IB_GID_INDEX; `show_gids` lists the table)"
                    .to_string()
            })?;
            gid = g;
            Some(i as u8)
        }
    };
    Ok(Local {
        ctx,
        port,
        addr: PortAddr {
            link,
            lid: pa.lid,
            gid,
            gid_index,
            mtu: pa.active_mtu,
        },
    })
}

/// This rank's memory and queue pair for one peer, before connecting.
struct Half {
    qp: Qp,
    remote_mr: Mr,
    local_mr: Mr,
    remote_mem: Memory,
    local_mem: Memory,
    psn: u32,
}

/// Local resources created before the connection round.
struct Prepared {
    lib: Lib,
    local: Local,
    pd: Pd,
    cq: Cq,
    halves: Vec<Option<Half>>,
    opts: VerbsOptions,
    direct: Option<DirectOwn>,
    direct_info: DirectInfo,
}

fn psn_for(rank: usize, peer: usize) -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (t ^ ((rank as u32) << 12) ^ (peer as u32).wrapping_mul(0x9e37)) & 0x00ff_ffff
}

fn prepare(
    rank: usize,
    world: usize,
    opts: VerbsOptions,
    direct: &mut dyn FnMut(&VerbsOptions, &str) -> DirectSpec,
) -> std::result::Result<Prepared, String> {
    let lib = ib::load()?;
    let local = choose_port(&lib, &opts)?;
    let dev = format!("{}:{}", local.ctx.name, local.port);
    let need = (opts.pinned_per_peer() * world.saturating_sub(1)) as u64;
    if let Some(p) = memlock_problem(need) {
        return Err(format!("{dev}: {p}"));
    }
    let pd = Pd::new(&local.ctx).map_err(|e| format!("{dev}: {e}"))?;
    let n = opts.slots;
    let sq_depth = (2 * n + 8) as u32;
    let rq_depth = (2 * n + 4) as u32;
    let cq_depth = ((sq_depth + rq_depth) as usize * world.saturating_sub(1)).max(16) as i32;
    let cq = Cq::new(&local.ctx, cq_depth).map_err(|e| format!("{dev}: {e}"))?;
    let mut halves = Vec::with_capacity(world);
    for peer in 0..world {
        if peer == rank {
            halves.push(None);
            continue;
        }
        let (remote_len, local_len) = opts.peer_memory();
        let (Some(remote_mem), Some(local_mem)) = (Memory::new(remote_len), Memory::new(local_len))
        else {
            return Err(format!(
                "{dev}: cannot allocate {} KiB of slot memory",
                (remote_len + local_len) / 1024
            ));
        };
        // SAFETY: both ranges are owned by the `Half` together with their MRs, which are
        // dropped before the memory (field order of `Peer`); Rust only forms references to
        // parts the protocol says the NIC is not writing at that moment.
        let remote_mr =
            unsafe { pd.register(remote_mem.as_ptr(), remote_len, Access::RemoteWrite) }
                .map_err(|e| format!("{dev}: {}", reg_hint(&e)))?;
        // SAFETY: as above.
        let local_mr = unsafe { pd.register(local_mem.as_ptr(), local_len, Access::LocalWrite) }
            .map_err(|e| format!("{dev}: {}", reg_hint(&e)))?;
        let mut qp = Qp::new(&pd, &cq, sq_depth, rq_depth).map_err(|e| format!("{dev}: {e}"))?;
        qp.to_init(local.port).map_err(|e| format!("{dev}: {e}"))?;
        for _ in 0..rq_depth {
            qp.post_recv(wr_id(peer, WrKind::Recv, 0))
                .map_err(|e| format!("{dev}: {e}"))?;
        }
        halves.push(Some(Half {
            qp,
            remote_mr,
            local_mr,
            remote_mem,
            local_mem,
            psn: psn_for(rank, peer),
        }));
    }
    // Only now, with a usable port, is it worth setting up device memory for the NIC.
    let spec = direct(&opts, &local.ctx.name);
    let (direct, direct_info) = register_direct(&pd, world, &opts, &spec);
    Ok(Prepared {
        lib,
        local,
        pd,
        cq,
        halves,
        opts,
        direct,
        direct_info,
    })
}

impl Prepared {
    fn blob(&self) -> Blob {
        let n = self.opts.slots;
        let sb = self.opts.slot_bytes();
        let qps = self
            .halves
            .iter()
            .map(|h| match h {
                None => QpInfo::default(),
                Some(h) => {
                    let base = h.remote_mem.as_ptr() as u64;
                    QpInfo {
                        qpn: h.qp.qpn,
                        psn: h.psn,
                        rkey: h.remote_mr.rkey,
                        rx_addr: base,
                        ctrl_addr: base + (n * sb) as u64,
                        cts_addr: base + (n * sb + CTRL_BYTES) as u64,
                    }
                }
            })
            .collect();
        Blob::Capable {
            device: format!("{}:{}", self.local.ctx.name, self.local.port),
            port: self.local.addr,
            slots: n as u32,
            slot_bytes: sb as u32,
            ctrl_bytes: CTRL_BYTES as u32,
            qps,
            direct: self.direct_info.clone(),
        }
    }

    /// Moves every queue pair to RTS towards its peer.
    fn connect(&mut self, rank: usize, blobs: &[Blob]) -> std::result::Result<(), String> {
        let rel = self.opts.reliability;
        for (peer, h) in self.halves.iter_mut().enumerate() {
            let Some(h) = h else { continue };
            let Blob::Capable { port, qps, .. } = &blobs[peer] else {
                return Err(format!("rank {peer} has no verbs connection information"));
            };
            let Some(theirs) = qps.get(rank) else {
                return Err(format!(
                    "rank {peer} sent connection information for {} ranks",
                    qps.len()
                ));
            };
            let remote = ib::Remote {
                qpn: theirs.qpn,
                psn: theirs.psn,
                lid: port.lid,
                gid: port.gid,
                sgid_index: match (self.local.addr.link, port.gid_index) {
                    (LinkLayer::Ethernet, _) => self.local.addr.gid_index,
                    (LinkLayer::InfiniBand, Some(_)) => self.local.addr.gid_index,
                    (LinkLayer::InfiniBand, None) => None,
                },
                mtu: wire::path_mtu(self.local.addr.mtu, port.mtu),
            };
            h.qp.to_rtr(self.local.port, &remote, &rel)
                .map_err(|e| format!("queue pair to rank {peer}: {e}"))?;
            h.qp.to_rts(h.psn, &rel)
                .map_err(|e| format!("queue pair to rank {peer}: {e}"))?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum PeerState {
    Open,
    /// The peer said goodbye (when it arrived: writes posted before it may still be
    /// waiting for their acknowledgement, see [`CLOSED_GRACE`]).
    Closed(Instant),
    /// The connection failed, or the peer aborted: the error every later use returns.
    Failed(Error),
}

impl Peer {
    /// Records that a verb on this connection failed: the connection is failed from now on,
    /// and every later use returns the same error (naming the rank, the peer and the verb).
    fn fail_verb(&mut self, rank: usize, peer: usize, op: String, e: &ib::VerbError) -> Error {
        let err = Error::Transport {
            rank: Some(rank),
            peer: Some(peer),
            op,
            what: e.err.to_string(),
        };
        self.state = PeerState::Failed(err.clone());
        err
    }
}

/// One connection.
#[derive(Debug)]
struct Peer {
    // Field order is drop order: the QP goes first, then the MRs, then the memory.
    qp: Qp,
    remote_mr: Mr,
    local_mr: Mr,
    remote_mem: Memory,
    local_mem: Memory,
    /// Liveness: the bootstrap's TCP connection to the peer (closed when its process dies).
    stream: Option<TcpStream>,
    /// The peer's memory.
    theirs: QpInfo,
    their_slot_bytes: usize,
    their_ctrl_bytes: usize,
    send: SendSide,
    recv: RecvSide,
    sq: SendQueue,
    /// Lengths of arrived frames, by slot.
    rx_len: Vec<u32>,
    /// Whether the frame in each slot is direct (payload in the landing slot).
    rx_direct: Vec<bool>,
    /// Direct frames taken but not released (frame indices, oldest first).
    held: VecDeque<u64>,
    /// Where this rank's direct payloads land at the peer: (address of landing slot 0 for
    /// this rank, rkey, bytes per slot).
    their_landing: Option<(u64, u32, usize)>,
    state: PeerState,
    /// Bye/abort written by this rank (send-queue index of the write).
    farewell: Option<u64>,
}

impl Peer {
    fn is_open(&self) -> bool {
        matches!(self.state, PeerState::Open)
    }
}

/// A clear-to-send credit claimed for one frame (see `VerbsTransport::claim`).
struct Claim {
    seq: u64,
    slot: usize,
    /// The peer's receive slot and its rkey.
    raddr: u64,
    rkey: u32,
    /// The staged header (inside `local_mr`).
    header_addr: u64,
}

/// A caller buffer registered for zero-copy sends.
#[derive(Debug)]
struct UserMr {
    id: u64,
    start: u64,
    end: u64,
    kind: MemoryKind,
    mr: Mr,
}

/// The verbs transport of one rank.
pub struct VerbsTransport {
    rank: usize,
    world: usize,
    // Field order is drop order: connections and registrations, then CQ, PD, context, library.
    peers: Vec<Option<Peer>>,
    user_mrs: Vec<UserMr>,
    direct: Option<DirectOwn>,
    /// Every rank's direct region information (this rank's included).
    direct_infos: Vec<DirectInfo>,
    cq: Cq,
    pd: Pd,
    /// Kept open until everything above is released.
    _ctx: Context,
    lib: Lib,
    wc: Vec<ffi::ibv_wc>,
    opts: VerbsOptions,
    desc: String,
    next_mr_id: u64,
    /// `abort` or `close` ran.
    finished: bool,
    /// Frames sent straight from registered caller memory.
    zero_copy_frames: u64,
}

impl std::fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("desc", &self.desc)
            .finish()
    }
}

fn timeout_ms(t: u8) -> f64 {
    4.096e-3 * f64::from(1u32 << t.min(31))
}

impl VerbsTransport {
    fn build(
        rank: usize,
        world: usize,
        prep: Prepared,
        blobs: &[Blob],
        streams: Vec<Option<TcpStream>>,
    ) -> Self {
        let Prepared {
            lib,
            local,
            pd,
            cq,
            halves,
            opts,
            direct,
            direct_info,
        } = prep;
        let mut direct_infos: Vec<DirectInfo> = (0..world)
            .map(|r| match blobs.get(r) {
                Some(Blob::Capable { direct, .. }) => direct.clone(),
                _ => DirectInfo::None,
            })
            .collect();
        if let Some(d) = direct_infos.get_mut(rank) {
            *d = direct_info;
        }
        let n = opts.slots;
        let mut streams = streams;
        streams.resize_with(world, || None);
        let mut peers = Vec::with_capacity(world);
        let mut mtus = Vec::new();
        for (peer, (h, stream)) in halves.into_iter().zip(streams).enumerate() {
            let Some(h) = h else {
                peers.push(None);
                continue;
            };
            let (theirs, their_slot_bytes, their_ctrl_bytes, their_mtu) = match &blobs[peer] {
                Blob::Capable {
                    qps,
                    slot_bytes,
                    ctrl_bytes,
                    port,
                    ..
                } => (
                    qps.get(rank).copied().unwrap_or_default(),
                    *slot_bytes as usize,
                    *ctrl_bytes as usize,
                    port.mtu,
                ),
                Blob::Incapable { .. } => (QpInfo::default(), 0, 0, 0),
            };
            let their_landing = match (&direct, &direct_infos[peer]) {
                (
                    Some(mine),
                    DirectInfo::Region {
                        kind,
                        addr,
                        rkey,
                        slot_bytes,
                    },
                ) if (mine.kind == DirectKind::HostEmulated)
                    == (*kind == DirectKind::HostEmulated) =>
                {
                    let sb = *slot_bytes as usize;
                    Some((addr + (rank * n * sb) as u64, *rkey, sb))
                }
                _ => None,
            };
            let path_mtu = wire::path_mtu(local.addr.mtu, their_mtu);
            mtus.push(path_mtu);
            if let Some(s) = &stream {
                let _ = s.set_nonblocking(true);
            }
            peers.push(Some(Peer {
                qp: h.qp,
                remote_mr: h.remote_mr,
                local_mr: h.local_mr,
                remote_mem: h.remote_mem,
                local_mem: h.local_mem,
                stream,
                theirs,
                their_slot_bytes,
                their_ctrl_bytes,
                send: SendSide::new(n as u64),
                recv: RecvSide::new(n as u64),
                sq: SendQueue::new((2 * n + 8) as u64),
                rx_len: vec![0; n],
                rx_direct: vec![false; n],
                held: VecDeque::new(),
                their_landing,
                state: PeerState::Open,
                farewell: None,
            }));
        }
        let a = &local.addr;
        let addressing = match a.gid_index {
            Some(gi) => format!("GID index {gi} {}", gid_string(&a.gid)),
            None => format!("LID {}", a.lid),
        };
        let path = match (mtus.iter().min(), mtus.iter().max()) {
            (Some(lo), Some(hi)) if lo == hi => format!(", path MTU {}", wire::mtu_bytes(*lo)),
            (Some(lo), Some(hi)) => {
                format!(
                    ", path MTU {}–{}",
                    wire::mtu_bytes(*lo),
                    wire::mtu_bytes(*hi)
                )
            }
            _ => String::new(),
        };
        let r = &opts.reliability;
        let desc = format!(
            "verbs {}:{} ({} {addressing}, active MTU {}{path}), RC, {} slots × {} KiB per peer \
             and direction, ACK timeout {} (~{:.0} ms) × {} retries, zero-copy sends from \
             registered buffers ≥ {} KiB",
            local.ctx.name,
            local.port,
            a.link.name(),
            wire::mtu_bytes(a.mtu),
            n,
            opts.slot_payload / 1024,
            r.timeout,
            timeout_ms(r.timeout),
            r.retry_cnt,
            opts.zero_copy_min / 1024,
        );
        // SAFETY: all-zero is a valid ibv_wc (integers and a union of integers).
        let wc = vec![unsafe { std::mem::zeroed::<ffi::ibv_wc>() }; POLL_BATCH];
        VerbsTransport {
            rank,
            world,
            peers,
            user_mrs: Vec::new(),
            direct,
            direct_infos,
            cq,
            pd,
            _ctx: local.ctx,
            lib,
            wc,
            opts,
            desc,
            next_mr_id: 1,
            finished: false,
            zero_copy_frames: 0,
        }
    }

    /// Every rank's direct region information, as exchanged at init (indexed by rank).
    pub fn direct_infos(&self) -> &[DirectInfo] {
        &self.direct_infos
    }

    /// The options in use.
    pub fn options(&self) -> &VerbsOptions {
        &self.opts
    }

    /// Registers memory of `kind` for zero-copy sends; returns its id for
    /// [`Transport::deregister`].
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
                self.pd.register(addr as *mut u8, len, Access::SendSource)
            },
            // SAFETY: the caller's contract covers the dma-buf range.
            MemoryKind::CudaDmaBuf { fd, offset } => unsafe {
                self.pd
                    .register_dmabuf(fd, offset, len, addr, Access::SendSource)
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

    fn lookup_mr(&self, data: &[u8]) -> Option<u32> {
        let a = data.as_ptr() as u64;
        let b = a + data.len() as u64;
        self.user_mrs
            .iter()
            .find(|m| m.kind == MemoryKind::Host && m.start <= a && b <= m.end)
            .map(|m| m.mr.lkey)
    }

    fn peer_ref(&self, peer: usize, op: &str) -> Result<&Peer> {
        let rank = self.rank;
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::invalid(Some(rank), op, format!("no connection to rank {peer}")))
    }

    fn peer_mut(&mut self, peer: usize, op: &str) -> Result<&mut Peer> {
        let rank = self.rank;
        self.peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::invalid(Some(rank), op, format!("no connection to rank {peer}")))
    }

    fn peer_err(&self, peer: usize, op: &str) -> Option<Error> {
        let p = self.peers.get(peer).and_then(Option::as_ref);
        match p.map(|p| &p.state) {
            None => Some(Error::invalid(
                Some(self.rank),
                op,
                format!("no connection to rank {peer}"),
            )),
            Some(PeerState::Open) => None,
            Some(PeerState::Closed(_)) => Some(Error::PeerLost {
                rank: self.rank,
                peer,
                op: op.into(),
                detail: "peer closed its communicator".into(),
            }),
            Some(PeerState::Failed(e)) => Some(e.clone()),
        }
    }

    fn finished_err(&self, op: &str) -> Error {
        Error::Transport {
            rank: Some(self.rank),
            peer: None,
            op: op.into(),
            what: "the verbs transport was closed or aborted".into(),
        }
    }

    /// Drains the completion queue and re-advertises consumed slots. Returns the number of
    /// completions, or the first error they carried (after processing all of them).
    fn progress(&mut self) -> Result<usize> {
        let mut total = 0;
        let mut first: Option<Error> = None;
        loop {
            let n = match self.cq.poll(&mut self.wc) {
                Ok(n) => n,
                Err(e) => {
                    return Err(Error::Transport {
                        rank: Some(self.rank),
                        peer: None,
                        op: e.verb.into(),
                        what: e.err.to_string(),
                    })
                }
            };
            for i in 0..n {
                let wc = self.wc[i];
                if let Err(e) = self.on_completion(&wc) {
                    first.get_or_insert(e);
                }
            }
            total += n;
            if n < self.wc.len() {
                break;
            }
        }
        if !self.finished {
            for peer in 0..self.peers.len() {
                if let Err(e) = self.flush_cts(peer) {
                    first.get_or_insert(e);
                }
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }

    fn protocol_error(&mut self, peer: usize, what: String) -> Error {
        let e = Error::Transport {
            rank: Some(self.rank),
            peer: Some(peer),
            op: "verbs protocol".into(),
            what: format!("rank {peer} broke the protocol: {what}"),
        };
        if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
            p.state = PeerState::Failed(e.clone());
        }
        e
    }

    fn on_completion(&mut self, wc: &ffi::ibv_wc) -> Result<()> {
        use ffi::ibv_wc_status as st;
        let rank = self.rank;
        let (peer, kind, idx) = split_wr_id(wc.wr_id);
        let finished = self.finished;
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        if wc.status != st::IBV_WC_SUCCESS {
            if kind != WrKind::Recv {
                p.sq.complete(idx);
            }
            // A frame that failed after the peer's goodbye never reached it: a peer leaves
            // only once it has every frame it needs, so the job's ranks disagree. Fail the
            // connection, so that the send waiting for this write reports it.
            if !finished && kind == WrKind::Data && matches!(p.state, PeerState::Closed(_)) {
                let status = ib::wc_status_string(&self.lib, wc.status);
                p.state = PeerState::Failed(Error::PeerLost {
                    rank,
                    peer,
                    op: kind.describe().into(),
                    detail: format!(
                        "peer closed its communicator, and a frame to it then failed: {status}"
                    ),
                });
                return Ok(());
            }
            // Flushes after this rank moved its QPs to ERR, and anything else from a peer
            // that already left or failed, are expected.
            if finished
                || !p.is_open()
                || wc.status == st::IBV_WC_WR_FLUSH_ERR && p.qp.state == qp::QpState::Err
            {
                return Ok(());
            }
            let status = ib::wc_status_string(&self.lib, wc.status);
            let r = &self.opts.reliability;
            let hint = match wc.status {
                st::IBV_WC_RETRY_EXC_ERR => format!(
                    ": no acknowledgement from rank {peer} within the retry budget (ACK timeout {} \
                     ≈ {:.0} ms × {} retries): its process died, its queue pair is gone or the \
                     link is down",
                    r.timeout,
                    timeout_ms(r.timeout),
                    r.retry_cnt
                ),
                st::IBV_WC_RNR_RETRY_EXC_ERR => format!(": rank {peer} had no receive posted"),
                st::IBV_WC_REM_ACCESS_ERR => {
                    format!(": rank {peer} refused the access (stale rkey?)")
                }
                _ => String::new(),
            };
            let detail = format!("{} failed: {status}{hint}", kind.describe());
            let e = match wc.status {
                st::IBV_WC_RETRY_EXC_ERR
                | st::IBV_WC_RNR_RETRY_EXC_ERR
                | st::IBV_WC_REM_ACCESS_ERR
                | st::IBV_WC_REM_OP_ERR
                | st::IBV_WC_REM_INV_REQ_ERR
                | st::IBV_WC_REM_ABORT_ERR
                | st::IBV_WC_RESP_TIMEOUT_ERR
                | st::IBV_WC_WR_FLUSH_ERR => Error::PeerLost {
                    rank,
                    peer,
                    op: "RDMA transfer".into(),
                    detail,
                },
                _ => Error::Transport {
                    rank: Some(rank),
                    peer: Some(peer),
                    op: kind.describe().into(),
                    what: detail,
                },
            };
            p.state = PeerState::Failed(e.clone());
            return Err(e);
        }
        if kind != WrKind::Recv {
            p.sq.complete(idx);
            return Ok(());
        }
        // A receive was consumed: replace it first (receives carry no buffer).
        if let Err(e) = p.qp.post_recv(wr_id(peer, WrKind::Recv, 0)) {
            return Err(p.fail_verb(rank, peer, e.verb.into(), &e));
        }
        // SAFETY: for RECV_RDMA_WITH_IMM completions the union holds the immediate.
        let raw = u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data });
        let imm = Imm::decode(raw);
        let landing_bytes = self.direct.as_ref().map_or(0, |d| d.layout.slot_bytes);
        match imm {
            Imm::Data { seq, len } | Imm::Direct { seq, len } => {
                let is_direct = matches!(imm, Imm::Direct { .. });
                let max = if is_direct {
                    HEADER_LEN + landing_bytes
                } else {
                    self.opts.slot_bytes()
                };
                let expect = (p.recv.arrived & 0xf) as u8;
                if !p.recv.may_arrive()
                    || seq != expect
                    || len as usize > max
                    || (len as usize) < HEADER_LEN
                    || (is_direct && landing_bytes == 0)
                {
                    let (a, c) = (p.recv.arrived, p.recv.cts_posted);
                    return Err(self.protocol_error(
                        peer,
                        format!("frame #{a} (seq bits {seq}, expected {expect}, {len} bytes) with {c} slots advertised"),
                    ));
                }
                let slot = (p.recv.arrived % p.recv.n) as usize;
                p.rx_len[slot] = len;
                p.rx_direct[slot] = is_direct;
                p.recv.arrived += 1;
            }
            Imm::Cts { seq } => {
                let expect = (p.send.cts_arrived & 0x3fff_ffff) as u32;
                if seq != expect {
                    return Err(self
                        .protocol_error(peer, format!("clear-to-send {seq}, expected {expect}")));
                }
                p.send.cts_arrived += 1;
            }
            Imm::Ctrl { len } => {
                let n = p.recv.n as usize;
                let sb = self.opts.slot_bytes();
                let len = (len as usize).min(CTRL_BYTES);
                if len < HEADER_LEN {
                    return Err(self.protocol_error(peer, format!("control frame of {len} bytes")));
                }
                let mut frame = vec![0u8; len];
                // SAFETY: the control slot lies inside `remote_mem` at this offset; the peer
                // wrote it once (its completion was just polled) and never writes it again.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        p.remote_mem.as_ptr().add(n * sb),
                        frame.as_mut_ptr(),
                        len,
                    );
                }
                let mut hb = [0u8; HEADER_LEN];
                hb.copy_from_slice(&frame[..HEADER_LEN]);
                let hdr = match FrameHeader::decode(&hb) {
                    Ok(h) => h,
                    Err(w) => return Err(self.protocol_error(peer, w)),
                };
                match hdr.kind {
                    FrameKind::Bye => p.state = PeerState::Closed(Instant::now()),
                    FrameKind::Abort => {
                        let end = (HEADER_LEN + hdr.len as usize).min(len);
                        let msg = String::from_utf8_lossy(&frame[HEADER_LEN..end]).into_owned();
                        let e = AbortClass::error(
                            hdr.coll,
                            rank,
                            hdr.root as usize,
                            "communicator",
                            msg,
                        );
                        p.state = PeerState::Failed(e.clone());
                        return Err(e);
                    }
                    FrameKind::Data => {
                        return Err(
                            self.protocol_error(peer, "data frame in the control slot".into())
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes the clear-to-send entries of consumed slots to `peer`, as far as the send queue
    /// allows.
    fn flush_cts(&mut self, peer: usize) -> Result<()> {
        let rank = self.rank;
        let sb = self.opts.slot_bytes();
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        while let Some((seq, slot)) = p.recv.pending_cts() {
            if !p.is_open() || !p.sq.has_room() {
                break;
            }
            let n = p.recv.n as usize;
            let entry = Cts {
                seq,
                addr: p.remote_mem.as_ptr() as u64 + (slot * sb) as u64,
                rkey: p.remote_mr.rkey,
                size: sb as u32,
            }
            .encode();
            let src_off = n * sb + slot * CTS_LEN;
            // SAFETY: `cts_out[slot]` lies inside `local_mem`; its previous write (CTS
            // `seq − n`) completed, since the peer used it to send the frame just consumed.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    entry.as_ptr(),
                    p.local_mem.as_ptr().add(src_off),
                    CTS_LEN,
                );
            }
            let mut sge = [ffi::ibv_sge {
                addr: p.local_mem.as_ptr() as u64 + src_off as u64,
                length: CTS_LEN as u32,
                lkey: p.local_mr.lkey,
            }];
            let remote = p.theirs.cts_addr + (slot * CTS_LEN) as u64;
            let sig = p.sq.must_signal();
            let idx = p.sq.post(sig);
            let imm = Imm::Cts {
                seq: (seq & 0x3fff_ffff) as u32,
            }
            .encode();
            // SAFETY: the SGE is inside `local_mr` and stays unchanged until the peer consumes
            // this CTS; the remote range is entry `slot` of the peer's CTS ring (its rkey).
            let r = unsafe {
                p.qp.post_write_imm(
                    wr_id(peer, WrKind::Cts, idx),
                    &mut sge,
                    remote,
                    p.theirs.rkey,
                    imm,
                    sig,
                )
            };
            if let Err(e) = r {
                return Err(p.fail_verb(rank, peer, format!("{} (clear-to-send)", e.verb), &e));
            }
            p.recv.cts_posted += 1;
        }
        Ok(())
    }

    /// Frees the receive slots of `peer` that nothing holds any more (every slot before the
    /// oldest held landing slot) and re-advertises them.
    fn settle(&mut self, peer: usize, op: &str) -> Result<()> {
        let p = self.peer_mut(peer, op)?;
        let oldest = p.held.front().copied();
        p.recv.settle(oldest);
        if self.finished {
            return Ok(());
        }
        self.flush_cts(peer)
    }

    /// Whether the send-queue entry `token − 1` to `peer` (a signalled write) has completed,
    /// polling completions if it has not yet.
    ///
    /// A peer that said goodbye received every frame it needed, and acknowledged each write
    /// before it wrote the goodbye; but the acknowledgement's send completion and the
    /// goodbye's receive completion come from different parts of the provider and can be
    /// polled in either order. So a goodbye does not fail a posted write at once: its
    /// completion is awaited for [`CLOSED_GRACE`] more.
    fn retired(&mut self, peer: usize, token: u64, op: &str) -> Result<bool> {
        let polled = if self.peer_ref(peer, op)?.sq.retired >= token {
            Ok(0)
        } else {
            self.progress()
        };
        let rank = self.rank;
        let p = self.peer_ref(peer, op)?;
        // A failed connection wins even over a retired entry: a failed write retires too.
        if let PeerState::Failed(e) = &p.state {
            return Err(e.clone());
        }
        if p.sq.retired >= token {
            return Ok(true);
        }
        if let PeerState::Closed(at) = &p.state {
            if at.elapsed() >= CLOSED_GRACE {
                return Err(Error::PeerLost {
                    rank,
                    peer,
                    op: op.into(),
                    detail: format!(
                        "peer closed its communicator and our write to it was still \
                         unacknowledged {:.1} s later",
                        at.elapsed().as_secs_f64()
                    ),
                });
            }
        }
        polled.map(|_| false)
    }

    /// Claims the next clear-to-send credit to `peer` for a frame that puts `need` bytes into
    /// the peer's receive slot and takes `wrs` send-queue entries: stages `hdr` in the staging
    /// slot of that credit and says where the frame goes. `None` while there is no credit or
    /// no room in the send queue.
    fn claim(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        need: usize,
        wrs: u64,
        op: &str,
    ) -> Result<Option<Claim>> {
        let sb = self.opts.slot_bytes();
        {
            let p = self.peer_ref(peer, op)?;
            if p.send.next_credit().is_none() || !p.sq.has_room_for(wrs) {
                // Completions may have brought a clear-to-send or retired the queue.
                self.progress()?;
            }
        }
        if let Some(e) = self.peer_err(peer, op) {
            return Err(e);
        }
        let p = self.peer_mut(peer, op)?;
        let Some(seq) = p.send.next_credit() else {
            return Ok(None);
        };
        if !p.sq.has_room_for(wrs) {
            return Ok(None);
        }
        let slot = p.send.index(seq);
        let (raddr, rkey) = if p.send.cts_written_by_peer(seq) {
            let n = p.send.n as usize;
            // The ring lives in `remote_mem` after the receive slots and the control slot.
            let ring = n * sb + CTRL_BYTES + slot * CTS_LEN;
            // SAFETY: the ring entry lies inside `remote_mem`; its completion was polled, so
            // the peer's write is complete, and the peer does not rewrite it before this
            // frame is consumed. A volatile read keeps the compiler from caching it.
            let e: [u8; CTS_LEN] = unsafe {
                std::ptr::read_volatile(p.remote_mem.as_ptr().add(ring) as *const [u8; CTS_LEN])
            };
            fence(Ordering::Acquire);
            match Cts::decode(&e) {
                Some(c) if c.seq == seq && c.size as usize >= need => (c.addr, c.rkey),
                other => {
                    let w = format!("clear-to-send entry {seq} reads {other:?}");
                    return Err(self.protocol_error(peer, w));
                }
            }
        } else {
            (
                p.theirs.rx_addr + (slot * p.their_slot_bytes) as u64,
                p.theirs.rkey,
            )
        };
        let staging = slot * sb;
        // SAFETY: staging slot `slot` lies inside `local_mem` and is free: CTS `seq` proves
        // that the frame previously staged there (seq − n) landed.
        unsafe {
            std::ptr::copy_nonoverlapping(
                hdr.encode().as_ptr(),
                p.local_mem.as_ptr().add(staging),
                HEADER_LEN,
            );
        }
        Ok(Some(Claim {
            seq,
            slot,
            raddr,
            rkey,
            header_addr: p.local_mem.as_ptr() as u64 + staging as u64,
        }))
    }

    /// The next arrived frame from `peer`, not yet taken: (slot, length, direct?, header).
    fn next_header(
        &mut self,
        peer: usize,
        op: &str,
    ) -> Result<Option<(usize, usize, bool, FrameHeader)>> {
        if self.finished {
            return Err(self.finished_err(op));
        }
        let polled = self.progress();
        if let Some(p) = self.peers.get(peer).and_then(Option::as_ref) {
            if let PeerState::Failed(e) = &p.state {
                return Err(e.clone());
            }
        }
        polled?;
        let sb = self.opts.slot_bytes();
        let p = self.peer_mut(peer, op)?;
        let Some(slot) = p.recv.next_frame() else {
            // Nothing more will come from a peer that left.
            return self.peer_err(peer, op).map_or(Ok(None), Err);
        };
        let len = p.rx_len[slot] as usize;
        let is_direct = p.rx_direct[slot];
        let mut hb = [0u8; HEADER_LEN];
        // SAFETY: the header is the first HEADER_LEN bytes of receive slot `slot` inside
        // `remote_mem`; the frame's completion was polled and the peer does not write this
        // slot again before it is re-advertised.
        unsafe {
            std::ptr::copy_nonoverlapping(
                p.remote_mem.as_ptr().add(slot * sb),
                hb.as_mut_ptr(),
                HEADER_LEN,
            );
        }
        match FrameHeader::decode(&hb) {
            Ok(h) if h.kind == FrameKind::Data && HEADER_LEN + h.len as usize == len => {
                Ok(Some((slot, len, is_direct, h)))
            }
            Ok(h) => {
                let w = format!(
                    "a {len}-byte write carries a {:?} frame header of length {}",
                    h.kind, h.len
                );
                Err(self.protocol_error(peer, w))
            }
            Err(w) => Err(self.protocol_error(peer, w)),
        }
    }

    /// Checks the liveness connection to `peer`: a closed connection without a goodbye means
    /// the process is gone.
    fn examine(&mut self, peer: usize) -> Result<()> {
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        if !p.is_open() {
            return Ok(());
        }
        let Some(s) = &mut p.stream else {
            return Ok(());
        };
        // Nothing is ever sent on this connection in verbs mode: discard whatever is there
        // (leftovers of the bootstrap) so that the end of the stream becomes visible.
        let mut b = [0u8; 256];
        let gone = loop {
            match io::Read::read(s, &mut b) {
                Ok(0) => {
                    break Some("connection closed without goodbye (process died?)".to_string())
                }
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break None,
                Err(e) => break Some(format!("{e} (process died?)")),
            }
        };
        let Some(detail) = gone else {
            return Ok(());
        };
        // A goodbye or abort written just before the process exited is in the CQ already.
        self.progress()?;
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        if !p.is_open() {
            return Ok(());
        }
        let e = Error::PeerLost {
            rank: self.rank,
            peer,
            op: "communicator".into(),
            detail,
        };
        p.state = PeerState::Failed(e.clone());
        Err(e)
    }

    /// Writes a control frame (abort or goodbye) to every open peer and waits briefly for the
    /// writes to be acknowledged.
    fn farewell(&mut self, hdr: &FrameHeader, msg: &[u8]) {
        let sb = self.opts.slot_bytes();
        for (peer, p) in self.peers.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            if !p.is_open() || p.their_ctrl_bytes < HEADER_LEN {
                continue;
            }
            if !p.sq.has_room() {
                tracing::warn!(
                    peer,
                    "no room in the send queue for a goodbye/abort frame: the peer will see this \
                     rank vanish instead"
                );
                continue;
            }
            let n = p.send.n as usize;
            let msg = &msg[..msg
                .len()
                .min(p.their_ctrl_bytes.min(CTRL_BYTES) - HEADER_LEN)];
            let len = HEADER_LEN + msg.len();
            let mut h = *hdr;
            h.len = msg.len() as u32;
            let off = n * sb + n * CTS_LEN;
            // SAFETY: `ctrl_out` lies inside `local_mem` and is written only here, once.
            unsafe {
                let dst = p.local_mem.as_ptr().add(off);
                std::ptr::copy_nonoverlapping(h.encode().as_ptr(), dst, HEADER_LEN);
                std::ptr::copy_nonoverlapping(msg.as_ptr(), dst.add(HEADER_LEN), msg.len());
            }
            let mut sge = [ffi::ibv_sge {
                addr: p.local_mem.as_ptr() as u64 + off as u64,
                length: len as u32,
                lkey: p.local_mr.lkey,
            }];
            let idx = p.sq.post(true);
            let imm = Imm::Ctrl { len: len as u32 }.encode();
            // SAFETY: the SGE is inside `local_mr` and never rewritten; the remote range is
            // the peer's control slot.
            let r = unsafe {
                p.qp.post_write_imm(
                    wr_id(peer, WrKind::Ctrl, idx),
                    &mut sge,
                    p.theirs.ctrl_addr,
                    p.theirs.rkey,
                    imm,
                    true,
                )
            };
            if r.is_ok() {
                p.farewell = Some(idx);
            }
        }
        let until = Instant::now() + FAREWELL;
        while Instant::now() < until {
            let _ = self.progress();
            let pending = self
                .peers
                .iter()
                .flatten()
                .any(|p| p.farewell.is_some_and(|i| p.sq.retired <= i) && p.is_open());
            if !pending {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Transport for VerbsTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }

    fn send(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        data: &[u8],
        progress: &mut SendProgress,
    ) -> Result<bool> {
        const OP: &str = "send";
        if self.finished {
            return Err(self.finished_err(OP));
        }
        let total = HEADER_LEN + data.len();
        if progress.token != 0 {
            // A zero-copy write is in flight: done once its signalled completion retired it.
            if !self.retired(peer, progress.token, OP)? {
                return Ok(false);
            }
            progress.written = total;
            progress.token = 0;
            return Ok(true);
        }
        if let Some(e) = self.peer_err(peer, OP) {
            return Err(e);
        }
        let sb = self.opts.slot_bytes();
        {
            let p = self.peer_ref(peer, OP)?;
            if total > p.their_slot_bytes || total > sb {
                return Err(Error::Transport {
                    rank: Some(self.rank),
                    peer: Some(peer),
                    op: OP.into(),
                    what: format!(
                        "a {total}-byte frame does not fit rank {peer}'s {}-byte slots (set the \
                         same DSPARK_CHUNK_BYTES and DSPARK_IB_SLOT_BYTES on every rank)",
                        p.their_slot_bytes.min(sb)
                    ),
                });
            }
        }
        let zc_lkey = if data.len() >= self.opts.zero_copy_min {
            self.lookup_mr(data)
        } else {
            None
        };
        let rank = self.rank;
        let Some(c) = self.claim(peer, hdr, total, 1, OP)? else {
            return Ok(false);
        };
        let (seq, raddr, rkey, base) = (c.seq, c.raddr, c.rkey, c.header_addr);
        let staging = c.slot * sb;
        let p = self.peer_mut(peer, OP)?;
        let imm = Imm::Data {
            seq: (seq & 0xf) as u8,
            len: total as u32,
        }
        .encode();
        let (res, token) = if let Some(lkey) = zc_lkey {
            let mut sges = [
                ffi::ibv_sge {
                    addr: base,
                    length: HEADER_LEN as u32,
                    lkey: p.local_mr.lkey,
                },
                ffi::ibv_sge {
                    addr: data.as_ptr() as u64,
                    length: data.len() as u32,
                    lkey,
                },
            ];
            let idx = p.sq.post(true);
            // SAFETY: the header is in `local_mr`; the payload lies inside a caller
            // registration (looked up above) and the engine keeps it unchanged until this
            // send returns true, which waits for the completion; the remote range is the
            // slot the peer advertised.
            let r = unsafe {
                p.qp.post_write_imm(
                    wr_id(peer, WrKind::Data, idx),
                    &mut sges,
                    raddr,
                    rkey,
                    imm,
                    true,
                )
            };
            (r, idx + 1)
        } else {
            // SAFETY: the staging slot holds `sb ≥ total` bytes inside `local_mem`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr(),
                    p.local_mem.as_ptr().add(staging + HEADER_LEN),
                    data.len(),
                );
            }
            let mut sge = [ffi::ibv_sge {
                addr: base,
                length: total as u32,
                lkey: p.local_mr.lkey,
            }];
            let sig = p.sq.must_signal();
            let idx = p.sq.post(sig);
            // SAFETY: the SGE is the staging slot inside `local_mr`, untouched until CTS
            // `seq + n` proves the write landed; the remote range is the advertised slot.
            let r = unsafe {
                p.qp.post_write_imm(
                    wr_id(peer, WrKind::Data, idx),
                    &mut sge,
                    raddr,
                    rkey,
                    imm,
                    sig,
                )
            };
            (r, 0)
        };
        if let Err(e) = res {
            return Err(p.fail_verb(rank, peer, format!("{} (frame)", e.verb), &e));
        }
        p.send.sent += 1;
        if zc_lkey.is_some() {
            self.zero_copy_frames += 1;
        }
        if token == 0 {
            progress.written = total;
            return Ok(true);
        }
        progress.token = token;
        Ok(false)
    }

    fn zero_copy_frames(&self) -> u64 {
        self.zero_copy_frames
    }

    fn recv(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool> {
        const OP: &str = "receive";
        let Some((slot, len, is_direct, hdr)) = self.next_header(peer, OP)? else {
            return Ok(false);
        };
        let expected = sink.on_header(&hdr)?;
        // Classified by the frame, as `mem` does: a payload in a landing slot is a device
        // collective's, whatever this rank expected.
        if is_direct {
            return Err(direct_mismatch(self.rank, peer, true));
        }
        if expected != hdr.len as usize {
            let w = format!("frame of {} bytes where {expected} were expected", hdr.len);
            return Err(self.protocol_error(peer, w));
        }
        let sb = self.opts.slot_bytes();
        let p = self.peer_mut(peer, OP)?;
        // SAFETY: slot `slot` lies inside `remote_mem` and holds a `len`-byte frame (checked
        // against the slot size on arrival); its completion was polled and the peer writes
        // this slot again only after it is re-advertised below, after the last use of this
        // slice.
        let frame: &[u8] =
            unsafe { std::slice::from_raw_parts(p.remote_mem.as_ptr().add(slot * sb), len) };
        let payload = &frame[HEADER_LEN..HEADER_LEN + expected];
        if let Some(dst) = sink.direct() {
            let got = progress.got;
            let end = got + expected;
            if end > dst.len() {
                return Err(self.protocol_error(
                    peer,
                    format!("frame overruns the destination ({end} > {})", dst.len()),
                ));
            }
            dst[got..end].copy_from_slice(payload);
        } else if !payload.is_empty() {
            sink.consume(payload)?;
        }
        progress.header = None;
        progress.expected = expected;
        progress.got += expected;
        self.peer_mut(peer, OP)?.recv.taken += 1;
        self.settle(peer, OP)?;
        Ok(true)
    }

    fn direct_layout(&self) -> Option<DirectLayout> {
        self.direct.as_ref().map(|d| d.layout)
    }

    fn direct_base(&self) -> Option<u64> {
        self.direct.as_ref().map(|d| d.mr.addr)
    }

    fn direct_host_region(&self) -> Option<Arc<dyn RegionAccess>> {
        let h = self.direct.as_ref()?.host.as_ref()?;
        Some(Arc::clone(h) as Arc<dyn RegionAccess>)
    }

    fn direct_peer(&self, peer: usize) -> bool {
        self.direct.is_some()
            && self
                .peers
                .get(peer)
                .and_then(Option::as_ref)
                .is_some_and(|p| p.their_landing.is_some())
    }

    fn send_direct(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        offset: usize,
        progress: &mut SendProgress,
    ) -> Result<bool> {
        const OP: &str = "send (direct)";
        if self.finished {
            return Err(self.finished_err(OP));
        }
        if let Some(e) = self.peer_err(peer, OP) {
            return Err(e);
        }
        let rank = self.rank;
        let len = hdr.len as usize;
        let Some((base, lkey, layout)) = self
            .direct
            .as_ref()
            .map(|d| (d.mr.addr, d.mr.lkey, d.layout))
        else {
            return Err(Error::invalid(
                Some(rank),
                OP,
                "no direct region at this rank",
            ));
        };
        let Some((landing, lrkey, their_sb)) = self.peer_ref(peer, OP)?.their_landing else {
            return Err(Error::invalid(
                Some(rank),
                OP,
                format!("rank {peer} has no direct region"),
            ));
        };
        if len == 0 || len > their_sb || offset.checked_add(len).is_none_or(|e| e > layout.len()) {
            return Err(Error::invalid(
                Some(rank),
                OP,
                format!(
                    "a {len}-byte payload at offset {offset} does not fit (rank {peer}'s landing \
                     slots hold {their_sb} bytes; this rank's region is {} bytes)",
                    layout.len()
                ),
            ));
        }
        let Some(c) = self.claim(peer, hdr, HEADER_LEN, 2, OP)? else {
            return Ok(false);
        };
        let (seq, slot, raddr, rkey) = (c.seq, c.slot, c.raddr, c.rkey);
        let p = self.peer_mut(peer, OP)?;
        let mut payload = [ffi::ibv_sge {
            addr: base + offset as u64,
            length: len as u32,
            lkey,
        }];
        let idx = p.sq.post(false);
        // SAFETY: the payload lies inside this rank's registered direct region (checked
        // above) and the engine leaves it unchanged until `direct_send_done` says the
        // signalled write below — which follows this one on the same queue — completed; the
        // remote range is landing slot `slot` for this rank in the peer's region (frame
        // `seq − n`, the previous user of that slot, was released: CTS `seq` proves it).
        let r = unsafe {
            p.qp.post_write(
                wr_id(peer, WrKind::Data, idx),
                &mut payload,
                landing + (slot * their_sb) as u64,
                lrkey,
                false,
            )
        };
        if let Err(e) = r {
            return Err(p.fail_verb(rank, peer, format!("{} (direct payload)", e.verb), &e));
        }
        let mut head = [ffi::ibv_sge {
            addr: c.header_addr,
            length: HEADER_LEN as u32,
            lkey: p.local_mr.lkey,
        }];
        let idx = p.sq.post(true);
        let imm = Imm::Direct {
            seq: (seq & 0xf) as u8,
            len: (HEADER_LEN + len) as u32,
        }
        .encode();
        // SAFETY: the header is in the staging slot inside `local_mr`, untouched until CTS
        // `seq + n`; the remote range is the advertised receive slot.
        let r = unsafe {
            p.qp.post_write_imm(
                wr_id(peer, WrKind::Data, idx),
                &mut head,
                raddr,
                rkey,
                imm,
                true,
            )
        };
        if let Err(e) = r {
            return Err(p.fail_verb(rank, peer, format!("{} (direct frame)", e.verb), &e));
        }
        p.send.sent += 1;
        progress.written = HEADER_LEN + len;
        progress.token = idx + 1;
        Ok(true)
    }

    fn direct_send_done(&mut self, peer: usize, token: u64) -> Result<bool> {
        self.retired(peer, token, "send (direct)")
    }

    fn recv_direct(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<Option<Landed>> {
        const OP: &str = "receive (direct)";
        let Some((slot, _len, is_direct, hdr)) = self.next_header(peer, OP)? else {
            return Ok(None);
        };
        let expected = sink.on_header(&hdr)?;
        if !is_direct && hdr.len > 0 {
            return Err(direct_mismatch(self.rank, peer, false));
        }
        if expected != hdr.len as usize {
            let w = format!("frame of {} bytes where {expected} were expected", hdr.len);
            return Err(self.protocol_error(peer, w));
        }
        let layout = self.direct.as_ref().map(|d| d.layout);
        let p = self.peer_mut(peer, OP)?;
        let frame = p.recv.taken;
        p.recv.taken += 1;
        let landed = match layout {
            Some(l) if is_direct => {
                p.held.push_back(frame);
                Landed {
                    offset: l.landing(peer, slot),
                    len: expected,
                }
            }
            _ => Landed { offset: 0, len: 0 },
        };
        progress.header = None;
        progress.expected = expected;
        progress.got = expected;
        self.settle(peer, OP)?;
        Ok(Some(landed))
    }

    fn release_direct(&mut self, peer: usize) -> Result<()> {
        const OP: &str = "release (direct)";
        let rank = self.rank;
        let p = self.peer_mut(peer, OP)?;
        if p.held.pop_front().is_none() {
            return Err(Error::invalid(
                Some(rank),
                OP,
                format!("no landing slot from rank {peer} is held"),
            ));
        }
        self.settle(peer, OP)
    }

    fn wait(&mut self, _interest: &[Interest], deadline: Instant) -> Result<()> {
        if self.progress()? > 0 {
            return Ok(());
        }
        let spin_until = Instant::now() + self.opts.spin;
        while Instant::now() < spin_until.min(deadline) {
            if self.progress()? > 0 {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        if let Err(e) = self.cq.arm() {
            return Err(Error::Transport {
                rank: Some(self.rank),
                peer: None,
                op: e.verb.into(),
                what: e.err.to_string(),
            });
        }
        // A completion that raced with arming is polled here; the channel catches the rest.
        if self.progress()? > 0 {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(());
        }
        // Wake up at least every 100 ms: robustness against a missed event costs nothing.
        let ms = (deadline - now).as_micros().div_ceil(1000).min(100) as i32;
        let cq_fd = self.cq.fd();
        let mut watched = Vec::with_capacity(self.world);
        {
            // SAFETY: the channel's descriptor stays open while `self.cq` lives, which
            // outlives this poll.
            let cq_bfd = unsafe { std::os::fd::BorrowedFd::borrow_raw(cq_fd) };
            let mut fds = vec![PollFd::new(cq_bfd, PollFlags::POLLIN)];
            for (i, p) in self.peers.iter().enumerate() {
                let Some(p) = p else { continue };
                if let (true, Some(s)) = (p.is_open(), &p.stream) {
                    watched.push(i);
                    fds.push(PollFd::new(s.as_fd(), PollFlags::POLLIN | super::rdhup()));
                }
            }
            let timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
            match nix::poll::poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(Error::io(Some(self.rank), None, "poll", io::Error::from(e))),
            }
            // Only the liveness connections that poll flagged need a look (one read each):
            // the others have nothing new, and reading them all costs O(world) per wait.
            let flagged: Vec<usize> = fds[1..]
                .iter()
                .zip(&watched)
                // nix cannot name POLLRDHUP, so `revents()` is None exactly when it is set.
                .filter(|(fd, _)| fd.revents().is_none_or(|r| !r.is_empty()))
                .map(|(_, &i)| i)
                .collect();
            watched = flagged;
        }
        self.cq.drain_events();
        self.progress()?;
        // A flagged liveness connection that reads as closed means its process is gone.
        for i in watched {
            self.examine(i)?;
        }
        Ok(())
    }

    fn check_peers(&mut self) -> Result<()> {
        self.progress()?;
        for i in 0..self.peers.len() {
            if let Some(p) = &self.peers[i] {
                if let PeerState::Failed(e) = &p.state {
                    return Err(e.clone());
                }
            }
            self.examine(i)?;
        }
        Ok(())
    }

    fn abort(&mut self, origin: usize, class: AbortClass, reason: &str) {
        if self.finished {
            return;
        }
        let hdr = FrameHeader::abort(origin, 0, class);
        self.farewell(&hdr, reason.as_bytes());
        self.finished = true;
        for p in self.peers.iter_mut().flatten() {
            if let Err(e) = p.qp.to_err() {
                tracing::debug!(qpn = p.qp.qpn, error = %e, "moving a queue pair to ERR failed");
            }
            if let Some(s) = &p.stream {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        // Collect the flushed completions so that nothing is left in flight.
        let _ = self.progress();
    }

    fn close(&mut self) {
        if self.finished {
            return;
        }
        self.farewell(&FrameHeader::bye(), &[]);
        self.finished = true;
        for p in self.peers.iter_mut().flatten() {
            if let Err(e) = p.qp.to_err() {
                tracing::debug!(qpn = p.qp.qpn, error = %e, "moving a queue pair to ERR failed");
            }
            if let Some(s) = &p.stream {
                let _ = s.shutdown(std::net::Shutdown::Write);
            }
        }
        let _ = self.progress();
    }

    fn register_host(&mut self, region: &[u8]) -> Result<Option<u64>> {
        if region.is_empty() {
            return Ok(None);
        }
        // SAFETY: registration only pins and maps the pages for the NIC's reads; the contract
        // that the caller deregisters before freeing the buffer is documented on the trait.
        let id =
            unsafe { self.register_raw(MemoryKind::Host, region.as_ptr() as u64, region.len())? };
        Ok(Some(id))
    }

    fn deregister(&mut self, id: u64) {
        self.user_mrs.retain(|m| m.id != id);
    }
}

/// What the transport negotiation decided.
#[derive(Debug)]
pub enum Selected {
    /// Verbs on every rank.
    Verbs(Box<VerbsTransport>),
    /// TCP on every rank, over these streams; `reason` says why not verbs (when there were
    /// peers to reach and verbs was not ruled out by `DSPARK_TRANSPORT=tcp`).
    Tcp {
        /// The bootstrap's data connections.
        streams: Vec<Option<TcpStream>>,
        /// Why verbs is not used.
        reason: Option<String>,
    },
}

fn mode_code(c: TransportChoice) -> u8 {
    match c {
        TransportChoice::Auto => 0,
        TransportChoice::Tcp => 1,
        TransportChoice::Verbs => 2,
    }
}

fn unavailable(reason: &str) -> Error {
    Error::unavailable("the verbs transport (DSPARK_TRANSPORT=verbs)", reason)
}

/// Agrees with every other rank on the transport, through the bootstrap (see
/// [`crate::comm::Communicator::init`]): verbs when every rank has a usable port and no rank
/// asks for TCP; otherwise TCP everywhere, or — when some rank asked for verbs —
/// [`Error::Unavailable`] on every rank, naming the rank and the reason.
///
/// # Errors
/// [`Error::Unavailable`], bootstrap errors ([`Error::Timeout`], [`Error::PeerLost`]),
/// [`Error::Config`] for bad `DSPARK_IB_*` settings.
pub fn select(
    boot: &mut Bootstrap,
    cfg: &Config,
    streams: Vec<Option<TcpStream>>,
    direct: &mut dyn FnMut(&VerbsOptions, &str) -> DirectSpec,
) -> Result<Selected> {
    let rank = cfg.rank;
    let world = cfg.world_size;
    let opts = VerbsOptions::from_lookup(cfg, |k| std::env::var(k).ok())?;
    if world == 1 {
        return match cfg.transport {
            TransportChoice::Verbs => {
                let prep = prepare(rank, world, opts, direct).map_err(|r| unavailable(&r))?;
                Ok(Selected::Verbs(Box::new(VerbsTransport::build(
                    rank,
                    world,
                    prep,
                    &[],
                    streams,
                ))))
            }
            _ => Ok(Selected::Tcp {
                streams,
                reason: None,
            }),
        };
    }
    // Round 1: requested mode + capability (+ connection information).
    let mut prep = None;
    let blob = if cfg.transport == TransportChoice::Tcp {
        Blob::Incapable {
            reason: "DSPARK_TRANSPORT=tcp".into(),
        }
    } else {
        match prepare(rank, world, opts, direct) {
            Ok(p) => {
                let b = p.blob();
                prep = Some(p);
                b
            }
            Err(reason) => Blob::Incapable { reason },
        }
    };
    let mut msg = vec![mode_code(cfg.transport)];
    msg.extend_from_slice(&blob.encode());
    let all = boot.all_gather(&msg)?;
    let mut modes = Vec::with_capacity(world);
    let mut blobs = Vec::with_capacity(world);
    for (r, m) in all.iter().enumerate() {
        let (mode, rest) = m.split_first().map_or((0, &[][..]), |(a, b)| (*a, b));
        modes.push(mode);
        blobs.push(Blob::decode(rest).unwrap_or_else(|w| Blob::Incapable {
            reason: format!("(rank {r}) {w}"),
        }));
    }
    let hosts: Vec<String> = boot.peers.iter().map(|p| p.host.clone()).collect();
    let host = |r: usize| hosts.get(r).map_or(String::new(), |h| format!(" on {h}"));
    let someone_wants_verbs = modes.contains(&mode_code(TransportChoice::Verbs));
    let mut why_not: Option<String> = None;
    for (r, b) in blobs.iter().enumerate() {
        if let Blob::Incapable { reason } = b {
            why_not = Some(format!("rank {r}{}: {reason}", host(r)));
            break;
        }
    }
    if why_not.is_none() {
        let links: Vec<(usize, LinkLayer)> = blobs
            .iter()
            .enumerate()
            .filter_map(|(r, b)| match b {
                Blob::Capable { port, .. } => Some((r, port.link)),
                Blob::Incapable { .. } => None,
            })
            .collect();
        if let Some(&(r, l)) = links.iter().find(|(_, l)| *l != links[0].1) {
            why_not = Some(format!(
                "rank 0's RDMA port is {} but rank {r}'s is {}: they cannot be connected",
                links[0].1.name(),
                l.name()
            ));
        }
    }
    if why_not.is_none() {
        // Both ends of a queue pair index the same slot ring: the slot layout must agree.
        let layout: Vec<(usize, u32, u32)> = blobs
            .iter()
            .enumerate()
            .filter_map(|(r, b)| match b {
                Blob::Capable {
                    slots, slot_bytes, ..
                } => Some((r, *slots, *slot_bytes)),
                Blob::Incapable { .. } => None,
            })
            .collect();
        if let Some(&(r, n, b)) = layout
            .iter()
            .find(|(_, n, b)| (*n, *b) != (layout[0].1, layout[0].2))
        {
            let msg = format!(
                "rank 0 uses {} slots of {} bytes per peer but rank {r}{} uses {n} of {b}: set the \
                 same DSPARK_IB_SLOTS, DSPARK_IB_SLOT_BYTES and DSPARK_CHUNK_BYTES on every rank",
                layout[0].1,
                layout[0].2,
                host(r)
            );
            return Err(Error::config("DSPARK_IB_SLOTS", msg));
        }
    }
    // Round 2 (only when round 1 found every rank capable): connect and agree it worked.
    if why_not.is_none() {
        let mut prep = prep
            .take()
            .ok_or_else(|| unavailable("internal: capable without resources"))?;
        let res = prep.connect(rank, &blobs);
        let mine = match &res {
            Ok(()) => vec![1u8],
            Err(w) => {
                let mut v = vec![0u8];
                v.extend_from_slice(w.as_bytes());
                v
            }
        };
        let all = boot.all_gather(&mine)?;
        for (r, m) in all.iter().enumerate() {
            if m.first() != Some(&1) {
                let w = String::from_utf8_lossy(m.get(1..).unwrap_or_default()).into_owned();
                why_not = Some(format!(
                    "rank {r}{}: connecting queue pairs failed: {w}",
                    host(r)
                ));
                break;
            }
        }
        if why_not.is_none() {
            let t = VerbsTransport::build(rank, world, prep, &blobs, streams);
            tracing::info!(rank, transport = %t.desc, "using RDMA verbs");
            return Ok(Selected::Verbs(Box::new(t)));
        }
    }
    let why = why_not.unwrap_or_default();
    if someone_wants_verbs {
        let who: Vec<String> = modes
            .iter()
            .enumerate()
            .filter(|(_, &m)| m == mode_code(TransportChoice::Verbs))
            .map(|(r, _)| r.to_string())
            .collect();
        return Err(unavailable(&format!(
            "{why} (DSPARK_TRANSPORT=verbs on rank(s) {})",
            who.join(", ")
        )));
    }
    let any_capable = blobs.iter().any(|b| matches!(b, Blob::Capable { .. }));
    let asked_tcp = modes.contains(&mode_code(TransportChoice::Tcp));
    if any_capable && !asked_tcp {
        // Some ranks could do RDMA but not all: the job silently runs slower. Say so.
        tracing::warn!(rank, reason = %why, "falling back to TCP on every rank: not every rank can use RDMA verbs");
    } else {
        tracing::info!(rank, reason = %why, "using TCP");
    }
    let reason = if cfg.transport == TransportChoice::Tcp
        && modes.iter().all(|&m| m == mode_code(TransportChoice::Tcp))
    {
        None
    } else {
        Some(format!("verbs unavailable: {why}"))
    };
    Ok(Selected::Tcp { streams, reason })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts_of(vars: &[(&str, &str)]) -> Result<VerbsOptions> {
        let cfg = Config::new(0, 2, "h:1");
        let m: std::collections::HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        VerbsOptions::from_lookup(&cfg, |k| m.get(k).cloned())
    }

    #[test]
    fn default_options_surface_a_dead_peer_within_seconds() {
        let o = opts_of(&[]).unwrap();
        let r = o.reliability;
        let worst_ms = timeout_ms(r.timeout) * f64::from(r.retry_cnt + 1);
        assert!(worst_ms < 5_000.0, "{worst_ms} ms");
        assert!(r.rnr_retry < 7, "RNR retry 7 means forever");
        assert_eq!(o.slot_payload, 512 * 1024);
        assert_eq!(o.slot_bytes() % 64, 0);
        assert!(o.slot_bytes() >= o.slot_payload + HEADER_LEN);
    }

    #[test]
    fn bad_tunables_name_their_variable() {
        let e = opts_of(&[("DSPARK_IB_SLOTS", "1")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("DSPARK_IB_SLOTS"), "{e}");
        let e = opts_of(&[("DSPARK_IB_SLOT_BYTES", "4K")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("DSPARK_IB_SLOT_BYTES") && e.contains("segment"),
            "{e}"
        );
        let e = opts_of(&[("DSPARK_IB_RETRY_CNT", "8")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("DSPARK_IB_RETRY_CNT"), "{e}");
        let o = opts_of(&[("DSPARK_IB_SLOTS", "4"), ("DSPARK_IB_SLOT_BYTES", "1M")]).unwrap();
        assert_eq!((o.slots, o.slot_payload), (4, 1 << 20));
    }

    #[test]
    fn device_specs_parse_with_optional_port() {
        assert_eq!(parse_device("mlx5_0").unwrap(), ("mlx5_0".into(), None));
        assert_eq!(
            parse_device("mlx5_1:2").unwrap(),
            ("mlx5_1".into(), Some(2))
        );
        assert!(parse_device("mlx5_0:0").is_err());
        assert!(parse_device(":1").is_err());
    }

    #[test]
    fn too_small_memlock_limit_is_reported_with_the_fix() {
        let w = memlock_shortfall(Some(64 * 1024), 9 << 20, false).unwrap();
        assert!(
            w.contains("RLIMIT_MEMLOCK is 64 KiB") && w.contains("ulimit -l unlimited"),
            "{w}"
        );
        assert_eq!(memlock_shortfall(None, 1 << 40, false), None);
        assert_eq!(memlock_shortfall(Some(1 << 30), 9 << 20, false), None);
        assert_eq!(
            memlock_shortfall(Some(0), 9 << 20, true),
            None,
            "CAP_IPC_LOCK ignores the limit"
        );
    }

    #[test]
    fn pinned_memory_accounts_for_both_directions() {
        let o = opts_of(&[("DSPARK_IB_SLOTS", "4")]).unwrap();
        assert_eq!(
            o.pinned_per_peer(),
            2 * 4 * o.slot_bytes() + 2 * CTRL_BYTES + 2 * 4 * CTS_LEN
        );
        // Worked by hand for the default 512 KiB segment: 524288 + 32 header bytes round up
        // to 524352-byte slots; 4 slots each way (4194816) + two 4 KiB control slots (8192)
        // + 4 CTS entries of 32 bytes each way (256).
        assert_eq!(o.slot_bytes(), 524_352);
        assert_eq!(o.pinned_per_peer(), 4_203_264);
    }

    #[test]
    fn gids_print_as_addresses() {
        let g = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 1];
        assert!(is_ipv4_mapped(&g));
        assert_eq!(gid_string(&g), "::ffff:10.77.0.1");
        let ib = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 2, 0xc9, 3, 0, 1, 2, 3];
        assert!(!is_ipv4_mapped(&ib));
        assert_eq!(gid_string(&ib), "fe80::2:c903:1:203");
    }

    #[test]
    fn missing_library_or_device_is_a_reason_not_a_panic() {
        // On machines without rdma-core this is the "cannot load" path; with it, the device
        // probe runs. Either way: a sentence, never a panic.
        let cfg = Config::new(0, 2, "h:1");
        let o = VerbsOptions::from_lookup(&cfg, |_| None).unwrap();
        if let Err(reason) = prepare(0, 2, o, &mut |_, _| DirectSpec::None) {
            assert!(!reason.is_empty());
        }
    }
}
