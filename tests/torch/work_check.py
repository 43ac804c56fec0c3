#!/usr/bin/env python3
"""Asynchronous Works as torch's own backends complete them, the backend under test beside a
gloo group made in the same run (`dist.new_group(backend="gloo")`), fed the same inputs:

1. DDP with PowerSGD (`powerSGD_hook`, which waits for a collective's future inside another
   future's callback) and with a callback that does the same by hand: no hang, and the
   trained parameters equal gloo's (within float tolerance);
2. an `irecv` posted before an asynchronous collective that is waited for, and only then
   the matching `send` on the peer (pipeline-parallel code does this): completes on every
   rank, the values exact;
3. `Work.wait(timeout)` on a receive whose sender is late: raises a RuntimeError (torch's
   DistBackendError) after about the timeout, not after the group's; the receive goes on and
   a later `wait()` gets the data;
4. `all_to_all_single` where one rank passes (equal) split sizes and the other none (legal
   in torch), uneven ones where one rank's blocks are equal and it passes none, empty blocks
   (each against gloo's result); an uneven one with `async_op=True` returns before the late
   peer has called; one whose rows do not split evenly without sizes is an error, as gloo's;
5. (dspark) a collective issued by another thread while this one gathers a coalesced call
   runs as itself, and the coalesced call's results are exact;
6. `Work.wait` with a negative timeout raises at once on an operation still in flight (torch's
   `wait_for`); with zero (torch's "no timeout") it waits.

Run under torchrun with 2 ranks:

    DSPARK_TEST_BACKEND=dspark torchrun --standalone --nproc-per-node 2 tests/torch/work_check.py

Every rank ends with "WORK_CHECK backend=B rank=R checks=K RESULT=PASS"; a check that fails
prints "work_check: FAIL ..." and exits 1. Each case is bounded by the group's timeout (60 s).
"""

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

BACKEND = os.environ.get("DSPARK_TEST_BACKEND", "dspark")
checks = 0


def fail(msg):
    sys.stdout.write(f"work_check: FAIL backend={BACKEND} rank={RANK}: {msg}\n")
    sys.stdout.flush()
    os._exit(1)


def check(cond, msg):
    global checks
    checks += 1
    if not cond:
        fail(msg)


def watchdog(what, limit_s):
    """Fails the run if `what` is not done within `limit_s` (a hang is a failure)."""
    done = threading.Event()

    def watch():
        if not done.wait(limit_s):
            fail(f"{what}: not done after {limit_s} s (hung)")

    threading.Thread(target=watch, daemon=True).start()
    return done


dist.init_process_group(backend=BACKEND, timeout=timedelta(seconds=60))
RANK, N = dist.get_rank(), dist.get_world_size()
if N != 2:
    fail(f"run with 2 ranks, not {N}")
PEER = 1 - RANK
GLOO = dist.new_group(backend="gloo")


# -- 1. a future's callback that waits for another collective's future -----------------------
def train(group, hook):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    # One bucket a step (checked below). With two (a 2.2 MB model, bucket_cap_mb=0.25) the
    # callbacks of different buckets, each issuing collectives from its own thread, issue
    # them in an order that differs between the ranks: gloo fails that case too ("Received
    # data size doesn't match expected size", tried 2026-12-05), as does dspark (a
    # MismatchError naming both calls). NCCL runs the callbacks inline on the issuing thread.
    model = DDP(net, process_group=group)
    state = powerSGD.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                   start_powerSGD_iter=2, warm_start=False)
    if hook == "powersgd":
        model.register_comm_hook(state, powerSGD.powerSGD_hook)
    elif hook == "nested":
        def nested(pg, bucket):
            t = bucket.buffer()
            fut = dist.all_reduce(t, group=pg, async_op=True).get_future()

            def then(f):
                # Another collective, waited for inside this callback.
                extra = torch.ones(3) * (RANK + 1)
                dist.all_reduce(extra, group=pg, async_op=True).get_future().wait()
                if not torch.equal(extra, torch.full((3,), 3.0)):
                    raise RuntimeError(f"nested all_reduce gave {extra}")
                return f.value()[0].div_(N)

            return fut.then(then)

        model.register_comm_hook(group, nested)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(RANK + 1)
    for _ in range(5):
        x = torch.randn(16, 32, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    buckets = model._get_ddp_logging_data().get("num_buckets_reduced")
    check(buckets == 1, f"DDP reduced {buckets} buckets a step, not 1")
    return [p.detach().clone() for p in model.parameters()]


for hook in ("powersgd", "nested"):
    done = watchdog(f"DDP with the {hook} hook", 90)
    mine = train(None, hook)
    ref = train(GLOO, hook)
    done.set()
    for i, (a, b) in enumerate(zip(mine, ref)):
        check(torch.allclose(a, b, rtol=1e-4, atol=1e-5),
              f"DDP {hook}: parameter {i} differs from gloo's by {(a - b).abs().max():.3g}")

# -- 1b. callbacks that do not block run in issue order (dspark; as NCCL's inline ones) ----
if BACKEND == "dspark":
    seen = []
    futs = []
    for i in range(40):
        t = torch.full((4,), float(i))
        f = dist.all_reduce(t, async_op=True).get_future()
        futs.append(f.then(lambda _f, i=i: seen.append(i)))
    torch.futures.wait_all(futs)
    check(seen == list(range(40)), f"callbacks ran in the order {seen}")

# -- 2. an irecv posted before a waited collective, its send after it ------------------------
done = watchdog("irecv, all_reduce.wait(), send", 90)
for size in (3, 100_003):
    got = torch.zeros(size)
    r = dist.irecv(got, src=PEER)
    z = torch.full((5,), float(RANK + 1))
    dist.all_reduce(z, async_op=True).wait()
    check(torch.equal(z, torch.full((5,), 3.0)), f"all_reduce between gave {z}")
    dist.send(torch.arange(size, dtype=torch.float32) + 1000 * PEER + RANK, dst=PEER)
    r.wait()
    want = torch.arange(size, dtype=torch.float32) + 1000 * RANK + PEER
    check(torch.equal(got, want), f"irecv of {size} got {got[:4]}..., want {want[:4]}...")
done.set()

# -- 3. wait(timeout) on a receive whose sender is late ---------------------------------------
# In a group of its own: gloo closes the pair when a wait times out (the group is unusable
# after), dspark leaves the receive in flight and a later wait gets the data.
LATE = dist.new_group(backend=BACKEND)
dist.barrier()
got = torch.zeros(7)
if RANK == 0:
    w = dist.irecv(got, src=1, group=LATE)
    if BACKEND == "dspark":
        # 6. A negative timeout is over already: raises at once (gloo closes the pair).
        t0 = time.monotonic()
        try:
            w.wait(timedelta(seconds=-1))
        except RuntimeError as e:
            took = time.monotonic() - t0
            check(took < 0.3 and "Timed out waiting" in str(e),
                  f"wait(timeout=-1 s) raised after {took:.2f} s: {e}")
        else:
            fail("wait(timeout=-1 s) returned, the sender sleeping 3 s")
    t0 = time.monotonic()
    try:
        w.wait(timedelta(seconds=0.5))
    except RuntimeError as e:  # torch's DistBackendError is one
        took = time.monotonic() - t0
        check(0.4 < took < 2.5, f"wait(timeout=0.5 s) raised after {took:.2f} s: {e}")
        if BACKEND == "dspark":
            check("Timed out waiting 500ms" in str(e) and isinstance(e, dist.DistBackendError),
                  f"wait(timeout=0.5 s) raised {type(e).__mro__}: {e}")
            # ... and where the receive stands, as dspark's Work says (the flight recorder's
            # name for the running call: "it runs as recv #1 from rank 1 (for 500ms)").
            check("it runs as recv #" in str(e) and "from rank 1" in str(e),
                  f"wait(timeout=0.5 s) does not say where the receive stands: {e}")
    else:
        fail(f"wait(timeout=0.5 s) returned after {time.monotonic() - t0:.2f} s, the sender "
             "sleeping 3 s")
    if BACKEND != "gloo":
        w.wait(timedelta(0))  # torch's "no timeout"
        check(torch.equal(got, torch.arange(7.0)), f"the late receive got {got}")
else:
    time.sleep(3)
    try:
        dist.send(torch.arange(7.0), dst=0, group=LATE)
    except RuntimeError:
        if BACKEND != "gloo":
            raise
dist.barrier()

# -- 4. all_to_all_single: split sizes on one rank only; rows that do not split -------------
def a2a(group, inp, out, splits):
    if splits:
        dist.all_to_all_single(out, inp, splits, splits, group=group)
    else:
        dist.all_to_all_single(out, inp, group=group)
    return out


for rows in (4, 6):
    inp = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + 100 * RANK
    splits = [rows // 2, rows // 2] if RANK == 1 else None
    mine = a2a(None, inp, torch.zeros(rows, 3), splits)
    ref = a2a(GLOO, inp, torch.zeros(rows, 3), splits)
    check(torch.equal(mine, ref), f"all_to_all_single, splits on rank 1 only: {mine} vs {ref}")
# Uneven blocks, where one rank's are equal and it passes no sizes (a legal mix, which failed
# with a MismatchError while equal and uneven blocks ran different protocols), with empty
# blocks, rows of three, float64 and int64: dspark's result is gloo's.
CASES = [  # per rank: (input split sizes or None, output split sizes or None, input rows)
    [(None, None, 8), ([4, 6], [4, 6], 10)],
    [([0, 3], [0, 5], 3), ([5, 2], [3, 2], 7)],
    [([1, 1], [1, 2], 2), ([2, 7], [1, 7], 9)],
]
for case in CASES:
    ins, outs, rows = case[RANK]
    out_rows = sum(outs) if outs else rows
    for dtype in (torch.float64, torch.int64):
        inp = (torch.arange(rows * 3, dtype=dtype).view(rows, 3) + 1000 * RANK)
        got = []
        for group in (None, GLOO):
            out = torch.full((out_rows, 3), -1, dtype=dtype)
            dist.all_to_all_single(out, inp, outs, ins, group=group)
            got.append(out)
        check(torch.equal(got[0], got[1]),
              f"all_to_all_single {dtype} sizes {case[RANK]}: {got[0].tolist()} vs gloo's "
              f"{got[1].tolist()}")

# Uneven and asynchronous: the call returns at once, before the peer has called (nothing is
# agreed first), and its Work completes with the data.
inp = torch.arange(5.0) + 10 * RANK
ins, outs = ([2, 3], [2, 1]) if RANK == 0 else ([1, 3], [3, 3])
out = torch.zeros(sum(outs))
dist.barrier()
if RANK == 1:
    time.sleep(1.0)
t0 = time.monotonic()
w = dist.all_to_all_single(out, inp[:sum(ins)], outs, ins, async_op=True)
took = time.monotonic() - t0
if RANK == 0:
    check(took < 0.5, f"an uneven all_to_all_single(async_op=True) returned after {took:.2f} s "
          "(the peer came 1 s late)")
w.wait()
want = (torch.tensor([0.0, 1.0, 10.0]) if RANK == 0
        else torch.tensor([2.0, 3.0, 4.0, 11.0, 12.0, 13.0]))
check(torch.equal(out, want), f"uneven async all_to_all_single gave {out}, want {want}")

for group in (GLOO, None):
    name = "gloo" if group is GLOO else BACKEND
    raised = None
    try:
        dist.all_to_all_single(torch.zeros(3, 2), torch.ones(3, 2), group=group)
    except (RuntimeError, ValueError) as e:
        raised = e
    check(raised is not None, f"{name}: all_to_all_single of 3 rows between 2 ranks without "
          "split sizes did not raise")

# -- 5. another thread's collective while this thread gathers a coalesced call (dspark) -----
# A Work's callback may issue a collective on its lane's thread while the main thread is
# inside a coalesced call: it must run as itself, not be folded into the main thread's batch.
# The window is made wide here: the backend's list all_gather, which all_gather_coalesced
# gathers, first has another thread run an all_reduce to the end.
if BACKEND == "dspark":
    impl = dist.group.WORLD
    if not hasattr(impl, "_coalesced"):
        impl = impl._get_backend(torch.device("cpu"))
    # all_gather_coalesced issues each input's gather through `_allgather_each` (the list
    # form of `allgather` is torch's multi-tensor form); older packages through `allgather`.
    hook = "_allgather_each" if hasattr(impl, "_allgather_each") else "allgather"
    plain = getattr(impl, hook)
    other = torch.full((3,), float(RANK + 1))
    between = []

    def allgather_with_another_thread(outs, ins, opts=None):
        def run():
            try:
                dist.all_reduce(other)
                # Done when it returns (folded into the batch, it would run only later).
                between.append(other.clone())
            except Exception as e:  # noqa: BLE001 - reported below
                between.append(e)
        th = threading.Thread(target=run)
        th.start()
        th.join(60)
        between.append(th.is_alive())
        return plain(outs, ins, opts)

    setattr(impl, hook, allgather_with_another_thread)
    try:
        done = watchdog("all_gather_coalesced with another thread's all_reduce", 90)
        ins = [torch.arange(2.0 + j) + 10 * RANK for j in range(3)]
        outs = [[torch.zeros(2 + j) for j in range(3)] for _ in range(N)]
        dist.all_gather_coalesced(outs, ins)
        done.set()
    finally:
        delattr(impl, hook)
    check(len(between) == 2 and between[1] is False
          and torch.equal(between[0], torch.full((3,), 3.0)),
          f"the other thread's all_reduce, when it returned and whether its thread was still "
          f"alive: {between}")
    ref = [[torch.zeros(2 + j) for j in range(3)] for _ in range(N)]
    dist.all_gather_coalesced(ref, ins, group=GLOO)
    for r in range(N):
        for j in range(3):
            check(torch.equal(outs[r][j], ref[r][j]),
                  f"all_gather_coalesced: [{r}][{j}] is {outs[r][j]}, gloo's {ref[r][j]}")

dist.barrier()
dist.destroy_process_group()
# One write, starting a line of its own (the ranks share torchrun's output).
sys.stdout.write(f"\nWORK_CHECK backend={BACKEND} rank={RANK} checks={checks} RESULT=PASS\n")
sys.stdout.flush()
