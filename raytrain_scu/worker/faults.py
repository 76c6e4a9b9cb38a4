"""Fault injection for the reliability tests (docs/reliability.md), read once from RAYTRAIN_SCU_* variables.

The loop reaches it only through its hooks (``hooks.faults``): ``poison`` on the loss of a step, ``after_step`` once a
step is done, ``after_report`` once its report (and checkpoint) is done too, ``fsync`` for the checkpoint writer and
``out_of_memory`` at the start of each phase. With none of the variables set, all of them do nothing.
"""
from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from raytrain_scu.core.dist import rank
from raytrain_scu.errors import InjectedFault


def _hold_dir() -> Path:
    """RAYTRAIN_SCU_HOLD_DIR, a directory of this run's own: its files say which hold or pause already happened (on
    one node: a rank restarted on another node finds its own node's directory)."""
    hold_dir = Path(os.environ["RAYTRAIN_SCU_HOLD_DIR"])
    hold_dir.mkdir(parents=True, exist_ok=True)
    return hold_dir


def hold_for_kill(step: int, seconds: float = 120.0) -> None:
    """RAYTRAIN_SCU_HOLD_AT_STEP=N: the first time this rank finishes step N (no ``rank<R>.pid`` under
    RAYTRAIN_SCU_HOLD_DIR yet), write that file and wait to be killed from outside (SIGKILL, node removal), so a test
    kills at a known step; an attempt that reaches step N again, after the restart, goes on."""
    held = _hold_dir() / f"rank{rank()}.pid"
    if held.exists():
        return
    held.write_text(f"{os.getpid()} {step}")
    time.sleep(seconds)
    raise InjectedFault(f"held after step {step} for {seconds:.0f} s and nobody killed this worker")


def pause_until_go(step: int, seconds: float = 300.0) -> None:
    """RAYTRAIN_SCU_PAUSE_AT_STEP=N: after step N, its report (and checkpoint), until a file ``go`` appears under
    RAYTRAIN_SCU_HOLD_DIR, write ``rank<R>.paused`` there and wait for ``go``, then go on: a test acts on the paused
    workers (SIGSTOP one, stop a server) at a known step. Once ``go`` exists, an attempt that reaches step N again,
    after a restart, goes on."""
    hold_dir = _hold_dir()
    if (hold_dir / "go").exists():
        return
    (hold_dir / f"rank{rank()}.paused").write_text(f"{os.getpid()} {step}")
    t0 = time.time()
    while not (hold_dir / "go").exists():
        if time.time() - t0 > seconds:
            raise InjectedFault(f"paused after step {step} for {seconds:.0f} s and no {hold_dir / 'go'} appeared")
        time.sleep(0.1)


def _full_disk_fsync(fd: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device (injected: RAYTRAIN_SCU_ENOSPC_AT_STEP)")


def _steps(text: str) -> set[int]:
    return {int(s) for s in text.split(",") if s.strip()}


@dataclass
class Faults:
    """Which faults to inject: a crash (``fault_at``) after that step of a fresh start, a hold (``hold_at``) or a
    pause (``pause_at``) after that step the first time the run reaches it, a non-finite loss on the steps in
    ``nan_at`` (counted from 1), a full disk at the checkpoint of the steps in ``enospc_at``, and an out-of-memory
    error at the start of a phase (``oom_at``: ``"train:1"``, ``"eval:20"``, ``"checkpoint:10"``; eval 0 is the
    evaluation before the first step). 0 / empty: none."""

    fault_at: int = 0
    hold_at: int = 0
    pause_at: int = 0
    nan_at: set[int] = field(default_factory=set)
    enospc_at: set[int] = field(default_factory=set)
    oom_at: set[str] = field(default_factory=set)
    ballast: object = None  # the memory a GPU out-of-memory injection holds

    @classmethod
    def from_env(cls) -> "Faults":
        """RAYTRAIN_SCU_FAULT_AT_STEP, _HOLD_AT_STEP, _PAUSE_AT_STEP, _NAN_AT_STEPS, _ENOSPC_AT_STEP (comma-separated)
        and _OOM_AT (``phase:step``, comma-separated); Ray passes RAYTRAIN_SCU_* to every worker."""
        env = os.environ
        for key in ("RAYTRAIN_SCU_HOLD_AT_STEP", "RAYTRAIN_SCU_PAUSE_AT_STEP"):
            if env.get(key) and not env.get("RAYTRAIN_SCU_HOLD_DIR"):
                raise ValueError(f"{key} needs RAYTRAIN_SCU_HOLD_DIR: a directory of this run's own, where the files "
                                 "that say a hold or pause happened are written")
        return cls(fault_at=int(env.get("RAYTRAIN_SCU_FAULT_AT_STEP", "0") or 0),
                   hold_at=int(env.get("RAYTRAIN_SCU_HOLD_AT_STEP", "0") or 0),
                   pause_at=int(env.get("RAYTRAIN_SCU_PAUSE_AT_STEP", "0") or 0),
                   nan_at=_steps(env.get("RAYTRAIN_SCU_NAN_AT_STEPS", "")),
                   enospc_at=_steps(env.get("RAYTRAIN_SCU_ENOSPC_AT_STEP", "")),
                   oom_at={s.strip() for s in env.get("RAYTRAIN_SCU_OOM_AT", "").split(",") if s.strip()})

    def poison(self, step: int, nats):
        """The loss of step ``step`` (from 1), made non-finite when asked: a NaN loss and gradient on the real path."""
        return nats * float("nan") if step in self.nan_at else nats

    def after_step(self, step: int, *, fresh: bool) -> None:
        """Crash after step ``step`` (from 1) of a run that did not resume from a checkpoint; hold after it the first
        time the run reaches it."""
        if self.fault_at and fresh and step == self.fault_at:
            raise InjectedFault(f"fault injected after step {step} (RAYTRAIN_SCU_FAULT_AT_STEP)")
        if self.hold_at and step == self.hold_at:
            hold_for_kill(step)

    def after_report(self, step: int) -> None:
        """Pause after step ``step``, its report and its checkpoint, the first time the run reaches it."""
        if self.pause_at and step == self.pause_at:
            pause_until_go(step)

    def fsync(self, step: int) -> Callable[[int], None]:
        """What the checkpoint writer of step ``step`` syncs its files with: ``os.fsync``, or one that finds the disk
        full."""
        return _full_disk_fsync if step in self.enospc_at else os.fsync

    def out_of_memory(self, phase: str, step: int, device) -> None:
        """At the start of ``phase`` at step ``step``, when asked: on a GPU, fill the card but 32 MiB, so the phase's
        own allocations run out for real; elsewhere, raise the error a CUDA allocation raises when the card is full
        (the handling is what is tested)."""
        if f"{phase}:{step}" not in self.oom_at:
            return
        if device.type == "cuda":
            torch.cuda.empty_cache()  # blocks the allocator keeps would serve the phase: the driver gets them back
            free, _ = torch.cuda.mem_get_info(device)
            self.ballast = torch.empty(max(0, free - (32 << 20)), dtype=torch.uint8, device=device)
            return
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected: RAYTRAIN_SCU_OOM_AT={phase}:{step})")
