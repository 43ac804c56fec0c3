#!/bin/bash
# Interleaved A/B of the sole-algorithm change: old (59c0e0d) and new (77c1087) dspark-bench,
# shm 2 ranks, 64 B, all_to_all / all_gather / all_reduce / broadcast, median µs per call.
OLD=/tmp/s43/bench-59c0e0d; NEW=$1
for round in 1 2 3 4 5; do
  for b in old new; do
    bin=$OLD; [ $b = new ] && bin=$NEW
    for c in all_to_all all_gather barrier_none all_reduce broadcast; do
      [ $c = barrier_none ] && continue
      t=$($bin --ranks 2 --transport shm -b 64 -e 64 --csv $c 2>/dev/null | grep -v '^#' | tail -1)
      echo "$round $b $c $t"
    done
  done
done
