//! Run-time compilation of CUDA C with NVRTC, cached per process and on disk.
//!
//! libnvrtc is loaded dynamically (through cudarc) the first time it is needed, by the library
//! names `libnvrtc.so`, `libnvrtc.so.12`, ... through the dynamic loader's ordinary search
//! (`LD_LIBRARY_PATH`, the `ldconfig` cache, the default directories). A CUDA toolkit install
//! provides it, and so does the PyPI wheel `nvidia-cuda-nvrtc-cu12`, which needs no GPU and no
//! driver: `tests/gpu/install_nvrtc.sh` installs the wheel and prints the directory to put on
//! `LD_LIBRARY_PATH`. When the library cannot be loaded every function here returns
//! [`Error::Unavailable`] (cudarc itself would panic; it is never asked to load a missing library).
//!
//! Compiled images are cached in the process (keyed by source, NVRTC version, architecture and
//! options) and, where a cache directory is writable, on disk: `$DSPARK_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/dspark`, else `~/.cache/dspark`. A cache that cannot be read or written is
//! skipped, with a `tracing` debug line saying why.
//!
//! The NVRTC calls themselves (presence, version, architectures, programs) are in the CUDA
//! layer, `gpu::cuda::nvrtc`; this module has no `unsafe`. Nothing here needs a GPU.

use std::collections::HashMap;
use std::ffi::CString;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::cuda::nvrtc::{require_nvrtc, Program};
use crate::error::{Error, Result};

pub use super::cuda::nvrtc::{error_string, libnvrtc_present, supported_archs, version};

/// Environment variable naming the disk cache directory (highest precedence).
pub const CACHE_DIR_ENV: &str = "DSPARK_CACHE_DIR";

/// A GPU architecture to compile for: `sm_90` (real: CUBIN, run through ptxas) or `compute_90`
/// (virtual: PTX, compiled by the driver at load time). A suffix `a` (`sm_90a`) selects the
/// architecture-specific feature set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuArch {
    /// Compute capability major version.
    pub major: u32,
    /// Compute capability minor version.
    pub minor: u32,
    /// `true` for `sm_XX` (CUBIN), `false` for `compute_XX` (PTX).
    pub real: bool,
    /// Architecture-specific variant (`sm_90a`).
    pub specific: bool,
}

impl GpuArch {
    /// `sm_<major><minor>`: a CUBIN for that compute capability.
    pub const fn sm(major: u32, minor: u32) -> Self {
        GpuArch {
            major,
            minor,
            real: true,
            specific: false,
        }
    }

    /// `compute_<major><minor>`: PTX for that compute capability.
    pub const fn compute(major: u32, minor: u32) -> Self {
        GpuArch {
            major,
            minor,
            real: false,
            specific: false,
        }
    }

    /// The number NVRTC uses for the architecture (`90` for 9.0).
    pub const fn number(&self) -> u32 {
        self.major * 10 + self.minor
    }

    /// The `--gpu-architecture=` option.
    pub fn option(&self) -> String {
        format!("--gpu-architecture={self}")
    }
}

impl fmt::Display for GpuArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let prefix = if self.real { "sm" } else { "compute" };
        let suffix = if self.specific { "a" } else { "" };
        write!(f, "{prefix}_{}{}{suffix}", self.major, self.minor)
    }
}

impl FromStr for GpuArch {
    type Err = Error;

    /// Accepts `sm_90`, `sm_90a`, `compute_80`, `90` (= `sm_90`) and `9.0` (= `sm_90`).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::config(
                "--arch",
                format!("{s:?} is not a GPU architecture (expected e.g. sm_90, sm_80, compute_90)"),
            )
        };
        let t = s.trim().to_ascii_lowercase();
        if let Some((ma, mi)) = t.split_once('.') {
            let major = ma.parse::<u32>().map_err(|_| bad())?;
            let minor = mi.parse::<u32>().map_err(|_| bad())?;
            if minor > 9 || major == 0 {
                return Err(bad());
            }
            return Ok(GpuArch::sm(major, minor));
        }
        let (real, rest) = if let Some(r) = t.strip_prefix("sm_") {
            (true, r)
        } else if let Some(r) = t.strip_prefix("compute_") {
            (false, r)
        } else {
            (true, t.as_str())
        };
        let (digits, specific) = match rest.strip_suffix('a') {
            Some(d) => (d, true),
            None => (rest, false),
        };
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let num = digits.parse::<u32>().map_err(|_| bad())?;
        let (major, minor) = (num / 10, num % 10);
        if major == 0 {
            return Err(bad());
        }
        Ok(GpuArch {
            major,
            minor,
            real,
            specific,
        })
    }
}

/// What NVRTC produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImageKind {
    /// A CUBIN (machine code for one real architecture).
    Cubin,
    /// PTX text (NUL-terminated), JIT-compiled by the driver.
    Ptx,
}

impl ImageKind {
    fn name(self) -> &'static str {
        match self {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        }
    }
}

/// Where a compiled image came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheOrigin {
    /// Compiled by this call.
    Compiled,
    /// Found in this process's cache.
    Process,
    /// Read from the disk cache file.
    Disk(PathBuf),
}

/// Resource use of one kernel as reported by ptxas (`--ptxas-options=-v`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FunctionStats {
    /// The kernel's (extern "C") name.
    pub name: String,
    /// Registers per thread.
    pub registers: Option<u32>,
    /// Stack frame bytes.
    pub stack_frame_bytes: u64,
    /// Bytes of register spill stores.
    pub spill_store_bytes: u64,
    /// Bytes of register spill loads.
    pub spill_load_bytes: u64,
}

impl FunctionStats {
    /// Whether ptxas had to spill registers to local memory for this kernel.
    pub fn spills(&self) -> bool {
        self.spill_store_bytes > 0 || self.spill_load_bytes > 0
    }
}

/// A compiled program.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The architecture compiled for.
    pub arch: GpuArch,
    /// CUBIN or PTX.
    pub kind: ImageKind,
    /// The image, ready for `cuModuleLoadData` (PTX is NUL-terminated).
    pub image: Arc<Vec<u8>>,
    /// The full NVRTC log (with ptxas's `-v` report for real architectures).
    pub log: String,
    /// The options passed to NVRTC.
    pub options: Vec<String>,
    /// The NVRTC version that compiled it.
    pub nvrtc_version: (i32, i32),
    /// Per-kernel resource use parsed from the log (empty for PTX).
    pub functions: Vec<FunctionStats>,
    /// Where this copy came from.
    pub origin: CacheOrigin,
    /// Compile time (zero when it came from a cache).
    pub compile_time: Duration,
}

impl Compiled {
    /// Kernels that spilled registers.
    pub fn spilling(&self) -> Vec<&FunctionStats> {
        self.functions.iter().filter(|f| f.spills()).collect()
    }

    /// Names of the kernel entry points in the image: the CUBIN's symbol table (ELF), the
    /// `.entry` directives for PTX.
    pub fn entry_names(&self) -> Vec<String> {
        match self.kind {
            ImageKind::Cubin => cubin_entries(&self.image),
            ImageKind::Ptx => ptx_entries(&String::from_utf8_lossy(&self.image)),
        }
    }
}

/// Global function symbols in a CUBIN (a little-endian ELF64 object): the kernels it holds.
/// Empty where the bytes are not such an object (no panic on any input).
pub fn cubin_entries(elf: &[u8]) -> Vec<String> {
    // The `N` bytes at `base + off`, bounds- and overflow-checked.
    fn bytes<const N: usize>(b: &[u8], base: usize, off: usize) -> Option<[u8; N]> {
        let at = base.checked_add(off)?;
        b.get(at..at.checked_add(N)?)?.try_into().ok()
    }
    fn u16_at(b: &[u8], base: usize, off: usize) -> Option<usize> {
        Some(u16::from_le_bytes(bytes(b, base, off)?) as usize)
    }
    fn u32_at(b: &[u8], base: usize, off: usize) -> Option<usize> {
        Some(u32::from_le_bytes(bytes(b, base, off)?) as usize)
    }
    fn u64_at(b: &[u8], base: usize, off: usize) -> Option<usize> {
        usize::try_from(u64::from_le_bytes(bytes(b, base, off)?)).ok()
    }
    // (type, offset, size, link, entry size) of section `i`.
    fn section(b: &[u8], shoff: usize, shentsize: usize, i: usize) -> Option<[usize; 5]> {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        Some([
            u32_at(b, h, 4)?,
            u64_at(b, h, 0x18)?,
            u64_at(b, h, 0x20)?,
            u32_at(b, h, 0x28)?,
            u64_at(b, h, 0x38)?,
        ])
    }
    fn entries(b: &[u8]) -> Option<Vec<String>> {
        // ELF magic, 64-bit class, little-endian.
        if b.get(..6)? != b"\x7fELF\x02\x01" {
            return None;
        }
        let (shoff, shentsize, shnum) = (
            u64_at(b, 0, 0x28)?,
            u16_at(b, 0, 0x3a)?,
            u16_at(b, 0, 0x3c)?,
        );
        if shentsize < 0x40 {
            return None;
        }
        const SHT_SYMTAB: usize = 2;
        let mut out = Vec::new();
        for i in 0..shnum {
            let [ty, off, size, link, entsize] = section(b, shoff, shentsize, i)?;
            if ty != SHT_SYMTAB {
                continue;
            }
            let [_, str_off, str_size, _, _] = section(b, shoff, shentsize, link)?;
            let strtab = b.get(str_off..str_off.checked_add(str_size)?)?;
            if entsize < 24 {
                return None;
            }
            for k in 0..size / entsize {
                let sym = off.checked_add(k.checked_mul(entsize)?)?;
                let [info] = bytes::<1>(b, sym, 4)?;
                // STB_GLOBAL (1) binding, STT_FUNC (2) type, defined here (section index not
                // SHN_UNDEF: imports such as `vprintf` are not kernels of this image).
                if info >> 4 != 1 || info & 0xf != 2 || u16_at(b, sym, 6)? == 0 {
                    continue;
                }
                let name = strtab.get(u32_at(b, sym, 0)?..)?;
                let end = name.iter().position(|&c| c == 0)?;
                out.push(String::from_utf8_lossy(&name[..end]).into_owned());
            }
        }
        Some(out)
    }
    entries(elf).unwrap_or_default()
}

/// `.entry` names in PTX text.
pub fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let rest = l
                .strip_prefix(".visible .entry ")
                .or_else(|| l.strip_prefix(".entry "))?;
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

/// Parses ptxas's verbose report (`ptxas info : Compiling entry function 'k' for 'sm_90'`,
/// `Function properties for k`, `N bytes stack frame, N bytes spill stores, N bytes spill
/// loads`, `Used N registers, ...`) into one entry per kernel, in order of appearance.
pub fn parse_ptxas_report(log: &str) -> Vec<FunctionStats> {
    let mut out: Vec<FunctionStats> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut current: Option<usize> = None;
    let mut slot = |name: &str, out: &mut Vec<FunctionStats>| -> usize {
        *index.entry(name.to_string()).or_insert_with(|| {
            out.push(FunctionStats {
                name: name.to_string(),
                ..Default::default()
            });
            out.len() - 1
        })
    };
    for line in log.lines() {
        let l = line.trim();
        if let Some(rest) = l.split("Compiling entry function '").nth(1) {
            if let Some(name) = rest.split('\'').next() {
                current = Some(slot(name, &mut out));
            }
        } else if let Some(rest) = l.split("Function properties for ").nth(1) {
            let name = rest.trim().trim_end_matches(':');
            current = Some(slot(name, &mut out));
        } else if l.contains("bytes spill stores") || l.contains("bytes stack frame") {
            if let Some(i) = current {
                for part in l.split(',') {
                    let part = part.trim();
                    let num = part
                        .split_whitespace()
                        .next()
                        .and_then(|n| n.parse::<u64>().ok());
                    if let Some(num) = num {
                        if part.ends_with("spill stores") {
                            out[i].spill_store_bytes = num;
                        } else if part.ends_with("spill loads") {
                            out[i].spill_load_bytes = num;
                        } else if part.ends_with("stack frame") {
                            out[i].stack_frame_bytes = num;
                        }
                    }
                }
            }
        } else if let Some(rest) = l.split("Used ").nth(1) {
            if let (Some(i), Some(n)) = (current, rest.split_whitespace().next()) {
                if rest
                    .split_whitespace()
                    .nth(1)
                    .is_some_and(|w| w.starts_with("register"))
                {
                    out[i].registers = n.parse().ok();
                }
            }
        }
    }
    out
}

/// Compiles `source` (program name `name`, used in diagnostics) for `arch` with `options`
/// (without `--gpu-architecture`, which is added), bypassing every cache.
///
/// A compile failure is an [`Error::Cuda`] whose text is the full NVRTC log.
pub fn compile_uncached(
    source: &str,
    name: &str,
    arch: GpuArch,
    options: &[String],
) -> Result<Compiled> {
    require_nvrtc()?;
    let nvrtc_version = version()?;
    let src = CString::new(source).map_err(|_| Error::Cuda {
        rank: None,
        op: "nvrtcCreateProgram".into(),
        what: "kernel source contains a NUL byte".into(),
    })?;
    let cname = CString::new(name).unwrap_or_default();
    let mut all_options = vec![arch.option()];
    all_options.extend(with_no_cache(options, nvrtc_version));
    let coptions: Vec<CString> = all_options
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| Error::Cuda {
            rank: None,
            op: "nvrtcCompileProgram".into(),
            what: "option contains NUL".into(),
        })?;
    let start = Instant::now();
    let mut prog = Program::create(&src, &cname)?;
    let r = prog.compile(&coptions);
    let log = prog.log();
    if let Err(r) = r {
        return Err(Error::Cuda {
            rank: None,
            op: format!("nvrtcCompileProgram({name}, {arch})"),
            what: format!(
                "{r:?}; options: {}; NVRTC log:\n{log}",
                all_options.join(" ")
            ),
        });
    }
    let (kind, image) = if arch.real {
        (ImageKind::Cubin, prog.cubin()?)
    } else {
        (ImageKind::Ptx, prog.ptx()?)
    };
    drop(prog);
    drop(src);
    drop(cname);
    if image.is_empty() {
        return Err(Error::Cuda {
            rank: None,
            op: format!("nvrtcCompileProgram({name}, {arch})"),
            what: "empty image".into(),
        });
    }
    let functions = if kind == ImageKind::Cubin {
        parse_ptxas_report(&log)
    } else {
        Vec::new()
    };
    Ok(Compiled {
        arch,
        kind,
        image: Arc::new(image),
        log,
        options: all_options,
        nvrtc_version,
        functions,
        origin: CacheOrigin::Compiled,
        compile_time: start.elapsed(),
    })
}

/// The disk cache directory from the environment: `$DSPARK_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/dspark`, else `$HOME/.cache/dspark`; `None` when none is set.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(|k| std::env::var_os(k))
}

pub use crate::config::cache_dir_from;

/// FNV-1a, 64 bits: a stable hash for cache keys (std's hasher may change between releases).
pub fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache key: everything that changes the output.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey {
    source_hash: u64,
    source_len: usize,
    nvrtc_version: (i32, i32),
    arch: GpuArch,
    options: Vec<String>,
}

impl CacheKey {
    fn new(source: &str, nvrtc_version: (i32, i32), arch: GpuArch, options: &[String]) -> Self {
        CacheKey {
            source_hash: fnv1a64(source.as_bytes()),
            source_len: source.len(),
            nvrtc_version,
            arch,
            options: options.to_vec(),
        }
    }

    fn text(&self) -> String {
        format!(
            "src={:016x}/{} nvrtc={}.{} arch={} opts={}",
            self.source_hash,
            self.source_len,
            self.nvrtc_version.0,
            self.nvrtc_version.1,
            self.arch,
            self.options.join("\u{1f}")
        )
    }

    fn file_name(&self, name: &str) -> String {
        let clean: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        format!(
            "{clean}-{}-{:016x}.bin",
            self.arch,
            fnv1a64(self.text().as_bytes())
        )
    }
}

const MAGIC: &[u8] = b"DSPARK-NVRTC-CACHE-1\n";

fn encode_entry(key: &CacheKey, c: &Compiled) -> Vec<u8> {
    let mut out = Vec::with_capacity(c.image.len() + c.log.len() + 256);
    out.extend_from_slice(MAGIC);
    let key_text = key.text();
    out.extend_from_slice(format!("key {}\n", key_text.len()).as_bytes());
    out.extend_from_slice(key_text.as_bytes());
    out.extend_from_slice(format!("\nlog {}\n", c.log.len()).as_bytes());
    out.extend_from_slice(c.log.as_bytes());
    out.extend_from_slice(format!("\n{} {}\n", c.kind.name(), c.image.len()).as_bytes());
    out.extend_from_slice(&c.image);
    out
}

/// Reads one `<tag> <len>\n<len bytes>` field; returns (tag, bytes, rest).
fn take_field(data: &[u8]) -> Option<(&str, &[u8], &[u8])> {
    let nl = data.iter().position(|b| *b == b'\n')?;
    let header = std::str::from_utf8(&data[..nl]).ok()?;
    let (tag, len) = header.split_once(' ')?;
    let len: usize = len.parse().ok()?;
    let end = (nl + 1).checked_add(len)?;
    let body = data.get(nl + 1..end)?;
    Some((tag, body, data.get(end..)?))
}

fn decode_entry(data: &[u8], key: &CacheKey) -> Option<(ImageKind, Vec<u8>, String)> {
    let rest = data.strip_prefix(MAGIC)?;
    let (tag, k, rest) = take_field(rest)?;
    if tag != "key" || k != key.text().as_bytes() {
        return None;
    }
    let rest = rest.strip_prefix(b"\n")?;
    let (tag, log, rest) = take_field(rest)?;
    if tag != "log" {
        return None;
    }
    let rest = rest.strip_prefix(b"\n")?;
    let (tag, image, rest) = take_field(rest)?;
    let kind = match tag {
        "cubin" => ImageKind::Cubin,
        "ptx" => ImageKind::Ptx,
        _ => return None,
    };
    if !rest.is_empty() || image.is_empty() {
        return None;
    }
    Some((
        kind,
        image.to_vec(),
        String::from_utf8_lossy(log).into_owned(),
    ))
}

fn read_disk(path: &Path, key: &CacheKey) -> Option<(ImageKind, Vec<u8>, String)> {
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) => {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::debug!(path = %path.display(), error = %e, "NVRTC disk cache unreadable; recompiling");
            }
            return None;
        }
    };
    let entry = decode_entry(&data, key);
    if entry.is_none() {
        tracing::debug!(path = %path.display(), "NVRTC disk cache entry is stale or corrupt; recompiling");
    }
    entry
}

/// Writes atomically (temporary file + rename); failures are logged at debug level and ignored.
fn write_disk(dir: &Path, path: &Path, bytes: &[u8]) -> std::result::Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"),
        std::process::id()
    ));
    let mut f =
        std::fs::File::create(&tmp).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    if let Err(e) = f.write_all(bytes).and_then(|_| f.sync_all()) {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("cannot write {}: {e}", tmp.display()));
    }
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot rename into {}: {e}", path.display())
    })
}

type ProcessCache = Mutex<HashMap<CacheKey, Arc<Compiled>>>;

fn process_cache() -> &'static ProcessCache {
    static CACHE: OnceLock<ProcessCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Empties this process's cache of compiled images (the disk cache is left alone), so that the
/// next [`compile`] reads the disk cache or compiles again. For tests and tools.
pub fn clear_process_cache() {
    if let Ok(mut m) = process_cache().lock() {
        m.clear();
    }
}

/// Where [`compile`] keeps and looks for compiled images on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskCache {
    /// The directory from the environment ([`cache_dir`]).
    FromEnv,
    /// This directory.
    Dir(PathBuf),
    /// No disk cache.
    Off,
}

impl DiskCache {
    fn dir(&self) -> Option<PathBuf> {
        match self {
            DiskCache::FromEnv => cache_dir(),
            DiskCache::Dir(d) => Some(d.clone()),
            DiskCache::Off => None,
        }
    }
}

/// `options`, plus `--no-cache` where ptxas's report is asked for of NVRTC 12.9 or later:
/// those keep their own cache of compiled programs, and a program served from it comes
/// without the report (no register or spill figures). Ours (process and disk) stands in
/// front anyway. Accepted by 12.9 and 13.0 (both tried).
fn with_no_cache(options: &[String], nvrtc_version: (i32, i32)) -> Vec<String> {
    let mut o = options.to_vec();
    let verbose = options
        .iter()
        .any(|o| o.starts_with("--ptxas-options") && o.contains("-v"));
    if verbose && nvrtc_version >= (12, 9) {
        o.push("--no-cache".to_string());
    }
    o
}

/// Compiles `source` for `arch`, using the process cache, then the disk cache, then NVRTC.
/// See [`compile_uncached`] for the arguments.
pub fn compile(
    source: &str,
    name: &str,
    arch: GpuArch,
    options: &[String],
    disk: &DiskCache,
) -> Result<Arc<Compiled>> {
    require_nvrtc()?;
    let nvrtc_version = version()?;
    // Keyed by the options NVRTC gets: an image cached without `--no-cache` (and maybe
    // without ptxas's report) is not taken for one made with it.
    let nvrtc_options = with_no_cache(options, nvrtc_version);
    let key = CacheKey::new(source, nvrtc_version, arch, &nvrtc_options);
    let cache = process_cache();
    if let Some(hit) = cache.lock().ok().and_then(|m| m.get(&key).cloned()) {
        let mut c = (*hit).clone();
        c.origin = CacheOrigin::Process;
        c.compile_time = Duration::ZERO;
        return Ok(Arc::new(c));
    }
    let dir = disk.dir();
    let path = dir.as_ref().map(|d| d.join(key.file_name(name)));
    let mut all_options = vec![arch.option()];
    all_options.extend(nvrtc_options);
    let compiled = match path
        .as_ref()
        .and_then(|p| read_disk(p, &key).map(|e| (p, e)))
    {
        Some((p, (kind, image, log))) => Compiled {
            arch,
            kind,
            functions: if kind == ImageKind::Cubin {
                parse_ptxas_report(&log)
            } else {
                Vec::new()
            },
            image: Arc::new(image),
            log,
            options: all_options,
            nvrtc_version,
            origin: CacheOrigin::Disk(p.clone()),
            compile_time: Duration::ZERO,
        },
        None => {
            let c = compile_uncached(source, name, arch, options)?;
            match (&dir, &path) {
                (Some(d), Some(p)) => match write_disk(d, p, &encode_entry(&key, &c)) {
                    Ok(()) => {
                        tracing::debug!(path = %p.display(), "NVRTC image written to the disk cache")
                    }
                    Err(e) => tracing::debug!(error = %e, "NVRTC disk cache skipped"),
                },
                _ => tracing::debug!(
                    "NVRTC disk cache skipped: no cache directory (set DSPARK_CACHE_DIR)"
                ),
            }
            c
        }
    };
    let compiled = Arc::new(compiled);
    if let Ok(mut m) = cache.lock() {
        m.insert(key, compiled.clone());
    }
    Ok(compiled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn arch_names_parse_and_print_round_trip() {
        for s in [
            "sm_90",
            "sm_80",
            "compute_90",
            "sm_90a",
            "compute_75",
            "sm_100",
            "sm_120",
        ] {
            assert_eq!(s.parse::<GpuArch>().unwrap().to_string(), s);
        }
        assert_eq!("90".parse::<GpuArch>().unwrap(), GpuArch::sm(9, 0));
        assert_eq!("8.6".parse::<GpuArch>().unwrap(), GpuArch::sm(8, 6));
        assert_eq!("SM_89".parse::<GpuArch>().unwrap(), GpuArch::sm(8, 9));
        assert_eq!(GpuArch::sm(10, 0).to_string(), "sm_100");
        assert_eq!(GpuArch::sm(9, 0).option(), "--gpu-architecture=sm_90");
        for bad in [
            "", "sm_", "sm_9", "sm_x0", "gfx90a", "0.5", "9.10", "compute_",
        ] {
            let e = bad.parse::<GpuArch>().unwrap_err();
            assert!(e.to_string().contains("--arch"), "{bad}: {e}");
        }
    }

    #[test]
    fn ptxas_report_gives_registers_and_spills_per_kernel() {
        let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dspark_a' for 'sm_90'
ptxas info    : Function properties for dspark_a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers, 376 bytes cmem[0]
ptxas info    : Compiling entry function 'dspark_b' for 'sm_90'
ptxas info    : Function properties for dspark_b
    24 bytes stack frame, 16 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, 384 bytes cmem[0]
";
        let f = parse_ptxas_report(log);
        assert_eq!(f.len(), 2);
        assert_eq!(f[0].name, "dspark_a");
        assert_eq!(f[0].registers, Some(18));
        assert!(!f[0].spills());
        assert_eq!(f[1].name, "dspark_b");
        assert_eq!(
            (
                f[1].stack_frame_bytes,
                f[1].spill_store_bytes,
                f[1].spill_load_bytes
            ),
            (24, 16, 8)
        );
        assert_eq!(f[1].registers, Some(255));
        assert!(f[1].spills());
    }

    /// A little-endian ELF64 object with a symbol table: the null symbol, a global function
    /// `k1`, a local function `helper`, a global object `data`, a global function `k2`, an
    /// undefined global function `vprintf`.
    fn tiny_elf() -> Vec<u8> {
        let strtab = b"\0k1\0helper\0data\0k2\0vprintf\0".to_vec();
        let sym = |name: u32, info: u8| {
            let mut v = name.to_le_bytes().to_vec();
            v.extend([info, 0, 1, 0]);
            v.extend([0u8; 16]);
            v
        };
        let mut symtab = sym(0, 0);
        symtab.extend(sym(1, 0x12)); // k1: global function
        symtab.extend(sym(4, 0x02)); // helper: local function
        symtab.extend(sym(11, 0x11)); // data: global object
        symtab.extend(sym(16, 0x12)); // k2: global function
        let mut import = sym(19, 0x12); // vprintf: global function, undefined
        import[6] = 0;
        symtab.extend(import);
        let mut elf = vec![0u8; 0x40];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        let sym_off = elf.len();
        elf.extend(&symtab);
        let str_off = elf.len();
        elf.extend(&strtab);
        let shoff = elf.len();
        let header = |ty: u32, off: usize, size: usize, link: u32, entsize: usize| {
            let mut h = vec![0u8; 0x40];
            h[4..8].copy_from_slice(&ty.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            h[0x28..0x2c].copy_from_slice(&link.to_le_bytes());
            h[0x38..0x40].copy_from_slice(&(entsize as u64).to_le_bytes());
            h
        };
        elf.extend(header(0, 0, 0, 0, 0));
        elf.extend(header(2, sym_off, symtab.len(), 2, 24));
        elf.extend(header(3, str_off, strtab.len(), 0, 0));
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&0x40u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        elf
    }

    #[test]
    fn cubin_entries_are_the_global_functions_and_bad_bytes_give_none() {
        let elf = tiny_elf();
        assert_eq!(cubin_entries(&elf), ["k1", "k2"]);
        // Every truncation, a wrong magic and a huge section offset: no panic, nothing made up.
        for n in 0..elf.len() {
            let got = cubin_entries(&elf[..n]);
            assert!(
                got.is_empty() || got == ["k1"] || got == ["k1", "k2"],
                "{n}: {got:?}"
            );
        }
        let mut bad = elf.clone();
        bad[1] = b'X';
        assert!(cubin_entries(&bad).is_empty());
        let mut far = elf;
        far[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(cubin_entries(&far).is_empty());
        assert!(cubin_entries(b"").is_empty());
    }

    #[test]
    fn ptx_entries_are_found() {
        let ptx =
            "//\n.version 8.7\n.visible .entry dspark_x(\n\t.param .u64 a\n)\n.entry dspark_y()\n";
        assert_eq!(
            ptx_entries(ptx),
            vec!["dspark_x".to_string(), "dspark_y".to_string()]
        );
    }

    #[test]
    fn cache_dir_follows_dspark_then_xdg_then_home() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| OsString::from(*v))
            }
        };
        assert_eq!(
            cache_dir_from(env(&[
                ("DSPARK_CACHE_DIR", "/a"),
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/h")
            ])),
            Some(PathBuf::from("/a"))
        );
        assert_eq!(
            cache_dir_from(env(&[
                ("DSPARK_CACHE_DIR", ""),
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/h")
            ])),
            Some(PathBuf::from("/x/dspark"))
        );
        assert_eq!(
            cache_dir_from(env(&[("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/dspark"))
        );
        assert_eq!(cache_dir_from(env(&[])), None);
    }

    fn sample(kind: ImageKind) -> Compiled {
        Compiled {
            arch: GpuArch::sm(9, 0),
            kind,
            image: Arc::new(vec![1, 2, 3, 0, b'\n', 9]),
            log: "ptxas info : Compiling entry function 'k' for 'sm_90'\nline two\n".into(),
            options: vec![],
            nvrtc_version: (12, 8),
            functions: vec![],
            origin: CacheOrigin::Compiled,
            compile_time: Duration::ZERO,
        }
    }

    #[test]
    fn cache_entries_round_trip_and_reject_other_keys_and_damage() {
        let key = CacheKey::new(
            "src",
            (12, 8),
            GpuArch::sm(9, 0),
            &["-default-device".to_string()],
        );
        let c = sample(ImageKind::Cubin);
        let bytes = encode_entry(&key, &c);
        let (kind, image, log) = decode_entry(&bytes, &key).unwrap();
        assert_eq!(kind, ImageKind::Cubin);
        assert_eq!(image, *c.image);
        assert_eq!(log, c.log);

        let other_arch = CacheKey::new(
            "src",
            (12, 8),
            GpuArch::sm(8, 0),
            &["-default-device".to_string()],
        );
        assert!(decode_entry(&bytes, &other_arch).is_none());
        let other_nvrtc = CacheKey::new(
            "src",
            (12, 9),
            GpuArch::sm(9, 0),
            &["-default-device".to_string()],
        );
        assert!(decode_entry(&bytes, &other_nvrtc).is_none());
        let other_src = CacheKey::new(
            "src2",
            (12, 8),
            GpuArch::sm(9, 0),
            &["-default-device".to_string()],
        );
        assert!(decode_entry(&bytes, &other_src).is_none());
        let other_opts = CacheKey::new("src", (12, 8), GpuArch::sm(9, 0), &[]);
        assert!(decode_entry(&bytes, &other_opts).is_none());
        assert!(
            decode_entry(&bytes[..bytes.len() - 1], &key).is_none(),
            "truncated"
        );
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode_entry(&longer, &key).is_none(), "trailing bytes");
        assert!(decode_entry(b"garbage", &key).is_none());
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(format!("key {}\n", usize::MAX).as_bytes());
        assert!(
            decode_entry(&huge, &key).is_none(),
            "a corrupt length is rejected, not a panic"
        );
        assert_ne!(key.file_name("k"), other_arch.file_name("k"));
        assert_ne!(key.file_name("k"), other_src.file_name("k"));
    }

    #[test]
    fn disk_writes_are_atomic_and_unwritable_dirs_are_reported_not_fatal() {
        let dir =
            std::env::temp_dir().join(format!("dspark-nvrtc-cache-test-{}", std::process::id()));
        let key = CacheKey::new("src", (12, 8), GpuArch::compute(9, 0), &[]);
        let c = sample(ImageKind::Ptx);
        let path = dir.join(key.file_name("k"));
        write_disk(&dir, &path, &encode_entry(&key, &c)).unwrap();
        let (kind, image, _) = read_disk(&path, &key).unwrap();
        assert_eq!((kind, image), (ImageKind::Ptx, c.image.to_vec()));
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();

        // A directory below a regular file can never be created.
        let file =
            std::env::temp_dir().join(format!("dspark-nvrtc-cache-file-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let bad_dir = file.join("sub");
        let err = write_disk(&bad_dir, &bad_dir.join("e.bin"), b"data").unwrap_err();
        assert!(err.contains("cannot create"), "{err}");
        assert!(read_disk(&bad_dir.join("e.bin"), &key).is_none());
        std::fs::remove_file(&file).unwrap();
    }

    #[test]
    fn fnv_is_the_published_function() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
