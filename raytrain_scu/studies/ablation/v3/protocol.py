"""The rules of the study v3 (docs/ablation-v3.md), written down before any run on its plants: the plants and the
order they run in, the arms of each seed, the second text domain's documents, and what the select plays choose
(the best fixed λ, the early-stopping step of ``none`` and of the law). No Ray and no training here.

Each plant has one stage: per seed ``none``, the 9-point fixed-λ grid and the logodds law at the grid-free target
(``rule``). The law's target needs no grid, so nothing waits for another stage. λ = 0.1 (the v1/v2 best, "carried
over") is a point of the grid: its runs serve both arms.
"""
from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path

import numpy as np

from raytrain_scu.errors import AblationError
from raytrain_scu.studies.ablation.report import end_level
from raytrain_scu.studies.ablation.v2 import protocol as v2
from raytrain_scu.studies.ablation.v3.rule import grid_free_target

# the second text domain: the running interpreter's own standard library, top-level modules of 60-200 kB (whole
# files of source, each one document), in name order, copied as text files where data.source=text reads them
STDLIB_DIR = "/tmp/raytrain_scu_v3_data/stdlib"
STDLIB_SIZE = (60_000, 200_000)
STDLIB_FILES = 9

_P1_OPTIM = ["optim.lr=0.002", "optim.warmup_steps=20", "optim.min_lr_ratio=0.1", "lora.r=16", "lora.alpha=32",
             "train.max_steps=300"]
# the plants: config overrides on top of experiments/ablation-v3.yaml (v2's setting); each differs from v2's P1 in
# what its note says. ORDER is the order they run in: cheapest first, so the most plants complete in the device
# time there is
PLANTS = {
    "P5": {"note": "LoRA r32, lr 3e-3 and 200 steps together (P1: r16, 2e-3, 300); Shakespeare as P1",
           "overrides": ["optim.lr=0.003", "optim.warmup_steps=15", "optim.min_lr_ratio=0.1", "lora.r=32",
                         "lora.alpha=64", "train.max_steps=200", "train.checkpoint_every=200",
                         "data.max_documents=9", "data.val_fraction=0.667"]},
    "P3": {"note": "a second text domain: 9 Python standard-library modules, 3 trained on; P1's optimizer",
           "overrides": [*_P1_OPTIM, "data.source=text", f"data.path={STDLIB_DIR}", "data.max_documents=9",
                         "data.val_fraction=0.667"]},
    "P4": {"note": "more plays per epoch: the bundle's first 24 texts, 18 trained on (5-7x P1's training "
                   "characters per epoch, so about 4 epochs in 300 steps against P1's ~24); P1's optimizer",
           "overrides": [*_P1_OPTIM, "data.max_documents=24", "data.val_fraction=0.25"]},
}
ORDER = ("P5", "P3", "P4")
SEEDS = (0, 1, 3)
LAMBDAS = (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
CARRIED_LAMBDA = 0.1  # arm 3: the v1/v2 best fixed λ, carried over with no grid
LAW = "logodds"
NON_INFERIORITY = 0.01  # the primary endpoint: upper end of the across-seed 95% interval of law − best fixed ≤ this
FAMILIES = ("none", "fixed", LAW)


# ---------------------------------------------------------------- the second text domain

def stdlib_sources(stdlib: str | None = None) -> list[Path]:
    """The standard library's top-level ``.py`` modules of STDLIB_SIZE bytes, in name order, the first
    STDLIB_FILES of them."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.glob("*.py") if STDLIB_SIZE[0] <= f.stat().st_size <= STDLIB_SIZE[1])
    if len(files) < STDLIB_FILES:
        raise AblationError(f"{root}: {len(files)} module(s) of {STDLIB_SIZE} bytes, the plant needs {STDLIB_FILES}")
    return files[:STDLIB_FILES]


def write_stdlib(out: str = STDLIB_DIR, stdlib: str | None = None) -> dict:
    """Copy the modules to ``out`` as ``NN_name.txt`` (data.source=text reads .txt), each headed by its name so the
    split prints it. Returns {python, files: [{name, sha256}]} for the study's record: another interpreter's
    library is another corpus."""
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob("*.txt"):
        old.unlink()
    record = []
    for i, src in enumerate(stdlib_sources(stdlib)):
        text = f"# Lib/{src.name}\n" + src.read_text(encoding="utf-8")
        (dst / f"{i:02d}_{src.stem}.txt").write_text(text, encoding="utf-8")
        record.append({"name": src.name, "sha256": hashlib.sha256(text.encode()).hexdigest()})
    return {"python": sys.version.split()[0], "files": record}


# ---------------------------------------------------------------- the arms

def seed_arms(seed: int, lambdas, target_s: float, eval_keys: dict) -> list[dict]:
    """One seed's arms: ``none`` and the law keep a checkpoint at every eval (early stopping and the law's best
    checkpoint are chosen from them), then the fixed-λ grid."""
    return [v2.arm("none", seed, extra=eval_keys), v2.arm(LAW, seed, extra=eval_keys, target_s=target_s),
            *[v2.arm("fixed", seed, lambda_init=lam) for lam in lambdas]]


def plant_arms(seeds, lambdas, target_s: float, eval_keys: dict) -> list[dict]:
    """Every arm of a plant, seed by seed (a call that runs part of a plant finishes a seed's arms first)."""
    return [a for s in seeds for a in seed_arms(s, lambdas, target_s, eval_keys)]


def pending(arms: list[dict], trials: list[dict]) -> list[dict]:
    return v2.pending(arms, trials)


def plant_done(trials: list[dict], seeds, lambdas, target_s: float) -> bool:
    return not pending(plant_arms(seeds, lambdas, target_s, {}), trials)


# ---------------------------------------------------------------- what the select plays choose

def best_fixed(trials: list[dict]) -> dict:
    """The best fixed λ (lowest mean select-plays BPT over seeds) and the S its runs end at (mean over seeds of the
    mean Ŝ over the last 20% of steps)."""
    arms = v2.by_arm(trials, "fixed")
    if not arms:
        raise AblationError("no fixed-λ trial recorded")
    sel = {a: float(np.mean([t["select_bpt"] for t in ts])) for a, ts in arms.items()}
    name = min(sel, key=sel.get)
    return {"best_arm": name, "best_lambda": arms[name][0]["params"]["controller.lambda_init"],
            "s_best": float(np.mean([end_level(t["history"], "ctrl/s_hat") for t in arms[name]])),
            "select_bpt": sel}


def best_eval(trial: dict) -> dict:
    """The eval (step 0: the base model) whose select-plays BPT is lowest, the earliest on a tie: early stopping for
    ``none``, the law's best checkpoint for the law."""
    return v2.early_stop(trial)


# ---------------------------------------------------------------- the plant model's stand-ins

# each plant as the plant model (core.plant) can express it, for the prediction recorded before the runs and the fast
# test of the rule: knobs of ``Plant`` and ``simulate``'s keywords. The model has no knob for a text domain (P3 is
# P1's model) nor for how much less a larger corpus is memorised (P4 is P1's model with ParamBPT per weight / 6, the
# mean of its 5.3-7.1x training characters); r32 is A's init x2 and the learned norms' speed x√2, by analogy with
# v2's assumption for r64 (x4, x2), not measured
MODEL = {
    "P5": {"knobs": {"init_scale": 2.0, "speed": 2 ** 0.5}, "sim": {"lr": 3e-3, "warmup_steps": 15}, "steps": 200},
    "P3": {"knobs": {}, "sim": {"lr": 2e-3, "warmup_steps": 20}, "steps": 300},
    "P4": {"knobs": {"p_scale": 1 / 6}, "sim": {"lr": 2e-3, "warmup_steps": 20}, "steps": 300},
}
