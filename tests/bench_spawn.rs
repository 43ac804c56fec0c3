//! `dspark-bench --ranks N` as a spawner of local ranks, as mpirun and torchrun users expect
//! one to behave when a rank goes wrong: a stopped rank (SIGSTOP, a debugger) is ended a
//! bounded time after another rank failed, instead of holding the spawner forever (it did, until
//! `kill -CONT`); a rank killed by a signal is reported as such; and no rank outlives the
//! spawner, whatever ends it.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

#[path = "common/bench.rs"]
mod bench;
use bench::bench_cmd;

/// The ranks' deadline: how long rank 0 waits for a stopped peer before it fails.
const TIMEOUT_S: u64 = 3;

/// How long the spawner may take, from the stop to its exit: the ranks' deadline, the
/// spawner's grace (at most the deadline) and its SIGTERM-to-SIGKILL 2 s, with ample room for
/// a loaded 2-core machine running a debug build. It waited forever before.
const BOUND: Duration = Duration::from_secs(45);

/// A spawner started by a test, with its ranks once they are up: every process is SIGKILLed
/// on drop when the test fails midway, so that no test leaves one behind.
struct Job {
    spawner: Child,
    /// Each rank's pid and start time.
    ranks: Vec<(u32, u64)>,
    stdout: mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl Job {
    /// `dspark-bench --ranks 2` timing 8-byte all_reduces for far longer than a test runs,
    /// once rank 0 has printed the column header (both ranks are up and in the timed loop).
    fn start() -> Job {
        let mut spawner = bench_cmd()
            .args(["--ranks", "2", "-b", "8", "-e", "8", "-w", "1", "-c", "0"])
            .args(["-n", "1000000000", "--transport", "shm"])
            .env("DSPARK_TIMEOUT", TIMEOUT_S.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("dspark-bench starts");
        let (tx, stdout) = mpsc::channel();
        let out = spawner.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut err = spawner.stderr.take().expect("stderr");
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let mut job = Job {
            spawner,
            ranks: Vec::new(),
            stdout,
            stderr,
        };
        let until = Instant::now() + Duration::from_secs(120);
        let mut seen = String::new();
        loop {
            match job
                .stdout
                .recv_timeout(until.saturating_duration_since(Instant::now()))
            {
                Ok(line) if line.contains("#wrong") => break,
                Ok(line) => seen += &(line + "\n"),
                Err(_) => {
                    let _ = job.spawner.kill();
                    let _ = job.spawner.wait();
                    panic!("no column header within 120 s: {seen}");
                }
            }
        }
        job.ranks = ranks_of(job.spawner.id());
        assert_eq!(
            job.ranks.len(),
            2,
            "the spawner's children: {:?}",
            job.ranks
        );
        job
    }

    /// Waits up to [`BOUND`] for the spawner to exit; its exit code (`None`: a signal) and
    /// stderr, and how long it took.
    fn finish(mut self) -> (Option<i32>, String, Duration) {
        let t0 = Instant::now();
        let code = loop {
            if let Some(st) = self.spawner.try_wait().expect("try_wait") {
                break st.code();
            }
            if t0.elapsed() > BOUND {
                // The old spawner: still waiting for the stopped rank.
                panic!(
                    "the spawner has not exited {} s on; its ranks: {:?}",
                    BOUND.as_secs(),
                    self.ranks
                        .iter()
                        .map(|&(p, _)| (p, state(p)))
                        .collect::<Vec<_>>()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let took = t0.elapsed();
        let spawner = std::mem::replace(&mut self.stderr, std::thread::spawn(String::new));
        (code, spawner.join().unwrap_or_default(), took)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Only processes this test started (a pid reused since is left alone).
        for r in &self.ranks {
            if same(r) {
                let _ = kill(Pid::from_raw(r.0 as i32), Signal::SIGKILL);
            }
        }
        let _ = self.spawner.kill();
        let _ = self.spawner.wait();
    }
}

/// The pids of `parent`'s ranks, in rank order (their `DSPARK_RANK`).
fn ranks_of(parent: u32) -> Vec<(u32, u64)> {
    let mut ranks: Vec<(usize, (u32, u64))> = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| {
            let (ppid, start) = stat(p)?;
            if ppid != parent {
                return None;
            }
            let env = std::fs::read(format!("/proc/{p}/environ")).ok()?;
            let rank = env
                .split(|&b| b == 0)
                .find_map(|kv| kv.strip_prefix(b"DSPARK_RANK="))
                .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())?;
            Some((rank, (p, start)))
        })
        .collect();
    ranks.sort_unstable();
    ranks.into_iter().map(|(_, p)| p).collect()
}

/// A process's parent and start time (`/proc/PID/stat` fields 4 and 22).
fn stat(pid: u32) -> Option<(u32, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
    Some((f.get(1)?.parse().ok()?, f.get(19)?.parse().ok()?))
}

/// Whether `(pid, start)` is still that process (not a pid reused since).
fn same(&(pid, start): &(u32, u64)) -> bool {
    stat(pid).is_some_and(|(_, s)| s == start)
}

/// A process's state letter (`R`, `S`, `T`, `Z`), or `gone`.
fn state(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s.rsplit_once(')')?.1.trim().chars().next()?.to_string()))
        .unwrap_or_else(|| "gone".into())
}

/// Whether a rank has ended: gone, or a zombie its new parent has not reaped yet (a
/// container's pid 1 may never reap it).
fn ended(pid: u32) -> bool {
    matches!(state(pid).as_str(), "gone" | "Z" | "X")
}

/// A rank stopped in the middle of the timed calls: rank 0 fails at its deadline, and the
/// spawner, which waited for the stopped rank forever, ends it a bounded time later, says
/// which rank it ended and why, exits non-zero, and leaves no rank behind.
#[test]
fn a_stopped_rank_is_ended_and_the_spawner_exits_non_zero() {
    let job = Job::start();
    let (r0, r1) = (job.ranks[0].0, job.ranks[1].0);
    kill(Pid::from_raw(r1 as i32), Signal::SIGSTOP).expect("SIGSTOP rank 1");
    let (code, err, took) = job.finish();
    assert!(matches!(code, Some(c) if c != 0), "exit {code:?}: {err}");
    assert!(err.contains("rank 0 exited with status 1"), "{err}");
    assert!(
        err.contains("ended rank 1") && err.contains("stopped") && err.contains("rank 0 failed"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    for p in [r0, r1] {
        assert!(
            ended(p),
            "rank pid {p} is still there ({}): {err}",
            state(p)
        );
    }
    eprintln!("the spawner exited {took:?} after the stop");
}

/// A rank killed by a signal (here rank 0, the one that prints the table) is reported as
/// killed by that signal; the other fails on its own or is ended, and the spawner exits
/// non-zero within the bound.
#[test]
fn a_rank_killed_by_a_signal_is_reported_as_such() {
    let job = Job::start();
    let (r0, r1) = (job.ranks[0].0, job.ranks[1].0);
    kill(Pid::from_raw(r0 as i32), Signal::SIGKILL).expect("SIGKILL rank 0");
    let (code, err, _) = job.finish();
    assert!(matches!(code, Some(c) if c != 0), "exit {code:?}: {err}");
    assert!(err.contains("rank 0 was killed by SIGKILL"), "{err}");
    for p in [r0, r1] {
        assert!(
            ended(p),
            "rank pid {p} is still there ({}): {err}",
            state(p)
        );
    }
}

/// The spawner ended from outside (SIGTERM to it alone, as `kill PID` sends; a SIGKILL alike)
/// takes its ranks with it: they ran on, timing, for as long as their iterations lasted.
#[test]
fn the_ranks_die_with_the_spawner() {
    let mut job = Job::start();
    let ranks: Vec<u32> = job.ranks.iter().map(|r| r.0).collect();
    // One rank stopped too: SIGKILL reaches a stopped process.
    kill(Pid::from_raw(ranks[1] as i32), Signal::SIGSTOP).expect("SIGSTOP rank 1");
    kill(Pid::from_raw(job.spawner.id() as i32), Signal::SIGTERM).expect("SIGTERM");
    let _ = job.spawner.wait();
    let until = Instant::now() + Duration::from_secs(20);
    while !ranks.iter().all(|&p| ended(p)) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    for &p in &ranks {
        assert!(ended(p), "rank pid {p} outlived its spawner ({})", state(p));
    }
}
