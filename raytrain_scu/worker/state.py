"""What one worker's loop carries from step to step, as a few typed parts. Each part says what it is in the metrics
row (:meth:`row`) and in a checkpoint (:meth:`saved` / :meth:`restore`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from raytrain_scu.config.schema import Config
from raytrain_scu.core import laws
from raytrain_scu.core.bounds import BoundWatch
from raytrain_scu.core.data.cache import TokenData
from raytrain_scu.core.dist import notice0
from raytrain_scu.worker.meter import Meter
from raytrain_scu.worker.oom import Phase


def step_outcome(data_bpt: float, param_bpt: float, grad_norm: float, *, loss_scaling: bool) -> str:
    """What becomes of one optimizer step, from its global DataBPT, ParamBPT and (unscaled) gradient norm.

    ``"skipped"``: a non-finite loss, or non-finite gradients with no loss scaling to recover from them; no
    optimizer step, counted in train/skipped_steps and toward train.max_consecutive_skips. ``"overflow"``: under
    fp16 loss scaling, a finite loss with inf/NaN gradients, the ordinary way GradScaler finds its scale too high;
    it skips the step and lowers the scale, counted apart in train/scaler_overflows, never as a failure.
    ``"ok"``: the optimizer steps.
    """
    if not (math.isfinite(data_bpt) and math.isfinite(param_bpt)):
        return "skipped"
    if math.isfinite(grad_norm):
        return "ok"
    return "overflow" if loss_scaling else "skipped"


def optimizer_step(optimizer, scaler, *, data_bpt: float, param_bpt: float, grad_norm: float) -> str:
    """Step (or skip) after ``scaler.unscale_(optimizer)``, update the scaler, zero the gradients; returns
    :func:`step_outcome`."""
    outcome = step_outcome(data_bpt, param_bpt, grad_norm, loss_scaling=scaler.is_enabled())
    if outcome != "skipped":
        scaler.step(optimizer)  # on an "overflow" GradScaler skips the step by itself
    # unscale_ recorded whether the gradients were finite: the scale backs off after inf/NaN gradients even when we
    # skipped the step ourselves, and the scaler is ready for the next unscale_
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return outcome


@dataclass
class Optimisation:
    """The adapters and what steps them: the peft model, its trainable tensors, the loss module the hooks prepared,
    AdamW, the fp16 loss scaler, autocast, and the count of skipped steps."""

    model: Any  # the peft model: adapters, save_pretrained
    params: list  # its trainable (adapter) tensors
    loss_model: torch.nn.Module  # the loss module (compiled, on the device)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: Any  # torch.autocast context for the forward passes
    centers: list  # per adapter tensor: its initial value (A), or None (B, from 0)
    offloaded: Any = None  # the model's OffloadedEmbedding (quant.offload_embedding): batches stage its rows
    sharded: bool = False  # FSDP (scaling.strategy=fsdp): params are each rank's shards, gradients reduce-scattered
    skipped_total: int = 0
    skipped_in_a_row: int = 0
    overflows_total: int = 0

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def steps_on_device(self) -> bool:
        """Whether the step can be launched before the host reads the step's numbers: fused AdamW skips it on the
        device where DataBPT, ParamBPT or the gradient norm is non-finite. fp16's loss scaler decides on the host."""
        return not self.scaler.is_enabled() and bool(self.optimizer.defaults.get("fused"))

    def launch(self, nonfinite: torch.Tensor) -> None:
        """The optimizer step without a host sync (:attr:`steps_on_device`): fused AdamW reads ``nonfinite`` (a 0-d
        float on the parameters' device, 1 = skip) as GradScaler's ``found_inf`` and then leaves the adapters, its
        moments and its step count as they were."""
        self.optimizer.found_inf = nonfinite
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, *, data_bpt: float, param_bpt: float, grad_norm: float) -> str:
        """The optimizer step (or a counted skip) after the backward passes; returns its outcome. Where
        :attr:`steps_on_device`, the step was launched already (:meth:`launch`) and only its outcome is counted."""
        if self.steps_on_device:
            outcome = step_outcome(data_bpt, param_bpt, grad_norm, loss_scaling=False)
        else:
            outcome = optimizer_step(self.optimizer, self.scaler, data_bpt=data_bpt, param_bpt=param_bpt,
                                     grad_norm=grad_norm)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if outcome == "skipped" else 0
        self.skipped_total += outcome == "skipped"
        self.overflows_total += outcome == "overflow"  # fp16 only: GradScaler's own skip, not a failure
        return outcome

    def row(self) -> dict:
        return {"train/skipped_steps": self.skipped_total, "train/scaler_overflows": self.overflows_total}

    def saved(self) -> dict:
        return {"skipped_steps": self.skipped_total, "skipped_in_a_row": self.skipped_in_a_row,
                "scaler_overflows": self.overflows_total}

    def restore(self, meta: dict) -> None:
        self.skipped_total, self.skipped_in_a_row = meta.get("skipped_steps", 0), meta.get("skipped_in_a_row", 0)
        self.overflows_total = meta.get("scaler_overflows", 0)


@dataclass
class Control:
    """The control law on λ (``controller.law``, any law of ``core.laws``) and what its inputs are measured against:
    the tokens of one epoch (N of ParamBPT)."""

    law: Any
    tokens_per_epoch: int
    every: int  # controller.control_every
    bounds: Optional[BoundWatch] = None  # says when λ sits at a bound for long

    def update(self, step: int, *, data_bpt: float, param_bpt: float, lr_factor: float) -> None:
        """After optimizer step ``step`` (from 1), on the control cadence, with the step's learning rate over its
        peak (the laws that scale a gain by it take it). A non-finite input is counted in ctrl/skipped by the law and
        changes nothing else. λ held at a bound for long is a notice (rank 0's reaches the console)."""
        if step % self.every == 0:
            laws.update(self.law, data_bpt, param_bpt, step=step, lr_factor=lr_factor)
        text = self.bounds.update(step, self.law.lam, self.law.s_hat) if self.bounds is not None else None
        if text:
            notice0(text)

    def saved(self) -> dict:
        return {"bound_watch": self.bounds.state_dict()} if self.bounds is not None else {}

    def restore(self, meta: dict) -> None:
        if self.bounds is not None and "bound_watch" in meta:  # a checkpoint without it: the stretch starts afresh
            self.bounds.load_state_dict(meta["bound_watch"])

    def row(self) -> dict:
        law = self.law
        row = {"ctrl/s": law.s, "ctrl/s_hat": law.s_hat, "ctrl/error": law.error, "ctrl/lambda": law.lam,
               "ctrl/integral": law.integral, "ctrl/skipped": law.n_skipped, **laws.telemetry(law)}
        if law.saturated_step is not None:
            row["ctrl/saturated_step"] = law.saturated_step
        return row


@dataclass
class Position:
    """Where the loop is in the data: sequences consumed over all ranks (the resume point) and per step; and the
    batch sent to the device ahead of its step (a cache, never saved)."""

    data: TokenData
    seqs_per_step: int  # sequences per optimizer step, over all ranks
    block_size: int
    position: int = 0
    # ((position, micro-step), (x, y, pos)): a batch sent to the device ahead of its step; never saved (rebuilt at will)
    ahead: Optional[tuple] = None

    def advance(self) -> None:
        self.position += self.seqs_per_step

    @property
    def tokens_seen(self) -> int:
        """Training tokens so far: the sweep's ASHA time axis, exact across resumes."""
        return self.position * self.block_size


@dataclass
class Record:
    """The run's own history: the rows so far, held-out BPT (at the start, last and best), where it resumed and which
    steps the loop runs."""

    history: list = field(default_factory=list)
    val_bpt: float = float("nan")
    val_step: Optional[int] = None  # the step at whose end val_bpt was measured (0: before training)
    best_val: float = float("inf")
    best_step: Optional[int] = None  # the step best_val was measured at (a runs listing reads it from meta.json)
    val_bpt_start: float = float("nan")
    start_step: int = 0
    fresh: bool = True  # no checkpoint to resume from (fault injection acts on fresh starts only)
    resumed_at: list = field(default_factory=list)
    ckpt_suffix: str = ""  # after a fallback: checkpoints never reuse the name of a skipped bad one

    def saved(self) -> dict:
        return {"val_bpt": self.val_bpt, "val_step": self.val_step, "best_val": self.best_val,
                "best_step": self.best_step, "resumed_at": self.resumed_at}

    def restore(self, meta: dict, *, problems: list) -> None:
        self.fresh = False
        self.start_step, self.history = meta["step"], meta["history"]
        self.val_bpt, self.best_val = meta.get("val_bpt", float("nan")), meta.get("best_val", float("inf"))
        self.val_step, self.best_step = meta.get("val_step"), meta.get("best_step")
        self.resumed_at = meta.get("resumed_at", []) + [self.start_step]
        self.ckpt_suffix = f"_from{self.start_step:08d}" if problems else ""

    def evaluated(self, val_bpt: float, step: int) -> None:
        """The held-out BPT measured at the end of step ``step``."""
        if val_bpt < self.best_val:
            self.best_val, self.best_step = val_bpt, step
        self.val_bpt, self.val_step = val_bpt, step


@dataclass
class Metering:
    """Throughput and MFU: the meter between reports, FLOPs per token of the frozen base and the card's peak; and
    the clock of the remaining-time estimate (``worker.periodic.eta_s``)."""

    meter: Optional[Meter]
    flops_per_token: float
    peak_flops: float = 0.0  # the card's dense bf16 peak; 0: unknown, no perf/mfu
    loop_t0: float = 0.0  # time.perf_counter() when the loop started (after setup)
    eval_s: float = 0.0  # the last held-out evaluation's seconds (the baseline's before any in the loop)
    eval_total_s: float = 0.0  # seconds of the evaluations in the loop so far


@dataclass
class State:
    """One worker's loop state: the run's config and the hooks into Ray (or their local stand-ins), the device, rank
    0's tracker, the checkpoint structure, and the parts above."""

    cfg: Config
    hooks: Any
    device: torch.device
    tracker: Any
    structure: dict
    opt: Optimisation
    ctrl: Control
    pos: Position
    rec: Record
    metering: Metering
    stop_path: Optional[Path] = None  # rank 0 stops the run (all ranks, after a checkpoint) when this file exists
    stopping: bool = False
    preempting: bool = False  # a rank's node is going: all ranks checkpoint this step and wait for a restart
    phase: Phase = field(default_factory=Phase)  # what an out-of-memory error names
