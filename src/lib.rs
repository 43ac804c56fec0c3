//! dspark: collective communication for distributed training.
//!
//! The API an embedder uses, in one sitting:
//!
//! - [`Communicator`]: joining a job ([`Communicator::from_env`], [`Communicator::init`],
//!   [`Communicator::init_with_store`]), the collectives on host memory, their non-blocking
//!   forms ([`Communicator::scope`] → [`Scope`], [`Work`]), device collectives
//!   ([`Communicator::enqueue`] → [`Enqueue`]), registered buffers ([`Registration`]),
//!   sub-communicators ([`Communicator::split`]), deadlines ([`Timed`]), abort, and what the
//!   communicator runs on ([`CommInfo`]);
//! - [`Config`] and its settings ([`config`]), [`Error`], the element and operator types
//!   ([`types`]: [`Element`], [`DataType`], [`ReduceOp`]), the data-path facts ([`path`],
//!   [`TransportKind`]), the algorithms ([`Algorithm`], [`Collective`]);
//! - the key-value store behind the store rendezvous ([`store`]), the CUDA context helper
//!   ([`cuda`]), and the raw forms the C ABI (`include/dspark.h`) and the Python package use
//!   ([`RawCall`], [`RawOp`]).
//!
//! `dspark::internals` (hidden from these docs) holds the engine, the transports, the
//! schedules and the rest for the project's own binaries, tests and benchmarks: it is not part
//! of the API and changes without notice.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod comm;
pub mod config;
pub mod error;
pub mod path;
pub(crate) mod time;
pub mod types;

/// Not API: the modules the project's binaries, tests, benchmarks and bindings use (quinn's
/// pattern). Nothing here is covered by semver.
#[doc(hidden)]
pub mod internals;

// Inside the crate the internal modules keep their short paths (`crate::plan`, ...).
pub(crate) use internals::{bootstrap, engine, gpu, plan, reduce, transport};

/// The key-value store behind the store rendezvous ([`Communicator::init_with_store`]): the
/// trait, an in-process store, a key prefix, and a client of torch's `TCPStore`.
pub mod store {
    pub use crate::bootstrap::store::{MemStore, PrefixStore, Store, TcpStore};
}

/// The flight recorder: each communicator's last operations
/// ([`Communicator::flight_record`]), dumped as JSON by every rank when a communicator fails
/// (`DSPARK_FR_DUMP`) and merged by `dspark analyze DIR`. The format is described in
/// [`FlightRecord::to_json`](flight::FlightRecord::to_json)'s module.
pub mod flight {
    pub use crate::engine::flight::{
        file_name, FailureKind, FlightEntry, FlightFailure, FlightPath, FlightProgress,
        FlightRecord, FlightState, DEFAULT_ENTRIES, FORMAT, VERSION,
    };
    pub use crate::engine::places::{Place, FULL_PLACES};
}

/// CUDA helpers for the device collectives: opening a GPU's context without cudarc's panic
/// where no driver is installed, and whether the driver and NVRTC libraries are present.
pub mod cuda {
    pub use crate::gpu::device::open_context;
    pub use crate::gpu::{libcuda_present, libnvrtc_present};
}

pub use comm::{
    CommInfo, Communicator, DirectRegionFact, Enqueue, RawCall, RawOp, Registration, Scope, Timed,
    Work,
};
pub use config::{Config, JobAuth};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use plan::{Algorithm, Collective};
pub use transport::TransportKind;
pub use types::{DataType, Element, ReduceOp};

/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
