"""``dist.recv(src=None)`` / ``dist.irecv(src=None)`` for the dspark torch backend: a receive
from any source, whose Work reports the sender (``work._source_rank()``, the group rank torch
turns into ``recv``'s return value).

Point-to-point messages travel on two communicators, one per direction (lower to higher
rank, and back: see ``_Ops._setup``), so a rank's senders are on one of them (rank 0 hears
only from higher ranks, the last rank only from lower ones) or on both. On one, the receive
is one ``Communicator.recv_any`` with the group's deadline. On both, it asks each in turn
for a message that starts arriving within a short slice (``try_recv_any``: nothing is taken
when none does, and the other direction's operations run in between), until one comes or
the deadline passes.

The receive runs on a thread of its own, so ``irecv`` returns at once; its Work completes
when the message is in the tensor. (So a receive from a named source issued right after it
may be matched first; MPI would match them in the order they were posted.)
"""

import threading
import time

import torch
import torch.distributed as dist

from . import _dspark
from ._torch_work import _wait_seconds, _wait_timed_out

# How long one direction is listened to before the other is (seconds).
_SLICE = 0.002


class _AnySourceWork(dist._Work):
    """The Work of a receive from any source: completes (or fails) when its thread ends."""

    def __init__(self, tensors):
        super().__init__()
        self._tensors = tensors
        self._done = threading.Event()
        self._src = -1
        self._exc = None
        self._fut = torch.futures.Future()

    def _finish(self, src, exc):
        self._src, self._exc = src, exc
        # The future first: a caller woken by `wait` may read `get_future().value()` at once.
        if exc is None:
            self._fut.set_result(self._tensors)
        else:
            self._fut.set_exception(exc)
        self._done.set()

    def wait(self, timeout=None):
        # The receive's own deadline bounds the wait; with `timeout`, it raises after that
        # long and the receive goes on.
        secs = _wait_seconds(timeout)
        if not self._done.wait(secs):
            raise _wait_timed_out(timeout)
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self):
        return self._done.is_set()

    def is_success(self):
        return self._done.is_set() and self._exc is None

    def exception(self):
        return self._exc if self._done.is_set() else None

    def result(self):
        self.wait()
        return self._tensors

    def _source_rank(self):
        """The group rank the message came from (torch's ``Work::sourceRank``)."""
        self.wait()
        return self._src

    source_rank = _source_rank

    def synchronize(self):
        pass

    def get_future(self):
        return self._fut


def recv_anysource(ops, tensors):
    """`ProcessGroup.recv_anysource` for `ops` (a dspark `_Ops`): starts the receive of
    `tensors` (one CPU tensor) and returns its Work."""
    from . import torch as _t  # the backend module (imports this one lazily)

    if len(tensors) != 1:
        raise _dspark.InvalidArgumentError(
            f"dspark: recv from any source takes one tensor, not {len(tensors)}"
        )
    (t,) = tensors
    if t.device.type != "cpu":
        raise _dspark.UnavailableError(
            f"dspark: recv from any source runs on CPU tensors; this one is on {t.device}"
        )
    if ops._p2p is None:
        raise _dspark.InvalidArgumentError(
            "dspark: recv from any source: no other rank in this group (size 1)"
        )
    fin = []
    out = _t._output(t, "recv tensor", fin)
    flat, dt = _t._flat(out)
    r, n = ops._r, ops._n
    # Lower ranks send on the first communicator, higher ones on the second.
    comms = ([ops._p2p[0]] if r > 0 else []) + ([ops._p2p[1]] if r < n - 1 else [])
    deadline_s = ops._deadline
    work = _AnySourceWork(list(tensors))

    def run():
        # `out` and `flat` (the memory received into) live as long as this closure.
        src, exc = -1, None
        try:
            src = _receive(comms, dt, flat, deadline_s, r)
            for f in fin:
                f()
        except _dspark.Error as e:
            exc = _t._torch_error(e, deadline_s)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            exc = e
        work._finish(src, exc)

    threading.Thread(target=run, name="dspark-recv-any", daemon=True).start()
    return work


def _receive(comms, dt, flat, deadline_s, rank):
    """The sender's group rank, once its message is in `flat`."""
    ptr, count = flat.data_ptr(), flat.numel()
    if len(comms) == 1:
        return comms[0]._recv_any(dt, ptr, count, None, deadline_s)
    if not deadline_s:
        deadline_s = comms[0].info()["timeout"]
    end = time.monotonic() + deadline_s
    while True:
        for c in comms:
            # What is left of the deadline, not all of it again: a message that starts
            # arriving late in the wait must end by the deadline too.
            left = max(end - time.monotonic(), 0.001)
            src = c._recv_any(dt, ptr, count, min(_SLICE, left), left)
            if src is not None:
                return src
        if time.monotonic() >= end:
            raise _dspark.TimeoutError(
                f"rank {rank}: timed out after {deadline_s:.3f} s in recv from any source: "
                "no message came from any other rank"
            )
