#!/usr/bin/env python3
"""`dist.recv(src=None)` / `dist.irecv(src=None)` and sparse `dist.all_reduce`, dspark beside
gloo: the same scenarios, the same expectations, with backend="gloo" and backend="dspark" on
each route into torch (the Python ProcessGroup and, on torch >= 2.14, the c10d Backend).

    python tests/torch/anysource_sparse_check.py [--world 3]

any-source  every rank but one sends 3 messages (prime lengths) to the receiver, which takes
            them with recv(src=None) and irecv(src=None) alternately: each returns (or its
            Work's _source_rank() names) the sender, whose rank fills the message, and every
            sender is heard 3 times in its own order. The receiver is a middle rank (its
            senders are on both sides) and then rank 0. On the c10d Backend route torch
            cannot read a Python backend's source rank (its Work holder forwards only wait and
            get_future): there the data must arrive and `_source_rank()` must raise torch's
            error, which is what is checked.
sparse      all_reduce (SUM) of sparse COO tensors: 1 to 3 sparse dimensions, 0 to 2 dense
            ones, float64, float32 and int64 values, one rank with no stored element, overlapping
            indices: equal to the sum computed locally from every rank's input, coalesced.

Last line: ANYSOURCE_SPARSE_CHECK runs=N failed=F time=T.Ts RESULT=PASS|FAIL (exit 0 on PASS).
"""

import argparse
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SOURCE_RANK_ERR = "sourceRank() may only be called"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sparse_input(rank, world, sd, dd, dtype, case):
    """Rank `rank`'s tensor of case `case`: rank 0 stores nothing in the odd cases."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    n = world + 2
    shape = [n] * sd + [3] * dd
    nnz = 0 if (rank == 0 and case % 2) else 2 + rank * 3
    idx = torch.randint(0, n, (sd, nnz), generator=g)
    vals = torch.randint(-50, 50, [nnz] + [3] * dd, generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, shape)


def sparse_cases():
    cases = []
    for sd in (1, 2, 3):
        for dd in (0, 1, 2):
            for dtype in (torch.float64, torch.float32, torch.int64):
                cases.append((sd, dd, dtype))
    return cases


def rank_main(rank, world, backend, route, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if route:
        os.environ["DSPARK_TORCH_ROUTE"] = route
    problems = []
    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
        backend_route = route == "backend"
        # any source, receiver a middle rank, then rank 0
        for receiver in sorted({world // 2, 0}):
            sizes = [7, 1, 131]
            if rank == receiver:
                heard = {r: 0 for r in range(world) if r != receiver}
                for k in range((world - 1) * len(sizes)):
                    # every sender's k-th message has the same length: the receiver does not
                    # know whose comes next, so the rounds are cut by a barrier below
                    n = sizes[k // (world - 1)]
                    t = torch.full((n,), -1.0)
                    if k % 2 == 0:
                        try:
                            src = dist.recv(t)
                        except RuntimeError as e:
                            if not (backend_route and SOURCE_RANK_ERR in str(e)):
                                raise
                            src = int(t[0])
                    else:
                        w = dist.irecv(t)
                        w.wait()
                        try:
                            src = w._source_rank()
                        except RuntimeError as e:
                            if not (backend_route and SOURCE_RANK_ERR in str(e)):
                                raise
                            src = int(t[0])
                        else:
                            if backend_route:
                                problems.append("the Backend route read a source rank")
                    if not torch.equal(t, torch.full((n,), float(src))):
                        problems.append(f"any-source message {k}: {t.tolist()} from {src}")
                    elif src not in heard:
                        problems.append(f"any-source message {k} from rank {src}")
                    else:
                        heard[src] += 1
                    if (k + 1) % (world - 1) == 0:
                        dist.barrier()
                if any(v != len(sizes) for v in heard.values()):
                    problems.append(f"receiver {receiver} heard {heard}")
            else:
                for n in sizes:
                    dist.send(torch.full((n,), float(rank)), receiver)
                    dist.barrier()
        # sparse
        for case, (sd, dd, dtype) in enumerate(sparse_cases()):
            t = sparse_input(rank, world, sd, dd, dtype, case)
            want = sparse_input(0, world, sd, dd, dtype, case)
            for r in range(1, world):
                want = want + sparse_input(r, world, sd, dd, dtype, case)
            want = want.coalesce()
            dist.all_reduce(t, dist.ReduceOp.SUM)
            if not t.is_sparse or not torch.equal(t.coalesce().to_dense(), want.to_dense()):
                problems.append(f"sparse case {case} ({sd} sparse, {dd} dense, {dtype}) wrong")
            elif backend != "gloo" and not t.is_coalesced():
                problems.append(f"sparse case {case}: result not coalesced")
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        problems.append(traceback.format_exc().strip().splitlines()[-1])
    q.put((rank, problems))


def run(world, backend, route):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, backend, route, port, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 180
    while len(results) < world and time.monotonic() < deadline:
        try:
            r, probs = q.get(timeout=1)
            results[r] = probs
        except Exception:  # noqa: BLE001 - queue.Empty
            if not any(p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    problems = []
    for r in range(world):
        if r not in results:
            problems.append(f"rank {r} reported nothing")
        problems += [f"rank {r}: {x}" for x in results.get(r, [])]
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=3)
    args = ap.parse_args()
    t0 = time.monotonic()
    runs = [("gloo", None), ("dspark", "pg")]
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 14):  # the c10d Backend route exists
        runs.append(("dspark", "backend"))
    failed = 0
    for backend, route in runs:
        problems = run(args.world, backend, route)
        for p in problems:
            print(f"PROBLEM backend={backend} route={route} {p}", flush=True)
        print(f"ANYSOURCE_SPARSE backend={backend} route={route} world={args.world} "
              f"problems={len(problems)}", flush=True)
        failed += bool(problems)
    result = "PASS" if not failed else "FAIL"
    print(f"ANYSOURCE_SPARSE_CHECK runs={len(runs)} failed={failed} "
          f"time={time.monotonic() - t0:.1f}s RESULT={result}", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
