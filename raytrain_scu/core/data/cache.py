"""The data a run trains on, in an on-disk cache: token blocks (text, :mod:`.blocks`) or rows of examples (chat and
prompt/completion, :mod:`.sft`), memory-mapped, keyed by everything that changes them, so a second call (or a second
worker on the node) skips tokenization.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import filelock
import numpy as np

from raytrain_scu.config.schema import DataConfig
from raytrain_scu.core.data import sft
from raytrain_scu.core.data.blocks import build_blocks
from raytrain_scu.core.data.packing import IGNORE_INDEX
from raytrain_scu.core.data.sources import SOURCES, describe, resolve_format, resolve_source, source_files
from raytrain_scu.core.data.plan import CUT_SCAN_BYTES, WORDS_VERSION
from raytrain_scu.core.data.stream import STREAM_LAYOUT, ShardStream, open_stream, use_streaming
from raytrain_scu.errors import DataError


@dataclass
class Rows:
    """Fixed-width rows of examples (:mod:`.packing`): inputs ``x``, targets ``y``, positions ``pos`` (each
    (n_rows, block_size)) and ``length``, the positions each row's examples fill. ``packed``: several examples a
    row, kept apart by the position restarts; else one a row, right-padded."""
    x: np.ndarray
    y: np.ndarray
    pos: np.ndarray
    length: np.ndarray
    packed: bool
    perms: dict = field(default_factory=dict, repr=False, compare=False)  # the stream's length-grouped epochs
    targets: np.ndarray = field(init=False, repr=False, compare=False)  # target tokens a row, read once

    def __post_init__(self):
        self.targets = (np.asarray(self.y) != IGNORE_INDEX).sum(axis=1)

    def __len__(self) -> int:
        return len(self.x)


@dataclass
class TokenData:
    """Both splits: packed token blocks (memory-mapped uint32, (n_blocks, block_size + 1)) for text, or
    :class:`Rows` for examples (``data.format`` chat / prompt_completion); for a streamed source (:mod:`.stream`),
    the train split is a :class:`~raytrain_scu.core.data.stream.ShardStream`, whose length is one epoch's blocks.

    Each worker builds its own with prepare_data (a cache hit): pickling a memmap ships a full copy.
    """
    train: "np.ndarray | Rows | ShardStream"
    val: "np.ndarray | Rows"
    block_size: int
    cache_path: str
    meta: dict

    @property
    def tokens_per_epoch(self) -> int:
        """Target tokens in one pass over the train split, over ALL ranks (the N of ParamBPT)."""
        if isinstance(self.train, Rows):
            return int(self.meta["n_train_targets"])
        return len(self.train) * self.block_size

    @property
    def streamed(self) -> bool:
        """Whether the train split is read in shards, and tokens_per_epoch an estimate (:mod:`.stream`)."""
        return isinstance(self.train, ShardStream)

    @property
    def plan(self) -> str:
        """A streamed source's shard plan fingerprint (:func:`.stream.plan_fingerprint`); "" for one read whole."""
        return self.meta["plan"] if self.streamed else ""

    def close(self) -> None:
        """Stops a streamed source's loader threads (nothing to stop for one read whole)."""
        if isinstance(self.train, ShardStream):
            self.train.close()


def tokens_per_epoch_from(override: int, data: TokenData) -> str:
    """Where a run's tokens_per_epoch (N) comes from: ``config`` (controller.tokens_per_epoch), ``estimated`` (a
    streamed source: the train shards' words x the validation shard's tokens per word) or ``measured`` (the train
    split)."""
    return "config" if override else "estimated" if data.streamed else "measured"


def tokenizer_identity(tokenizer) -> dict:
    """What makes two tokenizers produce the same ids: name, size, eos id and a hash of the full definition."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:  # slow tokenizers have no serialised form; the vocabulary is the next best thing
        definition = json.dumps(sorted(tokenizer.get_vocab().items()))
    return {"name": tokenizer.name_or_path, "len": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "sha256": hashlib.sha256(definition.encode()).hexdigest()}


def cache_key(*, source: str, path: str, files: list[Path], settings: dict, tokenizer_id: dict,
              block_size: int) -> str:
    """A directory name that changes whenever the data would: inputs (with sizes and mtimes), ``settings`` (every
    option that shapes the data) and the tokenizer."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    # hf_hub has no files: its identity is the dataset id
    key = {"source": source, "path": path if source == "hf_hub" else "", "files": stats, **settings,
           "tokenizer": tokenizer_id, "block_size": block_size, "layout": 2}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return f"{source}-b{block_size}-{digest[:24]}"


def _open_cache(dir_path: Path) -> TokenData:
    meta = json.loads((dir_path / "meta.json").read_text())
    splits = {}
    for split, arrays in meta["arrays"].items():
        opened = {}
        for name, (dtype, shape) in arrays.items():
            f = dir_path / f"{split}_{name}.bin"
            if not f.is_file() or f.stat().st_size != int(np.prod(shape)) * np.dtype(dtype).itemsize:
                raise DataError(f"token cache {dir_path} is incomplete ({f.name} missing or of the wrong size): "
                                f"delete it")
            opened[name] = np.memmap(f, dtype=dtype, mode="r", shape=tuple(shape))
        splits[split] = opened["blocks"] if "blocks" in opened else Rows(**opened, packed=meta["packing"])
    return TokenData(train=splits["train"], val=splits["val"], block_size=meta["block_size"],
                     cache_path=str(dir_path), meta=meta)


def _write(root: Path, final: Path, arrays: dict, meta: dict) -> None:
    """The arrays and their meta written beside ``final``, then renamed to it in one step: readers never see a
    half-written cache."""
    meta = {**meta, "arrays": {split: {name: [str(a.dtype), list(a.shape)] for name, a in named.items()}
                               for split, named in arrays.items()},
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by every process on the node
    for split, named in arrays.items():
        for name, a in named.items():
            np.ascontiguousarray(a).tofile(tmp / f"{split}_{name}.bin")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "meta.json").exists():
            raise
        # another node on a shared filesystem won the race: its copy is identical


def _streamed(tokenizer, *, source, path, files, text_field, root, block_size, seed, shard_bytes,
              loader_workers) -> TokenData:
    """A text source read in shards (:mod:`.stream`): a cache directory of shard files, each written whole as the
    stream reaches it. The seed picks the validation shard (data.val_fraction plays no part). The key holds the
    stream's layout version, its cut settings and its word definition: a plan cut another way, or quotas from words
    counted another way, never reuse these shard files."""
    settings = {"text_field": text_field, "format": "text", "seed": seed, "shard_bytes": shard_bytes,
                "stream_layout": STREAM_LAYOUT, "cut_scan_bytes": CUT_SCAN_BYTES, "words_version": WORDS_VERSION}
    key = cache_key(source=source, path=path, files=files, settings=settings,
                    tokenizer_id=tokenizer_identity(tokenizer), block_size=block_size)
    train, val, meta = open_stream(tokenizer, files=files, kind=source, text_field=text_field, dir_path=root / key,
                                   block_size=block_size, seed=seed, shard_bytes=shard_bytes,
                                   loader_workers=loader_workers)
    meta.update({"source": source, "path": SOURCES[source].where(path), "format": "text", "key": key})
    return TokenData(train=train, val=val, block_size=block_size, cache_path=str(root / key), meta=meta)


def prepare_data(tokenizer, *, source: str, path: str, text_field: str = "text", max_documents: int = 0,
                 block_size: int, val_fraction: float = 0.1, seed: int = 0, cache_dir: str = "",
                 fmt: str = "auto", chat_template: str = "", train_on: str = "answers", too_long: str = "truncate",
                 packing: bool = True, streaming: str, shard_bytes: int = DataConfig.shard_bytes,
                 loader_workers: int) -> TokenData:
    """Token blocks (text) or rows of examples (chat, prompt_completion: :mod:`.sft`) of a source, from the on-disk
    cache or built once (under a file lock) and cached; a large text source (``streaming``: :mod:`.stream`) in shards
    tokenised as the stream reaches them, by ``loader_workers`` threads ahead of it.

    `seed` picks the validation documents. `cache_dir` "" = ~/.cache/raytrain_scu/tokens. Every worker may call
    this: on one node the lock makes one process tokenize while the others wait; across nodes sharing a
    filesystem the atomic rename makes the first finished copy win.
    """
    if block_size < 1 or not 0.0 < val_fraction < 1.0:
        raise ValueError(f"need block_size >= 1 and 0 < val_fraction < 1, got {block_size}, {val_fraction}")
    source = resolve_source(source, path)
    files = source_files(source, path)
    fmt = resolve_format(source, path, fmt, text_field)
    settings = {"text_field": text_field, "max_documents": max_documents, "val_fraction": val_fraction,
                "seed": seed, "format": fmt}
    template = ""
    if fmt != "text":
        template = sft.template_for(tokenizer, fmt, chat_template)
        settings.update({"template_sha256": hashlib.sha256(template.encode()).hexdigest(), "train_on": train_on,
                         "too_long": too_long, "packing": packing})
    root = Path(cache_dir or "~/.cache/raytrain_scu/tokens").expanduser()
    if use_streaming(source=source, fmt=fmt, streaming=streaming, max_documents=max_documents, files=files):
        return _streamed(tokenizer, source=source, path=path, files=files, text_field=text_field, root=root,
                         block_size=block_size, seed=seed, shard_bytes=shard_bytes, loader_workers=loader_workers)
    key = cache_key(source=source, path=path, files=files, settings=settings,
                    tokenizer_id=tokenizer_identity(tokenizer), block_size=block_size)
    final = root / key
    if (final / "meta.json").exists():
        return _open_cache(final)

    root.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(final) + ".lock"):
        if (final / "meta.json").exists():  # another process built it while we waited
            return _open_cache(final)
        print(f"[raytrain_scu] data: tokenizing {describe(source, path)} -> {final}", flush=True)
        if fmt == "text":
            arrays, meta = build_blocks(tokenizer, source=source, path=path, text_field=text_field,
                                        max_documents=max_documents, block_size=block_size,
                                        val_fraction=val_fraction, seed=seed)
        else:
            arrays, meta = sft.build_rows(tokenizer, source=source, path=path, fmt=fmt, template=template,
                                          train_on=train_on, too_long=too_long, packing=packing,
                                          max_examples=max_documents, block_size=block_size,
                                          val_fraction=val_fraction, seed=seed)
        meta.update({"source": source, "path": SOURCES[source].where(path), "format": fmt, "packing": packing,
                     "n_files": len(files), "text_field": text_field, "max_documents": max_documents,
                     "val_fraction": val_fraction, "seed": seed, "tokenizer": tokenizer.name_or_path,
                     "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                     "block_size": block_size, "key": key})
        _write(root, final, arrays, meta)
    return _open_cache(final)
