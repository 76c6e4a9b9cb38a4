"""Ray Train callbacks: what runs inside a Train controller. The controller unpickles them before it starts the
workers, so this module imports only Ray, the standard library and ``ray.preemption`` (Ray alone): importing the
package's worker stack (torch, transformers, peft) there would add seconds to every run's start.

- :class:`Sink` and :class:`WorkersStarted`: each report's rank-0 metrics and each start of the worker group, in a
  JSON-lines file the driver reads (``launch.fit`` shows them).
- :class:`NotePlacementGroup`: a sweep trial's (controller, placement group), handed to the sweep's driver, which
  removes the group once the controller is gone (``tune.sweep.PlacementGroupReaper``).
- :class:`PreemptOnSigterm`: in each training worker, a SIGTERM to its process becomes Ray Train's own preemption
  notice.
"""
from __future__ import annotations

import json
import logging
import signal
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.train import UserCallback
from ray.train.v2._internal.execution.callback import WorkerCallback, WorkerGroupCallback

from raytrain_scu.ray.preemption import Notice

logger = logging.getLogger(__name__)


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class WorkersStarted(WorkerGroupCallback):
    """In the Ray Train controller: a line ``{"workers_started": n}`` in the sink's file at each start of the worker
    group, the end of Ray's part of the wait before the first report (Ray Train hands a UserCallback no such
    hook)."""

    def __init__(self, path: Path):
        self.path, self.starts = path, 0

    def after_worker_group_start(self, worker_group):
        self.starts += 1
        _append(self.path, {"workers_started": self.starts})


class Sink(UserCallback):
    """Runs in the Ray Train controller (always on the driver's node): appends each report's rank-0 metrics and
    whether it carried a checkpoint to a JSON-lines file the driver reads (:meth:`read`); with :meth:`callbacks`, the
    worker group's starts too."""

    def __init__(self):
        self.path = Path(tempfile.mkdtemp(prefix="raytrain_scu-")) / "reports.jsonl"
        self.path.touch()
        self.offset = 0

    def callbacks(self) -> list:
        """What ``build_trainer`` takes: this sink and the worker group's start notes."""
        return [self, WorkersStarted(self.path)]

    def after_report(self, run_context, metrics, checkpoint):
        _append(self.path, {"metrics": metrics[0], "checkpoint": checkpoint is not None})

    def read(self) -> list[dict]:
        """The driver side: the records written since the last call, whole lines only."""
        with open(self.path) as f:
            f.seek(self.offset)
            text = f.read()
        done = text[:text.rfind("\n") + 1]
        self.offset += len(done.encode())
        return [json.loads(line) for line in done.splitlines()]


class NotePlacementGroup(WorkerGroupCallback):
    """In a trial's Train controller: hand (this controller, its workers' placement group) to the sweep's driver.

    A Train run's placement group outlives its controller while the job lives, and Ray Train's own cleaner asks the
    state API, which answers for this cluster only where it has a dashboard of its own (docs/reliability.md), and
    whose address its process may fail to resolve (several Ray instances on a node). Without a cleanup, every trial
    ASHA stops keeps its workers' CPUs/GPUs until the sweep ends, and later trials wait for them forever.
    """

    def __init__(self, queue):
        self.queue = queue

    def after_worker_group_start(self, worker_group):
        pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
        self.queue.put((ray.get_runtime_context().current_actor, pg))


class PreemptOnSigterm(WorkerCallback):
    """In each training worker: a SIGTERM to the worker's process while its loop runs becomes Ray Train's own
    preemption notice for this worker, the one its preemption watcher hands every worker when Ray drains a node
    (``mark_preempt``), with a deadline ``grace_s`` (train.preempt_grace_s) ahead. The loop then checkpoints the step
    in flight on every rank and Ray Train restarts the group from that checkpoint
    (``ray.hooks.RayHooks.await_restart``), counted against ``FailureConfig.max_preemption_failures``, not
    ``run.max_failures``. Otherwise (a notice is in already, no loop runs, or Ray Train is shutting the worker down:
    the group's teardown) Ray's own handler ends the process at once, as without this."""

    def __init__(self, grace_s: float):
        self.grace_s, self.shutting_down = grace_s, False

    def after_init_train_context(self):
        # a task of the worker actor, so its main thread: the only one that may set a signal handler
        if threading.current_thread() is not threading.main_thread():
            logger.warning("SIGTERM is not turned into a preemption notice: the worker's callback ran off its main "
                           "thread")
            return
        # Ray's handler, or the default where none was set from Python (getsignal gives None)
        previous = signal.getsignal(signal.SIGTERM)
        previous = signal.SIG_DFL if previous is None else previous
        notice, node, told = Notice(), ray.get_runtime_context().get_node_id(), threading.Event()
        rank = notice.rank

        def on_sigterm(signum, frame):
            # no logging in here: a signal landing while this thread writes a log line would re-enter its stream
            if self.shutting_down or notice.held() is not None or not notice.loop.is_running():
                signal.signal(signal.SIGTERM, previous)
                signal.raise_signal(signal.SIGTERM)
                return
            notice.give(time.time() + self.grace_s, {node: [rank]})
            told.set()

        def say_told():  # the handler's line, from a thread of its own
            told.wait()
            logger.warning(f"rank {rank} got SIGTERM: checkpointing the step in flight within "
                           f"train.preempt_grace_s={self.grace_s:g} s, then Ray Train restarts the worker group")

        threading.Thread(target=say_told, name="raytrain_scu-sigterm-note", daemon=True).start()
        signal.signal(signal.SIGTERM, on_sigterm)

    def before_worker_shutdown(self):
        # Ray Train stops this worker (the run's end, a restart): a SIGTERM from here on is its teardown's
        self.shutting_down = True
