#!/usr/bin/env bash
# fresh_runs.sh BIN OUT - issue 25's fresh-run check: N (12) fresh `BIN --ranks 2` runs each of
# {shm, tcp} x {8 B, 64 KiB}, every run alone on the machine (under an exclusive lock on
# $LOCK, default /work/measure.lock, which builds take shared), the table's time (µs) per run
# into OUT/rows with the 1-minute load, then per cell: n, median, min, max, slowest / median.
#
# With FLOOR set to the cache-line floor's binary (`cargo bench --bench cacheline_floor
# --no-run` prints it), every round also runs it fresh (31 samples of 2000, pinned), as the cell
# `floor exchange`: the machine's own spread over fresh processes, with no library in them.
#
#   N=12 bash benches/fresh_runs.sh target/release/dspark-bench /tmp/fresh-A
set -euo pipefail
BIN=$1; OUT=$2; N=${N:-12}; LOCK=${LOCK:-/work/measure.lock}; FLOOR=${FLOOR:-}
mkdir -p "$OUT"; : > "$OUT/rows"
for i in $(seq 1 "$N"); do
 if [ -n "$FLOOR" ]; then
  v=$(flock -x -o "$LOCK" "$FLOOR" 31 2000 pin 2>/dev/null | awk -F, '$1=="exchange"{print $2}') || v=
  echo "floor exchange ${v:-nan} $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/rows"
 fi
 for t in shm tcp; do
  for s in 8 64K; do
    v=$(flock -x -o "$LOCK" "$BIN" --ranks 2 --transport $t -b $s -e $s 2>/dev/null | grep -v '^#' | awk 'NF>5{print $6; exit}') || v=
    echo "$t $s ${v:-nan} $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/rows"
  done
 done
done
python3 - "$OUT/rows" <<'PY'
import sys,statistics,collections
d=collections.defaultdict(list); loads=[]
for l in open(sys.argv[1]):
    t,s,v,ld=l.split(); loads.append(float(ld))
    if v != "nan": d[(t,s)].append(float(v))
    else: print(f"{t} {s}: a run failed (no time)")
print("transport size n median min max slowest/median")
for k in sorted(d):
    v=d[k]; m=statistics.median(v)
    print(*k, len(v), f"{m:.2f} {min(v):.2f} {max(v):.2f} {max(v)/m:.2f}")
print(f"load(1m) {min(loads)}..{max(loads)}")
PY
