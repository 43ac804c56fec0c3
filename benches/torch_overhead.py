"""Where the time of one small `torch.distributed.all_reduce` through dspark goes, in one job.

    torchrun --standalone --nproc-per-node 2 benches/torch_overhead.py [--sizes 8,4K,1M]
        [--rounds 7] [--budget 0.1] [--bench target/release/dspark-bench] [--gloo]
        [--old PACKAGE] [--bind] [--clock wall|cpu] [--json out.json]

Per size, `rounds` rounds; in each round every contender runs back to back (interleaved, so
machine noise hits them alike), and the medians over rounds are reported, per call:

- `dist`: `dist.all_reduce(t)` through the dspark backend (the default group);
- `direct`: the backend's `allreduce([t], opts)` called from Python (dspark's Python code,
  the native call and the Work; no torch dispatch);
- `noop_dist` / `noop_direct`: the same through a backend whose allreduce does nothing and
  returns a completed Work (a Python ProcessGroup, the route dspark takes for a group that is
  dspark's alone): torch's own share of `dist`;
- torch >= 2.14 also: `backend_dist`, `dist.all_reduce` through a dspark group forced onto
  c10d's Backend route (the route of a group shared with another backend,
  `cpu:dspark,cuda:nccl`), and `noop_be_dist`, the do-nothing backend on that route;
- `package`: `dspark.Communicator.all_reduce(t)` (the package without torch);
- `raw`: the native module's `_run` alone (one PyO3 call, no Python above it);
- `gloo` (`--gloo`): `dist.all_reduce` through a gloo group;
- `bench`: `dspark-bench --ranks 2 -b S -e S` (the Rust library alone, its default table's
  time), run by rank 0 between rounds while rank 1 waits;
- with `--old PACKAGE` (a copy of another build of the package renamed to PACKAGE, whose
  backend registers as PACKAGE): `old_dist` / `old_direct` through it, for A/B in one job.

"binding" = dist - bench: what the binding (torch's dispatch included) adds over the library.

On a loaded machine the 2-rank times swing with preemption (a rank waits for a descheduled
peer). The per-call costs themselves are measured robustly on one rank with the thread's CPU
time: `torchrun --standalone --nproc-per-node 1 benches/torch_overhead.py --clock cpu
--bench ''` (world of 1: the collective does no communication, so what remains is the
binding's and torch's own code).
"""

import argparse
import importlib
import json
import os
import statistics
import subprocess
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
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m:
            return f"{b / m:g} {unit}"
    return f"{b} B"


# ------------------------------------------------------------------ the do-nothing backend


def _has_py_backend():
    try:
        from torch._C._distributed_c10d import Backend as C10DBackend

        class _P(C10DBackend):
            pass

        _P(0, 1)
        return True
    except Exception:  # noqa: BLE001 - torch < 2.14: a Python ProcessGroup
        return False


def _noop_classes(as_process_group):
    if as_process_group:
        base = dist.ProcessGroup
    else:
        from torch._C._distributed_c10d import Backend as base

    class Done(dist._Work):
        def __init__(self, result):
            super().__init__()
            self._result = result

        def wait(self, timeout=None):
            return True

        def is_completed(self):
            return True

        def get_future(self):
            f = torch.futures.Future()
            f.set_result(self._result)
            return f

    class Noop(base):
        def __init__(self, rank, size):
            base.__init__(self, rank, size)
            self._done = Done(None)

        def allreduce(self, tensors, opts=None):
            d = self._done
            d._result = tensors
            return d

        def getBackendName(self):
            return "noop"

        def getGroupName(self):
            return "noop"

        def _get_backend(self, device=None):
            return self

    return Noop


def register_noop():
    """Registers "nooppg" (a Python ProcessGroup: the route of a group that is dspark's alone,
    and of every group before torch 2.14) and, where torch has a Python c10d Backend, "noop"
    (the route of a group shared with another backend). Returns the names registered."""
    names = []
    for name, as_pg in (("nooppg", True), ("noop", False)):
        if not as_pg and not _has_py_backend():
            continue
        Noop = _noop_classes(as_pg)
        dist.Backend.register_backend(
            name, lambda store, rank, size, timeout, N=Noop: N(rank, size), devices=["cpu"]
        )
        names.append(name)
    return names


def backend_of(group):
    try:
        return group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - a Python ProcessGroup is its own backend
        return group


# ---------------------------------------------------------------------------- the bench


# A rank's own place in its launcher's job: `dspark-bench --ranks` refuses to spawn a local job
# from inside one (src/bin/bench/spawn.rs's RANK_VARS), and this script runs under torchrun.
_LAUNCHER_VARS = ("DSPARK_RANK", "DSPARK_WORLD_SIZE", "RANK", "WORLD_SIZE",
                  "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                  "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID")


def run_bench(path, nbytes):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    out = subprocess.run(
        [path, "--ranks", "2", "-b", str(nbytes), "-e", str(nbytes), "--csv"]
        # The transport the torch ranks use (DSPARK_TRANSPORT), which the bench would
        # otherwise choose for itself.
        + (["--transport", os.environ["DSPARK_TRANSPORT"]]
           if os.environ.get("DSPARK_TRANSPORT") else []),
        capture_output=True, text=True, timeout=300, env=env,
    )
    for line in out.stdout.splitlines():
        f = line.split(",")
        if len(f) > 7 and f[0] == "all_reduce":
            return float(f[6]) * 1e-6
    raise RuntimeError(f"dspark-bench gave no row: {out.stdout[-500:]} {out.stderr[-500:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8,4K,1M")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.1, help="seconds per measurement")
    ap.add_argument("--bench", default="target/release/dspark-bench")
    ap.add_argument("--gloo", action="store_true")
    ap.add_argument("--old", default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (robust under load; world of 1)")
    ap.add_argument("--bind", action="store_true",
                    help="bind each rank to core LOCAL_RANK (as dspark-bench binds its ranks)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.bind:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]})
    clock = time.perf_counter if a.clock == "wall" else time.thread_time

    noops = register_noop()
    if a.old:
        importlib.import_module(a.old + ".torch")
    dist.init_process_group("dspark")
    rank, n = dist.get_rank(), dist.get_world_size()
    ctl = dist.new_group(backend="gloo")
    noop = dist.new_group(backend="nooppg")
    noop_be = dist.new_group(backend="noop") if "noop" in noops else None
    # The same dspark backend through c10d's Backend route (the route of a group shared with
    # another backend, e.g. "cpu:dspark,cuda:nccl"), for A/B in this job.
    via_backend = None
    if noop_be is not None:
        os.environ["DSPARK_TORCH_ROUTE"] = "backend"
        via_backend = dist.new_group(backend="dspark")
        del os.environ["DSPARK_TORCH_ROUTE"]
    old = dist.new_group(backend=a.old) if a.old else None
    import dspark

    store = dist.PrefixStore("overhead-package", dist.distributed_c10d._get_default_store())
    package = dspark.Communicator.from_store(store, rank, n, timeout=120)
    be_new = backend_of(dist.group.WORLD)
    be_noop = backend_of(noop)
    be_old = backend_of(old) if old is not None else None

    def timed(fn, iters):
        dist.barrier(group=ctl)
        t0 = clock()
        for _ in range(iters):
            fn()
        return (clock() - t0) / iters

    if rank == 0:
        print(f"# torch {torch.__version__}, {n} ranks, float32 sum, {a.rounds} interleaved "
              f"rounds, medians of {a.clock} time; dspark {type(be_new).__name__}"
              + (f", old = {a.old}" if a.old else ""), flush=True)
    rows = []
    for nbytes in [parse_size(s) for s in a.sizes.split(",")]:
        count = max(1, nbytes // 4)
        t = torch.ones(count)
        opts = dist.AllreduceOptions()
        if hasattr(opts, "asyncOp"):
            opts.asyncOp = False
        p = t.data_ptr()
        cases = {
            "dist": lambda: dist.all_reduce(t),
            "direct": lambda: be_new.allreduce([t], opts).wait(),
            "noop_dist": lambda: dist.all_reduce(t, group=noop),
            "noop_direct": lambda: be_noop.allreduce([t], opts).wait(),
            **({"backend_dist": lambda: dist.all_reduce(t, group=via_backend),
                "noop_be_dist": lambda: dist.all_reduce(t, group=noop_be)}
               if via_backend is not None else {}),
            "package": lambda: package.all_reduce(t),
            "raw": lambda: package._c._run("all_reduce", "f32", p, p, count, "sum", 0, None),
        }
        if old is not None:
            cases["old_dist"] = lambda: dist.all_reduce(t, group=old)
            cases["old_direct"] = lambda: be_old.allreduce([t], opts).wait()
        if a.gloo:
            cases["gloo"] = lambda: dist.all_reduce(t, group=ctl)
        timed(cases["dist"], 20)
        probe = timed(cases["dist"], 200)
        iters = max(3, min(50000, int(a.budget / max(probe, 1e-7))))
        it = torch.tensor([iters], dtype=torch.int64)
        dist.all_reduce(it, op=dist.ReduceOp.MAX, group=ctl)
        iters = int(it.item())
        gloo_iters = iters
        if a.gloo:
            g = timed(cases["gloo"], 3)
            gi = torch.tensor([max(3, min(iters, int(a.budget / max(g, 1e-7))))])
            dist.all_reduce(gi, op=dist.ReduceOp.MAX, group=ctl)
            gloo_iters = int(gi.item())
        res = {k: [] for k in list(cases) + ["bench"]}
        for r in range(a.rounds):
            # Rotate the order each round so no contender always runs first.
            keys = list(cases)
            keys = keys[r % len(keys):] + keys[:r % len(keys)]
            for k in keys:
                res[k].append(timed(cases[k], gloo_iters if k == "gloo" else iters))
            dist.barrier(group=ctl)
            if a.bench and n == 2:
                b = torch.zeros(1, dtype=torch.float64)
                if rank == 0:
                    b[0] = run_bench(a.bench, count * 4)
                dist.broadcast(b, 0, group=ctl)
                res["bench"].append(float(b[0]))
        med = {k: statistics.median(v) * 1e6 for k, v in res.items() if v}
        spread = {k: (min(v) * 1e6, max(v) * 1e6) for k, v in res.items() if v}
        row = {"bytes": count * 4, "iters": iters, "median_us": med, "range_us": spread,
               "rounds_us": {k: [x * 1e6 for x in v] for k, v in res.items() if v}}
        if "bench" in med:
            row["binding_us"] = med["dist"] - med["bench"]
            if "old_dist" in med:
                row["old_binding_us"] = med["old_dist"] - med["bench"]
            # Per round too: the binding's spread.
            row["binding_rounds_us"] = [(d - b) * 1e6 for d, b in zip(res["dist"], res["bench"])]
        rows.append(row)
        if rank == 0:
            print(f"## {fmt_bytes(count * 4)} ({iters} calls per measurement)")
            for k in res:
                if res[k]:
                    lo, hi = spread[k]
                    q1 = statistics.quantiles(res[k], n=4)[0] * 1e6 if len(res[k]) > 1 else lo
                    print(f"  {k:12s} {med[k]:10.2f} us   (rounds: min {lo:.2f}, "
                          f"first quartile {q1:.2f}, max {hi:.2f})")
            if "binding_us" in row:
                print(f"  binding = dist - bench: {row['binding_us']:.2f} us"
                      + (f"; old: {row['old_binding_us']:.2f} us" if "old_binding_us" in row
                         else "") + "  (limit 10 at 8 B)")
            print(f"  torch's share (noop_dist - noop_direct): "
                  f"{med['noop_dist'] - med['noop_direct']:.2f} us"
                  + (f" (through c10d's Backend route: {med['noop_be_dist'] - med['noop_direct']:.2f} us)"
                     if "noop_be_dist" in med else "")
                  + f"; dspark's backend (direct - raw): {med['direct'] - med['raw']:.2f} us",
                  flush=True)
            if "backend_dist" in med and "bench" in med:
                print(f"  binding through c10d's Backend route (backend_dist - bench): "
                      f"{med['backend_dist'] - med['bench']:.2f} us", flush=True)
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "world": n, "rows": rows}, f, indent=1)
    package.close()
    dist.barrier(group=ctl)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
