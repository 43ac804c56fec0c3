"""torch's Work objects for dspark's operations (part of :mod:`dspark.torch`): completed ones
for synchronous calls, future-backed ones completed in issue order by one thread per backend
for asynchronous calls."""

import atexit
import queue
import threading
import weakref

import torch
import torch.distributed as dist

from ._torch_errors import _torch_error

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

    def complete(self):
        try:
            for w in self.raws:
                w.wait()
            if self.finish is not None:
                self.finish()
        except BaseException as e:  # noqa: BLE001 - it goes to the future
            self.inner.set_result(_Failure(_torch_error(e, self.deadline)))
        else:
            self.inner.set_result(self.result)
        self.raws = self.finish = None


class _Completer:
    """One thread per backend that completes the futures of asynchronous operations, in
    issue order (they complete in issue order, so waiting for one after another is exact).
    Made on first use; it waits without the GIL."""

    def __init__(self):
        self._q = queue.SimpleQueue()
        self._t = None
        self._lock = threading.Lock()

    def put(self, pending):
        with self._lock:
            if self._t is None:
                self._t = threading.Thread(
                    target=self._run, name="dspark-futures", daemon=True
                )
                self._t.start()
                _COMPLETERS.add(self)
        self._q.put(pending)

    def _run(self):
        while True:
            p = self._q.get()
            if p is None:
                return
            p.complete()

    def stop(self):
        """Lets the thread complete what was queued, then end; waits for that (bounded),
        so that it does not run torch's future callbacks while the interpreter exits."""
        self._q.put(None)
        t = self._t
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


def _async_work(completer, raws, result, finish, deadline=None):
    """torch's Work for started operations (see `_AsyncWork`)."""
    p = _Pending(raws, result, finish, deadline)
    outer = p.inner.then(_unwrap)
    completer.put(p)
    return _AsyncWork(p.inner, outer)


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
        # The operation's deadline bounds the wait; `timeout` is not needed for that.
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
