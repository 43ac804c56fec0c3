#!/usr/bin/env bash
# interleaved: before, after, ompi over shm; NP and SIZES from env
SIZES=${SIZES:-8,64,512,1024,2048,4096}
NPS=${NPS:-2 4}
RUNS=${RUNS:-3}
OUT=${OUT:-/tmp/cmp-small-$(date +%H%M%S)}
mkdir -p $OUT
for pass in $(seq 1 $RUNS); do
 for np in $NPS; do
  for m in ${MODES:-shm}; do for who in before after ompi; do
   case $who in
    before) /tmp/dspark-bench-before --peer-rows dspark_before_$m --ranks $np --transport $m --sizes $SIZES ;;
    after) /work/wt-shm/target/release/dspark-bench --peer-rows dspark_after_$m --ranks $np --transport $m --sizes $SIZES ;;
    ompi) bash /work/shared/peers/run_mpi.sh ompi $m $np $SIZES ;;
   esac > $OUT/p$pass-$who-$m-$np.csv 2>$OUT/p$pass-$who-$m-$np.err
   echo "$pass $who $m $np $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/load.log
  done; done
 done
done
python3 - $OUT <<'PY'
import csv,sys,glob,statistics,collections
d=collections.defaultdict(list)
for f in glob.glob(sys.argv[1]+"/p*.csv"):
    for r in csv.reader(open(f)):
        if not r or r[0].startswith('#') or r[0]=='peer': continue
        try: d[(r[0],int(r[1]),int(r[2]))].append(float(r[5]))
        except: pass
nps=sorted({k[1] for k in d}); sizes=sorted({k[2] for k in d})
for m in ("shm","tcp"):
  for np in nps:
    a_,b_,o_=f"dspark_after_{m}",f"dspark_before_{m}",f"ompi_{m}"
    if (a_,np,sizes[0]) not in d: continue
    print(f"{m} np={np}: bytes  before  after  ompi  after/ompi before/ompi after/before (passes)")
    for b in sizes:
        g=lambda p: statistics.median(d[(p,np,b)]) if (p,np,b) in d else float('nan')
        a,bf,o=g(a_),g(b_),g(o_)
        print(f"  {b:>9} {bf:10.2f} {a:10.2f} {o:10.2f}  {a/o:5.2f} {bf/o:5.2f} {a/bf:5.2f} ({len(d.get((a_,np,b),[]))})")
PY
echo "load:"; cat $OUT/load.log | awk '{print $5}' | sort -n | sed -n '1p;$p'
