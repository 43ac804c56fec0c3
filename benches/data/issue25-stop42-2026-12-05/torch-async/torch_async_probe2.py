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
def two(t, u):
    a = dist.all_reduce(t, async_op=True); b = dist.all_reduce(u, async_op=True)
    a.wait(); b.wait()
for nbytes in (8, 65536):
    t = torch.ones(max(1, nbytes // 4)); u = torch.ones(max(1, nbytes // 4))
    res = {k: [] for k in ("d_sync", "d_async", "d_fut", "d_two", "g_async")}
    for _ in range(5):
        res["d_sync"].append(timed(lambda: dist.all_reduce(t), 2000))
        res["d_async"].append(timed(lambda: dist.all_reduce(t, async_op=True).wait(), 2000))
        res["d_fut"].append(timed(lambda: dist.all_reduce(t, async_op=True).get_future().wait(), 2000))
        res["d_two"].append(timed(lambda: two(t, u), 1000))
        res["g_async"].append(timed(lambda: dist.all_reduce(t, group=gloo, async_op=True).wait(), 500))
    if rank == 0:
        print(nbytes, " ".join(f"{k} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in res.items()), flush=True)
dist.destroy_process_group()
