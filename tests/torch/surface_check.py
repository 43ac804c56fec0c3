#!/usr/bin/env python3
"""What torch's conventions expect of a CPU backend when things go wrong, dspark beside gloo:
the same scenario, the same expectations, run with backend="gloo" and with backend="dspark"
(on each route into torch: the Python ProcessGroup and, on torch >= 2.14, the c10d Backend).

    python tests/torch/surface_check.py                  # every scenario
    python tests/torch/surface_check.py --scenario mb-missing

Scenarios (the expectations are torch's own, from its distributed suite, see each):
  timeout          2 ranks, group timeout 1 s; rank 0 alone calls dist.barrier(): it raises
                   within the timeout (+3 s) and not before it, with a message matching
                   " (Timed out|closed|timeout) " (test_barrier_timeout_full_group).
  timeout-async    the same with dist.all_reduce(async_op=True).wait().
  init-timeout     2 ranks, group timeout 2 s; rank 1 never calls init_process_group: rank 0's
                   init (and first barrier) raises within the timeout (+3 s), message as above,
                   a torch.distributed.DistStoreError (gloo's store wait raises one).
  mb-pass          3 ranks: dist.monitored_barrier(), then with wait_all_ranks=True, pass.
  mb-missing       3 ranks, rank 2 never arrives: rank 0 raises "Rank 2 failed to pass
                   monitoredBarrier", rank 1 "Rank 1 successfully reached monitoredBarrier,
                   but received errors while waiting for send/recv from rank 0"
                   (test_monitored_barrier_gloo, _failure_order).
  mb-wait-all      3 ranks, ranks 1 and 2 never arrive: rank 0 with wait_all_ranks=True
                   raises "Ranks 1, 2 failed to pass monitoredBarrier"
                   (test_monitored_barrier_wait_all_ranks).
  mb-rank0-timeout group.monitored_barrier(timedelta(0)) on rank 0: "Rank 0 timed out in
                   monitoredBarrier" (test_monitored_barrier_gloo_rank_0_timeout).
  mb-subgroup      3 ranks, new_group([0, 1]), rank 1 never arrives: rank 0 names rank 1;
                   rank 2 (not a member) passes (test_monitored_barrier_gloo_subgroup).

dspark must also: raise within the monitored barrier's timeout (+1.5 s) on every rank that
arrived (rank 1 learns rank 0's verdict and names rank 2; gloo's rank 1 waits for the group's
timeout and cannot name it), and raise errors that are both dspark's class and torch's
(dspark.TimeoutError and torch.distributed.DistBackendError). What gloo raises is printed
beside it.

Prints one line per rank and run:

    SURFACE scenario=S backend=B route=R rank=K outcome=RAISED|OK elapsed=E classes=... msg=...

a PROBLEM line for every unmet expectation, and last

    SURFACE_CHECK runs=N failed=F time=T.Ts RESULT=PASS|FAIL

Exit status 0 when every expectation held, for gloo and for dspark.
"""

import argparse
import datetime
import multiprocessing
import os
import re
import socket
import sys
import time
import traceback

TD = datetime.timedelta
TIMEOUT_RE = r" (Timed out|closed|timeout) "
MB_TIMEOUT = 1.5  # seconds: every monitored_barrier that must fail
GROUP_TIMEOUT = 4.0  # seconds: the group's, in the monitored barrier scenarios
SLACK = 1.5  # seconds a dspark rank may take beyond a timeout to raise
LIMIT = 60  # seconds a run may take before its ranks are killed

SCENARIOS = {
    # name: (ranks, group timeout)
    "timeout": (2, 1.0),
    "timeout-async": (2, 1.0),
    "init-timeout": (2, 2.0),
    "mb-pass": (3, GROUP_TIMEOUT),
    "mb-missing": (3, GROUP_TIMEOUT),
    "mb-wait-all": (3, GROUP_TIMEOUT),
    "mb-rank0-timeout": (2, GROUP_TIMEOUT),
    "mb-subgroup": (3, GROUP_TIMEOUT),
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- ranks


def attempt(fn):
    """(outcome, elapsed, exception or None)."""
    t0 = time.monotonic()
    try:
        fn()
        return "OK", time.monotonic() - t0, None
    except Exception as e:  # noqa: BLE001 - what it raised is the result
        return "RAISED", time.monotonic() - t0, e


def rank_main(scenario, backend, route, rank, world, port, group_timeout, q):
    import torch
    import torch.distributed as dist

    if route:
        os.environ["DSPARK_TORCH_ROUTE"] = route
    res = {"rank": rank, "outcome": "SKIPPED", "elapsed": 0.0, "classes": [], "msg": "",
           "dspark_timeout": False, "dist_backend_error": False}
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TD(seconds=LIMIT))

        def init():
            dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                    world_size=world, timeout=TD(seconds=group_timeout))

        if scenario != "init-timeout":
            init()

        def done_and_wait():
            # every rank says it is done, and stays until all are: a rank that exits early
            # would turn the others' timeouts into lost peers. Rank 0 serves the store, so
            # it leaves last.
            store.set(f"done/{rank}", "1")
            store.wait([f"done/{r}" for r in range(world)], TD(seconds=LIMIT))
            store.set(f"left/{rank}", "1")
            if rank == 0:
                store.wait([f"left/{r}" for r in range(world)], TD(seconds=LIMIT))

        fn = None
        if scenario == "init-timeout":
            if rank == 0:
                def fn():
                    init()
                    dist.barrier()
        elif scenario == "timeout":
            if rank == 0:
                fn = dist.barrier
        elif scenario == "timeout-async":
            if rank == 0:
                fn = lambda: dist.all_reduce(torch.ones(4), async_op=True).wait()  # noqa: E731
        elif scenario == "mb-pass":
            def fn():
                for _ in range(3):
                    dist.all_reduce(torch.ones(4))
                dist.monitored_barrier(timeout=TD(seconds=10))
                dist.all_reduce(torch.ones(4))
                dist.monitored_barrier(timeout=TD(seconds=10), wait_all_ranks=True)
        elif scenario == "mb-missing":
            if rank != 2:
                fn = lambda: dist.monitored_barrier(timeout=TD(seconds=MB_TIMEOUT))  # noqa: E731
        elif scenario == "mb-wait-all":
            if rank == 0:
                fn = lambda: dist.monitored_barrier(  # noqa: E731
                    timeout=TD(seconds=MB_TIMEOUT), wait_all_ranks=True)
        elif scenario == "mb-rank0-timeout":
            pg = dist.new_group(ranks=list(range(world)))
            if rank == 0:
                fn = lambda: pg.monitored_barrier(TD(seconds=0))  # noqa: E731
        elif scenario == "mb-subgroup":
            sub = dist.new_group(ranks=[0, 1])
            if rank != 1:
                fn = lambda: dist.monitored_barrier(sub, TD(seconds=MB_TIMEOUT))  # noqa: E731
        if fn is not None:
            outcome, elapsed, e = attempt(fn)
            res.update(outcome=outcome, elapsed=elapsed)
            if e is not None:
                ds = sys.modules.get("dspark")
                res.update(
                    classes=[f"{c.__module__}.{c.__name__}" for c in type(e).__mro__[:-3]],
                    msg=str(e),
                    dspark_timeout=ds is not None and isinstance(e, ds.TimeoutError),
                    dist_backend_error=isinstance(e, getattr(dist, "DistBackendError", ())),
                )
        done_and_wait()
    except Exception as e:  # noqa: BLE001 - the harness failed: reported as such
        res.update(outcome="HARNESS", msg=f"{type(e).__name__}: {e} {traceback.format_exc()}")
    q.put(res)
    q.close()
    q.join_thread()
    # no teardown: a group whose barrier timed out may not shut down cleanly, and that is
    # not what is checked here
    os._exit(0)


# ---------------------------------------------------------------------------- checks


def expectations(scenario, backend, r, world, group_timeout):
    """Problems with rank r's result `r` (a dict), as strings."""
    k = r["rank"]
    dspark = backend == "dspark"
    out = []

    def raised(regex, within=None, at_least=None):
        if r["outcome"] != "RAISED":
            out.append(f"expected an error matching {regex!r}, got {r['outcome']}")
            return
        if not re.search(regex, r["msg"]):
            out.append(f"the error does not match {regex!r}: {r['msg'][:300]!r}")
        if not any(c.endswith("RuntimeError") for c in r["classes"]):
            out.append(f"the error is not a RuntimeError: {r['classes']}")
        if within is not None and r["elapsed"] > within:
            out.append(f"raised after {r['elapsed']:.2f} s, more than {within:.2f} s")
        if at_least is not None and r["elapsed"] < at_least:
            out.append(f"raised after {r['elapsed']:.2f} s, before the {at_least:.2f} s timeout")
        if dspark and not (r["dspark_timeout"] and r["dist_backend_error"]):
            out.append("the error is not both dspark.TimeoutError and "
                       f"torch.distributed.DistBackendError: {r['classes']}")

    def passed():
        if r["outcome"] not in ("OK", "SKIPPED"):
            out.append(f"expected to pass, got {r['outcome']}: {r['msg'][:300]!r}")

    mb_within = MB_TIMEOUT + SLACK if dspark else None
    if scenario in ("timeout", "timeout-async", "init-timeout"):
        if k == 0:
            raised(TIMEOUT_RE, within=group_timeout + 3.0, at_least=group_timeout - 0.1)
            # A rank missing from the rendezvous: gloo's store wait raises DistStoreError.
            if scenario == "init-timeout" and not any(
                c.endswith(".DistStoreError") for c in r["classes"]
            ):
                out.append(f"a rendezvous timeout is not a DistStoreError: {r['classes']}")
        else:
            passed()
    elif scenario == "mb-pass":
        passed()
    elif scenario == "mb-missing":
        if k == 0:
            raised(r"Rank 2 failed to pass monitoredBarrier", within=mb_within)
        elif k == 1:
            raised(r"Rank 1 successfully reached monitoredBarrier, but received errors while "
                   r"waiting for send/recv from rank 0",
                   within=mb_within if dspark else group_timeout + 10)
            if dspark and "Rank 2 failed" not in r["msg"]:
                out.append(f"rank 1's error does not name rank 2: {r['msg'][:300]!r}")
        else:
            passed()
    elif scenario == "mb-wait-all":
        if k == 0:
            names = ", ".join(str(i) for i in range(1, world))
            raised(rf"Ranks {names} failed to pass monitoredBarrier", within=mb_within)
        else:
            passed()
    elif scenario == "mb-rank0-timeout":
        if k == 0:
            raised(r"Rank 0 timed out in monitoredBarrier", within=SLACK if dspark else None)
        else:
            passed()
    elif scenario == "mb-subgroup":
        if k == 0:
            raised(r"Rank 1 failed to pass monitoredBarrier", within=mb_within)
        else:
            passed()
    return out


def run(scenario, backend, route):
    world, group_timeout = SCENARIOS[scenario]
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main,
                         args=(scenario, backend, route, k, world, port, group_timeout, q))
             for k in range(world)]
    for p in procs:
        p.start()
    results, t_end = {}, time.monotonic() + LIMIT
    while len(results) < world and time.monotonic() < t_end:
        try:
            r = q.get(timeout=max(0.1, t_end - time.monotonic()))
        except Exception:  # noqa: BLE001 - queue.Empty: the limit ran out
            break
        results[r["rank"]] = r
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    problems = 0
    for k in range(world):
        r = results.get(k)
        tag = f"scenario={scenario} backend={backend} route={route or '-'} rank={k}"
        if r is None:
            print(f"PROBLEM {tag}: no result within {LIMIT} s (hung or died)", flush=True)
            problems += 1
            continue
        msg = r["msg"].replace("\n", " | ")[:400]
        print(f"SURFACE {tag} outcome={r['outcome']} elapsed={r['elapsed']:.2f} "
              f"classes={','.join(r['classes'])} msg={msg}", flush=True)
        if r["outcome"] == "HARNESS":
            print(f"PROBLEM {tag}: the harness failed: {msg}", flush=True)
            problems += 1
            continue
        for p in expectations(scenario, backend, r, world, group_timeout):
            print(f"PROBLEM {tag}: {p}", flush=True)
            problems += 1
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="run only these (repeatable)")
    args = ap.parse_args()
    import torch

    v = torch.__version__.split("+")[0].split(".")
    runs = [("gloo", None), ("dspark", "pg")]
    if (int(v[0]), int(v[1])) >= (2, 14):
        runs.append(("dspark", "backend"))
    t0 = time.monotonic()
    n = failed = 0
    for scenario in args.scenario or list(SCENARIOS):
        for backend, route in runs:
            n += 1
            if run(scenario, backend, route):
                failed += 1
    verdict = "PASS" if failed == 0 else "FAIL"
    print(f"SURFACE_CHECK runs={n} failed={failed} time={time.monotonic() - t0:.1f}s "
          f"RESULT={verdict}", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
