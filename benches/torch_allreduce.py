"""torch.distributed.all_reduce through dspark against gloo, interleaved, in one job.

    torchrun --standalone --nproc-per-node 2 benches/torch_allreduce.py [--max-bytes 256M]
        [--rounds 5] [--dtype float32] [--budget 0.2] [--json out.json]

Each size runs `rounds` rounds; in each round every contender runs back to back (dspark
through torch, gloo through torch, and dspark's own Python package without torch, to show
what the torch dispatch costs), so machine noise hits them alike. Reported: the median
time per call, the bus bandwidth (nccl-tests' 2(n-1)/n factor), and gloo/dspark. Compare
ratios from one run on one machine, never absolute times across machines.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def parse_size(s):
    s = s.strip().upper()
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
    return int(float(s) * mult)


def fmt_bytes(b):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m:
            return f"{b / m:g} {unit}"
    return f"{b} B"


def timed(fn, iters):
    dist.barrier(group=BARRIER)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--factor", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budget", type=float, default=0.2, help="seconds per measurement")
    ap.add_argument("--no-package", action="store_true",
                    help="skip dspark's own package (dspark.Communicator) column")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    global BARRIER
    dist.init_process_group("dspark")
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    BARRIER = gloo
    dtype = getattr(torch, a.dtype)
    esz = torch.empty(0, dtype=dtype).element_size()

    package = None
    if not a.no_package:
        import dspark

        store = dist.PrefixStore("bench-package", dist.distributed_c10d._get_default_store())
        package = dspark.Communicator.from_store(store, rank, n, timeout=120)

    sizes = []
    b = parse_size(a.min_bytes)
    while b <= parse_size(a.max_bytes):
        sizes.append(b)
        b *= a.factor
    if rank == 0:
        impl = dist.get_backend_impl() if hasattr(dist, "get_backend_impl") else None
        info = impl.dspark_info() if hasattr(impl, "dspark_info") else {}
        print(f"# torch {torch.__version__}, {n} ranks, {a.dtype}, {a.rounds} interleaved rounds")
        print(f"# dspark: {info.get('transport', '?')} ({info.get('transport_detail', '')}); "
              f"rendezvous: {info.get('rendezvous', '?')}")
        cols = "dspark_us  gloo_us  gloo/dspark  dspark_GB/s  gloo_GB/s"
        if package:
            cols += "  package_us  torch_over_package_us"
        print(f"# {'bytes':>10}  {cols}")
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // esz)
        t = torch.ones(count, dtype=dtype)
        # Calibrate on gloo (the slower one) so every contender runs as many iterations.
        probe = timed(lambda: dist.all_reduce(t, group=gloo), 3)
        iters = max(3, min(20000, int(a.budget / max(probe, 1e-7))))
        it = torch.tensor([iters], dtype=torch.int64)
        dist.all_reduce(it, op=dist.ReduceOp.MAX, group=gloo)
        iters = int(it.item())
        res = {"dspark": [], "gloo": [], "package": []}
        for _ in range(a.rounds):
            res["dspark"].append(timed(lambda: dist.all_reduce(t), iters))
            res["gloo"].append(timed(lambda: dist.all_reduce(t, group=gloo), iters))
            if package:
                res["package"].append(timed(lambda: package.all_reduce(t), iters))
        med = {k: statistics.median(v) for k, v in res.items() if v}
        bus = lambda s: nbytes * 2 * (n - 1) / n / s / 1e9 if n > 1 else 0.0  # noqa: E731
        row = {
            "bytes": count * esz,
            "iters": iters,
            "dspark_us": med["dspark"] * 1e6,
            "gloo_us": med["gloo"] * 1e6,
            "ratio": med["gloo"] / med["dspark"],
            "dspark_busbw": bus(med["dspark"]),
            "gloo_busbw": bus(med["gloo"]),
        }
        if package:
            row["package_us"] = med["package"] * 1e6
            row["torch_over_package_us"] = (med["dspark"] - med["package"]) * 1e6
        rows.append(row)
        if rank == 0:
            line = (f"  {fmt_bytes(row['bytes']):>10}  {row['dspark_us']:9.1f}  "
                    f"{row['gloo_us']:7.1f}  {row['ratio']:10.2f}x  "
                    f"{row['dspark_busbw']:11.3f}  {row['gloo_busbw']:9.3f}")
            if package:
                line += f"  {row['package_us']:10.1f}  {row['torch_over_package_us']:21.1f}"
            print(line, flush=True)
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "world": n, "dtype": a.dtype, "rows": rows}, f,
                      indent=1)
    if package:
        package.close()
    dist.barrier(group=gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
