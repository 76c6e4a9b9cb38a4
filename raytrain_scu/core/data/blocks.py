"""Documents -> token blocks in an on-disk cache.

Documents are split into train/val BY DOCUMENT (a seeded permutation), tokenized with EOS after every document and
packed into non-overlapping blocks of ``block_size + 1`` tokens (x = blk[:-1], y = blk[1:]). The blocks live in a
memory-mapped uint32 cache keyed by everything that changes them, so a second call (or a second worker on the node)
skips tokenization.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import filelock
import numpy as np

from raytrain_scu.core.data.sources import SOURCES, describe, iter_documents, resolve_source, source_files
from raytrain_scu.errors import DataError

TOKENIZE_BATCH_DOCS = 64


def load_documents(source: str, path: str, text_field: str = "text", max_documents: int = 0) -> list[str]:
    """The documents of a source, in a deterministic order; whitespace-only documents are skipped.

    `max_documents` > 0 keeps the first N. Raises DataError (naming the path) for a missing path, no matched
    files, undecodable text, a bad JSONL line, or no text at all.
    """
    source = resolve_source(source, path)
    docs = (d for d in iter_documents(source, path, text_field) if d.strip())
    if max_documents > 0:
        docs = itertools.islice(docs, max_documents)
    docs = list(docs)
    if not docs:
        raise DataError(f"no text in {describe(source, path)}: every document is empty or whitespace")
    return docs


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
            raise DataError(f"{describe(source, path)}: the {split} split has {len(tokens)} tokens, too few for one "
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

    root.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(final) + ".lock"):
        if (final / "meta.json").exists():  # another process built it while we waited
            return _open_cache(final)
        print(f"[raytrain_scu] data: tokenizing {describe(source, path)} -> {final}", flush=True)
        train, val, meta = _build_blocks(tokenizer, source=source, path=path, text_field=text_field,
                                         max_documents=max_documents, block_size=block_size,
                                         val_fraction=val_fraction, seed=seed)
        meta.update({"source": source, "path": SOURCES[source].where(path),
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
