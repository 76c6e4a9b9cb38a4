"""What a finished run leaves in its output directory, in this process with no Ray: ``adapter/`` is the primary
adapter (run.primary_adapter: the best checkpoint's by default, the last step's with ``last``), the other one beside
it when it is another step, and the summary and its printed block say which is which."""
import contextlib
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_cfg

from raytrain_scu.config.schema import Config
from raytrain_scu.console import format_summary
from raytrain_scu.core.checkpoint import BEST_METRIC
from raytrain_scu.driver import outputs
from raytrain_scu.driver.run import summarize


class Checkpoint:
    """A local checkpoint as summarize reads one (Ray's ``Checkpoint``: a path, and a local directory to read)."""

    def __init__(self, path: Path, step: int, val_bpt: dict[int, float]):
        self.path = str(path)
        (path / "adapter").mkdir(parents=True)
        (path / "adapter" / "adapter_config.json").write_text(json.dumps({"step": step}))
        history = [{"step": k, "ctrl/s": 0.02, "ctrl/s_hat": 0.02, "ctrl/lambda_applied": 0.0,
                    **({"val/data_bpt": val_bpt[k]} if k in val_bpt else {})} for k in range(step + 1)]
        torch.save({"history": history}, path / "state.pt")

    @contextlib.contextmanager
    def as_directory(self):
        yield self.path


def finished(tmp_path, *overrides, val_bpt=None, run_id=None):
    """summarize() of a 200-step run checkpointed at steps 20 and 200, whose held-out BPT was lowest at step 20 (or
    ``val_bpt``), logged into the MLflow run ``run_id``."""
    from types import SimpleNamespace

    val_bpt = val_bpt or {0: 6.0, 20: 4.7, 200: 4.9}
    cfg = tiny_cfg(tmp_path, "r", "tracking.enabled=false", "train.max_steps=200", *overrides)
    last = Checkpoint(tmp_path / "ck200", 200, val_bpt)
    best = Checkpoint(tmp_path / "ck20", 20, val_bpt)
    metrics = {"step": 200, "val/data_bpt": val_bpt[200], BEST_METRIC: val_bpt[200]}
    scored_20 = {"step": 20, "val/data_bpt": val_bpt[20], BEST_METRIC: val_bpt[20]}
    result = SimpleNamespace(metrics=metrics, checkpoint=last, best_checkpoints=[(last, metrics), (best, scored_20)])
    return summarize(cfg, result, run_id, {}, [], {"use_gpu": False, "vocab_size": 2048}), tmp_path / "r" / "output"


def step_of(adapter_dir: Path) -> int:
    return json.loads((adapter_dir / "adapter_config.json").read_text())["step"]


def test_by_default_the_primary_adapter_is_the_best_checkpoint_and_the_last_steps_is_beside_it(tmp_path):
    assert Config().run.primary_adapter == "best"
    summary, out = finished(tmp_path)
    assert step_of(out / "adapter") == 20 and step_of(out / "adapter_last") == 200
    assert not (out / "adapter_best").exists()
    assert (summary["primary_adapter"], summary["adapter_step"], summary["best_step"]) == ("best", 20, 20)
    assert summary["adapter"] == str(out / "adapter") and summary["last_adapter"] == str(out / "adapter_last")
    assert summary["best_adapter"] is None
    text = format_summary(summary).splitlines()
    assert f"  adapter          {out / 'adapter'}   (step 20, lowest held-out BPT)" in text
    assert f"  last adapter     {out / 'adapter_last'}   (step 200, the last)" in text
    assert summary["notes"] == []  # step 20, the lowest evaluation, has its checkpoint


def test_with_primary_adapter_last_the_last_steps_is_primary_and_the_best_is_beside_it(tmp_path):
    summary, out = finished(tmp_path, "run.primary_adapter=last")
    assert step_of(out / "adapter") == 200 and step_of(out / "adapter_best") == 20
    assert not (out / "adapter_last").exists()
    assert (summary["primary_adapter"], summary["adapter_step"], summary["last_adapter"]) == ("last", 200, None)
    text = format_summary(summary).splitlines()
    assert f"  adapter          {out / 'adapter'}   (step 200, the last)" in text
    assert f"  best adapter     {out / 'adapter_best'}   (step 20, lowest held-out BPT)" in text


def test_switching_primary_adapter_on_one_output_leaves_no_stale_directory(tmp_path):
    ck = {s: Checkpoint(tmp_path / f"ck{s}", s, {s: 5.0}) for s in (20, 200)}
    best = (Path(ck[20].path), {"step": 20})
    out = tmp_path / "out"
    out.mkdir()
    outputs.export_adapters(Path(ck[200].path), 200, best, out, "best")
    found = outputs.export_adapters(Path(ck[200].path), 200, best, out, "last")
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "adapter_best"] and step_of(out / "adapter") == 200
    # no best checkpoint (no finite held-out BPT): the last step's is the primary whatever was asked
    found = outputs.export_adapters(Path(ck[200].path), 200, None, out, "best")
    assert found["primary_adapter"] == "last" and sorted(p.name for p in out.iterdir()) == ["adapter"]


@pytest.mark.parametrize("driver_opened", [True, False])
def test_without_a_best_checkpoint_mlflows_adapter_is_the_last_steps_as_in_the_output(tmp_path, driver_opened):
    """No checkpoint has a finite held-out BPT, so adapter/ is the last step's under primary_adapter=best; MLflow's
    adapter is the same, in the run the driver opened or, when MLflow was unreachable at the driver's start, in the
    one rank 0 opened (found by its run key)."""
    from raytrain_scu.tracking.store import client_for, open_run, tracking_uri

    on = ["tracking.enabled=true"]
    cfg = tiny_cfg(tmp_path, "r", "train.max_steps=200", *on)
    run_id = open_run(cfg)  # the driver's, or rank 0's own
    nan = float("nan")
    summary, out = finished(tmp_path, *on, val_bpt={0: nan, 20: nan, 200: nan},
                            run_id=run_id if driver_opened else None)
    assert (summary["primary_adapter"], summary["adapter_step"], summary["mlflow_run_id"]) == ("last", 200, run_id)
    assert sorted(p.name for p in out.glob("adapter*")) == ["adapter"] and step_of(out / "adapter") == 200
    client = client_for(tracking_uri(cfg))
    logged = client.download_artifacts(run_id, "adapter", str(tmp_path / "from_mlflow"))
    assert step_of(Path(logged)) == 200
    assert [f.path for f in client.list_artifacts(run_id) if f.path.startswith("best")] == []


@pytest.mark.parametrize("val_bpt, says", [
    ({0: 6.0, 20: 4.7, 100: 4.5, 200: 4.9}, "the lowest held-out BPT (4.5) was at step 100, which has no checkpoint"),
    ({0: 4.0, 20: 4.7, 200: 4.9}, "the untrained adapter's held-out BPT (4, step 0) is lower than every checkpoint's"),
    ({0: 6.0, 20: 4.7, 100: 4.7, 200: 4.9}, None),  # a tie with the best checkpoint: nothing to say
])
def test_an_evaluation_better_than_every_checkpoint_is_said(val_bpt, says):
    history = [{"step": k, **({"val/data_bpt": val_bpt[k]} if k in val_bpt else {})} for k in range(201)]
    note = outputs.unexported_best(history, best_step=20)
    assert note == says if says is None else note.startswith(says)
