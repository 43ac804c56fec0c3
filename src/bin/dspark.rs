//! `dspark`: tools around the library. `dspark doctor` explains what this machine can do —
//! RDMA, locked memory, CUDA, GPUDirect RDMA, NVRTC — and, for every fast path that is missing,
//! why and what to do.
//!
//! ```text
//! dspark doctor                        # human report; exits 0 on a machine with none of it
//! dspark doctor --json                 # the same facts for tools
//! dspark doctor --compile-kernels      # compile every reduction kernel with NVRTC (no GPU needed)
//! dspark doctor --compile-kernels --arch sm_90 --arch sm_80
//! dspark doctor --require gpu-direct   # exit 1, saying why, unless GPUDirect RDMA is usable
//! dspark tune                          # measure the cost model's constants, write the tune file
//! dspark tune --transport shm --out tune.json --quick
//! dspark model                         # predicted allreduce times and crossovers, 8..4096 ranks
//! dspark model --ranks 2,4 --local-ranks 4 --cores 2
//! dspark analyze /tmp/fr                # merge the ranks' flight records (DSPARK_FR_DUMP)
//! ```
//!
//! The doctor lives in `doctor/` (a file per section of its report), `tune` and `model` in
//! `tools/`; this file is the command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

// The CPU binding of dspark-bench's spawned ranks, which `dspark tune` gives its ranks too.
#[path = "tools/analyze.rs"]
mod analyze;
#[path = "bench/bind.rs"]
#[allow(dead_code)]
mod bind;
// The cache-line round trip between two CPUs, which the doctor's core-to-core section shares.
#[path = "bench/distance.rs"]
#[allow(dead_code)]
mod distance;
#[path = "doctor/mod.rs"]
mod doctor;
#[path = "tools/late.rs"]
mod late;
#[path = "tools/logging.rs"]
mod logging;
#[path = "tools/model.rs"]
mod model;
#[path = "tools/tune.rs"]
mod tune;
#[path = "tools/waits.rs"]
mod waits;

#[derive(Parser, Debug)]
#[command(
    name = "dspark",
    version,
    about = "dspark collective-communication tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Explain this machine: RDMA, locked memory, CUDA, GPUDirect RDMA, NVRTC, and the data
    /// path device buffers would take.
    Doctor(doctor::DoctorArgs),
    /// Measure the cost model's constants on this machine (α, β between 2 local ranks over
    /// the transport; γ of the reduction kernel) and write the tune file init reads.
    Tune(tune::TuneArgs),
    /// The cost model's predicted allreduce time per algorithm, size and world, and where the
    /// cheapest algorithm changes (from the tune file's constants, else the defaults).
    Model(model::ModelArgs),
    /// Merge the ranks' flight records (`DSPARK_FR_DUMP=DIR`) and say which rank is behind
    /// and on which call, the first call where ranks disagree, which peer everyone waits
    /// for, and the last call every rank completed.
    Analyze(analyze::AnalyzeArgs),
    /// One rank of a `dspark tune` measurement (started by `dspark tune`).
    #[command(hide = true)]
    TuneRank(tune::RankArgs),
}

fn main() -> ExitCode {
    logging::init("dspark");
    let cli = Cli::parse();
    match &cli.command {
        Command::Doctor(args) => doctor::run(args),
        Command::Tune(args) => tune::tune_main(args),
        Command::Model(args) => model::model_main(args),
        Command::Analyze(args) => analyze::analyze_main(args),
        Command::TuneRank(args) => tune::rank_main(args),
    }
}
