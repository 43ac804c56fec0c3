//! The portable kernels: safe, element by element, and the definition the SIMD kernels must
//! match bit for bit. They also process the heads and tails the SIMD loops leave.

use crate::types::{DataType, ReduceOp};
use half::{bf16, f16};

/// The canonical quiet NaN of `f32` (positive, only the quiet bit set).
pub(crate) const QNAN_F32: u32 = 0x7FC0_0000;
/// The canonical quiet NaN of `f64`.
pub(crate) const QNAN_F64: u64 = 0x7FF8_0000_0000_0000;

/// One element type as the scalar kernels see it.
pub(crate) trait Scalar: Copy {
    /// Size in bytes.
    const SIZE: usize;
    /// Reads one element from exactly `SIZE` native-endian bytes.
    fn load(bytes: &[u8]) -> Self;
    /// Writes the element into exactly `SIZE` bytes.
    fn store(self, bytes: &mut [u8]);
    /// Sum (wrapping for integers).
    fn sum(a: Self, b: Self) -> Self;
    /// Product (wrapping for integers).
    fn prod(a: Self, b: Self) -> Self;
    /// Commutative minimum (floats: NaN if either is NaN, -0 < +0).
    fn min(a: Self, b: Self) -> Self;
    /// Commutative maximum.
    fn max(a: Self, b: Self) -> Self;
    /// The division of `Avg` by the world size (`world` > 0).
    fn div_world(self, world: usize) -> Self;
}

/// Commutative `f32` minimum: canonical NaN if either operand is NaN, and -0 < +0.
#[inline]
pub(crate) fn min_f32(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::from_bits(QNAN_F32)
    } else if a < b {
        a
    } else if b < a {
        b
    } else {
        // Equal: identical bits, or ±0 where the OR of the bits is -0.
        f32::from_bits(a.to_bits() | b.to_bits())
    }
}

/// Commutative `f32` maximum: canonical NaN if either operand is NaN, and -0 < +0.
#[inline]
pub(crate) fn max_f32(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::from_bits(QNAN_F32)
    } else if a > b {
        a
    } else if b > a {
        b
    } else {
        // Equal: identical bits, or ±0 where the AND of the bits is +0.
        f32::from_bits(a.to_bits() & b.to_bits())
    }
}

/// Commutative `f64` minimum (see [`min_f32`]).
#[inline]
pub(crate) fn min_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::from_bits(QNAN_F64)
    } else if a < b {
        a
    } else if b < a {
        b
    } else {
        f64::from_bits(a.to_bits() | b.to_bits())
    }
}

/// Commutative `f64` maximum (see [`max_f32`]).
#[inline]
pub(crate) fn max_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::from_bits(QNAN_F64)
    } else if a > b {
        a
    } else if b > a {
        b
    } else {
        f64::from_bits(a.to_bits() & b.to_bits())
    }
}

macro_rules! bytes_io {
    ($t:ty, $n:expr) => {
        const SIZE: usize = $n;
        #[inline(always)]
        fn load(bytes: &[u8]) -> Self {
            // The callers pass chunks of exactly SIZE bytes; the fallback is never taken.
            <[u8; $n]>::try_from(bytes).map_or_else(|_| <$t>::default(), <$t>::from_ne_bytes)
        }
        #[inline(always)]
        fn store(self, bytes: &mut [u8]) {
            if let Ok(out) = <&mut [u8; $n]>::try_from(bytes) {
                *out = self.to_ne_bytes();
            }
        }
    };
}

macro_rules! int_scalar {
    ($($t:ty => $n:expr),*) => {$(
        impl Scalar for $t {
            bytes_io!($t, $n);
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn div_world(self, world: usize) -> Self {
                div_int(self, world)
            }
        }
    )*};
}

int_scalar!(i8 => 1, u8 => 1, i32 => 4, u32 => 4, i64 => 8, u64 => 8);

/// Integer division truncating toward zero by a world size that may exceed the type's range.
trait DivInt: Sized {
    fn div_usize(self, world: usize) -> Self;
}

#[inline(always)]
fn div_int<T: DivInt>(v: T, world: usize) -> T {
    v.div_usize(world)
}

macro_rules! div_small {
    ($($t:ty),*) => {$(
        impl DivInt for $t {
            #[inline(always)]
            fn div_usize(self, world: usize) -> Self {
                // |self| < 2^32, so a world clamped to i64::MAX gives the same quotient (0).
                let w = i64::try_from(world).unwrap_or(i64::MAX).max(1);
                // The quotient's magnitude is at most |self|: it fits back.
                (i64::from(self) / w) as $t
            }
        }
    )*};
}
div_small!(i8, u8, i32, u32);

impl DivInt for i64 {
    #[inline(always)]
    fn div_usize(self, world: usize) -> Self {
        match i64::try_from(world) {
            Ok(w) if w > 0 => self / w,
            // World sizes of 2^63 and above: only i64::MIN / 2^63 is not 0.
            _ => (i128::from(self) / (world.max(1) as i128)) as i64,
        }
    }
}

impl DivInt for u64 {
    #[inline(always)]
    fn div_usize(self, world: usize) -> Self {
        match u64::try_from(world) {
            Ok(w) if w > 0 => self / w,
            Ok(_) => self,
            Err(_) => 0,
        }
    }
}

impl Scalar for f32 {
    bytes_io!(f32, 4);
    #[inline(always)]
    fn sum(a: Self, b: Self) -> Self {
        a + b
    }
    #[inline(always)]
    fn prod(a: Self, b: Self) -> Self {
        a * b
    }
    #[inline(always)]
    fn min(a: Self, b: Self) -> Self {
        min_f32(a, b)
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        max_f32(a, b)
    }
    #[inline(always)]
    fn div_world(self, world: usize) -> Self {
        self / world as f32
    }
}

impl Scalar for f64 {
    bytes_io!(f64, 8);
    #[inline(always)]
    fn sum(a: Self, b: Self) -> Self {
        a + b
    }
    #[inline(always)]
    fn prod(a: Self, b: Self) -> Self {
        a * b
    }
    #[inline(always)]
    fn min(a: Self, b: Self) -> Self {
        min_f64(a, b)
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        max_f64(a, b)
    }
    #[inline(always)]
    fn div_world(self, world: usize) -> Self {
        self / world as f64
    }
}

/// f16 and bf16: both operands to f32, the op in f32, one rounding back (nearest even).
macro_rules! half_scalar {
    ($($t:ty),*) => {$(
        impl Scalar for $t {
            bytes_io!($t, 2);
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() + b.to_f32())
            }
            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() * b.to_f32())
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                <$t>::from_f32(min_f32(a.to_f32(), b.to_f32()))
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                <$t>::from_f32(max_f32(a.to_f32(), b.to_f32()))
            }
            #[inline(always)]
            fn div_world(self, world: usize) -> Self {
                <$t>::from_f32(self.to_f32() / world as f32)
            }
        }
    )*};
}
half_scalar!(f16, bf16);

#[inline(always)]
fn zip_inplace<T: Scalar>(dst: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
    for (d, s) in dst.chunks_exact_mut(T::SIZE).zip(src.chunks_exact(T::SIZE)) {
        f(T::load(d), T::load(s)).store(d);
    }
}

#[inline(always)]
fn zip_into<T: Scalar>(dst: &mut [u8], a: &[u8], b: &[u8], f: impl Fn(T, T) -> T) {
    let ab = a.chunks_exact(T::SIZE).zip(b.chunks_exact(T::SIZE));
    for (d, (x, y)) in dst.chunks_exact_mut(T::SIZE).zip(ab) {
        f(T::load(x), T::load(y)).store(d);
    }
}

fn inplace_t<T: Scalar>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip_inplace(dst, src, T::sum),
        ReduceOp::Prod => zip_inplace(dst, src, T::prod),
        ReduceOp::Min => zip_inplace(dst, src, T::min),
        ReduceOp::Max => zip_inplace(dst, src, T::max),
    }
}

fn into_t<T: Scalar>(op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip_into(dst, a, b, T::sum),
        ReduceOp::Prod => zip_into(dst, a, b, T::prod),
        ReduceOp::Min => zip_into(dst, a, b, T::min),
        ReduceOp::Max => zip_into(dst, a, b, T::max),
    }
}

fn divide_t<T: Scalar>(dst: &mut [u8], world: usize) {
    for d in dst.chunks_exact_mut(T::SIZE) {
        T::load(d).div_world(world).store(d);
    }
}

macro_rules! by_dtype {
    ($dtype:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            DataType::I8 => $f::<i8>($($arg),*),
            DataType::U8 => $f::<u8>($($arg),*),
            DataType::I32 => $f::<i32>($($arg),*),
            DataType::U32 => $f::<u32>($($arg),*),
            DataType::I64 => $f::<i64>($($arg),*),
            DataType::U64 => $f::<u64>($($arg),*),
            DataType::F16 => $f::<f16>($($arg),*),
            DataType::BF16 => $f::<bf16>($($arg),*),
            DataType::F32 => $f::<f32>($($arg),*),
            DataType::F64 => $f::<f64>($($arg),*),
        }
    };
}

/// `dst[i] = dst[i] ⊕ src[i]` over the whole elements of the shorter slice.
pub(crate) fn reduce_inplace(dtype: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    by_dtype!(dtype, inplace_t, op, dst, src)
}

/// `dst[i] = a[i] ⊕ b[i]` over the whole elements of the shortest slice.
pub(crate) fn reduce_into(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    by_dtype!(dtype, into_t, op, dst, a, b)
}

/// `dst[i] = dst[i] / world` (the division of `Avg`); `world` must be > 0.
pub(crate) fn divide(dtype: DataType, dst: &mut [u8], world: usize) {
    by_dtype!(dtype, divide_t, dst, world)
}
