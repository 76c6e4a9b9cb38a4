"""The first GPU study's ablation: the stage rules, tracking of known traces, the tables without NaN, the held-out
units, the arms as valid sweeps, checkpoints refused, and the whole staged runner on hand-made trials (real
checkpoints and results file, no training), and the sweep stage for real (one Ray Tune trial). Ray Tune and real
training of the grid stages run in test_ablation_v2's tiny stage, through the same run_grid, checkpoint and scoring
code."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, TINY

from raytrain_scu.config.load import load_config
from raytrain_scu.core.checkpoint import write_checkpoint
from raytrain_scu.ray.tune import space as sweep_space
from raytrain_scu.studies.ablation import cli as ablation_cli
from raytrain_scu.studies.ablation import report as ablation_report
from raytrain_scu.studies.ablation import run as ablation

GPU_YAML = str(ROOT / "experiments" / "ablation-gpu.yaml")
LN2 = math.log(2.0)


# ---------------------------------------------------------------- the rules between stages

def hist(s_hat, lam, data=4.0, upd=0.1):
    n = len(s_hat)
    return {"step": list(range(1, n + 1)), "ctrl/s": list(s_hat), "ctrl/s_hat": list(s_hat), "ctrl/lambda": list(lam),
            "train/data_bpt": [data] * n, "train/param_bpt_update": [upd] * n, "ctrl/saturated_step": [None] * n,
            "train/param_bpt_a": [1.0] * n, "train/param_bpt_b": [0.5] * n, "val/data_bpt": [None] * n}


def test_targets_come_from_the_best_fixed_lambda_by_a_rule_that_stays_in_0_1():
    trials = [{"family": "fixed", "params": {"controller.lambda_init": lam}, "val_bpt": bpt,
               "history": hist([0.9] * 8 + [s] * 2, [lam] * 10)}
              for lam, bpt, s in ((0.1, 5.0, 0.6), (0.1, 5.2, 0.6), (1.0, 5.05, 0.2), (1.0, 5.05, 0.2))]
    choice = ablation.choose_targets(trials + [{"family": "none", "val_bpt": 1.0}], [0.5, 1, 2])
    assert choice["best_lambda"] == 1.0  # mean 5.05 < 5.1; the none arm is not a candidate
    assert choice["s_best"] == pytest.approx(0.2)  # the last 20% of the steps
    assert choice["targets"] == [pytest.approx(1 / 9, abs=1e-3), 0.2, pytest.approx(1 / 3, abs=1e-3)]
    assert choice["targets_init"] == choice["targets"]
    assert ablation.scaled_target(0.9, 2) < 1 and ablation.scaled_target(0.9, 0.5) > 0  # never 1.8
    assert choice["s_update_best"] == pytest.approx(0.1 / 4.1)
    with pytest.raises(ablation.AblationError, match="no fixed-λ trial"):
        ablation.choose_targets([{"family": "none", "val_bpt": 1.0}], [1])


def test_arms_are_valid_grids_and_their_family_reads_back(tmp_path):
    choice = {"targets": [0.1, 0.2, 0.4], "targets_init": [0.1, 0.2, 0.4]}
    stages = {"fixed": ablation.fixed_arms([0, 1], [0.1, 1.0]),
              "scu": ablation.scu_arms([0, 1], choice, [(0.2, 0.04)]),
              "tuned": ablation.tuned_arms([0, 1], choice, {"controller.kp": 0.3, "controller.ki": 0.01})}
    families = {}
    for stage, arms in stages.items():
        cfg = load_config(GPU_YAML, [f"run.storage_path={tmp_path}", "tune.search=grid", "tune.scheduler=none"])
        cfg.tune.space = {"arm": {"grid": arms}}
        sweep_space.resolve_space(cfg)  # every arm makes a valid config
        for a in arms:
            families[ablation.family_of(stage, a)] = families.get(ablation.family_of(stage, a), 0) + 1
    assert families == {"none": 2, "fixed": 4, "scu": 6, "scu_init": 6, "gains": 1, "tuned": 2}
    gains, = [a for a in stages["scu"] if "controller.kp" in a]
    assert (gains["controller.target_s"], gains["seed"]) == (0.2, 0)  # the middle target, the first seed
    space = ablation.sweep_space_for(choice, (0.05, 1.6), (0.005, 0.3))
    assert space["controller.target_s"] == {"loguniform": [0.1, 0.4]}


# ---------------------------------------------------------------- statistics of known traces

def test_tracking_is_core_settlings_on_known_traces():
    # Ŝ at S* from step 31 on; λ at its upper bound for 10 steps, then falls, then jitters by x1.2 (ln 0.18 < 0.5)
    s_hat = [0.5] * 30 + [0.2] * 120
    lam = [1000.0] * 10 + [3.0] * 20 + [0.1, 0.12] * 60
    t = {"history": hist(s_hat, lam), "target_s": 0.2, "lambda_min": 1e-4, "lambda_max": 1000.0}
    out = ablation_report.tracking(t)
    assert (out["settled_step"], out["settled_step_raw"]) == (31, 31)
    assert (out["steps_at_bound"], out["last_bound_step"], out["bound_hits"], out["reversals"]) == (10, 10, 1, 0)
    assert out["second_half_error"] == 0.0
    t["history"]["ctrl/s"] = [0.5] * 30 + [0.2, 0.3] * 60  # raw S leaves the band every other step
    t["history"]["ctrl/lambda"] = lam[:-1] + [1000.0]  # and λ meets its bound at the last step
    out = ablation_report.tracking(t)
    assert (out["settled_step"], out["settled_step_raw"], out["last_bound_step"]) == (None, None, 150)
    swings = [1.0, 2.0] * 5  # ln 2 = 0.69 each way: 8 reversals after the first move
    assert ablation_report.tracking({**t, "history": hist([0.2] * 10, swings)})["reversals"] == 8


def test_scoring_units_cut_whole_sections_and_keep_all_text():
    doc = "\n\n".join(f"speech {i} " + "x" * (30 * (i % 4 + 1)) for i in range(20))
    units = ablation.scoring_units([doc, "short"], min_chars=200)
    assert units[-1] == "short"  # a document shorter than a unit is one unit
    assert all(len(u) >= 200 for u in units[:-1])
    assert "".join(units[:-1]).replace("\n\n", "") == doc.replace("\n\n", "")


# ---------------------------------------------------------------- the report of a known results file

def trial(family, seed, params, nats, *, target=0.2, s=0.2):
    return {"stage": "x", "family": family, "seed": seed, "trial": f"{family}{seed}{params}", "params": params,
            "target_s": target, "kp": params.get("controller.kp", 0.8), "ki": params.get("controller.ki", 0.15),
            "lambda_min": 1e-4, "lambda_max": 10.0, "deadband": 0.002, "prior_center": "zero", "time_s": 10.0,
            "val_bpt": float(np.sum(nats) / 400 / LN2), "unit_nats": list(nats),
            "history": hist([s] * 10, [1.0, 2.0] * 5 if family.startswith("scu") else [1.0] * 10)}


@pytest.fixture
def results():
    rng = np.random.default_rng(0)
    fixed, scu, units = [], [], {}
    for seed in (0, 1, 2):
        none = rng.uniform(300, 400, 4)
        units[str(seed)] = {"tokens": [100] * 4, "base_bpt": 5.0}
        fixed += [trial("none", seed, {"controller.mode": "none"}, none),
                  trial("fixed", seed, {"controller.mode": "fixed", "controller.lambda_init": 1.0}, none - 10),
                  trial("fixed", seed, {"controller.mode": "fixed", "controller.lambda_init": 10.0}, none + 5)]
        scu.append(trial("scu", seed, {"controller.mode": "scu", "controller.target_s": 0.2}, none - 12))
    return {"setting": {"args": {"seeds": [0, 1, 2]}, "device": "cpu", "gpus": 0, "versions": {}, "started": "-",
                        "config_yaml": "seed: 0\n"},
            "stages": {"fixed": {"trials": fixed, "units": units,
                                 "choice": {"best_lambda": 1.0, "s_best": 0.2, "s_update_best": 0.1,
                                            "targets": [0.2], "targets_init": [0.2]}},
                       "scu": {"trials": scu, "units": units}}}


def test_summary_pairs_each_arm_with_none_and_the_best_fixed_lambda(results):
    rows = {r["arm"]: r for r in ablation_report.summarize(results, n_boot=200)}
    assert list(rows) == ["none", "fixed λ=1", "fixed λ=10", "scu S*=0.2"]
    assert rows["fixed λ=1"]["gap_none"] == pytest.approx(-10 / 100 / LN2)  # nats per unit of 100 tokens → bits
    assert rows["scu S*=0.2"]["gap_best_fixed"] == pytest.approx(-2 / 100 / LN2)
    assert rows["fixed λ=1"]["gap_best_fixed"] == 0.0 and rows["none"]["gap_none"] == 0.0
    assert rows["scu S*=0.2"]["reversals"] == 8  # λ 1, 2, 1, 2 ...: ln λ moves by 0.69 each step
    assert rows["scu S*=0.2"]["settled_step"] == [None] * 3  # 10 steps: fewer than the 100 a settled run needs
    assert "reversals" not in rows["none"]  # no tracking for a run without a controller
    assert rows["none"]["seeds"] == [0, 1, 2] and math.isfinite(rows["none"]["val_bpt_ci95"])


def test_report_tables_have_no_nan_and_the_json_is_valid(results, tmp_path):
    text = ablation_report.write(results, tmp_path, n_boot=100)
    assert "nan" not in text.lower()
    assert "| scu S*=0.2 | 3 | 0.2 | -, -, - | -, -, - | 0 | 8.0 | 0.0 | -, -, - |" in text  # the tracking table
    assert (tmp_path / "plots" / "regime.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.loads((tmp_path / "summary.json").read_text())


# ---------------------------------------------------------------- checkpoints

def fake_checkpoint(path, step, history):
    """A real write_checkpoint (manifest and all) of stand-in model and optimizer state."""
    def save_pretrained(out, safe_serialization=True):
        Path(out).mkdir(parents=True)
        (Path(out) / "adapter_model.safetensors").write_bytes(b"w" * 64)

    state = SimpleNamespace(state_dict=lambda: {})
    return write_checkpoint(path, model=SimpleNamespace(save_pretrained=save_pretrained), optimizer=state,
                            scaler=state, controller_state={}, step=step, position=0, structure={},
                            tokens_per_epoch=1, config_yaml="", history=history)


def test_final_checkpoint_verifies_and_must_be_the_last_step(tmp_path):
    with pytest.raises(ablation.AblationError, match="no checkpoint"):
        ablation.final_checkpoint(tmp_path, 30)
    fake_checkpoint(tmp_path / "checkpoint_000000", 10, [{"step": 10}])
    final = fake_checkpoint(tmp_path / "checkpoint_000001", 30, [{"step": 30}])
    assert ablation.final_checkpoint(tmp_path, 30) == final
    assert ablation.history(final) == [{"step": 30}]
    # the final one truncated: the older good one is not taken in its place
    (final / "state.pt").write_bytes((final / "state.pt").read_bytes()[:10])
    with pytest.raises(ablation.AblationError, match="checkpoint_000000 is of step 10.*checkpoint_000001"):
        ablation.final_checkpoint(tmp_path, 30)


def test_a_later_call_cannot_change_the_studys_rules(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    recorded = {"config": TINY, "seeds": [0, 1], "lambdas": [0.1, 1.0], "target_factors": [0.5, 1.0, 2.0],
                "gains": [[0.2, 0.04]], "kp_range": [0.05, 1.6], "ki_range": [0.005, 0.3], "sweep_samples": 8}
    (out / "results.json").write_text(json.dumps({"setting": {"args": recorded}, "stages": {}}))
    flags = [TINY, "controller.law=spec", "--out", str(out), "--seeds", "0,1", "--lambdas", "0.1,1", "--gains",
             "0.2:0.04", "--stages", ""]
    assert ablation_cli.main([*flags, "--target-factors", "1,3"]) == 2
    assert "changes --target-factors [1.0, 3.0] (the study's: [0.5, 1.0, 2.0])" in capsys.readouterr().err
    a = ablation_cli.parse_args(flags)
    ablation.check_rules(recorded, a)  # the same rules: accepted, and a rule flag the file lacked is recorded
    assert recorded["sweep_grace_steps"] == 100


def test_bad_stage_and_bad_config_exit_2_before_ray(capsys, tmp_path):
    assert ablation_cli.main([TINY, "--stages", "fixed,nope"]) == 2
    assert "unknown ['nope']" in capsys.readouterr().err
    assert ablation_cli.main([TINY, "controller.kp=-1"]) == 2
    assert "controller.kp: must be >= 0" in capsys.readouterr().err
    # the study is of the spec's law: a config of the logodds law (the default) is refused before any stage
    assert ablation_cli.main([TINY, "--stages", "", "--out", str(tmp_path / "out")]) == 2
    assert "controller.law: this study is of the spec law" in capsys.readouterr().err


# ---------------------------------------------------------------- the staged runner on hand-made trials

def fake_grid(calls):
    """``run.run_grid`` without Ray: each arm's trial gets a real checkpoint (stand-in weights) of a flat history."""
    from raytrain_scu.config.paths import run_dir
    from raytrain_scu.driver.resolve import resolve

    def grid(config_path, overrides, name, arms):
        calls.append(name)
        cfg = resolve(config_path, [*overrides, "tune.search=grid", "tune.scheduler=none"])
        cfg.tune.space = {"arm": {"grid": arms}}
        cfg.run.name = f"{cfg.run.name}-{name}"
        rows = []
        for i, arm in enumerate(arms):
            row = {"trial": f"{name}_{i:05d}", "params": {"arm": arm}, "status": "FINISHED", "time_s": 1.0}
            tcfg = sweep_space.trial_config(cfg, row["params"], row["trial"])
            lam = tcfg.controller.lambda_init
            steps = [{"step": s, "train/data_bpt": 4.0, "train/param_bpt": 1.0, "train/param_bpt_a": 0.6,
                      "train/param_bpt_b": 0.4, "train/param_bpt_update": 0.1, "ctrl/s": 0.2, "ctrl/s_hat": 0.2,
                      "ctrl/lambda": lam, "ctrl/lambda_applied": lam, "val/data_bpt": 5.0}
                     for s in range(1, tcfg.train.max_steps + 1)]
            fake_checkpoint(Path(run_dir(tcfg)) / "checkpoint_000000", tcfg.train.max_steps, steps)
            rows.append(row)
        return cfg, rows
    return grid


@pytest.mark.slow
def test_staged_ablation_runs_every_stage_in_order_and_resumes_from_its_file(tmp_path, capsys, monkeypatch):
    from raytrain_scu.driver import evaluate

    grids = []
    monkeypatch.setattr(ablation, "run_grid", fake_grid(grids))
    monkeypatch.setattr(evaluate, "score_shard", lambda config, adapters, docs: {  # adapter k scores 300 + k nats
        "tokens": np.full(len(docs), 100), "nats": {a: np.full(len(docs), 300.0 + k) for k, a in enumerate(adapters)}})
    best = {"controller.kp": 0.3, "controller.ki": 0.01, "controller.target_s": 0.2}
    monkeypatch.setattr(ablation, "run_sweep_stage", lambda *_: {"rows": [
        {"trial": "s0", "params": best, "metric": 4.7, "steps": 4, "status": "FINISHED"}], "best": best,
        "metric": "val/data_bpt"})
    out = tmp_path / "out"
    args = [TINY, "controller.law=spec", f"run.storage_path={tmp_path}/runs", "data.max_documents=3", "run.name=abl",
            "train.max_steps=4", "train.report_every=2", "train.eval_every=2", "train.checkpoint_every=4", "--out",
            str(out), "--seeds", "0,1", "--lambdas", "0.1,1", "--target-factors", "1", "--gains", "0.2:0.04", "--bootstrap", "50"]
    assert ablation_cli.main(args) == 0
    assert grids == ["fixed", "scu", "tuned"]  # and the sweep between scu and tuned
    res = json.loads((out / "results.json").read_text())
    assert list(res["stages"]) == list(ablation.STAGES)
    families = sorted(t["family"] for st in res["stages"].values() for t in st.get("trials", []))
    assert families == ["fixed"] * 4 + ["gains"] + ["none"] * 2 + ["scu"] * 2 + ["scu_init"] * 2 + ["tuned"] * 2
    fixed = res["stages"]["fixed"]
    assert fixed["choice"]["best_lambda"] == 0.1 and fixed["choice"]["targets"] == [0.2]  # the lower scores win
    for st in ("fixed", "scu", "tuned"):
        for t in res["stages"][st]["trials"]:
            assert len(t["unit_nats"]) == len(res["stages"][st]["units"][str(t["seed"])]["tokens"]) > 1
            assert t["history"]["step"][-1] == 4 and t["history"]["ctrl/s_hat"][-1] == 0.2
    assert {t["kp"] for t in res["stages"]["tuned"]["trials"]} == {0.3}  # the sweep's best gains
    assert "### Tracking and λ" in (out / "table.md").read_text()
    capsys.readouterr()
    assert ablation_cli.main(args) == 0  # everything recorded: no stage runs again
    assert capsys.readouterr().out.count("already in") == 4 and grids == ["fixed", "scu", "tuned"]


# ---------------------------------------------------------------- the sweep stage, for real

@pytest.mark.slow
def test_the_sweep_stage_runs_a_tune_sweep_of_scu_trials_around_the_fixed_stages_target(ray_local, results, tmp_path):
    """run_stage("sweep") on the hand-made fixed stage above (its rule gives S* = 0.2): a real random-search Tune
    sweep with ASHA (one 2-step trial: each costs a Ray Train run) of an SCU run on the study's first seed, its Kp, Ki
    and S* drawn from the stage's ranges; the stage records the trial and takes its gains as the best. Which of several
    trials is best is the sweep's order (test_sweep.py's three-trial sweep)."""
    import yaml

    a = SimpleNamespace(config=TINY, seeds=[3, 4], target_factors=[1.0], kp_range=(0.05, 1.6), ki_range=(0.005, 0.3),
                        sweep_samples=1, sweep_grace_steps=2,
                        overrides=["controller.law=spec", f"run.storage_path={tmp_path}", "run.name=abl",
                                   "scaling.num_workers=1",
                                   "scaling.cpus_per_worker=0.49", "data.max_documents=3", "train.max_steps=2",
                                   "train.report_every=2", "train.eval_every=2", "train.checkpoint_every=2",
                                   "train.eval_blocks=8", "tracking.enabled=false"])
    ablation.run_stage("sweep", results, a)
    sweep = results["stages"]["sweep"]
    row, = sweep["rows"]
    assert sweep["metric"] == "val/data_bpt" and sweep["wall_s"] > 0 and sweep["overrides"] == a.overrides
    assert row["status"] == "FINISHED" and row["steps"] == 2 and 10 < row["metric"] < 11.1  # ≈ log2(2048): 2 steps
    p = row["params"]
    assert p.keys() == {"controller.kp", "controller.ki", "controller.target_s"} and sweep["best"] == p
    assert 0.05 <= p["controller.kp"] <= 1.6 and 0.005 <= p["controller.ki"] <= 0.3
    assert 0.1 <= p["controller.target_s"] <= 0.4  # one target (0.2): from half to twice it
    # the trial ran as an SCU run on the first seed, under the stage's own name, with the drawn values
    saved, = (tmp_path / "abl-sweep").glob("**/checkpoint_*/config.yaml")
    c = yaml.safe_load(saved.read_text())
    assert (c["controller"]["mode"], c["seed"]) == ("scu", 3)
    assert {k: c["tune"][k] for k in ("search", "scheduler", "metric", "mode", "num_samples", "grace_period")} == {
        "search": "random", "scheduler": "asha", "metric": "val/data_bpt", "mode": "min", "num_samples": 1,
        "grace_period": 1}  # the first rung at --sweep-grace-steps (2 steps: the first report)
    assert c["tune"]["space"]["controller.target_s"] == {"loguniform": [0.1, 0.4]}
    assert [c["controller"][k] for k in ("kp", "ki", "target_s")] == [p[f"controller.{k}"]
                                                                      for k in ("kp", "ki", "target_s")]
