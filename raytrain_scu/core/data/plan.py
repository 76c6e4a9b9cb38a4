"""A streamed source's shard plan (:mod:`.stream`): byte ranges of its files (pieces) cut at a blank line (text) or
a line end (jsonl), each shard's words (its density measure) and its documents. Reads a few bounded pieces of a file
to cut it, never a whole file.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from raytrain_scu.core.data.sources import read_jsonl_lines
from raytrain_scu.errors import DataError

# past a text shard's nominal end, a blank line is looked for this far, then a line end; without one this far, a cut
# after the first whitespace (or at a character's start)
CUT_SCAN_BYTES = 2**16
COUNT_CHUNK_BYTES = 16 * 2**20  # what counting a shard's words reads at a time
# the version of what a word is (:func:`count_words`): kept with the words in a shard cache's meta.json and in its
# key, so words counted another way (and the quotas they set) are never reused
WORDS_VERSION = 2


def _cut(f, nominal: int, size: int, kind: str) -> int:
    """The end of a shard whose nominal end is ``nominal``: after the next blank line (text; the last whole line's
    end where none comes within CUT_SCAN_BYTES, and where the nominal end's line has no end within CUT_SCAN_BYTES,
    :func:`hard_cut`: after its first whitespace from the nominal end, or at a character's start) or the
    next line end (jsonl: a line is a document, never cut), or the file's end. Reads at most CUT_SCAN_BYTES at a time,
    so a file without line ends is not read whole."""
    f.seek(nominal)
    line = f.readline(CUT_SCAN_BYTES)  # to the end of the line the nominal end falls in
    if kind == "jsonl":
        while line and not line.endswith(b"\n"):
            line = f.readline(CUT_SCAN_BYTES)
        return min(f.tell(), size)
    if not line.endswith(b"\n") and f.tell() < size:
        return nominal + hard_cut(line)
    line_end = f.tell()  # the cut, where no blank line comes: never inside a line read in part
    while f.tell() < size and f.tell() - nominal < CUT_SCAN_BYTES:
        line = f.readline(CUT_SCAN_BYTES)
        if line.endswith(b"\n") or f.tell() >= size:
            line_end = f.tell()
            if not line.strip():
                break
    return min(line_end, size)


def hard_cut(buf: bytes) -> int:
    """Where to cut a run of bytes that holds no line end, as near its start as may be: after its first whitespace,
    else before its second UTF-8 character (never inside a character); len(buf) where neither is found."""
    found = [i for i in (buf.find(c) for c in (b" ", b"\t", b"\r", b"\x0b", b"\x0c")) if i >= 0]
    if found:
        return min(found) + 1
    for i in range(1, min(len(buf), 5)):
        if buf[i] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            return i
    return len(buf)


def count_words(path: Path, start: int, end: int) -> int:
    """Runs of bytes above 0x20 (space and the control characters part them) in ``path``'s bytes [start, end): a
    shard's density measure, cheap where tokenising is not (one numpy comparison a byte, COUNT_CHUNK_BYTES at a time:
    ~1 s a GiB here)."""
    words, prev_ws = 0, True
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(left, COUNT_CHUNK_BYTES))
            if not chunk:
                break
            left -= len(chunk)
            ws = np.frombuffer(chunk, dtype=np.uint8) <= 0x20
            words += int(np.count_nonzero(ws[:-1] > ws[1:])) + int(prev_ws and not ws[0])  # a space, then a word
            prev_ws = bool(ws[-1])
    return words


Piece = tuple[int, int, int]  # (file index, start byte, end byte)


def plan_shards(files: list[Path], *, kind: str, shard_bytes: int) -> list[tuple[Piece, ...]]:
    """Every shard's pieces, in file order: ``shard_bytes`` or a little more each (a file's piece ends where
    :func:`_cut` says, the next piece starts a shard's rest), the last shard's rest, if under half a shard, joined to
    the shard before it. Reads a few lines a shard, never a whole file."""
    shards: list[list[Piece]] = []
    current: list[Piece] = []
    for i, path in enumerate(files):
        size, start = path.stat().st_size, 0
        with open(path, "rb") as f:
            while start < size:
                want = shard_bytes - sum(e - s for _, s, e in current)
                end = size if start + want >= size else _cut(f, start + want, size, kind)
                current.append((i, start, end))
                start = end
                if sum(e - s for _, s, e in current) >= shard_bytes:
                    shards.append(current)
                    current = []
    if current and shards and sum(e - s for _, s, e in current) < shard_bytes // 2:
        shards[-1] += current
    elif current:
        shards.append(current)
    return [tuple(_joined(pieces)) for pieces in shards]


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Pieces of one file that meet, as one."""
    out = [pieces[0]]
    for f, s, e in pieces[1:]:
        if out[-1][0] == f and out[-1][2] == s:
            out[-1] = (f, out[-1][1], e)
        else:
            out.append((f, s, e))
    return out


def lines_before(path: Path, offset: int) -> int:
    """Line ends in ``path`` before byte ``offset`` (read COUNT_CHUNK_BYTES at a time): for an error's line number."""
    n = 0
    with open(path, "rb") as f:
        while f.tell() < offset:
            n += f.read(min(COUNT_CHUNK_BYTES, offset - f.tell())).count(b"\n")
    return n


def decode_piece(file: Path, raw: bytes, offset: int, first_line: int | None = None) -> str:
    """The text of ``raw``, the bytes of ``file`` from ``offset``, decoded strictly (as a worker decodes a shard);
    DataError naming the file's line (``first_line``: the line ``offset`` is on, counted here only when needed) and
    byte offset of an undecodable byte. A UTF-8 byte-order mark at the file's start is not text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        first = lines_before(file, offset) + 1 if first_line is None else first_line
        line = first + raw.count(b"\n", 0, e.start)
        raise DataError(f"{file}:{line}: not UTF-8 text: undecodable byte "
                        f"0x{raw[e.start]:02x} at byte offset {offset + e.start}") from None
    return text.removeprefix("\ufeff") if offset == 0 else text


def shard_documents(files: list[Path], pieces: tuple[Piece, ...], *, kind: str, text_field: str) -> list[str]:
    """The non-blank documents of one shard: its pieces' blank-line-separated sections (text) or each line's
    ``text_field`` (jsonl). A DataError names the file's line and byte offset of the fault."""
    docs = []
    for i, start, end in pieces:
        path = files[i]
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read(end - start)
        text = decode_piece(path, raw, start)
        if kind == "text":
            docs += re.split(r"\n\s*\n", text)
            continue
        try:
            docs += read_jsonl_lines(path, text.split("\n"), text_field)
        except DataError:  # said again with the file's line numbers, counted only now that one is needed
            docs += read_jsonl_lines(path, text.split("\n"), text_field, lines_before(path, start) + 1)
    return [d for d in docs if d.strip()]
