"""Where a run lives: one object computed from ``run.storage_path``, ``run.name`` and ``run.output_dir``, so no other
module parses a storage path or joins a run directory itself.

A remote storage path may carry pyarrow's filesystem options as a query, e.g.
``s3://bucket/runs?endpoint_override=http://127.0.0.1:9000`` for an S3-compatible server: Ray Train takes the URI
whole, and the package's own reads and writes (:meth:`RunPaths.uri`) append the same query to the paths they open.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raytrain_scu.config.schema import CACHE_DIR, Config


def storage_dir(storage_path: str) -> str:
    """``run.storage_path`` made absolute (``~`` expanded); a remote URI (``s3://``, ``gs://``) unchanged."""
    return storage_path if is_remote(storage_path) else os.path.abspath(os.path.expanduser(storage_path))


def is_remote(path: str) -> bool:
    """A URI (``s3://``, ``gs://``, ...) rather than a path on this machine's (or a shared) filesystem."""
    return "://" in path


def split_query(uri: str) -> tuple[str, str]:
    """``(path, "?query")`` of a remote URI (``("s3://b/runs", "?endpoint_override=...")``); a local path whole, with
    no query."""
    if not is_remote(uri) or "?" not in uri:
        return uri, ""
    path, query = uri.split("?", 1)
    return path.rstrip("/"), "?" + query


def cache_root() -> Path:
    """This machine's cache directory: ``RAYTRAIN_SCU_CACHE``, else :data:`~raytrain_scu.config.schema.CACHE_DIR`."""
    return Path(os.path.expanduser(os.environ.get("RAYTRAIN_SCU_CACHE") or CACHE_DIR))


@dataclass(frozen=True)
class RunPaths:
    """A run's places. ``run`` is Ray's run directory (checkpoints), the MLflow run key and the parent of ``output/``:
    a string, since it may be a remote URI (without its query: :meth:`uri` adds it). The file-based paths (the stop
    flag, logs, profiles) exist only for local or shared-filesystem storage and are None for a remote one; the lock and
    the metric buffer of a remote run live on the driver's and rank 0's machine (:attr:`local_state`)."""

    storage: str
    run: str
    remote: bool
    output_override: str = ""
    query: str = ""  # a remote URI's filesystem options ("?endpoint_override=..."), "" for none

    @classmethod
    def of(cls, cfg: Config) -> "RunPaths":
        storage, query = split_query(storage_dir(cfg.run.storage_path))
        return cls(storage=storage, run=f"{storage}/{cfg.run.name}", remote=is_remote(storage),
                   output_override=cfg.run.output_dir, query=query)

    @property
    def ray_storage(self) -> str:
        """What Ray Train's ``storage_path`` gets: the storage with its query."""
        return self.storage + self.query

    def uri(self, path: str) -> str:
        """``path`` (under this storage) with the storage's query, as pyarrow's ``FileSystem.from_uri`` takes it."""
        return path + self.query if self.remote else path

    @property
    def local(self) -> Optional[Path]:
        """The run directory as a local Path; None for remote storage."""
        return None if self.remote else Path(self.run)

    def _under(self, name: str) -> Optional[Path]:
        return None if self.remote else Path(self.run) / name

    @property
    def output_remote(self) -> bool:
        """Whether :attr:`output` is on remote storage (no ``run.output_dir`` under a remote storage path)."""
        return self.remote and not self.output_override

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
    def local_state(self) -> Path:
        """A directory on this machine for what must outlive a process: the run directory itself for local storage;
        for remote storage, one per run URI under the cache directory (``RAYTRAIN_SCU_CACHE``)."""
        if not self.remote:
            return Path(self.run)
        return cache_root() / "remote-runs" / hashlib.sha256(self.run.encode()).hexdigest()[:16]

    @property
    def lock(self) -> Path:
        """``<run dir>/.lock``: held by the one process that launches this run (for remote storage, on the driver's
        machine: :attr:`local_state`)."""
        return self.local_state / ".lock"

    @property
    def metric_buffer(self) -> Path:
        """``<run dir>/mlflow_buffer.jsonl``: rank 0's metric points until MLflow has them (remote storage: on rank
        0's machine, :attr:`local_state`)."""
        return self.local_state / "mlflow_buffer.jsonl"

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
