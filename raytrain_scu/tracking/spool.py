"""Rank 0's metric points on disk until the MLflow store has them: an outage of the tracking server, or a crash of
rank 0, loses none and records none twice.

``<run dir>/mlflow_buffer.jsonl`` holds the points, one JSON line each, with their step and the time they were
logged; ``mlflow_buffer.json`` beside it holds the byte offset up to which the store has them (``sent``), the length
of the appends made whole (``end``), the highest step they hold (``through``) and how many were dropped. Points are
appended at each report and sent from ``sent`` on; the offset moves after each batch the store accepted. Three
properties make it exactly once:

- an append counts once the state that says so is saved: opening the spool cuts the file back to ``end``, so an
  append the process died in (some lines of a report, or all of them without the state) goes whole, and its steps,
  above ``through``, are logged again when they are redone;
- a batch sent but not yet marked (a crash in between) is sent again after a restart, with the same keys, steps,
  values and timestamps, which MLflow's SQL store keeps once (a metric's key, step, timestamp and value are its
  primary key);
- a restarted rank 0 skips the steps up to ``through``, which are on disk already: the steps it redoes after
  resuming from an older checkpoint are not logged a second time.

Bounded: past ``max_points`` waiting points the oldest are dropped, and counted.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

from raytrain_scu.core.crashpoints import crash_point

SEND_BATCH = 1000  # metric points per MLflow log_batch call: its limit

class MetricSpool:
    """The on-disk buffer of one run's metric points, in the files this module's docstring describes."""

    def __init__(self, path: Path, max_points: int):
        self.path, self.state_path, self.max_points = path, path.with_suffix(".json"), max_points
        state = self._load_state()
        self.sent, self.through, self.dropped = state["sent"], state["through"], state["dropped"]
        self.end = self._cut_back(state["end"])
        # a file shorter than the offset sent (gone, or cut back where the state had no end): what it holds was sent,
        # and what is appended from here on is sent from its start
        self.sent = min(self.sent, self.end)
        self.waiting = sum(1 for _ in self._lines()) if self.path.exists() else 0

    def _cut_back(self, end) -> int:
        """Cut the file back to ``end``, the appends made whole, and return its length: what follows is an append the
        process died in. With ``end`` None, every whole line stays and a line written half goes."""
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1
        keep = whole if end is None else min(end, whole)
        if keep < len(data):
            os.truncate(self.path, keep)
        return keep

    def _load_state(self) -> dict:
        """The saved state; with none saved, no append counts yet (``end`` 0). A state that cannot be read, or one
        without ``end``, has ``end`` None: every whole line stays (a point sent again is kept once by the store)."""
        default = {"sent": 0, "through": -1, "dropped": 0}
        if not self.state_path.exists():
            return {**default, "end": 0}
        try:
            return {**default, "end": None, **json.loads(self.state_path.read_text())}
        except (OSError, ValueError):
            return {**default, "end": None}

    def _save_state(self) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps({"sent": self.sent, "through": self.through, "dropped": self.dropped,
                                   "end": self.end}))
        crash_point("spool.state")
        os.replace(tmp, self.state_path)

    def append(self, points: list) -> None:
        """Put ``points`` on disk (synced), drop the oldest waiting ones past ``max_points``, then save the state that
        makes the append count."""
        if not points:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        size = self.end
        crash_point("spool.append")
        try:
            with open(self.path, "ab") as f:
                for m in points:  # a line at a time: what a crash inside the append leaves is whole lines
                    f.write(json.dumps({"k": m.key, "v": m.value, "t": m.timestamp, "s": m.step}).encode() + b"\n")
                    f.flush()
                    crash_point("spool.line")
                os.fsync(f.fileno())
                end = f.tell()
        except OSError:
            with contextlib.suppress(OSError):  # whole lines only: a part written before the error goes
                os.truncate(self.path, size)
            raise
        self.end = end
        self.waiting += len(points)
        self.through = max(self.through, max(m.step for m in points))
        if self.waiting > self.max_points:
            self._drop(self.waiting - self.max_points)
        self._save_state()

    def _drop(self, n: int) -> None:
        for offset, _ in self._lines(limit=n):
            self.sent = offset
        self.waiting -= n
        self.dropped += n

    def _lines(self, limit: int = 0) -> Iterator[tuple[int, dict]]:
        """``(offset after the line, point)`` of the waiting points, oldest first; a torn last line is left out."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.sent)
            count = 0
            while (line := f.readline()).endswith(b"\n"):  # a torn last line: written half as the process died
                count += 1
                yield f.tell(), json.loads(line)
                if limit and count >= limit:
                    return

    def batches(self, size: int = SEND_BATCH) -> Iterator[tuple[int, list]]:
        """``(offset after the batch, its points as MLflow Metrics)`` of the waiting points, oldest first."""
        from mlflow.entities import Metric  # imported on the first send: importing mlflow takes seconds

        batch, offset = [], self.sent
        for offset, p in self._lines():
            batch.append(Metric(p["k"], p["v"], p["t"], p["s"]))
            if len(batch) == size:
                yield offset, batch
                batch = []
        if batch:
            yield offset, batch

    def mark_sent(self, offset: int, n: int) -> None:
        """The store has the points up to ``offset`` (``n`` of them). With none left waiting the file starts over,
        the state first: after a crash between the two, opening the spool cuts the file back to the state's ``end``,
        0, so nothing is sent twice."""
        self.sent, self.waiting = offset, self.waiting - n
        if self.waiting == 0:
            self.sent = self.end = 0
            self._save_state()
            crash_point("spool.reset")
            self.path.write_bytes(b"")
            return
        self._save_state()
