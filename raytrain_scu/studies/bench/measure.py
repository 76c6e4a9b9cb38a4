"""What every bench part shares: the device, the peers' batches and their timing, peak memory, freeing a part's memory
and compiled graphs, the proof that a timed loop trained, and the versions a result was measured with."""
from __future__ import annotations

import gc
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

import torch

from raytrain_scu.errors import DidNotTrain


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def batch_rows(blocks, i: int, batch: int, block: int):
    """Step ``i``'s rows of ``blocks`` (int64 token ids, ``batch`` x ``block``): the peers' walk through the data."""
    return torch.as_tensor(blocks[(i * batch) % (len(blocks) - batch):][:batch, :block].astype("int64"))


def pinned_batches(blocks, batch: int, block: int, count: int) -> list:
    """The batches of steps 0 .. count-1, built before any timing and, with a GPU here, in pinned host memory: what a
    DataLoader with ``pin_memory=True`` hands a loop, so that ``.to(device, non_blocking=True)`` overlaps the copy."""
    rows = [batch_rows(blocks, i, batch, block) for i in range(count)]
    return [r.pin_memory() for r in rows] if torch.cuda.is_available() else rows


def interval_times(step: Callable[[int], None], *, warmup: int, steps: int, interval: int) -> list[float]:
    """Seconds per step of each timed interval: ``step(i)`` for ``warmup`` untimed steps, then ``steps`` more in
    intervals of ``interval`` steps with the device synchronised only at an interval's ends, which is how our loop's
    report intervals are timed: between the two syncs the host queues work ahead as a loop that never waits on the
    device does. A last, shorter interval is divided by its own step count."""
    for i in range(warmup):
        step(i)
    sync()
    times, i, end = [], warmup, warmup + steps
    while i < end:
        n = min(interval, end - i)
        t0 = time.perf_counter()
        for j in range(i, i + n):
            step(j)
        sync()
        times.append((time.perf_counter() - t0) / n)
        i += n
    return times


def timing_note(interval: int) -> str:
    """How a peer part was timed, for its JSON."""
    return (f"median of intervals of {interval} steps after warm-up, synchronised at their ends; batches from pinned "
            f"memory, copied non-blocking")


def reset_mem() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mem() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def peak_reserved() -> float:
    """The allocator's peak reserved memory since :func:`reset_mem`: the allocated peak plus cached free blocks (which
    the allocator releases and retries before it raises an out-of-memory error)."""
    return torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0


def free() -> None:
    """A part's memory and compiled graphs: left in place, a later part at another batch recompiled the shared layer
    graph and ran slower (docs/log/benchmarks.md)."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kernel_profile(step, top: int = 12) -> dict:
    """One call of ``step`` under the profiler: the device time of its kernels (``device_ms``, memcpys left out) and
    of its memcpys (``copies_ms``: a loop that offloads to host memory copies beside its kernels), the ``top`` entries
    by device time with their launch counts (one kernel name can carry different products), and the attention kernels
    it ran (what says which SDPA path a loop took)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    kernels = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    copies = [e for e in kernels if e.key.startswith("Memcpy")]
    attention = sorted({e.key[:70] for e in kernels if any(w in e.key.lower() for w in
                                                            ("flash", "fmha", "attention", "cudnn", "sdpa"))})
    return {"device_ms": round(sum(e.device_time_total for e in kernels if e not in copies) / 1e3, 2),
            "copies_ms": round(sum(e.device_time_total for e in copies) / 1e3, 2),
            "top": [f"{e.key[:70]} {e.device_time_total / 1e3:.2f}ms x{e.count}" for e in kernels[:top]],
            "attention": "; ".join(attention) or "-"}


def proof_of_training(bpt_before: float, bpt_after: float, b_norm: float) -> dict:
    """The evidence that a timed loop trained: LoRA B left zero and the loss on a fixed set of blocks fell.
    Raises :class:`DidNotTrain` otherwise (the part then shows an error instead of a speed)."""
    if not (b_norm > 0.0 and bpt_after < bpt_before):
        raise DidNotTrain(f"the loop did not train: LoRA B norm {b_norm:.3g}, fixed-batch BPT {bpt_before:.4f} -> "
                          f"{bpt_after:.4f}")
    return {"bpt_before": round(bpt_before, 4), "bpt_after": round(bpt_after, 4), "lora_b_norm": round(b_norm, 4)}


def versions(*extra: str) -> dict:
    """torch, transformers, peft, ray and CUDA, plus the ``extra`` distributions that are installed."""
    out = {"cuda": torch.version.cuda or "-"}
    for dist in ("torch", "transformers", "peft", "ray", *extra):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "-"
    return out
