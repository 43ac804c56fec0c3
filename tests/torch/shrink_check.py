#!/usr/bin/env python3
"""``dist.shrink_group`` through the dspark backend, on each route into torch (the Python
ProcessGroup, ``pg``, and the c10d Backend, ``backend``), 3 ranks started here, the store
served by this driver (so it outlives any rank):

  kill   rank 2 kills itself (SIGKILL) after a first all_reduce; ranks 0 and 1 see the
         failure (a DistBackendError), compute a reference on a gloo group of the two made
         at the start, shrink the default group without rank 2 (SHRINK_DEFAULT), and check
         the shrunk group: size 2, same ranks, all_reduce of every op on float32, float64 and
         int64 tensors of 1001 elements equal to gloo's and to the exact values computed
         here, broadcast / all_gather, and a DDP step's averaged gradients.
  abort  rank 2 stops itself (SIGSTOP: hung, not dead) with a group timeout of 60 s; ranks
         0 and 1 start an all_reduce that cannot finish, then shrink with SHRINK_ABORT: the
         call in flight fails at once, the shrink succeeds within seconds (far below the
         timeout), and the shrunk group's all_reduce is exact.

    python tests/torch/shrink_check.py                 # every scenario on every route
    python tests/torch/shrink_check.py --scenario kill --route pg

Prints a PROBLEM line for every unmet expectation and last

    SHRINK_CHECK runs=N failed=F time=T.Ts RESULT=PASS|FAIL
"""

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
import traceback

TD = datetime.timedelta
WORLD = 3
COUNT = 1001  # odd, and not a multiple of the world


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def value(torch, dtype, rank, op):
    """Rank `rank`'s input: exact in every dtype; small for PRODUCT."""
    i = torch.arange(COUNT, dtype=torch.int64)
    if op == "PRODUCT":
        v = (i + rank) % 3 + 1
    else:
        v = (i * 7 + rank * 1000) % 997 - 300
    return v.to(dtype)


def expected(torch, dtype, ranks, op):
    vals = [value(torch, dtype, r, op) for r in ranks]
    out = vals[0].clone()
    for v in vals[1:]:
        if op == "SUM":
            out += v
        elif op == "PRODUCT":
            out *= v
        elif op == "MIN":
            out = torch.minimum(out, v)
        elif op == "MAX":
            out = torch.maximum(out, v)
    return out


def problem(msg):
    print(f"PROBLEM rank={os.environ.get('RANK')} {msg}", flush=True)
    return 1


def check_group(torch, dist, group, rank, old_ranks, gloo):
    """Every check of a shrunk group; returns the number of problems."""
    bad = 0
    if group.size() != len(old_ranks) or group.rank() != old_ranks.index(rank):
        bad += problem(f"shrunk group is rank {group.rank()} of {group.size()}")
    for dtype in (torch.float32, torch.float64, torch.int64):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            t = value(torch, dtype, rank, op)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
            want = expected(torch, dtype, old_ranks, op)
            if not torch.equal(t, want):
                bad += problem(f"all_reduce {op} {dtype}: {t[:5].tolist()} != {want[:5].tolist()}")
            if gloo is not None:
                ref = gloo[(dtype, op)]
                if not torch.equal(t, ref):
                    bad += problem(f"all_reduce {op} {dtype} differs from gloo's")
    b = torch.full((5,), float(rank))
    dist.broadcast(b, src=dist.get_global_rank(group, group.size() - 1), group=group)
    if not torch.equal(b, torch.full((5,), float(old_ranks[-1]))):
        bad += problem(f"broadcast gave {b.tolist()}")
    # DDP on the shrunk group (torch registers a shrunk group's cpu backend as gloo, and DDP's
    # logger crashed on dspark's until it is registered as custom): gradients averaged.
    from torch.nn.parallel import DistributedDataParallel as DDP

    if group._get_backend_name() != "custom":
        bad += problem(f"the shrunk group's backend is named {group._get_backend_name()!r}")
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(4, 2), process_group=group)
    ddp(torch.full((3, 4), float(rank + 1))).sum().backward()
    w = ddp.module.weight.grad
    want_w = 3.0 * sum(r + 1 for r in old_ranks) / len(old_ranks)
    if not torch.equal(w, torch.full_like(w, want_w)):
        bad += problem(f"DDP weight gradient {w.flatten().tolist()}, expected {want_w}")
    outs = [torch.zeros(1, dtype=torch.int64) for _ in old_ranks]
    dist.all_gather(outs, torch.tensor([rank]), group=group)
    if [int(o) for o in outs] != old_ranks:
        bad += problem(f"all_gather gave {[int(o) for o in outs]}")
    return bad


def rank_main(scenario, route, rank, port):
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import SHRINK_ABORT, SHRINK_DEFAULT

    os.environ["DSPARK_TORCH_ROUTE"] = route
    timeout = 60 if scenario == "abort" else 20
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=TD(seconds=60))
    dist.init_process_group("dspark", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=WORLD, timeout=TD(seconds=timeout))
    survivors = [0, 1]
    # The reference: gloo on the survivors, made while everyone is there.
    gloo_group = dist.new_group(survivors, backend="gloo")
    impl = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    print(f"BACKEND_IMPL {impl}", flush=True)
    bad = 0
    want_impl = "DsparkBackend" if route == "backend" else "DsparkProcessGroup"
    if impl != want_impl:
        bad += problem(f"route {route} runs through {impl}, expected {want_impl}")
    t = torch.ones(3)
    dist.all_reduce(t)
    if t.tolist() != [3.0] * 3:
        bad += problem(f"first all_reduce {t.tolist()}")
    if rank == 2:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
        time.sleep(120)
        return 1
    gloo = {}
    if scenario == "kill":
        try:
            for _ in range(100000):
                dist.all_reduce(torch.ones(1024))
            bad += problem("the group never failed")
        except dist.DistBackendError as e:
            print(f"rank {rank}: the group failed: {str(e).splitlines()[0]}", flush=True)
        for dtype in (torch.float32, torch.float64, torch.int64):
            for op in ("SUM", "PRODUCT", "MIN", "MAX"):
                r = value(torch, dtype, rank, op)
                dist.all_reduce(r, op=getattr(dist.ReduceOp, op), group=gloo_group)
                gloo[(dtype, op)] = r
        t0 = time.monotonic()
        new = dist.shrink_group([2], shrink_flags=SHRINK_DEFAULT)
    else:
        work = dist.all_reduce(torch.ones(1024), async_op=True)
        time.sleep(0.5)
        t0 = time.monotonic()
        new = dist.shrink_group([2], shrink_flags=SHRINK_ABORT)
        try:
            work.wait()
            bad += problem("the call in flight succeeded after SHRINK_ABORT")
        except Exception as e:  # noqa: BLE001 - any error: it was aborted
            print(f"rank {rank}: the call in flight failed: {str(e).splitlines()[0]}",
                  flush=True)
        gloo = None
    took = time.monotonic() - t0
    print(f"rank {rank}: shrink_group took {took:.2f}s", flush=True)
    if took > 15:
        bad += problem(f"shrink_group took {took:.1f}s")
    impl = type(new._get_backend(torch.device("cpu"))).__name__
    if impl != "DsparkBackend":
        bad += problem(f"the shrunk group's backend is {impl}")
    if dist.group.WORLD is not new or dist.get_world_size() != 2:
        bad += problem("the shrunk group is not the default group")
    bad += check_group(torch, dist, new, rank, survivors, gloo)
    # The caller leaves with os._exit, without closing the group (see examples/torch_shrink.py:
    # a goodbye can fail the other survivor's last call over shared memory).
    dist.barrier()
    return 1 if bad else 0


def run(scenario, route):
    port = free_port()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=TD(seconds=60),
                          wait_for_workers=False)
    procs = []
    for r in range(WORLD):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--rank-of", scenario, route, str(r), str(port)],
            env=env))
    codes = {}
    t0 = time.monotonic()
    while len(codes) < 2 and time.monotonic() - t0 < 150:
        for r in (0, 1):
            if r not in codes and procs[r].poll() is not None:
                codes[r] = procs[r].returncode
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    del store
    failed = 0
    for r in (0, 1):
        if codes.get(r) != 0:
            print(f"PROBLEM scenario={scenario} route={route} rank {r} exited {codes.get(r)}",
                  flush=True)
            failed = 1
    print(f"SHRINK scenario={scenario} route={route} ok={not failed}", flush=True)
    return failed


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":
        scenario, route, rank, port = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        try:
            code = rank_main(scenario, route, rank, port)
        except Exception:  # noqa: BLE001 - a rank's failure is a PROBLEM line
            traceback.print_exc()
            print(f"PROBLEM rank={rank} raised", flush=True)
            code = 1
        sys.stdout.flush()
        os._exit(code)
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=["kill", "abort"], action="append")
    ap.add_argument("--route", choices=["pg", "backend"], action="append")
    a = ap.parse_args()
    t0 = time.monotonic()
    runs = failed = 0
    for scenario in a.scenario or ["kill", "abort"]:
        for route in a.route or ["pg", "backend"]:
            runs += 1
            failed += run(scenario, route)
    print(f"SHRINK_CHECK runs={runs} failed={failed} time={time.monotonic() - t0:.1f}s "
          f"RESULT={'PASS' if failed == 0 else 'FAIL'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
