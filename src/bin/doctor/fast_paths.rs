//! The doctor's fast paths: one verdict per thing a fast collective needs (the RDMA verbs
//! transport, locked memory, CUDA GPUs, GPUDirect RDMA via dma-buf and via nvidia-peermem,
//! NVRTC), each OK with what was found or UNAVAILABLE with every blocker and its fix; in the
//! human report the "Fast paths" section, in the JSON `fast_paths`.

use dspark::internals::gpu::probe::{GpuInfo, MEMLOCK_MIN_BYTES};
use dspark::internals::gpu::sysfs::PeermemStatus;
use serde::Serialize;

use super::fixes::{
    FIX_DMABUF, FIX_LIBCUDA, FIX_MEMLOCK, FIX_NIC_DMABUF, FIX_NO_DEVICE, FIX_NVRTC, FIX_PEERMEM,
};
use super::gpu::{CudaSection, NvrtcSection};
use super::rdma::{verbs_usable, MemlockSection, RdmaSection};
use super::{kv, limit_text, rounded_bytes};

/// One fast path: OK, or unavailable with the reason and the fix.
#[derive(Clone, Debug, Serialize)]
pub(super) struct FastPath {
    pub(super) name: &'static str,
    pub(super) ok: bool,
    pub(super) detail: String,
    pub(super) fixes: Vec<String>,
}

/// Every fast path, in the report's order.
pub(super) fn fast_paths(
    rdma: &RdmaSection,
    memlock: &MemlockSection,
    cuda: &CudaSection,
    devices: &[GpuInfo],
    peermem: &PeermemStatus,
    nvrtc: &NvrtcSection,
) -> Vec<FastPath> {
    let mut fast = Vec::new();
    let verbs = verbs_usable(rdma);
    fast.push(verbs_path(&verbs));
    fast.push(memlock_path(memlock));
    let cuda_fp = cuda_path(cuda, devices);
    let no_gpu_reason = (!cuda_fp.ok).then(|| cuda_fp.detail.clone());
    fast.push(cuda_fp);

    // GPUDirect, each mechanism: every blocker with its fix.
    let mut common: Vec<(String, String)> = Vec::new();
    if let Err(b) = &verbs {
        for (w, f) in b {
            common.push((format!("verbs transport: {w}"), f.to_string()));
        }
    }
    if let Some(why) = &no_gpu_reason {
        common.push((format!("CUDA: {why}"), FIX_LIBCUDA.to_string()));
    }
    fast.push(dma_buf_path(&common, rdma, devices));
    fast.push(peermem_path(&common, peermem));
    fast.push(nvrtc_path(nvrtc));
    fast
}

/// The verbs transport: its active ports, or every blocker with its fix.
fn verbs_path(verbs: &Result<String, Vec<(String, &'static str)>>) -> FastPath {
    match verbs {
        Ok(d) => FastPath {
            name: "RDMA verbs transport",
            ok: true,
            detail: d.clone(),
            fixes: vec![],
        },
        Err(b) => FastPath {
            name: "RDMA verbs transport",
            ok: false,
            detail: b
                .iter()
                .map(|(w, _)| w.as_str())
                .collect::<Vec<_>>()
                .join("; "),
            fixes: b.iter().map(|(_, f)| f.to_string()).collect(),
        },
    }
}

/// Locked memory: the soft limit, or why registering buffers will fail.
fn memlock_path(memlock: &MemlockSection) -> FastPath {
    if memlock.sufficient {
        FastPath {
            name: "locked memory (RLIMIT_MEMLOCK)",
            ok: true,
            detail: format!(
                "soft limit {}",
                limit_text(memlock.limit.and_then(|l| l.soft))
            ),
            fixes: vec![],
        }
    } else {
        FastPath {
            name: "locked memory (RLIMIT_MEMLOCK)",
            ok: false,
            detail: match (&memlock.limit, &memlock.error) {
                (Some(l), _) => format!(
                "soft limit {} (hard {}) is below {}: registering buffers with the NIC will fail",
                limit_text(l.soft),
                limit_text(l.hard),
                rounded_bytes(MEMLOCK_MIN_BYTES)
            ),
                (None, Some(e)) => e.clone(),
                (None, None) => "unknown".to_string(),
            },
            fixes: vec![FIX_MEMLOCK.to_string()],
        }
    }
}

/// CUDA GPUs: the devices and driver version, or why there is no usable GPU.
fn cuda_path(cuda: &CudaSection, devices: &[GpuInfo]) -> FastPath {
    if !devices.is_empty() {
        let dv = cuda
            .probe
            .as_ref()
            .and_then(|p| p.driver_version)
            .map_or("?".to_string(), |(a, b)| format!("{a}.{b}"));
        FastPath {
            name: "CUDA GPUs",
            ok: true,
            detail: format!("{} device(s), driver API {dv}", devices.len()),
            fixes: vec![],
        }
    } else if !cuda.libcuda_loadable {
        let seen = if cuda.pci_gpus.is_empty() {
            String::new()
        } else {
            format!(" ({} NVIDIA GPU(s) on the PCI bus)", cuda.pci_gpus.len())
        };
        FastPath {
            name: "CUDA GPUs",
            ok: false,
            detail: format!("libcuda.so (NVIDIA driver) not loadable{seen}"),
            fixes: vec![FIX_LIBCUDA.to_string()],
        }
    } else {
        let why = cuda
            .error
            .clone()
            .or_else(|| cuda.probe.as_ref().and_then(|p| p.init_error.clone()))
            .unwrap_or_else(|| "no device".to_string());
        FastPath {
            name: "CUDA GPUs",
            ok: false,
            detail: format!("driver present but no usable GPU: {why}"),
            fixes: vec![FIX_NO_DEVICE.to_string()],
        }
    }
}

/// A GPUDirect mechanism: ready, or the blockers every mechanism shares (`common`: the
/// verbs transport, CUDA) followed by its `own`, with their fixes without repeats.
fn gdr(
    name: &'static str,
    common: &[(String, String)],
    own: Vec<(String, String)>,
    ok_detail: String,
) -> FastPath {
    let blockers: Vec<(String, String)> = common.iter().cloned().chain(own).collect();
    if blockers.is_empty() {
        FastPath {
            name,
            ok: true,
            detail: format!("ready ({ok_detail})"),
            fixes: vec![],
        }
    } else {
        let mut fixes: Vec<String> = Vec::new();
        for (_, f) in &blockers {
            if !fixes.contains(f) {
                fixes.push(f.clone());
            }
        }
        FastPath {
            name,
            ok: false,
            detail: blockers
                .iter()
                .map(|(w, _)| w.as_str())
                .collect::<Vec<_>>()
                .join("; "),
            fixes,
        }
    }
}

/// GPUDirect RDMA via dma-buf: a GPU that exports dma-bufs and a NIC that does not refuse
/// them.
fn dma_buf_path(common: &[(String, String)], rdma: &RdmaSection, devices: &[GpuInfo]) -> FastPath {
    let dma_buf_gpus: Vec<String> = devices
        .iter()
        .filter(|d| d.dma_buf_supported == Some(true))
        .map(|d| format!("GPU{}", d.ordinal))
        .collect();
    let mut dma_buf_own = Vec::new();
    if !devices.is_empty() && dma_buf_gpus.is_empty() {
        dma_buf_own.push((
            "no GPU reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED".to_string(),
            FIX_DMABUF.to_string(),
        ));
    }
    // The NIC side: blocking only when every probed device refuses.
    let nic_dma_buf: Vec<&str> = rdma
        .dma_buf
        .iter()
        .filter(|d| d.supported == Some(true))
        .map(|d| d.device.as_str())
        .collect();
    let nic_refusals: Vec<String> = rdma
        .dma_buf
        .iter()
        .filter(|d| d.supported == Some(false))
        .map(|d| format!("{}: {}", d.device, d.detail))
        .collect();
    if nic_dma_buf.is_empty() && !nic_refusals.is_empty() {
        dma_buf_own.push((
            format!(
                "no RDMA device accepts dma-buf registration ({})",
                nic_refusals.join("; ")
            ),
            FIX_NIC_DMABUF.to_string(),
        ));
    }
    let nic_side = if nic_dma_buf.is_empty() {
        "the NIC side, ibv_reg_dmabuf_mr, could not be probed here and is checked by the verbs \
         transport at init"
            .to_string()
    } else {
        format!(
            "dma-buf registration accepted by {}",
            nic_dma_buf.join(", ")
        )
    };
    gdr(
        "GPUDirect RDMA via dma-buf",
        common,
        dma_buf_own,
        format!(
            "dma-buf export supported by {}; {nic_side}",
            dma_buf_gpus.join(", ")
        ),
    )
}

/// GPUDirect RDMA via nvidia-peermem: the module loaded.
fn peermem_path(common: &[(String, String)], peermem: &PeermemStatus) -> FastPath {
    let peermem_own: Vec<(String, String)> = (!peermem.loaded)
        .then(|| {
            (
                "nvidia-peermem is not loaded (none of NCCL's three sysfs files exists)"
                    .to_string(),
                FIX_PEERMEM.to_string(),
            )
        })
        .into_iter()
        .collect();
    gdr(
        "GPUDirect RDMA via nvidia-peermem",
        common,
        peermem_own,
        format!(
            "loaded ({}{})",
            peermem.found.clone().unwrap_or_default(),
            peermem
                .version
                .as_ref()
                .map(|v| format!(", version {v}"))
                .unwrap_or_default()
        ),
    )
}

/// NVRTC: the library's version, or how to install it.
fn nvrtc_path(nvrtc: &NvrtcSection) -> FastPath {
    if nvrtc.loadable {
        let v = nvrtc
            .version
            .map_or("?".to_string(), |(a, b)| format!("{a}.{b}"));
        FastPath {
            name: "GPU reduction kernels (NVRTC)",
            ok: true,
            detail: format!("libnvrtc {v} loadable"),
            fixes: vec![],
        }
    } else {
        FastPath {
            name: "GPU reduction kernels (NVRTC)",
            ok: false,
            detail: "libnvrtc.so not loadable".into(),
            fixes: vec![FIX_NVRTC.into()],
        }
    }
}

/// The human report's "Fast paths" section: each verdict, the fixes under what is missing.
pub(super) fn render_fast_paths(o: &mut String, fast_paths: &[FastPath]) {
    o.push_str("\nFast paths\n");
    for f in fast_paths {
        if f.ok {
            kv(o, f.name, format!("OK: {}", f.detail));
        } else {
            kv(o, f.name, format!("UNAVAILABLE: {}", f.detail));
            for fix in &f.fixes {
                o.push_str(&format!("      -> {fix}\n"));
            }
        }
    }
}
