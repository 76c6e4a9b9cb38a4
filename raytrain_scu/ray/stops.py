"""The driver's Ctrl-C and SIGTERM while a run trains (``ray.launch.fit``): both stop the run after the step in
flight, with its checkpoint; what each raises once the run has stopped."""
from __future__ import annotations

import signal
import threading
import time

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config
from raytrain_scu.errors import Interrupted, Preempted

# what the first Ctrl-C (SIGINT) or SIGTERM (a preemption) says: the run stops after the step in flight, with its
# checkpoint
STOP_SAYS = {signal.SIGINT: "Ctrl-C: stopping after this step and writing its checkpoint (Ctrl-C again aborts without "
                            "one)",
             signal.SIGTERM: "SIGTERM: stopping after this step and writing its checkpoint, then exiting 143 (within "
                             "train.preempt_grace_s={grace:g} s)"}


class Stops:
    """Ctrl-C and SIGTERM while fit() runs (in the main thread, the only one that may handle signals). The first of
    either writes the run's stop flag (local storage): every rank stops after its next step and rank 0 checkpoints it;
    :meth:`raise_after` then raises :class:`Interrupted` (Ctrl-C) or :class:`Preempted` (SIGTERM) once fit() returns.
    The same signal again, or the first with remote storage (no flag), raises at once; :meth:`check` raises
    :class:`Preempted` once train.preempt_grace_s has passed since SIGTERM: whoever sent it kills this process soon."""

    def __init__(self, cfg: Config, progress, last: dict):
        self.flag, self.grace_s = RunPaths.of(cfg).stop_flag, cfg.train.preempt_grace_s
        self.progress, self.last, self.got, self.previous = progress, last, {}, {}

    def __enter__(self) -> "Stops":
        if self.flag is not None:
            self.flag.unlink(missing_ok=True)  # a leftover from a run killed hard would stop this one at its first step
        # run() called from another thread (a test, a notebook's worker) shows progress but leaves the signals to
        # whoever owns the main thread
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SAYS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.flag is not None:
            self.flag.unlink(missing_ok=True)

    def handle(self, signum, frame) -> None:
        """The signal handler: the first of a kind writes the stop flag and says so; the same one again raises."""
        self.got.setdefault(signum, []).append(time.monotonic())
        if len(self.got[signum]) > 1 or self.flag is None:
            raise (Preempted if signum == signal.SIGTERM else Interrupted)(self.last["step"], checkpointed=False)
        self.flag.parent.mkdir(parents=True, exist_ok=True)
        self.flag.write_text("stop\n")
        self.progress.close()
        print("[raytrain_scu] " + STOP_SAYS[signum].format(grace=self.grace_s), flush=True)

    def check(self) -> None:
        """While fit() runs: past train.preempt_grace_s since SIGTERM, the run is given up for preempted."""
        told = self.got.get(signal.SIGTERM)
        if told and time.monotonic() - told[0] > self.grace_s:
            raise Preempted(self.last["step"], checkpointed=False)

    def raise_after(self, max_steps: int) -> None:
        """fit() returned: short of ``max_steps`` after a signal, the run stopped for it."""
        if self.last["step"] == max_steps:
            return
        if signal.SIGTERM in self.got:
            raise Preempted(self.last["step"], checkpointed=self.last["checkpoint"])
        if signal.SIGINT in self.got:
            raise Interrupted(self.last["step"], checkpointed=self.last["checkpoint"])
