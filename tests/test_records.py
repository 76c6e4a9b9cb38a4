"""What a run records about itself, without Ray: which checkpoint is "best", the λ shown beside S, config changes."""
import math
import re
from pathlib import Path

import pytest
from conftest import tiny_cfg

from raytrain_scu.config.io import flatten
from raytrain_scu.core.checkpoint import BEST_METRIC, UNSCORED
from raytrain_scu.driver.run import best_checkpoint
from raytrain_scu.tracking.revisions import config_changes
from raytrain_scu.tracking.store import param_text


def test_best_checkpoint_is_the_lowest_own_evaluation_in_any_order():
    # Result.best_checkpoints as Ray 2.60 orders it (by score, worst first), with a NaN, a report without a score
    # (whose val/data_bpt is lower than any) and a preemption's checkpoint (UNSCORED: no evaluation of its own)
    ray_order = [("nan", {"step": 5, BEST_METRIC: math.nan}), ("no-val", {"step": 8, "val/data_bpt": 1.0}),
                 ("pre", {"step": 17, "val/data_bpt": 10.939, "val/step": 15, BEST_METRIC: UNSCORED}),
                 ("s15", {"step": 15, BEST_METRIC: 10.944}), ("s20", {"step": 20, BEST_METRIC: 10.939})]
    for order in (ray_order, ray_order[::-1], [ray_order[3], ray_order[0], ray_order[4], ray_order[2], ray_order[1]]):
        assert best_checkpoint(order)[0] == "s20"
    tie = [("s10", {"step": 10, BEST_METRIC: 3.0}), ("s30", {"step": 30, BEST_METRIC: 3.0})]
    assert best_checkpoint(tie)[0] == "s30"  # a tie goes to the later step
    # a preemption's checkpoint carries the last evaluation's val/data_bpt, but not as its score: passed over
    preempted = [("s10", {"step": 10, "val/data_bpt": 3.0, "val/step": 10, BEST_METRIC: 3.0}),
                 ("s14", {"step": 14, "val/data_bpt": 3.0, "val/step": 10, BEST_METRIC: UNSCORED})]
    assert best_checkpoint(preempted)[0] == "s10"
    assert best_checkpoint(ray_order[:3]) is None and best_checkpoint([]) is None and best_checkpoint(None) is None


def report(**over):
    return {"step": 7, "max_steps": 20, "train/data_bpt": 5.0, "val/data_bpt": 5.5, "ctrl/s": 0.25,
            "ctrl/s_hat": 0.3, "ctrl/lambda_applied": 0.125, "ctrl/lambda": 0.5, **over}


def test_progress_line_shows_the_lambda_the_loss_used_beside_s(capsys):
    from raytrain_scu.console import Progress

    Progress(tty=False).update(report())  # what the driver prints for each report
    line = capsys.readouterr().out
    lam = re.search(r"λ\S* (\S+)", line)
    assert lam and float(lam.group(1)) == 0.125, line  # ctrl/lambda_applied, not ctrl/lambda (next step's)
    assert "Ŝ 0.3" in line


def test_lambda_plot_pairs_each_step_with_the_lambda_its_loss_used(tmp_path, monkeypatch):
    import matplotlib.figure

    from raytrain_scu.plots import plot_history

    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def keep_lines(fig, fname, *args, **kwargs):  # what each PNG shows, then the real save
        drawn[Path(fname).name] = [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
                                   for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) > 2]
        return save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep_lines)
    # λ the loss used in step t, and λ after step t's update (= step t+1's): they differ by one step
    applied = [1.0, 2.0, 4.0, 8.0]
    history = [{"step": 0, "val/data_bpt": 6.0, "ctrl/lambda": 1.0}]
    history += [{"step": t, "ctrl/s": 0.1 * t, "ctrl/s_hat": 0.1 * t, "train/data_bpt": 5.0, "train/param_bpt": 0.1,
                 "ctrl/lambda_applied": lam, "ctrl/lambda": 2 * lam} for t, lam in zip(range(1, 5), applied)]
    plot_history(history, tmp_path, target_s=0.2, title="t")
    assert (tmp_path / "lambda.png").stat().st_size > 0
    lines = {label: (xs, ys) for label, xs, ys in drawn["lambda.png"]}
    lam_label = next(label for label in lines if "λ" in label)
    assert "applied" in lam_label
    assert lines[lam_label] == ([1, 2, 3, 4], applied)
    assert lines["S"] == ([1, 2, 3, 4], [0.1 * t for t in range(1, 5)])  # in the same figure, on the same steps


def test_config_changes_compare_as_param_text(tmp_path):
    before = {k: param_text(v) for k, v in flatten(tiny_cfg(tmp_path, "x")).items()}  # as MLflow holds params
    before["derived.world_size"] = "2"
    after = flatten(tiny_cfg(tmp_path, "x", "train.max_steps=60", "optim.lr=0.001"))
    assert config_changes(before, after) == {"train.max_steps": ("20", "60"), "optim.lr": ("0.003", "0.001")}
    del before["optim.lr"]  # a key the old run never had is no change
    assert config_changes(before, after) == {"train.max_steps": ("20", "60")}
    assert config_changes(before, flatten(tiny_cfg(tmp_path, "x"))) == {}


@pytest.mark.slow
def test_each_config_change_is_the_next_revision_of_the_mlflow_run(tmp_path, capsys):
    """A real sqlite store, no Ray: revision 0 is the params a worker logged; each changed re-run adds one."""
    import yaml

    from raytrain_scu.driver.run import record_config_change
    from raytrain_scu.tracking.store import (
        CHANGES_TAG,
        REVISION_TAG,
        client_for,
        log_params_once,
        open_run,
        tracking_uri,
    )

    def cfg(*over):
        return tiny_cfg(tmp_path, "ext", "train.max_steps=30", *over)

    run_id = open_run(cfg())
    client = client_for(tracking_uri(cfg()))
    log_params_once(client, run_id, {**flatten(cfg()), "derived.world_size": 2})  # what rank 0 logs
    notes = []
    assert record_config_change(cfg(), run_id, None, notes) == {}  # same config: nothing recorded
    assert REVISION_TAG not in client.get_run(run_id).data.tags

    assert record_config_change(cfg("train.max_steps=60"), run_id, None, notes) == {"train.max_steps": ("30", "60")}
    assert "[raytrain_scu] run ext extended: train.max_steps 30 -> 60; config revision 1" in capsys.readouterr().out
    # the second change is measured from revision 1, not from the params (which keep 30)
    changed = record_config_change(cfg("train.max_steps=60", "optim.lr=0.001"), run_id, None, notes)
    assert changed == {"optim.lr": ("0.003", "0.001")}
    assert "run ext resumed with a changed config: optim.lr 0.003 -> 0.001; config revision 2" in capsys.readouterr().out
    assert record_config_change(cfg("train.max_steps=60", "optim.lr=0.001"), run_id, None, notes) == {}
    r = client.get_run(run_id)
    assert r.data.params["train.max_steps"] == "30" and r.data.params["optim.lr"] == "0.003"
    assert r.data.tags[REVISION_TAG] == "2" and r.data.tags[CHANGES_TAG] == "optim.lr 0.003 -> 0.001"
    revs = {n: Path(client.download_artifacts(run_id, f"config_revisions/rev_{n}.yaml", str(tmp_path))).read_text()
            for n in (1, 2)}
    assert "# train.max_steps: 30 -> 60" in revs[1] and yaml.safe_load(revs[1])["train"]["max_steps"] == 60
    assert yaml.safe_load(revs[2])["optim"]["lr"] == 0.001 and notes == []


def test_a_config_change_without_mlflow_is_printed_from_the_checkpoint_config(tmp_path, capsys):
    import json

    from raytrain_scu.config.io import to_yaml
    from raytrain_scu.driver.run import record_config_change

    ckpt = tmp_path / "checkpoint_00000030"  # the two files of a checkpoint this reads
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(to_yaml(tiny_cfg(tmp_path, "off", "tracking.enabled=false",
                                                       "train.max_steps=30"), redact=True))
    (ckpt / "meta.json").write_text(json.dumps({"step": 30}))
    cfg = tiny_cfg(tmp_path, "off", "tracking.enabled=false", "train.max_steps=60")
    assert record_config_change(cfg, None, ckpt, []) == {"train.max_steps": ("30", "60")}
    assert ("[raytrain_scu] run off extended: train.max_steps 30 -> 60 (from step 30); not recorded: "
            "tracking.enabled=false") in capsys.readouterr().out
