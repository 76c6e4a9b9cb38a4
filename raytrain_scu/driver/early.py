"""The launch's checks that need neither torch, transformers nor Ray: the storage path takes writes, and the data
source is there and holds something. The train and sweep CLIs run them (:func:`check_inputs`) on the config as soon
as it is built, before anything imports the heavy libraries, so that a missing or empty data file or an unwritable
storage path fails within a second or two; :func:`~raytrain_scu.driver.preflight.preflight` runs them where its caller
did not. Every problem is a PreflightError naming the key at fault."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config
from raytrain_scu.core.data.sources import check_source
from raytrain_scu.errors import DataError, PreflightError


@contextlib.contextmanager
def as_preflight(*errors: type):
    """A lower layer's error, said as a PreflightError (the CLIs print it in one line and exit 2)."""
    try:
        yield
    except errors as e:
        raise PreflightError(str(e)) from None


def check_storage(cfg: Config) -> None:
    """A local run.storage_path must be writable (remote URIs are checked by Ray)."""
    paths = RunPaths.of(cfg)
    if paths.remote:
        return
    p = Path(paths.storage)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise PreflightError(f"run.storage_path={cfg.run.storage_path}: not writable ({e.strerror})") from None


def check_inputs(cfg: Config) -> None:
    """The storage path (:func:`check_storage`: the run's lock lives under it), then the data source's cheap checks
    (:func:`~raytrain_scu.core.data.sources.check_source`: the path exists, holds text or records, its first bytes
    decode; no tokenization, no full read)."""
    check_storage(cfg)
    d = cfg.data
    with as_preflight(DataError):
        check_source(d.source, d.path, d.text_field, d.format)
