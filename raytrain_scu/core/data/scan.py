"""Full reads of a large source's files before any worker starts, in bounded memory: every byte of a text source
decodes, every line of a jsonl source is an object with its text field. What :func:`.sources.check_source` checks on
a file's first bytes, these check on all of them, for a streamed source (:mod:`.stream`), which no worker reads whole
before training."""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Iterator

from raytrain_scu.core.data.sources import _decode, _read_jsonl_lines, source_files
from raytrain_scu.errors import DataError

SCAN_CHUNK_BYTES = 16 * 2**20  # what a full scan reads at a time: its memory, whatever the file's size


def _chunks(file: Path) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of a file in pieces of about SCAN_CHUNK_BYTES, each ending at a line end (or the file's)."""
    with open(file, "rb") as f:
        offset = 0
        while chunk := f.read(SCAN_CHUNK_BYTES):
            chunk += f.readline()
            yield offset, chunk
            offset += len(chunk)


def scan_text(files: list[Path]) -> None:
    """Every byte of every file decodes as UTF-8, and some file holds text: DataError naming the file and the byte
    offset otherwise. Reads the files in chunks, so its memory does not grow with their size."""
    any_text = False
    for f in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        for offset, chunk in _chunks(f):
            try:
                any_text = bool(decoder.decode(chunk).strip()) or any_text
            except UnicodeDecodeError as e:
                raise DataError(f"{f} is not UTF-8 text: undecodable byte 0x{chunk[e.start]:02x} at byte offset "
                                f"{offset + e.start}") from None
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"{f} is not UTF-8 text: it ends inside a character") from None
    if not any_text:
        raise DataError(f"no text in text data at {files[0] if len(files) == 1 else files[0].parent}: every file is "
                        f"empty or whitespace")


def scan_jsonl(files: list[Path], text_field: str) -> None:
    """Every non-blank line of every file is a JSON object whose ``text_field`` is a string: DataError naming the file
    and line otherwise. Each chunk's lines are parsed as one JSON array (one parser call, ~5x faster than one a line);
    a chunk that does not give one object with the field a line is parsed again line by line, which names the
    line."""
    for f in files:
        first_line = 1
        for _, chunk in _chunks(f):
            n_lines = chunk.count(b"\n") + (not chunk.endswith(b"\n"))
            try:
                objs = json.loads(b"[" + chunk.rstrip(b"\n").replace(b"\n", b",") + b"]")
                ok = len(objs) == n_lines and all(type(o) is dict and type(o.get(text_field)) is str for o in objs)
            except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
                ok = False
            if not ok:  # a blank line, a bad one, or the field missing: the line-by-line reading says which
                lines = (_decode(raw, f) for raw in chunk.split(b"\n"))
                for _ in _read_jsonl_lines(f, lines, text_field, first_line):
                    pass
            first_line += n_lines


def scan_source(source: str, path: str, text_field: str) -> None:
    """Every line of a (resolved) jsonl source (:func:`scan_jsonl`), every byte of a text one (:func:`scan_text`)."""
    files = source_files(source, path)
    if source == "jsonl":
        scan_jsonl(files, text_field)
    else:
        scan_text(files)
