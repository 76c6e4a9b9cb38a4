"""The sweep: space checks and the batch/tokens rule in seconds; then real Tune sweeps of Ray Train runs on CPU."""
import csv
import io
import math
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, TINY, in_process, tiny_cfg

from raytrain_scu.cli import sweep as sweep_cli
from raytrain_scu.config.io import to_yaml
from raytrain_scu.config.load import load_config
from raytrain_scu.config.schema import global_batch_tokens
from raytrain_scu.driver import sweep as driver_sweep
from raytrain_scu.errors import ConfigError
from raytrain_scu.ray.tune import results as sweep_results
from raytrain_scu.ray.tune import space as sweep_space
from raytrain_scu.ray.tune import sweep
from raytrain_scu.tracking.store import PARENT_TAG, child_runs, client_for, tracking_uri

# a 1-worker tiny run: val/data_bpt measured at every report so ASHA compares fresh values
FAST = ["scaling.num_workers=1", "train.max_steps=6", "train.report_every=2", "train.eval_every=2",
        "train.checkpoint_every=6", "train.eval_blocks=8"]


SPEED = ["tune.metric=perf/tokens_per_s", "tune.mode=max"]  # a sweep scored on throughput


def base(tmp_path, *overrides):
    return tiny_cfg(tmp_path, "sw", *FAST, *overrides)


# ---------------------------------------------------------------- fast: space, batch rule, resources, CLI errors

def test_default_space_tunes_the_global_batch_on_a_loss_and_the_micro_batch_on_speed(tmp_path):
    cfg = base(tmp_path)  # batch 4 x accum 2 x 1 worker x block 64 = 512 tokens per step
    space = sweep_space.resolve_space(cfg)
    assert list(space) == ["global_batch_tokens", "controller.logodds_kp", "controller.logodds_ki",
                           "controller.target_s"]  # the gains of the config's law, logodds by default
    assert (space["controller.logodds_kp"], space["controller.logodds_ki"]) == (
        {"loguniform": [0.5, 8.0]}, {"loguniform": [0.05, 0.8]})  # around its defaults, 2.0 and 0.2
    assert space["global_batch_tokens"] == {"choice": [256, 512, 1024]}
    spec = sweep_space.resolve_space(base(tmp_path, "controller.law=spec"))
    assert list(spec) == ["global_batch_tokens", "controller.kp", "controller.ki", "controller.target_s"]
    assert (spec["controller.kp"], spec["controller.ki"]) == ({"loguniform": [0.2, 3.2]}, {"loguniform": [0.02, 0.6]})
    assert "optim.lr" in sweep_space.resolve_space(cfg, with_lr=True)
    # a global batch no whole grad_accum reaches is left out, and the controller is not swept when it is off
    space = sweep_space.resolve_space(base(tmp_path, "data.grad_accum=1", "controller.mode=none"))
    assert space == {"global_batch_tokens": {"choice": [256, 512]}}
    # scored on speed: the micro-batch alone; a batch that cannot keep the tokens per step is left out
    assert sweep_space.resolve_space(base(tmp_path, *SPEED)) == {"data.batch_size": {"choice": [2, 4, 8]}}
    assert sweep_space.resolve_space(base(tmp_path, *SPEED, "data.grad_accum=1")) == {"data.batch_size": {"choice": [2, 4]}}
    # without the rule the micro-batch moves the global batch: a loss knob again
    assert list(sweep_space.resolve_space(base(tmp_path, "tune.keep_tokens_per_step=false")))[0] == "data.batch_size"


def test_batch_trials_keep_tokens_per_step(tmp_path):
    cfg = base(tmp_path)
    tokens = {global_batch_tokens(sweep_space.apply_params(cfg, {"data.batch_size": b})) for b in (1, 2, 4, 8)}
    assert tokens == {global_batch_tokens(cfg)} == {4 * 2 * 64}
    assert sweep_space.apply_params(cfg, {"data.batch_size": 2}).data.grad_accum == 4
    with pytest.raises(ConfigError, match="does not divide"):
        sweep_space.apply_params(cfg, {"data.batch_size": 3})
    with pytest.raises(sweep_space.SweepError, match="data.batch_size value 3"):
        sweep_space.resolve_space(base(tmp_path, *SPEED, "tune.space={data.batch_size: {choice: [2, 3]}}"))
    # without the rule, grad_accum stays and the global batch follows the batch size
    loose = base(tmp_path, "tune.keep_tokens_per_step=false")
    trial = sweep_space.apply_params(loose, {"data.batch_size": 8})
    assert trial.data.grad_accum == 2 and global_batch_tokens(trial) == 2 * global_batch_tokens(loose)


def test_micro_batch_is_scored_on_speed_never_on_a_loss(tmp_path):
    # with keep_tokens_per_step a trial's micro-batch only regroups the same sequences: a loss moves by float noise
    micro = "tune.space={data.batch_size: {choice: [2, 4, 8]}}"
    for metric in ("val/data_bpt", "train/data_bpt"):
        with pytest.raises(sweep_space.SweepError, match=r"micro-batch.*float noise.*perf/tokens_per_s.*global_batch_tokens"):
            sweep_space.resolve_space(base(tmp_path, micro, f"tune.metric={metric}"))
    assert sweep_space.resolve_space(base(tmp_path, *SPEED, micro)) == {"data.batch_size": {"choice": [2, 4, 8]}}
    with pytest.raises(sweep_space.SweepError, match="tune.mode=max"):
        sweep_space.resolve_space(base(tmp_path, "tune.metric=perf/tokens_per_s", micro))
    # when the micro-batch moves the global batch (keep_tokens_per_step=false) a loss may score it
    assert list(sweep_space.resolve_space(base(tmp_path, "tune.keep_tokens_per_step=false", micro))) == ["data.batch_size"]


def test_micro_batch_changes_the_loss_only_by_float_noise(tmp_path):
    # the premise of the rule above, on the real loop (one process, no Ray): 4 x 2 and 8 x 1 sequences per step train
    # on the same stream and score the same fixed validation blocks (eval at batch 4 and at batch 8)
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    runs = {}
    for batch, accum in ((4, 2), (8, 1)):
        hooks = LocalHooks()
        run_loop(base(tmp_path, f"data.batch_size={batch}", f"data.grad_accum={accum}", "train.max_steps=4",
                      "train.checkpoint_every=4", "tracking.enabled=false"), hooks=hooks)
        runs[batch] = hooks.reports
    ref = runs[4]
    assert [r["tokens_seen"] for r in ref] == [2 * 512, 4 * 512]  # the sweep's ASHA time: 512 tokens per step
    for batch in (8,):
        assert [r["tokens_seen"] for r in runs[batch]] == [r["tokens_seen"] for r in ref]
        for key in ("train/data_bpt", "val/data_bpt", "val/data_bpt_start"):
            assert [r[key] for r in runs[batch]] == pytest.approx([r[key] for r in ref], rel=1e-4), (batch, key)


def test_global_batch_is_the_optimisation_knob_mapped_to_grad_accum(tmp_path):
    from ray.tune.search.sample import Categorical

    cfg = base(tmp_path)  # one micro-step: batch 4 x 1 worker x block 64 = 256 tokens
    trial = sweep_space.apply_params(cfg, {"global_batch_tokens": 1024})
    assert (trial.data.batch_size, trial.data.grad_accum, global_batch_tokens(trial)) == (4, 4, 1024)
    with pytest.raises(ConfigError, match="global_batch_tokens=384 is not a whole number of micro-steps"):
        sweep_space.apply_params(cfg, {"global_batch_tokens": 384})
    space = sweep_space.resolve_space(base(tmp_path, "tune.space={global_batch_tokens: {choice: [256, 1024.0]}}"))
    assert space == {"global_batch_tokens": {"choice": [256, 1024]}}
    assert isinstance(sweep.tune_space(cfg, space)["global_batch_tokens"], Categorical)
    assert sweep_space.tokens_per_step_bounds(cfg, space) == (256, 1024)
    assert sweep_space.max_sequences_per_step(cfg, space) == 16
    # with a swept block size every pair must give a whole grad_accum: 256 tokens is less than one micro-step of 128
    with pytest.raises(sweep_space.SweepError, match="global_batch_tokens=256, data.block_size=128: .*not a whole number"):
        sweep_space.resolve_space(base(tmp_path, "tune.space={global_batch_tokens: {choice: [256, 1024]}, "
                                           "data.block_size: {choice: [64, 128]}}"))
    trial = sweep_space.apply_params(cfg, {"global_batch_tokens": 1024, "data.block_size": 128})
    assert (trial.data.grad_accum, global_batch_tokens(trial)) == (2, 1024)
    with pytest.raises(sweep_space.SweepError, match="not ranges"):
        sweep_space.resolve_space(base(tmp_path, "tune.space={global_batch_tokens: {randint: [256, 1024]}}"))
    with pytest.raises(sweep_space.SweepError, match="keep_tokens_per_step=false keeps data.grad_accum"):
        sweep_space.resolve_space(base(tmp_path, "tune.keep_tokens_per_step=false",
                                 "tune.space={global_batch_tokens: {choice: [256, 1024]}}"))
    with pytest.raises(ConfigError, match="tune.space.global_batch_tokens"):
        base(tmp_path, "tune.space={global_batch_tokens: {choice: [big]}}")


def test_asha_compares_trials_at_equal_tokens_not_equal_steps(tmp_path):
    # report every 2 steps; global batches of 256 and 1024 tokens: ASHA's rungs are 512, 1024, 2048, ... tokens
    cfg = base(tmp_path, "train.max_steps=8", "train.checkpoint_every=8",
               "tune.space={global_batch_tokens: {choice: [256, 1024]}}")
    space = sweep_space.resolve_space(cfg)

    def asha():
        scheduler = sweep.asha_scheduler(cfg, space)
        scheduler.set_search_properties(cfg.tune.metric, cfg.tune.mode)
        for trial in ("big", "small"):
            scheduler.on_trial_add(None, SimpleNamespace(trial_id=trial))
        return scheduler

    def report(scheduler, trial, step, bpt):
        tokens = step * {"big": 1024, "small": 256}[trial]
        return scheduler.on_trial_result(None, SimpleNamespace(trial_id=trial),
                                         {"step": step, "tokens_seen": tokens, "val/data_bpt": bpt})

    scheduler = asha()
    assert report(scheduler, "big", 2, 6.0) == "CONTINUE"    # 2048 tokens by step 2, and better for it
    # at step 2 the small batch has seen a quarter of that: on a step axis it would be stopped here
    assert report(scheduler, "small", 2, 7.0) == "CONTINUE"
    assert report(scheduler, "small", 4, 6.8) == "CONTINUE"
    assert report(scheduler, "small", 8, 6.4) == "STOP"      # 2048 tokens: worse than the big one was there
    scheduler = asha()
    report(scheduler, "big", 2, 6.0)
    assert report(scheduler, "small", 8, 5.9) == "CONTINUE"  # better at equal tokens: kept
    # one global batch: the first rung is grace_period reports, as on a step axis
    one = base(tmp_path, "tune.space={optim.lr: {choice: [0.01, 0.001]}}")
    assert sweep_space.tokens_per_step_bounds(one, sweep_space.resolve_space(one)) == (512, 512)


def test_space_kinds_become_tune_domains(tmp_path):
    from ray.tune.search.sample import Categorical, Float, Integer

    cfg = base(tmp_path, "tune.space={optim.lr: {loguniform: [1.0e-4, 1.0e-2]}, lora.r: {randint: [2, 8]}, "
                         "data.block_size: {uniform: [32, 64]}, controller.mode: {choice: [scu, none]}, "
                         "seed: {grid: [0, 1]}}")
    dom = sweep.tune_space(cfg, sweep_space.resolve_space(cfg))
    assert isinstance(dom["optim.lr"], Float) and isinstance(dom["controller.mode"], Categorical)
    assert isinstance(dom["lora.r"], Integer) and (dom["lora.r"].lower, dom["lora.r"].upper) == (2, 9)  # high inclusive
    assert isinstance(dom["data.block_size"], Integer)  # a range over an int key samples ints
    assert dom["seed"] == {"grid_search": [0, 1]}


def test_search_and_space_checks(tmp_path, monkeypatch):
    with pytest.raises(sweep_space.SweepError, match="tune.search=grid .* controller.logodds_kp"):
        sweep_space.resolve_space(base(tmp_path, "tune.search=grid"))
    with pytest.raises(sweep_space.SweepError, match="use choice instead of grid"):
        sweep_space.resolve_space(base(tmp_path, "tune.search=optuna", "tune.space={seed: {grid: [0, 1]}}"))
    with pytest.raises(sweep_space.SweepError, match="remove data.grad_accum"):
        sweep_space.resolve_space(base(tmp_path, "tune.space={data.grad_accum: {choice: [1, 2]}}"))
    with pytest.raises(sweep_space.SweepError, match="controller.target_s value 2"):
        sweep_space.resolve_space(base(tmp_path, "tune.space={controller.target_s: {uniform: [0.01, 2]}}"))
    with pytest.raises(sweep_space.SweepError, match="grace_period"):
        sweep_space.resolve_space(base(tmp_path, "tune.grace_period=4"))
    # a trial's resources are the base config's: they size the concurrency and are checked once
    with pytest.raises(sweep_space.SweepError, match="cannot sweep scaling.num_workers, scaling.cpus_per_worker:"):
        sweep_space.resolve_space(base(tmp_path, "tune.space={scaling.num_workers: {choice: [1, 2]}, "
                                           "scaling.cpus_per_worker: {choice: [1, 2]}, seed: {choice: [0, 1]}}"))
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if the extra were not installed
    with pytest.raises(sweep_space.SweepError, match=r"needs optuna.*pip install"):
        sweep_space.resolve_space(base(tmp_path, "tune.search=optuna"))


def test_arm_bundles_unlike_trials_into_one_grid(tmp_path):
    """tune.space.arm: each value sets several keys together, so the ablation's none, fixed-λ and SCU arms run as one
    grid sweep (crossed with seeds), and bad arms are refused before launch."""
    arms = "[{controller.mode: none}, {controller.mode: fixed, controller.lambda_init: 0.1}]"
    cfg = base(tmp_path, f"tune.space={{arm: {{grid: {arms}}}, seed: {{grid: [0, 1]}}}}", "tune.search=grid")
    space = sweep_space.resolve_space(cfg)
    assert space["arm"] == {"grid": [{"controller.mode": "none"},
                                     {"controller.mode": "fixed", "controller.lambda_init": 0.1}]}
    assert sweep.tune_space(cfg, space)["arm"] == {"grid_search": space["arm"]["grid"]}
    trial = sweep_space.trial_config(cfg, {"arm": space["arm"]["grid"][1], "seed": 1}, "t1")
    assert (trial.controller.mode, trial.controller.lambda_init, trial.seed) == ("fixed", 0.1, 1)
    cfg.tune.space = space
    fake = [SimpleNamespace(path="/x/t1", config={"arm": space["arm"]["grid"][1], "seed": 1}, error=None,
                            metrics={"step": 6, "val/data_bpt": 7.5, "tokens_seen": 3072})]
    rows = sweep_results.trial_rows(fake, cfg, space)
    assert "controller.mode=fixed controller.lambda_init=0.1" in sweep_results.format_table(rows, list(space),
                                                                                           "val/data_bpt")
    with pytest.raises(ConfigError, match=r"tune.space.arm\[0\]: 'controller.nope' is not a config key"):
        base(tmp_path, "tune.space={arm: {grid: [{controller.nope: 1}]}}")
    with pytest.raises(ConfigError, match=r"tune.space.arm\[0\].controller.lambda_init: expected a float"):
        base(tmp_path, "tune.space={arm: {grid: [{controller.lambda_init: x}]}}")
    with pytest.raises(ConfigError, match="an arm cannot set 'scaling.num_workers'"):
        base(tmp_path, "tune.space={arm: {grid: [{scaling.num_workers: 2}]}}")
    with pytest.raises(sweep_space.SweepError, match=r"arm\[0\] sets seed: sweep it as its own tune.space key"):
        sweep_space.resolve_space(base(tmp_path, "tune.search=grid", "tune.space={arm: {grid: [{seed: 1}]}, "
                                                 "seed: {grid: [0]}}"))
    with pytest.raises(sweep_space.SweepError, match=r"sets data.batch_size.*an arm sets no batch key"):
        sweep_space.resolve_space(base(tmp_path, "tune.search=grid", "tune.space={arm: {grid: [{data.batch_size: 2}]}}"))
    with pytest.raises(sweep_space.SweepError, match="controller.lambda_init"):  # a valid key, an invalid config
        sweep_space.resolve_space(base(tmp_path, "tune.search=grid", "tune.space={arm: {grid: [{controller.mode: "
                                                 "fixed, controller.lambda_init: -1.0}]}}"))


def test_concurrent_trials_from_cluster_resources(tmp_path):
    cfg = base(tmp_path)
    assert sweep.concurrent_trials({"CPU": 4.0}, sweep.trial_need(cfg, use_gpu=False)) == 3  # 3 x (1 + 0.01) <= 4
    gpu = base(tmp_path, "scaling.num_workers=2", "scaling.cpus_per_worker=4")
    assert sweep.concurrent_trials({"CPU": 64.0, "GPU": 8.0}, sweep.trial_need(gpu, use_gpu=True)) == 4
    with pytest.raises(sweep_space.SweepError, match="one trial needs CPU=8.01, GPU=2 but the cluster has CPU=64, GPU=1"):
        sweep.concurrent_trials({"CPU": 64.0, "GPU": 1.0}, sweep.trial_need(gpu, use_gpu=True))


@pytest.mark.slow
def test_space_results_and_ablation_modules_import_no_ray():
    # Ray lives at the edge: only ray/ imports it, and of the sweep only its Tune wiring; a fresh interpreter shows
    # what each module pulls in
    import subprocess

    code = ("import sys; import raytrain_scu.ray.tune.space, raytrain_scu.ray.tune.results, "
            "raytrain_scu.studies.ablation.run; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_without_a_config_prints_usage_and_exits_2(capsys):
    assert sweep_cli.main(["--lr"]) == 2
    assert capsys.readouterr().out.startswith("usage: ")
    assert sweep_cli.main(["--help"]) == 0
    text = capsys.readouterr().out  # the sweep's own flags, what it does, its keys with their defaults
    assert re.search(r"^  --lr +also sweep optim\.lr", text, re.M) and re.search(r"^  --verbose +Ray's", text, re.M)
    assert "best.yaml" in text and re.search(r'^  tune\.metric = "val/data_bpt" +the metric', text, re.M)
    assert sweep_cli.main([TINY, "--no-such-flag"]) == 2
    assert "unknown option(s) --no-such-flag" in capsys.readouterr().err


def test_the_last_line_says_when_the_finished_trials_saw_different_token_budgets():
    rows = [{"trial": "a", "status": "FINISHED", "tokens_seen": 20480, "metric": 7.0},
            {"trial": "b", "status": "FINISHED", "tokens_seen": 5120, "metric": 7.4},
            {"trial": "c", "status": "KILLED", "tokens_seen": 1024, "metric": 8.0}]  # ASHA's: compared at equal tokens
    note = sweep_results.token_budget_note(rows, rows[0])
    assert note.startswith("note: the finished trials trained on different token budgets, 5,120 to 20,480 tokens")
    assert "the best trial, a, saw 20,480" in note
    assert sweep_results.token_budget_note([rows[0], {**rows[1], "tokens_seen": 20480}, rows[2]], rows[0]) is None


def test_cli_memory_fit_error_exits_2(tmp_path, monkeypatch, capsys):
    from raytrain_scu.errors import MemoryFitError

    def no_fit(cfg, with_lr, verbose, inputs_checked):
        raise MemoryFitError("data.batch_size=64 does not fit")

    monkeypatch.setattr(driver_sweep, "sweep", no_fit)
    assert sweep_cli.main([TINY, f"run.storage_path={tmp_path}"]) == 2
    assert capsys.readouterr().err == "error: data.batch_size=64 does not fit\n"


@pytest.mark.parametrize("overrides, message", [
    (["tune.space={no.such_key: {choice: [1]}}"], "no.such_key"),
    (["tune.space={controller.kp: {between: [0, 1]}}"], "unknown kind 'between'"),
    (["tune.space={data.batch_size: {choice: [3]}}", *SPEED], "does not divide"),
    (["tune.space={data.batch_size: {choice: [2, 4]}}"], "float noise"),
    (["tune.space={global_batch_tokens: {choice: [100]}}"], "not a whole number of micro-steps"),
    (["train.eval_batches=4"], "use train.eval_blocks"),
    (["tune.search=optuna"], "needs optuna"),
    (["controller.target_s=1.5"], "controller.target_s"),
])
def test_cli_errors_exit_2_before_ray(tmp_path, monkeypatch, capsys, overrides, message):
    from raytrain_scu.ray.tune import sweep as tune_sweep

    monkeypatch.setitem(sys.modules, "optuna", None)
    monkeypatch.setattr(tune_sweep, "init_ray", lambda cfg: pytest.fail("Ray started"))
    assert sweep_cli.main([TINY, f"run.storage_path={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_table_sorted_by_metric_and_best_yaml_loads(tmp_path):
    metric = "perf/tokens_per_s"  # a micro-batch sweep is scored on speed, the higher the better
    cfg = base(tmp_path, "tune.space={data.batch_size: {grid: [2, 4, 8]}}", "tune.search=grid", *SPEED)
    space = sweep_space.resolve_space(cfg)
    cfg.tune.space = space
    fake = [SimpleNamespace(path=f"/x/t{b}", config={"data.batch_size": b}, error=None,
                            metrics={"step": steps, metric: speed, "tokens_seen": steps * 512, **resumed})
            for b, steps, speed, resumed in ((2, 6, 900.0, {"resumed_at": "2,4"}), (4, 2, 500.0, {}),
                                             (8, 6, 1200.0, {}))]
    cause = RuntimeError("the trial's driver failed")
    cause.__cause__ = ValueError("first line\nthe cause's last line")
    fake.append(SimpleNamespace(path="/x/t16", config={"data.batch_size": 1}, error=cause, metrics={}))
    rows = sweep_results.trial_rows(fake, cfg, space)
    assert [r["trial"] for r in rows] == ["t8", "t2", "t4", "t16"]
    assert [r["status"] for r in rows] == ["FINISHED", "FINISHED", "KILLED", "FAILED"]
    assert [r["resumed_at"] for r in rows] == [[], [2, 4], [], []]  # t2 restarted twice, from steps 2 and 4
    assert [r["error"] for r in rows] == [None, None, None, "ValueError: the cause's last line"]
    assert [r["grad_accum"] for r in rows] == [1, 4, 2, 8]
    assert [r["tokens_seen"] for r in rows] == [3072, 3072, 1024, None]
    table = sweep_results.format_table(rows, list(space), metric)
    close = [{**rows[0], "metric": 10.98755}, {**rows[1], "metric": 10.98757}]  # 4 digits would print two 10.99
    assert {line.split()[4] for line in sweep_results.format_table(close, list(space), metric).splitlines()[1:]} \
        == {"10.98755", "10.98757"}
    assert table.splitlines()[0].split() == ["trial", "data.batch_size", "data.grad_accum", "global_batch_tokens",
                                             metric, "scored_at", "steps", "tokens_seen", "status", "resumed_at"]
    assert table.splitlines()[2].split()[-2:] == ["FINISHED", "2,4"] and table.splitlines()[1].split()[-1] == "-"
    csv_rows = list(csv.DictReader(io.StringIO(sweep_results.trials_csv(rows, list(space), metric))))
    assert [(r["resumed_at"], r["error"]) for r in csv_rows] == [("", ""), ("2,4", ""), ("", ""),
                                                                 ("", "ValueError: the cause's last line")]
    best = sweep_results.best_row(rows)
    path = tmp_path / "best.yaml"
    path.write_text(to_yaml(sweep_results.best_config(cfg, best)))
    loaded = load_config(path)
    assert (loaded.data.batch_size, loaded.data.grad_accum, loaded.run.name) == (8, 1, "sw-best")
    pngs = sweep_results.plot_metric_vs_params(rows, space, metric, tmp_path / "plots", best)
    assert [p.name for p in pngs] == ["perf_tokens_per_s_vs_data.batch_size.png"]
    png = pngs[0].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (660, 440)  # 6 x 4 in at 110 dpi


def test_global_batch_table_has_one_global_batch_column_and_the_accumulation(tmp_path):
    cfg = base(tmp_path, "tune.space={global_batch_tokens: {grid: [256, 1024]}}", "tune.search=grid")
    space = sweep_space.resolve_space(cfg)
    fake = [SimpleNamespace(path=f"/x/g{g}", config={"global_batch_tokens": g}, error=None,
                            metrics={"step": 6, "val/data_bpt": bpt, "tokens_seen": 6 * g})
            for g, bpt in ((256, 7.5), (1024, 7.1))]
    rows = sweep_results.trial_rows(fake, cfg, space)
    head, *body = sweep_results.trials_csv(rows, list(space), "val/data_bpt").splitlines()
    assert head.split(",") == ["trial", "global_batch_tokens", "data.grad_accum", "val/data_bpt", "scored_at", "steps",
                               "tokens_seen", "status", "resumed_at", "run_name", "error"]
    assert [line.split(",")[:3] for line in body] == [["g1024", "1024", "4"], ["g256", "256", "1"]]
    assert load_config_text(tmp_path, to_yaml(sweep_results.best_config(cfg, rows[0]))).data.grad_accum == 4
    # the trial's MLflow child run: the accumulation and the global batch as params (a real sqlite store)
    params = {"global_batch_tokens": 1024}
    run_id = sweep_results.open_child_run(sweep_space.trial_config(cfg, params, "g1024"), "sw", None, params, "g1024")
    logged = client_for(tracking_uri(cfg)).get_run(run_id).data.params
    assert (logged["data.grad_accum"], logged["derived.global_batch_tokens"]) == ("4", "1024")


def load_config_text(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path)


def test_tiny_sweep_experiment_resolves():
    cfg = load_config(ROOT / "experiments" / "tiny-sweep.yaml")
    space = sweep_space.resolve_space(cfg)
    assert cfg.scaling.num_workers == 1
    assert space == {"global_batch_tokens": {"choice": [256, 512, 1024]},
                     "controller.logodds_kp": {"loguniform": [0.5, 8.0]},
                     "controller.target_s": {"loguniform": [0.002, 0.05]}}
    assert [sweep_space.apply_params(cfg, {"global_batch_tokens": g}).data.grad_accum for g in (256, 512, 1024)] == [1, 2, 4]


@pytest.mark.slow
def test_close_parent_run_ends_only_the_children_left_running(tmp_path):
    # a real sqlite store; the four ways a trial's child run ends
    cfg = base(tmp_path, "tune.space={optim.lr: {choice: [0.01, 0.001]}}")
    cfg.tune.space = sweep_space.resolve_space(cfg)
    parent_run_id = sweep_results.open_parent_run(cfg)
    client = client_for(tracking_uri(cfg))
    ends = {"done": ("FINISHED", "FINISHED"),       # reached train.max_steps: run_trial ended the run
            "saturated": ("FINISHED", "FINISHED"),  # train.stop_on_saturation: run_trial ended the run too
            "asha": ("KILLED", None),               # stopped by Tune: left RUNNING
            "crashed": ("FAILED", None)}            # failed: left RUNNING
    rows, run_ids = [], {}
    for i, (trial, (status, worker_end)) in enumerate(ends.items()):
        params = {"optim.lr": 0.01}
        run_ids[trial] = sweep_results.open_child_run(sweep_space.trial_config(cfg, params, trial), cfg.run.name, parent_run_id,
                                              params, trial)
        if worker_end:
            client.set_terminated(run_ids[trial], status=worker_end)
        rows.append({"trial": trial, "status": status, "metric": 7.0 + i,
                     "resumed_at": [4] if trial == "done" else [],
                     "error": "NonFiniteError: 1 optimizer steps in a row" if status == "FAILED" else None})
    sweep_results.close_parent_run(cfg, parent_run_id, rows, rows[0], "best: yes\n", [])

    runs = {t: client.get_run(r) for t, r in run_ids.items()}
    assert {t: r.info.status for t, r in runs.items()} == {"done": "FINISHED", "saturated": "FINISHED",
                                                           "asha": "KILLED", "crashed": "FAILED"}
    assert {t: r.data.tags["raytrain_scu.trial_status"] for t, r in runs.items()} == \
        {t: status for t, (status, _) in ends.items()}
    # which trial restarted and from which step; a failed one's cause
    assert {t: r.data.tags.get("raytrain_scu.trial_resumed_at") for t, r in runs.items()} == \
        {"done": "4", "saturated": None, "asha": None, "crashed": None}
    assert {t: r.data.tags.get("raytrain_scu.failure") for t, r in runs.items()} == \
        {"done": None, "saturated": None, "asha": None, "crashed": "NonFiniteError: 1 optimizer steps in a row"}
    parent = client.get_run(parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["raytrain_scu.best_run_id"] == run_ids["done"]
    # the space is logged once, as the base config's tune.space
    assert "sweep.space" not in parent.data.params
    assert parent.data.params["tune.space"] == '{"optim.lr": {"choice": [0.01, 0.001]}}'


# ---------------------------------------------------------------- integration: real sweeps (Ray, CPU workers, MLflow)

def sweep_runs(cfg, summary):
    """(parent run, child runs) of a sweep in its MLflow store."""
    client = client_for(tracking_uri(cfg))
    parent = client.get_run(summary["parent_run_id"])
    return parent, child_runs(cfg, parent.info.run_id)


TUNE_NOISE = ("Configuration for experiment", "View detailed results", "╭", "Trial status", "TrainingReport(",
              "tensorboard", "Trial ")


def job_groups(ray) -> dict:
    """{id: state} of the placement groups this job (this process's driver) made: a placement group's id ends with
    its creator's job id."""
    job = ray.get_runtime_context().get_job_id()
    return {k: v["state"] for k, v in ray.util.placement_group_table().items() if k.endswith(job)}


def held_groups(ray) -> list:
    """This job's placement groups that are not removed."""
    return [k for k, state in job_groups(ray).items() if state != "REMOVED"]


def held_cpus(ray) -> str:
    """What holds the local cluster's CPUs: the resources and every placement group not removed, read from the GCS
    (the state API answers through a dashboard, which need not be this cluster's)."""
    groups = {k: (v["state"], v.get("name"), v.get("bundles")) for k, v in ray.util.placement_group_table().items()
              if v["state"] != "REMOVED"}
    return f"available {ray.available_resources()}, total {ray.cluster_resources()}, placement groups held: {groups}"


class QueueThatFailsOnce:
    """A real Ray queue whose first read fails, as when its actor does not answer."""

    def __init__(self, queue):
        self.queue, self.failed = queue, False

    def empty(self):
        if not self.failed:
            self.failed = True
            raise ConnectionError("the queue's actor did not answer")
        return self.queue.empty()

    def get_nowait(self):
        return self.queue.get_nowait()


@pytest.mark.slow
def test_the_reaper_removes_a_dead_controllers_placement_group_and_outlives_what_fails(ray_local, capsys):
    """A trial's controller that died leaves its workers' placement group: the reaper removes it and keeps watching a
    live one's. An entry it cannot check or remove (here: not an actor, not a placement group) and a queue that does
    not answer are printed once and tried again on every pass, and the rest goes on: one failure must not leave every
    later trial's resources held until the job ends."""
    import threading

    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.queue import Queue

    @ray_local.remote(num_cpus=0)
    class Controller:
        pass

    def state(pg):
        return placement_group_table(pg)["state"]

    queue = Queue(actor_options={"num_cpus": 0})
    live, dead = Controller.remote(), Controller.remote()
    live_pg, dead_pg = placement_group([{"CPU": 0.01}]), placement_group([{"CPU": 0.01}])
    ray_local.get([live_pg.ready(), dead_pg.ready(), live.__ray_ready__.remote(), dead.__ray_ready__.remote()])
    try:
        for entry in [("not an actor", "a"), (dead, "not a placement group"), (dead, dead_pg), (live, live_pg)]:
            queue.put(entry)
        ray_local.kill(dead)
        reaper = sweep.PlacementGroupReaper(queue)
        for _ in range(120):  # the kill lands asynchronously
            if reaper.release() == 3:
                break
            time.sleep(0.5)
        assert reaper.release() == 3
        assert state(dead_pg) == "REMOVED" and state(live_pg) == "CREATED"
        assert [pg for _, pg in reaper.watched] == ["a", "not a placement group", live_pg]  # kept, tried again
        err = capsys.readouterr().err
        assert err.count("placement group 'a' could not ask whether its controller lives; tried again") == 1
        assert err.count("placement group 'not a placement group' could not be removed; tried again") == 1

        # the same in its thread, from a queue whose first read fails: the watch goes on, and at the end the live
        # controller's group goes too once that controller has ended
        again, stop = sweep.PlacementGroupReaper(QueueThatFailsOnce(queue)), threading.Event()
        queue.put((live, live_pg))
        watcher = threading.Thread(target=again.run, args=(stop, 0.1), daemon=True)
        watcher.start()
        for _ in range(120):
            if again.watched:
                break
            time.sleep(0.5)
        assert [pg for _, pg in again.watched] == [live_pg]
        ray_local.kill(live)
        stop.set()
        watcher.join(timeout=60)
        assert not watcher.is_alive() and state(live_pg) == "REMOVED"
        assert "the queue of trials' placement groups could not be read; tried again on every pass: ConnectionError" \
            in capsys.readouterr().err
    finally:
        for pg in (live_pg, dead_pg):
            if state(pg) != "REMOVED":
                remove_placement_group(pg)
        queue.shutdown()


def kill_the_held_trial_once_checkpointed(hold: Path, trials: Path, step: int, box: dict) -> None:
    """In a thread beside the sweep: once a trial's rank 0 holds after its step (RAYTRAIN_SCU_HOLD_AT_STEP: the first
    trial to get there, the only one) and Ray Train has registered that trial's checkpoint of ``step`` (its checkpoint
    manager's snapshot names it), SIGKILL the worker; ``box`` gets its trial id and pid, or an error."""
    import os
    import signal

    t0 = time.time()
    while time.time() - t0 < 600:
        held = hold / "rank0.pid"
        snapshots = [f for f in trials.glob("*/checkpoint_manager_snapshot.json")
                     if f"checkpoint_{step:08d}" in f.read_text(errors="replace")]
        if held.exists() and snapshots:
            pid = int(held.read_text().split()[0])
            box.update(trial=snapshots[0].parent.name.rsplit("-", 1)[-1], pid=pid, killed_after_s=time.time() - t0)
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.2)
    box["error"] = f"no trial held with its checkpoint {step} registered in 600 s"


@pytest.mark.slow
def test_sweep_asha_stops_one_trial_a_killed_one_resumes_a_diverging_one_fails_best_yaml_trains(
        ray_local, tmp_path, capfd, monkeypatch):
    """Three trials in grid order, one at a time (the table's order among more rows:
    test_table_sorted_by_metric_and_best_yaml_loads). The first (lr 0.01) has its worker SIGKILLed after step 6: Ray
    Train restarts it from its own checkpoint 4 (run.max_failures=1) and it finishes; the second (lr 1e-7) is
    stopped by ASHA; the third (lr 1e30) diverges at step 2 on every attempt and fails for good with its cause. The
    table, trials.csv, the console and MLflow say which trial restarted, from which step, and why the other failed;
    the best is chosen from the rest, and best.yaml passes preflight and trains in the loop, in this process (what a
    run of it computes does not depend on Ray)."""
    import threading

    from raytrain_scu.driver.preflight import preflight

    hold = tmp_path / "hold"
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_AT_STEP", "6")  # the first trial to finish step 6 waits there to be killed
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_DIR", str(hold))
    # one trial at a time in grid order, the bad lr second: ASHA judges it against the good one at the first rung
    # (step 2), where it stops a trial below the best half (reduction factor 2) of those recorded there. The diverging
    # lr is last: it fails at step 2, before its first report, so ASHA never judges it
    cfg = base(tmp_path, "train.max_steps=8", "train.checkpoint_every=4", "tune.search=grid",
               "tune.space={optim.lr: {grid: [0.01, 1e-7, 1e30]}}", "tune.scheduler=asha", "tune.grace_period=1",
               "tune.max_concurrent_trials=1", "run.max_failures=1", "train.max_consecutive_skips=1")
    box = {}
    killer = threading.Thread(target=kill_the_held_trial_once_checkpointed,
                              args=(hold, tmp_path / "sw" / "trials", 4, box), daemon=True)
    killer.start()
    summary = driver_sweep.sweep(cfg)
    killer.join(timeout=1)
    assert "pid" in box, box
    rows = summary["rows"]
    by_lr = {r["params"]["optim.lr"]: r for r in rows}
    good, bad, diverged = by_lr[0.01], by_lr[1e-7], by_lr[1e30]
    assert len(rows) == 3 and summary["errors"] == [diverged["trial"]]
    console = capfd.readouterr()
    print(console.out)  # for the record (-s)
    # the sweep's own console: a line per trial event, with the trial's values; no Tune tables, no trial output
    lines = console.out.splitlines()
    assert not [x for x in TUNE_NOISE if x in console.out + console.err], console.out + console.err
    for r in rows:
        lr = f"optim.lr={r['params']['optim.lr']:.4g}"
        assert f"[raytrain_scu] trial {r['trial']} started: {lr}" in lines, console.out
    for r in (good, bad):
        assert any(x.startswith(f"[raytrain_scu] trial {r['trial']} step 2/8  val/data_bpt ") for x in lines)
    assert any(x.startswith(f"[raytrain_scu] trial {bad['trial']} stopped by ASHA at step {bad['scored_step']}: "
                            f"val/data_bpt ") and x.endswith("optim.lr=1e-07") for x in lines), console.out
    assert any(x.startswith(f"[raytrain_scu] trial {good['trial']} finished at step 8: val/data_bpt ") for x in lines)
    # the killed trial: its own checkpoint 4, said on the console, in the table, trials.csv and MLflow
    assert box["trial"] == good["trial"] and good["resumed_at"] == [4], (box, good)
    assert f"[raytrain_scu] trial {good['trial']} resumed from its checkpoint at step 4 (restart 1); optim.lr=0.01" \
        in lines, console.out
    assert (good["status"], good["steps"]) == ("FINISHED", 8)
    # the diverging trial: failed for good, with its cause, on the console and in its row
    cause = "NonFiniteError: 1 optimizer steps in a row had a non-finite loss or gradient (last at step 2)"
    assert diverged["status"] == "FAILED" and diverged["error"].startswith(cause), diverged
    assert any(x.startswith(f"[raytrain_scu] trial {diverged['trial']} failed: {cause}") for x in lines), console.out
    assert f"[raytrain_scu] 1 trial(s) failed ({diverged['trial']}: {cause}" in console.out
    assert lines[-1].startswith(f"[raytrain_scu] best trial {good['trial']}: val/data_bpt=")  # one budget: no note
    assert any(x.split()[:2] == ["trial", "optim.lr"] for x in lines)  # the table
    table = next(i for i, x in enumerate(lines) if x.split()[:2] == ["trial", "optim.lr"])
    assert lines[table].split()[-2:] == ["status", "resumed_at"] and lines[table + 1].split()[-2:] == ["FINISHED", "4"]
    assert (Path(summary["sweep_dir"]) / "logs" / "driver.log").is_file()  # Tune's own log lines went there
    assert [r["params"]["optim.lr"] for r in rows] == [0.01, 1e-7, 1e30]  # best first, then ASHA's, then the failed
    assert bad["status"] == "KILLED" and bad["scored_step"] < 8 and bad["metric"] > good["metric"]  # ASHA stopped it
    assert summary["best"]["trial"] == good["trial"]  # chosen from the trials that did not fail
    assert {r["global_batch_tokens"] for r in rows} == {512}
    # the stopped trial's Train workers gave their CPU back (its controller died with the trial): every placement
    # group this job made is removed. Ray frees an exited actor's resources asynchronously, which on a loaded 2-core
    # machine can take tens of seconds. The cluster may be shared with another test process, so its free CPUs are not
    # the measure.
    assert job_groups(ray_local)  # the sweep's groups are found
    for _ in range(240):
        if not held_groups(ray_local):
            break
        time.sleep(0.5)
    assert not held_groups(ray_local), held_cpus(ray_local)

    client = client_for(tracking_uri(cfg))
    runs = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    parent, children = sweep_runs(cfg, summary)
    assert len(runs) == 4 and len(children) == 3                     # one parent, three linked children
    assert PARENT_TAG not in parent.data.tags and parent.info.status == "FINISHED"
    status = {}
    for child in children:
        p = child.data.params
        assert p["derived.global_batch_tokens"] == "512" and "optim.lr" in p
        status[float(p["optim.lr"])] = child.info.status
    assert status == {1e-7: "KILLED", 0.01: "FINISHED", 1e30: "FAILED"}
    # the table, trials.csv and MLflow agree on each trial's status, steps, restarts and failure
    csv_rows = {r["trial"]: r for r in csv.DictReader(io.StringIO(Path(summary["sweep_dir"], "trials.csv").read_text()))}
    for child in children:
        row = next(r for r in rows if r["run_name"] == child.data.tags["mlflow.runName"])
        tags = child.data.tags
        assert child.info.status == row["status"] == csv_rows[row["trial"]]["status"]
        assert tags.get("raytrain_scu.trial_resumed_at") == ("4" if row is good else None)
        assert csv_rows[row["trial"]]["resumed_at"] == ("4" if row is good else "")
        assert tags.get("raytrain_scu.failure") == row["error"] and csv_rows[row["trial"]]["error"] == (row["error"] or "")
        if row is diverged:
            continue
        history = client.get_metric_history(child.info.run_id, "ctrl/lambda")
        assert "val/data_bpt" in child.data.metrics
        assert max(m.step for m in history) == row["steps"] == int(tags["raytrain_scu.trial_steps"]) \
            == int(csv_rows[row["trial"]]["steps"])
    good_run = next(c for c in children if c.data.tags["mlflow.runName"] == good["run_name"])
    steps = [m.step for m in client.get_metric_history(good_run.info.run_id, "ctrl/lambda")]
    assert sorted(steps) == list(range(0, 9))  # every step once: those redone after the restart are not logged again
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"best.yaml", "trials.csv", "plots"} <= artifacts
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "plots")] == \
        ["plots/val_data_bpt_vs_optim.lr.png"]
    assert parent.data.tags["raytrain_scu.best_trial"] == good["trial"]

    best = load_config(summary["best_yaml"])
    assert best.optim.lr == 0.01 and best.tune.space == {}
    best = load_config(summary["best_yaml"], ["tracking.enabled=false"])  # no MLflow record is asserted of it
    preflight(best)
    last = in_process(best)
    assert last["step"] == 8 and math.isfinite(last["val/data_bpt"]) and last["train/lora_b_norm"] > 0


@pytest.mark.slow
def test_interrupted_sweep_resumes_when_rerun(ray_local, tmp_path, monkeypatch, capfd):
    # the fault fires only in a run that did not start from a checkpoint: the rerun succeeds only if it resumed
    monkeypatch.setenv("RAYTRAIN_SCU_FAULT_AT_STEP", "5")
    cfg = base(tmp_path, "train.max_steps=8", "train.checkpoint_every=4", "run.max_failures=0",
               "tune.space={optim.lr: {grid: [0.003]}}", "tune.search=grid")
    first = driver_sweep.sweep(cfg)
    assert first["rows"][0]["status"] == "FAILED" and first["errors"]
    out = capfd.readouterr().out
    trial = first["rows"][0]["trial"]
    assert re.search(rf"^\[raytrain_scu\] trial {trial} failed at step 4: \S*: .*fault injected after step 5.*; "
                     r"optim\.lr=0\.003$", out, re.M), out  # the cause in one line, after the last report (step 4)
    assert "Traceback" not in out and re.search(rf"1 trial\(s\) failed \({trial}: \S*: .*fault injected after step 5"
                                                rf".*\): re-run the same command", out), out
    second = driver_sweep.sweep(base(tmp_path, "train.max_steps=8", "train.checkpoint_every=4", "run.max_failures=0",
                                  "tune.space={optim.lr: {grid: [0.003]}}", "tune.search=grid"))
    row = second["rows"][0]
    assert (row["trial"], row["status"], row["steps"]) == (first["rows"][0]["trial"], "FINISHED", 8)
    assert row["resumed_at"] == [4] and row["error"] is None  # the re-run resumed it from its checkpoint 4
    assert f"[raytrain_scu] trial {trial} resumed from its checkpoint at step 4 (restart 1); optim.lr=0.003" \
        in capfd.readouterr().out
    assert second["parent_run_id"] == first["parent_run_id"]
    _, children = sweep_runs(cfg, second)
    assert len(children) == 1
    client = client_for(tracking_uri(cfg))
    assert [x.step for x in client.get_metric_history(children[0].info.run_id, "ctrl/lambda")] == list(range(0, 9))
