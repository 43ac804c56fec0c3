#!/usr/bin/env bash
# link_bed.sh - allreduce between "hosts" that are network namespaces joined by a shaped link,
# against the floor S / link rate (each host must send S bytes across for an allreduce of S).
#
#   sudo bash benches/link_bed.sh                              # 2 hosts x 2 ranks, 1 and 4 Gbit/s
#   RATES="1gbit 4gbit 10gbit" SIZES=16777216,67108864 bash benches/link_bed.sh
#   HOSTS=2 PER_HOST=2 ALGOS="default hier ring tree rabenseifner" PEERS="gloo ompi" bash benches/link_bed.sh
#   RUNS=3 bash benches/link_bed.sh                            # passes, peers' order alternated
#   BENCH_BEFORE=/tmp/old-dspark-bench ALGOS="default default@before hier hier@before" bash benches/link_bed.sh
#
# Every host is a network namespace; its ranks get DSPARK_HOST_ID=<host> (so ranks of one host
# use shared memory, /dev/shm being common to all namespaces) and reach the other hosts only
# through the link: one veth pair for 2 hosts, else one veth per host into a bridge in a
# "switch" namespace. Each end of every link is shaped with `tc qdisc ... tbf rate RATE` (this
# kernel has tbf, not netem), so a host sends at most RATE and receives at most RATE.
#
# Printed, per rate and size: each contender's median time per call (dspark-bench --peer-rows:
# median of samples of K back-to-back calls, max over ranks, f32 sum, checked) and its fraction
# of the floor (floor / time: 1.00 = line rate). Contenders: `default` (dspark, everything left
# to it), each forced algorithm in ALGOS (DSPARK_ALGO), gloo (torch.distributed, all TCP:
# GLOO_SOCKET_IFNAME, ranks of one host meet over that namespace's own address) and Open MPI
# where PEERS asks for them. Raw rows go to $OUT/rows.csv (rate,contender,ranks,bytes,...).
#
# Needs root (namespaces, tc). Names start with a per-run prefix (dslb<pid>), and everything
# made is removed on exit, on error and on ^C, so other namespaces on the machine are left alone.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOSTS=${HOSTS:-2}
PER_HOST=${PER_HOST:-2}
RATES=${RATES:-1gbit 4gbit}
SIZES=${SIZES:-1024,65536,1048576,16777216,67108864}
ALGOS=${ALGOS:-default hier ring}
PEERS=${PEERS:-}
RUNS=${RUNS:-1}
TIMEOUT=${TIMEOUT:-900}
BENCH=${BENCH:-${CARGO_TARGET_DIR:-$ROOT/target}/release/dspark-bench}
PY=${PY:-${DSPARK_TORCH_VENV:+$DSPARK_TORCH_VENV/bin/python}}
OUT=${OUT:-${TMPDIR:-/tmp}/dspark-link-bed/$(date +%Y%m%d-%H%M%S)}
P=dslb$$                       # name prefix: namespaces, links, host ids
SUB=10.$((200 + $$ % 50)).$(($$ / 50 % 250))   # the bed's /24 (inside the namespaces only)
WORLD=$((HOSTS * PER_HOST))
log() { echo "[link_bed $(date +%T)] $*" >&2; }

[ "$(id -u)" = 0 ] || { echo "link_bed: needs root (network namespaces, tc)" >&2; exit 2; }
(( HOSTS >= 2 && PER_HOST >= 1 )) || { echo "link_bed: HOSTS >= 2, PER_HOST >= 1" >&2; exit 2; }
[ -x "$BENCH" ] || { log "building dspark-bench"; (cd "$ROOT" && cargo build --release --quiet --bin dspark-bench); }
mkdir -p "$OUT"

ns() { echo "$P-h$1"; }
PIDS=()
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for h in $(seq 0 $((HOSTS - 1))); do ip netns del "$(ns "$h")" 2>/dev/null || true; done
    ip netns del "$P-sw" 2>/dev/null || true
    # veths die with their namespace; nothing was made in the root namespace.
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# tbf on one device: burst of 2 ms at the rate (at least 256 KiB: veth hands tbf 64 KiB GSO
# packets), queue of 20 ms.
shape() { # namespace device rate
    local bits; bits=$(rate_bits "$3")
    local burst=$(( bits / 8 / 500 )); (( burst < 262144 )) && burst=262144
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$3" burst "$burst" latency 20ms
}
rate_bits() { # 1gbit, 400mbit, 2.5gbit -> bits/s
    python3 -c "import re,sys; m=re.fullmatch(r'([0-9.]+)([kmg]?)bit','$1'.lower()); \
print(int(float(m[1])*{'':1,'k':1e3,'m':1e6,'g':1e9}[m[2]]))"
}

setup() {
    for h in $(seq 0 $((HOSTS - 1))); do
        ip netns add "$(ns "$h")"
        ip netns exec "$(ns "$h")" ip link set lo up
    done
    if (( HOSTS == 2 )); then
        ip link add "${P}a" netns "$(ns 0)" type veth peer name "${P}b" netns "$(ns 1)"
        for h in 0 1; do
            local dev; dev=${P}$([ "$h" = 0 ] && echo a || echo b)
            ip netns exec "$(ns "$h")" ip link set "$dev" name eth0
            ip netns exec "$(ns "$h")" ip addr add "$SUB.$((h + 1))/24" dev eth0
            ip netns exec "$(ns "$h")" ip link set eth0 up
        done
    else
        ip netns add "$P-sw"
        ip netns exec "$P-sw" ip link add br0 type bridge
        ip netns exec "$P-sw" ip link set br0 up
        for h in $(seq 0 $((HOSTS - 1))); do
            ip link add "${P}s$h" netns "$P-sw" type veth peer name "${P}h$h" netns "$(ns "$h")"
            ip netns exec "$P-sw" ip link set "${P}s$h" master br0 up
            ip netns exec "$(ns "$h")" ip link set "${P}h$h" name eth0
            ip netns exec "$(ns "$h")" ip addr add "$SUB.$((h + 1))/24" dev eth0
            ip netns exec "$(ns "$h")" ip link set eth0 up
        done
    fi
}

set_rate() {
    for h in $(seq 0 $((HOSTS - 1))); do
        shape "$(ns "$h")" eth0 "$1"
        (( HOSTS > 2 )) && shape "$P-sw" "${P}s$h" "$1"
    done
    return 0
}

# Runs WORLD ranks of a command, rank r in host r / PER_HOST; rank 0's stdout is the result.
# $1: label; the command follows, with the rank's environment exported.
PORT=$((20000 + $$ % 20000))
run_ranks() {
    local label=$1; shift
    PORT=$((PORT + 1))
    PIDS=()
    for r in $(seq 0 $((WORLD - 1))); do
        local h=$((r / PER_HOST))
        ip netns exec "$(ns "$h")" env DSPARK_RANK="$r" DSPARK_WORLD_SIZE="$WORLD" \
            RANK="$r" WORLD_SIZE="$WORLD" LOCAL_RANK=$((r % PER_HOST)) \
            MASTER_ADDR="$SUB.1" MASTER_PORT="$PORT" DSPARK_ROOT_ADDR="$SUB.1:$PORT" \
            DSPARK_HOST_ID="$P-h$h" GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
            timeout "$TIMEOUT" "$@" > "$OUT/$label.rank$r.out" 2> "$OUT/$label.rank$r.err" &
        PIDS+=($!)
    done
    local rc=0
    for pid in "${PIDS[@]}"; do wait "$pid" || rc=$?; done
    PIDS=()
    return $rc
}

contender() { # rate name -> appends rows
    local rate=$1 who=$2 label="$1-$2-pass$pass"
    log "$rate $who (load $(cut -d' ' -f1-3 /proc/loadavg))"
    echo "$rate $who $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.log"
    local ok=0 bench=$BENCH algo=${who%%@*}
    # NAME@before: the same contender with $BENCH_BEFORE (before/after, interleaved in one run).
    if [[ $who == *@* ]]; then bench=${BENCH_BEFORE:?"$who needs BENCH_BEFORE"}; fi
    case $algo in
    default) run_ranks "$label" "$bench" --peer-rows "$who" --sizes "$SIZES" && ok=1 ;;
    gloo)
        if [ -z "$PY" ]; then log "  gloo: no python with torch (set DSPARK_TORCH_VENV or PY)"; return; fi
        run_ranks "$label" "$PY" "$ROOT/benches/link_bed_gloo.py" --peer gloo --sizes "$SIZES" && ok=1 ;;
    ompi)
        log "  ompi: not launched on the bed (see benches/RESULTS.md: mpirun needs a daemon per namespace)"
        return ;;
    *) run_ranks "$label" env DSPARK_ALGO="$algo" "$bench" --peer-rows "$who" --sizes "$SIZES" && ok=1 ;;
    esac
    if (( ok )); then
        sed "s/^/$rate,/" "$OUT/$label.rank0.out" | grep -v '^$' >> "$OUT/rows.csv" || true
    else
        log "  FAILED: $who at $rate (see $OUT/$label.rank*.err)"
        tail -n 3 "$OUT/$label".rank*.err >&2 || true
    fi
}

log "bed: $HOSTS hosts x $PER_HOST ranks, prefix $P, subnet $SUB.0/24, out $OUT"
setup
: > "$OUT/rows.csv"
{ uname -a; nproc; uptime; git -C "$ROOT" rev-parse --short HEAD; } > "$OUT/machine.txt" 2>&1 || true
for rate in $RATES; do
    set_rate "$rate"
    for pass in $(seq 1 "$RUNS"); do
        order="$ALGOS $PEERS"
        (( pass % 2 == 0 )) && order=$(echo "$order" | tr ' ' '\n' | tac | tr '\n' ' ')
        for who in $order; do contender "$rate" "$who"; done
    done
done

# Summary: median over passes of each contender's time, and floor / time.
python3 "$ROOT/benches/link_bed_summary.py" "$OUT/rows.csv" "$HOSTS" "$PER_HOST"
log "rows: $OUT/rows.csv"
