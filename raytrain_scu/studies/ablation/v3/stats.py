"""The study v3's numbers from its records: per plant the arms' held-out BPT, the paired gaps with both intervals
(``v2.stats.gap``), the primary endpoint's verdict, and the law's tracking (``core.settling``), λ path and the S at
the grid's best λ. No Ray and no training here.

The arms (docs/ablation-v3.md): 1 the law at the grid-free target; 2 the best fixed λ on the select plays; 3 the
fixed λ carried over (0.1); 4 ``none`` stopped early on the select plays; 5 the law's best checkpoint on the select
plays. Everything compared is scored on the report plays.
"""
from __future__ import annotations

import math

import numpy as np

from raytrain_scu.studies.ablation.report import aligned
from raytrain_scu.studies.ablation.v2 import protocol as v2
from raytrain_scu.studies.ablation.v2.stats import arm_rows, gap, run_tracking, t_interval
from raytrain_scu.studies.ablation.v3 import protocol as p

# (name, arm, reference): the primary endpoint first, then the secondary ones and two for context
GAPS = (
    ("1 law − 2 best fixed λ (primary)", "law", "best"),
    ("1 law − 3 λ carried over", "law", "carried"),
    ("1 law − 4 early stopping", "law", "early"),
    ("5 law's best checkpoint − 4 early stopping", "law_best", "early"),
    ("5 law's best checkpoint − 2 best fixed λ", "law_best", "best"),
    ("2 best fixed λ − 4 early stopping", "best", "early"),
)
PATH_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)  # where the λ path is read, as fractions of the run's steps
EARLY_STOP = "none, stopped early (arm 4)"
LAW_BEST = "law's best checkpoint (arm 5)"


def _nats(ts: list[dict]) -> dict:
    return {t["seed"]: t["report_nats"] for t in ts}


def lambda_path(t: dict) -> list[tuple[int, float]]:
    """(step, λ after that step's update) at PATH_FRACTIONS of the run."""
    steps, lam = aligned(t, ("ctrl/lambda",))
    if not steps:
        return []
    return [(steps[i], lam[i]) for i in sorted({min(len(steps) - 1, max(0, round(f * len(steps)) - 1))
                                                 for f in PATH_FRACTIONS})]


def law_rows(trials: list[dict]) -> list[dict]:
    """Per law run (by seed): its tracking summary (passes: settled on Ŝ, λ at no bound after step 60), λ path,
    end Ŝ, and its best checkpoint's step."""
    rows = []
    for t in sorted(v2.by_arm(trials, p.LAW).get(_law_arm(trials), []), key=lambda t: t["seed"]):
        best = p.best_eval(t) if t.get("evals") else None
        rows.append({"seed": t["seed"], "target_s": t["target_s"], **run_tracking(t), "path": lambda_path(t),
                     "best_step": best["step"] if best else None})
    return rows


def _law_arm(trials: list[dict]) -> str | None:
    names = list(v2.by_arm(trials, p.LAW))
    return names[0] if names else None


def plant_numbers(plant: dict, rules: dict, n_boot: int) -> dict:
    """A plant's numbers: arms, the grid's choice, early stopping and the law's best checkpoint per seed, the gaps,
    the law's runs, and the primary endpoint's verdict (once every arm of every seed is recorded)."""
    trials, seeds = plant["trials"], plant["split"]["seeds"]
    done = p.plant_done(trials, seeds, rules["lambdas"], rules["target_s"])
    out = {"arms": arm_rows([t for t in trials if t["family"] in p.FAMILIES]), "choice": None, "early_stop": {},
           "law_best": {}, "gaps": [], "law_runs": law_rows(trials), "complete": done,
           "seeds_recorded": sorted({t["seed"] for t in trials})}
    for t in v2.by_arm(trials, "none").get("none", []):
        if t.get("evals"):
            out["early_stop"][t["seed"]] = p.best_eval(t)
    law_name = _law_arm(trials)
    for t in v2.by_arm(trials, p.LAW).get(law_name, []):
        if t.get("evals"):
            out["law_best"][t["seed"]] = p.best_eval(t)
    for key, label in (("early_stop", EARLY_STOP), ("law_best", LAW_BEST)):
        es = list(out[key].values())
        if es:
            rep = t_interval([e["report_bpt"] for e in es])
            out["arms"].append({"arm": label, "family": "derived", "seeds": sorted(out[key]),
                                "select_bpt": float(np.mean([e["select_bpt"] for e in es])),
                                "report_bpt": rep["mean"],
                                "report_half": rep["high"] - rep["mean"] if rep["n"] > 1 else math.nan,
                                "s_end": math.nan, "time_s": math.nan})
    fixed = v2.by_arm(trials, "fixed")
    refs = {"early": {s: e["report_nats"] for s, e in out["early_stop"].items()},
            "law_best": {s: e["report_nats"] for s, e in out["law_best"].items()}}
    if law_name:
        refs["law"] = _nats(v2.by_arm(trials, p.LAW)[law_name])
    carried = f"fixed λ={rules['carried_lambda']:g}"
    if carried in fixed:
        refs["carried"] = _nats(fixed[carried])
    if fixed:
        out["choice"] = choice = p.best_fixed(trials)
        refs["best"] = _nats(fixed[choice["best_arm"]])
    tokens = {int(s): u["report_tokens"] for s, u in plant["units"].items()}
    for name, a, b in GAPS:
        if refs.get(a) and refs.get(b) and set(refs[a]) & set(refs[b]):
            out["gaps"].append({"name": name, **gap(refs[a], refs[b], tokens, n_boot)})
    out["verdict"] = verdict(out, rules)
    return out


def verdict(numbers: dict, rules: dict) -> dict:
    """The primary endpoint on one plant: with every arm of every seed recorded, the law meets it when the upper end
    of the across-seed 95% interval of (law − best fixed λ) is at most NON_INFERIORITY bits/token; before that,
    no verdict."""
    g = next((g for g in numbers["gaps"] if g["name"].endswith("(primary)")), None)
    margin = rules.get("non_inferiority", p.NON_INFERIORITY)
    if not numbers["complete"] or g is None or not math.isfinite(g["t_high"]):
        return {"meets": None, "text": "no verdict: not every arm of every seed is recorded"}
    meets = bool(g["t_high"] <= margin)
    return {"meets": meets, "upper": g["t_high"],
            "text": (f"law − best fixed λ = {g['mean']:+.4f} bits/token, across-seed 95% interval "
                     f"[{g['t_low']:+.4f}, {g['t_high']:+.4f}]: upper end {'≤' if meets else '>'} +{margin:g}, "
                     f"{'meets' if meets else 'fails'} the primary endpoint")}


def overall(per: dict, plants) -> dict:
    """The study's answer: the rule replaces the grid only if it meets the primary endpoint on every plant."""
    verdicts = {pl: per[pl]["verdict"]["meets"] if pl in per else None for pl in plants}
    if any(v is False for v in verdicts.values()):
        text = "the rule fails the primary endpoint on " + ", ".join(pl for pl, v in verdicts.items() if v is False)
    elif all(v is True for v in verdicts.values()):
        text = "the rule meets the primary endpoint on every plant"
    else:
        text = ("not decided: plant(s) " + ", ".join(pl for pl, v in verdicts.items() if v is None)
                + " are not complete")
    return {"verdicts": verdicts, "adopt": all(v is True for v in verdicts.values()), "text": text}


def one_run_arms(per: dict, plants, rules: dict) -> dict | None:
    """The arms a user runs once, without a grid (1 the law, 3 λ carried over, 4 early stopping, 5 the law's best
    checkpoint), across the plants once every plant is complete: each arm's mean report BPT per plant, its gap to the
    plant's best one-run arm, and its worst and mean gap. ``chosen``: the arm whose worst gap is smallest. This
    criterion is not in the protocol: §5 did not say what "won" means when the winner differs by plant, and it was
    chosen after the results were seen."""
    if not all(pl in per and per[pl]["complete"] for pl in plants):
        return None
    names = {"law": f"{p.LAW} S*={rules['target_s']:g}", "carried": f"fixed λ={rules['carried_lambda']:g}",
             "early": EARLY_STOP, "law_best": LAW_BEST}
    bpt = {pl: {k: next(a["report_bpt"] for a in per[pl]["arms"] if a["arm"] == name) for k, name in names.items()}
           for pl in plants}
    gap = {k: {pl: bpt[pl][k] - min(bpt[pl].values()) for pl in plants} for k in names}
    worst = {k: max(g.values()) for k, g in gap.items()}
    return {"arms": names, "bpt": bpt, "gap": gap, "worst": worst,
            "mean": {k: float(np.mean(list(g.values()))) for k, g in gap.items()}, "chosen": min(worst, key=worst.get)}
