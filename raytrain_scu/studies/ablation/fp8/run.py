"""The FP8 accuracy study's calls: per plant, one Ray Tune grid (``studies.ablation.run.run_grid``) over the arms no
recorded trial has run, then every final adapter scored in bf16 on its seed's select and report plays (the study
v2's ``collect``). A call's trials are written to ``results.json`` as soon as they are scored, so the next call goes
on from the file."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from raytrain_scu.driver.resolve import resolve
from raytrain_scu.studies.ablation.fp8 import protocol as p
from raytrain_scu.studies.ablation.results import save
from raytrain_scu.studies.ablation.run import run_grid
from raytrain_scu.studies.ablation.v2 import protocol as v2
from raytrain_scu.studies.ablation.v2.run import call_record, collect, record


def plant_overrides(plant: str, overrides: list[str]) -> list[str]:
    """v2's plant overrides, then the call's own (which win: scaling, storage, a test's tiny settings)."""
    return [*v2.PLANTS[plant]["overrides"], *overrides]


def plant_config(config: str, plant: str, overrides: list[str]):
    return resolve(config, plant_overrides(plant, overrides))


def call_arms(results: dict, plant: str) -> list[dict]:
    rec = results["plants"][plant]
    return p.pending(p.arms(rec["split"]["seeds"]), rec["trials"])


def run_call(results: dict, plant: str, arms: list[dict], a, path: Path) -> None:
    """One Tune grid over ``arms`` on ``plant``, scored in bf16 and recorded (``results`` written to ``path``)."""
    t0 = time.time()
    name = f"fp8-{plant}-{hashlib.sha1(json.dumps(arms, sort_keys=True).encode()).hexdigest()[:8]}"
    cfg, rows = run_grid(a.config, plant_overrides(plant, a.overrides), name, arms)
    trials, units = collect(plant, None, cfg, rows, results["plants"][plant]["split"]["splits"], eval_families=())
    for t in trials:
        t["arm"] = p.label(t["params"])
    record(results, plant, trials, units)
    results["plants"][plant]["calls"].append(call_record(trials, t0, a.overrides))
    save(results, path)
