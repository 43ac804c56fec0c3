//! How a drive loop paces itself and how it ends a pass. While steps move it passes again at
//! once; when nothing moves it spins for [`EngineOptions::spin`], then blocks in the transport,
//! never past the call's deadline nor so long that an abort from another thread goes
//! unnoticed. A call that runs out of time fails with an error that says what its schedule was
//! waiting for. Both drive loops, the host's and the device's, end every pass that left steps
//! to do through [`Engine::end_pass`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::frame::Desc;
use super::scratch::Scratch;
use super::{trace, Engine, EngineOptions};
use crate::error::{Error, Result};
use crate::plan::Program;

/// What a drive loop does after a pass over its steps.
pub(super) enum Pace {
    /// Pass again at once (something moved, or still within the spin time).
    Again,
    /// Nothing moved for the spin time: block until something may.
    Block,
    /// The call's deadline passed; it has run this long.
    TimedOut(Duration),
    /// [`Engine::abort_flag`] was raised (from another thread): stop now.
    Aborted,
}

/// The longest a drive loop blocks in [`Transport::wait`] before it looks at the abort flag
/// again: an abort from another thread is noticed within this (plus one pass).
///
/// [`Transport::wait`]: crate::transport::Transport::wait
const ABORT_POLL: Duration = Duration::from_millis(50);

/// While spinning without yielding, [`Pacer::after_pass`] reads the clock once per this many
/// idle passes (a pass is tens of ns: the spin time is still kept to well under a µs).
const CLOCK_EVERY: u32 = 16;

/// Spin-then-block pacing of a drive loop, and its deadline.
pub(super) struct Pacer {
    start: Instant,
    deadline: Instant,
    spin: Duration,
    yield_while_spinning: bool,
    idle_since: Option<Instant>,
    idle_passes: u32,
    busy_rounds: u64,
}

impl Pacer {
    /// A pacer for a call that started at `start` and must end by `deadline`. It holds no
    /// reference to the abort flag, which [`Pacer::after_pass`] is handed: cloning its `Arc`
    /// per call was a locked add (and a locked sub at the drop) — full fences that waited for
    /// the one-shot contribution's cache line to leave this core, measured at a third of an
    /// 8-byte all_reduce's own time.
    pub(super) fn new(opts: &EngineOptions, start: Instant, deadline: Instant) -> Self {
        Pacer {
            start,
            deadline,
            spin: opts.spin,
            yield_while_spinning: opts.yield_while_spinning,
            idle_since: None,
            idle_passes: 0,
            busy_rounds: 0,
        }
    }

    /// How long the next [`Transport::wait`] may block: until the deadline, but never so
    /// long that an abort goes unnoticed.
    ///
    /// [`Transport::wait`]: crate::transport::Transport::wait
    pub(super) fn wait_until(&self) -> Instant {
        self.deadline.min(Instant::now() + ABORT_POLL)
    }

    /// The pacing of the pass that just ended (`moved`: whether any step progressed; `abort`:
    /// the engine's [`Engine::abort_flag`]).
    pub(super) fn after_pass(&mut self, moved: bool, abort: &AtomicBool) -> Pace {
        if moved {
            self.idle_since = None;
            // A peer trickling bytes must not keep a call alive past its deadline either.
            self.busy_rounds += 1;
            if self.busy_rounds.is_multiple_of(256) {
                if abort.load(Ordering::Relaxed) {
                    return Pace::Aborted;
                }
                if Instant::now() >= self.deadline {
                    return Pace::TimedOut(self.start.elapsed());
                }
            }
            return Pace::Again;
        }
        if abort.load(Ordering::Relaxed) {
            return Pace::Aborted;
        }
        // While spinning, the clock is read every `CLOCK_EVERY` idle passes: a read took 12%
        // of an 8-byte all_reduce's samples when every pass read it, and delays the pass that
        // finds the data (the spin time and the deadline are coarse by a few hundred ns).
        if self.idle_since.is_some() && !self.yield_while_spinning {
            self.idle_passes = self.idle_passes.wrapping_add(1);
            if !self.idle_passes.is_multiple_of(CLOCK_EVERY) {
                std::hint::spin_loop();
                return Pace::Again;
            }
        }
        let now = Instant::now();
        if now >= self.deadline {
            return Pace::TimedOut(now - self.start);
        }
        let idle = *self.idle_since.get_or_insert(now);
        if now - idle < self.spin {
            if self.yield_while_spinning {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            return Pace::Again;
        }
        Pace::Block
    }
}

impl Engine {
    /// Ends a pass of a drive loop that left steps to do (`moved`: whether any progressed): by
    /// [`Pacer`]'s verdict, returns at once for another pass, fails the call with the timeout
    /// error ([`Engine::timeout_error`]) or the abort's, or — nothing moved for the spin time —
    /// blocks in [`Transport::wait`] on the peers whose head steps may progress, until the
    /// deadline at most and never longer than [`ABORT_POLL`] (traced in the `waits` lane).
    /// `device_busy`: device work is in flight, whose completions are not file descriptors and
    /// take microseconds: yield the CPU and pass again instead of blocking.
    ///
    /// The tail of both drive loops, the host's and the device's ([`super::staged`]).
    ///
    /// [`Transport::wait`]: crate::transport::Transport::wait
    pub(super) fn end_pass(
        &mut self,
        pacer: &mut Pacer,
        moved: bool,
        prog: &Program,
        desc: &Desc,
        s: &mut Scratch,
        device_busy: bool,
    ) -> Result<()> {
        match pacer.after_pass(moved, &self.abort) {
            Pace::Again => return Ok(()),
            Pace::TimedOut(waited) => return Err(self.timeout_error(prog, desc, s, waited)),
            Pace::Aborted => return Err(self.aborted_error(desc.op_name())),
            Pace::Block => {}
        }
        if device_busy {
            std::thread::yield_now();
            return Ok(());
        }
        s.collect_interest(prog);
        let t0 = self.trace.is_some().then(Instant::now);
        self.transport.wait(&s.interest, pacer.wait_until())?;
        if let (Some(t), Some(t0)) = (self.trace.as_mut(), t0) {
            let peers: Vec<String> = s.interest.iter().map(|i| i.peer.to_string()).collect();
            let args = [("peers", format!("[{}]", peers.join(",")))];
            t.span(
                trace::Lane::Waits,
                "wait",
                "wait",
                t0,
                Instant::now(),
                &args,
            );
        }
        Ok(())
    }

    /// The error of a call that timed out after `waited`: which peer the schedule was waiting
    /// for, in which step and how far, or that it stalled (an internal error).
    fn timeout_error(&self, prog: &Program, desc: &Desc, s: &Scratch, waited: Duration) -> Error {
        let ready = |i: u32| prog.deps(i as usize).iter().all(|&d| s.done[d as usize]);
        let total = prog.steps.len();
        let done = s.done.iter().filter(|&&d| d).count();
        let mut peer = None;
        let mut detail = String::new();
        for &p in &s.active {
            if let Some(&i) = s.recvq[p].front().filter(|&&i| ready(i)) {
                peer = Some(p);
                let got = s.recv_prog[p].got;
                detail = format!(
                    "waiting to receive from rank {p} (step {} of {total}, {got} of {} bytes \
                     received; {done} steps done)",
                    i + 1,
                    prog.steps[i as usize].op.len() * desc.dtype.size(),
                );
                break;
            }
        }
        if peer.is_none() {
            for &p in &s.active {
                if let Some(&i) = s.sendq[p].front().filter(|&&i| ready(i)) {
                    peer = Some(p);
                    detail = format!(
                        "waiting to send to rank {p} (step {} of {total}): it is not reading",
                        i + 1
                    );
                    break;
                }
            }
        }
        if peer.is_none() {
            detail = format!("schedule stalled with {done} of {total} steps done (internal error)");
        }
        Error::Timeout {
            rank: self.rank,
            peer,
            op: format!("{} #{}", desc.coll.name(), desc.seq),
            waited,
            detail,
        }
    }
}
