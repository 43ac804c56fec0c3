"""Summary of benches/ddp_bed.sh's runs: every pass and the median per backend.

    python3 benches/ddp_bed_summary.py OUT_DIR [RATE]

OUT_DIR holds the runs' pass<k>-<backend>.json (examples/torch_ddp.py --json).
"""
import glob, json, os, statistics, sys
out = sys.argv[1]
rate = sys.argv[2] if len(sys.argv) > 2 else "?"
runs = {}
for f in sorted(glob.glob(os.path.join(out, "pass*.json"))):
    r = json.load(open(f))
    runs.setdefault(r["backend"], []).append((os.path.basename(f)[:-5], r))
if not runs:
    sys.exit("ddp_bed: no run finished")
r0 = next(iter(runs.values()))[0][1]
print(f"\nDDP on the link bed: {r0['ranks']} hosts x 1 rank at {rate}, MLP {r0['layers']}x"
      f"{r0['hidden']} ({r0['params'] / 1e6:.2f} M parameters, {r0['grad_bytes'] / 2**20:.1f} MiB "
      f"of f32 gradients), batch {r0['batch']}/rank, {r0['steps']} steps, bucket "
      f"{r0['bucket_cap_mb']:g} MiB, {r0['threads']} torch thread/rank")
cols = ["step_ms", "compute_ms", "exposed_ms", "samples_s", "solo_step_ms", "allreduce_ms",
        "efficiency"]
print("| run | backend | step ms | compute ms | exposed comm ms | samples/s | 1-rank step ms "
      "| allreduce alone ms (x 1-rank step) | scaling efficiency |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
def row(name, b, v):
    ar = v["allreduce_ms"]
    ars = f"{ar:.1f} ({ar / v['solo_step_ms']:.2f}x)" if ar is not None else "-"
    print(f"| {name} | {b} | {v['step_ms']:.2f} | {v['compute_ms']:.2f} | {v['exposed_ms']:.2f} "
          f"| {v['samples_s']:.0f} | {v['solo_step_ms']:.2f} | {ars} | {v['efficiency']:.1%} |")
for b, rs in runs.items():
    for name, r in rs:
        row(name, b, r)
for b, rs in runs.items():
    med = {c: statistics.median([r[c] for _, r in rs if r[c] is not None] or [float("nan")])
           for c in cols}
    row(f"median of {len(rs)}", b, med)
