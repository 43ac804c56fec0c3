#!/usr/bin/env python3
"""link_bed_gloo.py - one rank of gloo's allreduce (torch.distributed, f32 sum) on the link bed.

Started once per rank by benches/link_bed.sh with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
and GLOO_SOCKET_IFNAME set. The method is ../shared/peers/gloo_allreduce.py's (and
dspark-bench --peer-rows'): per size 2 verified warm-up batches, then S samples of K
back-to-back calls after a barrier, time/K, max over ranks, median over samples, every batch
checked exactly. Rank 0 prints peer,ranks,bytes,samples,batch,time_us,min_us,max_us,algbw,busbw.
"""
import argparse
import os
import sys
import time


def samples_for(nbytes):
    return 50 if nbytes <= 65536 else 30 if nbytes <= (1 << 20) else 20 if nbytes <= (16 << 20) else 10


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", default="gloo")
    ap.add_argument("--sizes", default="1024,1048576,16777216")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=n)
    failed = False
    for tok in args.sizes.split(","):
        nbytes = int(tok)
        count = nbytes // 4
        if count == 0:
            continue
        f = (torch.arange(count, dtype=torch.int64) % 97 + 1).to(torch.float32)
        ref = f * float(rank + 1)
        buf = ref.clone()
        K = max(1, min(50, (4 << 20) // nbytes))
        S = samples_for(nbytes)
        expect = f * float(n * (n + 1) // 2 * n ** (K - 1))
        bad = 0
        for _ in range(2):
            buf.copy_(ref)
            for _ in range(K):
                dist.all_reduce(buf)
            bad += int(not torch.equal(buf, expect))
        times = torch.zeros(S, dtype=torch.float64)
        for s in range(S):
            buf.copy_(ref)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(K):
                dist.all_reduce(buf)
            times[s] = (time.perf_counter() - t0) / K
            bad += int(not torch.equal(buf, expect))
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        badt = torch.tensor([bad], dtype=torch.int64)
        dist.all_reduce(badt)
        if rank == 0:
            t = sorted(times.tolist())
            med = t[S // 2] if S % 2 else 0.5 * (t[S // 2 - 1] + t[S // 2])
            algbw = nbytes / med / 1e9
            busbw = algbw * 2 * (n - 1) / n
            if badt.item():
                print(f"{args.peer},{n},{nbytes},{S},{K},NaN,NaN,NaN,NaN,NaN,WRONG", flush=True)
            else:
                print(f"{args.peer},{n},{nbytes},{S},{K},{med*1e6:.2f},{t[0]*1e6:.2f},"
                      f"{t[-1]*1e6:.2f},{algbw:.4f},{busbw:.4f}", flush=True)
        failed |= bool(badt.item())
    dist.destroy_process_group()
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
