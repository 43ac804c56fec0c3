#!/usr/bin/env python3
"""torch's flight recorder through a backend: a 2-rank timeout that torchfrtrace explains.

    torchrun --standalone --nproc-per-node 2 tests/torch/flight_check.py   (DSPARK_TEST_BACKEND=dspark|gloo)

Both ranks run a few all_reduces; then rank 0 calls one more that rank 1 never joins, and
times out (init_process_group(timeout=3 s)). With TORCH_FR_BUFFER_SIZE, TORCH_FR_DUMP_ON_TIMEOUT=1
and TORCH_FR_DUMP_TEMP_FILE=<dir>/trace_ set (by this script, before the group exists):

* dspark: rank 0 writes its dump when the call fails and signals rank 1 through the store;
  rank 1, which never called anything, writes its own within about a second, and rank 0's
  error waits for it (under a launcher that ends the job on that error, it is never written
  otherwise);
* gloo (the reference): each rank writes its dump on demand
  (torch._C._distributed_c10d._dump_fr_trace_file), rank 1 once rank 0 has failed.

Rank 0 then reads both dumps (the pickles) and counts each rank's all_reduce entries (the
reference: gloo's say 6 and 5), and runs `torchfrtrace <dir>` (from this venv): for dspark it
must report the all_reduce that not every rank joined and name rank 1 as the missing one.
(torch 2.15's torchfrtrace cannot read gloo's own dumps: their pg_config names the group ''
while the entries name it '0', a KeyError; so gloo's torchfrtrace result is reported, not
required.) It prints

    FLIGHT_CHECK backend=B world=2 all_reduces=6,5 torchfrtrace=ok|failed missing=1 collective=<name> RESULT=PASS|FAIL
"""

import pickle

import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

BACKEND = os.environ.get("DSPARK_TEST_BACKEND", "dspark")
RANK = int(os.environ["RANK"])
# One directory for both ranks: under the agent's run id (the same for every rank).
DIR = os.path.join(
    tempfile.gettempdir(),
    f"flight_check_{BACKEND}_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}_{os.environ['MASTER_PORT']}",
)
os.makedirs(DIR, exist_ok=True)
os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
os.environ["TORCH_FR_DUMP_ON_TIMEOUT"] = "1"
os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(DIR, "trace_")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

GOOD = 5


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def wait_for(path, limit=60.0):
    t0 = time.monotonic()
    while not os.path.exists(path) and time.monotonic() - t0 < limit:
        time.sleep(0.05)
    return os.path.exists(path)


def main():
    if BACKEND == "dspark":
        import dspark.torch  # noqa: F401 - registers the backend on torch without entry points
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=3))
    world = dist.get_world_size()
    assert world == 2, world
    for i in range(GOOD):
        t = torch.full((7,), float(RANK + i))
        dist.all_reduce(t)
        want = float(sum(r + i for r in range(world)))
        assert torch.equal(t, torch.full((7,), want)), (i, t)
    mine = os.path.join(DIR, f"trace_{RANK}")
    other = os.path.join(DIR, f"trace_{1 - RANK}")
    ok = True
    if RANK == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(7))
            say("FLIGHT rank 0: the all_reduce rank 1 never joined completed")
            ok = False
        except Exception as e:  # noqa: BLE001 - the timeout, whichever class
            say(f"FLIGHT rank 0 raised after {time.monotonic() - t0:.1f}s: {type(e).__name__}")
            if BACKEND == "dspark" and not os.path.exists(other):
                # The error waits for every rank's record: a launcher ends the job on it
                # (torchrun within a second), and rank 1's was then never written.
                say("FLIGHT rank 0's error came before rank 1's record was written")
                ok = False
        if BACKEND != "dspark":
            torch._C._distributed_c10d._dump_fr_trace_file(RANK, backend=BACKEND)
    else:
        if BACKEND == "dspark":
            # Nothing to do here: rank 0's failure makes this rank dump (the store signal).
            ok = wait_for(mine) and wait_for(other)
        else:
            ok = wait_for(other)
            torch._C._distributed_c10d._dump_fr_trace_file(RANK, backend=BACKEND)
        say(f"FLIGHT rank 1: dump written: {ok}")
    if RANK == 0:
        ok = ok and wait_for(mine) and wait_for(other)
        tool = os.path.join(os.path.dirname(sys.executable), "torchfrtrace")
        r = subprocess.run([tool, DIR], capture_output=True, text=True, timeout=120)
        report = r.stdout + r.stderr
        say("FLIGHT torchfrtrace:\n" + "\n".join("  " + l for l in report.splitlines()))
        joined = "Not all ranks joining collective" in report
        missing = "missing ranks: {1}" in report
        coll = next(
            (l.split("collective:", 1)[1].strip() for l in report.splitlines()
             if "collective:" in l and "all_reduce" in l),
            "none",
        )
        counts = []
        for r_ in range(world):
            with open(os.path.join(DIR, f"trace_{r_}"), "rb") as f:
                d = pickle.load(f)
            counts.append(sum(1 for e in d.get("entries", [])
                              if e["profiling_name"].endswith(":all_reduce")))
        traced = r.returncode == 0 and joined and missing and coll.endswith("all_reduce")
        ok = ok and counts == [GOOD + 1, GOOD] and (traced or BACKEND != "dspark")
        say(
            f"FLIGHT_CHECK backend={BACKEND} world={world} "
            f"all_reduces={','.join(map(str, counts))} "
            f"torchfrtrace={'ok' if traced else 'failed'} missing={1 if missing else '?'} "
            f"collective={coll} RESULT={'PASS' if ok else 'FAIL'}"
        )
    # Leave without a collective: rank 0's group is poisoned, rank 1's peer is gone.
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
