#!/usr/bin/env bash
# shellcheck disable=SC2317  # on_exit runs from a trap
# smoke.sh - prove the Soft-RoCE test bed works, with no dspark code at all.
#
#   tests/softroce/smoke.sh [LOGDIR]            (as root; ~1-3 min)
#
#   1. one VM: ibv_devinfo -d rxe0; a host-built C program (verbs-probe.c,
#      compiled here against the host's libibverbs) opens rxe0 and moves data
#      through an RC queue pair; an ib_write_bw server + client pair on rxe0
#   2. two VMs joined by a virtual wire: ib_write_bw server in node 0, client
#      in node 1 connecting to $RXE_PEER_IP, so RoCE traffic crosses the wire
#   and prints the timings and bandwidths.
#
# Exit status: 0 all passed; 77 the VM cannot run on this machine (skip);
# 125 a VM did not boot / RDMA setup failed; else the failing step's status.
# Logs: LOGDIR (default: a temp dir, removed unless a step failed).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# ------------------------------------------------------------ guest side
if [[ ${1:-} == --inside ]]; then
  role=$2
  case $role in
    single)
      probe=$3
      echo "== ibv_devinfo -d rxe0"
      ibv_devinfo -d rxe0
      echo "== host-built verbs-probe (GID index $RXE_GID_INDEX)"
      "$probe" rxe0 "$RXE_GID_INDEX"
      echo "== ib_write_bw pair in one VM, 64 KiB x 2000"
      t=$(sr_now_ms)
      sr_bw_pair 65536 2000 "$RXE_OUT/bw-single"
      echo "ib_write_bw pair took $(sr_secs "$t") s (both processes, connect included)"
      ;;
    server)
      echo "== ib_write_bw server on $RXE_IP"
      timeout 120 ib_write_bw -d rxe0 -x "$RXE_GID_INDEX" -F -s 65536 -n 1000 -p 18515
      ;;
    client)
      echo "== ib_write_bw client -> $RXE_PEER_IP across the virtual wire"
      # the server VM may start its command a little later: retry a refused
      # connection for up to 60 s (a refused attempt does not disturb the server)
      end=$(( SECONDS + 60 ))
      while :; do
        rc=0
        timeout 120 ib_write_bw -d rxe0 -x "$RXE_GID_INDEX" -F -s 65536 -n 1000 -p 18515 \
          "$RXE_PEER_IP" >/tmp/client.log 2>&1 || rc=$?
        if [[ $rc == 0 ]] || ! grep -q "Couldn't connect" /tmp/client.log || (( SECONDS > end )); then break; fi
        sleep 0.5
      done
      cat /tmp/client.log
      [[ $rc == 0 ]] || exit "$rc"
      sr_parse_bw </tmp/client.log >"$RXE_OUT/bw-two"
      ;;
    *) echo "smoke.sh: unknown role $role" >&2; exit 2 ;;
  esac
  exit 0
fi

# ------------------------------------------------------------ host side
TMP=$(mktemp -d /tmp/dspark-smoke.XXXXXX)
LOGDIR=${1:-$TMP/logs}
KEEP=0                                    # keep the temp logs when a step failed
# shellcheck disable=SC2119  # no temp dirs: on_exit below removes them
sr_install_traps
on_exit() {
  local rc=$?
  trap - EXIT
  sr_stop_all
  if [[ $KEEP == 1 && $LOGDIR == "$TMP"/* ]]; then rm -rf "${TMP:?}/bin"; sr_log "logs kept in $LOGDIR"
  else rm -rf "$TMP"; fi
  exit "$rc"
}
trap on_exit EXIT
mkdir -p "$LOGDIR"
T_ALL=$(sr_now_ms)
sr_preflight

command -v cc >/dev/null || { sr_log "no C compiler (cc) to build verbs-probe.c"; exit 1; }
mkdir -p "$TMP/bin"
cc -O2 -Wall -o "$TMP/bin/verbs-probe" "$SR_DIR/verbs-probe.c" -libverbs
sr_log "built $TMP/bin/verbs-probe on the host"

SR_VM_OPTS=(-t 240)
sr_log "step 1: one VM"
t=$(sr_now_ms) rc1=0
sr_one_vm "$LOGDIR/single" bash "$SR_DIR/smoke.sh" --inside single "$TMP/bin/verbs-probe" || rc1=$?
T1=$(sr_secs "$t")

sr_log "step 2: two VMs joined by a virtual wire"
t=$(sr_now_ms)
SR_CMD0=(bash "$SR_DIR/smoke.sh" --inside server)
SR_CMD1=(bash "$SR_DIR/smoke.sh" --inside client)
sr_two_vms "$LOGDIR/two" || true
T2=$(sr_secs "$t")

echo
echo "==================== softroce smoke summary ===================="
printf '%-44s %-8s %s\n' "step" "status" "wall s"
printf '%-44s %-8s %s\n' "1 one VM: devinfo + verbs-probe + bw pair" "$rc1" "$T1"
printf '%-44s %-8s %s\n' "2 two VMs: ib_write_bw across the wire" "$SR_RC0/$SR_RC1" "$T2"
for f in single/ two/node0/ two/node1/; do
  [[ -s $LOGDIR/${f}rxe-vm.timing ]] && printf 'VM %-10s %s\n' "${f%/}" "$(cat "$LOGDIR/${f}rxe-vm.timing")"
done
[[ -s $LOGDIR/single/bw-single ]] && echo "ib_write_bw 64 KiB, one VM:          $(cat "$LOGDIR/single/bw-single") MB/s (perftest MB = 2^20 B)"
[[ -s $LOGDIR/two/node1/bw-two ]] && echo "ib_write_bw 64 KiB, two VMs (wire):  $(cat "$LOGDIR/two/node1/bw-two") MB/s"
echo "total wall time: $(sr_secs "$T_ALL") s   logs: $LOGDIR"
echo "================================================================"
rc=$(sr_worst "$rc1" "$SR_RC0" "$SR_RC1")
[[ $rc == 0 ]] || KEEP=1
exit "$rc"
