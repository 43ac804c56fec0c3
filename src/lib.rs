//! dspark: collective communication for distributed training.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod error;
pub mod plan;
pub mod reduce;
pub mod types;

pub use error::{Error, Result};
pub use types::{DataType, Element, ReduceOp};
