"""The Ray edge, driver side: :func:`init_ray`, :func:`build_trainer` (one ``TorchTrainer`` per run or sweep trial),
the workers' environment (:func:`scu_env`), the reports relayed to the driver's console and Ctrl-C (:func:`fit`),
Ray's log files (:func:`logs_dir`, :func:`keep_logs`), a failure's root cause and context (:func:`root_cause`,
:func:`failure_notices`), Ray tasks (:func:`run_tasks`: evaluate's shards, the study's scoring) and the bench's Ray
runs (:func:`fit_and_collect`).
The worker side is :mod:`raytrain_scu.ray.hooks`.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Optional

import ray
import ray.train
import ray.train.torch
from ray.exceptions import RayTaskError
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.util.queue import Empty, Queue

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config, hang_timeout_s
from raytrain_scu.console import NOTICES
from raytrain_scu.core.checkpoint import BEST_METRIC
from raytrain_scu.errors import NotEnoughResources
from raytrain_scu.ray.callbacks import PreemptOnSigterm, Sink
from raytrain_scu.ray.stops import Stops
from raytrain_scu.ray.watchdog import HangWatchdog


def _no_colour_reset_at_exit() -> None:
    """Importing Ray runs its CLI logger's ``colorama.init(strip=False)``, which registers an atexit hook that writes
    ``\x1b[0m`` to stdout when that is a terminal: a stray colour reset after the driver's last line. Unregister it
    (colorama registers it once per process, so it does not come back)."""
    colorama = sys.modules.get("colorama")  # Ray's copy (ray/thirdparty_files), imported with ray.train
    if colorama is not None:
        atexit.unregister(colorama.initialise.reset_all)


_no_colour_reset_at_exit()


# ---------------------------------------------------------------- driver side

def train_func(config: dict) -> None:
    """What ``build_trainer`` hands Ray Train: ``ray.hooks.train_func``, imported when a worker calls it. A sweep
    trial's actor, which imports this module to build its trainer, therefore does not import transformers, peft or
    bitsandbytes (seconds per process) for it; torch comes with ``ray.train.torch``."""
    from raytrain_scu.ray.hooks import train_func as run_worker

    run_worker(config)


def scu_env() -> dict[str, str]:
    """This process's RAYTRAIN_SCU_* variables (fault injection, cache location): what every worker gets."""
    return {k: v for k, v in os.environ.items() if k.startswith("RAYTRAIN_SCU_")}


AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def init_ray(cfg: Config, *, verbose: bool = True) -> None:
    """Join the cluster at ``RAY_ADDRESS`` (``ray job submit``), else start a local Ray; nothing if Ray is up. Says
    which, in one line: starting Ray takes seconds.

    ``verbose`` false: the workers' and the controller's output stays in Ray's log files (:func:`logs_dir`) and the
    driver logs Ray's warnings and errors only, so the console holds the package's own lines. Ray's warning that a new
    local cluster has token authentication on (its default when RAY_AUTH_MODE is unset) becomes part of that line."""
    if ray.is_initialized():
        return
    quiet = {} if verbose else {"log_to_driver": False, "logging_level": logging.WARNING}
    address = os.environ.get("RAY_ADDRESS")
    auth = os.environ.get("RAY_AUTH_MODE")
    print(f"[raytrain_scu] joining the Ray cluster at RAY_ADDRESS={address}" if address else
          "[raytrain_scu] starting a local Ray instance" + ("" if auth else " (token authentication on, Ray's "
                                                             "default; RAY_AUTH_MODE=disabled turns it off)"),
          flush=True)
    auth_logger = logging.getLogger(AUTH_LOGGER)
    level = auth_logger.level
    if not verbose:
        auth_logger.setLevel(logging.ERROR)
    try:
        ray.init(**({"address": address} if address else {}), **{"log_to_driver": True, **quiet})
    finally:
        auth_logger.setLevel(level)


def logs_dir() -> Optional[Path]:
    """This Ray session's log directory on the driver's node (where the controller and, locally, the workers
    write); None when Ray is not up."""
    node = getattr(ray._private.worker, "_global_node", None)
    return Path(node.get_logs_dir_path()) if ray.is_initialized() and node is not None else None


def keep_logs(cfg: Config, source: Optional[Path]) -> Optional[Path]:
    """Copy this job's worker logs (the train workers', the controller's: ``worker-*-<job id>-*.out/err``) from
    ``source`` into ``<run dir>/logs/`` (local storage); returns that folder, None with nothing copied."""
    dest = RunPaths.of(cfg).logs
    if source is None or dest is None or not ray.is_initialized():
        return None
    job = ray.get_runtime_context().get_job_id()
    files = [f for f in source.glob(f"worker-*-{job}-*") if f.suffix in (".out", ".err")]
    if not files:
        return None
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, dest / f.name)
    except OSError:  # a full disk must not hide the run's own error: the logs stay in Ray's session directory
        return None
    return dest


@contextlib.contextmanager
def driver_logs_to_file(folder: Optional[Path], *, enabled: bool = True):
    """Inside, this process's own Ray log lines (Tune's warnings, a failed trial's traceback) go to
    ``<folder>/driver.log`` instead of the console; nothing changes when not ``enabled`` or without a folder."""
    if not enabled or folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("ray")  # Tune's and Train's loggers hand their records up to it
    to_file = logging.FileHandler(folder / "driver.log")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)
               and not isinstance(h, logging.FileHandler)]
    for h in console:
        logger.removeHandler(h)
    logger.addHandler(to_file)
    try:
        yield
    finally:
        logger.removeHandler(to_file)
        to_file.close()
        for h in console:
            logger.addHandler(h)


def root_cause(error: BaseException) -> Optional[str]:
    """``Type: message`` of the worker (or controller) exception inside Ray Train's wrapping; None if not Ray's."""
    if not isinstance(error, TrainingFailedError):
        return None
    failures = getattr(error, "worker_failures", None) or {}
    cause = failures[min(failures)] if failures else getattr(error, "controller_failure", error)
    return f"{type(cause).__name__}: {cause}".strip()


def failure_notices(error: BaseException) -> list[str]:
    """The notices rank 0 had not reported yet when it failed (a resume, a fallback: the failure's context), carried
    on its exception by :func:`raytrain_scu.ray.hooks.train_func`; [] for any other error."""
    failures = getattr(error, "worker_failures", None) or {}
    return list(getattr(failures.get(0), NOTICES, None) or [])


def workers_started_note(cfg: Config, starts: int) -> str:
    """What the workers do between their start and the first report, said when they start."""
    n = cfg.scaling.num_workers
    if starts > 1:
        return f"{n} worker(s) started again (attempt {starts}): they go on from the latest checkpoint"
    return (f"{n} worker(s) started: each loads the model and the data (and on a new run scores the held-out "
            f"baseline); the first report comes after train.report_every={cfg.train.report_every} steps")


def show_records(records: list[dict], cfg: Config, progress, last: dict) -> None:
    """The sink's new records on the console: the workers' start, then each report with the notices it carries
    (rank 0's since its previous report) above it; ``last`` keeps the last report's step and checkpoint."""
    for r in records:
        if "workers_started" in r:
            progress.note(workers_started_note(cfg, r["workers_started"]))
            continue
        for text in r["metrics"].get(NOTICES, "").splitlines():
            progress.note(text)
        last.update(step=int(r["metrics"]["step"]), checkpoint=r["checkpoint"])
        progress.update(r["metrics"], checkpoint=r["checkpoint"])


FIT_THREAD = "raytrain_scu-fit"  # the thread fit() runs trainer.fit() in


def fit(trainer: TorchTrainer, cfg: Config, sink: Sink, progress, watchdog: Optional[HangWatchdog] = None):
    """``trainer.fit()`` with each report shown by ``progress`` (``console.Progress``) on the driver, the workers'
    notices it carries (``console.notice``) and the hang ``watchdog``'s (the caller runs it) above it; Ctrl-C and
    SIGTERM stop the run after the step in flight, with its checkpoint (:class:`Stops`). fit() runs in a thread, so
    Ray Train installs no signal handler of its own."""
    box, last = {}, {"step": None, "checkpoint": False}

    def target():
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised in the driver's main thread
            box["error"] = e

    def show():
        while watchdog is not None and watchdog.notices:
            progress.note(watchdog.notices.pop(0))
        show_records(sink.read(), cfg, progress, last)

    thread = threading.Thread(target=target, name=FIT_THREAD, daemon=True)
    with Stops(cfg, progress, last) as stops:
        try:
            thread.start()
            while thread.is_alive():
                thread.join(timeout=0.2)
                show()
                stops.check()
            show()
        finally:
            progress.close()
    if "error" in box:
        raise box["error"]
    stops.raise_after(cfg.train.max_steps)
    return box["result"]


@contextlib.contextmanager
def hang_watchdog(cfg: Config, *, use_gpu: bool) -> Iterator[Optional[HangWatchdog]]:
    """The run's hang watchdog (``train.hang_timeout_s``, or its per-device default), watching inside the block; None
    when it is 0 (off). Its heartbeat actor is killed on leaving the block, whatever raises inside it (building the
    trainer, the fit)."""
    timeout = hang_timeout_s(cfg, use_gpu=use_gpu)
    if timeout <= 0:
        yield None
        return
    with HangWatchdog(timeout) as watchdog:
        yield watchdog


class Trainer(TorchTrainer):
    """A TorchTrainer without Ray Data's callback. The workers read their data themselves (core.data), never a Ray
    Dataset, and that callback starts a DatasetManager actor for every worker group it sees: one more process that
    imports Ray Data, about 4 s of CPU at each start and restart of a run, for shards no worker asks for."""

    def _create_default_callbacks(self):
        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, DatasetsCallback)]


def build_trainer(cfg: Config, *, use_gpu: bool, run_id: Optional[str], callbacks=(), extra_config=None,
                  env: Optional[dict[str, str]] = None, watchdog: Optional[HangWatchdog] = None) -> Trainer:
    """The :class:`Trainer` for one run (the sweep builds one per trial with this too). ``env``: the workers'
    RAYTRAIN_SCU_* variables (default: this process's, :func:`scu_env`); ``watchdog``: the hang watchdog whose
    heartbeat actor the workers report their steps to (:func:`fit` runs it)."""
    s = cfg.scaling
    resources = {"CPU": s.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = s.gpus_per_worker
    loop_config = {**asdict(cfg), "_mlflow_run_id": run_id,
                   "_heartbeats": watchdog.actor if watchdog is not None else None,
                   "_beat_every_s": watchdog.beat_every_s if watchdog is not None else None, **(extra_config or {})}
    # read from this process's environment when fit() starts the controller (Ray propagates it): a worker holds one
    # unconsumed report and blocks on the next until the controller polls, so Ray's 2 s default caps a fast loop
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(s.poll_interval_s)
    return Trainer(
        train_func,
        train_loop_config=loop_config,
        torch_config=TorchConfig(timeout_s=int(s.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=s.num_workers, use_gpu=use_gpu, resources_per_worker=resources,
                                     placement_strategy=s.placement_strategy),
        run_config=RunConfig(
            name=cfg.run.name, storage_path=RunPaths.of(cfg).ray_storage,
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.num_to_keep,
                                               checkpoint_score_attribute=BEST_METRIC,
                                               checkpoint_score_order="min"),
            # a worker's SIGTERM: Ray Train's preemption notice, so the step in flight is checkpointed
            callbacks=[*callbacks, PreemptOnSigterm(cfg.train.preempt_grace_s)],
            # RAYTRAIN_SCU_* variables (fault injection, cache location) reach every worker, on any node
            worker_runtime_env={"env_vars": scu_env() if env is None else env}),
    )


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
    build_trainer(cfg, use_gpu=use_gpu, run_id=None, callbacks=sink.callbacks()).fit()  # raises on a failed run
    return [r["metrics"] for r in sink.read() if "metrics" in r]


def _reporting(fn, queue, *args):
    """A Ray task's body: ``fn(*args, report=...)``, whose every report goes on ``queue`` to the driver."""
    return fn(*args, report=queue.put)


def _drain(queue, progress) -> None:
    while True:
        try:
            progress(queue.get_nowait())
        except Empty:
            return


def run_tasks(cfg: Config, fn, calls: list[tuple], *, gpus_per_worker: Optional[float], plain_errors: tuple = (),
              progress=None, verbose: bool = False) -> list:
    """``fn(*args)`` for each ``args`` of ``calls``, each in its own Ray task; the results in order.

    ``gpus_per_worker`` None: ``scaling.gpus_per_worker`` when ``scaling.use_gpu`` is true, or is auto and the
    cluster has GPUs; else CPU tasks of ``scaling.cpus_per_worker``. A task's exception of a ``plain_errors`` type is
    raised as itself, without the remote traceback. With ``progress``, ``fn`` is called with ``report=``, and every
    value a task reports reaches ``progress`` here while the tasks run. ``verbose``: the tasks' output on the console
    too, not only in Ray's log files."""
    init_ray(cfg, verbose=verbose)
    s = cfg.scaling
    if gpus_per_worker is None:
        use_gpu = s.use_gpu if s.use_gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
        gpus_per_worker = s.gpus_per_worker if use_gpu else 0.0
    env = scu_env()
    options = dict(num_cpus=s.cpus_per_worker, num_gpus=gpus_per_worker, runtime_env={"env_vars": env} if env else None)
    queue = Queue(actor_options={"num_cpus": 0}) if progress is not None else None
    if queue is None:
        refs = [ray.remote(fn).options(**options).remote(*args) for args in calls]
    else:
        refs = [ray.remote(_reporting).options(**options).remote(fn, queue, *args) for args in calls]
    try:
        pending = refs
        while pending and queue is not None:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            _drain(queue, progress)
        return ray.get(refs)
    except RayTaskError as e:
        if isinstance(e.cause, plain_errors):
            raise e.cause from None
        raise
    finally:
        if queue is not None:
            queue.shutdown()
