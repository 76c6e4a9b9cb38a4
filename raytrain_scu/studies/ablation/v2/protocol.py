"""The rules of the GPU study v2 (docs/control.md §7), written down before any result: the plants, the three-way
split of the plays, the arms of each stage, and what the select plays choose (the best fixed λ, the targets, each
law's S*, the early-stopping step). No Ray and no training here.

Per plant and seed the stages are ``fixed`` (``none`` and the fixed-λ grid) and ``laws`` (the spec's law and the
logodds law, each at 3 targets). ``laws`` needs the whole ``fixed`` stage of its plant: its targets come from it.
"""
from __future__ import annotations

import numpy as np

from raytrain_scu.core.data.blocks import split_documents
from raytrain_scu.errors import AblationError
from raytrain_scu.studies.ablation.report import end_level
from raytrain_scu.studies.ablation.run import scaled_target

# the plants: config overrides on top of the study's config (experiments/ablation-v2.yaml), and the plant model's
# knobs for the prediction drawn beside the GPU trace (core.plant; r 64 as A's init x4 and speed x2, an assumption)
PLANTS = {
    "P1": {"overrides": ["optim.lr=0.002", "optim.warmup_steps=20", "optim.min_lr_ratio=0.1", "lora.r=16",
                         "lora.alpha=32", "train.max_steps=300"],
           "model": {"knobs": {}, "lr": 0.002, "init_per_r16": 1.0}},
    "P2": {"overrides": ["optim.lr=0.0005", "optim.warmup_steps=20", "optim.min_lr_ratio=0.1", "lora.r=64",
                         "lora.alpha=128", "train.max_steps=600"],
           "model": {"knobs": {"init_scale": 4.0, "speed": 2.0}, "lr": 0.0005, "init_per_r16": 4.0}},
}
STAGES = ("fixed", "laws")
NEEDS = {"fixed": (), "laws": ("fixed",)}
SEEDS = (0, 1, 3)
LAMBDAS = (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
TARGET_FACTORS = (0.5, 1.0, 2.0)
LAWS = ("spec", "logodds")
FAMILIES = ("none", "fixed", *LAWS)
SELECT_STREAM = 1  # the select/report permutation draws from numpy's default_rng([seed, SELECT_STREAM])
BOUND_AFTER = 60  # the decision's tracking rule: λ at a bound in no step after this one
MAX_SEED_TRIES = 1000
# windows per batch when the study scores adapters: its speed, not its sums (right padding is ignored; a row's nats
# depend on the batch only through the bf16 kernels chosen for its shape). At the training batch of 8 the 135M model
# scores ~55k tokens/s on an H200 (measured), launch-bound
SCORE_BATCH = 32


# ---------------------------------------------------------------- the three-way split

def play_titles(docs: list[str]) -> list[str]:
    """Each document's first non-blank line (a play's title), for the printed split."""
    return [next((ln.strip() for ln in d.splitlines() if ln.strip()), "?")[:48] for d in docs]


def play_split(docs: list[str], seed: int, val_fraction: float) -> dict:
    """{train, select, report}: document indices. Train and held-out are the training loop's own split
    (``split_documents`` at this seed); the held-out ones are cut in two by a permutation seeded with
    [seed, SELECT_STREAM]: the first half select, the rest report."""
    index = {id(d): i for i, d in enumerate(docs)}
    train, held_out = split_documents(docs, val_fraction=val_fraction, seed=seed)
    held = [index[id(d)] for d in held_out]
    if len(held) < 2:
        raise AblationError(f"{len(held)} held-out document(s): the select and report plays need at least 2 "
                            f"(raise data.max_documents or data.val_fraction)")
    perm = np.random.default_rng([seed, SELECT_STREAM]).permutation(len(held))
    half = len(held) // 2
    return {"train": sorted(index[id(d)] for d in train), "select": sorted(held[i] for i in perm[:half]),
            "report": sorted(held[i] for i in perm[half:])}


def choose_seeds(docs: list[str], seeds, val_fraction: float) -> dict:
    """The seeds the study runs: each requested seed whose (train, select, report) split repeats an earlier one's
    is replaced by the next integer above it that is neither requested nor tried. Returns {seeds, splits (by seed as
    text), replaced ({seed: its replacement})}."""
    if len(set(seeds)) != len(seeds):
        raise AblationError(f"--seeds lists a seed twice: {list(seeds)}")
    taken, used, splits, replaced = set(seeds), [], {}, {}
    for seed in seeds:
        cand = seed
        for _ in range(MAX_SEED_TRIES):
            split = play_split(docs, cand, val_fraction)
            if split not in splits.values():
                break
            nxt = cand + 1
            while nxt in taken:
                nxt += 1
            taken.add(nxt)
            cand = nxt
        else:
            raise AblationError(f"no seed near {seed} gives a split of its own in {MAX_SEED_TRIES} tries")
        if cand != seed:
            replaced[str(seed)] = cand
        used.append(cand)
        splits[str(cand)] = split
    return {"seeds": used, "splits": splits, "replaced": replaced}


def split_text(choice: dict, titles: list[str]) -> str:
    """The three lists per seed, as printed before any trial."""
    lines = []
    for seed, new in choice["replaced"].items():
        lines.append(f"seed {seed} repeats an earlier seed's split: replaced by seed {new}")
    for seed in choice["seeds"]:
        sp = choice["splits"][str(seed)]
        lines.append(f"seed {seed}: " + " | ".join(f"{part} = {'; '.join(titles[i] for i in sp[part])}"
                                                   for part in ("train", "select", "report")))
    return "\n".join(lines)


# ---------------------------------------------------------------- the arms

def arm(family: str, seed: int, extra: dict | None = None, **controller) -> dict:
    """One trial's bundle for ``tune.space.arm``: the mode, the law, the controller values, ``extra`` config keys
    and the seed (:func:`family_of` reads the family back)."""
    mode = {"none": {"controller.mode": "none"}, "fixed": {"controller.mode": "fixed"}}.get(
        family, {"controller.mode": "scu", "controller.law": family})
    return {**mode, **{f"controller.{k}": v for k, v in controller.items()}, **(extra or {}), "seed": seed}


def family_of(params: dict) -> str:
    """none | fixed | spec | logodds."""
    mode = params["controller.mode"]
    return mode if mode in ("none", "fixed") else params["controller.law"]  # every scu arm of the study names it


def label(params: dict) -> str:
    """An arm's name, the same on every seed: ``none``, ``fixed λ=0.1``, ``logodds S*=0.241``."""
    family = family_of(params)
    if family == "fixed":
        return f"fixed λ={params['controller.lambda_init']:g}"
    if family in LAWS:
        return f"{family} S*={params['controller.target_s']:g}"
    return "none"


def none_extra(max_steps: int, eval_every: int) -> dict:
    """``none`` keeps a checkpoint at every eval (all of them), so early stopping can be scored on any step."""
    return {"train.checkpoint_every": eval_every, "run.num_to_keep": max_steps // eval_every + 1}


def stage_arms(stage: str, seeds, lambdas, *, targets=None, none_keys: dict | None = None) -> list[dict]:
    """Every arm of a stage, seed by seed (a call that runs part of a stage finishes a seed's arms first)."""
    out = []
    for seed in seeds:
        if stage == "fixed":
            out.append(arm("none", seed, extra=none_keys))
            out += [arm("fixed", seed, lambda_init=lam) for lam in lambdas]
        else:
            out += [arm(law, seed, target_s=t) for law in LAWS for t in targets]
    return out


def pending(arms: list[dict], trials: list[dict]) -> list[dict]:
    """The arms no recorded trial has run yet (an arm is its label and seed)."""
    done = {(t["arm"], t["seed"]) for t in trials}
    return [a for a in arms if (label(a), a["seed"]) not in done]


# ---------------------------------------------------------------- what the select plays choose

def by_arm(trials: list[dict], family: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for t in trials:
        if t["family"] == family:
            out.setdefault(t["arm"], []).append(t)
    return out


def choose_targets(trials: list[dict], factors) -> dict:
    """The best fixed λ (lowest mean select-plays BPT over seeds), the S its runs end at (mean over seeds of the mean
    Ŝ over the last 20% of steps), and S* = that S with its odds times each factor."""
    arms = by_arm(trials, "fixed")
    if not arms:
        raise AblationError("the fixed stage has no fixed-λ trial")
    name = min(arms, key=lambda a: np.mean([t["select_bpt"] for t in arms[a]]))
    best = arms[name]
    s_best = float(np.mean([end_level(t["history"], "ctrl/s_hat") for t in best]))
    return {"best_arm": name, "best_lambda": best[0]["params"]["controller.lambda_init"], "s_best": s_best,
            "targets": [scaled_target(s_best, f) for f in factors],
            "select_bpt": {a: float(np.mean([t["select_bpt"] for t in ts])) for a, ts in arms.items()}}


def selected_arm(trials: list[dict], family: str) -> str | None:
    """The arm of ``family`` with the lowest mean select-plays BPT over seeds (a law: its S*); None without one."""
    arms = by_arm(trials, family)
    return min(arms, key=lambda a: np.mean([t["select_bpt"] for t in arms[a]])) if arms else None


def early_stop(trial: dict) -> dict:
    """``none`` stopped at the eval whose select-plays BPT is lowest (the earliest on a tie): that eval's record
    (step, select_bpt, report_bpt, report_nats)."""
    evals = trial.get("evals") or []
    if not evals:
        raise AblationError(f"trial {trial['trial']} has no per-eval scores: only none is scored at every eval")
    return min(evals, key=lambda e: (e["select_bpt"], e["step"]))


def stage_done(trials: list[dict], stage: str, seeds, lambdas, targets=None) -> bool:
    """Whether every arm of the stage is recorded on every seed."""
    return not pending(stage_arms(stage, seeds, lambdas, targets=targets), trials)
