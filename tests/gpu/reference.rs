//! An independent reference for the reduction kernels' semantics, written from the spec in
//! `ReduceOp`'s documentation (not from the CUDA source), shared by the host-emulation test
//! (`tests/gpu_kernels_compile.rs`) and the GPU test (`tests/gpu_device.rs`) through `#[path]`.
//!
//! Buffers are raw little-endian bytes so that one code path serves all ten types.
//!
//! - integers: Sum/Prod wrap; Min/Max; Avg's finalize truncates toward zero;
//! - f16/bf16: through f32 with the `half` crate, the op in f32, one rounding;
//! - float Min/Max: NaN in → canonical quiet NaN out, -0.0 < +0.0, so commutative bit for bit.
//!   For Sum/Prod/finalize a NaN result is compared as "is NaN" (its payload is unspecified:
//!   GPUs produce the canonical NaN, CPUs propagate an operand's payload).

#![allow(dead_code)]

use dspark::{DataType, ReduceOp};
use half::{bf16, f16};

/// A small deterministic generator (SplitMix64).
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(pub u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub(crate) fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// Elements of `dtype` drawn so that every class appears: random bit patterns (NaN, inf,
    /// subnormals included) mixed with small values, zeros of both signs and exact halves that
    /// round to even.
    pub(crate) fn elements(&mut self, dtype: DataType, n: usize) -> Vec<u8> {
        let es = dtype.size();
        let mut out = vec![0u8; n * es];
        for i in 0..n {
            let e = &mut out[i * es..(i + 1) * es];
            let pick = self.below(8);
            match (dtype, pick) {
                (DataType::F16, 0) => e.copy_from_slice(
                    &f16::from_f32((self.below(64) as f32 - 32.0) / 4.0).to_le_bytes(),
                ),
                (DataType::BF16, 0) => e.copy_from_slice(
                    &bf16::from_f32((self.below(64) as f32 - 32.0) / 4.0).to_le_bytes(),
                ),
                (DataType::F32, 0) => {
                    e.copy_from_slice(&((self.below(64) as f32 - 32.0) / 4.0).to_le_bytes())
                }
                (DataType::F64, 0) => {
                    e.copy_from_slice(&((self.below(64) as f64 - 32.0) / 4.0).to_le_bytes())
                }
                (d, 1) if d.is_float() => {
                    // +0 or -0
                    e.fill(0);
                    if self.below(2) == 1 {
                        e[es - 1] = 0x80;
                    }
                }
                (_, 2) => {
                    // small integers / small magnitudes
                    let v = self.below(7) as i64 - 3;
                    let b = v.to_le_bytes();
                    e.copy_from_slice(&b[..es]);
                    if dtype.is_float() {
                        let f = v as f64;
                        match dtype {
                            DataType::F16 => e.copy_from_slice(&f16::from_f64(f).to_le_bytes()),
                            DataType::BF16 => e.copy_from_slice(&bf16::from_f64(f).to_le_bytes()),
                            DataType::F32 => e.copy_from_slice(&(f as f32).to_le_bytes()),
                            _ => e.copy_from_slice(&f.to_le_bytes()),
                        }
                    }
                }
                _ => self.fill(e),
            }
        }
        out
    }
}

fn canonical_f32() -> f32 {
    f32::from_bits(0x7fc0_0000)
}

fn min_f32(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        canonical_f32()
    } else if a == b {
        // Equal: the same value, or zeros of different signs: -0 is the smaller.
        if a.is_sign_negative() || b.is_sign_negative() {
            if a.is_sign_negative() {
                a
            } else {
                b
            }
        } else {
            a
        }
    } else if a < b {
        a
    } else {
        b
    }
}

fn max_f32(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        canonical_f32()
    } else if a == b {
        if a.is_sign_positive() {
            a
        } else {
            b
        }
    } else if a > b {
        a
    } else {
        b
    }
}

fn min_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::from_bits(0x7ff8_0000_0000_0000)
    } else if a == b {
        if a.is_sign_negative() {
            a
        } else {
            b
        }
    } else if a < b {
        a
    } else {
        b
    }
}

fn max_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::from_bits(0x7ff8_0000_0000_0000)
    } else if a == b {
        if a.is_sign_positive() {
            a
        } else {
            b
        }
    } else if a > b {
        a
    } else {
        b
    }
}

fn f32_op(op: ReduceOp, a: f32, b: f32) -> f32 {
    match op.step_op() {
        ReduceOp::Sum => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Min => min_f32(a, b),
        ReduceOp::Max => max_f32(a, b),
        ReduceOp::Avg => unreachable!(),
    }
}

macro_rules! int_ops {
    ($t:ty, $a:expr, $b:expr, $op:expr) => {{
        let a = <$t>::from_le_bytes($a.try_into().unwrap());
        let b = <$t>::from_le_bytes($b.try_into().unwrap());
        let r: $t = match $op.step_op() {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Prod => a.wrapping_mul(b),
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Avg => unreachable!(),
        };
        r.to_le_bytes().to_vec()
    }};
}

/// `a ⊕ b` for one element (bytes in, bytes out). `Avg` is its step op, `Sum`.
pub(crate) fn apply_one(dtype: DataType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    match dtype {
        DataType::I8 => int_ops!(i8, a, b, op),
        DataType::U8 => int_ops!(u8, a, b, op),
        DataType::I32 => int_ops!(i32, a, b, op),
        DataType::U32 => int_ops!(u32, a, b, op),
        DataType::I64 => int_ops!(i64, a, b, op),
        DataType::U64 => int_ops!(u64, a, b, op),
        DataType::F16 => {
            let x = f16::from_le_bytes(a.try_into().unwrap()).to_f32();
            let y = f16::from_le_bytes(b.try_into().unwrap()).to_f32();
            f16::from_f32(f32_op(op, x, y)).to_le_bytes().to_vec()
        }
        DataType::BF16 => {
            let x = bf16::from_le_bytes(a.try_into().unwrap()).to_f32();
            let y = bf16::from_le_bytes(b.try_into().unwrap()).to_f32();
            bf16::from_f32(f32_op(op, x, y)).to_le_bytes().to_vec()
        }
        DataType::F32 => {
            let x = f32::from_le_bytes(a.try_into().unwrap());
            let y = f32::from_le_bytes(b.try_into().unwrap());
            f32_op(op, x, y).to_le_bytes().to_vec()
        }
        DataType::F64 => {
            let x = f64::from_le_bytes(a.try_into().unwrap());
            let y = f64::from_le_bytes(b.try_into().unwrap());
            let r = match op.step_op() {
                ReduceOp::Sum => x + y,
                ReduceOp::Prod => x * y,
                ReduceOp::Min => min_f64(x, y),
                ReduceOp::Max => max_f64(x, y),
                ReduceOp::Avg => unreachable!(),
            };
            r.to_le_bytes().to_vec()
        }
    }
}

/// `x / world` for one element (Avg's finalize).
pub(crate) fn finalize_one(dtype: DataType, x: &[u8], world: u64) -> Vec<u8> {
    macro_rules! signed {
        ($t:ty) => {{
            let v = <$t>::from_le_bytes(x.try_into().unwrap()) as i128;
            ((v / world as i128) as $t).to_le_bytes().to_vec()
        }};
    }
    macro_rules! unsigned {
        ($t:ty) => {{
            let v = <$t>::from_le_bytes(x.try_into().unwrap()) as u128;
            ((v / world as u128) as $t).to_le_bytes().to_vec()
        }};
    }
    match dtype {
        DataType::I8 => signed!(i8),
        DataType::I32 => signed!(i32),
        DataType::I64 => signed!(i64),
        DataType::U8 => unsigned!(u8),
        DataType::U32 => unsigned!(u32),
        DataType::U64 => unsigned!(u64),
        DataType::F16 => {
            let v = f16::from_le_bytes(x.try_into().unwrap()).to_f32();
            f16::from_f32(v / world as f32).to_le_bytes().to_vec()
        }
        DataType::BF16 => {
            let v = bf16::from_le_bytes(x.try_into().unwrap()).to_f32();
            bf16::from_f32(v / world as f32).to_le_bytes().to_vec()
        }
        DataType::F32 => (f32::from_le_bytes(x.try_into().unwrap()) / world as f32)
            .to_le_bytes()
            .to_vec(),
        DataType::F64 => (f64::from_le_bytes(x.try_into().unwrap()) / world as f64)
            .to_le_bytes()
            .to_vec(),
    }
}

/// Element-wise `a ⊕ b` over whole buffers.
pub(crate) fn apply(dtype: DataType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    let es = dtype.size();
    a.chunks(es)
        .zip(b.chunks(es))
        .flat_map(|(x, y)| apply_one(dtype, op, x, y))
        .collect()
}

/// Element-wise `x / world` over a whole buffer.
pub(crate) fn finalize(dtype: DataType, x: &[u8], world: u64) -> Vec<u8> {
    x.chunks(dtype.size())
        .flat_map(|e| finalize_one(dtype, e, world))
        .collect()
}

/// Whether the element `bytes` of `dtype` is a NaN.
pub(crate) fn is_nan(dtype: DataType, bytes: &[u8]) -> bool {
    match dtype {
        DataType::F16 => f16::from_le_bytes(bytes.try_into().unwrap()).is_nan(),
        DataType::BF16 => bf16::from_le_bytes(bytes.try_into().unwrap()).is_nan(),
        DataType::F32 => f32::from_le_bytes(bytes.try_into().unwrap()).is_nan(),
        DataType::F64 => f64::from_le_bytes(bytes.try_into().unwrap()).is_nan(),
        _ => false,
    }
}

/// Compares a result with the reference: bit for bit, except that for Sum/Prod/finalize
/// (`exact_nan == false`) any NaN matches any NaN. Returns the first mismatching element index.
pub(crate) fn first_mismatch(
    dtype: DataType,
    got: &[u8],
    want: &[u8],
    exact_nan: bool,
) -> Option<usize> {
    if got.len() != want.len() {
        return Some(got.len().min(want.len()) / dtype.size());
    }
    let es = dtype.size();
    got.chunks(es).zip(want.chunks(es)).position(|(g, w)| {
        if g == w {
            return false;
        }
        !(!exact_nan && is_nan(dtype, g) && is_nan(dtype, w))
    })
}

/// Whether NaN payloads must match exactly for this op (Min/Max: the canonical NaN).
pub(crate) fn exact_nan(op: Option<ReduceOp>) -> bool {
    matches!(
        op.map(|o| o.step_op()),
        Some(ReduceOp::Min) | Some(ReduceOp::Max)
    )
}

/// Self-checks of the reference on hand-picked values, run by both tests.
pub(crate) fn self_check() {
    let f = |v: f32| v.to_le_bytes().to_vec();
    let neg0 = f(-0.0);
    let pos0 = f(0.0);
    assert_eq!(apply_one(DataType::F32, ReduceOp::Min, &pos0, &neg0), neg0);
    assert_eq!(apply_one(DataType::F32, ReduceOp::Min, &neg0, &pos0), neg0);
    assert_eq!(apply_one(DataType::F32, ReduceOp::Max, &neg0, &pos0), pos0);
    let nan = f32::from_bits(0xffc0_1234).to_le_bytes().to_vec();
    assert_eq!(
        apply_one(DataType::F32, ReduceOp::Max, &nan, &f(1.0)),
        0x7fc0_0000u32.to_le_bytes().to_vec()
    );
    assert_eq!(
        apply_one(DataType::I8, ReduceOp::Sum, &[127], &[1]),
        vec![0x80]
    );
    assert_eq!(
        apply_one(DataType::U8, ReduceOp::Prod, &[16], &[17]),
        vec![16]
    );
    assert_eq!(
        finalize_one(DataType::I32, &(-7i32).to_le_bytes(), 2),
        (-3i32).to_le_bytes().to_vec()
    );
    assert_eq!(
        finalize_one(DataType::I8, &(-128i8).to_le_bytes(), 300),
        vec![0]
    );
    // f16: 1 + 2^-11 is a tie between 1 and 1 + 2^-10: rounds to even (1).
    let one = f16::from_f32(1.0).to_le_bytes().to_vec();
    let tiny = f16::from_f32(2f32.powi(-11)).to_le_bytes().to_vec();
    assert_eq!(apply_one(DataType::F16, ReduceOp::Sum, &one, &tiny), one);
    let canon16 = apply_one(DataType::F16, ReduceOp::Min, &0xfe01u16.to_le_bytes(), &one);
    assert_eq!(canon16, 0x7e00u16.to_le_bytes().to_vec());
    let canonbf = apply_one(
        DataType::BF16,
        ReduceOp::Max,
        &one,
        &0xff81u16.to_le_bytes(),
    );
    assert_eq!(canonbf, 0x7fc0u16.to_le_bytes().to_vec());
}
