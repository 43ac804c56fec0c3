#!/usr/bin/env bash
# All GPU checks in one go, on a machine with an NVIDIA GPU, in under 10 minutes (per-step
# timeouts add up to 585 s; expected well under that); prints a
# summary table and exits non-zero if any check failed.
#
#   bash tests/gpu/run_all.sh           build (needs cargo) and run here
#   bash tests/gpu/run_all.sh --build   build only: stripped test binaries into target/gpu-check/
#   bash tests/gpu/run_all.sh --run     run the binaries in target/gpu-check/ (no cargo needed)
#
# The split exists because GPU machines often have no Rust toolchain: build on a development
# machine (x86-64 Linux, glibc not newer than the GPU machine's), copy or carry target/gpu-check/
# with the checkout, and run with --run there.
#
# Checks:
#   1. dspark doctor on the GPU machine (CUDA driver, GPUs, dma-buf/GPUDirect attributes, ...)
#   2. NVRTC: every kernel for sm_90 and sm_80, zero spills, 16-byte vectors, cache; the kernel
#      source run on the CPU against the reference (tests/gpu_kernels_compile.rs)
#   3. kernels on the GPU against the CPU reference: every op x type, odd lengths, misaligned
#      offsets, fresh random inputs, poisoned outputs (tests/gpu_device.rs)
#   4. reduction bandwidth vs a device-to-device copy in the same run (goal >= 85% at >= 64 MiB)
#   5. dma-buf export of device memory (cuMemGetHandleForAddressRange)
#   5b. the GPUDirect device (gpu::direct::CudaDirectDevice) on its own: bytes placed in a
#      landing slot of a direct region are copied / reduced (f32 sum, bf16 max) into the
#      destination after the flush, and d2h fills a send slot; no NIC involved
#   6. staged all-reduce (engine's host-staged path + gpu::staged::CudaStagedDevice), 2 ranks on
#      one GPU over TCP loopback at 16 and 256 MiB: correctness, then the total time against each
#      stage alone (goal: total <= 1.2x the slowest stage). The two ranks are threads of one
#      test process with separate streams and TCP connections, not separate processes.
#   7. non-blocking device collectives (Communicator::enqueue), 2 ranks on one GPU over TCP:
#      they return at once, copies queued on the same stream afterwards see their results, a
#      leaked Work (its buffer forgotten) is harmless, a mismatched call fails both Works with
#      a mismatch and leaves the stream free
#   7b. small all_reduces (one-shot through shared-memory slots) between a device rank and a
#      host rank, each way and both on the device, 2 ranks (threads) on one GPU over shm:
#      f32 at 1..1025 elements around the 4096-byte bound, i64 and f64, every operator, exact
#   7c. Communicator::all_to_all_v_device, 2 ranks (threads) on one GPU over TCP, the peer on
#      device or host memory: uneven, empty and multi-segment blocks, exact
#   7d. dspark-bench --mem device, every collective, 3 ranks (processes) on GPU 0, from sizes
#      whose per-rank buffers are empty up to 1 MiB, results checked; --compare-paths once
#   8. the torch backend on CUDA tensors (tests/torch/cuda_check.py): every reduction op x 8
#      dtypes at 1, 7 and 1000003 elements against a float64 reference, broadcast, reduce,
#      all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single (uneven and equal
#      splits) and all_to_all, send/recv, coalesced, a non-contiguous
#      output, and 10 DDP steps on CUDA against DDP over gloo on CPU; skipped without torch+CUDA
#      (through both routes into torch: the ProcessGroup of backend="dspark" and, forced with
#      DSPARK_TORCH_ROUTE=backend, the c10d Backend of a group shared with another backend)
#
# libnvrtc is looked for in the usual places (CUDA toolkit, pip wheels, LD_LIBRARY_PATH); a
# libnvrtc.so.13 alone is exposed to cudarc through a symlink named libnvrtc.so. Logs go to
# target/gpu-check/logs (packed into $OUT/gpu-check-logs.tgz where $OUT is set); a step still
# running near its limit gets its processes' stacks (cuda-gdb or gdb) appended to its log.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CHECK_DIR="${GPU_CHECK_DIR:-$ROOT/target/gpu-check}"
BIN="$CHECK_DIR/bin"
mode="${1:-all}"

build() {
    command -v cargo >/dev/null || { echo "run_all: cargo not found; build elsewhere with --build and use --run here" >&2; return 1; }
    mkdir -p "$BIN"
    local json
    json="$(mktemp)"
    echo "== building release test binaries (debug info off)" >&2
    (cd "$ROOT" && CARGO_PROFILE_RELEASE_DEBUG=0 cargo test --release --no-run \
        --test gpu_device --test gpu_kernels_compile --message-format=json) >"$json" || { rm -f "$json"; return 1; }
    (cd "$ROOT" && CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --bin dspark --bin dspark-bench) >&2 || { rm -f "$json"; return 1; }
    for t in gpu_device gpu_kernels_compile; do
        local exe
        exe="$(grep -o "\"executable\":\"[^\"]*/deps/${t}-[^\"]*\"" "$json" | tail -n1 | sed 's/.*:"\(.*\)"/\1/')"
        [ -n "$exe" ] || { echo "run_all: no executable for $t" >&2; rm -f "$json"; return 1; }
        cp "$exe" "$BIN/$t"
    done
    rm -f "$json"
    local target="${CARGO_TARGET_DIR:-$ROOT/target}"
    cp "$target/release/dspark" "$target/release/dspark-bench" "$BIN/"
    # The Python package's wheel, for the torch CUDA check (check 8); maturin from PATH or
    # from the torch test venv (tests/torch/venv.sh).
    local maturin
    maturin="$(command -v maturin || echo "$HOME/.cache/dspark/torch-venv/bin/maturin")"
    if [ -x "$maturin" ]; then
        rm -rf "$CHECK_DIR/wheels"
        (cd "$ROOT" && CARGO_PROFILE_RELEASE_DEBUG=0 "$maturin" build --release -q \
            -m python/Cargo.toml -o "$CHECK_DIR/wheels") >&2 || echo "run_all: building the wheel failed: check 8 will be skipped" >&2
    else
        echo "run_all: no maturin: the torch CUDA check (8) will be skipped" >&2
    fi
    command -v strip >/dev/null && strip "$BIN"/* 2>/dev/null
    echo "== built into $BIN:" >&2
    ls -la "$BIN" >&2
}

# Sets NVRTC_FOUND and puts a directory holding libnvrtc on LD_LIBRARY_PATH (and a libnvrtc.so shim when only an
# .so.13 exists, a name cudarc's 12.x loader does not try).
find_nvrtc() {
    local cands=() d f
    IFS=: read -r -a ldp <<<"${LD_LIBRARY_PATH:-}"
    cands+=("${ldp[@]}")
    for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-*; do
        [ -n "$d" ] && cands+=("$d/lib64" "$d/lib" "$d/targets/x86_64-linux/lib")
    done
    for py in python3 /opt/torch/.venv/bin/python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        while read -r d; do cands+=("$d"); done < <("$py" - <<'EOF' 2>/dev/null
import site, sys, glob, os
roots = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
for r in roots:
    for pat in ("nvidia/cuda_nvrtc/lib", "nvidia/cu13/lib", "nvidia/cu12/lib", "nvidia/*/lib"):
        for d in glob.glob(os.path.join(r, pat)):
            print(d)
EOF
        )
    done
    cands+=("$HOME/.cache/dspark/nvrtc-venv/lib/python3"*/site-packages/nvidia/cuda_nvrtc/lib)
    while read -r f; do cands+=("$(dirname "$f")"); done < <(ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnvrtc\.so[^ ]*')
    for d in "${cands[@]}"; do
        [ -d "$d" ] || continue
        for name in libnvrtc.so.12 libnvrtc.so libnvrtc.so.13; do
            if [ -e "$d/$name" ]; then
                export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
                if [ "$name" = libnvrtc.so.13 ]; then
                    mkdir -p "$CHECK_DIR/shim"
                    ln -sf "$d/$name" "$CHECK_DIR/shim/libnvrtc.so"
                    export LD_LIBRARY_PATH="$CHECK_DIR/shim:$LD_LIBRARY_PATH"
                fi
                NVRTC_FOUND="$d/$name"
                return 0
            fi
        done
    done
    if command -v pip >/dev/null 2>&1 || command -v python3 >/dev/null 2>&1; then
        if d="$(bash "$ROOT/tests/gpu/install_nvrtc.sh" | tail -n1)" && [ -n "$d" ]; then
            export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            NVRTC_FOUND="$d/libnvrtc.so.12"
            return 0
        fi
    fi
    return 1
}

# Check 7d: dspark-bench on device memory, every collective, 3 ranks (processes) on GPU 0 over
# shm, from sizes whose per-rank buffers are empty (all_gather of 4 B on 3 ranks: CUDA allocates
# no empty buffer, the bench runs those calls as the library's empty calls) up to 1 MiB, results
# checked; then --compare-paths once. Any wrong element or a bench error fails it.
bench_device_check() {
    local c fail=0 skew
    for c in all_reduce all_gather reduce_scatter broadcast reduce all_to_all all_to_all_v send_recv; do
        echo "--- $c"
        skew=()
        [ "$c" = all_to_all_v ] && skew=(--skew 0.5)
        # Exits non-zero on an error or any wrong element.
        CUDA_VISIBLE_DEVICES=0 "$BIN/dspark-bench" "$c" --ranks 3 --mem device "${skew[@]}" \
            -b 4 -e 1M -f 16 -c 1 -w 2 -n 20 || fail=1
    done
    echo "--- all_reduce --compare-paths"
    CUDA_VISIBLE_DEVICES=0 "$BIN/dspark-bench" all_reduce --ranks 2 --compare-paths -b 4 -e 4M -f 16 -c 1 -w 2 -n 20 || fail=1
    echo "SUMMARY: dspark-bench --mem device: $([ "$fail" -eq 0 ] && echo "every collective ran and checked" || echo FAILED)"
    return "$fail"
}

# Check 8: the torch backend on CUDA tensors, 2 ranks on GPU 0 (torchrun), with the wheel built
# by --build installed into a private directory. Skipped (exit 0, saying why) where there is
# no torch with CUDA or no wheel.
torch_cuda_check() {
    local py="${DSPARK_TORCH_PYTHON:-python3}" wheel site
    if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo "SUMMARY: torch CUDA check SKIPPED: no torch with CUDA for $py (set DSPARK_TORCH_PYTHON)"
        return 0
    fi
    wheel="$(ls "$CHECK_DIR"/wheels/dspark-*.whl 2>/dev/null | head -n1)"
    if [ -z "$wheel" ]; then
        echo "SUMMARY: torch CUDA check SKIPPED: no wheel in $CHECK_DIR/wheels (build with maturin)"
        return 0
    fi
    site="$(mktemp -d)"
    "$py" -m pip install -q --no-deps --no-index --target "$site" "$wheel" || return 1
    # Both routes into torch: the ProcessGroup (backend="dspark") and c10d's Backend (the route
    # of a group shared with another backend, forced here).
    local rc=0 route
    for route in pg backend; do
        if [ "$route" = backend ] && ! "$py" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 14) else 1)'; then
            echo "SUMMARY: torch CUDA check through the backend route SKIPPED: it needs torch >= 2.14 (a Python c10d Backend); this is torch $("$py" -c 'import torch; print(torch.__version__)')"
            continue
        fi
        echo "torch CUDA check through the $route route"
        PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" DSPARK_TORCH_ROUTE=$route "$py" \
            -m torch.distributed.run --standalone --nproc-per-node 2 \
            "$ROOT/tests/torch/cuda_check.py" || rc=1
    done
    rm -rf "$site"
    return $rc
}

declare -a NAMES RESULTS TIMES
# Per-step logs; with $OUT set (the device machines of this workplace, which return at most 8
# files) they are also packed into $OUT/gpu-check-logs.tgz at the end.
LOGDIR="$CHECK_DIR/logs"

# Stacks of every process under `pid` but the wrappers (timeout, bash, tee), through cuda-gdb
# or gdb where one is installed: what a step was doing when it ran out of time.
dump_stacks() {
    local pid="$1" dbg p n=0
    dbg="$(command -v cuda-gdb || command -v gdb)" || { echo "(no cuda-gdb or gdb for stacks)"; return; }
    local todo=("$pid") all=()
    while [ "${#todo[@]}" -gt 0 ]; do
        p="${todo[0]}"; todo=("${todo[@]:1}")
        all+=("$p")
        while read -r c; do [ -n "$c" ] && todo+=("$c"); done < <(pgrep -P "$p")
    done
    for p in "${all[@]}"; do
        case "$(cat "/proc/$p/comm" 2>/dev/null)" in timeout | bash | tee | sleep | "") continue ;; esac
        n=$((n + 1))
        [ "$n" -le 2 ] || break
        echo "=== stacks of $p ($(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-200))"
        timeout 20 "$dbg" -p "$p" -batch -ex "thread apply all bt 30" 2>&1 | grep -v '^\[New Thread\|^$'
    done
}

step() {
    local name="$1" limit="$2"
    shift 2
    local log
    log="$LOGDIR/$(echo "$name" | tr -c 'A-Za-z0-9_.-' '_').log"
    echo
    echo "=================== $name"
    local t0=$SECONDS
    # A step still running 45 s before its limit (half of it for short ones) has its stacks
    # taken into its log first (at most 2 processes, 20 s each).
    { timeout "$limit" "$@" 2>&1 | tee "$log"; exit "${PIPESTATUS[0]}"; } &
    local pid=$!
    (
        sleep $((limit > 90 ? limit - 45 : limit / 2))
        kill -0 "$pid" 2>/dev/null && dump_stacks "$pid" >"$log.stacks" 2>&1
    ) &
    local watcher=$!
    wait "$pid"
    local rc=$?
    pkill -P "$watcher" 2>/dev/null
    kill "$watcher" 2>/dev/null
    wait "$watcher" 2>/dev/null
    if [ -s "$log.stacks" ]; then
        echo "(stacks taken before the limit: $log.stacks)"
        cat "$log.stacks" >>"$log"
    fi
    local dt=$((SECONDS - t0))
    NAMES+=("$name")
    TIMES+=("$dt")
    if [ "$rc" -eq 0 ]; then
        RESULTS+=("PASS")
    elif [ "$rc" -eq 124 ]; then
        RESULTS+=("FAIL (timeout ${limit}s)")
    else
        RESULTS+=("FAIL (exit $rc)")
    fi
    grep -h '^SUMMARY:' "$log" >>"$LOGDIR/summary.txt" || true
}

run() {
    for b in dspark dspark-bench gpu_device gpu_kernels_compile; do
        [ -x "$BIN/$b" ] || { echo "run_all: $BIN/$b missing: run with --build first (or without arguments)" >&2; return 1; }
    done
    mkdir -p "$LOGDIR"
    : >"$LOGDIR/summary.txt"
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
    done
    NVRTC_FOUND=""
    if find_nvrtc; then
        echo "libnvrtc: $NVRTC_FOUND (LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
    else
        echo "libnvrtc: NOT FOUND (the NVRTC and GPU kernel checks will fail)"
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,pci.bus_id,memory.total --format=csv
    export DSPARK_REQUIRE_GPU=1 DSPARK_REQUIRE_NVRTC=1 DSPARK_REPO="$ROOT"
    DSPARK_CACHE_DIR="$(mktemp -d)"
    export DSPARK_CACHE_DIR
    local T0=$SECONDS

    step "doctor" 45 "$BIN/dspark" doctor --compile-kernels --require cuda --require nvrtc
    step "nvrtc compile + host emulation" 120 "$BIN/gpu_kernels_compile" --nocapture
    step "kernels vs CPU reference" 180 "$BIN/gpu_device" kernels_match --nocapture
    step "reduce bandwidth vs copy" 90 "$BIN/gpu_device" reduction_bandwidth --nocapture
    step "dma-buf export" 30 "$BIN/gpu_device" device_memory_exports --nocapture
    step "direct device (land, reduce, send slots)" 60 "$BIN/gpu_device" direct_device --nocapture
    step "staged allreduce 2 ranks TCP" 120 "$BIN/gpu_device" staged_all_reduce --nocapture
    step "enqueued (stream-ordered) device calls" 90 "$BIN/gpu_device" enqueued_device --nocapture
    step "one-shot device+host ranks shm" 60 "$BIN/gpu_device" small_device_all_reduces --nocapture
    step "device all_to_all_v (uneven blocks)" 60 "$BIN/gpu_device" device_all_to_all_v --nocapture
    step "dspark-bench --mem device, 3 ranks" 90 bash "$ROOT/tests/gpu/run_all.sh" --bench-check
    # A step runs a program under `timeout`, so the torch check (a function here) runs as
    # this script again with --torch-check.
    step "torch backend on CUDA tensors" 240 bash "$ROOT/tests/gpu/run_all.sh" --torch-check
    echo
    echo "=================== summary ($((SECONDS - T0)) s)"
    printf '%-34s %-22s %6s\n' "check" "result" "secs"
    local i fail=0
    for i in "${!NAMES[@]}"; do
        printf '%-34s %-22s %6s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}"
        case "${RESULTS[$i]}" in FAIL*) fail=1 ;; esac
    done
    echo
    sed 's/^SUMMARY: /  /' "$LOGDIR/summary.txt"
    echo "logs: $LOGDIR"
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
        tar czf "$OUT/gpu-check-logs.tgz" -C "$LOGDIR" . && echo "packed: $OUT/gpu-check-logs.tgz"
    fi
    rm -rf "$DSPARK_CACHE_DIR"
    return $fail
}

case "$mode" in
    --build) build ;;
    --run) run ;;
    --torch-check) torch_cuda_check ;;
    --bench-check) bench_device_check ;;
    all) build && run ;;
    *) echo "usage: $0 [--build|--run]" >&2; exit 2 ;;
esac
