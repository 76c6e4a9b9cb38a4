"""The study v3's report from its ``results.json``: the study's answer, then per plant what the select plays
chose, held-out BPT per arm on the report plays, the gaps with both intervals, the primary endpoint's verdict and
the law's runs (settling, λ's path, its best checkpoint); summary.json and table.md beside it.

``python -m raytrain_scu.studies.ablation.v3 --report DIR [--doc FILE]`` rebuilds it without running anything.
"""
from __future__ import annotations

import json
from pathlib import Path

from raytrain_scu.studies.ablation.numbers import num, steps
from raytrain_scu.studies.ablation.results import json_ready
from raytrain_scu.studies.ablation.v2 import protocol as v2
from raytrain_scu.studies.ablation.v2.report import arms_table, gaps_table, split_table
from raytrain_scu.studies.ablation.v3 import protocol as p
from raytrain_scu.studies.ablation.v3 import stats
from raytrain_scu.studies.ablation.v3.figures import NAMES, figures


def law_table(rows: list[dict]) -> str:
    lines = [f"| seed | S* | settled on Ŝ (step) | settled on raw S | λ reversals | steps at a bound | "
             f"last bound step after {v2.BOUND_AFTER} | mean abs(Ŝ − S*), 2nd half | passes | λ path (step: λ) | "
             f"best checkpoint step (select plays) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        late = r["last_bound_step"] if (r["last_bound_step"] or 0) > v2.BOUND_AFTER else None
        path = ", ".join(f"{s}: {lam:.3g}" for s, lam in r["path"])
        lines.append(f"| {r['seed']} | {r['target_s']:g} | {steps([r['settled_step']])} | "
                     f"{steps([r['settled_step_raw']])} | {r['reversals']} | {r['steps_at_bound']} | {steps([late])} | "
                     f"{num(r['second_half_error'], '.4f')} | {'yes' if r['passes'] else 'no'} | {path} | "
                     f"{steps([r['best_step']])} |")
    return "\n".join(lines)


def choice_text(plant: dict, rules: dict) -> str:
    c = plant["choice"]
    if c is None:
        return "No fixed-λ run recorded yet."
    stop = lambda d: "; ".join(f"seed {s}: step {e['step']} (select {e['select_bpt']:.4f}, report "  # noqa: E731
                               f"{e['report_bpt']:.4f})" for s, e in sorted(d.items())) or "none recorded"
    return (f"**The grid's choice on the select plays:** best fixed λ = {c['best_lambda']:g} (mean select-plays BPT "
            f"{c['select_bpt'][c['best_arm']]:.4f}); its runs end at S = {c['s_best']:.4g} (mean Ŝ, last 20% of "
            f"steps), against the rule's S* = {rules['target_s']:g}. The carried-over λ = {rules['carried_lambda']:g} "
            f"{'is' if c['best_lambda'] == rules['carried_lambda'] else 'is not'} the grid's best here.\n\n"
            f"**Early stopping of `none`** (arm 4): {stop(plant['early_stop'])}.\n\n"
            f"**The law's best checkpoint** (arm 5): {stop(plant['law_best'])}.")


def calls_table(rec: dict) -> str:
    lines = ["| trials | wall min | machine | overrides | started (UTC) |", "|---|---|---|---|---|"]
    for c in rec["calls"]:
        lines.append(f"| {len(c['trials'])} | {c['wall_s'] / 60:.1f} | {c['gpus']} × {c['device']} | "
                     f"`{' '.join(c['overrides'])}` | {c['started']} |")
    return "\n".join(lines)


def plant_text(pl: str, plant: dict, results: dict) -> str:
    setting, rec = results["setting"], results["plants"][pl]
    rules = setting["rules"]
    parts = [f"### Plant {pl}: {setting['plants'][pl]['note']}",
             f"Overrides: `{' '.join(setting['plants'][pl]['overrides'])}`. Seeds recorded: "
             f"{', '.join(map(str, plant['seeds_recorded'])) or 'none'} of {', '.join(map(str, rec['split']['seeds']))}"
             f"; {'complete' if plant['complete'] else 'NOT complete'}.",
             f"**Primary endpoint:** {plant['verdict']['text']}.",
             "**Calls**\n\n" + calls_table(rec),
             "**The documents** (train | select | report, per seed)\n\n" + split_table(rec["split"]),
             choice_text(plant, rules),
             "#### Held-out BPT per arm\n\n" + arms_table(plant["arms"])]
    if plant["gaps"]:
        parts.append("#### Gaps, paired by seed (report plays, bits/token)\n\n" + gaps_table(plant["gaps"]))
    if plant["law_runs"]:
        parts.append("#### The law's runs (`core.settling`)\n\n" + law_table(plant["law_runs"]))
    parts.append("#### Figures\n\n" + "\n".join(f"![{pl}_{n}](plots/{pl}_{n}.png)" for n in NAMES))
    return "\n\n".join(parts)


def numbers(results: dict, n_boot: int) -> tuple[dict, dict]:
    """Per plant its numbers, and the study's answer (with ``one_run``: the one-run arms across the plants, once
    every plant is complete)."""
    rules = results["setting"]["rules"]
    per = {pl: stats.plant_numbers(rec, rules, n_boot) for pl, rec in results["plants"].items()
           if rec.get("split") and rec["trials"]}
    answer = stats.overall(per, list(results["plants"]))
    answer["one_run"] = stats.one_run_arms(per, results["setting"]["order"], rules)
    return per, answer


def one_run_text(one: dict, order) -> str:
    """The one-run arms across the plants, and the post-hoc criterion that picks one of them."""
    lines = ["| arm | " + " | ".join(f"{pl} BPT (gap)" for pl in order) + " | worst gap | mean gap |",
             "|---|" + "---|" * (len(order) + 2)]
    for k, name in one["arms"].items():
        lines.append(f"| {name} | " + " | ".join(f"{one['bpt'][pl][k]:.4f} (+{one['gap'][k][pl]:.4f})" for pl in order)
                     + f" | +{one['worst'][k]:.4f} | +{one['mean'][k]:.4f} |")
    return ("## The one-run arms across the plants (a criterion chosen after the results)\n\n"
            "Report-plays BPT (mean of the seeds) of the arms a user runs once, without a grid, and each one's gap to "
            "the best of them on that plant. §5 did not say what \"won\" means when the winner differs by plant; "
            "the criterion here, the smallest worst-case gap over the complete plants, was chosen after these results "
            f"were seen. By it: **{one['arms'][one['chosen']]}**.\n\n" + "\n".join(lines))


def markdown(results: dict, per: dict, answer: dict) -> str:
    s = results["setting"]
    parts = [f"## The answer\n\n{answer['text']}. " + "; ".join(
                 f"{pl}: {'meets' if v else 'fails' if v is False else 'no verdict'}"
                 for pl, v in answer["verdicts"].items()) + ".",
             f"**Rules** (fixed by the first call): `{json.dumps(s['rules'])}`. Started {s['started']} on "
             f"{s['device']} (torch {s['versions'].get('torch', '?')}); plants run in the order "
             f"{', '.join(s['order'])}."]
    parts += [plant_text(pl, per[pl], results) for pl in s["order"] if pl in per]
    missing = [pl for pl in s["order"] if pl not in per]
    if missing:
        parts.append("Not run: " + ", ".join(f"{pl} ({s['plants'][pl]['note']})" for pl in missing) + ".")
    if answer.get("one_run"):
        parts.append(one_run_text(answer["one_run"], s["order"]))
    return "\n\n".join(parts)


def write(results: dict, out: Path, *, n_boot: int = 2000, doc: Path | None = None, plots: bool = True) -> str:
    """summary.json, table.md and (``plots``) the figures under ``out``; with ``doc``, also that document
    (``out/notes.md`` if there, then the generated part). Returns the markdown."""
    per, answer = numbers(results, n_boot)
    if plots:
        figures(results, per, out / "plots")
    text = markdown(results, per, answer)
    (out / "table.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(json_ready({"answer": answer, "plants": per}), indent=1,
                                                 allow_nan=False, default=str))
    if doc is not None:
        notes = out / "notes.md"
        doc.write_text((notes.read_text() + "\n\n" if notes.exists() else "")
                       + f"## The numbers (generated from {out}/results.json by `python -m "
                         f"raytrain_scu.studies.ablation.v3 --report {out} --doc {doc}`)\n\n" + text + "\n")
    return text
