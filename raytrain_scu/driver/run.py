"""The driver of one training run: the one owner of its MLflow run, the launch on Ray Train, and what comes after it
(the exported adapter, the best checkpoint, the summary).

Connects to a running cluster when ``RAY_ADDRESS`` is set (so ``ray job submit`` works), else starts a local one.
Re-running the same ``run.name`` with the same ``run.storage_path`` resumes from its latest good checkpoint.
A re-run whose config changed (a larger ``train.max_steps`` extends the run) prints the changed keys and records
them in MLflow as a config revision: the run's params keep their first values.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import yaml

from raytrain_scu.config.io import flatten, flatten_tree, redact_uri, to_yaml
from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config
from raytrain_scu.console import Progress, format_summary
from raytrain_scu.core import storage
from raytrain_scu.core.checkpoint import BEST_METRIC, UNSCORED, disk_full, is_disk_full, newest_good_local, read_meta
from raytrain_scu.core.registered import score_snapshot
from raytrain_scu.driver import outputs
from raytrain_scu.driver.generate import BASE_RECIPE, base_recipe
from raytrain_scu.driver.lock import run_lock
from raytrain_scu.driver.early import check_inputs
from raytrain_scu.driver.preflight import preflight
from raytrain_scu.errors import CheckpointError, Interrupted
from raytrain_scu.ray import launch
from raytrain_scu.ray.callbacks import Sink
from raytrain_scu.tracking.revisions import config_changes, format_changes, record_config_revision, recorded_config
from raytrain_scu.tracking.store import (
    end_run,
    find_run,
    log_adapter,
    log_best_checkpoint,
    open_run,
    remember_run_id,
    tracking_uri,
    ui_command,
)

# the console's word on where N comes from (core.data.cache.tokens_per_epoch_from): a streamed source's estimate, what
# it is and what sets it instead; the config's value; nothing for a measured count
N_FROM = {"estimated": " (estimated: the train shards' words x the validation shard's tokens per word, the source "
                       "being read in shards; controller.tokens_per_epoch sets it)",
          "config": " (set by controller.tokens_per_epoch)", "measured": ""}


def output_dir(cfg: Config) -> Path:
    """Where the adapter, config.yaml and summary.json go: ``run.output_dir``, else ``<run dir>/output``."""
    return Path(RunPaths.of(cfg).output)


def best_checkpoint(best_checkpoints) -> Optional[tuple]:
    """The ``(checkpoint, metrics)`` of ``Result.best_checkpoints`` with the lowest ``BEST_METRIC``, the held-out
    DataBPT measured at the checkpoint's own step (the latest step on a tie); None when none has one. Ray keeps that
    list sorted by score, worst first, so its first entry is the worst of the kept top-k: never pick by position. A
    checkpoint with no evaluation of its own (a preemption's, scored ``UNSCORED``) is passed over."""
    scored = [(m[BEST_METRIC], -int(m.get("step", 0)), i) for i, (_, m) in enumerate(best_checkpoints or [])
              if isinstance(m.get(BEST_METRIC), (int, float)) and math.isfinite(m[BEST_METRIC])
              and m[BEST_METRIC] != UNSCORED]
    return best_checkpoints[min(scored)[2]] if scored else None


def record_config_change(cfg: Config, run_id: Optional[str], resume_from: Optional[Path], notes: list) -> dict:
    """A re-run of a run name under a changed config (``train.max_steps`` raised to extend it, ...): print the changed
    keys and record them as the MLflow run's next config revision (its params keep their first values: MLflow never
    changes a param). The previous config is the MLflow run's latest revision; with no MLflow run, the config.yaml of
    ``resume_from``, the checkpoint the run resumes from. Returns ``{key: (old, new)}``."""
    rev, previous = 0, None
    if run_id:
        try:
            rev, previous = recorded_config(cfg, run_id)
        except Exception as e:  # noqa: BLE001 - tracking never kills training
            notes.append(f"config changes not checked: MLflow run {run_id} unreadable ({type(e).__name__}: "
                         f"{redact_uri(str(e))[:200]})")
            print(f"[raytrain_scu] warning: {notes[-1]}", file=sys.stderr, flush=True)
            return {}
    elif resume_from is not None:
        previous = flatten_tree(yaml.safe_load((resume_from / "config.yaml").read_text()))
    changes = config_changes(previous, flatten(cfg)) if previous else {}
    if not changes:
        return {}
    from_step = read_meta(resume_from)["step"] if resume_from is not None else None
    if run_id:
        try:
            record_config_revision(cfg, run_id, rev + 1, changes, from_step)
            where = f"config revision {rev + 1} recorded in MLflow run {run_id}; its params keep the first values"
        except Exception as e:  # noqa: BLE001
            where = f"NOT recorded in MLflow: {type(e).__name__}: {redact_uri(str(e))[:200]}"
            notes.append(f"config revision {rev + 1} {where}")
    else:
        where = "not recorded: " + ("tracking.enabled=false" if not cfg.tracking.enabled else "MLflow unreachable")
    old_steps, new_steps = changes.get("train.max_steps", ("0", "0"))
    what = "extended" if int(new_steps) > int(old_steps) else "resumed with a changed config"
    print(f"[raytrain_scu] run {cfg.run.name} {what}: {format_changes(changes)}"
          + (f" (from step {from_step})" if from_step is not None else "") + f"; {where}", flush=True)
    return changes


def run(cfg: Config, *, quiet: bool = False, verbose: bool = False, inputs_checked: bool = False,
        ui: Optional[str] = None) -> dict:
    """Validate, train, export. Returns a summary dict (also printed unless ``quiet``).

    Holds the run's lock (``driver.lock``) from before anything is read until the end: a second launch of the same
    run exits at once naming this one. The one owner of the run's MLflow run: opens it before launch (or finds it
    again on a re-run) and ends it, FINISHED after the summary, FAILED with the reason when training or the summary
    fails, KILLED on Ctrl-C (``launch.fit``); the workers only log into it. ``verbose``: Ray's and the workers'
    output on the console too. ``inputs_checked``: the caller ran :func:`~raytrain_scu.driver.early.check_inputs`
    (the CLI does, before it imports this module). ``ui``: the command the summary prints to open the MLflow UI (the
    CLI's knows the config file: ``make ui CONFIG=...``); default :func:`~raytrain_scu.tracking.store.ui_command`."""
    # the lock goes under the storage path, so it must be writable before anything else: a bad storage path is said
    # as such (preflight, which checks it too, is told it was)
    if not inputs_checked:
        check_inputs(cfg)
    with run_lock(cfg):
        finished = finished_summary(cfg)
        if finished is not None:  # before any check that loads the model or data, and before Ray
            if not quiet:
                print(f"[raytrain_scu] run {cfg.run.name} already finished at step {finished['steps']} "
                      f"(raise train.max_steps to extend it)", flush=True)
                print(format_summary(finished, title="finished earlier"), flush=True)
            return finished
        summary = _run(cfg, preflight(cfg, inputs_checked=True), verbose=verbose, ui=ui)
    if not quiet:
        print(format_summary(summary), flush=True)
    return summary


def open_tracking(cfg: Config, notes: list) -> Optional[str]:
    """The MLflow run this training run logs into (None with tracking off or the store unreachable)."""
    if not cfg.tracking.enabled:
        return None
    try:
        run_id = open_run(cfg)
        remember_run_id(cfg, run_id)
        return run_id
    except Exception as e:  # noqa: BLE001 - tracking never kills training; rank 0 retries
        notes.append(f"MLflow unreachable at start ({type(e).__name__}); rank 0 will retry")
        print(f"[raytrain_scu] warning: {notes[-1]}", file=sys.stderr)
        return None


def _run(cfg: Config, facts: dict, *, verbose: bool, ui: Optional[str]) -> dict:
    """Open the MLflow run, train on Ray Train, summarize; end the MLflow run with how it went."""
    notes: list = []
    run_id = open_tracking(cfg, notes)
    status, reason, ray_logs = "FAILED", None, None
    try:
        changes = record_config_change(cfg, run_id, facts["resume_from"], notes)
        if facts["resume_from"] is not None:  # the workers say it too, in their log files
            print(f"[raytrain_scu] resuming from {facts['resume_from'].name}", flush=True)
        ray_logs, result = _launch(cfg, facts, run_id, verbose=verbose)
        summary = summarize(cfg, result, run_id, changes, notes, facts, ui=ui)
        status = "FINISHED"
    except (KeyboardInterrupt, Interrupted):
        status = "KILLED"
        raise
    except BaseException as e:
        reason = launch.root_cause(e) or f"{type(e).__name__}: {e}"
        raise
    finally:
        kept = launch.keep_logs(cfg, ray_logs)
        if kept is not None:
            print(f"[raytrain_scu] worker logs: {kept}", flush=True)
        if run_id:
            end_run(cfg, run_id, status, reason=reason)
    return summary


def _launch(cfg: Config, facts: dict, run_id: Optional[str], *, verbose: bool):
    """Ray up, the cluster's capacity checked, the trainer built and fitted with its progress on the console and the
    hang watchdog running. Returns (Ray's log directory, Ray Train's result)."""
    launch.init_ray(cfg, verbose=verbose)
    # the cluster the run joined (RAY_ADDRESS, or a Ray already up), which preflight could not see: refused
    # before any worker starts, rather than waited for forever
    launch.check_capacity(cfg, use_gpu=facts["use_gpu"])
    print(f"[raytrain_scu] run {cfg.run.name}: {facts['model']}, {cfg.scaling.num_workers} worker(s) "
          f"({'GPU' if facts['use_gpu'] else 'CPU'}, {cfg.scaling.strategy}), {facts['train_blocks']} train / "
          f"{facts['val_blocks']} val {facts['unit']}, tokens_per_epoch={facts['tokens_per_epoch']}"
          + N_FROM[facts["tokens_per_epoch_from"]], flush=True)
    if facts["examples"]:
        print(f"[raytrain_scu] data: {facts['examples']}", flush=True)
    ray_logs = launch.logs_dir()
    if not verbose:
        print(f"[raytrain_scu] Ray's and the workers' logs: {ray_logs} (--verbose shows them here)", flush=True)
    if not RunPaths.of(cfg).remote:  # a run reported before checkpoints carried their own score: scored as now
        score_snapshot(RunPaths.of(cfg).local, BEST_METRIC, UNSCORED)
    sink = Sink()
    # the watchdog's actor exists from here: the block kills it whatever raises below (building the trainer, fit)
    with launch.hang_watchdog(cfg, use_gpu=facts["use_gpu"]) as watchdog:
        trainer = launch.build_trainer(cfg, use_gpu=facts["use_gpu"], run_id=run_id, callbacks=sink.callbacks(),
                                       watchdog=watchdog)
        progress = Progress(target_s=cfg.controller.target_s)
        return ray_logs, launch.fit(trainer, cfg, sink, progress, watchdog=watchdog)  # raises on failure


def finished_summary(cfg: Config) -> Optional[dict]:
    """The summary of this run name when it already reached train.max_steps with this very config (local storage): its
    output/summary.json, if output/config.yaml is this config and the newest checkpoint on disk is that step. None
    otherwise: a new run, an unfinished one, an extension, or a changed config (which preflight then checks)."""
    path = output_dir(cfg) / "summary.json"
    if RunPaths.of(cfg).remote or not path.is_file():
        return None
    saved = output_dir(cfg) / "config.yaml"
    if not saved.is_file() or saved.read_text() != to_yaml(cfg, redact=True):
        return None
    try:
        summary = json.loads(path.read_text())
        newest, _ = newest_good_local(RunPaths.of(cfg).local)
    except (ValueError, CheckpointError):
        return None  # unreadable: preflight says what is wrong
    steps = summary.get("steps")
    if newest is None or steps is None or read_meta(newest)["step"] != steps or steps < cfg.train.max_steps:
        return None
    return summary


@contextlib.contextmanager
def _naming_full_disk(path: str | Path, what: str) -> Iterator[None]:
    """A full disk inside is a :class:`~raytrain_scu.errors.DiskFullError` naming ``path`` and its free space."""
    try:
        yield
    except OSError as e:
        if is_disk_full(e):
            raise disk_full(path, what) from e
        raise


@contextlib.contextmanager
def _writing_output(cfg: Config) -> Iterator[Path]:
    """The directory summarize writes into: the output directory when it is local; under remote storage a local
    staging directory, uploaded whole at the end (core.storage: pyarrow's filesystem, as Ray's checkpoints). A full
    disk is a :class:`~raytrain_scu.errors.DiskFullError` naming the disk that is full: the output directory, or the
    local staging directory while the output is written there."""
    paths = RunPaths.of(cfg)
    what = "the run's output (adapter, config.yaml, summary.json)"
    if not paths.output_remote:
        with _naming_full_disk(paths.output, what):
            out = Path(paths.output)
            out.mkdir(parents=True, exist_ok=True)
            yield out
        return
    with _naming_full_disk(tempfile.gettempdir(), f"{what}, staged for {paths.output},"):
        out = Path(tempfile.mkdtemp(prefix="raytrain_scu_output_"))
    try:
        with _naming_full_disk(out, f"{what}, staged for {paths.output},"):
            yield out
        with _naming_full_disk(paths.output, what):
            storage.upload_dir(out, paths.uri(paths.output))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _in_output(found: dict, staged: Path, output: str) -> dict:
    """``found``'s paths (strings and lists of them) under the staging directory ``staged`` as the output
    directory ``output`` names them: the same paths for a local output, the remote URI's for remote storage."""
    def named(p: str) -> str:
        return f"{output}/{Path(p).relative_to(staged).as_posix()}"

    return {k: [named(p) for p in v] if isinstance(v, list) else named(v) if isinstance(v, str) else v
            for k, v in found.items()}


def _log_best(cfg: Config, result, run_id: Optional[str], summary: dict, notes: list, local) -> Optional[tuple]:
    """The best checkpoint (:func:`best_checkpoint`) into the summary, and as an MLflow artifact; returns its
    ``(local dir, metrics)`` (None when no checkpoint has a finite evaluation of its own step). ``local``:
    ``outputs.local_checkpoints``."""
    best = best_checkpoint(result.best_checkpoints)
    if best is None and result.best_checkpoints:
        notes.append("no checkpoint has a finite evaluation of its own step: no best checkpoint")
    if best is None:
        return None
    summary["best_step"], summary["best_val_bpt"] = best[1].get("step"), best[1][BEST_METRIC]
    best_dir = local(best[0])  # downloaded once from remote storage, for MLflow and adapter_best/
    if run_id and cfg.tracking.log_best_checkpoint:
        warn = log_best_checkpoint(cfg, run_id, str(best_dir), step=summary["best_step"],
                                   val_bpt=summary["best_val_bpt"])
        if warn:
            notes.append(warn)
    return best_dir, best[1]


def _run_rank0_opened(cfg: Config, notes: list) -> Optional[str]:
    """The MLflow run rank 0 opened when the driver could not (found by its run key), so the best checkpoint and the
    adapter go into it; None, with a note, when the store has none or is still unreachable."""
    try:
        run_id = find_run(cfg)
    except Exception as e:  # noqa: BLE001 - tracking never fails a finished run
        notes.append(f"MLflow unreachable after the run ({type(e).__name__}): no adapter or best checkpoint logged")
        return None
    if run_id is None:
        notes.append("MLflow has no run of this training run: no adapter or best checkpoint logged")
        return None
    remember_run_id(cfg, run_id)
    return run_id


def summarize(cfg: Config, result, run_id: Optional[str], changes: dict, notes: list, facts: dict, *,
              ui: Optional[str] = None) -> dict:
    """After fit(): log the best checkpoint; write the primary adapter (run.primary_adapter: the best checkpoint's or
    the last step's) to adapter/, the other beside it when it is another step, the control trace (scu_history.json,
    plots/), config.yaml, summary.json and base_model.json (what rebuilds the base model: generate) to the output
    directory (local, or on the remote storage); MLflow's ``adapter`` is what adapter/ holds. ``run_id`` None with
    tracking on (MLflow unreachable at start): the run rank 0 opened, found by its run key. ``ui``: the command that
    opens the MLflow UI (see :func:`run`). Returns the summary."""
    paths = RunPaths.of(cfg)
    if run_id is None and cfg.tracking.enabled:
        run_id = _run_rank0_opened(cfg, notes)
    last = result.metrics or {}
    # λ as the last progress line shows it: the value the last step's loss used (ctrl/lambda is the next step's)
    summary = {"run": cfg.run.name, "steps": last.get("step"), "val_bpt_start": last.get("val/data_bpt_start"),
               "val_bpt": last.get("val/data_bpt"), "lambda": last.get("ctrl/lambda_applied", last.get("ctrl/lambda")),
               "lambda_next": last.get("ctrl/lambda"), "s": last.get("ctrl/s"), "s_hat": last.get("ctrl/s_hat"),
               "tokens_per_s": last.get("perf/tokens_per_s"), "run_dir": paths.run, "mlflow_run_id": run_id,
               "config_changes": changes or None, "notes": notes}
    if cfg.tracking.enabled:
        uri, ui = redact_uri(tracking_uri(cfg)), ui or ui_command(cfg)
        summary["tracking_uri"] = f"{uri} (experiment {cfg.tracking.experiment})"
        if ui is not None:
            # mlflow-skinny alone has no UI server; make ui installs the full package first (make setup)
            needs = not ui.startswith("make ") and importlib.util.find_spec("flask") is None
            summary["ui_command"] = ui + ("   (needs the ui extra: pip install 'raytrain_scu[ui]')" if needs else "")
    with contextlib.ExitStack() as stack:
        local = outputs.local_checkpoints(stack)  # each checkpoint downloaded once (remote storage)
        with _naming_full_disk(tempfile.gettempdir(), "the checkpoints downloaded from the run's storage"):
            best = _log_best(cfg, result, run_id, summary, notes, local)
            last_dir = local(result.checkpoint) if result.checkpoint is not None else None
        with _writing_output(cfg) as out:
            found = outputs.export_adapters(last_dir, last.get("step"), best, out, cfg.run.primary_adapter)
            summary["primary_adapter"] = found.pop("primary_adapter")  # a word, not a path under the output
            if last_dir is not None:
                found["plots"] = outputs.write_trace(cfg, last_dir, out)
                note = outputs.unexported_best(outputs.history_of(last_dir), summary.get("best_step"))
                notes.extend([note] if note else [])
            # rank 0 logged the last step's adapter: as adapter under primary_adapter=last, where adapter/ is always
            # the last step's; as adapter_last otherwise, where adapter/ is the best checkpoint's or, with no best
            # checkpoint, the last step's
            if run_id and cfg.run.primary_adapter != "last" and "adapter" in found:
                warn = log_adapter(cfg, run_id, str(out / "adapter"))
                notes.extend([warn] if warn else [])
            summary.update(_in_output(found, out, paths.output))
            (out / "config.yaml").write_text(to_yaml(cfg, redact=True))
            (out / BASE_RECIPE).write_text(json.dumps(base_recipe(cfg, use_gpu=facts["use_gpu"],
                                                                  vocab_size=facts["vocab_size"]), indent=1))
            (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def failure(error: BaseException) -> tuple[Optional[str], list[str]]:
    """A failed run in words: ``Type: message`` of the worker's (or controller's) exception inside Ray Train's
    wrapping (None if the error is not Ray's), and the notices rank 0 had not reported yet (its context)."""
    return launch.root_cause(error), launch.failure_notices(error)
