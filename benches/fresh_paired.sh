#!/usr/bin/env bash
# fresh_paired.sh FLOOR OUT - issue 25's fresh-run check with the machine divided out: N (12)
# fresh process pairs per cell {tcp8, tcp64k, shm8, shm64k}, the cells interleaved, each run
# alone on the machine (under an exclusive lock on $LOCK, default /work/measure.lock), of
# `FLOOR 15 K pin paired-<cell>` (FLOOR: the cache-line floor's binary, which
# `cargo bench --bench cacheline_floor --no-run` prints). Each run opens a dspark communicator
# of 2 ranks pinned to CPUs 0 and 1 and the floor's own channel, and alternates K dspark
# all_reduces with K floor iterations, 15 samples (plus one untimed): see the `paired-` mode
# in benches/cacheline_floor.rs. Rows go to OUT/rows (cell, dspark µs, floor µs, ratio median,
# min, max, 1-minute load); then per cell: n, median, min, max, slowest / median of dspark's
# time, of the floor's, and of the ratio.
#
# Why: on this project's 2-vCPU VM the raw loopback TCP exchange (no dspark) sits at one of
# two levels ~1.5 µs apart, the slow one in stretches of 2 ms to nearly a second (most a
# few ms, some of 0.2-0.9 s, whole seconds mostly slow), so fresh `dspark-bench` runs at
# TCP 8 B spread as the machine does (benches/data/issue25-stop50-2026-12-07/). The ratio to
# a floor timed milliseconds apart in the same processes is dspark's own steadiness.
#
#   N=12 bash benches/fresh_paired.sh target/release/deps/cacheline_floor-... /tmp/paired-A
set -euo pipefail
FLOOR=$1; OUT=$2; N=${N:-12}; LOCK=${LOCK:-/work/measure.lock}
mkdir -p "$OUT"; : > "$OUT/rows"
# K per cell: about 2 ms of dspark calls per sample on the VM of 2026-12-07.
declare -A K=([tcp8]=500 [tcp64k]=100 [shm8]=5000 [shm64k]=200)
for i in $(seq 1 "$N"); do
  for c in tcp8 tcp64k shm8 shm64k; do
    r=$(flock -x -o "$LOCK" timeout 120 "$FLOOR" 15 "${K[$c]}" pin "paired-$c" 2>/dev/null \
        | awk -F, -v m="paired-$c" '$1==m {print $2, $3, $4, $5, $6}') || r=
    echo "$c ${r:-nan nan nan nan nan} $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/rows"
  done
done
python3 - "$OUT/rows" <<'PY'
import sys, statistics, collections
d = collections.defaultdict(list); loads = []
for l in open(sys.argv[1]):
    c, dsp, flo, r, rlo, rhi, ld = l.split(); loads.append(float(ld))
    if dsp == "nan":
        print(f"{c}: a run failed (no row)"); continue
    d[c].append((float(dsp), float(flo), float(r)))
def line(name, v):
    m = statistics.median(v)
    return f"{name} {len(v)} {m:.3f} {min(v):.3f} {max(v):.3f} {max(v)/m:.2f}"
print("cell | what | n median min max slowest/median")
for c in ("tcp8", "tcp64k", "shm8", "shm64k"):
    if c in d:
        for j, what in ((0, "dspark µs"), (1, "floor µs"), (2, "dspark ÷ floor")):
            print(line(f"{c} | {what} |", [x[j] for x in d[c]]))
print(f"load(1m) {min(loads)}..{max(loads)}")
PY
