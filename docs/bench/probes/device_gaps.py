# One-off diagnostic (not part of the package): the device's idle stretches in steady-state steps of our loop, from a
# CUDA-only profiler trace (no host operators recorded, so the host runs nearly as fast as unprofiled), grouped by the
# kernel that ended each stretch and by where in the step it fell. Run from the repository root on a GPU:
# python docs/bench/probes/device_gaps.py llama-3.1-8b-shape 2 (profiles/h200_2026-11-28_device_gaps_probe_*.txt).
# The bench's idle_<part> parts (train.profile_host=false) measure the same since.
import collections
import json
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from raytrain_scu.studies.bench.ours import bench_config
from raytrain_scu.worker import loop as L

preset, batch, steps = sys.argv[1], int(sys.argv[2]), 20
PROF = range(11, 14)  # profiled steps (0-based): no report inside (reports end steps 5, 10, 15)
orig_ts = L.train_step
prof = profile(activities=[ProfilerActivity.CUDA])
marks = []


def train_step(s, step):
    if step == PROF.start:
        torch.cuda.synchronize()
        prof.start()
    r = orig_ts(s, step)
    if step == PROF.stop - 1:
        torch.cuda.synchronize()
        prof.stop()
    return r


L.train_step = train_step
with tempfile.TemporaryDirectory() as tmp:
    cfg = bench_config(preset=preset, batch=batch, block=2048, steps=steps, report_every=5, storage=tmp,
                       name="gaps", compile=True)
    L.run_loop(cfg, hooks=__import__("raytrain_scu.worker.hooks", fromlist=["LocalHooks"]).LocalHooks())
    path = f"{tmp}/trace.json"
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
dev = sorted((e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
             key=lambda e: e["ts"])
t0, t1 = dev[0]["ts"], max(e["ts"] + e["dur"] for e in dev)
busy_to, idle, gaps = t0, 0.0, []
for i, e in enumerate(dev):
    gap = e["ts"] - busy_to
    if gap >= 5:
        prev = dev[i - 1]["name"] if i else "-"
        gaps.append((gap, prev[:70], e["name"][:70], (e["ts"] - t0)))
        idle += gap
    busy_to = max(busy_to, e["ts"] + e["dur"])
n = len(PROF)
busy = sum(e["dur"] for e in dev)
print(torch.cuda.get_device_name(0), preset, batch, "x 2048:", f"{(t1 - t0) / 1e3 / n:.2f} ms/step span, "
      f"{busy / 1e3 / n:.2f} ms/step kernels, idle (gaps >= 5 us) {idle / 1e3 / n:.2f} ms/step in "
      f"{len(gaps) / n:.0f} gaps")
by = collections.defaultdict(lambda: [0.0, 0])
for gap, prev, nxt, at in gaps:
    by[(prev, nxt)][0] += gap
    by[(prev, nxt)][1] += 1
print("ms/step  gaps/step  after -> before")
for (prev, nxt), (us, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{us / 1e3 / n:7.2f} {c / n:9.1f}  {prev} -> {nxt}")
print("largest gaps (us, at ms into the window, after -> before):")
for gap, prev, nxt, at in sorted(gaps, reverse=True)[:25]:
    print(f"{gap:8.0f} {at / 1e3:9.2f}  {prev} -> {nxt}")
