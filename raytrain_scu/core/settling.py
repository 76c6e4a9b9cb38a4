"""When a controlled run counts as settled, and the tracking figures reported beside it. Pure Python.

A run is settled from step t_s when, from t_s to the end and for at least ``min_steps`` steps, every step has

- |logit x − logit S*| ≤ ``tol`` (x is Ŝ, or the raw S for the second report),
- λ strictly inside (λmin, λmax),
- and max λ / min λ over that whole stretch ≤ ``lam_ratio``.

t_s is the earliest step from which all three hold to the end. The log-odds band is the same relative band at
every target (±0.1 in log-odds is about ±10% in ParamBPT at a fixed DataBPT), where a band in S itself would be
loose at small S* and tight at large S*.

A λ reversal is a change of direction of ln λ by at least ``min_swing`` (0.5 by default, a factor 1.65 in λ) from
the last extreme: the jitter of a settled λ does not count, a swing between bounds does.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

TOL = 0.1  # log-odds band around S*
MIN_STEPS = 100  # the settled stretch runs at least this many steps, to the end
LAM_RATIO = 1.5  # max λ / min λ over the settled stretch
MIN_SWING = 0.5  # a λ reversal counts when ln λ moves back by at least this


def logit(s: float) -> float:
    """ln(s / (1 − s)); ±inf at 0 and 1, nan outside [0, 1]."""
    if not 0.0 <= s <= 1.0 or s != s:
        return math.nan
    if s == 0.0:
        return -math.inf
    if s == 1.0:
        return math.inf
    return math.log(s / (1.0 - s))


def settled_from(x: Sequence[float], lam: Sequence[float], target_s: float, lambda_min: float, lambda_max: float,
                 steps: Optional[Sequence[int]] = None, *, tol: float = TOL, min_steps: int = MIN_STEPS,
                 lam_ratio: float = LAM_RATIO) -> Optional[int]:
    """The step t_s from which the run is settled (see the module docstring), or None.

    ``x`` (Ŝ or S) and ``lam`` are aligned per step (λ as it stands after that step's update); ``steps`` names the
    steps (default 1, 2, ...). A non-finite x or λ breaks the stretch.
    """
    n = len(x)
    if len(lam) != n or (steps is not None and len(steps) != n):
        raise ValueError(f"x, lam (and steps) must have one entry per step, got {n}, {len(lam)}")
    z = logit(target_s)
    lo, hi = math.inf, -math.inf
    start = n  # the earliest index whose suffix holds; n = none yet
    for i in range(n - 1, -1, -1):
        li, xi = lam[i], x[i]
        if li is None or xi is None or not (math.isfinite(li) and math.isfinite(xi)):
            break
        lo, hi = min(lo, li), max(hi, li)
        in_band = abs(logit(xi) - z) <= tol
        inside = lambda_min < li < lambda_max
        if not (in_band and inside and lo > 0 and hi / lo <= lam_ratio):
            break
        start = i
    if n - start < min_steps:
        return None
    return int(steps[start]) if steps is not None else start + 1


def reversals(lam: Sequence[float], min_swing: float = MIN_SWING) -> int:
    """How often ln λ changes direction by at least ``min_swing`` from its last extreme."""
    xs = [math.log(v) for v in lam if v is not None and v > 0 and math.isfinite(v)]
    if not xs:
        return 0
    direction, count = 0, 0
    lo = hi = ext = xs[0]
    for v in xs[1:]:
        if direction == 0:  # the first swing sets a direction; it is not a reversal
            lo, hi = min(lo, v), max(hi, v)
            if v - lo >= min_swing:
                direction, ext = 1, v
            elif hi - v >= min_swing:
                direction, ext = -1, v
        elif (v - ext) * direction > 0:
            ext = v
        elif abs(v - ext) >= min_swing:
            count, direction, ext = count + 1, -direction, v
    return count


def second_half_error(x: Sequence[float], target_s: float) -> float:
    """Mean |x − S*| over the second half of the run (what the first GPU study called 'after settling')."""
    tail = [v for v in x[len(x) // 2:] if v is not None and math.isfinite(v)]
    return sum(abs(v - target_s) for v in tail) / len(tail) if tail else math.nan


def at_bound(lam: Sequence[float], lambda_min: float, lambda_max: float) -> list[bool]:
    """Per step: λ at (or beyond) a bound."""
    return [v <= lambda_min or v >= lambda_max for v in lam]


def summary(s: Sequence[float], s_hat: Sequence[float], lam: Sequence[float], target_s: float, lambda_min: float,
            lambda_max: float, steps: Optional[Sequence[int]] = None) -> dict:
    """The tracking figures of one run: settled step on Ŝ and on raw S, λ reversals, the second-half error, the
    steps at a bound and the last of them (None when λ never met a bound)."""
    steps = list(steps) if steps is not None else list(range(1, len(lam) + 1))
    bound = at_bound(lam, lambda_min, lambda_max)
    hits = [st for st, b in zip(steps, bound) if b]
    return {
        "settled_step": settled_from(s_hat, lam, target_s, lambda_min, lambda_max, steps),
        "settled_step_raw": settled_from(s, lam, target_s, lambda_min, lambda_max, steps),
        "reversals": reversals(lam),
        "second_half_error": second_half_error(s_hat, target_s),
        "steps_at_bound": len(hits),
        "last_bound_step": hits[-1] if hits else None,
    }
