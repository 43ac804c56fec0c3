"""torch's Work objects for dspark's operations (part of :mod:`dspark.torch`): completed ones
for synchronous calls, future-backed ones for asynchronous calls. A backend's asynchronous
operations are waited for by one thread per communicator (a lane: a communicator runs its
operations in issue order, so waiting for one after another is exact, while operations on
different communicators, a collective and a receive, complete independently, as gloo's do),
and their futures are completed, and torch's callbacks run, in that order on runner threads
of the lane; a callback may wait for another operation's future (DDP's PowerSGD hook does),
which another runner then completes (see `_Lane`)."""

import atexit
import collections
import queue
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from . import _dspark
from ._torch_args import _seconds
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

    __slots__ = ("raws", "result", "finish", "inner", "deadline")

    def __init__(self, raws, result, finish, deadline=None):
        self.raws = raws
        self.result = result
        self.finish = finish
        self.deadline = deadline
        self.inner = torch.futures.Future()

    def settle(self, watch=None):
        """Waits for the operations (on a lane's thread); returns what completes the
        future: the result, or the failure. While `watch()` says so, waits in slices of
        `_HELP_AFTER_S` and calls `watch(True)` after each (see `_Lane.help`)."""
        try:
            for w in self.raws:
                while watch is not None and watch():
                    try:
                        w.wait(_HELP_AFTER_S)
                        break
                    except _dspark.TimeoutError:
                        if w.is_completed():  # its own deadline, not the slice's
                            break
                        watch(True)
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


# A callback that has run this long while futures of its lane wait to be completed is taken
# for one that waits for one of them (DDP's PowerSGD hook waits for a collective's future
# inside another's callback): another thread then completes them.
_HELP_AFTER_S = 0.002
# How long a lane's idle runner thread stays for the next future before it ends.
_RUNNER_IDLE_S = 2.0


class _Lane:
    """One communicator's (or set of communicators') asynchronous operations: a thread waits
    for them in issue order (the order a communicator completes them in), and runner
    threads complete their futures, which runs torch's callbacks, in that order, one at a
    time. Only when every runner has been inside one callback for `_HELP_AFTER_S` while
    futures wait does another runner start (a callback waiting for a later future would
    otherwise wait for itself); so callbacks that do not block run in order, as NCCL's
    inline ones do, and blocking ones run side by side, as on gloo's worker threads."""

    def __init__(self):
        self.q = queue.SimpleQueue()
        self.jobs = collections.deque()
        self.cond = threading.Condition()
        self.runners = 0
        self.busy = {}  # runner thread id -> when its callback started
        self.threads = []  # the runners' threads (joined at stop)
        self.closing = False
        self.thread = threading.Thread(target=self._wait_loop, name="dspark-futures",
                                       daemon=True)
        self.thread.start()

    # -- the waiting thread -------------------------------------------------------------
    def _wait_loop(self):
        while True:
            try:
                p = self.q.get(timeout=_HELP_AFTER_S if self.watch() else None)
            except queue.Empty:
                self.watch(True)
                continue
            if p is None:
                return
            v = p.settle(self.watch)
            self.give(lambda p=p, v=v: p.inner.set_result(v))

    def watch(self, act=False):
        """Whether futures wait to be completed while runners are busy (then the waiting
        thread waits in slices); with `act`, lets another runner take the next one if
        every busy runner has been inside its callback for `_HELP_AFTER_S`."""
        with self.cond:
            if not act:
                return bool(self.jobs) and self.runners > 0
            if self.jobs and self._may_run():
                if self.runners > len(self.busy):
                    self.cond.notify_all()
                else:
                    self._spawn()
            return bool(self.jobs)

    def _may_run(self):  # with self.cond held
        """Whether a runner may start the next callback: none is running, or every one
        running has run for `_HELP_AFTER_S` (so it is taken for waiting on a later one)."""
        now = time.monotonic()
        return all(now - t >= _HELP_AFTER_S for t in self.busy.values())

    # -- the runners ------------------------------------------------------------------------
    def give(self, job):
        with self.cond:
            self.jobs.append(job)
            if self.runners > len(self.busy):
                self.cond.notify_all()
            elif self.runners == 0:
                self._spawn()

    def _spawn(self):  # with self.cond held
        t = threading.Thread(target=self._run_loop, name="dspark-callbacks", daemon=True)
        self.runners += 1
        try:
            t.start()
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        except RuntimeError:  # no thread (interpreter shutting down, a thread limit)
            self.runners -= 1
            jobs, self.jobs = list(self.jobs), collections.deque()
            self.cond.release()
            try:
                for job in jobs:
                    _run_job(job)
            finally:
                self.cond.acquire()

    def _run_loop(self):
        me = threading.get_ident()
        while True:
            with self.cond:
                self.busy.pop(me, None)
                while not (self.jobs and self._may_run()):
                    if not self.cond.wait(_RUNNER_IDLE_S) or self.closing:
                        if not self.jobs:
                            self.runners -= 1
                            self.cond.notify_all()
                            return
                job = self.jobs.popleft()
                self.busy[me] = time.monotonic()
            _run_job(job)
            # Its future and tensors go now, while this runner counts as busy (stop waits
            # for it), not when the thread ends.
            del job

    def stop(self):
        """Lets the waiting thread wait for what was queued and the runners complete it,
        then end; waits for that (bounded), so that no future's callbacks run while the
        interpreter exits."""
        self.q.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=_STOP_WAIT_S)
        end = time.monotonic() + _STOP_WAIT_S
        with self.cond:
            self.closing = True
            self.cond.notify_all()
            threads = list(self.threads)
        # Joined, not counted: a thread still ending holds nothing of torch's then, but it
        # must not be ended by the interpreter's finalization in the middle of anything.
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, end - time.monotonic()))


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
        """Queues `pending` on `lane` (a hashable key: the communicators it runs on)."""
        with self._lock:
            if not self._closed:
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
                    return
        # Closed, or no thread to wait on: this caller waits and completes it.
        pending.complete()

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
_COMPLETERS = _LANES  # the name older code and tests know


@atexit.register
def _stop_completers():
    for lane in list(_LANES):
        lane.stop()


def _async_work(completer, raws, result, finish, deadline=None, lane=()):
    """torch's Work for started operations (see `_AsyncWork`), waited for on `lane` of
    `completer` (the communicators they run on)."""
    p = _Pending(raws, result, finish, deadline)
    outer = p.inner.then(_unwrap)
    completer.put(p, lane)
    return _AsyncWork(p.inner, outer)


def _wait_timed_out(secs):
    """What `Work.wait(timeout)` raises when the operation is still in flight: dspark's
    TimeoutError, also torch's DistBackendError, with torch's wording."""
    cls = _torch_class(_dspark.TimeoutError, False)
    return cls(
        f"dspark: Timed out waiting {int(secs * 1000)}ms for the operation to complete "
        "(Work.wait's timeout; the operation goes on, a later wait may still complete it)"
    )


class _AsyncWork(dist._Work):
    """A started operation: `wait`, `is_completed` and `get_future` answer from its future.
    `wait` raises the operation's own error (a `dspark.TimeoutError` that is also a
    `torch.distributed.DistBackendError`, say): the future-wrapping Work torch makes with
    `_create_work_from_future` returns True from `wait` whatever became of the operation, so
    an asynchronous call that timed out looked done. (torch's wrapper around a Python Work on
    the c10d Backend route forwards only `wait` and `get_future`.)"""

    def __init__(self, inner, outer):
        super().__init__()
        self._inner = inner
        self._outer = outer

    def _settled(self):
        # The inner future's value, once the outer one (`get_future()`) is complete too: the
        # inner is marked done before its `then` callback completes the outer, on the
        # completer's thread, so a caller woken by the inner alone could find
        # `get_future().value()` not ready yet (torch's "completed() INTERNAL ASSERT").
        v = self._inner.wait()
        try:
            self._outer.wait()
        except Exception:  # noqa: BLE001 - the failure is `v`'s, raised by the caller
            pass
        return v

    def wait(self, timeout=None):
        # Without `timeout` (or with torch's unset one) the operation's deadline bounds the
        # wait; with one, it raises after that long and leaves the operation in flight.
        secs = _seconds(timeout)
        if secs is not None and not self._outer.done():
            done = threading.Event()
            self._outer.add_done_callback(lambda _f: done.set())
            if not done.wait(secs):
                raise _wait_timed_out(secs)
        v = self._settled()
        if isinstance(v, _Failure):
            raise v.exc
        return True

    def is_completed(self):
        return self._outer.done()

    def is_success(self):
        return self._outer.done() and not isinstance(self._inner.value(), _Failure)

    def exception(self):
        if not self._inner.done():
            return None
        v = self._inner.value()
        return v.exc if isinstance(v, _Failure) else None

    def result(self):
        v = self._settled()
        if isinstance(v, _Failure):
            raise v.exc
        return v

    def source_rank(self):
        return -1

    def synchronize(self):
        pass

    def get_future(self):
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

    def source_rank(self):
        return -1

    def synchronize(self):
        pass

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut
