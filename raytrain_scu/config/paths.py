"""Where a run lives: one object computed from ``run.storage_path``, ``run.name`` and ``run.output_dir``, so no other
module parses a storage path or joins a run directory itself."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raytrain_scu.config.schema import Config


def storage_dir(storage_path: str) -> str:
    """``run.storage_path`` made absolute (``~`` expanded); a remote URI (``s3://``, ``gs://``) unchanged."""
    return storage_path if is_remote(storage_path) else os.path.abspath(os.path.expanduser(storage_path))


def is_remote(path: str) -> bool:
    """A URI (``s3://``, ``gs://``, ...) rather than a path on this machine's (or a shared) filesystem."""
    return "://" in path


@dataclass(frozen=True)
class RunPaths:
    """A run's places. ``run`` is Ray's run directory (checkpoints), the MLflow run key and the parent of ``output/``:
    a string, since it may be a remote URI. The file-based paths (the stop flag, the lock, logs, profiles) exist only
    for local or shared-filesystem storage and are None for a remote one."""

    storage: str
    run: str
    remote: bool
    output_override: str = ""

    @classmethod
    def of(cls, cfg: Config) -> "RunPaths":
        storage = storage_dir(cfg.run.storage_path)
        return cls(storage=storage, run=f"{storage}/{cfg.run.name}", remote=is_remote(storage),
                   output_override=cfg.run.output_dir)

    @property
    def local(self) -> Optional[Path]:
        """The run directory as a local Path; None for remote storage."""
        return None if self.remote else Path(self.run)

    def _under(self, name: str) -> Optional[Path]:
        return None if self.remote else Path(self.run) / name

    @property
    def output(self) -> str:
        """Where the exported adapter(s), config.yaml and summary.json go: ``run.output_dir``, else
        ``<run dir>/output`` (a URI under remote storage)."""
        if self.output_override:
            return os.path.abspath(os.path.expanduser(self.output_override))
        return f"{self.run}/output"

    @property
    def stop_flag(self) -> Optional[Path]:
        """``<run dir>/STOP``: the driver writes it on Ctrl-C and rank 0 stops the run after the step that sees it."""
        return self._under("STOP")

    @property
    def lock(self) -> Optional[Path]:
        """``<run dir>/.lock``: held by the one process that launches this run."""
        return self._under(".lock")

    @property
    def logs(self) -> Optional[Path]:
        """``<run dir>/logs``: the workers' log files, copied at the end of a run."""
        return self._under("logs")

    @property
    def profile(self) -> Optional[Path]:
        """``<run dir>/profile``: each rank's profiler table (``train.profile_steps``)."""
        return self._under("profile")

    @property
    def default_tracking_uri(self) -> str:
        """The MLflow store runs use when ``tracking.uri`` is empty: a sqlite file beside the run directories."""
        return f"sqlite:///{self.storage}/mlflow.db"


def run_dir(cfg: Config) -> str:
    """``RunPaths.of(cfg).run``: the run's directory (a string: it may be a remote URI)."""
    return RunPaths.of(cfg).run
