# bed_lib.sh - the link bed's hosts, links and launcher, sourced by benches/link_bed.sh and
# benches/ddp_bed.sh (not run on its own).
#
# Every host is a network namespace ($P-h<host>) holding one interface, eth0, with address
# $SUB.<host+1>: one veth pair for 2 hosts, else one veth per host into a bridge in a
# "switch" namespace ($P-sw). Each end of every link is shaped with `tc qdisc ... tbf rate
# RATE` (this kernel has tbf, not netem), so a host sends at most RATE and receives at most
# RATE. Names start with a per-run prefix (dslb<pid>); everything made is removed on exit, on
# error and on ^C (bed_cleanup, installed by bed_init), so other namespaces are left alone.
#
# The caller sets HOSTS, PER_HOST, OUT and TIMEOUT, then calls bed_init, bed_setup, bed_rate
# RATE, and run_ranks LABEL CMD... as often as it likes. Optional: PIN_CORES="c0 c1 ..."
# pins rank r to core c[r mod count] (taskset), RANK_ENV="K=V ..." adds to every rank's
# environment, and NO_ROOT_ADDR=1 leaves DSPARK_ROOT_ADDR unset (torch rendezvous through
# its own store at MASTER_ADDR:MASTER_PORT, which dspark must not also bind).

P=dslb$$                       # name prefix: namespaces, links, host ids
SUB=10.$((200 + $$ % 50)).$(($$ / 50 % 250))   # the bed's /24 (inside the namespaces only)
PORT=$((20000 + $$ % 20000))
PIDS=()

bed_log() { echo "[${BED_NAME:-bed} $(date +%T)] $*" >&2; }
ns() { echo "$P-h$1"; }
bed_load() { cut -d' ' -f1-3 /proc/loadavg; }

bed_cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for h in $(seq 0 $((HOSTS - 1))); do ip netns del "$(ns "$h")" 2>/dev/null || true; done
    ip netns del "$P-sw" 2>/dev/null || true
    # veths die with their namespace; nothing was made in the root namespace.
    exit "$rc"
}

bed_init() { # checks, traps, output directory
    [ "$(id -u)" = 0 ] || { echo "${BED_NAME:-bed}: needs root (network namespaces, tc)" >&2; exit 2; }
    (( HOSTS >= 2 && PER_HOST >= 1 )) || { echo "${BED_NAME:-bed}: HOSTS >= 2, PER_HOST >= 1" >&2; exit 2; }
    WORLD=$((HOSTS * PER_HOST))
    mkdir -p "$OUT"
    trap bed_cleanup EXIT
    trap 'exit 130' INT TERM
}

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

bed_setup() {
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

bed_rate() { # rate: shapes every link end
    for h in $(seq 0 $((HOSTS - 1))); do
        shape "$(ns "$h")" eth0 "$1"
        (( HOSTS > 2 )) && shape "$P-sw" "${P}s$h" "$1"
    done
    return 0
}

# Runs WORLD ranks of a command, rank r in host r / PER_HOST; rank r's output goes to
# $OUT/LABEL.rank<r>.out/.err. $1: label; the command follows, with the rank's environment.
run_ranks() {
    local label=$1; shift
    PORT=$((PORT + 1))
    PIDS=()
    local cores=(${PIN_CORES:-})
    for r in $(seq 0 $((WORLD - 1))); do
        local h=$((r / PER_HOST)) pin=()
        (( ${#cores[@]} )) && pin=(taskset -c "${cores[$((r % ${#cores[@]}))]}")
        local root=(DSPARK_ROOT_ADDR="$SUB.1:$PORT")
        [ -n "${NO_ROOT_ADDR:-}" ] && root=()
        ip netns exec "$(ns "$h")" env DSPARK_RANK="$r" DSPARK_WORLD_SIZE="$WORLD" \
            RANK="$r" WORLD_SIZE="$WORLD" LOCAL_RANK=$((r % PER_HOST)) \
            LOCAL_WORLD_SIZE="$PER_HOST" GROUP_RANK="$h" \
            MASTER_ADDR="$SUB.1" MASTER_PORT="$PORT" "${root[@]}" \
            DSPARK_HOST_ID="$P-h$h" GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ${RANK_ENV:-} \
            "${pin[@]}" timeout "$TIMEOUT" "$@" > "$OUT/$label.rank$r.out" 2> "$OUT/$label.rank$r.err" &
        PIDS+=($!)
    done
    local rc=0
    for pid in "${PIDS[@]}"; do wait "$pid" || rc=$?; done
    PIDS=()
    return $rc
}
