#!/bin/bash
for i in $(seq 1 14); do
  a=$(/tmp/bins/final --ranks 2 --transport shm -b 64K -e 64K --csv 2>/dev/null | awk -F, '$5==65536{print $7}')
  b=$(DSPARK_SHM_MEMBARRIER=0 /tmp/bins/final --ranks 2 --transport shm -b 64K -e 64K --csv 2>/dev/null | awk -F, '$5==65536{print $7}')
  echo "$a $b"
done
