"""The FP8 accuracy study's numbers and document from its ``results.json``: per plant each arm's report-plays BPT by
seed, the paired gap fp8 − bf16 with its across-seed t-interval and within-seed bootstrap, and the decision; written
to DIR/report.md and DIR/summary.json. No Ray and no training here."""
from __future__ import annotations

import json
import math
from pathlib import Path

from raytrain_scu.studies.ablation.fp8 import protocol as p
from raytrain_scu.studies.ablation.results import json_ready
from raytrain_scu.studies.ablation.v2.stats import gap


def plant_numbers(rec: dict, n_boot: int) -> dict:
    """{arm: {seed: report BPT}}, the gap fp8 − bf16 over the seeds both have, and whether its upper end passes."""
    nats = {arm: {t["seed"]: t["report_nats"] for t in rec["trials"] if t["arm"] == arm} for arm in p.ARMS}
    tokens = {int(s): u["report_tokens"] for s, u in rec["units"].items()}
    bpt = {arm: {t["seed"]: t["report_bpt"] for t in rec["trials"] if t["arm"] == arm} for arm in p.ARMS}
    g = gap(nats["fp8"], nats["bf16"], tokens, n_boot) if set(nats["fp8"]) & set(nats["bf16"]) else None
    complete = g is not None and g["n"] == len(rec["split"]["seeds"] if rec.get("split") else p.SEEDS)
    passes = complete and math.isfinite(g["t_high"]) and g["t_high"] <= p.TOLERANCE
    return {"bpt": bpt, "gap": g, "complete": complete, "passes": passes,
            "time_s": {arm: [t["time_s"] for t in rec["trials"] if t["arm"] == arm] for arm in p.ARMS}}


def decision(per: dict) -> str:
    if not all(n["complete"] for n in per.values()):
        return "incomplete: not every plant has both arms on every seed"
    return "default" if all(n["passes"] for n in per.values()) else "opt-in"


def plant_text(plant: str, n: dict, rec: dict) -> str:
    seeds = sorted({s for arm in n["bpt"].values() for s in arm})
    lines = [f"### {plant}", "", "| seed | bf16-trained | fp8-trained | fp8 − bf16 |", "|---|---|---|---|"]
    for s in seeds:
        b, f = n["bpt"]["bf16"].get(s), n["bpt"]["fp8"].get(s)
        d = f"{f - b:+.4f}" if b is not None and f is not None else "-"
        lines.append(f"| {s} | {b if b is None else f'{b:.4f}'} | {f if f is None else f'{f:.4f}'} | {d} |")
    g = n["gap"]
    if g is not None:
        lines += ["", f"Gap fp8 − bf16 over {g['n']} seeds: mean {g['mean']:+.4f} bits/token; across-seed 95% "
                      f"t-interval [{g['t_low']:+.4f}, {g['t_high']:+.4f}]; within-seed bootstrap "
                      f"[{g['boot_low']:+.4f}, {g['boot_high']:+.4f}]. Upper end ≤ +{p.TOLERANCE}: "
                      f"{'yes' if n['passes'] else 'no'}."]
    lines += ["", "| call's trials | wall min | machine | overrides | started |", "|---|---|---|---|---|"]
    lines += [f"| {len(c['trials'])} | {c['wall_s'] / 60:.1f} | {c['gpus']} × {c['device']} | "
              f"`{' '.join(c['overrides'])}` | {c['started']} |" for c in rec["calls"]]
    return "\n".join(lines)


def write(results: dict, out: Path, n_boot: int = 2000) -> str:
    """report.md and summary.json in ``out``; returns the report's text."""
    per = {pl: plant_numbers(rec, n_boot) for pl, rec in results["plants"].items()}  # a plant not run: incomplete
    verdict = decision(per)
    head = {"default": "FP8 passes on every plant: `hardware.preset=auto` may turn `model.base_fp8` on for Hopper "
                       "and Ada.",
            "opt-in": "FP8 fails on at least one plant: `model.base_fp8` stays opt-in."}.get(verdict, verdict)
    text = "\n\n".join([f"**Decision: {head}**", *(plant_text(pl, n, results["plants"][pl]) for pl, n in per.items()
                                                      if results["plants"][pl]["trials"])])
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(json_ready({"decision": verdict, "plants": per}), indent=1) + "\n")
    return text
