//! Probes of this machine: the CUDA driver and its GPUs, RLIMIT_MEMLOCK, rdma-core's
//! libibverbs.
//!
//! The CUDA probe loads libcuda only after [`libcuda_present`] says it can be loaded, and checks
//! that every driver entry point it calls is exported before calling it (cudarc panics on a
//! missing library or symbol). A machine without a driver gets [`Error::Unavailable`]; a driver
//! without a GPU gets a probe with no devices and the driver's reason.

use std::ffi::{c_char, c_int, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::driver::sys;
use serde::Serialize;

use super::sysfs::PciAddr;
use crate::error::{Error, Result};

/// Whether libcuda (the CUDA driver library) can be loaded on this machine.
pub fn libcuda_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's fixed list of names for the
        // driver library and closes what it opens; it is unsafe because loading a library runs
        // its initialisers, which for libcuda is the vendor's intended use.
        unsafe { sys::is_culib_present() }
    })
}

/// Why libcuda is missing, and what to do, in one sentence.
pub const NO_LIBCUDA: &str = "libcuda.so (the NVIDIA driver's CUDA library) could not be loaded: \
    no NVIDIA driver is installed, or the container does not expose it (--gpus / nvidia-container-toolkit)";

/// Checks that the driver exports every function in `names` (so that cudarc's loader cannot
/// panic on a missing symbol).
pub(crate) fn require_driver_symbols(names: &[&str]) -> Result<()> {
    if !libcuda_present() {
        return Err(Error::unavailable("CUDA", NO_LIBCUDA));
    }
    for name in names {
        // SAFETY: libcuda is present, so `culib()` loads it without panicking; looking a symbol up
        // only reads the library's symbol table and the returned pointer is dropped unused.
        let found = unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(name.as_bytes())
                .is_ok()
        };
        if !found {
            return Err(Error::unavailable(
                format!("CUDA driver function {name}"),
                "the installed NVIDIA driver is too old for this function: update the driver",
            ));
        }
    }
    Ok(())
}

/// Turns a driver result into `Result`, with the driver's error name in the message.
pub(crate) fn cu_check(op: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            rank: None,
            op: op.to_string(),
            what: cu_error_text(r),
        })
    }
}

/// `CUDA_ERROR_X: description` for a driver result.
pub(crate) fn cu_error_text(r: sys::CUresult) -> String {
    let mut desc: *const c_char = std::ptr::null();
    // SAFETY: only called after libcuda was found present (every caller went through
    // `require_driver_symbols`); cuGetErrorString writes a pointer to a static string or leaves it
    // null.
    let ok = unsafe { sys::cuGetErrorString(r, &mut desc) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !desc.is_null() {
        // SAFETY: non-null pointers from cuGetErrorString are static NUL-terminated strings.
        let d = unsafe { CStr::from_ptr(desc) }.to_string_lossy();
        format!("{r:?}: {d}")
    } else {
        format!("{r:?}")
    }
}

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
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
    let mut version: c_int = 0;
    // SAFETY: the symbol exists (checked); writes one int.
    let got_version =
        unsafe { sys::cuDriverGetVersion(&mut version) } == sys::CUresult::CUDA_SUCCESS;
    let driver_version = got_version.then_some((version / 1000, (version % 1000) / 10));
    // SAFETY: the symbol exists; cuInit(0) is the documented first call and may be repeated.
    let r = unsafe { sys::cuInit(0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Ok(CudaProbe {
            driver_version,
            devices: Vec::new(),
            init_error: Some(cu_error_text(r)),
        });
    }
    let mut count: c_int = 0;
    // SAFETY: the driver is initialised; writes one int.
    cu_check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
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

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Option<i32> {
    let mut v: c_int = 0;
    // SAFETY: `dev` came from cuDeviceGet; the call writes one int. An attribute unknown to an
    // older driver returns CUDA_ERROR_INVALID_VALUE, reported as `None`.
    (unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) } == sys::CUresult::CUDA_SUCCESS)
        .then_some(v)
}

fn device_info(ordinal: c_int) -> Result<GpuInfo> {
    use sys::CUdevice_attribute as A;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: the driver is initialised and `ordinal` < cuDeviceGetCount; writes one handle.
    cu_check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    let mut name = [0 as c_char; 256];
    // SAFETY: `name` has 256 bytes and the length passed is 255, so the result stays
    // NUL-terminated (the buffer starts zeroed).
    cu_check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), 255, dev)
    })?;
    let name_bytes: Vec<u8> = name
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    let mut bus = [0 as c_char; 64];
    // SAFETY: `bus` has 64 bytes, the length passed is 63 (NUL kept).
    let pci = (unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 63, dev) }
        == sys::CUresult::CUDA_SUCCESS)
        .then(|| {
            let b: Vec<u8> = bus
                .iter()
                .take_while(|c| **c != 0)
                .map(|c| *c as u8)
                .collect();
            PciAddr::parse(&String::from_utf8_lossy(&b))
        })
        .flatten();
    let mut total: usize = 0;
    // SAFETY: writes one usize.
    let total_mem = (unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) }
        == sys::CUresult::CUDA_SUCCESS)
        .then_some(total);
    let major = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).unwrap_or(0);
    let minor = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).unwrap_or(0);
    Ok(GpuInfo {
        ordinal: ordinal as usize,
        name: String::from_utf8_lossy(&name_bytes).into_owned(),
        compute_capability: (major, minor),
        pci,
        total_mem,
        sm_count: attribute(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        dma_buf_supported: attribute(dev, A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED).map(|v| v != 0),
        gpu_direct_rdma_supported: attribute(dev, A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)
            .map(|v| v != 0),
    })
}

/// RLIMIT_MEMLOCK of this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
