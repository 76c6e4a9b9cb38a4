"""The study v2 (docs/control.md §7): its split, arms, choices on the select plays, early stopping, gaps and decision
on hand-made records (no training), the report of a hand-made results.json, the CLI's refusals and its splitting
into calls; then one real tiny stage on CPU workers through Ray Tune, resumed from its file."""
import json
import math
import re

import pytest
from conftest import ROOT, TINY

from raytrain_scu.core.data.blocks import split_documents
from raytrain_scu.ray.tune import space as sweep_space
from raytrain_scu.studies.ablation import report_cli
from raytrain_scu.studies.ablation.v2 import cli as v2_cli
from raytrain_scu.studies.ablation.v2 import protocol as p
from raytrain_scu.studies.ablation.v2 import report as v2_report
from raytrain_scu.studies.ablation.v2 import run as v2_run
from raytrain_scu.studies.ablation.v2 import stats

V2_YAML = str(ROOT / "experiments" / "ablation-v2.yaml")
LN2 = math.log(2.0)
DOCS = [f"PLAY {k}\n\nsome text of play {k}" for k in range(9)]


# ---------------------------------------------------------------- the split

def test_the_split_is_three_way_disjoint_seeded_and_printed_per_seed():
    choice = p.choose_seeds(DOCS, [0, 1, 3], 0.667)
    assert choice["seeds"] == [0, 1, 3] and choice["replaced"] == {}
    for seed in (0, 1, 3):
        sp = choice["splits"][str(seed)]
        assert [len(sp[k]) for k in ("train", "select", "report")] == [3, 3, 3]
        assert sorted(sp["train"] + sp["select"] + sp["report"]) == list(range(9))
        _, held = split_documents(DOCS, val_fraction=0.667, seed=seed)  # the training loop's own held-out plays
        assert sorted(sp["select"] + sp["report"]) == sorted(DOCS.index(d) for d in held)
    assert p.choose_seeds(DOCS, [0, 1, 3], 0.667) == choice  # the same split on every call
    text = p.split_text(choice, p.play_titles(DOCS))
    first = choice["splits"]["0"]
    assert text.splitlines()[0] == ("seed 0: train = " + "; ".join(f"PLAY {i}" for i in first["train"]) +
                                    " | select = " + "; ".join(f"PLAY {i}" for i in first["select"]) +
                                    " | report = " + "; ".join(f"PLAY {i}" for i in first["report"]))


def test_a_seed_whose_split_repeats_an_earlier_one_is_replaced_by_the_next_unused_integer():
    docs = DOCS[:3]  # one play each: seeds 0 and 2 give the same split (train 1, select 0, report 2)
    assert p.play_split(docs, 0, 0.667) == p.play_split(docs, 2, 0.667)
    choice = p.choose_seeds(docs, [0, 2, 3], 0.667)
    # 2 repeats 0; 3 is requested, so 2 becomes 4 (whose split is new), and 3 keeps its own
    assert choice["seeds"] == [0, 4, 3] and choice["replaced"] == {"2": 4}
    assert "seed 2 repeats an earlier seed's split: replaced by seed 4" in p.split_text(choice, p.play_titles(docs))
    with pytest.raises(p.AblationError, match="twice"):
        p.choose_seeds(docs, [0, 0], 0.667)
    with pytest.raises(p.AblationError, match="at least 2"):
        p.play_split(docs, 0, 0.34)


# ---------------------------------------------------------------- the arms

def test_each_plant_has_the_protocols_48_arms_as_valid_tune_grids(tmp_path):
    fixed = p.stage_arms("fixed", [0, 1, 3], p.LAMBDAS, none_keys=p.none_extra(600, 10))
    laws = p.stage_arms("laws", [0, 1, 3], p.LAMBDAS, targets=[0.137, 0.241, 0.388])
    names = [p.label(a) for a in fixed + laws]
    assert len(fixed) == 30 and len(laws) == 18 and len(set(zip(names, [a["seed"] for a in fixed + laws]))) == 48
    assert sorted({p.family_of(a) for a in fixed + laws}) == ["fixed", "logodds", "none", "spec"]
    assert names[:3] == ["none", "fixed λ=0.001", "fixed λ=0.003"] and names[30:32] == ["spec S*=0.137", "spec S*=0.241"]
    cfg = v2_run.plant_config(V2_YAML, "P2", [f"run.storage_path={tmp_path}", "tune.search=grid", "tune.scheduler=none"])
    assert (cfg.lora.r, cfg.optim.lr, cfg.train.max_steps, cfg.data.max_documents) == (64, 5e-4, 600, 9)
    cfg.tune.space = {"arm": {"grid": fixed + laws}}
    sweep_space.resolve_space(cfg)  # every arm makes a valid config
    none = sweep_space.trial_config(cfg, {"arm": fixed[0]}, "t0")
    assert (none.controller.mode, none.train.checkpoint_every, none.run.num_to_keep) == ("none", 10, 61)
    law = sweep_space.trial_config(cfg, {"arm": laws[-1]}, "t1")  # controller.law is an arm key
    assert (law.controller.mode, law.controller.law, law.controller.target_s, law.seed) == ("scu", "logodds", 0.388, 3)


def test_pending_arms_are_the_unrecorded_ones_in_order():
    arms = p.stage_arms("fixed", [0, 1], [0.1, 1.0])
    done = [{"arm": "none", "seed": 0}, {"arm": "fixed λ=1", "seed": 0}]
    assert [(p.label(a), a["seed"]) for a in p.pending(arms, done)] == [
        ("fixed λ=0.1", 0), ("none", 1), ("fixed λ=0.1", 1), ("fixed λ=1", 1)]
    assert not p.stage_done(done, "fixed", [0, 1], [0.1, 1.0])
    assert p.stage_done(done + [{"arm": "fixed λ=0.1", "seed": 0}], "fixed", [0], [0.1, 1.0])


# ---------------------------------------------------------------- hand-made records

def hist(s_hat, lam, data=4.0):
    """Per-step columns as the runner records them (step 0 first, as the loop logs it)."""
    n = len(s_hat)
    param = [s / (1 - s) * data for s in s_hat]
    return {"step": list(range(n + 1)), "ctrl/s": [None, *s_hat], "ctrl/s_hat": [None, *s_hat],
            "ctrl/lambda": [1.0, *lam], "train/param_bpt": [None, *param], "train/data_bpt": [None] + [data] * n}


def trial(family, seed, value, report, select=None, *, s_hat=None, lam=None, n_units=4, steps=10, evals=None):
    """A recorded trial whose units all score ``report`` (``select``) bits per token of 100 tokens."""
    params = p.arm(family, seed, **({"lambda_init": value} if family == "fixed" else
                                    {"target_s": value} if family in p.LAWS else {}))
    select = report if select is None else select
    t = {"family": family, "arm": p.label(params), "seed": seed, "trial": f"{family}{value}-{seed}", "params": params,
         "law": family if family in p.LAWS else "spec", "target_s": value if family in p.LAWS else None,
         "lambda_min": 1e-4, "lambda_max": 1e3, "time_s": 10.0, "select_bpt": select, "report_bpt": report,
         "select_nats": [select * 100 * LN2] * n_units, "report_nats": [report * 100 * LN2] * n_units,
         "history": hist(s_hat or [0.2] * steps, lam or [value if family == "fixed" else 1.0] * steps)}
    if evals is not None:
        t["evals"] = [{"step": s, "select_bpt": a, "report_bpt": b, "report_nats": [b * 100 * LN2] * n_units}
                      for s, a, b in evals]
    return t


def test_the_best_fixed_lambda_targets_and_each_laws_target_are_chosen_on_the_select_plays():
    # λ = 1 is best on the report plays, λ = 0.1 on the select plays: the select plays decide
    trials = [trial("fixed", s, 0.1, report=5.0, select=4.0, s_hat=[0.9] * 8 + [0.2] * 2) for s in (0, 1)]
    trials += [trial("fixed", s, 1.0, report=4.5, select=4.2, s_hat=[0.1] * 10) for s in (0, 1)]
    choice = p.choose_targets(trials, [0.5, 1, 2])
    assert (choice["best_arm"], choice["best_lambda"]) == ("fixed λ=0.1", 0.1)
    assert choice["s_best"] == pytest.approx(0.2)  # the mean Ŝ over the last 20% of the steps
    assert choice["targets"] == [pytest.approx(1 / 9, abs=1e-3), 0.2, pytest.approx(1 / 3, abs=1e-3)]
    laws = [trial("logodds", s, t, report=r, select=sel) for s in (0, 1)
            for t, r, sel in ((0.111, 4.0, 4.3), (0.2, 4.4, 4.1), (0.333, 4.1, 4.2))]
    assert p.selected_arm(laws, "logodds") == "logodds S*=0.2" and p.selected_arm(laws, "spec") is None


def test_early_stopping_takes_the_select_plays_best_eval_and_reports_its_report_score():
    none = trial("none", 0, None, report=9.0, evals=[(0, 5.0, 5.1), (10, 4.7, 4.9), (20, 4.6, 4.95),
                                                      (30, 4.6, 4.5), (40, 6.0, 6.0)])
    best = p.early_stop(none)
    assert (best["step"], best["report_bpt"]) == (20, 4.95)  # a tie on the select plays goes to the earlier eval
    with pytest.raises(p.AblationError, match="per-eval"):
        p.early_stop(trial("fixed", 0, 0.1, report=5.0))


# ---------------------------------------------------------------- the gaps and the decision

def test_gap_intervals_across_seeds_and_within_seed_by_hand():
    tokens = {s: [100] * 4 for s in (0, 1, 3)}
    ref = {s: [5.0 * 100 * LN2] * 4 for s in (0, 1, 3)}
    arm = {s: [(5.0 + g) * 100 * LN2] * 4 for s, g in ((0, 0.01), (1, 0.02), (3, 0.06))}
    g = stats.gap(arm, ref, tokens, n_boot=200)
    assert g["per_seed"] == {0: pytest.approx(0.01), 1: pytest.approx(0.02), 3: pytest.approx(0.06)}
    # mean 0.03, sd = sqrt((0.02² + 0.01² + 0.03²) / 2) = 0.0264575, half-width 4.303 · sd / √3 = 0.0657294
    assert (g["mean"], g["t_low"], g["t_high"]) == (pytest.approx(0.03), pytest.approx(-0.0357294, abs=1e-6),
                                                    pytest.approx(0.0957294, abs=1e-6))
    # every unit differs by the same amount: any resample gives each seed's gap, so the bootstrap is the mean itself
    assert (g["boot_low"], g["boot_high"]) == (pytest.approx(0.03), pytest.approx(0.03))
    noisy = stats.gap({s: [v + d for v, d in zip(arm[s], (-2.0, 2.0, -1.0, 1.0))] for s in arm}, ref, tokens, 2000)
    assert noisy["mean"] == pytest.approx(0.03)  # the noise sums to zero in each seed
    # the units' noise only (±0.03 bits a unit): wider than none, much narrower than the spread across seeds
    assert noisy["boot_low"] < 0.03 < noisy["boot_high"] and noisy["boot_high"] - noisy["boot_low"] < 0.03


def test_the_first_studys_cross_seed_interval_is_wider_than_its_bootstrap():
    res = json.loads((ROOT / "docs" / "ablation" / "results.json").read_text())
    trials = [t for st in res["stages"].values() for t in st.get("trials", [])]
    best = {t["seed"]: t["val_bpt"] for t in trials if t["family"] == "fixed"
            and t["params"]["controller.lambda_init"] == 0.1}
    gaps = [t["val_bpt"] - best[t["seed"]] for t in trials if t["family"] == "scu" and t["target_s"] == 0.388]
    t = stats.t_interval(gaps)
    assert (round(t["mean"], 3), round(t["low"], 3), round(t["high"], 3)) == (-0.011, -0.025, 0.003)  # docs/ablation.md


def numbers_of(passes: int, t_low: dict, laws_done=True) -> dict:
    """Per-plant numbers as ``stats.plant_numbers`` gives them: logodds tracking rows with ``passes`` passing runs
    in all, and the gap to the best fixed λ with each plant's lower end."""
    out, left = {}, passes
    for pl in ("P1", "P2"):
        rows = []
        for target in (0.1, 0.2, 0.4):
            runs = []
            for _ in range(3):
                runs.append({"passes": left > 0})
                left -= 1
            rows.append({"family": "logodds", "runs": runs})
        out[pl] = {"tracking": rows, "laws_done": laws_done,
                   "gaps": [{"name": "logodds − best fixed λ", "mean": 0.0, "t_low": t_low[pl], "t_high": 0.1, "n": 3}]}
    return out


@pytest.mark.parametrize("passes, lows, adopt, verdict", [
    (16, {"P1": -0.01, "P2": 0.0}, True, "both rules hold"),
    (15, {"P1": -0.01, "P2": -0.02}, False, "do not both hold"),
    (18, {"P1": -0.01, "P2": 0.004}, False, "do not both hold"),
])
def test_the_decision_rule(passes, lows, adopt, verdict):
    d = stats.decision(numbers_of(passes, lows), ["P1", "P2"], [0, 1, 3], 3)
    assert (d["passes"], d["runs"], d["need"], d["adopt"]) == (passes, 18, 16, adopt)
    assert verdict in d["verdict"] and d["text"].count("\n") == 3


def test_the_decision_waits_for_every_stage():
    d = stats.decision(numbers_of(18, {"P1": -0.1, "P2": -0.1}, laws_done=False), ["P1", "P2"], [0, 1, 3], 3)
    assert not d["adopt"] and d["verdict"].startswith("incomplete") and "not recorded yet" in d["text"]
    only_p1 = {"P1": numbers_of(9, {"P1": -0.1, "P2": -0.1})["P1"]}
    assert stats.decision(only_p1, ["P1", "P2"], [0, 1, 3], 3)["verdict"].startswith("incomplete")


# ---------------------------------------------------------------- the report of a hand-made results.json

def law_trial(law, seed, target, report, select, steps=150):
    if law == "logodds":  # Ŝ falls to S* by step 20 and stays; λ settles at 0.1
        s_hat = [0.9 - (0.9 - target) * min(1.0, i / 20) for i in range(1, steps + 1)]
        lam = [min(1e3, 1.5 ** min(i, 10)) if i < 20 else 0.1 for i in range(1, steps + 1)]
    else:  # the spec's law: λ at its upper bound until step 100, Ŝ swinging
        s_hat = [target * (1.5 + math.sin(i / 10)) for i in range(1, steps + 1)]
        lam = [1e3 if i <= 100 else 1e-2 for i in range(1, steps + 1)]
    return trial(law, seed, target, report=report, select=select, s_hat=s_hat, lam=lam)


def plant_records(seed_shift=0.0) -> dict:
    trials, units = [], {}
    for k, seed in enumerate((0, 1, 3)):
        d = 0.01 * k + seed_shift
        units[str(seed)] = {"select_tokens": [100] * 4, "report_tokens": [100] * 4, "base_select_bpt": 5.1,
                            "base_report_bpt": 5.2}
        trials += [trial("none", seed, None, report=9.0, evals=[(0, 5.2, 5.2), (10, 4.9 + d, 4.95 + d), (20, 6, 6)]),
                   trial("fixed", seed, 0.1, report=4.90 + d, select=4.80, s_hat=[0.5] * 8 + [0.2] * 2),
                   trial("fixed", seed, 1.0, report=5.00 + d, select=5.00)]
        for target, r_log, r_spec in ((0.111, 4.95, 4.99), (0.2, 4.88, 4.93), (0.333, 4.92, 4.96)):
            trials += [law_trial("logodds", seed, target, r_log + d, select=r_log - 0.1),
                       law_trial("spec", seed, target, r_spec + d, select=r_spec - 0.1)]
    calls = [{"stage": "fixed", "trials": ["x"] * 9, "wall_s": 300.0, "device": "NVIDIA H100", "gpus": 1,
              "overrides": ["scaling.gpus_per_worker=0.25"], "started": "-"}]
    return {"trials": trials, "units": units, "calls": calls}


@pytest.fixture
def v2_results():
    split = p.choose_seeds(DOCS, [0, 1, 3], 0.667)
    split["titles"] = p.play_titles(DOCS)
    return {"protocol": "v2", "split": split,
            "setting": {"rules": {"config": "x.yaml", "seeds": [0, 1, 3], "lambdas": [0.1, 1.0],
                                  "target_factors": [0.5, 1.0, 2.0]}, "plants": p.PLANTS, "started": "-",
                        "device": "NVIDIA H100"},
            "plants": {"P1": plant_records(), "P2": plant_records(0.05)}}


@pytest.mark.slow
def test_the_report_reads_the_choices_gaps_tracking_and_decision_from_the_records(v2_results, tmp_path):
    per, decision = v2_report.numbers(v2_results, n_boot=100)
    p1 = per["P1"]
    assert p1["choice"]["targets"] == [0.111, 0.2, 0.333]  # the best fixed λ (0.1) ends at S = 0.2
    assert p1["selected"] == {"spec": "spec S*=0.2", "logodds": "logodds S*=0.2"}
    assert {s: e["step"] for s, e in p1["early_stop"].items()} == {0: 10, 1: 10, 3: 10}
    gaps = {g["name"]: g for g in p1["gaps"]}
    assert gaps["logodds − best fixed λ"]["mean"] == pytest.approx(-0.02)  # 4.88 against 4.90 on every seed
    assert gaps["logodds − early stopping"]["mean"] == pytest.approx(4.88 - 4.95)
    assert gaps["logodds − spec law"]["mean"] == pytest.approx(-0.05)
    logodds = [r for r in p1["tracking"] if r["family"] == "logodds"]
    assert [(r["settled"], r["passes"]) for r in logodds] == [(3, 3)] * 3
    assert all(r["passes"] == 0 and r["runs"][0]["last_bound_step"] == 100 for r in p1["tracking"]
               if r["family"] == "spec")
    assert decision["passes"] == 18 and decision["adopt"]
    text = v2_report.write(v2_results, tmp_path, n_boot=100)
    assert "nan" not in text.lower() and "Decision: both rules hold" in text
    assert "| logodds S*=0.2 | 0, 1, 3 | 3/3 | 3/3 | 20, 20, 20 |" in text
    assert "| logodds − best fixed λ | 0: -0.0200, 1: -0.0200, 3: -0.0200 | -0.0200 |" in text
    for name in ("P1_early_stopping", "P1_logodds", "P1_spec", "P2_logodds"):
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "results.json").write_text(json.dumps(v2_results))
    assert report_cli.main([str(tmp_path), "--bootstrap", "50"]) == 0  # the file says v2: v2's report


# ---------------------------------------------------------------- the CLI, and a study split into calls

def test_bad_input_exits_2_before_ray_and_plan_prints_the_split_without_running(tmp_path, capsys):
    from raytrain_scu.studies.ablation import cli as ablation_cli

    assert ablation_cli.main([TINY, "--protocol", "v2", "--plants", "P3"]) == 2
    assert "--plants: unknown ['P3']" in capsys.readouterr().err
    assert ablation_cli.main([TINY, "--protocol", "v2", "--stages", "fixed,nope"]) == 2
    assert ablation_cli.main([TINY, "--protocol", "v2", "controller.law=nope"]) == 2
    assert "controller.law" in capsys.readouterr().err
    out = tmp_path / "out"
    assert ablation_cli.main([TINY, "--protocol", "v2", "--plan", "--out", str(out), "--seeds", "0,2,3",
                              "--lambdas", "1", "data.max_documents=3", "data.val_fraction=0.667"]) == 0
    text = capsys.readouterr().out
    assert "seed 2 repeats an earlier seed's split: replaced by seed 4" in text and "seed 4: train = " in text
    assert "P1 fixed: would run 6 of 6 pending: none seed 0, fixed λ=1 seed 0, none seed 4" in text
    assert "P1 laws: waits for stage fixed" in text and not out.exists()


def fake_run_call(results, plant, stage, arms, a, path):
    """``run.run_call`` without Ray: each arm becomes a hand-made trial, recorded and saved."""
    from raytrain_scu.studies.ablation.results import save

    rec = results["plants"][plant]
    for arm in arms:
        family, seed = p.family_of(arm), arm["seed"]
        value = arm.get("controller.lambda_init", arm.get("controller.target_s"))
        rec["trials"].append(trial(family, seed, value, report=5.0, evals=[(0, 5.0, 5.0), (10, 4.0, 4.1)]
                                   if family == "none" else None))
        rec["units"][str(seed)] = {"select_tokens": [100] * 4, "report_tokens": [100] * 4}
    rec["calls"].append({"stage": stage, "trials": [p.label(x) for x in arms], "wall_s": 1.0, "device": "cpu",
                         "gpus": 0, "overrides": list(a.overrides), "started": "-"})
    save(results, path)


@pytest.mark.slow
def test_a_study_runs_in_calls_of_at_most_max_trials_each_going_on_from_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(v2_cli, "run_call", fake_run_call)
    out = tmp_path / "out"
    args = [TINY, "--out", str(out), "--plants", "P1", "--seeds", "0", "--lambdas", "0.1,1", "--bootstrap", "20",
            "--max-trials", "4"]
    assert v2_cli.main(args) == 0  # the fixed stage (3 trials), then 1 of the laws stage's 6
    log = capsys.readouterr().out
    assert "P1 fixed: running 3 of 3" in log and "P1 laws: running 1 of 6" in log
    res = json.loads((out / "results.json").read_text())
    assert [c["stage"] for c in res["plants"]["P1"]["calls"]] == ["fixed", "laws"] and res["split"]["seeds"] == [0]
    assert v2_cli.main(args) == 0 and "P1 laws: running 4 of 5" in capsys.readouterr().out
    assert v2_cli.main([*args, "--stages", "laws"]) == 0 and "P1 laws: running 1 of 1" in capsys.readouterr().out
    assert v2_cli.main(args) == 0
    log = capsys.readouterr().out
    assert "P1 fixed: every trial already in" in log and "P1 laws: every trial already in" in log
    res = json.loads((out / "results.json").read_text())
    assert sorted(t["arm"] for t in res["plants"]["P1"]["trials"]) == [  # targets: the best λ's S = 0.2, odds x ½, 1, 2
        "fixed λ=0.1", "fixed λ=1", "logodds S*=0.111", "logodds S*=0.2", "logodds S*=0.333", "none",
        "spec S*=0.111", "spec S*=0.2", "spec S*=0.333"]
    assert (out / "table.md").exists()
    # a later call keeps the first call's rules
    assert v2_cli.main([*args, "--lambdas", "0.1"]) == 2
    assert "changes --lambdas [0.1] (the study's: [0.1, 1.0])" in capsys.readouterr().err
    # ... and each plant's resolved config, but for where trials run
    assert v2_cli.main([*args, "optim.lr=0.001"]) == 2
    assert "P1: this call's resolved config differs" in capsys.readouterr().err
    assert v2_cli.main([*args, "scaling.cpus_per_worker=0.5", "tracking.enabled=false"]) == 0
    assert v2_cli.main([*args, "scaling.num_workers=1"]) == 2  # the global batch: what a trial computes
    assert "scaling.num_workers: 2 -> 1" in capsys.readouterr().err


def test_the_laws_stage_alone_needs_the_fixed_stage(tmp_path, capsys):
    out = tmp_path / "out"
    assert v2_cli.main([TINY, "--out", str(out), "--plants", "P1", "--stages", "laws", "--seeds", "0"]) == 1
    assert "P1: stage laws needs the whole fixed stage first" in capsys.readouterr().err


def test_none_needs_a_checkpoint_per_eval_and_keeps_only_its_last_once_scored(tmp_path):
    from types import SimpleNamespace

    from test_ablation import fake_checkpoint

    cfg = SimpleNamespace(train=SimpleNamespace(eval_every=2, max_steps=6))
    for i, step in enumerate((2, 6)):
        fake_checkpoint(tmp_path / f"checkpoint_{i:06d}", step, [])
    with pytest.raises(p.AblationError, match=r"step\(s\) \[4\]"):
        v2_run.eval_checkpoints(tmp_path, cfg)
    fake_checkpoint(tmp_path / "checkpoint_000002", 4, [])
    assert [s for s, _ in v2_run.eval_checkpoints(tmp_path, cfg)] == [2, 4, 6]
    v2_run.prune([tmp_path])
    assert [s for s, _ in v2_run.all_checkpoints(tmp_path)] == [6]
    results = {"plants": {"P1": {"trials": [], "units": {"0": {"select_tokens": [5], "report_tokens": [6]}}}}}
    with pytest.raises(p.AblationError, match="units differ"):
        v2_run.record(results, "P1", [], {"0": {"select_tokens": [5], "report_tokens": [7]}})


# ---------------------------------------------------------------- one real tiny stage, end to end on CPU

@pytest.mark.slow
def test_a_real_tiny_stage_through_ray_tune_is_scored_on_both_halves_and_resumes_from_its_file(ray_local, tmp_path,
                                                                                               capsys):
    import ray

    out = tmp_path / "out"
    # 3 plays: 1 trained on, 1 select, 1 report; 2 arms (none and λ = 1) on 1 seed, 4 steps, an eval every 2
    args = [TINY, "--protocol", "v2", "--plants", "P1", "--stages", "fixed", "--seeds", "0", "--lambdas", "1",
            "--target-factors", "1", "--bootstrap", "50", "--out", str(out), "scaling.num_workers=1",
            "scaling.cpus_per_worker=0.49", f"run.storage_path={tmp_path}/runs", "run.name=abl",
            "data.max_documents=3", "data.val_fraction=0.667", "train.max_steps=4", "train.report_every=2",
            "train.eval_every=2", "train.checkpoint_every=4", "lora.r=4", "lora.alpha=8", "optim.warmup_steps=1"]
    from raytrain_scu.studies.ablation import cli as ablation_cli

    ray_was_up = ray.is_initialized()  # the tests' Ray (ray_local), joined: left up for the tests after
    try:
        assert ablation_cli.main(args) == 0
    finally:
        if not ray_was_up:
            ray.shutdown()  # the runner started Ray in this process: leave the process as it was
    said = capsys.readouterr().out
    # the base, the two trials' final adapters and none's adapter of step 2: 4 models, scored in this process
    assert re.search(r"^\[raytrain_scu\] ablation v2: scoring 4 models \(base and adapters\) of 1 seed\(s\), .*"
                     r"in this process$", said, re.M), said
    assert re.search(r"^\[raytrain_scu\] ablation v2: scored in \d+ s$", said, re.M)
    res = json.loads((out / "results.json").read_text())
    rec = res["plants"]["P1"]
    assert sorted((t["arm"], t["seed"]) for t in rec["trials"]) == [("fixed λ=1", 0), ("none", 0)]
    units = rec["units"]["0"]
    sp = res["split"]["splits"]["0"]
    assert [len(sp[k]) for k in ("train", "select", "report")] == [1, 1, 1]
    for t in rec["trials"]:
        assert len(t["select_nats"]) == len(units["select_tokens"]) > 1
        assert len(t["report_nats"]) == len(units["report_tokens"]) > 1
        assert t["history"]["step"][-1] == 4 and "ctrl/log_odds_error" in t["history"]
    none, = [t for t in rec["trials"] if t["family"] == "none"]
    assert [e["step"] for e in none["evals"]] == [0, 2, 4]  # the base model, then every eval
    assert none["evals"][0]["report_bpt"] == pytest.approx(units["base_report_bpt"])
    assert none["evals"][-1]["report_bpt"] == none["report_bpt"]  # the last eval is the final adapter
    trial_dirs = list((tmp_path / "runs").glob("abl-P1-fixed-*/trials/*"))
    assert sorted(len(list(d.glob("checkpoint_0*"))) for d in trial_dirs) == [1, 1]  # none's evals pruned once scored
    table = (out / "table.md").read_text()
    assert "| none, stopped early | 1 |" in table and "P1_early_stopping.png" in table
    capsys.readouterr()
    assert ablation_cli.main(args) == 0  # everything recorded: no trial runs again
    assert "P1 fixed: every trial already in" in capsys.readouterr().out
    assert len(json.loads((out / "results.json").read_text())["plants"]["P1"]["calls"]) == 1


@pytest.mark.slow
def test_seeds_scored_in_ray_tasks_equal_the_seeds_scored_in_this_process(ray_local, tmp_path, capsys):
    """The multi-GPU path of the study's scoring (one Ray task per seed), run on CPU tasks: the same nats as scoring
    each seed in this process."""
    from dataclasses import asdict

    import torch

    from raytrain_scu.config.load import load_config
    from raytrain_scu.core.model.build import apply_lora, build_model
    from raytrain_scu.core.model.source import load_tokenizer

    tok = load_tokenizer("tiny")
    paths = []
    for i in range(2):
        model = apply_lora(build_model("tiny", vocab_size=len(tok), seed=i), r=4, alpha=8, targets=["q_proj", "v_proj"])
        for name, w in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(w, std=0.1)
        model.save_pretrained(str(tmp_path / f"a{i}"))
        paths.append(str(tmp_path / f"a{i}"))
    cfg = load_config(TINY, ["data.block_size=32", "data.batch_size=4", "scaling.cpus_per_worker=1"])
    docs = ["To be, or not to be, that is the question.", "Friends, Romans, countrymen, lend me your ears.",
            "Now is the winter of our discontent made glorious summer."]
    calls = {0: (asdict(cfg), {"base": "", "t0": paths[0]}, docs[:2]),
             3: (asdict(cfg), {"base": "", "t0": paths[1], "t1": paths[0]}, docs[1:])}
    here = v2_run.score_seeds(cfg, calls, tasks=False)
    import ray

    ray_was_up = ray.is_initialized()
    try:
        there = v2_run.score_seeds(cfg, calls, tasks=True)
    finally:
        if not ray_was_up:
            ray.shutdown()  # the tasks started Ray in this process: leave the process as it was
    said = capsys.readouterr().out
    assert "5 models (base and adapters) of 2 seed(s)" in said and "one Ray task per seed" in said
    for seed in calls:
        assert there[seed]["tokens"].tolist() == here[seed]["tokens"].tolist()
        for label in calls[seed][1]:
            assert there[seed]["nats"][label] == pytest.approx(here[seed]["nats"][label], rel=1e-6)
    assert here[3]["nats"]["t0"].tolist() != here[3]["nats"]["t1"].tolist()


def test_the_cost_note_sets_the_laws_spread_beside_the_fixed_arms_that_end_in_the_same_range_of_s():
    from raytrain_scu.studies.ablation.v2.report import cost_text

    rows = [{"family": "fixed", "arm": f"fixed λ={lam:g}", "sort": lam, "report_bpt": bpt, "s_end": s_end,
             "time_s": 10.0} for lam, bpt, s_end in ((0.01, 8.0, 0.9), (0.1, 5.5, 0.3), (0.3, 4.9, 0.06))]
    rows += [{"family": "logodds", "sort": s, "report_bpt": bpt, "s_end": s, "time_s": 12.0}
             for s, bpt in ((0.1, 4.95), (0.2, 4.91), (0.4, 4.93))]
    text = cost_text(rows, 3)
    assert "(S* = 0.1, 0.2, 0.4) are derived from the fixed grid" in text and "spans 4.9100–4.9500" in text
    assert "same range of S: fixed λ=0.1 ends at S = 0.3, 5.5000." in text  # 0.06 and 0.9 lie outside 0.1–0.4
    assert "derived" not in cost_text(rows[:3], 3)
