"""What every bench part shares: the device, synchronised timing, peak memory, freeing a part's memory and compiled
graphs, the proof that a timed loop trained, and the versions a result was measured with."""
from __future__ import annotations

import gc
from importlib.metadata import PackageNotFoundError, version

import torch

from raytrain_scu.errors import DidNotTrain


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_mem() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mem() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def free() -> None:
    """A part's memory and compiled graphs: left in place, a later part at another batch recompiled the shared layer
    graph and ran slower (docs/benchmarks.md)."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
