//! Path truth: the data path of every connection, in each direction, as a typed fact.
//!
//! A [`DataPath`] says which transport carries the bytes ([`TransportKind`]), how they get
//! between the user's buffer and the NIC ([`MemoryPath`]) and, when that is not the fast way,
//! why. [`decide`] is the one place where the path is chosen: a pure function of the requested
//! [`PathPolicy`] (`DSPARK_DATA_PATH`), the transport, where the buffers live and every rank's
//! GPUDirect capability. Asking for gpu-direct where it cannot be had is an
//! [`Error::Unavailable`] naming the rank and the reason — never a silent fallback — and `auto`
//! falls back to staging with a warning that names them too.
//!
//! [`gpu_direct_capability`] turns one GPU/NIC pair's probed facts (see [`crate::gpu::probe`]
//! and [`crate::gpu::sysfs`]) into the capability a rank announces.
//!
//! No I/O, no clock, no `unsafe` here.
//!
//! ```
//! use dspark::path::{decide, BufferLocation, GpuDirectCapability, PathInputs, PathPolicy, TransportKind};
//!
//! // Rank 1 has no GPUDirect: `auto` stages the connection and says why, naming the rank.
//! let caps = [GpuDirectCapability::DmaBuf, GpuDirectCapability::Unavailable("nvidia-peermem not loaded".into())];
//! let auto = PathInputs {
//!     policy: PathPolicy::Auto,
//!     rank: 0,
//!     peers: &[1],
//!     transport: TransportKind::Verbs,
//!     buffers: BufferLocation::Device,
//!     capabilities: &caps,
//! };
//! let plan = decide(&auto).unwrap();
//! assert_eq!(plan.column(), "verbs/staged");
//! assert!(plan.warnings[0].contains("rank 1") && plan.warnings[0].contains("nvidia-peermem"));
//! println!("{:#}", plan.connections[0]);
//!
//! // Asking for gpu-direct instead is an error at init, with the same facts.
//! let err = decide(&PathInputs { policy: PathPolicy::GpuDirect, ..auto }).unwrap_err();
//! assert!(err.to_string().contains("rank 1: nvidia-peermem not loaded"));
//! ```

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The environment variable holding the [`PathPolicy`].
pub const DATA_PATH_ENV: &str = "DSPARK_DATA_PATH";

/// Reason given for device memory over TCP.
pub const TCP_STAGED_REASON: &str =
    "TCP transport: device memory is staged through pinned host memory";

/// Reason given for device memory over the shared-memory transport.
pub const SHM_STAGED_REASON: &str =
    "shm transport: device memory is staged through host memory (CUDA IPC between the GPUs \
     of one host is not implemented)";

/// Reason given for device memory over a mixed communicator (shm within hosts, TCP between
/// them), when it is not split per connection.
pub const SHM_TCP_STAGED_REASON: &str =
    "shm+tcp transports: device memory is staged through host memory on every connection";

/// Reason given for device memory over the in-process transport.
pub const MEM_STAGED_REASON: &str =
    "in-process mem transport: device memory is staged through host memory";

/// Reason given when the user asked for staging.
pub const REQUESTED_STAGED_REASON: &str = "DSPARK_DATA_PATH=host-staged was requested";

pub use crate::transport::TransportKind;

/// How bytes get between the user's buffer and the wire.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryPath {
    /// The buffer is host memory; the transport reads and writes it directly.
    #[cfg_attr(feature = "cli", serde(rename = "host"))]
    HostMemory,
    /// GPUDirect RDMA: device memory registered with the NIC through a dma-buf.
    #[cfg_attr(feature = "cli", serde(rename = "gdr-dmabuf"))]
    GpuDirectDmaBuf,
    /// GPUDirect RDMA: device memory registered through nvidia-peermem.
    #[cfg_attr(feature = "cli", serde(rename = "gdr-peermem"))]
    GpuDirectPeerMem,
    /// Device memory copied through pinned host buffers (GPU → host → wire → host → GPU).
    #[cfg_attr(feature = "cli", serde(rename = "staged"))]
    HostStaged,
}

impl MemoryPath {
    /// Column text for the bench: `host`, `gdr-dmabuf`, `gdr-peermem`, `staged`.
    pub const fn short(self) -> &'static str {
        match self {
            MemoryPath::HostMemory => "host",
            MemoryPath::GpuDirectDmaBuf => "gdr-dmabuf",
            MemoryPath::GpuDirectPeerMem => "gdr-peermem",
            MemoryPath::HostStaged => "staged",
        }
    }

    /// A phrase for humans.
    pub const fn long(self) -> &'static str {
        match self {
            MemoryPath::HostMemory => "host memory",
            MemoryPath::GpuDirectDmaBuf => "GPUDirect RDMA via dma-buf",
            MemoryPath::GpuDirectPeerMem => "GPUDirect RDMA via nvidia-peermem",
            MemoryPath::HostStaged => {
                "host-staged (device memory copied through pinned host memory)"
            }
        }
    }

    /// Whether the NIC reads and writes device memory directly.
    pub const fn is_gpu_direct(self) -> bool {
        matches!(
            self,
            MemoryPath::GpuDirectDmaBuf | MemoryPath::GpuDirectPeerMem
        )
    }
}

impl fmt::Display for MemoryPath {
    /// `{}` gives the short column text, `{:#}` the long phrase.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            f.write_str(self.long())
        } else {
            f.write_str(self.short())
        }
    }
}

/// The data path of one direction of one connection.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DataPath {
    /// The transport.
    pub transport: TransportKind,
    /// The memory path at this rank's end.
    pub memory: MemoryPath,
    /// Why this is not the fast path (set for host-staged device memory), or a note.
    pub reason: Option<String>,
}

impl DataPath {
    /// Short text for a bench column: `verbs/gdr-dmabuf`, `tcp/staged`, `tcp/host`.
    pub fn short(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for DataPath {
    /// `{}`: the short text; `{:#}`: `verbs, host-staged (...): <reason>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            write!(f, "{}, {:#}", self.transport, self.memory)?;
            if let Some(r) = &self.reason {
                write!(f, ": {r}")?;
            }
            Ok(())
        } else {
            write!(f, "{}/{}", self.transport, self.memory)
        }
    }
}

/// Both directions of this rank's connection to `peer`.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConnectionPath {
    /// The peer rank.
    pub peer: usize,
    /// Data this rank sends to `peer`.
    pub send: DataPath,
    /// Data this rank receives from `peer`.
    pub recv: DataPath,
}

impl fmt::Display for ConnectionPath {
    /// `{}`: `rank 1: send verbs/gdr-dmabuf, recv verbs/gdr-dmabuf`; `{:#}` adds the reasons.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            write!(
                f,
                "rank {}: send {:#}; recv {:#}",
                self.peer, self.send, self.recv
            )
        } else {
            write!(
                f,
                "rank {}: send {}, recv {}",
                self.peer, self.send, self.recv
            )
        }
    }
}

/// `DSPARK_DATA_PATH`: which memory path device buffers should take.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "cli", serde(rename_all = "kebab-case"))]
pub enum PathPolicy {
    /// GPUDirect when every rank can, host-staged (with a warning naming who cannot) otherwise.
    #[default]
    Auto,
    /// GPUDirect on every connection, or an error at init naming why not.
    GpuDirect,
    /// Always stage device memory through host memory.
    HostStaged,
}

impl PathPolicy {
    /// `auto`, `gpu-direct`, `host-staged`.
    pub const fn name(self) -> &'static str {
        match self {
            PathPolicy::Auto => "auto",
            PathPolicy::GpuDirect => "gpu-direct",
            PathPolicy::HostStaged => "host-staged",
        }
    }

    /// Reads [`DATA_PATH_ENV`] through `env` (unset or empty: `auto`).
    pub fn from_env_with(env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        match env(DATA_PATH_ENV) {
            Some(v) if !v.trim().is_empty() => v.parse(),
            _ => Ok(PathPolicy::Auto),
        }
    }
}

impl fmt::Display for PathPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PathPolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "auto" => Ok(PathPolicy::Auto),
            "gpu-direct" | "gpudirect" | "gdr" => Ok(PathPolicy::GpuDirect),
            "host-staged" | "staged" => Ok(PathPolicy::HostStaged),
            _ => Err(Error::config(
                DATA_PATH_ENV,
                format!("{s:?} is not a data path (expected auto, gpu-direct or host-staged)"),
            )),
        }
    }
}

/// What one rank can do with its device memory and its NIC.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "cli",
    serde(rename_all = "kebab-case", tag = "kind", content = "reason")
)]
pub enum GpuDirectCapability {
    /// GPUDirect RDMA through dma-buf (preferred).
    DmaBuf,
    /// GPUDirect RDMA through nvidia-peermem.
    PeerMem,
    /// No GPUDirect RDMA, and why.
    Unavailable(String),
}

impl GpuDirectCapability {
    /// The memory path this capability gives, if it is a GPUDirect one.
    pub fn memory_path(&self) -> Option<MemoryPath> {
        match self {
            GpuDirectCapability::DmaBuf => Some(MemoryPath::GpuDirectDmaBuf),
            GpuDirectCapability::PeerMem => Some(MemoryPath::GpuDirectPeerMem),
            GpuDirectCapability::Unavailable(_) => None,
        }
    }
}

/// Where the collective's buffers live.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "cli", serde(rename_all = "lowercase"))]
pub enum BufferLocation {
    /// Host memory.
    Host,
    /// GPU memory.
    Device,
}

/// Everything [`decide`] needs.
#[derive(Clone, Copy, Debug)]
pub struct PathInputs<'a> {
    /// The requested policy.
    pub policy: PathPolicy,
    /// This rank.
    pub rank: usize,
    /// The ranks this rank is connected to.
    pub peers: &'a [usize],
    /// The transport chosen for the connections.
    pub transport: TransportKind,
    /// Where the buffers live.
    pub buffers: BufferLocation,
    /// Every rank's capability, indexed by rank.
    pub capabilities: &'a [GpuDirectCapability],
}

/// The decision for one rank.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathPlan {
    /// One entry per peer, in the order given.
    pub connections: Vec<ConnectionPath>,
    /// Fallbacks that `auto` made, one line per rank that lacks GPUDirect (to log as warnings).
    pub warnings: Vec<String>,
}

impl PathPlan {
    /// Text for a bench column: the common short path (`verbs/gdr-dmabuf`), or `mixed` when
    /// connections or directions differ (the header then lists them), or `-` with none.
    pub fn column(&self) -> String {
        let mut all = self
            .connections
            .iter()
            .flat_map(|c| [&c.send, &c.recv])
            .map(|p| p.short());
        match all.next() {
            None => "-".to_string(),
            Some(first) => {
                if all.all(|p| p == first) {
                    first
                } else {
                    "mixed".to_string()
                }
            }
        }
    }
}

fn staged(transport: TransportKind, reason: impl Into<String>) -> DataPath {
    DataPath {
        transport,
        memory: MemoryPath::HostStaged,
        reason: Some(reason.into()),
    }
}

fn symmetric(peer: usize, path: DataPath) -> ConnectionPath {
    ConnectionPath {
        peer,
        send: path.clone(),
        recv: path,
    }
}

/// `path` both ways on the connection to every one of `peers`.
fn all_symmetric(peers: &[usize], path: &DataPath) -> Vec<ConnectionPath> {
    peers.iter().map(|&q| symmetric(q, path.clone())).collect()
}

/// Whether device payloads move with GPUDirect RDMA under `policy`: over verbs, unless staging
/// was asked for, when every rank can (the job-wide rule of [`decide`], without building its
/// report — cheap enough for every call).
pub fn uses_gpu_direct(
    policy: PathPolicy,
    transport: TransportKind,
    capabilities: &[GpuDirectCapability],
) -> bool {
    transport == TransportKind::Verbs
        && policy != PathPolicy::HostStaged
        && !capabilities.is_empty()
        && capabilities.iter().all(|c| c.memory_path().is_some())
}

/// Decides the data path of every connection of `inputs.rank` (pure).
///
/// - Host buffers: `host` memory on every transport, whatever the policy.
/// - Device buffers over TCP or `mem`: always host-staged, with the reason; `gpu-direct` is an
///   error.
/// - Device buffers over verbs: `host-staged` stages everywhere; `auto` and `gpu-direct` use
///   GPUDirect on every connection when *every rank* can (each with its own mechanism, dma-buf
///   preferred — the path reported is this rank's): one job-wide decision, because a direct
///   payload cannot land in a rank's host slots. Otherwise `auto` stages every connection and
///   warns, naming the rank(s) and reason(s), and `gpu-direct` fails with
///   [`Error::Unavailable`] naming every rank that cannot.
pub fn decide(inputs: &PathInputs<'_>) -> Result<PathPlan> {
    let PathInputs {
        policy,
        rank,
        peers,
        transport,
        buffers,
        capabilities,
    } = *inputs;
    let cap = |r: usize| -> Result<&GpuDirectCapability> {
        capabilities.get(r).ok_or_else(|| {
            Error::invalid(
                Some(rank),
                "data path",
                format!("no GPUDirect capability known for rank {r}"),
            )
        })
    };
    if buffers == BufferLocation::Host {
        let p = DataPath {
            transport,
            memory: MemoryPath::HostMemory,
            reason: None,
        };
        return Ok(PathPlan {
            connections: all_symmetric(peers, &p),
            warnings: vec![],
        });
    }
    let forced = |reason: &str| {
        Error::unavailable(
            format!("GPUDirect RDMA ({DATA_PATH_ENV}=gpu-direct) at rank {rank}"),
            reason.to_string(),
        )
    };
    match transport {
        TransportKind::Tcp | TransportKind::Mem | TransportKind::Shm | TransportKind::ShmTcp => {
            let reason = match transport {
                TransportKind::Tcp => TCP_STAGED_REASON,
                TransportKind::Shm => SHM_STAGED_REASON,
                TransportKind::ShmTcp => SHM_TCP_STAGED_REASON,
                _ => MEM_STAGED_REASON,
            };
            if policy == PathPolicy::GpuDirect {
                return Err(forced(&format!(
                    "{reason}; GPUDirect RDMA needs the verbs transport (DSPARK_TRANSPORT=verbs)"
                )));
            }
            let p = staged(transport, reason);
            Ok(PathPlan {
                connections: all_symmetric(peers, &p),
                warnings: vec![],
            })
        }
        TransportKind::Verbs => {
            if policy == PathPolicy::HostStaged {
                let p = staged(transport, REQUESTED_STAGED_REASON);
                return Ok(PathPlan {
                    connections: all_symmetric(peers, &p),
                    warnings: vec![],
                });
            }
            let mine = cap(rank)?;
            for &q in peers {
                cap(q)?;
            }
            // Every rank must agree on how device payloads travel (a direct frame cannot be
            // received into host slots), so GPUDirect is used only when every rank can.
            let lacking: Vec<(usize, String)> = capabilities
                .iter()
                .enumerate()
                .filter_map(|(r, c)| match c {
                    GpuDirectCapability::Unavailable(why) => Some((r, why.clone())),
                    _ => None,
                })
                .collect();
            let everywhere = uses_gpu_direct(policy, transport, capabilities);
            // `rank r: why; ...` for every rank that cannot (empty when all can).
            let why = lacking
                .iter()
                .map(|(r, w)| format!("rank {r}: {w}"))
                .collect::<Vec<_>>()
                .join("; ");
            if policy == PathPolicy::GpuDirect && !lacking.is_empty() {
                return Err(forced(&format!(
                    "GPUDirect RDMA cannot be used on every connection of rank {rank}: {why} \
                     (set {DATA_PATH_ENV}=auto to stage those connections instead)"
                )));
            }
            let connections = match mine.memory_path() {
                Some(m) if everywhere => all_symmetric(
                    peers,
                    &DataPath {
                        transport,
                        memory: m,
                        reason: None,
                    },
                ),
                _ => all_symmetric(
                    peers,
                    &staged(
                        transport,
                        format!(
                            "GPUDirect RDMA unavailable (it is used only when every rank can): \
                             {why}"
                        ),
                    ),
                ),
            };
            let warnings = lacking
                .iter()
                .map(|(r, why)| {
                    let whose = if *r == rank { "this rank".to_string() } else { format!("rank {r}") };
                    format!(
                        "rank {rank}: GPUDirect RDMA unavailable at {whose} ({why}); its connections \
                         with rank {rank} are host-staged, which is typically several times slower \
                         at gradient-bucket sizes"
                    )
                })
                .collect();
            Ok(PathPlan {
                connections,
                warnings,
            })
        }
    }
}

/// The facts about one GPU/NIC pair that decide its GPUDirect capability (all probed elsewhere).
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuNicFacts {
    /// `Err(reason)` when the NIC cannot be used at all (no libibverbs, port down, ...).
    pub nic_usable: std::result::Result<(), String>,
    /// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (`None`: unknown, e.g. driver too old).
    pub gpu_dma_buf: Option<bool>,
    /// Whether the NIC/kernel accept dma-buf registrations (the `ibv_reg_dmabuf_mr(fd=-1)`
    /// probe: `None` when not probed).
    pub nic_dma_buf: Option<bool>,
    /// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (`None`: unknown).
    pub gpu_rdma: Option<bool>,
    /// nvidia-peermem is loaded (NCCL's sysfs check).
    pub peermem_loaded: bool,
    /// PCIe distance GPU↔NIC, NCCL-style short name and rank (`None`: unknown).
    pub distance: Option<crate::gpu::sysfs::PcieDistance>,
    /// The farthest distance at which GPUDirect is used (NCCL's default is PXB: beyond it,
    /// traffic crosses the CPU and GPUDirect is usually slower than staging).
    pub max_distance: crate::gpu::sysfs::PcieDistance,
}

/// The farthest GPU↔NIC distance at which GPUDirect is used by default (NCCL's default
/// too): beyond it, traffic crosses the CPU and GPUDirect is usually slower than staging.
pub const GDR_MAX_DISTANCE: crate::gpu::sysfs::PcieDistance = crate::gpu::sysfs::PcieDistance::Pxb;

/// Why a GPU and a NIC `d` apart should not use GPUDirect (`None` within `max`). The same
/// rule for the doctor's pairs and for the region a communicator sets up.
pub fn distance_blocker(
    d: crate::gpu::sysfs::PcieDistance,
    max: crate::gpu::sysfs::PcieDistance,
) -> Option<String> {
    (d > max).then(|| {
        format!(
            "GPU and NIC are {} apart ({}), beyond {}: GPUDirect would cross the CPU and is \
             usually slower than staging",
            d.short(),
            d.describe(),
            max.short()
        )
    })
}

/// One pair's GPUDirect capability from its facts (pure): the NIC must be usable and close
/// enough; then dma-buf when the GPU supports it and the NIC is not known to refuse it, else
/// nvidia-peermem when loaded and the GPU does not refuse GPUDirect RDMA; otherwise unavailable,
/// with every reason.
pub fn gpu_direct_capability(f: &GpuNicFacts) -> GpuDirectCapability {
    if let Err(why) = &f.nic_usable {
        return GpuDirectCapability::Unavailable(why.clone());
    }
    if let Some(why) = f.distance.and_then(|d| distance_blocker(d, f.max_distance)) {
        return GpuDirectCapability::Unavailable(why);
    }
    let dma_buf_why = match (f.gpu_dma_buf, f.nic_dma_buf) {
        (Some(true), Some(false)) => {
            Some("the NIC/kernel refuse dma-buf registration (ibv_reg_dmabuf_mr unsupported)")
        }
        (Some(true), _) => None,
        (Some(false), _) => Some(
            "the GPU/driver report no dma-buf support (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0)",
        ),
        (None, _) => {
            Some("the driver does not know CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (driver too old)")
        }
    };
    let Some(dma_buf_why) = dma_buf_why else {
        return GpuDirectCapability::DmaBuf;
    };
    let peermem_why = if !f.peermem_loaded {
        Some("nvidia-peermem is not loaded (none of /sys/kernel/mm/memory_peers/nv_mem/version, .../nv_mem_nc/version, /sys/module/nvidia_peermem/version exist)")
    } else if f.gpu_rdma == Some(false) {
        Some("the GPU reports no GPUDirect RDMA support (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED=0)")
    } else {
        None
    };
    match peermem_why {
        None => GpuDirectCapability::PeerMem,
        Some(p) => {
            GpuDirectCapability::Unavailable(format!("dma-buf: {dma_buf_why}; peermem: {p}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::sysfs::PcieDistance;

    fn caps_all() -> Vec<GpuDirectCapability> {
        vec![
            GpuDirectCapability::DmaBuf,
            GpuDirectCapability::PeerMem,
            GpuDirectCapability::Unavailable("nvidia-peermem not loaded".into()),
        ]
    }

    fn inputs<'a>(
        policy: PathPolicy,
        rank: usize,
        peers: &'a [usize],
        transport: TransportKind,
        buffers: BufferLocation,
        capabilities: &'a [GpuDirectCapability],
    ) -> PathInputs<'a> {
        PathInputs {
            policy,
            rank,
            peers,
            transport,
            buffers,
            capabilities,
        }
    }

    #[test]
    fn gpudirect_stops_at_pxb_like_nccl() {
        use PcieDistance::*;
        for d in [Same, Pix, Pxb] {
            assert_eq!(distance_blocker(d, GDR_MAX_DISTANCE), None, "{d:?}");
        }
        for (d, name) in [(Phb, "PHB"), (Sys, "SYS")] {
            let why = distance_blocker(d, GDR_MAX_DISTANCE).expect("blocked");
            assert!(why.contains(name) && why.contains("beyond PXB"), "{why}");
        }
    }

    #[test]
    fn policy_parses_from_its_names_and_errors_name_the_variable() {
        assert_eq!("auto".parse::<PathPolicy>().unwrap(), PathPolicy::Auto);
        assert_eq!(
            "gpu-direct".parse::<PathPolicy>().unwrap(),
            PathPolicy::GpuDirect
        );
        assert_eq!(
            " Host_Staged ".parse::<PathPolicy>().unwrap(),
            PathPolicy::HostStaged
        );
        let e = "fast".parse::<PathPolicy>().unwrap_err();
        assert!(
            e.to_string().contains("DSPARK_DATA_PATH") && e.to_string().contains("fast"),
            "{e}"
        );
        for p in [
            PathPolicy::Auto,
            PathPolicy::GpuDirect,
            PathPolicy::HostStaged,
        ] {
            assert_eq!(p.to_string().parse::<PathPolicy>().unwrap(), p);
        }
        assert_eq!(
            PathPolicy::from_env_with(|_| None).unwrap(),
            PathPolicy::Auto
        );
        assert_eq!(
            PathPolicy::from_env_with(|_| Some(String::new())).unwrap(),
            PathPolicy::Auto
        );
        assert_eq!(
            PathPolicy::from_env_with(|_| Some("host-staged".into())).unwrap(),
            PathPolicy::HostStaged
        );
        assert!(PathPolicy::from_env_with(|_| Some("x".into())).is_err());
    }

    #[test]
    fn short_and_long_texts() {
        assert_eq!(MemoryPath::HostMemory.to_string(), "host");
        assert_eq!(MemoryPath::GpuDirectDmaBuf.to_string(), "gdr-dmabuf");
        assert_eq!(MemoryPath::GpuDirectPeerMem.to_string(), "gdr-peermem");
        assert_eq!(MemoryPath::HostStaged.to_string(), "staged");
        assert!(format!("{:#}", MemoryPath::HostStaged).starts_with("host-staged"));
        let p = staged(TransportKind::Tcp, TCP_STAGED_REASON);
        assert_eq!(p.to_string(), "tcp/staged");
        assert_eq!(p.short(), "tcp/staged");
        let long = format!("{p:#}");
        assert!(
            long.contains("host-staged") && long.contains(TCP_STAGED_REASON),
            "{long}"
        );
        let c = symmetric(3, p);
        assert_eq!(c.to_string(), "rank 3: send tcp/staged, recv tcp/staged");
        assert!(format!("{c:#}").contains("pinned host memory"));
    }

    #[test]
    fn host_buffers_use_host_memory_on_every_transport_and_policy() {
        let caps = caps_all();
        for t in [TransportKind::Tcp, TransportKind::Verbs, TransportKind::Mem] {
            for pol in [
                PathPolicy::Auto,
                PathPolicy::GpuDirect,
                PathPolicy::HostStaged,
            ] {
                let plan =
                    decide(&inputs(pol, 0, &[1, 2], t, BufferLocation::Host, &caps)).unwrap();
                assert_eq!(plan.connections.len(), 2);
                for c in &plan.connections {
                    assert_eq!(c.send.memory, MemoryPath::HostMemory);
                    assert_eq!(c.recv.memory, MemoryPath::HostMemory);
                    assert_eq!(c.send.reason, None);
                    assert_eq!(c.send.transport, t);
                }
                assert!(plan.warnings.is_empty());
            }
        }
    }

    #[test]
    fn device_buffers_over_tcp_are_always_staged_and_gpu_direct_is_refused() {
        let caps = vec![GpuDirectCapability::DmaBuf; 2];
        for pol in [PathPolicy::Auto, PathPolicy::HostStaged] {
            let plan = decide(&inputs(
                pol,
                0,
                &[1],
                TransportKind::Tcp,
                BufferLocation::Device,
                &caps,
            ))
            .unwrap();
            assert_eq!(plan.connections[0].send.memory, MemoryPath::HostStaged);
            assert_eq!(
                plan.connections[0].recv.reason.as_deref(),
                Some(TCP_STAGED_REASON)
            );
            assert_eq!(plan.column(), "tcp/staged");
        }
        let e = decide(&inputs(
            PathPolicy::GpuDirect,
            1,
            &[0],
            TransportKind::Tcp,
            BufferLocation::Device,
            &caps,
        ))
        .unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, Error::Unavailable { .. }));
        assert!(
            s.contains("rank 1") && s.contains("TCP transport") && s.contains("DSPARK_DATA_PATH"),
            "{s}"
        );
        let e = decide(&inputs(
            PathPolicy::GpuDirect,
            0,
            &[1],
            TransportKind::Mem,
            BufferLocation::Device,
            &caps,
        ))
        .unwrap_err();
        assert!(e.to_string().contains("mem transport"), "{e}");
    }

    /// Every combination of (my capability, peer capability) × policy over verbs.
    #[test]
    fn verbs_paths_for_every_capability_pair_and_policy() {
        let kinds = caps_all();
        for mine in &kinds {
            for theirs in &kinds {
                let caps = vec![mine.clone(), theirs.clone()];
                let both = mine.memory_path().is_some() && theirs.memory_path().is_some();
                for pol in [
                    PathPolicy::Auto,
                    PathPolicy::GpuDirect,
                    PathPolicy::HostStaged,
                ] {
                    let r = decide(&inputs(
                        pol,
                        0,
                        &[1],
                        TransportKind::Verbs,
                        BufferLocation::Device,
                        &caps,
                    ));
                    match pol {
                        PathPolicy::HostStaged => {
                            let plan = r.unwrap();
                            let c = &plan.connections[0];
                            assert_eq!(c.send.memory, MemoryPath::HostStaged);
                            assert_eq!(c.send.reason.as_deref(), Some(REQUESTED_STAGED_REASON));
                            assert!(plan.warnings.is_empty());
                        }
                        _ if both => {
                            let plan = r.unwrap();
                            let c = &plan.connections[0];
                            let want = mine.memory_path().unwrap();
                            assert_eq!(
                                (c.send.memory, c.recv.memory),
                                (want, want),
                                "{mine:?} {theirs:?}"
                            );
                            assert_eq!(c.send.reason, None);
                            assert!(plan.warnings.is_empty());
                        }
                        PathPolicy::Auto => {
                            let plan = r.unwrap();
                            let c = &plan.connections[0];
                            assert_eq!(
                                c.send.memory,
                                MemoryPath::HostStaged,
                                "{mine:?} {theirs:?}"
                            );
                            assert_eq!(c.recv.memory, MemoryPath::HostStaged);
                            let reason = c.send.reason.as_deref().unwrap();
                            assert!(reason.contains("nvidia-peermem not loaded"), "{reason}");
                            assert!(!plan.warnings.is_empty());
                            for (r, cap) in [(0, mine), (1, theirs)] {
                                let named = reason.contains(&format!("rank {r}:"));
                                assert_eq!(
                                    named,
                                    cap.memory_path().is_none(),
                                    "rank {r} in {reason:?}"
                                );
                            }
                            assert_eq!(
                                plan.warnings.len(),
                                [mine, theirs]
                                    .iter()
                                    .filter(|c| c.memory_path().is_none())
                                    .count()
                            );
                        }
                        PathPolicy::GpuDirect => {
                            let e = r.unwrap_err();
                            assert!(matches!(e, Error::Unavailable { .. }));
                            let s = e.to_string();
                            assert!(
                                s.contains("nvidia-peermem not loaded") && s.contains("gpu-direct"),
                                "{s}"
                            );
                            if theirs.memory_path().is_none() {
                                assert!(s.contains("rank 1:"), "{s}");
                            }
                            if mine.memory_path().is_none() {
                                assert!(s.contains("rank 0:"), "{s}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gpu_direct_is_used_only_over_verbs_when_every_rank_can_and_staging_was_not_asked() {
        use GpuDirectCapability as C;
        let all = [C::DmaBuf, C::PeerMem, C::DmaBuf];
        let one_short = [C::DmaBuf, C::Unavailable("x".into()), C::DmaBuf];
        let v = TransportKind::Verbs;
        assert!(uses_gpu_direct(PathPolicy::Auto, v, &all));
        assert!(uses_gpu_direct(PathPolicy::GpuDirect, v, &all));
        assert!(!uses_gpu_direct(PathPolicy::HostStaged, v, &all));
        assert!(!uses_gpu_direct(PathPolicy::Auto, TransportKind::Tcp, &all));
        assert!(!uses_gpu_direct(PathPolicy::Auto, v, &one_short));
        assert!(!uses_gpu_direct(PathPolicy::Auto, v, &[]));
    }

    #[test]
    fn one_rank_without_gpu_direct_stages_every_connection_and_says_which() {
        // Ring of 4: rank 2 lacks GPUDirect. Every rank must move device payloads the same
        // way (a direct frame cannot land in host slots), so all connections are staged —
        // including rank 3's, which never talks to rank 2 — and the reason names rank 2.
        let caps = vec![
            GpuDirectCapability::DmaBuf,
            GpuDirectCapability::PeerMem,
            GpuDirectCapability::Unavailable("port down".into()),
            GpuDirectCapability::DmaBuf,
        ];
        for (rank, peers) in [(1, &[0usize, 2][..]), (3, &[0][..])] {
            let plan = decide(&inputs(
                PathPolicy::Auto,
                rank,
                peers,
                TransportKind::Verbs,
                BufferLocation::Device,
                &caps,
            ))
            .unwrap();
            assert_eq!(plan.connections.len(), peers.len());
            for c in &plan.connections {
                assert_eq!(c.send.memory, MemoryPath::HostStaged, "rank {rank}");
                assert!(c
                    .recv
                    .reason
                    .as_deref()
                    .unwrap()
                    .contains("rank 2: port down"));
            }
            assert_eq!(plan.warnings.len(), 1);
            assert!(plan.warnings[0].contains("rank 2") && plan.warnings[0].contains("port down"));
            assert_eq!(plan.column(), "verbs/staged");
            // gpu-direct is an error on every rank, naming rank 2.
            let e = decide(&inputs(
                PathPolicy::GpuDirect,
                rank,
                peers,
                TransportKind::Verbs,
                BufferLocation::Device,
                &caps,
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains("rank 2: port down"), "{e}");
        }
        // Everyone capable: GPUDirect with this rank's own mechanism, no warnings.
        let caps = vec![GpuDirectCapability::PeerMem, GpuDirectCapability::DmaBuf];
        let plan = decide(&inputs(
            PathPolicy::GpuDirect,
            1,
            &[0],
            TransportKind::Verbs,
            BufferLocation::Device,
            &caps,
        ))
        .unwrap();
        assert_eq!(plan.column(), "verbs/gdr-dmabuf");
        assert!(plan.warnings.is_empty());
    }

    #[test]
    fn a_missing_capability_is_an_argument_error_and_no_peers_is_an_empty_plan() {
        let caps = vec![GpuDirectCapability::DmaBuf];
        let e = decide(&inputs(
            PathPolicy::Auto,
            0,
            &[1],
            TransportKind::Verbs,
            BufferLocation::Device,
            &caps,
        ))
        .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let plan = decide(&inputs(
            PathPolicy::GpuDirect,
            0,
            &[],
            TransportKind::Verbs,
            BufferLocation::Device,
            &caps,
        ))
        .unwrap();
        assert!(plan.connections.is_empty());
        assert_eq!(plan.column(), "-");
    }

    fn facts() -> GpuNicFacts {
        GpuNicFacts {
            nic_usable: Ok(()),
            gpu_dma_buf: Some(true),
            nic_dma_buf: None,
            gpu_rdma: Some(true),
            peermem_loaded: true,
            distance: Some(PcieDistance::Pix),
            max_distance: PcieDistance::Pxb,
        }
    }

    #[test]
    fn capability_prefers_dma_buf_then_peermem() {
        assert_eq!(gpu_direct_capability(&facts()), GpuDirectCapability::DmaBuf);
        let f = GpuNicFacts {
            nic_dma_buf: Some(false),
            ..facts()
        };
        assert_eq!(gpu_direct_capability(&f), GpuDirectCapability::PeerMem);
        let f = GpuNicFacts {
            gpu_dma_buf: Some(false),
            ..facts()
        };
        assert_eq!(gpu_direct_capability(&f), GpuDirectCapability::PeerMem);
        let f = GpuNicFacts {
            gpu_dma_buf: None,
            gpu_rdma: None,
            ..facts()
        };
        assert_eq!(gpu_direct_capability(&f), GpuDirectCapability::PeerMem);
    }

    #[test]
    fn capability_unavailable_names_every_reason() {
        let f = GpuNicFacts {
            gpu_dma_buf: Some(false),
            peermem_loaded: false,
            ..facts()
        };
        let GpuDirectCapability::Unavailable(why) = gpu_direct_capability(&f) else {
            panic!()
        };
        assert!(
            why.contains("DMA_BUF_SUPPORTED=0") && why.contains("nvidia-peermem is not loaded"),
            "{why}"
        );
        let f = GpuNicFacts {
            gpu_dma_buf: Some(false),
            gpu_rdma: Some(false),
            ..facts()
        };
        let GpuDirectCapability::Unavailable(why) = gpu_direct_capability(&f) else {
            panic!()
        };
        assert!(why.contains("GPU_DIRECT_RDMA_SUPPORTED=0"), "{why}");
        let f = GpuNicFacts {
            nic_usable: Err("libibverbs.so.1 not found".into()),
            ..facts()
        };
        assert_eq!(
            gpu_direct_capability(&f),
            GpuDirectCapability::Unavailable("libibverbs.so.1 not found".into())
        );
        let f = GpuNicFacts {
            distance: Some(PcieDistance::Sys),
            ..facts()
        };
        let GpuDirectCapability::Unavailable(why) = gpu_direct_capability(&f) else {
            panic!()
        };
        assert!(why.contains("SYS") && why.contains("PXB"), "{why}");
        let f = GpuNicFacts {
            distance: Some(PcieDistance::Phb),
            max_distance: PcieDistance::Phb,
            ..facts()
        };
        assert_eq!(gpu_direct_capability(&f), GpuDirectCapability::DmaBuf);
        let f = GpuNicFacts {
            distance: None,
            ..facts()
        };
        assert_eq!(gpu_direct_capability(&f), GpuDirectCapability::DmaBuf);
    }

    #[cfg(feature = "cli")]
    #[test]
    fn paths_serialize_for_tools() {
        let c = symmetric(
            1,
            DataPath {
                transport: TransportKind::Verbs,
                memory: MemoryPath::GpuDirectDmaBuf,
                reason: None,
            },
        );
        let j = serde_json::to_value(&c).unwrap();
        assert_eq!(j["send"]["memory"], "gdr-dmabuf");
        assert_eq!(j["send"]["transport"], "verbs");
        let cap = serde_json::to_value(GpuDirectCapability::Unavailable("x".into())).unwrap();
        assert_eq!(cap["kind"], "unavailable");
        assert_eq!(cap["reason"], "x");
    }
}
