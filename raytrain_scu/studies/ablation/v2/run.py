"""The study v2's calls: per plant and stage, one Ray Tune grid (``driver.sweep``, through v1's ``run_grid``) over the
arms no recorded trial has run (at most ``--max-trials`` of them), then every adapter scored on its seed's select and
report plays (``driver.evaluate.score_shard``; ``none`` at every eval). The call's trials are written to
``results.json`` as soon as they are scored, so the next call, on this machine or another, goes on from the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from raytrain_scu.config.paths import run_dir
from raytrain_scu.config.schema import Config
from raytrain_scu.core.checkpoint import read_meta, verify
from raytrain_scu.core.data.blocks import load_documents
from raytrain_scu.driver.resolve import resolve
from raytrain_scu.errors import AblationError, DataError, EvalError, ModelError
from raytrain_scu.ray.tune.space import flat_params, trial_config
from raytrain_scu.studies.ablation.results import save
from raytrain_scu.studies.ablation.run import HISTORY_KEYS, columns, final_checkpoint, history, run_grid, scoring_units
from raytrain_scu.studies.ablation.v2 import protocol as p
from raytrain_scu.studies.ablation.v2.stats import bpt

# the v1 columns and the laws' own telemetry (ctrl/log_odds_error ... is absent, None, under the spec's law)
V2_HISTORY_KEYS = (*HISTORY_KEYS, "train/lr", "ctrl/error", "ctrl/log_odds_error", "ctrl/raw_error", "ctrl/d_hat",
                   "ctrl/held")


def plant_overrides(plant: str, overrides: list[str]) -> list[str]:
    """The plant's overrides, then the call's own (which win: scaling, storage, a test's tiny settings)."""
    return [*p.PLANTS[plant]["overrides"], *overrides]


def plant_config(config: str, plant: str, overrides: list[str]) -> Config:
    return resolve(config, plant_overrides(plant, overrides))


def call_arms(results: dict, plant: str, stage: str, cfg: Config) -> list[dict]:
    """The stage's arms on this plant that no recorded trial has run, in the protocol's order."""
    rules, trials = results["setting"]["rules"], results["plants"][plant]["trials"]
    seeds = results["split"]["seeds"]
    targets = None
    if stage == "laws":
        if not p.stage_done(trials, "fixed", seeds, rules["lambdas"]):
            raise AblationError(f"{plant}: stage laws needs the whole fixed stage first (its targets come from it)")
        targets = p.choose_targets(trials, rules["target_factors"])["targets"]
    keys = p.none_extra(cfg.train.max_steps, cfg.train.eval_every)
    return p.pending(p.stage_arms(stage, seeds, rules["lambdas"], targets=targets, none_keys=keys), trials)


def grid_name(plant: str, stage: str, arms: list[dict]) -> str:
    """The Tune experiment of these arms: the same arms get the same name, so a call that died is restored."""
    digest = hashlib.sha1(json.dumps(arms, sort_keys=True).encode()).hexdigest()[:8]
    return f"{plant}-{stage}-{digest}"


def all_checkpoints(trial_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every ``checkpoint_*`` of a trial that matches its manifest, by step."""
    found = [(read_meta(d)["step"], d) for d in sorted(Path(trial_dir).glob("checkpoint_*"))
             if d.is_dir() and not d.name.endswith(".partial") and verify(d) is None]
    return sorted(found)


def eval_checkpoints(trial_dir: Path, cfg: Config) -> list[tuple[int, Path]]:
    """``none``'s checkpoints, one per eval to the end; a missing one is an AblationError."""
    t = cfg.train
    found = dict(all_checkpoints(trial_dir))
    want = list(range(t.eval_every, t.max_steps + 1, t.eval_every))
    missing = [s for s in want if s not in found]
    if missing:
        raise AblationError(f"{trial_dir}: no good checkpoint of step(s) {missing}: none keeps one per eval")
    return [(s, found[s]) for s in want]


def _group(family_cfg: Config, rows: list[dict], eval_families: tuple[str, ...]) -> dict[int, list[dict]]:
    """The grid's trials by seed: row, config, final checkpoint, and (``eval_families``) the checkpoint of every
    eval."""
    groups: dict[int, list[dict]] = {}
    for row in rows:
        cfg = trial_config(family_cfg, row["params"], row["trial"])
        tdir = Path(run_dir(cfg))
        params = flat_params(row["params"])
        evals = eval_checkpoints(tdir, cfg) if p.family_of(params) in eval_families else []
        groups.setdefault(cfg.seed, []).append({"row": row, "cfg": cfg, "params": params, "dir": tdir,
                                                "final": final_checkpoint(tdir, cfg.train.max_steps), "evals": evals})
    return groups


def _round(xs) -> list[float]:
    return [float(f"{x:.9g}") for x in xs]


def _trial(plant: str, stage: Optional[str], seed: int, i: int, g: dict, part: dict, sel_tokens, rep_tokens) -> dict:
    """The record of trial ``t{i}`` of a seed's group ``g``, from the seed's scores split into (select, report);
    ``stage`` None: a study without stages, whose records have no ``stage`` key."""
    sel, rep = part[f"t{i}"]
    c = g["cfg"].controller
    staged = {} if stage is None else {"stage": stage}
    trial = {"plant": plant, **staged, "family": p.family_of(g["params"]), "arm": p.label(g["params"]),
             "seed": seed, "trial": g["row"]["trial"], "params": g["params"], "law": c.law,
             "target_s": c.target_s if c.mode == "scu" else None, "lambda_init": c.lambda_init,
             "lambda_min": c.lambda_min, "lambda_max": c.lambda_max, "time_s": g["row"].get("time_s"),
             "select_bpt": bpt(sel, sel_tokens), "report_bpt": bpt(rep, rep_tokens),
             "select_nats": _round(sel), "report_nats": _round(rep),
             "history": columns(history(g["final"]), V2_HISTORY_KEYS)}
    if g["evals"]:
        keys = ["base"] + [f"t{i}" if ck == g["final"] else f"t{i}@{step}" for step, ck in g["evals"]]
        trial["evals"] = [{"step": step, "select_bpt": bpt(part[k][0], sel_tokens),
                           "report_bpt": bpt(part[k][1], rep_tokens), "report_nats": _round(part[k][1])}
                          for step, k in zip([0] + [s for s, _ in g["evals"]], keys)]
    return trial


def score_seeds(family_cfg: Config, calls: dict[int, tuple], *, tasks: Optional[bool] = None) -> dict[int, dict]:
    """``score_shard(*calls[seed])`` for every seed. ``tasks`` None: one Ray task per seed, each on a GPU of its own,
    when this machine has several GPUs (the Tune grid has finished, so they are free), else one after another in this
    process; True or False chooses (a task holds one GPU where CUDA is, else CPUs only). The tasks read the trials'
    checkpoints from this machine's disk, so they run on a local Ray only (no RAY_ADDRESS)."""
    from raytrain_scu.driver.evaluate import score_shard

    seeds, t0 = sorted(calls), time.time()
    if tasks is None:
        tasks = torch.cuda.device_count() > 1 and len(seeds) > 1 and not os.environ.get("RAY_ADDRESS")
    models, units = (sum(len(calls[s][i]) for s in seeds) for i in (1, 2))
    print(f"[raytrain_scu] ablation v2: scoring {models} models (base and adapters) of {len(seeds)} seed(s), each on "
          f"its seed's select and report units ({units} in all), "
          f"{'one Ray task per seed' if tasks else 'in this process'}", flush=True)
    if tasks:
        from raytrain_scu.ray.launch import run_tasks

        gpus = 1 if torch.cuda.is_available() else 0
        scored = dict(zip(seeds, run_tasks(family_cfg, score_shard, [calls[s] for s in seeds], gpus_per_worker=gpus,
                                           plain_errors=(EvalError, ModelError, DataError))))
    else:
        scored = {s: score_shard(*calls[s]) for s in seeds}
    print(f"[raytrain_scu] ablation v2: scored in {time.time() - t0:.0f} s", flush=True)
    return scored


def collect(plant: str, stage: Optional[str], family_cfg: Config, rows: list[dict], splits: dict,
            eval_families: tuple[str, ...] = ("none",)) -> tuple[list[dict], dict]:
    """Each trial's record (arm, seed, history, nats per unit on the select and the report plays; the families of
    ``eval_families``: the same at every eval, step 0 being the base model) and each seed's unit token counts.
    ``stage`` None: the records have no ``stage`` key (v3)."""
    d = family_cfg.data
    docs = load_documents(d.source, d.path, d.text_field, d.max_documents)
    groups, calls, cut = _group(family_cfg, rows, eval_families), {}, {}
    for seed, group in groups.items():
        split = splits[str(seed)]
        select = scoring_units([docs[i] for i in split["select"]])
        report = scoring_units([docs[i] for i in split["report"]])
        adapters = {"base": ""}
        for i, g in enumerate(group):
            adapters[f"t{i}"] = str(g["final"] / "adapter")
            adapters.update({f"t{i}@{step}": str(ck / "adapter") for step, ck in g["evals"] if ck != g["final"]})
        config = asdict(group[0]["cfg"])
        config["data"]["batch_size"] = p.SCORE_BATCH
        calls[seed], cut[seed] = (config, adapters, select + report), len(select)
    scored = score_seeds(family_cfg, calls)
    trials, units = [], {}
    for seed, group in sorted(groups.items()):
        scores, n = scored[seed], cut[seed]
        tokens = scores["tokens"]
        part = {k: (v[:n], v[n:]) for k, v in scores["nats"].items()}
        units[str(seed)] = {"select_tokens": tokens[:n].tolist(), "report_tokens": tokens[n:].tolist(),
                            "base_select_bpt": bpt(part["base"][0], tokens[:n]),
                            "base_report_bpt": bpt(part["base"][1], tokens[n:])}
        trials += [_trial(plant, stage, seed, i, g, part, tokens[:n], tokens[n:]) for i, g in enumerate(group)]
    return trials, units


def prune(group_dirs: list[Path]) -> None:
    """After the trials are recorded: each ``none`` trial keeps its final checkpoint only (one per eval is a lot of
    disk at LoRA r 64)."""
    for tdir in group_dirs:
        for _, ckpt in all_checkpoints(tdir)[:-1]:
            shutil.rmtree(ckpt, ignore_errors=True)


def record(results: dict, plant: str, trials: list[dict], units: dict) -> None:
    """Add a call's trials and unit counts to ``results``; a seed's units must be the same in every call."""
    rec = results["plants"][plant]
    for seed, u in units.items():
        old = rec["units"].get(seed)
        if old is not None and (old["select_tokens"], old["report_tokens"]) != (u["select_tokens"],
                                                                                u["report_tokens"]):
            raise AblationError(f"{plant} seed {seed}: the held-out units differ from an earlier call's")
        rec["units"][seed] = u
    rec["trials"] += trials


def call_record(trials: list[dict], t0: float, overrides: list[str]) -> dict:
    """What a study records of one call (each call may run on another machine, its GPUs shared between trials): its
    trials, wall time from ``t0``, device, GPU count, the call's overrides and when it started (UTC)."""
    from raytrain_scu.studies.bench.measure import device_name

    return {"trials": [t["trial"] for t in trials], "wall_s": time.time() - t0, "device": device_name(),
            "gpus": torch.cuda.device_count(), "overrides": list(overrides),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0))}


def run_call(results: dict, plant: str, stage: str, arms: list[dict], a, path: Path) -> None:
    """One Tune grid over ``arms`` on ``plant``, scored and recorded (``results`` written to ``path``)."""
    t0 = time.time()
    overrides = plant_overrides(plant, a.overrides)
    cfg, rows = run_grid(a.config, overrides, grid_name(plant, stage, arms), arms)
    trials, units = collect(plant, stage, cfg, rows, results["split"]["splits"])
    record(results, plant, trials, units)
    results["plants"][plant]["calls"].append({"stage": stage, **call_record(trials, t0, a.overrides)})
    save(results, path)
    prune([Path(run_dir(trial_config(cfg, r["params"], r["trial"]))) for r in rows
           if p.family_of(flat_params(r["params"])) == "none"])
