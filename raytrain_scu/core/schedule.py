"""The learning-rate schedule: linear warmup, then cosine decay. Pure Python: the training loop (``worker.step``) and
the plant model (``core.plant``) both read it here."""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def lr_factors(steps: int, *, warmup_steps: int = 20, min_lr_ratio: float = 0.1) -> list[float]:
    """lr / peak lr for each of ``steps`` optimizer steps: :func:`lr_at` at a peak of 1."""
    return [lr_at(step, lr=1.0, warmup_steps=warmup_steps, max_steps=steps, min_lr_ratio=min_lr_ratio)
            for step in range(steps)]
