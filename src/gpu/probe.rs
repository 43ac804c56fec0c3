//! Probes of this machine: the CUDA driver and its GPUs, RLIMIT_MEMLOCK, rdma-core's
//! libibverbs.
//!
//! The CUDA probe loads libcuda only after [`libcuda_present`] says it can be loaded, and checks
//! that every driver entry point it calls is exported before calling it (cudarc panics on a
//! missing library or symbol). A machine without a driver gets [`Error::Unavailable`]; a driver
//! without a GPU gets a probe with no devices and the driver's reason.

use std::ffi::c_int;
use std::path::{Path, PathBuf};

use super::cuda::driver::{self, require_driver_symbols, CUdevice_attribute as A};
use super::sysfs::PciAddr;
use crate::error::{Error, Result};

pub use super::cuda::driver::{libcuda_present, NO_LIBCUDA};

const PROBE_SYMBOLS: [&str; 9] = [
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetPCIBusId",
    "cuGetErrorString",
];

/// One CUDA device as the driver describes it.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// PCI address (from cuDeviceGetPCIBusId).
    pub pci: Option<PciAddr>,
    /// Total memory in bytes.
    pub total_mem: Option<usize>,
    /// Number of SMs.
    pub sm_count: Option<i32>,
    /// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (`None`: the driver does not know the attribute).
    pub dma_buf_supported: Option<bool>,
    /// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (`None`: unknown to this driver).
    pub gpu_direct_rdma_supported: Option<bool>,
}

/// What the CUDA driver reports.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaProbe {
    /// Driver API version `(major, minor)` (e.g. 12.8).
    pub driver_version: Option<(i32, i32)>,
    /// The devices.
    pub devices: Vec<GpuInfo>,
    /// Why there are no devices (cuInit's error, e.g. CUDA_ERROR_NO_DEVICE), if so.
    pub init_error: Option<String>,
}

/// Probes the CUDA driver: version and every device. [`Error::Unavailable`] without libcuda.
pub fn probe_cuda() -> Result<CudaProbe> {
    require_driver_symbols(&PROBE_SYMBOLS)?;
    let driver_version = driver::driver_version().map(|v| (v / 1000, (v % 1000) / 10));
    if let Err(reason) = driver::init() {
        return Ok(CudaProbe {
            driver_version,
            devices: Vec::new(),
            init_error: Some(reason),
        });
    }
    let count = driver::device_count()?;
    let mut devices = Vec::new();
    for ordinal in 0..count.max(0) {
        devices.push(device_info(ordinal)?);
    }
    Ok(CudaProbe {
        driver_version,
        devices,
        init_error: None,
    })
}

fn device_info(ordinal: c_int) -> Result<GpuInfo> {
    let dev = driver::device_get(ordinal)?;
    let name = driver::device_name(dev)?;
    let pci = driver::device_pci_bus_id(dev).and_then(|b| PciAddr::parse(&b));
    let total_mem = driver::device_total_mem(dev);
    let attribute = |attr| driver::device_attribute(dev, attr);
    let major = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).unwrap_or(0);
    let minor = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).unwrap_or(0);
    Ok(GpuInfo {
        ordinal: ordinal as usize,
        name,
        compute_capability: (major, minor),
        pci,
        total_mem,
        sm_count: attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        dma_buf_supported: attribute(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED).map(|v| v != 0),
        gpu_direct_rdma_supported: attribute(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)
            .map(|v| v != 0),
    })
}

/// RLIMIT_MEMLOCK of this process.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemlockLimit {
    /// Soft limit in bytes (`None` = unlimited).
    pub soft: Option<u64>,
    /// Hard limit in bytes (`None` = unlimited).
    pub hard: Option<u64>,
}

/// The smallest RLIMIT_MEMLOCK that dspark considers enough: registered buffers and staging
/// areas of a few hundred MiB per connection need far more than the usual 8 MiB default.
pub const MEMLOCK_MIN_BYTES: u64 = 1 << 30;

impl MemlockLimit {
    /// Whether the soft limit is at least [`MEMLOCK_MIN_BYTES`].
    pub fn sufficient(&self) -> bool {
        self.soft.is_none_or(|s| s >= MEMLOCK_MIN_BYTES)
    }
}

/// Reads RLIMIT_MEMLOCK.
pub fn memlock_limit() -> Result<MemlockLimit> {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    let (soft, hard) = getrlimit(Resource::RLIMIT_MEMLOCK).map_err(|e| {
        Error::io(
            None,
            None,
            "getrlimit(RLIMIT_MEMLOCK)",
            std::io::Error::from(e),
        )
    })?;
    let f = |v: u64| (v != RLIM_INFINITY).then_some(v);
    Ok(MemlockLimit {
        soft: f(soft),
        hard: f(hard),
    })
}

/// Where rdma-core's libibverbs was found.
#[cfg_attr(feature = "cli", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsLibrary {
    /// The path of `libibverbs.so.1`, if found.
    pub path: Option<String>,
    /// Where it was looked for.
    pub searched: Vec<String>,
}

/// Library directories searched for `libibverbs.so.1` (besides `ldconfig -p` and
/// `LD_LIBRARY_PATH`).
pub const LIB_DIRS: [&str; 8] = [
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib64",
    "usr/local/lib",
];

/// Finds `libibverbs.so.1` in `ldconfig_output` (the text of `ldconfig -p`, if available), the
/// `LD_LIBRARY_PATH` directories, and [`LIB_DIRS`] below `root`.
pub fn find_libibverbs(
    root: &Path,
    ldconfig_output: Option<&str>,
    ld_library_path: Option<&str>,
) -> VerbsLibrary {
    const NAME: &str = "libibverbs.so.1";
    let mut searched = Vec::new();
    if let Some(out) = ldconfig_output {
        searched.push("ldconfig -p".to_string());
        for line in out.lines() {
            let l = line.trim();
            if l.starts_with(NAME) {
                if let Some((_, path)) = l.rsplit_once("=> ") {
                    return VerbsLibrary {
                        path: Some(path.trim().to_string()),
                        searched,
                    };
                }
            }
        }
    }
    let mut dirs: Vec<PathBuf> = ld_library_path
        .unwrap_or("")
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| root.join(d.trim_start_matches('/')))
        .collect();
    dirs.extend(LIB_DIRS.iter().map(|d| root.join(d)));
    for d in dirs {
        let p = d.join(NAME);
        searched.push(d.display().to_string());
        if p.exists() {
            return VerbsLibrary {
                path: Some(p.display().to_string()),
                searched,
            };
        }
    }
    VerbsLibrary {
        path: None,
        searched,
    }
}

/// [`find_libibverbs`] on this machine (runs `ldconfig -p` when it exists).
pub fn libibverbs() -> VerbsLibrary {
    let ldconfig = ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"]
        .iter()
        .find_map(|c| std::process::Command::new(c).arg("-p").output().ok())
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let ld = std::env::var("LD_LIBRARY_PATH").ok();
    find_libibverbs(Path::new("/"), ldconfig.as_deref(), ld.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libibverbs_is_found_through_ldconfig_then_library_dirs() {
        let ld = "1234 libs found in cache `/etc/ld.so.cache'\n\
                  \tlibibverbs.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libibverbs.so.1\n";
        let v = find_libibverbs(Path::new("/nonexistent-root"), Some(ld), None);
        assert_eq!(
            v.path.as_deref(),
            Some("/usr/lib/x86_64-linux-gnu/libibverbs.so.1")
        );

        let root = std::env::temp_dir().join(format!("dspark-probe-verbs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("opt/rdma/lib")).unwrap();
        std::fs::write(root.join("opt/rdma/lib/libibverbs.so.1"), b"").unwrap();
        let v = find_libibverbs(&root, Some("0 libs found\n"), Some("/opt/rdma/lib"));
        assert!(v.path.unwrap().ends_with("opt/rdma/lib/libibverbs.so.1"));
        let v = find_libibverbs(&root, None, None);
        assert!(v.path.is_none());
        assert!(v.searched.iter().any(|s| s.ends_with("usr/lib64")));
        std::fs::create_dir_all(root.join("usr/lib64")).unwrap();
        std::fs::write(root.join("usr/lib64/libibverbs.so.1"), b"").unwrap();
        assert!(find_libibverbs(&root, None, None)
            .path
            .unwrap()
            .ends_with("usr/lib64/libibverbs.so.1"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn memlock_is_readable_and_judged_against_one_gib() {
        let m = memlock_limit().unwrap();
        assert!(m.soft.is_none() || m.soft <= m.hard || m.hard.is_none());
        assert!(MemlockLimit {
            soft: None,
            hard: None
        }
        .sufficient());
        assert!(!MemlockLimit {
            soft: Some(8 << 20),
            hard: None
        }
        .sufficient());
        assert!(MemlockLimit {
            soft: Some(2 << 30),
            hard: Some(2 << 30)
        }
        .sufficient());
    }

    #[test]
    fn cuda_probe_without_a_driver_is_unavailable_not_a_panic() {
        if libcuda_present() {
            eprintln!("skipped: libcuda is present on this machine");
            return;
        }
        match probe_cuda() {
            Err(Error::Unavailable { reason, .. }) => {
                assert!(reason.contains("libcuda"), "{reason}")
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}
