"""The study v3's calls: per plant, one Ray Tune grid (``studies.ablation.run.run_grid``) over the arms no recorded
trial has run (at most ``--max-trials``), then every adapter scored on its seed's select and report plays
(``driver.evaluate.score_shard``; ``none`` and the law at every eval). The call's trials are written to
``results.json`` as soon as they are scored, so the next call, on this machine or another, goes on from the file.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from raytrain_scu.config.paths import run_dir
from raytrain_scu.config.schema import Config
from raytrain_scu.driver.resolve import resolve
from raytrain_scu.ray.tune.space import flat_params, trial_config
from raytrain_scu.studies.ablation.results import save
from raytrain_scu.studies.ablation.run import run_grid
from raytrain_scu.studies.ablation.v2 import protocol as v2
from raytrain_scu.studies.ablation.v2.run import call_record, collect, prune, record
from raytrain_scu.studies.ablation.v3 import protocol as p

EVAL_FAMILIES = ("none", p.LAW)  # scored at every eval


def plant_overrides(plant: str, overrides: list[str]) -> list[str]:
    """The plant's overrides, then the call's own (which win: scaling, storage, a test's tiny settings)."""
    return [*p.PLANTS[plant]["overrides"], *overrides]


def plant_config(config: str, plant: str, overrides: list[str]) -> Config:
    return resolve(config, plant_overrides(plant, overrides))


def eval_keys(cfg: Config) -> dict:
    return v2.none_extra(cfg.train.max_steps, cfg.train.eval_every)


def call_arms(results: dict, plant: str, cfg: Config) -> list[dict]:
    """The plant's arms that no recorded trial has run, in the protocol's order."""
    rules, rec = results["setting"]["rules"], results["plants"][plant]
    arms = p.plant_arms(rec["split"]["seeds"], rules["lambdas"], rules["target_s"], eval_keys(cfg))
    return p.pending(arms, rec["trials"])


def grid_name(plant: str, arms: list[dict]) -> str:
    """The Tune experiment of these arms: the same arms get the same name, so a call that died is restored."""
    return f"{plant}-{hashlib.sha1(json.dumps(arms, sort_keys=True).encode()).hexdigest()[:8]}"


def run_call(results: dict, plant: str, arms: list[dict], a, path: Path) -> None:
    """One Tune grid over ``arms`` on ``plant``, scored and recorded (``results`` written to ``path``)."""
    t0 = time.time()
    cfg, rows = run_grid(a.config, plant_overrides(plant, a.overrides), grid_name(plant, arms), arms)
    splits = results["plants"][plant]["split"]["splits"]
    trials, units = collect(plant, None, cfg, rows, splits, eval_families=EVAL_FAMILIES)
    record(results, plant, trials, units)
    results["plants"][plant]["calls"].append(call_record(trials, t0, a.overrides))
    save(results, path)
    prune([Path(run_dir(trial_config(cfg, r["params"], r["trial"]))) for r in rows
           if v2.family_of(flat_params(r["params"])) in EVAL_FAMILIES])
