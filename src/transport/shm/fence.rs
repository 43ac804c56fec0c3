//! The wake-up fences: who pays for the full fence of the sleep/wake handshake.
//!
//! A rank that publishes something (a frame in a ring, a one-shot contribution) and a rank
//! that goes to sleep waiting for it meet as in Dekker's algorithm: the publisher stores its
//! data and then looks at the reader's `sleeping` word; the reader stores `sleeping` and then
//! looks at the data. Each side needs a full fence between its store and its load, or both
//! may miss the other (the publisher sees no sleeper, the sleeper sees no data) and the
//! sleeper waits out its poll period (`LIVENESS_POLL`) for data that is there.
//!
//! The publisher runs this on every call, the sleeper only after it spun for its whole spin
//! budget. So where the kernel offers it, the fence moves to the sleeper: each process
//! registers for `membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)` once, and advertises it in its
//! segment header (`OFF_ASYM`). A sleeper that registered issues that membarrier after its
//! own fence, which runs a full barrier on every CPU that is running a thread of a registered
//! process (a thread that is not running passed one in the context switch); a publisher
//! whose process registered and whose peers all advertise it then needs only a compiler fence
//! (the pairing `membarrier(2)` documents). Anything else keeps the full fence on both sides:
//! a kernel or seccomp profile without membarrier, a peer that did not register.
//!
//! Measured on the 2-core development VM: the publisher's fence was 4 ns of an 8-byte
//! one-shot all_reduce (0.117 µs) and 10 ns of a 64-byte one (0.14 µs). A membarrier costs
//! the sleeper 0.35 µs when no other registered thread runs, but 10.6 µs when one runs on
//! the other vCPU, and that thread loses about as much to the interrupt (an IPI in a VM
//! exits to the hypervisor; on bare metal it is a few times cheaper). A rank sleeps only
//! after its spin (50 µs, grown to 2 ms after a short sleep: `engine::pace::Spin`), so with a
//! few ranks that is at most a few percent of a late rank's time (an 8-byte all_reduce after
//! 0.1–5 ms of skew measured the same with and without). But every sleeper interrupts every
//! running registered thread, so a host's cost grows with the square of its ranks: groups
//! of more than [`MAX_GROUP`] ranks keep full fences.

use std::sync::atomic::{compiler_fence, fence, Ordering};
use std::sync::OnceLock;

/// `MEMBARRIER_CMD_QUERY`: the commands this kernel supports, as a bit mask.
const CMD_QUERY: libc::c_int = 0;
/// `MEMBARRIER_CMD_GLOBAL_EXPEDITED`.
const CMD_GLOBAL_EXPEDITED: libc::c_int = 1 << 1;
/// `MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED`.
const CMD_REGISTER_GLOBAL_EXPEDITED: libc::c_int = 1 << 2;

/// The most ranks of one host's shared-memory group that use membarrier fences: beyond it,
/// a sleeper's membarrier would interrupt more running ranks than the publishers' fences it
/// stands for are worth (the module docs).
pub(super) const MAX_GROUP: usize = 4;

/// `membarrier(cmd, 0, 0)`: its result, or -1 with `errno` set.
fn membarrier(cmd: libc::c_int) -> libc::c_long {
    // SAFETY: membarrier takes two integers and a CPU id and touches no memory of ours; an
    // unknown command or a kernel without the call fails with EINVAL or ENOSYS.
    unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            cmd,
            0 as libc::c_uint,
            0 as libc::c_int,
        )
    }
}

/// Whether this process registered for global expedited membarriers: tried once per
/// process, at the first shared-memory transport that asks (`ShmOptions::membarrier`).
pub(super) fn registered() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        let cmds = membarrier(CMD_QUERY);
        let wanted = (CMD_GLOBAL_EXPEDITED | CMD_REGISTER_GLOBAL_EXPEDITED) as libc::c_long;
        cmds >= 0 && cmds & wanted == wanted && membarrier(CMD_REGISTER_GLOBAL_EXPEDITED) == 0
    })
}

/// The publisher's fence between its store and its look at `sleeping`: a compiler fence
/// where `light` (this process registered and every peer advertises it), else a full fence.
#[inline(always)]
pub(super) fn publisher(light: bool) {
    if light {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

/// The sleeper's fence between its `sleeping` store and its look at the data: a full fence,
/// and the membarrier that stands for the publishers' fences where `asym` (its segment says
/// it issues one, so its peers may publish with a compiler fence only). Says `false` when
/// that membarrier failed (a wake-up may then come only at the sleeper's poll period).
pub(super) fn sleeper(asym: bool) -> bool {
    fence(Ordering::SeqCst);
    !asym || membarrier(CMD_GLOBAL_EXPEDITED) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_agrees_with_what_the_kernel_says_it_supports() {
        let cmds = membarrier(CMD_QUERY);
        let wanted = (CMD_GLOBAL_EXPEDITED | CMD_REGISTER_GLOBAL_EXPEDITED) as libc::c_long;
        let supported = cmds >= 0 && cmds & wanted == wanted;
        assert_eq!(registered(), supported, "query said {cmds:#x}");
        // A registered process's sleeper issues the membarrier, which must succeed.
        // (Unregistered, the membarrier fails with EPERM: this checks the registration too.)
        assert!(sleeper(registered()));
    }
}
