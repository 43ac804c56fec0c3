#!/bin/bash
# ompi_pairs.sh ROUNDS bin_after bin_before: per round floor, OMPI shm, after, before at 8 and 64 B (peers' method), ns from algbw
F=/work/main/target/release/deps/cacheline_floor-85c81cfb63f333ba
fl() { $F 11 2000 exchange 2>/dev/null | awk -F, '$1=="exchange"{print $2}'; }
ns() { awk -F, -v b=$1 '$3==b {printf "%.1f", b/$9}'; }
echo "round floor ompi8 after8 before8 ompi64 after64 before64 floor_after"
for i in $(seq 1 $1); do
  f0=$(fl)
  o=$(bash /work/shared/peers/run_mpi.sh ompi shm 2 8,64 2>/dev/null)
  d=$($2 --peer-rows dspark_shm --ranks 2 --transport shm --sizes 8,64 2>/dev/null)
  b=$($3 --peer-rows dspark_shm_before --ranks 2 --transport shm --sizes 8,64 2>/dev/null)
  f1=$(fl)
  echo "$i $f0 $(echo "$o"|ns 8) $(echo "$d"|ns 8) $(echo "$b"|ns 8) $(echo "$o"|ns 64) $(echo "$d"|ns 64) $(echo "$b"|ns 64) $f1"
done
