#!/usr/bin/env python3
"""PyTorch's own distributed suite (`torch.testing._internal.distributed.distributed_test`'s
`DistributedTest._DistTestBase`) against a third-party backend, through a small runner, as
facebookresearch/torch_ucc's test/torch_tests.py does.

    python tests/torch/distributed_suite.py --ci            # the curated list (CI)
    python tests/torch/distributed_suite.py --all           # every test of the suite
    python tests/torch/distributed_suite.py -k broadcast    # the tests whose name has "broadcast"
    python tests/torch/distributed_suite.py --list          # print the curated list

The backend is DSPARK_TEST_BACKEND (default dspark; BACKEND, as the suite names it, wins when
set). It is activated by its entry point alone: nothing here imports dspark. Each test starts
WORLD_SIZE (default 2) fresh rank processes, forked by default (--spawn: spawned, as torch's
test_distributed_spawn does; ~10 s a test instead of ~0.3 s on 2 cores), which join through a
file:// store (`TestDistBackend.init_method`); INIT_METHOD (default env://) only matters to the
few tests that re-initialise the default group themselves. A hung test fails after
DISTRIBUTED_TESTS_DEFAULT_TIMEOUT (set here to 120 s).

DSPARK_TEST_BACKEND=glooplugin checks the runner itself: gloo registered under a third-party
name, so the suite gates (skips) exactly as for dspark while gloo does the work.

Gated as gloo, every group dspark's (issue 24):

    python tests/torch/distributed_suite.py --vs-gloo [-k PATTERN] [--route pg|backend]

runs the suite twice in one job, both with BACKEND=gloo, so the suite's own gating is gloo's
(every CPU test gloo runs): once with real gloo, once with every group it creates made by
dspark (DSPARK_SUITE_GROUPS=dspark, see below). It prints both summaries, then
`GLOO_ONLY <test> <dspark's failure>` for each test gloo passed and dspark did not, and exits
1 if there is one other than test_get_backend (which asserts the group's backend is named
"gloo"). --route forces dspark's route into torch (DSPARK_TORCH_ROUTE; by default a group
that is dspark's on every device takes the ProcessGroup route). The last line:

    DIST_SUITE_VS_GLOO world=2 route=auto gloo=ran/passed/failed/skipped dspark=ran/passed/failed/skipped gloo_only=N allowed=M time=T.Ts RESULT=PASS

The last line of standard output is the parseable summary:

    DIST_SUITE mode=ci backend=dspark world=2 ran=R passed=P failed=F skipped=S start=fork time=T.Ts RESULT=PASS

preceded by `FAILED <test> <exception line>` for each failure (errors included), `PASSED <test>
<seconds>` for each pass and, with --verbose-skips, `SKIPPED <test> <reason>`. Exit status: 0
when nothing failed, 1 otherwise.
"""

import os
import sys
import tempfile

BACKEND = os.environ.get("BACKEND") or os.environ.get("DSPARK_TEST_BACKEND", "dspark")
os.environ["BACKEND"] = BACKEND
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("INIT_METHOD", "env://")
# A hung test fails after this many seconds instead of the suite's default 300.
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
if "TEMP_DIR" not in os.environ:
    # (spawned ranks re-import this module with TEMP_DIR already set by their parent)
    _tmp = tempfile.mkdtemp(prefix="dspark-dist-suite-")
    os.mkdir(os.path.join(_tmp, "barrier"))
    os.mkdir(os.path.join(_tmp, "test_dir"))
    os.environ["TEMP_DIR"] = _tmp

    import atexit
    import shutil

    _owner = os.getpid()
    atexit.register(lambda: os.getpid() == _owner and shutil.rmtree(_tmp, ignore_errors=True))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if not dist.is_available():
    print("DIST_SUITE torch.distributed is not available", file=sys.stderr)
    sys.exit(2)

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

BUILTIN = {"gloo", "nccl", "mpi", "ucc", "xccl"}
if BACKEND == "glooplugin":
    # Self-test of this runner: gloo registered under a third-party name, so the suite gates
    # tests exactly as it does for dspark (the plugin set) while the collectives are gloo's.
    def _glooplugin(store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("glooplugin", _glooplugin, devices=["cpu"])
# DSPARK_SUITE_GROUPS=dspark (with BACKEND=gloo): the suite gates (skips) every test as for
# gloo — its decorators read BACKEND when it is imported — while every group it creates is
# dspark's. The swap is at torch's _new_process_group_helper, the one function that makes every
# group (init_process_group, new_group, new_subgroups, the suite's own re-initialisations):
# a backend string naming gloo there names dspark instead, so each group is exactly what
# backend="dspark" gives a user (dist.get_backend() answers "dspark", which only
# test_get_backend checks, and torch's checks of gloo's own profiler events do not apply).
GROUPS = os.environ.get("DSPARK_SUITE_GROUPS", "")
if GROUPS == "dspark":
    if BACKEND != "gloo":
        print("DIST_SUITE DSPARK_SUITE_GROUPS=dspark needs BACKEND=gloo", file=sys.stderr)
        sys.exit(2)
    import re
    from torch.distributed import distributed_c10d as _c10d

    dist.Backend._ensure_backend_registered("dspark")
    if "DSPARK" not in dist.Backend._plugins:
        print("DIST_SUITE dspark is not registered with torch (is the package installed?)",
              file=sys.stderr)
        sys.exit(2)
    _torch_helper = _c10d._new_process_group_helper

    def _as_dspark(backend):
        s = str(backend)
        new = re.sub(r"(?i)\bgloo\b", "dspark", s) if "gloo" in s.lower() else backend
        if "dspark" not in str(new).lower():
            # Say so rather than let another backend pass for dspark.
            raise AssertionError(f"a group of backend {backend!r} would not be dspark's")
        return new

    def _dspark_groups_helper(*args, **kwargs):
        if len(args) > 3:  # (group_size, group_rank, global_ranks_in_group, backend, ...)
            args = (*args[:3], _as_dspark(args[3]), *args[4:])
        elif "backend" in kwargs:
            kwargs["backend"] = _as_dspark(kwargs["backend"])
        return _torch_helper(*args, **kwargs)

    _c10d._new_process_group_helper = _dspark_groups_helper
elif GROUPS:
    print(f"DIST_SUITE DSPARK_SUITE_GROUPS={GROUPS!r}: only 'dspark' is known", file=sys.stderr)
    sys.exit(2)
if BACKEND not in BUILTIN:
    # What the backend provides on CPU: registered as a plugin, DDP, subgroups (new_group).
    DistTestCases.backend_feature["plugin"].add(BACKEND)
    DistTestCases.backend_feature["ddp"].add(BACKEND)
    DistTestCases.backend_feature["subgroup"].add(BACKEND)

# Only after DistTestCases is adjusted: the suite reads it at import.
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


# How each test starts its ranks: "fork" (default: ~0.3 s a test) or "spawn" (as torch's own
# test_distributed_spawn and torch_ucc do: every rank re-imports the suite, ~10 s a test on
# 2 cores). The backend is only ever initialised in the ranks, so forking is safe.
START = os.environ.get("DSPARK_SUITE_START", "fork")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if START == "fork":
            # as PyTorch's own test_distributed_fork did: ranks start in ~0.1 s instead of
            # re-importing the suite (~5 s on 2 cores)
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()


# The collective / point-to-point / group / DDP tests a CPU backend should pass: every test of
# the suite that runs (is not skipped) for a third-party backend on CPU with 2 ranks and passes
# with gloo registered under a plugin name (DSPARK_TEST_BACKEND=glooplugin), except
# test_ddp_logging_data_cpu, which expects DDP's log to name the backend while torch names
# every registered backend "custom". About 20 s with forked ranks on 2 cores (measured: 62 tests
# in 38 s including the skipped ones with --all).
CI_TESTS = [
    "test_Backend_enum_class",
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_all_gather",
    "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_full_group",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty",
    "test_all_gather_complex",
    "test_all_gather_full_group",
    "test_all_reduce_coalesced_max_complex_unsupported",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_full_group_max",
    "test_all_reduce_full_group_min",
    "test_all_reduce_full_group_product",
    "test_all_reduce_full_group_sum",
    "test_all_reduce_max",
    "test_all_reduce_min",
    "test_all_reduce_product",
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_barrier",
    "test_barrier_full_group",
    "test_broadcast",
    "test_broadcast_full_group",
    "test_ddp_create_graph",
    "test_destroy_full_group",
    "test_destroy_group",
    "test_dump_DDP_relevant_env_vars",
    "test_gather",
    "test_gather_checks",
    "test_gather_full_group",
    "test_get_backend",
    "test_get_rank",
    "test_get_rank_size_full_group",
    "test_get_rank_size_group",
    # Not here: test_isend, test_irecv, test_isend_autograd_profiler and
    # test_isend_torch_profiler assert `work.is_completed()` on the Work dist.isend returns.
    # For a Python backend torch wraps the backend's Work in a holder that forwards only
    # wait() and get_future(), so is_completed() stays False whatever the backend returns
    # (a torch limitation, not a dspark one; the futures do complete, ops_check.py checks).
    "test_reduce_full_group_max",
    "test_reduce_full_group_min",
    "test_reduce_full_group_product",
    "test_reduce_full_group_sum",
    "test_reduce_max",
    "test_reduce_min",
    "test_reduce_product",
    "test_reduce_sum",
    "test_reduce_sum_twice",
    "test_scatter",
    "test_scatter_checks",
    "test_scatter_complex",
    "test_scatter_full_group",
    "test_send_recv",
    "test_send_recv_any_source",
    "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler",
    "test_send_recv_autograd_profiler",
    "test_send_recv_torch_profiler",
    "test_send_recv_with_tag",
    "test_send_recv_with_tag_autograd_profiler",
    "test_send_recv_with_tag_torch_profiler",
    "test_static_graph_api_cpu",
]


def error_line(err):
    """The exception line of a unittest traceback (the last `SomethingError: ...` line)."""
    import re

    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Failure|Timeout)\w*(:|$)", ln):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def suite_names():
    return sorted(n for n in dir(TestDistBackendWithSpawn) if n.startswith("test_"))


# Tests gloo passes that dspark may fail: torch asks the group for its backend's name.
ALLOWED_GLOO_ONLY = {"test_get_backend"}


def vs_gloo(pattern, route, spawn):
    """Runs the gloo-gated suite with real gloo, then with every group dspark's, each in a
    child process of this script, and compares them (see the module docs)."""
    import re
    import subprocess
    import time

    sel = ["-k", pattern] if pattern else ["--all"]
    if spawn:
        sel.append("--spawn")
    world = os.environ["WORLD_SIZE"]
    t0 = time.monotonic()
    legs = {}
    for leg in ("gloo", "dspark"):
        env = dict(os.environ, BACKEND="gloo", DSPARK_TEST_BACKEND="gloo")
        env.pop("TEMP_DIR", None)
        env.pop("DSPARK_SUITE_GROUPS", None)
        env.pop("DSPARK_TORCH_ROUTE", None)
        if leg == "dspark":
            env["DSPARK_SUITE_GROUPS"] = "dspark"
            if route:
                env["DSPARK_TORCH_ROUTE"] = route
        p = subprocess.run([sys.executable, os.path.abspath(__file__), *sel], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = p.stdout
        summary = [ln for ln in out.splitlines() if ln.startswith("DIST_SUITE mode=")]
        passed = set(re.findall(r"^PASSED (\S+)", out, re.M))
        failed = dict(re.findall(r"^FAILED (\S+) ?(.*)$", out, re.M))
        counts = {k: int(v) for k, v in re.findall(r" (ran|passed|failed|skipped)=(\d+)",
                                                   summary[-1] if summary else "")}
        legs[leg] = (passed, failed, counts, summary)
        print(f"=== leg {leg}: exit {p.returncode}", flush=True)
        for ln in out.splitlines():
            if ln.startswith(("FAILED ", "DIST_SUITE ")):
                print(f"  {ln}", flush=True)
        if not summary:
            print(out[-4000:], flush=True)
    g_pass, g_fail, g_counts, g_sum = legs["gloo"]
    d_pass, d_fail, d_counts, d_sum = legs["dspark"]
    gloo_only = sorted(g_pass - d_pass)
    for name in gloo_only:
        why = d_fail.get(name, "(not passed: skipped or not run)")
        tag = " (allowed)" if name in ALLOWED_GLOO_ONLY else ""
        print(f"GLOO_ONLY {name}{tag} {why}", flush=True)
    for name in sorted(d_pass - g_pass):
        print(f"DSPARK_ONLY {name}", flush=True)
    bad = [n for n in gloo_only if n not in ALLOWED_GLOO_ONLY]
    broken = not g_sum or not d_sum or not g_pass
    result = "PASS" if not bad and not broken else "FAIL"

    def c(k):
        return "/".join(str(k.get(x, "?")) for x in ("ran", "passed", "failed", "skipped"))

    print(
        f"DIST_SUITE_VS_GLOO world={world} route={route or 'auto'} gloo={c(g_counts)} "
        f"dspark={c(d_counts)} gloo_only={len(gloo_only)} allowed={len(gloo_only) - len(bad)} "
        f"time={time.monotonic() - t0:.1f}s RESULT={result}",
        flush=True,
    )
    return 0 if result == "PASS" else 1


def main():
    import argparse
    import time
    import unittest

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--ci", action="store_true", help="the curated list")
    mode.add_argument("--all", action="store_true", help="every test of the suite")
    mode.add_argument("-k", dest="pattern", help="the tests whose name contains PATTERN")
    mode.add_argument("--list", action="store_true", help="print the curated list and exit")
    ap.add_argument("--vs-gloo", action="store_true",
                    help="gated as gloo: real gloo, then every group dspark's; compare "
                         "(every test, or those of -k)")
    ap.add_argument("--route", choices=["pg", "backend"],
                    help="with --vs-gloo: force dspark's route into torch (DSPARK_TORCH_ROUTE)")
    ap.add_argument("--spawn", action="store_true",
                    help="spawn the ranks (as torch's test_distributed_spawn) instead of forking them")
    ap.add_argument("--verbose-skips", action="store_true", help="print the reason of every skip")
    args = ap.parse_args()
    if args.vs_gloo:
        if args.ci or args.list:
            ap.error("--vs-gloo runs every test gloo runs (or those of -k), not --ci or --list")
        return vs_gloo(args.pattern, args.route, args.spawn)
    if not (args.ci or args.all or args.list or args.pattern):
        ap.error("one of --ci, --all, -k, --list or --vs-gloo is required")

    global START
    if args.spawn:
        START = os.environ["DSPARK_SUITE_START"] = "spawn"
    all_names = suite_names()
    if args.list:
        print("\n".join(CI_TESTS))
        return 0
    if args.ci:
        missing = [n for n in CI_TESTS if n not in all_names]
        if missing:
            print(f"DIST_SUITE the curated list names tests this torch lacks: {missing}", flush=True)
            return 2
        names, mode_name = CI_TESTS, "ci"
    elif args.all:
        names, mode_name = all_names, "all"
    else:
        names, mode_name = [n for n in all_names if args.pattern in n], f"k:{args.pattern}"

    class Result(unittest.TextTestResult):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.passed = []
            self.times = {}

        def startTest(self, test):
            self._t0 = time.monotonic()
            super().startTest(test)

        def stopTest(self, test):
            self.times[test._testMethodName] = time.monotonic() - self._t0
            super().stopTest(test)

        def addSuccess(self, test):
            super().addSuccess(test)
            self.passed.append(test._testMethodName)

    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    t0 = time.monotonic()
    print(f"DIST_SUITE running {len(names)} tests: backend={BACKEND} world={os.environ['WORLD_SIZE']} "
          f"torch={torch.__version__} start={START}", flush=True)
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=2, resultclass=Result)
    res = runner.run(suite)
    elapsed = time.monotonic() - t0

    failed = [(getattr(t, "_testMethodName", str(t)), e) for t, e in res.failures + res.errors]
    for name, err in failed:
        print(f"FAILED {name} {error_line(err)}", flush=True)
    for name in res.passed:
        print(f"PASSED {name} {res.times.get(name, 0):.1f}s")
    if args.verbose_skips:
        for t, why in res.skipped:
            print(f"SKIPPED {t._testMethodName} {why}")
    slow = sorted(res.times.items(), key=lambda kv: -kv[1])[:5]
    print("DIST_SUITE slowest: " + ", ".join(f"{n} {s:.1f}s" for n, s in slow), flush=True)
    result = "PASS" if not failed else "FAIL"
    print(
        f"DIST_SUITE mode={mode_name} backend={BACKEND}{'+groups=dspark' if GROUPS else ''} "
        f"world={os.environ['WORLD_SIZE']} ran={res.testsRun} passed={len(res.passed)} failed={len(failed)} "
        f"skipped={len(res.skipped)} start={START} time={elapsed:.1f}s RESULT={result}",
        flush=True,
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
