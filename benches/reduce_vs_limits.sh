#!/usr/bin/env bash
# reduce_vs_limits.sh - the reduce kernels against this machine's `dst += src` limit, same run.
#
# Builds memcpy_bw.c from the peers directory (the C reference: `dst[i] += src[i]` on f32,
# compiled with -march=native; only the reference gets that flag, never dspark) and the
# criterion benchmark benches/reduce.rs, then for ROUNDS rounds runs every benchmark on its own
# with a memcpy_bw run of the same size just before and just after it. A ratio compares one
# benchmark with the mean of the two reduce_add runs around it, so slow drifts of a shared,
# noisy machine cancel; the table shows the median ratio over rounds and its range.
#
# GB/s follows memcpy_bw.c: bytes of ONE buffer per operation / time (each operation reads two
# buffers and writes one), GB = 1e9 B. Gelem/s = elements of one buffer per ns.
#
# Environment:
#   PEERS_DIR    directory holding memcpy_bw.c (default: ../shared/peers next to the repo)
#   ROUNDS       rounds (default 3)
#   BENCH_FILTER regex on "group/name" of benches/reduce.rs (default: all of them)
#   WORK         scratch directory, emptied first (default ${TMPDIR:-/tmp}/dspark-reduce-vs-limits)
#   CARGO_TARGET_DIR as usual (default <repo>/target)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-$ROOT/../shared/peers}
ROUNDS=${ROUNDS:-3}
BENCH_FILTER=${BENCH_FILTER:-.*}
WORK=${WORK:-${TMPDIR:-/tmp}/dspark-reduce-vs-limits}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}

[ -f "$PEERS_DIR/memcpy_bw.c" ] || { echo "no memcpy_bw.c in $PEERS_DIR (set PEERS_DIR)" >&2; exit 2; }
rm -rf "$WORK"
mkdir -p "$WORK"
cc -O3 -march=native -o "$WORK/memcpy_bw" "$PEERS_DIR/memcpy_bw.c"
EXE=$(cd "$ROOT" && cargo bench --bench reduce --no-run --message-format=json 2>"$WORK/build.log" |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "reduce" and m.get("executable"):
        print(m["executable"])') || { cat "$WORK/build.log" >&2; exit 1; }
[ -x "$EXE" ] || { echo "bench executable not found" >&2; cat "$WORK/build.log" >&2; exit 1; }

# Benchmark ids look like group/name/size, e.g. reduce_inplace/f32/64MiB.
mapfile -t IDS < <("$EXE" --bench --list 2>/dev/null | sed -n 's/: benchmark$//p' |
    grep -E "^(${BENCH_FILTER})/[^/]+$" || true)
[ "${#IDS[@]}" -gt 0 ] || { echo "no benchmark matches BENCH_FILTER=$BENCH_FILTER" >&2; exit 2; }

bytes_of() {
    case "$1" in
        *KiB) echo $(( ${1%KiB} << 10 )) ;;
        *MiB) echo $(( ${1%MiB} << 20 )) ;;
        *) echo "unknown size label $1" >&2; exit 2 ;;
    esac
}

load0=$(cut -d' ' -f1 /proc/loadavg)
for r in $(seq 1 "$ROUNDS"); do
    i=0
    for id in "${IDS[@]}"; do
        i=$((i + 1))
        echo "round $r/$ROUNDS: $id" >&2
        bytes=$(bytes_of "${id##*/}")
        "$WORK/memcpy_bw" "$bytes" >"$WORK/limits.$r.$i.before.csv"
        re=$(printf '%s' "$id" | sed 's/[][\.*^$+?(){}|]/\\&/g')
        (cd "$ROOT" && CRITERION_HOME="$WORK/criterion.$r" "$EXE" --bench "^${re}\$") \
            >>"$WORK/bench.log" 2>&1 || { tail -20 "$WORK/bench.log" >&2; exit 1; }
        "$WORK/memcpy_bw" "$bytes" >"$WORK/limits.$r.$i.after.csv"
        printf '%s\t%s\t%s\n' "$r" "$i" "$id" >>"$WORK/index.tsv"
    done
done
load1=$(cut -d' ' -f1 /proc/loadavg)

WORK=$WORK LOAD="$load0 -> $load1" python3 - <<'EOF'
import json, os, statistics as st

work = os.environ["WORK"]
elem = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i32": 4, "i8": 1, "u8": 1}

def size_bytes(label):
    return int(label[:-3]) << (10 if label.endswith("KiB") else 20)

def limit_runs(r, i):
    """{kind: [GB/s of the run before, of the run after]}"""
    out = {}
    for when in ("before", "after"):
        for line in open(f"{work}/limits.{r}.{i}.{when}.csv"):
            f = line.strip().split(",")
            if len(f) >= 10 and f[0] in ("memcpy", "reduce_add") and f[-1] != "WRONG":
                out.setdefault(f[0], []).append(float(f[8]))
    return out

rows = {}    # id -> {"gbps": [...], "ratio": [...]} over rounds
lims = {}    # (kind, size label) -> [GB/s ...]
ours_by_round = {}  # (round, id) -> GB/s
for line in open(f"{work}/index.tsv"):
    r, i, bid = line.rstrip("\n").split("\t")
    group, name, size = bid.split("/")
    est = f"{work}/criterion.{r}/{group}/{name}/{size}/new/estimates.json"
    gbps = size_bytes(size) / json.load(open(est))["median"]["point_estimate"]  # B/ns = GB/s
    lim = limit_runs(r, i)
    for kind, v in lim.items():
        lims.setdefault((kind, size), []).extend(v)
    row = rows.setdefault(bid, {"gbps": [], "ratio": []})
    row["gbps"].append(gbps)
    if lim.get("reduce_add"):
        row["ratio"].append(gbps / st.mean(lim["reduce_add"]))
    ours_by_round[(r, bid)] = gbps

level = next((l.split("simd level")[-1].strip() for l in open(f"{work}/bench.log") if "simd level" in l), "?")
rounds = len({r for r, _ in ours_by_round})
print(f"dspark simd level: {level}; {os.cpu_count()} CPUs; load average {os.environ['LOAD']}; {rounds} rounds")
print("GB/s = bytes of one buffer / median time (memcpy_bw.c convention), median over rounds;")
print("ratio = ours / mean of the reduce_add runs just before and after it (median, min..max)\n")
print(f"{'kernel':<34} {'size':>6} {'GB/s':>8} {'Gelem/s':>8} {'vs reduce_add':>14} {'range':>13}")
sizes = sorted({bid.split("/")[2] for bid in rows}, key=size_bytes, reverse=True)
for size in sizes:
    for kind in ("memcpy", "reduce_add"):
        v = lims.get((kind, size))
        if v:
            ge = f"{st.median(v) / 4:8.2f}" if kind == "reduce_add" else f"{'-':>8}"
            print(f"{'C ' + kind + ' (f32, -march=native)':<34} {size:>6} {st.median(v):8.2f} {ge}")
    for bid in sorted(b for b in rows if b.endswith("/" + size)):
        group, name, _ = bid.split("/")
        g, rat = rows[bid]["gbps"], rows[bid]["ratio"]
        e = elem.get(name, 4)
        rs = f"{st.median(rat):14.2f} {min(rat):6.2f}..{max(rat):<5.2f}" if rat else ""
        print(f"{group + '/' + name:<34} {size:>6} {st.median(g):8.2f} {st.median(g) / e:8.2f} {rs}")
    print()

for size in sizes:
    for h in ("f16", "bf16"):
        per_round = [ours_by_round[(r, f"reduce_inplace/{h}/{size}")] / 2
                     / (ours_by_round[(r, f"reduce_inplace/f32/{size}")] / 4)
                     for r in {r for r, _ in ours_by_round}
                     if (r, f"reduce_inplace/{h}/{size}") in ours_by_round
                     and (r, f"reduce_inplace/f32/{size}") in ours_by_round]
        if per_round:
            print(f"{h} elements/s vs f32 at {size}: {st.median(per_round):.2f}x "
                  f"(range {min(per_round):.2f}..{max(per_round):.2f}; target >= 0.5)")
EOF
