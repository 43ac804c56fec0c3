//! Not API: the modules the project's binaries, tests, benchmarks and bindings use (quinn's
//! pattern), hidden from the documentation. Nothing here is covered by semver; inside the crate
//! they keep their short paths (`crate::plan`, ...). Their files stay where the layout puts
//! them (`src/plan/`, ...): the design map is `docs/design.md`.

#![allow(missing_docs)]
// Links between these hidden modules are for `cargo doc --document-private-items` readers.
#![allow(rustdoc::private_intra_doc_links)]

#[path = "bootstrap/mod.rs"]
pub mod bootstrap;
/// The C ABI (`include/dspark.h`): `extern "C"` functions exported from the library.
#[path = "capi/mod.rs"]
pub mod capi;
#[path = "engine/mod.rs"]
pub mod engine;
/// Fuzz targets over the decoders and parsers (`testing` feature only).
#[cfg(feature = "testing")]
#[path = "fuzzing.rs"]
pub mod fuzzing;
#[path = "gpu/mod.rs"]
pub mod gpu;
#[path = "plan/mod.rs"]
pub mod plan;
#[path = "reduce/mod.rs"]
pub mod reduce;
/// dspark's log on stderr for Python and C programs (the extension module and
/// `dspark_comm_init_from_env` install it).
#[path = "stderr_log.rs"]
pub mod stderr_log;
#[path = "transport/mod.rs"]
pub mod transport;

pub use crate::comm::work;

/// Where ranks sit: affinity masks, kernel CPU lists, and who shares whose CPUs (setup's
/// `crowd.rs`; dspark-bench's and the doctor's binding use the same lists).
pub mod cpus {
    pub use crate::comm::setup::crowd::{
        allowed, count, crowd, format_list, format_ranges, parse_list, parse_ranges, ranges_of,
        Crowd, Ranges, Seat, MAX_CPU,
    };
    pub use crate::comm::setup::quota::{
        cpu_cgroups, cpus_text, mine as quota, CpuCgroup, Held, Quota, Throttled,
    };
}

/// What a communicator decides before its cost model: the sizes its all_reduce runs
/// one-shot through shared slots (`dspark model` shows them beside the model's choice).
pub mod choice {
    pub use crate::comm::setup::one_shot_max_bytes;
}

/// The job's secret: the per-job secret a spawner gives its children, and the variables.
pub mod trust {
    pub use crate::config::trust::{spawner_secret, SPAWNER_SECRET_ENV, TOKEN_ENV, TOKEN_FILE_ENV};
}

/// Fault-injection hooks for the project's tests (`testing` feature only).
#[cfg(feature = "testing")]
pub mod testing {
    pub use crate::comm::split::fail_next_split_on_this_thread;
}
