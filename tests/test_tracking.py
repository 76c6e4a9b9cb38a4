"""MLflow integration: a real sqlite store read back with MlflowClient."""
import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from conftest import free_port, mlflow_runs, tiny_cfg

from raytrain_scu.core.checkpoint import read_meta
from raytrain_scu.driver.run import run
from raytrain_scu.tracking.store import (
    BEST_STEP_TAG,
    CHANGES_TAG,
    CHECKOUT,
    REVISION_TAG,
    RUN_KEY_TAG,
    run_key,
    ui_command,
)

pytestmark = pytest.mark.slow


def client_and_runs(tmp_path, cfg):
    """The MLflow runs that carry this training run's run-key tag."""
    return mlflow_runs(tmp_path, cfg.run.name, f"tags.`{RUN_KEY_TAG}` = '{run_key(cfg)}'")


def artifact_paths(client, run_id, path=""):
    out = []
    for f in client.list_artifacts(run_id, path):
        out += artifact_paths(client, run_id, f.path) if f.is_dir else [f.path]
    return out


RESTARTED = ["scaling.num_workers=1", "train.checkpoint_every=5", "run.max_failures=1"]


@pytest.fixture(scope="module")
def restarted(ray_local, tmp_path_factory):
    """(storage, config, summary) of one 10-step run (1 worker, checkpoints at 5 and 10) whose worker died after step
    8 and that Ray restarted from step 5. The tests below read it; those that run it again take it as ``rerun``, which
    puts it back afterwards. Each Ray Train run costs 20-60 s here: one run serves them all."""
    import os

    storage = tmp_path_factory.mktemp("tracked")
    cfg = tiny_cfg(storage, "tracked", *RESTARTED, "train.max_steps=10")
    os.environ["RAYTRAIN_SCU_FAULT_AT_STEP"] = "8"  # a worker dies after step 8; Ray restarts from step 5
    try:
        summary = run(cfg, quiet=True)
    finally:
        del os.environ["RAYTRAIN_SCU_FAULT_AT_STEP"]
    return storage, cfg, summary


def copy_storage(src: Path, dst: Path) -> None:
    """Make ``dst`` the run storage ``src`` as it is now: its run directories and MLflow artifacts copied over
    whatever ``dst`` holds, its MLflow sqlite store through sqlite's backup API (the store is written in place, so
    connections this process's MLflow keeps open to ``dst``'s store read the copy, not a deleted file)."""
    import contextlib
    import shutil
    import sqlite3

    db = "mlflow.db"
    for p in dst.iterdir():
        if p.name != db:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for p in src.iterdir():
        if not p.name.startswith(db):  # the store and any journal of it
            shutil.copytree(p, dst / p.name, symlinks=True) if p.is_dir() else shutil.copy2(p, dst / p.name)
    with contextlib.closing(sqlite3.connect(src / db)) as a, contextlib.closing(sqlite3.connect(dst / db)) as b:
        a.backup(b)


@pytest.fixture(scope="module")
def pristine(restarted, tmp_path_factory):
    """A copy of ``restarted``'s storage as the run left it."""
    copy = tmp_path_factory.mktemp("tracked-pristine")
    copy_storage(restarted[0], copy)
    return copy


@pytest.fixture
def rerun(restarted, pristine):
    """``restarted``, for a test that runs it again (a re-run, an extension): its storage is put back as the run left
    it afterwards, so that what each test sees does not depend on the order the tests run in."""
    yield restarted
    copy_storage(pristine, restarted[0])


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
    # run() called without the CLI's config file: this venv's mlflow by its full path
    mlflow_ui = f"{Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db"
    assert summary["ui_command"].startswith(mlflow_ui)
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
    # MLflow's adapter is what output/adapter holds, the run's primary one (run.primary_adapter=best): the best
    # checkpoint's; the last step's is adapter_last
    assert "adapter_last/adapter_model.safetensors" in arts
    got = {name: Path(client.download_artifacts(r.info.run_id, f"{name}/adapter_model.safetensors",
                                                str(tmp_path / "artifacts" / name))).read_bytes()
           for name in ("adapter", "best_checkpoint/adapter")}
    assert got["adapter"] == got["best_checkpoint/adapter"]
    assert got["adapter"] == (Path(summary["adapter"]) / "adapter_model.safetensors").read_bytes()  # output/adapter


def test_restart_continues_the_same_run_without_duplicate_steps(rerun):
    tmp_path, cfg, summary = rerun
    assert read_meta(tmp_path / "tracked" / "checkpoint_00000010")["resumed_at"] == [5]  # it did restart
    run(cfg, quiet=True)  # re-running the finished run's name: same MLflow run, nothing logged twice
    client, runs = client_and_runs(tmp_path, cfg)
    assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"]
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "ctrl/lambda")]
    assert sorted(steps) == list(range(0, 11))
    assert REVISION_TAG not in runs[0].data.tags  # the same config: no config revision


def test_extending_a_run_records_the_config_change(rerun, capsys):
    # the finished run above, extended from 10 to 12 steps
    tmp_path, cfg, first = rerun
    capsys.readouterr()
    longer = run(tiny_cfg(tmp_path, "tracked", *RESTARTED, "train.max_steps=12"), quiet=True)
    out = capsys.readouterr().out
    assert "[raytrain_scu] run tracked extended: train.max_steps 10 -> 12 (from step 10); config revision 1" in out
    assert longer["steps"] == 12 and longer["mlflow_run_id"] == first["mlflow_run_id"]
    client, runs = client_and_runs(tmp_path, cfg)
    r = client.get_run(first["mlflow_run_id"])
    assert len(runs) == 1 and r.data.params["train.max_steps"] == "10"  # MLflow never changes a param ...
    assert r.data.tags[REVISION_TAG] == "1" and r.data.tags[CHANGES_TAG] == "train.max_steps 10 -> 12"  # ... so this
    rev = Path(client.download_artifacts(r.info.run_id, "config_revisions/rev_1.yaml", str(tmp_path))).read_text()
    assert "resuming at step 10" in rev and yaml.safe_load(rev)["train"]["max_steps"] == 12
    assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "ctrl/lambda")) == list(range(0, 13))


def test_unreachable_tracking_server_does_not_stop_training(tmp_path):
    """Nothing listens at tracking.uri. The driver notes it and goes on without an MLflow run (every later MLflow call
    of the driver needs one, so the rest of its path is a run with no run id); rank 0's loop (in this process, the
    loop with LocalHooks) trains to the end, checkpoints, and keeps its points on disk for a later run of the name."""
    import torch

    from raytrain_scu.config.paths import RunPaths
    from raytrain_scu.driver.run import open_tracking
    from raytrain_scu.tracking.spool import MetricSpool
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    cfg = tiny_cfg(tmp_path, "offline", "scaling.num_workers=1", "train.max_steps=6", "train.report_every=3",
                   "train.checkpoint_every=3", f"tracking.uri=http://127.0.0.1:{free_port()}")  # nothing listens
    notes = []
    assert open_tracking(cfg, notes) is None and any("MLflow unreachable" in n for n in notes)
    hooks = LocalHooks(device=torch.device("cpu"), run_dir=tmp_path / "offline")
    with pytest.warns(UserWarning, match="MLflow connect failed"):
        run_loop(cfg, hooks=hooks)
    assert [r["step"] for r in hooks.reports] == [3, 6]
    assert (tmp_path / "offline" / "checkpoint_00000006" / "adapter" / "adapter_model.safetensors").is_file()
    spool = MetricSpool(RunPaths.of(cfg).metric_buffer, cfg.tracking.buffer_max_points)
    assert spool.waiting > 0 and spool.through == 6  # every step's points wait, on disk


# ---------------------------------------------------------------- the tracking server goes away and comes back

class MlflowServer:
    """A real ``mlflow server`` on a sqlite store and a fixed port, in a session of its own, started and stopped by
    the test (the same port each time), without MLflow's job execution (conftest)."""

    def __init__(self, root: Path, port: int):
        self.root, self.port, self.proc = root, port, None

    def start(self) -> None:
        import shutil
        import subprocess
        import sys

        mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent))
        self.proc = subprocess.Popen(
            [mlflow, "server", "--backend-store-uri", f"sqlite:///{self.root}/server.db", "--artifacts-destination",
             str(self.root / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            cwd=self.root, stdout=open(self.root / "server.log", "a"), stderr=subprocess.STDOUT,
            start_new_session=True)
        wait(lambda: self.healthy() or self.proc.poll() is not None, 120, "the MLflow server")
        assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]

    def healthy(self) -> bool:
        import urllib.request

        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200
        except OSError:
            return False

    def stop(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and its uvicorn worker: this test started them
            try:
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        wait(lambda: not self.healthy(), 30, "the MLflow server to stop")


def wait(predicate, timeout_s: float, what: str):
    import time

    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


def test_an_mlflow_outage_loses_no_metric_and_doubles_none(tmp_path, monkeypatch):
    """A real tracking server, stopped after step 10 and started again after step 20 of a 30-step run (the loop in
    this process, as rank 0: the tracker is what is tested, Ray adds nothing to it). Every step's ctrl/lambda and
    train/data_bpt is in the store exactly once, the outage's points with the time they were logged, not the time
    they were sent."""
    import threading
    import time

    import torch

    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    server = MlflowServer(tmp_path, free_port())
    hold = tmp_path / "hold"
    monkeypatch.setenv("RAYTRAIN_SCU_PAUSE_AT_STEP", "10")  # after step 10 and its report, until hold/go
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_DIR", str(hold))
    times, problems = {}, []

    def outage():  # stop at step 10; start again once step 20 is reported (its flush found the server down)
        try:
            wait(lambda: (hold / "rank0.paused").exists(), 300, "the pause after step 10")
            server.stop()
            times["down"] = time.time()
            (hold / "go").touch()
            wait(lambda: any(r["step"] >= 20 for r in hooks.reports), 300, "the report of step 20")
            server.start()
            times["up"] = time.time()
        except Exception as e:  # noqa: BLE001
            problems.append(repr(e))
    try:
        server.start()
        hooks = LocalHooks(device=torch.device("cpu"), run_dir=tmp_path / "out")
        threading.Thread(target=outage, daemon=True).start()
        cfg = tiny_cfg(tmp_path, "outage", "scaling.num_workers=1", "train.max_steps=30", "train.report_every=5",
                       "train.checkpoint_every=10", f"tracking.uri=http://127.0.0.1:{server.port}")
        original = hooks.report

        def report(metrics, checkpoint_dir, name):  # step 25's flush must find the server up again
            original(metrics, checkpoint_dir, name)
            if metrics["step"] == 20:
                wait(lambda: "up" in times or problems, 300, "the server to come back")
        hooks.report = report
        said = "MLflow log metrics failed .* metric points in .*mlflow_buffer.* wait and are sent"
        with pytest.warns(UserWarning, match=said):
            run_loop(cfg, hooks=hooks)
        assert not problems, problems
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"http://127.0.0.1:{server.port}")
        run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
        assert run.info.status == "FINISHED"
        for key, first in (("ctrl/lambda", 0), ("train/data_bpt", 1)):
            points = client.get_metric_history(run.info.run_id, key)
            assert sorted(m.step for m in points) == list(range(first, 31)), key  # each step once
            late = [m for m in points if 10 < m.step <= 20]  # logged while the server was down
            assert all(times["down"] * 1000 - 1000 <= m.timestamp <= times["up"] * 1000 for m in late), key
        assert (tmp_path / "outage" / "mlflow_buffer.jsonl").read_bytes() == b""  # everything was delivered
    finally:
        server.stop()


def test_a_restarted_rank0_sends_what_was_left_once_and_skips_what_it_redoes(tmp_path, monkeypatch):
    """The disk buffer across a crash of rank 0 (no Ray: the tracker alone, a sqlite store). The first tracker's
    last batch reached the store but the crash came before it was marked sent; the restarted tracker, resuming from
    the checkpoint of step 4 with steps 5..6 buffered, sends that batch again (the store keeps it once), skips steps
    5..6 as it redoes them, and logs 7..8. Bounded: past tracking.buffer_max_points the oldest are dropped, and
    said."""
    import warnings

    from raytrain_scu.tracking.spool import MetricSpool
    from raytrain_scu.tracking.tracker import MlflowTracker

    def crash(self, offset, n):
        raise SystemExit("rank 0 died here")

    cfg = tiny_cfg(tmp_path, "crash")
    first = MlflowTracker(cfg)
    first.start({"seed": 0})
    for step in range(0, 7):
        first.log_step({"step": step, "ctrl/lambda": 1.0 + step, "train/data_bpt": 5.0 - step})
        if step == 4:  # a report
            first.flush()
    monkeypatch.setattr(MetricSpool, "mark_sent", crash)  # the store takes the batch, then rank 0 dies
    with pytest.raises(SystemExit):
        first.flush()
    monkeypatch.undo()
    second = MlflowTracker(cfg, run_id=first.run_id)
    assert second.logged_through == 6 and second.spool.waiting == 4  # steps 5, 6: two metrics each
    second.start({"seed": 0})
    for step in range(5, 9):  # resumed from the checkpoint of step 4
        second.log_step({"step": step, "ctrl/lambda": 100.0 + step, "train/data_bpt": 0.5})
    second.flush()
    for key in ("ctrl/lambda", "train/data_bpt"):
        points = second.client.get_metric_history(first.run_id, key)
        assert sorted(m.step for m in points) == list(range(0, 9)), key
    assert {m.step: m.value for m in second.client.get_metric_history(first.run_id, "ctrl/lambda")}[6] == 7.0

    small = MlflowTracker(tiny_cfg(tmp_path, "small", "tracking.buffer_max_points=10",
                                   "tracking.uri=http://127.0.0.1:9"))  # nothing listens: everything waits
    for step in range(8):
        small.log_step({"step": step, "ctrl/lambda": 1.0, "train/data_bpt": 1.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        small.flush()
        small.finish([])
    assert small.spool.waiting == 10 and small.spool.dropped == 6
    said = " ".join(str(w.message) for w in caught)
    assert "10 metric points (kept in" in said and "6 metric points dropped from a full buffer" in said


def test_points_with_no_room_on_disk_are_counted_as_dropped_and_never_said_kept(tmp_path):
    """The buffer's directory cannot be written (here: a file stands where the run directory goes, a real OSError):
    the points wait in memory, bounded by tracking.buffer_max_points; the ones dropped for the bound are counted, and
    at the end the ones still in memory are said lost, not kept on disk."""
    import warnings

    from raytrain_scu.tracking.tracker import MlflowTracker

    cfg = tiny_cfg(tmp_path, "nodisk", "tracking.buffer_max_points=10", "tracking.uri=http://127.0.0.1:9")
    (tmp_path / "nodisk").write_text("a file, not a directory")
    tracker = MlflowTracker(cfg)
    for step in range(8):  # 16 points
        tracker.log_step({"step": step, "ctrl/lambda": 1.0, "train/data_bpt": 1.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.flush()
        tracker.finish([])
    said = " ".join(str(w.message) for w in caught)
    assert tracker.spool.waiting == 0 and len(tracker.pending) == 10 and tracker.lost == 6
    assert "and 10 in memory (no room on disk)" in said, said
    assert "kept in" not in said and "10 metric points lost (no room on disk" in said, said
    assert "6 metric points dropped from a full buffer" in said, said


def test_points_held_in_memory_for_want_of_disk_reach_a_store_that_is_up(tmp_path):
    """No room for the buffer on disk, and the store (a real sqlite MLflow store) answers: the points held in memory
    are sent, none is lost."""
    import warnings

    from mlflow.tracking import MlflowClient

    from raytrain_scu.tracking.tracker import MlflowTracker

    uri = f"sqlite:///{tmp_path}/store.db"
    cfg = tiny_cfg(tmp_path, "nodisk", "tracking.buffer_max_points=100", f"tracking.uri={uri}")
    (tmp_path / "nodisk").write_text("a file, not a directory")
    tracker = MlflowTracker(cfg)
    for step in range(8):
        tracker.log_step({"step": step, "ctrl/lambda": float(step)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker.flush()
    assert tracker.pending == [] and tracker.lost == 0
    history = MlflowClient(uri).get_metric_history(tracker.run_id, "ctrl/lambda")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(8)]


def test_a_torn_last_line_of_the_spool_is_cut_off_and_later_points_stay_readable(tmp_path):
    """A line written half (a crash or a full disk mid-append) is cut off when the spool is opened: the points before
    it wait, the next append starts its own line, and the file reads whole on every later open."""
    from types import SimpleNamespace

    from raytrain_scu.tracking.spool import MetricSpool

    def point(step):
        return SimpleNamespace(key="ctrl/lambda", value=float(step), timestamp=1000 + step, step=step)

    path = tmp_path / "mlflow_buffer.jsonl"
    MetricSpool(path, 100).append([point(1)])
    with open(path, "a") as f:
        f.write('{"k": "ctrl/lambda", "v": 2.0, "t"')  # torn
    spool = MetricSpool(path, 100)
    assert spool.waiting == 1
    spool.append([point(3)])
    again = MetricSpool(path, 100)
    assert again.waiting == 2 and [p["s"] for _, p in again._lines()] == [1, 3]


def test_the_ui_command_runs_from_a_plain_shell(tmp_path, monkeypatch):
    """In the checkout, from make's venv, with the config file known (the train CLI's): make ui with the config and
    the overrides that move the store, and no others; from another venv or elsewhere this venv's mlflow by its full
    path; none for a tracking server."""
    cfg = tiny_cfg(tmp_path, "ui")
    monkeypatch.chdir(CHECKOUT)
    tiny = "experiments/tiny-cpu.yaml"
    assert ui_command(cfg, tiny, [f"run.storage_path={tmp_path}", "train.max_steps=3"]) == \
        f"make ui CONFIG={tiny} ARGS=run.storage_path={tmp_path}"
    assert ui_command(cfg, tiny, ["train.max_steps=3"]) == f"make ui CONFIG={tiny}"
    both = [f"run.storage_path={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    assert shlex.split(ui_command(cfg, tiny, both)) == ["make", "ui", f"CONFIG={tiny}", "ARGS=" + " ".join(both)]
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "own-venv"))  # a venv of the user's own: make would build another
    assert ui_command(cfg, tiny).startswith(shlex.quote(str(Path(sys.executable).parent / "mlflow")))
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)  # outside the checkout there is no Makefile to run
    assert ui_command(cfg, tiny) == shlex.join([str(Path(sys.executable).parent / "mlflow"), "ui",
                                                "--backend-store-uri", f"sqlite:///{tmp_path}/mlflow.db"])
    assert ui_command(tiny_cfg(tmp_path, "ui", "tracking.uri=http://127.0.0.1:5000"), tiny) is None


def test_a_new_sqlite_store_is_a_copy_of_the_template_that_mlflow_opens_as_its_own(tmp_path, monkeypatch):
    """A new store starts as a copy of the empty one MLflow made in the cache: the same schema and rows as a store
    MLflow builds itself at that path (its Default experiment, with its artifact location from the working directory,
    made when MLflow opens the copy), and it records a run."""
    import sqlite3

    from raytrain_scu.tracking.store import client_for

    monkeypatch.setenv("RAYTRAIN_SCU_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)

    def contents(db: Path) -> tuple:
        con = sqlite3.connect(db)
        # a table's statement with its lines sorted: MLflow's own migrations order a table's constraints differently
        # from one process to the next (they come from a set)
        schema = sorted((kind, name, sorted((sql or "").splitlines()))
                        for kind, name, sql in con.execute("SELECT type, name, sql FROM sqlite_master"))
        rows = {t: sorted(con.execute(f'SELECT * FROM "{t}"')) for (t,) in
                con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        con.close()
        rows["experiments"] = [r[:4] for r in rows["experiments"]]  # id, name, artifact location, stage: no times
        return schema, rows

    first, second = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    client_for(f"sqlite:///{first}").search_experiments()  # makes the template, then copies it
    templates = list((tmp_path / "cache" / "mlflow").glob("empty-*.db"))
    assert len(templates) == 1
    client = client_for(f"sqlite:///{second}")
    assert [(e.experiment_id, e.name, e.artifact_location) for e in client.search_experiments()] == \
        [("0", "Default", str(tmp_path / "mlruns" / "0"))]
    # what MLflow builds itself, by its own migrations, at a third path
    from mlflow.tracking import MlflowClient

    own = tmp_path / "c" / "mlflow.db"
    own.parent.mkdir()
    MlflowClient(tracking_uri=f"sqlite:///{own}").search_experiments()
    assert contents(second) == contents(own) == contents(first)
    run_id = client.create_run("0").info.run_id
    client.log_metric(run_id, "x", 1.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "x")] == [(3, 1.5)]
    # a URI with a query seeds the file it names, not one named with the query
    client_for(f"sqlite:///{tmp_path / 'd' / 'mlflow.db'}?timeout=30").search_experiments()
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["mlflow.db"]
