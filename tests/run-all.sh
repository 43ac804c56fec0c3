#!/usr/bin/env bash
# tests/run-all.sh - the whole test suite, installing what it needs on a fresh Debian 12 /
# Ubuntu machine. Run as root (apt, network namespaces, the Soft-RoCE VMs).
#
#   bash tests/run-all.sh            # everything
#   SKIP_VM=1 bash tests/run-all.sh  # without the Soft-RoCE VM suite (it is not optional in CI)
#
# Stages: system packages -> NVRTC wheel (kernels compile without a GPU) -> cargo tests
# (unit, simulator, threads over mem, multi-process TCP, network namespaces, NVRTC compile,
# doctor, doc tests) -> release-only unit tests -> Soft-RoCE VM suite (verbs on a real verbs
# stack in QEMU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log() { echo "[run-all $(date +%T)] $*" >&2; }
T0=$SECONDS

# ---------------------------------------------------------------- system packages
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)   # tests/netfault.rs: silent drops and resets (no tc netem here)
command -v python3 >/dev/null || need+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
command -v cc >/dev/null || need+=(gcc libc6-dev)
command -v mpirun >/dev/null || need+=(openmpi-bin)   # the mpirun launcher test
command -v slurmd >/dev/null || need+=(slurmd slurmctld slurm-client munge)   # the srun test
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "apt-get install ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
    else
        log "missing ${need[*]} and cannot install them (not root or no apt-get)"
        exit 1
    fi
fi

# ---------------------------------------------------------------- NVRTC (no GPU needed)
if [ -f tests/gpu/install_nvrtc.sh ]; then
    log "installing the NVRTC wheel (nvidia-cuda-nvrtc-cu12) so every CUDA kernel compiles"
    NVRTC_DIR=$(bash tests/gpu/install_nvrtc.sh | tail -n 1)
    if [ -d "$NVRTC_DIR" ]; then
        export LD_LIBRARY_PATH="$NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export DSPARK_REQUIRE_NVRTC=1   # the compile test fails instead of skipping
        log "libnvrtc from $NVRTC_DIR"
    else
        log "NVRTC wheel not installed ($NVRTC_DIR): kernel compile tests will be skipped"
    fi
fi

# ---------------------------------------------------------------- torch (torchrun, TCPStore)
# torch from PyPI into a cached venv (~3 GB download and 5.4 GB on disk the first time; reused
# afterwards): torchrun for the launcher tests, torch's TCPStore server for the store client.
log "torch venv (tests/torch/venv.sh)"
DSPARK_TORCH_PYTHON=$(bash tests/torch/venv.sh | tail -n 1)
export DSPARK_TORCH_PYTHON
export DSPARK_REQUIRE_TORCH=1 DSPARK_REQUIRE_MPI=1 DSPARK_REQUIRE_NETFAULT=1
log "torch from $DSPARK_TORCH_PYTHON"

# ---------------------------------------------------------------- Slurm (srun)
# A one-node Slurm cluster on this machine, so that the README's srun lines run as typed.
log "one-node Slurm cluster (tests/slurm/local-cluster.sh)"
SLURM_CONF=$(bash tests/slurm/local-cluster.sh | tail -n 1)
export SLURM_CONF DSPARK_REQUIRE_SLURM=1
trap 'bash tests/slurm/local-cluster.sh stop' EXIT

# ---------------------------------------------------------------- cargo tests
log "cargo test (profile ci: optimised, with debug assertions)"
# tests/fuzz.rs: 200k structure-aware inputs per fuzz target here (about 15 s in all; 20k
# by default elsewhere, 10^6 and more for a full run: DSPARK_FUZZ_CASES=1000000).
DSPARK_FUZZ_CASES=${DSPARK_FUZZ_CASES:-200000} cargo test --workspace --profile ci --all-targets
log "doc tests"
cargo test --workspace --doc
# The criterion benchmarks ran once each above (test mode); here they measure, briefly
# (benches/comm.rs and benches/reduce.rs; numbers from a shared CI machine are indicative only).
log "criterion benchmarks, quick mode (cargo bench --bench comm --bench reduce -- --quick)"
DSPARK_BENCH_QUICK=1 cargo bench --profile ci --bench comm --bench reduce -- --quick
# The ci profile keeps debug assertions, so the #[cfg(not(debug_assertions))] unit tests (the
# release behaviour of unequal-length reductions) only run in a release build of the lib tests.
log "release-only unit tests (cargo test --release --lib unequal_lengths)"
release_out=$(cargo test --release --lib unequal_lengths 2>&1) || {
    echo "$release_out" >&2
    log "release-only unit tests FAILED"
    exit 1
}
echo "$release_out" >&2
# A filter that matches nothing passes too: insist that the release-only test really ran.
if ! grep -q 'unequal_lengths_reduce_the_common_prefix_in_release_builds \.\.\. ok' <<<"$release_out"; then
    log "release-only unit tests FAILED: unequal_lengths_reduce_the_common_prefix_in_release_builds did not run"
    exit 1
fi

# ---------------------------------------------------------------- Soft-RoCE VM suite
if [ -n "${SKIP_VM:-}" ]; then
    log "SKIP_VM set: not running the Soft-RoCE VM suite"
elif [ -f tests/softroce/run-suite.sh ]; then
    log "Soft-RoCE VM suite (verbs on a real verbs stack inside QEMU)"
    set +e
    # Reuse the test binary built above (same profile) instead of building another.
    SOFTROCE_PROFILE=ci bash tests/softroce/run-suite.sh
    rc=$?
    set -e
    if [ $rc = 77 ]; then
        # Only where QEMU or the guest kernel cannot be installed at all (the suite printed
        # why); a machine that booted the VM before never gets here (its 77 becomes 125).
        log "SKIPPED the Soft-RoCE VM suite: it cannot run on this machine (reason above)"
    elif [ $rc != 0 ]; then
        log "Soft-RoCE VM suite FAILED (status $rc)"
        exit $rc
    fi
else
    log "tests/softroce/run-suite.sh is missing"
    exit 1
fi
log "all tests passed in $((SECONDS - T0)) s"
