import statistics, time, sys
import torch, torch.distributed as dist
dist.init_process_group("dspark")
gloo = dist.new_group(backend="gloo")
rank = dist.get_rank()
def timed(fn, iters):
    dist.barrier(group=gloo)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6
for nbytes in (8, 65536):
    t = torch.ones(max(1, nbytes // 4))
    res = {k: [] for k in ("d_sync", "d_async", "g_sync", "g_async")}
    for _ in range(5):
        res["d_sync"].append(timed(lambda: dist.all_reduce(t), 2000))
        res["d_async"].append(timed(lambda: dist.all_reduce(t, async_op=True).wait(), 2000))
        res["g_sync"].append(timed(lambda: dist.all_reduce(t, group=gloo), 2000))
        res["g_async"].append(timed(lambda: dist.all_reduce(t, group=gloo, async_op=True).wait(), 2000))
    if rank == 0:
        print(nbytes, " ".join(f"{k} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in res.items()), flush=True)
dist.destroy_process_group()
