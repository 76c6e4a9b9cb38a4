"""``python -m raytrain_scu.studies.ablation.fp8 CONFIG [key=value ...] --plants P1,P2 --out DIR``: the FP8 accuracy
study of docs/fp8-accuracy.md.

    # what a call would run, and each plant's split, without running anything
    python -m raytrain_scu.studies.ablation.fp8 experiments/ablation-v2.yaml --plan --out docs/fp8-accuracy
    # both plants on one GPU shared by a plant's 6 trials
    python -m raytrain_scu.studies.ablation.fp8 experiments/ablation-v2.yaml --out docs/fp8-accuracy \\
        scaling.gpus_per_worker=0.16 scaling.cpus_per_worker=2
    # the report alone, from DIR/results.json
    python -m raytrain_scu.studies.ablation.fp8 --report docs/fp8-accuracy

The first call records the rules (config, seeds, λ, the tolerance) and each plant's split; a later call that changes
them or a plant's locked config is refused. Exit codes: 0 done (the report written), 1 a trial could not be scored
(run again to resume), 2 a bad argument or config.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from raytrain_scu.core.data.blocks import load_documents
from raytrain_scu.errors import USER_ERRORS, AblationError, CheckpointError
from raytrain_scu.studies.ablation.fp8 import protocol as p
from raytrain_scu.studies.ablation.fp8 import report
from raytrain_scu.studies.ablation.fp8.run import call_arms, plant_config, run_call
from raytrain_scu.studies.ablation.results import save
from raytrain_scu.studies.ablation.v2 import protocol as v2
from raytrain_scu.studies.ablation.v2.cli import check_locked


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m raytrain_scu.studies.ablation.fp8",
                                 description="FP8-trained adapters against bf16-trained ones, scored in bf16")
    ap.add_argument("config", nargs="?")
    ap.add_argument("overrides", nargs="*", help="key=value, applied after the plant's own overrides")
    ap.add_argument("--out", default="fp8_accuracy_out",
                    help="directory of results.json (read to resume) and the report")
    ap.add_argument("--plants", default=",".join(p.PLANTS), help=f"plants to run, of {','.join(p.PLANTS)}")
    ap.add_argument("--seeds", default=",".join(map(str, p.SEEDS)), type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--max-trials", type=int, default=0, help="run at most this many trials in this call (0: all)")
    ap.add_argument("--plan", action="store_true", help="print the splits and what this call would run; run nothing")
    ap.add_argument("--report", metavar="DIR", help="write the report of DIR/results.json and exit")
    ap.add_argument("--bootstrap", type=int, default=2000)
    return ap.parse_intermixed_args(argv)


def rules_of(a) -> dict:
    return {"config": a.config, "seeds": list(a.seeds), "lambda": p.LAMBDA, "tolerance": p.TOLERANCE,
            "arms": p.ARMS}


def new_results(a) -> dict:
    from raytrain_scu.studies.bench.measure import device_name, versions

    return {"protocol": "fp8",
            "setting": {"rules": rules_of(a), "plants": {pl: v2.PLANTS[pl]["overrides"] for pl in p.PLANTS},
                        "select_stream": v2.SELECT_STREAM, "config_yaml": {}, "device": device_name(),
                        "versions": versions(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
            "plants": {pl: {"split": None, "trials": [], "units": {}, "calls": []} for pl in p.PLANTS}}


def the_split(results: dict, plant: str, a, cfg) -> str:
    """v2's split of the plays for the study's seeds, recorded on the plant's first call and checked after."""
    d = cfg.data
    docs = load_documents(d.source, d.path, d.text_field, d.max_documents)
    choice = v2.choose_seeds(docs, a.seeds, d.val_fraction)
    rec = results["plants"][plant]
    if rec["split"] is None:
        rec["split"] = choice
    elif json.loads(json.dumps(choice)) != rec["split"]:
        raise AblationError(f"{plant}: the data give another split than the one recorded")
    return v2.split_text(choice, v2.play_titles(docs))


def run_plants(results: dict, a, plants: list[str], path: Path) -> None:
    left = a.max_trials or math.inf
    for pl in plants:
        arms = call_arms(results, pl)
        take = arms[:int(min(left, len(arms)))]
        if not take:
            print(f"[raytrain_scu] fp8 study {pl}: {len(arms)} trial(s) pending, none in this call", flush=True)
            continue
        names = ", ".join(f"{p.label(x)} seed {x['seed']}" for x in take)
        print(f"[raytrain_scu] fp8 study {pl}: {'would run' if a.plan else 'running'} {len(take)} of {len(arms)} "
              f"pending: {names}", flush=True)
        if not a.plan:
            run_call(results, pl, take, a, path)
        left -= len(take)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.report:
        out = Path(a.report)
        print(report.write(json.loads((out / "results.json").read_text()), out, n_boot=a.bootstrap))
        return 0
    try:
        if not a.config:
            raise ValueError("give the study's config (experiments/ablation-v2.yaml)")
        plants = [x for x in a.plants.split(",") if x]
        bad = [x for x in plants if x not in p.PLANTS]
        if bad or not plants:
            raise ValueError(f"--plants: unknown {bad or 'none given'}, expected some of {', '.join(p.PLANTS)}")
        if a.max_trials < 0:
            raise ValueError(f"--max-trials: expected >= 0, got {a.max_trials}")
        configs = {pl: plant_config(a.config, pl, a.overrides) for pl in plants}  # a bad config fails before Ray
    except (*USER_ERRORS, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else new_results(a)
    try:
        if results["setting"]["rules"] != json.loads(json.dumps(rules_of(a))):
            raise AblationError(f"this study's rules were fixed by its first call: {results['setting']['rules']}; "
                                f"this call's are {rules_of(a)}. Give the recorded values, or another --out")
        for pl in plants:
            check_locked(results["setting"]["config_yaml"], pl, configs[pl])
            print(f"[raytrain_scu] fp8 study {pl}: the plays of each seed (train | select | report)\n"
                  + the_split(results, pl, a, configs[pl]), flush=True)
    except (*USER_ERRORS, AblationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.plan:
        save(results, path)  # the rules and the splits, before any trial
    try:
        run_plants(results, a, plants, path)
    except (AblationError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.plan:
        return 0
    print(report.write(results, out, n_boot=a.bootstrap))
    return 0
