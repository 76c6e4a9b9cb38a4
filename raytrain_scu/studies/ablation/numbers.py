"""What both versions of the ablation's report share: the 95% t-interval, the stratified paired bootstrap of a gap in
bits per token, how a number, an interval and a list of steps print, and the document's generated part."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np

from raytrain_scu.core.bootstrap import LN2

# Student's t, two-sided 95%, by degrees of freedom (beyond 30: 1.96)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
        25: 2.060, 30: 2.042}


def mean_ci(values) -> tuple[float, float]:
    """Mean and the half-width of its two-sided 95% t-interval; NaN for what fewer values cannot give."""
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean()) if len(v) else math.nan
    if len(v) < 2:
        return mean, math.nan
    df = len(v) - 1
    t = T975.get(df) or next((T975[k] for k in sorted(T975) if k >= df), 1.96)  # between rows: the next one up
    return mean, t * float(v.std(ddof=1)) / math.sqrt(len(v))


def bootstrap_interval(pairs: list[tuple], n_boot: int, ci: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """The stratified paired bootstrap of the mean over seeds of each seed's gap in bits per token: ``pairs`` holds
    (arm nats, reference nats, tokens) per seed, one entry per unit; units are resampled within each seed, arm and
    reference together, so seeds weigh alike."""
    if not pairs:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    boots = []
    for a, b, tok in pairs:
        d, tok = np.asarray(a, np.float64) - np.asarray(b, np.float64), np.asarray(tok, np.float64)
        idx = rng.integers(0, len(d), size=(n_boot, len(d)))
        boots.append(d[idx].sum(axis=1) / tok[idx].sum(axis=1) / LN2)
    boot = np.mean(boots, axis=0)
    return float(np.quantile(boot, (1 - ci) / 2)), float(np.quantile(boot, (1 + ci) / 2))


def num(value, spec: str) -> str:
    """``value`` in ``spec``, or '-' for none or a NaN."""
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def interval(lo, hi) -> str:
    return f"[{num(lo, '+.4f')}, {num(hi, '+.4f')}]"


def steps(vals) -> str:
    return ", ".join("-" if v is None else str(v) for v in vals)


def write_doc(out: Path, doc: Path, markdown_at: Callable[[Path], str]) -> None:
    """``doc``: ``out/notes.md`` (the hand-written reading of the numbers, if there), then the generated part,
    ``markdown_at(out as the document reaches it)``."""
    notes = out / "notes.md"
    rel = out.relative_to(doc.parent) if out.is_relative_to(doc.parent) else out
    doc.write_text((notes.read_text() + "\n\n" if notes.exists() else "") +
                   f"## The numbers (generated from {out}/results.json by "
                   f"`python -m raytrain_scu.ablation_report {out} --doc {doc}`)\n\n" + markdown_at(rel) + "\n")
