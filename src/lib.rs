//! dspark: collective communication for distributed training.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod bootstrap;
/// The C ABI (`include/dspark.h`).
pub mod capi;
pub mod comm;
pub mod config;
pub mod engine;
pub mod error;
/// Fuzz targets over the decoders and parsers (`testing` feature only; not part of the API).
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod gpu;
pub mod path;
pub mod plan;
pub mod reduce;
pub(crate) mod time;
pub mod transport;
pub mod types;

pub use comm::{CommInfo, Communicator, Enqueue, RawCall, RawOp, Registration, Scope, Timed, Work};
pub use config::Config;
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use types::{DataType, Element, ReduceOp};

/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
