//! x86-64 SIMD kernels: AVX2 (+F16C) and AVX-512 (F+BW), chosen at run time.
//!
//! The pieces:
//! * a [`Codec`] per element type and level loads `LANES` elements from unaligned memory into a
//!   register (f16 and bf16 widen to f32) and stores a register back (f16/bf16 round to nearest
//!   even, exactly like `half`'s `from_f32`);
//! * a [`BinOp`] per operation and register type (the op markers below);
//! * generic drivers ([`binary`], [`divide`]) that loop over whole registers and report how
//!   many elements they did; the safe scalar kernels do the rest.
//!
//! Every helper is `#[inline(always)]` and free of `#[target_feature]`; only the entry points in
//! [`avx2`] and [`avx512`] enable features, so everything inlines into them and is compiled for
//! their level. Those entry points are `unsafe fn`: calling one on a CPU without its features is
//! undefined behaviour, which is why the dispatcher only hands them out after detection.

pub(crate) mod avx2;
// AVX-512 intrinsics are stable since Rust 1.89 (the package's `rust-version` is older).
#[clippy::msrv = "1.89"]
pub(crate) mod avx512;

/// A SIMD kernel for `dst[i] = a[i] ⊕ b[i]`: processes a prefix of whole registers of the `n`
/// elements and returns its length in elements. `dst` may equal `a` (in place), otherwise
/// must not overlap `a` or `b`.
pub(crate) type BinaryFn = unsafe fn(dst: *mut u8, a: *const u8, b: *const u8, n: usize) -> usize;

/// A SIMD kernel for `dst[i] = dst[i] / world`: processes a prefix of the `n` elements and
/// returns its length in elements.
pub(crate) type DivideFn = unsafe fn(dst: *mut u8, n: usize, world: usize) -> usize;

/// Loading and storing one element type at one SIMD level.
pub(crate) trait Codec {
    /// The register the elements live in while they are reduced.
    type V: Copy;
    /// Elements per register.
    const LANES: usize;
    /// Bytes per element in memory.
    const ELEM: usize;
    /// Loads `LANES` elements from `p`.
    ///
    /// # Safety
    /// `p` is valid for reading `LANES * ELEM` bytes (any alignment) and the CPU has the
    /// level's features.
    unsafe fn load(p: *const u8) -> Self::V;
    /// Stores `LANES` elements to `p`.
    ///
    /// # Safety
    /// `p` is valid for writing `LANES * ELEM` bytes (any alignment) and the CPU has the
    /// level's features.
    unsafe fn store(p: *mut u8, v: Self::V);
}

/// A floating-point codec whose register can be divided by the world size (`Avg`).
pub(crate) trait DivCodec: Codec {
    /// `world` converted to the arithmetic type (f32 for f16/bf16/f32, f64 for f64), in all
    /// lanes.
    ///
    /// # Safety
    /// The CPU has the level's features.
    unsafe fn splat_world(world: usize) -> Self::V;
    /// `v / w` lane by lane.
    ///
    /// # Safety
    /// The CPU has the level's features.
    unsafe fn div(v: Self::V, w: Self::V) -> Self::V;
}

/// One reduction operation on a register type.
pub(crate) trait BinOp<V> {
    /// `a ⊕ b` lane by lane.
    ///
    /// # Safety
    /// The CPU has the features of the level that owns `V`'s implementation.
    unsafe fn apply(a: V, b: V) -> V;
}

/// An op on a pair of registers (codecs that widen one load into two registers) is the op on
/// each.
impl<V: Copy, O: BinOp<V>> BinOp<(V, V)> for O {
    #[inline(always)]
    unsafe fn apply(a: (V, V), b: (V, V)) -> (V, V) {
        // SAFETY: forwarded contract of `BinOp::apply`.
        unsafe { (O::apply(a.0, b.0), O::apply(a.1, b.1)) }
    }
}

/// Operation markers; each level implements [`BinOp`] for them on its register types.
pub(crate) mod ops {
    macro_rules! markers {
        ($($(#[$m:meta])* $name:ident),* $(,)?) => {$(
            $(#[$m])*
            #[derive(Debug)]
            pub(crate) struct $name;
        )*};
    }
    markers! {
        /// Wrapping 8-bit add.
        Add8,
        /// Wrapping 8-bit multiply (low 8 bits of the product).
        Mul8,
        /// Signed 8-bit minimum.
        MinI8,
        /// Signed 8-bit maximum.
        MaxI8,
        /// Unsigned 8-bit minimum.
        MinU8,
        /// Unsigned 8-bit maximum.
        MaxU8,
        /// Wrapping 32-bit add.
        Add32,
        /// Wrapping 32-bit multiply.
        Mul32,
        /// Signed 32-bit minimum.
        MinI32,
        /// Signed 32-bit maximum.
        MaxI32,
        /// Unsigned 32-bit minimum.
        MinU32,
        /// Unsigned 32-bit maximum.
        MaxU32,
        /// Wrapping 64-bit add.
        Add64,
        /// Wrapping 64-bit multiply.
        Mul64,
        /// Signed 64-bit minimum.
        MinI64,
        /// Signed 64-bit maximum.
        MaxI64,
        /// Unsigned 64-bit minimum.
        MinU64,
        /// Unsigned 64-bit maximum.
        MaxU64,
        /// f32 add.
        AddF32,
        /// f32 multiply.
        MulF32,
        /// Commutative f32 minimum (canonical NaN, -0 < +0).
        MinF32,
        /// Commutative f32 maximum (canonical NaN, -0 < +0).
        MaxF32,
        /// f64 add.
        AddF64,
        /// f64 multiply.
        MulF64,
        /// Commutative f64 minimum (canonical NaN, -0 < +0).
        MinF64,
        /// Commutative f64 maximum (canonical NaN, -0 < +0).
        MaxF64,
    }
}

/// The generic binary loop: whole registers only, unrolled by four.
///
/// # Safety
/// `dst` is valid for writing and `a`, `b` for reading `n` elements of `C::ELEM` bytes; `dst`
/// equals `a` or overlaps neither `a` nor `b`; the CPU has the level's features.
#[inline(always)]
pub(crate) unsafe fn binary<C: Codec, O: BinOp<C::V>>(
    dst: *mut u8,
    a: *const u8,
    b: *const u8,
    n: usize,
) -> usize {
    let lanes = C::LANES;
    let mut i = 0usize;
    while n - i >= 4 * lanes {
        let off = i * C::ELEM;
        let step = lanes * C::ELEM;
        // SAFETY: elements i..i + 4 * lanes are in bounds (checked above); every load of a
        // block happens before its store, so dst == a is fine.
        unsafe {
            let a0 = C::load(a.add(off));
            let b0 = C::load(b.add(off));
            let a1 = C::load(a.add(off + step));
            let b1 = C::load(b.add(off + step));
            let a2 = C::load(a.add(off + 2 * step));
            let b2 = C::load(b.add(off + 2 * step));
            let a3 = C::load(a.add(off + 3 * step));
            let b3 = C::load(b.add(off + 3 * step));
            C::store(dst.add(off), O::apply(a0, b0));
            C::store(dst.add(off + step), O::apply(a1, b1));
            C::store(dst.add(off + 2 * step), O::apply(a2, b2));
            C::store(dst.add(off + 3 * step), O::apply(a3, b3));
        }
        i += 4 * lanes;
    }
    while n - i >= lanes {
        let off = i * C::ELEM;
        // SAFETY: elements i..i + lanes are in bounds (checked above).
        unsafe {
            let x = C::load(a.add(off));
            let y = C::load(b.add(off));
            C::store(dst.add(off), O::apply(x, y));
        }
        i += lanes;
    }
    i
}

/// The generic `dst /= world` loop over whole registers.
///
/// # Safety
/// `dst` is valid for reading and writing `n` elements of `C::ELEM` bytes; the CPU has the
/// level's features.
#[inline(always)]
pub(crate) unsafe fn divide<C: DivCodec>(dst: *mut u8, n: usize, world: usize) -> usize {
    let lanes = C::LANES;
    // SAFETY: the caller guarantees the features.
    let w = unsafe { C::splat_world(world) };
    let mut i = 0usize;
    while n - i >= lanes {
        let off = i * C::ELEM;
        // SAFETY: elements i..i + lanes are in bounds (checked above).
        unsafe {
            let p = dst.add(off);
            C::store(p, C::div(C::load(p), w));
        }
        i += lanes;
    }
    i
}

/// Expands to the `(DataType, ReduceOp) -> BinaryFn` table of one level, given the level's
/// generic entry point `$run::<Codec, Op>` and codecs named `Int<1>`, `Int<4>`, `Int<8>`, `F16`,
/// `Bf16`, `F32`, `F64` in scope.
macro_rules! binary_table {
    ($run:ident) => {
        /// The kernel of this level for `dtype` and `op` (`Avg` reduces as `Sum`).
        pub(crate) fn binary_kernel(
            dtype: $crate::types::DataType,
            op: $crate::types::ReduceOp,
        ) -> $crate::reduce::x86::BinaryFn {
            use $crate::reduce::x86::ops::*;
            use $crate::reduce::x86::BinaryFn;
            use $crate::types::DataType as D;
            use $crate::types::ReduceOp as R;
            match (dtype, op) {
                (D::I8 | D::U8, R::Sum | R::Avg) => $run::<Int<1>, Add8> as BinaryFn,
                (D::I8 | D::U8, R::Prod) => $run::<Int<1>, Mul8>,
                (D::I8, R::Min) => $run::<Int<1>, MinI8>,
                (D::I8, R::Max) => $run::<Int<1>, MaxI8>,
                (D::U8, R::Min) => $run::<Int<1>, MinU8>,
                (D::U8, R::Max) => $run::<Int<1>, MaxU8>,
                (D::I32 | D::U32, R::Sum | R::Avg) => $run::<Int<4>, Add32>,
                (D::I32 | D::U32, R::Prod) => $run::<Int<4>, Mul32>,
                (D::I32, R::Min) => $run::<Int<4>, MinI32>,
                (D::I32, R::Max) => $run::<Int<4>, MaxI32>,
                (D::U32, R::Min) => $run::<Int<4>, MinU32>,
                (D::U32, R::Max) => $run::<Int<4>, MaxU32>,
                (D::I64 | D::U64, R::Sum | R::Avg) => $run::<Int<8>, Add64>,
                (D::I64 | D::U64, R::Prod) => $run::<Int<8>, Mul64>,
                (D::I64, R::Min) => $run::<Int<8>, MinI64>,
                (D::I64, R::Max) => $run::<Int<8>, MaxI64>,
                (D::U64, R::Min) => $run::<Int<8>, MinU64>,
                (D::U64, R::Max) => $run::<Int<8>, MaxU64>,
                (D::F32, R::Sum | R::Avg) => $run::<F32, AddF32>,
                (D::F32, R::Prod) => $run::<F32, MulF32>,
                (D::F32, R::Min) => $run::<F32, MinF32>,
                (D::F32, R::Max) => $run::<F32, MaxF32>,
                (D::F64, R::Sum | R::Avg) => $run::<F64, AddF64>,
                (D::F64, R::Prod) => $run::<F64, MulF64>,
                (D::F64, R::Min) => $run::<F64, MinF64>,
                (D::F64, R::Max) => $run::<F64, MaxF64>,
                (D::F16, R::Sum | R::Avg) => $run::<F16, AddF32>,
                (D::F16, R::Prod) => $run::<F16, MulF32>,
                (D::F16, R::Min) => $run::<F16, MinF32>,
                (D::F16, R::Max) => $run::<F16, MaxF32>,
                (D::BF16, R::Sum | R::Avg) => $run::<Bf16, AddF32>,
                (D::BF16, R::Prod) => $run::<Bf16, MulF32>,
                (D::BF16, R::Min) => $run::<Bf16, MinF32>,
                (D::BF16, R::Max) => $run::<Bf16, MaxF32>,
            }
        }
    };
}
pub(crate) use binary_table;
