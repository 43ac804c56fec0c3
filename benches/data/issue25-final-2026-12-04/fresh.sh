#!/usr/bin/env bash
# fresh.sh BIN OUT: 12 fresh dspark-bench --ranks 2 runs each of {shm,tcp} x {8, 64K}, each run
# alone on the machine (exclusive measurement lock); table time (µs); slowest / median.
BIN=$1; OUT=$2; N=${N:-12}; mkdir -p $OUT; : > $OUT/rows
for i in $(seq 1 $N); do
 for t in shm tcp; do
  for s in 8 64K; do
    v=$(flock -x /work/measure.lock $BIN --ranks 2 --transport $t -b $s -e $s 2>/dev/null | grep -v '^#' | awk 'NF>5{print $6; exit}')
    echo "$t $s $v $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/rows
  done
 done
done
python3 - $OUT/rows <<'PY'
import sys,statistics,collections
d=collections.defaultdict(list); loads=[]
for l in open(sys.argv[1]):
    t,s,v,ld=l.split(); d[(t,s)].append(float(v)); loads.append(float(ld))
print("transport size n median min max slowest/median")
for k in sorted(d):
    v=d[k]; m=statistics.median(v)
    print(*k, len(v), f"{m:.2f} {min(v):.2f} {max(v):.2f} {max(v)/m:.2f}")
print(f"load(1m) {min(loads)}..{max(loads)}")
PY
