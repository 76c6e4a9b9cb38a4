"""The study v2's report from its ``results.json``: per plant what the select plays chose, early stopping, held-out
BPT per arm on the report plays, the gaps with both intervals, tracking as ``core.settling`` defines it, the cost,
and the decision of docs/control.md §7; figures beside it (``figures``).

``python -m raytrain_scu.ablation_report DIR [--doc FILE]`` rebuilds it without running anything (v1 or v2: the file
says which).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from raytrain_scu.studies.ablation.numbers import interval, num, steps, write_doc
from raytrain_scu.studies.ablation.results import json_ready
from raytrain_scu.studies.ablation.v2 import protocol as p
from raytrain_scu.studies.ablation.v2 import stats
from raytrain_scu.studies.ablation.v2.figures import figures

# ---------------------------------------------------------------- tables

def split_table(split: dict) -> str:
    titles = split["titles"]
    lines = ["| seed | train plays | select plays | report plays |", "|---|---|---|---|"]
    for seed in split["seeds"]:
        sp = split["splits"][str(seed)]
        lines.append(f"| {seed} | " + " | ".join("; ".join(titles[i] for i in sp[k])
                                                 for k in ("train", "select", "report")) + " |")
    notes = [f"Seed {s} repeated an earlier seed's split and was replaced by seed {n}."
             for s, n in split["replaced"].items()]
    return "\n".join(lines + ([""] + notes if notes else []))


def arms_table(rows: list[dict]) -> str:
    lines = ["| arm | seeds | select-plays BPT (mean) | report-plays BPT (mean ± 95% t) | Ŝ at the end (mean, last "
             "20%) | Tune wall s / trial |", "|---|---|---|---|---|---|"]
    for r in rows:
        half = num(r["report_half"], ".4f")
        lines.append(f"| {r['arm']} | {len(r['seeds'])} | {num(r['select_bpt'], '.4f')} | "
                     f"{num(r['report_bpt'], '.4f')}{'' if half == '-' else ' ± ' + half} | "
                     f"{num(r['s_end'], '.4g')} | {num(r['time_s'], '.0f')} |")
    return "\n".join(lines)


def gaps_table(gaps: list[dict]) -> str:
    lines = ["| gap (report plays, bits/token) | per seed | mean | across seeds, 95% t | within seed, paired "
             "bootstrap 95% |", "|---|---|---|---|---|"]
    for g in gaps:
        per = ", ".join(f"{s}: {v:+.4f}" for s, v in sorted(g["per_seed"].items()))
        lines.append(f"| {g['name']} | {per} | {num(g['mean'], '+.4f')} | {interval(g['t_low'], g['t_high'])} | "
                     f"{interval(g['boot_low'], g['boot_high'])} |")
    return "\n".join(lines)


def tracking_table(rows: list[dict]) -> str:
    lines = [f"| arm | seeds | settled on Ŝ | settled on raw S | settled step on Ŝ (per seed) | λ reversals (per "
             f"seed) | steps at a bound (per seed) | last step at a bound after step {p.BOUND_AFTER} (per seed) | "
             f"mean abs(Ŝ − S*), second half | passes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs, n = r["runs"], len(r["runs"])
        late = [x["last_bound_step"] if (x["last_bound_step"] or 0) > p.BOUND_AFTER else None for x in runs]
        err = sum(x["second_half_error"] for x in runs) / n
        lines.append(f"| {r['arm']} | {steps(r['seeds'])} | {r['settled']}/{n} | {r['settled_raw']}/{n} | "
                     f"{steps([x['settled_step'] for x in runs])} | {steps([x['reversals'] for x in runs])} | "
                     f"{steps([x['steps_at_bound'] for x in runs])} | {steps(late)} | {num(err, '.4f')} | "
                     f"{r['passes']}/{n} |")
    return "\n".join(lines)


def choice_text(plant: dict) -> str:
    c = plant["choice"]
    if c is None:
        return "The fixed stage is not complete: no best fixed λ, targets or gaps yet."
    sel = ", ".join(f"{law}: {arm}" for law, arm in plant["selected"].items()) or "the laws stage is not complete"
    es = "; ".join(f"seed {s}: step {e['step']} (select {e['select_bpt']:.4f}, report {e['report_bpt']:.4f})"
                   for s, e in sorted(plant["early_stop"].items()))
    return (f"**Chosen on the select plays:** best fixed λ = {c['best_lambda']:g} (mean select-plays BPT "
            f"{c['select_bpt'][c['best_arm']]:.4f}); its runs end at S = {c['s_best']:.4g} (mean Ŝ, last 20% of "
            f"steps), so the targets are {', '.join(f'{x:g}' for x in c['targets'])}. Each law's S*: {sel}.\n\n"
            f"**Early stopping** (`none` at the select plays' best eval; its report-plays score is the comparator): "
            f"{es or 'no none run recorded'}.")


def cost_text(rows: list[dict], n_lambdas: int) -> str:
    """Runs per arm, and what the logodds law's figures lean on: its targets come from the fixed grid. Its
    report-plays BPT over its targets is set beside the fixed arms whose end Ŝ lies in the same range of S."""
    fixed, law = ([r["time_s"] for r in rows if r["family"] == f and math.isfinite(r["time_s"])]
                  for f in ("fixed", "logodds"))
    text = (f"Every run trains the same steps: the fixed-λ grid is {n_lambdas} runs per seed (mean Tune wall "
            f"{num(sum(fixed) / len(fixed) if fixed else math.nan, '.0f')} s each), the logodds law one run per "
            f"target ({num(sum(law) / len(law) if law else math.nan, '.0f')} s). Tune's wall time includes start-up "
            f"and any sharing of a GPU (`scaling.gpus_per_worker` < 1 in the calls above): compare run counts.")
    laws = sorted((r["sort"], r["report_bpt"]) for r in rows if r["family"] == "logodds")
    if not laws:
        return text
    lo, hi = laws[0][0], laws[-1][0]
    inside = [r for r in rows if r["family"] == "fixed" and lo <= r["s_end"] <= hi]
    same = "; ".join(f"{r['arm']} ends at S = {r['s_end']:.3g}, {r['report_bpt']:.4f}" for r in inside) or "none"
    return text + (f" The law's figures do not come at one run's cost alone: its targets (S* = "
                   f"{', '.join(f'{t:g}' for t, _ in laws)}) are derived from the fixed grid's best λ. Over them its "
                   f"report-plays BPT spans {min(b for _, b in laws):.4f}–{max(b for _, b in laws):.4f}. Fixed-λ "
                   f"arms whose end Ŝ lies in the same range of S: {same}.")


def calls_table(results: dict) -> str:
    lines = ["| plant | stage | trials | wall min | machine | overrides | started |", "|---|---|---|---|---|---|---|"]
    for pl, rec in results["plants"].items():
        for c in rec["calls"]:
            lines.append(f"| {pl} | {c['stage']} | {len(c['trials'])} | {c['wall_s'] / 60:.1f} | {c['gpus']} × "
                         f"{c['device']} | `{' '.join(c['overrides'])}` | {c['started']} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the document

def numbers(results: dict, n_boot: int) -> tuple[dict, dict]:
    """Each plant's :func:`stats.plant_numbers` (plants with a recorded trial), and the decision over all plants."""
    rules = results["setting"]["rules"]
    seeds = results["split"]["seeds"]
    per = {pl: stats.plant_numbers(rec, {**rules, "seeds": seeds}, n_boot)
           for pl, rec in results["plants"].items() if rec["trials"]}
    return per, stats.decision(per, list(results["plants"]), seeds, len(rules["target_factors"]))


def plant_text(pl: str, plant: dict, results: dict, plots: list[Path], rel: str) -> str:
    over = " ".join(results["setting"]["plants"][pl]["overrides"])
    parts = [f"### Plant {pl}: `{over}`", choice_text(plant),
             "#### Held-out BPT per arm\n\n" + arms_table(plant["arms"])]
    if plant["gaps"]:
        parts.append("#### Gaps, paired by seed (the laws at their selected S*)\n\n" + gaps_table(plant["gaps"]))
    if plant["tracking"]:
        parts.append("#### Tracking (`core.settling`)\n\nSettled: from some step to the end, at least 100 steps with "
                     "abs(logit Ŝ − logit S*) ≤ 0.1, λ strictly inside its bounds and max λ / min λ ≤ 1.5; '-' = "
                     "never. Reversals count only moves of ln λ by at least 0.5. A run passes when it settles on Ŝ "
                     f"and λ is at a bound in no step after step {p.BOUND_AFTER}.\n\n" + tracking_table(plant["tracking"]))
    parts.append("#### Cost\n\n" + cost_text(plant["arms"], len(results["setting"]["rules"]["lambdas"])))
    mine = [x for x in plots if x.name.startswith(f"{pl}_")]
    if mine:
        parts.append("#### Figures\n\n" + "\n".join(f"![{x.stem}]({rel}/{x.name})" for x in mine))
    return "\n\n".join(parts)


def markdown(results: dict, per: dict, decision: dict, plots: list[Path], rel: str) -> str:
    s = results["setting"]
    parts = ["## The decision (docs/control.md §7)\n\n" + decision["text"].replace("\n", "\n\n"),
             f"**Rules** (fixed by the first call): `{json.dumps(s['rules'])}`. Started {s['started']} on "
             f"{s['device']}.\n\n**Calls**\n\n" + calls_table(results),
             "**The plays** (the training loop's train and held-out split of each seed; the held-out plays cut into "
             "select and report plays before any trial)\n\n" + split_table(results["split"])]
    parts += [plant_text(pl, plant, results, plots, rel) for pl, plant in per.items()]
    return "\n\n".join(parts)


def write(results: dict, out: Path, *, n_boot: int = 2000, doc: Path | None = None) -> str:
    """summary.json, table.md and figures under ``out``; with ``doc``, also that document (``out/notes.md`` if
    there, then the generated part). Returns the markdown."""
    per, decision = numbers(results, n_boot)
    plots = figures(results, per, out / "plots")
    text = markdown(results, per, decision, plots, "plots")
    (out / "table.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(json_ready({"decision": decision, "plants": per}), indent=1,
                                                 allow_nan=False, default=str))
    if doc is not None:
        write_doc(out, doc, lambda rel: markdown(results, per, decision, plots, f"{rel}/plots"))
    return text
