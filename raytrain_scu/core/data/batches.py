"""Deterministic, resumable sharded batches of the token blocks.

The training stream is the concatenation of permutations perm(seed, epoch) of the train blocks; a global sample
counter ``position`` indexes it. A step takes ``batch_size * grad_accum * world_size`` consecutive positions, so
resuming from ``position`` with a different world size continues the same stream. Validation scores one fixed set of
blocks, sharded over the ranks.
"""
from __future__ import annotations

import functools
import math
from typing import Iterator

import numpy as np
import torch

from raytrain_scu.core.data.blocks import TokenData

IGNORE_INDEX = -100  # cross_entropy's default ignore_index: val padding rows count for nothing


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


def calibration_batches(data: TokenData, *, blocks: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """The token ids (int64, CPU) of the first ``blocks`` train blocks in stream order (all of them where there are
    fewer), in batches of at most ``batch_size``: the same on every rank."""
    idx = stream_indices(0, min(blocks, len(data.train)), n_blocks=len(data.train), seed=seed)
    return [_to_xy(data.train[idx[i:i + batch_size]], False)[0] for i in range(0, len(idx), batch_size)]


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
