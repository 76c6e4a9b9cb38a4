# One-off diagnostic (not part of the package): where the host spends a steady-state step of our loop, whether the
# device had run dry when the host reached each phase, and which calls synchronise (CUDA sync debug mode). Run from
# the repository root on a GPU: python docs/bench/probes/host_phases.py llama-3.1-8b-shape 2. It ran at commit 97abb27
# (profiles/h200_2026-11-28_host_phases_*.txt, which printed four stack frames; host_sync_stack_1b.txt nine, as here);
# perf/sync_wait_frac has been dropped from the loop since, so that line prints None now.
import collections
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch

from raytrain_scu.studies.bench.ours import bench_config
from raytrain_scu.worker import loop as L
from raytrain_scu.worker import step as S
from raytrain_scu.worker.hooks import LocalHooks

preset, batch, steps = sys.argv[1], int(sys.argv[2]), 20
WINDOW = range(8, 19)  # steady-state steps (0-based), not the first report's
T = collections.defaultdict(list)
DRY = collections.defaultdict(list)
SYNCS = collections.Counter()
state = {"step": -1}


def dry(label):
    if state["step"] in WINDOW and torch.cuda.is_available():
        DRY[label].append(torch.cuda.current_stream().query())


def wrap(mod, name, label=None):
    f = getattr(mod, name)

    def w(*a, **k):
        dry(f"enter {label or name}")
        t0 = time.perf_counter()
        r = f(*a, **k)
        if state["step"] in WINDOW:
            T[label or name].append(time.perf_counter() - t0)
        return r
    setattr(mod, name, w)


orig_backward = torch.autograd.backward


def backward(*a, **k):
    dry("enter backward")
    t0 = time.perf_counter()
    r = orig_backward(*a, **k)
    if state["step"] in WINDOW:
        T["backward"].append(time.perf_counter() - t0)
    return r


torch.autograd.backward = backward
for n in ("micro_steps", "global_sums", "send_ahead", "_read"):
    wrap(S, n)
orig_ts, orig_as = L.train_step, L.after_step


def train_step(s, step):
    state["step"] = step
    if step in (12, 13) and torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    dry("enter train_step")
    t0 = time.perf_counter()
    r = orig_ts(s, step)
    if step in WINDOW:
        T["train_step"].append(time.perf_counter() - t0)
    return r


def after_step(s, step, row):
    dry("enter after_step")
    t0 = time.perf_counter()
    r = orig_as(s, step, row)
    if step in WINDOW and (step + 1) % 5:
        T["after_step (no report)"].append(time.perf_counter() - t0)
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("default")
    return r


L.train_step, L.after_step = train_step, after_step


def show(message, category, filename, lineno, file=None, line=None):
    frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
    ours = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in frames
            if "raytrain_scu" in f.filename or "transformers" in f.filename or "torch/" in f.filename][-9:]
    if "synchroniz" not in str(message).lower():
        return
    SYNCS[(str(message)[:60], "\n      < ".join(reversed(ours)))] += 1


warnings.showwarning = show
warnings.simplefilter("always")
with tempfile.TemporaryDirectory() as tmp:
    cfg = bench_config(preset=preset, batch=batch, block=2048, steps=steps, report_every=5, storage=tmp, name="probe",
                       compile=True)
    hooks = LocalHooks()
    L.run_loop(cfg, hooks=hooks)
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", preset, batch, "x 2048")
print("rates", [round(r["perf/tokens_per_s"]) for r in hooks.reports if "perf/tokens_per_s" in r])
print("sync_wait_frac", [r.get("perf/sync_wait_frac") for r in hooks.reports])
print("host ms per call, median over steps 9-19 (n):")
for k, v in T.items():
    print(f"  {k:28s} {1e3 * statistics.median(v):8.2f}  (n={len(v)})")
print("device ran dry (stream idle) when the host reached:")
for k, v in DRY.items():
    print(f"  {k:28s} {sum(v)}/{len(v)}")
print("synchronising calls in steps 13-14 (count, message, where):")
for (m, where), n in SYNCS.most_common(30):
    print(f"  {n:4d}  {m} | {where}")
