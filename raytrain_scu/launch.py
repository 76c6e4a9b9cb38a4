"""The Ray edge: the only place a training run touches Ray (the Tune sweep and the environment check aside).

- the driver side: :func:`init_ray`, :func:`build_trainer` (one ``TorchTrainer`` per run or sweep trial), the
  workers' environment (:func:`scu_env`), the progress line (:func:`progress_callback`), a failure's root cause
  (:func:`root_cause`), and the Ray runs of evaluate (:func:`run_tasks`) and bench (:func:`fit_and_collect`);
- the worker side: :func:`train_func` runs ``loop.run_loop`` with :class:`RayHooks`, the handful of calls the loop
  makes into Ray Train (device, checkpoint to resume from, DDP, report), and :func:`checkpoint_candidates` turns a
  Ray checkpoint into the plain ``(name, open)`` pairs ``checkpoint.open_good_checkpoint`` verifies.
"""
from __future__ import annotations

import json
import os
import tempfile
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
from raytrain_scu.config import Config, build_config, storage_dir
from raytrain_scu.console import fmt_eta
from raytrain_scu.faults import Faults
from raytrain_scu.loop import run_loop


# ---------------------------------------------------------------- driver side

def scu_env() -> dict[str, str]:
    """This process's RAYTRAIN_SCU_* variables (fault injection, cache location): what every worker gets."""
    return {k: v for k, v in os.environ.items() if k.startswith("RAYTRAIN_SCU_")}


def init_ray(cfg: Config) -> None:
    """Join the cluster at ``RAY_ADDRESS`` (``ray job submit``), else start a local Ray; nothing if Ray is up."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    else:
        ray.init(log_to_driver=True)


def root_cause(error: BaseException) -> Optional[str]:
    """``Type: message`` of the worker (or controller) exception inside Ray Train's wrapping; None if not Ray's."""
    if not isinstance(error, TrainingFailedError):
        return None
    failures = getattr(error, "worker_failures", None) or {}
    cause = failures[min(failures)] if failures else getattr(error, "controller_failure", error)
    return f"{type(cause).__name__}: {cause}".strip()


class Progress(UserCallback):
    """One line per report, printed by the Ray Train controller and forwarded to the driver's console."""

    def __init__(self):
        self.t0, self.step0 = None, None

    def after_report(self, run_context, metrics, checkpoint):
        r = metrics[0]
        step, max_steps = int(r["step"]), int(r["max_steps"])
        now = time.time()
        if self.t0 is None:
            self.t0, self.step0 = now, step
        rate = (step - self.step0) / (now - self.t0) if step > self.step0 else 0.0
        eta = fmt_eta((max_steps - step) / rate) if rate > 0 else "?"
        # λ_applied: the λ the loss used in this step, the one beside the S it produced (ctrl/lambda is already the
        # next step's, after the controller's update)
        print(f"[raytrain_scu] step {step}/{max_steps}  DataBPT {r['train/data_bpt']:.4f}  "
              f"val {r.get('val/data_bpt', float('nan')):.4f}  λ_applied {r['ctrl/lambda_applied']:.4g}  "
              f"S {r['ctrl/s']:.4g}  Ŝ {r['ctrl/s_hat']:.4g}  tok/s {r.get('perf/tokens_per_s', 0):.0f}  ETA {eta}"
              + ("  [checkpoint]" if checkpoint is not None else ""), flush=True)


def progress_callback() -> Progress:
    """The console's progress line, one per report (``train`` passes it to :func:`build_trainer`)."""
    return Progress()


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


def fit_and_collect(cfg: Config, *, use_gpu: bool) -> list[dict]:
    """Run ``cfg`` on Ray Train with no MLflow run and return rank 0's reports, in order (bench's Ray parts)."""
    sink = Path(tempfile.mkdtemp()) / "reports.jsonl"

    class Collect(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            with open(sink, "a") as f:
                f.write(json.dumps(metrics[0]) + "\n")

    init_ray(cfg)
    build_trainer(cfg, use_gpu=use_gpu, run_id=None, callbacks=[Collect()]).fit()  # raises on a failed run
    return [json.loads(line) for line in sink.read_text().splitlines()]


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
    run_loop(build_config(config), hooks=RayHooks(), run_id=run_id)


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
        return ray.train.torch.prepare_model(model, move_to_device=move_to_device,
                                             parallel_strategy_kwargs={"gradient_as_bucket_view": True})

    @staticmethod
    def report(metrics: dict, checkpoint_dir, checkpoint_dir_name):
        checkpoint = Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_dir_name)
        if checkpoint is not None:
            # wait until the controller has registered it: a worker lost from here on restarts from this checkpoint
            # (Ray registers reports asynchronously, one health-check poll at a time)
            ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
