"""Out of device memory, said in one line: which phase of the loop ran out (the first training step, a later one, an
evaluation, a checkpoint), the micro-batch, what ``hardware.memory``'s estimator makes of it, and what would fit.

The loop records its phase as it enters one (:meth:`Phase.enter`, which is also where fault injection can make a
phase run out); ``run_loop`` turns a ``torch.cuda.OutOfMemoryError`` into :class:`DeviceOutOfMemory` with
:func:`out_of_memory`. Nothing is written after the error, so the last checkpoint stays the newest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from raytrain_scu.hardware.shape import memory_kwargs, model_shape
from raytrain_scu.config.schema import Config
from raytrain_scu.errors import DeviceOutOfMemory
from raytrain_scu.hardware.memory import GIB, USABLE_FRACTION, estimate_peak_memory_gib, largest_batch, no_fit_message

PHASES = {"setup": "setting up (the model, the data, a resume)", "train": "a training step", "eval": "an evaluation",
          "checkpoint": "writing a checkpoint"}


@dataclass
class Phase:
    """Where the loop is: ``name`` (a key of :data:`PHASES`), at optimizer step ``step`` (from 1; 0 before the first),
    with ``first_step`` the first step of this attempt and ``checkpoint_step`` the newest checkpoint's step."""

    name: str = "setup"
    step: int = 0
    first_step: int = 1
    checkpoint_step: int = 0

    def enter(self, name: str, step: int, faults, device) -> None:
        self.name, self.step = name, step
        faults.out_of_memory(name, step, device)


def device_memory_gib(device) -> Optional[float]:
    """The card's memory in GiB; None on a CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / GIB


def _fit_advice(cfg: Config, card_gib: Optional[float], kwargs: dict) -> str:
    """What batch fits by the estimate, with the data.grad_accum that keeps the global batch."""
    b, accum = cfg.data.batch_size, cfg.data.grad_accum
    best = largest_batch(card_gib, b, USABLE_FRACTION, **kwargs) if card_gib else b
    if best == 0:
        return no_fit_message(b, card_gib, USABLE_FRACTION, kwargs).split(". ", 1)[-1]
    if best >= b:  # the estimate says it fits: something else holds memory (another process, fragmentation)
        best = max(1, b // 2)
        why = "The estimate says it fits, so something else holds card memory; try "
    else:
        est = estimate_peak_memory_gib(batch_size=best, **kwargs)["total_gib"]
        why = f"data.batch_size={best} fits by the estimate (~{est:.1f} GiB), e.g. "
    if b == 1:
        return why + "model.gradient_checkpointing=true or quant.load_in_4bit=true, or a shorter data.block_size"
    return why + f"data.batch_size={best} data.grad_accum={math.ceil(b * accum / best)} (the same global batch)"


def out_of_memory(cfg: Config, phase: Phase, device, error: BaseException) -> DeviceOutOfMemory:
    """The one-line error of ``error``, an out-of-memory error raised in ``phase``."""
    d = cfg.data
    card_gib = device_memory_gib(device)
    card = f"a {card_gib:.1f} GiB card" if card_gib else f"the {device.type} device"
    micro = f"micro-batch data.batch_size={d.batch_size} x data.block_size={d.block_size}"
    shape = model_shape(cfg)
    kwargs = {**shape, **memory_kwargs(cfg)} if shape else None
    if kwargs:
        kwargs.pop("batch_size")
        est = estimate_peak_memory_gib(batch_size=d.batch_size, **kwargs)["total_gib"]
        estimate = f"; the estimator puts a step at ~{est:.1f} GiB"
    else:
        estimate = "; no memory estimate for this model"
    kept = (f"the checkpoint of step {phase.checkpoint_step} is kept and a re-run resumes from it"
            if phase.checkpoint_step else "no checkpoint was written yet")
    if phase.name == "train" and phase.step == phase.first_step:
        advice = _fit_advice(cfg, card_gib, kwargs) if kwargs else "lower data.batch_size"
        return DeviceOutOfMemory(f"out of memory on {card} in the first training step (step {phase.step}): {micro}"
                                 f"{estimate}. {advice}")
    where = PHASES.get(phase.name, phase.name)
    if phase.name == "eval" and phase.step == 0:
        where = "the evaluation before the first step"
    elif phase.name != "setup":
        where += f" at step {phase.step}"
    return DeviceOutOfMemory(f"out of memory on {card} in {where} ({micro}{estimate}); {kept}. "
                             f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
