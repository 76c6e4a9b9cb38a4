"""The paired bootstrap over documents that ``evaluate`` compares two models with. numpy only."""
from __future__ import annotations

import math

import numpy as np

LN2 = math.log(2.0)
# settings that only exist here: the training config has no bootstrap
DEFAULT_BOOTSTRAP = 2000
DEFAULT_CI = 0.95
BOOTSTRAP_CHUNK_ELEMENTS = 4_000_000  # resample indices drawn per chunk: bounded memory for many documents


def paired_bootstrap(nats_a, nats_b, tokens, n_boot: int = DEFAULT_BOOTSTRAP, ci: float = DEFAULT_CI,
                     seed: int = 0) -> dict:
    """Paired bootstrap over documents of BPT_A − BPT_B, each BPT a ratio of sums (token-weighted).

    Documents are resampled with replacement (a seeded numpy Generator), A and B of a document together. Returns
    ``diff_bpt`` (on all documents), ``mean_diff_bpt`` (over resamples), the percentile interval ``ci_low`` ..
    ``ci_high`` at level ``ci``, and ``p_sign_flip``: the share of resamples on the other side of zero from
    ``diff_bpt`` (a one-sided bootstrap p-value; 1.0 when ``diff_bpt`` is 0).
    """
    nats_a, nats_b, tokens = (np.asarray(v, dtype=np.float64) for v in (nats_a, nats_b, tokens))
    n = len(tokens)
    if n == 0 or len(nats_a) != n or len(nats_b) != n:
        raise ValueError(f"need equal, non-empty per-document arrays, got {len(nats_a)}, {len(nats_b)}, {n}")
    if tokens.sum() <= 0:
        raise ValueError("no target tokens to score")
    if n_boot < 1 or not 0.0 < ci < 1.0:
        raise ValueError(f"need n_boot >= 1 and 0 < ci < 1, got {n_boot}, {ci}")
    nats_diff = nats_a - nats_b
    diff = nats_diff.sum() / tokens.sum() / LN2
    rng = np.random.default_rng(seed)
    diffs = np.empty(n_boot, dtype=np.float64)
    per_chunk = max(1, BOOTSTRAP_CHUNK_ELEMENTS // n)
    for start in range(0, n_boot, per_chunk):
        idx = rng.integers(0, n, size=(min(per_chunk, n_boot - start), n))
        diffs[start:start + len(idx)] = nats_diff[idx].sum(axis=1) / tokens[idx].sum(axis=1) / LN2
    low, high = np.quantile(diffs, [(1.0 - ci) / 2, (1.0 + ci) / 2])
    p_sign_flip = float(np.mean(diffs * np.sign(diff) <= 0)) if diff != 0 else 1.0
    return {"diff_bpt": float(diff), "mean_diff_bpt": float(diffs.mean()), "ci_low": float(low),
            "ci_high": float(high), "ci": ci, "n_boot": n_boot, "p_sign_flip": p_sign_flip, "documents": n,
            "seed": seed}
