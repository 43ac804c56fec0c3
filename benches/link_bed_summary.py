#!/usr/bin/env python3
"""link_bed_summary.py ROWS.csv HOSTS PER_HOST - the link bed's table: median over passes of each
contender's time per call and its fraction of the floor S*8/rate (benches/link_bed.sh)."""
import collections, re, statistics, sys
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
