//! Shared segments: one anonymous memory file (`memfd`) per rank, sized and sealed at init,
//! mapped by every rank of the host, and the futex calls that wait on words inside them.
//!
//! A segment has no name anywhere: its owner creates it with `memfd_create`, peers open it
//! through `/proc/<owner pid>/fd/<n>` while the owner is known to be alive (it waits in the
//! bootstrap until every peer has mapped it), and the kernel frees it when the last mapping
//! goes — after any exit, SIGKILL included. Nothing is left in `/dev/shm` or anywhere else.
//!
//! Every `unsafe` block of the transport that touches raw memory is here or in `ring` use of
//! [`Seg::at`], each with its `// SAFETY:` comment.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

/// Bytes of a cache line (and of the alignment of every shared word and frame).
pub(super) const LINE: usize = 64;
/// Bytes of a page: the unit in which ring memory is committed.
pub(super) const PAGE: usize = 4096;

/// A copy that would leave a segment: `len` bytes at `off` of a `seg_len`-byte mapping (an
/// internal bug, or ring counters a misbehaving peer wrote). Checked before every copy, so
/// that it is an error instead of a panic or an access outside the mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct OutOfBounds {
    pub(super) off: usize,
    pub(super) len: usize,
    pub(super) seg_len: usize,
}

impl OutOfBounds {
    fn check(off: usize, len: usize, seg_len: usize) -> Result<(), Self> {
        match off.checked_add(len) {
            Some(end) if end <= seg_len => Ok(()),
            _ => Err(OutOfBounds { off, len, seg_len }),
        }
    }
}

impl std::fmt::Display for OutOfBounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes at offset {} lie outside the {}-byte segment",
            self.len, self.off, self.seg_len
        )
    }
}

/// A mapping of a shared segment (this rank's own or a peer's); unmapped on drop.
#[derive(Debug)]
pub struct Seg {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `Seg` is a pointer to a shared mapping that lives until `drop`; every access to the
// memory goes through atomics or through byte copies of ranges the ring protocol assigns to
// one side at a time, so it may move between and be used from threads.
unsafe impl Send for Seg {}
// SAFETY: as for `Send`: shared access is through atomics and protocol-owned ranges only.
unsafe impl Sync for Seg {}

impl Drop for Seg {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what `mmap` returned in `Seg::map`, unmapped once.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

impl Seg {
    /// Maps `len` bytes of `file` shared, read-write. Nothing is populated: the ranges in use
    /// are, with [`Seg::populate`] (the rings of the pairs connected at init, and each other
    /// ring when its pair is first used).
    pub(super) fn map(file: &File, len: usize) -> Result<Self, String> {
        // SAFETY: a fresh mapping chosen by the kernel (no fixed address), of a file we hold
        // open; the result is checked for MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!(
                "mmap of {len} bytes: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Seg { ptr: p.cast(), len })
    }

    /// Populates the page tables of `len` bytes at `off` (page-aligned, inside the segment),
    /// as `MAP_POPULATE` does for a whole mapping: without it every process took a minor
    /// fault on the first touch of each page of every ring, inside its first collectives — a
    /// 64 KiB all_reduce walks the ring, and fresh `dspark-bench` runs at 64 KiB then took
    /// 29–766 µs where steady state is 7 µs. `MADV_POPULATE_WRITE` (Linux 5.14) allocates the
    /// pages not allocated yet ([`commit`] normally did) and reports a failure (ENOMEM) to the
    /// caller instead of a SIGBUS at a later access; older kernels fault each page in by
    /// reading it (a hole of a memory file is allocated on that read).
    pub(super) fn populate(&self, off: usize, len: usize) -> Result<(), String> {
        if len == 0 {
            return Ok(());
        }
        let aligned = off.is_multiple_of(PAGE) && len.is_multiple_of(PAGE);
        if !aligned || OutOfBounds::check(off, len, self.len).is_err() {
            return Err(format!(
                "internal: populating {len} bytes at {off} of a {}-byte segment",
                self.len
            ));
        }
        // SAFETY: madvise on a page-aligned range inside our own live mapping (checked just
        // above); MADV_POPULATE_WRITE only fills page tables, it writes no byte.
        let r = unsafe { libc::madvise(self.ptr.add(off).cast(), len, libc::MADV_POPULATE_WRITE) };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(format!("populating {len} bytes of shared memory: {e}"));
        }
        // A kernel before 5.14: read a word of each page (atomically: a peer may write it).
        for page in (off..off + len).step_by(PAGE) {
            std::hint::black_box(self.u64_at(page).load(std::sync::atomic::Ordering::Relaxed));
        }
        Ok(())
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Raw pointer to byte `off` (must be `< len`; checked in debug builds).
    pub(super) fn at(&self, off: usize) -> *mut u8 {
        debug_assert!(off < self.len);
        // SAFETY: `off < len`, so the result stays inside the mapping.
        unsafe { self.ptr.add(off) }
    }

    /// Asks the CPU to bring the cache line at `off` into this core's cache (nothing outside
    /// the segment, nor on CPUs without a prefetch instruction this code knows). Not a read:
    /// no value is taken, so a line another process is writing can be fetched.
    pub(super) fn prefetch(&self, off: usize) {
        if off >= self.len {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // SAFETY: a prefetch is a hint that reads nothing the program sees and cannot
            // fault; the address is inside the mapping all the same (`off < len`).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.at(off).cast::<i8>()) };
        }
    }

    /// The 64-bit atomic at `off` (8-aligned, inside the segment). The offsets are layout
    /// constants and ring bases that fit the segment's length, which is checked against the
    /// layout when a peer's segment is mapped: the assert below guards an internal invariant
    /// that no peer can break.
    pub(super) fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= self.len);
        // SAFETY: in bounds and aligned (checked above; the mapping is page-aligned); the
        // memory lives as long as `self`; all access to this word, here and in other
        // processes, is atomic.
        unsafe { &*(self.at(off) as *const AtomicU64) }
    }

    /// The 32-bit atomic at `off` (4-aligned, inside the segment).
    pub(super) fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off.is_multiple_of(4) && off + 4 <= self.len);
        // SAFETY: as in `u64_at`.
        unsafe { &*(self.at(off) as *const AtomicU32) }
    }

    /// Copies `dst.len()` bytes from `off` into `dst`; nothing when they are not all inside.
    pub(super) fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        OutOfBounds::check(off, dst.len(), self.len)?;
        // SAFETY: in bounds (checked just above, without overflow); `dst` is ours and cannot
        // overlap the shared mapping (a distinct allocation); the bytes read belong to the
        // reader under the protocol.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// Copies `src` to `off`; nothing when the bytes would not all be inside.
    pub(super) fn write(&self, off: usize, src: &[u8]) -> Result<(), OutOfBounds> {
        OutOfBounds::check(off, src.len(), self.len)?;
        // SAFETY: in bounds (checked just above, without overflow); the destination bytes
        // belong to the writer under the protocol (no reader looks at them until they are
        // published).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len());
        }
        Ok(())
    }

    /// The `n` bytes at `off` as a slice, for reducing straight out of the segment.
    ///
    /// # Safety
    /// The caller guarantees that no process writes those bytes while the slice lives: the
    /// ring protocol gives `[tail, head)` to the receiver until it advances `tail`.
    ///
    /// # Errors
    /// [`OutOfBounds`] (and no slice) when the bytes are not all inside the segment.
    pub(super) unsafe fn slice(&self, off: usize, n: usize) -> Result<&[u8], OutOfBounds> {
        OutOfBounds::check(off, n, self.len)?;
        // SAFETY: in bounds (checked just above, without overflow); not written while
        // borrowed (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) })
    }
}

/// Creates this rank's segment file: a sealed memfd of `len` bytes, of which only the
/// ranges `commit_now` (offset, length) are allocated now (so that a full memory cgroup fails
/// init with ENOMEM/ENOSPC, not a later SIGBUS); the rest is reserved, and allocated by
/// [`commit`] when first needed.
pub(super) fn create(
    len: usize,
    commit_now: &[(usize, usize)],
    name: &str,
) -> Result<File, String> {
    let cname = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: a valid NUL-terminated name; the flags are documented memfd_create flags.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(len as u64)
        .map_err(|e| format!("sizing the segment to {len} bytes: {e}"))?;
    for &(off, n) in commit_now {
        commit(&file, off, n)?;
    }
    // SAFETY: fcntl(F_ADD_SEALS) on our own descriptor with documented seal bits: nobody
    // (a peer included) can shrink or grow it under a mapping (which would raise SIGBUS).
    // Allocating inside the sealed size (`commit`) stays allowed.
    let r = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    if r != 0 {
        return Err(format!(
            "sealing the segment: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(file)
}

/// Allocates `len` bytes at `off` of a segment file (fallocate; a no-op where they are
/// allocated already). `Err` (ENOMEM or ENOSPC: a memory cgroup's limit, or the host's
/// memory) names the size.
pub(super) fn commit(file: &File, off: usize, len: usize) -> Result<(), String> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: plain fallocate(2) on our own descriptor, mode 0 (allocate), inside its size.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, off as libc::off_t, len as libc::off_t) };
    if r != 0 {
        return Err(format!(
            "allocating {len} bytes of shared memory: {} (memory cgroup limit?)",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// Opens a peer's segment through its process's descriptor table, checking that it is a
/// sealed file of the announced size.
pub(super) fn open_peer(pid: u32, fd: u32, len: usize) -> Result<File, String> {
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| format!("opening {path}: {e} (another PID namespace or user?)"))?;
    let size = file
        .metadata()
        .map_err(|e| format!("fstat {path}: {e}"))?
        .len();
    if size != len as u64 {
        return Err(format!(
            "{path} has {size} bytes, {len} were announced (not the segment)"
        ));
    }
    // SAFETY: fcntl(F_GET_SEALS) on a descriptor we own.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(format!(
            "{path} is not sealed against shrinking (not the segment)"
        ));
    }
    Ok(file)
}

/// FUTEX_WAIT on a process-shared word: sleeps while `*word == expected`, at most `timeout`.
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT (shared: no PRIVATE flag, the word is in a MAP_SHARED mapping) on
    // a live, aligned 32-bit word with a valid relative timeout; the kernel only reads it.
    // EAGAIN, EINTR and ETIMEDOUT are all fine: the caller re-checks everything.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// FUTEX_WAKE every waiter on a process-shared word.
pub(super) fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned 32-bit word; no memory is written.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Eight random bytes (`/dev/urandom`, else the time and pid mixed): the segment's nonce,
/// so that a peer that opens the wrong file (a reused pid) finds out.
pub(super) fn nonce() -> u64 {
    use std::io::Read;
    let mut b = [0u8; 8];
    if File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ (u64::from(std::process::id()) << 32) ^ 0x9e37_79b9_7f4a_7c15
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy outside the mapping (a bad offset from an internal bug or from ring counters a
    /// peer wrote) is refused with an error naming the peer, before any byte moves.
    #[test]
    fn a_copy_outside_the_segment_is_an_error_naming_the_peer_not_a_panic() {
        let len = 4096;
        let file = create(len, &[(0, len)], "dspark-seg-test").unwrap();
        let seg = Seg::map(&file, len).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(seg.read(len - 16, &mut buf), Ok(()));
        let past = OutOfBounds {
            off: len - 8,
            len: 16,
            seg_len: len,
        };
        assert_eq!(seg.read(len - 8, &mut buf), Err(past));
        assert!(
            seg.read(usize::MAX - 4, &mut buf).is_err(),
            "an end that overflows"
        );
        assert!(seg.write(len, &[1]).is_err());
        assert_eq!(seg.write(len - 1, &[7]), Ok(()));
        // SAFETY: no other process maps this segment, and nothing writes it while the slices
        // live.
        unsafe {
            assert!(seg.slice(len - 1, 2).is_err());
            assert_eq!(seg.slice(len - 1, 1), Ok(&[7u8][..]));
        }
        match super::super::out_of_bounds(0, 3)(past) {
            crate::error::Error::Transport {
                rank, peer, what, ..
            } => {
                assert_eq!((rank, peer), (Some(0), Some(3)));
                assert!(what.contains("16 bytes at offset 4088"), "{what}");
            }
            e => panic!("not a transport error: {e:?}"),
        }
    }
}
