import json,sys
pre=sys.argv[1]
R={}
for r in range(4):
    t=open(f"{pre}.rank{r}.json").read().rstrip().rstrip(',')
    if not t.endswith(']'): t+=']'
    R[r]=[e for e in json.loads(t) if e.get('ph')=='X']
c0=[e for e in R[0] if e['cat']=='call' and e['args'].get('bytes')==1048576][-60:]
c0s=sorted(c0,key=lambda c:c['dur'])
for c in [c0s[0], c0s[-1]]:
    s=c['ts']; print('CALL dur',c['dur'], c['name'])
    for r in range(4):
        ev=[x for x in R[r] if x['ts']>=s-300 and x['ts']<s+c['dur'] and x['cat']!='call']
        print(' r%d'%r, ' '.join(f"{x['cat'][:4]}{x['args'].get('bytes',0)//1024}k@{x['ts']-s:.0f}+{x['dur']:.0f}" for x in sorted(ev,key=lambda x:x['ts'])))
