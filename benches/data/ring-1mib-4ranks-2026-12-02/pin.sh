#!/usr/bin/env bash
# usage: pin.sh "cpu0 cpu1 cpu2 cpu3"|free sizes  -> prints rank 0's peer rows
B=/work/wt-model-refit/target/release/dspark-bench
cpus=$1; sizes=$2; n=${N:-4}
port=$((20000 + RANDOM % 20000))
pids=()
for r in $(seq 0 $((n-1))); do
  if [ "$cpus" = free ]; then pre=(); else c=$(echo $cpus | cut -d' ' -f$((r+1))); pre=(taskset -c $c); fi
  if [ $r = 0 ]; then out=/dev/stdout; else out=/dev/null; fi
  env DSPARK_RANK=$r DSPARK_WORLD_SIZE=$n DSPARK_ROOT_ADDR=127.0.0.1:$port DSPARK_TRANSPORT=tcp \
    "${pre[@]}" $B --peer-rows x --sizes $sizes > $out 2>>/tmp/mr/err.log &
  pids+=($!)
done
for p in "${pids[@]}"; do wait $p; done
