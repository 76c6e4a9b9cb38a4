"""The study's ``results.json``: written after every stage, so a re-run resumes where it stopped."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def json_ready(value):
    """``value`` with every NaN or infinity as None: JSON has no NaN (``json.dumps`` would write an invalid token)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        return json_ready(value.item())
    return value


def save(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(json_ready(results), indent=None, allow_nan=False, default=str))
    tmp.replace(path)
