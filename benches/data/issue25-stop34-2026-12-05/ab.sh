#!/bin/bash
# usage: ab.sh N label=cmd... ; prints median/min µs at 8 and 64 B per label (cmd must print --csv)
N=$1; shift
declare -A res
for i in $(seq 1 $N); do
  for spec in "$@"; do
    label=${spec%%=*}; cmd=${spec#*=}
    out=$($cmd --ranks 2 --transport shm -b 8 -e 64 -f 8 -n 300000 --csv 2>&1 | awk -F, '$5==8||$5==64 {printf "%s:%s ", $5, $7}')
    res[$label]+="$out"$'\n'
  done
done
for spec in "$@"; do label=${spec%%=*}
  echo "$label $(echo "${res[$label]}" | tr ' ' '\n' | gawk -F: 'NF==2{a[$1]=a[$1]" "$2} END{for(k in a){n=split(a[k],v," ");asort(v);printf "%sB med %.4f min %.4f max %.4f  ",k,v[int((n+1)/2)],v[1],v[n]}}')"
done
