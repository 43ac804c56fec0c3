"""Absurd world sizes and ranks through the Python package: each must raise
``dspark.ConfigError`` within a second of the call, never abort, panic or hang. Every case
runs in a child process of its own (so an abort or a crash is a failed case, not a dead
checker), through both ways into a communicator: ``Communicator.from_env()`` with
``DSPARK_WORLD_SIZE`` set, and ``Communicator.from_store(store, rank, world_size)``.

    python tests/torch/limits_check.py

Prints one line per case and ends with "LIMITS_CHECK cases=K failed=F RESULT=PASS" (or FAIL).
"""

import json
import os
import socket
import subprocess
import sys

WORLDS = [0, 2**32 + 2, 2**40, 2**64 - 1]
# The binding's own conversions: ints that fit no usize at all.
STORE_ONLY = [(0, 2**64), (0, -1), (2**64, 2), (-1, 2)]
CHILD_LIMIT = 20  # seconds, import torch included: a case that runs past it hung

CHILD = r"""
import json, os, sys, time
route, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import dspark
if route == "store":
    import torch.distributed as dist
    store = dist.HashStore()
t0 = time.monotonic()
try:
    if route == "env":
        c = dspark.Communicator.from_env()
    else:
        c = dspark.Communicator.from_store(store, rank, world, timeout=3)
    out = {"cls": None, "msg": f"no error: {c!r}"}
except BaseException as e:
    out = {"cls": type(e).__name__, "msg": str(e)[:400],
           "config": isinstance(e, dspark.ConfigError)}
out["secs"] = time.monotonic() - t0
print("RESULT " + json.dumps(out), flush=True)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(route, rank, world):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DSPARK_", "MASTER_", "OMPI_", "PMI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DSPARK_TIMEOUT"] = "3"
    if route == "env":
        env.update(DSPARK_RANK=str(rank), DSPARK_WORLD_SIZE=str(world),
                   DSPARK_ROOT_ADDR=f"127.0.0.1:{free_port()}")
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, route, str(rank), str(world)],
                           env=env, capture_output=True, text=True, timeout=CHILD_LIMIT)
    except subprocess.TimeoutExpired:
        return f"hung: no answer within {CHILD_LIMIT} s"
    res = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not res:
        tail = " | ".join((p.stderr or "").strip().splitlines()[-3:])
        return f"exit status {p.returncode} without an answer: {tail}"
    r = json.loads(res[0])
    if not r.get("config"):
        return f"{r['cls']} (not ConfigError) after {r['secs']:.2f} s: {r['msg']}"
    if r["secs"] >= 1.0:
        return f"ConfigError but after {r['secs']:.2f} s: {r['msg']}"
    return None, f"ConfigError after {r['secs']:.3f} s: {r['msg']}"


def main():
    cases = [(route, 0, w) for w in WORLDS for route in ("env", "store")]
    cases += [("store", r, w) for r, w in STORE_ONLY]
    failed = 0
    for route, rank, world in cases:
        got = run_case(route, rank, world)
        if isinstance(got, tuple):
            print(f"ok      route={route} rank={rank} world={world}: {got[1]}", flush=True)
        else:
            failed += 1
            print(f"PROBLEM route={route} rank={rank} world={world}: {got}", flush=True)
    verdict = "PASS" if failed == 0 else "FAIL"
    print(f"LIMITS_CHECK cases={len(cases)} failed={failed} RESULT={verdict}", flush=True)
    sys.exit(0 if failed == 0 else 1)


if __name__ == "__main__":
    main()
