"""``dspark.Communicator``: dspark's collectives on numpy arrays and torch CPU tensors."""

import json
import os

from . import _dspark
from ._buffers import describe
from ._dspark import InvalidArgumentError

_OPS = {"sum", "prod", "min", "max", "avg"}


def _op_name(op):
    name = str(op).lower()
    if name == "product":
        name = "prod"
    if name not in _OPS:
        raise InvalidArgumentError(
            f"dspark: unknown reduce op {op!r} (expected one of sum, prod, min, max, avg)"
        )
    return name


class Work:
    """A non-blocking operation in flight, returned by ``async_op=True`` calls.

    The operation runs to completion in issue order whether or not anybody waits for it;
    the communicator keeps its buffers alive until then, so dropping a ``Work`` is safe.

    What is kept is the memory itself: a tensor's ``untyped_storage()``, and a
    ``memoryview`` of a numpy array or other buffer. So ``del`` of the array or tensor,
    ``tensor.set_(...)`` and a ``resize_`` within the storage's size are harmless while the
    operation runs, and a ``bytearray``/``array.array`` resize or a numpy ``resize()``
    raises. What remains the caller's contract, as with torch's own asynchronous work: do
    not grow a tensor with ``resize_`` (torch reallocates the storage in place and frees
    the old memory the operation still uses) nor ``resize(refcheck=False)`` a numpy array,
    and do not read or write the buffers, until the ``Work`` completed.
    """

    __slots__ = ("_w", "_result")

    def __init__(self, w, result):
        self._w = w
        self._result = result

    def wait(self, timeout=None):
        """Waits (GIL released) and returns the output array; raises the operation's error.
        With ``timeout`` (seconds), ``dspark.TimeoutError`` means it is still in flight."""
        self._w.wait(timeout)
        return self._result

    def test(self):
        """``True`` once done, ``False`` while in flight; raises the operation's error."""
        return self._w.test()

    def is_completed(self):
        """Whether it finished, successfully or not. Never raises."""
        return self._w.is_completed()

    def whereabouts(self):
        """Where it stands while in flight (``None`` once it ended): queued behind which
        running call and how many more, or running as which call (``all_reduce #17``) and for
        how long. Never blocks; ``wait(timeout)``'s ``TimeoutError`` says the same."""
        return self._w.whereabouts()

    def __repr__(self):
        return repr(self._w)


class Communicator:
    """A group of ranks running collectives together.

    Build one with :meth:`from_env` (under torchrun, mpirun, srun, or with ``DSPARK_*``
    variables, exactly as ``dspark-bench``) or :meth:`from_store` (through a torch
    ``Store``). Every rank must call the same collectives in the same order with matching
    arguments; mismatches raise ``MismatchError`` instead of corrupting data, and every call
    has a deadline (``DSPARK_TIMEOUT``, or ``timeout=`` per call), so a dead peer raises
    instead of hanging.

    Buffers are C-contiguous numpy arrays, contiguous torch CPU tensors, or other objects
    with the buffer protocol (``bytearray``, ``array.array``, ``memoryview``; ``bytes``
    where dspark only reads), of one of float32, float64, float16, bfloat16, int8, uint8,
    int32, uint32, int64, uint64. They are used in place, without copies, and the GIL is
    released while dspark communicates. Any other object (one that only offers
    ``__array_interface__``, say) raises ``InvalidArgumentError``, which is then also a
    ``TypeError``; an unusable buffer (read-only where dspark writes, strided, another
    dtype) one that is also a ``ValueError``.
    ``async_op=True`` returns a :class:`Work` instead of waiting.
    """

    def __init__(self, raw):
        if not isinstance(raw, _dspark.Communicator):
            raise TypeError("use Communicator.from_env() or Communicator.from_store()")
        self._c = raw

    @classmethod
    def from_env(cls):
        """Joins the job the environment describes (see the README's launcher section)."""
        return cls(_dspark.Communicator.from_env())

    @classmethod
    def from_store(cls, store, rank, world_size, timeout=None):
        """Joins through a key-value store with torch's interface (``torch.distributed``'s
        ``TCPStore``, ``FileStore``, ``HashStore``, ``PrefixStore``; ``set``, ``get``, ``add``,
        ``wait`` and ``compare_set``): rank 0 listens on an ephemeral port and publishes its
        address there, with a random secret that every rank proves unless they have a token
        (``DSPARK_JOB_TOKEN_FILE``): the job is as private as the store. ``timeout``: seconds,
        the deadline of every call (default ``DSPARK_TIMEOUT`` or 60 s)."""
        if hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        return cls(_dspark.Communicator.init_with_store(store, rank, world_size, timeout))

    @property
    def rank(self):
        return self._c.rank

    @property
    def world_size(self):
        return self._c.world_size

    def info(self):
        """Every fact the communicator knows about its paths, as a dict: the transport and
        why not a faster one, each connection's, hosts, CPU sharing, timeout (seconds), where
        all_reduce switches algorithm, the path device memory takes on every connection and
        why (`device_path`, `device_paths`), GPUs where asynchronous device calls block
        (`enqueue_blocks`, among those used so far), rendezvous, and how the ranks
        authenticated each other (`auth`).
        The same object as C's ``dspark_comm_describe``."""
        return self._c.info()

    # -- the collectives ---------------------------------------------------------------
    def _go(self, coll, dtype, send, recv, count, keep, result, op=None, peer=0,
            async_op=False, timeout=None, **exchange):
        if async_op:
            return Work(
                self._c._start(coll, dtype, send, recv, count, keep, op, peer, timeout,
                               **exchange),
                result,
            )
        self._c._run(coll, dtype, send, recv, count, op, peer, timeout, **exchange)
        return result

    def _same(self, coll, a, b):
        if a[2] != b[2]:
            raise InvalidArgumentError(
                f"dspark: {coll}: send is {a[2]} but recv is {b[2]}"
            )

    def all_reduce(self, buf, op="sum", *, async_op=False, timeout=None):
        """Reduces ``buf`` across the ranks, in place, with ``op`` (sum, prod, min, max,
        avg)."""
        p, n, dt, keep = describe(buf, True, "all_reduce buffer")
        return self._go("all_reduce", dt, p, p, n, keep, buf, _op_name(op),
                        async_op=async_op, timeout=timeout)

    def all_gather(self, send, recv, *, async_op=False, timeout=None):
        """Gathers every rank's ``send`` into ``recv`` (``world_size`` times as long), in
        rank order."""
        s = describe(send, False, "all_gather send")
        r = describe(recv, True, "all_gather recv")
        self._same("all_gather", s, r)
        if r[1] != s[1] * self.world_size:
            raise InvalidArgumentError(
                f"dspark: all_gather: recv has {r[1]} elements, expected {s[1]} x world "
                f"{self.world_size} = {s[1] * self.world_size}"
            )
        return self._go("all_gather", s[2], s[0], r[0], s[1], (s[3], r[3]), recv,
                        async_op=async_op, timeout=timeout)

    def reduce_scatter(self, send, recv, op="sum", *, async_op=False, timeout=None):
        """Reduces ``send`` (``world_size`` blocks) across the ranks; this rank gets block
        ``rank`` of the result in ``recv``."""
        s = describe(send, False, "reduce_scatter send")
        r = describe(recv, True, "reduce_scatter recv")
        self._same("reduce_scatter", s, r)
        if s[1] != r[1] * self.world_size:
            raise InvalidArgumentError(
                f"dspark: reduce_scatter: send has {s[1]} elements, expected recv's {r[1]} "
                f"x world {self.world_size} = {r[1] * self.world_size}"
            )
        return self._go("reduce_scatter", s[2], s[0], r[0], r[1], (s[3], r[3]), recv,
                        _op_name(op), async_op=async_op, timeout=timeout)

    def broadcast(self, buf, root=0, *, async_op=False, timeout=None):
        """Copies the root's ``buf`` into every rank's ``buf``."""
        p, n, dt, keep = describe(buf, True, "broadcast buffer")
        return self._go("broadcast", dt, p, p, n, keep, buf, peer=self._rank_arg(root, "root"),
                        async_op=async_op, timeout=timeout)

    def reduce(self, buf, op="sum", root=0, *, async_op=False, timeout=None):
        """Reduces ``buf`` across the ranks into the root's ``buf`` (in place; other ranks'
        buffers are left as they were)."""
        p, n, dt, keep = describe(buf, True, "reduce buffer")
        return self._go("reduce", dt, p, p, n, keep, buf, _op_name(op),
                        peer=self._rank_arg(root, "root"), async_op=async_op, timeout=timeout)

    def all_to_all(self, send, recv, *, async_op=False, timeout=None):
        """Block ``j`` of ``send`` goes to rank ``j``; block ``i`` of ``recv`` comes from rank
        ``i`` (equal blocks)."""
        s = describe(send, False, "all_to_all send")
        r = describe(recv, True, "all_to_all recv")
        self._same("all_to_all", s, r)
        if s[1] != r[1] or s[1] % self.world_size:
            raise InvalidArgumentError(
                f"dspark: all_to_all: send ({s[1]}) and recv ({r[1]}) must have the same "
                f"number of elements, a multiple of world {self.world_size}"
            )
        return self._go("all_to_all", s[2], s[0], r[0], s[1] // self.world_size,
                        (s[3], r[3]), recv, async_op=async_op, timeout=timeout)

    def send(self, buf, peer, *, async_op=False, timeout=None):
        """Sends ``buf`` to ``peer`` (which calls :meth:`recv` with as many elements)."""
        p, n, dt, keep = describe(buf, False, "send buffer")
        return self._go("send", dt, p, 0, n, keep, None, peer=self._rank_arg(peer, "peer"),
                        async_op=async_op, timeout=timeout)

    def recv(self, buf, peer, *, async_op=False, timeout=None):
        """Receives into ``buf`` from ``peer``."""
        p, n, dt, keep = describe(buf, True, "recv buffer")
        return self._go("recv", dt, 0, p, n, keep, buf, peer=self._rank_arg(peer, "peer"),
                        async_op=async_op, timeout=timeout)

    def recv_any(self, buf, *, wait=None, timeout=None):
        """Receives into ``buf`` the next message any peer sends to this rank and returns
        its rank (MPI's ``MPI_ANY_SOURCE``). With ``wait`` (seconds), returns None when no
        message started arriving within it, having received nothing. Blocking only."""
        p, n, dt, keep = describe(buf, True, "recv buffer")
        src = self._c._recv_any(dt, p, n, wait, timeout)
        del keep
        return src

    def all_to_all_v(self, send, send_counts, recv, recv_counts, *, async_op=False,
                     timeout=None):
        """Block ``j`` of ``send`` (``send_counts[j]`` elements, the blocks in rank order)
        goes to rank ``j``; block ``i`` of ``recv`` (``recv_counts[i]`` elements) comes from
        rank ``i``: an all-to-all whose blocks differ in size (MPI's ``Alltoallv``). Rank
        ``j``'s ``recv_counts[r]`` must equal rank ``r``'s ``send_counts[j]``; a pair that
        disagrees fails with a ``MismatchError`` naming both sizes."""
        s = describe(send, False, "all_to_all_v send")
        r = describe(recv, True, "all_to_all_v recv")
        self._same("all_to_all_v", s, r)
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if min(sc + rc, default=0) < 0 or sum(sc) != s[1] or sum(rc) != r[1]:
            raise InvalidArgumentError(
                f"dspark: all_to_all_v: counts {sc} / {rc} must be non-negative and add up "
                f"to send's {s[1]} and recv's {r[1]} elements"
            )
        w = self._c._all_to_all_v(s[2], s[0], sc, r[0], rc, (s[3], r[3]), timeout,
                                  not async_op)
        return Work(w, recv) if async_op else recv

    def send_recv(self, send, dest, recv, source, *, async_op=False, timeout=None):
        """Sends ``send`` to ``dest`` and receives ``recv`` from ``source`` at once (MPI's
        ``Sendrecv``): the two progress together, so ranks that exchange buffers (a swap, a
        ring shift) complete whatever the size, where a :meth:`send` then a :meth:`recv` on
        both ranks of a swap wait on each other once the message outgrows what the transport
        buffers. ``dest`` and ``source`` may be the same rank; a peer may answer with
        :meth:`send_recv` or with :meth:`recv` and :meth:`send`."""
        s = describe(send, False, "send_recv send")
        r = describe(recv, True, "send_recv recv")
        self._same("send_recv", s, r)
        return self._go("send_recv", s[2], s[0], r[0], s[1], (s[3], r[3]), recv,
                        peer=self._rank_arg(dest, "dest"), async_op=async_op,
                        timeout=timeout, peer2=self._rank_arg(source, "source"),
                        count2=r[1])

    def barrier(self, *, async_op=False, timeout=None):
        """Returns once every rank entered it."""
        return self._go("barrier", "u8", 0, 0, 0, None, None, async_op=async_op,
                        timeout=timeout)

    def _rank_arg(self, r, what):
        r = int(r)
        if not 0 <= r < self.world_size:
            raise InvalidArgumentError(
                f"dspark: {what} {r} is not a rank of this communicator (world "
                f"{self.world_size})"
            )
        return r

    # -- groups, abort, close ----------------------------------------------------------
    def split(self, colour, key=0):
        """Sub-communicators, as ``ncclCommSplit``: same ``colour`` → one group, ordered by
        ``key`` then rank; ``None`` or a negative colour opts out (returns ``None``)."""
        c = self._c.split(colour, key)
        return None if c is None else Communicator(c)

    def shrink(self, exclude, abort=False):
        """A communicator of this one's ranks minus ``exclude``, as ``ncclCommShrink``: every
        survivor calls it with the same excluded ranks, also after a lost peer or an abort
        (``abort=True`` aborts this one first, as torch's ``SHRINK_ABORT``, once the
        excluded ranks were checked: an ``InvalidArgumentError`` for a rank that is not one,
        or this rank among them, leaves it as it was). A survivor's new rank is the number
        of survivors below it. A survivor naming another set gets ``MismatchError``, a rank
        the others exclude ``InvalidArgumentError``."""
        exclude = [self._rank_arg(r, "excluded rank") for r in exclude]
        return Communicator(self._c.shrink(exclude, abort=bool(abort)))

    def flight_record(self):
        """The flight record: this communicator's last operations (``DSPARK_FR_ENTRIES``,
        2000 by default), oldest first, as a dict in the dump format that
        ``DSPARK_FR_DUMP`` writes and ``dspark analyze`` reads (``entries``: ``seq``,
        ``collective``, ``dtype``, ``count``, ``op``, ``root``, ``peer``, ``algorithm``,
        ``transport``, ``path``, ``state``, times, ``failure``). ``None`` when the recorder is
        off. Any thread, any time: it never waits for an operation in progress.
        ``json.dump(comm.flight_record(), open(f"{dir}/rank{comm.rank}.json", "w"))`` writes
        a file ``dspark analyze dir`` reads."""
        text = self._c.flight_record_json()
        return None if text is None else json.loads(text)

    def write_flight_record(self, directory):
        """Writes :meth:`flight_record` into ``directory`` (made if missing) as
        ``DSPARK_FR_DUMP`` does on a failure, for ``dspark analyze directory``; returns the
        file's path, or ``None`` when the recorder is off. Never waits for an operation."""
        return self._c.write_flight_record(os.fspath(directory))

    def abort(self):
        """Every operation in flight and every later one fails with ``AbortedError``; the
        peers are told. Any thread; returns at once."""
        self._c.abort()

    def close(self):
        """Runs what was issued to completion, says goodbye to the peers, and frees the
        connections. Later calls raise ``AbortedError``."""
        self._c.close()

    @property
    def closed(self):
        return self._c.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<dspark.Communicator rank {self.rank}/{self.world_size}>"
