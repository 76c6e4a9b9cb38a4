"""Named points on the run's write paths (checkpoint files, their sync and commit, the metric spool, the MLflow calls)
where a fault test kills this process, as a lost machine or the kernel's OOM killer would: SIGKILL, so no ``finally``
block, ``atexit`` handler or buffered write runs.

``RAYTRAIN_SCU_CRASH_AT=<point>:<n>`` kills the process the ``n``-th time (from 1) it reaches ``<point>``; with ``n``
= 0 it never fires and the process only counts the points it reaches (:data:`reached`), which is how a test lists
them. Unset, :func:`crash_point` returns at once. docs/reliability.md lists the points.

Each process counts its own, whatever its role. Most points are on rank 0's writes, but under Ray the variable is
the driver's too (the workers get it from the driver's environment), and the driver reaches points of its own: it
opens the run (``mlflow.run_created``), and a sweep's driver logs the parent's and each trial's params
(``mlflow.params``). Such a point kills the driver, at its own count. The crash-point test runs the loop alone
(``LocalHooks``): one process that is rank 0 and opens the run.
"""
from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "RAYTRAIN_SCU_CRASH_AT"
reached: Counter = Counter()  # point -> times reached in this process, while ENV is set


def crash_point(name: str) -> None:
    """Count ``name``; SIGKILL this process when RAYTRAIN_SCU_CRASH_AT names it and this is the wanted occurrence."""
    at = os.environ.get(ENV)
    if not at:
        return
    point, _, n = at.rpartition(":")
    if not point or not n.isdigit():
        raise ValueError(f"{ENV}={at!r}: expected <point>:<n>, e.g. checkpoint.manifest:2 (n = 0: count only)")
    reached[name] += 1
    if name == point and reached[name] == int(n):
        os.kill(os.getpid(), signal.SIGKILL)
