"""MLflow integration: a real sqlite store read back with MlflowClient."""
import json
from pathlib import Path

import pytest
import yaml
from conftest import free_port, mlflow_runs, tiny_cfg

from raytrain_scu.core.checkpoint import read_meta
from raytrain_scu.driver.run import run
from raytrain_scu.tracking import BEST_STEP_TAG, CHANGES_TAG, REVISION_TAG, RUN_KEY_TAG, run_key

pytestmark = pytest.mark.slow


def client_and_runs(tmp_path, cfg):
    """The MLflow runs that carry this training run's run-key tag."""
    return mlflow_runs(tmp_path, cfg.run.name, f"tags.`{RUN_KEY_TAG}` = '{run_key(cfg)}'")


def artifact_paths(client, run_id, path=""):
    out = []
    for f in client.list_artifacts(run_id, path):
        out += artifact_paths(client, run_id, f.path) if f.is_dir else [f.path]
    return out


@pytest.fixture(scope="module")
def restarted(ray_local, tmp_path_factory):
    """(storage, config, summary) of one 10-step run (1 worker, checkpoints at 5 and 10) whose worker died after step
    8 and that Ray restarted from step 5. The two tests below read it; each Ray Train run costs ~20 s here."""
    import os

    storage = tmp_path_factory.mktemp("tracked")
    cfg = tiny_cfg(storage, "tracked", "scaling.num_workers=1", "train.max_steps=10", "train.checkpoint_every=5",
                   "run.max_failures=1")
    os.environ["RAYTRAIN_SCU_FAULT_AT_STEP"] = "8"  # a worker dies after step 8; Ray restarts from step 5
    try:
        summary = run(cfg, quiet=True)
    finally:
        del os.environ["RAYTRAIN_SCU_FAULT_AT_STEP"]
    return storage, cfg, summary


def test_params_metrics_and_artifacts(restarted):
    # what a run records, here through a restart: nothing of it is lost or doubled by one
    tmp_path, cfg, summary = restarted
    client, runs = client_and_runs(tmp_path, cfg)
    assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"]
    r = client.get_run(summary["mlflow_run_id"])
    assert r.info.status == "FINISHED"
    # one experiment per config file (its stem), the run named run.name; the summary says where and how to look
    assert client.get_experiment(r.info.experiment_id).name == "tiny-cpu" and r.info.run_name == "tracked"
    assert summary["tracking_uri"].startswith(f"sqlite:///{tmp_path}/mlflow.db")
    assert summary["ui_command"].startswith(f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db")
    p = r.data.params
    assert p["controller.target_s"] == "0.01" and p["train.max_steps"] == "10"
    assert int(p["derived.tokens_per_epoch"]) > 0 and p["derived.world_size"] == "1"
    assert {"version.torch", "version.ray", "version.peft", "version.transformers", "derived.gpu_name"} <= set(p)
    lam = client.get_metric_history(r.info.run_id, "ctrl/lambda")
    steps = sorted(m.step for m in lam)
    assert steps == list(range(0, 11))  # step 0 (before training) and every optimizer step
    for name in ("train/data_bpt", "train/param_bpt", "ctrl/s", "ctrl/s_hat", "ctrl/error", "ctrl/integral",
                 "val/data_bpt", "perf/tokens_per_s"):
        assert client.get_metric_history(r.info.run_id, name), name
    arts = artifact_paths(client, r.info.run_id)
    for want in ("config.yaml", "scu_history.json", "plots/s_tracking.png", "plots/lambda.png", "plots/bpt.png",
                 "plots/val_bpt.png", "plots/tokens_per_s.png", "adapter/adapter_model.safetensors",
                 "best_checkpoint/controller.json"):
        assert want in arts, (want, arts)
    # best_checkpoint is the checkpoint (steps 5 and 10, both kept) with the lowest val/data_bpt; Ray lists its
    # top-k worst first. Step 0's val is the untrained baseline, not a checkpoint.
    val = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "val/data_bpt") if m.step > 0}
    assert sorted(val) == [5, 10] and val[5] != val[10], val
    best_step = min(val, key=val.get)
    meta = client.download_artifacts(r.info.run_id, "best_checkpoint/meta.json", str(tmp_path))
    assert json.loads(Path(meta).read_text())["step"] == best_step, val
    assert r.data.tags[BEST_STEP_TAG] == str(best_step) and summary["best_step"] == best_step
    assert summary["best_val_bpt"] == pytest.approx(val[best_step])


def test_restart_continues_the_same_run_without_duplicate_steps(restarted):
    tmp_path, cfg, summary = restarted
    assert read_meta(tmp_path / "tracked" / "checkpoint_00000010")["resumed_at"] == [5]  # it did restart
    run(cfg, quiet=True)  # re-running the finished run's name: same MLflow run, nothing logged twice
    client, runs = client_and_runs(tmp_path, cfg)
    assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"]
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "ctrl/lambda")]
    assert sorted(steps) == list(range(0, 11))
    assert REVISION_TAG not in runs[0].data.tags  # the same config: no config revision


def test_extending_a_run_records_the_config_change(ray_local, tmp_path, capsys):
    common = ["scaling.num_workers=1", "train.checkpoint_every=3", "train.report_every=3"]
    first = run(tiny_cfg(tmp_path, "extended", *common, "train.max_steps=3"), quiet=True)
    assert first["config_changes"] is None
    capsys.readouterr()
    longer = run(tiny_cfg(tmp_path, "extended", *common, "train.max_steps=6"), quiet=True)
    out = capsys.readouterr().out
    assert "[raytrain_scu] run extended extended: train.max_steps 3 -> 6 (from step 3); config revision 1" in out
    assert longer["steps"] == 6 and longer["mlflow_run_id"] == first["mlflow_run_id"]
    client, runs = client_and_runs(tmp_path, tiny_cfg(tmp_path, "extended"))
    r = client.get_run(first["mlflow_run_id"])
    assert len(runs) == 1 and r.data.params["train.max_steps"] == "3"  # MLflow never changes a param ...
    assert r.data.tags[REVISION_TAG] == "1" and r.data.tags[CHANGES_TAG] == "train.max_steps 3 -> 6"  # ... so this
    rev = Path(client.download_artifacts(r.info.run_id, "config_revisions/rev_1.yaml", str(tmp_path))).read_text()
    assert "resuming at step 3" in rev and yaml.safe_load(rev)["train"]["max_steps"] == 6
    assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "ctrl/lambda")) == list(range(0, 7))


def test_unreachable_tracking_server_does_not_stop_training(ray_local, tmp_path):
    cfg = tiny_cfg(tmp_path, "offline", "scaling.num_workers=1", "train.max_steps=6", "train.report_every=3",
                   "train.checkpoint_every=3", f"tracking.uri=http://127.0.0.1:{free_port()}")  # nothing listens
    summary = run(cfg, quiet=True)
    assert summary["steps"] == 6 and summary["adapter"]
    assert any("MLflow unreachable" in n for n in summary["notes"])
