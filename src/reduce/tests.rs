//! Tests of every kernel level this CPU supports against an independent element-by-element
//! reference written here (wrapping_* integer ops, IEEE f32/f64, `half`'s to_f32/from_f32, and
//! min/max by `total_cmp`), never against the code under test.

use super::*;
use half::{bf16, f16};

/// xorshift64*: a tiny seeded generator so that failures reproduce.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// A "nice" float: a small integer times a power of two in [2^-12, 2^12].
    fn nice(&mut self) -> f32 {
        let m = self.below(2001) as f32 - 1000.0;
        let e = self.below(25) as i32 - 12;
        m * 2f32.powi(e)
    }
}

/// The levels this CPU can run: every one of them is tested, not only the dispatched one.
///
/// A level this CPU lacks is left untested; that is reported once per test process on stderr
/// (written to `std::io::stderr()` directly, not with `eprintln!`, so that libtest's output
/// capture does not hide it in a passing run), so a CI runner without, say, AVX-512 shows it.
///
/// `DSPARK_REQUIRE_SIMD`: a comma-separated list of level names (`scalar`, `avx2`, `avx512`,
/// or the full [`SimdLevel::name`], e.g. `avx512f+avx512bw`). Every test that runs kernels
/// panics when a listed level is unavailable on this CPU (or the name is unknown), so a runner
/// that is meant to test, e.g., the AVX-512 kernels cannot pass without running them.
fn levels() -> Vec<SimdLevel> {
    use std::io::Write;
    let (run, missing): (Vec<SimdLevel>, Vec<SimdLevel>) =
        SimdLevel::ALL.into_iter().partition(|l| l.is_supported());
    let why = if cfg!(target_arch = "x86_64") {
        "this CPU lacks its instructions"
    } else {
        "not an x86_64 build"
    };
    static REPORTED: std::sync::Once = std::sync::Once::new();
    REPORTED.call_once(|| {
        for l in &missing {
            let _ = writeln!(
                std::io::stderr(),
                "reduce tests: SIMD level {} ({:?}) UNTESTED: {why}",
                l.name(),
                l
            );
        }
    });
    if let Ok(required) = std::env::var("DSPARK_REQUIRE_SIMD") {
        if let Err(e) = check_required_levels(&required, &run) {
            panic!("DSPARK_REQUIRE_SIMD={required:?}: {e} ({why})");
        }
    }
    run
}

/// Checks a `DSPARK_REQUIRE_SIMD` value against the levels that will be tested.
fn check_required_levels(required: &str, run: &[SimdLevel]) -> Result<(), String> {
    for want in required.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        let want = want.to_ascii_lowercase();
        let level = SimdLevel::ALL
            .into_iter()
            .find(|l| want == l.name() || want == format!("{l:?}").to_ascii_lowercase())
            .ok_or_else(|| format!("unknown SIMD level {want:?}"))?;
        if !run.contains(&level) {
            return Err(format!("SIMD level {} is unavailable", level.name()));
        }
    }
    Ok(())
}

#[test]
fn required_simd_levels_must_be_known_and_available() {
    use SimdLevel::*;
    assert_eq!(check_required_levels("", &[Scalar]), Ok(()));
    assert_eq!(check_required_levels("scalar", &[Scalar]), Ok(()));
    assert_eq!(
        check_required_levels(" AVX2 , avx512", &[Scalar, Avx2, Avx512]),
        Ok(())
    );
    assert_eq!(check_required_levels("avx2+f16c", &[Scalar, Avx2]), Ok(()));
    assert_eq!(
        check_required_levels("avx2,avx512", &[Scalar, Avx2]),
        Err("SIMD level avx512f+avx512bw is unavailable".into())
    );
    assert_eq!(
        check_required_levels("avx2", &[Scalar]),
        Err("SIMD level avx2+f16c is unavailable".into())
    );
    assert_eq!(
        check_required_levels("avx9", &[Scalar, Avx2, Avx512]),
        Err("unknown SIMD level \"avx9\"".into())
    );
}

trait TestElem: Element + Copy {
    fn random(rng: &mut Rng) -> Self;
    fn specials() -> Vec<Self>;
    /// The definition of one reduction step.
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self;
    /// The definition of Avg's final division.
    fn reference_div(self, world: usize) -> Self;
    fn is_nan(self) -> bool;
    fn bits(self) -> u64;
}

macro_rules! int_elem {
    ($($t:ty => $wide:ty),*) => {$(
        impl TestElem for $t {
            fn random(rng: &mut Rng) -> Self {
                match rng.below(4) {
                    0 => Self::specials()[rng.below(Self::specials().len())],
                    1 => (rng.below(21) as i64 - 10) as $t,
                    _ => rng.next() as $t,
                }
            }
            fn specials() -> Vec<Self> {
                vec![<$t>::MIN, <$t>::MAX, 0, 1, 2, <$t>::MAX / 2, <$t>::MIN / 2, (0 as $t).wrapping_sub(1)]
            }
            fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => if a <= b { a } else { b },
                    ReduceOp::Max => if a >= b { a } else { b },
                }
            }
            fn reference_div(self, world: usize) -> Self {
                (<$wide>::from(self) / world as $wide) as $t
            }
            fn is_nan(self) -> bool {
                false
            }
            fn bits(self) -> u64 {
                self as u64
            }
        }
    )*};
}
int_elem!(i8 => i128, u8 => u128, i32 => i128, u32 => u128, i64 => i128, u64 => u128);

const F32_QNAN: u32 = 0x7FC0_0000;
const F64_QNAN: u64 = 0x7FF8_0000_0000_0000;

fn ref_min_f32(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::from_bits(F32_QNAN)
    } else if a.total_cmp(&b).is_le() {
        a
    } else {
        b
    }
}

fn ref_max_f32(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::from_bits(F32_QNAN)
    } else if a.total_cmp(&b).is_ge() {
        a
    } else {
        b
    }
}

fn ref_f32(op: ReduceOp, a: f32, b: f32) -> f32 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Min => ref_min_f32(a, b),
        ReduceOp::Max => ref_max_f32(a, b),
    }
}

impl TestElem for f32 {
    fn random(rng: &mut Rng) -> Self {
        match rng.below(8) {
            0 => f32::from_bits(rng.next() as u32),
            1 => f32::from_bits(rng.next() as u32 & 0x807F_FFFF), // subnormal
            2 => Self::specials()[rng.below(Self::specials().len())],
            _ => rng.nice(),
        }
    }
    fn specials() -> Vec<Self> {
        [
            0u32,
            0x8000_0000,
            0x3F80_0000,
            0xBF80_0000,
            0x7F80_0000,
            0xFF80_0000,
            F32_QNAN,
            0xFFC0_0000,
            0x7F80_0001,
            0x7FC1_2345,
            0x0000_0001,
            0x8000_0001,
            0x0080_0000,
            0x007F_FFFF,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x3F00_0000,
        ]
        .into_iter()
        .map(f32::from_bits)
        .collect()
    }
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
        ref_f32(op, a, b)
    }
    fn reference_div(self, world: usize) -> Self {
        self / world as f32
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn bits(self) -> u64 {
        self.to_bits().into()
    }
}

impl TestElem for f64 {
    fn random(rng: &mut Rng) -> Self {
        match rng.below(8) {
            0 => f64::from_bits(rng.next()),
            1 => f64::from_bits(rng.next() & 0x800F_FFFF_FFFF_FFFF),
            2 => Self::specials()[rng.below(Self::specials().len())],
            _ => f64::from(rng.nice()) * f64::from(rng.nice()),
        }
    }
    fn specials() -> Vec<Self> {
        [
            0u64,
            1 << 63,
            1f64.to_bits(),
            (-1f64).to_bits(),
            0x7FF0_0000_0000_0000,
            0xFFF0_0000_0000_0000,
            F64_QNAN,
            0xFFF8_0000_0000_0000,
            0x7FF0_0000_0000_0001,
            0x7FF8_0000_1234_5678,
            1,
            (1 << 63) | 1,
            0x0010_0000_0000_0000,
            f64::MAX.to_bits(),
            f64::MIN.to_bits(),
        ]
        .into_iter()
        .map(f64::from_bits)
        .collect()
    }
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min | ReduceOp::Max if a.is_nan() || b.is_nan() => f64::from_bits(F64_QNAN),
            ReduceOp::Min => {
                if a.total_cmp(&b).is_le() {
                    a
                } else {
                    b
                }
            }
            ReduceOp::Max => {
                if a.total_cmp(&b).is_ge() {
                    a
                } else {
                    b
                }
            }
        }
    }
    fn reference_div(self, world: usize) -> Self {
        self / world as f64
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn bits(self) -> u64 {
        self.to_bits()
    }
}

macro_rules! half_elem {
    ($t:ty, $specials:expr) => {
        impl TestElem for $t {
            fn random(rng: &mut Rng) -> Self {
                match rng.below(8) {
                    0 => <$t>::from_bits(rng.next() as u16),
                    1 => <$t>::from_bits(rng.next() as u16 & 0x807F), // small / subnormal
                    2 => Self::specials()[rng.below(Self::specials().len())],
                    // Up to ~2^17: f16 sums and products overflow to infinity.
                    3 => <$t>::from_f32(rng.nice() * 32.0),
                    _ => <$t>::from_f32(rng.nice()),
                }
            }
            fn specials() -> Vec<Self> {
                $specials.into_iter().map(<$t>::from_bits).collect()
            }
            fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                <$t>::from_f32(ref_f32(op, a.to_f32(), b.to_f32()))
            }
            fn reference_div(self, world: usize) -> Self {
                <$t>::from_f32(self.to_f32() / world as f32)
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn bits(self) -> u64 {
                self.to_bits().into()
            }
        }
    };
}
// ±0, ±1, ±inf, NaNs (canonical, negative, signalling, payload), smallest subnormals, largest
// subnormal, smallest normal, ±max, 0.5, 2048.
half_elem!(
    f16,
    [
        0u16, 0x8000, 0x3C00, 0xBC00, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7E55, 0x0001,
        0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3800, 0x6800
    ]
);
half_elem!(
    bf16,
    [
        0u16, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FD5, 0x0001,
        0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F00, 0x4500
    ]
);

/// Whether `got` is what the definition gives: the same bits, except that a NaN result of
/// Sum/Prod/Avg may carry any payload (the hardware's choice, not part of the contract).
fn same<T: TestElem>(op: ReduceOp, got: T, want: T) -> bool {
    if op != ReduceOp::Min && op != ReduceOp::Max && want.is_nan() {
        got.is_nan()
    } else {
        got.bits() == want.bits()
    }
}

/// `vals` laid out at byte offset `off` (so possibly misaligned), with guard bytes around.
fn placed<T: TestElem>(vals: &[T], off: usize) -> Vec<u8> {
    let bytes: &[u8] = bytemuck::cast_slice(vals);
    let mut buf = vec![0xA5u8; off + bytes.len() + 8];
    buf[off..off + bytes.len()].copy_from_slice(bytes);
    buf
}

fn read<T: TestElem>(buf: &[u8], off: usize, i: usize) -> T {
    let s = size_of::<T>();
    bytemuck::pod_read_unaligned(&buf[off + i * s..off + (i + 1) * s])
}

fn assert_guards(buf: &[u8], off: usize, len: usize, what: &str) {
    assert!(
        buf[..off].iter().all(|&x| x == 0xA5),
        "{what}: bytes before the buffer changed"
    );
    assert!(
        buf[off + len..].iter().all(|&x| x == 0xA5),
        "{what}: bytes after the buffer changed"
    );
}

/// Runs reduce_inplace_at and reduce_into_at on `a`, `b` at the given byte offsets and checks
/// every element against the reference and the guard bytes around the destination.
/// Checks one level's kernels (`Some`), or the dispatcher the engine calls (`None`: the scalar
/// loop below `TINY_BYTES`, the best level above), against the reference.
fn check_binary<T: TestElem>(
    level: Option<SimdLevel>,
    op: ReduceOp,
    a: &[T],
    b: &[T],
    offs: [usize; 3],
) {
    let dtype = T::DATA_TYPE;
    let n = a.len();
    let len = n * dtype.size();
    let [od, oa, ob] = offs;
    let what = |f: &str, i: usize| {
        format!("{f} {dtype:?} {op:?} at {level:?}, n={n}, offsets {offs:?}, element {i}")
    };

    let bbuf = placed(b, ob);
    let mut dbuf = placed(a, od);
    let (d, s) = (&mut dbuf[od..od + len], &bbuf[ob..ob + len]);
    match level {
        Some(level) => reduce_inplace_at(level, dtype, op, d, s),
        None => reduce_inplace(dtype, op, d, s),
    }
    for i in 0..n {
        let (got, want) = (read::<T>(&dbuf, od, i), T::reference(op, a[i], b[i]));
        assert!(
            same(op, got, want),
            "{}: {:?} ⊕ {:?} gave {got:?}, want {want:?}",
            what("inplace", i),
            a[i],
            b[i]
        );
    }
    assert_guards(&dbuf, od, len, &what("inplace", n));

    let abuf = placed(a, oa);
    let mut dbuf = vec![0xA5u8; od + len + 8];
    let (d, x, y) = (
        &mut dbuf[od..od + len],
        &abuf[oa..oa + len],
        &bbuf[ob..ob + len],
    );
    match level {
        Some(level) => reduce_into_at(level, dtype, op, d, x, y),
        None => reduce_into(dtype, op, d, x, y),
    }
    for i in 0..n {
        let (got, want) = (read::<T>(&dbuf, od, i), T::reference(op, a[i], b[i]));
        assert!(
            same(op, got, want),
            "{}: {:?} ⊕ {:?} gave {got:?}, want {want:?}",
            what("into", i),
            a[i],
            b[i]
        );
    }
    assert_guards(&dbuf, od, len, &what("into", n));
}

fn random_vec<T: TestElem>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::random(rng)).collect()
}

/// Lengths around every register width and unroll factor, primes, and long ones with tails.
fn lengths() -> Vec<usize> {
    let mut v: Vec<usize> = (0..=70).collect();
    v.extend([127, 128, 129, 131, 257, 1021, 1023, 4097]);
    v
}

/// Byte offsets of (dst, a, b): aligned, misaligned for the type, element-aligned but not
/// cache-line-aligned (which exercises the alignment prologue).
const OFFSETS: [[usize; 3]; 5] = [[0, 0, 0], [1, 3, 2], [3, 1, 0], [4, 8, 12], [8, 0, 4]];

fn check_all_ops<T: TestElem>(seed: u64) {
    let mut rng = Rng::new(seed);
    // Every level, then the dispatcher.
    for level in levels().into_iter().map(Some).chain([None]) {
        for op in ReduceOp::ALL {
            for n in lengths() {
                let a = random_vec::<T>(&mut rng, n);
                let b = random_vec::<T>(&mut rng, n);
                for offs in OFFSETS {
                    check_binary(level, op, &a, &b, offs);
                }
            }
        }
    }
}

macro_rules! per_type_tests {
    ($($name:ident: $t:ty),*) => {$(
        #[test]
        fn $name() {
            check_all_ops::<$t>(<$t as Element>::DATA_TYPE.code() as u64 + 1);
        }
    )*};
}

per_type_tests! {
    every_op_on_i8_matches_the_reference_at_all_lengths_and_offsets: i8,
    every_op_on_u8_matches_the_reference_at_all_lengths_and_offsets: u8,
    every_op_on_i32_matches_the_reference_at_all_lengths_and_offsets: i32,
    every_op_on_u32_matches_the_reference_at_all_lengths_and_offsets: u32,
    every_op_on_i64_matches_the_reference_at_all_lengths_and_offsets: i64,
    every_op_on_u64_matches_the_reference_at_all_lengths_and_offsets: u64,
    every_op_on_f16_matches_the_reference_at_all_lengths_and_offsets: f16,
    every_op_on_bf16_matches_the_reference_at_all_lengths_and_offsets: bf16,
    every_op_on_f32_matches_the_reference_at_all_lengths_and_offsets: f32,
    every_op_on_f64_matches_the_reference_at_all_lengths_and_offsets: f64
}

/// All ordered pairs of the special values plus random ones, as two long vectors.
fn special_pairs<T: TestElem>(rng: &mut Rng) -> (Vec<T>, Vec<T>) {
    let s = T::specials();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for &x in &s {
        for &y in &s {
            a.push(x);
            b.push(y);
        }
    }
    for _ in 0..1000 {
        a.push(T::random(rng));
        b.push(if rng.below(4) == 0 {
            a[a.len() - 1]
        } else {
            T::random(rng)
        });
    }
    (a, b)
}

fn check_specials_and_commutativity<T: TestElem>() {
    let mut rng = Rng::new(99);
    let (a, b) = special_pairs::<T>(&mut rng);
    let dtype = T::DATA_TYPE;
    let bytes = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
    for level in levels() {
        for op in ReduceOp::ALL {
            check_binary(Some(level), op, &a, &b, [0, 0, 0]);
            check_binary(Some(level), op, &a, &b, [3, 1, 2]);
        }
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let mut ab = vec![0u8; a.len() * dtype.size()];
            let mut ba = ab.clone();
            reduce_into_at(level, dtype, op, &mut ab, &bytes(&a), &bytes(&b));
            reduce_into_at(level, dtype, op, &mut ba, &bytes(&b), &bytes(&a));
            assert!(
                ab == ba,
                "{dtype:?} {op:?} at {level:?} depends on operand order"
            );
        }
    }
}

#[test]
fn float_specials_match_the_reference_and_min_max_commute_bit_for_bit() {
    check_specials_and_commutativity::<f16>();
    check_specials_and_commutativity::<bf16>();
    check_specials_and_commutativity::<f32>();
    check_specials_and_commutativity::<f64>();
}

#[test]
fn integer_extremes_wrap_and_compare_plainly() {
    check_specials_and_commutativity::<i8>();
    check_specials_and_commutativity::<u8>();
    check_specials_and_commutativity::<i32>();
    check_specials_and_commutativity::<u32>();
    check_specials_and_commutativity::<i64>();
    check_specials_and_commutativity::<u64>();
}

/// One pair repeated over SIMD-sized buffers: the result of every element, at every level.
fn pair_result<T: TestElem>(level: SimdLevel, op: ReduceOp, x: T, y: T) -> Vec<u64> {
    let n = 67;
    let mut d = vec![x; n];
    let s = vec![y; n];
    reduce_inplace_at(
        level,
        T::DATA_TYPE,
        op,
        bytemuck::cast_slice_mut(&mut d),
        bytemuck::cast_slice(&s),
    );
    d.into_iter().map(TestElem::bits).collect()
}

#[test]
fn min_prefers_negative_zero_max_positive_zero_and_nan_is_canonical() {
    for level in levels() {
        for (x, y) in [(-0.0f32, 0.0f32), (0.0, -0.0)] {
            assert!(pair_result(level, ReduceOp::Min, x, y)
                .iter()
                .all(|&b| b == 0x8000_0000));
            assert!(pair_result(level, ReduceOp::Max, x, y)
                .iter()
                .all(|&b| b == 0));
        }
        for (x, y) in [(-0.0f64, 0.0f64), (0.0, -0.0)] {
            assert!(pair_result(level, ReduceOp::Min, x, y)
                .iter()
                .all(|&b| b == 1 << 63));
            assert!(pair_result(level, ReduceOp::Max, x, y)
                .iter()
                .all(|&b| b == 0));
        }
        for (x, y) in [(f16::NEG_ZERO, f16::ZERO), (f16::ZERO, f16::NEG_ZERO)] {
            assert!(pair_result(level, ReduceOp::Min, x, y)
                .iter()
                .all(|&b| b == 0x8000));
            assert!(pair_result(level, ReduceOp::Max, x, y)
                .iter()
                .all(|&b| b == 0));
        }
        for (x, y) in [(bf16::NEG_ZERO, bf16::ZERO), (bf16::ZERO, bf16::NEG_ZERO)] {
            assert!(pair_result(level, ReduceOp::Min, x, y)
                .iter()
                .all(|&b| b == 0x8000));
            assert!(pair_result(level, ReduceOp::Max, x, y)
                .iter()
                .all(|&b| b == 0));
        }
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let snan = f32::from_bits(0xFF80_0001);
            for (x, y) in [(snan, 1.0), (1.0, snan), (f32::NAN, f32::NEG_INFINITY)] {
                assert!(
                    pair_result(level, op, x, y)
                        .iter()
                        .all(|&b| b == 0x7FC0_0000),
                    "{level:?}"
                );
            }
            let nan64 = f64::from_bits(0xFFF0_0000_0000_0001);
            for (x, y) in [(nan64, 1.0), (1.0, nan64)] {
                assert!(pair_result(level, op, x, y)
                    .iter()
                    .all(|&b| b == 0x7FF8_0000_0000_0000));
            }
            for (x, y) in [
                (f16::from_bits(0xFC01), f16::ONE),
                (f16::ONE, f16::from_bits(0xFE12)),
            ] {
                assert!(
                    pair_result(level, op, x, y).iter().all(|&b| b == 0x7E00),
                    "{level:?}"
                );
            }
            for (x, y) in [
                (bf16::from_bits(0xFF81), bf16::ONE),
                (bf16::ONE, bf16::from_bits(0xFFD2)),
            ] {
                assert!(
                    pair_result(level, op, x, y).iter().all(|&b| b == 0x7FC0),
                    "{level:?}"
                );
            }
        }
    }
}

#[test]
fn f16_overflow_rounds_to_infinity_and_ties_round_to_even() {
    for level in levels() {
        // 65504 + 16 is a tie between 65504 and 65536 (which overflows): even is 65536 -> inf.
        let max = f16::MAX;
        assert!(pair_result(level, ReduceOp::Sum, max, f16::from_f32(16.0))
            .iter()
            .all(|&b| b == 0x7C00));
        // 65504 + 8 rounds down to 65504.
        assert!(pair_result(level, ReduceOp::Sum, max, f16::from_f32(8.0))
            .iter()
            .all(|&b| b == 0x7BFF));
        // 1 + 2^-11 is a tie: stays 1; (1 + 2^-10) + 2^-11 is a tie: rounds up to 1 + 2^-9.
        let one = f16::ONE;
        let half_ulp = f16::from_f32(2f32.powi(-11));
        assert!(pair_result(level, ReduceOp::Sum, one, half_ulp)
            .iter()
            .all(|&b| b == 0x3C00));
        let one_ulp = f16::from_bits(0x3C01);
        assert!(pair_result(level, ReduceOp::Sum, one_ulp, half_ulp)
            .iter()
            .all(|&b| b == 0x3C02));
        // bf16: 1 + 2^-8 is a tie: stays 1; (1 + 2^-7) + 2^-8 rounds up to 1 + 2^-6.
        let b_half_ulp = bf16::from_f32(2f32.powi(-8));
        assert!(pair_result(level, ReduceOp::Sum, bf16::ONE, b_half_ulp)
            .iter()
            .all(|&b| b == 0x3F80));
        let b_one_ulp = bf16::from_bits(0x3F81);
        assert!(pair_result(level, ReduceOp::Sum, b_one_ulp, b_half_ulp)
            .iter()
            .all(|&b| b == 0x3F82));
        // bf16 overflow: max + max is infinity.
        assert!(pair_result(level, ReduceOp::Sum, bf16::MAX, bf16::MAX)
            .iter()
            .all(|&b| b == 0x7F80));
    }
}

/// Every f16 and bf16 bit pattern through the widening and narrowing of each level: max(x, x)
/// is x itself for every non-NaN and the canonical NaN for every NaN; x + -0 is x.
#[test]
fn every_half_bit_pattern_survives_the_simd_conversions() {
    fn run<T: TestElem>(from_bits: fn(u16) -> T, neg_zero: T) {
        let all: Vec<T> = (0..=u16::MAX).map(from_bits).collect();
        let zeros = vec![neg_zero; all.len()];
        for level in levels() {
            check_binary(Some(level), ReduceOp::Max, &all, &all, [0, 0, 0]);
            check_binary(Some(level), ReduceOp::Sum, &all, &zeros, [2, 0, 0]);
        }
    }
    run::<f16>(f16::from_bits, f16::NEG_ZERO);
    run::<bf16>(bf16::from_bits, bf16::NEG_ZERO);
}

fn check_finalize<T: TestElem>(seed: u64) {
    let mut rng = Rng::new(seed);
    let dtype = T::DATA_TYPE;
    let mut worlds: Vec<usize> = (0..=9).collect();
    worlds.extend([127, 128, 200, 1 << 20, 1 << 40, 1 << 63, usize::MAX]);
    for level in levels() {
        for n in [0, 1, 7, 16, 67, 1023] {
            let mut vals = random_vec::<T>(&mut rng, n);
            vals.extend(T::specials());
            for &world in &worlds {
                for op in ReduceOp::ALL {
                    for off in [0, 1, 4] {
                        let len = vals.len() * dtype.size();
                        let mut buf = placed(&vals, off);
                        finalize_at(level, dtype, op, &mut buf[off..off + len], world);
                        for (i, &v) in vals.iter().enumerate() {
                            let want = if op == ReduceOp::Avg && world > 1 {
                                v.reference_div(world)
                            } else {
                                v
                            };
                            let got = read::<T>(&buf, off, i);
                            assert!(
                                if want.is_nan() { got.is_nan() } else { got.bits() == want.bits() },
                                "finalize {dtype:?} {op:?} at {level:?}: {v:?} / {world} gave {got:?}, want {want:?}"
                            );
                        }
                        assert_guards(&buf, off, len, "finalize");
                    }
                }
            }
        }
    }
}

#[test]
fn finalize_divides_only_avg_once_by_the_world_size() {
    check_finalize::<i8>(1);
    check_finalize::<u8>(2);
    check_finalize::<i32>(3);
    check_finalize::<u32>(4);
    check_finalize::<i64>(5);
    check_finalize::<u64>(6);
    check_finalize::<f16>(7);
    check_finalize::<bf16>(8);
    check_finalize::<f32>(9);
    check_finalize::<f64>(10);
}

#[test]
fn integer_avg_truncates_toward_zero() {
    let mut v = [-7i32, 7, -1, 1, i32::MIN, i32::MAX];
    finalize_slice(ReduceOp::Avg, &mut v, 2);
    assert_eq!(v, [-3, 3, 0, 0, i32::MIN / 2, i32::MAX / 2]);
    let mut v = [-128i8, -128, 127];
    finalize_slice(ReduceOp::Avg, &mut v[..1], 128);
    finalize_slice(ReduceOp::Avg, &mut v[1..], 200);
    assert_eq!(v, [-1, 0, 0]);
    let mut v = [i64::MIN, i64::MIN + 1];
    finalize_slice(ReduceOp::Avg, &mut v, 1 << 63);
    assert_eq!(v, [-1, 0]);
    let mut v = [u64::MAX, u64::MAX - 1];
    finalize_slice(ReduceOp::Avg, &mut v, usize::MAX);
    assert_eq!(v, [1, 0]);
}

#[test]
fn half_avg_divides_in_f32_and_rounds_once() {
    // Each reduction step rounds to f16 once; the division widens to f32 and rounds once.
    let x = f16::from_bits(0x3C01);
    let mut v = vec![x; 40];
    for _ in 0..2 {
        let src = vec![x; 40];
        reduce_slice(ReduceOp::Avg, &mut v, &src);
    }
    finalize_slice(ReduceOp::Avg, &mut v, 3);
    let want = f16::from_f32(
        f16::from_f32(f16::from_f32(x.to_f32() * 2.0).to_f32() + x.to_f32()).to_f32() / 3.0,
    );
    assert!(
        v.iter().all(|&y| y.to_bits() == want.to_bits()),
        "{v:?} vs {want:?}"
    );
}

#[test]
fn partial_trailing_bytes_are_left_alone() {
    for level in levels() {
        let mut d = [1u8, 0, 0, 0, 9, 9, 9];
        let s = [2u8, 0, 0, 0, 5, 5, 5];
        reduce_inplace_at(level, DataType::I32, ReduceOp::Sum, &mut d, &s);
        assert_eq!(d, [3, 0, 0, 0, 9, 9, 9]);
        let mut d = [7u8; 7];
        reduce_into_at(level, DataType::U32, ReduceOp::Sum, &mut d, &s, &s);
        assert_eq!(d, [4, 0, 0, 0, 7, 7, 7]);
        let mut d = [8u8, 0, 0, 0, 9, 9, 9];
        finalize_at(level, DataType::U32, ReduceOp::Avg, &mut d, 2);
        assert_eq!(d, [4, 0, 0, 0, 9, 9, 9]);
    }
}

#[cfg(not(debug_assertions))]
#[test]
fn unequal_lengths_reduce_the_common_prefix_in_release_builds() {
    let mut d = [1u32; 5];
    reduce_slice(ReduceOp::Sum, &mut d, &[1u32; 3]);
    assert_eq!(d, [2, 2, 2, 1, 1]);
    let mut d = [0u32; 5];
    reduce_slice_into(ReduceOp::Sum, &mut d, &[1u32; 4], &[2u32; 2]);
    assert_eq!(d, [3, 3, 0, 0, 0]);
}

/// The debug-build twin of the test above: there the length mismatch is a `debug_assert`.
#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "reduce_inplace: buffer lengths differ")]
fn unequal_lengths_panic_in_reduce_slice_in_debug_builds() {
    let mut d = [1u32; 5];
    reduce_slice(ReduceOp::Sum, &mut d, &[1u32; 3]);
}

/// As above, for the out-of-place form.
#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "reduce_into: buffer lengths differ")]
fn unequal_lengths_panic_in_reduce_slice_into_in_debug_builds() {
    let mut d = [0u32; 5];
    reduce_slice_into(ReduceOp::Sum, &mut d, &[1u32; 4], &[2u32; 2]);
}

#[test]
fn typed_wrappers_reduce_like_the_byte_api() {
    let mut d: Vec<i32> = (0..100).collect();
    let s: Vec<i32> = (0..100).map(|i| 2 * i).collect();
    reduce_slice(ReduceOp::Sum, &mut d, &s);
    assert!(d.iter().enumerate().all(|(i, &x)| x == 3 * i as i32));
    let mut out = vec![0i32; 100];
    reduce_slice_into(ReduceOp::Max, &mut out, &d, &s);
    assert_eq!(out, d);
    let mut h: Vec<bf16> = (0..50).map(|i| bf16::from_f32(i as f32)).collect();
    let hs = h.clone();
    reduce_slice(ReduceOp::Avg, &mut h, &hs);
    finalize_slice(ReduceOp::Avg, &mut h, 2);
    assert_eq!(h, hs);
}

#[test]
fn simd_level_names_the_best_level_this_cpu_supports() {
    let best = SimdLevel::best();
    assert!(best.is_supported());
    assert_eq!(simd_level(), best.name());
    assert!(SimdLevel::ALL
        .iter()
        .rev()
        .take_while(|&&l| l != best)
        .all(|l| !l.is_supported()));
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bw") {
        assert_eq!(simd_level(), "avx512f+avx512bw");
    }
}
