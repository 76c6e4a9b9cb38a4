"""Full reads of a large source's files before any worker starts, in bounded memory: every byte of a text source
decodes, every line of a jsonl source is an object with its text field. What :func:`.sources.check_source` checks on
a file's first bytes, these check on all of them, for a streamed source (:mod:`.stream`), which no worker reads whole
before training."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from raytrain_scu.core.data.plan import decode_piece, hard_cut
from raytrain_scu.core.data.sources import read_jsonl_lines, source_files
from raytrain_scu.errors import DataError

SCAN_CHUNK_BYTES = 16 * 2**20  # what a full scan reads at a time: its memory, whatever the file's size
MAX_JSONL_LINE_BYTES = 8 * SCAN_CHUNK_BYTES  # a jsonl line (one document) longer than this is refused


def _chunks(file: Path, *, whole_lines: bool) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of a file in pieces of about SCAN_CHUNK_BYTES, each ending at a line end (or the file's). A
    line longer than SCAN_CHUNK_BYTES is cut (``whole_lines`` False: where :func:`.plan.hard_cut` says, after the
    first whitespace of the bytes read past the chunk, never inside a character) or, for a jsonl file, read on up to
    MAX_JSONL_LINE_BYTES and refused past that, naming its line and byte offset: a file without line ends is never
    read whole."""
    with open(file, "rb") as f:
        offset, first_line = 0, 1
        while chunk := f.read(SCAN_CHUNK_BYTES):
            tail = f.readline(SCAN_CHUNK_BYTES)
            start = chunk.rfind(b"\n") + 1  # where the chunk's last line begins
            while whole_lines and tail and not tail.endswith(b"\n"):
                if len(chunk) + len(tail) - start > MAX_JSONL_LINE_BYTES:
                    line = first_line + chunk.count(b"\n", 0, start)
                    raise DataError(f"{file}:{line}: no line end in {MAX_JSONL_LINE_BYTES} bytes from byte offset "
                                    f"{offset + start}: a jsonl source holds one document a line")
                chunk += tail
                tail = f.readline(SCAN_CHUNK_BYTES)
            if not whole_lines and not tail.endswith(b"\n") and f.tell() < file.stat().st_size:
                tail = tail[:hard_cut(tail)]
                f.seek(offset + len(chunk) + len(tail))
            chunk += tail
            yield offset, chunk
            offset += len(chunk)
            first_line += chunk.count(b"\n")


def scan_text(files: list[Path]) -> None:
    """Every byte of every file decodes as UTF-8, and some file holds text: DataError naming the file, its line and
    the byte offset otherwise. Reads the files in chunks, so its memory does not grow with their size."""
    any_text = False
    for f in files:
        first_line = 1
        for offset, chunk in _chunks(f, whole_lines=False):
            any_text = bool(decode_piece(f, chunk, offset, first_line).strip()) or any_text
            first_line += chunk.count(b"\n")
    if not any_text:
        raise DataError(f"no text in text data at {files[0] if len(files) == 1 else files[0].parent}: every file is "
                        f"empty or whitespace")


def scan_jsonl(files: list[Path], text_field: str) -> None:
    """Every non-blank line of every file is UTF-8 and a JSON object whose ``text_field`` is a string: DataError
    naming the file and line otherwise. Each chunk is decoded strictly, then its lines parsed as one JSON array (one
    parser call, ~5x faster than one a line); a chunk that does not give one object with the field a line is parsed
    again line by line, which names the line."""
    for f in files:
        first_line = 1
        for offset, chunk in _chunks(f, whole_lines=True):
            n_lines = chunk.count(b"\n") + (not chunk.endswith(b"\n"))
            text = decode_piece(f, chunk, offset, first_line)
            try:
                objs = json.loads("[" + text.rstrip("\n").replace("\n", ",") + "]")
                ok = len(objs) == n_lines and all(type(o) is dict and type(o.get(text_field)) is str for o in objs)
            except ValueError:  # JSONDecodeError is a ValueError
                ok = False
            if not ok:  # a blank line, a bad one, or the field missing: the line-by-line reading says which
                for _ in read_jsonl_lines(f, text.split("\n"), text_field, first_line):
                    pass
            first_line += n_lines


def scan_source(source: str, path: str, text_field: str) -> None:
    """Every line of a (resolved) jsonl source (:func:`scan_jsonl`), every byte of a text one (:func:`scan_text`)."""
    files = source_files(source, path)
    if source == "jsonl":
        scan_jsonl(files, text_field)
    else:
        scan_text(files)
