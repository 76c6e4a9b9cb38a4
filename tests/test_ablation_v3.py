"""The study v3 (docs/ablation-v3.md): the grid-free target (derived from v2's records, and held by the law on the
plant model's stand-in of each new plant), the second text domain's documents, the arms, the endpoints and verdicts
on hand-made records, the report, and the CLI's refusals. No training here."""
import json
import math

import pytest
from conftest import ROOT

from raytrain_scu.config.schema import ControllerConfig
from raytrain_scu.core import laws
from raytrain_scu.core.plant import Plant, simulate
from raytrain_scu.core.settling import summary
from raytrain_scu.errors import AblationError
from raytrain_scu.ray.tune import space as sweep_space
from raytrain_scu.studies.ablation.v2 import protocol as v2
from raytrain_scu.studies.ablation.v3 import cli as v3_cli
from raytrain_scu.studies.ablation.v3 import protocol as p
from raytrain_scu.studies.ablation.v3 import report as v3_report
from raytrain_scu.studies.ablation.v3 import rule
from raytrain_scu.studies.ablation.v3 import run as v3_run
from raytrain_scu.studies.ablation.v3 import stats

V3_YAML = str(ROOT / "experiments" / "ablation-v3.yaml")
V2_RESULTS = ROOT / "docs" / "ablation-v2" / "results.json"
LN2 = math.log(2.0)


# ---------------------------------------------------------------- the rule

def test_the_rules_target_is_what_its_design_gives_on_v2s_records():
    d = rule.design(json.loads(V2_RESULTS.read_text()))
    assert d["target_s"] == rule.GRID_FREE_TARGET_S
    # the two plants' minima straddle the rule, and at the rule neither is worse than the reported excess
    lo, hi = sorted(c["argmin_s"] for c in d["curves"].values())
    assert lo < d["target_s"] < hi
    assert max(rule.excess(c, d["target_s"]) for c in d["curves"].values()) == pytest.approx(d["worst_excess"])


def test_the_design_moves_with_the_records_it_is_given():
    # a plant whose select BPT is lowest at S = 0.5 (in logit, 0) pulls the minimax target above 0.23
    def tr(family, seed, s, sel, arm=None):
        n = 10
        return {"family": family, "seed": seed, "arm": arm or f"{family} {s}", "select_bpt": sel,
                "history": {"ctrl/s_hat": [s] * n}}
    parabola = [tr("fixed", 0, s, (math.log(s / (1 - s))) ** 2) for s in (0.15, 0.3, 0.45)]
    parabola.append(tr("fixed", 0, 0.4, math.log(0.4 / 0.6) ** 2, arm=rule.REFERENCE_ARM))
    curve = rule.plant_curve(parabola)
    assert curve["argmin_s"] == pytest.approx(0.5, abs=1e-6) and curve["points"] == 4
    v2_records = json.loads(V2_RESULTS.read_text())
    moved = rule.design({"plants": {"P1": v2_records["plants"]["P1"], "X": {"trials": parabola}}}, plants=("P1", "X"))
    assert moved["target_s"] > rule.GRID_FREE_TARGET_S


@pytest.mark.parametrize("plant", p.ORDER)
def test_the_law_holds_the_rules_target_on_the_plant_models_stand_in_for_each_new_plant(plant):
    m = p.MODEL[plant]
    target = rule.grid_free_target()
    for seed in (0, 1):
        law = laws.build(ControllerConfig(mode="scu", law="logodds", target_s=target, lambda_min=1e-4,
                                          lambda_max=1e3, lambda_init=1.0))
        out = simulate(law, Plant(**m["knobs"]), m["steps"], seed=seed, **m["sim"])
        s = summary(out["s"], out["s_hat"], out["lam"], target, 1e-4, 1e3, out["step"])
        assert s["settled_step"] is not None and s["settled_step"] <= m["steps"] // 2, s
        assert s["steps_at_bound"] == 0
        assert 1e-3 < out["lam"][-1] < 10  # inside the fixed grid's range: the grid can be compared with it


# ---------------------------------------------------------------- the second text domain

def test_the_stdlib_documents_are_the_first_nine_modules_in_size_range_by_name(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    sizes = {"a.py": 70_000, "b.py": 10_000, "c.py": 250_000, "d.py": 60_000, "e.py": 200_000}
    sizes |= {f"m{k:02d}.py": 80_000 + k for k in range(10)}
    for name, size in sizes.items():
        (lib / name).write_text("x" * size)
    (lib / "pkg").mkdir()
    (lib / "pkg" / "big.py").write_text("y" * 90_000)  # packages are not top-level modules
    out = tmp_path / "docs"
    rec = p.write_stdlib(str(out), stdlib=str(lib))
    names = [f["name"] for f in rec["files"]]
    assert names == ["a.py", "d.py", "e.py", *[f"m{k:02d}.py" for k in range(6)]]
    files = sorted(out.glob("*.txt"))
    assert [f.name for f in files][:2] == ["00_a.txt", "01_d.txt"]
    assert files[0].read_text().splitlines()[0] == "# Lib/a.py"
    again = p.write_stdlib(str(out), stdlib=str(lib))  # the same library gives the same record
    assert again == rec and len(list(out.glob("*.txt"))) == 9
    (lib / "a.py").write_text("z" * 70_000)
    assert p.write_stdlib(str(out), stdlib=str(lib))["files"][0]["sha256"] != rec["files"][0]["sha256"]


# ---------------------------------------------------------------- the arms

def test_each_plant_has_11_arms_per_seed_as_valid_tune_grids(tmp_path):
    cfg = v3_run.plant_config(V3_YAML, "P5", [f"run.storage_path={tmp_path}", "tune.search=grid",
                                              "tune.scheduler=none"])
    assert (cfg.lora.r, cfg.optim.lr, cfg.train.max_steps, cfg.controller.law) == (32, 3e-3, 200, "logodds")
    arms = p.plant_arms([0, 1, 3], p.LAMBDAS, rule.grid_free_target(), v3_run.eval_keys(cfg))
    names = [v2.label(a) for a in arms]
    assert len(arms) == 33 and len(set(zip(names, [a["seed"] for a in arms]))) == 33
    assert names[:3] == ["none", "logodds S*=0.23", "fixed λ=0.001"] and f"fixed λ={p.CARRIED_LAMBDA:g}" in names
    cfg.tune.space = {"arm": {"grid": arms}}
    sweep_space.resolve_space(cfg)
    law = sweep_space.trial_config(cfg, {"arm": arms[1]}, "t1")
    assert (law.controller.mode, law.controller.law, law.controller.target_s) == ("scu", "logodds", 0.23)
    assert (law.train.checkpoint_every, law.run.num_to_keep) == (10, 21)  # a checkpoint at every eval: arm 5
    fixed = sweep_space.trial_config(cfg, {"arm": arms[2]}, "t2")
    assert (fixed.controller.mode, fixed.train.checkpoint_every) == ("fixed", 200)
    p4 = v3_run.plant_config(V3_YAML, "P4", [f"run.storage_path={tmp_path}"])
    assert (p4.data.max_documents, p4.data.val_fraction, p4.lora.r, p4.train.max_steps) == (24, 0.25, 16, 300)


# ---------------------------------------------------------------- hand-made records

def hist(s_hat, lam, data=4.0):
    n = len(s_hat)
    return {"step": list(range(n + 1)), "ctrl/s": [None, *s_hat], "ctrl/s_hat": [None, *s_hat],
            "ctrl/lambda": [1.0, *lam], "train/data_bpt": [None] + [data] * n}


def trial(family, seed, value, report, select=None, *, evals=None, steps=200, n_units=4):
    params = v2.arm(family, seed, **({"lambda_init": value} if family == "fixed" else
                                     {"target_s": value} if family == p.LAW else {}))
    select = report if select is None else select
    if family == p.LAW:  # settles on its target from step 60, λ steady at 0.1
        s_hat, lam = [0.6] * 59 + [value] * (steps - 59), [1.0] * 59 + [0.1] * (steps - 59)
    else:
        s_hat, lam = [0.2] * steps, [value or 0.0] * steps
    t = {"family": family, "arm": v2.label(params), "seed": seed, "trial": f"{family}{value}-{seed}",
         "params": params, "law": p.LAW, "target_s": value if family == p.LAW else None, "lambda_min": 1e-4,
         "lambda_max": 1e3, "time_s": 10.0, "select_bpt": select, "report_bpt": report,
         "select_nats": [select * 100 * LN2] * n_units, "report_nats": [report * 100 * LN2] * n_units,
         "history": hist(s_hat, lam)}
    if evals is not None:
        t["evals"] = [{"step": s, "select_bpt": a, "report_bpt": b, "report_nats": [b * 100 * LN2] * n_units}
                      for s, a, b in evals]
    return t


RULES = {"lambdas": [0.1, 1.0], "target_s": 0.23, "carried_lambda": 0.1, "non_inferiority": 0.01, "seeds": [0, 1, 3]}


def plant_record(law_gaps, *, best_is=1.0, seeds=(0, 1, 3)):
    """A complete plant: per seed, none (evals), the law (evals), λ = 0.1 and λ = 1; ``best_is`` wins the select
    plays; the law's report BPT is the best fixed λ's plus ``law_gaps[seed]``."""
    trials = []
    for i, s in enumerate(seeds):
        base = 5.0 + 0.1 * i
        sel = {0.1: 5.0, 1.0: 5.0}
        sel[best_is] = 4.9
        for lam in (0.1, 1.0):
            trials.append(trial("fixed", s, lam, report=base + (0.0 if lam == best_is else 0.03), select=sel[lam]))
        trials.append(trial("none", s, None, report=9.0, evals=[(0, 5.5, 5.4 + i / 10), (10, 4.8, base - 0.02),
                                                                 (20, 5.2, 5.3)]))
        trials.append(trial(p.LAW, s, 0.23, report=base + law_gaps[i], select=4.95,
                            evals=[(0, 5.5, 5.5), (100, 4.9, base - 0.01), (200, 4.95, base + law_gaps[i])]))
    split = {"seeds": list(seeds), "splits": {str(s): {"train": [0], "select": [1], "report": [2]} for s in seeds},
             "replaced": {}, "titles": ["A", "B", "C"]}
    return {"trials": trials, "split": split, "units": {str(s): {"report_tokens": [100] * 4} for s in seeds},
            "calls": []}


def test_the_primary_endpoint_is_non_inferiority_so_a_noisy_result_fails_it():
    close = stats.plant_numbers(plant_record([0.001, 0.003, 0.002]), RULES, 50)
    assert close["choice"]["best_arm"] == "fixed λ=1" and close["complete"]
    primary = close["gaps"][0]
    assert primary["name"].endswith("(primary)") and primary["mean"] == pytest.approx(0.002, abs=1e-9)
    assert close["verdict"]["meets"] is True and "meets" in close["verdict"]["text"]
    # the same mean gap, noisier across seeds: its interval's upper end passes +0.01, so it fails
    noisy = stats.plant_numbers(plant_record([-0.02, 0.002, 0.024]), RULES, 50)
    assert noisy["gaps"][0]["mean"] == pytest.approx(0.002, abs=1e-9)
    assert noisy["verdict"]["meets"] is False and noisy["verdict"]["upper"] > 0.01
    # worse on every seed by more than the margin: fails
    assert stats.plant_numbers(plant_record([0.02, 0.02, 0.021]), RULES, 50)["verdict"]["meets"] is False


def test_a_plant_with_a_missing_run_has_no_verdict_and_the_study_is_not_decided():
    rec = plant_record([0.001, 0.003, 0.002])
    rec["trials"] = [t for t in rec["trials"] if not (t["seed"] == 3 and t["family"] == "fixed")]
    num = stats.plant_numbers(rec, RULES, 50)
    assert not num["complete"] and num["verdict"]["meets"] is None
    answer = stats.overall({"P5": num}, ["P5", "P3"])
    assert not answer["adopt"] and answer["text"].startswith("not decided")
    done = stats.plant_numbers(plant_record([0.001, 0.003, 0.002]), RULES, 50)
    assert stats.overall({"P5": done}, ["P5"])["adopt"]
    assert not stats.overall({"P5": done, "P3": noisy_fail()}, ["P5", "P3"])["adopt"]


def noisy_fail():
    return stats.plant_numbers(plant_record([0.05, 0.04, 0.06]), RULES, 50)


def test_the_secondary_arms_early_stopping_and_the_laws_best_checkpoint_are_chosen_on_the_select_plays():
    num = stats.plant_numbers(plant_record([0.001, 0.003, 0.002], best_is=0.1), RULES, 50)
    names = [g["name"] for g in num["gaps"]]
    assert names[:4] == ["1 law − 2 best fixed λ (primary)", "1 law − 3 λ carried over",
                         "1 law − 4 early stopping", "5 law's best checkpoint − 4 early stopping"]
    assert num["choice"]["best_lambda"] == 0.1  # here the carried λ is the grid's best: arms 2 and 3 coincide
    carried = next(g for g in num["gaps"] if g["name"] == "1 law − 3 λ carried over")
    assert carried["mean"] == pytest.approx(num["gaps"][0]["mean"])
    assert {s: e["step"] for s, e in num["early_stop"].items()} == {0: 10, 1: 10, 3: 10}
    assert {s: e["step"] for s, e in num["law_best"].items()} == {0: 100, 1: 100, 3: 100}
    best_vs_early = next(g for g in num["gaps"] if g["name"].startswith("5 "))
    assert best_vs_early["mean"] == pytest.approx(0.01, abs=1e-9)  # (base − 0.01) − (base − 0.02)
    run = num["law_runs"][0]
    assert run["settled_step"] == 60 and run["passes"] and run["best_step"] == 100
    assert run["path"][-1] == (200, 0.1)


def test_the_report_states_each_plants_verdict_and_what_did_not_run(tmp_path):
    results = {"protocol": "v3", "setting": {
        "rules": {**RULES, "config": "x.yaml", "order": list(p.ORDER)}, "order": list(p.ORDER), "plants": p.PLANTS,
        "device": "NVIDIA H200", "versions": {"torch": "2.11"}, "started": "now"},
        "plants": {"P5": plant_record([0.001, 0.003, 0.002]),
                   "P3": {"split": None, "data": None, "trials": [], "units": {}, "calls": []},
                   "P4": {"split": None, "data": None, "trials": [], "units": {}, "calls": []}}}
    text = v3_report.write(results, tmp_path, n_boot=50, plots=False)
    assert text.startswith("## The answer\n\nnot decided: plant(s) P3, P4 are not complete")
    assert "P5: meets" in text and "Not run: P3" in text and "meets the primary endpoint" in text
    assert (tmp_path / "table.md").exists() and json.loads((tmp_path / "summary.json").read_text())["answer"]


# ---------------------------------------------------------------- the CLI

def test_a_plant_does_not_start_before_the_plants_ahead_of_it_in_the_order_are_complete():
    results = {"setting": {"rules": RULES}, "plants": {
        "P5": plant_record([0.0, 0.0, 0.0]), "P3": {"split": None, "trials": []}, "P4": {"split": None, "trials": []}}}
    v3_cli.check_order(results, "P5")
    v3_cli.check_order(results, "P3")
    with pytest.raises(AblationError, match="P4 runs after P3"):
        v3_cli.check_order(results, "P4")
    results["plants"]["P5"]["trials"].pop()
    with pytest.raises(AblationError, match="P3 runs after P5"):
        v3_cli.check_order(results, "P3")


def test_bad_input_exits_2_and_a_later_call_may_not_change_the_rules(tmp_path, capsys):
    assert v3_cli.main([V3_YAML, "--plants", "P9", "--out", str(tmp_path)]) == 2
    assert "unknown ['P9']" in capsys.readouterr().err
    a = v3_cli.parse_args([V3_YAML, "--out", str(tmp_path)])
    (tmp_path / "results.json").write_text(json.dumps({**v3_cli.new_results(a) | {}, "setting": {
        **v3_cli.new_results(a)["setting"], "rules": {**v3_cli.rules_of(a), "target_s": 0.3}}}))
    assert v3_cli.main([V3_YAML, "--plants", "P5", "--plan", "--out", str(tmp_path)]) == 2
    assert "rules were fixed by its first call" in capsys.readouterr().err


# ---------------------------------------------------------------- the committed records

def test_the_committed_report_and_the_scu_pages_figures_come_from_the_committed_results(tmp_path):
    out = ROOT / "docs" / "ablation-v3"
    results = json.loads((out / "results.json").read_text())
    text = v3_report.write(results, tmp_path, n_boot=2000, plots=False)
    assert text + "\n" == (out / "table.md").read_text()
    per, answer = v3_report.numbers(results, 50)
    assert all(per[pl]["complete"] for pl in p.ORDER)
    assert answer["verdicts"] == {"P5": True, "P3": False, "P4": False} and not answer["adopt"]
    page = " ".join((ROOT / "docs" / "scu.md").read_text().split())  # the SCU page's words, line breaks aside
    readme = " ".join((ROOT / "README.md").read_text().split())

    def num(x):
        return f"{x:+.4f}".replace("-", "−")  # the pages write a minus sign

    # the README's answer: met on P5 alone, so the default is early stopping; the page's, plant by plant
    met = sum(answer["verdicts"].values())
    assert f"a grid-free S* = 0.23 met its test on {met} of {len(answer['verdicts'])} plants" in readme
    assert "so `controller.mode=none` (early stopping) is the default" in readme
    assert "**the rule failed the test on P3 and P4** and met it on P5" in page
    for pl, word in (("P5", "met"), ("P3", "failed"), ("P4", "failed")):  # the primary endpoint, plant by plant
        g = per[pl]["gaps"][0]
        assert f"{num(g['mean'])} [{num(g['t_low'])}, {num(g['t_high'])}], {word}" in page, pl
    assert f"the grid's best λ there is {per['P4']['choice']['best_lambda']:g}" in page
    # the table of one-run arms, the lowest per plant in bold, and the post-hoc criterion's numbers
    one = answer["one_run"]
    for pl in p.ORDER:
        low = min(one["bpt"][pl].values())
        cells = [f"**{v:.4f}**" if v == low else f"{v:.4f}" for v in one["bpt"][pl].values()]
        assert f"| {pl} | " + " | ".join(cells) + " |" in page, pl
    assert list(one["arms"]) == ["law", "carried", "early", "law_best"] and one["chosen"] == "early"
    w, m = one["worst"], one["mean"]
    assert f"Early stopping's worst gap to a plant's best is the smallest, {w['early']:.3f} bits/token (the SCU's " \
           f"{w['law']:.3f}, λ = 0.1's {w['carried']:.3f}), and so is its mean gap ({m['early']:.3f})" in page
    assert min(m, key=m.get) == "early"
    near = max(one["gap"]["law"]["P5"], one["gap"]["law"]["P3"])
    assert near < 0.002 and "within 0.002 bits of the best one-run arm on P5 and P3 and " \
                           f"{one['gap']['law']['P4']:.3f} behind it on P4" in page
    s_best = sorted(per[pl]["choice"]["s_best"] for pl in p.ORDER)
    assert f"ended at S = {s_best[0]:.2f}–{s_best[-1]:.2f}" in page
    log = " ".join((ROOT / "docs" / "ablation-v3.md").read_text().split())
    assert f"early stopping, at most {w['early']:+.4f} bits/token behind (mean {m['early']:+.4f}), against " \
           f"{w['law']:+.4f} for the law, {w['carried']:+.4f} for λ = 0.1 and {w['law_best']:+.4f} for the law's " \
           "best checkpoint" in log


def test_the_package_defaults_are_what_the_study_chose():
    """§5's second branch: the rule failed on a complete plant, so the default is the one-run arm the post-hoc
    criterion picks, early stopping: no penalty, the best checkpoint as the adapter, a checkpoint at every eval; the
    SCU stays selectable, with the logodds law."""
    from raytrain_scu.config.load import build_config
    from raytrain_scu.config.schema import Config

    d = Config()
    assert (d.controller.mode, d.run.primary_adapter) == ("none", "best")
    assert d.train.eval_every == d.train.checkpoint_every  # every evaluation has a checkpoint to export
    assert d.train.max_steps // d.train.eval_every >= 10  # evaluated often enough for the choice to mean something
    summary = json.loads((ROOT / "docs" / "ablation-v3" / "summary.json").read_text())
    assert summary["answer"]["adopt"] is False and summary["answer"]["one_run"]["chosen"] == "early"
    scu = build_config({"controller": {"mode": "scu"}})
    assert (scu.controller.mode, scu.controller.law) == ("scu", "logodds")
    assert isinstance(laws.build(scu.controller), laws.LAWS["logodds"])
