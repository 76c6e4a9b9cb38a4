"""The handful of calls the loop makes into its runner, as one object (``hooks``):

- ``get_device()``: the torch device of this worker;
- ``open_checkpoint(stack)``: the checkpoint to resume from, opened and verified (``(local dir, problems)``), or None;
- ``prepare_model(model, move_to_device)``: the loss module placed on the device;
- ``report(metrics, checkpoint_dir, checkpoint_dir_name)``: the same number of calls on every rank; rank 0 passes
  the checkpoint directory, the others None;
- ``heartbeat(step)``: after every completed step (``None`` once the loop is done): what the driver's hang watchdog
  reads (Ray's hooks send at most one per short interval: ``ray.watchdog.Heartbeat``);
- ``preempt_notice()``: whether this rank has been told that its node is going (a preemption); read at every step,
  each rank's answer joins the step's all-reduce, so all ranks checkpoint the same step;
- ``await_restart()``: after that checkpoint, on every rank: hand the node back and wait for the runner to restart
  the group from the checkpoint (or return, where a new loop is what resumes);
- ``faults``: fault injection (``worker.faults.Faults``).

``ray.hooks.RayHooks`` makes them Ray Train's calls; :class:`LocalHooks` runs the same loop in one bare process.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import torch

from raytrain_scu.core import checkpoint as ckpt
from raytrain_scu.core.crashpoints import crash_point
from raytrain_scu.core.registered import record_committed
from raytrain_scu.worker.faults import Faults


def _copy_file(src, dst) -> None:
    shutil.copy2(src, dst)
    crash_point("hooks.copy")


class LocalHooks:
    """One process, no Ray: the same loop, for benchmarks (Ray overhead), debugging and fast tests. Reports are kept.
    With ``run_dir``, each checkpoint is copied there as ``checkpoint_<step>``, file by file into its final name as
    Ray Train copies it (so a copy cut short is an incomplete checkpoint that resuming skips), then recorded as
    committed (``core.registered``, where Ray Train registers it), and a new loop resumes from the
    newest good one; without, there is no checkpoint to resume from."""

    def __init__(self, device=None, run_dir: Optional[str | Path] = None):
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.reports: list[dict] = []
        self.beats: list[Optional[int]] = []
        self.faults = Faults.from_env()

    def get_device(self):
        return self.device

    def open_checkpoint(self, stack):
        if self.run_dir is None or ckpt.newest_good_local(self.run_dir)[0] is None:
            return None  # none, or only unregistered copies cut short: a fresh start, as under Ray
        found = sorted((d for d in self.run_dir.glob("checkpoint_*") if d.is_dir() and not d.name.endswith(".partial")),
                       reverse=True)
        return ckpt.open_good_checkpoint([(d.name, lambda d=d: d) for d in found]) if found else None

    def prepare_model(self, model, move_to_device: bool):
        return model.to(self.device) if move_to_device else model

    def report(self, metrics: dict, checkpoint_dir, checkpoint_dir_name):
        self.reports.append(dict(metrics))
        if checkpoint_dir is not None and self.run_dir is not None:
            shutil.copytree(checkpoint_dir, self.run_dir / checkpoint_dir_name, copy_function=_copy_file,
                            dirs_exist_ok=True)
            record_committed(self.run_dir, checkpoint_dir_name)  # as Ray Train registers one once copied

    def heartbeat(self, step: Optional[int]) -> None:
        self.beats.append(step)

    def preempt_notice(self) -> bool:
        """One bare process has no runner to say its node is going: a SIGTERM ends it as Python's default does."""
        return False

    def await_restart(self) -> None:
        """The loop returns: a new loop with this ``run_dir`` resumes from the checkpoint it just wrote."""
