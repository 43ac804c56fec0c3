//! The doctor's GPU side: the CUDA section (the driver, its devices with their dma-buf and
//! GPUDirect RDMA attributes, NVIDIA GPUs seen on the PCI bus even without a driver), the
//! nvidia-peermem module, and the NVRTC section (the library, its architectures, the kernel
//! cache, and `--compile-kernels`' results): what is probed and how it reads in the report.

use std::collections::BTreeSet;
use std::path::Path;

use dspark::internals::gpu::kernels;
use dspark::internals::gpu::nvrtc::{self, CacheOrigin, DiskCache, GpuArch};
use dspark::internals::gpu::probe::{self, CudaProbe, GpuInfo};
use dspark::internals::gpu::sysfs::{PciGpu, PeermemStatus, Sysfs};
use serde::Serialize;

use super::{kv, rounded_bytes, DoctorArgs};

#[derive(Debug, Serialize)]
pub(super) struct CudaSection {
    pub(super) libcuda_loadable: bool,
    pub(super) probe: Option<CudaProbe>,
    pub(super) error: Option<String>,
    /// NVIDIA GPUs on the PCI bus (seen even without a driver).
    pub(super) pci_gpus: Vec<PciGpu>,
}

#[derive(Debug, Serialize)]
pub(super) struct KernelCompile {
    pub(super) arch: String,
    pub(super) ok: bool,
    pub(super) error: Option<String>,
    pub(super) kernels_expected: usize,
    pub(super) kernels_compiled: usize,
    pub(super) spill_store_bytes: u64,
    pub(super) spill_load_bytes: u64,
    pub(super) max_registers: Option<u32>,
    pub(super) origin: String,
    pub(super) seconds: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct NvrtcSection {
    pub(super) loadable: bool,
    pub(super) version: Option<(i32, i32)>,
    pub(super) supported_archs: Vec<u32>,
    pub(super) cache_dir: Option<String>,
    pub(super) cache_writable: Option<bool>,
    pub(super) compile: Vec<KernelCompile>,
}

impl CudaSection {
    /// The driver's devices (none without a usable driver).
    pub(super) fn devices(&self) -> Vec<GpuInfo> {
        self.probe
            .as_ref()
            .map(|p| p.devices.clone())
            .unwrap_or_default()
    }
}

/// The CUDA section: whether libcuda loads, the driver's devices, and NVIDIA GPUs in sysfs.
pub(super) fn probe_cuda_section(sysfs: &Sysfs) -> CudaSection {
    let libcuda_loadable = probe::libcuda_present();
    let (cuda_probe, cuda_error) = match probe::probe_cuda() {
        Ok(p) => (Some(p), None),
        Err(e) => (None, Some(e.to_string())),
    };
    CudaSection {
        libcuda_loadable,
        probe: cuda_probe,
        error: cuda_error,
        pci_gpus: sysfs.pci_gpus(),
    }
}

/// The NVRTC section; with `--compile-kernels`, every reduction kernel compiled for the
/// `--arch` list, else for each GPU's own architecture (sm_90 without a GPU).
pub(super) fn probe_nvrtc(args: &DoctorArgs, devices: &[GpuInfo]) -> Result<NvrtcSection, String> {
    let nvrtc_loadable = nvrtc::libnvrtc_present();
    let cache_dir = nvrtc::cache_dir();
    let mut nvrtc_section = NvrtcSection {
        loadable: nvrtc_loadable,
        version: nvrtc::version().ok(),
        supported_archs: nvrtc::supported_archs().unwrap_or_default(),
        cache_writable: cache_dir.as_deref().map(dir_writable),
        cache_dir: cache_dir.map(|d| d.display().to_string()),
        compile: Vec::new(),
    };
    if args.compile_kernels {
        let mut archs: Vec<GpuArch> = Vec::new();
        for a in &args.arch {
            archs.push(a.parse::<GpuArch>().map_err(|e| e.to_string())?);
        }
        if archs.is_empty() {
            let ccs: BTreeSet<(i32, i32)> = devices.iter().map(|d| d.compute_capability).collect();
            for (ma, mi) in ccs {
                let arch = kernels::choose_arch(
                    (ma.max(0) as u32, mi.max(0) as u32),
                    &nvrtc_section.supported_archs,
                )
                .unwrap_or(GpuArch::sm(ma.max(0) as u32, mi.max(0) as u32));
                archs.push(arch);
            }
            if archs.is_empty() {
                archs.push(GpuArch::sm(9, 0));
            }
        }
        nvrtc_section.compile = compile_kernels(&archs);
    }
    Ok(nvrtc_section)
}

/// Whether a file can be created in `dir` (made if missing): the kernel cache's test.
fn dir_writable(dir: &Path) -> bool {
    if std::fs::create_dir_all(dir).is_err() {
        return false;
    }
    let probe = dir.join(format!(".dspark-doctor-{}", std::process::id()));
    let ok = std::fs::write(&probe, b"x").is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

/// `--compile-kernels`: every reduction kernel for each architecture, timed, with its
/// register use and spills, and where the module came from (compiled now or a cache).
fn compile_kernels(archs: &[GpuArch]) -> Vec<KernelCompile> {
    archs
        .iter()
        .map(|&arch| {
            let start = std::time::Instant::now();
            match kernels::compile_all(arch, &DiskCache::FromEnv) {
                Ok(b) => {
                    let (s, l) = b.spill_bytes();
                    KernelCompile {
                        arch: arch.to_string(),
                        ok: true,
                        error: None,
                        kernels_expected: b.expected,
                        kernels_compiled: b.found,
                        spill_store_bytes: s,
                        spill_load_bytes: l,
                        max_registers: b.max_registers(),
                        origin: match &b.compiled.origin {
                            CacheOrigin::Compiled => "compiled now".to_string(),
                            CacheOrigin::Process => "process cache".to_string(),
                            CacheOrigin::Disk(p) => format!("disk cache {}", p.display()),
                        },
                        seconds: start.elapsed().as_secs_f64(),
                    }
                }
                Err(e) => KernelCompile {
                    arch: arch.to_string(),
                    ok: false,
                    error: Some(e.to_string()),
                    kernels_expected: kernels::all_kernels().len(),
                    kernels_compiled: 0,
                    spill_store_bytes: 0,
                    spill_load_bytes: 0,
                    max_registers: None,
                    origin: String::new(),
                    seconds: start.elapsed().as_secs_f64(),
                },
            }
        })
        .collect()
}

/// The human report's "CUDA" section: the driver, each device, the GPUs on the PCI bus.
pub(super) fn render_cuda(o: &mut String, cuda: &CudaSection) {
    o.push_str("\nCUDA\n");
    kv(
        o,
        "libcuda.so",
        if cuda.libcuda_loadable {
            "loadable"
        } else {
            "NOT LOADABLE"
        },
    );
    if let Some(p) = &cuda.probe {
        kv(
            o,
            "driver API version",
            p.driver_version
                .map_or("?".to_string(), |(a, b)| format!("{a}.{b}")),
        );
        if let Some(e) = &p.init_error {
            kv(o, "cuInit", e);
        }
        for d in &p.devices {
            let flag = |v: Option<bool>| match v {
                Some(true) => "yes",
                Some(false) => "no",
                None => "unknown (driver too old)",
            };
            kv(
                o,
                &format!("GPU{}", d.ordinal),
                format!(
                    "{}, compute capability {}.{}, PCI {}, {} SMs, {}",
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.pci.map_or("?".to_string(), |a| a.to_string()),
                    d.sm_count.unwrap_or(0),
                    d.total_mem
                        .map_or("?".to_string(), |m| rounded_bytes(m as u64))
                ),
            );
            kv(o, "  dma-buf supported", flag(d.dma_buf_supported));
            kv(
                o,
                "  GPUDirect RDMA supported",
                flag(d.gpu_direct_rdma_supported),
            );
        }
    }
    if cuda.pci_gpus.is_empty() {
        kv(o, "NVIDIA GPUs on PCI bus", "none");
    } else {
        for g in &cuda.pci_gpus {
            kv(
                o,
                &format!("PCI GPU {}", g.addr),
                format!(
                    "kernel driver: {}",
                    g.driver.as_deref().unwrap_or("none bound")
                ),
            );
        }
    }
}

/// The human report's "nvidia-peermem" section.
pub(super) fn render_peermem(o: &mut String, peermem: &PeermemStatus) {
    o.push_str("\nnvidia-peermem\n");
    match &peermem.found {
        Some(f) => kv(
            o,
            "module",
            format!(
                "loaded ({f}{})",
                peermem
                    .version
                    .as_ref()
                    .map(|v| format!(", {v}"))
                    .unwrap_or_default()
            ),
        ),
        None => kv(
            o,
            "module",
            format!("not loaded (checked {})", peermem.checked.join(", ")),
        ),
    }
}

/// The human report's "NVRTC (GPU reduction kernels)" section, with `--compile-kernels`' lines.
pub(super) fn render_nvrtc(o: &mut String, nvrtc: &NvrtcSection) {
    o.push_str("\nNVRTC (GPU reduction kernels)\n");
    kv(
        o,
        "libnvrtc.so",
        if nvrtc.loadable {
            "loadable"
        } else {
            "NOT LOADABLE"
        },
    );
    if let Some((a, b)) = nvrtc.version {
        kv(o, "version", format!("{a}.{b}"));
    }
    if !nvrtc.supported_archs.is_empty() {
        let archs: Vec<String> = nvrtc
            .supported_archs
            .iter()
            .map(|a| format!("sm_{a}"))
            .collect();
        kv(o, "architectures", archs.join(" "));
    }
    kv(
        o,
        "kernel cache",
        match (&nvrtc.cache_dir, nvrtc.cache_writable) {
            (Some(d), Some(true)) => format!("{d} (writable)"),
            (Some(d), _) => format!("{d} (NOT writable: kernels are recompiled in every process)"),
            (None, _) => "none (set DSPARK_CACHE_DIR)".to_string(),
        },
    );
    for c in &nvrtc.compile {
        if c.ok {
            kv(
                o,
                &format!("compile {}", c.arch),
                format!(
                    "{}/{} kernels compiled, spill stores {} B, spill loads {} B, max {} registers, {} ({:.1} s)",
                    c.kernels_compiled,
                    c.kernels_expected,
                    c.spill_store_bytes,
                    c.spill_load_bytes,
                    c.max_registers.unwrap_or(0),
                    c.origin,
                    c.seconds
                ),
            );
        } else {
            kv(
                o,
                &format!("compile {}", c.arch),
                format!("FAILED: {}", c.error.as_deref().unwrap_or("?")),
            );
        }
    }
}
