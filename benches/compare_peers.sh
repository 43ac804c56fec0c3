#!/usr/bin/env bash
# compare_peers.sh - dspark's allreduce next to Open MPI, MPICH, Gloo and the raw limits,
# measured interleaved in one session on this machine (the machine is shared and noisy:
# compare ratios from one run, never absolute times from different runs).
#
#   bash benches/compare_peers.sh                    # 3 passes, 2 and 4 ranks
#   RUNS=1 NPS=2 bash benches/compare_peers.sh       # quick look
#   PEERS="limits ompi gloonative gloo" bash benches/compare_peers.sh   # + torch Gloo (3 GB install)
#   MODES="shm tcp" NPS=2 bash benches/compare_peers.sh   # + dspark and Open MPI over shared memory
#   VARIANTS="spin5:DSPARK_SPIN_US=5 spin20:DSPARK_SPIN_US=20" bash benches/compare_peers.sh
#       # + dspark with knobs, interleaved with the rest: rows dspark_<mode>_<label>, one column each
#   BENCH_BEFORE=/tmp/old/dspark-bench bash benches/compare_peers.sh   # + another build: column "before"
#
# Uses the peer benchmarks in $PEERS_DIR (default ../shared/peers next to the repository):
# same sizes, same method (median of samples of K back-to-back allreduces, max over ranks,
# f32 sum, exact check), same CSV rows; dspark runs through `dspark-bench --peer-rows`.
# Prints the merged summary and the ratios the project tracks.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-$ROOT/../shared/peers}
RUNS=${RUNS:-3}
NPS=${NPS:-2 4}
PEERS=${PEERS:-limits ompi gloonative}
# Transports of dspark (and of Open MPI, which runs in the same modes): tcp, shm.
MODES=${MODES:-tcp}
# dspark again with environment knobs: "LABEL:K=V[,K=V...] ...", run right after plain dspark.
VARIANTS=${VARIANTS:-}
SIZES=${SIZES:-8,1024,65536,1048576,16777216,67108864,268435456}
export PEERS_WORK=${PEERS_WORK:-${TMPDIR:-/tmp}/dspark-peers}
[ -f "$PEERS_DIR/run_all.sh" ] || { echo "compare_peers: no peer benchmarks at $PEERS_DIR (set PEERS_DIR)" >&2; exit 2; }
has() { [[ " $PEERS " == *" $1 "* ]]; }
log() { echo "[compare $(date +%T)] $*" >&2; }

log "installing and building the peers (first time: apt + compile)"
RUNS=0 PEERS="$PEERS" bash "$PEERS_DIR/run_all.sh" >/dev/null
BUILD=$PEERS_WORK/build
log "building dspark-bench (release)"
(cd "$ROOT" && cargo build --release --quiet --bin dspark-bench)
BENCH=${CARGO_TARGET_DIR:-$ROOT/target}/release/dspark-bench

OUT=$PEERS_WORK/results/dspark-$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
{ uname -a; nproc; uptime; } > "$OUT/machine.txt" 2>&1 || true
run() { # name, command...
    local name=$1; shift
    log "pass $pass: $name (load $(cut -d' ' -f1-3 /proc/loadavg))"
    echo "$pass $name $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.log"
    if ! "$@" > "$OUT/pass$pass/$name.csv" 2> "$OUT/pass$pass/$name.err"; then
        log "  FAILED: $name (see $OUT/pass$pass/$name.err)"; status=1
    fi
}
status=0
for pass in $(seq 1 "$RUNS"); do
    mkdir -p "$OUT/pass$pass"
    has limits && run limits "$PEERS_DIR/limits.sh" "$SIZES"
    for np in $NPS; do
        # Alternate who goes first, so that drift in the machine's load hits everyone alike.
        order="dspark ompi gloonative gloo"
        (( pass % 2 == 0 )) && order="gloo gloonative ompi dspark"
        for who in $order; do
            case $who in
            dspark) for m in $MODES; do
                    run "dspark_${m}_np$np" "$BENCH" --peer-rows "dspark_$m" --ranks "$np" --transport "$m" --sizes "$SIZES"
                    if [ -n "${BENCH_BEFORE:-}" ]; then
                        run "dspark_${m}_before_np$np" "$BENCH_BEFORE" --peer-rows "dspark_${m}_before" --ranks "$np" --transport "$m" --sizes "$SIZES"
                    fi
                    for v in $VARIANTS; do
                        IFS=, read -ra kv <<< "${v#*:}"
                        run "dspark_${m}_${v%%:*}_np$np" env "${kv[@]}" "$BENCH" --peer-rows "dspark_${m}_${v%%:*}" --ranks "$np" --transport "$m" --sizes "$SIZES"
                    done
                done ;;
            ompi) has ompi && for m in $MODES; do run "ompi_${m}_np$np" "$PEERS_DIR/run_mpi.sh" ompi "$m" "$np" "$SIZES"; done ;;
            gloonative) has gloonative && run "gloo_native_np$np" "$BUILD/gloo_native" --nproc "$np" --peer gloo_native --sizes "$SIZES" ;;
            gloo) has gloo && run "gloo_tcp_np$np" "$PEERS_WORK/venv/bin/python" "$PEERS_DIR/gloo_allreduce.py" --nproc "$np" --peer gloo_tcp --sizes "$SIZES" ;;
            esac
        done
    done
done
python3 "$PEERS_DIR/summarize.py" "$OUT" > "$OUT/summary.csv"
cat "$OUT/summary.csv"
echo
VARIANT_LABELS=$([ -n "${BENCH_BEFORE:-}" ] && printf 'before '; for v in $VARIANTS; do printf '%s ' "${v%%:*}"; done) python3 - "$OUT/summary.csv" <<'PY'
import csv, os, sys
rows = {}
for r in csv.DictReader(open(sys.argv[1])):
    if r["time_us"] in ("WRONG", ""):
        continue
    try:
        rows[(r["peer"], int(r["ranks"]), int(r["bytes"]))] = float(r["time_us"])
    except ValueError:
        pass
def t(p, n, b): return rows.get((p, n, b))
variants = os.environ.get("VARIANT_LABELS", "").split()
def vcols(base, n, b, o):
    out = ""
    for v in variants:
        x = t(f"{base}_{v}", n, b)
        out += f" {x:>10.2f}" if x is not None else f" {'-':>10}"
        out += f" {x / o:>12.2f}" if x is not None and o else f" {'-':>12}"
    return out
sizes = sorted({b for (_, _, b) in rows})
ranks = sorted({n for (p, n, _) in rows if p == "dspark_tcp"})
print("ratios (median time; < 1 means dspark is faster)")
print(f"{'ranks':>5} {'bytes':>10} {'dspark us':>10} {'ompi_tcp us':>11} {'dspark/ompi':>11} {'gloo_native us':>14} {'gloo/dspark':>11} {'tcp_exchange us':>15} {'reduce_add GB/s':>15}" + "".join(f" {v+' us':>10} {v+'/ompi':>12}" for v in variants))
for n in ranks:
    for b in sizes:
        d = t("dspark_tcp", n, b)
        if d is None:
            continue
        o = t("ompi_tcp", n, b); g = t("gloo_native", n, b); x = t("tcp_exchange", 2, b)
        ra = t("reduce_add", 1, b)
        f = lambda v: f"{v:.2f}" if v is not None else "-"
        print(f"{n:>5} {b:>10} {d:>10.2f} {f(o):>11} {f(d/o if o else None):>11} {f(g):>14} {f(g/d if g else None):>11} {f(x):>15} {f(b/ra/1e3 if ra else None):>15}" + vcols("dspark_tcp", n, b, o))
ranks = sorted({n for (p, n, _) in rows if p == "dspark_shm"})
if ranks:
    print()
    print("shared memory (median time; < 1 means dspark is faster)")
    print(f"{'ranks':>5} {'bytes':>10} {'dspark_shm us':>13} {'ompi_shm us':>11} {'shm/ompi':>9} {'dspark_tcp us':>13} {'memcpy GB/s':>11}" + "".join(f" {v+' us':>10} {v+'/ompi':>12}" for v in variants))
    for n in ranks:
        for b in sizes:
            d = t("dspark_shm", n, b)
            if d is None:
                continue
            o = t("ompi_shm", n, b); c = t("dspark_tcp", n, b); mc = t("memcpy", 1, b)
            f = lambda v: f"{v:.2f}" if v is not None else "-"
            print(f"{n:>5} {b:>10} {d:>13.2f} {f(o):>11} {f(d/o if o else None):>9} {f(c):>13} {f(b/mc/1e3 if mc else None):>11}" + vcols("dspark_shm", n, b, o))
PY
log "results in $OUT"
exit $status
