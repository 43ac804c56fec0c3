#!/usr/bin/env bash
# perftest-ratio.sh - dspark send/recv bandwidth at 1 MiB against perftest's
# ib_write_bw, in the same Soft-RoCE VM, interleaved, median of N runs each.
#
#   tests/softroce/perftest-ratio.sh [LOGDIR]                    (as root)
#
# Inside ONE VM, RUNS times (default 3), alternating:
#   ib_write_bw -d rxe0 -x $RXE_GID_INDEX -s 1048576 -F -n $IB_ITERS  (server + client on 127.0.0.1)
#   $DSPARK_BW_CMD                       (must print dspark-bench's --csv rows)
# then prints both medians (MiB/s, perftest's "MB") and dspark/ib_write_bw.
# TCG timing is noisy (and the host is shared): only the ratio means anything.
#
# DSPARK_BW_CMD defaults to the release dspark-bench built here:
#   dspark-bench send_recv --transport verbs -b 1M -e 1M -n $DSPARK_ITERS -w 5 --ranks 2 --csv
# (its CSV: collective,dtype,op,ranks,bytes,count,time_us,algbw_GBps,busbw_GBps,
#  wrong,transport,path; the row with bytes=1048576 is used, MiB/s = bytes /
#  time_us * 1e6 / 2^20, and its transport column must say verbs).
#
# Environment: DSPARK_BW_CMD, RUNS (3), IB_ITERS (200), DSPARK_ITERS (50),
# MIN_RATIO (0.80), SOFTROCE_RATIO_TIMEOUT (VM time limit, s, default 420).
# Exit status: 0 ratio >= MIN_RATIO; 1 below it, or the dspark command is
# missing / failed / did not run over verbs; 77 skip (VM cannot run here);
# 125 the VM did not boot; 124 time limit.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNS=${RUNS:-3} IB_ITERS=${IB_ITERS:-200} DSPARK_ITERS=${DSPARK_ITERS:-50} MIN_RATIO=${MIN_RATIO:-0.80}

# MiB/s of the 1 MiB row of dspark-bench --csv output (stdin); checks transport
dspark_csv_mibs() {
  awk -F, '
    $1 == "collective" { for (i = 1; i <= NF; i++) col[$i] = i; next }
    ("bytes" in col) && $col["bytes"] == 1048576 {
      tr = $col["transport"]; t = $col["time_us"]; w = $col["wrong"]; b = $col["bytes"]
    }
    END {
      if (!("bytes" in col)) { print "no CSV header (collective,...) in the output" > "/dev/stderr"; exit 1 }
      if (t == "") { print "no row with bytes=1048576" > "/dev/stderr"; exit 1 }
      if (tr != "verbs") { print "transport column is \"" tr "\", not verbs" > "/dev/stderr"; exit 1 }
      if (w != "0" && w != "N/A") { print "#wrong = " w > "/dev/stderr"; exit 1 }
      if (t <= 0) { print "time_us " t " is not positive" > "/dev/stderr"; exit 1 }
      printf "%.2f\n", b / t * 1e6 / 1048576
    }'
}

# ------------------------------------------------------------ guest side
if [[ ${1:-} == --inside ]]; then
  : >"$RXE_OUT/ib.txt"; : >"$RXE_OUT/dspark.txt"
  for run in $(seq "$RUNS"); do
    echo "=== run $run/$RUNS: ib_write_bw 1 MiB x $IB_ITERS"
    t=$(sr_now_ms)
    sr_bw_pair 1048576 "$IB_ITERS" "$RXE_OUT/ib.run"
    ib=$(cat "$RXE_OUT/ib.run")
    echo "$ib" >>"$RXE_OUT/ib.txt"
    echo "ib_write_bw: $ib MiB/s (pair wall time $(sr_secs "$t") s for $IB_ITERS MiB, connection set-up included)"
    echo "=== run $run/$RUNS: $DSPARK_BW_CMD"
    rc=0
    timeout -k 5 180 bash -c "$DSPARK_BW_CMD" >"$RXE_OUT/dspark.run" 2>"$RXE_OUT/dspark.err" || rc=$?
    cat "$RXE_OUT/dspark.run"; cat "$RXE_OUT/dspark.err" >&2
    [[ $rc == 0 ]] || { echo "the dspark command exited $rc" >&2; exit 1; }
    ds=$(dspark_csv_mibs <"$RXE_OUT/dspark.run") || exit 1
    echo "$ds" >>"$RXE_OUT/dspark.txt"
    echo "dspark send/recv: $ds MiB/s"
  done
  exit 0
fi

# ------------------------------------------------------------ host side
TMP=$(mktemp -d /tmp/dspark-ratio.XXXXXX)
LOGDIR=${1:-$TMP/logs}
sr_install_traps "$TMP"
mkdir -p "$LOGDIR"
rm -f "$LOGDIR/ratio.txt"
T_ALL=$(sr_now_ms)
sr_preflight

if [[ -z ${DSPARK_BW_CMD:-} ]]; then
  if [[ ! -f $SR_ROOT/src/bin/dspark-bench.rs && ! -f $SR_ROOT/src/bin/dspark-bench/main.rs ]]; then
    sr_log "dspark-bench does not exist yet (src/bin/dspark-bench.rs); set DSPARK_BW_CMD to the dspark command to measure"
    echo "dspark-bench missing" >"$LOGDIR/ratio.txt"; exit 1
  fi
  [[ "${RUSTFLAGS:-} ${CARGO_BUILD_RUSTFLAGS:-} ${CARGO_ENCODED_RUSTFLAGS:-}" != *target-cpu=native* ]] \
    || { sr_log "RUSTFLAGS has target-cpu=native: the binary would crash in the VM (TCG has no AVX-512)"; exit 1; }
  sr_log "building dspark-bench (release)"
  rc=0
  (cd "$SR_ROOT" && cargo build --release --bin dspark-bench --message-format=json-render-diagnostics) \
    >"$TMP/build.json" || rc=$?
  [[ $rc == 0 ]] || { sr_log "cargo build --release --bin dspark-bench failed"; echo "build failed" >"$LOGDIR/ratio.txt"; exit 1; }
  BENCH=$(grep '"reason":"compiler-artifact"' "$TMP/build.json" | grep '"name":"dspark-bench"' \
          | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n1)
  [[ -n $BENCH && -x $BENCH ]] || { sr_log "no dspark-bench executable in cargo's output"; exit 1; }
  DSPARK_BW_CMD="$BENCH send_recv --transport verbs -b 1M -e 1M -n $DSPARK_ITERS -w 5 --ranks 2 --csv"
else
  first=${DSPARK_BW_CMD%% *}
  command -v "$first" >/dev/null || { sr_log "DSPARK_BW_CMD: $first is not an executable (not built yet?)"; echo "dspark command missing" >"$LOGDIR/ratio.txt"; exit 1; }
fi
export DSPARK_BW_CMD RUNS IB_ITERS DSPARK_ITERS
sr_log "dspark command: $DSPARK_BW_CMD"

SR_VM_OPTS=(-t "${SOFTROCE_RATIO_TIMEOUT:-420}" -e RUNS -e IB_ITERS -e DSPARK_ITERS)
rc=0
sr_one_vm "$LOGDIR" bash "$SR_DIR/perftest-ratio.sh" --inside || rc=$?
if [[ $rc != 0 ]]; then
  sr_log "the measurement failed (status $rc); logs in $LOGDIR"
  echo "measurement failed (status $rc)" >"$LOGDIR/ratio.txt"
  [[ $rc == 77 || $rc == 125 || $rc == 124 ]] && exit "$rc"
  exit 1
fi
ib_med=$(sr_median <"$LOGDIR/ib.txt")
ds_med=$(sr_median <"$LOGDIR/dspark.txt")
ratio=$(awk -v d="$ds_med" -v i="$ib_med" 'BEGIN { printf "%.3f", d / i }')
ok=$(awk -v r="$ratio" -v m="$MIN_RATIO" 'BEGIN { print (r >= m) ? 1 : 0 }')
line="dspark send/recv ${ds_med} MiB/s vs ib_write_bw ${ib_med} MiB/s at 1 MiB: ratio ${ratio} (goal >= ${MIN_RATIO})"
echo "$line" >"$LOGDIR/ratio.txt"
echo
echo "================== perftest ratio (median of $RUNS, interleaved) =================="
echo "ib_write_bw runs (MiB/s):      $(tr '\n' ' ' <"$LOGDIR/ib.txt")"
echo "dspark send/recv runs (MiB/s): $(tr '\n' ' ' <"$LOGDIR/dspark.txt")"
echo "$line"
echo "verdict: $([[ $ok == 1 ]] && echo PASS || echo "BELOW GOAL")    total wall time $(sr_secs "$T_ALL") s"
echo "==================================================================================="
[[ $ok == 1 ]]
