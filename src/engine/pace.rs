//! How a drive loop paces itself and how it ends a pass. While steps move it passes again at
//! once; when nothing moves it spins ([`EngineOptions::spin`], grown by [`Spin`] after a wait
//! that slept and was woken soon after), then blocks in the transport,
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

/// The longest the spin grows to ([`Spin`]).
pub const ADAPTED_SPIN_MAX: Duration = Duration::from_millis(2);

/// Whether an engine configured with spin `base` adapts it ([`Spin`]): not for 0 (never
/// spin), nor for a spin already as long as [`ADAPTED_SPIN_MAX`].
pub fn spin_adapts(base: Duration) -> bool {
    !base.is_zero() && base < ADAPTED_SPIN_MAX
}

/// The spin time of an engine's next wait: the configured one
/// ([`EngineOptions::spin`]), grown after a wait that slept and was woken soon after.
///
/// Why: where waking a sleeping rank takes longer than the spin (an idle vCPU on a virtual
/// machine: measured 40–500 µs here against the 50 µs spin), two ranks that fell out of step
/// once keep each other asleep — each sleeps while the other is being woken, and every call
/// then costs a wake-up (fresh 2-rank runs over shm at 8 B: 184 µs a call in 1 of 12,
/// against 0.25 µs; with a 1–5 µs spin, every run). A wait that slept and still ended within
/// [`ADAPTED_SPIN_MAX`] twice over would have been caught by spinning; the next waits spin
/// twice its length (at most [`ADAPTED_SPIN_MAX`]), which outlasts the other rank's
/// wake-up and puts the pair back in step within two calls. Past the configured spin they
/// yield the CPU at every pass ([`Pacer::after_pass`]): a busy spin of milliseconds held the
/// core that a peer needed where ranks shared cores unnoticed (benches/link_bed.sh, 4 ranks on
/// 2 cores before setup counted ranks per kernel, `crowd.rs`: a 1 KiB all_reduce 2.1 ms
/// instead of 90 µs); yielding, 71 µs. Each
/// call that did not sleep gives back an eighth of the excess, so a spin of 2 ms is back
/// near the configured one after some 50 calls. A configured spin of 0 (never spin) stays 0.
///
/// The cost: any wait that slept and ended within 4 ms teaches it, also one for a peer that
/// was simply late or for bytes slow on a wire (a 512 KiB segment at 4 Gbit/s takes ~1 ms), so
/// for some 50 calls after such a wait a rank polls, yielding, for up to 2 ms where it used to
/// sleep: CPU time, not other threads' progress (the yield hands the core to any of them;
/// measured on the DDP bed, 1 rank per core with its progress thread: 87.7% scaling against
/// 88.5% before, within that bed's spread).
#[derive(Clone, Copy, Debug)]
pub(super) struct Spin {
    base: Duration,
    now: Duration,
}

impl Spin {
    pub(super) fn new(base: Duration) -> Self {
        Spin { base, now: base }
    }

    /// The spin time of the next wait.
    pub(super) fn now(&self) -> Duration {
        self.now
    }

    /// Learns from a finished call: `slept_wait` is its longest wait that slept
    /// ([`Pacer::finish`]), `None` when none did.
    pub(super) fn learn(&mut self, slept_wait: Option<Duration>) {
        match slept_wait {
            Some(w) if spin_adapts(self.base) && w <= 2 * ADAPTED_SPIN_MAX => {
                self.now = (2 * w).clamp(self.base, ADAPTED_SPIN_MAX);
            }
            _ => {
                let excess = self.now.saturating_sub(self.base);
                self.now = if excess < Duration::from_micros(1) {
                    self.base
                } else {
                    self.now - excess / 8
                };
            }
        }
    }
}

/// Spin-then-block pacing of a drive loop, and its deadline.
pub(super) struct Pacer {
    /// The call's start and deadline; `None` until the first clock read of a pacer made by
    /// [`Pacer::lazy`].
    clock: Option<(Instant, Instant)>,
    /// The call's timeout, for a lazy pacer's deadline.
    timeout: Duration,
    spin: Duration,
    /// The configured spin ([`EngineOptions::spin`]): spinning past it yields at every pass.
    base_spin: Duration,
    yield_while_spinning: bool,
    /// This wait has spun past `base_spin`: every pass reads the clock and yields.
    yielding: bool,
    idle_since: Option<Instant>,
    idle_passes: u32,
    busy_rounds: u64,
    /// The current wait has blocked (slept in the transport) at least once.
    blocked: bool,
    /// The longest wait (idle time until something moved) that blocked.
    slept_wait: Option<Duration>,
}

impl Pacer {
    /// A pacer for a call that started at `start` and must end by `deadline`. It holds no
    /// reference to the abort flag, which [`Pacer::after_pass`] is handed: cloning its `Arc`
    /// per call was a locked add (and a locked sub at the drop) — full fences that waited for
    /// the one-shot contribution's cache line to leave this core, measured at a third of an
    /// 8-byte all_reduce's own time.
    ///
    /// `spin`: how long to spin before blocking ([`Spin::now`]).
    pub(super) fn new(
        opts: &EngineOptions,
        spin: Duration,
        start: Instant,
        deadline: Instant,
    ) -> Self {
        let timeout = deadline.saturating_duration_since(start);
        Pacer {
            clock: Some((start, deadline)),
            ..Pacer::lazy(opts, spin, timeout)
        }
    }

    /// A pacer for a call that found nothing to do and has not read the clock: its start
    /// (and idle time) begins at its first clock read, [`CLOCK_EVERY`] idle passes later
    /// when it does not yield (a few hundred ns), and its deadline is `timeout` after that.
    /// The one-shot all_reduce waits this way: its call is stamped by the coarse clock
    /// ([`crate::time::coarse_ns`]), and a precise read before the first re-poll cost ~22 ns
    /// on this VM, an eighth of an 8-byte call.
    pub(super) fn lazy(opts: &EngineOptions, spin: Duration, timeout: Duration) -> Self {
        Pacer {
            clock: None,
            timeout,
            spin,
            base_spin: opts.spin,
            yield_while_spinning: opts.yield_while_spinning,
            yielding: false,
            idle_since: None,
            idle_passes: 0,
            busy_rounds: 0,
            blocked: false,
            slept_wait: None,
        }
    }

    /// At the call's end: the longest wait of this call that blocked, from its first idle
    /// pass until something moved (the last one included), for [`Spin::learn`]; `None` when
    /// no wait blocked.
    pub(super) fn finish(&mut self) -> Option<Duration> {
        self.end_wait();
        self.slept_wait
    }

    /// Something moved: the wait (if any) is over; one that blocked is remembered.
    fn end_wait(&mut self) {
        if std::mem::take(&mut self.blocked) {
            if let Some(idle) = self.idle_since {
                let w = idle.elapsed();
                self.slept_wait = Some(self.slept_wait.map_or(w, |s| s.max(w)));
            }
        }
        self.idle_since = None;
        self.yielding = false;
    }

    /// How long the next [`Transport::wait`] may block: until the deadline, but never so
    /// long that an abort goes unnoticed.
    ///
    /// [`Transport::wait`]: crate::transport::Transport::wait
    pub(super) fn wait_until(&self) -> Instant {
        let poll = Instant::now() + ABORT_POLL;
        self.clock.map_or(poll, |(_, deadline)| deadline.min(poll))
    }

    /// The pacing of the pass that just ended (`moved`: whether any step progressed; `abort`:
    /// the engine's [`Engine::abort_flag`]).
    pub(super) fn after_pass(&mut self, moved: bool, abort: &AtomicBool) -> Pace {
        if moved {
            self.end_wait();
            // A peer trickling bytes must not keep a call alive past its deadline either.
            self.busy_rounds += 1;
            if self.busy_rounds.is_multiple_of(256) {
                if abort.load(Ordering::Relaxed) {
                    return Pace::Aborted;
                }
                if let Some((start, deadline)) = self.clock {
                    if Instant::now() >= deadline {
                        return Pace::TimedOut(start.elapsed());
                    }
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
        let idle = self.idle_since.is_some() || self.clock.is_none();
        if idle && !self.yield_while_spinning && !self.yielding {
            self.idle_passes = self.idle_passes.wrapping_add(1);
            if !self.idle_passes.is_multiple_of(CLOCK_EVERY) {
                std::hint::spin_loop();
                return Pace::Again;
            }
        }
        let now = Instant::now();
        let timeout = self.timeout;
        let (start, deadline) = *self
            .clock
            .get_or_insert_with(|| (now, crate::time::deadline(now, timeout)));
        if now >= deadline {
            return Pace::TimedOut(now - start);
        }
        let idle = *self.idle_since.get_or_insert(now);
        if now - idle < self.spin {
            // Past the configured spin (the part [`Spin`] added), the CPU is offered to
            // whoever else wants it at every pass: a peer on this core (ranks that outnumber
            // the cores unnoticed, as on benches/link_bed.sh) runs, and the rank stays awake
            // without holding the core the way a busy spin of up to 2 ms would.
            if self.yield_while_spinning || now - idle >= self.base_spin {
                self.yielding = true;
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            return Pace::Again;
        }
        Pace::Block
    }

    /// The caller is about to sleep in the transport ([`Pace::Block`]): the wait that ends at
    /// the next move counts for [`Spin::learn`]. (A drive loop with device work in flight
    /// yields instead of sleeping, and does not call this.)
    pub(super) fn sleeping(&mut self) {
        self.blocked = true;
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
        pacer.sleeping();
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

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn a_wait_that_slept_and_ended_soon_doubles_into_the_spin_up_to_the_cap() {
        let mut s = Spin::new(50 * US);
        s.learn(Some(300 * US));
        assert_eq!(s.now(), 600 * US);
        s.learn(Some(3 * ADAPTED_SPIN_MAX / 2));
        assert_eq!(s.now(), ADAPTED_SPIN_MAX);
        // Shorter than the configured spin: never below it.
        s.learn(Some(10 * US));
        assert_eq!(s.now(), 50 * US);
    }

    #[test]
    fn a_long_sleep_teaches_nothing_and_calls_without_sleep_give_the_excess_back() {
        let mut s = Spin::new(50 * US);
        s.learn(Some(10 * ADAPTED_SPIN_MAX));
        assert_eq!(
            s.now(),
            50 * US,
            "a peer that long late was rightly slept on"
        );
        s.learn(Some(ADAPTED_SPIN_MAX));
        let mut last = s.now();
        assert_eq!(last, ADAPTED_SPIN_MAX);
        let mut calls = 0;
        while s.now() > 50 * US {
            s.learn(None);
            assert!(s.now() < last, "shrinks every call");
            last = s.now();
            calls += 1;
        }
        assert_eq!(s.now(), 50 * US);
        assert!(
            (30..80).contains(&calls),
            "{calls} calls back to the configured spin"
        );
    }

    #[test]
    fn a_configured_spin_above_the_cap_or_of_zero_stays() {
        let mut never = Spin::new(Duration::ZERO);
        never.learn(Some(100 * US));
        assert_eq!(never.now(), Duration::ZERO);
        let mut long = Spin::new(10 * ADAPTED_SPIN_MAX);
        long.learn(Some(100 * US));
        assert_eq!(long.now(), 10 * ADAPTED_SPIN_MAX);
    }

    #[test]
    fn the_pacer_reports_only_the_waits_that_blocked() {
        let opts = EngineOptions::default();
        let abort = AtomicBool::new(false);
        let now = Instant::now();
        let far = now + Duration::from_secs(60);
        // Spins without blocking, then moves: no slept wait.
        let mut p = Pacer::new(&opts, Duration::from_secs(1), now, far);
        assert!(matches!(p.after_pass(false, &abort), Pace::Again));
        assert!(matches!(p.after_pass(true, &abort), Pace::Again));
        assert_eq!(p.finish(), None);
        // A zero spin blocks at the first idle pass; a wait counts once the caller sleeps
        // (`sleeping`), and ends at the next move, or at the call's end when its last step
        // completes without another pass.
        let mut p = Pacer::new(&opts, Duration::ZERO, now, far);
        assert!(matches!(p.after_pass(false, &abort), Pace::Block));
        assert!(matches!(p.after_pass(true, &abort), Pace::Again));
        assert_eq!(p.finish(), None, "blocked, but yielded instead of sleeping");
        assert!(matches!(p.after_pass(false, &abort), Pace::Block));
        p.sleeping();
        std::thread::sleep(Duration::from_millis(2));
        assert!(matches!(p.after_pass(true, &abort), Pace::Again));
        let first = p.finish().expect("a slept wait");
        assert!(first >= Duration::from_millis(2));
        assert!(matches!(p.after_pass(false, &abort), Pace::Block));
        p.sleeping();
        std::thread::sleep(Duration::from_millis(20));
        let longest = p.finish().expect("slept waits");
        assert!(
            longest >= Duration::from_millis(20) && longest >= first,
            "the longest, the open one included: {longest:?} after {first:?}"
        );
    }
}
