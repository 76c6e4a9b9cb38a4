"""The Ray edge, worker side: :func:`train_func` runs ``worker.loop.run_loop`` with :class:`RayHooks`, the handful of
calls the loop makes into Ray Train (device, checkpoint to resume from, placement, report), and
:func:`checkpoint_candidates` turns a Ray checkpoint into the plain ``(name, open)`` pairs
``core.checkpoint.open_good_checkpoint`` verifies."""
from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path
from typing import Optional

import pyarrow.fs as pafs
import ray.train
import ray.train.torch
from ray.train import Checkpoint

from raytrain_scu.config.load import build_config
from raytrain_scu.config.paths import RunPaths
from raytrain_scu.console import NOTICES, relaying_warnings, take_notices
from raytrain_scu.core.checkpoint import disk_full, is_disk_full, open_good_checkpoint, verify
from raytrain_scu.ray.preemption import Notice
from raytrain_scu.ray.watchdog import Heartbeat
from raytrain_scu.worker.faults import Faults
from raytrain_scu.worker.loop import run_loop


def train_func(config: dict) -> None:
    """Ray Train per-worker entry point. ``config`` is ``asdict(Config)`` plus ``_mlflow_run_id``, ``_heartbeats``
    (the hang watchdog's actor, or None) and ``_beat_every_s`` (the least time between two of a rank's beats)."""
    config = dict(config)
    run_id, heartbeats = config.pop("_mlflow_run_id", None), config.pop("_heartbeats", None)
    every_s = config.pop("_beat_every_s", None) or 0.0
    cfg = build_config(config)
    with relaying_warnings():  # the package's warnings reach the driver's console with the reports
        try:
            hooks = RayHooks(heartbeats, run_dir=RunPaths.of(cfg).run, beat_every_s=every_s,
                             restart_wait_s=cfg.train.preempt_grace_s)
            run_loop(cfg, hooks=hooks, run_id=run_id)
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
    return open_good_checkpoint(checkpoint_candidates(ray_checkpoint, stack))


class RayHooks:
    """The handful of calls the loop makes into Ray Train; ``worker.hooks.LocalHooks`` stands in for them without Ray.
    ``heartbeats``: the hang watchdog's actor (``ray.watchdog.Heartbeats``) or None, sent a beat at most once per
    ``beat_every_s`` (``ray.watchdog.Heartbeat``); ``run_dir``: where Ray copies checkpoints (named in a full disk's
    error); ``restart_wait_s``: how long :meth:`await_restart` waits for Ray Train to restart the group
    (train.preempt_grace_s)."""

    def __init__(self, heartbeats=None, run_dir: str = "", beat_every_s: float = 0.0, *, restart_wait_s: float):
        self.faults = Faults.from_env()
        self.run_dir, self.restart_wait_s, self.notice = run_dir, restart_wait_s, Notice()
        ctx = ray.train.get_context()
        rank, node_id = ctx.get_world_rank(), ray.get_runtime_context().get_node_id()
        self.beat = Heartbeat(heartbeats, rank, node_id, beat_every_s) if heartbeats is not None else None
        if heartbeats is not None and rank == 0:  # a new worker group: the last attempt's beats no longer count
            heartbeats.start_attempt.remote(ctx.get_world_size())

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

    def heartbeat(self, step: Optional[int]) -> None:
        """A completed step (None: done stepping), sent without waiting, at most once per ``beat_every_s``."""
        if self.beat is not None:
            self.beat(step)

    def preempt_notice(self) -> bool:
        """Whether Ray Train told this worker that a node of its group is going: the preemption watcher's notice of
        a drained node (Ray's ``mark_preempt``) or this process's own SIGTERM (``ray.callbacks.PreemptOnSigterm``).
        Read from this worker's own train context (``ray.preemption``), not with ``ray.train.get_preemption_info()``:
        that one is a barrier through Ray's synchronization actor at every step and returns rank 0's view alone, where
        the step's all-reduce carries every rank's at no extra cost."""
        return self.notice.held() is not None

    def await_restart(self) -> None:
        """After the preemption's checkpoint, on every rank: once Ray has registered it, the preemption's deadline
        becomes now, so Ray Train's controller (waiting out the preemption) restarts the group from that checkpoint
        at its next poll (scaling.poll_interval_s), not at the node's deadline; then wait to be stopped. Returning is
        no option: a group whose ranks all return has finished, for Ray, preempted or not. Not stopped within
        ``restart_wait_s`` (train.preempt_grace_s, the window the preemption gave), it raises rather than wait on: the
        worker ends with that error, and Ray Train, which holds the notice, restarts the group from the checkpoint."""
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        self.notice.give(time.time())
        time.sleep(self.restart_wait_s)
        raise RuntimeError(f"Ray Train did not restart the worker group within train.preempt_grace_s="
                           f"{self.restart_wait_s:g} s of the preemption's checkpoint")

    def report(self, metrics: dict, checkpoint_dir, checkpoint_dir_name):
        if self.beat is not None:
            self.beat.reported()
        checkpoint = Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        try:
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_dir_name)
        except OSError as e:  # Ray's copy into the run directory found the storage full
            if not is_disk_full(e):
                raise
            dest = f"{self.run_dir}/{checkpoint_dir_name}"
            if "://" not in dest and Path(dest).is_dir() and verify(dest) is not None:
                shutil.rmtree(dest, ignore_errors=True)  # the incomplete copy gives its space back
            raise disk_full(dest, checkpoint_dir_name) from e
        if checkpoint is not None:
            # wait until the controller has registered it: a worker lost from here on restarts from this checkpoint
            # (Ray registers reports asynchronously, one health-check poll at a time)
            ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
