"""Documents -> token blocks.

Documents are split into train/val BY DOCUMENT (a seeded permutation), tokenized with EOS after every document and
packed into non-overlapping blocks of ``block_size + 1`` tokens (x = blk[:-1], y = blk[1:]). :mod:`.cache` keeps
them on disk.
"""
from __future__ import annotations

import itertools

import numpy as np

from raytrain_scu.core.data.sources import NOT_DOCUMENTS, describe, iter_documents, resolve_format, resolve_source
from raytrain_scu.errors import DataError

TOKENIZE_BATCH_DOCS = 64


def load_documents(source: str, path: str, text_field: str = "text", max_documents: int = 0) -> list[str]:
    """The documents of a source, in a deterministic order; whitespace-only documents are skipped.

    `max_documents` > 0 keeps the first N. Raises DataError (naming the path) for a missing path, no matched
    files, undecodable text, a bad JSONL line, or no text at all.
    """
    source = resolve_source(source, path)
    if resolve_format(source, path, "auto", text_field) != "text":
        raise DataError(f"{describe(source, path)} {NOT_DOCUMENTS}")
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


def max_documents_hint(max_documents: int, documents_read: int, source: str) -> str:
    """The fix to name first when a split is too small and ``data.max_documents`` cut the source (the likeliest
    cause); '' where it did not."""
    if not 0 < max_documents <= documents_read:
        return ""
    paragraphs = " (a text file's documents are its blank-line-separated sections)" if source == "text" else ""
    return (f"data.max_documents=0 reads the whole source, of which this config reads {max_documents} documents"
            f"{paragraphs}")


def build_blocks(tokenizer, *, source, path, text_field, max_documents, block_size, val_fraction, seed):
    """({split: {"blocks": array}}, meta) from the source: read, split, tokenize, pack."""
    docs = load_documents(source, path, text_field, max_documents)
    train_docs, val_docs = split_documents(docs, val_fraction=val_fraction, seed=seed)
    arrays, meta = {}, {}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        tokens = tokenize_documents(tokenizer, split_docs)
        blocks = pack_blocks(tokens, block_size)
        if len(blocks) == 0:
            fix = "lower data.block_size or add data"
            hint = max_documents_hint(max_documents, len(docs), source)
            fix = f"{hint}; or {fix}" if hint else fix
            raise DataError(f"{describe(source, path)}: the {split} split has {len(tokens)} tokens, too few for one "
                            f"block of block_size + 1 = {block_size + 1} ({fix})")
        arrays[split] = {"blocks": blocks}
        meta.update({f"n_{split}_docs": len(split_docs), f"n_{split}_tokens": len(tokens),
                     f"n_{split}_blocks": len(blocks)})
    return arrays, meta
