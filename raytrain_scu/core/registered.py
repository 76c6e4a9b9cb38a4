"""Which checkpoints a run's runner registered: the record in its run directory that tells a copy cut short (never
registered: the runner hands the workers no such checkpoint) from a registered checkpoint damaged afterwards (the
runner hands it over, and resuming from it fails). Ray Train writes its checkpoint manager's snapshot once a reported
checkpoint is copied and registered; ``worker.hooks.LocalHooks`` keeps its own record the same way."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

# the record of the checkpoints a run's runner registered, in its run directory: Ray Train's snapshot of its
# checkpoint manager (written once a reported checkpoint's copy is complete and registered), and LocalHooks' own
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
LOCAL_RECORD = "committed_checkpoints.json"


def _names(record: Path) -> Optional[set[str]]:
    """The checkpoint names one record lists (none when it is not there); None when it cannot be read."""
    if not record.is_file():
        return set()
    try:
        data = json.loads(record.read_text())
        results = [*data.get("checkpoint_results", []), *data.get("pending_training_results", []),
                   data.get("latest_checkpoint_result") or {}]
        return {r["checkpoint_dir_name"] for r in results if r} | set(data.get("checkpoints", []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def registered_checkpoints(run_dir: str | Path) -> Optional[set[str]]:
    """The names of the checkpoints the runner of ``run_dir`` registered: those Ray Train's snapshot lists (kept,
    latest, pending) and those in LocalHooks' record; an empty set with neither record. None when a record is there
    but cannot be read: then no checkpoint may be taken for a copy cut short."""
    ray_names, local_names = _names(Path(run_dir) / RAY_SNAPSHOT), _names(Path(run_dir) / LOCAL_RECORD)
    return None if ray_names is None or local_names is None else ray_names | local_names


def record_committed(run_dir: str | Path, name: str) -> None:
    """LocalHooks: checkpoint ``name`` is whole in ``run_dir`` (its copy done), as Ray Train registers one; the record
    is replaced in one rename, so it lists a checkpoint or does not."""
    path = Path(run_dir) / LOCAL_RECORD
    names = sorted((_names(path) or set()) | {name})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"checkpoints": names}))
    os.replace(tmp, path)


def score_snapshot(run_dir: str | Path, key: str, unscored: float) -> int:
    """Ray Train's snapshot (its checkpoints ranked under ``checkpoint_score_order="min"``) in ``run_dir`` of a run whose checkpoints were reported without their own score ``key``:
    each listed checkpoint without it gets its own step's held-out BPT (``val/data_bpt`` where ``val/step`` is its
    step) or ``unscored``, as the run's new checkpoints are reported. Ray reads the snapshot back when the run
    resumes, and it ranks a checkpoint without the key best under "min": such a checkpoint would never be deleted,
    and each newly evaluated best would be, under ``run.num_to_keep``. Rewritten in one rename; returns how many
    checkpoints it scored (0 when there is no snapshot, every one has its score, or it cannot be read: Ray then says
    so itself when it reads it)."""
    path = Path(run_dir) / RAY_SNAPSHOT
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    results = [*data.get("checkpoint_results", []), *data.get("pending_training_results", []),
               data.get("latest_checkpoint_result") or {}]
    scored = set()  # the snapshot lists the latest checkpoint twice: among the kept ones and as the latest
    for result in results:
        metrics = result.get("metrics")
        if metrics is None or key in metrics:
            continue
        own = metrics.get("val/step") == metrics.get("step") and metrics.get("val/data_bpt") is not None
        metrics[key] = float(metrics["val/data_bpt"]) if own else unscored
        scored.add(result.get("checkpoint_dir_name"))
    if scored:
        # Ray keeps the list sorted, best last (under "min", as ray.launch sets: the highest score first), ties by
        # report order, and reads it back as it is: sorted again by the new scores, its report indices with it
        ranked = sorted(zip(data["checkpoint_results"], data["checkpoint_report_indices"]),
                        key=lambda pair: (-pair[0]["metrics"][key], pair[1]))
        data["checkpoint_results"] = [result for result, _ in ranked]
        data["checkpoint_report_indices"] = [index for _, index in ranked]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    return len(scored)
