//! The doctor's GPU/NIC pairs: every GPU (the driver's devices, else NVIDIA GPUs on the PCI
//! bus) with every RDMA device, their PCIe distance, what GPUDirect RDMA the pair allows, and
//! the path device buffers take over verbs between two machines configured like this one;
//! in the human report the "GPU <-> NIC" and "Resulting data path for GPU buffers" sections.

use dspark::internals::gpu::probe::GpuInfo;
use dspark::internals::gpu::sysfs::{PciAddr, PcieDistance, PeermemStatus, Sysfs};
use dspark::path::{
    self, BufferLocation, GpuDirectCapability, GpuNicFacts, PathInputs, PathPolicy, TransportKind,
};
use serde::Serialize;

use super::fixes::fixes_for_capability;
use super::gpu::CudaSection;
use super::kv;
use super::rdma::{nic_usable, RdmaSection};

#[derive(Debug, Serialize)]
pub(super) struct PairReport {
    pub(super) gpu: String,
    pub(super) gpu_pci: Option<String>,
    pub(super) nic: String,
    pub(super) distance: Option<PcieDistance>,
    pub(super) distance_detail: String,
    /// What the hardware and drivers of this pair allow (what dspark uses).
    pub(super) capability: GpuDirectCapability,
    /// The memory path device buffers take over verbs between two machines configured like
    /// this one.
    pub(super) verbs_path: String,
    pub(super) verbs_reason: Option<String>,
    pub(super) fixes: Vec<String>,
}

/// The GPUs to pair with NICs: the driver's devices, else NVIDIA GPUs on the PCI bus.
struct GpuRef {
    label: String,
    pci: Option<PciAddr>,
    dma_buf: Option<bool>,
    rdma: Option<bool>,
    driver_missing: Option<String>,
}

/// The GPUs to pair: the driver's devices, else the NVIDIA GPUs on the PCI bus, each with why
/// no driver serves it.
fn gpus_to_pair(cuda: &CudaSection, devices: &[GpuInfo]) -> Vec<GpuRef> {
    if !devices.is_empty() {
        devices
            .iter()
            .map(|d| GpuRef {
                label: format!("GPU{} {}", d.ordinal, d.name),
                pci: d.pci,
                dma_buf: d.dma_buf_supported,
                rdma: d.gpu_direct_rdma_supported,
                driver_missing: None,
            })
            .collect()
    } else {
        let why = if !cuda.libcuda_loadable {
            "libcuda.so (NVIDIA driver) not loadable".to_string()
        } else {
            cuda.probe
                .as_ref()
                .and_then(|p| p.init_error.clone())
                .or_else(|| cuda.error.clone())
                .unwrap_or_else(|| "the CUDA driver reports no device".to_string())
        };
        cuda.pci_gpus
            .iter()
            .map(|g| GpuRef {
                label: format!("PCI GPU {}", g.addr),
                pci: Some(g.addr),
                dma_buf: None,
                rdma: None,
                driver_missing: Some(why.clone()),
            })
            .collect()
    }
}

/// Every GPU with every RDMA device: distance, capability, and the path over verbs.
pub(super) fn gpu_nic_pairs(
    sysfs: &Sysfs,
    rdma: &RdmaSection,
    cuda: &CudaSection,
    devices: &[GpuInfo],
    peermem: &PeermemStatus,
) -> Result<Vec<PairReport>, String> {
    let gpus = gpus_to_pair(cuda, devices);

    let mut pairs = Vec::new();
    for g in &gpus {
        for nic in &rdma.devices {
            let (distance, distance_detail) = match g.pci.map(|a| sysfs.distance(a, &nic.name)) {
                Some(Ok(r)) => (Some(r.distance), r.detail),
                Some(Err(e)) => (None, e),
                None => (None, "GPU PCI address unknown".to_string()),
            };
            let facts = path::gpu_direct_capability(&GpuNicFacts {
                nic_usable: nic_usable(rdma, nic).map_err(|(w, _)| w),
                gpu_dma_buf: g.dma_buf,
                nic_dma_buf: rdma.dma_buf_of(&nic.name).and_then(|d| d.supported),
                gpu_rdma: g.rdma,
                peermem_loaded: peermem.loaded,
                distance,
                max_distance: path::GDR_MAX_DISTANCE,
            });
            // Without a driver nothing GPU-side works, whatever else holds; list every blocker.
            let capability = match (&g.driver_missing, facts) {
                (None, c) => c,
                (Some(d), GpuDirectCapability::Unavailable(w)) => {
                    GpuDirectCapability::Unavailable(format!("no usable CUDA driver ({d}); {w}"))
                }
                (Some(d), _) => {
                    GpuDirectCapability::Unavailable(format!("no usable CUDA driver ({d})"))
                }
            };
            // The path between two machines configured like this one.
            let caps = vec![capability.clone(), capability.clone()];
            let plan = path::decide(&PathInputs {
                policy: PathPolicy::Auto,
                rank: 0,
                peers: &[1],
                transport: TransportKind::Verbs,
                buffers: BufferLocation::Device,
                capabilities: &caps,
            })
            .map_err(|e| e.to_string())?;
            let verbs_path = plan
                .connections
                .first()
                .map_or("-".to_string(), |c| c.send.short());
            let (verbs_reason, fixes) = match &capability {
                GpuDirectCapability::Unavailable(why) => (
                    Some(format!("GPUDirect RDMA unavailable: {why}")),
                    fixes_for_capability(why),
                ),
                _ => (None, Vec::new()),
            };
            pairs.push(PairReport {
                gpu: g.label.clone(),
                gpu_pci: g.pci.map(|a| a.to_string()),
                nic: nic.name.clone(),
                distance,
                distance_detail,
                verbs_path,
                verbs_reason,
                capability,
                fixes,
            });
        }
    }
    Ok(pairs)
}

/// The human report's "GPU <-> NIC" section: each pair's PCIe distance.
pub(super) fn render_pairs(o: &mut String, pairs: &[PairReport]) {
    o.push_str("\nGPU <-> NIC\n");
    if pairs.is_empty() {
        kv(o, "pairs", "none (needs both a GPU and an RDMA device)");
    }
    for p in pairs {
        kv(
            o,
            &format!("{} <-> {}", p.gpu, p.nic),
            match p.distance {
                Some(d) => format!("{} ({}): {}", d.short(), d.describe(), p.distance_detail),
                None => format!("distance unknown: {}", p.distance_detail),
            },
        );
    }
}

/// The human report's "Resulting data path for GPU buffers" section: over TCP, and over
/// verbs per pair with the fixes for what keeps GPUDirect RDMA away.
pub(super) fn render_data_path(o: &mut String, tcp_device_path: &str, pairs: &[PairReport]) {
    o.push_str("\nResulting data path for GPU buffers\n");
    kv(o, "over TCP", tcp_device_path);
    if pairs.is_empty() {
        kv(
            o,
            "over verbs",
            "no GPU/NIC pair: device buffers cannot use GPUDirect RDMA here",
        );
    }
    for p in pairs {
        let text = match &p.verbs_reason {
            None => format!("{}: GPUDirect RDMA", p.verbs_path),
            Some(why) => format!("{}: {why}", p.verbs_path),
        };
        kv(o, &format!("{} <-> {}", p.gpu, p.nic), text);
        for fix in &p.fixes {
            o.push_str(&format!("      -> {fix}\n"));
        }
    }
}
