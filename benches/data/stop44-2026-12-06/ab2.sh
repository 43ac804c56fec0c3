#!/bin/bash
for i in $(seq 1 10); do
  for v in base new; do
    a=$(/tmp/bench-$v all_to_all_v --ranks 2 -b 64 -e 64 --csv 2>/dev/null | awk -F, 'NR==2{print $7}')
    echo "$i $v a2av_shm_64B=$a"
  done
done
