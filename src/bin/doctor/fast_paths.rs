//! The doctor's fast paths: one verdict per thing a fast collective needs (the RDMA verbs
//! transport, locked memory, CUDA GPUs, GPUDirect RDMA via dma-buf and via nvidia-peermem,
//! NVRTC), each OK with what was found or UNAVAILABLE with every blocker and its fix; in the
//! human report the "Fast paths" section, in the JSON `fast_paths`.

use dspark::internals::gpu::probe::{GpuInfo, MEMLOCK_MIN_BYTES};
use dspark::internals::gpu::sysfs::PeermemStatus;
use serde::Serialize;

use super::fixes::{
    FIX_DMABUF, FIX_GPU_RDMA, FIX_LIBCUDA, FIX_MEMLOCK, FIX_NIC_DMABUF, FIX_NO_DEVICE, FIX_NVRTC,
    FIX_PEERMEM,
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
    let mut verbs = verbs_usable(rdma);
    // The transport refuses to start where it cannot pin one peer's buffers (transport::
    // verbs::prepare): a blocker like the hardware's, for `--require verbs` too.
    if let Some(why) = memlock.verbs_shortfall() {
        let blocker = (format!("one peer's pinned buffers: {why}"), FIX_MEMLOCK);
        match &mut verbs {
            Ok(_) => verbs = Err(vec![blocker]),
            Err(b) => b.push(blocker),
        }
    } else if let (Ok(d), Some(peers)) = (&mut verbs, memlock.verbs_peers()) {
        d.push_str(&format!(
            "; RLIMIT_MEMLOCK holds {peers} peers' pinned buffers ({} each)",
            rounded_bytes(memlock.verbs_bytes_per_peer)
        ));
    }
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
    fast.push(peermem_path(&common, peermem, devices));
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
    if memlock.cap_ipc_lock {
        FastPath {
            name: "locked memory (RLIMIT_MEMLOCK)",
            ok: true,
            detail: format!(
                "CAP_IPC_LOCK: the soft limit ({}) does not apply",
                limit_text(memlock.limit.and_then(|l| l.soft))
            ),
            fixes: vec![],
        }
    } else if memlock.sufficient {
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

/// GPUDirect RDMA via nvidia-peermem: the module loaded, and a GPU that does not report
/// GPUDirect RDMA off (the library refuses peermem on one that does: `path::decide`).
fn peermem_path(
    common: &[(String, String)],
    peermem: &PeermemStatus,
    devices: &[GpuInfo],
) -> FastPath {
    let mut peermem_own: Vec<(String, String)> = (!peermem.loaded)
        .then(|| {
            (
                "nvidia-peermem is not loaded (none of NCCL's three sysfs files exists)"
                    .to_string(),
                FIX_PEERMEM.to_string(),
            )
        })
        .into_iter()
        .collect();
    if !devices.is_empty()
        && devices
            .iter()
            .all(|d| d.gpu_direct_rdma_supported == Some(false))
    {
        peermem_own.push((
            "no GPU reports GPUDirect RDMA support \
             (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED=0)"
                .to_string(),
            FIX_GPU_RDMA.to_string(),
        ));
    }
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

#[cfg(test)]
mod tests {
    use dspark::internals::gpu::probe::{CudaProbe, MemlockLimit, VerbsLibrary};
    use dspark::internals::gpu::sysfs::{RdmaDevice, RdmaPort};

    use super::super::rdma::memlock_section;
    use super::*;

    /// A NIC with libibverbs and one ACTIVE port.
    fn rdma_ok() -> RdmaSection {
        RdmaSection {
            libibverbs: VerbsLibrary {
                path: Some("/usr/lib/libibverbs.so.1".into()),
                searched: vec![],
            },
            devices: vec![RdmaDevice {
                name: "mlx5_0".into(),
                node_type: None,
                fw_ver: None,
                pci: None,
                ports: vec![RdmaPort {
                    port: 1,
                    state: Some("4: ACTIVE".into()),
                    phys_state: None,
                    link_layer: None,
                    rate: None,
                    gids: vec![],
                    active_mtu: None,
                    mtu_note: String::new(),
                }],
            }],
            dma_buf: vec![],
        }
    }

    fn limit(soft: u64) -> dspark::Result<MemlockLimit> {
        Ok(MemlockLimit {
            soft: Some(soft),
            hard: Some(soft),
        })
    }

    fn no_gpu() -> (CudaSection, NvrtcSection) {
        (
            CudaSection {
                libcuda_loadable: false,
                probe: None,
                error: Some("no libcuda".into()),
                pci_gpus: vec![],
            },
            NvrtcSection {
                loadable: false,
                version: None,
                supported_archs: vec![],
                cache_dir: None,
                cache_writable: None,
                compile: vec![],
            },
        )
    }

    fn path<'a>(fast: &'a [FastPath], name: &str) -> &'a FastPath {
        fast.iter().find(|f| f.name == name).unwrap()
    }

    /// A process with CAP_IPC_LOCK (an RDMA container's usual set-up) under docker's 64 KiB
    /// default: no limit applies, as the verbs transport itself decides; without the
    /// capability, a limit that cannot hold one peer's buffers blocks the verbs transport
    /// (and so `--require verbs`), which was MET while the transport refused to start.
    #[test]
    fn memlock_follows_cap_ipc_lock_and_blocks_verbs_below_one_peer() {
        let (cuda, nvrtc) = no_gpu();
        let peermem = PeermemStatus {
            loaded: false,
            found: None,
            version: None,
            checked: vec![],
        };
        let capped = memlock_section(limit(64 << 10), true);
        let fast = fast_paths(&rdma_ok(), &capped, &cuda, &[], &peermem, &nvrtc);
        let m = path(&fast, "locked memory (RLIMIT_MEMLOCK)");
        assert!(m.ok && m.detail.contains("CAP_IPC_LOCK"), "{m:?}");
        assert!(path(&fast, "RDMA verbs transport").ok, "{fast:?}");

        let plain = memlock_section(limit(64 << 10), false);
        assert!(plain.verbs_bytes_per_peer > 64 << 10, "{plain:?}");
        let fast = fast_paths(&rdma_ok(), &plain, &cuda, &[], &peermem, &nvrtc);
        assert!(!path(&fast, "locked memory (RLIMIT_MEMLOCK)").ok);
        let v = path(&fast, "RDMA verbs transport");
        assert!(
            !v.ok && v.detail.contains("one peer's pinned buffers"),
            "{v:?}"
        );
        assert!(v.fixes.iter().any(|f| f.contains("ulimit -l")), "{v:?}");
        let met =
            super::super::summary::requirements(&[super::super::Requirement::Verbs], &fast, &[]);
        assert!(!met[0].met, "{:?}", met[0].reason);

        // The slots the advice says to shrink count: fewer, smaller slots pin less.
        use super::super::rdma::verbs_bytes_per_peer as per_peer;
        let default = per_peer(|_| None).unwrap();
        let fewer = per_peer(|k| match k {
            "DSPARK_IB_SLOTS" => Some("2".into()),
            "DSPARK_CHUNK_BYTES" => Some("64K".into()),
            _ => None,
        })
        .unwrap();
        assert!(0 < fewer && fewer < default, "{fewer} against {default}");
        // Settings init would refuse are said, not replaced by the defaults.
        let bad = per_peer(|k| (k == "DSPARK_IB_SLOTS").then(|| "1".into()));
        assert!(
            bad.as_ref().is_err_and(|e| e.contains("DSPARK_IB_SLOTS")),
            "{bad:?}"
        );

        // Enough for some peers, not the 1 GiB the GPU paths want: verbs says how many.
        let some = memlock_section(limit(64 << 20), false);
        let fast = fast_paths(&rdma_ok(), &some, &cuda, &[], &peermem, &nvrtc);
        let v = path(&fast, "RDMA verbs transport");
        let peers = (64u64 << 20) / some.verbs_bytes_per_peer;
        assert!(
            v.ok && v.detail.contains(&format!("holds {peers} peers'")),
            "{v:?}"
        );
    }

    /// nvidia-peermem loaded, but every GPU reports GPUDirect RDMA off (a GeForce): the
    /// library stages every pair, so the fast path is not "ready".
    #[test]
    fn peermem_is_unavailable_where_no_gpu_reports_gpudirect_rdma() {
        let (_, nvrtc) = no_gpu();
        let gpu = |rdma: Option<bool>| GpuInfo {
            ordinal: 0,
            name: "GPU".into(),
            compute_capability: (8, 6),
            pci: None,
            total_mem: None,
            sm_count: None,
            dma_buf_supported: Some(false),
            gpu_direct_rdma_supported: rdma,
        };
        let cuda = CudaSection {
            libcuda_loadable: true,
            probe: Some(CudaProbe {
                driver_version: Some((12, 8)),
                devices: vec![gpu(Some(false))],
                init_error: None,
            }),
            error: None,
            pci_gpus: vec![],
        };
        let peermem = PeermemStatus {
            loaded: true,
            found: Some("/sys/module/nvidia_peermem/version".into()),
            version: Some("1".into()),
            checked: vec![],
        };
        let memlock = memlock_section(
            Ok(MemlockLimit {
                soft: None,
                hard: None,
            }),
            false,
        );
        let with = |rdma: Option<bool>| {
            let fast = fast_paths(&rdma_ok(), &memlock, &cuda, &[gpu(rdma)], &peermem, &nvrtc);
            path(&fast, "GPUDirect RDMA via nvidia-peermem").clone()
        };
        let p = with(Some(false));
        assert!(
            !p.ok && p.detail.contains("GPU_DIRECT_RDMA_SUPPORTED=0"),
            "{p:?}"
        );
        assert!(with(Some(true)).ok, "{:?}", with(Some(true)));
    }
}
