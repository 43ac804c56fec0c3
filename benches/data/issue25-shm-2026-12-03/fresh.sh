#!/usr/bin/env bash
# 12 fresh runs each: {before,after} x {shm,tcp} x {8, 64K}, interleaved; table time (µs)
N=${N:-12}
OUT=${OUT:-/tmp/fresh-$(date +%H%M%S)}; mkdir -p $OUT
for i in $(seq 1 $N); do
 for t in shm tcp; do
  for s in 8 64K; do
   for who in before after; do
    bin=/tmp/dspark-bench-before; [ $who = after ] && bin=/work/wt-shm/target/release/dspark-bench
    v=$($bin --ranks 2 --transport $t -b $s -e $s 2>/dev/null | grep -v '^#' | awk 'NF>5{print $6; exit}')
    echo "$who $t $s $v $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/rows
   done
  done
 done
done
python3 - $OUT/rows <<'PY'
import sys,statistics,collections
d=collections.defaultdict(list); loads=[]
for l in open(sys.argv[1]):
    w,t,s,v,ld=l.split(); d[(t,s,w)].append(float(v)); loads.append(float(ld))
print("transport size who n median min max slowest/median")
for k in sorted(d):
    v=d[k]; m=statistics.median(v)
    print(*k, len(v), f"{m:.2f} {min(v):.2f} {max(v):.2f} {max(v)/m:.2f}")
print(f"load(1m) {min(loads)}..{max(loads)}")
PY
