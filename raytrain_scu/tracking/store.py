"""MLflow tracking: a real client on rank 0, a no-op elsewhere, so the loop never branches on rank to log.

- Default store ``sqlite:///<storage_path>/mlflow.db`` with artifacts in ``<storage_path>/mlartifacts`` (MLflow >= 3.13
  refuses the ``file:`` store); ``tracking.uri`` may be an ``http(s)://`` tracking server for clusters.
- One MLflow run per training run, found again by its tag ``raytrain_scu.run_key`` (storage path + run name) and
  kept in ``<storage_path>/<name>/mlflow_run.json``: a worker restart or re-running the same run name continues the
  SAME run; steps already logged are not logged again.
- Metrics are buffered, on disk in the run directory (``tracker``, ``spool``), and sent with ``log_batch`` at each
  report, never one call per scalar, with the steps and timestamps they were logged at.
- Tracking never kills training: a failed call warns, keeps the buffer and retries at the next flush; the run ends
  with what could be recorded and says what was not (a re-run of the run name sends what is left).
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
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from raytrain_scu.config.io import redact_uri
from raytrain_scu.config.paths import RunPaths, cache_root, storage_dir
from raytrain_scu.config.schema import Config
from raytrain_scu.core.crashpoints import crash_point

RUN_KEY_TAG = "raytrain_scu.run_key"
PARENT_TAG = "mlflow.parentRunId"
REVISION_TAG = "raytrain_scu.config_revision"  # N: the config changed N times after the params were logged
CHANGES_TAG = "raytrain_scu.config_changes"  # the last revision's changes, "key: old -> new; ..."
BEST_STEP_TAG = "raytrain_scu.best_checkpoint_step"  # the step of the best_checkpoint artifact
BEST_VAL_TAG = "raytrain_scu.best_checkpoint_val_bpt"  # and its val/data_bpt
FAILURE_TAG = "raytrain_scu.failure"  # why a FAILED run failed: the one line the CLI printed after `error:`
STORE_KEYS = ("run.storage_path", "tracking.uri")  # the keys that decide which store a config's runs use
CHECKOUT = Path(__file__).resolve().parents[2]  # the source tree, whose Makefile has `make ui` (none in a wheel)


def default_uri(storage_path: str) -> str:
    """The sqlite store beside the run directories of ``run.storage_path``: what runs use without ``tracking.uri``."""
    return f"sqlite:///{storage_dir(storage_path)}/mlflow.db"


def tracking_uri(cfg: Config) -> str:
    return cfg.tracking.uri or RunPaths.of(cfg).default_tracking_uri


def ui_command(cfg: Config, config_file: Optional[str] = None, overrides: Sequence[str] = ()) -> Optional[str]:
    """The command that opens the MLflow UI on the store this config's runs use, as the run's summary prints it, one
    that works from a plain shell (no venv activated). In the checkout, run from the venv `make` sets up, with the
config file known (the train CLI's):
    ``make ui CONFIG=<file>``, with ARGS= the overrides that move the store (``STORE_KEYS``); make sets up the venv,
    the ``ui`` extra (the full mlflow package: its server and flask) with it. Elsewhere: this venv's ``mlflow ui`` by
    its full path, which needs that extra. None for an http(s) tracking server, which serves the UI at its own
    address."""
    uri = redact_uri(tracking_uri(cfg))
    if uri.startswith(("http://", "https://")):
        return None
    in_make_venv = Path(sys.prefix).resolve() == (CHECKOUT / ".venv").resolve()  # the venv `make` sets up and uses
    in_checkout = Path.cwd().resolve() == CHECKOUT and (CHECKOUT / "Makefile").is_file()
    if config_file is not None and in_make_venv and in_checkout:
        store = [f"{key}={redact_uri(value)}" for key, value in (o.split("=", 1) for o in overrides if "=" in o)
                 if key.strip() in STORE_KEYS]
        return shlex.join(["make", "ui", f"CONFIG={config_file}", *([f"ARGS={' '.join(store)}"] if store else [])])
    return shlex.join([str(Path(sys.executable).parent / "mlflow"), "ui", "--backend-store-uri", uri])


def run_key(cfg: Config) -> str:
    """The tag value that finds a training run's MLflow run again: its run directory."""
    return RunPaths.of(cfg).run


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
        db = Path(uri[len("sqlite:///"):].split("?", 1)[0])  # the file, without the URI's query (?timeout=...)
        db.parent.mkdir(parents=True, exist_ok=True)
        if db.name != ":memory:" and not db.exists():
            _seed_sqlite(db)
    return MlflowClient(tracking_uri=uri)


# the rows MLflow's schema migrations leave in a new database, whatever its path: its schema version and the default
# workspace. Its Default experiment (id 0) holds an artifact location made from the working directory, so the template
# has none and MLflow makes it when it opens the copy, as it does in a database of its own.
_TEMPLATE_ROWS = {"alembic_version": 1, "workspaces": 1}


def _empty_store() -> Path:
    """A sqlite store as MLflow makes it, without its Default experiment: made once per MLflow version in the cache
    (``cache_root()/mlflow``) by MLflow itself. Raises if MLflow's new database holds other rows than
    :data:`_TEMPLATE_ROWS`: a copy of it would then not be what MLflow makes at another path."""
    import sqlite3
    import tempfile

    import mlflow
    from mlflow.tracking import MlflowClient

    template = cache_root() / "mlflow" / f"empty-{mlflow.__version__}.db"
    if template.is_file():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=template.parent) as tmp:
        made = Path(tmp, "mlflow.db")
        MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()
        con = sqlite3.connect(made)
        try:
            con.execute("DELETE FROM experiments")
            con.commit()
            tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            rows = {t: n for t in tables if (n := con.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0])}
        finally:
            con.close()
        if rows != _TEMPLATE_ROWS:
            raise RuntimeError(f"MLflow {mlflow.__version__}'s new sqlite store holds {rows}, not {_TEMPLATE_ROWS}")
        os.replace(made, template)
    return template


def _seed_sqlite(db: Path) -> None:
    """A new sqlite store starts as a copy of :func:`_empty_store`: MLflow builds a new database by running each of
    its schema migrations, 3-8 s of CPU (2-core machine) at every new ``run.storage_path``, and it opens the copy as
    one of its own (the schema check passes, the Default experiment is made). Where no copy can be made (an
    unwritable cache, no hard links on this filesystem, an MLflow whose new store holds other rows), a warning says
    why and MLflow builds the database itself, as without this."""
    import shutil

    staged = db.with_name(f".{db.name}.{os.getpid()}")
    try:
        shutil.copyfile(_empty_store(), staged)
        try:
            os.link(staged, db)  # only where no store is yet: another process's store is never replaced
        except FileExistsError:
            pass
    except Exception as e:  # noqa: BLE001 - the store is MLflow's own then, only slower to make
        warnings.warn(f"a new MLflow store is built by MLflow's migrations, not copied from the template: "
                      f"{type(e).__name__}: {e}")
    finally:
        staged.unlink(missing_ok=True)


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


def _run_with_key(client, exp_id: str, cfg: Config) -> Optional[str]:
    found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key(cfg)}'", max_results=1)
    return found[0].info.run_id if found else None


def find_run(cfg: Config) -> Optional[str]:
    """The MLflow run id of this training run, found by its run-key tag; None when the store has none. Raises on an
    unreachable store."""
    client = client_for(tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.tracking.experiment or cfg.run.name)
    return None if exp is None else _run_with_key(client, exp.experiment_id, cfg)


def _find_or_create_run(cfg: Config, parent_run_id: Optional[str] = None) -> str:
    """The MLflow run id for this training run: found by its run-key tag, else created."""
    uri = tracking_uri(cfg)
    client = client_for(uri)
    exp_id = experiment_id(client, cfg.tracking.experiment or cfg.run.name, uri)
    found = _run_with_key(client, exp_id, cfg)
    if found is not None:
        return found
    tags = {RUN_KEY_TAG: run_key(cfg), "mlflow.runName": cfg.run.name}
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
    crash_point("mlflow.run_created")
    client_for(tracking_uri(cfg)).set_terminated(run_id, status="RUNNING")
    return run_id


def end_run(cfg: Config, run_id: str, status: str, reason: Optional[str] = None) -> None:
    """End the run :func:`open_run` opened: FINISHED, FAILED or KILLED; a failure's ``reason`` becomes the tag
    :data:`FAILURE_TAG`. Warns instead of raising (tracking never kills training)."""
    try:
        client = client_for(tracking_uri(cfg))
        if reason:
            client.set_tag(run_id, FAILURE_TAG, param_text(redact_uri(reason)))
        client.set_terminated(run_id, status=status)
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"MLflow run {run_id} not marked {status}: {type(e).__name__}: {redact_uri(str(e))[:200]}")


def remember_run_id(cfg: Config, run_id: str) -> None:
    """Keep the run id with the Ray run directory (local storage) so people and tools can find it."""
    p = RunPaths.of(cfg).local
    if p is None:
        return
    p.mkdir(parents=True, exist_ok=True)
    (p / "mlflow_run.json").write_text(json.dumps({"run_id": run_id, "tracking_uri": redact_uri(tracking_uri(cfg))}))


def param_text(value) -> str:
    """A value as MLflow keeps it in a param (text, at most 6000 characters)."""
    return str(value)[:6000]


def log_params_once(client, run_id: str, params: dict) -> None:
    """Log the params ``run_id`` does not have yet: MLflow refuses to change a param, and a resumed sweep re-logs."""
    from mlflow.entities import Param

    existing = client.get_run(run_id).data.params
    new = [Param(k, param_text(v)) for k, v in params.items() if k not in existing]
    for i in range(0, len(new), 100):
        crash_point("mlflow.params")
        client.log_batch(run_id, params=new[i:i + 100])


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


def log_adapter(cfg: Config, run_id: str, adapter_dir: str) -> Optional[str]:
    """Driver side, after fit(): what the output's ``adapter/`` holds (the run's primary adapter) as the ``adapter``
    artifact. Returns a warning text on failure."""
    try:
        client_for(tracking_uri(cfg)).log_artifacts(run_id, adapter_dir, artifact_path="adapter")
        return None
    except Exception as e:  # noqa: BLE001
        return f"adapter not logged to MLflow: {type(e).__name__}: {redact_uri(str(e))[:200]}"


# ---------------------------------------------------------------- sweeps: one parent run, one child run per trial

SWEEP_TAG = "raytrain_scu.sweep"  # the sweep's name, on the parent and on every child
TRIAL_TAG = "raytrain_scu.trial_id"  # the Tune trial id, on each child


def child_runs(cfg: Config, parent_run_id: str) -> list:
    """The runs whose ``mlflow.parentRunId`` tag is ``parent_run_id`` (a sweep's trials), in cfg's experiment."""
    uri = tracking_uri(cfg)
    client = client_for(uri)
    exp_id = experiment_id(client, cfg.tracking.experiment or cfg.run.name, uri)
    return client.search_runs([exp_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'", max_results=5000)
