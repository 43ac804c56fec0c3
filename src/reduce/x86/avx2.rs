//! The AVX2 + F16C level: 256-bit registers.
//!
//! Every function here except the entry points is an `#[inline(always)]` helper that only runs
//! inlined into [`run`] or [`run_divide`], which enable `avx2,f16c`; their `unsafe` blocks rely
//! on that (the intrinsics need those features) and on the pointer contracts of [`Codec`].

use super::ops::*;
use super::{BinOp, Codec, DivCodec, DivideFn};
use crate::reduce::scalar::{QNAN_F32, QNAN_F64};
use crate::types::DataType;
use std::arch::x86_64::*;

/// The features this level needs, in `is_x86_feature_detected!` terms.
pub(crate) fn supported() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
}

/// The binary entry point of this level.
///
/// # Safety
/// The CPU supports AVX2 and F16C ([`supported`]), and the pointers satisfy [`super::binary`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn run<C: Codec, O: BinOp<C::V>>(
    dst: *mut u8,
    a: *const u8,
    b: *const u8,
    n: usize,
) -> usize {
    // SAFETY: forwarded contract; the features are enabled on this function.
    unsafe { super::binary::<C, O>(dst, a, b, n) }
}

/// The `Avg` division entry point of this level.
///
/// # Safety
/// The CPU supports AVX2 and F16C, and `dst` satisfies [`super::divide`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn run_divide<C: DivCodec>(dst: *mut u8, n: usize, world: usize) -> usize {
    // SAFETY: forwarded contract; the features are enabled on this function.
    unsafe { super::divide::<C>(dst, n, world) }
}

super::binary_table!(run);

/// The division kernel of this level for a float type; `None` for integers.
pub(crate) fn divide_kernel(dtype: DataType) -> Option<DivideFn> {
    match dtype {
        DataType::F32 => Some(run_divide::<F32>),
        DataType::F64 => Some(run_divide::<F64>),
        DataType::F16 => Some(run_divide::<F16>),
        DataType::BF16 => Some(run_divide::<Bf16>),
        _ => None,
    }
}

/// Integers of `N` bytes, 32 / `N` to a register.
#[derive(Debug)]
pub(crate) struct Int<const N: usize>;

impl<const N: usize> Codec for Int<N> {
    type V = __m256i;
    const LANES: usize = 32 / N;
    const ELEM: usize = N;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        // SAFETY: 32 readable bytes at p (Codec contract); loadu takes any alignment.
        unsafe { _mm256_loadu_si256(p.cast()) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut u8, v: __m256i) {
        // SAFETY: 32 writable bytes at p (Codec contract); storeu takes any alignment.
        unsafe { _mm256_storeu_si256(p.cast(), v) }
    }
}

/// f32, 8 to a register.
#[derive(Debug)]
pub(crate) struct F32;

impl Codec for F32 {
    type V = __m256;
    const LANES: usize = 8;
    const ELEM: usize = 4;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256 {
        // SAFETY: 32 readable bytes at p; unaligned load.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut u8, v: __m256) {
        // SAFETY: 32 writable bytes at p; unaligned store.
        unsafe { _mm256_storeu_ps(p.cast(), v) }
    }
}

/// f64, 4 to a register.
#[derive(Debug)]
pub(crate) struct F64;

impl Codec for F64 {
    type V = __m256d;
    const LANES: usize = 4;
    const ELEM: usize = 8;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256d {
        // SAFETY: 32 readable bytes at p; unaligned load.
        unsafe { _mm256_loadu_pd(p.cast()) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut u8, v: __m256d) {
        // SAFETY: 32 writable bytes at p; unaligned store.
        unsafe { _mm256_storeu_pd(p.cast(), v) }
    }
}

/// f16 widened to f32 with F16C, 8 to a register; stores round to nearest even.
#[derive(Debug)]
pub(crate) struct F16;

impl Codec for F16 {
    type V = __m256;
    const LANES: usize = 8;
    const ELEM: usize = 2;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes at p; unaligned load; F16C enabled by the entry point.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut u8, v: __m256) {
        // SAFETY: 16 writable bytes at p; unaligned store. The immediate selects round to
        // nearest even whatever MXCSR says.
        unsafe { _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
    }
}

/// bf16 widened to f32, 16 to a pair of registers; stores round to nearest even in integer
/// arithmetic and keep NaNs NaN, bit for bit like `half::bf16::from_f32`.
///
/// Widening interleaves each 16-bit value with a zero below it (`vpunpck[lh]wd`), which puts
/// the bf16 bits in the high half of an f32 lane; narrowing takes the high halves back with
/// `vpackusdw`. Both work within 128-bit lanes and are exact inverses, so the element order in
/// the registers is permuted but every result lands where its operands came from.
#[derive(Debug)]
pub(crate) struct Bf16;

impl Codec for Bf16 {
    type V = (__m256, __m256);
    const LANES: usize = 16;
    const ELEM: usize = 2;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> (__m256, __m256) {
        // SAFETY: 32 readable bytes at p; unaligned load.
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            let z = _mm256_setzero_si256();
            (
                _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h)),
                _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h)),
            )
        }
    }
    #[inline(always)]
    unsafe fn store(p: *mut u8, v: (__m256, __m256)) {
        // SAFETY: 32 writable bytes at p; unaligned store.
        unsafe {
            let packed = _mm256_packus_epi32(bf16_round(v.0), bf16_round(v.1));
            _mm256_storeu_si256(p.cast(), packed)
        }
    }
}

/// f32 lanes to bf16 bits in the low half of each lane (the high half is zero).
#[inline(always)]
unsafe fn bf16_round(v: __m256) -> __m256i {
    // SAFETY: register-only intrinsics; AVX2 enabled by the entry point.
    unsafe {
        let x = _mm256_castps_si256(v);
        let hi = _mm256_srli_epi32::<16>(x);
        // Nearest even: add 0x7FFF plus the lowest kept bit, then drop the low half. No
        // non-NaN input can carry out of bit 31 (the largest is -inf, 0xFF80_0000).
        let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
        let t = _mm256_add_epi32(_mm256_add_epi32(x, lsb), _mm256_set1_epi32(0x7FFF));
        let rounded = _mm256_srli_epi32::<16>(t);
        // NaN: keep the high half and set the quiet bit.
        let nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
        let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        _mm256_blendv_epi8(rounded, nan, is_nan)
    }
}

impl DivCodec for Bf16 {
    #[inline(always)]
    unsafe fn splat_world(world: usize) -> (__m256, __m256) {
        // SAFETY: AVX enabled by the entry point.
        let w = unsafe { _mm256_set1_ps(world as f32) };
        (w, w)
    }
    #[inline(always)]
    unsafe fn div(v: (__m256, __m256), w: (__m256, __m256)) -> (__m256, __m256) {
        // SAFETY: AVX enabled by the entry point.
        unsafe { (_mm256_div_ps(v.0, w.0), _mm256_div_ps(v.1, w.1)) }
    }
}

macro_rules! f32_div {
    ($($t:ty),*) => {$(
        impl DivCodec for $t {
            #[inline(always)]
            unsafe fn splat_world(world: usize) -> __m256 {
                // SAFETY: AVX enabled by the entry point.
                unsafe { _mm256_set1_ps(world as f32) }
            }
            #[inline(always)]
            unsafe fn div(v: __m256, w: __m256) -> __m256 {
                // SAFETY: AVX enabled by the entry point.
                unsafe { _mm256_div_ps(v, w) }
            }
        }
    )*};
}
f32_div!(F32, F16);

impl DivCodec for F64 {
    #[inline(always)]
    unsafe fn splat_world(world: usize) -> __m256d {
        // SAFETY: AVX enabled by the entry point.
        unsafe { _mm256_set1_pd(world as f64) }
    }
    #[inline(always)]
    unsafe fn div(v: __m256d, w: __m256d) -> __m256d {
        // SAFETY: AVX enabled by the entry point.
        unsafe { _mm256_div_pd(v, w) }
    }
}

/// Implements [`BinOp`] for a marker with a body over `a` and `b`.
macro_rules! binop {
    ($($op:ty, $v:ty, |$a:ident, $b:ident| $body:expr;)*) => {$(
        impl BinOp<$v> for $op {
            #[inline(always)]
            unsafe fn apply($a: $v, $b: $v) -> $v {
                // SAFETY: register-only intrinsics; AVX2 enabled by the entry point.
                unsafe { $body }
            }
        }
    )*};
}

binop! {
    Add8, __m256i, |a, b| _mm256_add_epi8(a, b);
    Mul8, __m256i, |a, b| mul8(a, b);
    MinI8, __m256i, |a, b| _mm256_min_epi8(a, b);
    MaxI8, __m256i, |a, b| _mm256_max_epi8(a, b);
    MinU8, __m256i, |a, b| _mm256_min_epu8(a, b);
    MaxU8, __m256i, |a, b| _mm256_max_epu8(a, b);
    Add32, __m256i, |a, b| _mm256_add_epi32(a, b);
    Mul32, __m256i, |a, b| _mm256_mullo_epi32(a, b);
    MinI32, __m256i, |a, b| _mm256_min_epi32(a, b);
    MaxI32, __m256i, |a, b| _mm256_max_epi32(a, b);
    MinU32, __m256i, |a, b| _mm256_min_epu32(a, b);
    MaxU32, __m256i, |a, b| _mm256_max_epu32(a, b);
    Add64, __m256i, |a, b| _mm256_add_epi64(a, b);
    Mul64, __m256i, |a, b| mul64(a, b);
    // AVX2 has no 64-bit min/max: compare and blend (a > b picks b for min, a for max).
    MinI64, __m256i, |a, b| _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(a, b));
    MaxI64, __m256i, |a, b| _mm256_blendv_epi8(b, a, _mm256_cmpgt_epi64(a, b));
    MinU64, __m256i, |a, b| _mm256_blendv_epi8(a, b, gt_u64(a, b));
    MaxU64, __m256i, |a, b| _mm256_blendv_epi8(b, a, gt_u64(a, b));
    AddF32, __m256, |a, b| _mm256_add_ps(a, b);
    MulF32, __m256, |a, b| _mm256_mul_ps(a, b);
    MinF32, __m256, |a, b| min_f32(a, b);
    MaxF32, __m256, |a, b| max_f32(a, b);
    AddF64, __m256d, |a, b| _mm256_add_pd(a, b);
    MulF64, __m256d, |a, b| _mm256_mul_pd(a, b);
    MinF64, __m256d, |a, b| min_f64(a, b);
    MaxF64, __m256d, |a, b| max_f64(a, b);
}

/// Low 8 bits of the byte products: 16-bit multiplies of the even and the odd bytes.
#[inline(always)]
unsafe fn mul8(a: __m256i, b: __m256i) -> __m256i {
    // SAFETY: register-only intrinsics; AVX2 enabled by the entry point.
    unsafe {
        // The low byte of a 16-bit product depends only on the low bytes of the operands.
        let even = _mm256_mullo_epi16(a, b);
        let odd = _mm256_mullo_epi16(_mm256_srli_epi16::<8>(a), _mm256_srli_epi16::<8>(b));
        _mm256_or_si256(
            _mm256_slli_epi16::<8>(odd),
            _mm256_and_si256(even, _mm256_set1_epi16(0x00FF)),
        )
    }
}

/// Low 64 bits of the products: lo*lo + ((hi*lo + lo*hi) << 32).
#[inline(always)]
unsafe fn mul64(a: __m256i, b: __m256i) -> __m256i {
    // SAFETY: register-only intrinsics; AVX2 enabled by the entry point.
    unsafe {
        let lo = _mm256_mul_epu32(a, b);
        let cross = _mm256_add_epi64(
            _mm256_mul_epu32(_mm256_srli_epi64::<32>(a), b),
            _mm256_mul_epu32(a, _mm256_srli_epi64::<32>(b)),
        );
        _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(cross))
    }
}

/// Unsigned 64-bit `a > b` as a lane mask: flip the sign bits, compare signed.
#[inline(always)]
unsafe fn gt_u64(a: __m256i, b: __m256i) -> __m256i {
    // SAFETY: register-only intrinsics; AVX2 enabled by the entry point.
    unsafe {
        let s = _mm256_set1_epi64x(i64::MIN);
        _mm256_cmpgt_epi64(_mm256_xor_si256(a, s), _mm256_xor_si256(b, s))
    }
}

/// Commutative minimum: `minps` is right for ordered unequal lanes; equal lanes take the OR
/// of the bits (-0 wins over +0), unordered lanes the canonical NaN.
#[inline(always)]
unsafe fn min_f32(a: __m256, b: __m256) -> __m256 {
    // SAFETY: register-only intrinsics; AVX enabled by the entry point.
    unsafe {
        let m = _mm256_min_ps(a, b);
        let m = _mm256_blendv_ps(m, _mm256_or_ps(a, b), _mm256_cmp_ps::<_CMP_EQ_OQ>(a, b));
        let nan = _mm256_castsi256_ps(_mm256_set1_epi32(QNAN_F32 as i32));
        _mm256_blendv_ps(m, nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(a, b))
    }
}

/// Commutative maximum: equal lanes take the AND of the bits (+0 wins over -0).
#[inline(always)]
unsafe fn max_f32(a: __m256, b: __m256) -> __m256 {
    // SAFETY: register-only intrinsics; AVX enabled by the entry point.
    unsafe {
        let m = _mm256_max_ps(a, b);
        let m = _mm256_blendv_ps(m, _mm256_and_ps(a, b), _mm256_cmp_ps::<_CMP_EQ_OQ>(a, b));
        let nan = _mm256_castsi256_ps(_mm256_set1_epi32(QNAN_F32 as i32));
        _mm256_blendv_ps(m, nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(a, b))
    }
}

/// f64 version of [`min_f32`].
#[inline(always)]
unsafe fn min_f64(a: __m256d, b: __m256d) -> __m256d {
    // SAFETY: register-only intrinsics; AVX enabled by the entry point.
    unsafe {
        let m = _mm256_min_pd(a, b);
        let m = _mm256_blendv_pd(m, _mm256_or_pd(a, b), _mm256_cmp_pd::<_CMP_EQ_OQ>(a, b));
        let nan = _mm256_castsi256_pd(_mm256_set1_epi64x(QNAN_F64 as i64));
        _mm256_blendv_pd(m, nan, _mm256_cmp_pd::<_CMP_UNORD_Q>(a, b))
    }
}

/// f64 version of [`max_f32`].
#[inline(always)]
unsafe fn max_f64(a: __m256d, b: __m256d) -> __m256d {
    // SAFETY: register-only intrinsics; AVX enabled by the entry point.
    unsafe {
        let m = _mm256_max_pd(a, b);
        let m = _mm256_blendv_pd(m, _mm256_and_pd(a, b), _mm256_cmp_pd::<_CMP_EQ_OQ>(a, b));
        let nan = _mm256_castsi256_pd(_mm256_set1_epi64x(QNAN_F64 as i64));
        _mm256_blendv_pd(m, nan, _mm256_cmp_pd::<_CMP_UNORD_Q>(a, b))
    }
}
