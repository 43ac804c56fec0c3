#!/usr/bin/env python3
"""The current build's allreduce choices (`dspark model`, ranks sharing CORES cores) against
measured matrices (benches/model_matrix.sh CSVs): per cell the measured fastest algorithm,
the model's choice and how far behind the fastest it measured; the count of cells more than
10% behind. For refitting src/plan/model.rs without re-measuring:

    cargo build --release --bin dspark
    python3 benches/model_matrix_eval.py benches/data/model-matrix-2026-12-02d.csv
"""
import os
import csv,statistics,collections,subprocess,sys
DSPARK=os.environ.get('DSPARK', os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'target', 'release', 'dspark'))
CORES=os.environ.get('CORES','2')
d=collections.defaultdict(list)
for f in sys.argv[1:]:
    for r in csv.DictReader(open(f)):
        d[(int(r['world']),int(r['bytes']),r['algo'])].append(float(r['time_us']))
names={'ring':'ring','tree':'tree','recursive_doubling':'recursive_doubling','rabenseifner':'rabenseifner'}
def sz(b):
    return f"{b>>20}M" if b>=1<<20 else f"{b>>10}K"
bad=0; tot=0
for n in range(3,9):
    out=subprocess.run([DSPARK,'model','--ranks',str(n),'--local-ranks',str(n),'--cores',CORES,'-b','4K','-e','16M','-f','2'],capture_output=True,text=True).stdout
    ch={}
    for line in out.splitlines():
        f=line.split()
        if len(f)>=2 and f[0][0].isdigit() and f[0][-1] in 'KMG':
            ch[f[0]]=f[-1]
    for b in [4096,32768,262144,1048576,4194304,16777216]:
        med={a:statistics.median(d[(n,b,a)]) for a in names if (n,b,a) in d}
        best=min(med,key=med.get); c=ch.get(sz(b))
        r=med.get(c,float('nan'))/med[best]; tot+=1
        flag='  <==' if r>1.10 else ''
        if r>1.10: bad+=1
        print(n,sz(b),'fastest',best,'chosen',c,'%.2f'%r,flag)
print('cells >10% behind:',bad,'of',tot)
