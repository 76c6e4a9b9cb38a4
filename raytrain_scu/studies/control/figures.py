"""The figures of docs/control.md: the model's open-loop fit, the spec's law on the model beside the GPU traces, and
the logodds law on the model.

    python -m raytrain_scu.studies.control.figures docs/ablation/results.json --out docs/control
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from raytrain_scu.core.controller import SCUController
from raytrain_scu.core.plant import FITTED, Plant, simulate
from raytrain_scu.studies.control import fit_plant, screen

TARGETS = (0.137, 0.241, 0.388)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fit_figure(runs: list[dict], out: Path) -> None:
    """Open-loop replay against the trace, held-out seed 3: ParamBPT and its parts."""
    plt = _plt()
    pick = [r for r in runs if r["seed"] == 3 and (r["family"] in ("scu", "none") or
                                                    r["lam"][0] in (0.01, 0.1, 1.0, 10.0))][:8]
    steps = len(pick[0]["P"])
    pa, pb, _ = fit_plant.replay(dict(FITTED), pick, steps)
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharey=True)
    for ax, r, a, b in zip(axes.flat, pick, pa, pb):
        ax.semilogy(r["P"], "k", lw=1.2, label="ParamBPT, GPU")
        ax.semilogy(a + b, "k--", lw=1.2, label="model")
        ax.semilogy(r["PA"], "tab:blue", lw=0.6, label="A part, GPU")
        ax.semilogy(a, "--", color="tab:blue", lw=0.6, label="A, model")
        ax.semilogy(r["PB"], "tab:red", lw=0.6, label="B part, GPU")
        ax.semilogy(b, "--", color="tab:red", lw=0.6, label="B, model")
        ax.set(ylim=(1e-4, 1e3), title=r["name"])
        ax.title.set_fontsize(8)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Open-loop replay of the held-out seed (logged λ in, ParamBPT out): solid GPU, dashed model")
    fig.tight_layout()
    fig.savefig(out / "fit.png", dpi=80)
    plt.close(fig)


def seed_plant(run: dict) -> Plant:
    """The fitted plant at one GPU run's scale: its N (first ParamBPT / 65) and its base DataBPT."""
    return Plant(p_scale=run["P"][0] / fit_plant.R_REF, data_bpt0=float(np.nanmean(run["D"][:5])))


def spec_figure(runs: list[dict], out: Path) -> None:
    """The spec's law (default gains, the study's bounds) in closed loop on the model beside the GPU run, seed 0."""
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), sharex=True)
    for j, target in enumerate(TARGETS):
        gpu = next(r for r in runs if r["family"] == "scu" and r["seed"] == 0 and r["name"].startswith(
            f"scu S*={target} "))
        model = simulate(SCUController(target_s=target, **screen.V1), seed_plant(gpu), len(gpu["P"]))
        steps = np.arange(1, len(gpu["P"]) + 1)
        axes[0, j].semilogy(steps, gpu["lam"], "k", label="λ applied, GPU (seed 0)")
        axes[0, j].semilogy(model["step"], model["lam_applied"], "tab:orange", label="λ applied, model")
        axes[0, j].set(title=f"spec law, default gains, S* = {target}", ylim=(5e-5, 2e3))
        s_gpu = gpu["P"] / (gpu["P"] + gpu["D"])
        axes[1, j].plot(steps, s_gpu, "k", lw=0.8, label="S, GPU")
        axes[1, j].plot(model["step"], model["s"], "tab:orange", lw=0.8, label="S, model")
        axes[1, j].axhline(target, color="grey", ls="--")
        axes[1, j].set(xlabel="optimizer step", ylim=(0, 1))
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "spec_cycle.png", dpi=80)
    plt.close(fig)


def logodds_figure(out: Path) -> None:
    """The logodds law with its defaults on the fitted plant and three perturbed ones: log-odds error and λ."""
    plt = _plt()
    names = ("fitted", "lr 5e-4", "LoRA r64 (init x4, speed x2)", "lag 10 steps")
    fig, axes = plt.subplots(2, len(names), figsize=(17, 7))
    for j, name in enumerate(names):
        plant, kw = screen.PLANTS[name]
        for target in TARGETS:
            o = simulate(screen.logodds(target), plant, 300, **kw)
            z = math.log(target / (1 - target))
            err = [math.log(s / (1 - s)) - z for s in o["s_hat"]]
            axes[0, j].plot(o["step"], err, lw=1, label=f"S* = {target}")
            axes[1, j].semilogy(o["step"], o["lam"], lw=1, label=f"S* = {target}")
        axes[0, j].axhspan(-0.1, 0.1, color="green", alpha=0.15)
        axes[0, j].set(title=f"logodds law: {name}", ylim=(-2, 3), ylabel="logit Ŝ − logit S*")
        axes[1, j].set(ylim=(1e-4, 1e3), xlabel="optimizer step", ylabel="λ")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "logodds_model.png", dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raytrain_scu.studies.control.figures", description=__doc__.split("\n")[0])
    ap.add_argument("results", help="the GPU study's results.json")
    ap.add_argument("--out", required=True, help="the folder the PNGs go to")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = fit_plant.load_runs(args.results)
    fit_figure(runs, out)
    spec_figure(runs, out)
    logodds_figure(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
