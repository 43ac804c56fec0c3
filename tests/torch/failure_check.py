#!/usr/bin/env python3
"""Failures through a torch.distributed backend: every surviving rank must raise, not hang.

    DSPARK_TEST_BACKEND=dspark python tests/torch/failure_check.py            # every scenario
    DSPARK_TEST_BACKEND=dspark python tests/torch/failure_check.py --scenario kill-last

This script is its own driver: it hosts the TCPStore (as torchrun's agent does, so that any
rank, rank 0 included, can die without taking the store with it), starts the ranks itself
(RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True), each in its own
process group, collects every rank's output separately, kills whatever is still running after
a hard limit, and judges each rank by the markers it printed:

    FAILCHECK rank=R scenario=S case=C outcome=RAISED elapsed=E.EE error=Type: message
    FAILCHECK rank=R scenario=S case=C outcome=COMPLETED elapsed=E.EE
    FAILCHECK rank=R scenario=S outcome=DYING step=K          (the victim, just before SIGKILL)

Scenarios (init_process_group(timeout=DSPARK_FAILURE_TIMEOUT seconds, default 15)):
  kill-last   3 ranks train a small DDP model; rank 2 SIGKILLs itself inside the backward of
              step 3 (from a gradient hook, with allreduces in flight). Ranks 0 and 1 must raise
              within the timeout (measured from the start of that step; the limit allows
              timeout x 1.5 + 5 s) and then exit by themselves.
  kill-first  the same with 2 ranks, rank 0 the victim (the store lives in the driver).
  mismatch-*  3 ranks (one launch each); on a group of the backend, rank 1 calls
              - mismatch-collective: all_gather_into_tensor while the others all_reduce,
              - mismatch-count:      all_reduce of 1000 elements while the others reduce 100,
              - mismatch-dtype:      all_reduce of float64 while the others reduce float32;
              every rank must raise, within the same limit, and exit by itself.
  --info adds the informational mismatch cases (reported, never failing): mismatch-op (MAX
  against SUM) and mismatch-dtype-same-bytes (float64 x 64 against float32 x 128).

Per scenario the driver prints one line per rank and

    FAILURE_CHECK scenario=kill-last world=3 timeout=15s RESULT=PASS survivors raised after 15.1s,15.2s

and finally `FAILURE_CHECK backend=... scenarios=N failed=F time=T.Ts RESULT=PASS|FAIL`.
Exit status 0 when every scenario passed.
"""

import argparse
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BACKEND = os.environ.get("DSPARK_TEST_BACKEND", "dspark")
TIMEOUT = float(os.environ.get("DSPARK_FAILURE_TIMEOUT", "15"))
KILL_STEP = 3


def out(line):
    """One write per line, so that the ranks' lines do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def marker(**kv):
    err = kv.pop("error", None)
    line = "FAILCHECK " + " ".join(f"{k}={v}" for k, v in kv.items())
    if err is not None:
        line += " error=" + err.replace("\n", " | ")[:400]
    out(line)


# ----------------------------------------------------------------------------- ranks


def rank_main():
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    scenario = os.environ["DSPARK_FAILURE_SCENARIO"]
    cases = os.environ.get("DSPARK_FAILURE_CASES", "").split(",")
    dist.init_process_group(backend=BACKEND, timeout=datetime.timedelta(seconds=TIMEOUT))

    if scenario.startswith("kill"):
        victim = world - 1 if scenario == "kill-last" else 0
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
        ddp = DDP(model, bucket_cap_mb=0.05)  # several buckets: allreduces in flight when the victim dies
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        step_box = [0]
        if rank == victim:
            def die(grad):
                if step_box[0] == KILL_STEP:
                    marker(rank=rank, scenario=scenario, outcome="DYING", step=KILL_STEP)
                    os.kill(os.getpid(), signal.SIGKILL)
                return grad
            # the first layer's weight gets its gradient last: later buckets are already in flight
            model[0].weight.register_hook(die)
        t_kill = None
        step = 0
        try:
            for step in range(200):
                step_box[0] = step
                if step == KILL_STEP:
                    t_kill = time.monotonic()
                    marker(rank=rank, scenario=scenario, outcome="STEP", step=step)
                x = torch.randn(32, 64)
                opt.zero_grad()
                ddp(x).square().mean().backward()
                opt.step()
                if step > KILL_STEP:
                    # keep going slowly: a backend that lost the victim silently shows up here
                    time.sleep(0.2)
            marker(rank=rank, scenario=scenario, case="ddp", outcome="COMPLETED",
                   elapsed=f"{time.monotonic() - (t_kill or time.monotonic()):.2f}", step=step)
            code = 0
        except Exception as e:  # noqa: BLE001 - any exception is what we want
            el = time.monotonic() - (t_kill or time.monotonic())
            marker(rank=rank, scenario=scenario, case="ddp", outcome="RAISED", elapsed=f"{el:.2f}", step=step,
                   error=f"{type(e).__name__}: {e}")
            code = 3
        # exit by ourselves (no destroy_process_group: the group is broken); a hang in the
        # interpreter's teardown shows up in the driver as a rank that never exits
        sys.stdout.flush()
        sys.exit(code)

    # mismatch: one fresh group of the backend per case, lined up through gloo
    ref = dist.new_group(backend="gloo")
    code = 0
    for case in cases:
        # (new_group's own default timeout is torch's 30 minutes: pass ours)
        g = dist.new_group(backend=BACKEND, timeout=datetime.timedelta(seconds=TIMEOUT))
        dist.barrier(group=ref)
        marker(rank=rank, scenario=scenario, case=case, outcome="BEGIN")
        t0 = time.monotonic()
        try:
            odd = rank == 1
            if case == "collective":
                x = torch.ones(16)
                if odd:
                    out = torch.zeros(16 * world)
                    dist.all_gather_into_tensor(out, x, group=g)
                else:
                    dist.all_reduce(x, group=g)
            elif case == "count":
                dist.all_reduce(torch.ones(1000 if odd else 100), group=g)
            elif case == "dtype":
                dist.all_reduce(torch.ones(64, dtype=torch.float64 if odd else torch.float32), group=g)
            elif case == "op":
                dist.all_reduce(torch.ones(64), op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM, group=g)
            elif case == "dtype-same-bytes":
                dist.all_reduce(torch.ones(64, dtype=torch.float64) if odd else torch.ones(128), group=g)
            else:
                raise SystemExit(f"unknown case {case}")
            marker(rank=rank, scenario=scenario, case=case, outcome="COMPLETED", elapsed=f"{time.monotonic() - t0:.2f}")
        except Exception as e:  # noqa: BLE001
            marker(rank=rank, scenario=scenario, case=case, outcome="RAISED", elapsed=f"{time.monotonic() - t0:.2f}",
                   error=f"{type(e).__name__}: {e}")
            code = 3
        try:
            # line up again (gloo) before the next case: a rank stuck above shows up here
            dist.barrier(group=ref)
        except Exception as e:  # noqa: BLE001
            marker(rank=rank, scenario=scenario, case=case, outcome="LOST-SYNC", error=f"{type(e).__name__}: {e}")
            sys.stdout.flush()
            os._exit(4)
    sys.stdout.flush()
    sys.exit(code)


# ----------------------------------------------------------------------------- driver

MARK = re.compile(r"^FAILCHECK (.*)$", re.M)


def parse(out):
    marks = []
    for m in MARK.finditer(out):
        body = m.group(1)
        err = None
        if " error=" in body:
            body, err = body.split(" error=", 1)
        kv = dict(p.split("=", 1) for p in body.split() if "=" in p)
        if err is not None:
            kv["error"] = err
        marks.append(kv)
    return marks


def launch(scenario, world, cases, limit):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=limit))
    port = store.port
    tmp = tempfile.mkdtemp(prefix="dspark-failure-")
    procs = []
    for r in range(world):
        env = dict(os.environ)
        env.update({
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "DSPARK_FAILURE_SCENARIO": scenario, "DSPARK_FAILURE_CASES": ",".join(cases),
            "DSPARK_FAILURE_RANK_MODE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        })
        f = open(os.path.join(tmp, f"rank{r}.log"), "w+b")
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((p, f))
    t0 = time.monotonic()
    ended = [None] * world
    killed = [False] * world
    while any(e is None for e in ended):
        for i, (p, _) in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        if time.monotonic() - t0 > limit:
            for i, (p, _) in enumerate(procs):
                if ended[i] is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait()
                    ended[i] = time.monotonic() - t0
                    killed[i] = True
        time.sleep(0.05)
    results = []
    for i, (p, f) in enumerate(procs):
        f.seek(0)
        out = f.read().decode(errors="replace")
        f.close()
        results.append({"rank": i, "code": p.returncode, "out": out, "ended": ended[i], "killed": killed[i],
                        "marks": parse(out)})
    del store
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def show_tail(res, n=25):
    lines = res["out"].rstrip().splitlines()
    return "\n".join("    | " + ln for ln in lines[-n:])


def judge_kill(scenario, world, results):
    victim = world - 1 if scenario == "kill-last" else 0
    limit = TIMEOUT * 1.5 + 5
    problems, times = [], []
    v = results[victim]
    if not any(m.get("outcome") == "DYING" for m in v["marks"]):
        problems.append(f"the victim (rank {victim}) never reached step {KILL_STEP} (exit {v['code']})")
    for res in results:
        r = res["rank"]
        if r == victim:
            out(f"  rank {r} (victim): exit {res['code']}")
            continue
        raised = [m for m in res["marks"] if m.get("outcome") == "RAISED"]
        done = [m for m in res["marks"] if m.get("outcome") == "COMPLETED"]
        if raised:
            m = raised[0]
            el = float(m["elapsed"])
            times.append(el)
            status = "ok" if el <= limit else f"TOO SLOW (limit {limit:.1f}s)"
            if res["killed"]:
                how = "then hung: killed by the driver"
            else:
                how = f"exit {res['code']} {res['ended']:.1f}s after launch"
            out(f"  rank {r} (survivor): raised after {el:.2f}s at step {m.get('step')} [{status}]; {how}: "
                  f"{m.get('error', '')[:300]}")
            if el > limit:
                problems.append(f"rank {r} raised only after {el:.1f}s (timeout {TIMEOUT:g}s)")
            if res["killed"]:
                problems.append(f"rank {r} raised but then hung instead of exiting")
        elif done:
            problems.append(f"rank {r} completed its steps without any error although rank {victim} died")
            out(f"  rank {r} (survivor): NO ERROR, completed\n{show_tail(res)}")
        else:
            how = "HUNG (killed by the driver)" if res["killed"] else f"exited {res['code']} without a marker"
            problems.append(f"rank {r} {how}")
            out(f"  rank {r} (survivor): {how}\n{show_tail(res)}")
    return problems, "survivors raised after " + ",".join(f"{t:.1f}s" for t in times)


def judge_mismatch(scenario, world, results, cases, info_cases):
    limit = TIMEOUT * 1.5 + 5
    problems, notes = [], []
    for case in cases:
        informational = case in info_cases
        outcomes = []
        for res in results:
            r = res["rank"]
            ms = [m for m in res["marks"] if m.get("case") == case and m.get("outcome") != "BEGIN"]
            if not ms:
                began = any(m.get("case") == case and m.get("outcome") == "BEGIN" for m in res["marks"])
                how = "HUNG (killed by the driver)" if res["killed"] else f"no outcome (exit {res['code']})"
                if not began:
                    how += ", never began this case"
                outcomes.append((r, how, None))
                continue
            m = ms[0]
            outcomes.append((r, m["outcome"], m))
        for r, oc, m in outcomes:
            detail = ""
            if m is not None:
                detail = f" after {m.get('elapsed', '?')}s" + (f": {m['error'][:250]}" if m.get("error") else "")
            out(f"  case {case}{' (info)' if informational else ''}: rank {r} {oc}{detail}")
        bad = [(r, oc, m) for r, oc, m in outcomes
               if oc != "RAISED" or (m is not None and float(m.get("elapsed", 0)) > limit)]
        if bad:
            msg = f"case {case}: " + "; ".join(
                f"rank {r} {oc}" + (f" after {m.get('elapsed')}s" if m is not None else "") for r, oc, m in bad)
            (notes if informational else problems).append(msg)
    for res in results:
        if res["killed"]:
            problems.append(f"rank {res['rank']} had to be killed by the driver (stuck)")
        if res["killed"] or (res["code"] not in (0, 3)):
            out(f"  rank {res['rank']} exit {res['code']}{' (killed)' if res['killed'] else ''}; its output:\n"
                  f"{show_tail(res)}")
    return problems, "; ".join(notes)


def driver():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    required = ["kill-last", "kill-first", "mismatch-collective", "mismatch-count", "mismatch-dtype"]
    info = ["mismatch-op", "mismatch-dtype-same-bytes"]
    ap.add_argument("--scenario", action="append", choices=required + info,
                    help="run only these (repeatable); default: the required ones")
    ap.add_argument("--info", action="store_true", help="add the informational mismatch cases")
    args = ap.parse_args()
    scenarios = args.scenario or (required + (info if args.info else []))
    t0 = time.monotonic()
    failed = 0
    out(f"failure_check: backend={BACKEND} timeout={TIMEOUT:g}s")
    for sc in scenarios:
        world = 2 if sc == "kill-first" else 3
        # startup (imports on a loaded machine) + the worst allowed time
        limit = 60 + TIMEOUT * 2 + 10
        t1 = time.monotonic()
        case = sc.split("-", 1)[1]
        results = launch(sc, world, [case], limit)
        out(f"scenario {sc} ({world} ranks) ran {time.monotonic() - t1:.1f}s:")
        if sc.startswith("kill"):
            problems, summary = judge_kill(sc, world, results)
        else:
            problems, summary = judge_mismatch(sc, world, results, [case], {case} if sc in info else set())
            if sc in info:
                summary = "(informational, never fails) " + ("every rank raised" if not summary else summary)
            else:
                summary = "every rank raised" if not problems else "not every rank raised"
        status = "PASS" if not problems else "FAIL"
        if problems:
            failed += 1
            for p in problems:
                out(f"  PROBLEM {p}")
        out(f"FAILURE_CHECK scenario={sc} world={world} timeout={TIMEOUT:g}s RESULT={status} {summary}")
    out(f"FAILURE_CHECK backend={BACKEND} scenarios={len(scenarios)} failed={failed} "
          f"time={time.monotonic() - t0:.1f}s RESULT={'PASS' if not failed else 'FAIL'}")
    return 0 if not failed else 1


if __name__ == "__main__":
    if os.environ.get("DSPARK_FAILURE_RANK_MODE"):
        rank_main()
    else:
        sys.exit(driver())
