"""One launch per run: an exclusive lock the driver takes before Ray starts and holds until the run ends.

Local storage: ``<run dir>/.lock``, held with ``flock`` on an open descriptor, and a holder record in the file (host,
pid, start time, command) that a second launch names in its error (:class:`~raytrain_scu.errors.RunLocked`, exit 2).
The kernel drops a flock when its process dies, however it dies, so a record left by a killed driver sits in a lock
nobody holds: the next launch takes it over and says whose it was. A clean end empties the record.

Shared filesystems: on NFS, Linux turns ``flock`` into an NFS byte-range lock (NLM for v3, the protocol's own for
v4), which the server arbitrates across clients, unless the share is mounted with ``local_lock=flock`` or ``all``
(then it excludes launches on one client only). A lock of a client that crashed is freed when the server's lease
runs out (NFSv4: 90 s by default). Remote object storage (``s3://``) has no lock a client can take: the lock then
lives on the driver's machine (``RunPaths.local_state``), so two launches from one machine (the head, where ``ray
job submit`` runs drivers) exclude each other and launches from different machines do not.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config
from raytrain_scu.errors import RunLocked

_held: set[str] = set()  # the locks this process holds: a nested take is a no-op (a flock would refuse its own)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode(errors="replace").strip()
    try:
        record = json.loads(text) if text else {}
    except ValueError:
        record = {"unreadable": text[:200]}
    return record if isinstance(record, dict) else {}


def _write(fd: int, record: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    os.fsync(fd)


def describe(record: dict) -> str:
    """A holder record in words: ``pid P on host H since T (command)``."""
    if not record:
        return "a process that left no record"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return (f"pid {record.get('pid')} on host {record.get('host')} since {since}"
            + (f" ({record['command']})" if record.get("command") else ""))


def _refusal(cfg: Config, path: Path, record: dict) -> RunLocked:
    gone = (record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int)
            and not _alive(record["pid"]))
    why = (f"; that pid is gone, so a process it started still holds the lock (`fuser -v {path}` names it)"
           if gone else "")
    return RunLocked(f"run {cfg.run.name} is already being trained: its lock {path} is held by {describe(record)}"
                     f"{why}. Wait for that run to end (or stop it), or use another run.name.")


def acquire(cfg: Config) -> tuple[int, Optional[dict]]:
    """Take the run's lock without waiting: ``(descriptor, the stale record taken over or None)``. Raises
    :class:`RunLocked` naming the holder when another live process has it."""
    path = RunPaths.of(cfg).lock
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        record = _read(fd)
        os.close(fd)
        raise _refusal(cfg, path, record) from None
    stale = _read(fd) or None  # a record in a lock nobody held: its holder died without releasing it
    _write(fd, {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                "command": " ".join(sys.argv)[:300]})
    return fd, stale


def release(fd: int) -> None:
    """Empty the holder record (a clean end leaves nothing to take over), then drop the lock."""
    try:
        os.ftruncate(fd, 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextlib.contextmanager
def run_lock(cfg: Config) -> Iterator[None]:
    """Hold the run's lock for the block (a no-op when this process holds it already). A stale lock is taken over
    with a notice on stderr."""
    key = str(RunPaths.of(cfg).lock)
    if key in _held:
        yield
        return
    fd, stale = acquire(cfg)
    if stale is not None:
        print(f"[raytrain_scu] took over the stale lock of run {cfg.run.name}: its holder, {describe(stale)}, "
              f"is gone", file=sys.stderr, flush=True)
    _held.add(key)
    try:
        yield
    finally:
        _held.discard(key)
        release(fd)
