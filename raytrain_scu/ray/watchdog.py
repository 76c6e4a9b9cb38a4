"""The hang watchdog: a rank that stops making progress (stopped with SIGSTOP, stuck in a collective) is seen from
outside its process, since a stopped process runs no thread of its own.

Every rank sends a heartbeat after completed steps to a small actor on the driver's node (:class:`Heartbeats`; the
worker side is :class:`Heartbeat`, called by ``RayHooks.heartbeat``): at most one per :func:`beat_every_s`, small
against the timeout, besides the first step's, a reporting step's and the last (None). The driver's
:class:`HangWatchdog` reads it every few seconds; once every rank of the current attempt has completed a step, no
step completing on any rank for ``train.hang_timeout_s`` (plus one beat interval) is a hang. It then SIGKILLs every
worker process of that attempt (a stopped process dies of SIGKILL too; one on another node through a task pinned to
that node), and Ray Train restarts the group from the last checkpoint, exactly as after a worker crash, within
``run.max_failures``. The clock of an attempt starts at its first completed step: building the
model, resuming and the first step's compile never count. An attempt one of whose ranks on the driver's node has
exited is a crash, not a hang: Ray Train is already tearing that group down, and the watchdog gives that another
``train.hang_timeout_s`` before it kills what is left of the group itself.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0)
class Heartbeats:
    """The ranks' last completed steps of the current attempt: ``{rank: (pid, node id, step, seconds since)}``."""

    def __init__(self):
        self.attempt, self.world, self.beats = 0, 0, {}

    def start_attempt(self, world: int) -> None:
        """Rank 0, as a worker group starts: the previous attempt's beats no longer count."""
        self.attempt, self.world, self.beats = self.attempt + 1, world, {}

    def beat(self, rank: int, pid: int, node_id: str, step: Optional[int]) -> None:
        """Rank ``rank`` completed ``step`` (None: it is done stepping)."""
        self.beats[rank] = (pid, node_id, step, time.monotonic())

    def read(self) -> tuple[int, int, dict]:
        now = time.monotonic()
        return self.attempt, self.world, {r: (pid, node, step, now - t) for r, (pid, node, step, t) in
                                          self.beats.items()}


def beat_every_s(timeout_s: float) -> float:
    """The least time between two heartbeats a rank sends: a tenth of the hang timeout, at most 1 s. A rank's newest
    completed step may be this much newer than its newest beat, so the watchdog waits this much beyond the timeout;
    at a second, a fast loop (many steps a second) sends one RPC a second per rank instead of one per step."""
    return min(1.0, timeout_s / 10)


class Heartbeat:
    """Worker side: sends rank ``rank``'s completed steps to the :class:`Heartbeats` actor ``actor``, without waiting,
    at most one per ``every_s`` seconds. Always sent: the first step of this attempt (the watchdog's clock starts when
    every rank has one), the step after a :meth:`reported` (what the watchdog's notice names as the last completed
    step is then the last reported one, where a checkpoint may be) and None (done stepping)."""

    def __init__(self, actor, rank: int, node_id: str, every_s: float, clock=time.monotonic):
        self.actor, self.rank, self.node_id, self.every_s, self.clock = actor, rank, node_id, every_s, clock
        self.pid = os.getpid()
        self.sent_at: Optional[float] = None  # None: nothing sent yet this attempt
        self.due = True

    def reported(self) -> None:
        """The loop reported this step: its beat is sent whatever the interval."""
        self.due = True

    def __call__(self, step: Optional[int]) -> None:
        now = self.clock()
        if step is not None and not self.due and now - self.sent_at < self.every_s:
            return
        self.sent_at, self.due = now, False
        self.actor.beat.remote(self.rank, self.pid, self.node_id, step)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def exited(pid: int) -> bool:
    """Whether process ``pid`` of this node has ended (gone, or a zombie not yet reaped)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def crashed(beats: dict, node_id: str) -> bool:
    """Whether a rank of the attempt that runs on node ``node_id`` has exited."""
    return any(node == node_id and exited(pid) for pid, node, _, _ in beats.values())


def stalled(world: int, beats: dict, timeout_s: float) -> Optional[float]:
    """Seconds since the last completed step on any rank when that exceeds ``timeout_s`` and every rank of the
    attempt is stepping (each has completed a step, none is done); None otherwise."""
    if world == 0 or len(beats) < world or any(step is None for _, _, step, _ in beats.values()):
        return None
    quiet = min(age for _, _, _, age in beats.values())
    return quiet if quiet > timeout_s else None


class HangWatchdog:
    """Driver side: reads :class:`Heartbeats` from a thread, while in a ``with`` block, and kills a hung attempt's
    workers. ``notices`` collects the lines the driver prints."""

    def __init__(self, timeout_s: float, poll_s: Optional[float] = None):
        self.timeout_s = timeout_s
        self.poll_s = poll_s or min(5.0, max(0.5, timeout_s / 10))
        self.beat_every_s = beat_every_s(timeout_s)
        here = ray.get_runtime_context().get_node_id()
        self.actor = Heartbeats.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote()
        self.node_id = here
        self.notices: list[str] = []
        self.handled: set[int] = set()  # attempts already killed
        self.crash_seen: dict[int, float] = {}  # attempt -> when a rank of it was first seen exited
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raytrain_scu-watchdog", daemon=True)

    def __enter__(self) -> "HangWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            self._thread.join(timeout=self.poll_s + 5)
        finally:  # the actor goes with the block, even when a second Ctrl-C lands in the join
            ray.kill(self.actor, no_restart=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                attempt, world, beats = ray.get(self.actor.read.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a busy cluster: look again at the next poll
                continue
            # the ranks' newest steps may be up to beat_every_s newer than their newest beats: never kill earlier
            quiet = None if attempt in self.handled else stalled(world, beats, self.timeout_s + self.beat_every_s)
            if quiet is not None and self.due(attempt, crashed(beats, self.node_id), time.monotonic()):
                self.handled.add(attempt)
                self._kill_attempt(beats, quiet)

    def due(self, attempt: int, has_exited_rank: bool, now: float) -> bool:
        """Whether a stalled attempt is killed now: at once, unless a rank of it has exited (a crash Ray Train is
        tearing down), which gets another ``timeout_s`` from when the exited rank was first seen."""
        if not has_exited_rank:
            return True
        return now - self.crash_seen.setdefault(attempt, now) > self.timeout_s

    def _kill_attempt(self, beats: dict, quiet: float) -> None:
        steps = sorted({step for _, _, step, _ in beats.values()})
        for rank, (pid, node, _, _) in sorted(beats.items()):
            if node == self.node_id:
                _kill(pid)
            else:  # a process on another node: killed there, by a task pinned to its node
                ray.remote(_kill).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node, soft=False)).remote(pid)
        self.notices.append(
            f"no step completed in {quiet:.0f} s (train.hang_timeout_s={self.timeout_s:g}; last completed step "
            f"{'/'.join(map(str, steps))}): killed the worker group (pids "
            f"{', '.join(str(b[0]) for _, b in sorted(beats.items()))}); Ray Train restarts it from the last "
            f"checkpoint (run.max_failures)")
