//! Host facts read from sysfs: nvidia-peermem, GPU↔NIC PCIe distance, RDMA devices and ports,
//! NVIDIA GPUs on the PCI bus.
//!
//! Every probe reads below a root directory ([`Sysfs::new`], `/` on a real machine) so that tests
//! build a fake tree in a temporary directory and exercise the real code. No CUDA, no verbs, no
//! `unsafe`: plain file reads and symlink resolution. Missing files are facts ("no RDMA device"),
//! never errors.

use std::fmt;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The three files NCCL checks (`net_ib/gdr.cc`): nvidia-peermem is loaded when any one exists.
pub const PEERMEM_FILES: [&str; 3] = [
    "sys/kernel/mm/memory_peers/nv_mem/version",
    "sys/kernel/mm/memory_peers/nv_mem_nc/version",
    "sys/module/nvidia_peermem/version",
];

/// A sysfs tree rooted at `root` (`/` on a real machine).
#[derive(Clone, Debug)]
pub struct Sysfs {
    root: PathBuf,
}

impl Default for Sysfs {
    fn default() -> Self {
        Sysfs::new("/")
    }
}

/// Whether nvidia-peermem is loaded, and how that was decided.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeermemStatus {
    /// One of [`PEERMEM_FILES`] exists.
    pub loaded: bool,
    /// The file that exists (absolute, as seen on the real machine), if any.
    pub found: Option<String>,
    /// Its content (the module version), trimmed.
    pub version: Option<String>,
    /// The files that were checked.
    pub checked: Vec<String>,
}

/// A PCI address `domain:bus:device.function`, normalised to lower-case sysfs form
/// (`0000:3b:00.0`).
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddr {
    /// PCI domain (segment).
    pub domain: u32,
    /// Bus.
    pub bus: u8,
    /// Device.
    pub device: u8,
    /// Function.
    pub function: u8,
}

impl PciAddr {
    /// Parses `0000:3B:00.0`, `00000000:3b:00.0` (nvidia-smi) or `3b:00.0` (domain 0).
    pub fn parse(s: &str) -> Option<PciAddr> {
        let s = s.trim();
        let (rest, function) = s.rsplit_once('.')?;
        let parts: Vec<&str> = rest.split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [d, b, dev] => (u32::from_str_radix(d, 16).ok()?, *b, *dev),
            [b, dev] => (0, *b, *dev),
            _ => return None,
        };
        let hex8 = |t: &str| {
            if t.is_empty() || t.len() > 2 {
                None
            } else {
                u8::from_str_radix(t, 16).ok()
            }
        };
        let function = u8::from_str_radix(function, 16).ok().filter(|f| *f < 8)?;
        let device = hex8(device).filter(|d| *d < 32)?;
        Some(PciAddr {
            domain,
            bus: hex8(bus)?,
            device,
            function,
        })
    }
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

/// How far apart two PCI devices are, in NCCL's vocabulary (ordered from near to far).
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PcieDistance {
    /// The same PCI device.
    Same,
    /// PIX: at most one PCIe bridge between them (same switch port).
    Pix,
    /// PXB: several PCIe bridges, but below a common switch (not through the CPU).
    Pxb,
    /// PHB: through a PCIe host bridge / root port of one CPU (same NUMA node).
    Phb,
    /// SYS: across CPU sockets (the inter-socket link).
    Sys,
}

impl PcieDistance {
    /// NCCL's short name (`PIX`, `PXB`, `PHB`, `SYS`; `LOC` for the same device).
    pub fn short(self) -> &'static str {
        match self {
            PcieDistance::Same => "LOC",
            PcieDistance::Pix => "PIX",
            PcieDistance::Pxb => "PXB",
            PcieDistance::Phb => "PHB",
            PcieDistance::Sys => "SYS",
        }
    }

    /// A phrase for humans.
    pub fn describe(self) -> &'static str {
        match self {
            PcieDistance::Same => "same PCI device",
            PcieDistance::Pix => "same PCIe switch, one bridge apart",
            PcieDistance::Pxb => "same PCIe switch hierarchy, several bridges apart",
            PcieDistance::Phb => "same CPU root complex (traffic crosses the host bridge)",
            PcieDistance::Sys => {
                "different CPU sockets / root complexes (traffic crosses the inter-socket link)"
            }
        }
    }
}

impl fmt::Display for PcieDistance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short())
    }
}

/// The PCIe placement of a device: its canonical sysfs path split into the root
/// (`pci0000:00`) and the chain of PCI devices from the root port down to the device itself.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciPlacement {
    /// The PCI root (host bridge) directory name, e.g. `pci0000:00`.
    pub root: String,
    /// Devices from the root port down to the device (last element).
    pub chain: Vec<PciAddr>,
    /// The device's NUMA node (`None` when sysfs says -1 or has no file).
    pub numa_node: Option<i32>,
}

/// A distance with the explanation of how it was derived.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistanceReport {
    /// The classification.
    pub distance: PcieDistance,
    /// How: the common ancestor, or the NUMA nodes compared.
    pub detail: String,
}

/// Classifies the distance between two placements (pure; see [`Sysfs::distance`]).
///
/// Common ancestor below the root port: PIX (one bridge on the path) or PXB; both below the same
/// root port or host bridge: PHB; different host bridges: PHB on the same NUMA node, SYS on
/// different ones (also SYS when the nodes are unknown and the host bridges differ, since
/// nothing shows that they are close).
pub fn classify(a: &PciPlacement, b: &PciPlacement) -> DistanceReport {
    if a.root != b.root {
        return match (a.numa_node, b.numa_node) {
            (Some(x), Some(y)) if x == y => DistanceReport {
                distance: PcieDistance::Phb,
                detail: format!("different host bridges ({} and {}) on NUMA node {x}", a.root, b.root),
            },
            (Some(x), Some(y)) => DistanceReport {
                distance: PcieDistance::Sys,
                detail: format!("different host bridges ({} and {}) on NUMA nodes {x} and {y}", a.root, b.root),
            },
            _ => DistanceReport {
                distance: PcieDistance::Sys,
                detail: format!(
                    "different host bridges ({} and {}), NUMA node unknown: assuming they are on different sockets",
                    a.root, b.root
                ),
            },
        };
    }
    let common = a
        .chain
        .iter()
        .zip(b.chain.iter())
        .take_while(|(x, y)| x == y)
        .count();
    if common == a.chain.len() && common == b.chain.len() {
        return DistanceReport {
            distance: PcieDistance::Same,
            detail: "same device".into(),
        };
    }
    if common == 0 {
        return DistanceReport {
            distance: PcieDistance::Phb,
            detail: format!("below different root ports of host bridge {}", a.root),
        };
    }
    if common == 1 {
        return DistanceReport {
            distance: PcieDistance::Phb,
            detail: format!(
                "meet at root port {} (part of the CPU's root complex)",
                a.chain[0]
            ),
        };
    }
    // Bridges on the path: below the common ancestor on each side (excluding the endpoints),
    // plus the common ancestor itself.
    let below = |c: &PciPlacement| c.chain.len().saturating_sub(common + 1);
    let bridges = below(a) + below(b) + 1;
    let ancestor = a.chain[common - 1];
    if bridges <= 1 {
        DistanceReport {
            distance: PcieDistance::Pix,
            detail: format!("both directly below bridge {ancestor}"),
        }
    } else {
        DistanceReport {
            distance: PcieDistance::Pxb,
            detail: format!("common PCIe bridge {ancestor}, {bridges} bridges on the path"),
        }
    }
}

/// One RDMA port as sysfs shows it.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaPort {
    /// Port number (1-based).
    pub port: u32,
    /// `state` (e.g. `4: ACTIVE`).
    pub state: Option<String>,
    /// `phys_state` (e.g. `5: LinkUp`).
    pub phys_state: Option<String>,
    /// `link_layer` (`InfiniBand` or `Ethernet`).
    pub link_layer: Option<String>,
    /// `rate` (e.g. `200 Gb/sec (4X HDR)`).
    pub rate: Option<String>,
    /// Populated GIDs: (index, gid, type such as `RoCE v2`, netdev).
    pub gids: Vec<GidEntry>,
    /// The MTU as far as sysfs tells it (see [`RdmaPort::mtu_note`]).
    pub active_mtu: Option<u32>,
    /// How the MTU was obtained, or why it is unknown.
    pub mtu_note: String,
}

impl RdmaPort {
    /// Whether `state` says ACTIVE.
    pub fn is_active(&self) -> bool {
        self.state.as_deref().is_some_and(|s| s.contains("ACTIVE"))
    }
}

/// One populated GID table entry.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the GID table.
    pub index: u32,
    /// The GID, as sysfs prints it.
    pub gid: String,
    /// `gid_attrs/types/<i>` (`IB/RoCE v1`, `RoCE v2`), if readable.
    pub kind: Option<String>,
    /// `gid_attrs/ndevs/<i>` (the Ethernet netdev for RoCE), if readable.
    pub netdev: Option<String>,
}

/// One RDMA device under `/sys/class/infiniband`.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaDevice {
    /// Device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// `node_type` (e.g. `1: CA`).
    pub node_type: Option<String>,
    /// `fw_ver`.
    pub fw_ver: Option<String>,
    /// Its PCI placement, when it is a PCI device (software devices such as rxe/siw have none).
    pub pci: Option<PciPlacement>,
    /// Ports.
    pub ports: Vec<RdmaPort>,
}

/// An NVIDIA GPU seen on the PCI bus (vendor 0x10de, display/3D class) — found even when the
/// CUDA driver is missing.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciGpu {
    /// PCI address.
    pub addr: PciAddr,
    /// PCI device id (`0x2330`).
    pub device_id: Option<String>,
    /// Kernel driver bound to it (`nvidia`, `vfio-pci`, none).
    pub driver: Option<String>,
    /// Placement.
    pub placement: Option<PciPlacement>,
}

fn read_trim(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// Resolves every symlink component of `path` (like `realpath`), but relative to `root` for
/// absolute link targets, so that a fake tree under a temporary directory works like `/`.
fn resolve_under(root: &Path, path: &Path) -> Option<PathBuf> {
    fn parts(p: &Path) -> Vec<String> {
        p.components()
            .filter_map(|c| match c {
                Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
                Component::ParentDir => Some("..".to_string()),
                _ => None,
            })
            .collect()
    }
    // `cur` is relative to `root`; `queue` holds the components still to walk.
    let mut cur = PathBuf::new();
    let mut queue: std::collections::VecDeque<String> = parts(path).into();
    let mut hops = 0;
    while let Some(part) = queue.pop_front() {
        if part == ".." {
            cur.pop();
            continue;
        }
        let candidate = cur.join(&part);
        let full = root.join(&candidate);
        match fs::read_link(&full) {
            Ok(target) => {
                hops += 1;
                if hops > 64 {
                    return None; // a link loop
                }
                if target.is_absolute() {
                    cur = PathBuf::new();
                }
                for r in parts(&target).into_iter().rev() {
                    queue.push_front(r);
                }
            }
            Err(_) if full.exists() => cur = candidate,
            Err(_) => return None,
        }
    }
    Some(cur)
}

impl Sysfs {
    /// A tree rooted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Sysfs { root: root.into() }
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    /// nvidia-peermem detection exactly as NCCL does it: any of [`PEERMEM_FILES`] exists.
    pub fn peermem(&self) -> PeermemStatus {
        let checked: Vec<String> = PEERMEM_FILES.iter().map(|f| format!("/{f}")).collect();
        for f in PEERMEM_FILES {
            let p = self.p(f);
            if p.exists() {
                return PeermemStatus {
                    loaded: true,
                    found: Some(format!("/{f}")),
                    version: read_trim(&p).filter(|v| !v.is_empty()),
                    checked,
                };
            }
        }
        PeermemStatus {
            loaded: false,
            found: None,
            version: None,
            checked,
        }
    }

    /// Placement of a device given the sysfs path (relative to the root) of a symlink or
    /// directory that resolves to its directory under `/sys/devices/pci*`.
    fn placement_of(&self, rel: &str) -> Option<PciPlacement> {
        let resolved = resolve_under(&self.root, Path::new(rel.trim_start_matches('/')))?;
        let comps: Vec<String> = resolved
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let at = comps
            .iter()
            .position(|c| c.starts_with("pci") && c.contains(':'))?;
        let root = comps[at].clone();
        let chain: Vec<PciAddr> = comps[at + 1..]
            .iter()
            .map_while(|c| PciAddr::parse(c))
            .collect();
        if chain.is_empty() {
            return None;
        }
        let numa_node = read_trim(&self.root.join(&resolved).join("numa_node"))
            .and_then(|s| s.parse::<i32>().ok())
            .filter(|n| *n >= 0);
        Some(PciPlacement {
            root,
            chain,
            numa_node,
        })
    }

    /// Placement of the PCI device `addr` (via `/sys/bus/pci/devices/<addr>`).
    pub fn pci_placement(&self, addr: PciAddr) -> Option<PciPlacement> {
        self.placement_of(&format!("sys/bus/pci/devices/{addr}"))
    }

    /// Placement of the RDMA device `name` (via `/sys/class/infiniband/<name>/device`).
    pub fn rdma_placement(&self, name: &str) -> Option<PciPlacement> {
        self.placement_of(&format!("sys/class/infiniband/{name}/device"))
    }

    /// PCIe distance between the GPU at `gpu` and the RDMA device `nic`, or why it is unknown.
    pub fn distance(&self, gpu: PciAddr, nic: &str) -> Result<DistanceReport, String> {
        let g = self
            .pci_placement(gpu)
            .ok_or_else(|| format!("GPU {gpu} not found under /sys/bus/pci/devices"))?;
        let n = self.rdma_placement(nic).ok_or_else(|| {
            format!("{nic} is not a PCI device (software RDMA such as rxe/siw, or no sysfs link)")
        })?;
        Ok(classify(&g, &n))
    }

    /// RDMA devices under `/sys/class/infiniband`, sorted by name (empty when there are none).
    pub fn rdma_devices(&self) -> Vec<RdmaDevice> {
        let base = self.p("sys/class/infiniband");
        let mut names: Vec<String> = match fs::read_dir(&base) {
            Ok(rd) => rd
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
            Err(_) => Vec::new(),
        };
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let dir = base.join(&name);
                let mut ports: Vec<u32> = fs::read_dir(dir.join("ports"))
                    .map(|rd| {
                        rd.filter_map(|e| e.ok())
                            .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                            .collect()
                    })
                    .unwrap_or_default();
                ports.sort_unstable();
                RdmaDevice {
                    node_type: read_trim(&dir.join("node_type")),
                    fw_ver: read_trim(&dir.join("fw_ver")),
                    pci: self.rdma_placement(&name),
                    ports: ports
                        .into_iter()
                        .map(|p| self.rdma_port(&dir.join("ports").join(p.to_string()), p))
                        .collect(),
                    name,
                }
            })
            .collect()
    }

    fn rdma_port(&self, dir: &Path, port: u32) -> RdmaPort {
        let link_layer = read_trim(&dir.join("link_layer"));
        let mut idx: Vec<u32> = fs::read_dir(dir.join("gids"))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        idx.sort_unstable();
        let gids: Vec<GidEntry> = idx
            .into_iter()
            .filter_map(|i| {
                let gid = read_trim(&dir.join("gids").join(i.to_string()))?;
                if gid.is_empty() || gid.chars().all(|c| c == '0' || c == ':') {
                    return None;
                }
                Some(GidEntry {
                    index: i,
                    gid,
                    kind: read_trim(&dir.join("gid_attrs/types").join(i.to_string()))
                        .filter(|s| !s.is_empty()),
                    netdev: read_trim(&dir.join("gid_attrs/ndevs").join(i.to_string()))
                        .filter(|s| !s.is_empty()),
                })
            })
            .collect();
        let (active_mtu, mtu_note) = if link_layer.as_deref() == Some("Ethernet") {
            match gids.iter().find_map(|g| g.netdev.clone()) {
                Some(nd) => match read_trim(&self.p(&format!("sys/class/net/{nd}/mtu"))).and_then(|m| m.parse::<u32>().ok()) {
                    Some(m) => (
                        roce_active_mtu(m),
                        format!(
                            "RoCE: derived from {nd} MTU {m} (largest IB MTU fitting the Ethernet MTU minus RoCE headers)"
                        ),
                    ),
                    None => (None, format!("RoCE: MTU of netdev {nd} unreadable")),
                },
                None => (None, "RoCE: no netdev attached to any GID".to_string()),
            }
        } else {
            (
                None,
                "not exposed in sysfs for InfiniBand ports: see `ibv_devinfo -v` (active_mtu)"
                    .to_string(),
            )
        };
        RdmaPort {
            port,
            state: read_trim(&dir.join("state")),
            phys_state: read_trim(&dir.join("phys_state")),
            rate: read_trim(&dir.join("rate")),
            link_layer,
            gids,
            active_mtu,
            mtu_note,
        }
    }

    /// NVIDIA GPUs on the PCI bus (vendor 0x10de, class 0x0300xx or 0x0302xx), by address.
    pub fn pci_gpus(&self) -> Vec<PciGpu> {
        let base = self.p("sys/bus/pci/devices");
        let mut out: Vec<PciGpu> = fs::read_dir(&base)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        let addr = PciAddr::parse(&name)?;
                        let dir = base.join(&name);
                        let vendor = read_trim(&dir.join("vendor"))?;
                        let class = read_trim(&dir.join("class"))?;
                        let class = class.trim_start_matches("0x");
                        if !vendor.eq_ignore_ascii_case("0x10de")
                            || !(class.starts_with("0300") || class.starts_with("0302"))
                        {
                            return None;
                        }
                        let driver = fs::read_link(dir.join("driver"))
                            .ok()
                            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()));
                        Some(PciGpu {
                            addr,
                            device_id: read_trim(&dir.join("device")),
                            driver,
                            placement: self.pci_placement(addr),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by_key(|g| g.addr);
        out
    }
}

/// The RoCE active MTU the kernel derives from an Ethernet MTU (`iboe_get_mtu`): the largest IB
/// MTU (256..4096) not above the Ethernet MTU minus the RoCE headers (GRH 40, UDP 8, BTH 12,
/// XRC ext 4, AtomicETH 28, ICRC 4 = 96 bytes).
pub fn roce_active_mtu(eth_mtu: u32) -> Option<u32> {
    let avail = eth_mtu.checked_sub(96)?;
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|m| *m <= avail)
}

#[cfg(test)]
pub(crate) mod fake {
    //! Builders for fake sysfs trees in a temporary directory.
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::path::{Path, PathBuf};

    /// A temporary directory removed on drop.
    pub(crate) struct TempTree(pub PathBuf);

    impl TempTree {
        pub(crate) fn new(tag: &str) -> Self {
            static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p =
                std::env::temp_dir().join(format!("dspark-sysfs-{tag}-{}-{n}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).unwrap();
            TempTree(p)
        }

        pub(crate) fn write(&self, rel: &str, content: &str) {
            let p = self.0.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, content).unwrap();
        }

        pub(crate) fn link(&self, rel: &str, target: &str) {
            let p = self.0.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            symlink(target, p).unwrap();
        }

        /// A PCI device at `devpath` (below sys/devices, e.g. `pci0000:00/0000:00:01.0/0000:01:00.0`)
        /// with its /sys/bus/pci/devices link (relative, as the kernel makes it).
        pub(crate) fn pci_device(&self, devpath: &str, numa: i32, vendor: &str, class: &str) {
            let dir = format!("sys/devices/{devpath}");
            self.write(&format!("{dir}/numa_node"), &format!("{numa}\n"));
            self.write(&format!("{dir}/vendor"), &format!("{vendor}\n"));
            self.write(&format!("{dir}/class"), &format!("{class}\n"));
            let bdf = Path::new(devpath)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned();
            self.link(
                &format!("sys/bus/pci/devices/{bdf}"),
                &format!("../../../devices/{devpath}"),
            );
        }

        /// An RDMA device `name` whose `device` link points at the PCI device at `devpath`.
        pub(crate) fn rdma_device(&self, name: &str, devpath: Option<&str>) {
            self.write(
                &format!("sys/devices/virtual/infiniband/{name}/node_type"),
                "1: CA\n",
            );
            if let Some(dp) = devpath {
                self.link(
                    &format!("sys/devices/virtual/infiniband/{name}/device"),
                    &format!("../../../{dp}"),
                );
            }
            self.link(
                &format!("sys/class/infiniband/{name}"),
                &format!("../../devices/virtual/infiniband/{name}"),
            );
        }
    }

    impl Drop for TempTree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::TempTree;
    use super::*;

    fn addr(s: &str) -> PciAddr {
        PciAddr::parse(s).unwrap()
    }

    #[test]
    fn pci_addresses_parse_in_cuda_nvidia_smi_and_sysfs_spelling() {
        assert_eq!(addr("0000:3B:00.0").to_string(), "0000:3b:00.0");
        assert_eq!(addr("00000000:3b:00.0").to_string(), "0000:3b:00.0");
        assert_eq!(addr("3b:00.1").to_string(), "0000:3b:00.1");
        assert_eq!(addr("10000:01:1f.7").to_string(), "10000:01:1f.7");
        for bad in [
            "",
            "pci0000:00",
            "0000:3b:00",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "zz:00.0",
            "0000:100:00.0",
        ] {
            assert!(PciAddr::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn peermem_is_detected_by_any_of_nccls_three_files() {
        let t = TempTree::new("peermem-none");
        let s = Sysfs::new(&t.0);
        let st = s.peermem();
        assert!(!st.loaded);
        assert_eq!(st.checked.len(), 3);
        assert!(st
            .checked
            .iter()
            .any(|c| c == "/sys/module/nvidia_peermem/version"));

        for (i, f) in PEERMEM_FILES.iter().enumerate() {
            let t = TempTree::new(&format!("peermem-{i}"));
            t.write(f, "1.2-0\n");
            let st = Sysfs::new(&t.0).peermem();
            assert!(st.loaded, "{f}");
            assert_eq!(st.found.as_deref(), Some(format!("/{f}").as_str()));
            assert_eq!(st.version.as_deref(), Some("1.2-0"));
        }

        // The module directory without the version file is not enough (NCCL checks the file).
        let t = TempTree::new("peermem-dir-only");
        fs::create_dir_all(t.0.join("sys/module/nvidia_peermem")).unwrap();
        assert!(!Sysfs::new(&t.0).peermem().loaded);
    }

    /// Two sockets. Socket 0 (pci0000:00, NUMA 0): root port 00:01.0 → switch upstream 01:00.0 →
    /// downstream ports 02:08.0 and 02:10.0; GPU0 at 03:00.0 and NIC0 at 03:00.1 below 02:08.0,
    /// NIC1 at 04:00.0 below 02:10.0; NIC2 at 05:00.0 below another root port 00:02.0.
    /// GPU1 at 06:00.0 directly below root port 00:01.0's sibling... see below.
    /// Socket 1 (pci0000:80, NUMA 1): NIC3 at 81:00.0 below root port 80:01.0.
    /// Socket 0 second host bridge (pci0000:40, NUMA 0): NIC4 at 41:00.0.
    fn topology() -> TempTree {
        let t = TempTree::new("topo");
        let sw = "pci0000:00/0000:00:01.0/0000:01:00.0";
        t.pci_device(
            &format!("{sw}/0000:02:08.0/0000:03:00.0"),
            0,
            "0x10de",
            "0x030200",
        );
        t.pci_device(
            &format!("{sw}/0000:02:08.0/0000:03:00.1"),
            0,
            "0x15b3",
            "0x020700",
        );
        t.pci_device(
            &format!("{sw}/0000:02:10.0/0000:04:00.0"),
            0,
            "0x15b3",
            "0x020700",
        );
        t.pci_device(
            "pci0000:00/0000:00:02.0/0000:05:00.0",
            0,
            "0x15b3",
            "0x020700",
        );
        t.pci_device(
            "pci0000:00/0000:00:01.0/0000:06:00.0",
            0,
            "0x15b3",
            "0x020700",
        );
        t.pci_device(
            "pci0000:80/0000:80:01.0/0000:81:00.0",
            1,
            "0x15b3",
            "0x020700",
        );
        t.pci_device(
            "pci0000:40/0000:40:01.0/0000:41:00.0",
            0,
            "0x15b3",
            "0x020700",
        );
        t.pci_device(
            "pci0000:c0/0000:c0:01.0/0000:c1:00.0",
            -1,
            "0x15b3",
            "0x020700",
        );
        t.rdma_device("mlx5_0", Some(&format!("{sw}/0000:02:08.0/0000:03:00.1")));
        t.rdma_device("mlx5_1", Some(&format!("{sw}/0000:02:10.0/0000:04:00.0")));
        t.rdma_device("mlx5_2", Some("pci0000:00/0000:00:02.0/0000:05:00.0"));
        t.rdma_device("mlx5_3", Some("pci0000:80/0000:80:01.0/0000:81:00.0"));
        t.rdma_device("mlx5_4", Some("pci0000:40/0000:40:01.0/0000:41:00.0"));
        t.rdma_device("mlx5_5", Some("pci0000:00/0000:00:01.0/0000:06:00.0"));
        t.rdma_device("mlx5_6", Some("pci0000:c0/0000:c0:01.0/0000:c1:00.0"));
        t.rdma_device("rxe0", None);
        t
    }

    #[test]
    fn pcie_distance_is_classified_from_resolved_sysfs_links() {
        let t = topology();
        let s = Sysfs::new(&t.0);
        let gpu = addr("0000:03:00.0");
        let d = |nic: &str| s.distance(gpu, nic).unwrap().distance;
        assert_eq!(d("mlx5_0"), PcieDistance::Pix, "same downstream port");
        assert_eq!(
            d("mlx5_1"),
            PcieDistance::Pxb,
            "same switch, different downstream ports"
        );
        assert_eq!(d("mlx5_5"), PcieDistance::Phb, "meet only at the root port");
        assert_eq!(
            d("mlx5_2"),
            PcieDistance::Phb,
            "different root ports, same host bridge"
        );
        assert_eq!(
            d("mlx5_4"),
            PcieDistance::Phb,
            "different host bridge, same NUMA node"
        );
        assert_eq!(d("mlx5_3"), PcieDistance::Sys, "other socket");
        assert_eq!(
            d("mlx5_6"),
            PcieDistance::Sys,
            "NUMA unknown across host bridges"
        );
        let r = s.distance(gpu, "mlx5_3").unwrap();
        assert!(r.detail.contains("NUMA nodes 0 and 1"), "{}", r.detail);
        let e = s.distance(gpu, "rxe0").unwrap_err();
        assert!(e.contains("not a PCI device"), "{e}");
        let e = s.distance(addr("0000:99:00.0"), "mlx5_0").unwrap_err();
        assert!(e.contains("not found"), "{e}");
    }

    #[test]
    fn placement_follows_relative_links_to_the_full_pci_path() {
        let t = topology();
        let s = Sysfs::new(&t.0);
        let p = s.rdma_placement("mlx5_1").unwrap();
        assert_eq!(p.root, "pci0000:00");
        let chain: Vec<String> = p.chain.iter().map(|a| a.to_string()).collect();
        assert_eq!(
            chain,
            [
                "0000:00:01.0",
                "0000:01:00.0",
                "0000:02:10.0",
                "0000:04:00.0"
            ]
        );
        assert_eq!(p.numa_node, Some(0));
        assert_eq!(
            s.pci_placement(addr("0000:c1:00.0")).unwrap().numa_node,
            None
        );
    }

    #[test]
    fn classification_of_pure_placements() {
        let pl = |root: &str, chain: &[&str], numa: Option<i32>| PciPlacement {
            root: root.into(),
            chain: chain.iter().map(|c| addr(c)).collect(),
            numa_node: numa,
        };
        let a = pl("pci0000:00", &["00:01.0", "01:00.0"], Some(0));
        assert_eq!(classify(&a, &a).distance, PcieDistance::Same);
        // Endpoint directly below root port vs. device deeper below it: the root port is the
        // common ancestor → PHB.
        let b = pl("pci0000:00", &["00:01.0", "01:00.1"], Some(0));
        assert_eq!(classify(&a, &b).distance, PcieDistance::Phb);
        // Two functions of one device below a switch port: PIX.
        let c = pl(
            "pci0000:00",
            &["00:01.0", "01:00.0", "02:00.0", "03:00.0"],
            None,
        );
        let d = pl(
            "pci0000:00",
            &["00:01.0", "01:00.0", "02:00.0", "03:00.1"],
            None,
        );
        assert_eq!(classify(&c, &d).distance, PcieDistance::Pix);
        // Deeper switch on one side: PXB.
        let e = pl(
            "pci0000:00",
            &[
                "00:01.0", "01:00.0", "02:00.0", "03:00.0", "04:00.0", "05:00.0",
            ],
            None,
        );
        assert_eq!(classify(&d, &e).distance, PcieDistance::Pxb);
        assert!(PcieDistance::Pix < PcieDistance::Pxb && PcieDistance::Phb < PcieDistance::Sys);
    }

    #[test]
    fn rdma_ports_gids_and_roce_mtu_are_read_from_sysfs() {
        let t = topology();
        let base = "sys/devices/virtual/infiniband/mlx5_0/ports/1";
        t.write(&format!("{base}/state"), "4: ACTIVE\n");
        t.write(&format!("{base}/phys_state"), "5: LinkUp\n");
        t.write(&format!("{base}/link_layer"), "Ethernet\n");
        t.write(&format!("{base}/rate"), "100 Gb/sec (4X EDR)\n");
        t.write(
            &format!("{base}/gids/0"),
            "fe80:0000:0000:0000:0202:c9ff:fe01:0203\n",
        );
        t.write(
            &format!("{base}/gids/1"),
            "0000:0000:0000:0000:0000:ffff:0a00:0001\n",
        );
        t.write(
            &format!("{base}/gids/2"),
            "0000:0000:0000:0000:0000:0000:0000:0000\n",
        );
        t.write(&format!("{base}/gid_attrs/types/0"), "IB/RoCE v1\n");
        t.write(&format!("{base}/gid_attrs/types/1"), "RoCE v2\n");
        t.write(&format!("{base}/gid_attrs/ndevs/0"), "eth2\n");
        t.write(&format!("{base}/gid_attrs/ndevs/1"), "eth2\n");
        t.write("sys/class/net/eth2/mtu", "9000\n");
        let ib = "sys/devices/virtual/infiniband/mlx5_1/ports/1";
        t.write(&format!("{ib}/state"), "1: DOWN\n");
        t.write(&format!("{ib}/link_layer"), "InfiniBand\n");
        let devs = Sysfs::new(&t.0).rdma_devices();
        let names: Vec<&str> = devs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names[0..2], ["mlx5_0", "mlx5_1"]);
        assert!(names.contains(&"rxe0"));
        let p = &devs[0].ports[0];
        assert!(p.is_active());
        assert_eq!(p.gids.len(), 2, "the all-zero GID is not listed");
        assert_eq!(p.gids[1].kind.as_deref(), Some("RoCE v2"));
        assert_eq!(p.gids[1].netdev.as_deref(), Some("eth2"));
        assert_eq!(p.active_mtu, Some(4096));
        let q = &devs[1].ports[0];
        assert!(!q.is_active());
        assert_eq!(q.active_mtu, None);
        assert!(q.mtu_note.contains("ibv_devinfo"));
        assert!(devs
            .iter()
            .find(|d| d.name == "rxe0")
            .unwrap()
            .pci
            .is_none());
    }

    #[test]
    fn roce_mtu_follows_the_kernels_rule() {
        assert_eq!(roce_active_mtu(1500), Some(1024));
        assert_eq!(roce_active_mtu(9000), Some(4096));
        assert_eq!(roce_active_mtu(4200), Some(4096));
        assert_eq!(roce_active_mtu(4100), Some(2048));
        assert_eq!(roce_active_mtu(300), None);
    }

    #[test]
    fn nvidia_gpus_are_found_on_the_pci_bus_without_cuda() {
        let t = topology();
        let gpus = Sysfs::new(&t.0).pci_gpus();
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus[0].addr.to_string(), "0000:03:00.0");
        assert_eq!(gpus[0].driver, None);
        assert!(gpus[0].placement.is_some());
    }

    #[test]
    fn an_empty_root_has_no_devices_and_no_peermem() {
        let t = TempTree::new("empty");
        let s = Sysfs::new(&t.0);
        assert!(s.rdma_devices().is_empty());
        assert!(s.pci_gpus().is_empty());
        assert!(!s.peermem().loaded);
    }
}
