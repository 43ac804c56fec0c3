#!/bin/bash
# usage: pads.sh label=bin ... : ASLR off, the stack moved by PAD in 16-byte steps; 8 B time per binary
F=$(ls -t /work/main/target/release/deps/cacheline_floor-* | grep -v '\.d$' | head -1)
echo "# floor: $($F 11 2000 exchange 2>&1 | awk -F, '$1=="exchange"{print $2}')"
for pad in $(seq 0 ${STEP:-16} 240); do
  row="pad $pad"
  P=$(head -c $pad /dev/zero | tr '\0' x)
  for spec in "$@"; do label=${spec%%=*}; bin=${spec#*=}
    t=$(PAD=$P setarch -R $bin --ranks 2 --transport shm -b 8 -e 64 -f 8 -n 300000 --csv 2>&1 | awk -F, '$5==8||$5==64 {printf "%s ", $7}')
    row="$row | $label $t"
  done
  echo "$row"
done
echo "# floor: $($F 11 2000 exchange 2>&1 | awk -F, '$1=="exchange"{print $2}')"
