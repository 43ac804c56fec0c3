#!/usr/bin/env bash
# link_bed.sh - allreduce between "hosts" that are network namespaces joined by a shaped link,
# against the floor S / link rate (each host must send S bytes across for an allreduce of S).
#
#   sudo bash benches/link_bed.sh                              # 2 hosts x 2 ranks, 1 and 4 Gbit/s
#   RATES="1gbit 4gbit 10gbit" SIZES=16777216,67108864 bash benches/link_bed.sh
#   HOSTS=2 PER_HOST=2 ALGOS="default hier ring tree rabenseifner" PEERS="gloo ompi" bash benches/link_bed.sh
#   ALGOS=default PEERS=ompi OMPI_ARGS="--bind-to core" bash benches/link_bed.sh   # Open MPI, own args
#   RUNS=3 bash benches/link_bed.sh                            # passes, peers' order alternated
#   BENCH_BEFORE=/tmp/old-dspark-bench ALGOS="default default@before hier hier@before" bash benches/link_bed.sh
#   ALGOS="default default~DSPARK_SPIN_US=5 ring~DSPARK_SPIN_US=5,DSPARK_SEGMENT_BYTES=262144" bash benches/link_bed.sh
#       # NAME~K=V[,K=V]: the same contender with environment knobs, interleaved with the rest
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
# Open MPI (PEERS=ompi; ../shared/peers/mpi_allreduce.c as ../shared/peers/run_all.sh builds
# it into /tmp/dspark-peers/build, or MPI_BENCH=...): mpirun runs in host 0's namespace under
# its own UTS namespace named h0, `-H h0:PER_HOST,h1:PER_HOST,...`, and starts one orted per
# other host through an rsh agent written to $OUT/ompi_agent.sh (`--mca plm_rsh_agent`: enters
# namespace h<n> and `unshare --uts` + `hostname h<n>`, so each host has its own name and
# vader joins only the ranks of one host); out-of-band and the TCP BTL on eth0
# (`--mca btl tcp,vader,self`). OMPI_ARGS (default `--bind-to none --mca mpi_yield_when_idle
# 1`: every "host" is the same cores, so the ranks are really oversubscribed; bound and
# busy-polling, a 1 KiB all_reduce took 6.5 ms instead of 25 us) replaces those extra
# arguments; MPI_SAMPLES (10) samples per size.
#
# Needs root (namespaces, tc). Names start with a per-run prefix (dslb<pid>), and everything
# made is removed on exit, on error and on ^C, so other namespaces on the machine are left alone.
# The bed itself (namespaces, links, shaping, cleanup, the per-rank launcher) is
# benches/bed_lib.sh, shared with benches/ddp_bed.sh (DDP training on the same bed).
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
BED_NAME=link_bed
# shellcheck source=benches/bed_lib.sh
. "$ROOT/benches/bed_lib.sh"    # namespaces, links, tbf, cleanup, run_ranks
log() { bed_log "$@"; }

bed_init
[ -x "$BENCH" ] || { log "building dspark-bench"; (cd "$ROOT" && cargo build --release --quiet --bin dspark-bench); }

# Open MPI on the bed: mpirun runs in host 0's namespace under its own UTS namespace with
# host name h0, and starts one orted per other host through an rsh agent ($OUT/ompi_agent.sh)
# that enters that host's namespace (and names it h<host>): `-H h0:PER_HOST,h1:PER_HOST,...`,
# out-of-band and TCP BTL on eth0, vader between the ranks of one host.
MPI_BENCH=${MPI_BENCH:-${PEERS_WORK:-${TMPDIR:-/tmp}/dspark-peers}/build/mpi_allreduce_ompi}
run_ompi() { # label mpirun
    local label=$1 mpirun=$2 hosts=() h
    for h in $(seq 0 $((HOSTS - 1))); do hosts+=("h$h:$PER_HOST"); done
    cat > "$OUT/ompi_agent.sh" <<AGENT
#!/bin/sh
# Open MPI's rsh agent on the bed: \$1 = host name h<n>, the rest = the command (one string).
host=\$1; shift
exec ip netns exec "$P-\$host" unshare --uts sh -c "hostname \$host; \$*"
AGENT
    chmod +x "$OUT/ompi_agent.sh"
    PIDS=()
    ip netns exec "$(ns 0)" unshare --uts sh -c 'hostname h0; exec "$@"' sh \
        env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout "$TIMEOUT" \
        "$mpirun" --allow-run-as-root -np "$WORLD" -H "$(IFS=,; echo "${hosts[*]}")" \
        --mca plm_rsh_agent "$OUT/ompi_agent.sh" --mca oob_tcp_if_include eth0 \
        --mca pml ob1 --mca btl tcp,vader,self --mca btl_tcp_if_include eth0 \
        ${OMPI_ARGS---bind-to none --mca mpi_yield_when_idle 1} "$MPI_BENCH" --peer ompi --samples "${MPI_SAMPLES:-10}" --sizes "$SIZES" > "$OUT/$label.rank0.out" 2> "$OUT/$label.rank0.err" &
    PIDS+=($!)
    local rc=0
    wait "${PIDS[0]}" || rc=$?
    PIDS=()
    return $rc
}

contender() { # rate name -> appends rows
    local rate=$1 who=$2 label="$1-$2-pass$pass"
    log "$rate $who (load $(cut -d' ' -f1-3 /proc/loadavg))"
    echo "$rate $who $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.log"
    local ok=0 bench=$BENCH algo=${who%%[@~]*} knobs=()
    # NAME@before: the same contender with $BENCH_BEFORE (before/after, interleaved in one run).
    if [[ $who == *@* ]]; then bench=${BENCH_BEFORE:?"$who needs BENCH_BEFORE"}; fi
    # NAME~K=V,K=V: the same contender with these in every rank's environment.
    if [[ $who == *~* ]]; then IFS=, read -ra knobs <<< "${who#*~}"; fi
    case $algo in
    default) run_ranks "$label" env "${knobs[@]}" "$bench" --peer-rows "$who" --sizes "$SIZES" && ok=1 ;;
    gloo)
        if [ -z "$PY" ]; then log "  gloo: no python with torch (set DSPARK_TORCH_VENV or PY)"; return; fi
        run_ranks "$label" "$PY" "$ROOT/benches/link_bed_gloo.py" --peer gloo --sizes "$SIZES" && ok=1 ;;
    ompi)
        local mpirun; mpirun=$(command -v mpirun.openmpi || command -v mpirun || true)
        if [ -z "$mpirun" ] || [ ! -x "$MPI_BENCH" ]; then
            log "  ompi: needs mpirun and $MPI_BENCH (../shared/peers/run_all.sh builds it; or set MPI_BENCH)"
            return
        fi
        run_ompi "$label" "$mpirun" && ok=1 ;;
    *) run_ranks "$label" env "${knobs[@]}" DSPARK_ALGO="$algo" "$bench" --peer-rows "$who" --sizes "$SIZES" && ok=1 ;;
    esac
    if (( ok )); then
        sed "s/^/$rate,/" "$OUT/$label.rank0.out" | grep -v '^$' >> "$OUT/rows.csv" || true
    else
        log "  FAILED: $who at $rate (see $OUT/$label.rank*.err)"
        tail -n 3 "$OUT/$label".rank*.err >&2 || true
    fi
}

log "bed: $HOSTS hosts x $PER_HOST ranks, prefix $P, subnet $SUB.0/24, out $OUT"
bed_setup
: > "$OUT/rows.csv"
{ uname -a; nproc; uptime; git -C "$ROOT" rev-parse --short HEAD; } > "$OUT/machine.txt" 2>&1 || true
for rate in $RATES; do
    bed_rate "$rate"
    for pass in $(seq 1 "$RUNS"); do
        order="$ALGOS $PEERS"
        (( pass % 2 == 0 )) && order=$(echo "$order" | tr ' ' '\n' | tac | tr '\n' ' ')
        for who in $order; do contender "$rate" "$who"; done
    done
done

# Summary: median over passes of each contender's time, and floor / time.
python3 "$ROOT/benches/link_bed_summary.py" "$OUT/rows.csv" "$HOSTS" "$PER_HOST"
log "rows: $OUT/rows.csv"
