"""DDP training with dspark (or gloo) as the torch.distributed backend.

    torchrun --standalone --nproc-per-node 2 examples/torch_ddp.py --backend dspark
    torchrun --standalone --nproc-per-node 2 examples/torch_ddp.py --backend gloo

An unmodified DDP script: the only dspark-specific thing is the backend name (and the
package being installed: `pip install ./python`; no `import dspark`). It trains an MLP on
synthetic data (a fixed random "teacher" network labels random inputs, so the task is
learnable and the same on every run) and prints:

- samples/s of the whole job;
- the step time split into compute and *exposed* communication: the same steps are timed
  under `ddp.no_sync()` (no gradient allreduce at all) and with DDP's allreduces, which run
  during the backward pass; the difference is the communication that overlap did not hide;
- the scaling efficiency as the design notes' story computes it:
  (N-rank throughput) / (N x 1-rank throughput), with the 1-rank throughput measured in the
  same run by rank 0 alone (the other ranks wait, so it has the machine to itself).

Options: --steps, --batch (per rank), --hidden, --layers, --warmup; --bucket-cap-mb (DDP's
gradient bucket size, torch's default 25 MiB), --threads (torch's intra-op threads per rank),
--allreduce-probe K (also time K plain `dist.all_reduce` calls of the whole gradient's size,
outside DDP: the communication that overlap has to hide, beside the 1-rank step), --json FILE
(rank 0 also writes every number to FILE). benches/ddp_bed.sh runs it on the link bed.
"""

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

IN, CLASSES = 256, 10


def make_model(hidden, layers):
    mods, width = [], IN
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*mods)


def batches(rank, batch, steps):
    """Synthetic data labelled by a fixed teacher network: the same on every run."""
    g = torch.Generator().manual_seed(1234)
    teacher = nn.Linear(IN, CLASSES)
    with torch.no_grad():
        teacher.weight.copy_(torch.randn(CLASSES, IN, generator=g))
        teacher.bias.zero_()
    out = []
    g = torch.Generator().manual_seed(10_000 + rank)
    for _ in range(steps):
        x = torch.randn(batch, IN, generator=g)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        out.append((x, y))
    return out


def run_steps(model, opt, data, sync=True):
    """Trains on `data`; returns (seconds, last loss). With `sync=False` the steps run
    under `no_sync()` (no allreduce) with a learning rate of 0: the same computation, but
    the parameters stay as they are, and the optimizer's state (momentum, fed by these
    rank-local gradients) is put back afterwards, so the ranks stay in step."""
    loss_fn = nn.CrossEntropyLoss()
    lrs = [g["lr"] for g in opt.param_groups]
    saved = None
    if not sync:
        saved = copy.deepcopy(opt.state_dict())
        for g in opt.param_groups:
            g["lr"] = 0.0
    t0 = time.perf_counter()
    loss = None
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        if sync or not hasattr(model, "no_sync"):
            loss = loss_fn(model(x), y)
            loss.backward()
        else:
            with model.no_sync():
                loss = loss_fn(model(x), y)
                loss.backward()
        opt.step()
    secs = time.perf_counter() - t0
    if saved is not None:
        opt.load_state_dict(saved)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    return secs, loss.detach().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="dspark", help="dspark or gloo (or any torch backend)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="DDP's bucket_cap_mb (default: torch's, 25)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads per rank")
    ap.add_argument("--allreduce-probe", type=int, default=0, metavar="K",
                    help="also time K plain all_reduce calls of the gradient's size")
    ap.add_argument("--json", default=None, metavar="FILE", help="rank 0 writes its numbers here")
    a = ap.parse_args()

    if a.threads:
        torch.set_num_threads(a.threads)
    dist.init_process_group(backend=a.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # deliberately different: DDP's init broadcast makes them equal
    model = make_model(a.hidden, a.layers)
    params = sum(p.numel() for p in model.parameters())
    data = batches(rank, a.batch, a.warmup + a.steps)
    warm, timed = data[:a.warmup], data[a.warmup:]

    # 1-rank throughput: rank 0 alone, no DDP, no communication, nobody else computing.
    base = None
    if rank == 0:
        solo = make_model(a.hidden, a.layers)
        sopt = torch.optim.SGD(solo.parameters(), lr=0.05, momentum=0.9)
        run_steps(solo, sopt, warm)
        secs, _ = run_steps(solo, sopt, timed)
        base = a.batch * a.steps / secs
    dist.barrier()

    ddp = DDP(model) if a.bucket_cap_mb is None else DDP(model, bucket_cap_mb=a.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    run_steps(ddp, opt, warm)
    # Interleave compute-only and DDP steps in halves, so noise hits both alike.
    half = len(timed) // 2
    t_comp = t_ddp = 0.0
    loss = None
    for chunk in (timed[:half], timed[half:]):
        dist.barrier()
        s, _ = run_steps(ddp, opt, chunk, sync=False)
        t_comp += s
        dist.barrier()
        s, loss = run_steps(ddp, opt, chunk, sync=True)
        t_ddp += s
    times = torch.tensor([t_comp, t_ddp], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the job is as fast as its slowest rank
    t_comp, t_ddp = times.tolist()
    steps = len(timed)
    throughput = n * a.batch * steps / t_ddp

    # Everyone ends with the same parameters (a cheap check that training really synced).
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    in_sync = torch.equal(flat, ref)

    # The gradient's allreduce on its own: one plain all_reduce of every gradient element
    # (f32), outside DDP and with nothing to overlap; median of K calls, slowest rank's.
    probe_ms = None
    if a.allreduce_probe > 0:
        grad = torch.ones(params, dtype=torch.float32)
        dist.all_reduce(grad)
        samples = []
        for _ in range(a.allreduce_probe):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(grad)
            samples.append(time.perf_counter() - t0)
        worst = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        probe_ms = 1e3 * worst.item()

    if rank == 0:
        impl = dist.get_backend_impl() if hasattr(dist, "get_backend_impl") else None
        info = impl.dspark_info() if hasattr(impl, "dspark_info") else None
        step_ms = 1e3 * t_ddp / steps
        comp_ms = 1e3 * t_comp / steps
        print(f"backend {a.backend}, {n} ranks, torch {torch.__version__}, MLP {a.layers}x"
              f"{a.hidden} ({params / 1e6:.2f} M parameters, {params * 4 / 2**20:.1f} MiB of "
              f"gradients per step), batch {a.batch} per rank, {steps} steps")
        if info:
            print(f"  dspark transport: {info['transport']}; rendezvous: {info['rendezvous']}")
        print(f"  throughput        {throughput:10.1f} samples/s")
        print(f"  step time         {step_ms:10.2f} ms = compute {comp_ms:.2f} ms + exposed "
              f"communication {step_ms - comp_ms:.2f} ms")
        print(f"  1-rank throughput {base:10.1f} samples/s (rank 0 alone, same run)")
        print(f"  scaling efficiency {throughput / (n * base):9.1%}  "
              f"(N-rank throughput / (N x 1-rank throughput))")
        print(f"  final loss {loss:.4f}; parameters identical on every rank: {in_sync}")
        solo_ms = 1e3 * a.batch / base
        if probe_ms is not None:
            print(f"  gradient allreduce {probe_ms:9.2f} ms alone (plain all_reduce of "
                  f"{params * 4 / 2**20:.1f} MiB, median of {a.allreduce_probe}) = "
                  f"{probe_ms / solo_ms:.2f} x the 1-rank step ({solo_ms:.2f} ms)")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({
                    "backend": a.backend, "ranks": n, "torch": torch.__version__,
                    "layers": a.layers, "hidden": a.hidden, "batch": a.batch,
                    "steps": steps, "params": params, "grad_bytes": params * 4,
                    "bucket_cap_mb": a.bucket_cap_mb if a.bucket_cap_mb is not None else 25,
                    "threads": torch.get_num_threads(),
                    "step_ms": step_ms, "compute_ms": comp_ms,
                    "exposed_ms": step_ms - comp_ms, "samples_s": throughput,
                    "solo_samples_s": base, "solo_step_ms": solo_ms,
                    "efficiency": throughput / (n * base), "allreduce_ms": probe_ms,
                    "loss": loss, "in_sync": in_sync,
                    "transport": info["transport"] if info else None,
                }, f)
    dist.destroy_process_group()
    if not in_sync:
        raise SystemExit(f"rank {rank}: parameters differ from rank 0's after training")


if __name__ == "__main__":
    main()
