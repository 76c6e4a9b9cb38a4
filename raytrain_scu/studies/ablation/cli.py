"""``python -m raytrain_scu.ablation``: the first GPU study's staged runner, or with ``--protocol v2`` the study v2's
(:mod:`raytrain_scu.studies.ablation.v2.cli`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from raytrain_scu.driver.resolve import resolve
from raytrain_scu.errors import USER_ERRORS, AblationError, CheckpointError
from raytrain_scu.studies.ablation import report as ablation_report
from raytrain_scu.studies.ablation.results import save
from raytrain_scu.studies.ablation.run import (
    NEEDS,
    STAGES,
    check_law,
    check_rules,
    choose_targets,
    run_stage,
    setting,
)


def parse_args(argv):
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(prog="python -m raytrain_scu.ablation", description="The staged SCU study: none vs fixed λ vs SCU, on Ray Tune")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--out", default="ablation_out", help="directory of results.json (read to resume), plots, table")
    p.add_argument("--stages", default=",".join(STAGES), help=f"stages to run, in order, of {','.join(STAGES)}")
    p.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--lambdas", default="1e-4,1e-3,1e-2,0.1,1,10,100,1000", type=floats)
    p.add_argument("--target-factors", default="0.5,1,2", type=floats, help="S* = the best fixed λ's S times these")
    p.add_argument("--gains", default="0.4:0.075,0.2:0.04,0.1:0.02",
                   type=lambda s: [tuple(float(v) for v in g.split(":")) for g in s.split(",")],
                   help="the stability grid's Kp:Ki pairs (the default gains' runs are the scu arm's)")
    p.add_argument("--kp-range", default="0.05,1.6", type=floats)
    p.add_argument("--ki-range", default="0.005,0.3", type=floats)
    p.add_argument("--sweep-samples", default=8, type=int)
    p.add_argument("--sweep-grace-steps", default=100, type=int, help="steps before ASHA may stop a sweep trial")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--protocol", default="v1", choices=["v1", "v2"], help="v2: the study of docs/control.md §7")
    return p.parse_args(argv)


def protocol_of(argv: list[str]) -> str:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--protocol", default="v1")
    return p.parse_known_args(argv)[0].protocol


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 with results written, 1 when a trial cannot be compared (re-run to resume), 2 for a bad config."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if protocol_of(argv) == "v2":
        from raytrain_scu.studies.ablation.v2.cli import main as v2_main

        return v2_main(argv)
    a = parse_args(argv)
    stages = [s for s in a.stages.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    try:
        if bad:
            raise ValueError(f"--stages: unknown {bad}, expected some of {', '.join(STAGES)}")
        cfg = resolve(a.config, a.overrides)  # a bad config fails here, before any sweep starts
        check_law(cfg)
    except (*USER_ERRORS, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"setting": setting(cfg, a), "stages": {}}
    try:
        check_rules(results["setting"]["args"], a)
    except AblationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "fixed" in results["stages"]:  # the current rule's targets, whatever rule wrote the file
        results["stages"]["fixed"]["choice"] = choose_targets(results["stages"]["fixed"]["trials"], a.target_factors)
        save(results, path)
    try:
        for name in stages:
            if name in results["stages"]:
                print(f"[raytrain_scu] ablation stage {name}: already in {path}, kept", flush=True)
                continue
            missing = [s for s in NEEDS[name] if s not in results["stages"]]
            if missing:
                raise AblationError(f"stage {name} needs {', '.join(missing)} first (in {path})")
            run_stage(name, results, a)
            save(results, path)
            print(f"[raytrain_scu] ablation stage {name} done in {results['stages'][name]['wall_s']:.0f} s: "
                  f"{path}", flush=True)
    except (AblationError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = ablation_report.write(results, out, n_boot=a.bootstrap)
    print(report)
    return 0

