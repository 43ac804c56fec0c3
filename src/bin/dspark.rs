//! `dspark`: tools around the library. `dspark doctor` explains what this machine can do —
//! RDMA, locked memory, CUDA, GPUDirect RDMA, NVRTC — and, for every fast path that is missing,
//! why and what to do.
//!
//! ```text
//! dspark doctor                        # human report; exits 0 on a machine with none of it
//! dspark doctor --json                 # the same facts for tools
//! dspark doctor --compile-kernels      # compile every reduction kernel with NVRTC (no GPU needed)
//! dspark doctor --compile-kernels --arch sm_90 --arch sm_80
//! dspark doctor --require gpu-direct   # exit 1, saying why, unless GPUDirect RDMA is usable
//! dspark tune                          # measure the cost model's constants, write the tune file
//! dspark tune --transport shm --out tune.json --quick
//! dspark model                         # predicted allreduce times and crossovers, 8..4096 ranks
//! dspark model --ranks 2,4 --local-ranks 4 --cores 2
//! ```

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use dspark::gpu::kernels;
use dspark::gpu::nvrtc::{self, CacheOrigin, DiskCache, GpuArch};
use dspark::gpu::probe::{self, CudaProbe, MemlockLimit, VerbsLibrary, MEMLOCK_MIN_BYTES};
use dspark::gpu::sysfs::{PciAddr, PciGpu, PcieDistance, PeermemStatus, RdmaDevice, Sysfs};
use dspark::path::{
    self, BufferLocation, GpuDirectCapability, GpuNicFacts, PathInputs, PathPolicy, TransportKind,
};
use dspark::transport::verbs::{probe_nic_dmabuf, NicDmaBuf};
use serde::Serialize;

// The CPU binding of dspark-bench's spawned ranks, which `dspark tune` gives its ranks too.
#[path = "bench/bind.rs"]
#[allow(dead_code)]
mod bind;
#[path = "tools/model.rs"]
mod model;
#[path = "tools/tune.rs"]
mod tune;

#[derive(Parser, Debug)]
#[command(
    name = "dspark",
    version,
    about = "dspark collective-communication tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Explain this machine: RDMA, locked memory, CUDA, GPUDirect RDMA, NVRTC, and the data
    /// path device buffers would take.
    Doctor(DoctorArgs),
    /// Measure the cost model's constants on this machine (α, β between 2 local ranks over
    /// the transport; γ of the reduction kernel) and write the tune file init reads.
    Tune(tune::TuneArgs),
    /// The cost model's predicted allreduce time per algorithm, size and world, and where the
    /// cheapest algorithm changes (from the tune file's constants, else the defaults).
    Model(model::ModelArgs),
    /// One rank of a `dspark tune` measurement (started by `dspark tune`).
    #[command(hide = true)]
    TuneRank(tune::RankArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Requirement {
    /// GPUDirect RDMA usable for at least one GPU/NIC pair.
    GpuDirect,
    /// The RDMA verbs transport (rdma-core and an active port).
    Verbs,
    /// A CUDA driver with at least one GPU.
    Cuda,
    /// NVRTC loadable (GPU reduction kernels can be compiled).
    Nvrtc,
}

#[derive(Args, Debug)]
struct DoctorArgs {
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Compile every reduction kernel with NVRTC (no GPU needed) and report the result; warms
    /// the kernel cache.
    #[arg(long)]
    compile_kernels: bool,
    /// Architecture(s) for --compile-kernels (sm_90, sm_80, compute_90, ...). Default: each GPU's
    /// own, or sm_90 without a GPU.
    #[arg(long, value_name = "ARCH", requires = "compile_kernels")]
    arch: Vec<String>,
    /// Exit with status 1, saying why, unless this is available (repeatable).
    #[arg(long, value_enum, value_name = "WHAT")]
    require: Vec<Requirement>,
    /// Read sysfs and library directories below this root instead of / (for tests).
    #[arg(long, hide = true, default_value = "/")]
    root: PathBuf,
}

/// One fast path: OK, or unavailable with the reason and the fix.
#[derive(Clone, Debug, Serialize)]
struct FastPath {
    name: &'static str,
    ok: bool,
    detail: String,
    fixes: Vec<String>,
}

#[derive(Debug, Serialize)]
struct RdmaSection {
    libibverbs: VerbsLibrary,
    devices: Vec<RdmaDevice>,
    /// Per device, whether it accepts dma-buf registrations (probed only on the real root
    /// with libibverbs present).
    dma_buf: Vec<NicDmaBuf>,
}

impl RdmaSection {
    fn dma_buf_of(&self, device: &str) -> Option<&NicDmaBuf> {
        self.dma_buf.iter().find(|d| d.device == device)
    }
}

#[derive(Debug, Serialize)]
struct MemlockSection {
    limit: Option<MemlockLimit>,
    error: Option<String>,
    minimum_bytes: u64,
    sufficient: bool,
}

#[derive(Debug, Serialize)]
struct CudaSection {
    libcuda_loadable: bool,
    probe: Option<CudaProbe>,
    error: Option<String>,
    /// NVIDIA GPUs on the PCI bus (seen even without a driver).
    pci_gpus: Vec<PciGpu>,
}

#[derive(Debug, Serialize)]
struct KernelCompile {
    arch: String,
    ok: bool,
    error: Option<String>,
    kernels_expected: usize,
    kernels_compiled: usize,
    spill_store_bytes: u64,
    spill_load_bytes: u64,
    max_registers: Option<u32>,
    origin: String,
    seconds: f64,
}

#[derive(Debug, Serialize)]
struct NvrtcSection {
    loadable: bool,
    version: Option<(i32, i32)>,
    supported_archs: Vec<u32>,
    cache_dir: Option<String>,
    cache_writable: Option<bool>,
    compile: Vec<KernelCompile>,
}

#[derive(Debug, Serialize)]
struct PairReport {
    gpu: String,
    gpu_pci: Option<String>,
    nic: String,
    distance: Option<PcieDistance>,
    distance_detail: String,
    /// What the hardware and drivers of this pair allow (what dspark uses).
    capability: GpuDirectCapability,
    /// The memory path device buffers take over verbs between two machines configured like
    /// this one.
    verbs_path: String,
    verbs_reason: Option<String>,
    fixes: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    rdma: RdmaSection,
    memlock: MemlockSection,
    cuda: CudaSection,
    peermem: PeermemStatus,
    nvrtc: NvrtcSection,
    pairs: Vec<PairReport>,
    tcp_device_path: String,
    fast_paths: Vec<FastPath>,
    notes: Vec<String>,
    requirements: Vec<RequirementResult>,
}

#[derive(Debug, Serialize)]
struct RequirementResult {
    requirement: Requirement,
    met: bool,
    reason: String,
}

const FIX_RDMA_CORE: &str =
    "install rdma-core (Debian/Ubuntu: apt-get install rdma-core ibverbs-providers; \
     RHEL/Rocky: dnf install rdma-core libibverbs)";
const FIX_NO_NIC: &str =
    "load the NIC's RDMA driver (mlx5_ib for NVIDIA/Mellanox; check `rdma link`), \
     or for a functional test create Soft-RoCE: rdma link add rxe0 type rxe netdev <eth>";
const FIX_PORT: &str = "check the link (`ibstat`, cable, switch port); InfiniBand also needs a subnet manager (opensm)";
const FIX_LIBCUDA: &str =
    "install the NVIDIA driver (check `nvidia-smi`); in a container run with --gpus all \
     (NVIDIA container toolkit)";
const FIX_NO_DEVICE: &str = "check `nvidia-smi` and CUDA_VISIBLE_DEVICES";
const FIX_PEERMEM: &str =
    "modprobe nvidia-peermem (ships with the NVIDIA driver; persist it in /etc/modules-load.d); \
     it must exist as /sys/module/nvidia_peermem/version";
const FIX_DMABUF: &str =
    "dma-buf needs the NVIDIA open kernel modules (driver >= 515) on Turing or newer, \
     Linux >= 5.12 and rdma-core >= 34";
const FIX_NIC_DMABUF: &str =
    "dma-buf registration needs a NIC driver that implements it (mlx5 on Linux >= 5.12 with \
     rdma-core >= 34); software RDMA (rxe, siw) never does: use nvidia-peermem there";
const FIX_DISTANCE: &str =
    "use a GPU that shares a PCIe switch with the NIC (`nvidia-smi topo -m`), or the closest \
     NIC (DSPARK_IB_DEVICE)";
const FIX_NVRTC: &str = "install NVRTC: the CUDA toolkit, or `pip install nvidia-cuda-nvrtc-cu12` \
     (tests/gpu/install_nvrtc.sh) and put its lib directory on LD_LIBRARY_PATH";
const FIX_MEMLOCK: &str = "`ulimit -l unlimited` before starting; persistent: `* - memlock unlimited` in \
     /etc/security/limits.conf; systemd services: LimitMEMLOCK=infinity; containers: --ulimit memlock=-1";

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn limit_text(v: Option<u64>) -> String {
    v.map_or("unlimited".to_string(), human_bytes)
}

fn dir_writable(dir: &Path) -> bool {
    if std::fs::create_dir_all(dir).is_err() {
        return false;
    }
    let probe = dir.join(format!(".dspark-doctor-{}", std::process::id()));
    let ok = std::fs::write(&probe, b"x").is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

/// Whether the verbs transport can run: `Err` lists every blocker with its fix.
fn verbs_usable(rdma: &RdmaSection) -> Result<String, Vec<(String, &'static str)>> {
    let mut blockers: Vec<(String, &'static str)> = Vec::new();
    if rdma.libibverbs.path.is_none() {
        blockers.push((
            "rdma-core's libibverbs.so.1 is not installed".into(),
            FIX_RDMA_CORE,
        ));
    }
    if rdma.devices.is_empty() {
        blockers.push((
            "no RDMA device under /sys/class/infiniband".into(),
            FIX_NO_NIC,
        ));
    }
    let active: Vec<String> = rdma
        .devices
        .iter()
        .flat_map(|d| {
            d.ports
                .iter()
                .filter(|p| p.is_active())
                .map(move |p| format!("{}:{}", d.name, p.port))
        })
        .collect();
    if !rdma.devices.is_empty() && active.is_empty() {
        let states: Vec<String> = rdma
            .devices
            .iter()
            .flat_map(|d| {
                d.ports.iter().map(move |p| {
                    format!(
                        "{}:{} {}",
                        d.name,
                        p.port,
                        p.state.as_deref().unwrap_or("?")
                    )
                })
            })
            .collect();
        blockers.push((
            format!("no RDMA port is ACTIVE ({})", states.join(", ")),
            FIX_PORT,
        ));
    }
    if blockers.is_empty() {
        Ok(format!("active port(s): {}", active.join(", ")))
    } else {
        Err(blockers)
    }
}

fn nic_usable(rdma: &RdmaSection, dev: &RdmaDevice) -> Result<(), (String, &'static str)> {
    if rdma.libibverbs.path.is_none() {
        return Err((
            "rdma-core's libibverbs.so.1 is not installed".into(),
            FIX_RDMA_CORE,
        ));
    }
    if !dev.ports.iter().any(|p| p.is_active()) {
        return Err((format!("{} has no ACTIVE port", dev.name), FIX_PORT));
    }
    Ok(())
}

/// The fixes for the blockers named in a capability's reason, in order, without repeats.
fn fixes_for_capability(why: &str) -> Vec<String> {
    let table: [(&str, &str); 7] = [
        ("CUDA driver", FIX_LIBCUDA),
        ("libibverbs", FIX_RDMA_CORE),
        ("ACTIVE", FIX_PORT),
        ("apart (", FIX_DISTANCE),
        ("refuse dma-buf registration", FIX_NIC_DMABUF),
        ("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED", FIX_DMABUF),
        ("nvidia-peermem is not loaded", FIX_PEERMEM),
    ];
    let mut out: Vec<String> = Vec::new();
    for (needle, fix) in table {
        if why.contains(needle) && !out.iter().any(|f| f == fix) {
            out.push(fix.to_string());
        }
    }
    out
}

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

/// The GPUs to pair with NICs: the driver's devices, else NVIDIA GPUs on the PCI bus.
struct GpuRef {
    label: String,
    pci: Option<PciAddr>,
    dma_buf: Option<bool>,
    rdma: Option<bool>,
    driver_missing: Option<String>,
}

fn build_report(args: &DoctorArgs) -> Result<Report, String> {
    let sysfs = Sysfs::new(&args.root);
    let on_real_root = args.root == Path::new("/");

    // RDMA
    let libibverbs = if on_real_root {
        probe::libibverbs()
    } else {
        probe::find_libibverbs(&args.root, None, None)
    };
    let devices = sysfs.rdma_devices();
    let dma_buf = if on_real_root && libibverbs.path.is_some() {
        devices.iter().map(|d| probe_nic_dmabuf(&d.name)).collect()
    } else {
        Vec::new()
    };
    let rdma = RdmaSection {
        libibverbs,
        devices,
        dma_buf,
    };

    // Locked memory
    let memlock = match probe::memlock_limit() {
        Ok(l) => MemlockSection {
            sufficient: l.sufficient(),
            limit: Some(l),
            error: None,
            minimum_bytes: MEMLOCK_MIN_BYTES,
        },
        Err(e) => MemlockSection {
            limit: None,
            error: Some(e.to_string()),
            minimum_bytes: MEMLOCK_MIN_BYTES,
            sufficient: false,
        },
    };

    // CUDA
    let libcuda_loadable = probe::libcuda_present();
    let (cuda_probe, cuda_error) = match probe::probe_cuda() {
        Ok(p) => (Some(p), None),
        Err(e) => (None, Some(e.to_string())),
    };
    let cuda = CudaSection {
        libcuda_loadable,
        probe: cuda_probe,
        error: cuda_error,
        pci_gpus: sysfs.pci_gpus(),
    };
    let devices = cuda
        .probe
        .as_ref()
        .map(|p| p.devices.clone())
        .unwrap_or_default();

    // nvidia-peermem
    let peermem = sysfs.peermem();

    // NVRTC
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

    // GPUs to pair with NICs.
    let gpus: Vec<GpuRef> = if !devices.is_empty() {
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
        let why = if !libcuda_loadable {
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
    };

    let mut pairs = Vec::new();
    for g in &gpus {
        for nic in &rdma.devices {
            let (distance, distance_detail) = match g.pci.map(|a| sysfs.distance(a, &nic.name)) {
                Some(Ok(r)) => (Some(r.distance), r.detail),
                Some(Err(e)) => (None, e),
                None => (None, "GPU PCI address unknown".to_string()),
            };
            let facts = path::gpu_direct_capability(&GpuNicFacts {
                nic_usable: nic_usable(&rdma, nic).map_err(|(w, _)| w),
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

    // Fast paths.
    let mut fast = Vec::new();
    let verbs = verbs_usable(&rdma);
    fast.push(match &verbs {
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
    });
    fast.push(if memlock.sufficient {
        FastPath {
            name: "locked memory (RLIMIT_MEMLOCK)",
            ok: true,
            detail: format!("soft limit {}", limit_text(memlock.limit.and_then(|l| l.soft))),
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
                    human_bytes(MEMLOCK_MIN_BYTES)
                ),
                (None, Some(e)) => e.clone(),
                (None, None) => "unknown".to_string(),
            },
            fixes: vec![FIX_MEMLOCK.to_string()],
        }
    });
    let cuda_fp = if !devices.is_empty() {
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
    } else if !libcuda_loadable {
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
    };
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
    let gdr = |name: &'static str, own: Vec<(String, String)>, ok_detail: String| {
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
    };
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
    fast.push(gdr(
        "GPUDirect RDMA via dma-buf",
        dma_buf_own,
        format!(
            "dma-buf export supported by {}; {nic_side}",
            dma_buf_gpus.join(", ")
        ),
    ));
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
    fast.push(gdr(
        "GPUDirect RDMA via nvidia-peermem",
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
    ));
    fast.push(if nvrtc_section.loadable {
        let v = nvrtc_section
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
    });

    let gpu_direct_pairs = pairs
        .iter()
        .filter(|p| !matches!(p.capability, GpuDirectCapability::Unavailable(_)))
        .count();
    let mut notes = vec![
        "paths per GPU/NIC pair assume the peer node is configured like this one; at init each \
         connection's path is decided from both ends' facts (comm.data_paths(), bench path column)"
            .to_string(),
        format!(
            "GPUDirect is not used beyond PCIe distance {} (NCCL's default limit) unless \
             DSPARK_DATA_PATH=gpu-direct asks for it",
            path::GDR_MAX_DISTANCE.short()
        ),
    ];
    let cuda_ok = fast.iter().any(|f| f.name == "CUDA GPUs" && f.ok);
    let policy = PathPolicy::from_env_with(|k| std::env::var(k).ok()).unwrap_or(PathPolicy::Auto);
    notes.extend(region_note(!pairs.is_empty(), cuda_ok, policy));
    if !on_real_root {
        notes.push(format!(
            "sysfs and library directories read below {}",
            args.root.display()
        ));
    }

    // Requirements.
    let mut requirements = Vec::new();
    for r in args.require.iter().copied().collect::<BTreeSet<_>>() {
        let find = |name: &str| {
            fast.iter()
                .find(|f| f.name == name)
                .map_or((false, format!("{name}: not probed")), |f| {
                    (f.ok, f.detail.clone())
                })
        };
        let (met, reason) = match r {
            Requirement::GpuDirect => {
                if gpu_direct_pairs > 0 {
                    (
                        true,
                        format!("{gpu_direct_pairs} GPU/NIC pair(s) can use GPUDirect RDMA"),
                    )
                } else if pairs.is_empty() {
                    let mut why: Vec<&str> = Vec::new();
                    for f in fast
                        .iter()
                        .filter(|f| !f.ok && f.name.starts_with("GPUDirect"))
                    {
                        for part in f.detail.split("; ") {
                            if !why.contains(&part) {
                                why.push(part);
                            }
                        }
                    }
                    (
                        false,
                        format!("no GPU/NIC pair on this machine: {}", why.join("; ")),
                    )
                } else {
                    let why: Vec<String> = pairs
                        .iter()
                        .map(|p| match &p.capability {
                            GpuDirectCapability::Unavailable(w) => {
                                format!("{} <-> {}: {w}", p.gpu, p.nic)
                            }
                            _ => String::new(),
                        })
                        .collect();
                    (false, why.join("; "))
                }
            }
            Requirement::Verbs => find("RDMA verbs transport"),
            Requirement::Cuda => find("CUDA GPUs"),
            Requirement::Nvrtc => find("GPU reduction kernels (NVRTC)"),
        };
        requirements.push(RequirementResult {
            requirement: r,
            met,
            reason,
        });
    }

    Ok(Report {
        rdma,
        memlock,
        cuda,
        peermem,
        nvrtc: nvrtc_section,
        pairs,
        tcp_device_path: format!("tcp/staged: {}", path::TCP_STAGED_REASON),
        fast_paths: fast,
        notes,
        requirements,
    })
}

fn kv(out: &mut String, label: &str, value: impl AsRef<str>) {
    let dots = 36usize.saturating_sub(label.chars().count() + 1);
    out.push_str(&format!(
        "  {label} {} {}\n",
        ".".repeat(dots.max(2)),
        value.as_ref()
    ));
}

fn render_human(r: &Report) -> String {
    let mut o = String::new();
    o.push_str("dspark doctor: what this machine can do for collectives, and why not\n\n");

    o.push_str("RDMA (verbs)\n");
    match &r.rdma.libibverbs.path {
        Some(p) => kv(&mut o, "libibverbs.so.1", format!("found: {p}")),
        None => kv(
            &mut o,
            "libibverbs.so.1",
            format!(
                "NOT FOUND (searched {})",
                r.rdma.libibverbs.searched.join(", ")
            ),
        ),
    }
    if r.rdma.devices.is_empty() {
        kv(&mut o, "devices", "none under /sys/class/infiniband");
    }
    for d in &r.rdma.devices {
        let pci = d
            .pci
            .as_ref()
            .and_then(|p| p.chain.last())
            .map_or("no PCI device (software RDMA)".to_string(), |a| {
                format!("PCI {a}")
            });
        kv(
            &mut o,
            &format!("device {}", d.name),
            format!(
                "{pci}{}",
                d.fw_ver
                    .as_ref()
                    .filter(|f| !f.is_empty())
                    .map(|f| format!(", firmware {f}"))
                    .unwrap_or_default()
            ),
        );
        if let Some(b) = r.rdma.dma_buf_of(&d.name) {
            let verdict = match b.supported {
                Some(true) => "accepted",
                Some(false) => "REFUSED",
                None => "unknown",
            };
            kv(
                &mut o,
                "  dma-buf registration",
                format!("{verdict}: {}", b.detail),
            );
        }
        for p in &d.ports {
            kv(
                &mut o,
                &format!("  port {}", p.port),
                format!(
                    "state {}, phys {}, link layer {}, rate {}",
                    p.state.as_deref().unwrap_or("?"),
                    p.phys_state.as_deref().unwrap_or("?"),
                    p.link_layer.as_deref().unwrap_or("?"),
                    p.rate.as_deref().unwrap_or("?")
                ),
            );
            kv(
                &mut o,
                "    MTU",
                p.active_mtu
                    .map_or(p.mtu_note.clone(), |m| format!("{m} ({})", p.mtu_note)),
            );
            if p.gids.is_empty() {
                kv(&mut o, "    GIDs", "none populated");
            }
            for g in &p.gids {
                kv(
                    &mut o,
                    &format!("    GID {}", g.index),
                    format!(
                        "{} {}{}",
                        g.gid,
                        g.kind.as_deref().unwrap_or(""),
                        g.netdev
                            .as_ref()
                            .map(|n| format!(" ({n})"))
                            .unwrap_or_default()
                    ),
                );
            }
        }
    }

    o.push_str("\nLocked memory\n");
    match (&r.memlock.limit, &r.memlock.error) {
        (Some(l), _) => kv(
            &mut o,
            "RLIMIT_MEMLOCK",
            format!(
                "soft {}, hard {}{}",
                limit_text(l.soft),
                limit_text(l.hard),
                if r.memlock.sufficient {
                    String::new()
                } else {
                    format!(": below {}", human_bytes(r.memlock.minimum_bytes))
                }
            ),
        ),
        (None, Some(e)) => kv(&mut o, "RLIMIT_MEMLOCK", format!("unreadable: {e}")),
        _ => {}
    }

    o.push_str("\nCUDA\n");
    kv(
        &mut o,
        "libcuda.so",
        if r.cuda.libcuda_loadable {
            "loadable"
        } else {
            "NOT LOADABLE"
        },
    );
    if let Some(p) = &r.cuda.probe {
        kv(
            &mut o,
            "driver API version",
            p.driver_version
                .map_or("?".to_string(), |(a, b)| format!("{a}.{b}")),
        );
        if let Some(e) = &p.init_error {
            kv(&mut o, "cuInit", e);
        }
        for d in &p.devices {
            let flag = |v: Option<bool>| match v {
                Some(true) => "yes",
                Some(false) => "no",
                None => "unknown (driver too old)",
            };
            kv(
                &mut o,
                &format!("GPU{}", d.ordinal),
                format!(
                    "{}, compute capability {}.{}, PCI {}, {} SMs, {}",
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.pci.map_or("?".to_string(), |a| a.to_string()),
                    d.sm_count.unwrap_or(0),
                    d.total_mem
                        .map_or("?".to_string(), |m| human_bytes(m as u64))
                ),
            );
            kv(&mut o, "  dma-buf supported", flag(d.dma_buf_supported));
            kv(
                &mut o,
                "  GPUDirect RDMA supported",
                flag(d.gpu_direct_rdma_supported),
            );
        }
    }
    if r.cuda.pci_gpus.is_empty() {
        kv(&mut o, "NVIDIA GPUs on PCI bus", "none");
    } else {
        for g in &r.cuda.pci_gpus {
            kv(
                &mut o,
                &format!("PCI GPU {}", g.addr),
                format!(
                    "kernel driver: {}",
                    g.driver.as_deref().unwrap_or("none bound")
                ),
            );
        }
    }

    o.push_str("\nnvidia-peermem\n");
    match &r.peermem.found {
        Some(f) => kv(
            &mut o,
            "module",
            format!(
                "loaded ({f}{})",
                r.peermem
                    .version
                    .as_ref()
                    .map(|v| format!(", {v}"))
                    .unwrap_or_default()
            ),
        ),
        None => kv(
            &mut o,
            "module",
            format!("not loaded (checked {})", r.peermem.checked.join(", ")),
        ),
    }

    o.push_str("\nNVRTC (GPU reduction kernels)\n");
    kv(
        &mut o,
        "libnvrtc.so",
        if r.nvrtc.loadable {
            "loadable"
        } else {
            "NOT LOADABLE"
        },
    );
    if let Some((a, b)) = r.nvrtc.version {
        kv(&mut o, "version", format!("{a}.{b}"));
    }
    if !r.nvrtc.supported_archs.is_empty() {
        let archs: Vec<String> = r
            .nvrtc
            .supported_archs
            .iter()
            .map(|a| format!("sm_{a}"))
            .collect();
        kv(&mut o, "architectures", archs.join(" "));
    }
    kv(
        &mut o,
        "kernel cache",
        match (&r.nvrtc.cache_dir, r.nvrtc.cache_writable) {
            (Some(d), Some(true)) => format!("{d} (writable)"),
            (Some(d), _) => format!("{d} (NOT writable: kernels are recompiled in every process)"),
            (None, _) => "none (set DSPARK_CACHE_DIR)".to_string(),
        },
    );
    for c in &r.nvrtc.compile {
        if c.ok {
            kv(
                &mut o,
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
                &mut o,
                &format!("compile {}", c.arch),
                format!("FAILED: {}", c.error.as_deref().unwrap_or("?")),
            );
        }
    }

    o.push_str("\nGPU <-> NIC\n");
    if r.pairs.is_empty() {
        kv(
            &mut o,
            "pairs",
            "none (needs both a GPU and an RDMA device)",
        );
    }
    for p in &r.pairs {
        kv(
            &mut o,
            &format!("{} <-> {}", p.gpu, p.nic),
            match p.distance {
                Some(d) => format!("{} ({}): {}", d.short(), d.describe(), p.distance_detail),
                None => format!("distance unknown: {}", p.distance_detail),
            },
        );
    }

    o.push_str("\nFast paths\n");
    for f in &r.fast_paths {
        if f.ok {
            kv(&mut o, f.name, format!("OK: {}", f.detail));
        } else {
            kv(&mut o, f.name, format!("UNAVAILABLE: {}", f.detail));
            for fix in &f.fixes {
                o.push_str(&format!("      -> {fix}\n"));
            }
        }
    }

    o.push_str("\nResulting data path for GPU buffers\n");
    kv(&mut o, "over TCP", &r.tcp_device_path);
    if r.pairs.is_empty() {
        kv(
            &mut o,
            "over verbs",
            "no GPU/NIC pair: device buffers cannot use GPUDirect RDMA here",
        );
    }
    for p in &r.pairs {
        let text = match &p.verbs_reason {
            None => format!("{}: GPUDirect RDMA", p.verbs_path),
            Some(why) => format!("{}: {why}", p.verbs_path),
        };
        kv(&mut o, &format!("{} <-> {}", p.gpu, p.nic), text);
        for fix in &p.fixes {
            o.push_str(&format!("      -> {fix}\n"));
        }
    }
    for n in &r.notes {
        o.push_str(&format!("  note: {n}\n"));
    }
    for q in &r.requirements {
        let name = q
            .requirement
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default();
        o.push_str(&format!(
            "\nrequire {name}: {}: {}\n",
            if q.met { "MET" } else { "NOT MET" },
            q.reason
        ));
    }
    o
}

fn doctor(args: &DoctorArgs) -> ExitCode {
    let report = match build_report(args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dspark doctor: {e}");
            return ExitCode::from(2);
        }
    };
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("dspark doctor: cannot serialise the report: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        print!("{}", render_human(&report));
    }
    let mut failed = false;
    for q in report.requirements.iter().filter(|q| !q.met) {
        let name = q
            .requirement
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default();
        eprintln!("dspark doctor: requirement {name} not met: {}", q.reason);
        failed = true;
    }
    for c in report.nvrtc.compile.iter().filter(|c| !c.ok) {
        eprintln!(
            "dspark doctor: compiling the kernels for {} failed: {}",
            c.arch,
            c.error.as_deref().unwrap_or("?")
        );
        failed = true;
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DSPARK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
    let cli = Cli::parse();
    match &cli.command {
        Command::Doctor(args) => doctor(args),
        Command::Tune(args) => tune::tune_main(args),
        Command::Model(args) => model::model_main(args),
        Command::TuneRank(args) => tune::rank_main(args),
    }
}

/// What a communicator's init allocates on this machine for GPUDirect (issue #11 item 7), when
/// that is anything to say: on a machine with a GPU/NIC pair and a usable CUDA driver, a CUDA
/// context and the direct region, unless `DSPARK_DATA_PATH=host-staged`.
fn region_note(has_pair: bool, cuda_ok: bool, policy: PathPolicy) -> Option<String> {
    if !has_pair || !cuda_ok {
        return None;
    }
    Some(if policy == PathPolicy::HostStaged {
        "DSPARK_DATA_PATH=host-staged is set: a communicator creates no CUDA context and \
         allocates no GPU memory at init"
            .to_string()
    } else {
        format!(
            "at init a communicator over verbs here creates a CUDA context and allocates a \
             GPUDirect region (world x slots x segment bytes of GPU memory per rank; \
             DSPARK_DATA_PATH={policy}), kept only when every rank registered one; a job that \
             never passes GPU memory sets DSPARK_DATA_PATH=host-staged to allocate none \
             (CommInfo::direct_region and the bench header's `gpu region` line say what init \
             did)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doctor_says_init_allocates_a_gpu_region_only_where_it_would_and_how_to_avoid_it() {
        let auto = region_note(true, true, PathPolicy::Auto).unwrap();
        assert!(
            auto.contains("allocates a GPUDirect region")
                && auto.contains("DSPARK_DATA_PATH=host-staged to allocate none"),
            "{auto}"
        );
        let staged = region_note(true, true, PathPolicy::HostStaged).unwrap();
        assert!(
            staged.contains("no CUDA context") && staged.contains("no GPU memory"),
            "{staged}"
        );
        assert_eq!(
            region_note(true, false, PathPolicy::Auto),
            None,
            "no driver"
        );
        assert_eq!(region_note(false, true, PathPolicy::Auto), None, "no pair");
    }
}
