"""The dspark Python package without torch.distributed: dspark.Communicator on numpy arrays
and torch CPU tensors, checked against numpy references computed from every rank's
(seeded, hence known) inputs; the error classes; the GIL release; leaked Work.

    torchrun --standalone --nproc-per-node 3 tests/torch/package_check.py

Joins through torchrun's agent store (Communicator.from_env). Exits non-zero naming the
first failing check; every rank ends with "PACKAGE_CHECK world=N rank=R checks=K RESULT=PASS".
"""

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
