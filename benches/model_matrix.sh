#!/usr/bin/env bash
# model_matrix.sh - the measured matrix the cost model (src/plan/model.rs) is fitted to:
# `dspark-bench --algo all` (every allreduce algorithm, side by side, the default table's
# time) over TCP for each world size and size, in fresh runs repeated REPS times, the worlds
# interleaved within each repetition so that drift in the machine's load hits all alike.
#
#   bash benches/model_matrix.sh > benches/data/model-matrix-$(date +%F).csv
#   WORLDS="3 4" REPS=3 bash benches/model_matrix.sh
#
# One CSV row per (rep, world, size, algorithm): the measured time, the model's prediction
# and the algorithm the model chose, with the load average when the run started.
# Summarize with benches/model_matrix_summary.py.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH=${BENCH:-${CARGO_TARGET_DIR:-$ROOT/target}/release/dspark-bench}
WORLDS=${WORLDS:-3 4 5 6 7 8}
REPS=${REPS:-3}
# Two sweeps cover 4 KiB, 32 KiB, 256 KiB (x8) and 1, 4, 16 MiB (x4).
SWEEPS=${SWEEPS:-"4K:256K:8 1M:16M:4"}
echo "rep,world,bytes,algo,time_us,model_us,default,load1"
for rep in $(seq 1 "$REPS"); do
    for n in $WORLDS; do
        for sw in $SWEEPS; do
            IFS=: read -r b e f <<< "$sw"
            load=$(cut -d' ' -f1 /proc/loadavg)
            echo "[matrix $(date +%T)] rep $rep world $n $b-$e load $load" >&2
            "$BENCH" --ranks "$n" --transport tcp --algo all -b "$b" -e "$e" -f "$f" 2>&1 |
                awk -v rep="$rep" -v n="$n" -v load="$load" '
                /--algo all:/ { on = 1; next }
                on && $2 == "size" { na = 0; for (i = 3; i <= NF; i++) if ($i != "busbw" && $i != "model" && $i != "fastest" && $i != "default") algos[na++] = $i; next }
                on && $1 ~ /^[0-9]+$/ { for (k = 0; k < na; k++) if ($(2 + 3 * k) ~ /^[0-9.]+$/) printf "%s,%s,%s,%s,%s,%s,%s,%s\n", rep, n, $1, algos[k], $(2 + 3 * k), $(4 + 3 * k), $NF, load }'
        done
    done
done
