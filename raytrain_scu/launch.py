"""The Ray edge: the only place a training run touches Ray (the Tune sweep and the environment check aside).

- the driver side: :func:`init_ray`, :func:`build_trainer` (one ``TorchTrainer`` per run or sweep trial), the
  workers' environment (:func:`scu_env`), the reports relayed to the driver's console and Ctrl-C (:func:`fit`),
  Ray's log files (:func:`logs_dir`, :func:`keep_logs`), a failure's root cause and context (:func:`root_cause`,
  :func:`failure_notices`), and the Ray runs of evaluate (:func:`run_tasks`) and bench (:func:`fit_and_collect`);
- the worker side: :func:`train_func` runs ``loop.run_loop`` with :class:`RayHooks`, the handful of calls the loop
  makes into Ray Train (device, checkpoint to resume from, placement, report), and :func:`checkpoint_candidates` turns a
  Ray checkpoint into the plain ``(name, open)`` pairs ``checkpoint.open_good_checkpoint`` verifies.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Optional

import pyarrow.fs as pafs
import ray
import ray.train
import ray.train.torch
from ray.exceptions import RayTaskError
from ray.train import (Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError,
                       UserCallback)
from ray.train.torch import TorchTrainer

from raytrain_scu import checkpoint as ckpt
from raytrain_scu.config import Config, ConfigError, build_config, run_dir, storage_dir
from raytrain_scu.console import NOTICES, relaying_warnings, take_notices
from raytrain_scu.faults import Faults
from raytrain_scu.loop import run_loop, stop_flag


def _no_colour_reset_at_exit() -> None:
    """Importing Ray runs its CLI logger's ``colorama.init(strip=False)``, which registers an atexit hook that writes
    ``\x1b[0m`` to stdout when that is a terminal: a stray colour reset after the driver's last line. Unregister it
    (colorama registers it once per process, so it does not come back)."""
    colorama = sys.modules.get("colorama")  # Ray's copy (ray/thirdparty_files), imported with ray.train
    if colorama is not None:
        atexit.unregister(colorama.initialise.reset_all)


_no_colour_reset_at_exit()


# ---------------------------------------------------------------- driver side

def scu_env() -> dict[str, str]:
    """This process's RAYTRAIN_SCU_* variables (fault injection, cache location): what every worker gets."""
    return {k: v for k, v in os.environ.items() if k.startswith("RAYTRAIN_SCU_")}


def init_ray(cfg: Config, *, verbose: bool = True) -> None:
    """Join the cluster at ``RAY_ADDRESS`` (``ray job submit``), else start a local Ray; nothing if Ray is up.

    ``verbose`` false: the workers' and the controller's output stays in Ray's log files (:func:`logs_dir`) and the
    driver logs Ray's warnings and errors only, so the console holds the package's own lines."""
    if ray.is_initialized():
        return
    quiet = {} if verbose else {"log_to_driver": False, "logging_level": logging.WARNING}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **{"log_to_driver": True, **quiet})
    else:
        ray.init(**{"log_to_driver": True, **quiet})


def logs_dir() -> Optional[Path]:
    """This Ray session's log directory on the driver's node (where the controller and, locally, the workers
    write); None when Ray is not up."""
    node = getattr(ray._private.worker, "_global_node", None)
    return Path(node.get_logs_dir_path()) if ray.is_initialized() and node is not None else None


def keep_logs(cfg: Config, source: Optional[Path]) -> Optional[Path]:
    """Copy this job's worker logs (the train workers', the controller's: ``worker-*-<job id>-*.out/err``) from
    ``source`` into ``<run dir>/logs/`` (local storage); returns that folder, None with nothing copied."""
    if source is None or "://" in cfg.run.storage_path or not ray.is_initialized():
        return None
    job = ray.get_runtime_context().get_job_id()
    files = [f for f in source.glob(f"worker-*-{job}-*") if f.suffix in (".out", ".err")]
    if not files:
        return None
    dest = Path(run_dir(cfg)) / "logs"
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, dest / f.name)
    return dest


def root_cause(error: BaseException) -> Optional[str]:
    """``Type: message`` of the worker (or controller) exception inside Ray Train's wrapping; None if not Ray's."""
    if not isinstance(error, TrainingFailedError):
        return None
    failures = getattr(error, "worker_failures", None) or {}
    cause = failures[min(failures)] if failures else getattr(error, "controller_failure", error)
    return f"{type(cause).__name__}: {cause}".strip()


def failure_notices(error: BaseException) -> list[str]:
    """The notices rank 0 had not reported yet when it failed (a resume, a fallback: the failure's context), carried
    on its exception by :func:`train_func`; [] for any other error."""
    failures = getattr(error, "worker_failures", None) or {}
    return list(getattr(failures.get(0), NOTICES, None) or [])


class Sink(UserCallback):
    """Runs in the Ray Train controller (always on the driver's node): appends each report's rank-0 metrics and
    whether it carried a checkpoint to a JSON-lines file the driver reads (:meth:`read`)."""

    def __init__(self):
        self.path = Path(tempfile.mkdtemp(prefix="raytrain_scu-")) / "reports.jsonl"
        self.path.touch()
        self.offset = 0

    def after_report(self, run_context, metrics, checkpoint):
        with open(self.path, "a") as f:
            f.write(json.dumps({"metrics": metrics[0], "checkpoint": checkpoint is not None}) + "\n")

    def read(self) -> list[dict]:
        """The driver side: the reports written since the last call, whole lines only."""
        with open(self.path) as f:
            f.seek(self.offset)
            text = f.read()
        done = text[:text.rfind("\n") + 1]
        self.offset += len(done.encode())
        return [json.loads(line) for line in done.splitlines()]


class Interrupted(Exception):
    """Ctrl-C stopped the run at ``step`` (the last report), with a checkpoint of that step or without one."""

    def __init__(self, step: Optional[int], checkpointed: bool):
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpointed = step, checkpointed


def fit(trainer: TorchTrainer, cfg: Config, sink: Sink, progress):
    """``trainer.fit()`` with each report shown by ``progress`` (``console.Progress``) on the driver, the workers'
    notices it carries (``console.notice``) above it, and Ctrl-C.

    fit() runs in a thread, so Ray Train installs no SIGINT handler of its own. The first SIGINT writes the stop
    flag (local storage): every rank stops after its next step, rank 0 checkpoints it, and this raises
    :class:`Interrupted` once fit() returns. A second SIGINT (or the first with remote storage, which has no flag)
    raises it at once."""
    flag = stop_flag(cfg)
    if flag is not None:
        flag.unlink(missing_ok=True)  # a leftover from a run killed hard would stop this one at its first step
    box, last, sigints = {}, {"step": None, "checkpoint": False}, []

    def target():
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised in the driver's main thread
            box["error"] = e

    def on_sigint(signum, frame):
        sigints.append(time.time())
        if len(sigints) > 1 or flag is None:
            raise Interrupted(last["step"], checkpointed=False)
        flag.parent.mkdir(parents=True, exist_ok=True)
        flag.write_text("stop\n")
        progress.close()
        print("[raytrain_scu] Ctrl-C: stopping after this step and writing its checkpoint (Ctrl-C again aborts "
              "without one)", flush=True)

    def show():
        for r in sink.read():
            for text in r["metrics"].get(NOTICES, "").splitlines():  # rank 0's notices since its previous report
                progress.note(text)
            last.update(step=int(r["metrics"]["step"]), checkpoint=r["checkpoint"])
            progress.update(r["metrics"], checkpoint=r["checkpoint"])

    thread = threading.Thread(target=target, name="raytrain_scu-fit", daemon=True)
    # only the main thread may handle signals: run() called from another thread (a test, a notebook's worker) shows
    # progress but leaves Ctrl-C to whoever owns the main thread
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main else None
    try:
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.2)
            show()
        show()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
        progress.close()
        if flag is not None:
            flag.unlink(missing_ok=True)
    if "error" in box:
        raise box["error"]
    if sigints and last["step"] != cfg.train.max_steps:
        raise Interrupted(last["step"], checkpointed=last["checkpoint"])
    return box["result"]


def build_trainer(cfg: Config, *, use_gpu: bool, run_id: Optional[str], callbacks=(), extra_config=None,
                  env: Optional[dict[str, str]] = None) -> TorchTrainer:
    """The TorchTrainer for one run (the sweep builds one per trial with this too). ``env``: the workers'
    RAYTRAIN_SCU_* variables (default: this process's, :func:`scu_env`)."""
    s = cfg.scaling
    resources = {"CPU": s.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = s.gpus_per_worker
    loop_config = {**asdict(cfg), "_mlflow_run_id": run_id, **(extra_config or {})}
    # read from this process's environment when fit() starts the controller (Ray propagates it): a worker holds one
    # unconsumed report and blocks on the next until the controller polls, so Ray's 2 s default caps a fast loop
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(s.poll_interval_s)
    return TorchTrainer(
        train_func,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=s.num_workers, use_gpu=use_gpu, resources_per_worker=resources,
                                     placement_strategy=s.placement_strategy),
        run_config=RunConfig(
            name=cfg.run.name, storage_path=storage_dir(cfg.run.storage_path),
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.num_to_keep,
                                               checkpoint_score_attribute=ckpt.BEST_METRIC,
                                               checkpoint_score_order="min"),
            callbacks=list(callbacks),
            # RAYTRAIN_SCU_* variables (fault injection, cache location) reach every worker, on any node
            worker_runtime_env={"env_vars": scu_env() if env is None else env}),
    )


class NotEnoughResources(ConfigError):
    """The Ray cluster has fewer GPUs (or CPUs) than the run's workers ask for; Ray would wait for them forever. A
    ConfigError (scaling.* is at fault), so the CLIs say so in one line and exit 2."""


def check_capacity(cfg: Config, *, use_gpu: bool) -> None:
    """Refuse, before any worker starts, ``scaling.num_workers`` workers that need more GPUs (with ``use_gpu``) or
    CPUs than the Ray cluster has now."""
    s, have = cfg.scaling, ray.cluster_resources()
    for key, each in (("GPU", s.gpus_per_worker if use_gpu else 0.0), ("CPU", s.cpus_per_worker)):
        need = s.num_workers * each
        if need > have.get(key, 0.0):
            raise NotEnoughResources(f"scaling.num_workers={s.num_workers}: {s.num_workers} workers x {each:g} {key} "
                                     f"need {need:g} {key}s, but the Ray cluster has {have.get(key, 0.0):g}")


def fit_and_collect(cfg: Config, *, use_gpu: bool) -> list[dict]:
    """Run ``cfg`` on Ray Train with no MLflow run and return rank 0's reports, in order (bench's Ray parts). Refuses
    more workers than the cluster can place (:func:`check_capacity`) before starting any."""
    sink = Sink()
    init_ray(cfg)
    check_capacity(cfg, use_gpu=use_gpu)
    build_trainer(cfg, use_gpu=use_gpu, run_id=None, callbacks=[sink]).fit()  # raises on a failed run
    return [r["metrics"] for r in sink.read()]


def run_tasks(cfg: Config, fn, calls: list[tuple], *, gpus_per_worker: Optional[float],
              plain_errors: tuple = ()) -> list:
    """``fn(*args)`` for each ``args`` of ``calls``, each in its own Ray task; the results in order.

    ``gpus_per_worker`` None: ``scaling.gpus_per_worker`` when ``scaling.use_gpu`` is true, or is auto and the
    cluster has GPUs; else CPU tasks of ``scaling.cpus_per_worker``. A task's exception of a ``plain_errors`` type is
    raised as itself, without the remote traceback."""
    init_ray(cfg)
    s = cfg.scaling
    if gpus_per_worker is None:
        use_gpu = s.use_gpu if s.use_gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
        gpus_per_worker = s.gpus_per_worker if use_gpu else 0.0
    env = scu_env()
    task = ray.remote(fn).options(num_cpus=s.cpus_per_worker, num_gpus=gpus_per_worker,
                                  runtime_env={"env_vars": env} if env else None)
    refs = [task.remote(*args) for args in calls]
    try:
        return ray.get(refs)
    except RayTaskError as e:
        if isinstance(e.cause, plain_errors):
            raise e.cause from None
        raise


# ---------------------------------------------------------------- worker side

def train_func(config: dict) -> None:
    """Ray Train per-worker entry point. ``config`` is ``asdict(Config)`` plus ``_mlflow_run_id``."""
    config = dict(config)
    run_id = config.pop("_mlflow_run_id", None)
    with relaying_warnings():  # the package's warnings reach the driver's console with the reports
        try:
            run_loop(build_config(config), hooks=RayHooks(), run_id=run_id)
        except Exception as e:
            # what no report carried (a resume, a fallback) travels with the failure: its context (failure_notices)
            setattr(e, NOTICES, take_notices())
            raise


def _name(path: str) -> str:
    """``checkpoint_00000020`` of a Ray checkpoint's path: the same for every rank, wherever it downloads."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def _materialise(checkpoint: Checkpoint, stack) -> Path:
    local = Path(stack.enter_context(checkpoint.as_directory()))
    return local / "ckpt" if (local / "ckpt").is_dir() else local


def checkpoint_candidates(ray_checkpoint: Checkpoint, stack) -> list[tuple[str, object]]:
    """``(name, open)`` of every ``checkpoint_*`` in the run directory of the given Ray checkpoint, newest first;
    ``open()`` downloads one (if remote) into ``stack`` and returns its local directory.

    Newest on disk, not Ray's latest: a checkpoint written and copied just before the driver or the controller died
    (Ctrl-C, a lost head) is on disk but was never registered, and Ray would resume from the one before it."""
    fs, path = ray_checkpoint.filesystem, ray_checkpoint.path.rstrip("/")
    parent = path.rsplit("/", 1)[0]
    try:
        infos = fs.get_file_info(pafs.FileSelector(parent, recursive=False))
    except OSError:
        infos = []
    # names carry the zero-padded step, so name order is step order (a `_fromNNN` suffix sorts after its step)
    found = sorted((i.path.rstrip("/") for i in infos if i.type == pafs.FileType.Directory
                    and i.base_name.startswith("checkpoint_") and not i.base_name.endswith(".partial")), reverse=True)
    if path not in found:  # Ray's own is always a candidate
        found = sorted([*found, path], reverse=True)
    return [(_name(p), partial(_materialise, Checkpoint(path=p, filesystem=fs), stack)) for p in found]


def open_checkpoint(ray_checkpoint: Checkpoint, stack) -> tuple[Path, list[str]]:
    """The newest good checkpoint from ``ray_checkpoint`` back, the same on every rank
    (``checkpoint.open_good_checkpoint``); its local directory lives as long as ``stack``."""
    return ckpt.open_good_checkpoint(checkpoint_candidates(ray_checkpoint, stack))


class RayHooks:
    """The handful of calls the loop makes into Ray Train; ``loop.LocalHooks`` stands in for them without Ray."""

    def __init__(self):
        self.faults = Faults.from_env()

    @staticmethod
    def get_device():
        return ray.train.torch.get_device()

    @staticmethod
    def open_checkpoint(stack) -> Optional[tuple[Path, list[str]]]:
        """The checkpoint Ray Train hands this attempt (a restart, a re-run of the run name), opened and verified;
        None on a fresh start."""
        latest = ray.train.get_checkpoint()
        return None if latest is None else open_checkpoint(latest, stack)

    @staticmethod
    def prepare_model(model, move_to_device: bool):
        # no DDP wrapper: the loop averages the adapters' gradients itself (dist.average_gradients says why)
        return ray.train.torch.prepare_model(model, move_to_device=move_to_device, parallel_strategy=None)

    @staticmethod
    def report(metrics: dict, checkpoint_dir, checkpoint_dir_name):
        checkpoint = Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_dir_name)
        if checkpoint is not None:
            # wait until the controller has registered it: a worker lost from here on restarts from this checkpoint
            # (Ray registers reports asynchronously, one health-check poll at a time)
            ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
