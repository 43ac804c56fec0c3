"""The dspark Python package without torch.distributed: dspark.Communicator on numpy arrays
and torch CPU tensors, checked against numpy references computed from every rank's
(seeded, hence known) inputs; the error classes; the GIL release; leaked Work; only
tensors and buffer-protocol objects accepted (a fake ``__array_interface__`` raises, a
bytearray or array.array works); a tensor dropped while a non-blocking call uses it.

    torchrun --standalone --nproc-per-node 3 tests/torch/package_check.py

Joins through torchrun's agent store (Communicator.from_env). Exits non-zero naming the
first failing check; every rank ends with "PACKAGE_CHECK world=N rank=R checks=K RESULT=PASS".
"""

import array
import gc
import os
import sys
import threading
import time

import numpy as np
import torch

import dspark

RANK = int(os.environ["RANK"])
N = int(os.environ["WORLD_SIZE"])
checks = 0


def fail(msg):
    sys.stdout.write(f"package_check: FAIL rank {RANK}: {msg}\n")
    sys.stdout.flush()
    sys.exit(1)


def check(cond, msg):
    global checks
    checks += 1
    if not cond:
        fail(msg)


def data(rank, count, dtype, salt=0):
    """Rank `rank`'s input: small integers, exact in every dtype and for every op."""
    rng = np.random.default_rng(1000 * rank + 7 * count + salt)
    # Products of N such values stay exact: int8 and uint8 in 1..3, float16 in -7..7.
    lo, hi = {np.int8: (1, 4), np.uint8: (1, 4), np.float16: (-7, 8)}.get(dtype, (-50, 50))
    if np.dtype(dtype).kind == "u":
        lo = 0
    return rng.integers(lo, hi, size=count).astype(dtype)


def expect_raises(cls, fn, what):
    global checks
    checks += 1
    try:
        fn()
    except cls as e:
        if "rank" not in str(e) and cls is not dspark.InvalidArgumentError:
            fail(f"{what}: {type(e).__name__} without a rank in its message: {e}")
        return e
    except Exception as e:  # noqa: BLE001
        fail(f"{what}: expected {cls}, got {type(e).__name__}: {e}")
    fail(f"{what}: expected {cls}, nothing raised")


comm = dspark.Communicator.from_env()
check(comm.rank == RANK and comm.world_size == N, "rank/world")
check(comm.info()["transport"] in ("tcp", "verbs", "mem", "shm"), f"info {comm.info()}")
info = comm.info()
check(
    isinstance(info["cpu_sharing"], str)
    and info["spin_yields"] == ("oversubscribed" in info["cpu_sharing"])
    and info["spin_us"] >= 0,
    f"cpu sharing and spin {info}",
)

REDUCE = {
    "sum": lambda xs: np.sum(xs, axis=0, dtype=xs[0].dtype),
    "prod": lambda xs: np.prod(xs, axis=0, dtype=xs[0].dtype),
    "min": lambda xs: np.min(xs, axis=0),
    "max": lambda xs: np.max(xs, axis=0),
}
DTYPES = [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.uint32,
          np.int64, np.uint64]
COUNTS = [1, 2, 7, 13, 1031]

# -- numpy: every collective, dtype, op and awkward count ---------------------------------
for dt in DTYPES:
    for count in COUNTS:
        everyone = [data(r, count, dt) for r in range(N)]
        for op, ref in REDUCE.items():
            x = everyone[RANK].copy()
            comm.all_reduce(x, op)
            check(np.array_equal(x, ref(everyone)), f"all_reduce {op} {dt.__name__} {count}")
            for root in range(N):
                x = everyone[RANK].copy()
                comm.reduce(x, op, root)
                want = ref(everyone) if RANK == root else everyone[RANK]
                check(np.array_equal(x, want), f"reduce {op} root {root} {dt.__name__} {count}")
            blocks = [data(r, count * N, dt, 1) for r in range(N)]
            out = np.empty(count, dtype=dt)
            comm.reduce_scatter(blocks[RANK], out, op)
            check(np.array_equal(out, ref(blocks)[RANK * count:(RANK + 1) * count]),
                  f"reduce_scatter {op} {dt.__name__} {count}")
        if np.dtype(dt).kind == "f":
            x = everyone[RANK].copy()
            comm.all_reduce(x, "avg")
            want = (np.sum(np.array(everyone, dtype=np.float64), axis=0) / N)
            tol = 1e-2 if dt == np.float16 else 1e-6
            check(np.allclose(x.astype(np.float64), want, rtol=tol, atol=tol),
                  f"all_reduce avg {dt.__name__} {count}")
        out = np.empty(count * N, dtype=dt)
        comm.all_gather(everyone[RANK], out)
        check(np.array_equal(out, np.concatenate(everyone)), f"all_gather {dt.__name__} {count}")
        for root in range(N):
            x = everyone[RANK].copy()
            comm.broadcast(x, root)
            check(np.array_equal(x, everyone[root]), f"broadcast root {root} {dt.__name__}")
        sends = [data(r, count * N, dt, 2) for r in range(N)]
        out = np.empty(count * N, dtype=dt)
        comm.all_to_all(sends[RANK], out)
        want = np.concatenate([sends[r][RANK * count:(RANK + 1) * count] for r in range(N)])
        check(np.array_equal(out, want), f"all_to_all {dt.__name__} {count}")
        # all_to_all_v: rank r sends rank j a block of (r + 2j + count) % 4 elements, blocking
        # and not; each block a slice of the sender's data.
        size = lambda i, j: (i + 2 * j + count) % 4  # noqa: E731
        mine = data(RANK, sum(size(RANK, j) for j in range(N)), dt, 4)
        starts = lambda i: np.cumsum([0] + [size(i, j) for j in range(N)])  # noqa: E731
        want = np.concatenate([data(i, sum(size(i, j) for j in range(N)), dt, 4)
                               [starts(i)[RANK]:starts(i)[RANK + 1]] for i in range(N)])
        for async_op in (False, True):
            got = np.full(len(want), 99, dtype=dt)
            w = comm.all_to_all_v(mine, [size(RANK, j) for j in range(N)], got,
                                  [size(i, RANK) for i in range(N)], async_op=async_op)
            if async_op:
                w.wait()
            check(np.array_equal(got, want), f"all_to_all_v {dt.__name__} {count} "
                  f"async={async_op}: {got} vs {want}")
        if N > 1:
            nxt, prv = (RANK + 1) % N, (RANK - 1) % N
            got = np.empty(count, dtype=dt)
            if RANK % 2 == 0:
                comm.send(everyone[RANK], nxt)
                comm.recv(got, prv)
            else:
                comm.recv(got, prv)
                comm.send(everyone[RANK], nxt)
            check(np.array_equal(got, everyone[prv]), f"send/recv ring {dt.__name__} {count}")
            # The same ring in one call per rank, no ordering by parity; the messages'
            # lengths differ by rank (rank r sends count + r elements), blocking and not.
            mine = data(RANK, count + RANK, dt, 3)
            want = data(prv, count + prv, dt, 3)
            for async_op in (False, True):
                got = np.zeros(count + prv, dtype=dt)
                w = comm.send_recv(mine, nxt, got, prv, async_op=async_op)
                if async_op:
                    w.wait()
                check(np.array_equal(got, want),
                      f"send_recv ring {dt.__name__} {count} async={async_op}")
            # From any source: every other rank sends to the last one, which names them.
            last = N - 1
            if RANK == last:
                if count == 1 and dt == np.int32:
                    check(comm.recv_any(np.empty(count, dtype=dt), wait=0.05) is None,
                          "recv_any with a wait and no sender")
                comm.barrier()
                heard = []
                for _ in range(N - 1):
                    got = np.empty(count, dtype=dt)
                    src = comm.recv_any(got)
                    heard.append(src)
                    check(src in range(N - 1) and np.array_equal(got, everyone[src]),
                          f"recv_any {dt.__name__} {count} from {src}")
                check(sorted(heard) == list(range(N - 1)), f"recv_any sources {heard}")
            else:
                comm.barrier()
                comm.send(everyone[RANK], last)
comm.barrier()

# -- torch CPU tensors, bfloat16 included (numpy has none) --------------------------------
for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8):
    everyone = [torch.arange(11, dtype=torch.int64).mul(r + 1).remainder(5).to(dt)
                for r in range(N)]
    x = everyone[RANK].clone()
    comm.all_reduce(x)
    check(torch.equal(x, sum(e.to(torch.float64) for e in everyone).to(dt)),
          f"torch all_reduce {dt}")
    out = torch.empty(11 * N, dtype=dt)
    comm.all_gather(everyone[RANK], out)
    check(torch.equal(out, torch.cat(everyone)), f"torch all_gather {dt}")

# -- non-blocking: several in flight, of different collectives and sizes ------------------
arrays, works, wants = [], [], []
for i, count in enumerate([5, 100_003, 17, 3]):
    everyone = [data(r, count, np.float64, 10 + i) for r in range(N)]
    x = everyone[RANK].copy()
    arrays.append(x)
    works.append(comm.all_reduce(x, "sum", async_op=True))
    wants.append(np.sum(everyone, axis=0))
g_in = data(RANK, 9, np.int32, 99)
g_out = np.empty(9 * N, dtype=np.int32)
works.append(comm.all_gather(g_in, g_out, async_op=True))
for w in works:
    w.wait()
for x, want in zip(arrays, wants):
    check(np.allclose(x, want, rtol=1e-12), "async all_reduce")
check(np.array_equal(g_out, np.concatenate([data(r, 9, np.int32, 99) for r in range(N)])),
      "async all_gather")
check(works[0].test() is True and works[0].is_completed(), "test() after wait")

# -- a leaked Work: buffers dropped by Python while the operation may still run ----------
for _ in range(20):
    tmp = np.ones(200_000, dtype=np.float32)
    comm.all_reduce(tmp, async_op=True)   # Work dropped at once
    del tmp
gc.collect()
x = np.ones(4, dtype=np.float32)
comm.all_reduce(x)
check(np.array_equal(x, np.full(4, N, dtype=np.float32)), "after leaked Work")

# -- the flight record: the last calls, as the dump format --------------------------------
x = np.ones(13, dtype=np.float64)
comm.all_reduce(x, op="max")
rec = comm.flight_record()
check(rec is not None and rec["format"] == "dspark-flight-record" and rec["version"] == 1,
      f"flight record header: {rec and {k: rec[k] for k in ('format', 'version')}}")
check(rec["rank"] == RANK and rec["world"] == N and rec["reason"] == "on_demand", "record ids")
last = rec["entries"][-1]
check((last["collective"], last["dtype"], last["count"], last["op"], last["state"])
      == ("all_reduce", "double", 13, "max", "completed"), f"last flight entry {last}")
check(rec["recorded"] >= len(rec["entries"]) > 20 and last["seq"] > 20,
      f"record count {rec['recorded']} entries {len(rec['entries'])} last seq {last['seq']}")

# -- only tensors and buffer-protocol objects: a claimed pointer is never used ----------------
class FakeArray:
    """Claims a million float32 at an address nobody owns, through ``__array_interface__``
    and the attributes dspark used to read (before, it read and wrote there: SIGSEGV)."""

    def __init__(self, addr):
        self.__array_interface__ = {"version": 3, "shape": (1 << 20,), "typestr": "<f4",
                                    "data": (addr, False)}
        self.dtype = np.dtype(np.float32)
        self.size = 1 << 20
        self.shape = (1 << 20,)
        self.flags = {"C_CONTIGUOUS": True, "WRITEABLE": True}


class LyingTensor(torch.Tensor):
    """A tensor subclass whose data_ptr() points outside its storage."""

    def data_ptr(self):
        return 16


def raises(cls, fn):
    try:
        fn()
    except cls:
        return True
    return False


def not_a_buffer(fn, what):
    e = expect_raises(dspark.InvalidArgumentError, fn, what)
    check(isinstance(e, TypeError), f"{what}: {type(e).__name__} is not a TypeError")
    check(type(FAKE).__name__ in str(e) or "list" in str(e) or "dict" in str(e),
          f"{what}: the message names what was passed: {e}")


def bad_buffer(fn, what):
    e = expect_raises(dspark.InvalidArgumentError, fn, what)
    check(isinstance(e, ValueError), f"{what}: {type(e).__name__} is not a ValueError")


FAKE = FakeArray(16)
real = np.zeros(1 << 20, dtype=np.float32)
for addr in (16, real.ctypes.data + (1 << 40)):
    FAKE = FakeArray(addr)
    not_a_buffer(lambda: comm.all_reduce(FAKE), "all_reduce of a fake __array_interface__")
    not_a_buffer(lambda: comm.all_reduce(FAKE, async_op=True), "async all_reduce of a fake")
    not_a_buffer(lambda: comm.broadcast(FAKE, 0), "broadcast of a fake")
    not_a_buffer(lambda: comm.all_gather(FAKE, np.zeros(N << 20, np.float32)),
                 "all_gather from a fake")
    not_a_buffer(lambda: comm.all_gather(real, FAKE), "all_gather into a fake")
    not_a_buffer(lambda: comm.send_recv(FAKE, RANK, real, RANK), "send_recv from a fake")
    not_a_buffer(lambda: comm.send_recv(real, RANK, FAKE, RANK), "send_recv into a fake")
not_a_buffer(lambda: comm.all_reduce([1.0, 2.0]), "all_reduce of a list")
not_a_buffer(lambda: comm.all_reduce({"data": (16, False)}), "all_reduce of a dict")
bad_buffer(lambda: comm.all_reduce(torch.ones(4).as_subclass(LyingTensor)),
           "a tensor whose data_ptr lies outside its storage")
bad_buffer(lambda: comm.all_reduce(b"abcd"), "all_reduce into read-only bytes")
bad_buffer(lambda: comm.all_reduce(array.array("h", [1, 2])), "int16 array.array")
bad_buffer(lambda: comm.all_reduce(np.ones(3, dtype=">f4")), "big-endian numpy")
bad_buffer(lambda: comm.all_reduce(memoryview(bytearray(16))[::2]), "strided memoryview")
x = np.ones(4, np.float32)
comm.all_reduce(x)
check(np.array_equal(x, np.full(4, N, np.float32)), "the communicator works after refusals")

# Buffer-protocol objects are used in place.
ba = bytearray([RANK + 1] * 5)
comm.all_reduce(ba)
check(ba == bytearray([N * (N + 1) // 2 % 256] * 5), f"all_reduce of a bytearray: {ba}")
aa = array.array("i", [RANK, -RANK, 7])
comm.all_reduce(aa, "max")
check(list(aa) == [N - 1, 0, 7], f"all_reduce max of an array.array('i'): {aa}")
ad = array.array("d", [RANK + 0.5] * 3)
comm.all_reduce(ad)
check(list(ad) == [sum(r + 0.5 for r in range(N))] * 3, f"all_reduce of array.array('d'): {ad}")
mv = memoryview(bytearray(8 * 4)).cast("q")
mv[0], mv[3] = RANK, 2 ** 40 + RANK
comm.all_reduce(mv)
check(mv.tolist() == [sum(range(N)), 0, 0, 2 ** 40 * N + sum(range(N))],
      f"all_reduce of a memoryview: {mv.tolist()}")
gathered = bytearray(3 * N)
comm.all_gather(bytes([RANK, 7, 255 - RANK]), gathered)
check(gathered == b"".join(bytes([r, 7, 255 - r]) for r in range(N)),
      "all_gather from bytes into a bytearray")
# In flight, an exported buffer cannot be resized: the memory cannot move.
ba = bytearray(1 << 20)
w = comm.all_reduce(ba, async_op=True)
check(raises(BufferError, lambda: ba.extend(b"x" * (1 << 20))), "resize a bytearray in flight")
xs = np.ones(1 << 18, np.float32)
w2 = comm.all_reduce(xs, async_op=True)
check(raises(ValueError, lambda: xs.resize(1 << 20)), "numpy resize() in flight")
w.wait()
w2.wait()
check(xs[0] == N and ba[0] == 0, "the in-flight buffers' results")

# A tensor's memory outlives the tensor while a non-blocking call uses it. Rank 0 issues
# last (after a pause), so the others' calls are surely still in flight when they drop
# their tensor's storage (set_), the tensor (del) or shrink it (resize_), and then fill
# fresh tensors of the same size with a sentinel: memory freed under the call would be
# reused there (or unmapped: a crash). Rank 0 keeps its storage and checks the result in it.
BIG = 1 << 22  # 16 MiB of float32: allocated by mmap, unmapped when freed
want_big = sum(torch.arange(BIG, dtype=torch.float32).remainder(97).add(r) for r in range(N))
for mem, case in [(m, c) for m in ("private", "shared") for c in ("set_", "del", "resize_")]:
    t = torch.arange(BIG, dtype=torch.float32).remainder(97).add(RANK)
    if mem == "shared":
        t.share_memory_()  # a mapping of its own, unmapped when freed
    held = t.untyped_storage() if RANK == 0 else None
    if RANK == 0:
        time.sleep(0.3)
    w = comm.all_reduce(t, async_op=True)
    if case == "set_":
        t.set_(torch.empty(0))
    elif case == "resize_":
        t.resize_(0)
    if case != "resize_" or RANK != 0:
        del t, w
        gc.collect()
    junk = [torch.full((BIG,), -12345.0) for _ in range(3)]
    comm.barrier()  # after the all_reduce: it completed
    if RANK == 0:
        if case == "resize_":
            w.wait()
            check(t.untyped_storage().data_ptr() == held.data_ptr(), "resize_(0) kept storage")
        got = torch.empty(0, dtype=torch.float32).set_(held, 0, (BIG,))
        check(torch.equal(got, want_big), f"async all_reduce ({mem}) result after {case}")
    check(all(bool((j == -12345.0).all()) for j in junk),
          f"{mem} {case}: nothing written into memory allocated after the tensor was dropped")
    del junk, held

# -- errors --------------------------------------------------------------------------------
expect_raises(dspark.InvalidArgumentError, lambda: comm.all_reduce(np.ones(3), "xor"), "bad op")
expect_raises(dspark.InvalidArgumentError,
              lambda: comm.all_gather(np.ones(3), np.ones(3 * N + 1)), "bad all_gather size")
expect_raises(dspark.InvalidArgumentError, lambda: comm.broadcast(np.ones(3), N), "bad root")
expect_raises(dspark.InvalidArgumentError,
              lambda: comm.all_reduce(np.ones((4, 4))[:, 1]), "non-contiguous")
expect_raises(dspark.InvalidArgumentError,
              lambda: comm.all_reduce(np.ones(3, dtype=np.complex64)), "complex dtype")
expect_raises(dspark.InvalidArgumentError,
              lambda: comm.send_recv(np.ones(3), N, np.ones(3), 0), "bad send_recv dest")
expect_raises(dspark.InvalidArgumentError,
              lambda: comm.send_recv(np.ones(3), 0, np.ones(3, np.float32), 0),
              "send_recv of two dtypes")
check(issubclass(dspark.TimeoutError, dspark.Error) and issubclass(dspark.Error, RuntimeError),
      "exception hierarchy")

if N > 1:
    # A mismatch (rank 0 sends a different count) raises MismatchError on every rank; the
    # communicator is then poisoned, so use a fresh one (split) for what follows.
    sub = comm.split(0, RANK)
    e = expect_raises(dspark.MismatchError,
                      lambda: sub.all_reduce(np.ones(5 if RANK == 0 else 6, dtype=np.float32)),
                      "mismatched counts")
    check("all_reduce" in str(e), f"mismatch names the collective: {e}")

    # The GIL is released while waiting: a Python thread runs meanwhile. Rank 0 is late.
    sub2 = comm.split(0, RANK)
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    if RANK == 0:
        time.sleep(1.0)
    t = threading.Thread(target=spin)
    t.start()
    before = ticks[0]
    sub2.barrier()
    stop.set()
    t.join()
    if RANK != 0:
        check(ticks[0] - before > 50, f"GIL released during barrier: {ticks[0] - before} ticks")

    # A per-call timeout: rank 0 never joins this broadcast; the others time out, name
    # rank 0 and raise dspark.TimeoutError; the communicator is then poisoned on them.
    sub3 = comm.split(0, RANK)
    if RANK != 0:
        t0 = time.monotonic()
        # The first to time out tells the others, who may see that (AbortedError) first.
        e = expect_raises((dspark.TimeoutError, dspark.AbortedError),
                          lambda: sub3.broadcast(np.ones(3), 0, timeout=1.0), "per-call timeout")
        check("timed out" in str(e), f"the error says it timed out: {e}")
        check(time.monotonic() - t0 < 10, "timeout took too long")
    comm.barrier()  # rank 0 stays silent until the others timed out
    sub3.abort()
    # Rank 0 sees its abort; the others keep the error that poisoned sub3 first.
    expect_raises(dspark.AbortedError if RANK == 0 else (dspark.TimeoutError, dspark.AbortedError),
                  lambda: sub3.barrier(), "after abort")
    comm.barrier()

comm.close()
expect_raises(dspark.AbortedError, lambda: comm.barrier(), "after close")
# One write per line, so that the ranks' summaries do not run into each other.
sys.stdout.write(f"PACKAGE_CHECK world={N} rank={RANK} checks={checks} RESULT=PASS\n")
sys.stdout.flush()
