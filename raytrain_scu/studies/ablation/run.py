"""``python -m raytrain_scu.ablation CONFIG.yaml key=value... --out DIR``: does SCU help? none vs fixed λ vs SCU.

The study runs in stages, each one Ray Tune sweep of Ray Train runs (one GPU each on a GPU cluster) recorded in
MLflow; every stage's trials are kept in ``DIR/results.json`` as they finish, so a re-run skips the stages done and a
later call (another machine) goes on from the file. The settings of every stage follow from the ones before by rules
fixed here, before any SCU result comes in. The study is of the spec's law (``LAW``; :func:`check_law` refuses a config
of another before any stage):

1. ``fixed``: ``none`` and fixed λ on the ``--lambdas`` grid, over ``--seeds``. The best fixed λ is the one with the
   lowest held-out BPT (mean over seeds); S* for the SCU arms is the S it ends at (mean Ŝ over the last 20% of
   steps, mean over seeds) with its odds S/(1 − S) times each ``--target-factors``, and likewise for the prior
   centred on the update (the same S*).
2. ``scu``: SCU at those targets (default gains) and with ``controller.prior_center=init`` at its targets, over the
   seeds; the stability grid ``--gains`` (Kp:Ki pairs) at the middle target, first seed.
3. ``sweep``: ``raytrain_scu.sweep`` over controller.kp, controller.ki (log-uniform) and controller.target_s around
   the middle target, with ASHA on held-out BPT at equal tokens, first seed.
4. ``tuned``: SCU at the middle target with the sweep's best gains, over the seeds.

Each finished adapter is scored on its seed's whole validation split (held-out documents cut into units of whole
speeches, the paired bootstrap's resampling units); ``ablation_report`` turns the file into docs/ablation.md.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from raytrain_scu.config.io import to_yaml
from raytrain_scu.config.paths import run_dir
from raytrain_scu.config.schema import Config
from raytrain_scu.core.checkpoint import newest_good_local, read_meta
from raytrain_scu.core.model.flops import bits_per_token
from raytrain_scu.driver.resolve import resolve
from raytrain_scu.errors import AblationError, ConfigError
from raytrain_scu.ray.tune.space import flat_params, trial_config
from raytrain_scu.studies.ablation.report import end_level

STAGES = ("fixed", "scu", "sweep", "tuned")
LAW = "spec"  # the law the stages are written for: the stability grid and the sweep set its controller.kp and .ki
NEEDS = {"fixed": (), "scu": ("fixed",), "sweep": ("fixed",), "tuned": ("fixed", "sweep")}  # whose results a stage uses
UNIT_CHARS = 2000  # held-out documents are cut at blank lines into units of at least this many characters
HISTORY_KEYS = ("step", "train/data_bpt", "train/param_bpt", "train/param_bpt_a", "train/param_bpt_b",
                "train/param_bpt_update", "ctrl/s", "ctrl/s_hat", "ctrl/lambda", "ctrl/lambda_applied",
                "ctrl/saturated_step", "val/data_bpt")


# ---------------------------------------------------------------- the arms of each stage

def arm(family: str, seed: int, **values) -> dict:
    """One trial's bundle for ``tune.space.arm``: the controller keys and the seed (:func:`family_of` reads the
    family back from them)."""
    mode = {"none": "none", "fixed": "fixed"}.get(family, "scu")
    return {"controller.mode": mode, **{f"controller.{k}": v for k, v in values.items()}, "seed": seed}


def family_of(stage: str, params: dict) -> str:
    """none | fixed | scu (default gains) | scu_init (the update-centred prior) | gains (the stability grid) | tuned."""
    mode = params["controller.mode"]
    if mode in ("none", "fixed"):
        return mode
    if stage == "tuned":
        return "tuned"
    if params.get("controller.prior_center") == "init":
        return "scu_init"
    return "gains" if "controller.kp" in params else "scu"


def check_law(cfg: Config) -> None:
    """The study runs the spec's law (``LAW``): a config of another is refused before any stage starts."""
    if cfg.controller.law != LAW:
        raise ConfigError(f"controller.law: this study is of the {LAW} law (its --gains grid and its sweep set "
                          f"controller.kp and controller.ki), got {cfg.controller.law!r}: set controller.law={LAW} "
                          f"(experiments/ablation-gpu.yaml does), or compare the laws with --protocol v2")


def fixed_arms(seeds, lambdas) -> list[dict]:
    return [arm("none", s) for s in seeds] + [arm("fixed", s, lambda_init=lam) for lam in lambdas for s in seeds]


def choose_targets(trials: list[dict], factors) -> dict:
    """The rule from the fixed stage to the SCU targets: the best fixed λ (lowest mean held-out BPT), the S (and, for
    the record, the update-centred S) its runs end at, and S* from that S and each factor (:func:`scaled_target`),
    for both prior centres."""
    by_lam: dict[float, list[dict]] = {}
    for t in trials:
        if t["family"] == "fixed":
            by_lam.setdefault(t["params"]["controller.lambda_init"], []).append(t)
    if not by_lam:
        raise AblationError("the fixed stage has no fixed-λ trial: give --lambdas")
    best = min(by_lam, key=lambda lam: np.mean([t["val_bpt"] for t in by_lam[lam]]))
    s_best = float(np.mean([end_level(t["history"], "ctrl/s_hat") for t in by_lam[best]]))
    s_upd = float(np.mean([end_level(t["history"], "s_update") for t in by_lam[best]]))
    targets = [scaled_target(s_best, f) for f in factors]
    # the update-centred arms take the same S*: the best fixed λ's update-centred S is no guide (under the zero-centred
    # penalty the A factors shrink towards 0, so w − w_init ≈ −w_init and that S is near the init's)
    return {"best_lambda": best, "s_best": s_best, "s_update_best": s_upd, "targets": targets,
            "targets_init": list(targets)}


def scaled_target(s: float, factor: float) -> float:
    """S* from an S a run ends at: its odds S/(1 − S) times ``factor``, back to a ratio (3 significant digits). The odds
    keep S* inside (0, 1) (a plain 2·S would pass 1 for S above 0.5); for small S it is about factor·S."""
    odds = s / (1.0 - s) * factor
    return float(f"{odds / (1.0 + odds):.3g}")


def middle(values: list) -> float:
    return sorted(values)[len(values) // 2]


def scu_arms(seeds, choice: dict, gains) -> list[dict]:
    """SCU at each target (default gains) and with the update-centred prior at its targets, every seed; the
    stability grid of (Kp, Ki) at the middle target on the first seed."""
    out = [arm("scu", s, target_s=t) for t in choice["targets"] for s in seeds]
    out += [arm("scu_init", s, target_s=t, prior_center="init") for t in choice["targets_init"] for s in seeds]
    mid = middle(choice["targets"])
    out += [arm("gains", seeds[0], target_s=mid, kp=kp, ki=ki) for kp, ki in gains]
    return out


def sweep_space_for(choice: dict, kp_range, ki_range) -> dict:
    lo, hi = min(choice["targets"]), max(choice["targets"])
    return {"controller.kp": {"loguniform": list(kp_range)}, "controller.ki": {"loguniform": list(ki_range)},
            "controller.target_s": {"loguniform": [lo, hi] if lo < hi else [lo / 2, lo * 2]}}


def tuned_arms(seeds, choice: dict, best: dict) -> list[dict]:
    return [arm("tuned", s, target_s=middle(choice["targets"]), kp=best["controller.kp"], ki=best["controller.ki"])
            for s in seeds]


# ---------------------------------------------------------------- running a stage

def run_grid(config_path: str, overrides: list[str], name: str, arms: list[dict]) -> tuple[Config, list[dict]]:
    """One Tune grid over ``arms`` (each a ``tune.space.arm`` bundle): the sweep's config and its trial rows."""
    from raytrain_scu.driver.sweep import sweep  # Ray is imported when a stage runs, not when the CLI checks its input

    cfg = resolve(config_path, [*overrides, "tune.search=grid", "tune.scheduler=none"])
    cfg.tune.space = {"arm": {"grid": arms}}
    cfg.run.name = f"{cfg.run.name}-{name}"
    rows = sweep(cfg)["rows"]
    unfinished = [f"{r['trial']} ({r['status']})" for r in rows if r["status"] != "FINISHED"]
    if unfinished:
        raise AblationError(f"sweep {cfg.run.name}: {len(unfinished)} trial(s) did not reach train.max_steps: "
                            f"{', '.join(unfinished)}. Run the same command again: ERROR/PENDING trials resume")
    return cfg, rows


def final_checkpoint(run_dir: Path, max_steps: int) -> Path:
    """The trial's newest checkpoint that matches its manifest, which must be the one of step ``max_steps``
    (sweep trials keep their adapter there, under adapter/). Raises AblationError or CheckpointError."""
    ckpt, problems = newest_good_local(run_dir)
    if ckpt is None:
        raise AblationError(f"no checkpoint in {run_dir}")
    step = read_meta(ckpt)["step"]
    if step != max_steps:
        raise AblationError(f"{run_dir}: the newest good checkpoint {ckpt.name} is of step {step}, not the final "
                            f"step {max_steps}" + (f" (newer ones: {'; '.join(problems)})" if problems else ""))
    return ckpt


def history(ckpt: Path) -> list[dict]:
    """The per-step rows the training loop saved in a checkpoint."""
    return torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)["history"]


def columns(rows: list[dict], keys: tuple = HISTORY_KEYS) -> dict:
    """History rows as compact columns of ``keys`` (None where a row lacks the key), 6 significant digits."""
    def num(v):
        return None if v is None or not math.isfinite(v) else float(f"{v:.6g}")
    return {k: [num(r.get(k)) if k != "step" else r["step"] for r in rows] for k in keys}


def scoring_units(docs: list[str], min_chars: int = UNIT_CHARS) -> list[str]:
    """Held-out documents cut at blank lines into units of whole sections, each at least ``min_chars`` long (a last
    short piece joins the unit before it): the paired bootstrap resamples these."""
    units = []
    for doc in docs:
        parts, cur = re.split(r"\n\s*\n", doc), []
        doc_units = []
        for p in parts:
            cur.append(p)
            if sum(len(x) for x in cur) >= min_chars:
                doc_units.append("\n\n".join(cur))
                cur = []
        if cur:
            if doc_units:
                doc_units[-1] += "\n\n" + "\n\n".join(cur)
            else:
                doc_units.append("\n\n".join(cur))
        units += [u for u in doc_units if u.strip()]
    return units


def collect(stage: str, family_cfg: Config, rows: list[dict]) -> tuple[list[dict], dict]:
    """Each trial's record (arm, seed, history columns, held-out nats per unit) and each seed's unit token counts."""
    from raytrain_scu.driver.evaluate import held_out_documents, score_shard

    trials, units = [], {}
    groups: dict[int, list[tuple[dict, Config, Path]]] = {}
    for row in rows:
        cfg = trial_config(family_cfg, row["params"], row["trial"])
        ckpt = final_checkpoint(Path(run_dir(cfg)), cfg.train.max_steps)
        groups.setdefault(cfg.seed, []).append((row, cfg, ckpt))
    for seed, group in sorted(groups.items()):
        docs = scoring_units(held_out_documents(group[0][1], "val"))
        adapters = {"base": "", **{f"trial{i}": str(ck / "adapter") for i, (_, _, ck) in enumerate(group)}}
        scores = score_shard(asdict(group[0][1]), adapters, docs)
        tokens = scores["tokens"]
        units[str(seed)] = {"tokens": tokens.tolist(),
                            "base_bpt": bits_per_token(float(scores["nats"]["base"].sum()), float(tokens.sum()))}
        for i, (row, cfg, ckpt) in enumerate(group):
            params = flat_params(row["params"])
            nats = scores["nats"][f"trial{i}"]
            c = cfg.controller
            trials.append({"stage": stage, "family": family_of(stage, params), "seed": seed,
                           "trial": row["trial"], "params": params, "target_s": c.target_s, "kp": c.kp, "ki": c.ki,
                           "lambda_min": c.lambda_min, "lambda_max": c.lambda_max, "deadband": c.deadband,
                           "prior_center": c.prior_center, "time_s": row.get("time_s"),
                           "val_bpt": bits_per_token(float(nats.sum()), float(tokens.sum())),
                           "unit_nats": [float(f"{x:.9g}") for x in nats], "history": columns(history(ckpt))})
    return trials, units


def run_sweep_stage(config_path: str, overrides: list[str], choice: dict, seed: int, a) -> dict:
    """The PI-gain sweep: random search with ASHA on held-out BPT at equal tokens; its rows and best trial."""
    from raytrain_scu.driver.sweep import sweep  # Ray is imported when a stage runs, not when the CLI checks its input

    base = resolve(config_path, overrides)
    t = base.train  # ASHA's first rung after --sweep-grace-steps: early on, the weakest penalty scores best (none's
    # held-out BPT is lowest at step 20-30 and worst by the end), so an early rung would stop the gains that win
    grace = max(1, min(math.ceil(a.sweep_grace_steps / t.report_every), t.max_steps // t.report_every))
    cfg = resolve(config_path, [*overrides, "controller.mode=scu", f"seed={seed}", "tune.search=random",
                                "tune.scheduler=asha", "tune.metric=val/data_bpt", "tune.mode=min",
                                f"tune.num_samples={a.sweep_samples}", f"tune.grace_period={grace}"])
    cfg.tune.space = sweep_space_for(choice, a.kp_range, a.ki_range)
    cfg.run.name = f"{cfg.run.name}-sweep"
    out = sweep(cfg)
    rows = [{k: r[k] for k in ("trial", "params", "metric", "steps", "tokens_seen", "status", "time_s") if k in r}
            for r in out["rows"]]
    best = next((r for r in rows if r["status"] == "FINISHED" and math.isfinite(r["metric"])), None)
    if best is None:
        raise AblationError(f"sweep {cfg.run.name}: no trial finished with a finite {cfg.tune.metric}")
    return {"rows": rows, "best": best["params"], "metric": cfg.tune.metric}


# ---------------------------------------------------------------- the results file

def setting(cfg: Config, a) -> dict:
    """What the results were measured on: the config, the stage rules' arguments, the card and the versions."""
    from raytrain_scu.studies.bench.measure import device_name, versions

    return {"config_yaml": to_yaml(cfg, redact=True), "args": {k: v for k, v in vars(a).items() if k != "out"},
            "device": device_name(), "gpus": torch.cuda.device_count(), "versions": versions(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def run_stage(name: str, results: dict, a) -> None:
    """Run one stage (its rule's inputs come from the stages before) and record it in ``results``."""
    seeds, st = a.seeds, results["stages"]
    t0 = time.time()
    if name != "fixed":  # the rule, applied again: the file may hold a choice an older rule made
        st["fixed"]["choice"] = choose_targets(st["fixed"]["trials"], a.target_factors)
    if name == "sweep":
        st["sweep"] = run_sweep_stage(a.config, a.overrides, st["fixed"]["choice"], seeds[0], a)
    else:
        if name == "fixed":
            arms = fixed_arms(seeds, a.lambdas)
        elif name == "scu":
            arms = scu_arms(seeds, st["fixed"]["choice"], a.gains)
        else:
            arms = tuned_arms(seeds, st["fixed"]["choice"], st["sweep"]["best"])
        cfg, rows = run_grid(a.config, a.overrides, name, arms)
        trials, units = collect(name, cfg, rows)
        st[name] = {"trials": trials, "units": units}
        if name == "fixed":
            st[name]["choice"] = choose_targets(trials, a.target_factors)
    from raytrain_scu.studies.bench.measure import device_name

    # each stage may run on another machine, and with GPUs shared between trials (scaling.gpus_per_worker < 1)
    st[name].update(wall_s=time.time() - t0, device=device_name(), gpus=torch.cuda.device_count(),
                    overrides=list(a.overrides))


RULE_ARGS = ("config", "seeds", "lambdas", "target_factors", "gains", "kp_range", "ki_range", "sweep_samples",
             "sweep_grace_steps")  # the flags that define the study: fixed for all of its stages


def check_rules(recorded: dict, a) -> None:
    """A study's rules are the first call's: a later call with another value of a rule flag is refused (naming it);
    a rule flag the file does not hold yet (added before its stage ran) is recorded."""
    # tuples as lists on both sides, as the file holds them
    current = json.loads(json.dumps({k: getattr(a, k) for k in RULE_ARGS}))
    before = json.loads(json.dumps({k: recorded[k] for k in RULE_ARGS if k in recorded}))
    differ = [f"--{k.replace('_', '-')} {current[k]} (the study's: {v})" for k, v in before.items() if v != current[k]]
    if differ:
        raise AblationError(f"this study's rules were fixed by its first call; this call changes {'; '.join(differ)}. "
                            f"Give the recorded values, or start a new study with another --out")
    recorded.update({k: current[k] for k in RULE_ARGS if k not in recorded})
