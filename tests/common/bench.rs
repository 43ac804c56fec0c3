//! dspark-bench as the bench tests run it (`#[path]`-included by `tests/bench_cli.rs` and
//! `tests/bench_spawn.rs`, which need nothing else of `common`).

use std::process::Command;

/// The binary under test.
pub(crate) const BENCH: &str = env!("CARGO_BIN_EXE_dspark-bench");

/// The bench without the launcher variables of whatever runs the tests (inside an srun step
/// or a torchrun rank, every `--ranks` call would be refused).
pub(crate) fn bench_cmd() -> Command {
    let mut c = Command::new(BENCH);
    let vars = dspark::config::LAUNCHER_RANK_VARS
        .iter()
        .flat_map(|(r, w)| [*r, *w]);
    for v in vars.chain(dspark::config::SLURM_STEP_VARS) {
        c.env_remove(v);
    }
    c
}
