"""torch's Work objects for dspark's operations (part of :mod:`dspark.torch`): completed ones
for synchronous calls, future-backed ones for asynchronous calls. A backend's asynchronous
operations are waited for by one thread per communicator (a lane: a communicator runs its
operations in issue order, so waiting for one after another is exact, while operations on
different communicators, a collective and a receive, complete independently, as gloo's do),
and their futures are completed, and torch's callbacks run, on a pool of threads that grows
whenever every one of them is busy: a callback may wait for another operation's future
(DDP's PowerSGD hook does), which then completes on another thread."""

import atexit
import queue
import threading
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


class _Callbacks:
    """Threads that complete futures, and so run torch's callbacks on them: the jobs run in
    the order given while a thread is free; when every thread is busy (a callback waiting
    for another operation's future), a new one starts, so no completion waits behind a
    callback. Threads stay for later jobs; they are few (one more per callback blocked at
    once)."""

    def __init__(self):
        self._q = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = []

    def run(self, job):
        with self._lock:
            if self._idle:
                self._idle -= 1
                spawn = False
            else:
                spawn = True
                t = threading.Thread(target=self._loop, name="dspark-callbacks", daemon=True)
                self._threads.append(t)
        self._q.put(job)
        if spawn:
            t.start()

    def _loop(self):
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # noqa: BLE001 - torch reports a callback's error itself
                pass
            with self._lock:
                self._idle += 1

    def stop(self):
        """Ends every thread once the jobs given before ran; waits for that (bounded)."""
        with self._lock:
            threads = list(self._threads)
            self._threads.clear()
            self._idle = 0
        for _ in threads:
            self._q.put(None)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=_STOP_WAIT_S)


# The threads that complete every backend's futures.
_CALLBACKS = _Callbacks()


class _Completer:
    """A backend's lanes: one thread per communicator (or set of communicators, for an
    operation that spans several) waits for its asynchronous operations in issue order
    (which is the order they complete in), then hands each future to `_CALLBACKS` to
    complete. Lanes are made on first use; they wait without the GIL."""

    def __init__(self):
        self._lanes = {}
        self._lock = threading.Lock()

    def put(self, pending, lane=()):
        """Queues `pending` on `lane` (a hashable key: the communicators it runs on)."""
        with self._lock:
            q = self._lanes.get(lane)
            if q is None:
                q = self._lanes[lane] = (queue.SimpleQueue(), [None])
                t = threading.Thread(target=self._run, args=(q[0],),
                                     name="dspark-futures", daemon=True)
                q[1][0] = t
                t.start()
                _COMPLETERS.add(self)
        q[0].put(pending)

    @staticmethod
    def _run(q):
        while True:
            p = q.get()
            if p is None:
                return
            v = p.settle()
            _CALLBACKS.run(lambda p=p, v=v: p.inner.set_result(v))

    def stop(self):
        """Lets every lane wait for what was queued, then end; waits for that (bounded),
        so that no future's callbacks run while the interpreter exits."""
        with self._lock:
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for q, _ in lanes:
            q.put(None)
        for _, (t,) in lanes:
            if t is not None and t is not threading.current_thread():
                t.join(timeout=_STOP_WAIT_S)


# How long stopping a completer waits for it (every operation it waits for has completed or
# failed by the time the communicators are closed, so this is a bound, not a delay).
_STOP_WAIT_S = 5.0
# Every completer with a thread, stopped at exit before the interpreter finalizes: a
# daemon thread still inside torch's future callbacks then dies mid-C++ ("terminate
# called without an active exception", SIGABRT at exit after dropped async Works).
_COMPLETERS = weakref.WeakSet()


@atexit.register
def _stop_completers():
    for c in list(_COMPLETERS):
        c.stop()
    _CALLBACKS.stop()


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
