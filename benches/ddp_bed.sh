#!/usr/bin/env bash
# ddp_bed.sh - DDP training (examples/torch_ddp.py) across "hosts" joined by a shaped link:
# the story the project exists for, dspark beside gloo in the same run.
#
#   sudo DSPARK_TORCH_VENV=~/.cache/dspark/torch-venv bash benches/ddp_bed.sh   # 2 hosts, 1 Gbit/s, 3 passes
#   RATE=4gbit RUNS=5 HIDDEN=1024 LAYERS=4 BATCH=1024 BUCKET_MB=4 bash benches/ddp_bed.sh
#   BACKENDS="dspark" RANK_ENV="DSPARK_SPIN_US=0" bash benches/ddp_bed.sh      # one backend, a knob
#
# The bed is benches/bed_lib.sh's (also link_bed.sh's): every host is a network namespace
# whose eth0 reaches the others only through a veth shaped with tbf to RATE. One rank per
# host (PER_HOST=1 by default), rank r pinned with taskset to core PIN_CORES[r] (default: rank
# r on core r mod nproc; on a 2-core machine that is all of it), torch with one thread per
# rank (--threads 1, OMP_NUM_THREADS=1). Rendezvous: env:// with MASTER_ADDR = host 0's bed
# address (torch's TCPStore; dspark rendezvous through that store), gloo over eth0
# (GLOO_SOCKET_IFNAME). BACKENDS run interleaved, RUNS passes, the order reversed every other
# pass.
#
# Each run prints (examples/torch_ddp.py): step time = compute (the same steps under
# no_sync()) + exposed communication, samples/s, the 1-rank throughput and step (rank 0 alone,
# same job), scaling efficiency = N-rank throughput / (N x 1-rank throughput), and the
# gradient's allreduce alone (PROBE plain dist.all_reduce calls of the gradient's size on the
# bed, median) beside the 1-rank step. The summary gives every pass and the median per
# backend. Results: $OUT/<pass>-<backend>.json, logs $OUT/*.rank<r>.{out,err}, loads
# $OUT/load.log.
#
# Needs root (namespaces, tc) and a python with torch and the dspark package (PY, else
# $DSPARK_TORCH_VENV/bin/python).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOSTS=${HOSTS:-2}
PER_HOST=${PER_HOST:-1}
RATE=${RATE:-1gbit}
RUNS=${RUNS:-3}
BACKENDS=${BACKENDS:-dspark gloo}
HIDDEN=${HIDDEN:-512}
LAYERS=${LAYERS:-8}
BATCH=${BATCH:-2560}
STEPS=${STEPS:-40}
WARMUP=${WARMUP:-8}
BUCKET_MB=${BUCKET_MB:-1}
PROBE=${PROBE:-5}
THREADS=${THREADS:-1}
TIMEOUT=${TIMEOUT:-300}
PY=${PY:-${DSPARK_TORCH_VENV:+$DSPARK_TORCH_VENV/bin/python}}
OUT=${OUT:-${TMPDIR:-/tmp}/dspark-ddp-bed/$(date +%Y%m%d-%H%M%S)}
if [ -z "${PIN_CORES+x}" ]; then
    PIN_CORES=$(seq -s' ' 0 $(( $(nproc) - 1 )))
fi
BED_NAME=ddp_bed
# shellcheck source=benches/bed_lib.sh
. "$ROOT/benches/bed_lib.sh"    # namespaces, links, tbf, cleanup, run_ranks
NO_ROOT_ADDR=1                  # torch's store binds MASTER_PORT; dspark meets through it
RANK_ENV="DSPARK_SOCKET_IFNAME=eth0 ${RANK_ENV:-}"

[ -n "$PY" ] && [ -x "$PY" ] || { echo "ddp_bed: no python with torch (set DSPARK_TORCH_VENV or PY)" >&2; exit 2; }
bed_init
bed_log "bed: $HOSTS hosts x $PER_HOST ranks at $RATE, prefix $P, subnet $SUB.0/24, pinned to" \
    "cores [$PIN_CORES], MLP ${LAYERS}x$HIDDEN batch $BATCH, bucket $BUCKET_MB MiB, out $OUT"
bed_setup
bed_rate "$RATE"
{ uname -a; nproc; uptime; git -C "$ROOT" rev-parse --short HEAD; "$PY" -c 'import torch; print("torch", torch.__version__)'; } \
    > "$OUT/machine.txt" 2>&1 || true

for pass in $(seq 1 "$RUNS"); do
    order=$BACKENDS
    (( pass % 2 == 0 )) && order=$(echo "$order" | tr ' ' '\n' | tac | tr '\n' ' ')
    for b in $order; do
        label="pass$pass-$b"
        bed_log "pass $pass $b (load $(bed_load))"
        echo "$label $(bed_load)" >> "$OUT/load.log"
        rc=0
        run_ranks "$label" "$PY" "$ROOT/examples/torch_ddp.py" --backend "$b" \
            --hidden "$HIDDEN" --layers "$LAYERS" --batch "$BATCH" --steps "$STEPS" \
            --warmup "$WARMUP" --bucket-cap-mb "$BUCKET_MB" --threads "$THREADS" \
            --allreduce-probe "$PROBE" --json "$OUT/$label.json" || rc=$?
        if [ -s "$OUT/$label.json" ]; then
            sed 's/^/    /' "$OUT/$label.rank0.out" >&2
            # torch 2.15's gloo can abort in its teardown ("terminate called without an active
            # exception") after the job's results are in: reported, the numbers kept.
            (( rc == 0 )) || bed_log "  $b, pass $pass: finished, but a rank exited with status $rc" \
                "at teardown: $(grep -h -m1 -v '^\[W' "$OUT/$label".rank*.err | head -n1)"
        else
            bed_log "  FAILED: $b, pass $pass, status $rc (see $OUT/$label.rank*.err)"
            tail -n 5 "$OUT/$label".rank*.err >&2 || true
        fi
    done
done

python3 "$ROOT/benches/ddp_bed_summary.py" "$OUT" "$RATE"
bed_log "out: $OUT"
