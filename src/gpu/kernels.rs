//! The CUDA reduction kernels: their source, names, compile options and launch geometry.
//!
//! The CUDA C source (`kernels.cu`, kept in the crate) has one kernel per (kind, op, type):
//! `reduce_inplace` (`dst = dst ⊕ src`), `reduce_into` (`dst = a ⊕ b`) for Sum, Prod, Min, Max
//! over all ten element types, and `finalize` (`dst /= world`, the second half of Avg) per type:
//! 90 kernels in one module. Semantics are exactly those of the CPU kernels (see
//! [`ReduceOp`]); the source's header comment spells them out.
//!
//! Nothing here touches a GPU: [`compile_all`] needs only libnvrtc. Launching lives in
//! [`super::device`].

use std::sync::Arc;

use super::nvrtc::{self, Compiled, DiskCache, GpuArch};
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};

/// The CUDA C source of every reduction kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// The program name given to NVRTC (appears in its diagnostics).
pub const PROGRAM_NAME: &str = "dspark_kernels.cu";

/// Threads per block of every launch (the source declares `__launch_bounds__(256)`).
pub const BLOCK_THREADS: u32 = 256;

/// Resident blocks per SM aimed for by [`grid_size`] (2048 threads per SM on sm_80/sm_90).
pub const BLOCKS_PER_SM: u32 = 8;

/// The operators that have their own kernels; `Avg` runs as `Sum` plus [`KernelKind::Finalize`].
pub const STEP_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

/// What a kernel does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelKind {
    /// `dst[i] = dst[i] ⊕ src[i]`
    ReduceInplace,
    /// `dst[i] = a[i] ⊕ b[i]`
    ReduceInto,
    /// `dst[i] = dst[i] / world` (Avg's final division).
    Finalize,
}

impl KernelKind {
    /// All kinds.
    pub const ALL: [KernelKind; 3] = [
        KernelKind::ReduceInplace,
        KernelKind::ReduceInto,
        KernelKind::Finalize,
    ];
}

/// The entry-point name of a kernel. `op` is ignored for [`KernelKind::Finalize`]; `Avg` maps to
/// the `Sum` kernel (its division is the separate finalize kernel).
pub fn kernel_name(kind: KernelKind, dtype: DataType, op: ReduceOp) -> String {
    let ty = dtype.rust_name();
    match kind {
        KernelKind::ReduceInplace => format!("dspark_reduce_inplace_{}_{ty}", op.step_op().name()),
        KernelKind::ReduceInto => format!("dspark_reduce_into_{}_{ty}", op.step_op().name()),
        KernelKind::Finalize => format!("dspark_finalize_{ty}"),
    }
}

/// Every kernel in the source: `(kind, type, op, name)`; `op` is `None` for finalize kernels.
pub fn all_kernels() -> Vec<(KernelKind, DataType, Option<ReduceOp>, String)> {
    let mut out = Vec::new();
    for dtype in DataType::ALL {
        for op in STEP_OPS {
            for kind in [KernelKind::ReduceInplace, KernelKind::ReduceInto] {
                out.push((kind, dtype, Some(op), kernel_name(kind, dtype, op)));
            }
        }
        out.push((
            KernelKind::Finalize,
            dtype,
            None,
            kernel_name(KernelKind::Finalize, dtype, ReduceOp::Sum),
        ));
    }
    out
}

/// NVRTC options for the kernels (the architecture option is added by [`nvrtc::compile`]).
///
/// IEEE semantics are pinned explicitly (no fused multiply-add, no flush to zero, correctly
/// rounded division) so that results match the CPU kernels bit for bit; real architectures
/// also get ptxas's verbose report so that register spills are visible.
pub fn compile_options(arch: GpuArch) -> Vec<String> {
    let mut o: Vec<String> = [
        "-default-device",
        "--std=c++17",
        "--fmad=false",
        "--ftz=false",
        "--prec-div=true",
        "--prec-sqrt=true",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if arch.real {
        o.push("--ptxas-options=-v".to_string());
    }
    o
}

/// The result of compiling every kernel for one architecture.
#[derive(Clone, Debug)]
pub struct KernelBuild {
    /// The compiled module, its log and its origin (compiled, process or disk cache).
    pub compiled: Arc<Compiled>,
    /// How many kernels the source defines ([`all_kernels`]).
    pub expected: usize,
    /// Kernels found in the image (function symbols of the CUBIN, or `.entry` in PTX).
    pub found: usize,
}

impl KernelBuild {
    /// Total bytes of spill stores and loads over all kernels (0 for PTX: not known until the
    /// driver compiles it).
    pub fn spill_bytes(&self) -> (u64, u64) {
        self.compiled.functions.iter().fold((0, 0), |(s, l), f| {
            (s + f.spill_store_bytes, l + f.spill_load_bytes)
        })
    }

    /// The largest register count of any kernel.
    pub fn max_registers(&self) -> Option<u32> {
        self.compiled
            .functions
            .iter()
            .filter_map(|f| f.registers)
            .max()
    }
}

/// Compiles every kernel for `arch` (cached, see [`nvrtc::compile`]) and checks that each one
/// the source is meant to define is in the image.
pub fn compile_all(arch: GpuArch, disk: &DiskCache) -> Result<KernelBuild> {
    let compiled = nvrtc::compile(SOURCE, PROGRAM_NAME, arch, &compile_options(arch), disk)?;
    let entries = compiled.entry_names();
    let expected = all_kernels();
    let missing: Vec<&str> = expected
        .iter()
        .map(|k| k.3.as_str())
        .filter(|n| !entries.iter().any(|e| e == n))
        .collect();
    if !missing.is_empty() {
        return Err(Error::Cuda {
            rank: None,
            op: format!("nvrtcCompileProgram({PROGRAM_NAME}, {arch})"),
            what: format!(
                "{} of {} kernels missing from the image (first: {}); NVRTC log:\n{}",
                missing.len(),
                expected.len(),
                missing[0],
                compiled.log
            ),
        });
    }
    Ok(KernelBuild {
        expected: expected.len(),
        found: expected.len(),
        compiled,
    })
}

/// The architecture to compile for on a device of compute capability `cc`, given the real
/// architectures libnvrtc supports ([`nvrtc::supported_archs`]): a CUBIN for the device's own
/// architecture when NVRTC knows it, else PTX for the newest supported architecture below it
/// (the driver compiles PTX for newer GPUs at load time). [`Error::Unavailable`] when NVRTC is
/// too new for the device (it supports nothing at or below `cc`).
pub fn choose_arch(cc: (u32, u32), supported: &[u32]) -> Result<GpuArch> {
    let want = cc.0 * 10 + cc.1;
    if supported.contains(&want) {
        return Ok(GpuArch::sm(cc.0, cc.1));
    }
    match supported.iter().copied().filter(|a| *a <= want).max() {
        Some(a) => Ok(GpuArch::compute(a / 10, a % 10)),
        None => Err(Error::unavailable(
            format!("NVRTC code generation for sm_{want}"),
            format!(
                "this libnvrtc supports only {:?}; install an NVRTC release that still supports compute capability {}.{}",
                supported, cc.0, cc.1
            ),
        )),
    }
}

/// Number of blocks for a launch over `n` elements of `elem_size` bytes on a device with
/// `sm_count` SMs: enough blocks for one 16-byte vector per thread, capped at
/// [`BLOCKS_PER_SM`] per SM (grid-stride loops cover the rest); at least 1.
pub fn grid_size(n: u64, elem_size: usize, sm_count: u32) -> u32 {
    let per_vec = (16 / elem_size.clamp(1, 16)) as u64;
    let vectors = n.div_ceil(per_vec).max(1);
    let wanted = vectors.div_ceil(u64::from(BLOCK_THREADS));
    let cap = u64::from(sm_count.max(1)) * u64::from(BLOCKS_PER_SM);
    wanted.min(cap).clamp(1, u64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_op_and_type_has_kernels_with_distinct_names() {
        let all = all_kernels();
        assert_eq!(all.len(), 10 * 4 * 2 + 10);
        let names: HashSet<_> = all.iter().map(|k| k.3.clone()).collect();
        assert_eq!(names.len(), all.len());
        for d in DataType::ALL {
            for op in ReduceOp::ALL {
                for kind in [KernelKind::ReduceInplace, KernelKind::ReduceInto] {
                    assert!(names.contains(&kernel_name(kind, d, op)));
                }
            }
        }
    }

    #[test]
    fn avg_runs_the_sum_kernel_and_names_match_the_source() {
        assert_eq!(
            kernel_name(KernelKind::ReduceInplace, DataType::F16, ReduceOp::Avg),
            "dspark_reduce_inplace_sum_f16"
        );
        assert_eq!(
            kernel_name(KernelKind::ReduceInto, DataType::BF16, ReduceOp::Max),
            "dspark_reduce_into_max_bf16"
        );
        assert_eq!(
            kernel_name(KernelKind::Finalize, DataType::U64, ReduceOp::Min),
            "dspark_finalize_u64"
        );
        // The source generates names from these pieces.
        for d in DataType::ALL {
            assert!(
                SOURCE.contains(&format!("DS_TYPE_ENTRIES({}, ", d.rust_name())),
                "{d:?}"
            );
        }
        for op in STEP_OPS {
            assert!(
                SOURCE.contains(&format!("DS_REDUCE_ENTRIES({}, ", op.name())),
                "{op:?}"
            );
        }
    }

    #[test]
    fn source_needs_no_headers() {
        assert!(!SOURCE
            .lines()
            .any(|l| l.trim_start().starts_with("#include")));
    }

    #[test]
    fn options_pin_ieee_semantics_and_ask_ptxas_for_spills_on_real_archs() {
        let real = compile_options(GpuArch::sm(9, 0));
        for o in [
            "--fmad=false",
            "--ftz=false",
            "--prec-div=true",
            "-default-device",
            "--std=c++17",
        ] {
            assert!(real.iter().any(|x| x == o), "{o}");
        }
        assert!(real.iter().any(|x| x == "--ptxas-options=-v"));
        assert!(!compile_options(GpuArch::compute(9, 0))
            .iter()
            .any(|x| x.contains("ptxas")));
    }

    #[test]
    fn arch_is_the_devices_own_or_ptx_for_the_newest_older_one() {
        let nvrtc_12_8 = [
            50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 120,
        ];
        assert_eq!(choose_arch((9, 0), &nvrtc_12_8).unwrap(), GpuArch::sm(9, 0));
        assert_eq!(choose_arch((8, 6), &nvrtc_12_8).unwrap(), GpuArch::sm(8, 6));
        assert_eq!(
            choose_arch((12, 1), &nvrtc_12_8).unwrap(),
            GpuArch::compute(12, 0)
        );
        assert_eq!(
            choose_arch((10, 3), &nvrtc_12_8).unwrap(),
            GpuArch::compute(10, 1)
        );
        let e = choose_arch((3, 5), &nvrtc_12_8).unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    }

    #[test]
    fn grid_is_at_least_one_block_and_capped_per_sm() {
        assert_eq!(grid_size(0, 4, 132), 1);
        assert_eq!(grid_size(1, 1, 132), 1);
        assert_eq!(grid_size(4 * 256, 4, 132), 1);
        assert_eq!(grid_size(4 * 256 + 1, 4, 132), 2);
        assert_eq!(grid_size(1 << 30, 4, 132), 132 * BLOCKS_PER_SM);
        assert_eq!(grid_size(1 << 30, 8, 0), BLOCKS_PER_SM);
    }
}
