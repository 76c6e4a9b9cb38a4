"""This worker's Ray Train preemption notice, read and set in one place. Ray 2.60 keeps it in the worker's train
context (``preemption_context.preemption_info``), where its preemption watcher puts a drained node's notice; no public
API sets it, so this module alone reaches into ``ray.train.v2._internal``. It imports only Ray: the Train controller
unpickles ``ray.callbacks``, which uses it."""
from __future__ import annotations

from typing import Optional

from ray.train import PreemptionInfo
from ray.train.v2._internal.execution.context import get_train_context


class Notice:
    """This worker's preemption notice, in its train context (looked up once, here: a signal handler then reads and
    sets it without touching Ray's context machinery); with the worker's rank and its training function's runner."""

    def __init__(self):
        context = get_train_context()
        self.place, self.rank = context.preemption_context, context.get_world_rank()
        self.loop = context.execution_context.training_thread_runner  # is_running(): whether the loop runs

    def held(self) -> Optional[PreemptionInfo]:
        """The notice this worker holds (a node of its group is going), or None."""
        return self.place.preemption_info

    def give(self, deadline_s: float, node_to_ranks: Optional[dict] = None) -> None:
        """Hand this worker a notice with the deadline ``deadline_s`` (``time.time()`` seconds), naming the
        ``node_to_ranks`` going (default: those of the notice it holds, else none). Safe in a signal handler: it
        only assigns an object."""
        if node_to_ranks is None:
            told = self.place.preemption_info
            node_to_ranks = told.preempted_node_to_ranks if told is not None else {}
        self.place.preemption_info = PreemptionInfo(deadline_ms=int(deadline_s * 1000),
                                                    preempted_node_to_ranks=node_to_ranks)
