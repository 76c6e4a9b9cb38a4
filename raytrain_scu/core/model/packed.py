"""Attention over packed rows: several examples in one row, each attending only to itself, positions restarting.

    kw = packed_inputs(pos)                  # pos: (B, T) each example's own positions 0, 1, ...
    model(input_ids=x, **kw)                 # position_ids=pos and packed_mask, which the attention reads

A 0 in ``pos`` starts an example. The mask is made once per forward and shared by every layer:
- on a GPU, a FlexAttention BlockMask (document-causal) for compiled FlexAttention, which skips the blocks between
  examples: on an H200 at 8 x 2048 tokens of ~390-token examples, forward and backward of one layer's attention take
  1.80 ms (1B shape) and 2.04 ms (8B shape), against 3.81 / 6.53 ms for SDPA with a boolean mask and 2.09 / 3.39 ms
  for ``varlen_attn`` (docs/bench/h200_2026-12-02_packed_attention_*.json);
- elsewhere (and for heads smaller than FlexAttention's 16), a boolean (B, 1, T, T) block-diagonal causal mask for
  SDPA: exact, what the CPU tests compare against examples run one at a time.

Models whose attention is not plain causal attention over the whole row (a sliding window, logit soft-capping,
chunked attention, non-attention layers) are refused: :func:`check_packing`.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from raytrain_scu.errors import ModelError


def segments(pos: torch.Tensor) -> torch.Tensor:
    """Each token's example number within its row: a running count of position restarts."""
    return (pos == 0).cumsum(-1)


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return create_block_mask, torch.compile(flex_attention)


FLEX_MIN_HEAD_DIM = 16  # FlexAttention's kernels need query/key/value heads of at least 16


def head_dim(config) -> int:
    """The attention head size of a transformers config (0 where it has no attention heads)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", 0)
    return getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 0) // heads if heads else 0)


def packed_mask(pos: torch.Tensor, *, flex: bool):
    """The mask of packed rows ``pos`` (B, T): a BlockMask with ``flex`` (CUDA, heads of at least
    FLEX_MIN_HEAD_DIM), else a boolean (B, 1, T, T) tensor."""
    seg = segments(pos)
    B, T = pos.shape
    if flex:
        create_block_mask, _ = _flex()

        def document_causal(b, h, q, k):
            return (seg[b, q] == seg[b, k]) & (q >= k)
        return create_block_mask(document_causal, B, None, T, T, device=pos.device, _compile=True)
    causal = torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()
    return (seg[:, None, :, None] == seg[:, None, None, :]) & causal


def packed_inputs(pos: torch.Tensor, *, head_size: int) -> dict:
    """The model's keyword arguments for packed rows: the positions, and the mask its attention reads (FlexAttention's
    on CUDA where the heads are large enough, the boolean one elsewhere)."""
    flex = pos.is_cuda and head_size >= FLEX_MIN_HEAD_DIM
    return {"position_ids": pos, "packed_mask": packed_mask(pos, flex=flex)}


def attention(module, query, key, value, mask, *, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function contract ((B, H, T, D) in, (B, T, H, D) out, no weights) over packed rows."""
    for key_name in ("sliding_window", "softcap"):
        if kwargs.get(key_name) is not None:
            raise ModelError(f"packed rows with {key_name}={kwargs[key_name]}: this attention keeps examples apart "
                             f"only under plain causal attention; set data.packing=false")
    if isinstance(mask, torch.Tensor):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
    else:
        if dropout:
            raise ModelError(f"packed rows on a GPU use FlexAttention, which has no attention dropout "
                             f"(the model's is {dropout}); set data.packing=false")
        out = _flex()[1](query, key, value, block_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def check_packing(config, name: str, *, gpu: bool = False) -> None:
    """Refuse packed rows for a model whose attention does not see a whole row causally (a sliding window, logit
    soft-capping, chunked attention, non-attention layers), or on GPUs (FlexAttention) has attention dropout, naming
    what it has."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems = []
    if gpu and getattr(text, "attention_dropout", 0.0):
        problems.append(f"attention dropout {text.attention_dropout} (FlexAttention, the GPU kernel, has none)")
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        problems.append(f"a sliding window of {text.sliding_window}")
    if getattr(text, "attn_logit_softcapping", None):
        problems.append("attention logit soft-capping")
    if getattr(text, "attention_chunk_size", None):
        problems.append("chunked attention")
    kinds = set(getattr(text, "layer_types", None) or []) | set(getattr(text, "layers_block_type", None) or [])
    other = sorted(kinds - {"full_attention", "attention"})
    if other:
        problems.append(f"layers of kind {', '.join(other)}")
    if problems:
        raise ModelError(f"data.packing=true: {name} has {' and '.join(problems)}, where packed examples would see "
                         f"each other; set data.packing=false (one example a row, padded)")
