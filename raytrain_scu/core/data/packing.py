"""Examples -> fixed-width rows: packed (several examples a row, each attending only to itself) or one example a row.

A row holds ``block_size`` positions as three arrays: the input ids ``x``, the targets ``y`` (the next token where it
is a target token, IGNORE_INDEX elsewhere) and ``pos``, each example's own positions 0, 1, ... (a 0 starts a new
example; the attention keeps every example to itself by these restarts). An example of L tokens takes L - 1
positions: x = ids[:-1], y = ids[1:] where they are targets. What is left of a row is filler: EOS inputs, no target,
positions of a segment of their own.
"""
from __future__ import annotations

import bisect

import numpy as np

IGNORE_INDEX = -100


def best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``sizes`` whose sizes sum to at most ``capacity``: longest first, each into the fullest
    bin it fits (best fit decreasing). Deterministic: ties go to the earliest bin and the lower index."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index), sorted
    for i in order:
        at = bisect.bisect_left(free, (sizes[i], -1))
        if at == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - sizes[i], len(bins) - 1))
            continue
        room, b = free.pop(at)
        bins[b].append(i)
        bisect.insort(free, (room - sizes[i], b))
    return bins


def rows_of(examples: list[tuple[list[int], list[bool]]], *, block_size: int, packing: bool, pad_id: int
            ) -> dict[str, np.ndarray]:
    """``x`` (uint32), ``y`` (int32), ``pos`` (int32), each (n_rows, block_size), and ``length`` (int32, n_rows): the
    positions a row's examples fill. Examples are (ids, target) of at most ``block_size + 1`` tokens."""
    sizes = [len(ids) - 1 for ids, _ in examples]
    groups = best_fit_decreasing(sizes, block_size) if packing else [[i] for i in range(len(examples))]
    n = len(groups)
    x = np.full((n, block_size), pad_id, dtype=np.uint32)
    y = np.full((n, block_size), IGNORE_INDEX, dtype=np.int32)
    pos = np.zeros((n, block_size), dtype=np.int32)
    length = np.zeros(n, dtype=np.int32)
    for r, group in enumerate(groups):
        at = 0
        for i in group:
            ids, target = examples[i]
            k = len(ids) - 1
            x[r, at:at + k] = ids[:-1]
            y[r, at:at + k] = np.where(target[1:], ids[1:], IGNORE_INDEX)
            pos[r, at:at + k] = np.arange(k)
            at += k
        pos[r, at:] = np.arange(block_size - at)
        length[r] = at
    return {"x": x, "y": y, "pos": pos, "length": length}
