# lib.sh - shared by smoke.sh, run-suite.sh and perftest-ratio.sh (sourced,
# never run). Host side: start one or two VMs through rxe-vm.sh, keep their
# logs, time them, and never leave one behind. Guest side: ib_write_bw pairs.
# shellcheck shell=bash

SR_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
# shellcheck disable=SC2034  # used by the scripts that source this
SR_ROOT=$(cd "$SR_DIR/../.." && pwd -P)
RXE_VM=$SR_DIR/rxe-vm.sh
SR_VM_OPTS=()      # extra rxe-vm.sh options for every VM (e.g. -t 300)
# vCPUs per VM in two-VM mode: two TCG VMs share this machine's cores
SR_TWO_VM_CPUS=${SR_TWO_VM_CPUS:-1}
SR_PIDS=()         # runners in flight, stopped on exit

sr_log() { echo "[softroce $(date +%T)] $*" >&2; }
sr_now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
sr_secs() { local d=$(( $(sr_now_ms) - $1 )); printf '%d.%d' $((d / 1000)) $((d % 1000 / 100)); }

# stop every runner still in flight (each runner then kills its QEMU)
sr_stop_all() {
  local p
  for p in "${SR_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${SR_PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
  done
  SR_PIDS=()
}

# sr_install_traps TMPDIR...: on exit or interrupt stop the runners and
# remove the given temp dirs
sr_install_traps() {
  SR_TMPDIRS=("$@")
  trap 'rc=$?; trap - EXIT; sr_stop_all; rm -rf "${SR_TMPDIRS[@]}"; exit $rc' EXIT
  trap 'sr_log "interrupted"; exit 130' INT
  trap 'sr_log "terminated"; exit 143' TERM HUP
}

# sr_preflight: install/check once; exit 77 (skip) or 125 (fail) as rxe-vm.sh says
sr_preflight() {
  local rc=0
  bash "$RXE_VM" --setup-only || rc=$?
  if [[ $rc != 0 ]]; then
    sr_log "rxe-vm.sh --setup-only exited $rc"
    exit "$rc"
  fi
}

# a TCP port on 127.0.0.1 that nothing listens on (for the virtual wire)
sr_free_port() {
  local p
  for _ in $(seq 100); do
    p=$(( 40000 + RANDOM % 20000 ))
    [[ -z $(ss -Htan "sport = :$p or dport = :$p" 2>/dev/null) ]] && { echo "$p"; return 0; }
  done
  return 1
}

# sr_one_vm LOGDIR CMD...: one VM; output streamed; returns the runner's status
sr_one_vm() {
  local logdir=$1 rc=0; shift
  mkdir -p "$logdir"
  bash "$RXE_VM" "${SR_VM_OPTS[@]}" -o "$logdir" -- "$@" &
  SR_PIDS=($!)
  wait "${SR_PIDS[0]}" || rc=$?
  SR_PIDS=()
  return "$rc"
}

# sr_two_vms LOGDIR: two VMs joined by a virtual wire. Node 0 (listen,
# 10.78.0.1) runs the array SR_CMD0, node 1 (connect, 10.78.0.2) runs SR_CMD1.
# Output lines are prefixed [node0]/[node1]. Sets SR_RC0 and SR_RC1; returns
# 0 only when both are 0.
sr_two_vms() {
  local logdir=$1 port
  port=$(sr_free_port) || { sr_log "no free TCP port for the virtual wire"; SR_RC0=125 SR_RC1=125; return 125; }
  mkdir -p "$logdir/node0" "$logdir/node1"
  bash "$RXE_VM" -c "$SR_TWO_VM_CPUS" "${SR_VM_OPTS[@]}" -o "$logdir/node0" --link "listen:$port" -- "${SR_CMD0[@]}" \
    > >(sed -u 's/^/[node0] /') 2> >(sed -u 's/^/[node0] /' >&2) &
  SR_PIDS=($!)
  bash "$RXE_VM" -c "$SR_TWO_VM_CPUS" "${SR_VM_OPTS[@]}" -o "$logdir/node1" --link "connect:$port" -- "${SR_CMD1[@]}" \
    > >(sed -u 's/^/[node1] /') 2> >(sed -u 's/^/[node1] /' >&2) &
  SR_PIDS+=($!)
  SR_RC0=0 SR_RC1=0
  wait "${SR_PIDS[1]}" || SR_RC1=$?
  wait "${SR_PIDS[0]}" || SR_RC0=$?
  SR_PIDS=()
  sleep 0.2                                    # let the sed prefixers drain
  [[ $SR_RC0 == 0 && $SR_RC1 == 0 ]]
}

# sr_worst RC...: the status a script should return for several runner
# statuses: 0 if all 0; 125 if any VM failed; 124 if any timed out; 77 only
# if every one skipped; else the first failure
sr_worst() {
  local r first=0 all77=1
  for r in "$@"; do [[ $r == 125 ]] && { echo 125; return; }; done
  for r in "$@"; do [[ $r == 124 ]] && { echo 124; return; }; done
  for r in "$@"; do
    [[ $r == 77 ]] || all77=0
    [[ $r != 0 && $r != 77 && $first == 0 ]] && first=$r
  done
  if [[ $first != 0 ]]; then echo "$first"; elif [[ $all77 == 1 && $# -gt 0 ]]; then echo 77; else echo 0; fi
}

# ---------------------------------------------------------------- guest side
# sr_wait_listen PORT SECS: until a local TCP listener on PORT (inside a VM)
sr_wait_listen() {
  local end=$(( SECONDS + $2 ))
  until [[ -n $(ss -Hltn "sport = :$1" 2>/dev/null) ]]; do
    (( SECONDS < end )) || return 1
    sleep 0.1
  done
}

# sr_bw_pair SIZE ITERS OUTFILE: an ib_write_bw server and client in this VM,
# both on rxe0; prints the client report, writes its "BW average" (MiB/s, as
# perftest counts MB) to OUTFILE. Bounded: 120 s.
sr_bw_pair() {
  local size=$1 iters=$2 out=$3 port=18515 spid rc=0 bw
  local args=(-d "${RXE_DEV:-rxe0}" -x "${RXE_GID_INDEX:-1}" -F -s "$size" -n "$iters" -p "$port")
  timeout 120 ib_write_bw "${args[@]}" >/tmp/ib_server.log 2>&1 &
  spid=$!
  if ! sr_wait_listen "$port" 20; then
    echo "ib_write_bw server did not listen within 20 s:" >&2; cat /tmp/ib_server.log >&2
    kill "$spid" 2>/dev/null; return 1
  fi
  timeout 120 ib_write_bw "${args[@]}" 127.0.0.1 >/tmp/ib_client.log 2>&1 || rc=$?
  wait "$spid" 2>/dev/null || true
  cat /tmp/ib_client.log
  if [[ $rc != 0 ]]; then echo "ib_write_bw client exited $rc; server said:" >&2; cat /tmp/ib_server.log >&2; return 1; fi
  bw=$(sr_parse_bw </tmp/ib_client.log)
  [[ -n $bw ]] || { echo "no BW average in ib_write_bw output" >&2; return 1; }
  echo "$bw" >"$out"
}

# the "BW average[MB/sec]" column of perftest's result row (MB = 2^20 bytes)
sr_parse_bw() { awk '$1 ~ /^[0-9]+$/ && NF >= 5 && $2 ~ /^[0-9]+$/ { v = $4 } END { if (v != "") print v }'; }

# median of the numbers on stdin
sr_median() { sort -g | awk '{ a[NR] = $1 } END { if (NR == 0) exit 1; if (NR % 2) print a[(NR + 1) / 2]; else printf "%.2f\n", (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
