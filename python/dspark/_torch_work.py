"""torch's Work objects for dspark's operations (part of :mod:`dspark.torch`): completed ones
for synchronous calls, future-backed ones for asynchronous calls. A backend's asynchronous
operations are waited for by one thread per communicator (a lane: a communicator runs its
operations in issue order, so waiting for one after another is exact, while operations on
different communicators, a collective and a receive, complete independently, as gloo's do),
and the same thread completes their futures, which runs torch's callbacks, in that order; a
callback may wait for another operation's future (DDP's PowerSGD hook does): another thread
then takes the lane over (see `_Lane`)."""

import atexit
import queue
import sys
import threading
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from . import _dspark
from ._torch_errors import _torch_class, _torch_error

class _Failure:
    """What the inner future of a failed operation holds (see `_unwrap`)."""

    __slots__ = ("exc",)

    def __init__(self, exc):
        self.exc = exc


def _unwrap(fut):
    # Runs as a `then` callback: raising here marks the outer future failed in C++, which is
    # what C++ consumers (DDP's reducer) see. `Future.set_exception` only stores the
    # exception as the value (re-raised by Python's `wait` alone): DDP would take it for its
    # tensors and crash.
    v = fut.value()
    if isinstance(v, _Failure):
        raise v.exc
    return v


class _Pending:
    """A started operation (or several: list and coalesced forms) and its future."""

    __slots__ = ("raws", "result", "finish", "inner", "deadline", "_lock")

    def __init__(self, raws, result, finish, deadline=None):
        self.raws = raws
        self.result = result
        self.finish = finish
        self.deadline = deadline
        self.inner = torch.futures.Future()
        # Set by `make_lazy` (issued after the exit handler stopped the lanes: no thread
        # completes it; its Work does, when asked: `complete_now`, `poll`).
        self._lock = None

    def make_lazy(self):
        self._lock = threading.Lock()

    @property
    def lazy(self):
        return self._lock is not None

    def settle(self):
        """Waits for the operations (on a lane's thread); returns what completes the
        future: the result, or the failure."""
        try:
            for w in self.raws:
                w.wait()
            if self.finish is not None:
                self.finish()
        except BaseException as e:  # noqa: BLE001 - it goes to the future
            v = _Failure(_torch_error(e, self.deadline))
        else:
            v = self.result
        self.raws = self.finish = None
        return v

    def complete(self):
        self.inner.set_result(self.settle())

    def complete_now(self):
        """Completes a lazy operation on this thread (waiting for it), once."""
        with self._lock:
            if not self.inner.done():
                self.complete()

    def wait_for(self, secs):
        """Waits up to `secs` for a lazy operation's every part to finish, completing
        nothing: False when one is still in flight then (`Work.wait(timeout)`'s timeout)."""
        end = time.monotonic() + secs
        for w in self.raws or ():
            try:
                w.wait(max(0.0, end - time.monotonic()))
            except Exception:  # noqa: BLE001 - a failure is the operation's, settled later
                if not w.is_completed():
                    return False
        return True

    def poll(self):
        """Completes a lazy operation whose every part has finished; never blocks (a thread
        completing it already holds the lock)."""
        raws = self.raws
        if raws is not None and all(w.is_completed() for w in raws):
            if self._lock.acquire(blocking=False):
                try:
                    if not self.inner.done():
                        self.complete()
                finally:
                    self._lock.release()


# A callback that has run this long while operations of its lane wait is taken for one that
# waits for one of them (DDP's PowerSGD hook waits for a collective's future inside another's
# callback): another thread then takes the lane over.
_HELP_AFTER_S = 0.002


class _Lane:
    """One communicator's (or set of communicators') asynchronous operations. A thread (the
    lane's server) waits for them in issue order, the order a communicator completes them
    in, and completes each future itself, which runs torch's callbacks there, one at a
    time and in order, as NCCL's inline ones run. When a callback queues an operation on
    its own lane (`queued`), or has run for `_HELP_AFTER_S` while operations another thread
    queued wait (`_Monitor`), a new server takes the lane over and the old one ends once its
    callback returns: a callback waiting for a later future would otherwise wait for itself.
    Blocking callbacks then run side by side, as on gloo's worker threads."""

    def __init__(self):
        self.q = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.gen = 0  # the server generation that owns the lane
        self.threads = []  # every server's thread (joined at stop)
        self.cb_since = None  # when the current server's callback started, if in one
        self.server = None  # the thread id of the server inside that callback
        self._serve()

    def _serve(self):  # with self.lock held, or before the lane is shared
        """Starts a server for the lane; the old one (if any) ends after its callback. Raises
        RuntimeError, changing nothing, when no thread can start."""
        t = threading.Thread(target=self._loop, args=(self.gen + 1,), name="dspark-futures",
                             daemon=True)
        t.start()
        self.gen += 1
        self.cb_since = None
        self.threads = [x for x in self.threads if x.is_alive()] + [t]

    def _loop(self, gen):
        while True:
            p = self.q.get()
            if p is None:
                return
            v = p.settle()
            # (Only a server inside a callback is taken over: this one still owns the lane.)
            with self.lock:
                self.cb_since = time.monotonic()
                self.server = threading.get_ident()
            _run_job(lambda: p.inner.set_result(v))
            del p, v
            with self.lock:
                if self.gen != gen:
                    return  # another server took the lane over meanwhile
                self.cb_since = None

    def queued(self):
        """After an operation was queued (by the caller): if the lane's server is inside a
        callback and that callback issued it (it will likely wait for it: PowerSGD does), a
        new server takes over at once; if another thread issued it, the monitor looks at
        the lane until the callback returns (`stuck`)."""
        with self.lock:
            if self.cb_since is None:
                return
            if self.server == threading.get_ident():
                self._take_over()
                return
        _MONITOR.watch(self)

    def stuck(self, now):
        """Called by the monitor: takes the lane over when its server has been inside a
        callback for `_HELP_AFTER_S` while operations wait. Returns whether the server is
        still inside a callback (to be looked at again)."""
        with self.lock:
            if self.cb_since is None:
                return False
            if now - self.cb_since < _HELP_AFTER_S or self.q.empty():
                return True
            self._take_over()
            return False

    def _take_over(self):
        """A new server for the lane (with `self.lock` held). Without a thread for it (the
        interpreter shutting down, a thread limit), this thread waits for and completes
        what is queued, in order, so that the stuck callback's wait still ends; said once
        as a warning."""
        try:
            self._serve()
            return
        except RuntimeError as e:
            warnings.warn(f"dspark: no thread to take a stuck lane over ({e}); its "
                          "operations complete on the thread that found it stuck",
                          RuntimeWarning, stacklevel=2)
        self.lock.release()
        try:
            while True:
                try:
                    p = self.q.get_nowait()
                except queue.Empty:
                    break
                if p is None:  # stop: for the server to see
                    self.q.put(None)
                    break
                p.complete()
        finally:
            self.lock.acquire()

    def stop(self):
        """Lets the server wait for and complete what was queued, then end; waits for that
        and for servers still inside callbacks (bounded), so that no future's callbacks run
        while the interpreter exits. Nothing is queued afterwards: `_Completer.put` checks the
        flags set before every stop (`_closed`, `_EXITING`) under the locks it queues under."""
        self.q.put(None)
        end = time.monotonic() + _STOP_WAIT_S
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, end - time.monotonic()))


# How often the monitor looks at lanes whose server was inside a callback when an operation
# was queued behind it (rarely: only a callback that waits for such an operation needs it).
_MONITOR_EVERY_S = 0.02


class _Monitor:
    """One thread for every lane: while some lane had an operation queued behind a callback
    (from another thread: one queued by the callback itself is handled at once), it looks
    every `_MONITOR_EVERY_S` whether that callback is stuck (`_Lane.stuck`); otherwise it
    sleeps. Started on first use."""

    def __init__(self):
        self.cond = threading.Condition()
        self.lanes = set()
        self.t = None

    def watch(self, lane):
        with self.cond:
            if not self.lanes:
                self.cond.notify()
            self.lanes.add(lane)
            if self.t is None:
                self.t = threading.Thread(target=self._loop, name="dspark-monitor", daemon=True)
                try:
                    self.t.start()
                except RuntimeError as e:
                    self.t = None
                    warnings.warn(f"dspark: no thread for the lane monitor ({e}): a callback "
                                  "that waits for an operation another thread queued behind "
                                  "it is not taken over", RuntimeWarning, stacklevel=2)

    def _loop(self):
        while True:
            with self.cond:
                while not self.lanes:
                    self.cond.wait()
                self.cond.wait(_MONITOR_EVERY_S)
                lanes = list(self.lanes)
            now = time.monotonic()
            done = [lane for lane in lanes if not lane.stuck(now)]
            with self.cond:
                self.lanes.difference_update(done)


_MONITOR = _Monitor()


def _run_job(job):
    try:
        job()
    except BaseException:  # noqa: BLE001 - torch reports a callback's error in its future
        threading.excepthook(threading.ExceptHookArgs((*sys.exc_info(), None)))


class _Completer:
    """A backend's lanes (`_Lane`), one per communicator or set of communicators its
    asynchronous operations run on; made on first use."""

    def __init__(self):
        self._lanes = {}
        self._lock = threading.Lock()
        self._closed = False

    def put(self, pending, lane=()):
        """Queues `pending` on `lane` (a hashable key: the communicators it runs on). After
        the exit handler stopped the lanes (an operation issued by an exit handler that runs
        after dspark's), nothing is queued: the operation's Work completes it when it is
        waited for or looked at (`_Pending.lazy`)."""
        with _EXIT_LOCK:
            queued, inline = self._put(pending, lane, _EXITING)
        # Outside the locks: both may run torch's callbacks on this thread (a lane taken over
        # without a thread for it completes what is queued here), and a callback may issue.
        if queued is not None:
            queued.queued()
        elif inline:
            pending.complete()

    def _put(self, pending, lane, exiting):
        """`put` under the exit lock: the lane `pending` was queued on, or None and whether
        the caller must complete it itself."""
        with self._lock:
            if not self._closed and not exiting:
                q = self._lanes.get(lane)
                if q is None:
                    try:
                        q = self._lanes[lane] = _Lane()
                    except RuntimeError:  # no thread: completed below, on this one
                        q = None
                    else:
                        _LANES.add(q)
                if q is not None:
                    q.q.put(pending)
                    return q, False
        if exiting:
            # The interpreter is exiting: a thread started now could die inside torch's
            # callbacks. The operation is in flight; its Work completes it when waited for
            # or looked at (an `irecv` and an `isend` issued one after the other both start).
            pending.make_lazy()
            return None, False
        # Closed, or no thread to wait on: this caller waits and completes it (the call
        # returns when it completed instead of at once).
        if not self._closed:
            warnings.warn("dspark: no thread to wait for an asynchronous operation; it "
                          "completes before the call returns", RuntimeWarning, stacklevel=4)
        return None, True

    def stop(self):
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for lane in lanes:
            lane.stop()


# How long stopping a lane waits for it (every operation it waits for has completed or
# failed by the time the communicators are closed, so this is a bound, not a delay).
_STOP_WAIT_S = 5.0
# Every lane, stopped at exit before the interpreter finalizes: a daemon thread still
# inside torch's future callbacks then dies mid-C++ ("terminate called without an active
# exception", SIGABRT at exit after dropped async Works).
_LANES = weakref.WeakSet()


# Set by the exit handler: from then on no lane is made (its thread could die inside torch's
# callbacks at finalization) and operations complete when their Work is waited for. The lock
# orders it with `_Completer.put` on other threads: a lane made just before is in `_LANES`.
_EXITING = False
_EXIT_LOCK = threading.Lock()


@atexit.register
def _stop_completers():
    global _EXITING
    with _EXIT_LOCK:
        _EXITING = True
    for lane in list(_LANES):
        lane.stop()


def _async_work(completer, raws, result, finish, deadline=None, lane=()):
    """torch's Work for started operations (see `_AsyncWork`), waited for on `lane` of
    `completer` (the communicators they run on)."""
    p = _Pending(raws, result, finish, deadline)
    outer = p.inner.then(_unwrap)
    completer.put(p, lane)
    return _AsyncWork(p.inner, outer, p)


def _wait_seconds(timeout):
    """`Work.wait`'s timeout as seconds: None for none (None, or torch's `kNoTimeout`, zero);
    a negative one is already over (torch's `wait_for` returns at once), 0.0."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return None if s == 0 else max(s, 0.0)


def _wait_timed_out(timeout, pending=None):
    """What `Work.wait(timeout)` raises when the operation is still in flight: dspark's
    TimeoutError, also torch's DistBackendError, with torch's wording and the timeout as
    given, then where the operation stands (`_whereabouts`) when `pending` tells."""
    secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    cls = _torch_class(_dspark.TimeoutError, False)
    where = _whereabouts(pending)
    return cls(
        f"dspark: Timed out waiting {int(secs * 1000)}ms for the operation to complete "
        "(Work.wait's timeout; the operation goes on, a later wait may still complete it)"
        + (f": {where}" if where else "")
    )


def _whereabouts(pending):
    """Where the first unfinished part of `pending` stands, as its dspark Work says ("it runs
    as all_reduce #17 (for 2.1s); ..."), or None when none tells (all done, or no parts)."""
    raws = pending.raws if pending is not None else None  # None once settled
    for w in raws or ():
        try:
            where = w.whereabouts()
        except Exception:  # noqa: BLE001 - only words for a message; the timeout is the error
            continue
        if where:
            return where
    return None


def _source_rank_or_none(work):
    """`Work.source_rank()`: the rank a recv's Work was posted for, else -1."""
    return work._src


def _source_rank_of_recv(work):
    """`Work._source_rank()`: as torch's, an error for the Work of anything but a recv."""
    if work._src < 0:
        raise RuntimeError(
            "dspark: sourceRank() may only be called on the Work of a recv (as torch's)"
        )
    return work._src


class _AsyncWork(dist._Work):
    """A started operation: `wait`, `is_completed` and `get_future` answer from its future.
    `wait` raises the operation's own error (a `dspark.TimeoutError` that is also a
    `torch.distributed.DistBackendError`, say): the future-wrapping Work torch makes with
    `_create_work_from_future` returns True from `wait` whatever became of the operation, so
    an asynchronous call that timed out looked done. (torch's wrapper around a Python Work on
    the c10d Backend route forwards only `wait` and `get_future`.)"""

    def __init__(self, inner, outer, pending=None):
        super().__init__()
        self._inner = inner
        self._outer = outer
        # Kept only for an operation issued after the exit handler, which this Work completes.
        self._lazy = pending if pending is not None and pending.lazy else None
        # For a timed-out wait's message: where the operation stands (`_whereabouts`).
        self._pending = pending

    def _drive(self):
        if self._lazy is not None:
            self._lazy.complete_now()

    def _poll(self):
        if self._lazy is not None:
            self._lazy.poll()

    def _settled(self):
        # The inner future's value, once the outer one (`get_future()`) is complete too: the
        # inner is marked done before its `then` callback completes the outer, on the
        # completer's thread, so a caller woken by the inner alone could find
        # `get_future().value()` not ready yet (torch's "completed() INTERNAL ASSERT"). So
        # the outer is waited for, which implies the inner: waiting for the inner first put
        # a second wait (the outer's) on every `wait()` (benches/RESULTS.md, "Issue 25, stop
        # 42": an 8-byte `wait()` 3–23 µs slower than `get_future().wait()` before).
        try:
            self._outer.wait()
        except Exception:  # noqa: BLE001 - the failure is the inner's value, raised by the caller
            pass
        return self._inner.value()

    def wait(self, timeout=None):
        # Without `timeout` (or with zero, torch's kNoTimeout) the operation's deadline
        # bounds the wait; with one, it raises after that long (a negative one at once) and
        # leaves the operation in flight.
        secs = _wait_seconds(timeout)
        if self._lazy is not None and secs is not None and not self._lazy.wait_for(secs):
            raise _wait_timed_out(timeout, self._pending)
        self._drive()  # (after the exit handler: on this thread, within the op's deadline)
        if secs is not None and not self._outer.done():
            done = threading.Event()
            self._outer.add_done_callback(lambda _f: done.set())
            if not done.wait(secs):
                raise _wait_timed_out(timeout, self._pending)
        v = self._settled()
        if isinstance(v, _Failure):
            raise v.exc
        return True

    def is_completed(self):
        self._poll()
        return self._outer.done()

    def is_success(self):
        self._poll()
        return self._outer.done() and not isinstance(self._inner.value(), _Failure)

    def exception(self):
        self._poll()
        if not self._inner.done():
            return None
        v = self._inner.value()
        return v.exc if isinstance(v, _Failure) else None

    def result(self):
        self._drive()
        v = self._settled()
        if isinstance(v, _Failure):
            raise v.exc
        return v

    _src = -1  # set by `recv` for its Work: the rank the receive was posted for
    source_rank = _source_rank_or_none
    _source_rank = _source_rank_of_recv

    def synchronize(self):
        pass

    def get_future(self):
        # After the exit handler nothing else completes it: done before the future is given.
        self._drive()
        return self._outer


class _Done(dist._Work):
    """A completed operation (the synchronous calls): nothing to wait for."""

    def __init__(self, result):
        super().__init__()
        self._result = result

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    _src = -1  # set by `recv` for its Work: the rank the receive was posted for
    source_rank = _source_rank_or_none
    _source_rank = _source_rank_of_recv

    def synchronize(self):
        pass

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut
