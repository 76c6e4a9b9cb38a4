"""``python -m raytrain_scu.studies.ablation.v3 CONFIG [key=value ...] --plants P5 --out DIR``: the study v3 of
docs/ablation-v3.md.

    # what a call would run, and each plant's split, without running anything
    python -m raytrain_scu.studies.ablation.v3 experiments/ablation-v3.yaml --plants P5 --plan --out docs/ablation-v3
    # a call of at most 11 trials (one seed's arms) of P5, on one GPU shared by all of them
    python -m raytrain_scu.studies.ablation.v3 experiments/ablation-v3.yaml --plants P5 --max-trials 11 \\
        --out docs/ablation-v3 scaling.gpus_per_worker=0.09 scaling.cpus_per_worker=1
    # the report alone, from DIR/results.json
    python -m raytrain_scu.studies.ablation.v3 --report docs/ablation-v3

The first call records the rules (config, seeds, λ grid, the rule's S*, the carried λ, the margin, the plant
order) and each plant's split when the plant first runs; a later call that changes a rule or a plant's locked config
is refused, and a plant may start only once every plant before it in the order is complete. Exit codes: 0 done (the
report written), 1 a trial could not be scored (run again to resume), 2 a bad argument or config.
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
from raytrain_scu.studies.ablation.results import save
from raytrain_scu.studies.ablation.v2 import protocol as v2
from raytrain_scu.studies.ablation.v2.cli import check_locked
from raytrain_scu.studies.ablation.v3 import protocol as p
from raytrain_scu.studies.ablation.v3 import report
from raytrain_scu.studies.ablation.v3.rule import grid_free_target
from raytrain_scu.studies.ablation.v3.run import call_arms, plant_config, run_call


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m raytrain_scu.studies.ablation.v3",
                                 description="The study v3: the logodds law at a grid-free target against a λ grid")
    ap.add_argument("config", nargs="?")
    ap.add_argument("overrides", nargs="*", help="key=value, applied after the plant's own overrides")
    ap.add_argument("--out", default="ablation_v3_out",
                    help="directory of results.json (read to resume) and the report")
    ap.add_argument("--plants", default=p.ORDER[0], help=f"plants to run, of {','.join(p.ORDER)}")
    ap.add_argument("--seeds", default=",".join(map(str, p.SEEDS)), type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--lambdas", default=",".join(f"{x:g}" for x in p.LAMBDAS),
                    type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--max-trials", type=int, default=0, help="run at most this many trials in this call (0: all)")
    ap.add_argument("--plan", action="store_true", help="print the splits and what this call would run; run nothing")
    ap.add_argument("--report", metavar="DIR", help="write the report of DIR/results.json and exit")
    ap.add_argument("--bootstrap", type=int, default=2000)
    return ap.parse_intermixed_args(argv)


def rules_of(a) -> dict:
    return {"config": a.config, "seeds": list(a.seeds), "lambdas": list(a.lambdas), "target_s": grid_free_target(),
            "carried_lambda": p.CARRIED_LAMBDA, "non_inferiority": p.NON_INFERIORITY, "order": list(p.ORDER)}


def new_results(a) -> dict:
    from raytrain_scu.studies.bench.measure import device_name, versions

    return {"protocol": "v3",
            "setting": {"rules": rules_of(a), "order": list(p.ORDER), "plants": p.PLANTS,
                        "select_stream": v2.SELECT_STREAM, "config_yaml": {}, "device": device_name(),
                        "versions": versions(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
            "plants": {pl: {"split": None, "data": None, "trials": [], "units": {}, "calls": []} for pl in p.ORDER}}


def prepare_data(plant: str) -> dict | None:
    """Write what the plant's data source reads, if it has to be written (the standard-library plant)."""
    return p.write_stdlib() if any(o.startswith("data.path=") and p.STDLIB_DIR in o
                                   for o in p.PLANTS[plant]["overrides"]) else None


def check_plant(results: dict, plant: str, cfg, data: dict | None) -> None:
    """A plant's locked config and its data's record must match what its first call recorded (recorded if new)."""
    check_locked(results["setting"]["config_yaml"], plant, cfg)
    rec = results["plants"][plant]
    if rec["data"] is None:
        rec["data"] = data
    elif json.loads(json.dumps(data)) != rec["data"]:
        raise AblationError(f"{plant}: the data differ from the first call's ({rec['data']}): another interpreter's "
                            f"standard library is another corpus")


def the_split(results: dict, plant: str, a, cfg) -> str:
    d = cfg.data
    docs = load_documents(d.source, d.path, d.text_field, d.max_documents)
    choice = v2.choose_seeds(docs, a.seeds, d.val_fraction)
    choice["titles"] = v2.play_titles(docs)
    rec = results["plants"][plant]
    if rec["split"] is None:
        rec["split"] = choice
    elif json.loads(json.dumps(choice)) != rec["split"]:
        raise AblationError(f"{plant}: the data give another split than the one recorded")
    return v2.split_text(choice, choice["titles"])


def check_order(results: dict, plant: str) -> None:
    """A plant starts only when every plant before it in the pre-registered order is complete."""
    rules = results["setting"]["rules"]
    for before in p.ORDER[:p.ORDER.index(plant)]:
        rec = results["plants"][before]
        if rec["split"] is None or not p.plant_done(rec["trials"], rec["split"]["seeds"], rules["lambdas"],
                                                    rules["target_s"]):
            raise AblationError(f"{plant} runs after {before}, which is not complete (docs/ablation-v3.md: the "
                                f"plants run in the order {', '.join(p.ORDER)})")


def run_plants(results: dict, a, plants: list[str], configs: dict, path: Path) -> None:
    """Each plant's pending arms in order, at most ``--max-trials`` trials in all (``--plan``: print them only)."""
    left = a.max_trials or math.inf
    for pl in plants:
        arms = call_arms(results, pl, configs[pl])
        if not arms:
            print(f"[raytrain_scu] ablation v3 {pl}: every trial already in {path}", flush=True)
            continue
        take = arms[:int(min(left, len(arms)))]
        if not take:
            print(f"[raytrain_scu] ablation v3 {pl}: {len(arms)} trial(s) left for a later call", flush=True)
            continue
        names = ", ".join(f"{v2.label(x)} seed {x['seed']}" for x in take)
        if a.plan:
            print(f"[raytrain_scu] ablation v3 {pl}: would run {len(take)} of {len(arms)} pending: {names}", flush=True)
        else:
            check_order(results, pl)
            print(f"[raytrain_scu] ablation v3 {pl}: running {len(take)} of {len(arms)} pending: {names}", flush=True)
            run_call(results, pl, take, a, path)
            print(f"[raytrain_scu] ablation v3 {pl}: {len(take)} trial(s) recorded in "
                  f"{results['plants'][pl]['calls'][-1]['wall_s']:.0f} s: {path}", flush=True)
        left -= len(take)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.report:
        out = Path(a.report)
        print(report.write(json.loads((out / "results.json").read_text()), out, n_boot=a.bootstrap))
        return 0
    try:
        if not a.config:
            raise ValueError("give the study's config (experiments/ablation-v3.yaml)")
        plants = [x for x in a.plants.split(",") if x]
        bad = [x for x in plants if x not in p.PLANTS]
        if bad or not plants:
            raise ValueError(f"--plants: unknown {bad or 'none given'}, expected some of {', '.join(p.ORDER)}")
        if a.max_trials < 0:
            raise ValueError(f"--max-trials: expected >= 0, got {a.max_trials}")
        data = {pl: prepare_data(pl) for pl in plants}
        configs = {pl: plant_config(a.config, pl, a.overrides) for pl in plants}  # a bad config fails before Ray
    except (*USER_ERRORS, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else new_results(a)
    try:
        rules = results["setting"]["rules"]
        if rules != rules_of(a):
            raise AblationError(f"this study's rules were fixed by its first call: {rules}; this call's are "
                                f"{rules_of(a)}. Give the recorded values, or start a new study with another --out")
        for pl in plants:
            check_plant(results, pl, configs[pl], data[pl])
            print(f"[raytrain_scu] ablation v3 {pl}: the documents of each seed (train | select | report)\n"
                  + the_split(results, pl, a, configs[pl]), flush=True)
    except (*USER_ERRORS, AblationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.plan:
        save(results, path)  # the rules and the splits, before any trial
    try:
        run_plants(results, a, plants, configs, path)
    except (AblationError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.plan:
        return 0
    print(report.write(results, out, n_boot=a.bootstrap))
    return 0
