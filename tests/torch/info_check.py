#!/usr/bin/env python3
"""Path truth from Python: `dspark.Communicator.info()` and `dspark.torch.info(group)` say which
transport every connection uses and which path CUDA tensors take on it, and why, against what
the test set up. Run under torchrun, with WANT_TRANSPORT the transport every rank should report
(ranks of one host: `shm`, or `tcp` with DSPARK_TRANSPORT=tcp):

    WANT_TRANSPORT=shm torchrun --standalone --nproc-per-node 3 tests/torch/info_check.py
    DSPARK_TRANSPORT=tcp WANT_TRANSPORT=tcp torchrun --standalone --nproc-per-node 3 \\
        tests/torch/info_check.py

Checks, on each rank:
- the package's communicator: rank, world, transport, every peer's transport, and every
  connection's device path (no GPU and no RDMA here: `<transport>/staged` both ways, with
  the reason), the common `device_path`, no GPU where asynchronous calls block, where
  all_reduce switches algorithm (from 4 B on), the timeout given, the object's format;
- the same through torch: `dspark.torch.info()` of the world group made with
  backend="dspark", and of a `new_group([0, 1])` (2 ranks: one peer), a ValueError for a
  gloo group and for a group without this rank, and `cuda_backend` naming gloo for a
  `cpu:dspark,cuda:gloo` group (its CUDA tensors are not dspark's);
- an all_reduce on the dspark group against the gloo group's in the same run (the group the
  facts describe works).

Ends with "INFO_CHECK rank=R RESULT=PASS".
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist

import dspark
import dspark.torch

RANK = int(os.environ["RANK"])
N = int(os.environ["WORLD_SIZE"])
WANT = os.environ["WANT_TRANSPORT"]
problems = []


def check(ok, what):
    if not ok:
        problems.append(what)
        sys.stdout.write(f"info_check: PROBLEM rank {RANK}: {what}\n")


def check_info(info, rank, world, where):
    """`info` of a communicator where this process is `rank` of `world`, all on one host."""
    check(info.get("format") == "dspark-comm-info" and info.get("version") == 1,
          f"{where}: format/version {info.get('format')} {info.get('version')}")
    check(info["rank"] == rank and info["world_size"] == world,
          f"{where}: rank {info['rank']} of {info['world_size']}, expected {rank} of {world}")
    if world == 1:
        return
    check(info["transport"] == WANT, f"{where}: transport {info['transport']}, expected {WANT}")
    peers = [p for p in range(world) if p != rank]
    check([info["peer_transports"][p] for p in peers] == [WANT] * len(peers),
          f"{where}: peer_transports {info['peer_transports']}")
    conns = info["device_paths"]
    check([c["peer"] for c in conns] == peers, f"{where}: device_paths peers {conns}")
    for c in conns:
        for d in ("send", "recv"):
            p = c[d]
            check(p["transport"] == WANT and p["memory"] == "staged"
                  and p["path"] == f"{WANT}/staged" and isinstance(p["reason"], str)
                  and len(p["reason"]) > 10,
                  f"{where}: rank {c['peer']} {d}: {p}")
    check(info["device_path"] == f"{WANT}/staged" and info["device_path_error"] is None,
          f"{where}: device_path {info['device_path']} ({info['device_path_error']})")
    check(info["enqueue_blocks"] == [], f"{where}: enqueue_blocks {info['enqueue_blocks']}")
    steps = info["all_reduce_algorithms"]
    check(bool(steps) and steps[0]["from_bytes"] == 4
          and all(isinstance(s["algorithm"], str) and s["algorithm"] for s in steps)
          and [s["from_bytes"] for s in steps] == sorted(s["from_bytes"] for s in steps),
          f"{where}: all_reduce_algorithms {steps}")
    check(len(info["gpu_direct"]) == world
          and all(g.startswith("unavailable: ") for g in info["gpu_direct"]),
          f"{where}: gpu_direct {info['gpu_direct']}")
    # Shared memory is the fast path between ranks of one host; TCP there was asked for, and
    # the reason says so (every rank asked: ranks 0 to world-1).
    if WANT == "shm":
        check(info["transport_reason"] is None, f"{where}: {info['transport_reason']} on shm")
    else:
        asked = f"DSPARK_TRANSPORT={WANT} on ranks 0-{world - 1}"
        check(asked in (info["transport_reason"] or ""),
              f"{where}: transport_reason {info['transport_reason']!r} lacks {asked!r}")


os.environ["DSPARK_TIMEOUT"] = "42"
comm = dspark.Communicator.from_env()
del os.environ["DSPARK_TIMEOUT"]
info = comm.info()
check_info(info, RANK, N, "Communicator.info()")
check(info["timeout"] == 42.0 and isinstance(info["timeout"], float)
      and isinstance(info["spin_us"], float),
      f"timeout {info['timeout']!r}, expected 42.0 (DSPARK_TIMEOUT), and floats")
comm.close()

dist.init_process_group("dspark", timeout=datetime.timedelta(seconds=50))
gloo = dist.new_group(backend="gloo")
world_info = dspark.torch.info()
check_info(world_info, RANK, N, "dspark.torch.info()")
check(world_info["timeout"] == 50.0, f"torch group timeout {world_info['timeout']}, expected 50")
pair = dist.new_group([0, 1], backend="dspark")
if RANK in (0, 1):
    check_info(dspark.torch.info(pair), RANK, 2, "dspark.torch.info(new_group([0, 1]))")
else:
    try:
        dspark.torch.info(pair)
        check(False, "dspark.torch.info(a group without this rank) did not raise")
    except ValueError as e:
        check("not a member" in str(e), f"dspark.torch.info(a group without this rank): {e}")
# The route into torch decides whether the world group has a CUDA backend of dspark's.
check(world_info["cuda_backend"] in ("dspark", None),
      f"dspark.torch.info(): cuda_backend {world_info['cuda_backend']!r}")
# CUDA tensors of a shared group go to the other backend, and info says which.
shared = dist.new_group(backend="cpu:dspark,cuda:gloo")
shared_info = dspark.torch.info(shared)
check(shared_info["cuda_backend"] == "gloo" and shared_info["transport"] == WANT,
      f"dspark.torch.info(cpu:dspark,cuda:gloo): cuda_backend {shared_info['cuda_backend']!r}, "
      f"transport {shared_info['transport']}")
try:
    dspark.torch.info(gloo)
    check(False, "dspark.torch.info(gloo group) did not raise")
except ValueError as e:
    check("no dspark backend" in str(e), f"dspark.torch.info(gloo group): {e}")

x = torch.arange(1009, dtype=torch.float64) * (RANK + 1)
y = x.clone()
dist.all_reduce(x)
dist.all_reduce(y, group=gloo)
check(torch.equal(x, y), f"all_reduce: dspark {x[:3]} gloo {y[:3]}")
dist.destroy_process_group()

if problems:
    sys.stdout.write(f"\nINFO_CHECK rank={RANK} RESULT=FAIL problems={len(problems)}\n")
    sys.exit(1)
sys.stdout.write(f"\nINFO_CHECK rank={RANK} RESULT=PASS\n")
sys.stdout.flush()
