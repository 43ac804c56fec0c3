#!/bin/bash
# usage: pairs.sh ROUNDS label=bin ... : per round, floor then each binary (8 B and 64 B, 300k calls); prints a row per round
R=$1; shift
F=/work/main/target/release/deps/cacheline_floor-85c81cfb63f333ba
for i in $(seq 1 $R); do
  f=$($F 11 2000 exchange 2>&1 | awk -F, '$1=="exchange"{print $2}')
  row="floor $f"
  for spec in "$@"; do label=${spec%%=*}; bin=${spec#*=}
    out=$($bin --ranks 2 --transport shm -b 8 -e 64 -f 8 -n 300000 --csv 2>&1 | awk -F, '$5==8||$5==64 {printf "%s ", $7}')
    row="$row | $label $out"
  done
  echo "$row"
done
