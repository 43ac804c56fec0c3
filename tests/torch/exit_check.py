#!/usr/bin/env python3
"""Collectives in an exit handler that runs after dspark's own (training scripts end with
`atexit.register(...)` of a barrier and `destroy_process_group`): dspark's exit handler stops
the threads that complete asynchronous operations, and an operation issued after it must
still complete (before, its future was queued for a thread that had ended, and `wait()`
never returned).

This script registers its handler before dspark's module is imported (torch >= 2.14 imports
it when the group is made; older torch at `import torch`, in which case the check says so
and the order is not what is tested), so that Python runs it after dspark's. In it, each
rank runs an asynchronous all_reduce, an asynchronous barrier and a synchronous all_reduce
through the backend under test, checks them against a gloo group's results on the same
inputs, and destroys the group. A watchdog fails the run after 60 s.

    DSPARK_TEST_BACKEND=dspark torchrun --standalone --nproc-per-node 2 tests/torch/exit_check.py

Every rank ends with "EXIT_CHECK backend=B rank=R order=O checks=K RESULT=PASS" (O: `after`
when dspark's handler ran first, `unknown` otherwise); a failed check prints
"exit_check: FAIL ..." and exits 1.
"""

import atexit
import os
import sys
import threading
from datetime import timedelta

BACKEND = os.environ.get("DSPARK_TEST_BACKEND", "dspark")
RANK = int(os.environ.get("RANK", "0"))
checks = 0
# Whether dspark's module (and its exit handler) came after this script's handler.
ORDER = "after" if "dspark._torch_work" not in sys.modules else "unknown"


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
    dist.barrier()
    dist.destroy_process_group()
    done.set()
    sys.stdout.write(f"\nEXIT_CHECK backend={BACKEND} rank={RANK} order={ORDER} "
                     f"checks={checks} RESULT=PASS\n")
    sys.stdout.flush()


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
