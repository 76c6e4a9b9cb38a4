"""The handful of calls the loop makes into its runner, as one object (``hooks``):

- ``get_device()``: the torch device of this worker;
- ``open_checkpoint(stack)``: the checkpoint to resume from, opened and verified (``(local dir, problems)``), or None;
- ``prepare_model(model, move_to_device)``: the loss module placed on the device;
- ``report(metrics, checkpoint_dir, checkpoint_dir_name)``: the same number of calls on every rank; rank 0 passes
  the checkpoint directory, the others None;
- ``faults``: fault injection (``worker.faults.Faults``).

``ray.hooks.RayHooks`` makes them Ray Train's calls; :class:`LocalHooks` runs the same loop in one bare process.
"""
from __future__ import annotations

import torch

from raytrain_scu.worker.faults import Faults


class LocalHooks:
    """One process, no Ray: the same loop, for benchmarks (Ray overhead) and debugging. Reports are kept; there is
    no checkpoint to resume from."""

    def __init__(self, device=None):
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.reports: list[dict] = []
        self.faults = Faults.from_env()

    def get_device(self):
        return self.device

    def open_checkpoint(self, stack):
        return None

    def prepare_model(self, model, move_to_device: bool):
        return model.to(self.device) if move_to_device else model

    def report(self, metrics: dict, checkpoint_dir, checkpoint_dir_name):
        self.reports.append(dict(metrics))
