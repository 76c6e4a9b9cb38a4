"""Reading and writing directories on a run's storage when it is remote (``s3://``, ``gs://``), through pyarrow's
filesystems, the way Ray Train reaches the same storage. A URI may carry pyarrow's options as a query
(``s3://bucket/path?endpoint_override=http://host:9000``); credentials come from the environment (``AWS_*``)."""
from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs

from raytrain_scu.config.paths import split_query


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, path in it)`` of a URI (its query applied to the filesystem)."""
    return pafs.FileSystem.from_uri(uri)


def is_dir(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def is_file(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type == pafs.FileType.File


def join(uri: str, name: str) -> str:
    """``name`` under the directory ``uri``, its query kept at the end."""
    path, query = split_query(uri)
    return f"{path.rstrip('/')}/{name}{query}"


def upload_dir(local: str | Path, uri: str) -> None:
    """Copy the local directory ``local`` to ``uri``, replacing what is there."""
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        fs.delete_dir(path)
    fs.create_dir(path)
    pafs.copy_files(str(local), path, destination_filesystem=fs)


def download_dir(uri: str, local: str | Path) -> Path:
    """Copy the directory at ``uri`` into the local directory ``local``; returns ``local``."""
    fs, path = filesystem(uri)
    Path(local).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(path, str(local), source_filesystem=fs)
    return Path(local)
