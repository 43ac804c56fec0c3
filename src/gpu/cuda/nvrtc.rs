//! The NVRTC (libnvrtc) calls of the crate: presence, version, supported architectures, error
//! strings, and [`Program`], a compiled-once program that owns its `nvrtcProgram` — each a small
//! function over `cudarc::nvrtc::sys` calls, returning the crate's [`Error`] (see [the layer's
//! docs](super)). The kernel cache and everything else about compiling lives in
//! [`gpu::nvrtc`](crate::gpu::nvrtc).
//!
//! Every function here checks first that libnvrtc can be loaded (cudarc would panic) and
//! returns [`Error::Unavailable`] when it cannot. Nothing here needs a GPU.

use std::ffi::{c_char, c_int, CStr, CString};
use std::marker::PhantomData;
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

use crate::error::{Error, Result};

pub(crate) use sys::nvrtcResult;

/// Whether libnvrtc can be loaded by cudarc on this machine.
pub fn libnvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's fixed list of library names
        // and drops each handle it opens; loading libnvrtc runs no code of ours. It is unsafe only
        // because loading any shared library runs its initialisers.
        unsafe { sys::is_culib_present() }
    })
}

/// [`Error::Unavailable`] unless libnvrtc can be loaded.
pub(crate) fn require_nvrtc() -> Result<()> {
    if libnvrtc_present() {
        Ok(())
    } else {
        Err(Error::unavailable(
            "NVRTC (libnvrtc)",
            "libnvrtc.so could not be loaded: install the CUDA toolkit, or the PyPI wheel \
             nvidia-cuda-nvrtc-cu12 (tests/gpu/install_nvrtc.sh), and put the directory holding \
             libnvrtc.so.12 on LD_LIBRARY_PATH",
        ))
    }
}

fn nvrtc_err(op: &str, r: nvrtcResult) -> Error {
    Error::Cuda {
        rank: None,
        op: op.to_string(),
        what: format!("{r:?}"),
    }
}

fn check(op: &str, r: nvrtcResult) -> Result<()> {
    if r == nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(nvrtc_err(op, r))
    }
}

/// The version of the loaded libnvrtc, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    static VERSION: OnceLock<std::result::Result<(i32, i32), nvrtcResult>> = OnceLock::new();
    let v = VERSION.get_or_init(|| {
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: libnvrtc is present (checked above), and nvrtcVersion only writes the two ints
        // through the valid pointers given.
        let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
        if r == nvrtcResult::NVRTC_SUCCESS {
            Ok((major, minor))
        } else {
            Err(r)
        }
    });
    v.map_err(|r| nvrtc_err("nvrtcVersion", r))
}

/// The real architectures (`sm_XX`, as `XX`) this libnvrtc can generate code for.
pub fn supported_archs() -> Result<Vec<u32>> {
    require_nvrtc()?;
    let mut n: c_int = 0;
    // SAFETY: libnvrtc is present; the call writes one int.
    check("nvrtcGetNumSupportedArchs", unsafe {
        sys::nvrtcGetNumSupportedArchs(&mut n)
    })?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    if !archs.is_empty() {
        // SAFETY: `archs` has room for the `n` ints NVRTC reported it will write.
        check("nvrtcGetSupportedArchs", unsafe {
            sys::nvrtcGetSupportedArchs(archs.as_mut_ptr())
        })?;
    }
    Ok(archs
        .into_iter()
        .filter(|a| *a > 0)
        .map(|a| a as u32)
        .collect())
}

/// The error string NVRTC gives for a result code (for diagnostics).
pub fn error_string(r: nvrtcResult) -> String {
    if !libnvrtc_present() {
        return format!("{r:?}");
    }
    // SAFETY: libnvrtc is present; nvrtcGetErrorString returns a pointer to a static string.
    let p = unsafe { sys::nvrtcGetErrorString(r) };
    if p.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: `p` is non-null and points at a NUL-terminated static string owned by libnvrtc.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// RAII owner of an `nvrtcProgram`; destroying it never panics. It borrows its source and
/// name for its whole life, so that they outlive it on every path.
pub(crate) struct Program<'a> {
    prog: sys::nvrtcProgram,
    _text: PhantomData<&'a CStr>,
}

impl std::fmt::Debug for Program<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Program({:p})", self.prog)
    }
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        if !self.prog.is_null() {
            // SAFETY: `prog` was created by nvrtcCreateProgram and is destroyed exactly once
            // (here); the result is ignored because Drop cannot report it and a failure to free
            // a program leaks memory at worst.
            let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.prog) };
        }
    }
}

impl<'a> Program<'a> {
    /// `nvrtcCreateProgram`: the program `source`, named `name` in diagnostics, no headers.
    pub(crate) fn create(source: &'a CStr, name: &'a CStr) -> Result<Self> {
        require_nvrtc()?;
        let mut prog = Program {
            prog: std::ptr::null_mut(),
            _text: PhantomData,
        };
        // SAFETY: libnvrtc is present; `source` and `name` are NUL-terminated and outlive the
        // program (it borrows them for `'a`). No headers are passed.
        check("nvrtcCreateProgram", unsafe {
            sys::nvrtcCreateProgram(
                &mut prog.prog,
                source.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        Ok(prog)
    }

    /// `nvrtcCompileProgram` with `options`. The status comes back as NVRTC gave it (the
    /// caller's error carries the [`log`](Program::log) too).
    pub(crate) fn compile(&mut self, options: &[CString]) -> std::result::Result<(), nvrtcResult> {
        let option_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();
        // SAFETY: `prog` is live; `option_ptrs` points at `options.len()` NUL-terminated strings
        // that live until the end of this function.
        let r = unsafe {
            sys::nvrtcCompileProgram(self.prog, option_ptrs.len() as c_int, option_ptrs.as_ptr())
        };
        if r == nvrtcResult::NVRTC_SUCCESS {
            Ok(())
        } else {
            Err(r)
        }
    }

    /// The compile log (empty when NVRTC cannot give it).
    pub(crate) fn log(&self) -> String {
        let mut size: usize = 0;
        // SAFETY: `self.prog` is a live program; the call writes one usize.
        if unsafe { sys::nvrtcGetProgramLogSize(self.prog, &mut size) }
            != nvrtcResult::NVRTC_SUCCESS
            || size == 0
        {
            return String::new();
        }
        let mut buf = vec![0 as c_char; size];
        // SAFETY: `buf` holds `size` bytes, the size NVRTC reported for the NUL-terminated log.
        if unsafe { sys::nvrtcGetProgramLog(self.prog, buf.as_mut_ptr()) }
            != nvrtcResult::NVRTC_SUCCESS
        {
            return String::new();
        }
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The CUBIN of a program compiled for a real architecture (`sm_XX`).
    pub(crate) fn cubin(&self) -> Result<Vec<u8>> {
        let mut size: usize = 0;
        // SAFETY: `prog` is live and compiled; writes one usize.
        check("nvrtcGetCUBINSize", unsafe {
            sys::nvrtcGetCUBINSize(self.prog, &mut size)
        })?;
        let mut buf = vec![0u8; size];
        if size > 0 {
            // SAFETY: `buf` has the `size` bytes NVRTC reported for the CUBIN.
            check("nvrtcGetCUBIN", unsafe {
                sys::nvrtcGetCUBIN(self.prog, buf.as_mut_ptr().cast())
            })?;
        }
        Ok(buf)
    }

    /// The PTX (NUL included) of a program compiled for a virtual architecture
    /// (`compute_XX`).
    pub(crate) fn ptx(&self) -> Result<Vec<u8>> {
        let mut size: usize = 0;
        // SAFETY: `prog` is live and compiled; writes one usize.
        check("nvrtcGetPTXSize", unsafe {
            sys::nvrtcGetPTXSize(self.prog, &mut size)
        })?;
        let mut buf = vec![0u8; size];
        if size > 0 {
            // SAFETY: `buf` has the `size` bytes (NUL included) NVRTC reported for the PTX.
            check("nvrtcGetPTX", unsafe {
                sys::nvrtcGetPTX(self.prog, buf.as_mut_ptr().cast())
            })?;
        }
        Ok(buf)
    }
}
