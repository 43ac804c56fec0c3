#!/bin/bash
# ab2.sh N RANKS SIZES  then pairs "label|env|bin" ...: interleaved medians over shm
N=$1; R=$2; S=$3; shift 3
for i in $(seq 1 $N); do
  for spec in "$@"; do
    IFS='|' read -r lab envs bin <<< "$spec"
    flock -x /work/measure.lock env $envs $bin --peer-rows x --ranks $R --transport shm --sizes $S 2>/dev/null | awk -F, -v w=$lab '{print w, $3, $6}'
  done
done | python3 -c "
import sys,statistics,collections
d=collections.defaultdict(list)
for l in sys.stdin:
    w,s,v=l.split(); d[(int(s),w)].append(float(v))
for k in sorted(d): print(k, 'median %.3f'%statistics.median(d[k]), 'min %.3f'%min(d[k]))
"
