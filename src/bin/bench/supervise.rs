//! The spawner's watch over the local ranks it started (`--ranks`), as mpirun and torchrun
//! keep theirs: it waits without waking while every rank runs, and once one has ended gives
//! the others a bounded time to end too — [`GRACE`] after a failure (they fail on their own
//! within their deadline when a peer is gone; a stopped rank never does), their deadline and
//! [`GRACE`] after a success — then ends the rest (SIGTERM with SIGCONT, which a stopped
//! process needs to act on it, then SIGKILL [`TERM_GRACE`] later), says which ranks it ended
//! and why, and exits non-zero. No rank outlives the spawner: each also dies with it
//! ([`die_with_parent`]), whatever ends the spawner (`timeout`, a SIGKILL).

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitid, Id, WaitPidFlag};
use nix::unistd::Pid;

/// How long the other ranks get once one has failed: a rank whose peer exited notices at
/// once (its connections close), one waiting for a stopped or stuck peer at its deadline, and
/// the ranks waiting for the same rank reach theirs within about the same moment. At most the
/// ranks' deadline (`DSPARK_TIMEOUT`) where that is shorter.
pub(crate) const GRACE: Duration = Duration::from_secs(5);

/// From SIGTERM (and SIGCONT) to SIGKILL.
pub(crate) const TERM_GRACE: Duration = Duration::from_secs(2);

/// After SIGKILL, how long the spawner waits for the kernel to end a rank (one in an
/// uninterruptible sleep ends when the sleep does) before it says so and leaves.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// The parent's pid, given to each spawned rank so that it can tell whether the parent that
/// spawned it is still there ([`die_with_parent`]).
pub(crate) const PARENT_ENV: &str = "DSPARK_BENCH_PARENT";

/// In a spawned rank: dies (SIGKILL) when the spawner does, so that a spawner ended by
/// `timeout`, Ctrl-C in another process group or SIGKILL leaves no rank running; and exits
/// at once when the spawner is already gone.
pub(crate) fn die_with_parent() -> Result<(), String> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)
        .map_err(|e| format!("cannot ask to die with the spawner (prctl): {e}"))?;
    // Set after the spawner may have died: then this process is already someone else's.
    let parent = std::env::var(PARENT_ENV).ok();
    let now = nix::unistd::getppid().as_raw().to_string();
    match parent {
        Some(p) if p != now => Err(format!(
            "the dspark-bench that spawned this rank (pid {p}) is gone"
        )),
        _ => Ok(()),
    }
}

/// The ranks' deadline as they read it (`DSPARK_TIMEOUT`, else the default): a rank still
/// running that much after another finished waits for nothing that will come.
fn rank_timeout() -> Duration {
    std::env::var("DSPARK_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
        .map_or(dspark::config::DEFAULT_TIMEOUT, Duration::from_secs_f64)
}

/// What a rank's process is doing now, from `/proc` (for the message when it is ended).
fn state_of(pid: u32) -> &'static str {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command's closing parenthesis.
    match stat
        .rsplit_once(')')
        .and_then(|(_, s)| s.trim().chars().next())
    {
        Some('T') => "stopped",
        Some('t') => "stopped by a debugger",
        Some('D') => "in an uninterruptible sleep",
        Some('Z') => "exiting",
        Some('R') => "running",
        Some(_) => "waiting",
        None => "state unknown",
    }
}

/// A signal's name (`SIGKILL`), else its number.
fn signal_name(sig: i32) -> String {
    Signal::try_from(sig).map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_string())
}

/// How a rank ended, for the messages: `None` when it exited 0.
pub(crate) fn ending(st: &ExitStatus) -> Option<String> {
    match (st.code(), st.signal()) {
        (Some(0), _) => None,
        (Some(c), _) => Some(format!("exited with status {c}")),
        (None, Some(s)) => Some(format!(
            "was killed by {}{}",
            signal_name(s),
            if st.core_dumped() {
                " (core dumped)"
            } else {
                ""
            }
        )),
        (None, None) => Some(format!("ended ({st})")),
    }
}

/// The spawner's exit code for a rank's end: its own code (2: wrong results or refused
/// arguments, as the rank says), 1 for a signal.
fn code_of(st: &ExitStatus) -> u8 {
    match st.code() {
        Some(0) => 0,
        Some(c) => c.clamp(1, 255) as u8,
        None => 1,
    }
}

/// Waits for the spawned ranks (rank r is `children[r]`) as the module says; returns the
/// spawner's exit code: the worst of the ranks' (0 when every rank exited 0), at least 1
/// when it had to end a rank.
pub(crate) fn supervise(mut children: Vec<Child>) -> u8 {
    let n = children.len();
    let (tx, rx) = mpsc::channel::<usize>();
    for (r, c) in children.iter().enumerate() {
        let pid = Pid::from_raw(c.id() as i32);
        let tx = tx.clone();
        // Each rank's end is awaited on a thread of its own, without reaping it (WNOWAIT):
        // its pid stays its own until `Child::wait` below, so a signal sent to a rank that
        // has just ended reaches no other process.
        let waiter = std::thread::Builder::new()
            .name(format!("rank {r} waiter"))
            .stack_size(64 << 10)
            .spawn(move || {
                while let Err(Errno::EINTR) =
                    waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT)
                {
                }
                let _ = tx.send(r);
            });
        if let Err(e) = waiter {
            eprintln!("dspark-bench: cannot watch rank {r} (a thread): {e}; ending the ranks");
            end_all(
                &mut children,
                &mut vec![None; n],
                "the spawner could not watch them",
            );
            return 1;
        }
    }
    drop(tx);
    let mut status: Vec<Option<ExitStatus>> = vec![None; n];
    let mut worst = 0u8;
    // The first rank to end, whether it failed, when; and by when the rest must have.
    let mut first: Option<(usize, bool, Instant)> = None;
    let mut deadline: Option<Instant> = None;
    // Ranks whose waiter returned while they ran (waitid failed; never seen): polled.
    let mut polled: Vec<usize> = Vec::new();
    while status.iter().any(Option::is_none) {
        let poll = (!polled.is_empty()).then(|| Instant::now() + Duration::from_millis(100));
        let wake = match (deadline, poll) {
            (Some(d), Some(p)) => Some(d.min(p)),
            (d, p) => d.or(p),
        };
        let got = match wake {
            None => rx.recv().ok(),
            Some(w) => match rx.recv_timeout(w.saturating_duration_since(Instant::now())) {
                Ok(r) => Some(r),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    // Every waiter has answered: only the polled ranks are left.
                    std::thread::sleep(w.saturating_duration_since(Instant::now()));
                    None
                }
            },
        };
        let mut ended = Vec::new();
        // A rank whose status cannot be had (ECHILD: the spawner inherited SIGCHLD ignored,
        // and the kernel reaped its ranks itself) has ended, as a failure: polling it again
        // would never end.
        let unknown = |r: usize, e: std::io::Error| {
            eprintln!("dspark-bench: rank {r} ended, its status unknown ({e}): taken as failed");
            ExitStatus::from_raw(1 << 8)
        };
        if let Some(r) = got {
            match children[r].try_wait() {
                Ok(Some(st)) => ended.push((r, st)),
                Ok(None) => polled.push(r),
                Err(e) => ended.push((r, unknown(r, e))),
            }
        }
        polled.retain(|&r| match children[r].try_wait() {
            Ok(Some(st)) => {
                ended.push((r, st));
                false
            }
            Ok(None) => true,
            Err(e) => {
                ended.push((r, unknown(r, e)));
                false
            }
        });
        for (r, st) in ended {
            let failed = !st.success();
            if let Some(how) = ending(&st) {
                // A rank that exits 2 has said why (wrong results, refused arguments).
                if st.code() != Some(2) {
                    eprintln!("dspark-bench: rank {r} {how}");
                }
            }
            worst = worst.max(code_of(&st));
            status[r] = Some(st);
            let now = Instant::now();
            let grace = GRACE.min(rank_timeout());
            match first {
                None => {
                    first = Some((r, failed, now));
                    deadline = Some(
                        now + if failed {
                            grace
                        } else {
                            rank_timeout() + grace
                        },
                    );
                }
                Some(_) if failed => deadline = deadline.map(|d| d.min(now + grace)),
                Some(_) => {}
            }
        }
        let lost = got.is_none() && wake.is_none();
        if lost || deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
    }
    if status.iter().any(Option::is_none) {
        let why = match first {
            Some((f, failed, at)) => format!(
                "it had not exited {:.1} s after rank {f} {}",
                at.elapsed().as_secs_f64(),
                if failed { "failed" } else { "finished" }
            ),
            None => "the spawner lost track of it".into(),
        };
        end_all(&mut children, &mut status, &why);
        worst = worst.max(1);
    }
    worst
}

/// Ends every rank still running: SIGTERM and SIGCONT, SIGKILL after [`TERM_GRACE`]; says for
/// each which signal ended it and `why`.
fn end_all(children: &mut [Child], status: &mut [Option<ExitStatus>], why: &str) {
    let running: Vec<usize> = (0..children.len())
        .filter(|&r| status[r].is_none())
        .collect();
    let states: Vec<&str> = running
        .iter()
        .map(|&r| state_of(children[r].id()))
        .collect();
    for &r in &running {
        let pid = Pid::from_raw(children[r].id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        // A stopped process acts on SIGTERM only once continued.
        let _ = kill(pid, Signal::SIGCONT);
    }
    let mut left = wait_until(children, status, &running, TERM_GRACE);
    if !left.is_empty() {
        for &r in &left {
            let _ = children[r].kill();
        }
        left = wait_until(children, status, &left, KILL_WAIT);
    }
    for (&r, state) in running.iter().zip(&states) {
        let pid = children[r].id();
        match &status[r] {
            Some(st) => eprintln!(
                "dspark-bench: ended rank {r} (pid {pid}, {state}): {why}; {}",
                match st.signal() {
                    Some(s) => format!("{} ended it", signal_name(s)),
                    None => format!("it {}", ending(st).unwrap_or_else(|| "exited 0".into())),
                }
            ),
            None if left.contains(&r) => eprintln!(
                "dspark-bench: rank {r} (pid {pid}, {}) is still there {} s after SIGKILL: {why}",
                state_of(pid),
                KILL_WAIT.as_secs()
            ),
            None => {}
        }
    }
}

/// Polls `ranks` until each has ended or `limit` has passed (the ranks are being ended: a
/// few milliseconds' polling costs nothing measured); returns those still running.
fn wait_until(
    children: &mut [Child],
    status: &mut [Option<ExitStatus>],
    ranks: &[usize],
    limit: Duration,
) -> Vec<usize> {
    let until = Instant::now() + limit;
    loop {
        for &r in ranks {
            if status[r].is_none() {
                if let Ok(Some(st)) = children[r].try_wait() {
                    status[r] = Some(st);
                }
            }
        }
        let left: Vec<usize> = ranks
            .iter()
            .copied()
            .filter(|&r| status[r].is_none())
            .collect();
        if left.is_empty() || Instant::now() >= until {
            return left;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
