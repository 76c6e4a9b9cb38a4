"""The sweep: space checks and the batch/tokens rule in seconds; then real Tune sweeps of Ray Train runs on CPU."""
import math
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import ROOT, TINY, tiny_cfg
from raytrain_scu import sweep, tracking
from raytrain_scu.config import ConfigError, load_config, to_yaml

# a 1-worker tiny run: val/data_bpt measured at every report so ASHA compares fresh values
FAST = ["scaling.num_workers=1", "train.max_steps=6", "train.report_every=2", "train.eval_every=2",
        "train.checkpoint_every=6", "train.eval_batches=2"]


def base(tmp_path, *overrides):
    return tiny_cfg(tmp_path, "sw", *FAST, *overrides)


# ---------------------------------------------------------------- fast: space, batch rule, resources, CLI errors

def test_default_space_sweeps_batch_and_controller_and_lr_when_asked(tmp_path):
    cfg = base(tmp_path)  # batch 4 x accum 2
    space = sweep.resolve_space(cfg)
    assert list(space) == ["data.batch_size", "controller.kp", "controller.ki", "controller.target_s"]
    assert space["data.batch_size"] == {"choice": [2, 4, 8]}
    assert "optim.lr" in sweep.resolve_space(cfg, with_lr=True)
    # a batch that cannot keep tokens per step is left out, and the controller is not swept when it is off
    space = sweep.resolve_space(base(tmp_path, "data.grad_accum=1", "controller.mode=none"))
    assert space == {"data.batch_size": {"choice": [2, 4]}}


def test_batch_trials_keep_tokens_per_step(tmp_path):
    cfg = base(tmp_path)
    tokens = {sweep.global_batch_tokens(sweep.apply_params(cfg, {"data.batch_size": b})) for b in (1, 2, 4, 8)}
    assert tokens == {sweep.global_batch_tokens(cfg)} == {4 * 2 * 64}
    assert sweep.apply_params(cfg, {"data.batch_size": 2}).data.grad_accum == 4
    with pytest.raises(ConfigError, match="does not divide"):
        sweep.apply_params(cfg, {"data.batch_size": 3})
    with pytest.raises(sweep.SweepError, match="data.batch_size value 3"):
        sweep.resolve_space(base(tmp_path, "tune.space={data.batch_size: {choice: [2, 3]}}"))
    # without the rule, grad_accum stays and the global batch follows the batch size
    loose = base(tmp_path, "tune.keep_tokens_per_step=false")
    trial = sweep.apply_params(loose, {"data.batch_size": 8})
    assert trial.data.grad_accum == 2 and sweep.global_batch_tokens(trial) == 2 * sweep.global_batch_tokens(loose)


def test_space_kinds_become_tune_domains(tmp_path):
    from ray.tune.search.sample import Categorical, Float, Integer

    cfg = base(tmp_path, "tune.space={optim.lr: {loguniform: [1.0e-4, 1.0e-2]}, lora.r: {randint: [2, 8]}, "
                         "data.block_size: {uniform: [32, 64]}, controller.mode: {choice: [scu, none]}, "
                         "seed: {grid: [0, 1]}}")
    dom = sweep.tune_space(cfg, sweep.resolve_space(cfg))
    assert isinstance(dom["optim.lr"], Float) and isinstance(dom["controller.mode"], Categorical)
    assert isinstance(dom["lora.r"], Integer) and (dom["lora.r"].lower, dom["lora.r"].upper) == (2, 9)  # high inclusive
    assert isinstance(dom["data.block_size"], Integer)  # a range over an int key samples ints
    assert dom["seed"] == {"grid_search": [0, 1]}


def test_search_and_space_checks(tmp_path, monkeypatch):
    with pytest.raises(sweep.SweepError, match="tune.search=grid .* controller.kp"):
        sweep.resolve_space(base(tmp_path, "tune.search=grid"))
    with pytest.raises(sweep.SweepError, match="use choice instead of grid"):
        sweep.resolve_space(base(tmp_path, "tune.search=optuna", "tune.space={seed: {grid: [0, 1]}}"))
    with pytest.raises(sweep.SweepError, match="remove data.grad_accum"):
        sweep.resolve_space(base(tmp_path, "tune.space={data.grad_accum: {choice: [1, 2]}}"))
    with pytest.raises(sweep.SweepError, match="controller.target_s value 2"):
        sweep.resolve_space(base(tmp_path, "tune.space={controller.target_s: {uniform: [0.01, 2]}}"))
    with pytest.raises(sweep.SweepError, match="grace_period"):
        sweep.resolve_space(base(tmp_path, "tune.grace_period=4"))
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if the extra were not installed
    with pytest.raises(sweep.SweepError, match=r"needs optuna.*pip install"):
        sweep.resolve_space(base(tmp_path, "tune.search=optuna"))


def test_concurrent_trials_from_cluster_resources(tmp_path):
    cfg = base(tmp_path)
    assert sweep.concurrent_trials({"CPU": 4.0}, sweep.trial_need(cfg, use_gpu=False)) == 3  # 3 x (1 + 0.01) <= 4
    gpu = base(tmp_path, "scaling.num_workers=2", "scaling.cpus_per_worker=4")
    assert sweep.concurrent_trials({"CPU": 64.0, "GPU": 8.0}, sweep.trial_need(gpu, use_gpu=True)) == 4
    with pytest.raises(sweep.SweepError, match="one trial needs CPU=8.01, GPU=2 but the cluster has CPU=64, GPU=1"):
        sweep.concurrent_trials({"CPU": 64.0, "GPU": 1.0}, sweep.trial_need(gpu, use_gpu=True))


@pytest.mark.parametrize("overrides, message", [
    (["tune.space={no.such_key: {choice: [1]}}"], "no.such_key"),
    (["tune.space={controller.kp: {between: [0, 1]}}"], "unknown kind 'between'"),
    (["tune.space={data.batch_size: {choice: [3]}}"], "does not divide"),
    (["tune.search=optuna"], "needs optuna"),
    (["controller.target_s=1.5"], "controller.target_s"),
])
def test_cli_errors_exit_2_before_ray(tmp_path, monkeypatch, capsys, overrides, message):
    import raytrain_scu.train

    monkeypatch.setitem(sys.modules, "optuna", None)
    monkeypatch.setattr(raytrain_scu.train, "init_ray", lambda cfg: pytest.fail("Ray started"))
    assert sweep.main([TINY, f"run.storage_path={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_table_sorted_by_metric_and_best_yaml_loads(tmp_path):
    cfg = base(tmp_path, "tune.space={data.batch_size: {grid: [2, 4, 8]}}", "tune.search=grid")
    space = sweep.resolve_space(cfg)
    cfg.tune.space = space
    fake = [SimpleNamespace(path=f"/x/t{b}", config={"data.batch_size": b}, error=None,
                            metrics={"step": steps, "val/data_bpt": bpt})
            for b, steps, bpt in ((2, 6, 7.5), (4, 2, 9.0), (8, 6, 7.1))]
    fake.append(SimpleNamespace(path="/x/t16", config={"data.batch_size": 1}, error=RuntimeError("x"), metrics={}))
    rows = sweep.trial_rows(fake, cfg, space)
    assert [r["trial"] for r in rows] == ["t8", "t2", "t4", "t16"]
    assert [r["status"] for r in rows] == ["DONE", "DONE", "STOPPED", "ERROR"]
    assert [r["grad_accum"] for r in rows] == [1, 4, 2, 8]
    table = sweep.format_table(rows, list(space), "val/data_bpt")
    assert table.splitlines()[0].split() == ["trial", "data.batch_size", "data.grad_accum", "global_batch_tokens",
                                             "val/data_bpt", "steps", "status"]
    best = sweep.best_row(rows)
    path = tmp_path / "best.yaml"
    path.write_text(to_yaml(sweep.best_config(cfg, best)))
    loaded = load_config(path)
    assert (loaded.data.batch_size, loaded.data.grad_accum, loaded.run.name) == (8, 1, "sw-best")
    pngs = sweep.plot_metric_vs_params(rows, space, "val/data_bpt", tmp_path / "plots", best)
    assert [p.name for p in pngs] == ["val_data_bpt_vs_data.batch_size.png"] and pngs[0].stat().st_size > 0


def test_tiny_sweep_experiment_resolves():
    cfg = load_config(ROOT / "experiments" / "tiny-sweep.yaml")
    space = sweep.resolve_space(cfg)
    assert cfg.scaling.num_workers == 1 and len(space) >= 2


# ---------------------------------------------------------------- integration: real sweeps (Ray, CPU workers, MLflow)

def sweep_runs(cfg, summary):
    """(parent run, child runs) of a sweep in its MLflow store."""
    client = tracking.client_for(tracking.tracking_uri(cfg))
    parent = client.get_run(summary["parent_run_id"])
    return parent, tracking.child_runs(cfg, parent.info.run_id)


@pytest.mark.slow
def test_three_trial_sweep_asha_stops_the_bad_one_children_linked_best_yaml_trains(ray_local, tmp_path):
    from raytrain_scu.train import run

    # one trial at a time in grid order, the bad lr last: ASHA judges it against the others at the first rung (step 2)
    cfg = base(tmp_path, "train.max_steps=8", "train.checkpoint_every=8", "tune.search=grid",
               "tune.space={optim.lr: {grid: [0.01, 0.005, 1e-7]}}", "tune.scheduler=asha", "tune.grace_period=1",
               "tune.max_concurrent_trials=1")
    summary = sweep.run_sweep(cfg)
    rows = summary["rows"]
    by_lr = {r["params"]["optim.lr"]: r for r in rows}
    assert len(rows) == 3 and not summary["errors"]
    assert [r["metric"] for r in rows] == sorted(r["metric"] for r in rows)
    assert rows[0]["status"] == "DONE" and rows[0]["steps"] == 8
    assert rows[0]["params"]["optim.lr"] == 0.01
    bad = by_lr[1e-7]
    assert bad["status"] == "STOPPED" and bad["steps"] < 8 and bad["metric"] > rows[0]["metric"]  # ASHA stopped it
    assert {r["global_batch_tokens"] for r in rows} == {512}
    # the stopped trial's Train workers gave their CPU back (its controller died with the trial)
    for _ in range(20):
        if ray_local.available_resources().get("CPU") == ray_local.cluster_resources()["CPU"]:
            break
        time.sleep(0.5)
    assert ray_local.available_resources().get("CPU") == ray_local.cluster_resources()["CPU"]

    client = tracking.client_for(tracking.tracking_uri(cfg))
    runs = client.search_runs([client.get_experiment_by_name("sw").experiment_id])
    parent, children = sweep_runs(cfg, summary)
    assert len(runs) == 4 and len(children) == 3                     # one parent, three linked children
    assert tracking.PARENT_TAG not in parent.data.tags and parent.info.status == "FINISHED"
    status = {}
    for child in children:
        p, m = child.data.params, child.data.metrics
        assert p["derived.global_batch_tokens"] == "512" and "val/data_bpt" in m and "optim.lr" in p
        status[float(p["optim.lr"])] = child.info.status
    assert status[1e-7] == "KILLED" and status[rows[0]["params"]["optim.lr"]] == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"best.yaml", "trials.csv", "plots"} <= artifacts
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "plots")] == \
        ["plots/val_data_bpt_vs_optim.lr.png"]
    assert parent.data.tags["raytrain_scu.best_trial"] == rows[0]["trial"]

    best = load_config(summary["best_yaml"])
    assert best.optim.lr == rows[0]["params"]["optim.lr"] and best.tune.space == {}
    trained = run(best, quiet=True)
    assert trained["steps"] == 8 and math.isfinite(trained["val_bpt"])


@pytest.mark.slow
def test_interrupted_sweep_resumes_when_rerun(ray_local, tmp_path, monkeypatch):
    # the fault fires only in a run that did not start from a checkpoint: the rerun succeeds only if it resumed
    monkeypatch.setenv("RAYTRAIN_SCU_FAULT_AT_STEP", "5")
    cfg = base(tmp_path, "train.max_steps=8", "train.checkpoint_every=4", "run.max_failures=0",
               "tune.space={optim.lr: {grid: [0.003]}}", "tune.search=grid")
    first = sweep.run_sweep(cfg)
    assert first["rows"][0]["status"] == "ERROR" and first["errors"]
    second = sweep.run_sweep(base(tmp_path, "train.max_steps=8", "train.checkpoint_every=4", "run.max_failures=0",
                                  "tune.space={optim.lr: {grid: [0.003]}}", "tune.search=grid"))
    row = second["rows"][0]
    assert (row["trial"], row["status"], row["steps"]) == (first["rows"][0]["trial"], "DONE", 8)
    assert second["parent_run_id"] == first["parent_run_id"]
    _, children = sweep_runs(cfg, second)
    assert len(children) == 1
    client = tracking.client_for(tracking.tracking_uri(cfg))
    assert [x.step for x in client.get_metric_history(children[0].info.run_id, "ctrl/lambda")] == list(range(0, 9))
