#!/bin/bash
# usage: pairs2.sh ROUNDS label=bin ... : per round, the floor (pingpong, exchange) then each binary (8 B and 64 B)
R=$1; shift
F=$(ls -t /work/main/target/release/deps/cacheline_floor-* | grep -v '\.d$' | head -1)
for i in $(seq 1 $R); do
  f=$($F 11 2000 pingpong exchange 2>&1 | awk -F, '$1=="pingpong"||$1=="exchange"{printf "%s %s ", $1, $2}')
  row="$f"
  for spec in "$@"; do label=${spec%%=*}; bin=${spec#*=}
    out=$($bin --ranks 2 --transport shm -b 8 -e 64 -f 8 -n 300000 --csv 2>&1 | awk -F, '$5==8||$5==64 {printf "%s ", $7}')
    row="$row | $label $out"
  done
  echo "$row"
done
