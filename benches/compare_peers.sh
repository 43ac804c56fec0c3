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
# Prints the merged summary and the ratios the project tracks. With shm in MODES, each
# transport's contenders run back to back and every shared-memory run has the cache-line floor
# (benches/cacheline_floor.rs, built here; FLOOR=path to use another, FLOOR= for none) right
# before and after it: the last table gives per pass where the vCPUs were (near or far) and
# dspark / Open MPI only where both ran in the same placement, beside dspark / the floor.
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
# The cache-line floor (benches/cacheline_floor.rs) beside every shared-memory run: FLOOR= to
# skip it, or the path of a built one.
if [[ " $MODES " == *" shm "* ]] && [ -z "${FLOOR+x}" ]; then
    log "building the cache-line floor (benches/cacheline_floor.rs)"
    FLOOR=$(cd "$ROOT" && cargo bench --bench cacheline_floor --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cacheline_floor" and m.get("executable"):
        print(m["executable"])') || FLOOR=
    [ -n "$FLOOR" ] || log "  could not build the floor: no floor beside the shm runs"
fi
FLOOR=${FLOOR:-}

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
floor() { # name: the cache-line round trip (µs) between CPUs 0 and 1 right now, into floors.txt
    [ -n "$FLOOR" ] || return 0
    local p
    p=$(timeout 60 "$FLOOR" 31 2000 pin pingpong 2>/dev/null | awk -F, '$1=="pingpong"{print $2}') || p=
    echo "$1 ${p:-nan}" >> "$OUT/pass$pass/floors.txt"
}
shm_run() { # name, command...: run, with the floor right before and right after in shm mode
    [ "$m" = shm ] && floor "$1 before"
    run "$@"
    [ "$m" = shm ] && floor "$1 after"
    return 0
}
first_mode=${MODES%% *}
for pass in $(seq 1 "$RUNS"); do
    mkdir -p "$OUT/pass$pass"
    has limits && run limits "$PEERS_DIR/limits.sh" "$SIZES"
    for np in $NPS; do
      # Each transport's contenders back to back, so that dspark and Open MPI over shared memory
      # run minutes apart at most (the host moves a VM's vCPUs between cores sharing a cache
      # and cores apart, which changes a small call's time 2-3x: the floor records where).
      for m in $MODES; do
        # Alternate who goes first, so that drift in the machine's load hits everyone alike.
        order="dspark ompi gloonative gloo"
        (( pass % 2 == 0 )) && order="gloo gloonative ompi dspark"
        for who in $order; do
            case $who in
            dspark)
                shm_run "dspark_${m}_np$np" "$BENCH" --peer-rows "dspark_$m" --ranks "$np" --transport "$m" --sizes "$SIZES"
                if [ -n "${BENCH_BEFORE:-}" ]; then
                    shm_run "dspark_${m}_before_np$np" "$BENCH_BEFORE" --peer-rows "dspark_${m}_before" --ranks "$np" --transport "$m" --sizes "$SIZES"
                fi
                for v in $VARIANTS; do
                    IFS=, read -ra kv <<< "${v#*:}"
                    shm_run "dspark_${m}_${v%%:*}_np$np" env "${kv[@]}" "$BENCH" --peer-rows "dspark_${m}_${v%%:*}" --ranks "$np" --transport "$m" --sizes "$SIZES"
                done ;;
            ompi) has ompi && shm_run "ompi_${m}_np$np" "$PEERS_DIR/run_mpi.sh" ompi "$m" "$np" "$SIZES" ;;
            # TCP only: once per pass and ranks, with the first transport's contenders.
            gloonative) [ "$m" = "$first_mode" ] && has gloonative && run "gloo_native_np$np" "$BUILD/gloo_native" --nproc "$np" --peer gloo_native --sizes "$SIZES" ;;
            gloo) [ "$m" = "$first_mode" ] && has gloo && run "gloo_tcp_np$np" "$PEERS_WORK/venv/bin/python" "$PEERS_DIR/gloo_allreduce.py" --nproc "$np" --peer gloo_tcp --sizes "$SIZES" ;;
            esac
        done
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
if [ -n "$FLOOR" ] && [[ " $MODES " == *" shm "* ]]; then
echo
python3 - "$OUT" <<'PY'
import csv, glob, os, statistics, sys
out = sys.argv[1]
FAR = 0.2  # µs round trip: FAR_US of src/bin/bench/distance.rs
def place(b, a):
    if b != b or a != a:
        return None
    return "near" if max(b, a) < FAR else ("far" if min(b, a) >= FAR else "moved")
runs = {}  # (pass, name) -> (placement, floor, {(ranks, bytes): µs})
for d in sorted(glob.glob(os.path.join(out, "pass*"))):
    ps = int(os.path.basename(d)[4:])
    fl = {}
    if os.path.exists(os.path.join(d, "floors.txt")):
        for l in open(os.path.join(d, "floors.txt")):
            name, when, v = l.split()
            fl[(name, when)] = float(v)
    for f in glob.glob(os.path.join(d, "*_shm_np*.csv")):
        name = os.path.basename(f)[:-4]
        b, a = fl.get((name, "before"), float("nan")), fl.get((name, "after"), float("nan"))
        t = {}
        for r in csv.reader(open(f)):
            if len(r) < 10 or not r[1].isdigit() or (len(r) > 10 and r[10] == "WRONG"):
                continue
            us, gbps = float(r[5]), float(r[8])
            # Under 1 µs from algbw (4 decimals): the time column has 2 decimals of µs.
            t[(int(r[1]), int(r[2]))] = int(r[2]) / gbps / 1e3 if us < 1 and gbps > 0 else us
        runs[(ps, name)] = (place(b, a), (b + a) / 2, t)
passes = sorted({p for p, _ in runs})
print("shared memory by placement: the cache-line round trip between CPUs 0 and 1 right before "
      "and after each run (near < 0.2 µs, far >= 0.2, moved: one of each); per pass "
      "dspark / Open MPI when both ran in one placement, and dspark / the round trip")
print(f"{'ranks':>5} {'bytes':>10} " + " ".join(f"{'pass ' + str(p):>16}" for p in passes)
      + f" {'matched median':>15} {'dspark/floor':>12}")
keys = sorted({k for v in runs.values() for k in v[2]})
for n, b in keys:
    cells, ratios, floors = [], [], []
    for p in passes:
        d, o = runs.get((p, f"dspark_shm_np{n}")), runs.get((p, f"ompi_shm_np{n}"))
        if not d or (n, b) not in d[2]:
            cells.append("-"); continue
        if d[1] == d[1]:
            floors.append(d[2][(n, b)] / d[1])
        if not o or (n, b) not in o[2]:
            cells.append(f"{d[0] or '?'} -"); continue
        r = d[2][(n, b)] / o[2][(n, b)]
        if d[0] and d[0] == o[0] and d[0] != "moved":
            ratios.append(r); cells.append(f"{d[0]} {r:.2f}")
        else:
            cells.append(f"{d[0] or '?'}/{o[0] or '?'} ({r:.2f})")
    m = f"{statistics.median(ratios):.2f} ({len(ratios)})" if ratios else "- (0)"
    fm = f"{statistics.median(floors):.1f}" if floors else "-"
    print(f"{n:>5} {b:>10} " + " ".join(f"{c:>16}" for c in cells) + f" {m:>15} {fm:>12}")
PY
fi
log "results in $OUT"
exit $status
