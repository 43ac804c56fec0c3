//! The operation queue of a communicator, its progress thread, and [`Work`] handles.
//!
//! Every operation of a communicator — blocking or not, from any thread — runs in the order it
//! was issued, on one engine. Whoever holds the *driver role* runs queued operations, one at a
//! time, on its own thread: the communicator's progress thread (so that operations progress
//! while the caller computes), a thread that waits for a [`Work`] it issued and finds nobody
//! driving (no hand-off latency), or a blocking call, which first runs whatever is queued
//! ahead of it and then its own operation on the caller's thread with borrowed buffers, as a
//! call without a queue would.
//!
//! Abort (`Shared::abort`, behind [`Communicator::abort`](crate::Communicator::abort)) raises a flag that the running operation looks at while it
//! waits; then every queued and later operation fails at once with the same error.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::engine::Engine;
use crate::error::{Error, Result};

/// How long a thread waiting for an operation that another thread drives polls for it before
/// it sleeps. A small operation usually completes within this, and polling saves the
/// sleep/wake-up pair (two system calls and a context switch, several µs) on every
/// non-blocking call that is waited for at once — the per-call cost of the non-blocking path.
const SPIN_WAIT: Duration = Duration::from_micros(50);

/// Polls between two yields (and clock reads) of that spin.
const SPIN_POLLS_PER_YIELD: u32 = 64;

/// While operations were issued within the last `WATCH_FOR`, the progress thread does not
/// sleep until woken: it looks at the queue every `WATCH_PERIOD`, and issuing an operation
/// wakes nobody. A caller that waits at once then runs its operation itself, as a blocking
/// call does, without the two wake-ups and context switches (several µs each on a virtual
/// machine) that handing it to the progress thread and back costs; an operation overlapped
/// with computation starts at most `WATCH_PERIOD` late. After `WATCH_FOR` without an
/// operation the thread sleeps until the next one wakes it, which then starts at once.
const WATCH_PERIOD: Duration = Duration::from_micros(100);
const WATCH_FOR: Duration = Duration::from_millis(5);

/// [`Shared::state`]: someone holds the driver role (and so the engine).
const DRIVING: u32 = 1;
/// [`Shared::state`]: the driver must give the role up through the queue's lock
/// ([`Shared::release`]'s slow path), because operations are queued, a thread waits for the
/// role, the communicator shuts down or aborts. Set under the queue's lock by whoever makes it
/// so; cleared there by a releasing driver once none of it holds.
const ATTENTION: u32 = 2;

/// An operation, run by whoever holds the driver role.
pub(crate) type Task = Box<dyn FnOnce(&mut Engine) -> Result<()> + Send>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Tasks run under catch_unwind, so a poisoned lock only means a panic between two
    // statements of this module that touch no shared invariant. (A panic while the engine
    // is held fails the communicator: see `Role`'s drop.)
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The error a communicator fails with after a panic inside one of its operations; `call`:
/// the call in progress, as the flight recorder has it ([`Shared::in_progress`]).
fn panicked(rank: usize, call: Option<(String, Duration)>) -> Error {
    Error::Transport {
        rank: Some(rank),
        peer: None,
        op: call.map_or_else(|| "collective".into(), |(name, _)| name),
        what: "internal error: a panic inside the operation (a dspark bug; please report it); \
               the communicator is unusable"
            .into(),
    }
}

/// The completion of one queued operation.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    /// Set (after `state.result`) once complete: polled without the lock by `test` and by a
    /// waiter's spin.
    ready: AtomicBool,
    state: Mutex<Outcome>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct Outcome {
    result: Option<Result<()>>,
    /// Threads blocked in `wait_until` (the finisher makes no wake-up call without one).
    sleepers: usize,
}

impl Completion {
    fn finish(&self, r: Result<()>) {
        let mut st = lock(&self.state);
        st.result = Some(r);
        self.ready.store(true, Ordering::Release);
        if st.sleepers > 0 {
            self.cv.notify_all();
        }
    }

    /// The result, once complete.
    pub(crate) fn get(&self) -> Option<Result<()>> {
        if !self.ready.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.state).result.clone()
    }

    /// Polls for completion for at most `SPIN_WAIT` (or until `until`), yielding the CPU
    /// between polls so that a driver on the same core keeps running. `true` once complete.
    fn spin(&self, until: Option<Instant>) -> bool {
        let start = Instant::now();
        let end = match until {
            Some(t) => t.min(start + SPIN_WAIT),
            None => start + SPIN_WAIT,
        };
        let mut polls = 0u32;
        loop {
            if self.ready.load(Ordering::Acquire) {
                return true;
            }
            polls += 1;
            if polls.is_multiple_of(SPIN_POLLS_PER_YIELD) {
                if Instant::now() >= end {
                    return false;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Blocks until complete or `until` (then `None`). Without `until` it waits for the
    /// operation itself, which ends by its own deadline.
    fn wait_until(&self, until: Option<Instant>) -> Option<Result<()>> {
        let mut st = lock(&self.state);
        loop {
            if let Some(r) = st.result.as_ref() {
                return Some(r.clone());
            }
            st.sleepers += 1;
            st = match until {
                None => self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(t) => {
                    let left = t.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        st.sleepers -= 1;
                        return None;
                    }
                    self.cv
                        .wait_timeout(st, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
            st.sleepers -= 1;
        }
    }
}

struct Job {
    task: Task,
    timeout: Option<Duration>,
    done: Arc<Completion>,
    /// What it is and when it was issued (the flight record's queued entries).
    what: &'static str,
    issued: Instant,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// The progress thread sleeps until woken (not watching the queue).
    progress_sleeping: bool,
    /// When the last operation was queued (the progress thread watches the queue for
    /// `WATCH_FOR` after it).
    last_submit: Option<Instant>,
    /// Threads waiting for the driver role (blocking calls, closing).
    role_waiters: usize,
    /// The communicator is being dropped: the progress thread drains the queue and exits.
    shutdown: bool,
}

impl Queue {
    /// The operations queued (not started): what each is and when it was issued, for the
    /// flight record.
    fn queued(&self) -> Vec<(&'static str, Instant)> {
        self.jobs.iter().map(|j| (j.what, j.issued)).collect()
    }
}

/// A communicator's engine, the queue in front of it and the driver role.
pub(crate) struct Shared {
    rank: usize,
    /// Locked only by the holder of the driver role, who gives it back before the role, so
    /// never contended: a lock whose release is a plain store (std's is a locked exchange,
    /// which looks for sleepers).
    engine: spin::mutex::SpinMutex<Engine>,
    /// [`DRIVING`] and [`ATTENTION`]. A blocking call on an idle communicator takes and gives
    /// up the driver role with one compare-and-swap each, without the queue's lock: two
    /// locked instructions fewer per call, ~10 ns of an 8-byte all_reduce over shared
    /// memory. Everything else (queued operations, waiters, abort, shutdown) sets
    /// [`ATTENTION`], which sends the driver through the lock.
    state: AtomicU32,
    q: Mutex<Queue>,
    /// Wakes the progress thread.
    wake_progress: Condvar,
    /// Wakes threads waiting for the driver role.
    role_free: Condvar,
    /// The engine's abort flag.
    abort: Arc<AtomicBool>,
    /// The error that poisoned the engine, mirrored for readers that do not drive.
    poison: Mutex<Option<Error>>,
    /// The engine's flight recorder, read without the engine.
    flight: Option<Arc<crate::engine::flight::Recorder>>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared").field("rank", &self.rank).finish()
    }
}

impl Shared {
    pub(crate) fn new(engine: Engine) -> Arc<Self> {
        let shared = Arc::new(Shared {
            rank: engine.rank(),
            abort: engine.abort_flag(),
            flight: engine.flight_recorder(),
            engine: spin::mutex::SpinMutex::new(engine),
            state: AtomicU32::new(0),
            q: Mutex::new(Queue::default()),
            wake_progress: Condvar::new(),
            role_free: Condvar::new(),
            poison: Mutex::new(None),
        });
        if let Some(r) = &shared.flight {
            // A dump on failure lists what waits behind the failed call. Weak: the recorder
            // must not keep its communicator alive. `try_lock`: the dump runs inside the
            // engine; no path fails the engine with the queue's lock held, and should one
            // come to, it must not wait for itself.
            let weak = Arc::downgrade(&shared);
            r.set_queued_source(Box::new(move || {
                let s = weak.upgrade()?;
                // Held only for moments by others (a submit, a waiter, the progress
                // thread's look): retried for at most a millisecond.
                let start = Instant::now();
                let q = loop {
                    match s.q.try_lock() {
                        Ok(q) => break q,
                        Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
                        Err(std::sync::TryLockError::WouldBlock) => {
                            if start.elapsed() > Duration::from_millis(1) {
                                return None;
                            }
                            std::thread::yield_now();
                        }
                    }
                };
                Some(q.queued())
            }));
        }
        shared
    }

    /// Takes the driver role without the queue's lock: only when nobody holds it and
    /// nothing needs [`ATTENTION`].
    fn take_fast(&self) -> bool {
        self.state
            .compare_exchange(0, DRIVING, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// Takes the driver role if nobody holds it. `_q`: the queue's lock, held.
    fn take(&self, _q: &Queue) -> bool {
        let mut s = self.state.load(Ordering::Relaxed);
        while s & DRIVING == 0 {
            match self.state.compare_exchange_weak(
                s,
                s | DRIVING,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
        false
    }

    /// Whether someone holds the driver role.
    fn driving(&self) -> bool {
        self.state.load(Ordering::Acquire) & DRIVING != 0
    }

    /// Raises [`ATTENTION`] (`_q`: the queue's lock, held) and says whether someone held the
    /// driver role then: that driver gives the role up through the queue's lock, and so
    /// sees what the caller changed there.
    fn attention(&self, _q: &Queue) -> bool {
        self.state.fetch_or(ATTENTION, Ordering::AcqRel) & DRIVING != 0
    }

    /// The error that poisoned the engine, if any (without waiting for the driver role).
    pub(crate) fn poisoned(&self) -> Option<Error> {
        lock(&self.poison).clone()
    }

    /// The flight record now, with the operations still queued (`None`: the recorder is
    /// off). Never waits for the engine.
    pub(crate) fn flight_record(&self) -> Option<crate::engine::flight::FlightRecord> {
        let r = self.flight.as_ref()?;
        Some(r.snapshot(&lock(&self.q).queued()))
    }

    /// The call in progress as the flight recorder has it (`all_reduce #17`, `send #3 to
    /// rank 1`) and how long it has run; `None` when the recorder is off or no call runs.
    /// Never waits for the engine.
    fn in_progress(&self) -> Option<(String, Duration)> {
        let r = self.flight.as_ref()?;
        let e = r.latest()?;
        if e.state != crate::engine::flight::FlightState::Started {
            return None;
        }
        let mut name = match e.seq {
            Some(s) => format!("{} #{s}", e.collective),
            None => e.collective.to_string(),
        };
        match (e.collective, e.peer) {
            ("send", Some(p)) => name.push_str(&format!(" to rank {p}")),
            ("recv", Some(p)) => name.push_str(&format!(" from rank {p}")),
            _ => {}
        }
        let ran = Duration::from_nanos(r.unix_now_ns().saturating_sub(e.started_unix_ns));
        Some((name, ran))
    }

    /// Where the operation of `done` stands, for an error of a bounded wait: queued (behind
    /// how many, and what runs meanwhile) or running (as which call, for how long).
    fn whereabouts(&self, done: &Arc<Completion>) -> String {
        let ahead = lock(&self.q)
            .jobs
            .iter()
            .position(|j| Arc::ptr_eq(&j.done, done));
        let running = self.in_progress();
        match (ahead, running) {
            (Some(k), run) => {
                let mut behind = Vec::new();
                if let Some((c, t)) = run {
                    behind.push(format!("{c}, which has run for {t:.1?}"));
                }
                if k > 0 {
                    behind.push(format!(
                        "{k} {}operation{} issued before it",
                        if behind.is_empty() { "" } else { "more " },
                        if k == 1 { "" } else { "s" }
                    ));
                }
                if behind.is_empty() {
                    "it has not started: it is the next to run".into()
                } else {
                    format!("it has not started: it waits for {}", behind.join(" and "))
                }
            }
            (None, Some((c, t))) => format!(
                "it runs as {c} (for {t:.1?}); it goes on until it completes or its own \
                 deadline passes"
            ),
            (None, None) => "it is still in flight; it goes on until it completes or its own \
                             deadline passes"
                .into(),
        }
    }

    /// Queues `task`; it runs after every operation issued before it.
    pub(crate) fn submit(
        self: &Arc<Self>,
        task: Task,
        timeout: Option<Duration>,
        what: &'static str,
    ) -> Work {
        let done = Arc::new(Completion::default());
        let mut q = lock(&self.q);
        let issued = Instant::now();
        q.jobs.push_back(Job {
            task,
            timeout,
            done: Arc::clone(&done),
            what,
            issued,
        });
        q.last_submit = Some(issued);
        let driven = self.attention(&q);
        // A watching progress thread finds the job by itself within WATCH_PERIOD.
        if !driven && q.progress_sleeping {
            self.wake_progress.notify_one();
        }
        drop(q);
        Work::new(self, done, what)
    }

    /// A `Work` that is already complete with `r` (an operation that ran on the caller's
    /// thread).
    pub(crate) fn finished(self: &Arc<Self>, r: Result<()>, what: &'static str) -> Work {
        let done = Arc::new(Completion::default());
        done.finish(r);
        Work::new(self, done, what)
    }

    /// Runs `f` on the caller's thread with the engine, after every operation issued before
    /// it, and with `timeout` as its deadline (the communicator's when `None`).
    pub(crate) fn exclusive<R>(
        &self,
        timeout: Option<Duration>,
        f: impl FnOnce(&mut Engine) -> Result<R>,
    ) -> Result<R> {
        let ahead = self.take_waiting();
        let mut role = self.role();
        #[cfg(test)]
        tests::panic_here_if_asked();
        if ahead {
            self.drive(&mut role.eng, None);
        }
        self.run_one(&mut role.eng, timeout, f)
        // `role` gives the driver role up here, after the result is taken.
    }

    /// Takes the driver role, waiting for its holder to give it up; says whether operations
    /// are queued (issued before the caller's).
    fn take_waiting(&self) -> bool {
        if self.take_fast() {
            return false;
        }
        let mut q = lock(&self.q);
        while !self.take(&q) {
            q.role_waiters += 1;
            // A driver that gave the role up meanwhile did not see this waiter: then the role
            // is free, take it.
            if self.attention(&q) {
                q = self.role_free.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            q.role_waiters -= 1;
        }
        !q.jobs.is_empty()
    }

    /// Runs one operation with the engine: honours a pending abort first, contains panics,
    /// and mirrors the poison.
    fn run_one<R>(
        &self,
        eng: &mut Engine,
        timeout: Option<Duration>,
        f: impl FnOnce(&mut Engine) -> Result<R>,
    ) -> Result<R> {
        let r = match catch_unwind(AssertUnwindSafe(|| {
            eng.honour_abort();
            eng.set_call_timeout(timeout);
            f(eng)
        })) {
            Ok(r) => r,
            Err(_) => {
                // Half-sent frames and an advanced sequence number: this rank can no longer
                // agree with its peers. Fail for good, and tell them (contained: the role
                // must still be given up).
                let e = panicked(self.rank, self.in_progress());
                let _ = catch_unwind(AssertUnwindSafe(|| eng.fail(e.clone())));
                Err(e)
            }
        };
        eng.set_call_timeout(None);
        self.mirror_poison(eng);
        r.map_err(|e| e.at_rank(self.rank))
    }

    /// The driver role's hold on the engine, for a caller that has just taken the role. Its
    /// drop gives the role up (`release`), also when a panic unwinds through the driver, so
    /// that the next caller is never left waiting for a role nobody holds.
    fn role(&self) -> Role<'_> {
        Role {
            eng: EngineHold {
                shared: self,
                // Free: only the holder of the driver role locks the engine, and gives it
                // back before the role (`Role`'s field order).
                guard: self.engine.lock(),
                was_panicking: std::thread::panicking(),
            },
            _token: RoleToken { shared: self },
        }
    }

    /// Copies the engine's poison where readers that do not drive see it.
    fn mirror_poison(&self, eng: &Engine) {
        if let Some(p) = eng.poisoned() {
            let mut mirror = lock(&self.poison);
            if mirror.is_none() {
                *mirror = Some(p.clone());
            }
        }
    }

    /// Runs queued operations until the queue is empty or `target` is complete. The caller
    /// holds the driver role.
    fn drive(&self, eng: &mut Engine, target: Option<&Completion>) {
        loop {
            if target.is_some_and(|t| t.get().is_some()) {
                return;
            }
            let Some(job) = lock(&self.q).jobs.pop_front() else {
                return;
            };
            let r = self.run_one(eng, job.timeout, job.task);
            job.done.finish(r);
        }
    }

    /// Gives the driver role up: to the progress thread when operations are queued, else to
    /// a thread waiting for it. A pending abort is honoured first (so that peers hear of it
    /// even when nothing runs).
    ///
    /// The caller has given the engine's lock back already: the next driver, which may take
    /// the role the moment this CAS or store clears it, finds the engine free.
    fn release(&self) {
        if self
            .state
            .compare_exchange(DRIVING, 0, Ordering::Release, Ordering::Relaxed)
            .is_ok()
        {
            // Nothing needed attention: no operation queued, nobody waiting, no abort (which
            // raises ATTENTION after its flag) and no shutdown.
            return;
        }
        let mut q = lock(&self.q);
        // Checked under the queue lock: `abort` raises the flag before it raises ATTENTION,
        // so either its ATTENTION sent this driver here or it took the role itself.
        if self.abort.load(Ordering::Acquire) {
            // Free: this thread still holds the role.
            let mut eng = self.engine.lock();
            if eng.poisoned().is_none() {
                drop(q);
                // Runs from `Role`'s drop, maybe while unwinding: a panic here must not
                // abort the process, and the role must be given up all the same.
                if catch_unwind(AssertUnwindSafe(|| eng.honour_abort())).is_err() {
                    let _ = catch_unwind(AssertUnwindSafe(|| {
                        eng.fail(panicked(self.rank, self.in_progress()))
                    }));
                }
                self.mirror_poison(&eng);
                q = lock(&self.q);
            }
        }
        // Nobody else changes the state while this driver holds the role and the lock.
        let attention = !q.jobs.is_empty() || q.role_waiters > 0 || q.shutdown;
        self.state
            .store(if attention { ATTENTION } else { 0 }, Ordering::Release);
        if !q.jobs.is_empty() || q.shutdown {
            self.wake_progress.notify_one();
        }
        if q.role_waiters > 0 {
            self.role_free.notify_all();
        }
    }

    /// Waits for `done`, driving the queue when nobody does.
    fn wait(&self, done: &Completion, until: Option<Instant>) -> Option<Result<()>> {
        loop {
            if let Some(r) = done.get() {
                return Some(r);
            }
            let q = lock(&self.q);
            if until.is_none() && self.take(&q) {
                drop(q);
                let mut role = self.role();
                self.drive(&mut role.eng, Some(done));
                drop(role);
                continue;
            }
            if !q.jobs.is_empty() && !self.driving() {
                // A bounded wait does not drive (the operation may outlast it): have the
                // progress thread start it now rather than at its next look.
                self.wake_progress.notify_one();
            }
            drop(q);
            // Someone else drives: a small operation is about to complete.
            if done.spin(until) {
                continue;
            }
            return done.wait_until(until);
        }
    }

    /// Makes the operation in progress and every later one fail with `Aborted`, and tells
    /// the peers. Returns without waiting for the operation in progress.
    pub(crate) fn abort(&self) {
        self.abort.store(true, Ordering::Release);
        let q = lock(&self.q);
        if self.attention(&q) {
            // The driver notices the flag within the engine's abort poll, and at the latest
            // when it gives the role up (through the lock: ATTENTION).
            return;
        }
        if !self.take(&q) {
            return;
        }
        drop(q);
        let mut role = self.role();
        self.drive(&mut role.eng, None);
        drop(role);
    }

    /// The progress thread: drives whenever operations are queued and nobody drives.
    pub(crate) fn progress(self: Arc<Self>) {
        loop {
            let mut q = lock(&self.q);
            while self.driving() || (q.jobs.is_empty() && !q.shutdown) {
                let watching =
                    !q.shutdown && q.last_submit.is_some_and(|t| t.elapsed() < WATCH_FOR);
                if watching {
                    q = self
                        .wake_progress
                        .wait_timeout(q, WATCH_PERIOD)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                } else {
                    q.progress_sleeping = true;
                    q = self
                        .wake_progress
                        .wait(q)
                        .unwrap_or_else(|e| e.into_inner());
                    q.progress_sleeping = false;
                }
            }
            if q.jobs.is_empty() {
                // Shut down, and everything issued has run.
                return;
            }
            if !self.take(&q) {
                continue;
            }
            drop(q);
            let mut role = self.role();
            self.drive(&mut role.eng, None);
            drop(role);
        }
    }

    /// Tells the progress thread to drain the queue and exit.
    pub(crate) fn shutdown(&self) {
        let mut q = lock(&self.q);
        q.shutdown = true;
        self.attention(&q);
        drop(q);
        self.wake_progress.notify_all();
    }

    /// Runs `f` with the engine, holding the driver role (operations still queued stay
    /// queued): for closing the communicator, after the progress thread exited.
    pub(crate) fn with_engine<R>(&self, f: impl FnOnce(&mut Engine) -> R) -> R {
        self.take_waiting();
        let mut role = self.role();
        f(&mut role.eng)
    }
}

/// The driver role and the engine it holds (see [`Shared::role`]).
///
/// Its fields drop in order: the engine's lock is given back first, then the role
/// ([`Shared::release`]), so that the next driver never finds the engine still locked.
struct Role<'a> {
    eng: EngineHold<'a>,
    _token: RoleToken<'a>,
}

/// The engine, locked by the holder of the driver role.
struct EngineHold<'a> {
    shared: &'a Shared,
    guard: spin::mutex::SpinMutexGuard<'a, Engine>,
    /// A panic was unwinding already when the role was taken (a communicator dropped, or a
    /// collective called from a destructor, during a panic): not one of ours.
    was_panicking: bool,
}

impl std::ops::Deref for EngineHold<'_> {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.guard
    }
}

impl std::ops::DerefMut for EngineHold<'_> {
    fn deref_mut(&mut self) -> &mut Engine {
        &mut self.guard
    }
}

impl Drop for EngineHold<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.was_panicking {
            // A panic while the engine was held outside a guarded operation: its state may
            // be half-updated, so the communicator fails for good and tells its peers, as
            // after a panic inside an operation. Contained: a panic here would abort.
            let (shared, eng) = (self.shared, &mut *self.guard);
            if eng.poisoned().is_none() {
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    eng.fail(panicked(shared.rank, shared.in_progress()))
                }));
            }
            shared.mirror_poison(eng);
        }
    }
}

/// The driver role itself: its drop gives it up ([`Shared::release`]).
struct RoleToken<'a> {
    shared: &'a Shared,
}

impl Drop for RoleToken<'_> {
    fn drop(&mut self) {
        self.shared.release();
    }
}

/// A non-blocking operation in flight: wait for it, or poll it.
///
/// Dropping or leaking a `Work` does not stop the operation: it runs to completion in issue
/// order whether or not anybody waits for it. For operations started in a
/// [`Communicator::scope`](crate::Communicator::scope), the scope waits for every one of them
/// before it returns, so the borrowed buffers are never touched after their borrow ends —
/// even when a `Work` is forgotten.
#[must_use = "an operation's error is only reported by wait() or test()"]
pub struct Work {
    /// Weak: a `Work` must not keep the transport alive past its communicator.
    shared: Weak<Shared>,
    rank: usize,
    done: Arc<Completion>,
    what: &'static str,
    /// Set by a device operation whose GPU work never finished (see
    /// [`Work::buffers_may_be_in_use`]).
    stuck: Option<Arc<AtomicBool>>,
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.what)
            .field("done", &self.done.get().is_some())
            .finish()
    }
}

impl Work {
    pub(crate) fn new(shared: &Arc<Shared>, done: Arc<Completion>, what: &'static str) -> Self {
        Work {
            shared: Arc::downgrade(shared),
            rank: shared.rank,
            done,
            what,
            stuck: None,
        }
    }

    /// This `Work` reports what `flag` says (set by a device operation's task).
    pub(crate) fn with_stuck_flag(mut self, flag: Arc<AtomicBool>) -> Self {
        self.stuck = Some(flag);
        self
    }

    /// Whether the operation ended (failed) while GPU work it had queued on its buffers was
    /// still running and never finished within the device's drop wait (10 s): its staging
    /// memory was leaked rather than reused, and the caller's buffers may still be written
    /// by that work. A caller that keeps buffers alive for the operation (the Python
    /// binding's keepalives) must then never release them. `false` for host operations and
    /// while the operation runs.
    pub fn buffers_may_be_in_use(&self) -> bool {
        self.stuck
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Acquire))
    }

    /// Waits for the operation, driving the queue when nobody does.
    fn wait_for(&self, until: Option<Instant>) -> Option<Result<()>> {
        match self.shared.upgrade() {
            Some(s) => s.wait(&self.done, until),
            // The communicator is gone: it ran everything issued before it went.
            None => self.done.get(),
        }
    }

    pub(crate) fn completion(&self) -> &Arc<Completion> {
        &self.done
    }

    /// `Ok(true)` once the operation completed, `Ok(false)` while it is in flight, its error
    /// if it failed. Never blocks.
    ///
    /// # Errors
    /// The operation's error.
    pub fn test(&self) -> Result<bool> {
        match self.done.get() {
            None => Ok(false),
            Some(r) => r.map(|()| true),
        }
    }

    /// Waits for the operation, running it (and what was issued before it) on this thread
    /// when no other thread is: a caller that waits at once pays no wake-up of the progress
    /// thread. It cannot wait forever: the operation itself fails by its deadline (the
    /// communicator's, or the one it was issued with). Waiting again returns the same result.
    ///
    /// # Errors
    /// The operation's error: `Timeout`, `PeerLost`, `Mismatch`, `Aborted`, ...
    pub fn wait(&self) -> Result<()> {
        self.wait_for(None).unwrap_or_else(|| Err(self.lost()))
    }

    /// Waits for the operation at most `timeout`.
    ///
    /// # Errors
    /// The operation's error; [`Error::Timeout`] when it is still in flight after
    /// `timeout`. The operation then goes on (wait again, or
    /// [`Communicator::abort`](crate::Communicator::abort) the communicator to stop it).
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let until = crate::time::deadline(start, timeout);
        // Completed between the deadline and now: its result, not a stale whereabouts.
        match self.wait_for(Some(until)).or_else(|| self.done.get()) {
            Some(r) => r,
            None => Err(Error::Timeout {
                rank: self.rank,
                peer: None,
                op: format!("waiting for {}", self.what),
                waited: start.elapsed(),
                detail: self
                    .whereabouts()
                    .unwrap_or_else(|| "the operation is still in flight".into()),
            }),
        }
    }

    /// Where the operation stands while it is in flight, in the words of
    /// [`wait_timeout`](Self::wait_timeout)'s error: queued (behind which running call, for
    /// how long, and how many more) or running (as which call, e.g. `all_reduce #17`, and for
    /// how long). `None` once it has completed or failed. Never blocks on the operation; for
    /// a watchdog, or a caller's own timeout message (the torch backend's `Work.wait`).
    pub fn whereabouts(&self) -> Option<String> {
        if self.done.get().is_some() {
            return None;
        }
        Some(self.shared.upgrade().map_or_else(
            || "the operation is still in flight".into(),
            |s| s.whereabouts(&self.done),
        ))
    }

    fn lost(&self) -> Error {
        Error::Transport {
            rank: Some(self.rank),
            peer: None,
            op: self.what.into(),
            what: "internal error: the operation never completed".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    #[cfg(feature = "testing")]
    use std::panic::{catch_unwind, AssertUnwindSafe};
    #[cfg(feature = "testing")]
    use std::time::{Duration, Instant};

    thread_local! {
        /// Makes this thread's next `Shared::exclusive` panic while it holds the driver role,
        /// outside the guarded operation: a stand-in for a bug between the role's taking and
        /// the guarded call.
        static PANIC_IN_ROLE: Cell<bool> = const { Cell::new(false) };
    }

    pub(super) fn panic_here_if_asked() {
        if PANIC_IN_ROLE.with(|p| p.replace(false)) {
            panic!("a bug while holding the driver role");
        }
    }

    #[cfg(feature = "testing")]
    use crate::transport::mem::MemFabric;
    #[cfg(feature = "testing")]
    use crate::{Communicator, Config, ReduceOp};

    /// Two ranks as threads over a `mem` fabric, each running `f(rank, its communicator)`
    /// (deadline: `timeout`); their results in rank order.
    #[cfg(feature = "testing")]
    fn two_ranks<R: Send>(
        timeout: Duration,
        f: impl Fn(usize, Communicator) -> R + Sync,
    ) -> Vec<R> {
        let fabric = MemFabric::new(2, 4);
        let mut cfg = Config::new(0, 1, "");
        cfg.timeout = timeout;
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let (t, cfg, f) = (fabric.transport(r), &cfg, &f);
                    s.spawn(move || {
                        f(
                            r,
                            Communicator::from_transport(r, 2, Box::new(t), cfg).unwrap(),
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// A panic while the engine is held outside a guarded operation (what poisoned the
    /// engine's std lock before it became a spin lock): the communicator must then fail for
    /// good and tell its peer, not run on a state that may be half-updated (#11 item 8).
    #[cfg(feature = "testing")]
    #[test]
    fn a_poisoned_engine_lock_fails_the_communicator_and_its_peers() {
        let start = Instant::now();
        let res = two_ranks(Duration::from_secs(60), |r, c| {
            let mut v = vec![1u32; 100];
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            if r == 0 {
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    c.shared
                        .with_engine(|_| panic!("a bug while holding the engine"))
                }));
            }
            let e = c.all_reduce(&mut v, ReduceOp::Sum).map(|_| v[0]);
            (e, start.elapsed())
        });
        let (e0, _) = &res[0];
        let e0 = e0.as_ref().unwrap_err().to_string();
        assert!(e0.contains("panic") && e0.contains("rank 0"), "{e0}");
        let (e1, at) = &res[1];
        let e1 = e1.as_ref().unwrap_err().to_string();
        assert!(e1.contains("rank 0"), "rank 1 must name rank 0: {e1}");
        assert!(
            *at < Duration::from_secs(20),
            "rank 1 failed only after {at:?}"
        );
    }

    /// A collective called while a panic of the user's unwinds (from a destructor: a guard
    /// that ends a phase with a barrier) takes the driver role during the unwind. That must
    /// not count as a panic inside the library: the call and the ones after it succeed on
    /// every rank, and no peer hears of an internal error. (Closing a communicator dropped
    /// during a panic takes the role the same way.)
    #[cfg(feature = "testing")]
    #[test]
    fn a_collective_called_while_a_users_panic_unwinds_is_no_library_panic() {
        struct SyncOnDrop<'a>(&'a Communicator);
        impl Drop for SyncOnDrop<'_> {
            fn drop(&mut self) {
                let mut v = vec![1u32; 10];
                let r = self.0.all_reduce(&mut v, ReduceOp::Sum);
                assert!(
                    r.is_ok() && v[0] == 2,
                    "the call during the unwind: {r:?} {v:?}"
                );
            }
        }
        let res = two_ranks(Duration::from_secs(20), |r, c| {
            let mut v = vec![1u32; 10];
            if r == 0 {
                let p = catch_unwind(AssertUnwindSafe(|| {
                    let _sync = SyncOnDrop(&c);
                    panic!("a bug in the user's code");
                }));
                assert!(p.is_err());
            } else {
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            }
            let mut w = vec![1u32; 10];
            c.all_reduce(&mut w, ReduceOp::Sum)
                .map(|()| w[0])
                .map_err(|e| e.to_string())
        });
        assert_eq!(res, [Ok(2), Ok(2)]);
    }

    /// #11 item 8 (review M2): a panic while a thread holds the driver role but outside the
    /// guarded operation must still give the role up. Otherwise every later call of the
    /// communicator waits forever for a role nobody holds. The next call must fail promptly
    /// (the engine failed as the panic left it), and the peer must hear of it.
    #[cfg(feature = "testing")]
    #[test]
    fn a_panic_while_holding_the_driver_role_gives_the_role_up_and_fails_the_next_call() {
        let fabric = MemFabric::new(2, 4);
        let mut cfg = Config::new(0, 1, "");
        cfg.timeout = Duration::from_secs(60);
        let start = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel();
        for r in 0..2 {
            let (t, cfg, tx) = (fabric.transport(r), cfg.clone(), tx.clone());
            std::thread::spawn(move || {
                let c = Communicator::from_transport(r, 2, Box::new(t), &cfg).unwrap();
                let mut v = vec![1u32; 100];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                if r == 0 {
                    PANIC_IN_ROLE.with(|p| p.set(true));
                    let p = catch_unwind(AssertUnwindSafe(|| {
                        let _ = c.all_reduce(&mut v, ReduceOp::Sum);
                    }));
                    assert!(p.is_err(), "the injected panic must have happened");
                }
                let e = c.all_reduce(&mut v, ReduceOp::Sum).map(|_| v[0]);
                let _ = tx.send((r, e, start.elapsed()));
            });
        }
        drop(tx);
        let mut got = Vec::new();
        for _ in 0..2 {
            // Without the role guard, rank 0's next call never returns.
            let res = rx.recv_timeout(Duration::from_secs(30));
            got.push(res.expect("a call after the panic hung: the driver role was never given up"));
        }
        got.sort_by_key(|g| g.0);
        let e0 = got[0].1.as_ref().unwrap_err().to_string();
        assert!(e0.contains("panic") && e0.contains("rank 0"), "{e0}");
        let e1 = got[1].1.as_ref().unwrap_err().to_string();
        assert!(e1.contains("rank 0"), "rank 1 must name rank 0: {e1}");
        assert!(
            got[1].2 < Duration::from_secs(20),
            "rank 1 failed only after {:?}",
            got[1].2
        );
    }
}
