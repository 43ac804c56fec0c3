"""The torch backend keeps a tensor's memory alive while a non-blocking call uses it: every
rank drops its tensor's storage (``set_``), the tensor itself (``del``) or shrinks it
(``resize_(0)``) right after ``dist.all_reduce(..., async_op=True)`` (the fast path) or
``dist.broadcast(..., async_op=True)`` (the general path) returned, then fills fresh tensors
of the same size with a sentinel. Memory freed under the call would be reused there, or
unmapped (a crash): tensors of the process's heap, and tensors moved to shared memory
(``share_memory_()``: a mapping of their own, unmapped when freed). The checking rank keeps the storage and
compares the result in it with the reduction computed by torch; the others check that their
sentinels are intact. The rank whose data everyone waits for issues last, after a pause, so
the others' calls are surely still in flight.

    torchrun --standalone --nproc-per-node 3 tests/torch/inflight_check.py

Every rank ends with "INFLIGHT_CHECK world=N rank=R checks=K RESULT=PASS".
"""

import gc
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

BIG = 1 << 22  # 16 MiB of float32
SENTINEL = -12345.0
checks = 0


def fail(msg):
    sys.stdout.write(f"inflight_check: FAIL rank {RANK}: {msg}\n")
    sys.stdout.flush()
    sys.exit(1)


def check(cond, msg):
    global checks
    checks += 1
    if not cond:
        fail(msg)


def data(r):
    return torch.arange(BIG, dtype=torch.float32).remainder(97).add(r)


dist.init_process_group(backend=os.environ.get("DSPARK_TEST_BACKEND", "dspark"),
                        timeout=timedelta(seconds=60))
RANK, N = dist.get_rank(), dist.get_world_size()

SUM = sum(data(r) for r in range(N))
for coll in ("all_reduce", "broadcast"):
    # all_reduce: rank 0 is late and checks; broadcast: rank 0 is the (late) source and
    # the last rank checks what it received.
    checker = 0 if coll == "all_reduce" else N - 1
    for mem, case in [(m, c) for m in ("private", "shared") for c in ("set_", "del", "resize_")]:
        t = data(RANK)
        if mem == "shared":
            t.share_memory_()  # mapped from a file: unmapped when freed, however large
        held = t.untyped_storage() if RANK == checker else None
        if RANK == 0:
            time.sleep(0.3)
        if coll == "all_reduce":
            w = dist.all_reduce(t, async_op=True)
            want = SUM
        else:
            w = dist.broadcast(t, src=0, async_op=True)
            want = data(0)
        keep = case == "resize_" and RANK == checker
        if case == "set_":
            t.set_(torch.empty(0))
        elif case == "resize_":
            t.resize_(0)
        if not keep:
            del t, w
            gc.collect()
        junk = [torch.full((BIG,), SENTINEL) for _ in range(6)]
        dist.barrier()  # issued after the call: it completed
        if RANK == checker:
            if keep:
                w.wait()
                check(t.untyped_storage().data_ptr() == held.data_ptr(),
                      f"{coll} {mem} {case}: resize_(0) kept the storage")
            got = torch.empty(0, dtype=torch.float32).set_(held, 0, (BIG,))
            check(torch.equal(got, want), f"{coll} {mem}: the result after {case} in flight")
        check(all(bool((j == SENTINEL).all()) for j in junk),
              f"{coll} {mem} {case}: nothing written into memory allocated after the drop")
        del junk, held

dist.destroy_process_group()
sys.stdout.write(f"INFLIGHT_CHECK world={N} rank={RANK} checks={checks} RESULT=PASS\n")
sys.stdout.flush()
