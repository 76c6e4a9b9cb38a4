"""The package's error types, in one place: every layer may raise them, and the CLIs map them to exit codes.

Bad input (exit 2, one ``error:`` line, before any worker starts where possible) is a :class:`UserError`: the
message names the key or file at fault and what would do. A failed run (exit 1) is any other error; the ones the
package raises itself are below too, so the driver can say what happened in one line.
"""
from __future__ import annotations

from typing import Optional


class UserError(ValueError):
    """Bad input found before or while launching: the CLIs print ``error: <message>`` and exit 2."""


class ConfigError(UserError):
    """A config problem; the message names the key and what was expected."""


class NotEnoughResources(ConfigError):
    """The Ray cluster has fewer GPUs (or CPUs) than the run's workers ask for; Ray would wait for them forever.
    ``scaling.*`` is at fault."""


class PreflightError(UserError):
    """A problem found on the driver before any Ray worker starts (storage, model, data, machine)."""


class MemoryFitError(UserError):
    """The run cannot fit on the card; the message names what would."""


class SweepError(UserError):
    """A sweep that cannot run as configured (its space, its storage, its data)."""


class EvalError(UserError):
    """An evaluation that cannot run as asked (no adapter, no held-out text, a bad CLI argument)."""


class GenerateError(UserError):
    """A generation that cannot run as asked (no run directory, no adapter in it)."""


class RunsError(UserError):
    """A runs listing that cannot run as asked (no such storage path, no such run in it)."""


class RunLocked(UserError):
    """Another live process holds the run directory's lock: two launches must never write one run."""


class ModelError(ValueError):
    """The model cannot be found, built or converted as configured."""


class DataError(ValueError):
    """The data source cannot be read or gives too little text."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or does not fit this run."""


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row were skipped: a non-finite loss, or (without fp16 loss scaling) a non-finite
    gradient."""


class NotLearningError(RuntimeError):
    """The LoRA B matrices are still exactly zero after optimizer steps: no data gradient reached the adapters."""


class DiskFullError(RuntimeError):
    """No space was left for a write the run needs (a checkpoint, the exported adapter); the message names the path
    and the free space there. The checkpoint before it stays intact, and a re-run resumes from it once space is
    freed."""


class DeviceOutOfMemory(RuntimeError):
    """The accelerator ran out of memory; the message names the phase (a training step, an evaluation, a checkpoint),
    the micro-batch and the memory estimate, and what would fit."""


class InjectedFault(RuntimeError):
    """A failure raised on purpose by fault injection (tests and reliability drills)."""


class DidNotTrain(RuntimeError):
    """A timed bench part whose loop did not learn: its figure does not count."""


class AblationError(RuntimeError):
    """A study stage that cannot run or whose results break its own rules."""


class Interrupted(Exception):
    """Ctrl-C stopped the run at ``step`` (the last report; None: before the first), with a checkpoint of that step
    or without one. ``why``: what stopped it without waiting for the step in flight's checkpoint ("" when it
    waited)."""

    def __init__(self, step: Optional[int], checkpointed: bool, why: str = ""):
        super().__init__(f"interrupted at step {step}" + (f" ({why})" if why else ""))
        self.step, self.checkpointed, self.why = step, checkpointed, why


class Preempted(Interrupted):
    """A SIGTERM to the driver (a preemption: a spot reclaim, a pod's deletion) stopped the run at ``step`` (the last
    report; None: before the first), with a checkpoint of that step or without one; ``why`` as for
    :class:`Interrupted` (train.preempt_grace_s ran out, a second SIGTERM, remote storage)."""


# what the CLIs catch as bad input (exit 2)
USER_ERRORS = (UserError,)
