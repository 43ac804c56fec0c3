#!/usr/bin/env python3
"""CUDA tensors through the dspark torch.distributed backend (a GPU machine: tests/gpu/run_all.sh
runs it).

    torchrun --standalone --nproc-per-node 2 tests/torch/cuda_check.py

Every rank uses GPU (local rank mod the number of GPUs), so 2 ranks on one GPU work. Checks:
- the reductions against every rank's input reduced here in float64 (independent of any
  backend); gloo on CPU is the reference for DDP;
- all_reduce (SUM, MIN, MAX, PRODUCT, AVG), broadcast, reduce, all_gather_into_tensor,
  reduce_scatter_tensor, all_gather and reduce_scatter (list forms), send/recv and the coalesced all_reduce, on float32, float64, float16,
  bfloat16, int8, uint8, int32 and int64, at 1, 7 and 1000003 elements: synchronous calls, whose
  result is read by work queued afterwards on torch's current stream (no wait in between), and
  async_op=True calls waited through their Work;
- all_to_all_single with uneven and equal splits and all_to_all (list form) on float32,
  bfloat16, int64 and uint8, synchronous and async_op=True, against the blocks computed here;
- a non-contiguous output (copied back on the same stream);
- ten DDP steps of a small model on CUDA with different initialisations per rank: the
  parameters agree with the same DDP run over gloo on CPU (float32, within 1e-4 relative).

Prints `SKIPPED: <why>` and exits 0 without CUDA; otherwise `CUDA_CHECK world=N checks=C
failures=F RESULT=PASS|FAIL` on rank 0 and exits 1 on any failure.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist

import dspark.torch  # noqa: F401  (explicit: works on every torch, with or without the entry point)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
       "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}


def main():
    if not torch.cuda.is_available():
        print("cuda_check: SKIPPED: torch sees no CUDA device", flush=True)
        return 0
    timeout = datetime.timedelta(seconds=int(os.environ.get("DSPARK_CUDA_TIMEOUT", "120")))
    dist.init_process_group("dspark", timeout=timeout)
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    checks = failures = 0

    def check(label, got, want, exact, rtol=None):
        nonlocal checks, failures
        checks += 1
        got = got.cpu()
        low = got.dtype in (torch.float16, torch.bfloat16)
        ok = torch.equal(got, want) if exact else torch.allclose(
            got.double(), want.double(), rtol=rtol or (2e-2 if low else 1e-5),
            atol=1e-2 if low else 1e-6)
        if not ok:
            failures += 1
            diff = (got.double() - want.double()).abs()
            i = int(diff.argmax()) if diff.numel() else 0
            print(f"MISMATCH rank={rank} {label}: element {i} is {got.flatten()[i].item()} "
                  f"instead of {want.flatten()[i].item()}", flush=True)

    def make(r, count, dtype, op="sum"):
        # Small exactly representable values; PRODUCT keeps them at 1 or 2 so nothing
        # overflows; no zeros for MIN/MAX ties to hide in.
        i = torch.arange(count, dtype=torch.int64)
        v = (i % 2) + 1 if op == "product" else (i * 7 + r * 3) % 23 + 1
        return v.to(dtype)

    def reference(name, count, dtype):
        """The reduction of every rank's input, computed here in float64 (independent of
        any backend), then rounded once to `dtype` (AVG: the sum divided by n)."""
        xs = torch.stack([make(q, count, dtype, name).double() for q in range(n)])
        r = {"sum": xs.sum(0), "min": xs.min(0).values, "max": xs.max(0).values,
             "product": xs.prod(0), "avg": xs.sum(0) / n}[name]
        if name == "avg" and not dtype.is_floating_point:
            r = r.trunc()  # integers: truncated toward zero, as NCCL and dspark do
        return r.to(dtype)

    for dtype in DTYPES:
        exact = not dtype.is_floating_point
        for count in (1, 7, int(os.environ.get("DSPARK_OPS_LARGE", "1000003"))):
            for name, op in OPS.items():
                ref = reference(name, count, dtype)
                y = make(rank, count, dtype, name).to(dev)
                dist.all_reduce(y, op)
                z = y.clone()  # queued on the current stream after the collective
                check(f"all_reduce {name} {dtype} n={count}", z, ref, exact or name in ("min", "max"))
            # async_op=True: work queued on the current stream right after the call (before
            # any wait) sees the result; then the Work completes without error.
            y = make(rank, count, dtype).to(dev)
            w = dist.all_reduce(y, async_op=True)
            z = y.clone()
            w.wait()
            check(f"all_reduce async {dtype} n={count}", z, reference("sum", count, dtype), exact)
            # broadcast from the last rank
            y = make(rank, count, dtype).to(dev)
            dist.broadcast(y, n - 1)
            check(f"broadcast {dtype} n={count}", y, make(n - 1, count, dtype), True)
            # reduce to rank 0
            y = make(rank, count, dtype).to(dev)
            dist.reduce(y, 0)
            if rank == 0:
                check(f"reduce {dtype} n={count}", y, reference("sum", count, dtype), exact)
            # all_gather_into_tensor
            y = make(rank, count, dtype).to(dev)
            out = torch.empty(count * n, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, y)
            check(f"all_gather_into_tensor {dtype} n={count}", out,
                  torch.cat([make(q, count, dtype) for q in range(n)]), True)
            # reduce_scatter_tensor
            out = torch.empty(count, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, make(rank, count * n, dtype).to(dev))
            full = reference("sum", count * n, dtype)
            check(f"reduce_scatter_tensor {dtype} n={count}", out,
                  full[rank * count:(rank + 1) * count], exact)
            # The list forms: reduce_scatter and all_gather (concatenated and split on
            # torch's current stream around the call).
            out = torch.empty(count, dtype=dtype, device=dev)
            ins = make(rank, count * n, dtype).to(dev).chunk(n)
            dist.reduce_scatter(out, list(ins))
            check(f"reduce_scatter (list) {dtype} n={count}", out,
                  full[rank * count:(rank + 1) * count], exact)
            outs = [torch.empty(count, dtype=dtype, device=dev) for _ in range(n)]
            dist.all_gather(outs, make(rank, count, dtype).to(dev))
            check(f"all_gather (list) {dtype} n={count}", torch.cat(outs),
                  torch.cat([make(q, count, dtype) for q in range(n)]), True)
            # send/recv around the ring
            if n > 1:
                y = make(rank, count, dtype).to(dev)
                got = torch.empty(count, dtype=dtype, device=dev)
                reqs = [dist.isend(y, (rank + 1) % n), dist.irecv(got, (rank - 1) % n)]
                for r in reqs:
                    r.wait()
                check(f"send/recv {dtype} n={count}", got, make((rank - 1) % n, count, dtype), True)

    # all_to_all on CUDA tensors (MoE's expert exchange): uneven splits (rank q sends rank j
    # (q + 2j) % 4 rows of 3 elements, none for some pairs), equal splits, the list form, and
    # async_op=True (complete once it returns); against the blocks computed here.
    def block(q, j, rows, dtype):
        return (torch.arange(rows * 3, dtype=torch.int64) * 5 + q * 11 + j * 3).remainder(
            101).to(dtype).reshape(rows, 3)

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for split in ("uneven", "equal"):
            rows = [((rank + 2 * j) % 4 if split == "uneven" else 2) for j in range(n)]
            rows_in = [((q + 2 * rank) % 4 if split == "uneven" else 2) for q in range(n)]
            inp = torch.cat([block(rank, j, rows[j], dtype) for j in range(n)]).to(dev)
            out = torch.full((sum(rows_in), 3), 77, dtype=dtype, device=dev)
            for async_op in (False, True):
                w = dist.all_to_all_single(out, inp, rows_in if split == "uneven" else None,
                                           rows if split == "uneven" else None,
                                           async_op=async_op)
                if async_op:
                    w.wait()
                check(f"all_to_all_single {split} {dtype} async={async_op}", out.clone(),
                      torch.cat([block(q, rank, rows_in[q], dtype) for q in range(n)]), True)
        outs = [torch.empty(((q + 2 * rank) % 4, 3), dtype=dtype, device=dev) for q in range(n)]
        dist.all_to_all(outs, [block(rank, j, (rank + 2 * j) % 4, dtype).to(dev) for j in range(n)])
        check(f"all_to_all (list) {dtype}", torch.cat(outs),
              torch.cat([block(q, rank, (q + 2 * rank) % 4, dtype) for q in range(n)]), True)

    # A non-contiguous output: every other column of a matrix.
    m = torch.zeros(5, 8, device=dev)
    view = m[:, ::2]
    view.copy_(torch.full((5, 4), float(rank + 1)))
    dist.all_reduce(view)
    want = torch.zeros(5, 8)
    want[:, ::2] = float(sum(q + 1 for q in range(n)))
    check("all_reduce non-contiguous", m, want, True)

    # Coalesced all_reduce (what DDP issues).
    ts = [make(rank, c, torch.float32).to(dev) for c in (3, 1000, 17)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for c, t in zip((3, 1000, 17), ts):
        check(f"coalesced all_reduce n={c}", t, reference("sum", c, torch.float32), True)

    # DDP on CUDA against DDP over gloo on CPU, different initialisations per rank.
    def model():
        torch.manual_seed(1234 + rank)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    ddp_cuda = torch.nn.parallel.DistributedDataParallel(model().to(dev), device_ids=[dev.index])
    ddp_cpu = torch.nn.parallel.DistributedDataParallel(model(), process_group=gloo)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ddp_cuda, ddp_cpu)]
    gen = torch.Generator().manual_seed(99 + rank)
    for _ in range(10):
        xb = torch.randn(16, 32, generator=gen)
        yb = torch.randn(16, 4, generator=gen)
        for m, o, d in ((ddp_cuda, opts[0], dev), (ddp_cpu, opts[1], torch.device("cpu"))):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xb.to(d)), yb.to(d)).backward()
            o.step()
    for (name, p), q in zip(ddp_cuda.module.named_parameters(), ddp_cpu.module.parameters()):
        # CUDA and CPU matmuls round differently: 1e-4 relative after ten steps.
        check(f"DDP parameter {name}", p.detach(), q.detach(), False, rtol=1e-4)

    torch.cuda.synchronize()
    total = torch.tensor([failures, checks], dtype=torch.int64)
    dist.all_reduce(total, group=gloo)
    if rank == 0:
        print(f"SUMMARY: CUDA_CHECK world={n} checks={int(total[1])} failures={int(total[0])} "
              f"RESULT={'PASS' if int(total[0]) == 0 else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    return 0 if int(total[0]) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
