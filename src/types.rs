//! Element types and reduction operators.
//!
//! [`DataType`] names the ten element types dspark moves and reduces; [`Element`] ties each Rust
//! type to its `DataType`; [`ReduceOp`] is the set of reductions. Names follow nccl-tests
//! (`float`, `half`, `bfloat16`, ...) so that bench output reads the same as `all_reduce_perf`.

use std::fmt;
use std::str::FromStr;

/// The element type of a collective's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DataType {
    /// `i8`
    I8,
    /// `u8`
    U8,
    /// `i32`
    I32,
    /// `u32`
    U32,
    /// `i64`
    I64,
    /// `u64`
    U64,
    /// IEEE 754 binary16 ([`half::f16`]).
    F16,
    /// bfloat16 ([`half::bf16`]).
    BF16,
    /// `f32`
    F32,
    /// `f64`
    F64,
}

impl DataType {
    /// Every data type, in wire-code order.
    pub const ALL: [DataType; 10] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::BF16,
        DataType::F32,
        DataType::F64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::BF16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// Whether the type is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::BF16 | DataType::F32 | DataType::F64
        )
    }

    /// The nccl-tests name of the type (`int8`, `uint8`, `int32`, `uint32`, `int64`, `uint64`,
    /// `half`, `bfloat16`, `float`, `double`).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::I8 => "int8",
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
            DataType::F16 => "half",
            DataType::BF16 => "bfloat16",
            DataType::F32 => "float",
            DataType::F64 => "double",
        }
    }

    /// The Rust name of the type (`i8`, ..., `f16`, `bf16`, `f32`, `f64`).
    pub const fn rust_name(self) -> &'static str {
        match self {
            DataType::I8 => "i8",
            DataType::U8 => "u8",
            DataType::I32 => "i32",
            DataType::U32 => "u32",
            DataType::I64 => "i64",
            DataType::U64 => "u64",
            DataType::F16 => "f16",
            DataType::BF16 => "bf16",
            DataType::F32 => "f32",
            DataType::F64 => "f64",
        }
    }

    /// The one-byte code used on the wire.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The type with wire code `code`, if any.
    pub fn from_code(code: u8) -> Option<DataType> {
        Self::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error returned when a string names no [`DataType`] or [`ReduceOp`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseNameError {
    /// What was being parsed ("data type" or "reduce op").
    pub what: &'static str,
    /// The string that did not parse.
    pub input: String,
    /// The accepted names.
    pub expected: &'static str,
}

impl fmt::Display for ParseNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?} (expected one of: {})",
            self.what, self.input, self.expected
        )
    }
}

impl std::error::Error for ParseNameError {}

impl FromStr for DataType {
    type Err = ParseNameError;

    /// Accepts nccl-tests names (`float`, `half`, `bfloat16`, `int32`, ...) and Rust names
    /// (`f32`, `f16`, `bf16`, `i32`, ...).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        let found = DataType::ALL
            .into_iter()
            .find(|d| d.name() == t || d.rust_name() == t)
            .or(match t.as_str() {
                "char" => Some(DataType::I8),
                "int" => Some(DataType::I32),
                "float16" | "fp16" => Some(DataType::F16),
                "float32" | "fp32" => Some(DataType::F32),
                "float64" | "fp64" => Some(DataType::F64),
                "bf16" => Some(DataType::BF16),
                _ => None,
            });
        found.ok_or_else(|| ParseNameError {
            what: "data type",
            input: s.to_string(),
            expected: "int8 uint8 int32 uint32 int64 uint64 half bfloat16 float double \
                       (or i8 u8 i32 u32 i64 u64 f16 bf16 f32 f64)",
        })
    }
}

/// A reduction operator.
///
/// `Avg` is `Sum` followed by one division by the world size (integers truncate toward zero).
/// `f16`/`bf16` accumulate in `f32` and round once per reduction step (round to nearest even).
/// Integer `Sum` and `Prod` wrap on overflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Sum, then one division by the world size.
    Avg,
}

impl ReduceOp {
    /// Every operator, in wire-code order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The nccl-tests name (`sum`, `prod`, `min`, `max`, `avg`).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// The operator applied at every reduction step: `Avg` reduces with `Sum` and divides once
    /// at the end.
    pub const fn step_op(self) -> ReduceOp {
        match self {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        }
    }

    /// The one-byte code used on the wire.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The operator with wire code `code`, if any.
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        Self::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = ParseNameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == t)
            .ok_or_else(|| ParseNameError {
                what: "reduce op",
                input: s.to_string(),
                expected: "sum prod min max avg",
            })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type that dspark can move and reduce.
///
/// Implemented for `f32`, `f64`, [`half::f16`], [`half::bf16`], `i8`, `u8`, `i32`, `u32`, `i64`
/// and `u64`. The trait is sealed: the reduction kernels exist for exactly these types.
pub trait Element:
    bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + Default + sealed::Sealed + 'static
{
    /// The [`DataType`] of `Self`.
    const DATA_TYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DATA_TYPE: DataType = DataType::$d;
        }
    )*};
}

element! {
    i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
    half::f16 => F16, half::bf16 => BF16, f32 => F32, f64 => F64,
}

/// A byte count in the largest binary unit that divides it exactly: `1 GiB`, `512 KiB`,
/// `1000 B` (never rounded, so that a size reads back exactly). With `short`, the compact
/// form of axis labels and size arguments: `1G`, `512K`, `1000`.
pub fn human_bytes(bytes: u64, short: bool) -> String {
    let (v, unit) = [(30, "G"), (20, "M"), (10, "K")]
        .into_iter()
        .find(|&(shift, _)| bytes >= 1 << shift && bytes.is_multiple_of(1 << shift))
        .map_or((bytes, ""), |(shift, u)| (bytes >> shift, u));
    match (short, unit) {
        (true, u) => format!("{v}{u}"),
        (false, "") => format!("{v} B"),
        (false, u) => format!("{v} {u}iB"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(<i8 as Element>::DATA_TYPE.size(), size_of::<i8>());
        assert_eq!(<half::bf16 as Element>::DATA_TYPE.size(), 2);
        assert_eq!(<f64 as Element>::DATA_TYPE.size(), 8);
        assert_eq!(<u32 as Element>::DATA_TYPE.size(), 4);
    }

    #[test]
    fn wire_codes_round_trip_and_reject_unknown_codes() {
        for d in DataType::ALL {
            assert_eq!(DataType::from_code(d.code()), Some(d));
        }
        for o in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_code(o.code()), Some(o));
        }
        assert_eq!(DataType::from_code(10), None);
        assert_eq!(ReduceOp::from_code(5), None);
    }

    #[test]
    fn names_parse_in_nccl_tests_and_rust_spelling() {
        assert_eq!("float".parse::<DataType>().unwrap(), DataType::F32);
        assert_eq!("f32".parse::<DataType>().unwrap(), DataType::F32);
        assert_eq!("half".parse::<DataType>().unwrap(), DataType::F16);
        assert_eq!("bf16".parse::<DataType>().unwrap(), DataType::BF16);
        assert_eq!("uint64".parse::<DataType>().unwrap(), DataType::U64);
        assert!("float128".parse::<DataType>().is_err());
        assert_eq!("AVG".parse::<ReduceOp>().unwrap(), ReduceOp::Avg);
        assert!("xor".parse::<ReduceOp>().is_err());
    }

    #[test]
    fn byte_counts_read_in_the_largest_unit_that_divides_them_exactly() {
        for (b, long, short) in [
            (0u64, "0 B", "0"),
            (1000, "1000 B", "1000"),
            (1024, "1 KiB", "1K"),
            (1536, "1536 B", "1536"),
            (512 << 10, "512 KiB", "512K"),
            (3 << 20, "3 MiB", "3M"),
            ((1 << 20) + (1 << 10), "1025 KiB", "1025K"),
            (1 << 30, "1 GiB", "1G"),
            (5 << 30, "5 GiB", "5G"),
        ] {
            assert_eq!(human_bytes(b, false), long, "{b}");
            assert_eq!(human_bytes(b, true), short, "{b}");
        }
    }
}
