"""PNG plots of a run's control trace (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path


def _series(history: list, key: str):
    pts = [(r["step"], r[key]) for r in history if key in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_history(history: list, out_dir: str | Path, *, target_s: float, title: str = "") -> list[Path]:
    """Write s_tracking.png, lambda.png, bpt.png, val_bpt.png and tokens_per_s.png; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (("s_tracking.png", _s_tracking), ("lambda.png", _lambda), ("bpt.png", _bpt),
                       ("val_bpt.png", _val_bpt), ("tokens_per_s.png", _throughput)):
        fig = draw(plt, history, target_s=target_s, title=title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def _s_and_target(ax, history: list, target_s: float) -> None:
    ax.plot(*_series(history, "ctrl/s"), label="S", alpha=0.5, lw=1)
    ax.plot(*_series(history, "ctrl/s_hat"), label="Ŝ (EMA)", lw=2)
    ax.axhline(target_s, color="k", ls="--", label=f"S* = {target_s:g}")


def _s_tracking(plt, history: list, *, target_s: float, title: str):
    fig, ax = plt.subplots(figsize=(7, 4))
    _s_and_target(ax, history, target_s)
    ax.set(xlabel="optimizer step", ylabel="S = ParamBPT / (DataBPT + ParamBPT)", title=f"{title}: S and Ŝ vs S*")
    ax.legend()
    return fig


def _lambda(plt, history: list, *, target_s: float, title: str):
    # λ the loss used in step t (ctrl/lambda_applied) under the S of that step; ctrl/lambda is the value after
    # step t's update, i.e. step t+1's, and would sit one step off
    fig, (ax_s, ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    _s_and_target(ax_s, history, target_s)
    ax_s.set(ylabel="S", title=f"{title}: λ the loss used at each step, beside that step's S")
    ax_s.legend()
    steps, lams = _series(history, "ctrl/lambda_applied")
    ax.plot(steps, lams, lw=2, label="λ applied in step t (ctrl/lambda_applied)")
    if lams and min(lams) > 0:
        ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="λ applied")
    ax.legend()
    return fig


def _bpt(plt, history: list, *, target_s: float, title: str):
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(history, "train/data_bpt"), label="DataBPT (train)")
    ax2 = ax.twinx()
    ax2.plot(*_series(history, "train/param_bpt"), color="tab:red", label="ParamBPT")
    ax.set(xlabel="optimizer step", ylabel="DataBPT (bits/token)", title=f"{title}: DataBPT and ParamBPT")
    ax2.set_ylabel("ParamBPT (bits/token)", color="tab:red")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    return fig


def _val_bpt(plt, history: list, *, target_s: float, title: str):
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(history, "val/data_bpt"), marker="o")
    ax.set(xlabel="optimizer step", ylabel="held-out DataBPT (bits/token)", title=f"{title}: validation BPT")
    return fig


def _throughput(plt, history: list, *, target_s: float, title: str):
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(history, "perf/tokens_per_s"), marker=".")
    ax.set(xlabel="optimizer step", ylabel="tokens/s (all workers)", title=f"{title}: throughput")
    return fig
