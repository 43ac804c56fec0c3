#!/bin/bash
# A/B: 61aeb0b (base) against this stop's HEAD (new), alternating fresh runs, 2 ranks over shm.
for i in 1 2 3 4 5 6; do
  for v in base new; do
    a=$(/tmp/bench-$v all_to_all_v --ranks 2 -b 64 -e 64 --csv 2>/dev/null | awk -F, 'NR==2{print $7}')
    b=$(/tmp/bench-$v all_reduce --ranks 2 -b 8 -e 8 --csv 2>/dev/null | awk -F, 'NR==2{print $7}')
    c=$(/tmp/bench-$v all_to_all_v --ranks 2 --transport tcp -b 64K -e 64K --csv 2>/dev/null | awk -F, 'NR==2{print $7}')
    echo "$i $v a2av_shm_64B=$a allreduce_shm_8B=$b a2av_tcp_64KiB=$c"
  done
done
