"""``python -m raytrain_scu.ablation CONFIG.yaml key=value...``: does SCU help? none vs fixed λ vs SCU, honestly.

Runs the arms as grid sweeps through the sweep machinery (so every run is a Ray Train run recorded in MLflow, a child
of its arm's sweep), all with the config's steps and data, then scores every adapter on its seed's held-out
documents with ``evaluate.score_shard`` and writes ``docs/ablation.md``-ready markdown, JSON and plots:

- arms: ``none``; ``fixed`` with λ ∈ ``--lambdas``; ``scu`` with S* ∈ ``--targets``; each over ``--seeds``
  (a seed also picks the train/validation split of documents, so every comparison is paired within a seed);
- per arm: held-out BPT (mean over seeds, 95% t-interval), the gap to ``none`` (per-document paired bootstrap,
  pooled over seeds), S tracking error (RMS of Ŝ − S* after warm-up), λ swing (max/min of λ after warm-up), final λ,
  saturation step;
- stability: a grid over (Kp, Ki) at one S*, ranked by RMS tracking error, against the default gains.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from raytrain_scu.checkpoint import CheckpointError, newest_good_local, read_meta
from raytrain_scu.config import Config, run_dir
from raytrain_scu.evaluate import DEFAULT_BOOTSTRAP, paired_bootstrap, score_shard
from raytrain_scu.hardware import resolve
from raytrain_scu.model import bits_per_token
from raytrain_scu.sweep_space import trial_config
from raytrain_scu.train import USER_ERRORS

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
FAMILIES = ("none", "fixed", "scu", "gains")  # the order of the tables' rows; gains is a table of its own


class AblationError(RuntimeError):
    """A trial that cannot be compared (unfinished, or without its final checkpoint); the message says why."""


def arm_sweeps(*, seeds, lambdas, targets, gains) -> dict[str, list[str]]:
    """Overrides for each grid sweep: one per arm family, plus the (Kp, Ki) stability sweep."""
    seed_grid = f"seed: {{grid: {list(seeds)}}}"
    return {
        "none": ["controller.mode=none", f"tune.space={{{seed_grid}}}"],
        "fixed": ["controller.mode=fixed",
                  f"tune.space={{controller.lambda_init: {{grid: {list(lambdas)}}}, {seed_grid}}}"],
        "scu": ["controller.mode=scu",
                f"tune.space={{controller.target_s: {{grid: {list(targets)}}}, {seed_grid}}}"],
        "gains": ["controller.mode=scu", f"seed={seeds[0]}",
                  f"tune.space={{controller.kp: {{grid: {list(gains[0])}}}, controller.ki: {{grid: {list(gains[1])}}}}}"],
    }


def check_finished(sweep_name: str, rows: list[dict]) -> None:
    """Raise AblationError unless every trial of the sweep reached train.max_steps (status DONE).

    An ERROR or PENDING trial has no final adapter yet; a STOPPED one trained fewer steps than the other arms.
    """
    unfinished = [f"{r['trial']} ({r['status']})" for r in rows if r["status"] != "FINISHED"]
    if unfinished:
        raise AblationError(f"sweep {sweep_name}: {len(unfinished)} trial(s) did not reach train.max_steps: "
                            f"{', '.join(unfinished)}. ERROR/PENDING trials resume when the same command is run "
                            f"again; a STOPPED one (time budget, stop_on_saturation) needs those limits lifted and a "
                            f"new run.name, since every arm must train the same steps")


def run_arms(config_path: str, overrides: list[str], sweeps: dict[str, list[str]]) -> dict[str, dict]:
    """Run (or resume) each family's grid sweep; ``{family: {"cfg": sweep config, "rows": trial rows}}`` (rows as
    ``sweep_results.trial_rows`` gives them)."""
    from raytrain_scu.sweep import run_sweep  # the Tune wiring: Ray is imported only when the arms run

    out = {}
    for family, extra in sweeps.items():
        # a grid search runs each combination once (sweep.make_tuner ignores tune.num_samples for it)
        cfg = resolve(config_path, [*overrides, *extra, "tune.search=grid", "tune.scheduler=none"])
        cfg.run.name = f"{cfg.run.name}-{family}"
        rows = run_sweep(cfg)["rows"]
        check_finished(cfg.run.name, rows)
        out[family] = {"cfg": cfg, "rows": rows}
    return out


def trial_run(family_cfg: Config, row: dict) -> tuple[Config, Path]:
    """A trial's full config, built by the sweep's own ``trial_config``, and its Train run directory."""
    cfg = trial_config(family_cfg, row["params"], row["trial"])
    return cfg, Path(run_dir(cfg))


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


def control_stats(hist: list[dict], target_s: float, warmup_frac: float = 0.2) -> dict:
    """RMS of Ŝ − S* and λ swing (max/min) after the first ``warmup_frac`` of steps; final λ; saturation step."""
    rows = [r for r in hist if r.get("step", 0) >= 1 and "ctrl/s_hat" in r]
    cut = rows[int(len(rows) * warmup_frac):]
    err = np.array([r["ctrl/s_hat"] - target_s for r in cut])
    lams = np.array([r["ctrl/lambda"] for r in cut])
    sat = next((r["ctrl/saturated_step"] for r in rows if "ctrl/saturated_step" in r), None)
    return {"rms_tracking_error": float(np.sqrt(np.mean(err ** 2))) if len(err) else math.nan,
            "lambda_swing": float(lams.max() / lams.min()) if len(lams) and lams.min() > 0 else math.nan,
            "final_lambda": rows[-1]["ctrl/lambda"] if rows else math.nan, "saturated_step": sat,
            "final_s_hat": rows[-1]["ctrl/s_hat"] if rows else math.nan}


def arm_label(family: str, params: dict) -> str:
    if family == "fixed":
        return f"fixed λ={params['controller.lambda_init']:g}"
    if family == "scu":
        return f"scu S*={params['controller.target_s']:g}"
    if family == "gains":
        return f"scu Kp={params['controller.kp']:g} Ki={params['controller.ki']:g}"
    return "none"


def mean_ci(values) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return float(v.mean()), math.nan
    return float(v.mean()), T975.get(len(v) - 1, 1.96) * float(v.std(ddof=1)) / math.sqrt(len(v))


def collect(arms: dict[str, dict], *, n_boot: int) -> dict:
    """Score every adapter on its seed's held-out documents and gather the control traces."""
    from raytrain_scu.evaluate import held_out_documents

    trials = []
    for family, a in arms.items():
        for row in a["rows"]:
            cfg, run_dir = trial_run(a["cfg"], row)
            ckpt = final_checkpoint(run_dir, cfg.train.max_steps)
            hist = history(ckpt)
            target = cfg.controller.target_s  # none and fixed: the config's S*, for the tracking error
            trials.append({"family": family, "arm": arm_label(family, row["params"]), "seed": cfg.seed, "cfg": cfg,
                           "adapter": str(ckpt / "adapter"), "history": hist, "target_s": target,
                           **control_stats(hist, target)})
    by_seed: dict[int, list[dict]] = {}
    for t in trials:
        by_seed.setdefault(t["seed"], []).append(t)
    for group in by_seed.values():
        cfg = group[0]["cfg"]  # the arms' model and data, this seed's split
        docs = held_out_documents(cfg, "val")
        # peft adapter names: plain identifiers (no dots), mapped back to the trials by position
        adapters = {"base": "", **{f"trial{i}": t["adapter"] for i, t in enumerate(group)}}
        scores = score_shard(asdict(cfg), adapters, docs)
        tokens = scores["tokens"]
        n_tokens = float(tokens.sum())
        none_nats = scores["nats"][f"trial{next(i for i, t in enumerate(group) if t['family'] == 'none')}"]
        base_bpt = bits_per_token(float(scores["nats"]["base"].sum()), n_tokens)
        for i, t in enumerate(group):
            nats = scores["nats"][f"trial{i}"]
            t.update(nats=nats, tokens=tokens, none_nats=none_nats, base_bpt=base_bpt,
                     val_bpt=bits_per_token(float(nats.sum()), n_tokens))
    return {"trials": trials, "n_boot": n_boot}


def summarize(result: dict) -> list[dict]:
    """One row per arm, its seeds pooled, in :func:`row_order`: what table.md and results.json hold."""
    rows = []
    arms: dict[str, list[dict]] = {}
    for t in result["trials"]:
        arms.setdefault(t["arm"], []).append(t)
    for arm, ts in arms.items():
        mean, half = mean_ci([t["val_bpt"] for t in ts])
        # gap to none: per-document differences of every seed pooled, each seed paired on its own documents
        nats_a = np.concatenate([t["nats"] for t in ts])
        nats_b = np.concatenate([t["none_nats"] for t in ts])
        toks = np.concatenate([t["tokens"] for t in ts])
        gap = paired_bootstrap(nats_a, nats_b, toks, n_boot=result["n_boot"], seed=0)
        rows.append({"arm": arm, "family": ts[0]["family"], "seeds": len(ts), "val_bpt": mean, "val_bpt_ci95": half,
                     "base_bpt": float(np.mean([t["base_bpt"] for t in ts])),
                     "gap_to_none": gap["diff_bpt"], "gap_ci_low": gap["ci_low"], "gap_ci_high": gap["ci_high"],
                     "rms_tracking_error": float(np.mean([t["rms_tracking_error"] for t in ts])),
                     "lambda_swing": float(np.mean([t["lambda_swing"] for t in ts])),
                     "final_lambda": float(np.mean([t["final_lambda"] for t in ts])),
                     "final_s_hat": float(np.mean([t["final_s_hat"] for t in ts])),
                     "saturated_steps": [t["saturated_step"] for t in ts]})
    return sorted(rows, key=row_order)


def plot(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    lam = ("λ applied in step t (ctrl/lambda_applied)", "ctrl/lambda_applied", True)  # beside that step's Ŝ
    for family, ylabel, key, log in [("scu", *lam), ("scu", "Ŝ", "ctrl/s_hat", False),
                                     ("gains", *lam), ("gains", "Ŝ", "ctrl/s_hat", False)]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for t in result["trials"]:
            if t["family"] != family:
                continue
            pts = [(r["step"], r[key]) for r in t["history"] if r.get("step", 0) >= 1 and key in r]
            ax.plot(*zip(*pts), label=f"{t['arm']} seed {t['seed']}", lw=1)
            if key == "ctrl/s_hat":
                ax.axhline(t["target_s"], color="k", ls=":", lw=0.7)
        if log:
            ax.set_yscale("log")
        ax.set(xlabel="optimizer step", ylabel=ylabel, title=f"{family}: {ylabel}(t) (dotted: S*)")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        name = f"{family}_{'s_hat' if key == 'ctrl/s_hat' else 'lambda'}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


HEADER = ("| arm | seeds | held-out BPT (mean ± 95% CI) | gap to none [95% CI] | RMS(Ŝ−S*) | λ swing | final λ | "
          "final Ŝ | saturation step |\n|---|---|---|---|---|---|---|---|---|")


def row_order(row: dict) -> tuple:
    """Family (FAMILIES order), then the arm's swept values as :func:`arm_label` wrote them."""
    return FAMILIES.index(row["family"]), [float(v) for v in re.findall(r"=(\S+)", row["arm"])]


def _num(value, spec: str) -> str:
    """``value`` formatted, or '-' where it is undefined (None, NaN: e.g. the λ swing of λ = 0, one seed's CI)."""
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def markdown(rows: list[dict]) -> str:
    """The arms table (none, fixed, scu), then the gains table, each in :func:`row_order`; takes :func:`summarize`'s
    rows or the results.json they were written to."""
    tables = []
    for families in (FAMILIES[:3], FAMILIES[3:]):
        lines = [HEADER]
        for r in sorted((r for r in rows if r["family"] in families), key=row_order):
            ci = _num(r["val_bpt_ci95"], ".4f")
            bpt = _num(r["val_bpt"], ".4f") + ("" if ci == "-" else f" ± {ci}")
            gap = f"{_num(r['gap_to_none'], '+.4f')} [{_num(r['gap_ci_low'], '+.4f')}, {_num(r['gap_ci_high'], '+.4f')}]"
            sat = ", ".join("-" if s is None else str(s) for s in r["saturated_steps"])
            lines.append(f"| {r['arm']} | {r['seeds']} | {bpt} | {gap} | {_num(r['rms_tracking_error'], '.4g')} | "
                         f"{_num(r['lambda_swing'], '.3g')} | {_num(r['final_lambda'], '.4g')} | "
                         f"{_num(r['final_s_hat'], '.4g')} | {sat} |")
        if len(lines) > 1:
            tables.append("\n".join(lines))
    return "\n\n".join(tables)


def json_ready(value):
    """``value`` with every NaN or infinity as None: JSON has no NaN (``json.dumps`` would write an invalid token)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 with results written, 1 when a trial cannot be compared (re-run to resume), 2 for a bad config."""
    p = argparse.ArgumentParser(prog="python -m raytrain_scu.ablation", description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lambdas", default="0.1,1,10")
    p.add_argument("--targets", default="0.005,0.01,0.02")
    p.add_argument("--kp", default="0.2,0.8")
    p.add_argument("--ki", default="0.05,0.15")
    p.add_argument("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP)
    p.add_argument("--out", default="ablation_out", help="directory for results.json, table.md and plots")
    a = p.parse_args(argv)
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    try:
        resolve(a.config, a.overrides)  # a bad config fails here, before any sweep starts
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sweeps = arm_sweeps(seeds=[int(x) for x in a.seeds.split(",")], lambdas=floats(a.lambdas),
                        targets=floats(a.targets), gains=(floats(a.kp), floats(a.ki)))
    try:
        arms = run_arms(a.config, a.overrides, sweeps)
        result = collect(arms, n_boot=a.bootstrap)
    except (AblationError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = summarize(result)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot(result, out / "plots")
    (out / "table.md").write_text(markdown(rows) + "\n")
    (out / "results.json").write_text(json.dumps(json_ready(rows), indent=1, allow_nan=False, default=str))
    print(markdown(rows))
    print(f"[raytrain_scu] ablation results in {out} (plots: {', '.join(p.name for p in plots)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
