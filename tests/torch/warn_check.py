#!/usr/bin/env python3
"""dspark's warnings reach a Python process's stderr, as the binaries print them (a Python
process has no tracing subscriber of its own: before, every degraded path — GPUDirect falling
back to staging, device calls run as blocking ones, a forced algorithm that does not apply —
went unseen there). Run under torchrun with DSPARK_ALGO=pairwise, which all_reduce does not
implement (so it runs its default and warns once):

    DSPARK_ALGO=pairwise torchrun --standalone --nproc-per-node 2 tests/torch/warn_check.py

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
sys.stdout.write(f"\nWARN_CHECK rank={RANK} RESULT=PASS\n")
sys.stdout.flush()
