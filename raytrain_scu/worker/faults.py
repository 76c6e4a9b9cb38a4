"""Fault injection for the reliability tests (docs/reliability.md), read once from RAYTRAIN_SCU_* variables.

The loop reaches it only through its hooks (``hooks.faults``): ``poison`` on the loss of a step, ``after_step`` once a
step is done. With none of the variables set, both do nothing.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from raytrain_scu.core.dist import rank
from raytrain_scu.errors import InjectedFault


def hold_for_kill(step: int, seconds: float = 120.0) -> None:
    """RAYTRAIN_SCU_HOLD_AT_STEP=N: after step N of a fresh start, write ``rank<R>.pid`` under RAYTRAIN_SCU_HOLD_DIR
    and wait to be killed from outside (SIGKILL, node removal), so a test kills at a known step."""
    hold_dir = Path(os.environ.get("RAYTRAIN_SCU_HOLD_DIR") or tempfile.gettempdir())
    hold_dir.mkdir(parents=True, exist_ok=True)
    (hold_dir / f"rank{rank()}.pid").write_text(f"{os.getpid()} {step}")
    time.sleep(seconds)
    raise InjectedFault(f"held after step {step} for {seconds:.0f} s and nobody killed this worker")


@dataclass
class Faults:
    """Which faults to inject: a crash (``fault_at``) or a hold (``hold_at``) after that step of a fresh start, and a
    non-finite loss on the steps in ``nan_at`` (counted from 1). 0 / empty: none."""

    fault_at: int = 0
    hold_at: int = 0
    nan_at: set[int] = field(default_factory=set)

    @classmethod
    def from_env(cls) -> "Faults":
        """RAYTRAIN_SCU_FAULT_AT_STEP, RAYTRAIN_SCU_HOLD_AT_STEP, RAYTRAIN_SCU_NAN_AT_STEPS (comma-separated); Ray
        passes RAYTRAIN_SCU_* to every worker."""
        env = os.environ
        return cls(fault_at=int(env.get("RAYTRAIN_SCU_FAULT_AT_STEP", "0") or 0),
                   hold_at=int(env.get("RAYTRAIN_SCU_HOLD_AT_STEP", "0") or 0),
                   nan_at={int(s) for s in env.get("RAYTRAIN_SCU_NAN_AT_STEPS", "").split(",") if s.strip()})

    def poison(self, step: int, nats):
        """The loss of step ``step`` (from 1), made non-finite when asked: a NaN loss and gradient on the real path."""
        return nats * float("nan") if step in self.nan_at else nats

    def after_step(self, step: int, *, fresh: bool) -> None:
        """Crash or hold after step ``step`` (from 1) of a run that did not resume from a checkpoint."""
        if self.fault_at and fresh and step == self.fault_at:
            raise InjectedFault(f"fault injected after step {step} (RAYTRAIN_SCU_FAULT_AT_STEP)")
        if self.hold_at and fresh and step == self.hold_at:
            hold_for_kill(step)
