"""The ablation's numbers, tables and plots from its ``results.json`` (``raytrain_scu.ablation`` writes it).

``python -m raytrain_scu.ablation_report DIR [--doc docs/ablation.md]`` rebuilds them without running anything
(``report_cli``).
Per arm: held-out BPT (mean over seeds, 95% t-interval), its gap to ``none`` and to the best fixed λ (the mean over
seeds of each seed's paired difference, with a bootstrap that resamples units within each seed); for SCU
arms, tracking as ``core.settling`` defines it (the settled step on Ŝ and on raw S, the mean |Ŝ − S*| over the second
half, λ reversals of at least 0.5 in ln λ, steps at a bound and the last of them, bound hits, the saturation
detector's step); cost in GPU seconds.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from raytrain_scu.core import settling
from raytrain_scu.studies.ablation.numbers import bootstrap_interval, interval, mean_ci, num, steps, write_doc

ORDER = ("none", "fixed", "scu", "scu_init", "tuned", "gains")
SCU_FAMILIES = ("scu", "scu_init", "tuned", "gains")
PER_SEED = ("settled_step", "settled_step_raw", "last_bound_step", "saturated_step")  # listed per seed, not averaged


# ---------------------------------------------------------------- per trial

def label(t: dict) -> str:
    f, p = t["family"], t["params"]
    if f == "fixed":
        return f"fixed λ={p['controller.lambda_init']:g}"
    if f in ("scu", "scu_init"):
        return f"{f} S*={t['target_s']:.3g}"
    if f in ("gains", "tuned"):
        return f"{f} Kp={t['kp']:.3g} Ki={t['ki']:.3g} S*={t['target_s']:.3g}"
    return "none"


def series(t: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a history column, the step-0 row and missing values left out."""
    h = t["history"]
    pts = [(s, v) for s, v in zip(h["step"], h[key]) if s >= 1 and v is not None]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s), np.asarray(v, dtype=np.float64)


SETTLE_FRAC = 0.2  # the S a run ends at: the mean over this last share of its steps


def end_level(history: dict, key: str) -> float:
    """Mean of ``key`` over the last SETTLE_FRAC of the steps (``s_update``: the update-centred S of each step): the
    S a fixed-λ run ends at, which sets the SCU arms' S*. A level, not a claim that the run settled."""
    if key == "s_update":
        _, upd = series({"history": history}, "train/param_bpt_update")
        _, data = series({"history": history}, "train/data_bpt")
        vals = upd / (data + upd)
    else:
        _, vals = series({"history": history}, key)
    return float(vals[-max(1, int(len(vals) * SETTLE_FRAC)):].mean()) if len(vals) else math.nan


def aligned(t: dict, keys: tuple) -> tuple[list, ...]:
    """(steps, then one list per key) over the steps >= 1 where every key has a value."""
    h = t["history"]
    rows = [(s, *vals) for s, *vals in zip(h["step"], *(h[k] for k in keys))
            if s >= 1 and all(v is not None for v in vals)]
    return tuple(list(c) for c in zip(*rows)) if rows else tuple([] for _ in range(len(keys) + 1))


def tracking(t: dict) -> dict:
    """``core.settling.summary`` of one controlled run (settled step on Ŝ and on raw S, λ reversals of at least 0.5
    in ln λ, second-half error, steps at a bound, the last of them), and how often λ entered a bound."""
    steps, s, s_hat, lam = aligned(t, ("ctrl/s", "ctrl/s_hat", "ctrl/lambda"))
    out = settling.summary(s, s_hat, lam, t["target_s"], t["lambda_min"], t["lambda_max"], steps)
    at = settling.at_bound(lam, t["lambda_min"], t["lambda_max"])
    out["bound_hits"] = sum(1 for i, b in enumerate(at) if b and (i == 0 or not at[i - 1]))
    return out


def trial_stats(t: dict) -> dict:
    _, lam = series(t, "ctrl/lambda")
    out = {"s_end": end_level(t["history"], "ctrl/s_hat"),
           "final_lambda": float(lam[-1]) if len(lam) else math.nan,
           "saturated_step": next((int(v) for v in t["history"]["ctrl/saturated_step"] if v is not None), None)}
    for key in ("train/param_bpt_a", "train/param_bpt_b", "train/param_bpt_update"):
        _, v = series(t, key)
        out[key.split("/")[1]] = float(v[-1]) if len(v) else math.nan
    if t["family"] in SCU_FAMILIES and len(lam):
        out.update(tracking(t))
    return out


# ---------------------------------------------------------------- per arm

def all_trials(results: dict) -> list[dict]:
    return [t for st in results["stages"].values() for t in st.get("trials", [])]


def units_of(results: dict, seed: int) -> np.ndarray:
    """A seed's unit token counts, the same in every stage (checked)."""
    found = [np.asarray(st["units"][str(seed)]["tokens"]) for st in results["stages"].values()
             if str(seed) in st.get("units", {})]
    if any(not np.array_equal(found[0], f) for f in found[1:]):
        raise ValueError(f"seed {seed}: the held-out units differ between stages")
    return found[0]


def gap(results: dict, ts: list[dict], ref: dict[int, dict], n_boot: int, ci: float = 0.95) -> dict:
    """BPT(arm) − BPT(reference): the mean over seeds of each seed's difference on its own held-out units, and a
    stratified paired bootstrap of it (units resampled within each seed, arm and reference together; seeds weigh
    alike). The interval covers the held-out sample only: not how another training seed would have gone."""
    pairs = [(t, ref[t["seed"]]) for t in ts if t["seed"] in ref]
    if not pairs:
        return {"diff_bpt": math.nan, "ci_low": math.nan, "ci_high": math.nan}
    point, units = [], []
    for t, r in pairs:
        d = np.asarray(t["unit_nats"]) - np.asarray(r["unit_nats"])
        tok = units_of(results, t["seed"]).astype(np.float64)
        point.append(d.sum() / tok.sum() / math.log(2))
        units.append((t["unit_nats"], r["unit_nats"], tok))
    lo, hi = bootstrap_interval(units, n_boot, ci)
    return {"diff_bpt": float(np.mean(point)), "ci_low": lo, "ci_high": hi}


def summarize(results: dict, n_boot: int) -> list[dict]:
    """One row per arm (seeds pooled), in ORDER then by the arm's values."""
    trials = all_trials(results)
    choice = results["stages"]["fixed"]["choice"]
    none = {t["seed"]: t for t in trials if t["family"] == "none"}
    best = {t["seed"]: t for t in trials if t["family"] == "fixed"
            and t["params"]["controller.lambda_init"] == choice["best_lambda"]}
    arms: dict[str, list[dict]] = {}
    for t in trials:
        arms.setdefault(label(t), []).append(t)
    rows = []
    for name, ts in arms.items():
        stats = [trial_stats(t) for t in ts]
        mean, half = mean_ci([t["val_bpt"] for t in ts])
        g_none, g_best = gap(results, ts, none, n_boot), gap(results, ts, best, n_boot)
        row = {"arm": name, "family": ts[0]["family"], "seeds": sorted(t["seed"] for t in ts), "val_bpt": mean,
               "val_bpt_ci95": half, "per_seed_val_bpt": {str(t["seed"]): t["val_bpt"] for t in ts},
               "gap_none": g_none["diff_bpt"], "gap_none_ci": [g_none["ci_low"], g_none["ci_high"]],
               "gap_best_fixed": g_best["diff_bpt"], "gap_best_fixed_ci": [g_best["ci_low"], g_best["ci_high"]],
               "target_s": ts[0]["target_s"] if ts[0]["family"] in SCU_FAMILIES else None,
               "time_s": float(np.mean([t["time_s"] for t in ts])) if all(t["time_s"] for t in ts) else math.nan,
               "sort": [ts[0]["params"].get("controller.lambda_init", 0), ts[0]["target_s"], ts[0]["kp"], ts[0]["ki"]]}
        for key in stats[0]:
            vals = [s.get(key) for s in stats]
            if key in PER_SEED:
                row[key] = vals
            elif all(isinstance(v, (int, float)) for v in vals):
                row[key] = float(np.mean(vals))
        rows.append(row)
    return sorted(rows, key=lambda r: (ORDER.index(r["family"]), r["sort"]))


# ---------------------------------------------------------------- tables

def _gap(v, ci) -> str:
    return f"{num(v, '+.4f')} {interval(ci[0], ci[1])}"


def outcome_table(rows: list[dict]) -> str:
    lines = ["| arm | seeds | held-out BPT (mean ± 95% CI) | gap to none [95% CI] | gap to best fixed λ [95% CI] | "
             "Ŝ at the end (mean, last 20%) | final λ | Tune wall s / trial |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = num(r["val_bpt_ci95"], ".4f")
        lines.append(f"| {r['arm']} | {len(r['seeds'])} | {num(r['val_bpt'], '.4f')}{'' if ci == '-' else ' ± ' + ci} | "
                     f"{_gap(r['gap_none'], r['gap_none_ci'])} | {_gap(r['gap_best_fixed'], r['gap_best_fixed_ci'])} | "
                     f"{num(r['s_end'], '.4g')} | {num(r['final_lambda'], '.3g')} | {num(r['time_s'], '.0f')} |")
    return "\n".join(lines)


def control_table(rows: list[dict]) -> str:
    """Tracking as ``core.settling`` defines it: settled = at least 100 steps to the end with |logit Ŝ − logit S*|
    ≤ 0.1, λ strictly inside its bounds and max λ / min λ ≤ 1.5."""
    lines = ["| arm | seeds | S* | settled on Ŝ at step (per seed) | settled on raw S at step (per seed) | "
             "mean abs(Ŝ − S*), second half | λ reversals (≥ 0.5 in ln λ) | steps at a bound | last step at a bound "
             "(per seed) | bound hits | saturation step (per seed) | ParamBPT A / B at the end |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["family"] not in SCU_FAMILIES:
            continue
        lines.append(f"| {r['arm']} | {len(r['seeds'])} | {num(r['target_s'], '.3g')} | {steps(r['settled_step'])} | "
                     f"{steps(r['settled_step_raw'])} | {num(r.get('second_half_error'), '.4g')} | "
                     f"{num(r.get('reversals'), '.1f')} | {num(r.get('steps_at_bound'), '.1f')} | "
                     f"{steps(r['last_bound_step'])} | {num(r.get('bound_hits'), '.1f')} | "
                     f"{steps(r['saturated_step'])} | {num(r.get('param_bpt_a'), '.3g')} / "
                     f"{num(r.get('param_bpt_b'), '.3g')} |")
    return "\n".join(lines)


def sweep_table(sweep: dict) -> str:
    lines = [f"| trial | Kp | Ki | S* | {sweep['metric']} | steps | status |", "|---|---|---|---|---|---|---|"]
    for r in sweep["rows"]:
        p = r["params"]
        lines.append(f"| {r['trial']} | {p['controller.kp']:.3g} | {p['controller.ki']:.3g} | "
                     f"{p['controller.target_s']:.3g} | {num(r['metric'], '.5f')} | {r['steps']} | {r['status']} |")
    return "\n".join(lines)


def cost(results: dict, rows: list[dict]) -> dict:
    """GPU seconds: the whole fixed-λ grid on one seed (what finding the best λ takes) against one SCU run."""
    fixed = [t for t in all_trials(results) if t["family"] == "fixed" and t["seed"] == results["setting"]["args"]["seeds"][0]]
    scu = [r["time_s"] for r in rows if r["family"] == "scu"]
    return {"grid_runs": len(fixed), "grid_gpu_s": float(sum(t["time_s"] or math.nan for t in fixed)),
            "scu_gpu_s": float(np.mean(scu)) if scu else math.nan}


# ---------------------------------------------------------------- plots

def _fig(title: str, ylabel: str, log: bool = False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
    if log:
        ax.set_yscale("log")
    return plt, fig, ax


def _save(plt, fig, ax, path: Path) -> Path:
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(results: dict, out: Path) -> list[Path]:
    """Representative arms on the first seed: the regime (held-out BPT over steps), Ŝ against S* and λ for the SCU
    arms, the stability grid and the tuned gains, and ParamBPT's A and B parts."""
    out.mkdir(parents=True, exist_ok=True)
    trials = all_trials(results)
    choice = results["stages"]["fixed"]["choice"]
    seed0 = results["setting"]["args"]["seeds"][0]
    first = [t for t in trials if t["seed"] == seed0]
    best = [t for t in first if t["family"] == "fixed" and t["params"]["controller.lambda_init"] == choice["best_lambda"]]
    mid = sorted(choice["targets"])[len(choice["targets"]) // 2]
    scu_mid = [t for t in first if t["family"] == "scu" and t["target_s"] == mid]
    paths = []
    plt, fig, ax = _fig(f"held-out BPT over training (seed {seed0})", "val/data_bpt (fixed validation blocks)")
    for t in [t for t in first if t["family"] in ("none", "fixed", "tuned")] + scu_mid:
        ax.plot(*series(t, "val/data_bpt"), label=label(t), lw=2 if t in best or t["family"] != "fixed" else 0.8)
    paths.append(_save(plt, fig, ax, out / "regime.png"))
    for fam in ("scu", "scu_init", "gains", "tuned"):  # the gains grid and the tuned gains beside the default's
        group = [t for t in first if t["family"] == fam] + (scu_mid if fam in ("gains", "tuned") else [])
        if not group:
            continue
        plt, fig, ax = _fig(f"{fam}: Ŝ(t) against S* (dotted), seed {seed0}", "Ŝ")
        for t in group:
            line, = ax.plot(*series(t, "ctrl/s_hat"), label=label(t), lw=1)
            ax.axhline(t["target_s"], color=line.get_color(), ls=":", lw=0.8)
        paths.append(_save(plt, fig, ax, out / f"{fam}_s_hat.png"))
        plt, fig, ax = _fig(f"{fam}: λ(t), seed {seed0} (dashed: the best fixed λ)", "λ", log=True)
        for t in group:
            ax.plot(*series(t, "ctrl/lambda"), label=label(t), lw=1)
        ax.axhline(choice["best_lambda"], color="k", ls="--", lw=0.8)
        paths.append(_save(plt, fig, ax, out / f"{fam}_lambda.png"))
    plt, fig, ax = _fig(f"ParamBPT's parts (seed {seed0})", "bits per training token", log=True)
    for t in [t for t in first if t["family"] == "none"] + best + scu_mid:
        for key, ls in (("train/param_bpt_a", "-"), ("train/param_bpt_b", "--")):
            ax.plot(*series(t, key), ls=ls, lw=1, label=f"{label(t)}: {key.split('_')[-1].upper()}")
    paths.append(_save(plt, fig, ax, out / "param_bpt_parts.png"))
    return paths


# ---------------------------------------------------------------- the document

def setting_text(results: dict) -> str:
    s = results["setting"]
    v = s["versions"]
    return (f"**Machine:** {s['gpus']} × {s['device']}; torch {v.get('torch')}, CUDA {v.get('cuda')}, transformers "
            f"{v.get('transformers')}, peft {v.get('peft')}, Ray {v.get('ray')}. Started {s['started']}.\n\n"
            + "".join(f"- stage `{k}`: {st['gpus']} × {st['device']}, {st['wall_s'] / 60:.1f} min, overrides "
                      f"`{' '.join(st['overrides'])}`\n" for k, st in results["stages"].items() if "device" in st)
            + "\n"
            f"**Rules and grids** (fixed before the first trial): `{json.dumps(s['args'])}`\n\n"
            f"<details><summary>The study's config (every trial's base)</summary>\n\n```yaml\n{s['config_yaml']}```\n"
            f"</details>")


def markdown(results: dict, rows: list[dict], plot_paths: list[Path], rel: str) -> str:
    choice = results["stages"]["fixed"]["choice"]
    parts = [setting_text(results),
             f"**From the fixed stage** (the rule picks): best fixed λ = {choice['best_lambda']:g}; its runs end at "
             f"S = {choice['s_best']:.4g} (mean Ŝ over the last 20% of steps; update-centred S = "
             f"{choice['s_update_best']:.4g}); SCU targets "
             f"{choice['targets']}, update-centred targets {choice['targets_init']}.",
             "### Held-out BPT\n\n" + outcome_table(rows),
             "### Tracking and λ\n\nSettled (`core.settling`): from some step to the end, at least 100 steps with "
             "abs(logit Ŝ − logit S*) ≤ 0.1, λ strictly inside its bounds and max λ / min λ ≤ 1.5; '-' = never. "
             "Reversals count only moves of ln λ by at least 0.5.\n\n" + control_table(rows)]
    if "sweep" in results["stages"]:
        sw = results["stages"]["sweep"]
        parts.append(f"### PI-gain sweep (ASHA on {sw['metric']} at equal tokens)\n\nBest: "
                     f"`{json.dumps(sw['best'])}`\n\n" + sweep_table(sw))
    c = cost(results, rows)
    parts.append(f"### Cost\n\nEvery run trains the same steps. The fixed-λ grid on one seed: {c['grid_runs']} runs "
                 f"({num(c['grid_gpu_s'], '.0f')} s of Tune wall time); one SCU run: {num(c['scu_gpu_s'], '.0f')} s. "
                 f"Tune's wall time per trial includes start-up, any wait for a free GPU and, where a stage's trials "
                 f"shared a GPU (`scaling.gpus_per_worker` < 1 in the machine list above), its sharing: compare run "
                 f"counts.")
    parts.append("### Plots\n\n" + "\n".join(f"![{p.stem}]({rel}/{p.name})" for p in plot_paths))
    return "\n\n".join(parts)


def write(results: dict, out: Path, *, n_boot: int = 2000, doc: Path | None = None) -> str:
    """summary.json, table.md and plots under ``out``; with ``doc``, also that document: ``out/notes.md`` (the
    hand-written reading of the numbers, if there) followed by the generated tables. Returns the markdown."""
    rows = summarize(results, n_boot)
    plot_paths = plots(results, out / "plots")
    text = markdown(results, rows, plot_paths, "plots")
    (out / "table.md").write_text(text + "\n")
    from raytrain_scu.studies.ablation.results import json_ready

    (out / "summary.json").write_text(json.dumps(json_ready(rows), indent=1, allow_nan=False))
    if doc is not None:
        write_doc(out, doc, lambda rel: markdown(results, rows, plot_paths, str(rel / "plots")))
    return text
