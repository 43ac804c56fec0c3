#!/usr/bin/env python3
"""model_matrix_summary.py MATRIX.csv - medians of benches/model_matrix.sh's rows.

For each world and size: the median time of every algorithm over the repetitions (with the
smallest and largest), the fastest, the algorithm the model chose (the build that measured)
and how much slower the choice was than the fastest. `hier` on one host is the ring's
schedule (no host layout) and is left out of "fastest". Prints CSV then a readable table.
"""
import csv
import statistics
import sys
from collections import defaultdict

ALGOS = ["recursive_doubling", "tree", "ring", "rabenseifner"]
SHORT = {"recursive_doubling": "rd", "tree": "tree", "ring": "ring", "rabenseifner": "rab", "hier": "hier"}


def main():
    t = defaultdict(list)
    chosen = defaultdict(set)
    for r in csv.DictReader(open(sys.argv[1])):
        k = (int(r["world"]), int(r["bytes"]))
        t[k + (r["algo"],)].append(float(r["time_us"]))
        chosen[k].add(r["default"])
    keys = sorted(chosen)
    print("world,bytes," + ",".join(f"{a}_med_us,{a}_min_us,{a}_max_us" for a in ALGOS)
          + ",runs,fastest,chosen,chosen_over_fastest")
    table = []
    for k in keys:
        med = {}
        cells = []
        for a in ALGOS:
            v = t.get(k + (a,), [])
            if v:
                med[a] = statistics.median(v)
                cells += [f"{med[a]:.1f}", f"{min(v):.1f}", f"{max(v):.1f}"]
            else:
                cells += ["", "", ""]
        fastest = min(med, key=med.get)
        ch = "/".join(sorted(chosen[k]))
        ratio = med.get(ch, float("nan")) / med[fastest]
        runs = len(t.get(k + ("ring",), []))
        print(f"{k[0]},{k[1]}," + ",".join(cells) + f",{runs},{fastest},{ch},{ratio:.2f}")
        table.append((k, med, fastest, ch, ratio))
    print()
    print(f"{'n':>3} {'bytes':>9} " + " ".join(f"{SHORT[a]:>9}" for a in ALGOS)
          + f" {'fastest':>7} {'chosen':>7} {'ch/best':>7}")
    for k, med, fastest, ch, ratio in table:
        print(f"{k[0]:>3} {k[1]:>9} " + " ".join(f"{med.get(a, float('nan')):>9.1f}" for a in ALGOS)
              + f" {SHORT[fastest]:>7} {SHORT.get(ch, ch):>7} {ratio:>7.2f}")


main()
