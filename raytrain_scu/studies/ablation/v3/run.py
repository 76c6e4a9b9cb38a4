"""The study v3's calls: per plant, one Ray Tune grid (``studies.ablation.run.run_grid``) over the arms no recorded
trial has run (at most ``--max-trials``), then every adapter scored on its seed's select and report plays
(``driver.evaluate.score_shard``; ``none`` and the law at every eval). The call's trials are written to
``results.json`` as soon as they are scored, so the next call, on this machine or another, goes on from the file.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from raytrain_scu.config.paths import run_dir
from raytrain_scu.config.resolve import resolve
from raytrain_scu.config.schema import Config
from raytrain_scu.core.data.blocks import load_documents
from raytrain_scu.ray.tune.space import flat_params, trial_config
from raytrain_scu.studies.ablation.results import save
from raytrain_scu.studies.ablation.run import columns, final_checkpoint, history, run_grid, scoring_units
from raytrain_scu.studies.ablation.v2 import protocol as v2
from raytrain_scu.studies.ablation.v2.run import V2_HISTORY_KEYS, eval_checkpoints, prune, record, score_seeds
from raytrain_scu.studies.ablation.v2.stats import bpt
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


def _group(family_cfg: Config, rows: list[dict]) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = {}
    for row in rows:
        cfg = trial_config(family_cfg, row["params"], row["trial"])
        tdir = Path(run_dir(cfg))
        params = flat_params(row["params"])
        evals = eval_checkpoints(tdir, cfg) if v2.family_of(params) in EVAL_FAMILIES else []
        groups.setdefault(cfg.seed, []).append({"row": row, "cfg": cfg, "params": params, "dir": tdir,
                                                "final": final_checkpoint(tdir, cfg.train.max_steps), "evals": evals})
    return groups


def _round(xs) -> list[float]:
    return [float(f"{x:.9g}") for x in xs]


def _trial(plant: str, seed: int, i: int, g: dict, part: dict, sel_tokens, rep_tokens) -> dict:
    sel, rep = part[f"t{i}"]
    c = g["cfg"].controller
    trial = {"plant": plant, "family": v2.family_of(g["params"]), "arm": v2.label(g["params"]), "seed": seed,
             "trial": g["row"]["trial"], "params": g["params"], "law": c.law,
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


def collect(plant: str, family_cfg: Config, rows: list[dict], splits: dict) -> tuple[list[dict], dict]:
    """Each trial's record (arm, seed, per-step history, nats per unit on the select and report plays; ``none`` and
    the law: the same at every eval, step 0 being the base model) and each seed's unit token counts."""
    d = family_cfg.data
    docs = load_documents(d.source, d.path, d.text_field, d.max_documents)
    groups, calls, cut = _group(family_cfg, rows), {}, {}
    for seed, group in groups.items():
        split = splits[str(seed)]
        select = scoring_units([docs[i] for i in split["select"]])
        report = scoring_units([docs[i] for i in split["report"]])
        adapters = {"base": ""}
        for i, g in enumerate(group):
            adapters[f"t{i}"] = str(g["final"] / "adapter")
            adapters.update({f"t{i}@{step}": str(ck / "adapter") for step, ck in g["evals"] if ck != g["final"]})
        config = asdict(group[0]["cfg"])
        config["data"]["batch_size"] = v2.SCORE_BATCH
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
        trials += [_trial(plant, seed, i, g, part, tokens[:n], tokens[n:]) for i, g in enumerate(group)]
    return trials, units


def run_call(results: dict, plant: str, arms: list[dict], a, path: Path) -> None:
    """One Tune grid over ``arms`` on ``plant``, scored and recorded (``results`` written to ``path``)."""
    from raytrain_scu.studies.bench.measure import device_name

    t0 = time.time()
    cfg, rows = run_grid(a.config, plant_overrides(plant, a.overrides), grid_name(plant, arms), arms)
    trials, units = collect(plant, cfg, rows, results["plants"][plant]["split"]["splits"])
    record(results, plant, trials, units)
    results["plants"][plant]["calls"].append({
        "trials": [t["trial"] for t in trials], "wall_s": time.time() - t0, "device": device_name(),
        "gpus": torch.cuda.device_count(), "overrides": list(a.overrides),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.gmtime(t0))})
    save(results, path)
    prune([Path(run_dir(trial_config(cfg, r["params"], r["trial"]))) for r in rows
           if v2.family_of(flat_params(r["params"])) in EVAL_FAMILIES])
