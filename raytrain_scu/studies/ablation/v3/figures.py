"""The study v3's figures, per plant: held-out BPT against the S each run ends at (the fixed-λ grid and the law on one
curve), and the law's GPU traces (every seed) beside the plant model's stand-in for the plant at the run's scale."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from raytrain_scu.config.schema import ControllerConfig
from raytrain_scu.core import laws
from raytrain_scu.core.plant import Plant, simulate
from raytrain_scu.core.settling import TOL, logit
from raytrain_scu.studies.ablation.report import aligned, end_level
from raytrain_scu.studies.ablation.v2.figures import _plt, save_figure
from raytrain_scu.studies.ablation.v3 import protocol as p
from raytrain_scu.studies.control.fit_plant import R_REF

NAMES = ("curve", "law")  # each plant's figures: {plant}_{name}.png


def _logit(s: float) -> float:
    return logit(min(max(s, 1e-6), 1 - 1e-6))


def curve_figure(trials: list[dict], plant: str, target_s: float, out: Path) -> Path | None:
    """Report-plays BPT of every fixed-λ run and every law run against the logit of the Ŝ it ends at; the rule's
    S* marked. Runs that end near S = 1 (BPT several bits worse) are left off the axis range."""
    runs = [t for t in trials if t["family"] in ("fixed", p.LAW)]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, seed in enumerate(sorted({t["seed"] for t in runs})):
        mine = [(_logit(end_level(t["history"], "ctrl/s_hat")), t) for t in runs if t["seed"] == seed]
        fixed = sorted((x, t) for x, t in mine if t["family"] == "fixed")
        ax.plot([x for x, _ in fixed], [t["report_bpt"] for _, t in fixed], "o-", color=f"C{k}", ms=4, lw=0.8,
                label=f"fixed λ, seed {seed}")
        for x, t in fixed:
            ax.annotate(f"{t['params']['controller.lambda_init']:g}", (x, t["report_bpt"]), fontsize=6,
                        xytext=(2, 2), textcoords="offset points")
        for x, t in mine:
            if t["family"] == p.LAW:
                ax.plot(x, t["report_bpt"], "*", color=f"C{k}", ms=12, mec="k", label=f"law, seed {seed}")
    low = min(t["report_bpt"] for t in runs)
    ax.axvline(_logit(target_s), color="r", ls=":", lw=0.8)
    ax.set(xlabel="logit of the Ŝ the run ends at (mean, last 20% of steps)", ylabel="report-plays BPT",
           ylim=(low - 0.05, low + 0.45), xlim=(-10, 3),
           title=f"{plant}: fixed λ (dots, labelled λ) and the law at S* = {target_s:g} (stars), per seed")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return save_figure(fig, out / f"{plant}_curve.png")


def model_run(t: dict, plant: str, steps: int) -> dict:
    """The law at the run's target on the plant model's stand-in for ``plant`` (``protocol.MODEL``), at the run's
    scale: its first ParamBPT over A's init at the stand-in's init scale sets σ²N, its first DataBPTs the level."""
    m = p.MODEL[plant]
    knobs = {k: v for k, v in m["knobs"].items() if k != "p_scale"}  # the run's own first ParamBPT sets the scale
    _, param, data = aligned(t, ("train/param_bpt", "train/data_bpt"))
    model = Plant(**knobs, p_scale=param[0] / (R_REF * knobs.get("init_scale", 1.0)),
                  data_bpt0=float(np.mean(data[:5])))
    c = ControllerConfig(mode="scu", law=p.LAW, target_s=t["target_s"], lambda_min=t["lambda_min"],
                         lambda_max=t["lambda_max"], lambda_init=t.get("lambda_init", 1.0))
    return simulate(laws.build(c), model, steps, **m["sim"])


def law_figure(trials: list[dict], plant: str, best_lambda: float | None, out: Path) -> Path | None:
    """logit Ŝ − logit S* (top, the settling band shaded) and λ (bottom) of every seed of the law beside the plant
    model's prediction at the first seed's scale (dashed)."""
    runs = sorted([t for t in trials if t["family"] == p.LAW], key=lambda t: t["seed"])
    if not runs:
        return None
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7))
    z = logit(runs[0]["target_s"])
    for t in runs:
        steps, s_hat, lam = aligned(t, ("ctrl/s_hat", "ctrl/lambda"))
        top.plot(steps, [_logit(v) - z for v in s_hat], lw=1, label=f"GPU, seed {t['seed']}")
        bottom.semilogy(steps, lam, lw=1, label=f"GPU, seed {t['seed']}")
    sim = model_run(runs[0], plant, len(aligned(runs[0], ("ctrl/lambda",))[0]))
    top.plot(sim["step"], [_logit(v) - z for v in sim["s_hat"]], "k--", lw=1,
             label=f"model stand-in (seed {runs[0]['seed']}'s scale)")
    bottom.semilogy(sim["step"], sim["lam"], "k--", lw=1, label="model stand-in")
    top.axhspan(-TOL, TOL, color="green", alpha=0.15)
    top.set(title=f"{plant}, logodds law at S* = {runs[0]['target_s']:g}", ylim=(-3, 4), ylabel="logit Ŝ − logit S*")
    if best_lambda:
        bottom.axhline(best_lambda, color="grey", ls=":", lw=0.8)
    bottom.set(xlabel="optimizer step", ylabel="λ (dotted: the grid's best fixed λ)", ylim=(1e-2, 2e1))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return save_figure(fig, out / f"{plant}_law.png")


def figures(results: dict, numbers: dict, out: Path) -> list[Path]:
    """Every figure the recorded trials allow, per plant."""
    out.mkdir(parents=True, exist_ok=True)
    target = results["setting"]["rules"]["target_s"]
    paths = []
    for plant, rec in results["plants"].items():
        choice = numbers.get(plant, {}).get("choice") or {}
        paths += [curve_figure(rec["trials"], plant, target, out),
                  law_figure(rec["trials"], plant, choice.get("best_lambda"), out)]
    return [x for x in paths if x is not None]
