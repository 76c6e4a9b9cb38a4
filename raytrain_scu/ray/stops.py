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
    :class:`Preempted` once train.preempt_grace_s has passed since SIGTERM: whoever sent it kills this process soon.
    Each carries the last report's step and whether that report had a checkpoint.

    The handler writes no console output: a signal that lands while the main thread prints (the progress line) would
    make a print inside it a reentrant call on stdout. :meth:`check`, in fit()'s poll loop, says what it did."""

    def __init__(self, cfg: Config, progress, last: dict):
        self.flag, self.grace_s = RunPaths.of(cfg).stop_flag, cfg.train.preempt_grace_s
        self.progress, self.last, self.got, self.previous = progress, last, {}, {}
        self.unsaid: list = []  # the signals whose stop the console has not been told of yet

    def __enter__(self) -> "Stops":
        if self.flag is not None:
            self.flag.unlink(missing_ok=True)  # a leftover from a run killed hard would stop this one at its first step
        # run() called from another thread (a test, a notebook's worker) shows progress but leaves the signals to
        # whoever owns the main thread
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SAYS}
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.flag is not None:
            self.flag.unlink(missing_ok=True)
        if exc_type is None:
            self.say()  # a signal taken after the last poll

    def stopped(self, signum, why: str = "") -> Interrupted:
        """What the run stopped for: the last report's step and whether it carried a checkpoint."""
        kind = Preempted if signum == signal.SIGTERM else Interrupted
        return kind(self.last["step"], checkpointed=self.last["checkpoint"], why=why)

    def handle(self, signum, frame) -> None:
        """The signal handler: the first of a kind writes the stop flag (:meth:`check` says so); the same one again,
        or any with no flag to write, raises."""
        self.got.setdefault(signum, []).append(time.monotonic())
        if self.flag is None:
            raise self.stopped(signum, why="remote storage has no stop flag: the run cannot stop after a step")
        if len(self.got[signum]) > 1:
            raise self.stopped(signum, why="a second " + ("SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"))
        self.flag.parent.mkdir(parents=True, exist_ok=True)
        self.flag.write_text("stop\n")
        self.unsaid.append(signum)

    def say(self) -> None:
        """The console line of each stop asked for since the last call."""
        while self.unsaid:
            self.progress.close()
            print("[raytrain_scu] " + STOP_SAYS[self.unsaid.pop(0)].format(grace=self.grace_s), flush=True)

    def check(self) -> None:
        """While fit() runs (its poll loop): say the stops asked for; past train.preempt_grace_s since SIGTERM, the
        run is given up for preempted."""
        self.say()
        told = self.got.get(signal.SIGTERM)
        if told and time.monotonic() - told[0] > self.grace_s:
            raise self.stopped(signal.SIGTERM, why=f"train.preempt_grace_s={self.grace_s:g} s ran out before the "
                                                   f"step in flight was checkpointed")

    def raise_after(self, max_steps: int) -> None:
        """fit() returned: short of ``max_steps`` after a signal, the run stopped for it."""
        if self.last["step"] == max_steps:
            return
        if signal.SIGTERM in self.got:
            raise self.stopped(signal.SIGTERM)
        if signal.SIGINT in self.got:
            raise self.stopped(signal.SIGINT)
