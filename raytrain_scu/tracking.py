"""MLflow tracking: a real client on rank 0, a no-op elsewhere, so the loop never branches on rank to log.

- Default store ``sqlite:///<storage_path>/mlflow.db`` with artifacts in ``<storage_path>/mlartifacts`` (MLflow >= 3.13
  refuses the ``file:`` store); ``tracking.uri`` may be an ``http(s)://`` tracking server for clusters.
- One MLflow run per training run, found again by its tag ``raytrain_scu.run_key`` (storage path + run name) and
  kept in ``<storage_path>/<name>/mlflow_run.json``: a worker restart or re-running the same run name continues the
  SAME run; steps already logged are not logged again.
- Metrics are buffered and sent with ``log_batch`` at each report, never one call per scalar.
- Tracking never kills training: a failed call warns, keeps the buffer and retries at the next flush; the run ends
  with what could be recorded and says what was not.
- Params are logged once and MLflow never changes one: a re-run of the run name whose config changed (say
  ``train.max_steps`` raised to extend it) is recorded as a config revision instead, the tag
  ``raytrain_scu.config_revision`` = N, the artifact ``config_revisions/rev_N.yaml`` and the tag
  ``raytrain_scu.config_changes`` (``key: old -> new``); revision 0 is the params.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

from raytrain_scu.config import (Config, flatten, flatten_tree, global_batch_tokens, redact_uri, run_dir, storage_dir,
                                 to_yaml)

RUN_KEY_TAG = "raytrain_scu.run_key"
PARENT_TAG = "mlflow.parentRunId"
REVISION_TAG = "raytrain_scu.config_revision"  # N: the config changed N times after the params were logged
CHANGES_TAG = "raytrain_scu.config_changes"  # the last revision's changes, "key: old -> new; ..."
BEST_STEP_TAG = "raytrain_scu.best_checkpoint_step"  # the step of the best_checkpoint artifact
BEST_VAL_TAG = "raytrain_scu.best_checkpoint_val_bpt"  # and its val/data_bpt
MAX_BUFFER = 2_000_000


def default_uri(storage_path: str) -> str:
    return f"sqlite:///{storage_dir(storage_path)}/mlflow.db"


def tracking_uri(cfg: Config) -> str:
    return cfg.tracking.uri or default_uri(cfg.run.storage_path)


def ui_command(cfg: Config) -> Optional[str]:
    """The command that opens the MLflow UI on the store this config's runs use, as the run's summary prints it (``make
    ui`` runs the same); it needs the ``ui`` extra (the full mlflow package: its server and flask). None for an http(s)
    tracking server, which serves the UI at its own address."""
    uri = redact_uri(tracking_uri(cfg))
    if uri.startswith(("http://", "https://")):
        return None
    return shlex.join(["mlflow", "ui", "--backend-store-uri", uri])


def run_key(cfg: Config) -> str:
    return run_dir(cfg)


def _quiet_http() -> None:
    # a dead server must cost seconds, not MLflow's default minutes of retries, per attempt
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    # a new sqlite store's schema set-up is MLflow's business, not a line on the user's console
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


def client_for(uri: str):
    _quiet_http()
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str, uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if uri.startswith("sqlite:///"):  # an explicit artifact location beside the database
        location = Path(Path(uri[len("sqlite:///"):]).parent, "mlartifacts").resolve().as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # noqa: BLE001 - another process created it first
        return client.get_experiment_by_name(name).experiment_id


def _find_or_create_run(cfg: Config, parent_run_id: Optional[str] = None) -> str:
    """The MLflow run id for this training run: found by its run-key tag, else created."""
    uri = tracking_uri(cfg)
    client = client_for(uri)
    exp_id = experiment_id(client, cfg.tracking.experiment or cfg.run.name, uri)
    key = run_key(cfg)
    found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=1)
    if found:
        return found[0].info.run_id
    tags = {RUN_KEY_TAG: key, "mlflow.runName": cfg.run.name}
    if parent_run_id:
        tags[PARENT_TAG] = parent_run_id
    return client.create_run(exp_id, tags=tags, run_name=cfg.run.name).info.run_id


# ---------------------------------------------------------------- the run's lifecycle: one owner opens and ends it

def open_run(cfg: Config, parent_run_id: Optional[str] = None) -> str:
    """Open this training run's MLflow run: found again by its run key (a restart, a re-run of the run name, a resumed
    sweep) or created, a child of ``parent_run_id`` when given; its status RUNNING. Whoever opens a run ends it with
    :func:`end_run` (the driver, the sweep; rank 0's tracker only when nobody else could open it); the workers only
    log into it. Raises on an unreachable store."""
    run_id = _find_or_create_run(cfg, parent_run_id)
    client_for(tracking_uri(cfg)).set_terminated(run_id, status="RUNNING")
    return run_id


def end_run(cfg: Config, run_id: str, status: str) -> None:
    """End the run :func:`open_run` opened: FINISHED, FAILED or KILLED. Warns instead of raising (tracking never
    kills training)."""
    try:
        client_for(tracking_uri(cfg)).set_terminated(run_id, status=status)
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"MLflow run {run_id} not marked {status}: {type(e).__name__}: {redact_uri(str(e))[:200]}")


def remember_run_id(cfg: Config, run_id: str) -> None:
    """Keep the run id with the Ray run directory (local storage) so people and tools can find it."""
    d = storage_dir(cfg.run.storage_path)
    if "://" in d:
        return
    p = Path(d) / cfg.run.name
    p.mkdir(parents=True, exist_ok=True)
    (p / "mlflow_run.json").write_text(json.dumps({"run_id": run_id, "tracking_uri": redact_uri(tracking_uri(cfg))}))


def derived_params(cfg: Config, *, tokens_per_epoch: int, world: int, device) -> dict:
    """Flattened resolved config plus the values derived at run time."""
    from importlib.metadata import version

    import peft
    import torch
    import transformers

    gpu_name, gpu_count = "none", 0
    if device.type == "cuda":
        gpu_name, gpu_count = torch.cuda.get_device_name(device), world
    out = flatten(cfg, redact=True)
    out.update({"derived.tokens_per_epoch": tokens_per_epoch, "derived.world_size": world,
                "derived.global_batch_tokens": global_batch_tokens(cfg, world),
                "derived.gpu_name": gpu_name, "derived.gpu_count": gpu_count,
                "version.torch": torch.__version__, "version.transformers": transformers.__version__,
                "version.peft": peft.__version__, "version.ray": version("ray")})
    return out


def param_text(value) -> str:
    """A value as MLflow keeps it in a param (text, at most 6000 characters)."""
    return str(value)[:6000]


def log_params_once(client, run_id: str, params: dict) -> None:
    """Log the params ``run_id`` does not have yet: MLflow refuses to change a param, and a resumed sweep re-logs."""
    from mlflow.entities import Param

    existing = client.get_run(run_id).data.params
    new = [Param(k, param_text(v)) for k, v in params.items() if k not in existing]
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i:i + 100])


class NullTracker:
    """What ranks other than 0 (and runs with tracking off) get."""

    run_id = None

    def start(self, params: dict, resumed_at: int = 0) -> None:
        pass

    def log_step(self, row: dict, step: Optional[int] = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, history: list, model=None, status: str = "FINISHED") -> None:
        pass


class MlflowTracker(NullTracker):
    """Rank 0's MLflow client with a retrying metric buffer. It logs into the run its driver opened (``run_id``); only
    with none (no driver, or MLflow was unreachable when the driver tried) does it open the run itself, and then it
    also ends it in :meth:`finish`."""

    def __init__(self, cfg: Config, run_id: Optional[str] = None, parent_run_id: Optional[str] = None):
        self.cfg, self.run_id, self.parent_run_id = cfg, run_id, parent_run_id
        self.owns_run = False  # True once this tracker opened the run: then it ends it too
        self.uri = tracking_uri(cfg)
        self.client = None
        self.buffer: list = []
        self.logged_through = -1  # steps <= this are already in MLflow (a resumed run)
        self.params: dict = {}
        self.params_logged = False
        self.failures = 0
        self.dropped = 0
        self.sysmon = None

    def _connect(self) -> bool:
        if self.client is not None and self.run_id is not None:
            return True
        try:
            self.client = client_for(self.uri)
            if self.run_id is None:
                self.run_id, self.owns_run = open_run(self.cfg, self.parent_run_id), True
            hist = self.client.get_metric_history(self.run_id, "ctrl/lambda")
            self.logged_through = max((m.step for m in hist), default=-1)
            return True
        except Exception as e:  # noqa: BLE001 - tracking must never kill training
            self._warn("connect", e)
            self.client = None if self.run_id is None else self.client
            return False

    def _warn(self, what: str, e: Exception) -> None:
        self.failures += 1
        if self.failures <= 3 or self.failures % 50 == 0:
            warnings.warn(f"MLflow {what} failed ({redact_uri(self.uri)}): {type(e).__name__}: "
                          f"{redact_uri(str(e))[:200]}; "
                          f"buffering {len(self.buffer)} metric points and retrying at the next report")

    def start(self, params: dict, resumed_at: int = 0) -> None:
        self.params = params
        if self._connect():
            self._log_params()
            self._start_system_metrics()

    def _log_params(self) -> None:
        if self.params_logged:
            return
        try:
            log_params_once(self.client, self.run_id, self.params)
            self.params_logged = True
        except Exception as e:  # noqa: BLE001
            self._warn("log params", e)

    def _start_system_metrics(self) -> None:
        on = self.cfg.tracking.system_metrics
        if on is None:
            import torch

            on = torch.cuda.is_available()
        if not on or self.sysmon is not None:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.sysmon = SystemMetricsMonitor(self.run_id, sampling_interval=10, resume_logging=True,
                                               tracking_uri=self.uri)
            self.sysmon.start()
        except Exception as e:  # noqa: BLE001
            self._warn("system metrics", e)

    def log_step(self, row: dict, step: Optional[int] = None) -> None:
        from mlflow.entities import Metric

        step = int(row["step"] if step is None else step)
        if step <= self.logged_through:
            return  # already recorded before a restart: no duplicate steps
        ts = int(time.time() * 1000)
        self.buffer.extend(Metric(k, float(v), ts, step) for k, v in row.items()
                           if k != "step" and isinstance(v, (int, float)))
        if len(self.buffer) > MAX_BUFFER:
            self.dropped += len(self.buffer) - MAX_BUFFER
            del self.buffer[:len(self.buffer) - MAX_BUFFER]

    def flush(self) -> None:
        if not self.buffer or not self._connect():
            return
        self._log_params()
        try:
            while self.buffer:
                self.client.log_batch(self.run_id, metrics=self.buffer[:1000])
                del self.buffer[:1000]
        except Exception as e:  # noqa: BLE001
            self._warn("log metrics", e)

    def finish(self, history: list, model=None, status: str = "FINISHED") -> None:
        """The last metrics and the artifacts; ``status`` ends the run only if this tracker opened it."""
        self.flush()
        if self.sysmon is not None:
            try:
                self.sysmon.finish()
            except Exception as e:  # noqa: BLE001
                self._warn("system metrics", e)
        unrecorded = []
        if self.client is None or self.run_id is None:
            unrecorded.append("everything (no connection to the tracking server)")
        else:
            try:
                self._log_artifacts(history, model)
                if self.owns_run:
                    self.client.set_terminated(self.run_id, status=status)
            except Exception as e:  # noqa: BLE001
                self._warn("log artifacts", e)
                unrecorded.append("artifacts (config, history, plots, adapter)")
        if self.buffer:
            unrecorded.append(f"{len(self.buffer)} metric points")
        if self.dropped:
            unrecorded.append(f"{self.dropped} metric points dropped from a full buffer")
        if unrecorded:
            warnings.warn(f"MLflow ({redact_uri(self.uri)}) did not record: " + "; ".join(unrecorded))

    def _log_artifacts(self, history: list, model) -> None:
        from raytrain_scu.plots import plot_history

        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            (t / "config.yaml").write_text(to_yaml(self.cfg, redact=True))
            (t / "scu_history.json").write_text(json.dumps(history))
            self.client.log_artifact(self.run_id, str(t / "config.yaml"))
            self.client.log_artifact(self.run_id, str(t / "scu_history.json"))
            plots = t / "plots"
            plot_history(history, plots, target_s=self.cfg.controller.target_s, title=self.cfg.run.name)
            self.client.log_artifacts(self.run_id, str(plots), artifact_path="plots")
            if model is not None:
                model.save_pretrained(str(t / "adapter"), safe_serialization=True)
                self.client.log_artifacts(self.run_id, str(t / "adapter"), artifact_path="adapter")


def for_rank(cfg: Config, rank: int, run_id: Optional[str] = None, parent_run_id: Optional[str] = None):
    """A real tracker on rank 0 when tracking is on, else a no-op."""
    if rank != 0 or not cfg.tracking.enabled:
        return NullTracker()
    return MlflowTracker(cfg, run_id=run_id, parent_run_id=parent_run_id)


def log_best_checkpoint(cfg: Config, run_id: str, ckpt_dir: str, *, step: int, val_bpt: float) -> Optional[str]:
    """Driver side, after fit(): the best checkpoint (lowest val/data_bpt) as an artifact, its step and val/data_bpt
    as tags. Returns a warning text on failure."""
    try:
        client = client_for(tracking_uri(cfg))
        client.log_artifacts(run_id, ckpt_dir, artifact_path="best_checkpoint")
        client.set_tag(run_id, BEST_STEP_TAG, str(step))
        client.set_tag(run_id, BEST_VAL_TAG, repr(float(val_bpt)))
        return None
    except Exception as e:  # noqa: BLE001
        return f"best checkpoint not logged to MLflow: {type(e).__name__}: {redact_uri(str(e))[:200]}"


# ---------------------------------------------------------------- config revisions: a run re-run with a changed config

def config_changes(before: dict, after: dict) -> dict[str, tuple[str, str]]:
    """``{key: (old, new)}`` of two flat configs (:func:`~raytrain_scu.config.flatten`), compared as param text. A key
    only one side has (one a newer package added) is no change."""
    return {k: (param_text(before[k]), param_text(v)) for k, v in after.items()
            if k in before and param_text(before[k]) != param_text(v)}


def format_changes(changes: dict[str, tuple[str, str]]) -> str:
    return "; ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items())


def recorded_config(cfg: Config, run_id: str) -> tuple[int, Optional[dict]]:
    """(revision, flat config) the MLflow run holds: revision 0 is its params, revision N the artifact
    ``config_revisions/rev_N.yaml``. (0, None) when no params are logged yet (no worker started)."""
    import yaml

    client = client_for(tracking_uri(cfg))
    run = client.get_run(run_id)
    rev = int(run.data.tags.get(REVISION_TAG, 0))
    if rev == 0:
        return 0, dict(run.data.params) or None
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run_id, f"config_revisions/rev_{rev}.yaml", tmp)
        return rev, flatten_tree(yaml.safe_load(Path(path).read_text()))


def record_config_revision(cfg: Config, run_id: str, rev: int, changes: dict[str, tuple[str, str]],
                           from_step: Optional[int]) -> None:
    """Driver side, before fit(): the run's config revision ``rev``, the whole config (redacted) with the changes in
    its header, then the tags (a revision tag always has its artifact)."""
    client = client_for(tracking_uri(cfg))
    head = (f"# config revision {rev} of run {cfg.run.name}"
            + (f", resuming at step {from_step}" if from_step is not None else "") + "\n"
            + "".join(f"# {k}: {old} -> {new}\n" for k, (old, new) in changes.items()))
    client.log_text(run_id, head + to_yaml(cfg, redact=True), f"config_revisions/rev_{rev}.yaml")
    client.set_tag(run_id, CHANGES_TAG, format_changes(changes)[:8000])
    client.set_tag(run_id, REVISION_TAG, str(rev))


# ---------------------------------------------------------------- sweeps: one parent run, one child run per trial

SWEEP_TAG = "raytrain_scu.sweep"  # the sweep's name, on the parent and on every child
TRIAL_TAG = "raytrain_scu.trial_id"  # the Tune trial id, on each child


def child_runs(cfg: Config, parent_run_id: str) -> list:
    """The runs whose ``mlflow.parentRunId`` tag is ``parent_run_id`` (a sweep's trials), in cfg's experiment."""
    uri = tracking_uri(cfg)
    client = client_for(uri)
    exp_id = experiment_id(client, cfg.tracking.experiment or cfg.run.name, uri)
    return client.search_runs([exp_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'", max_results=5000)


def main(argv: list[str] | None = None) -> int:
    """``python -m raytrain_scu.tracking uri CONFIG.yaml [key=value ...]``: the tracking URI that config's runs use
    (what `make ui` opens)."""
    import sys

    from raytrain_scu.hardware import resolve
    from raytrain_scu.train import USER_ERRORS

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "uri":
        print("usage: python -m raytrain_scu.tracking uri CONFIG.yaml [key=value ...]", file=sys.stderr)
        return 2
    try:
        print(tracking_uri(resolve(argv[1], argv[2:], announce=False)))
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
