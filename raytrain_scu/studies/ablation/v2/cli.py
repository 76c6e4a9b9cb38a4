"""``python -m raytrain_scu.ablation CONFIG [key=value ...] --protocol v2 --out DIR``: the GPU study v2 of
docs/control.md §7 (its section says how to split it over device calls and sessions).

    # all of it (one GPU per trial; on one shared GPU add scaling.gpus_per_worker=0.25 scaling.cpus_per_worker=3)
    python -m raytrain_scu.ablation experiments/ablation-v2.yaml --protocol v2 --plants P1,P2 --out docs/ablation-v2
    # a call of at most 8 trials of P1's fixed stage; the next call goes on from DIR/results.json
    python -m raytrain_scu.ablation experiments/ablation-v2.yaml --protocol v2 --plants P1 --stages fixed \\
        --max-trials 8 --out docs/ablation-v2
    # what a call would run, and the split, without running anything
    python -m raytrain_scu.ablation experiments/ablation-v2.yaml --protocol v2 --plan --out docs/ablation-v2

The first call records the rules (config, seeds, λ grid, target factors) and the split; a later call that changes
a rule, or whose data give another split, is refused. Exit codes: 0 done (the report written), 1 a trial could not
be scored or a stage's inputs are missing (run again to resume), 2 a bad argument or config.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import yaml

from raytrain_scu.config.io import flatten, flatten_tree, to_yaml
from raytrain_scu.core.data.blocks import load_documents
from raytrain_scu.errors import USER_ERRORS, AblationError, CheckpointError
from raytrain_scu.studies.ablation.results import save
from raytrain_scu.studies.ablation.v2 import protocol as p
from raytrain_scu.studies.ablation.v2 import report
from raytrain_scu.studies.ablation.v2.run import call_arms, plant_config, run_call
from raytrain_scu.tracking.revisions import config_changes

RULE_ARGS = ("config", "seeds", "lambdas", "target_factors")  # fixed by the study's first call
# config keys a later call may change: how a trial shares a machine and where it is stored, not what it computes
# (scaling.num_workers sets the global batch and scaling.use_gpu the device, so both stay locked)
FREE_KEYS = ("scaling.gpus_per_worker", "scaling.cpus_per_worker", "scaling.placement_strategy",
             "scaling.poll_interval_s", "tracking.", "run.storage_path", "run.output_dir", "model.cache_dir",
             "data.cache_dir", "data.loader_workers")


def parse_args(argv):
    nums = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(prog="python -m raytrain_scu.ablation --protocol v2",
                                 description="The GPU study v2: none, fixed λ, the spec's law and the logodds law")
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value, applied after the plant's own overrides")
    ap.add_argument("--protocol", default="v2", choices=["v2"])
    ap.add_argument("--out", default="ablation_v2_out", help="directory of results.json (read to resume) and the report")
    ap.add_argument("--plants", default=",".join(p.PLANTS), help=f"plants to run, of {','.join(p.PLANTS)}")
    ap.add_argument("--stages", default=",".join(p.STAGES), help=f"stages to run, in order, of {','.join(p.STAGES)}")
    ap.add_argument("--seeds", default=",".join(map(str, p.SEEDS)), type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--lambdas", default=",".join(f"{x:g}" for x in p.LAMBDAS), type=nums)
    ap.add_argument("--target-factors", default=",".join(f"{x:g}" for x in p.TARGET_FACTORS), type=nums)
    ap.add_argument("--max-trials", type=int, default=0, help="run at most this many trials in this call (0: all)")
    ap.add_argument("--plan", action="store_true", help="print the split and what this call would run; run nothing")
    ap.add_argument("--bootstrap", type=int, default=2000)
    return ap.parse_intermixed_args(argv)


def _names(text: str, known, what: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in known]
    if bad or not names:
        raise ValueError(f"--{what}: unknown {bad or 'none given'}, expected some of {', '.join(known)}")
    return names


def new_results(a, configs: dict) -> dict:
    from raytrain_scu.studies.bench.measure import device_name, versions

    return {"protocol": "v2", "split": None,
            "setting": {"rules": json.loads(json.dumps({k: getattr(a, k) for k in RULE_ARGS})),
                        "plants": p.PLANTS, "select_stream": p.SELECT_STREAM,
                        "config_yaml": {pl: to_yaml(c, redact=True) for pl, c in configs.items()},
                        "device": device_name(), "versions": versions(),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
            "plants": {pl: {"trials": [], "units": {}, "calls": []} for pl in p.PLANTS}}


def locked(flat: dict) -> dict:
    """A flat config's keys that every call of the study must share (all but :data:`FREE_KEYS`)."""
    return {k: v for k, v in flat.items() if not k.startswith(FREE_KEYS)}


def locked_changes(recorded_yaml: str, cfg) -> list[str]:
    """``key: recorded -> now`` for each locked key whose value differs from the plant's recorded config (compared as
    a re-run's config revision is: ``tracking.revisions.config_changes``)."""
    changes = config_changes(locked(flatten_tree(yaml.safe_load(recorded_yaml))), locked(flatten(cfg)))
    return [f"{k}: {old} -> {new}" for k, (old, new) in sorted(changes.items())]


def check_locked(recorded: dict, plant: str, cfg) -> None:
    """The plant's resolved config must match the one in ``recorded`` (plant -> YAML) but for :data:`FREE_KEYS`;
    a plant config ``recorded`` lacks is recorded."""
    changes = locked_changes(recorded[plant], cfg) if plant in recorded else []
    if changes:
        free = ", ".join(k.rstrip(".") + (".*" if k.endswith(".") else "") for k in FREE_KEYS)
        raise AblationError(f"{plant}: this call's resolved config differs from the one its plant's first call "
                            f"recorded, in {'; '.join(changes)}. Only how trials share a machine and where they are "
                            f"stored may change ({free})")
    recorded.setdefault(plant, to_yaml(cfg, redact=True))


def check_rules(results: dict, a, configs: dict) -> None:
    """A later call keeps the first call's rules and each plant's resolved config (but for :data:`FREE_KEYS`);
    a plant config the file lacks is recorded."""
    rules = results["setting"]["rules"]
    current = json.loads(json.dumps({k: getattr(a, k) for k in RULE_ARGS}))
    differ = [f"--{k.replace('_', '-')} {current[k]} (the study's: {rules[k]})" for k in RULE_ARGS
              if rules.get(k) != current[k]]
    if differ:
        raise AblationError(f"this study's rules were fixed by its first call; this call changes {'; '.join(differ)}. "
                            f"Give the recorded values, or start a new study with another --out")
    for pl, c in configs.items():
        check_locked(results["setting"]["config_yaml"], pl, c)


def the_split(results: dict, a, cfg) -> str:
    """Choose (first call) or check (later calls) the seeds and their three-way split; the text to print."""
    d = cfg.data
    docs = load_documents(d.source, d.path, d.text_field, d.max_documents)
    choice = p.choose_seeds(docs, a.seeds, d.val_fraction)
    choice["titles"] = p.play_titles(docs)
    if results["split"] is None:
        results["split"] = choice
    elif json.loads(json.dumps(choice)) != results["split"]:
        raise AblationError("the data give another split than the one recorded: the study's data changed "
                            "(data.max_documents, data.val_fraction, the source?)")
    return p.split_text(choice, choice["titles"])


def run_calls(results: dict, a, plants: list[str], stages: list[str], configs: dict, path: Path) -> None:
    """Each plant's stages in order, at most ``--max-trials`` trials in all; a stage whose inputs are missing waits
    when an earlier stage of this call ran out of trials, and is an AblationError otherwise."""
    left = a.max_trials or math.inf
    for pl in plants:
        rules, trials = results["setting"]["rules"], results["plants"][pl]["trials"]
        for stage in stages:
            missing = [s for s in p.NEEDS[stage] if not p.stage_done(trials, s, results["split"]["seeds"],
                                                                      rules["lambdas"])]
            if missing and not set(missing) <= set(stages):
                raise AblationError(f"{pl}: stage {stage} needs the whole {', '.join(missing)} stage first")
            if missing:
                print(f"[raytrain_scu] ablation v2 {pl} {stage}: waits for stage {', '.join(missing)}", flush=True)
                continue
            arms = call_arms(results, pl, stage, configs[pl])
            if not arms:
                print(f"[raytrain_scu] ablation v2 {pl} {stage}: every trial already in {path}, kept", flush=True)
                continue
            take = arms[:int(min(left, len(arms)))]
            if not take:
                print(f"[raytrain_scu] ablation v2 {pl} {stage}: {len(arms)} trial(s) left for a later call "
                      f"(--max-trials reached)", flush=True)
                continue
            if a.plan:
                print(f"[raytrain_scu] ablation v2 {pl} {stage}: would run {len(take)} of {len(arms)} pending: "
                      + ", ".join(f"{p.label(x)} seed {x['seed']}" for x in take), flush=True)
            else:
                print(f"[raytrain_scu] ablation v2 {pl} {stage}: running {len(take)} of {len(arms)} pending trial(s)",
                      flush=True)
                run_call(results, pl, stage, take, a, path)
                print(f"[raytrain_scu] ablation v2 {pl} {stage}: {len(take)} trial(s) recorded in "
                      f"{results['plants'][pl]['calls'][-1]['wall_s']:.0f} s: {path}", flush=True)
            left -= len(take)


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 with results written, 1 when a trial cannot be scored or a stage's inputs are missing, 2 for bad input."""
    a = parse_args(argv)
    try:
        plants = _names(a.plants, p.PLANTS, "plants")
        stages = _names(a.stages, p.STAGES, "stages")
        if a.max_trials < 0:
            raise ValueError(f"--max-trials: expected >= 0, got {a.max_trials}")
        configs = {pl: plant_config(a.config, pl, a.overrides) for pl in plants}  # a bad config fails before Ray
    except (*USER_ERRORS, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else new_results(a, configs)
    try:
        check_rules(results, a, configs)
        print("[raytrain_scu] ablation v2: the plays of each seed (train | select | report)\n"
              + the_split(results, a, configs[plants[0]]), flush=True)
    except (*USER_ERRORS, AblationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.plan:
        save(results, path)  # the rules and the split, before any trial
    try:
        run_calls(results, a, plants, stages, configs, path)
    except (AblationError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.plan:
        return 0
    print(report.write(results, out, n_boot=a.bootstrap))
    return 0
