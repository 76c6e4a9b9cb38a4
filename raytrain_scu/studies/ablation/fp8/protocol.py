"""The rules of the FP8 accuracy study, written down before any of its runs. No Ray and no training here.

Per plant (the study v2's P1, 300 steps, and P2, 600 steps) and seed (v2's 0, 1, 3 and v2's splits of the plays),
two arms that differ only in ``model.base_fp8``: ``bf16`` and ``fp8`` (GPTQ codes, the default rounding). Both run
fixed λ = 0.1, the best fixed λ of both plants in v2, so the comparison sits where a regularised run does best. Each
run's final adapter is scored in bf16 (``driver.evaluate.score_shard`` builds no FP8) on its seed's report plays.
The gap of a seed is BPT(fp8-trained) − BPT(bf16-trained) on the same tokens; the decision: FP8 is accurate enough
to be the default on Hopper and Ada when the upper end of the across-seed 95% t-interval of the gap is at most
``TOLERANCE`` on every plant.
"""
from __future__ import annotations

from raytrain_scu.studies.ablation.v2 import protocol as v2

PLANTS = ("P1", "P2")
SEEDS = (0, 1, 3)
LAMBDA = 0.1
TOLERANCE = 0.01  # bits per token
ARMS = {"bf16": {"model.base_fp8": False}, "fp8": {"model.base_fp8": True}}


def arms(seeds) -> list[dict]:
    """Every arm, seed by seed (a call that runs part of a plant finishes a seed's pair first)."""
    return [v2.arm("fixed", s, extra=dict(ARMS[name]), lambda_init=LAMBDA) for s in seeds for name in ARMS]


def label(params: dict) -> str:
    """``fp8`` or ``bf16``: the arm's precision of the frozen base."""
    return "fp8" if params.get("model.base_fp8") else "bf16"


def pending(all_arms: list[dict], trials: list[dict]) -> list[dict]:
    """The arms no recorded trial has run yet (an arm is its label and seed)."""
    done = {(t["arm"], t["seed"]) for t in trials}
    return [a for a in all_arms if (label(a), a["seed"]) not in done]
