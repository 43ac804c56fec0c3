"""dspark as a ``torch.distributed`` backend: ``init_process_group(backend="dspark")``.

Registration needs no ``import dspark``: torch >= 2.14 finds :func:`register` through the
``torch.distributed.backends`` entry point, older torch through the ``torch.backends``
autoload hook. ``import dspark.torch`` registers explicitly.

How it plugs in (see the README's PyTorch section):

- torch >= 2.14: :class:`DsparkBackend`, a Python subclass of c10d's ``Backend`` (torch's
  ``PyBackend`` trampoline, as torch's own nccl4py backend), for a group that shares its
  devices with another backend (``cpu:dspark,cuda:nccl``). A group that is dspark's alone
  (``backend="dspark"``), and every group on older torch: :class:`DsparkProcessGroup`, a
  Python ``ProcessGroup`` with both generations of method names and its own group-name
  storage, which ``dist.all_reduce`` calls without torch's C++ dispatch and trampoline
  (about 8 µs less per call on torch 2.15; :func:`_route`). ``DSPARK_TORCH_ROUTE=backend|pg``
  forces one.
- Rendezvous: through the store torch hands the factory (a ``PrefixStore`` per group), never
  by binding ``MASTER_PORT``. ``new_group`` and several groups per process work: each group
  is its own dspark communicator with its own sequence numbers and mismatch checks.
- Work: every Work's ``get_future()`` completes with the tensor list (DDP requires it).
  Synchronous calls (``async_op=False``) run at once on the caller's thread with the GIL
  released; asynchronous ones go through the communicator's progress thread and complete in
  issue order. The timeout of ``init_process_group(timeout=...)`` is every call's deadline
  (torch has no watchdog for Python backends: dspark's deadlines are the guard).
- Errors: dspark's classes, each raised through this backend as a subclass that is also
  the matching ``torch.distributed`` error (``DistBackendError``, ``DistNetworkError``,
  ``DistStoreError``; :func:`_torch_error`), a timeout's message with torch's "Timed out".
  ``Work.wait()`` raises an asynchronous operation's error. ``dist.monitored_barrier``
  names the ranks that did not arrive, as gloo's (:meth:`_Ops.monitored_barrier`).
- Asynchronous operations hold their tensors and the tensors' storages until they
  completed, so ``del`` or ``set_()`` of a tensor in flight is harmless. As with torch's
  own backends, growing a tensor in flight with ``resize_`` (which reallocates its storage
  in place) or using it before the Work completed is the caller's error.
- Tensors reach dspark as data pointers: no copies for contiguous tensors of float32,
  float64, float16, bfloat16, int8, uint8, int32, int64 (and uint32, uint64, bool, complex
  where an op makes sense for them). Non-contiguous tensors are copied to contiguous ones and
  back; never is wrong data sent.
"""

import atexit
import os
import queue
import sys
import threading
import time
import warnings
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from . import _dspark
from . import _flight
from ._buffers import TORCH_DTYPES
from ._dspark import InvalidArgumentError, UnavailableError

__all__ = ["register", "DsparkBackend", "DsparkProcessGroup", "NAME"]

NAME = "dspark"

_RED = dist.ReduceOp.RedOpType
_OPS = {
    _RED.SUM: "sum",
    _RED.PRODUCT: "prod",
    _RED.MIN: "min",
    _RED.MAX: "max",
    _RED.AVG: "avg",
}
_UNSUPPORTED_OPS = {
    getattr(_RED, n): n for n in ("BAND", "BOR", "BXOR") if hasattr(_RED, n)
}
_UNSET_TIMEOUT = dist.AllreduceOptions().timeout
# torch.distributed re-exports AllgatherOptions from 2.9 on; 2.8 has it only in _c10d.
_AllgatherOptions = getattr(dist, "AllgatherOptions", None) or getattr(
    torch._C._distributed_c10d, "AllgatherOptions"
)
# The fast path's tables (`allreduce`): torch dtype -> index into the native module's
# `_FAST_DTYPES`, and the code of a plain ReduceOp -> index into its `_FAST_OPS`. The op's
# code is read as `hash(opts.reduceOp)`: c10d's ReduceOp hashes to its RedOpType's value,
# which costs one C call where `opts.reduceOp.op` makes an enum object and hashing that
# calls back into pybind (0.9 us against 0.25 us a call). Checked here for every plain op;
# a torch where it does not hold gets an empty table, i.e. the general path.
_FAST_DTYPES = {
    getattr(torch, name): _dspark._FAST_DTYPES.index(code)
    for name, code in (
        ("float32", "f32"), ("float64", "f64"), ("float16", "f16"), ("bfloat16", "bf16"),
        ("int8", "i8"), ("uint8", "u8"), ("int32", "i32"), ("int64", "i64"),
    )
}


def _fast_op_table():
    table = {}
    for kind, name in _OPS.items():
        try:
            code = int(kind)
            if hash(dist.ReduceOp(kind)) != code:
                return {}
        except Exception:  # noqa: BLE001 - an unexpected torch: no fast path
            return {}
        table[code] = _dspark._FAST_OPS.index(name)
    return table


_FAST_OPS = _fast_op_table()
# bool: OR for sum and max, AND for product and min (what NCCL and Gloo compute).
_BOOL_OPS = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


def _seconds(td):
    """A timedelta (or None) as seconds, None when unset (torch uses -1 ms for unset)."""
    if td is None:
        return None
    s = td.total_seconds() if hasattr(td, "total_seconds") else float(td)
    return s if s > 0 else None


# ----------------------------------------------------------------------------- errors

# dspark's errors as torch sees them: each class raised through this backend is also the
# torch.distributed error that names the same failure, where this torch has it (2.15:
# DistBackendError, DistNetworkError, DistStoreError; all RuntimeErrors), so code written
# for gloo or NCCL (`except dist.DistBackendError`) catches dspark's too, and
# `except dspark.TimeoutError` still works. The plain `dspark` module never imports torch:
# the subclasses live here, made once per (dspark class, torch classes).
_DistBackendError = getattr(dist, "DistBackendError", None)
_DistNetworkError = getattr(dist, "DistNetworkError", None)
_DistStoreError = getattr(dist, "DistStoreError", None)
_TORCH_BASES = {
    _dspark.TimeoutError: (_DistBackendError,),
    _dspark.PeerLostError: (_DistNetworkError, _DistBackendError),
    _dspark.IoError: (_DistNetworkError, _DistBackendError),
    _dspark.AbortedError: (_DistBackendError,),
    _dspark.MismatchError: (_DistBackendError,),
    _dspark.InternalError: (_DistBackendError,),
}
_TORCH_CLASSES = {}
_MAPPED = set()
# What the Rust side puts in the message of an error the rendezvous store raised.
_STORE_MARK = "rendezvous: store "


def _torch_class(cls, store):
    key = (cls, store)
    got = _TORCH_CLASSES.get(key)
    if got is None:
        bases = tuple(b for b in _TORCH_BASES.get(cls, ()) if b is not None)
        if store and _DistStoreError is not None:
            bases = (_DistStoreError, *bases)
        got = cls
        if bases:
            try:
                got = type(cls.__name__, (cls, *bases), {
                    "__module__": __name__,
                    "__doc__": f"{cls.__doc__} Also {', '.join(b.__name__ for b in bases)}.",
                })
                _MAPPED.add(got)
            except TypeError:  # a torch whose error classes cannot be mixed in: keep dspark's
                got = cls
        _TORCH_CLASSES[key] = got
    return got


def _torch_error(e, deadline_s=None, rendezvous=False):
    """`e` (a dspark error) as the class torch's conventions recognise (see above); a
    timeout's message also starts as torch's backends' do ("... Timed out waiting 1000ms",
    which torch's tests match with ``" (Timed out|closed|timeout) "``). `rendezvous`: `e`
    ended a group's creation, where a timeout means ranks did not all join, which gloo
    reports as the store's (``DistStoreError``). Anything else is returned as it is."""
    _flight.on_error(e)  # TORCH_FR_DUMP_ON_TIMEOUT: dump, and ask the other ranks to dump
    cls = type(e)
    if cls in _MAPPED or cls not in _TORCH_BASES:
        return e
    msg = str(e)
    store = _STORE_MARK in msg or (rendezvous and issubclass(cls, _dspark.TimeoutError))
    new_cls = _torch_class(cls, store)
    if new_cls is cls:
        return e
    if issubclass(cls, _dspark.TimeoutError):
        ms = f" {int(deadline_s * 1000)}ms" if deadline_s else ""
        msg = f"dspark: Timed out waiting{ms}: {msg}"
    new = new_cls(msg)
    new.__traceback__ = e.__traceback__
    return new


# ------------------------------------------------------------------------------- Work


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


# ---------------------------------------------------------------------------- buffers


def _flat(t):
    """The dspark view of a contiguous tensor: (tensor actually passed, dtype name)."""
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    elif t.is_complex():
        t = torch.view_as_real(t)
    dt = TORCH_DTYPES.get(str(t.dtype))
    if dt is None:
        raise InvalidArgumentError(
            f"dspark: tensors of dtype {t.dtype} are not supported (float32, float64, "
            "float16, bfloat16, int8, uint8, int32, int64, uint32, uint64, bool, complex)"
        )
    return t, dt


def _check_device(t, what, cuda=False):
    """CPU tensors everywhere; CUDA tensors where the operation goes through `_go` (the
    device path, ordered on torch's current stream)."""
    if t.device.type == "cpu" or (cuda and t.device.type == "cuda"):
        return
    raise UnavailableError(
        f"dspark: {what} is on {t.device}; this dspark torch backend runs this operation "
        "on CPU tensors only" + ("" if t.device.type != "cuda" else
        " (CUDA tensors: all_reduce, broadcast, reduce, all_gather, reduce_scatter, "
        "send/recv and the coalesced forms)") + ". Use "
        "init_process_group(backend=\"cpu:dspark,cuda:nccl\") to keep CUDA tensors on "
        "NCCL."
    )


def _input(t, what):
    """A contiguous tensor holding t's data (t itself when it is contiguous)."""
    _check_device(t, what, cuda=True)
    return t if t.is_contiguous() else t.contiguous()


def _output(t, what, finishers):
    """A contiguous tensor that receives t's result; registers a copy back when t is not
    contiguous."""
    _check_device(t, what, cuda=True)
    if t.is_contiguous():
        return t
    tmp = t.contiguous()
    finishers.append(lambda: t.copy_(tmp))
    return tmp


def _chain(finishers):
    if not finishers:
        return None

    def run():
        for f in finishers:
            f()

    return run


def _premul_factor(red):
    """The factor of a PREMUL_SUM ReduceOp (`dist._make_nccl_premul_sum(f)`): an attribute
    on newer torch; on older ones (2.8) only in the op's pickled state, `(op, factor)`."""
    factor = getattr(red, "factor", None)
    if factor is None:
        try:
            state = red.__getstate__()
            factor = state[1] if isinstance(state, tuple) and len(state) > 1 else None
        except Exception:
            factor = None
    return factor


# --------------------------------------------------------------------------- the backend


class _Ops:
    """The collectives, shared by :class:`DsparkBackend` and :class:`DsparkProcessGroup`."""

    def _setup(self, store, rank, size, timeout, group_id=None, comm=None):
        self._timeout = timeout if timeout is not None else timedelta(minutes=30)
        self._deadline = _seconds(self._timeout)
        try:
            # `comm`: a communicator made already (a shrink's, `_torch_shrink.py`).
            self._comm = comm if comm is not None else _dspark.Communicator.init_with_store(
                store, rank, size, self._deadline
            )
        except _dspark.Error as e:
            raise _torch_error(e, self._deadline, rendezvous=True) from None
        # monitored_barrier meets through the store (see there).
        self._store = store
        self._mb_seq = 0
        self._r = rank
        self._n = size
        self._group_id = group_id
        self._completer = _Completer()
        self._all_reduce = self._comm._all_reduce
        # The fast path's completed Work: a C++ one (torch's wait on a Python Work calls
        # back into Python, 0.7-0.8 us inside the dispatch), wrapping a future completed
        # with a list that each call fills with its tensor (get_future() gives the tensor
        # list, as DDP needs of every Work). A synchronous call's Work is only waited for
        # (torch's wrapper drops it): one per backend serves them all.
        self._sync_tensors = [None]
        fut = torch.futures.Future()
        fut.set_result(self._sync_tensors)
        self._sync_work = _create_work_from_future(fut)
        self._collect = None
        # Point-to-point messages travel on two more communicators, one per direction
        # (lower to higher rank, higher to lower): each runs its operations in order, so
        # with a single queue an irecv posted before the matching isend (every rank
        # receiving from its left, then sending to its right) would wait for a send queued
        # behind it. Split here, at init, because only the ranks of a send and its recv
        # take part in it later.
        self._p2p = None
        if size > 1:
            try:
                self._p2p = (self._comm.split(0, rank), self._comm.split(0, rank))
            except _dspark.Error as e:
                raise _torch_error(e, self._deadline) from None

    def _p2p_comm(self, coll, peer):
        lo_to_hi = (self._r < peer) if coll == "send" else (peer < self._r)
        return self._p2p[0 if lo_to_hi else 1]

    # -- plumbing ----------------------------------------------------------------------
    def _op(self, red, dtype, what):
        """(dspark op name, premultiply factor or None) for a torch ReduceOp."""
        kind = getattr(red, "op", red)
        if kind in _UNSUPPORTED_OPS:
            raise InvalidArgumentError(
                f"dspark: {what}: ReduceOp.{_UNSUPPORTED_OPS[kind]} is not supported "
                "(dspark reduces with SUM, PRODUCT, MIN, MAX, AVG and PREMUL_SUM)"
            )
        factor = None
        if kind == _RED.PREMUL_SUM:
            factor = _premul_factor(red)
            if factor is None:
                raise InvalidArgumentError(f"dspark: {what}: PREMUL_SUM without a factor")
            name = "sum"
        else:
            name = _OPS.get(kind)
            if name is None:
                raise InvalidArgumentError(f"dspark: {what}: unsupported ReduceOp {red}")
        if dtype == torch.bool:
            if name not in _BOOL_OPS or factor is not None:
                raise InvalidArgumentError(
                    f"dspark: {what}: {name} is not defined for bool tensors"
                )
            name = _BOOL_OPS[name]
        elif dtype.is_complex and (name not in ("sum", "avg")):
            raise InvalidArgumentError(
                f"dspark: {what}: {name} is not defined for complex tensors"
            )
        if factor is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise InvalidArgumentError(
                f"dspark: {what}: PREMUL_SUM needs a floating-point tensor, not {dtype}"
            )
        return name, factor

    def _go(self, opts, calls, keep, result, finishers=(), sync=None):
        """Runs or starts `calls`: (collective, send tensor|None, recv tensor|None, count,
        op, root/peer). `keep` holds every tensor the calls touch; `finishers` run once the
        calls completed (copies back into non-contiguous outputs). Synchronous calls return a
        completed Work; asynchronous ones a future-backed one."""
        if self._collect is not None:  # inside a coalesced call: gathered, run at its end
            self._collect.append((calls, keep, finishers))
            return None
        async_op = getattr(opts, "asyncOp", True) if sync is None else not sync
        timeout = _seconds(getattr(opts, "timeout", None))
        finish = _chain(list(finishers))
        prepared = []
        devices = set()
        # The storages the pointers point into, held with the tensors until the calls
        # completed: a `set_()` or `del` of a tensor meanwhile leaves its memory alive.
        storages = []
        for coll, s, r, count, op, peer in calls:
            dt = "u8"
            sp = rp = 0
            if s is not None:
                devices.add(s.device)
                s, dt = _flat(s)
                sp = s.data_ptr()
                storages.append(s.untyped_storage())
            if r is not None:
                devices.add(r.device)
                r, dt = _flat(r)
                rp = r.data_ptr()
                storages.append(r.untyped_storage())
            if count is None:
                count = (s if s is not None else r).numel()
            c = self._p2p_comm(coll, peer) if coll in ("send", "recv") else self._comm
            prepared.append((c, coll, dt, sp, rp, count, op, peer))
        keep = (keep, storages)
        cuda = [d for d in devices if d.type == "cuda"]
        deadline = timeout or self._deadline
        try:
            if cuda:
                return self._go_cuda(devices, prepared, keep, result, finish, timeout)
            if not async_op:
                for c, coll, dt, sp, rp, count, op, peer in prepared:
                    c._run(coll, dt, sp, rp, count, op, peer, timeout)
                if finish is not None:
                    finish()
                return _Done(result)
            raws = [
                c._start(coll, dt, sp, rp, count, keep, op, peer, timeout)
                for c, coll, dt, sp, rp, count, op, peer in prepared
            ]
        except _dspark.Error as e:
            raise _torch_error(e, deadline) from None
        return _async_work(self._completer, raws, result, finish, deadline)

    def _go_cuda(self, devices, prepared, keep, result, finish, timeout):
        """CUDA tensors: every call is queued on torch's current stream of their GPU and
        returns at once, as NCCL's do; the Work's future completes (with the result) once
        they completed. A synchronous call is the same: work torch queues afterwards on that
        stream sees the result."""
        if len(devices) != 1:
            raise InvalidArgumentError(
                "dspark: one operation's tensors must all be on one CUDA device, not "
                + ", ".join(sorted(str(d) for d in devices))
            )
        (dev,) = devices
        stream = torch.cuda.current_stream(dev).cuda_stream
        raws = [
            c._start_device(coll, dt, sp, rp, count, keep, dev.index, stream, op, peer, timeout)
            for c, coll, dt, sp, rp, count, op, peer in prepared
        ]
        # Copies back into non-contiguous outputs: queued now on the same stream, after the
        # collectives (a completer thread would queue them on its own default stream).
        if finish is not None:
            finish()
        return _async_work(self._completer, raws, result, None, timeout or self._deadline)

    def _coalesced(self, opts, result, issue):
        """Runs `issue()` (several single-op calls) as one operation: their calls are
        gathered and started together, with one Work."""
        self._collect = []
        try:
            issue()
            parts = self._collect
        finally:
            self._collect = None
        calls, keep, fins = [], [], []
        for c, k, f in parts:
            calls += c
            keep += k
            fins += f
        return self._go(opts, calls, keep, result, fins)

    def _root(self, root, what):
        root = int(root)
        if not 0 <= root < self._n:
            raise InvalidArgumentError(
                f"dspark: {what}: root {root} is not a rank of this group (size {self._n})"
            )
        return root

    def _elems(self, t):
        """Elements as dspark counts them (complex counts twice)."""
        return t.numel() * (2 if t.is_complex() else 1)

    # -- all_reduce --------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        # The common case (one contiguous CPU tensor, a plain op: every DDP bucket, every
        # dist.all_reduce) without the general path's bookkeeping: a handful of attribute
        # reads and one native call with plain ints.
        if len(tensors) == 1 and self._collect is None:
            t = tensors[0]
            op = _FAST_OPS.get(hash(opts.reduceOp))
            dt = _FAST_DTYPES.get(t.dtype)
            if (op is not None and dt is not None and t.is_cpu and not t.is_sparse
                    and t.is_contiguous()):
                td = opts.timeout
                timeout = None if td == _UNSET_TIMEOUT else _seconds(td)
                try:
                    if opts.asyncOp:
                        p = t.data_ptr()
                        # The storage too: see `_go`.
                        w = self._comm._start("all_reduce", _dspark._FAST_DTYPES[dt], p, p,
                                              t.numel(), (tensors, t.untyped_storage()),
                                              _dspark._FAST_OPS[op], 0, timeout)
                        return _async_work(self._completer, [w], tensors, None,
                                           timeout or self._deadline)
                    self._all_reduce(t.data_ptr(), t.numel(), dt, op, timeout)
                except _dspark.Error as e:
                    raise _torch_error(e, timeout or self._deadline) from None
                self._sync_tensors[0] = t
                return self._sync_work
        if any(t.is_sparse for t in tensors):
            from ._sparse import all_reduce as sparse_all_reduce  # as gloo's

            return sparse_all_reduce(self, tensors, opts)
        calls, keep, fin = [], list(tensors), []
        for t in tensors:
            op, factor = self._op(opts.reduceOp, t.dtype, "allreduce")
            out = _output(t, "allreduce tensor", fin)
            src = out
            if factor is not None:
                src = out * factor
                keep.append(src)
            calls.append(("all_reduce", src, out, None, op, 0))
            keep.append(out)
        return self._go(opts, calls, keep, list(tensors), fin)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self.allreduce(tensors, opts)

    # -- broadcast ---------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        root = self._root(opts.rootRank, "broadcast")
        calls, keep, fin = [], list(tensors), []
        for t in tensors:
            out = _output(t, "broadcast tensor", fin)
            calls.append(("broadcast", out, out, None, None, root))
            keep.append(out)
        return self._go(opts, calls, keep, list(tensors), fin)

    # -- reduce ------------------------------------------------------------------------
    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        root = self._root(opts.rootRank, "reduce")
        calls, keep, fin = [], list(tensors), []
        for t in tensors:
            op, factor = self._op(opts.reduceOp, t.dtype, "reduce")
            out = _output(t, "reduce tensor", fin) if self._r == root else _input(t, "reduce tensor")
            src = out if factor is None else out * factor
            calls.append(("reduce", src, out, None, op, root))
            keep += [out, src]
        return self._go(opts, calls, keep, list(tensors), fin)

    # -- all_gather --------------------------------------------------------------------
    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        if output.numel() != input.numel() * self._n or output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"dspark: all_gather_into_tensor: output has {output.numel()} {output.dtype} "
                f"elements, expected {input.numel()} {input.dtype} x group size {self._n}"
            )
        fin = []
        inp = _input(input, "all_gather input")
        out = _output(output, "all_gather output", fin)
        return self._go(
            opts,
            [("all_gather", inp, out, self._elems(inp), None, 0)],
            [input, output, inp, out],
            [output],
            fin,
        )

    _allgather_base = all_gather_single

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        calls, keep, fin = [], [output_lists, inputs], []
        for outs, t in zip(output_lists, inputs):
            if len(outs) != self._n or any(
                o.numel() != t.numel() or o.dtype != t.dtype for o in outs
            ):
                raise InvalidArgumentError(
                    f"dspark: all_gather: expected {self._n} output tensors of {t.numel()} "
                    f"{t.dtype} elements each"
                )
            inp = _input(t, "all_gather input")
            flat = torch.empty(t.numel() * self._n, dtype=t.dtype)
            calls.append(("all_gather", inp, flat, self._elems(inp), None, 0))
            keep += [inp, flat]

            def copy_out(outs=outs, flat=flat, k=t.numel()):
                for i, o in enumerate(outs):
                    o.copy_(flat[i * k:(i + 1) * k].view(o.shape))

            fin.append(copy_out)
        return self._go(opts, calls, keep, list(output_lists), fin)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # output_lists[rank][j] receives input j of that rank (the transpose of allgather's
        # layout, where outputs[j][rank] does).
        if len(output_lists) != self._n or any(len(o) != len(inputs) for o in output_lists):
            raise InvalidArgumentError(
                f"dspark: all_gather_coalesced: expected {self._n} output lists of "
                f"{len(inputs)} tensors each"
            )
        per_input = [[output_lists[r][j] for r in range(self._n)] for j in range(len(inputs))]
        return self._coalesced(opts, list(output_lists),
                               lambda: self.allgather(per_input, inputs, opts))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        def issue():
            for o, i in zip(outputs, inputs):
                self.all_gather_single(o, i, opts)

        return self._coalesced(opts, list(outputs), issue)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- reduce_scatter ----------------------------------------------------------------
    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if input.numel() != output.numel() * self._n or output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"dspark: reduce_scatter_tensor: input has {input.numel()} {input.dtype} "
                f"elements, expected {output.numel()} {output.dtype} x group size {self._n}"
            )
        op, factor = self._op(opts.reduceOp, input.dtype, "reduce_scatter")
        fin = []
        inp = _input(input, "reduce_scatter input")
        if factor is not None:
            inp = inp * factor
        out = _output(output, "reduce_scatter output", fin)
        return self._go(
            opts,
            [("reduce_scatter", inp, out, self._elems(out), op, 0)],
            [input, output, inp, out],
            [output],
            fin,
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        calls, keep, fin = [], [outputs, input_lists], []
        for out_t, ins in zip(outputs, input_lists):
            if len(ins) != self._n or any(
                i.numel() != out_t.numel() or i.dtype != out_t.dtype for i in ins
            ):
                raise InvalidArgumentError(
                    f"dspark: reduce_scatter: expected {self._n} input tensors of "
                    f"{out_t.numel()} {out_t.dtype} elements each"
                )
            op, factor = self._op(opts.reduceOp, out_t.dtype, "reduce_scatter")
            for i in ins:
                _check_device(i, "reduce_scatter input")
            flat = torch.cat([i.reshape(-1) for i in ins])
            if factor is not None:
                flat.mul_(factor)
            out = _output(out_t, "reduce_scatter output", fin)
            calls.append(("reduce_scatter", flat, out, self._elems(out), op, 0))
            keep += [flat, out]
        return self._go(opts, calls, keep, list(outputs), fin)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        def issue():
            for o, i in zip(outputs, inputs):
                self.reduce_scatter_single(o, i, opts)

        return self._coalesced(opts, list(outputs), issue)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- all_to_all --------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        n = self._n
        if output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"dspark: all_to_all_single: input is {input.dtype} but output is {output.dtype}"
            )
        _check_device(input, "all_to_all input")
        _check_device(output, "all_to_all output")
        if not input.is_contiguous() or not output.is_contiguous():
            # torch's own check, the same for every backend.
            raise InvalidArgumentError("dspark: all_to_all_single: Tensors must be contiguous")
        in_rows = input.size(0) if input.dim() else 1
        out_rows = output.size(0) if output.dim() else 1
        in_row = input.numel() // in_rows if in_rows else 0
        out_row = output.numel() // out_rows if out_rows else 0
        ins = list(input_split_sizes) or None
        outs = list(output_split_sizes) or None
        if ins is None and outs is None and input.numel() == output.numel() and input.numel() % n == 0:
            return self._go(
                opts,
                [("all_to_all", input, output, self._elems(input) // n, None, 0)],
                [input, output],
                [output],
            )
        if ins is None:
            if in_rows % n:
                raise InvalidArgumentError(
                    f"dspark: all_to_all_single: {in_rows} input rows do not split into {n}"
                )
            ins = [in_rows // n] * n
        if outs is None:
            if out_rows % n:
                raise InvalidArgumentError(
                    f"dspark: all_to_all_single: {out_rows} output rows do not split into {n}"
                )
            outs = [out_rows // n] * n
        if len(ins) != n or len(outs) != n or sum(ins) != in_rows or sum(outs) != out_rows:
            raise InvalidArgumentError(
                f"dspark: all_to_all_single: split sizes {ins} / {outs} do not match "
                f"{in_rows} input / {out_rows} output rows and group size {n}"
            )
        in_counts = [s * in_row for s in ins]
        out_counts = [s * out_row for s in outs]
        return self._all_to_allv(opts, input.reshape(-1), in_counts, output.reshape(-1),
                                 out_counts, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        if len(outputs) != self._n or len(inputs) != self._n:
            raise InvalidArgumentError(
                f"dspark: all_to_all: expected {self._n} input and output tensors"
            )
        dtype = inputs[0].dtype
        if any(t.dtype != dtype for t in list(inputs) + list(outputs)):
            raise InvalidArgumentError("dspark: all_to_all: tensors of different dtypes")
        for t in list(inputs) + list(outputs):
            _check_device(t, "all_to_all tensor")
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=dtype)

        def copy_out():
            off = 0
            for t in outputs:
                k = t.numel()
                t.copy_(flat_out[off:off + k].view(t.shape))
                off += k

        return self._all_to_allv(opts, flat_in, [t.numel() for t in inputs], flat_out,
                                 [t.numel() for t in outputs], list(outputs), [copy_out],
                                 keep=[inputs, outputs])

    def _all_to_allv(self, opts, flat_in, in_counts, flat_out, out_counts, result,
                     finishers=(), keep=()):
        """Uneven all-to-all: every block padded to the largest block of the job (agreed by
        one small all_reduce MAX), one equal all_to_all, then unpacked."""
        n = self._n
        m = torch.tensor([max(in_counts + out_counts)], dtype=torch.int64)
        try:
            self._comm._run("all_reduce", "i64", m.data_ptr(), m.data_ptr(), 1, "max", 0,
                            _seconds(getattr(opts, "timeout", None)))
        except _dspark.Error as e:
            raise _torch_error(e, self._deadline) from None
        m = int(m.item())
        dtype = flat_in.dtype
        if all(c == m for c in in_counts + out_counts):
            return self._go(
                opts,
                [("all_to_all", flat_in, flat_out, self._elems(flat_in) // n, None, 0)],
                [flat_in, flat_out, *keep],
                result,
                finishers,
            )
        send = torch.zeros(n * m, dtype=dtype)
        off = 0
        for j, c in enumerate(in_counts):
            send[j * m:j * m + c] = flat_in[off:off + c]
            off += c
        recv = torch.empty(n * m, dtype=dtype)

        def unpack():
            o = 0
            for i, c in enumerate(out_counts):
                flat_out[o:o + c] = recv[i * m:i * m + c]
                o += c

        return self._go(
            opts,
            [("all_to_all", send, recv, self._elems(send) // n, None, 0)],
            [send, recv, flat_out, *keep],
            result,
            [unpack, *finishers],
        )

    # -- gather / scatter --------------------------------------------------------------
    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        root = self._root(opts.rootRank, "gather")
        t = _input(inputs[0], "gather input")
        if self._r != root:
            return self._go(opts, [("send", t, None, None, None, root)], [t], [])
        outs = output_lists[0]
        if len(outs) != self._n or any(o.numel() != t.numel() or o.dtype != t.dtype for o in outs):
            raise InvalidArgumentError(
                f"dspark: gather: expected {self._n} output tensors of {t.numel()} {t.dtype}"
            )
        calls, keep, fin = [], [t, outs], []
        for i, o in enumerate(outs):
            out = _output(o, "gather output", fin)
            keep.append(out)
            if i == root:
                fin.insert(0, lambda out=out: out.copy_(t.view(out.shape)))
            else:
                calls.append(("recv", None, out, None, None, i))
        return self._go(opts, calls, keep, [list(outs)], fin)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        root = self._root(opts.rootRank, "scatter")
        fin = []
        out = _output(outputs[0], "scatter output", fin)
        if self._r != root:
            return self._go(opts, [("recv", None, out, None, None, root)], [out, outputs],
                            list(outputs), fin)
        ins = input_lists[0]
        if len(ins) != self._n or any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
            raise InvalidArgumentError(
                f"dspark: scatter: expected {self._n} input tensors of {out.numel()} {out.dtype}"
            )
        calls, keep = [], [out, outputs]
        for i, t in enumerate(ins):
            src = _input(t, "scatter input")
            keep.append(src)
            if i == root:
                fin.insert(0, lambda src=src: out.copy_(src.view(out.shape)))
            else:
                calls.append(("send", src, None, None, None, i))
        return self._go(opts, calls, keep, list(outputs), fin)

    # -- point to point ----------------------------------------------------------------
    def send(self, tensors, dst, tag=0):
        dst = self._root(dst, "send")
        calls, keep = [], list(tensors)
        for t in tensors:
            src = _input(t, "send tensor")
            calls.append(("send", src, None, None, None, dst))
            keep.append(src)
        return self._go(None, calls, keep, list(tensors))

    def recv(self, tensors, src, tag=0):
        src = self._root(src, "recv")
        calls, keep, fin = [], list(tensors), []
        for t in tensors:
            out = _output(t, "recv tensor", fin)
            calls.append(("recv", None, out, None, None, src))
            keep.append(out)
        return self._go(None, calls, keep, list(tensors), fin)

    def recv_anysource(self, tensors, tag=0):
        from ._anysource import recv_anysource  # its Work reports the sender

        try:
            return recv_anysource(self, tensors)
        except _dspark.Error as e:
            raise _torch_error(e, self._deadline) from None

    recvAnysource = recv_anysource

    # -- barrier -----------------------------------------------------------------------
    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._go(opts, [("barrier", None, None, 0, None, 0)], [], [])

    # -- monitored_barrier -------------------------------------------------------------
    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        """``dist.monitored_barrier`` (gloo's semantics and messages): every rank but 0
        reports to rank 0, which waits for them within ``timeout`` and names the ranks that
        did not arrive ("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 2000 ms"; with
        ``wait_all_ranks`` every one: "Ranks 1, 2 failed ..."), then releases them. Rank 0
        gives up when the timeout has run out (``wait_all_ranks`` too, where gloo waits the
        timeout once per missing rank). The others wait for rank 0's verdict as long as the
        group's timeout (as gloo, so that they are not the first to fail) and raise with
        what rank 0 reported when it failed.

        It meets through the group's store (keys under ``dspark-mb/<call>/``), not the
        communicator: a rank that never arrives leaves nothing behind in the data streams,
        and one that arrives late learns rank 0's verdict at once. The errors are
        ``dspark.TimeoutError`` (also ``torch.distributed.DistBackendError``).

        ``opts`` is what each route passes: a ``BarrierOptions`` (the c10d Backend route),
        a ``timedelta`` or seconds (``ProcessGroup.monitored_barrier``), or None."""
        timeout = getattr(opts, "timeout", opts)
        if timeout is None:
            secs = None
        elif hasattr(timeout, "total_seconds"):
            secs = timeout.total_seconds()
        else:
            secs = float(timeout)
        if secs is None or secs < 0:  # unset (torch's -1 ms): the group's timeout
            secs = self._timeout.total_seconds()
        self._mb_seq += 1
        if self._n == 1:
            return
        prefix = f"dspark-mb/{self._mb_seq}/"
        store = self._store
        if self._r != 0:
            self._mb_follow(store, prefix, max(secs, self._timeout.total_seconds()))
        else:
            self._mb_lead(store, prefix, secs, wait_all_ranks)

    def _mb_fail(self, msg):
        return _torch_class(_dspark.TimeoutError, False)(msg)

    def _mb_follow(self, store, prefix, secs):
        r = self._r
        head = (f"Rank {r} successfully reached monitoredBarrier, but received errors while "
                "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.")
        try:
            store.set(f"{prefix}arrived/{r}", "1")
            store.wait([f"{prefix}verdict"], timedelta(seconds=secs))
            verdict = store.get(f"{prefix}verdict").decode("utf-8", "replace")
        except Exception as e:  # noqa: BLE001 - the store's own error, reported
            raise self._mb_fail(
                f"{head}\n dspark: no word from rank 0 within {secs * 1000:.0f} ms: "
                f"{type(e).__name__}: {e}") from None
        try:
            if store.add(f"{prefix}read", 1) == self._n - 1:  # the last reader tidies up
                for k in ("verdict", "read"):
                    store.delete_key(f"{prefix}{k}")
        except Exception:  # noqa: BLE001 - a store without delete_key: a few bytes stay
            pass
        if verdict != "ok":
            raise self._mb_fail(f"{head}\n Rank 0 reported: {verdict}")

    def _mb_lead(self, store, prefix, secs, wait_all):
        ms = int(secs * 1000)
        deadline = time.monotonic() + secs
        passed, failed, why = [], [], {}
        for i in range(1, self._n):
            key = f"{prefix}arrived/{i}"
            left = deadline - time.monotonic()
            if not wait_all and left <= 0:
                done = (f"Successfully processed ranks: {', '.join(map(str, passed))}"
                        if passed else "No ranks successfully processed in monitoredBarrier.")
                msg = f"Rank 0 timed out in monitoredBarrier after {ms} ms.\n{done}"
                self._mb_verdict(store, prefix, msg)
                raise self._mb_fail(msg)
            try:
                # store.wait with 0 waits forever: check once when no time is left
                if left > 0:
                    store.wait([key], timedelta(seconds=left))
                elif not store.check([key]):
                    raise LookupError("not arrived")
                passed.append(i)
            except Exception as e:  # noqa: BLE001 - a timeout, or the store failed
                why[i] = f"{type(e).__name__}: {e}"
                if not wait_all:
                    msg = f"[Rank 0]: Rank {i} failed to pass monitoredBarrier in {ms} ms"
                    self._mb_verdict(store, prefix, msg)
                    raise self._mb_fail(
                        f"{msg}\n dspark: it had not arrived when the timeout ran out "
                        f"(the store said {why[i]})") from None
                failed.append(i)
        if failed:
            msg = (f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass "
                   f"monitoredBarrier in {ms} ms")
            self._mb_verdict(store, prefix, msg)
            raise self._mb_fail(msg)
        self._mb_verdict(store, prefix, "ok")

    def _mb_verdict(self, store, prefix, verdict):
        try:
            store.set(f"{prefix}verdict", verdict)
            for i in range(1, self._n):
                store.delete_key(f"{prefix}arrived/{i}")
        except Exception:  # noqa: BLE001 - the others then time out on their own
            pass

    # -- the rest ----------------------------------------------------------------------
    def getBackendName(self):
        return NAME

    def _comms(self):
        return [self._comm, *(self._p2p or ())]

    def abort(self):
        for c in self._comms():
            c.abort()

    def shutdown(self):
        for c in self._comms():
            c.close()
        self._completer.stop()

    def dspark_info(self):
        """The dspark communicator's facts (transport, path, rendezvous, timeout)."""
        return self._comm.info()

    # -- dist.shrink_group (torch >= 2.15; the work is in _torch_shrink.py) -------------
    @property
    def supports_shrinking(self):
        return DsparkBackend is not None

    def shrink(self, ranks_to_exclude, shrink_flags=0, opts=None):
        from . import _torch_shrink

        return _torch_shrink.shrink(self, ranks_to_exclude, shrink_flags, opts)


def _probe_backend_route():
    """Whether torch has the Python Backend trampoline (torch >= 2.14)."""
    try:
        from torch._C._distributed_c10d import Backend as C10DBackend

        class _Probe(C10DBackend):
            pass

        _Probe(0, 1)
        return True
    except Exception:  # noqa: BLE001 - "No constructor defined!" before 2.14
        return False


_HAS_PY_BACKEND = _probe_backend_route()

if _HAS_PY_BACKEND:
    from torch._C._distributed_c10d import Backend as _C10DBackend

    class DsparkBackend(_Ops, _C10DBackend):
        """dspark as a c10d ``Backend`` (torch >= 2.14)."""

        def __init__(self, store, rank, size, timeout, group_id=None, comm=None):
            _C10DBackend.__init__(self, rank, size)
            self._setup(store, rank, size, timeout, group_id, comm)
            self._options = _C10DBackend.Options(NAME, timeout=self._timeout)

        @property
        def options(self):
            return self._options

        @property
        def supports_splitting(self):
            return False

        @property
        def supports_coalescing(self):
            return False

else:
    DsparkBackend = None


class DsparkProcessGroup(_Ops, dist.ProcessGroup):
    """dspark as a Python ``ProcessGroup`` (every group that is dspark's alone, and every
    group on torch before 2.14; :func:`_route`). Keeps its own group name and description: a pure-Python
    ``ProcessGroup`` has no backend to hold them, and FSDP2's DeviceMesh needs them."""

    def __init__(self, store, rank, size, timeout, group_id=None):
        dist.ProcessGroup.__init__(self, rank, size)
        self._setup(store, rank, size, timeout, group_id)
        self._name = group_id or ""
        self._desc = ""

    def getGroupName(self):
        return self._name

    def setGroupName(self, name):
        self._name = name

    def _set_group_name(self, name):
        self._name = name

    @property
    def group_name(self):
        return self._name

    def getGroupDesc(self):
        return self._desc

    def setGroupDesc(self, desc):
        self._desc = desc

    def _set_group_desc(self, desc):
        self._desc = desc

    @property
    def group_desc(self):
        return self._desc

    def _get_backend(self, device=None):
        return self

    @property
    def _device_types(self):
        # torch's `dist.monitored_barrier` refuses a group without "cpu" here, and a group
        # that replaced torch's (this route) has no backends registered, so the list is
        # empty. Only that caller is told "cpu": the other readers of this list (object
        # collectives, the flight recorder's hook, shutdown) go on seeing what they always
        # saw, which is what they were written and tested against.
        f = sys._getframe(1)
        if (f.f_code.co_name == "monitored_barrier"
                and f.f_globals.get("__name__") == "torch.distributed.distributed_c10d"):
            return [torch.device("cpu")]
        return dist.ProcessGroup._device_types.__get__(self)

    def name(self):
        return NAME


def _group_backends():
    """The backend torch is creating this group with, per device (``{"cpu": "dspark",
    "cuda": "nccl"}``), read from the caller's ``backend_config``; None where it cannot be
    read (torch without that local: the caller then takes the Backend route, which is right
    for every backend string)."""
    f = sys._getframe(1)
    for _ in range(4):
        f = f.f_back
        if f is None:
            return None
        cfg = f.f_locals.get("backend_config")
        if cfg is not None and hasattr(cfg, "get_device_backend_map"):
            try:
                return {str(d): str(b).lower() for d, b in cfg.get_device_backend_map().items()}
            except Exception:  # noqa: BLE001 - a torch whose config differs: no answer
                return None
    return None


def _route():
    """``"backend"`` or ``"pg"``: how the group torch is creating plugs in.

    ``DSPARK_TORCH_ROUTE=backend|pg`` forces one. Otherwise: torch before 2.14 has only the
    ProcessGroup route. From 2.14 a group that is dspark's on every device takes the
    ProcessGroup route too: ``dist.all_reduce`` then calls dspark's Python method directly,
    where the Backend route goes through c10d's C++ ProcessGroup, its dispatcher and the
    Python trampoline back, about 8 µs more per call (torch 2.15, benches/torch_overhead.py).
    A group that shares its devices with another backend (``cpu:dspark,cuda:nccl``) must be
    a Backend: torch replaces the whole group with a ProcessGroup a factory returns.
    """
    forced = os.environ.get("DSPARK_TORCH_ROUTE", "").strip().lower()
    if forced == "pg" or not _HAS_PY_BACKEND:
        if forced == "backend":
            raise UnavailableError(
                "dspark: DSPARK_TORCH_ROUTE=backend needs torch >= 2.14 (a Python c10d "
                f"Backend); this is torch {torch.__version__}"
            )
        return "pg"
    if forced == "backend":
        return "backend"
    backends = _group_backends()
    if backends is None:
        # Degraded, not wrong: say so once.
        global _ROUTE_WARNED
        if not _ROUTE_WARNED:
            _ROUTE_WARNED = True
            warnings.warn(
                "dspark: could not read which backends this torch "
                f"({torch.__version__}) creates the group with; using c10d's Backend route, "
                "about 8 us more per call than the ProcessGroup route "
                "(DSPARK_TORCH_ROUTE=pg forces that one for groups that are dspark's alone)",
                RuntimeWarning,
                stacklevel=2,
            )
        return "backend"
    if all(b == NAME for b in backends.values()):
        return "pg"
    return "backend"


_ROUTE_WARNED = False


def _create(opts, backend_options=None):
    """The extended-API factory torch calls for every group this rank is in."""
    cls = DsparkBackend if _route() == "backend" else DsparkProcessGroup
    group = cls(
        opts.store,
        opts.group_rank,
        opts.group_size,
        getattr(opts, "timeout", None),
        getattr(opts, "group_id", None),
    )
    # init_process_group(device_id=...) bound torch's own group to a device before asking
    # for the backend; a group that replaces it keeps the binding.
    bound = getattr(getattr(opts, "process_group", None), "bound_device_id", None)
    if bound is not None and cls is DsparkProcessGroup:
        try:
            group.bound_device_id = bound
        except Exception:  # noqa: BLE001 - a torch without the setter: nothing to keep
            pass
    _flight.register(group, opts)  # TORCH_FR_*: torch's flight-recorder dumps
    return group


def dump_flight_record(path=None):
    """Writes this rank's flight record of every dspark group in torch's flight-recorder
    format (what ``torchfrtrace`` reads) to ``path``, by default
    ``${TORCH_FR_DUMP_TEMP_FILE}<global rank>`` (``/tmp/nccl_trace_rank_<rank>``); returns
    the path. The on-demand counterpart of ``TORCH_FR_DUMP_ON_TIMEOUT`` (see
    ``dspark/_flight.py``); ``flight_record_bytes()`` gives the pickle instead."""
    return _flight.dump(path)


def flight_record_bytes():
    """This rank's flight record in torch's format, pickled: what
    ``torch._C._distributed_c10d._dump_fr_trace()`` returns for torch's own backends."""
    return _flight.dump_bytes()


_registered = threading.Lock()


def register():
    """Registers backend ``"dspark"`` with torch.distributed (idempotent). torch calls this
    through the package's entry point; call it yourself only on torch without one."""
    with _registered:
        if hasattr(dist.Backend, NAME.upper()) and NAME.upper() in getattr(
            dist.Backend, "_plugins", {NAME.upper(): None}
        ):
            return
        dist.Backend.register_backend(
            NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )


register()
