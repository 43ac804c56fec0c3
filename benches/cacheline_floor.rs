//! The floor of a small all_reduce over shared memory on this machine: two processes (fork)
//! and shared cache lines, nothing else — no library, no headers, no wake-ups.
//!
//! * `pingpong`: one shared line; the parent stores an odd number, the child waits for it and
//!   stores the next even one, the parent waits for that: one round trip = two line
//!   transfers. Reported per round trip.
//! * `exchange`: two lines, one per process (what a one-shot all_reduce of up to 32 bytes
//!   needs): each process stores its next flag in its own line, then waits for the other's.
//!   Reported per exchange (per iteration of either process).
//! * `oneshot64k`: the floor of a 64 KiB one-shot all_reduce (f32 sum): each process copies
//!   its 64 KiB into its own half of a shared buffer (two slots, by iteration parity), raises
//!   its flag, waits for the other's, and adds the other's 64 KiB into its result; a second
//!   flag says "read", so a slot is rewritten only after the peer read it. Reported per call.
//! * `tcp8` (only when named): not shared memory, the same shape over TCP: the two processes
//!   hold the two ends of one loopback connection (`TCP_NODELAY`, non-blocking); each sends 8
//!   bytes, then reads until the other's 8 bytes are in, spinning on `recv` (as a 2-rank
//!   8-byte all_reduce over TCP does, with no library around it). Reported per exchange: the
//!   floor of dspark's TCP 8-byte all_reduce on this machine at this minute, for
//!   `benches/fresh_runs.sh` to divide by.
//! * `paired-<cell>` (only when named; cell `tcp8`, `tcp64k`, `shm8`, `shm64k`): dspark beside
//!   its floor in one process pair, interleaved. Both processes open a dspark communicator of
//!   2 ranks over the cell's transport (`tcp` or `shm`) and the floor's own channel, then each
//!   sample times `k` dspark all_reduces (f32 sum, 8 B or 64 KiB) and right after `k` floor
//!   iterations: `tcp8` or a 64 KiB exchange over one loopback connection for `tcp`, the
//!   two-line `exchange` or `oneshot64k` for `shm`. The row: dspark's median µs per call, the
//!   floor's, and the median, lowest and highest of the per-sample ratio dspark ÷ floor. The
//!   ratio divides out what the machine does at that moment: on this project's VM the raw TCP
//!   exchange itself sits at one of two levels ~1.5 µs apart, the slow one in stretches of
//!   2 ms to nearly a second (`benches/data/issue25-stop50-2026-12-07/`), so a fresh run's
//!   time alone says more about the second it ran in than about dspark.
//! * `lines` (only when named): `pingpong` on each of the 64 lines of one fresh page in turn,
//!   `samples` rounds over the page, `k` round trips per line and round; one row per line
//!   (`line<i>`), then `lines` with the median, fastest and slowest line's median. Where the
//!   last-level cache is cut into slices homed by physical address, each line's round trip
//!   is its own and steady for the mapping's life, and differs in the next run (new physical
//!   pages): on this project's 2-vCPU VM 0.104 to 0.143 µs across one page, a line steady
//!   within 0.007 µs in a run. What a fresh process's flags land on is part of its placement.
//!
//! Timing as the peers' benchmarks: the median of `samples` samples of `k` back-to-back
//! iterations each, in µs per iteration.
//!
//! ```text
//! cargo bench --bench cacheline_floor                # 31 samples of 2000
//! cargo bench --bench cacheline_floor -- 101 5000    # samples, k
//! cargo bench --bench cacheline_floor -- 31 2000 pin # parent on CPU 0, child on CPU 1
//! cargo bench --bench cacheline_floor -- 31 200 pin oneshot64k   # only the modes named
//! cargo bench --bench cacheline_floor -- 31 500 pin tcp8          # the TCP exchange
//! cargo bench --bench cacheline_floor -- 5 4000 pin lines         # each line of a page
//! cargo bench --bench cacheline_floor -- 15 500 pin paired-tcp8    # dspark beside tcp8
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

const LINE: usize = 64;
/// Bytes per process and call of the `oneshot64k` mode.
const ONESHOT: usize = 64 << 10;

/// A shared anonymous mapping of `len` bytes (inherited across fork).
fn shared(len: usize) -> *mut u8 {
    // SAFETY: a fresh shared anonymous mapping chosen by the kernel; checked for MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert!(p != libc::MAP_FAILED, "mmap failed");
    p.cast()
}

/// The atomic word at the start of line `i` of `base`.
fn word(base: *mut u8, i: usize) -> &'static AtomicU64 {
    // SAFETY: `base` is a live page-aligned shared mapping that is never unmapped and holds
    // line `i` (6 lines for `run`'s modes, the 64 of a page for `lines`); every access to
    // these words, in both processes, is atomic.
    unsafe { &*(base.add(i * LINE) as *const AtomicU64) }
}

/// Pins this process to `cpu`, or exits saying why (a header claiming a pinning that did not
/// happen would mislabel every number).
fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t filled with CPU_SET and passed by pointer with its size.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        eprintln!(
            "cacheline_floor: cannot pin to cpu {cpu}: {}",
            std::io::Error::last_os_error()
        );
        std::process::exit(1);
    }
}

/// How long any wait for the other process may take before this one gives up (it died, or
/// never got a CPU): no run of this program is near it, and nothing then spins forever
/// holding a measurement lock.
const GIVE_UP: std::time::Duration = std::time::Duration::from_secs(60);

fn wait_for(w: &AtomicU64, v: u64) {
    let mut spins = 0u32;
    // From this wait's own start (read only once it has spun a while): a long run (`lines`
    // makes 64 times `pingpong`'s round trips) is not a peer that stopped answering.
    let mut since: Option<Instant> = None;
    while w.load(Ordering::Acquire) < v {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1 << 16)
            && since.get_or_insert_with(Instant::now).elapsed() > GIVE_UP
        {
            eprintln!("cacheline_floor: the other process stopped answering; giving up");
            std::process::exit(1);
        }
    }
}

/// One process's side of the `oneshot64k` mode. Lines 2 and 3 (process 0, 1) hold the
/// "ready" flags, lines 4 and 5 the "read" flags; the data slots follow the first page:
/// process `p`'s slot for parity `q` at `4096 + (2p + q) * ONESHOT`.
struct OneShot {
    base: *mut u8,
    me: usize,
    input: Vec<f32>,
    result: Vec<f32>,
}

impl OneShot {
    fn new(base: *mut u8, me: usize) -> OneShot {
        let n = ONESHOT / 4;
        let input = (0..n).map(|k| (k % 251) as f32 + me as f32).collect();
        OneShot {
            base,
            me,
            input,
            result: vec![0.0; n],
        }
    }

    fn slot(&self, who: usize, call: u64) -> *mut f32 {
        let off = 4096 + (2 * who + (call % 2) as usize) * ONESHOT;
        // SAFETY: within the mapping of 4096 + 4 * ONESHOT bytes made by `run`.
        unsafe { self.base.add(off).cast() }
    }

    /// Call number `call` (from 1): publish, wait, add the peer's contribution.
    fn call(&mut self, call: u64) {
        let (me, peer) = (self.me, 1 - self.me);
        // The slot of this parity was last read by the peer at call - 2.
        wait_for(word(self.base, 4 + peer), call.saturating_sub(2));
        let n = self.input.len();
        // SAFETY: this process's own slot (no one else writes it), n f32 inside the mapping,
        // not read by the peer until the flag below says so.
        unsafe { std::ptr::copy_nonoverlapping(self.input.as_ptr(), self.slot(me, call), n) };
        word(self.base, 2 + me).store(call, Ordering::Release);
        wait_for(word(self.base, 2 + peer), call);
        // SAFETY: the peer's slot for this call, complete (its flag was acquired above) and
        // not rewritten until this process's "read" flag below reaches this call.
        let theirs = unsafe { std::slice::from_raw_parts(self.slot(peer, call), n) };
        for ((r, a), b) in self.result.iter_mut().zip(&self.input).zip(theirs) {
            *r = a + b;
        }
        word(self.base, 4 + me).store(call, Ordering::Release);
        std::hint::black_box(&self.result);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Forks: the child (on CPU 1 when `pinned`) runs `child` and exits, the parent (on CPU 0)
/// runs `parent`, waits for the child and returns what `parent` did; a child that failed (a
/// panic: exit status 1) fails the run. The two may share only memory mapped shared and
/// sockets opened before the call.
fn forked<R>(pinned: bool, child: impl FnOnce(), parent: impl FnOnce() -> R) -> R {
    // SAFETY: fork in a process that is single-threaded here: no mode has started a thread
    // before forking (a `paired-` cell's communicator, with its threads, is opened after the
    // fork in each process, and dropped, its threads joined, before the next cell forks).
    // The child leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        if pinned {
            pin(1);
        }
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).is_ok();
        // SAFETY: leave the forked child without running the parent's destructors (nor, on
        // a panic, going on with the parent's code).
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    if pinned {
        pin(0);
    }
    let r = parent();
    let mut status = 0;
    // SAFETY: waiting for our own child, its status into a local.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        eprintln!("cacheline_floor: the child process failed (wait status {status})");
        std::process::exit(1);
    }
    r
}

/// Runs `samples` × `k` iterations of `mode` in both processes; the parent returns the
/// per-iteration times of its samples.
fn run(mode: &str, samples: usize, k: usize, pinned: bool) -> Vec<f64> {
    let base = shared(4096 + 4 * ONESHOT);
    let total = (samples * k) as u64;
    let child = || match mode {
        "pingpong" => {
            let w = word(base, 0);
            for i in 0..total {
                wait_for(w, 2 * i + 1);
                w.store(2 * i + 2, Ordering::Release);
            }
        }
        "oneshot64k" => {
            let mut o = OneShot::new(base, 1);
            for i in 1..=total {
                o.call(i);
            }
        }
        _ => {
            let (mine, theirs) = (word(base, 1), word(base, 0));
            for i in 1..=total {
                mine.store(i, Ordering::Release);
                wait_for(theirs, i);
            }
        }
    };
    let parent = || {
        let mut times = Vec::with_capacity(samples);
        let mut i = 0u64;
        let mut oneshot = OneShot::new(base, 0);
        for _ in 0..samples {
            let t0 = Instant::now();
            for _ in 0..k {
                match mode {
                    "pingpong" => {
                        let w = word(base, 0);
                        w.store(2 * i + 1, Ordering::Release);
                        wait_for(w, 2 * i + 2);
                    }
                    "oneshot64k" => oneshot.call(i + 1),
                    _ => {
                        let (mine, theirs) = (word(base, 0), word(base, 1));
                        mine.store(i + 1, Ordering::Release);
                        wait_for(theirs, i + 1);
                    }
                }
                i += 1;
            }
            times.push(t0.elapsed().as_secs_f64() * 1e6 / k as f64);
        }
        times
    };
    forked(pinned, child, parent)
}

/// Reads exactly `buf.len()` bytes from the non-blocking `s`, spinning on `recv`.
fn spin_read(s: &mut std::net::TcpStream, buf: &mut [u8]) {
    use std::io::Read;
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => panic!("tcp8: the other process closed the connection"),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("tcp8: recv: {e}"),
        }
    }
}

/// One exchange of the `tcp8` mode (number `iter`): send 8 bytes, then read the other's 8.
fn tcp8_exchange(s: &mut std::net::TcpStream, iter: u64) {
    use std::io::Write;
    let out = iter.to_le_bytes();
    let mut sent = 0;
    while sent < out.len() {
        match s.write(&out[sent..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("tcp8: send: {e}"),
        }
    }
    let mut back = [0u8; 8];
    spin_read(s, &mut back);
    assert_eq!(u64::from_le_bytes(back), iter, "tcp8: out of step");
}

/// The `tcp8` mode: the per-exchange times of the parent's `samples` samples of `k`.
fn run_tcp8(samples: usize, k: usize, pinned: bool) -> Vec<f64> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("tcp8: bind");
    let addr = listener.local_addr().expect("tcp8: address");
    let total = (samples * k) as u64;
    let ready = |s: &std::net::TcpStream| {
        s.set_nodelay(true).expect("tcp8: TCP_NODELAY");
        s.set_nonblocking(true).expect("tcp8: non-blocking");
    };
    let child = || {
        let mut s = std::net::TcpStream::connect(addr).expect("tcp8: connect");
        ready(&s);
        for i in 0..total {
            tcp8_exchange(&mut s, i);
        }
    };
    let parent = || {
        let (mut s, _) = listener.accept().expect("tcp8: accept");
        ready(&s);
        let mut times = Vec::with_capacity(samples);
        let mut i = 0u64;
        for _ in 0..samples {
            let t0 = Instant::now();
            for _ in 0..k {
                tcp8_exchange(&mut s, i);
                i += 1;
            }
            times.push(t0.elapsed().as_secs_f64() * 1e6 / k as f64);
        }
        times
    };
    forked(pinned, child, parent)
}

/// One exchange of `out.len()` bytes each way over the non-blocking `s` (both ends send and
/// receive at once, so neither blocks the other however large): the floor of a 2-rank
/// all_reduce of that many bytes over TCP, which moves at least as much each way.
fn tcp_exchange(s: &mut std::net::TcpStream, out: &[u8], back: &mut [u8]) {
    use std::io::{ErrorKind, Read, Write};
    // Nothing to do this turn, or a signal: try again.
    let again =
        |e: &std::io::Error| matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted);
    let (mut sent, mut got) = (0, 0);
    while sent < out.len() || got < back.len() {
        if sent < out.len() {
            match s.write(&out[sent..]) {
                Ok(n) => sent += n,
                Err(e) if again(&e) => {}
                Err(e) => panic!("tcp exchange: send: {e}"),
            }
        }
        if got < back.len() {
            match s.read(&mut back[got..]) {
                Ok(0) => panic!("tcp exchange: the other process closed the connection"),
                Ok(n) => got += n,
                Err(e) if again(&e) => {}
                Err(e) => panic!("tcp exchange: recv: {e}"),
            }
        }
    }
}

/// The `paired-<cell>` mode: per sample of the parent's, (dspark µs per call, floor µs per
/// iteration), timed back to back.
fn run_paired(cell: &str, samples: usize, k: usize, pinned: bool) -> Vec<(f64, f64)> {
    let (tcp, bytes) = match cell {
        "tcp8" => (true, 8),
        "tcp64k" => (true, ONESHOT),
        "shm8" => (false, 8),
        "shm64k" => (false, ONESHOT),
        _ => panic!("paired: no cell {cell:?} (tcp8, tcp64k, shm8, shm64k)"),
    };
    let base = shared(4096 + 4 * ONESHOT);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("paired: bind");
    let addr = listener.local_addr().expect("paired: address");
    listener
        .set_nonblocking(true)
        .expect("paired: non-blocking listener");
    // dspark's rank 0 listens on a port found free here (a benchmark, not a test: a port
    // taken in between fails the run loudly).
    let root = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("paired: a port for dspark")
        .to_string();
    let side = |me: usize| {
        let mut c = dspark::Config::new(me, 2, root.clone());
        c.transport = if tcp {
            dspark::config::TransportChoice::Tcp
        } else {
            dspark::config::TransportChoice::Shm
        };
        c.timeout = std::time::Duration::from_secs(30);
        let comm = dspark::Communicator::init(c).expect("paired: dspark init");
        let mut s = tcp.then(|| {
            let s = if me == 0 {
                // Not forever: a child that failed before connecting is not waited for.
                let since = Instant::now();
                loop {
                    match listener.accept() {
                        Ok((s, _)) => break s,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            assert!(since.elapsed() < GIVE_UP, "paired: nobody connected");
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        Err(e) => panic!("paired: accept: {e}"),
                    }
                }
            } else {
                std::net::TcpStream::connect(addr).expect("paired: connect")
            };
            s.set_nodelay(true).expect("paired: TCP_NODELAY");
            s.set_nonblocking(true).expect("paired: non-blocking");
            s
        });
        let mut buf = vec![0f32; bytes / 4];
        let out = vec![me as u8; bytes];
        let mut back = vec![0u8; bytes];
        let mut oneshot = OneShot::new(base, me);
        let mut i = 0u64;
        let mut floor = || {
            i += 1;
            match (&mut s, bytes) {
                (Some(s), 8) => tcp8_exchange(s, i),
                (Some(s), _) => tcp_exchange(s, &out, &mut back),
                (None, 8) => {
                    word(base, me).store(i, Ordering::Release);
                    wait_for(word(base, 1 - me), i);
                }
                (None, _) => oneshot.call(i),
            }
        };
        let mut times = Vec::with_capacity(samples);
        // One sample's worth of each first (the first calls of a fresh process are its own
        // question: `dspark-bench`'s fresh runs ask it), then the timed samples.
        for sample in 0..=samples {
            let t0 = Instant::now();
            for _ in 0..k {
                comm.all_reduce(&mut buf, dspark::ReduceOp::Sum)
                    .expect("paired: all_reduce");
            }
            let d = t0.elapsed().as_secs_f64() * 1e6 / k as f64;
            let t1 = Instant::now();
            for _ in 0..k {
                floor();
            }
            let f = t1.elapsed().as_secs_f64() * 1e6 / k as f64;
            if sample > 0 {
                times.push((d, f));
            }
        }
        std::hint::black_box(&buf);
        times
    };
    forked(
        pinned,
        || {
            side(1);
        },
        || side(0),
    )
}

/// Lines of the page the `lines` mode walks.
const PAGE_LINES: usize = 64;

/// The `lines` mode: per line of the second page of a fresh mapping, the per-round-trip time
/// of each of `samples` rounds of `k` round trips (the parent's), by line.
fn run_lines(samples: usize, k: usize, pinned: bool) -> Vec<Vec<f64>> {
    let base = shared(2 * 4096);
    // SAFETY: the second page of a mapping of two pages: `word` stays inside it.
    let page = unsafe { base.add(4096) };
    let k = k as u64;
    let child = || {
        for s in 0..samples as u64 {
            for line in 0..PAGE_LINES {
                let w = word(page, line);
                for r in 0..k {
                    let v = 2 * (s * k + r) + 1;
                    wait_for(w, v);
                    w.store(v + 1, Ordering::Release);
                }
            }
        }
    };
    let parent = || {
        let mut times: Vec<Vec<f64>> = (0..PAGE_LINES)
            .map(|_| Vec::with_capacity(samples))
            .collect();
        for s in 0..samples as u64 {
            for (line, t) in times.iter_mut().enumerate() {
                let w = word(page, line);
                let t0 = Instant::now();
                for r in 0..k {
                    let v = 2 * (s * k + r) + 1;
                    w.store(v, Ordering::Release);
                    wait_for(w, v + 1);
                }
                t.push(t0.elapsed().as_secs_f64() * 1e6 / k as f64);
            }
        }
        times
    };
    forked(pinned, child, parent)
}

fn main() {
    // `cargo bench` passes `--bench`; numbers are samples and k, `pin` pins.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let nums: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let samples = nums.first().copied().unwrap_or(31).max(1);
    let k = nums.get(1).copied().unwrap_or(2000).max(1);
    let pinned = args.iter().any(|a| a == "pin");
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "# cache-line floor: {samples} samples x {k} iterations, {}, load {}",
        if pinned {
            "pinned to CPUs 0 and 1"
        } else {
            "unpinned"
        },
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!("mode,us_per_iter_median,us_min,us_max");
    const MODES: [&str; 3] = ["pingpong", "exchange", "oneshot64k"];
    let asked: Vec<&str> = MODES
        .into_iter()
        .filter(|m| args.iter().any(|a| a == m))
        .collect();
    let lines = args.iter().any(|a| a == "lines");
    let tcp8 = args.iter().any(|a| a == "tcp8");
    let paired: Vec<&str> = args
        .iter()
        .filter_map(|a| a.strip_prefix("paired-"))
        .collect();
    for mode in if asked.is_empty() && !lines && !tcp8 && paired.is_empty() {
        MODES.to_vec()
    } else {
        asked
    } {
        let t = run(mode, samples, k, pinned);
        let (lo, hi) = t
            .iter()
            .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        println!("{mode},{:.3},{lo:.3},{hi:.3}", median(t));
    }
    if tcp8 {
        let t = run_tcp8(samples, k, pinned);
        let (lo, hi) = t
            .iter()
            .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        println!("tcp8,{:.3},{lo:.3},{hi:.3}", median(t));
    }
    if !paired.is_empty() {
        println!("mode,dspark_us,floor_us,ratio_median,ratio_min,ratio_max");
    }
    for cell in &paired {
        let t = run_paired(cell, samples, k, pinned);
        let r: Vec<f64> = t.iter().map(|(d, f)| d / f).collect();
        let (lo, hi) = r
            .iter()
            .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        println!(
            "paired-{cell},{:.4},{:.4},{:.3},{lo:.3},{hi:.3}",
            median(t.iter().map(|x| x.0).collect()),
            median(t.iter().map(|x| x.1).collect()),
            median(r)
        );
    }
    if lines {
        let mut medians = Vec::with_capacity(PAGE_LINES);
        for (line, t) in run_lines(samples, k, pinned).into_iter().enumerate() {
            let (lo, hi) = t
                .iter()
                .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
            let m = median(t);
            println!("line{line},{m:.3},{lo:.3},{hi:.3}");
            medians.push(m);
        }
        let (lo, hi) = medians
            .iter()
            .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        println!("lines,{:.3},{lo:.3},{hi:.3}", median(medians));
    }
}
