#!/usr/bin/env python3
"""Collectives in an exit handler that runs after dspark's own (training scripts end with
`atexit.register(...)` of a barrier and `destroy_process_group`): dspark's exit handler stops
the threads that complete asynchronous operations, and an operation issued after it must
still complete (before, its future was queued for a thread that had ended, and `wait()`
never returned), without a new such thread (one started then could die inside torch's
callbacks when the interpreter finalizes).

This script registers its handler before torch and dspark are imported, so that Python runs
it after dspark's. In it, each rank runs an asynchronous all_reduce (sizes 1, 7 and 1000,
against a gloo group's result on the same input), an asynchronous barrier, a synchronous
MAX all_reduce, and an exchange (`irecv`, then `isend`, then both waits, on a lane not used
before exit), a `wait(timeout)` that must time out on a receive not yet sent (dspark only),
checks that no lane thread ("dspark-futures") is alive afterwards, and destroys
the group. A watchdog fails
the run after 60 s.

    DSPARK_TEST_BACKEND=dspark torchrun --standalone --nproc-per-node 2 tests/torch/exit_check.py

Every rank ends with "EXIT_CHECK backend=B rank=R checks=K RESULT=PASS"; a failed check
prints "exit_check: FAIL ..." and exits 1.
"""

import atexit
import os
import sys
import threading
import time
from datetime import timedelta

BACKEND = os.environ.get("DSPARK_TEST_BACKEND", "dspark")
RANK = int(os.environ.get("RANK", "0"))
checks = 0


def fail(msg):
    sys.stdout.write(f"exit_check: FAIL backend={BACKEND} rank={RANK}: {msg}\n")
    sys.stdout.flush()
    os._exit(1)


def check(cond, msg):
    global checks
    checks += 1
    if not cond:
        fail(msg)


def at_exit():
    done = threading.Event()

    def watch():
        if not done.wait(60):
            fail("the collectives in the exit handler did not complete within 60 s (hung)")

    threading.Thread(target=watch, daemon=True).start()
    n = dist.get_world_size()
    for size in (1, 7, 1000):
        x = torch.arange(size, dtype=torch.float32) * (RANK + 1) + RANK
        ref = x.clone()
        w = dist.all_reduce(x, async_op=True)
        w.wait()
        dist.all_reduce(ref, group=GLOO)
        check(torch.equal(x, ref), f"async all_reduce of {size}: {x[:4]} against gloo's {ref[:4]}")
    dist.barrier(async_op=True).wait()
    y = torch.full((3,), float(RANK + 2), dtype=torch.float64)
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    check(torch.equal(y, torch.full((3,), float(n + 1), dtype=torch.float64)), f"max: {y}")
    # Both ranks post their receive first, then their send, then wait for both (a ring's
    # exchange): completing each operation as it is issued would block every rank in its
    # receive until the deadline.
    if RANK < 2:
        peer = 1 - RANK
        got = torch.zeros(5, dtype=torch.int64)
        mine = torch.arange(5) * 3 + RANK
        works = [dist.irecv(got, peer), dist.isend(mine, peer)]
        for w in works:
            w.wait()
        check(torch.equal(got, torch.arange(5) * 3 + peer), f"irecv from {peer}: {got}")
    if BACKEND == "dspark":
        # `Work.wait(timeout)` keeps its timeout after the exit handler: rank 0's receive
        # cannot complete until rank 1 sends, after the gloo barrier that rank 0 reaches
        # only once its 0.3 s wait gave up (the call's own deadline is 30 s).
        if RANK == 0:
            got = torch.zeros(3, dtype=torch.int32)
            w = dist.irecv(got, 1)
            t0 = time.monotonic()
            try:
                w.wait(timeout=timedelta(milliseconds=300))
                fail("wait(timeout) on a receive nobody sent yet returned")
            except dist.DistBackendError as e:
                took = time.monotonic() - t0
                check("Timed out" in str(e), f"wait(timeout) raised {e!r}")
                check(took < 5, f"wait(timeout=0.3 s) took {took:.1f} s")
            check(not w.is_completed(), "the timed-out receive looks complete")
        dist.barrier(group=GLOO)
        if RANK == 1:
            dist.send(torch.tensor([7, 8, 9], dtype=torch.int32), 0)
        if RANK == 0:
            w.wait()
            check(torch.equal(got, torch.tensor([7, 8, 9], dtype=torch.int32)),
                  f"the receive after its timed-out wait: {got}")
    if BACKEND == "dspark":
        lanes = [t.name for t in threading.enumerate() if t.name == "dspark-futures"]
        check(not lanes, f"lane threads alive after the exit handler: {lanes}")
    dist.barrier()
    dist.destroy_process_group()
    done.set()
    sys.stdout.write(f"\nEXIT_CHECK backend={BACKEND} rank={RANK} checks={checks} "
                     "RESULT=PASS\n")
    sys.stdout.flush()


# The order under test: this handler before dspark's (something that imported dspark first,
# a sitecustomize say, would make the run test nothing).
if "dspark._torch_work" in sys.modules:
    fail("dspark was imported before the exit handler was registered")
atexit.register(at_exit)

import torch  # noqa: E402 - after the handler: see the module docs
import torch.distributed as dist  # noqa: E402

dist.init_process_group(backend=BACKEND, timeout=timedelta(seconds=30))
GLOO = dist.new_group(backend="gloo")
# One collective before exit, so the lanes exist when dspark's handler stops them.
z = torch.ones(4)
dist.all_reduce(z, async_op=True).wait()
check(torch.equal(z, torch.full((4,), float(dist.get_world_size()))), f"before exit: {z}")
if BACKEND == "dspark" and "dspark._torch_work" not in sys.modules:
    fail("dspark's torch module was not imported by init_process_group")
