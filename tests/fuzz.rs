//! Property-based fuzzing of every decoder that reads what another process sent or a file
//! holds, and of the configuration parsers (the targets of `dspark::internals::fuzzing`;
//! issue #11 item 13, issue #22 item 5). Decoder → target:
//!
//! | decoder | target |
//! | --- | --- |
//! | a rank's hello to rank 0, a data connection's hello | `bootstrap_hello`, `bootstrap_peer_hello` |
//! | rank 0's replies: challenge, reject, the welcome with the rank table (the gathered address table, whole or partial) | `bootstrap_reply` |
//! | proofs, a data connection's challenge and acknowledgement | `bootstrap_proofs` |
//! | the bootstrap's all-gathered blobs (one rank's, everybody's) | `bootstrap_blobs` |
//! | the frame header | `frame_header` |
//! | the verbs connection blob; clear-to-send entries, immediates, work-request ids | `verbs_blob`, `verbs_words` |
//! | the cost model rank 0 broadcasts (`plan::model::wire`: `decode` is its only decoder) | `plan_cost_model` |
//! | the transport negotiation: shm offer, verbs offer, confirmation | `setup_shm_offer`, `setup_verbs_offer`, `setup_confirm` |
//! | a rank's seat: its kernel's boot id and allowed CPUs (all-gathered at init) | `setup_seat` |
//! | shared-memory segment info (`SegInfo`, all-gathered at init) | `shm_seg_info` |
//! | a peer's shared segment: header words (checked when mapped), ring counters and frames, `status` words and abort message, the published `tail` (stateful: two real ranks per input) | `shm_ring` |
//! | a split's all-gathered record (colour, key, the new group's leader address) | `split_record` |
//! | the tune file (`dspark tune` writes it, every rank reads it) | `tune_file` |
//! | `/proc/<pid>/stat`, `/proc/meminfo`, `/proc/self/status` (`CapEff`), `/proc/net/tcp` | `proc_files` |
//! | TCPStore replies (GET, ADD, CHECK, WAIT, PING), and a stored counter's text | `store_replies` |
//! | the TCP transport's frame reassembly from a byte stream (stateful) | `tcp_frames` |
//! | the data listener's non-blocking handshake-message reader (`door::pull_message`, stateful) | `door_messages` |
//! | the environment and the small configuration parsers | `config_env`, `config_values` |
//!
//! Each target gets `DSPARK_FUZZ_CASES` inputs (default 20 000: the quick mode; CI runs
//! 200 000, `tests/run-all.sh`; the full mode is `DSPARK_FUZZ_CASES=1000000`); the stateful
//! targets ([`fuzzing::STATEFUL`], a loopback connection per input) a twentieth of that, at
//! least 500. Inputs are random bytes, valid messages (which must decode
//! to the value they encode), and valid messages mutated structure-aware — bit flips, length
//! fields set to edge values, insertions, deletions, truncations, splices of two messages.
//! An input fails when the target panics (a decoder that panics, or a broken property) or
//! when one allocation during the call is larger than the input justifies (a decoder that
//! trusts a length field; beyond it, only what [`fuzzing::fixed_allocation`] names). The
//! stateful targets write their stream in pieces split at points the input draws, over a
//! real loopback connection, and compare what is read with the stream read whole and with a
//! reference reading of it. The failing input is printed in hex, with the seed
//! (`DSPARK_FUZZ_SEED`) that reproduces the run.
//!
//! The coverage-guided twin of these targets is in `fuzz/` (cargo-afl).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use dspark::internals::fuzzing::{self, Rng, XorShift};

/// The system allocator, noting the largest single allocation of each thread.
struct Counting;

thread_local! {
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note(n: usize) {
    let _ = PEAK.try_with(|p| {
        if n > p.get() {
            p.set(n)
        }
    });
}

// SAFETY: every call forwards to the system allocator with the same arguments; `note` only
// updates a thread-local number (const-initialised, no destructor: it never allocates).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: the caller's contract for `alloc` is the system allocator's.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        // SAFETY: `p` was allocated by this allocator, that is by `System`, with `l`.
        unsafe { System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` was allocated by this allocator, that is by `System`, with `l`.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The largest allocation an input of `n` bytes may cause: a few copies of it (re-encoding,
/// strings) and small bookkeeping, never what a length field inside it claims.
fn allowed(n: usize) -> usize {
    8 * n + (64 << 10)
}

fn cases() -> usize {
    std::env::var("DSPARK_FUZZ_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(20_000)
}

fn seed() -> u64 {
    std::env::var("DSPARK_FUZZ_SEED")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0x6473_7061_726b)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

const EDGE_U32: [u32; 10] = [
    0,
    1,
    2,
    31,
    32,
    0x7f,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    0x0100_0000,
];

/// One structure-aware mutation of `b` (`other` is a second input to splice with).
fn mutate(r: &mut XorShift, b: &mut Vec<u8>, other: &[u8]) {
    let len = b.len();
    match r.below(10) {
        0 if len > 0 => {
            let i = r.below(len);
            b[i] ^= 1 << r.below(8);
        }
        1 if len > 0 => {
            let i = r.below(len);
            b[i] = [0, 1, 2, 0x7f, 0x80, 0xfe, 0xff][r.below(7)];
        }
        2 if len >= 4 => {
            // A length field (or any word) set to an edge value, or to about the input's size.
            let i = r.below(len - 3);
            let v = match r.below(3) {
                0 => (len + r.below(3)).saturating_sub(1) as u32,
                _ => EDGE_U32[r.below(EDGE_U32.len())],
            };
            b[i..i + 4].copy_from_slice(&v.to_le_bytes());
        }
        3 if len >= 2 => {
            let i = r.below(len - 1);
            let v = [0u16, 1, 0xff, 0x7fff, 0xffff][r.below(5)];
            b[i..i + 2].copy_from_slice(&v.to_le_bytes());
        }
        4 => {
            let i = r.below(len + 1);
            let n = 1 + r.below(16);
            let mut ins = vec![0u8; n];
            r.fill(&mut ins);
            b.splice(i..i, ins);
        }
        5 if len > 0 => {
            let i = r.below(len);
            let n = 1 + r.below((len - i).min(16));
            b.drain(i..i + n);
        }
        6 => b.truncate(r.below(len + 1)),
        7 if len > 0 => {
            let i = r.below(len);
            let n = 1 + r.below((len - i).min(32));
            let copy = b[i..i + n].to_vec();
            let at = r.below(len + 1);
            b.splice(at..at, copy);
        }
        8 => {
            let cut = r.below(len + 1);
            let from = r.below(other.len() + 1);
            b.truncate(cut);
            b.extend_from_slice(&other[from..]);
        }
        _ if len > 0 => {
            let i = r.below(len);
            b[i] = b[i].wrapping_add(if r.below(2) == 0 { 1 } else { 255 });
        }
        _ => b.push(r.next_u64() as u8),
    }
}

/// Runs `DSPARK_FUZZ_CASES` inputs through target `name`.
fn fuzz(name: &str) {
    let target = fuzzing::target(name).expect("a target of dspark::internals::fuzzing");
    let n = if fuzzing::STATEFUL.contains(&name) {
        // A loopback connection per input: a twentieth of the inputs, at least 500.
        (cases() / 20).max(500.min(cases()))
    } else {
        cases()
    };
    let fixed = fuzzing::fixed_allocation(name);
    let run_seed = seed()
        ^ name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    let mut r = XorShift(run_seed | 1);
    let messages = fuzzing::is_message_target(name);
    let mut corpus: Vec<Vec<u8>> = (0..64).map(|_| fuzzing::sample(name, &mut r)).collect();
    let t0 = Instant::now();
    let mut peak_seen = 0usize;
    for case in 0..n {
        let input = match case % 8 {
            // Random bytes.
            0 => {
                let max = if r.below(8) == 0 { 4096 } else { 96 };
                let mut b = vec![0u8; r.below(max)];
                r.fill(&mut b);
                b
            }
            // A valid input (message targets: checked to round-trip while it is made).
            1 => {
                let s = if messages {
                    fuzzing::round_trip(name, &mut r)
                } else {
                    fuzzing::sample(name, &mut r)
                };
                let slot = r.below(corpus.len());
                corpus[slot] = s.clone();
                s
            }
            // Mutated inputs; some join the corpus, so that mutations pile up.
            _ => {
                let mut b = corpus[r.below(corpus.len())].clone();
                let other = corpus[r.below(corpus.len())].clone();
                for _ in 0..1 + r.below(4) {
                    mutate(&mut r, &mut b, &other);
                }
                if r.below(16) == 0 {
                    let slot = r.below(corpus.len());
                    corpus[slot] = b.clone();
                }
                b
            }
        };
        PEAK.with(|p| p.set(0));
        let res = catch_unwind(AssertUnwindSafe(|| target(&input)));
        let peak = PEAK.with(Cell::get);
        if let Err(e) = res {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!(
                "fuzz target {name} failed on case {case} (DSPARK_FUZZ_SEED={}): {why}\ninput: {}",
                seed(),
                hex(&input)
            );
        }
        assert!(
            peak <= allowed(input.len()) + fixed,
            "fuzz target {name} allocated {peak} bytes at once for a {}-byte input (case {case}, \
             DSPARK_FUZZ_SEED={}): {}",
            input.len(),
            seed(),
            hex(&input)
        );
        peak_seen = peak_seen.max(peak);
    }
    eprintln!(
        "fuzz {name}: {n} cases in {:.1} s, no failure (largest allocation {peak_seen} bytes)",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn fuzz_bootstrap_hello() {
    fuzz("bootstrap_hello");
}

#[test]
fn fuzz_bootstrap_peer_hello() {
    fuzz("bootstrap_peer_hello");
}

#[test]
fn fuzz_bootstrap_reply() {
    fuzz("bootstrap_reply");
}

#[test]
fn fuzz_bootstrap_proofs() {
    fuzz("bootstrap_proofs");
}

#[test]
fn fuzz_bootstrap_blobs() {
    fuzz("bootstrap_blobs");
}

#[test]
fn fuzz_frame_header() {
    fuzz("frame_header");
}

#[test]
fn fuzz_verbs_blob() {
    fuzz("verbs_blob");
}

#[test]
fn fuzz_verbs_words() {
    fuzz("verbs_words");
}

#[test]
fn fuzz_plan_cost_model() {
    fuzz("plan_cost_model");
}

#[test]
fn fuzz_config_env() {
    fuzz("config_env");
}

#[test]
fn fuzz_config_values() {
    fuzz("config_values");
}

#[test]
fn fuzz_setup_shm_offer() {
    fuzz("setup_shm_offer");
}

#[test]
fn fuzz_setup_verbs_offer() {
    fuzz("setup_verbs_offer");
}

#[test]
fn fuzz_setup_confirm() {
    fuzz("setup_confirm");
}

#[test]
fn fuzz_setup_seat() {
    fuzz("setup_seat");
}

#[test]
fn fuzz_shm_seg_info() {
    fuzz("shm_seg_info");
}

#[test]
fn fuzz_split_record() {
    fuzz("split_record");
}

#[test]
fn fuzz_tune_file() {
    fuzz("tune_file");
}

#[test]
fn fuzz_proc_files() {
    fuzz("proc_files");
}

#[test]
fn fuzz_tcp_frames() {
    fuzz("tcp_frames");
}

#[test]
fn fuzz_door_messages() {
    fuzz("door_messages");
}

#[test]
fn fuzz_store_replies() {
    fuzz("store_replies");
}

#[test]
fn fuzz_shm_ring() {
    fuzz("shm_ring");
}

#[test]
fn every_target_has_a_test_here() {
    let here = include_str!("fuzz.rs");
    for (name, _) in fuzzing::TARGETS {
        assert!(
            here.contains(&format!("fuzz(\"{name}\")")),
            "target {name} is not fuzzed in tests/fuzz.rs"
        );
    }
}

/// The allocation check catches what it is for: a decoder that sizes a buffer by a length
/// field before checking it against the input.
#[test]
fn the_allocation_check_sees_a_trusting_decoder() {
    let trusting = |b: &[u8]| {
        let n = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let v: Vec<u8> = Vec::with_capacity(n.min(1 << 30));
        std::hint::black_box(v);
    };
    PEAK.with(|p| p.set(0));
    trusting(&[0xff, 0xff, 0xff, 0x00]);
    assert!(PEAK.with(Cell::get) > allowed(4));
}

/// Found by the full run (case 189741 of config_values): a bracketed host with a blank at its
/// start splits to that host, which joined again is unbracketed, so the split trims it. Not a
/// bug in the parsers (such a host never resolves, and the error names it) but in the
/// property, which now leaves such hosts out; the parsers must still not panic on it.
#[test]
fn regression_bracketed_host_with_a_leading_blank() {
    let input = b"[ \x001]:8080";
    assert_eq!(
        dspark::config::split_host_port(std::str::from_utf8(input).unwrap()),
        Ok((" \u{0}1".to_string(), 8080))
    );
    fuzzing::config_values(input);
}

/// Found by target proc_files (case 16316 of the CI count): a `MemAvailable` of more KiB than
/// a `u64` holds in bytes overflowed `kib * 1024` in the shared-memory sizing (fixed: it is
/// unknown now, as an unreadable file is).
#[test]
fn regression_mem_available_overflow() {
    let input = b"\xa0MemTotal:       \x01\x00768000 kB\nMemAvailable:   12481475759600000000 20 4 30 10 -1\n";
    fuzzing::proc_files(input);
}
