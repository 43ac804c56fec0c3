//! CPU reduction kernels: `dst = dst ⊕ src` over byte buffers, SIMD chosen at run time.
//!
//! The engine reduces every received chunk with [`reduce_inplace`] (or [`reduce_into`] when
//! the result goes to a third buffer) and ends an `Avg` with [`finalize`]. Buffers are raw bytes
//! in native endianness, of any alignment; only the whole elements of the shortest buffer are
//! touched. Nothing here allocates, blocks or panics.
//!
//! # Semantics (shared bit for bit with the GPU kernels)
//!
//! * Integer `Sum` and `Prod` wrap; `Min`/`Max` are the plain ones.
//! * `f32`/`f64` `Sum`/`Prod` are IEEE operations in the type.
//! * `f16`/`bf16`: both operands are widened to `f32`, the op runs in `f32`, and the result is
//!   rounded back once to nearest even (what `half`'s `from_f32` does).
//! * Float `Min`/`Max` are commutative bit for bit, so every rank ends with the same bits
//!   whatever operand order it used: if either operand is NaN the result is the canonical
//!   quiet NaN of the type (`f16` 0x7E00, `bf16` 0x7FC0, `f32` 0x7FC0_0000, `f64`
//!   0x7FF8_0000_0000_0000), and -0 < +0.
//! * `Avg` reduces as `Sum`; [`finalize`] divides once by the world size (integers truncate
//!   toward zero; `f16`/`bf16` divide in `f32` and round once).
//!
//! NaN *payloads* from `Sum`/`Prod` are whatever the hardware produces and are not part of the
//! contract.
//!
//! # Implementations
//!
//! On x86-64 the best of AVX-512 (F+BW), AVX2 (+F16C) and a portable scalar loop is picked once
//! per process with `is_x86_feature_detected!` ([`simd_level`] names it); other architectures use
//! the scalar loop, which is also the definition the SIMD kernels are tested against.
//!
//! ```
//! use dspark::internals::reduce::{finalize, reduce_slice};
//! use dspark::ReduceOp;
//!
//! let mut acc = vec![1.0f32, 2.0, 3.0];
//! reduce_slice(ReduceOp::Avg, &mut acc, &[3.0, 4.0, 5.0]);
//! let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut acc);
//! finalize(dspark::DataType::F32, ReduceOp::Avg, bytes, 2);
//! assert_eq!(acc, [2.0, 3.0, 4.0]);
//! ```

use crate::types::{DataType, Element, ReduceOp};
use std::sync::OnceLock;

mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;

/// Buffers shorter than this many bytes skip the alignment prologue of the SIMD path.
#[cfg(target_arch = "x86_64")]
const ALIGN_MIN_BYTES: usize = 512;
/// Buffers shorter than this many bytes (two AVX-512 registers) go straight to the scalar loop
/// (which the compiler vectorises for the baseline x86-64) from [`reduce_inplace`] and
/// [`reduce_into`]: below it a SIMD kernel has at most one register to do, and the dispatch
/// to it with the scalar head and tail around it took 238 instructions for 8 bytes against 60
/// for the scalar loop alone (callgrind). Over shared memory, 2 ranks, one-shot: 8 bytes went
/// from 0.125 to 0.117 µs with a threshold of 64, and 64 bytes from 0.135 to 0.125 with 128.
const TINY_BYTES: usize = 128;
/// The alignment the SIMD path gives `dst` before its main loop (one cache line).
#[cfg(target_arch = "x86_64")]
const ALIGN: usize = 64;

/// A SIMD implementation level (for tests, benchmarks and diagnostics).
///
/// Not part of the stable API: the dispatcher picks the best supported level by itself.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimdLevel {
    /// Portable element-by-element loops.
    Scalar,
    /// AVX2 with F16C, 256-bit registers.
    Avx2,
    /// AVX-512F and AVX-512BW, 512-bit registers.
    Avx512,
}

impl SimdLevel {
    /// Every level, worst first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];

    /// The name [`simd_level`] reports for this level.
    pub const fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2+f16c",
            SimdLevel::Avx512 => "avx512f+avx512bw",
        }
    }

    /// Whether this CPU can run the level.
    pub fn is_supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => x86::avx2::supported(),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => x86::avx512::supported(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best level this CPU supports, detected once per process.
    pub fn best() -> SimdLevel {
        static BEST: OnceLock<SimdLevel> = OnceLock::new();
        *BEST.get_or_init(|| {
            SimdLevel::ALL
                .into_iter()
                .rev()
                .find(|l| l.is_supported())
                .unwrap_or(SimdLevel::Scalar)
        })
    }

    /// `self` if this CPU supports it, else [`SimdLevel::Scalar`].
    #[cfg(target_arch = "x86_64")]
    fn or_scalar(self) -> SimdLevel {
        if self == SimdLevel::best() || self.is_supported() {
            self
        } else {
            SimdLevel::Scalar
        }
    }
}

/// Which implementation runs on this CPU, for bench headers and `dspark doctor`:
/// `"avx512f+avx512bw"`, `"avx2+f16c"` or `"scalar"`.
pub fn simd_level() -> &'static str {
    SimdLevel::best().name()
}

/// The SIMD binary kernel of `level`, which must be supported by this CPU.
#[cfg(target_arch = "x86_64")]
fn binary_kernel(level: SimdLevel, dtype: DataType, op: ReduceOp) -> Option<x86::BinaryFn> {
    match level {
        SimdLevel::Scalar => None,
        SimdLevel::Avx2 => Some(x86::avx2::binary_kernel(dtype, op)),
        SimdLevel::Avx512 => Some(x86::avx512::binary_kernel(dtype, op)),
    }
}

/// The SIMD division kernel of `level` (floats only), which must be supported by this CPU.
#[cfg(target_arch = "x86_64")]
fn divide_kernel(level: SimdLevel, dtype: DataType) -> Option<x86::DivideFn> {
    match level {
        SimdLevel::Scalar => None,
        SimdLevel::Avx2 => x86::avx2::divide_kernel(dtype),
        SimdLevel::Avx512 => x86::avx512::divide_kernel(dtype),
    }
}

/// How many elements to do in scalar code so that the SIMD loop stores to cache-line-aligned
/// addresses (0 when `p` is not element-aligned or the buffer is short).
#[cfg(target_arch = "x86_64")]
fn head_elems(p: *const u8, size: usize, n: usize) -> usize {
    let mis = p as usize % ALIGN;
    if mis == 0 || !mis.is_multiple_of(size) || n * size < ALIGN_MIN_BYTES {
        0
    } else {
        ((ALIGN - mis) / size).min(n)
    }
}

/// `dst[i] = dst[i] ⊕ src[i]` for every whole element; `op` Avg reduces as Sum.
///
/// `dst` and `src` are native-endian buffers of `dtype` elements, of any alignment, and should
/// have equal lengths (checked in debug builds); only the whole elements of the shorter one are
/// reduced.
pub fn reduce_inplace(dtype: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    if dst.len() < TINY_BYTES {
        debug_assert_eq!(
            dst.len(),
            src.len(),
            "reduce_inplace: buffer lengths differ"
        );
        scalar::reduce_inplace(dtype, op, dst, src);
        return;
    }
    reduce_inplace_at(SimdLevel::best(), dtype, op, dst, src);
}

/// [`reduce_inplace`] with a given implementation level (scalar if this CPU lacks it).
#[doc(hidden)]
pub fn reduce_inplace_at(
    level: SimdLevel,
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    src: &[u8],
) {
    debug_assert_eq!(
        dst.len(),
        src.len(),
        "reduce_inplace: buffer lengths differ"
    );
    let size = dtype.size();
    let n = dst.len().min(src.len()) / size;
    let (Some(dst), Some(src)) = (dst.get_mut(..n * size), src.get(..n * size)) else {
        return;
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = binary_kernel(level.or_scalar(), dtype, op) {
        let head = head_elems(dst.as_ptr(), size, n);
        let (Some((dh, dt)), Some((sh, st))) = (
            dst.split_at_mut_checked(head * size),
            src.split_at_checked(head * size),
        ) else {
            return;
        };
        scalar::reduce_inplace(dtype, op, dh, sh);
        let p = dt.as_mut_ptr();
        // SAFETY: the kernel belongs to a level this CPU supports (`or_scalar`); `dt` and `st`
        // hold n - head elements each; the kernel reads and writes `dt` only through `p`
        // (in place: dst == a), and `st` cannot overlap `dt` (shared vs. exclusive borrow).
        let done = unsafe { kernel(p, p, st.as_ptr(), n - head) };
        if let (Some(d), Some(s)) = (dt.get_mut(done * size..), st.get(done * size..)) {
            scalar::reduce_inplace(dtype, op, d, s);
        }
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = level;
    scalar::reduce_inplace(dtype, op, dst, src);
}

/// `dst[i] = a[i] ⊕ b[i]` for every whole element; `op` Avg reduces as Sum.
///
/// The buffers should have equal lengths (checked in debug builds); only the whole elements of
/// the shortest are written. `a` and `b` may be the same buffer.
pub fn reduce_into(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    if dst.len() < TINY_BYTES {
        debug_assert!(
            dst.len() == a.len() && a.len() == b.len(),
            "reduce_into: buffer lengths differ"
        );
        scalar::reduce_into(dtype, op, dst, a, b);
        return;
    }
    reduce_into_at(SimdLevel::best(), dtype, op, dst, a, b);
}

/// [`reduce_into`] with a given implementation level (scalar if this CPU lacks it).
#[doc(hidden)]
pub fn reduce_into_at(
    level: SimdLevel,
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    a: &[u8],
    b: &[u8],
) {
    debug_assert!(
        dst.len() == a.len() && a.len() == b.len(),
        "reduce_into: buffer lengths differ"
    );
    let size = dtype.size();
    let n = dst.len().min(a.len()).min(b.len()) / size;
    let (Some(dst), Some(a), Some(b)) = (
        dst.get_mut(..n * size),
        a.get(..n * size),
        b.get(..n * size),
    ) else {
        return;
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = binary_kernel(level.or_scalar(), dtype, op) {
        let head = head_elems(dst.as_ptr(), size, n);
        let (Some((dh, dt)), Some((ah, at)), Some((bh, bt))) = (
            dst.split_at_mut_checked(head * size),
            a.split_at_checked(head * size),
            b.split_at_checked(head * size),
        ) else {
            return;
        };
        scalar::reduce_into(dtype, op, dh, ah, bh);
        // SAFETY: the kernel belongs to a level this CPU supports (`or_scalar`); `dt`, `at` and
        // `bt` hold n - head elements each; `dt` is an exclusive borrow, so it overlaps
        // neither `at` nor `bt` (which may overlap each other: both are only read).
        let done = unsafe { kernel(dt.as_mut_ptr(), at.as_ptr(), bt.as_ptr(), n - head) };
        let k = done * size;
        if let (Some(d), Some(x), Some(y)) = (dt.get_mut(k..), at.get(k..), bt.get(k..)) {
            scalar::reduce_into(dtype, op, d, x, y);
        }
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = level;
    scalar::reduce_into(dtype, op, dst, a, b);
}

/// The final step of `op`: for Avg, `dst[i] = dst[i] / world` (integers truncate toward zero,
/// f16/bf16 divide in f32 and round once to nearest even); for every other op, nothing.
///
/// `world` is the number of ranks; 0 and 1 leave `dst` unchanged.
pub fn finalize(dtype: DataType, op: ReduceOp, dst: &mut [u8], world: usize) {
    finalize_at(SimdLevel::best(), dtype, op, dst, world);
}

/// [`finalize`] with a given implementation level (scalar if this CPU lacks it).
#[doc(hidden)]
pub fn finalize_at(level: SimdLevel, dtype: DataType, op: ReduceOp, dst: &mut [u8], world: usize) {
    if op != ReduceOp::Avg || world <= 1 {
        return;
    }
    let size = dtype.size();
    let n = dst.len() / size;
    let Some(dst) = dst.get_mut(..n * size) else {
        return;
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = divide_kernel(level.or_scalar(), dtype) {
        // SAFETY: the kernel belongs to a level this CPU supports (`or_scalar`); `dst` holds n
        // elements and is exclusively borrowed.
        let done = unsafe { kernel(dst.as_mut_ptr(), n, world) };
        if let Some(rest) = dst.get_mut(done * size..) {
            scalar::divide(dtype, rest, world);
        }
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = level;
    scalar::divide(dtype, dst, world);
}

/// Typed [`reduce_inplace`]: `dst[i] = dst[i] ⊕ src[i]`; `op` Avg reduces as Sum.
pub fn reduce_slice<T: Element>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    // Casting element slices to bytes cannot fail; the `else` is never taken.
    let (Ok(d), Ok(s)) = (
        bytemuck::try_cast_slice_mut(dst),
        bytemuck::try_cast_slice(src),
    ) else {
        return;
    };
    reduce_inplace(T::DATA_TYPE, op, d, s);
}

/// Typed [`reduce_into`]: `dst[i] = a[i] ⊕ b[i]`; `op` Avg reduces as Sum.
pub fn reduce_slice_into<T: Element>(op: ReduceOp, dst: &mut [T], a: &[T], b: &[T]) {
    let (Ok(d), Ok(x), Ok(y)) = (
        bytemuck::try_cast_slice_mut(dst),
        bytemuck::try_cast_slice(a),
        bytemuck::try_cast_slice(b),
    ) else {
        return;
    };
    reduce_into(T::DATA_TYPE, op, d, x, y);
}

/// Typed [`finalize`]: for Avg, `dst[i] = dst[i] / world`; nothing for other ops.
pub fn finalize_slice<T: Element>(op: ReduceOp, dst: &mut [T], world: usize) {
    if let Ok(d) = bytemuck::try_cast_slice_mut(dst) {
        finalize(T::DATA_TYPE, op, d, world);
    }
}
