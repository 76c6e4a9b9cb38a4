"""The frozen token embedding and LM head made smaller (QLoRA's remaining bf16 bulk): ``quant.embedding_int8`` keeps
them in int8 with one scale per row, ``quant.offload_embedding`` keeps the input embedding in CPU memory. No ray,
mlflow or torch.distributed.

bitsandbytes quantises the decoder's linears but leaves the 128k-row embedding and head in bf16: at the Llama-3.1-8B
shape that is 0.98 GiB each, at the 1B shape (tied) 0.49 GiB, a quarter of a QLoRA run's peak. In int8 each row r is
``round(W[r] / s[r])`` with ``s[r] = max|W[r]| / 127``, so

    embedding   E[ids]        = q[ids] * s[ids]                      (the rows looked up, then scaled)
    head        h @ W.T       = (h @ q.T) * s                        (a row of W is a column of the logits)
    head grad   g @ W         = (g * s) @ q

The head's products dequantise ``q`` a slice of rows at a time (:data:`SLICE_BYTES`), never the whole table, so no
bf16 copy of it exists at any moment; the fused loss (loss.py) takes ``(q, s)`` the same way. A tied model keeps one
table for both. Both weights are frozen under LoRA, so nothing here needs a weight gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_scu.core.model.parts import base_of
from raytrain_scu.errors import ModelError

INT8_MAX = 127.0
SLICE_BYTES = 64 << 20  # the largest dequantised slice of a table a head product makes (bytes, compute dtype)


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (2-D) as int8 rows and their float32 scales [rows]: ``w ≈ q * s[:, None]``. A zero row gets the scale
    1e-12 / 127 (its q is all zeros). Row by row in float32 slices: no float32 copy of a whole 128k-row table."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    s = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for a, b in row_slices(w.shape[0], w.shape[1], 4):
        rows = w[a:b].float()
        s[a:b] = rows.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
        q[a:b] = torch.round(rows / s[a:b, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, s


def slice_rows(cols: int, elem_bytes: int) -> int:
    """How many rows of a table ``cols`` wide make at most :data:`SLICE_BYTES` once dequantised (at least one)."""
    return max(1, SLICE_BYTES // max(1, cols * elem_bytes))


def row_slices(rows: int, cols: int, elem_bytes: int) -> list[tuple[int, int]]:
    """(start, end) row ranges of a [rows, cols] table, each at most :data:`SLICE_BYTES` once dequantised."""
    step = slice_rows(cols, elem_bytes)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def dequant_rows(q: torch.Tensor, s: torch.Tensor, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows a:b of the table in ``dtype``: near the original weights, so fp16 cannot overflow as ``h @ q.T`` can."""
    return q[a:b].to(dtype) * s[a:b, None].to(dtype)


def int8_logits(h: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``h @ (q * s[:, None]).T`` in h's dtype, one slice of rows of ``q`` dequantised at a time. No autograd here:
    :class:`Int8Head` wraps it."""
    parts = [h @ dequant_rows(q, s, a, b, h.dtype).t()
             for a, b in row_slices(q.shape[0], q.shape[1], h.element_size())]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def int8_grad_input(g: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``g @ (q * s[:, None])`` in g's dtype (the gradient that reaches the head's input), slice by slice."""
    out = None
    for a, b in row_slices(q.shape[0], q.shape[1], g.element_size()):
        part = g[..., a:b] @ dequant_rows(q, s, a, b, g.dtype)
        out = part if out is None else out.add_(part)
    return out


class _Int8Linear(torch.autograd.Function):
    """``x @ W.T`` for an int8 table that saves only the table for its backward (autograd through the slices would
    keep every dequantised slice: a bf16 copy of the whole table)."""

    @staticmethod
    def forward(ctx, x, q, s):
        ctx.save_for_backward(q, s)
        return int8_logits(x, q, s)

    @staticmethod
    def backward(ctx, grad_out):
        q, s = ctx.saved_tensors
        return int8_grad_input(grad_out, q, s), None, None


class Int8Table(nn.Module):
    """One frozen [rows, dim] table in int8 (buffer ``weight``) with its float32 row scales (``weight_scale``); the
    dtype it stands in for is ``dtype``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q, s = quantize_rows_int8(weight.detach())
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", s)
        self.dtype = weight.dtype


class Int8Embedding(nn.Module):
    """An embedding lookup from an :class:`Int8Table`, times ``embed_scale`` where the model's own embedding has one
    (Gemma's scaled word embedding)."""

    def __init__(self, table: Int8Table, embed_scale=None):
        super().__init__()
        self.table = table
        self.register_buffer("embed_scale", embed_scale, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        out = (F.embedding(ids, t.weight).float() * t.weight_scale[ids].unsqueeze(-1)).to(t.dtype)
        return out if self.embed_scale is None else out * self.embed_scale.to(t.dtype)


class Int8Head(nn.Module):
    """A frozen LM head ``x @ W.T (+ b)`` from an :class:`Int8Table` (shared with the embedding when tied)."""

    def __init__(self, table: Int8Table, bias=None):
        super().__init__()
        self.table = table
        self.register_buffer("bias", None if bias is None else bias.detach())

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    @property
    def weight_scale(self) -> torch.Tensor:
        return self.table.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if not torch.is_autocast_enabled(x.device.type) else torch.get_autocast_dtype(x.device.type)
        out = _Int8Linear.apply(x.to(dtype), self.table.weight, self.table.weight_scale)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class OffloadedEmbedding(nn.Module):
    """The input embedding kept in CPU memory: its rows for a batch are looked up on the CPU and copied to the ids'
    device. The table is held outside the module tree, so moving the model never brings it to the GPU.

    Looked up in the forward, the rows need the ids back on the host: a device-to-host copy that waits for every kernel
    queued before it (the previous step's backward and optimizer step), so the device idles while the host looks up
    and launches again. :meth:`stage` avoids that: given a batch's host ids as they are sent to the device, it looks
    their rows up at once and queues their copy; the forward that gets those device ids (the same tensor) takes the
    staged rows without a sync, once. Any other ids (an evaluation between the two) take the synchronous way and leave
    the staged rows for their batch."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", inner.to("cpu"))
        self._staged: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (device ids, their rows on the device)

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def stage(self, host_ids: torch.Tensor, device_ids: torch.Tensor) -> None:
        """The rows of ``host_ids`` (CPU), looked up now and copied to ``device_ids``' device without waiting, for the
        forward that gets ``device_ids`` (the same ids, sent there)."""
        with torch.no_grad():
            rows = self.inner(host_ids)
            if device_ids.device.type == "cuda":
                rows = rows.pin_memory()
            self._staged = (device_ids, rows.to(device_ids.device, non_blocking=True))

    @torch.compiler.disable  # the staged rows are matched by tensor identity: eager, never guarded on by dynamo
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._staged is not None and self._staged[0] is ids:
            rows, self._staged = self._staged[1], None
            return rows
        return self.inner(ids.to("cpu")).to(ids.device)  # other ids (an evaluation's) leave the stage for its batch


def offloaded_embedding(model) -> Optional[OffloadedEmbedding]:
    """``model``'s input embedding where it is an :class:`OffloadedEmbedding`, else None."""
    lm = base_of(model)
    emb = lm.get_input_embeddings()
    return emb if isinstance(emb, OffloadedEmbedding) else None


TIED_OFFLOAD = ("quant.offload_embedding: this model ties its input embedding to its LM head, which would leave the "
                "GPU too; use quant.embedding_int8=true to shrink the shared table instead")


def ties_embeddings(hf_config) -> bool:
    """Whether a transformers config ties the input embedding to the LM head (transformers' default: tied)."""
    return bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", True))


def shrink_embeddings(model, *, int8: bool = False, offload: bool = False) -> None:
    """Replace ``model``'s (a peft or transformers causal LM, already on its device) frozen embedding and LM head:
    with ``int8`` both by :class:`Int8Embedding` / :class:`Int8Head` (one table when tied), with ``offload`` the
    input embedding by an :class:`OffloadedEmbedding`. Forward hooks on the old embedding (gradient checkpointing's
    input-requires-grad hook) move to the new one. Errors name the quant.* key."""
    if not (int8 or offload):
        return
    lm = base_of(model)
    emb, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    key = "quant.embedding_int8" if int8 else "quant.offload_embedding"
    scale = getattr(emb, "embed_scale", None)
    if not isinstance(emb, nn.Embedding) or (type(emb) is not nn.Embedding and not torch.is_tensor(scale)):
        raise ModelError(f"{key}: the input embedding is a {type(emb).__name__}, not a plain (or scaled) nn.Embedding")
    if any(p.requires_grad for p in emb.parameters()):
        raise ModelError(f"{key}: the input embedding is trainable (LoRA or modules_to_save on it); it must be frozen")
    if offload and tied:
        raise ModelError(TIED_OFFLOAD)
    new_emb = emb
    if int8:
        if type(head) is not nn.Linear or head.weight.requires_grad:
            raise ModelError(f"quant.embedding_int8: the LM head is a {type(head).__name__}"
                             f"{' (trainable)' if isinstance(head, nn.Linear) else ''}, not a frozen nn.Linear")
        table = Int8Table(emb.weight)
        new_emb = Int8Embedding(table, scale if type(emb) is not nn.Embedding else None)
        lm.set_output_embeddings(Int8Head(table if tied else Int8Table(head.weight), head.bias))
    if offload:
        new_emb = OffloadedEmbedding(new_emb)
    for hooks in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                  "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):  # moved: the old module may live on inside
        getattr(new_emb, hooks).update(getattr(emb, hooks))
        getattr(emb, hooks).clear()
    lm.set_input_embeddings(new_emb)


def embedding_targets(model, targets) -> list[str]:
    """The LoRA target names in ``targets`` that name ``model``'s input embedding or LM head module (what
    quant.embedding_int8 / quant.offload_embedding replace with frozen tables, where peft has no adapter)."""
    return embedding_targets_of(model, targets, head_only=False)


def embedding_targets_of(model, targets, *, head_only: bool) -> list[str]:
    """:func:`embedding_targets`, or with ``head_only`` those naming the LM head alone (``model.head_fp8``)."""
    lm = base_of(model)
    tables = (lm.get_output_embeddings(),) if head_only else (lm.get_input_embeddings(), lm.get_output_embeddings())
    mods = {id(m) for m in tables if m is not None}
    names = {n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if id(m) in mods}
    return [t for t in targets if t in names]


EMBEDDING_TARGETS = ("lora.target_modules: {hit} would put LoRA on the embedding or LM head, which "
                     "quant.embedding_int8 / quant.offload_embedding replace with frozen tables; drop them from the "
                     "targets or turn those off")
