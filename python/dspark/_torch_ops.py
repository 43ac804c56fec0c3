"""The backend's common part (part of :mod:`dspark.torch`): a group's communicators, the path
every collective takes into dspark (synchronous, asynchronous, CUDA, coalesced), barriers,
``monitored_barrier`` and the rest of the group's methods."""

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from . import _dspark
from ._dspark import InvalidArgumentError
from ._torch_args import (
    _BOOL_OPS,
    _OPS,
    _RED,
    _UNSUPPORTED_OPS,
    NAME,
    _chain,
    _flat,
    _premul_factor,
    _seconds,
)
from ._torch_collectives import _Collectives
from ._torch_errors import _torch_class, _torch_error
from ._torch_work import _async_work, _Completer, _Done


# The sends and receives inside a collective (gather, scatter), named apart from a user's.
_ON_COMM = {"coll_send": "send", "coll_recv": "recv"}


def _lane(prepared):
    """The completer lane of prepared calls: the communicators they run on, in order."""
    return tuple(dict.fromkeys(id(p[0]) for p in prepared))


class _Ops(_Collectives):
    """The collectives, shared by :class:`DsparkBackend` and :class:`DsparkProcessGroup`: set-up,
    the plumbing every collective goes through (:meth:`_go`), barriers and the rest here; the
    collectives' argument handling in :class:`~dspark._torch_collectives._Collectives`."""

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
        # The coalesced calls being gathered, per thread (`_coalesced`): None when no thread
        # gathers, so the fast path's one look stays cheap.
        self._collect = None
        self._collect_lock = threading.Lock()
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
        collect = self._collect  # read once: another thread may end its gathering now
        if collect is not None:
            # Inside a coalesced call on this thread: gathered, run at its end. Another
            # thread's calls meanwhile (a Work's callback issuing a collective) run as usual.
            parts = collect.get(threading.get_ident())
            if parts is not None:
                parts.append((calls, keep, finishers))
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
            if coll in ("send", "recv"):
                c = self._p2p_comm(coll, peer)
            else:
                # A collective's own sends and receives (gather, scatter: `_ON_COMM`) run on
                # the collectives' communicator, in their order: on the point-to-point
                # ones a user's isend still in flight took the scatter's place in the
                # peer's recv (the two swapped data, or failed with a mismatch).
                c = self._comm
                coll = _ON_COMM.get(coll, coll)
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
        return _async_work(self._completer, raws, result, finish, deadline,
                           _lane(prepared))

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
        current = torch.cuda.current_stream(dev)
        stream = current.cuda_stream
        # Point-to-point calls leave the stream free (torch's semantics: their Work is waited
        # for before the tensors are used): an isend and an irecv issued back to back run on
        # communicators of their own, and with the stream made to wait for the isend the
        # irecv's start (after the stream's earlier work) would wait for it, while the peer's
        # isend waits for this irecv: more than the transport buffers would never move.
        p2p = all(p[1] in ("send", "recv") for p in prepared)
        raws = [
            c._start_device(coll, dt, sp, rp, count, keep, dev.index, stream, op, peer, timeout,
                            ordered=not p2p)
            for c, coll, dt, sp, rp, count, op, peer in prepared
        ]
        deadline = timeout or self._deadline
        if p2p:
            # Copies back into non-contiguous outputs once the calls completed (the Work
            # completes after they are queued), on the caller's stream, not the completer
            # thread's.
            def done(finish=finish, current=current):
                with torch.cuda.stream(current):
                    finish()

            return _async_work(self._completer, raws, result,
                               None if finish is None else done, deadline, _lane(prepared))
        # Copies back into non-contiguous outputs: queued now on the same stream, after the
        # collectives (a completer thread would queue them on its own default stream).
        if finish is not None:
            finish()
        return _async_work(self._completer, raws, result, None, deadline, _lane(prepared))

    def _coalesced(self, opts, result, issue):
        """Runs `issue()` (several single-op calls) as one operation: their calls are
        gathered and started together, with one Work. Only this thread's calls are gathered."""
        me = threading.get_ident()
        parts = []
        with self._collect_lock:
            gathering = dict(self._collect or {})
            outer = gathering.get(me)
            gathering[me] = parts
            self._collect = gathering
        try:
            issue()
        finally:
            with self._collect_lock:
                gathering = dict(self._collect)
                if outer is None:
                    del gathering[me]
                else:
                    gathering[me] = outer
                self._collect = gathering or None
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
        """The dspark communicator's facts (:meth:`dspark.Communicator.info`; through
        :func:`dspark.torch.info`)."""
        return self._comm.info()

    # -- dist.shrink_group (torch >= 2.15; the work is in _torch_shrink.py) -------------
    @property
    def supports_shrinking(self):
        from ._torch_route import DsparkBackend

        return DsparkBackend is not None

    def shrink(self, ranks_to_exclude, shrink_flags=0, opts=None):
        from . import _torch_shrink

        return _torch_shrink.shrink(self, ranks_to_exclude, shrink_flags, opts)
