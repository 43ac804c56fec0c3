#!/bin/bash
# small_pairs.sh ROUNDS: per round, the cache-line exchange floor, then Open MPI (shm), dspark
# (this stop) and dspark (before, 6185493) at 8 and 64 B, all through the peers' timing method,
# then the floor again: one line per round, so that rounds in one vCPU placement can be paired.
cd /work/main
F=$(ls -t target/release/deps/cacheline_floor-* | grep -v "\.d$" | head -1)
fl() { $F 11 2000 exchange 2>/dev/null | awk -F, '$1=="exchange"{print $2}'; }
get() { awk -F, -v b=$1 '$3==b {print $6}'; }
echo "round floor_before ompi8 dspark8 before8 ompi64 dspark64 before64 floor_after"
for i in $(seq 1 $1); do
  f0=$(fl)
  o=$(bash /work/shared/peers/run_mpi.sh ompi shm 2 8,64 2>/dev/null)
  d=$(/tmp/s34/dspark-bench --peer-rows dspark_shm --ranks 2 --transport shm --sizes 8,64 2>/dev/null)
  b=$(/tmp/bench-6185493 --peer-rows dspark_shm_before --ranks 2 --transport shm --sizes 8,64 2>/dev/null)
  f1=$(fl)
  echo "$i $f0 $(echo "$o"|get 8) $(echo "$d"|get 8) $(echo "$b"|get 8) $(echo "$o"|get 64) $(echo "$d"|get 64) $(echo "$b"|get 64) $f1"
done
