"""The study v2's figures, in the style of v1's report and ``studies.control.figures``: early stopping of ``none`` on
the select and report plays, and each law's GPU trace (every seed) with the plant model's prediction beside it."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from raytrain_scu.config.schema import ControllerConfig
from raytrain_scu.core import laws
from raytrain_scu.core.plant import Plant, simulate
from raytrain_scu.core.settling import TOL, logit
from raytrain_scu.studies.ablation.report import aligned
from raytrain_scu.studies.ablation.v2 import protocol as p
from raytrain_scu.studies.control.fit_plant import R_REF


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 80) -> Path:
    """Write ``fig`` to ``path`` with a tight layout, and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)
    return path


def model_run(t: dict, plant: str, steps: int) -> dict:
    """The plant model driven by the trial's law at its target, at the trial's scale: ParamBPT's first value sets σ²N
    (over A's init at this plant's rank, ``init_per_r16`` x 65 bits), its first DataBPTs the base level."""
    m = p.PLANTS[plant]["model"]
    _, param, data = aligned(t, ("train/param_bpt", "train/data_bpt"))
    model = Plant(**m["knobs"], p_scale=param[0] / (R_REF * m["init_per_r16"]),
                  data_bpt0=float(np.mean(data[:5])))
    c = ControllerConfig(mode="scu", law=t["law"], target_s=t["target_s"], lambda_min=t["lambda_min"],
                         lambda_max=t["lambda_max"], lambda_init=t.get("lambda_init", 1.0))
    return simulate(laws.build(c), model, steps, lr=m["lr"])


def early_stopping_figure(trials: list[dict], plant: str, out: Path) -> Path | None:
    """``none``'s held-out BPT at every eval on the select (solid) and report (dashed) plays; the select plays' best
    step marked."""
    nones = sorted([t for t in trials if t["family"] == "none" and t.get("evals")], key=lambda t: t["seed"])
    if not nones:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for t in nones:
        steps = [e["step"] for e in t["evals"]]
        line, = ax.plot(steps, [e["select_bpt"] for e in t["evals"]], lw=1.2, label=f"select plays, seed {t['seed']}")
        ax.plot(steps, [e["report_bpt"] for e in t["evals"]], ls="--", lw=1, color=line.get_color(),
                label=f"report plays, seed {t['seed']}")
        best = p.early_stop(t)
        ax.axvline(best["step"], color=line.get_color(), ls=":", lw=0.8)
    ax.set(xlabel="optimizer step", ylabel="held-out BPT (whole plays, units)",
           title=f"{plant}: none, scored at every eval (dotted: the early-stopping step)")
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, out / f"{plant}_early_stopping.png", dpi=110)


def law_figure(trials: list[dict], plant: str, law: str, best_lambda: float | None, out: Path) -> Path | None:
    """Per target: logit Ŝ − logit S* (top, the settling band shaded) and λ (bottom) of every seed on the GPU
    (solid) beside the plant model's prediction at the first seed's scale (dashed)."""
    runs = sorted([t for t in trials if t["family"] == law], key=lambda t: (t["target_s"], t["seed"]))
    targets = sorted({t["target_s"] for t in runs})
    if not targets:
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, len(targets), figsize=(5 * len(targets), 7), squeeze=False)
    for j, target in enumerate(targets):
        top, bottom = axes[0, j], axes[1, j]
        z = logit(target)
        group = [t for t in runs if t["target_s"] == target]
        for t in group:
            steps, s_hat, lam = aligned(t, ("ctrl/s_hat", "ctrl/lambda"))
            top.plot(steps, [logit(min(max(v, 1e-12), 1 - 1e-12)) - z for v in s_hat], lw=1,
                     label=f"GPU, seed {t['seed']}")
            bottom.semilogy(steps, lam, lw=1, label=f"GPU, seed {t['seed']}")
        sim = model_run(group[0], plant, len(aligned(group[0], ("ctrl/lambda",))[0]))
        top.plot(sim["step"], [logit(min(max(v, 1e-12), 1 - 1e-12)) - z for v in sim["s_hat"]], "k--", lw=1,
                 label=f"model (seed {group[0]['seed']}'s scale)")
        bottom.semilogy(sim["step"], sim["lam"], "k--", lw=1, label="model")
        top.axhspan(-TOL, TOL, color="green", alpha=0.15)
        top.set(title=f"{plant}, {law} law, S* = {target:g}", ylim=(-3, 4), ylabel="logit Ŝ − logit S*")
        if best_lambda:
            bottom.axhline(best_lambda, color="grey", ls=":", lw=0.8)
        bottom.set(xlabel="optimizer step", ylabel="λ (dotted: the best fixed λ)", ylim=(5e-5, 2e3))
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    return save_figure(fig, out / f"{plant}_{law}.png")


def figures(results: dict, numbers: dict, out: Path) -> list[Path]:
    """Every figure the recorded trials allow, per plant."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for plant, rec in results["plants"].items():
        choice = numbers.get(plant, {}).get("choice") or {}
        paths.append(early_stopping_figure(rec["trials"], plant, out))
        paths += [law_figure(rec["trials"], plant, law, choice.get("best_lambda"), out) for law in p.LAWS]
    return [x for x in paths if x is not None]
