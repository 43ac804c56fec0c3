#!/usr/bin/env python3
"""A straggler through torch: `dspark analyze` on the records of a job that is slow, not hung.

    DSPARK_BIN=target/debug/dspark torchrun --standalone --nproc-per-node 3 tests/torch/late_check.py

Rank 1 sleeps 50 ms before each of 12 all_reduces of 64 KiB (a straggler: its data loading).
Every rank notes when it called each one (its own clock, in Python: the reference), then
writes its dspark flight records (`dspark.torch.write_flight_records`). Rank 0 gathers the
notes, finds the rank that called last in most calls and its median lateness behind the
others' median (the reference), and runs `dspark analyze` on the records: its `late:` line
must name the same rank, with a median within 10 ms of the reference's. It prints

    LATE_CHECK world=3 reference=1:50.1ms analyze=1:50.0ms RESULT=PASS|FAIL
"""

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import dspark.torch

RANK = int(os.environ["RANK"])
CALLS = 12
SLOW = 1
SLEEP_S = 0.05
DIR = os.path.join(
    tempfile.gettempdir(),
    f"late_check_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}_{os.environ['MASTER_PORT']}",
)


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def reference(notes):
    """The rank that called last in most calls, and its median lateness (ms) behind the
    median of the others' calls, in those calls."""
    lasts = {}
    for i in range(CALLS):
        at = [n[i] for n in notes]
        r = max(range(len(at)), key=lambda q: at[q])
        others = [t for q, t in enumerate(at) if q != r]
        lasts.setdefault(r, []).append((at[r] - statistics.median_high(others)) / 1e6)
    r, late = max(lasts.items(), key=lambda kv: len(kv[1]))
    return r, statistics.median_high(late)


def main():
    dist.init_process_group("dspark")
    world = dist.get_world_size()
    t = torch.ones(16384)
    notes = []
    for _ in range(CALLS):
        if RANK == SLOW:
            time.sleep(SLEEP_S)
        notes.append(time.time_ns())
        dist.all_reduce(t)
    files = dspark.torch.write_flight_records(DIR)
    assert files, "no flight record written (is the recorder off?)"
    every = [None] * world
    dist.all_gather_object(every, notes)  # also: every rank's records are written
    ok = True
    if RANK == 0:
        ref_rank, ref_ms = reference(every)
        r = subprocess.run(
            [os.environ["DSPARK_BIN"], "analyze", DIR], capture_output=True, text=True, timeout=60
        )
        report = r.stdout + r.stderr
        say("LATE dspark analyze:\n" + "\n".join("  " + l for l in report.splitlines()))
        m = re.search(r"^\s*late: rank (\d+) .*? a median ([0-9.]+) ms after", report, re.M)
        got = (int(m.group(1)), float(m.group(2))) if m else (None, float("nan"))
        ok = (
            r.returncode == 0
            and ref_rank == SLOW
            and got[0] == ref_rank
            and abs(got[1] - ref_ms) <= 10.0
        )
        say(
            f"LATE_CHECK world={world} reference={ref_rank}:{ref_ms:.1f}ms "
            f"analyze={got[0]}:{got[1]:.1f}ms RESULT={'PASS' if ok else 'FAIL'}"
        )
    dist.barrier()
    if RANK == 0 and ok:
        shutil.rmtree(DIR, ignore_errors=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
