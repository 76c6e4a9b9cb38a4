"""``train.profile_steps``: torch.profiler over a run's last steps, and what its record says: the operators and kernels
by time, and on a GPU where the device sat idle and what the host was doing then. No ray or mlflow.

The idle account reads the profiler's own Chrome trace (``rank<k>.trace.json.gz`` beside the table). The device is
busy while any kernel, copy or memset runs; every stretch with none, inside the profiled steps, is idle. Each idle
stretch is charged to what ended it: the host operator that launched the next device work (the innermost operator
around its launch call) and the longest operator around that one (the phase: the optimizer step, a compiled layer's
backward, ...). A stretch that ends right after a host wait (a synchronize, a device-to-host copy) is charged to
that wait: the device ran dry while the host waited for it, then waited for the host.

The copy account, from the same trace, charges the device time of every copy (a copy kernel, or a memcpy) to the
host operators around its launch, innermost last: which cast, ``contiguous`` or ``cat`` in which phase wrote it.

Recording the host's operators slows the host, and the device then waits on it where an unprofiled step would not
(docs/log/benchmarks.md measures how much). With ``train.profile_host=false`` only the device is recorded
(:func:`device_account`): its idle stretches are close to an unprofiled step's, each named by the kernels on either
side of it.
"""
from __future__ import annotations

import bisect
import contextlib
import gzip
import json
from collections import defaultdict
from pathlib import Path

from raytrain_scu.core.dist import notice0, print0, rank

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # device work in a Chrome trace; annotations are not
MIN_GAP_US = 20.0  # shorter idle stretches are launch latency between back-to-back kernels, not a cause


@contextlib.contextmanager
def profiled(*, steps: int, left: int, cuda: bool, out_dir: Path, host: bool = True):
    """All ranks. With ``steps`` = N > 0, torch.profiler records the last N of the ``left`` steps still to run (each
    from the end of the step before, so the reports and evals between them count) and every rank writes its table of
    operators and kernels by self time on the device (the CPU on a CPU run) to ``out_dir/rank<k>.txt``, on a GPU
    followed by :func:`idle_account` (and the trace beside it). On a GPU without ``host``: the device alone, its
    kernels by time after :func:`device_account`. Yields what the loop calls after each step (a no-op when off). Fewer
    than 2 steps left, or a run that stops before the window ends (Ctrl-C, stop_on_saturation): a notice says so and
    no table is written."""
    if steps == 0 or left < 2:
        if steps:
            notice0(f"train.profile_steps: {left} step(s) left to run, none profiled (one warms the profiler up)")
        yield lambda: None
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    if not host and not cuda:
        notice0("train.profile_host=false: this worker has no GPU, so its host operators are profiled instead")
    device_only = cuda and not host
    active = min(steps, left - 1)  # one step before the window warms the profiler up
    when = schedule(wait=left - active - 1, warmup=1, active=active, repeat=1)
    cpu, gpu = ProfilerActivity.CPU, ProfilerActivity.CUDA
    activities = [gpu] if device_only else [cpu, gpu] if cuda else [cpu]
    with profile(activities=activities, schedule=when) as prof:
        yield prof.step
    if prof.step_num < left:  # after the last report: the worker's log, not the console
        print0(f"[raytrain_scu] train.profile_steps: the run stopped after {prof.step_num} of {left} steps, before "
               f"the profiled window ended; no profile written")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    if device_only:
        text = (device_account(_trace(prof, out_dir), steps=active) + "\n"
                + prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
    elif cuda:
        trace = _trace(prof, out_dir)
        text = (profile_table(prof.key_averages(), steps=active, device="cuda") + "\n"
                + idle_account(trace, steps=active) + "\n" + copy_account(trace, steps=active))
    else:
        text = profile_table(prof.key_averages(), steps=active, device="cpu")
    (out_dir / f"rank{rank()}.txt").write_text(text)
    print0(f"[raytrain_scu] profile of the last {active} step(s): {out_dir}/rank<k>.txt")


def _trace(prof, out_dir: Path) -> dict:
    """The profiler's Chrome trace, written beside the table (``rank<k>.trace.json.gz``) and read back."""
    trace_file = out_dir / f"rank{rank()}.trace.json.gz"
    prof.export_chrome_trace(str(trace_file))
    with gzip.open(trace_file, "rt") as f:
        return json.load(f)


def device_account(trace: dict, *, steps: int, top: int = 15) -> str:
    """A trace of the device alone: per profiled step (the window's totals over ``steps``), the span from the first
    kernel to the last, the time of the kernels, copies and memsets (work on overlapping streams counts twice), and
    the idle stretches grouped by the kernel that ended before each and the one that started it, the largest first."""
    device = sorted((e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS
                     and "ts" in e and "dur" in e), key=lambda e: e["ts"])
    if not device:
        return "device: no kernels in the trace\n"
    t0 = device[0]["ts"]
    stretches, busy_to = _idle_stretches(device, t0)
    n = max(1, steps)
    lines = [f"steps profiled: {steps}, the device alone; per step: span {(busy_to - t0) / 1e3 / n:.2f} ms, kernels, "
             f"copies and memsets {sum(e['dur'] for e in device) / 1e3 / n:.2f} ms, idle "
             f"{sum(gap for _, gap, _, _ in stretches) / 1e3 / n:.2f} ms (stretches >= {MIN_GAP_US:g} us); the idle "
             f"stretches by the kernels around them, per step:",
             f"{'ms/step':>8}  {'count/step':>10}  ended before | started after"]
    by_kernels = [((before["name"][:60], after["name"][:60]), gap) for _, gap, before, after in stretches]
    return "\n".join(lines + _grouped(by_kernels, steps=n, top=top)) + "\n"


def _idle_stretches(device: list, start: float) -> tuple[list, float]:
    """The idle stretches of at least ``MIN_GAP_US`` among ``device`` (device work sorted by start), counted from
    ``start``: each as (its start, its length, the work that ended last before it, the work that ended it); and when
    the last work ends."""
    stretches, busy_to, last = [], start, None
    for e in device:
        if e["ts"] - busy_to >= MIN_GAP_US:
            stretches.append((busy_to, e["ts"] - busy_to, last, e))
        if e["ts"] + e["dur"] >= busy_to:
            busy_to, last = e["ts"] + e["dur"], e
    return stretches, busy_to


def _grouped(keyed: list, *, steps: int, top: int) -> list[str]:
    """Table rows of ``keyed`` ((a, b), microseconds) summed by key, per step: ms, count, ``a | b``, the largest
    first."""
    sums = defaultdict(lambda: [0.0, 0])
    for key, us in keyed:
        sums[key][0] += us
        sums[key][1] += 1
    return [f"{us / 1e3 / steps:8.2f}  {c / steps:10.1f}  {a} | {b}"
            for (a, b), (us, c) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:top]]


def profile_table(events, *, steps: int, device: str) -> str:
    """A profiler's averages as text: the wall time per step and the busy time on ``device`` (on a GPU the sum of its
    kernels' time, so overlapping streams count twice; the operators that launched them and the annotated regions
    around them, DDP's or NCCL's, are not added again), then the top 40 operators and kernels by self time."""
    from torch.autograd import DeviceType

    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    walls = [e.cpu_time_total for e in events if e.key.startswith("ProfilerStep")]
    # is_user_annotation: not on every torch this package accepts (>= 2.4); without it, no annotation is left out
    busy = sum(getattr(e, key) for e in events if not e.key.startswith("ProfilerStep")
               and not getattr(e, "is_user_annotation", False)
               and (device != "cuda" or e.device_type == DeviceType.CUDA))
    head = (f"steps profiled: {steps}; wall per step: {sum(walls) / 1e3 / max(1, steps):.2f} ms; {device} busy per "
            f"step (self time): {busy / 1e3 / max(1, steps):.2f} ms\n")
    return head + events.table(sort_by=key, row_limit=40, max_name_column_width=70)


def idle_account(trace: dict, *, steps: int, top: int = 15) -> str:
    """Where the device sat idle in a Chrome trace (torch.profiler's ``export_chrome_trace``), per profiled step, and
    what ended each idle stretch (see the module's docstring), the largest first."""
    ev, t0, t1 = _steps(trace)
    if not ev:
        return "device idle: no ProfilerStep in the trace\n"
    device = sorted((e for e in ev if e.get("cat") in DEVICE_CATS and t0 <= e["ts"] < t1), key=lambda e: e["ts"])
    launches, host = _launches_and_host(ev)
    waits = sorted((e["ts"] + e["dur"], e["name"]) for e in launches.values()
                   if "Synchronize" in e["name"] or "MemcpyDtoH" in e["name"]
                   or ("Memcpy" in e["name"] and "Async" not in e["name"]))
    stretches, busy_to = _idle_stretches(device, t0)
    idle = sum(gap for _, gap, _, _ in stretches) + max(0.0, t1 - busy_to)
    wall = (t1 - t0) / 1e3 / steps
    lines = [f"device idle per step: {idle / 1e3 / steps:.2f} ms of {wall:.2f} ms wall (stretches >= {MIN_GAP_US:g} "
             f"us); what ended them, per step:", f"{'ms/step':>8}  {'count/step':>10}  phase | launching operator"]
    by_cause = [(_cause(after, launches, host, waits, start), gap) for start, gap, _, after in stretches]
    return "\n".join(lines + _grouped(by_cause, steps=steps, top=top)) + "\n"


COPY_OPS = {"", "to", "copy", "t", "view", "unsafe", "transpose", "permute", "clone", "expand", "contiguous"}


def _is_copy(e: dict) -> bool:
    """A memcpy, an ATen copy kernel (a cast, ``contiguous``, ``cat``), or a Triton kernel that inductor fused from
    copies and views only (``triton_poi_fused__to_copy_t_1``); not one named after a cast it fused into real work."""
    name = e.get("name", "")
    if e.get("cat") == "gpu_memcpy":
        return True
    if e.get("cat") != "kernel" or "copy" not in name.lower():
        return False
    if not name.startswith("triton_"):
        return True
    ops = name.split("fused_", 1)[-1].split("_")
    return all(op in COPY_OPS or op.isdigit() for op in ops)


def copy_account(trace: dict, *, steps: int, top: int = 15, depth: int = 4) -> str:
    """The device time of copies per profiled step (see the module's docstring), by the ``depth`` innermost host
    operators around each copy's launch, the largest first."""
    ev, t0, t1 = _steps(trace)
    if not ev:
        return "device copies: no ProfilerStep in the trace\n"
    copies = [e for e in ev if _is_copy(e) and t0 <= e["ts"] < t1]
    launches, host = _launches_and_host(ev)
    by_chain, total = defaultdict(lambda: [0.0, 0]), 0.0
    for e in copies:
        around = _around(e, launches, host)
        chain = " > ".join(o["name"] for o in sorted(around, key=lambda o: o["dur"])[:depth][::-1]) or "-"
        by_chain[chain][0] += e["dur"]
        by_chain[chain][1] += 1
        total += e["dur"]
    head = (f"device copies per step: {total / 1e3 / steps:.2f} ms in {len(copies) / steps:.1f} copies; by the host "
            f"operators around their launch (outermost first), per step:")
    lines = [head, f"{'ms/step':>8}  {'count/step':>10}  operators"]
    for chain, (us, n) in sorted(by_chain.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{us / 1e3 / steps:8.2f}  {n / steps:10.1f}  {chain}")
    return "\n".join(lines) + "\n"


def _steps(trace: dict) -> tuple[list, float, float]:
    """A Chrome trace's complete events and the span of its profiled steps (first start, last end); no events when it
    has no ProfilerStep."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e and "dur" in e]
    marks = [e for e in ev if e.get("name", "").startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation"]
    if not marks:
        return [], 0.0, 0.0
    return ev, min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)


def _launches_and_host(ev: list) -> tuple[dict, dict]:
    """Launch calls by correlation id, and each host thread's operators by start time."""
    launches = {e["args"]["correlation"]: e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    host = defaultdict(list)
    for e in ev:
        if e.get("cat") in ("cpu_op", "user_annotation") and not e["name"].startswith("ProfilerStep#"):
            host[(e["pid"], e["tid"])].append(e)
    for ops in host.values():
        ops.sort(key=lambda e: e["ts"])
    return launches, host


def _around(kernel: dict, launches: dict, host: dict) -> list:
    """The host operators open at the launch call of ``kernel``: every one among the last few thousand to start, and
    the long ones among all; empty when its launch is not in the trace."""
    launch = launches.get(kernel.get("args", {}).get("correlation"))
    if launch is None:
        return []
    ops = host.get((launch["pid"], launch["tid"]), [])
    t = launch["ts"]
    j = bisect.bisect_right(ops, t, key=lambda o: o["ts"])
    around = [o for o in ops[max(0, j - 4000):j] if o["ts"] + o["dur"] >= t]
    return around + [o for o in ops[:max(0, j - 4000)] if o["dur"] >= 1000.0 and o["ts"] + o["dur"] >= t]


def _cause(kernel: dict, launches: dict, host: dict, waits: list, gap_start: float) -> tuple[str, str]:
    """(phase, operator) that ended the idle stretch before ``kernel``: a host wait that ended inside the stretch,
    else the operators around the launch call of ``kernel``."""
    i = bisect.bisect_left(waits, (gap_start, ""))
    if i < len(waits) and waits[i][0] <= kernel["ts"]:
        return "host waited for the device", waits[i][1]
    launch = launches.get(kernel.get("args", {}).get("correlation"))
    if launch is None:
        return "-", "launch not in the trace"
    around = _around(kernel, launches, host)  # the innermost is the launching operator, the longest the phase
    if not around:
        return "-", launch["name"]
    inner = min(around, key=lambda o: o["dur"])["name"]
    outer = max(around, key=lambda o: o["dur"])["name"]
    return outer, inner
