"""Training FLOPs per token with a frozen base (what ``perf/mfu`` and the bench divide by), and bits per token."""
from __future__ import annotations

import math

from raytrain_scu.core.model.families import ATTENTION_LAYER, family_of


def matmul_params(hf_config) -> int:
    """Parameters that take part in matrix products per token: the decoder's linear layers and the LM head. A
    family with its own layer count (Granite-4.0-H's Mamba-2 hybrid) is counted layer by layer (``families``)."""
    c = hf_config
    layers = family_of(c).layers
    if layers is not None:
        return sum(n for n, _ in layers(c)) + c.hidden_size * c.vocab_size
    d, L, ffn, v = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    head_dim = getattr(c, "head_dim", None) or d // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    q = c.num_attention_heads * head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * ffn
    return L * per_layer + d * v


def flops_per_token(hf_config, seq_len: int) -> float:
    """Training FLOPs per token with a frozen base: 4·N_matmul (forward + input gradients) + 12·L·d·T (attention:
    QKᵀ and AV over the full T x T square, forward and twice that backward). A GraniteMoeHybrid config: the
    attention term over its attention layers only (d = heads·head_dim), plus 3 x the Mamba-2 layers' SSD scan
    FLOPs (``families.granite_hybrid_layers``; forward and twice that backward, like attention)."""
    c = hf_config
    layers = family_of(c).layers
    if layers is not None:
        attn_layers = sum(1 for kind in c.layer_types if kind in ATTENTION_LAYER)
        scan = sum(f for _, f in layers(c))
        return 4.0 * matmul_params(c) + 12.0 * attn_layers * c.hidden_size * seq_len + 3.0 * scan
    return 4.0 * matmul_params(c) + 12.0 * c.num_hidden_layers * c.hidden_size * seq_len


def bits_per_token(nats: float, tokens: float) -> float:
    """Bits per token of summed nats over counted tokens; NaN where no token counted."""
    return nats / tokens / math.log(2.0) if tokens > 0 else float("nan")
