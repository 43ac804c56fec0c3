#!/usr/bin/env bash
# fresh_runs.sh BIN OUT - issue 25's fresh-run check: N (12) fresh `BIN --ranks 2` runs each of
# {shm, tcp} x {8 B, 64 KiB}, every run alone on the machine (under an exclusive lock on
# $LOCK, default /work/measure.lock, which builds take shared), the table's time (µs) per run
# into OUT/rows with the 1-minute load, then per cell: n, median, min, max, slowest / median.
#
# With FLOOR set to the cache-line floor's binary (`cargo bench --bench cacheline_floor
# --no-run` prints it), three library-free floors run fresh right before and right after every
# dspark run, in the same hold of the lock: the ping-pong round trip of one cache line between
# two forked processes pinned to CPUs 0 and 1, a one-shot 64 KiB f32 all_reduce between them,
# and an 8-byte exchange between them over one loopback TCP connection (`tcp8`: each sends 8
# bytes, then spins on recv for the other's). The TCP floor moves by itself: on 2026-12-06 it
# exchanged in 3.1-3.5 µs or in 4.5-4.8 µs, and dspark's TCP 8 B runs were 3.7-4.3 or
# 5.4-6.4 µs beside it. The slow mode is the machine's for seconds at a time: it spans fresh
# process pairs and starts or ends in the middle of one connection, whatever the receive does
# (spinning on recv or poll, blocking, ping-pong instead of exchange). On a VM the host decides where the two vCPUs run and moves them: on one 2-vCPU machine
# the round trip was 0.045 µs (cores sharing a cache) or 0.35 µs (cores apart) from one minute
# to the next, and dspark's times moved with it (shm 64 KiB 2.0 vs 4.5 µs, TCP 64 KiB 13 vs
# 19 µs). The summary then adds, per cell:
# * the runs grouped by placement: near (the round trip before and after under 0.2 µs), far
#   (both 0.2 µs or more), moved (one each): per group n, median, slowest / median — dspark's
#   steadiness within one placement;
# * dspark's time over the reference of its size (shm 8 B: the round trip, TCP 8 B: the TCP
#   exchange, 64 KiB: the one-shot; the mean of before and after): what is left when the machine's state of the moment is
#   divided out. (dspark beats the naive one-shot at 64 KiB: a reference, not a floor.)
# Each row also keeps the bench header's own `# distance` (rank 0's CPU to rank 1's, measured
# by the bench's parent just before its ranks start).
#
#   N=12 FLOOR=target/release/deps/cacheline_floor-... bash benches/fresh_runs.sh \
#       target/release/dspark-bench /tmp/fresh-A
set -euo pipefail
BIN=$1; OUT=$2; N=${N:-12}; LOCK=${LOCK:-/work/measure.lock}; FLOOR=${FLOOR:-}
mkdir -p "$OUT"; : > "$OUT/rows"
floor() { # "pingpong_µs oneshot64k_µs tcp8_µs" of one fresh run of the floor, or "nan nan nan"
  [ -n "$FLOOR" ] || { echo nan nan nan; return; }
  local p o t
  p=$(timeout 120 "$FLOOR" 31 2000 pin pingpong 2>/dev/null | awk -F, '$1=="pingpong"{print $2}') || p=
  o=$(timeout 120 "$FLOOR" 15 200 pin oneshot64k 2>/dev/null | awk -F, '$1=="oneshot64k"{print $2}') || o=
  t=$(timeout 120 "$FLOOR" 15 300 pin tcp8 2>/dev/null | awk -F, '$1=="tcp8"{print $2}') || t=
  echo "${p:-nan} ${o:-nan} ${t:-nan}"
}
one() { # transport size: "time floor_before(3) floor_after(3) distance" in one hold of the lock
  local b o v d a
  b=$(floor)
  # `--csv`: its time_us has 4 decimals. (The table's time has 2, a tenth of an 8-byte call,
  # and the time from its algbw's 3 decimals of GB/s moved in steps of 3.5-7% at 8 B: one
  # step more on one run of 12 read as a slowest / median of up to 1.07 that was not there.)
  o=$(timeout 300 "$BIN" --ranks 2 --transport "$1" -b "$2" -e "$2" --csv 2>&1) || o=
  v=$(awk -F, '$1 !~ /^#/ && $7 ~ /^[0-9.]+$/ {print $7; exit}' <<<"$o")
  # The bench's own note (stderr under --csv): rank 0's CPU to rank 1's, measured by its
  # parent just before.
  d=$(awk '/^# distance/{for(i=1;i<=NF;i++) if($i=="µs"){print $(i-1); exit}}' <<<"$o")
  a=$(floor)
  echo "${v:-nan} $b $a ${d:-nan}"
}
export -f floor one; export BIN FLOOR
for i in $(seq 1 "$N"); do
 for t in shm tcp; do
  for s in 8 64K; do
    r=$(flock -x -o "$LOCK" bash -c "one $t $s")
    echo "$t $s $r $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/rows"
  done
 done
done
python3 - "$OUT/rows" <<'PY'
import sys, statistics, collections, math
d = collections.defaultdict(list); loads = []
for l in open(sys.argv[1]):
    f = l.split()
    if len(f) == 8:  # rows of the version before the distance column
        f.insert(7, "nan")
    if len(f) == 9:  # rows of the version before the TCP floor
        f[5:5] = ["nan"]; f[8:8] = ["nan"]
    t, s, v, pb, ob, tb, pa, oa, ta, dist, ld = f; loads.append(float(ld))
    if v == "nan":
        print(f"{t} {s}: a run failed (no time)"); continue
    d[(t, s)].append(tuple(map(float, (v, pb, pa, ob, oa, tb, ta))))
def line(name, v):
    m = statistics.median(v)
    return f"{name} {len(v)} {m:.3f} {min(v):.3f} {max(v):.3f} {max(v)/m:.2f}"
print("transport size n median min max slowest/median")
for k in sorted(d):
    print(line(" ".join(k), [x[0] for x in d[k]]))
ok = lambda *f: not any(math.isnan(x) for x in f)
for i, name in ((1, "ping-pong round trip"), (3, "one-shot 64 KiB"), (5, "TCP 8 B exchange")):
    f = [x[j] for k in d for x in d[k] for j in (i, i + 1) if ok(x[j])]
    if f:
        m = statistics.median(f)
        print(f"floor {name}, before and after every run: n {len(f)} median {m:.3f} "
              f"min {min(f):.3f} max {max(f):.3f} µs, slowest/median {max(f)/m:.2f}")
if any(ok(x[1], x[2]) for k in d for x in d[k]):
    # Near or far by the round trip before and after (FAR_US of src/bin/bench/distance.rs):
    # both under 0.2 µs near, both at or over it far, else the vCPUs moved during the run.
    FAR = 0.2
    place = lambda b, a: "near" if max(b, a) < FAR else ("far" if min(b, a) >= FAR else "moved")
    print("by placement (ping-pong round trip before and after, far from 0.2 µs): "
          "transport size | placement | n median min max slowest/median")
    for k in sorted(d):
        for p in ("near", "far", "moved"):
            v = [x[0] for x in d[k] if ok(x[1], x[2]) and place(x[1], x[2]) == p]
            if v:
                print(line(f"{' '.join(k)} | {p} |", v))
    print("dspark / the reference of its size (shm 8 B: ping-pong, TCP 8 B: the TCP exchange, 64K: "
          "one-shot 64 KiB; mean of before and after): transport size n median min max slowest/median")
    for k in sorted(d):
        i = 3 if k[1] != "8" else (5 if k[0] == "tcp" else 1)
        r = [x[0] / ((x[i] + x[i + 1]) / 2) for x in d[k] if ok(x[i], x[i + 1])]
        if r:
            print(line(" ".join(k), r))
print(f"load(1m) {min(loads)}..{max(loads)}")
PY
