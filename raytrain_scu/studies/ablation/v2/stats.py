"""The study v2's numbers from its records: each run's tracking (``core.settling``), each arm's held-out BPT, the
paired gaps with both intervals, and the decision rule of docs/control.md §7. No Ray and no training here.

A gap g_s = BPT(arm, seed s) − BPT(reference, seed s), both on seed s's report plays. Its interval **across seeds**
is the t-interval of the g_s (mean ± t·sd/√n; with 3 seeds t = 4.303): how another training seed could go. Beside
it, v1's **within-seed** paired bootstrap: units resampled within each seed, arm and reference together, the seeds'
gaps averaged: the held-out sample's noise only.
"""
from __future__ import annotations

import math

import numpy as np

from raytrain_scu.core import settling
from raytrain_scu.core.model.flops import bits_per_token
from raytrain_scu.studies.ablation.numbers import bootstrap_interval, mean_ci
from raytrain_scu.studies.ablation.report import aligned, end_level
from raytrain_scu.studies.ablation.v2 import protocol as p

PASS_SHARE = 16 / 18  # the tracking rule: the logodds law passes in at least 16 of its 18 runs


# ---------------------------------------------------------------- intervals

def t_interval(values) -> dict:
    """Mean and its two-sided 95% t-interval over ``values`` (one per seed); no interval from one value."""
    mean, half = mean_ci(values)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values)}


def bpt(nats, tokens) -> float:
    """Bits per token of per-unit nats and token counts, summed over the units (the study's one BPT)."""
    return bits_per_token(float(np.sum(nats)), float(np.sum(tokens)))


def gap(arm: dict, ref: dict, tokens: dict, n_boot: int) -> dict:
    """The paired gap of ``arm`` to ``ref`` ({seed: report-plays nats per unit}; ``tokens`` the same per seed) over
    the seeds both have: per seed, its mean with the across-seed t-interval, and the within-seed bootstrap."""
    seeds = sorted(set(arm) & set(ref))
    per_seed = {s: bpt(arm[s], tokens[s]) - bpt(ref[s], tokens[s]) for s in seeds}
    t = t_interval(list(per_seed.values()))
    lo, hi = bootstrap_interval([(arm[s], ref[s], tokens[s]) for s in seeds], n_boot)
    return {"per_seed": per_seed, "mean": t["mean"], "t_low": t["low"], "t_high": t["high"], "boot_low": lo,
            "boot_high": hi, "n": len(seeds)}


# ---------------------------------------------------------------- per run and per arm

def run_tracking(t: dict) -> dict:
    """``core.settling.summary`` of one controlled run, and whether it passes the decision's tracking rule (settled
    on Ŝ, λ at a bound in no step after BOUND_AFTER)."""
    steps, s, s_hat, lam = aligned(t, ("ctrl/s", "ctrl/s_hat", "ctrl/lambda"))
    out = settling.summary(s, s_hat, lam, t["target_s"], t["lambda_min"], t["lambda_max"], steps)
    late = out["last_bound_step"] is not None and out["last_bound_step"] > p.BOUND_AFTER
    out["passes"] = out["settled_step"] is not None and not late
    return out


def arm_rows(trials: list[dict]) -> list[dict]:
    """One row per arm: held-out BPT on the select and the report plays, the Ŝ it ends at, Tune's wall time."""
    rows = []
    for family in p.FAMILIES:
        for name, ts in p.by_arm(trials, family).items():
            rep = t_interval([t["report_bpt"] for t in ts])
            times = [t["time_s"] for t in ts if t.get("time_s")]
            rows.append({"arm": name, "family": family, "seeds": sorted(t["seed"] for t in ts),
                         "select_bpt": float(np.mean([t["select_bpt"] for t in ts])), "report_bpt": rep["mean"],
                         "report_half": rep["high"] - rep["mean"] if rep["n"] > 1 else math.nan,
                         "s_end": float(np.mean([end_level(t["history"], "ctrl/s_hat") for t in ts])),
                         "time_s": float(np.mean(times)) if times else math.nan, "sort": _sort_key(ts[0])})
    return sorted(rows, key=lambda r: (p.FAMILIES.index(r["family"]), r["sort"]))


def _sort_key(t: dict) -> float:
    return t["params"].get("controller.lambda_init", 0.0) if t["family"] == "fixed" else (t["target_s"] or 0.0)


def tracking_rows(trials: list[dict]) -> list[dict]:
    """One row per law arm: each seed's tracking summary, and the counts the decision reads."""
    rows = []
    for law in p.LAWS:
        for name, ts in sorted(p.by_arm(trials, law).items(), key=lambda kv: kv[1][0]["target_s"]):
            ts = sorted(ts, key=lambda t: t["seed"])
            runs = [run_tracking(t) for t in ts]
            rows.append({"arm": name, "family": law, "target_s": ts[0]["target_s"], "seeds": [t["seed"] for t in ts],
                         "runs": runs, "settled": sum(r["settled_step"] is not None for r in runs),
                         "settled_raw": sum(r["settled_step_raw"] is not None for r in runs),
                         "passes": sum(r["passes"] for r in runs)})
    return rows


# ---------------------------------------------------------------- per plant, and the decision

GAPS = (  # (name, arm, reference): the protocol's three gaps first, then two for context
    ("logodds − best fixed λ", "logodds", "best"),
    ("logodds − early stopping", "logodds", "early"),
    ("logodds − spec law", "logodds", "spec"),
    ("spec law − best fixed λ", "spec", "best"),
    ("best fixed λ − early stopping", "best", "early"),
)


def _nats(ts: list[dict]) -> dict:
    return {t["seed"]: t["report_nats"] for t in ts}


def plant_numbers(plant: dict, rules: dict, n_boot: int) -> dict:
    """A plant's numbers: arms, tracking, what the select plays chose, early stopping per seed, and the gaps (once
    the stages they need are recorded)."""
    trials, seeds, lambdas = plant["trials"], rules["seeds"], rules["lambdas"]
    out = {"arms": arm_rows(trials), "tracking": tracking_rows(trials), "choice": None, "selected": {},
           "early_stop": {}, "gaps": [], "laws_done": False,
           "fixed_done": p.stage_done(trials, "fixed", seeds, lambdas)}
    for t in p.by_arm(trials, "none").get("none", []):
        if t.get("evals"):
            out["early_stop"][t["seed"]] = p.early_stop(t)
    if out["early_stop"]:
        es = list(out["early_stop"].values())
        rep = t_interval([e["report_bpt"] for e in es])
        out["arms"].insert(1, {"arm": "none, stopped early", "family": "none", "seeds": sorted(out["early_stop"]),
                               "select_bpt": float(np.mean([e["select_bpt"] for e in es])), "report_bpt": rep["mean"],
                               "report_half": rep["high"] - rep["mean"] if rep["n"] > 1 else math.nan,
                               "s_end": math.nan, "time_s": math.nan})
    if not out["fixed_done"]:
        return out
    out["choice"] = choice = p.choose_targets(trials, rules["target_factors"])
    out["laws_done"] = p.stage_done(trials, "laws", seeds, lambdas, choice["targets"])
    arms = {f: p.by_arm(trials, f) for f in p.FAMILIES}
    refs = {"best": _nats(arms["fixed"][choice["best_arm"]]),
            "early": {s: e["report_nats"] for s, e in out["early_stop"].items()}}
    if out["laws_done"]:
        for law in p.LAWS:
            out["selected"][law] = p.selected_arm(trials, law)
            refs[law] = _nats(arms[law][out["selected"][law]])
    tokens = {int(s): u["report_tokens"] for s, u in plant["units"].items()}
    for name, a, b in GAPS:
        if a in refs and b in refs:
            out["gaps"].append({"name": name, **gap(refs[a], refs[b], tokens, n_boot)})
    return out


def decision(numbers: dict, plants, seeds, n_targets: int) -> dict:
    """The rule of docs/control.md §7 over the plants ``numbers`` holds (each :func:`plant_numbers`): tracking (the
    logodds law passes in ≥ 16/18 of its runs: settled on Ŝ, no λ bound after step 60) and held-out BPT (on each
    plant the across-seed 95% interval of the gap to the best fixed λ has its lower end ≤ 0)."""
    expected = len(plants) * n_targets * len(seeds)
    need = math.ceil(PASS_SHARE * expected - 1e-9)
    runs = [r for pl in plants if pl in numbers for row in numbers[pl]["tracking"] if row["family"] == "logodds"
            for r in row["runs"]]
    passes = sum(r["passes"] for r in runs)
    gaps = {pl: next((g for g in numbers.get(pl, {}).get("gaps", []) if g["name"] == "logodds − best fixed λ"), None)
            for pl in plants}
    bpt_ok = {pl: None if g is None or not numbers[pl]["laws_done"] or not math.isfinite(g["t_low"])
              else bool(g["t_low"] <= 0) for pl, g in gaps.items()}
    complete = all(pl in numbers and numbers[pl]["laws_done"] for pl in plants) and len(runs) == expected
    tracking_ok = passes >= need
    if not complete or None in bpt_ok.values():
        verdict = "incomplete: not every stage of every plant is recorded (or one seed only); nothing is decided"
    elif tracking_ok and all(bpt_ok.values()):
        verdict = "both rules hold: the logodds law is proposed as the default law"
    else:
        verdict = "the rules do not both hold: the logodds law is not proposed as the default law"
    lines = [f"1. Tracking: the logodds law passes in {passes} of {len(runs)} recorded runs ({expected} in the study; "
             f"it needs {need}): {'holds' if tracking_ok else 'fails' if complete else 'not decided'}."]
    for letter, (pl, g) in zip("abcdefghij", gaps.items()):
        if g is None or not numbers[pl]["laws_done"]:
            text = "not recorded yet"
        elif bpt_ok[pl] is None:
            text = f"gap {g['mean']:+.4f} on {g['n']} seed(s): no across-seed interval"
        else:
            text = (f"gap {g['mean']:+.4f}, across-seed 95% interval [{g['t_low']:+.4f}, {g['t_high']:+.4f}]: lower "
                    f"end {'≤' if bpt_ok[pl] else '>'} 0, {'holds' if bpt_ok[pl] else 'fails'}")
        lines.append(f"2{letter}. Held-out BPT on {pl} (logodds at its selected S* − the best fixed λ): {text}.")
    lines.append(f"Decision: {verdict}.")
    return {"passes": passes, "runs": len(runs), "expected": expected, "need": need, "tracking_ok": tracking_ok,
            "bpt_ok": bpt_ok, "complete": complete, "adopt": verdict.startswith("both rules hold"),
            "verdict": verdict, "text": "\n".join(lines)}
