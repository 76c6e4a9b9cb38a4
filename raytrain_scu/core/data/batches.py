"""Deterministic, resumable sharded batches of the token blocks or example rows.

The training stream is the concatenation of permutations perm(seed, epoch) of the train blocks (rows); a global
sample counter ``position`` indexes it (a source read in shards has a stream of its own over the same positions:
:mod:`.stream`). A step takes ``batch_size * grad_accum * world_size`` consecutive positions,
so resuming from ``position`` with a different world size continues the same stream. Validation scores one fixed set
of blocks, sharded over the ranks.

A batch is (x, y, pos): pos is None for text blocks and for one example a row (right-padded: causal attention keeps
the padding out of every real token's view), and each example's own positions for packed rows. Rows of one example
each are cut to the batch's longest (rounded up to :data:`PAD_MULTIPLE`), and their stream is length-grouped: each
chunk of :data:`GROUP_BATCHES` micro-batches of the permutation is sorted longest first and its micro-batches taken in
a seeded order, so a micro-batch holds examples of similar length.
"""
from __future__ import annotations

import functools
import math
from typing import Iterator

import numpy as np
import torch

from raytrain_scu.core.data.cache import Rows, TokenData
from raytrain_scu.core.data.packing import IGNORE_INDEX  # cross_entropy's default: what counts for nothing
from raytrain_scu.core.data.stream import ShardStream

PAD_MULTIPLE = 64  # a padded batch's width rounds up to this: few distinct shapes for torch.compile
GROUP_BATCHES = 64  # micro-batches per length-sorted chunk of a padded stream


@functools.lru_cache(maxsize=4)  # consecutive steps touch one or two epochs: a few entries make each lookup free
def _epoch_perm(seed: int, epoch: int, n_blocks: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch]).permutation(n_blocks)
    perm.flags.writeable = False  # shared by every caller of the cache
    return perm


def epoch_of(position: int, n_blocks: int) -> int:
    """The epoch a global stream position falls in."""
    return position // n_blocks


def grouped_perm(seed: int, epoch: int, rows: Rows, batch_size: int) -> np.ndarray:
    """perm(seed, epoch) length-grouped: each chunk of GROUP_BATCHES micro-batches sorted longest first (stable), then
    its micro-batches in a seeded order, so a step's width does not fall chunk after chunk. Kept on ``rows`` for the
    epochs in use (a step touches one or two)."""
    key = (seed, epoch, batch_size)
    if key not in rows.perms:
        perm = _epoch_perm(seed, epoch, len(rows)).copy()
        lengths = np.asarray(rows.length)
        chunk = batch_size * GROUP_BATCHES
        for c, start in enumerate(range(0, len(perm), chunk)):
            part = perm[start:start + chunk]
            part = part[np.argsort(-lengths[part], kind="stable")]
            batches = [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
            order = np.random.default_rng([seed, epoch, c]).permutation(len(batches))
            perm[start:start + chunk] = np.concatenate([batches[i] for i in order])
        while len(rows.perms) >= 4:
            rows.perms.pop(next(iter(rows.perms)))
        rows.perms[key] = perm
    return rows.perms[key]


def stream_indices(position: int, count: int, *, n_blocks: int, seed: int, grouped: Rows | None = None,
                   batch_size: int = 1) -> np.ndarray:
    """Train block indices at stream positions position .. position + count - 1 (p -> perm(seed, p // n)[p % n]);
    with ``grouped`` (rows of one example each), each epoch's permutation length-grouped (:func:`grouped_perm`)."""
    epochs, offsets = np.divmod(np.arange(position, position + count, dtype=np.int64), n_blocks)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        perm = (_epoch_perm(seed, int(epoch), n_blocks) if grouped is None
                else grouped_perm(seed, int(epoch), grouped, batch_size))
        out[sel] = perm[offsets[sel]]
    return out


def _pinned(tensors, pin_memory: bool):
    if pin_memory and torch.cuda.is_available():
        return tuple(t.pin_memory() if t is not None else None for t in tensors)
    return tuple(tensors)


def _to_xy(rows: np.ndarray, pin_memory: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    return _pinned((t[:, :-1].contiguous(), t[:, 1:].contiguous()), pin_memory)


def rows_batch(split, idx: np.ndarray, *, pin_memory: bool = False):
    """(x, y, pos) int64 on CPU of the blocks or rows ``idx`` of a split (pos None where not packed); rows of one
    example each cut to the longest, rounded up to PAD_MULTIPLE."""
    if not isinstance(split, Rows):
        return (*_to_xy(split[idx], pin_memory), None)
    width = split.x.shape[1]
    if not split.packed:
        longest = int(split.length[idx].max()) if len(idx) else 1
        width = min(width, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
    x, y = (torch.from_numpy(np.asarray(a[idx, :width], dtype=np.int64)) for a in (split.x, split.y))
    pos = torch.from_numpy(np.asarray(split.pos[idx, :width], dtype=np.int64)) if split.packed else None
    return _pinned((x, y, pos), pin_memory)


def train_batch(data: TokenData, *, position: int, micro_step: int, rank: int, world_size: int,
                batch_size: int, seed: int, pin_memory: bool = False):
    """(x, y, pos) int64 (batch_size, width) on CPU for one rank's micro-step of the step starting at `position`
    (pos None, width block_size, for text blocks: see :func:`rows_batch`).

    The step owns positions [position, position + batch_size * grad_accum * world_size); micro-step m of rank r
    takes the batch_size positions from position + (m * world_size + r) * batch_size. Advance `position` by the
    global batch after each optimizer step and save it in checkpoints.
    """
    start = position + (micro_step * world_size + rank) * batch_size
    if isinstance(data.train, ShardStream):  # a source read in shards: its own stream of the same positions
        return (*_to_xy(data.train.rows(start, batch_size), pin_memory), None)
    idx = stream_indices(start, batch_size, **_stream(data, batch_size, seed))
    return rows_batch(data.train, idx, pin_memory=pin_memory)


def step_counts(data: TokenData, *, position: int, count: int, batch_size: int, seed: int) -> tuple[int, int]:
    """(target tokens, tokens) of the training stream's positions position .. position + count - 1: an optimizer
    step's over all ranks when ``count`` is its sequences, the same numbers on every rank without a collective.
    Tokens leave out padding and a packed row's filler; every token of a text block is both."""
    if not isinstance(data.train, Rows):
        return count * data.block_size, count * data.block_size
    idx = stream_indices(position, count, **_stream(data, batch_size, seed))
    return int(data.train.targets[idx].sum()), int(np.asarray(data.train.length)[idx].sum())


def _stream(data: TokenData, batch_size: int, seed: int) -> dict:
    """stream_indices' settings for a split: length-grouped where rows hold one example each."""
    train = data.train
    grouped = isinstance(train, Rows) and not train.packed
    return {"n_blocks": len(train), "seed": seed, "grouped": train if grouped else None, "batch_size": batch_size}


def calibration_batches(data: TokenData, *, blocks: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """The token ids (int64, CPU) of the first ``blocks`` train blocks in stream order (all of them where there are
    fewer), in batches of at most ``batch_size``: the same on every rank. A streamed source's loader threads are not
    started here: setup reads these, and only the training loop's end closes the stream."""
    count = min(blocks, len(data.train))
    if isinstance(data.train, ShardStream):
        rows = data.train.rows(0, count, prefetch=False)
        return [_to_xy(rows[i:i + batch_size], False)[0] for i in range(0, count, batch_size)]
    idx = stream_indices(0, count, **_stream(data, batch_size, seed))
    return [rows_batch(data.train, idx[i:i + batch_size])[0] for i in range(0, len(idx), batch_size)]


def val_block_indices(n_val: int, max_blocks: int = 0) -> np.ndarray:
    """The validation blocks one evaluation scores: all ``n_val``, or ``max_blocks`` > 0 of them spread evenly over
    the split (block ``i * n_val // max_blocks``, so every part of the split is represented), or all of them when the
    split has no more than ``max_blocks``. The set depends on ``n_val`` and ``max_blocks`` only: never on the batch
    size, the accumulation or the number of ranks, so every such setting scores the same blocks."""
    if max_blocks <= 0 or max_blocks >= n_val:
        return np.arange(n_val)
    return np.arange(max_blocks) * n_val // max_blocks


def val_batches(data: TokenData, *, rank: int, world_size: int, batch_size: int, max_blocks: int = 0,
                pin_memory: bool = False) -> Iterator[tuple]:
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
        x, y, pos = rows_batch(data.val, idx)
        n_pad = batch_size - len(idx)
        if n_pad:
            width = x.shape[1]
            x = torch.cat([x, torch.zeros(n_pad, width, dtype=torch.int64)])
            y = torch.cat([y, torch.full((n_pad, width), IGNORE_INDEX, dtype=torch.int64)])
            if pos is not None:  # every padding token a segment of its own
                pos = torch.cat([pos, torch.zeros(n_pad, width, dtype=torch.int64)])
        yield _pinned((x, y, pos), pin_memory)
