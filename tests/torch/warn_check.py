#!/usr/bin/env python3
"""dspark's warnings reach a Python process's stderr, as the binaries print them (a Python
process has no tracing subscriber of its own: before, every degraded path — GPUDirect falling
back to staging, device calls run as blocking ones, a forced algorithm that does not apply —
went unseen there). Run under torchrun with DSPARK_ALGO=pairwise, which all_reduce does not
implement (so it runs its default and warns once):

    DSPARK_ALGO=pairwise torchrun --standalone --nproc-per-node 2 tests/torch/warn_check.py

With DSPARK_TUNE_FILE naming a file that is not a tune file, it then makes three torch groups
(four communicators per process in all), whose inits each read it: the warning about it comes
once per process, its repeats at debug level.

Each rank runs an all_reduce of 10007 float64 (past the one-shot sizes, which no forced
algorithm changes) through dspark.Communicator.from_env, checks it
against the sum computed here and ends with "WARN_CHECK rank=R RESULT=PASS". tests/torch_backend.rs
looks for the warning in the output, and for none with DSPARK_LOG=off.
"""

import os
import sys

import numpy as np

import dspark

RANK = int(os.environ["RANK"])
N = int(os.environ["WORLD_SIZE"])

comm = dspark.Communicator.from_env()
x = np.arange(10007, dtype=np.float64) + RANK
comm.all_reduce(x)
want = sum(np.arange(10007, dtype=np.float64) + r for r in range(N))
if not np.array_equal(x, want):
    sys.stdout.write(f"warn_check: FAIL rank {RANK}: {x[:4]} against {want[:4]}\n")
    sys.exit(1)
comm.close()

# Three more communicators in this process, as a torch job makes them (one per group): an
# init warning about the machine (a tune file that cannot be parsed, WARN_TUNE_FILE) is given
# once per process, the repeats at debug level. Each group's all_reduce against the sum.
if os.environ.get("DSPARK_TUNE_FILE"):
    import torch
    import torch.distributed as dist

    dist.init_process_group("dspark")
    groups = [None, dist.new_group(backend="dspark"), dist.new_group(backend="dspark")]
    for i, g in enumerate(groups):
        t = torch.arange(101, dtype=torch.float64) + RANK + i
        dist.all_reduce(t, group=g)
        want_t = sum(torch.arange(101, dtype=torch.float64) + r + i for r in range(N))
        if not torch.equal(t, want_t):
            sys.stdout.write(f"warn_check: FAIL rank {RANK}: group {i}: {t[:4]}\n")
            sys.exit(1)
    dist.destroy_process_group()
sys.stdout.write(f"\nWARN_CHECK rank={RANK} RESULT=PASS\n")
sys.stdout.flush()
