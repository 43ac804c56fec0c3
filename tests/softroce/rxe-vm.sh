#!/usr/bin/env bash
# shellcheck disable=SC2317  # cleanup runs from a trap
# rxe-vm.sh - run one command inside a throw-away QEMU VM that has a real RDMA
#             verbs stack (Soft-RoCE, rdma_rxe) and this host's own root
#             filesystem; stream its output; exit with its status.
#
# dspark's verbs transport is tested for real here: the host kernel has no
# RDMA, but Debian's stock kernel (linux-image-amd64) ships rdma_rxe. The VM
# boots that kernel, mounts the host "/" read-only over virtio-9p under a tmpfs
# overlay (writable, thrown away), creates rxe0 and runs the command, so
# binaries built on the host run inside unchanged.
#
# Usage (as root, on Debian 12 / x86_64):
#   tests/softroce/rxe-vm.sh [options] [--] COMMAND [ARGS...]
#   tests/softroce/rxe-vm.sh --setup-only        # install + check, boot nothing
#
#   tests/softroce/rxe-vm.sh -- ibv_devinfo -d rxe0
#   # two "nodes": two VMs joined by a virtual wire, each with its own rxe0
#   tests/softroce/rxe-vm.sh --link listen:47911  -- CMD_A &
#   tests/softroce/rxe-vm.sh --link connect:47911 -- CMD_B
#
# Options:
#   -t SECS     time limit of the command inside the VM (default 600); the VM
#               is killed hard at boot + setup + SECS + 60 s whatever happens
#   -c N        vCPUs (default min(2, nproc))       -m MB   guest RAM (default 2048)
#   -o DIR      keep the logs (rxe-vm.{console.log,setup.log,stdout,stderr,
#               qemu.err}) in DIR; DIR is also shared read-write at the same
#               path inside the VM and exported there as $RXE_OUT
#   -w DIR      share DIR read-write at the same path (repeatable); everything
#               else the VM writes is thrown away
#   -e VAR[=V]  pass VAR into the VM (repeatable). Passed automatically: PATH,
#               HOME, LANG, TERM, and every DSPARK_* and RUST_* variable
#   --link listen:PORT | connect:PORT
#               two-node mode: a virtio NIC (eth0) joined point to point to ONE
#               other rxe-vm.sh VM through 127.0.0.1:PORT; rxe0 sits on eth0 with
#               10.78.0.1 (listen) / 10.78.0.2 (connect). The connect side waits
#               (max 120 s) for the listener; each side waits (max 90 s) for the
#               peer to answer ping before running the command
#   -a ACCEL    auto (default), kvm or tcg. auto uses TCG when /dev/kvm is the
#               nested PVM hypervisor (kvm_pvm: stock kernels cannot boot on
#               it) or unusable, else tries KVM and falls back to TCG
#   -v          also stream the guest console to stderr
#   -q          no progress messages
#   --no-install  never run apt-get
#   --setup-only  install and check the dependencies, then exit
#
# Inside the VM the command runs as root, in this cwd, with a memlock limit of
# unlimited and:
#   RXE_VM=1 RXE_DEV=rxe0 RXE_GID_INDEX=<IPv4-mapped RoCE v2 GID, normally 1>
#   RXE_IP=<rxe0's IPv4>  RXE_OUT=<-o DIR, or a scratch dir>
#   two-node mode also: RXE_PEER_IP=<the other VM's IP> RXE_LINK_ROLE=listen|connect
#
# Exit status:
#   the command's own status       it ran (0 = success)
#   124   the command hit -t (or the VM the hard deadline)
#   125   the VM did not boot, RDMA setup failed, or the VM died without a
#         result (a console tail is printed): CI must FAIL on this
#   77    cannot run here at all: not root, not x86_64, or QEMU / the kernel
#         package / rdma-core cannot be installed (the reason is printed): CI
#         may SKIP on this. Once a VM has booted on this machine, 77 turns into
#         125 (a machine that could boot it must keep booting it); so does
#         RXE_VM_NO_SKIP=1
#   2     usage error
#
# Facts behind the choices (see tests/softroce/README.md): switch_root, not
# chroot, into the shared root (module auto-loading needs the real modprobe);
# TCG's "-cpu max" has AVX2 but no AVX-512, so never build with
# target-cpu=native; QEMU 7.2's socket netdev does not retry a connect, so the
# connect side starts only once the listener is up.
set -euo pipefail

PROG=rxe-vm.sh
EX_SKIP=77 EX_INFRA=125 EX_TIMEOUT=124
STATE_DIR=${RXE_VM_STATE_DIR:-/var/lib/dspark-softroce}  # "this machine booted a VM once"
log() { [[ $QUIET == 1 ]] || echo "$PROG: $*" >&2; }
infra_fail() { echo "$PROG: error: $*" >&2; exit $EX_INFRA; }
usage_err() { echo "$PROG: $*  (see $0 --help)" >&2; exit 2; }
cannot_run_here() {
  if [[ ${RXE_VM_NO_SKIP:-0} == 1 || -e $STATE_DIR/booted-once ]]; then
    echo "$PROG: error: $* -- and this machine booted the VM before" \
         "(${STATE_DIR}/booted-once) or RXE_VM_NO_SKIP=1: failing, not skipping" >&2
    exit $EX_INFRA
  fi
  echo "$PROG: SKIP: cannot run the Soft-RoCE VM on this machine: $*" >&2
  exit $EX_SKIP
}

# ------------------------------------------------------------------ options
TIMEOUT=600 MEM=2048 CPUS=$(( $(nproc) < 2 ? $(nproc) : 2 ))
OUT='' LINK='' ACCEL=auto VERBOSE=0 QUIET=0 INSTALL=1 SETUP_ONLY=0
SHARES=() ENV_PASS=(PATH HOME LANG TERM)
while [[ $# -gt 0 ]]; do
  case $1 in
    -t) TIMEOUT=${2:?-t needs a value}; shift 2 ;;
    -c) CPUS=${2:?-c needs a value}; shift 2 ;;
    -m) MEM=${2:?-m needs a value}; shift 2 ;;
    -o) OUT=${2:?-o needs a value}; shift 2 ;;
    -w) SHARES+=("${2:?-w needs a value}"); shift 2 ;;
    -e) ENV_PASS+=("${2:?-e needs a value}"); shift 2 ;;
    -a) ACCEL=${2:?-a needs a value}; shift 2 ;;
    --link) LINK=${2:?--link needs a value}; shift 2 ;;
    -v) VERBOSE=1; shift ;;
    -q) QUIET=1; shift ;;
    --no-install) INSTALL=0; shift ;;
    --setup-only) SETUP_ONLY=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '/shellcheck/d; $d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    -*) usage_err "unknown option $1" ;;
    *) break ;;
  esac
done
[[ $SETUP_ONLY == 1 || $# -gt 0 ]] || usage_err "no command given"
for v in TIMEOUT MEM CPUS; do [[ ${!v} =~ ^[1-9][0-9]*$ ]] || usage_err "$v must be a positive integer"; done
[[ $ACCEL =~ ^(auto|kvm|tcg)$ ]] || usage_err "-a must be auto, kvm or tcg"
LINK_ROLE='' LINK_PORT='' MY_IP='' PEER_IP='' MAC=''
if [[ -n $LINK ]]; then
  [[ $LINK =~ ^(listen|connect):([0-9]+)$ ]] || usage_err "--link must be listen:PORT or connect:PORT"
  LINK_ROLE=${BASH_REMATCH[1]} LINK_PORT=${BASH_REMATCH[2]}
  if [[ $LINK_ROLE == listen ]]; then MY_IP=10.78.0.1 PEER_IP=10.78.0.2 MAC=52:54:00:78:00:01
  else MY_IP=10.78.0.2 PEER_IP=10.78.0.1 MAC=52:54:00:78:00:02; fi
fi

# ------------------------------------------------------------- 1. dependencies
[[ $(uname -m) == x86_64 ]] || cannot_run_here "host is $(uname -m), only x86_64 is supported"
# qemu-system-x86: the VM            linux-image-amd64: guest kernel with rdma_rxe + 9p
# busybox-static: initramfs shell    kmod cpio gzip xz-utils: build the initramfs, modprobe
# iproute2: ip, rdma, ss             rdma-core ibverbs-providers libibverbs1: verbs + rxe provider
# ibverbs-utils: ibv_devinfo         perftest: ib_write_bw   libibverbs-dev: build against verbs
PKGS=(qemu-system-x86 linux-image-amd64 busybox-static kmod cpio gzip xz-utils iproute2
      rdma-core ibverbs-providers libibverbs1 libibverbs-dev ibverbs-utils perftest)
TOOLS=(qemu-system-x86_64 modprobe cpio gzip ip rdma ss ibv_devinfo ib_write_bw timeout)
missing_pkgs() {
  local p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || echo "$p"
  done
}
have_all() {
  local t
  [[ -z $(missing_pkgs) ]] || return 1
  for t in "${TOOLS[@]}"; do command -v "$t" >/dev/null || return 1; done
}
command -v dpkg-query >/dev/null || cannot_run_here "not a Debian-style system (no dpkg-query)"
if ! have_all; then
  [[ $(id -u) == 0 ]] || cannot_run_here "packages missing and not root: $(missing_pkgs | xargs)"
  [[ $INSTALL == 1 ]] || cannot_run_here "packages missing and --no-install given: $(missing_pkgs | xargs)"
  command -v apt-get >/dev/null || cannot_run_here "no apt-get to install: $(missing_pkgs | xargs)"
  # one installer at a time (several runners may start together); apt's own
  # lock is waited for too, with a bound
  exec 9>/run/lock/dspark-softroce-install.lock
  flock -w 900 9 || cannot_run_here "another installation holds /run/lock/dspark-softroce-install.lock for 15 min"
  if ! have_all; then
    want=$(missing_pkgs | xargs)
    log "installing (~1-3 min, ~100 MB): ${want:-"${PKGS[*]}"}"
    export DEBIAN_FRONTEND=noninteractive
    APT=(apt-get -q -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3)
    timeout 900 "${APT[@]}" update >&2 || log "apt-get update failed (trying the install anyway)"
    # shellcheck disable=SC2086  # $want is a list of package names
    timeout 1800 "${APT[@]}" install -y --no-install-recommends ${want:-"${PKGS[@]}"} >&2 \
      || cannot_run_here "apt-get install ${want:-"${PKGS[*]}"} failed"
    have_all || cannot_run_here "still missing after apt-get install: $(missing_pkgs | xargs)"
  fi
  exec 9>&-
fi
[[ $(id -u) == 0 ]] || cannot_run_here "must run as root (QEMU exports all of / over 9p)"
BUSYBOX=/bin/busybox
if [[ ! -x $BUSYBOX ]] || ldd "$BUSYBOX" >/dev/null 2>&1; then
  cannot_run_here "$BUSYBOX is missing or not static (busybox-static)"
fi
KVER=
for k in $(printf '%s\n' /boot/vmlinuz-* | sed 's|^/boot/vmlinuz-||' | sort -rV); do
  if modprobe -S "$k" --show-depends rdma_rxe >/dev/null 2>&1 &&
     modprobe -S "$k" --show-depends 9p >/dev/null 2>&1; then KVER=$k; break; fi
done
[[ -n $KVER ]] || cannot_run_here "no /boot/vmlinuz-* whose modules include rdma_rxe and 9p (linux-image-amd64)"
KERNEL=/boot/vmlinuz-$KVER
[[ -r $KERNEL ]] || cannot_run_here "$KERNEL is not readable"
if [[ $SETUP_ONLY == 1 ]]; then
  log "setup OK: $(qemu-system-x86_64 --version | head -n1), guest kernel $KVER"
  exit 0
fi

# ------------------------------------------------------------- 2. work dirs
if [[ -n $OUT ]]; then
  mkdir -p "$OUT" || infra_fail "cannot create $OUT"
  OUT=$(cd "$OUT" && pwd -P)
fi
for i in "${!SHARES[@]}"; do
  [[ -d ${SHARES[$i]} ]] || usage_err "-w ${SHARES[$i]}: not a directory"
  SHARES[i]=$(cd "${SHARES[$i]}" && pwd -P)
done
WORK=$(mktemp -d /tmp/dspark-rxe-vm.XXXXXX)
CTL=$WORK/ctl                                  # shared with the guest as "ctl"
mkdir -p "$CTL/out"
QPID='' WATCHDOG='' TAILPIDS=() booted='' BOOT_S='' READY_S='' TOTAL_S=''
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  set +e
  [[ -n $QPID ]] && kill -9 "$QPID" 2>/dev/null
  [[ -n $WATCHDOG ]] && kill "$WATCHDOG" 2>/dev/null
  for p in "${TAILPIDS[@]}"; do kill "$p" 2>/dev/null; done
  [[ -n $QPID ]] && wait "$QPID" 2>/dev/null
  if [[ -n $OUT ]]; then                       # keep the logs
    cp "$CTL/console.log" "$OUT/rxe-vm.console.log" 2>/dev/null
    cp "$CTL/setup.log" "$OUT/rxe-vm.setup.log" 2>/dev/null
    cp "$CTL/stdout" "$OUT/rxe-vm.stdout" 2>/dev/null
    cp "$CTL/stderr" "$OUT/rxe-vm.stderr" 2>/dev/null
    cp "$WORK/qemu.err" "$OUT/rxe-vm.qemu.err" 2>/dev/null
    printf 'accel=%s boot_s=%s ready_s=%s total_s=%s status=%s\n' \
      "${booted:-none}" "${BOOT_S:-}" "${READY_S:-}" "${TOTAL_S:-}" "$rc" >"$OUT/rxe-vm.timing"
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT
trap 'log "terminated"; exit 143' TERM HUP

# ------------------------------------------------------------- 3. initramfs
# busybox + the modules that mount the 9p root and the overlay; everything
# else (rdma_rxe, virtio_net, ...) is modprobe'd later from the shared root.
IRD=$WORK/initramfs
mkdir -p "$IRD"/{bin,dev,proc,sys,lower,upper,newroot,ctl,mods}
cp "$BUSYBOX" "$IRD/bin/busybox"
for a in sh mount mkdir insmod switch_root poweroff touch; do ln -s busybox "$IRD/bin/$a"; done
n=0
mods=$(for m in virtio_pci 9pnet_virtio 9p overlay; do
         modprobe -S "$KVER" --show-depends "$m" || exit 1
       done) || infra_fail "a boot module is missing for $KVER"
while read -r m; do
  n=$((n + 1)); dst=$IRD/mods/$(printf %02d "$n").ko
  case $m in                                   # busybox insmod wants plain .ko
    *.ko.xz) xz -dc "$m" >"$dst" ;;
    *.ko.zst) zstd -qdc "$m" >"$dst" ;;
    *.ko.gz) gzip -dc "$m" >"$dst" ;;
    *) cp "$m" "$dst" ;;
  esac || infra_fail "cannot unpack module $m"
done < <(awk '$1 == "insmod" && !seen[$2]++ { print $2 }' <<<"$mods")
cat >"$IRD/init" <<'EOF'
#!/bin/sh
# stage 1: host root (9p, ro) + tmpfs overlay, then switch_root into it
export PATH=/bin
fail() { echo "rxe-vm init: $*"; echo "$*" >/ctl/init-failed; poweroff -f; }
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in /mods/*.ko; do insmod "$m" || echo "rxe-vm init: insmod $m failed"; done
O=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o $O,cache=none ctl /ctl || fail "cannot mount the ctl share"
touch /ctl/booted
mount -t 9p -o $O,ro,cache=loose hostroot /lower || fail "cannot mount the host root over 9p"
mount -t tmpfs -o size=50% tmpfs /upper && mkdir -p /upper/u /upper/w || fail "tmpfs failed"
mount -t overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w overlay /newroot \
  || fail "overlay mount failed"
mkdir -p /newroot/run && mount -t tmpfs -o mode=755 tmpfs /newroot/run || fail "tmpfs /run failed"
mkdir -p /newroot/run/rxe-vm && mount --move /ctl /newroot/run/rxe-vm || fail "moving ctl failed"
i=0                              # read-write shares: tag sN at the host path listed in ctl/shares
while read -r path; do
  mkdir -p "/newroot$path" && mount -t 9p -o $O,cache=none "s$i" "/newroot$path" \
    || fail "cannot mount share s$i at $path"
  i=$((i + 1))
done </newroot/run/rxe-vm/shares
mount --move /proc /newroot/proc; mount --move /sys /newroot/sys; mount --move /dev /newroot/dev
exec switch_root /newroot /bin/bash /run/rxe-vm/stage2.sh
fail "switch_root failed"
EOF
chmod 755 "$IRD/init"
(cd "$IRD" && find . | cpio -o -H newc --quiet | gzip -1) >"$WORK/initrd.gz" \
  || infra_fail "building the initramfs failed"

# ------------------------------------------------------------- 4. guest stage 2
cat >"$CTL/stage2.sh" <<'EOF'
#!/bin/bash
# stage 2: PID 1 on the host's root. Soft-RoCE up, then the command.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
C=/run/rxe-vm
up() { cut -d' ' -f1 /proc/uptime; }
finish() {
  echo "$1" >$C/rc.tmp; sync; mv $C/rc.tmp $C/rc; sync
  echo "rxe-vm: guest done rc=$1 at ${2:-$(up)} s"
  /bin/busybox poweroff -f; echo o >/proc/sysrq-trigger; sleep 10
}
setup_fail() { echo "rxe-vm: RDMA setup failed: $*" | tee -a $C/setup.log; echo "$*" >$C/setup-failed; finish 125; }
source $C/config                      # TIMEOUT CWD OUT MY_IP PEER_IP LINK_ROLE
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
chmod 1777 /tmp 2>/dev/null
hostname "rxe-vm${LINK_ROLE:+-$LINK_ROLE}"
echo "rxe-vm: stage 2 at $(up) s"
(
  PS4='+ [$(cut -d" " -f1 /proc/uptime)] '   # time-stamped trace in setup.log
  set -x
  modprobe virtio_rng &                 # entropy for getrandom(); not waited for
  modprobe rdma_rxe && modprobe ib_uverbs || exit 1
  ip link set lo up || exit 1
  if [ -n "$LINK_ROLE" ]; then         # two-node mode: virtio NIC to the other VM
    modprobe virtio_net || exit 1
    for i in $(seq 100); do [ -e /sys/class/net/eth0 ] && break; sleep 0.1; done
    ip addr add "$MY_IP/24" dev eth0 && ip link set eth0 up || exit 1
    dev=eth0
  else                                 # one VM: rxe0 over a dummy device, loops back inside
    modprobe dummy numdummies=0 && ip link add dummy0 type dummy &&
      ip addr add "$MY_IP/24" dev dummy0 && ip link set dummy0 up || exit 1
    dev=dummy0
  fi
  rdma link add rxe0 type rxe netdev $dev || exit 1
  for i in $(seq 100); do [ -e /dev/infiniband/uverbs0 ] && break; sleep 0.1; done
  rdma link show; ibv_devices
) >$C/setup.log 2>&1 || setup_fail "$(tail -n 3 $C/setup.log | tr '\n' ' ')"
active() { grep -q 'rxe0/1 state ACTIVE' $C/setup.log || rdma link show rxe0/1 2>/dev/null | grep -q 'state ACTIVE'; }
for i in $(seq 50); do active && break; sleep 0.1; done
active || setup_fail "rxe0 port 1 is not ACTIVE"
# the IPv4-mapped RoCE v2 GID (normally index 1)
IFS=. read -r o1 o2 o3 o4 <<<"$MY_IP"
mapped=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' "$o1" "$o2" "$o3" "$o4")
GID_INDEX= gids=/sys/class/infiniband/rxe0/ports/1/gids
for i in $(seq 50); do
  read -r g <$gids/1 2>/dev/null && [ "$g" = "$mapped" ] && { GID_INDEX=1; break; }   # no fork
  g=$(grep -lx "$mapped" $gids/* 2>/dev/null | head -n1)
  [ -n "$g" ] && { GID_INDEX=${g##*/}; break; }
  sleep 0.1
done
[ -n "$GID_INDEX" ] || setup_fail "no GID $mapped on rxe0"
if [ -n "$LINK_ROLE" ]; then           # the wire works once the peer answers (max 90 s)
  end=$(( $(cut -d. -f1 /proc/uptime) + 90 ))
  until busybox ping -c1 -W1 "$PEER_IP" >/dev/null 2>&1; do
    [ "$(cut -d. -f1 /proc/uptime)" -lt $end ] || setup_fail "peer $PEER_IP does not answer over eth0 (90 s)"
    sleep 0.3
  done
  export RXE_PEER_IP=$PEER_IP RXE_LINK_ROLE=$LINK_ROLE
fi
echo "rxe-vm: rxe0 ready at $(up) s (GID index $GID_INDEX)"
echo "$(up)" >$C/ready
ulimit -l unlimited                   # ibv_reg_mr pins memory
cd "$CWD" 2>/dev/null || cd /
set -a; source $C/env; set +a
export RXE_VM=1 RXE_DEV=rxe0 RXE_GID_INDEX=$GID_INDEX RXE_IP=$MY_IP RXE_OUT=$OUT
mapfile -d '' -t CMD <$C/cmd          # NUL-separated argv: no quoting issues
t0=$(cut -d. -f1 /proc/uptime)
timeout -k 10 "$TIMEOUT" "${CMD[@]}" >$C/stdout 2>$C/stderr </dev/null
rc=$?
if [ $rc = 124 -o $rc = 137 ] && [ $(( $(cut -d. -f1 /proc/uptime) - t0 )) -ge "$TIMEOUT" ]; then
  echo "rxe-vm: the command hit its time limit ($TIMEOUT s)"; : >$C/timedout
fi
finish $rc
EOF
[[ -n $LINK_ROLE ]] || MY_IP=10.77.0.1
GUEST_OUT=${OUT:-/run/rxe-vm/out}
printf 'TIMEOUT=%q\nCWD=%q\nOUT=%q\nMY_IP=%q\nPEER_IP=%q\nLINK_ROLE=%q\n' \
  "$TIMEOUT" "$PWD" "$GUEST_OUT" "$MY_IP" "$PEER_IP" "$LINK_ROLE" >"$CTL/config"
: >"$CTL/env"
while IFS= read -r v; do ENV_PASS+=("$v"); done < <(compgen -e | grep -E '^(DSPARK|RUST)_' || true)
for v in "${ENV_PASS[@]}"; do
  if [[ $v == *=* ]]; then printf '%s=%q\n' "${v%%=*}" "${v#*=}" >>"$CTL/env"
  elif [[ -n ${!v+x} ]]; then printf '%s=%q\n' "$v" "${!v}" >>"$CTL/env"; fi
done
printf '%s\0' "$@" >"$CTL/cmd"
: >"$CTL/stdout"; : >"$CTL/stderr"; : >"$CTL/console.log"; : >"$CTL/shares"
SHARE_ARGS=() i=0
for d in ${OUT:+"$OUT"} "${SHARES[@]}"; do
  echo "$d" >>"$CTL/shares"
  SHARE_ARGS+=(-fsdev "local,id=s$i,path=$d,security_model=none"
               -device "virtio-9p-pci,fsdev=s$i,mount_tag=s$i")
  i=$((i + 1))
done
NET_ARGS=()
[[ -n $LINK_ROLE ]] && NET_ARGS=(-netdev "socket,id=n0,$LINK_ROLE=127.0.0.1:$LINK_PORT"
                                 -device "virtio-net-pci,netdev=n0,mac=$MAC")

# ------------------------------------------------------------- 5. boot
CANDS=()
if [[ $ACCEL != tcg ]]; then
  if [[ -d /sys/module/kvm_pvm ]]; then
    [[ $ACCEL == kvm ]] && infra_fail "-a kvm: /dev/kvm is the PVM nested hypervisor (kvm_pvm), stock kernels do not boot on it"
    log "/dev/kvm is the nested PVM hypervisor (kvm_pvm), which cannot boot stock kernels: using TCG"
  elif [[ -r /dev/kvm && -w /dev/kvm ]]; then
    CANDS+=(kvm)
  elif [[ $ACCEL == kvm ]]; then
    infra_fail "-a kvm: /dev/kvm is not usable"
  fi
fi
[[ $ACCEL == kvm ]] || CANDS+=(tcg)

SETUP_LIMIT=120                                # boot -> rxe0 ready
[[ -n $LINK_ROLE ]] && SETUP_LIMIT=240          # ... and the peer answering
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
since() { local d=$(( $(now_ms) - $1 )); printf '%d.%d' $((d / 1000)) $((d % 1000 / 100)); }
start_vm() {  # $1 = kvm|tcg; -cpu host only with KVM, never under TCG
  local accel cpu
  if [[ $1 == kvm ]]; then accel=kvm cpu=host; else accel=tcg,thread=multi cpu=max; fi
  rm -f "$CTL"/{booted,ready,rc,timedout,setup-failed,init-failed}
  : >"$CTL/console.log"
  qemu-system-x86_64 -name dspark-rxe-vm -accel "$accel" -machine q35 -cpu "$cpu" \
    -smp "$CPUS" -m "$MEM" -nodefaults -display none -no-reboot -monitor none \
    -serial "file:$CTL/console.log" \
    -kernel "$KERNEL" -initrd "$WORK/initrd.gz" \
    -append "console=ttyS0 panic=-1 quiet loglevel=4 rdinit=/init" \
    -device virtio-rng-pci \
    -fsdev "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap" \
    -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot \
    -fsdev "local,id=ctl,path=$CTL,security_model=none" \
    -device virtio-9p-pci,fsdev=ctl,mount_tag=ctl \
    "${SHARE_ARGS[@]}" "${NET_ARGS[@]}" </dev/null >"$WORK/qemu.err" 2>&1 &
  QPID=$!
  # watchdog: QEMU never outlives this script (even if it is SIGKILLed) nor
  # the hard deadline (boot + setup + command + slack)
  local limit=$(( 300 + SETUP_LIMIT + TIMEOUT + 60 )) me=$$ q=$QPID
  ( end=$(( SECONDS + limit ))
    while kill -0 "$q" 2>/dev/null; do
      if ! kill -0 "$me" 2>/dev/null; then kill -9 "$q"; sleep 1; rm -rf "$WORK"; exit; fi
      if (( SECONDS > end )); then kill -9 "$q"; exit; fi
      sleep 1
    done ) </dev/null >/dev/null 2>&1 &
  WATCHDOG=$!
}
stop_vm() {
  if [[ -n $QPID ]]; then kill -9 "$QPID" 2>/dev/null || true; wait "$QPID" 2>/dev/null || true; fi
  if [[ -n $WATCHDOG ]]; then kill "$WATCHDOG" 2>/dev/null || true; fi
  QPID='' WATCHDOG=''
}
show_failure() {  # why the VM gave no result
  echo "$PROG: ---- VM failure: $* ----" >&2
  [[ -s $CTL/init-failed ]] && echo "initramfs: $(cat "$CTL/init-failed")" >&2
  [[ -s $WORK/qemu.err ]] && { echo "--- qemu stderr (tail) ---" >&2; tail -n 15 "$WORK/qemu.err" >&2; }
  [[ -s $CTL/setup.log ]] && { echo "--- RDMA setup log (tail) ---" >&2; tail -n 20 "$CTL/setup.log" >&2; }
  echo "--- guest console (tail${OUT:+, whole log in $OUT/rxe-vm.console.log}) ---" >&2
  tail -n 30 "$CTL/console.log" >&2
}

if [[ $LINK_ROLE == connect ]]; then  # QEMU 7.2 does not retry: wait for the listener
  for ((r = 0; r < 240; r++)); do
    [[ -n $(ss -Hltn "sport = :$LINK_PORT" 2>/dev/null) ]] && break
    (( r % 20 == 0 )) && log "waiting for the listening VM on 127.0.0.1:$LINK_PORT"
    sleep 0.5
  done
  [[ -n $(ss -Hltn "sport = :$LINK_PORT") ]] \
    || infra_fail "nothing listens on 127.0.0.1:$LINK_PORT after 120 s (start the --link listen:$LINK_PORT VM first)"
fi
T0=$(now_ms)
for acc in "${CANDS[@]}"; do
  if [[ $acc == kvm ]]; then limit=30; else limit=180; fi  # TCG is slow on a loaded host
  log "booting ($acc, $CPUS vCPU, $MEM MiB, kernel $KVER${LINK:+, link $LINK})"
  start_vm "$acc"
  for ((i = 0; i < limit * 10; i++)); do
    [[ -e $CTL/booted ]] && { booted=$acc; break; }
    kill -0 "$QPID" 2>/dev/null || break
    sleep 0.1
  done
  [[ -n $booted ]] && break
  if kill -0 "$QPID" 2>/dev/null; then why="the guest did not reach its initramfs within $limit s"
  else wait "$QPID" 2>/dev/null && qrc=0 || qrc=$?; why="QEMU exited (status $qrc) before the guest booted"; fi
  echo "$PROG: no boot with $acc: $why" >&2
  [[ $acc == "${CANDS[-1]}" ]] && show_failure "the VM did not boot (tried: ${CANDS[*]}): $why"
  stop_vm
done
[[ -n $booted ]] || exit $EX_INFRA
if mkdir -p "$STATE_DIR" 2>/dev/null; then touch "$STATE_DIR/booted-once" 2>/dev/null || true; fi
BOOT_S=$(since "$T0")
log "VM booted in $BOOT_S s ($booted)"

# RDMA setup (and, in two-node mode, the peer) within a bound
for ((i = 0; i < SETUP_LIMIT * 10; i++)); do
  [[ -e $CTL/ready || -e $CTL/rc ]] && break
  kill -0 "$QPID" 2>/dev/null || break
  sleep 0.1
done
if [[ ! -e $CTL/ready ]]; then
  if [[ -e $CTL/setup-failed ]]; then show_failure "RDMA setup failed: $(cat "$CTL/setup-failed")"
  else show_failure "rxe0 was not ready ${SETUP_LIMIT} s after boot"; fi
  TOTAL_S=$(since "$T0")
  exit $EX_INFRA
fi
READY_S=$(since "$T0")
log "rxe0 ready at $READY_S s; running: $*"

# stream the command's output while it runs; bounded by the hard deadline
tail -n +1 -s 0.3 -f --pid="$QPID" "$CTL/stdout" & TAILPIDS+=($!)
tail -n +1 -s 0.3 -f --pid="$QPID" "$CTL/stderr" >&2 & TAILPIDS+=($!)
if [[ $VERBOSE == 1 ]]; then
  tail -n +1 -s 0.3 -f --pid="$QPID" "$CTL/console.log" | sed -u 's/^/[console] /' >&2 &
  TAILPIDS+=($!)
fi
deadline=$(( $(now_ms) + (TIMEOUT + 30) * 1000 )) timed_out=0
while kill -0 "$QPID" 2>/dev/null; do
  if (( $(now_ms) > deadline )); then
    timed_out=1; echo "$PROG: hard deadline (-t $TIMEOUT + 30 s) reached: killing the VM" >&2
    kill -9 "$QPID" 2>/dev/null || true; break
  fi
  sleep 0.3
done
wait "$QPID" 2>/dev/null && qrc=0 || qrc=$?
QPID=
for p in "${TAILPIDS[@]}"; do wait "$p" 2>/dev/null || true; done
TAILPIDS=()
TOTAL_S=$(since "$T0")

if [[ -s $CTL/rc ]]; then
  rc=$(cat "$CTL/rc")
  log "command exited with status $rc (boot $BOOT_S s, rxe0 ready $READY_S s, total $TOTAL_S s)"
  if [[ -e $CTL/timedout ]]; then echo "$PROG: the command hit its time limit (-t $TIMEOUT s)" >&2; exit $EX_TIMEOUT; fi
  exit "$rc"
fi
show_failure "the VM ended without a result (qemu status $qrc, after $TOTAL_S s)"
[[ $timed_out == 1 ]] && exit $EX_TIMEOUT
exit $EX_INFRA
