#!/bin/bash
# quota_exp.sh: dspark-bench inside a cgroup v1 cpu quota, policies interleaved
BIN=${BIN:-/work/main/target/release/dspark-bench}
CG=/sys/fs/cgroup/cpu/dsq$$
mkdir -p $CG; echo ${QUOTA:-100000} > $CG/cpu.cfs_quota_us
trap 'rmdir $CG' EXIT
for r in 1 2; do
for np in 2 4; do
for pol in "default:" "spin0:DSPARK_SPIN_US=0" "spin5:DSPARK_SPIN_US=5" "yield100:DSPARK_SPIN_US=100"; do
  name=${pol%%:*}; kv=${pol#*:}
  out=$(flock -x -o /work/measure.lock bash -c "echo \$\$ > $CG/cgroup.procs; env $kv timeout 300 $BIN --ranks $np --transport shm -b 8 -e 1M -f 128 -n ${N:-2000} 2>/dev/null")
  echo "$r np$np $name: $(grep -v '^#' <<<"$out" | awk 'NF>5{printf "%s=%s ", $1, $6}') $(grep -o 'no other rank[^;]*\|[0-9]* ranks on CPU[^;]*' <<<"$out" | head -1)"
done; done; done
