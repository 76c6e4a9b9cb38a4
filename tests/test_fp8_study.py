"""The FP8 accuracy study (docs/fp8-accuracy.md): its arms as Tune grids, its gap and decision on hand-made records
(no training), and its CLI's refusals, plan and resumable calls (the training itself is the study v2's run_grid and
collect, tested in test_ablation_v2.py)."""
import json
import math

import pytest
from conftest import ROOT
from test_fp8 import cpu_fp8

from raytrain_scu.ray.tune import space as sweep_space
from raytrain_scu.studies.ablation.fp8 import cli as fp8_cli
from raytrain_scu.studies.ablation.fp8 import protocol as p
from raytrain_scu.studies.ablation.fp8 import report
from raytrain_scu.studies.ablation.fp8 import run as fp8_run

V2_YAML = str(ROOT / "experiments" / "ablation-v2.yaml")
LN2 = math.log(2.0)


@cpu_fp8
def test_each_seed_has_a_bf16_and_an_fp8_arm_at_fixed_lambda_on_v2s_plants(tmp_path):
    arms = p.arms([0, 1, 3])
    assert [(p.label(a), a["seed"]) for a in arms] == [("bf16", 0), ("fp8", 0), ("bf16", 1), ("fp8", 1),
                                                        ("bf16", 3), ("fp8", 3)]
    for plant, (r, steps) in {"P1": (16, 300), "P2": (64, 600)}.items():
        cfg = fp8_run.plant_config(V2_YAML, plant, [f"run.storage_path={tmp_path}", "tune.search=grid",
                                                    "tune.scheduler=none"])
        cfg.tune.space = {"arm": {"grid": arms}}
        sweep_space.resolve_space(cfg)
        for i, a in enumerate(arms[:2]):
            t = sweep_space.trial_config(cfg, {"arm": a}, f"t{i}")
            assert (t.lora.r, t.train.max_steps, t.controller.mode, t.controller.lambda_init) == (r, steps, "fixed",
                                                                                                  0.1)
            assert t.model.base_fp8 is (p.label(a) == "fp8") and t.model.fp8_rounding == "gptq"
    done = [{"arm": "bf16", "seed": 0}, {"arm": "fp8", "seed": 1}]
    assert [(p.label(a), a["seed"]) for a in p.pending(arms, done)] == [("fp8", 0), ("bf16", 1), ("bf16", 3),
                                                                       ("fp8", 3)]


def trial(arm: str, seed: int, bpt: float) -> dict:
    return {"arm": arm, "seed": seed, "trial": f"{arm}-{seed}", "report_bpt": bpt, "time_s": 60.0,
            "report_nats": [bpt * 100 * LN2] * 4, "params": {"model.base_fp8": arm == "fp8"}}


def plant(gaps: dict, seeds=(0, 1, 3)) -> dict:
    """bf16-trained adapters at 4.9 + seed/100; fp8-trained ones ``gaps[seed]`` above (a missing seed: no fp8 run)."""
    trials = []
    for s in seeds:
        trials.append(trial("bf16", s, 4.9 + s / 100))
        if s in gaps:
            trials.append(trial("fp8", s, 4.9 + s / 100 + gaps[s]))
    return {"split": {"seeds": list(seeds)}, "trials": trials, "calls": [],
            "units": {str(s): {"report_tokens": [100] * 4} for s in seeds}}


def test_fp8_becomes_the_default_only_when_every_plants_upper_end_is_within_the_tolerance(tmp_path):
    tight = plant({0: 0.002, 1: 0.004, 3: 0.003})
    n = report.plant_numbers(tight, n_boot=200)
    assert n["gap"]["mean"] == pytest.approx(0.003, abs=1e-9)
    assert n["gap"]["t_high"] == pytest.approx(0.003 + 4.303 * 0.001 / math.sqrt(3), abs=1e-6)
    assert n["complete"] and n["passes"]
    # mean 0.0033 but noisy: the interval's upper end (~0.041) is past the tolerance, so a noisy result fails
    noisy = plant({0: 0.0, 1: 0.02, 3: -0.01})
    assert not report.plant_numbers(noisy, n_boot=200)["passes"]
    assert report.decision({"P1": n, "P2": report.plant_numbers(tight, 200)}) == "default"
    assert report.decision({"P1": n, "P2": report.plant_numbers(noisy, 200)}) == "opt-in"
    missing = report.plant_numbers(plant({0: 0.002, 1: 0.004}), 200)
    assert not missing["complete"] and report.decision({"P1": n, "P2": missing}).startswith("incomplete")
    text = report.write({"plants": {"P1": tight, "P2": noisy}}, tmp_path)
    assert text.startswith("**Decision: FP8 fails on at least one plant: `model.base_fp8` stays opt-in.**")
    assert "| 1 | 4.9100 | 4.9300 | +0.0200 |" in text and "Upper end ≤ +0.01: no" in text
    assert json.loads((tmp_path / "summary.json").read_text())["decision"] == "opt-in"
    one_plant = report.write({"plants": {"P1": tight, "P2": plant({}, seeds=())}}, tmp_path)
    assert one_plant.startswith("**Decision: incomplete")  # a plant not run yet decides nothing


def fake_run_call(results, plant_name, arms, a, path):
    """``run.run_call`` without Ray: each arm a hand-made trial, fp8 0.003 bits above bf16."""
    from raytrain_scu.studies.ablation.results import save

    rec = results["plants"][plant_name]
    for arm in arms:
        rec["trials"].append(trial(p.label(arm), arm["seed"], 4.9 + (0.003 if p.label(arm) == "fp8" else 0.0)))
        rec["units"][str(arm["seed"])] = {"report_tokens": [100] * 4}
    rec["calls"].append({"trials": [p.label(x) for x in arms], "wall_s": 1.0, "device": "cpu", "gpus": 0,
                         "overrides": list(a.overrides), "started": "-"})
    save(results, path)


@cpu_fp8
def test_the_cli_refuses_bad_input_plans_and_goes_on_from_its_file_in_calls(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert fp8_cli.main([V2_YAML, "--plants", "P3", "--out", str(out)]) == 2
    assert "--plants: unknown ['P3']" in capsys.readouterr().err
    assert fp8_cli.main([V2_YAML, "controller.law=nope", "--out", str(out)]) == 2
    assert "controller.law" in capsys.readouterr().err
    storage = f"run.storage_path={tmp_path / 'runs'}"
    assert fp8_cli.main([V2_YAML, storage, "--plan", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "P1: would run 6 of 6 pending: bf16 seed 0, fp8 seed 0, bf16 seed 1" in text and "seed 3: train = " in text
    assert not out.exists()
    monkeypatch.setattr(fp8_cli, "run_call", fake_run_call)
    assert fp8_cli.main([V2_YAML, storage, "--max-trials", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "P1: running 4 of 6 pending" in text and "P2: 6 trial(s) pending, none in this call" in text
    assert "Decision: incomplete" in text
    assert fp8_cli.main([V2_YAML, storage, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "P1: running 2 of 2 pending: bf16 seed 3, fp8 seed 3" in text and "P2: running 6 of 6" in text
    assert "Decision: FP8 passes on every plant" in text
    assert fp8_cli.main([V2_YAML, storage, "--seeds", "0,1", "--out", str(out)]) == 2
    assert "rules were fixed by its first call" in capsys.readouterr().err
    assert fp8_cli.main([V2_YAML, storage, "lora.dropout=0.1", "--out", str(out)]) == 2
    assert "differs from the one its plant's first call recorded" in capsys.readouterr().err
