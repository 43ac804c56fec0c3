#!/usr/bin/env python3
"""link_bed_summary.py ROWS.csv HOSTS PER_HOST - the link bed's table: median over passes of each
contender's time per call and its fraction of the floor S*8/rate (benches/link_bed.sh)."""
import collections, glob, os, re, statistics, sys
# dspark's forced algorithms, as DSPARK_ALGO names them (contenders of those names).
ALGOS = {"ring", "tree", "recursive_doubling", "rabenseifner", "hier", "binomial_tree", "one_shot"}
rows = [l.strip().split(",") for l in open(sys.argv[1]) if l.strip()]
def bits(rate):
    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.lower())
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
t = collections.defaultdict(list)
order, sizes, rates = [], [], []
for r in rows:
    if len(r) < 7 or r[6] in ("NaN", "") or (len(r) > 11 and r[11]):
        continue
    rate, who, size, us = r[0], r[1], int(r[3]), float(r[6])
    t[(rate, who, size)].append(us)
    for lst, v in ((order, who), (sizes, size), (rates, rate)):
        if v not in lst:
            lst.append(v)
print(f"# {sys.argv[2]} hosts x {sys.argv[3]} ranks; cell: median us per call (fraction of the floor S*8/rate)")
for rate in rates:
    print(f"\n## {rate}")
    print("| contender | " + " | ".join(f"{s} B" for s in sorted(sizes)) + " |")
    print("| --- |" + " ---: |" * len(sizes))
    floor = {s: s * 8 / bits(rate) * 1e6 for s in sizes}
    print("| floor | " + " | ".join(f"{floor[s]:.0f}" for s in sorted(sizes)) + " |")
    for who in order:
        cells = []
        for s in sorted(sizes):
            v = t.get((rate, who, s))
            if not v:
                cells.append("-")
                continue
            m = statistics.median(v)
            cells.append(f"{m:.0f} ({floor[s] / m:.2f})")
        print(f"| {who} | " + " | ".join(cells) + " |")
    # What the default ran at each size (`# algorithm` on rank 0's stderr, dspark-bench
    # --peer-rows) against the forced algorithms' own rows: the choice's forced time over the
    # best forced time. Two fresh jobs of one algorithm on this bed differ by up to ~1.7x at
    # the small sizes (4 ranks sharing 2 cores), more than the choice's 10% allows, so the
    # default's own row can miss what its choice does not.
    d = os.path.dirname(os.path.abspath(sys.argv[1]))
    ran = collections.defaultdict(set)
    for f in glob.glob(os.path.join(d, f"{glob.escape(rate)}-default-pass*.rank0.err")):
        for l in open(f, errors="replace"):
            if l.startswith("# algorithm :"):
                for kv in l.split(":", 1)[1].split():
                    size, _, algo = kv.partition("=")
                    ran[int(size)].add(algo)
    forced = [w for w in order if w in ALGOS]
    if ran and forced:
        cells, ratio = [], []
        for s in sorted(sizes):
            algos = ran.get(s, set())
            cells.append("/".join(sorted(algos)) or "-")
            best = min(((statistics.median(t[(rate, w, s)]), w) for w in forced
                        if t.get((rate, w, s))), default=None)
            mine = [statistics.median(t[(rate, a, s)]) for a in algos if t.get((rate, a, s))]
            if best and len(mine) == len(algos) == 1:
                ratio.append(f"{mine[0] / best[0]:.2f} ({best[1]})")
            else:
                ratio.append("-")
        print("| default runs | " + " | ".join(cells) + " |")
        print("| its forced row ÷ the best forced | " + " | ".join(ratio) + " |")
