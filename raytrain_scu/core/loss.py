"""The training loss: Σ cross-entropy nats of a causal LM, with the LM head and the cross-entropy fused chunk by chunk
(logits never materialised in fp32) where the model's head is known, and the model's own logits elsewhere; and
compiling it for training. No ray, mlflow or torch.distributed.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_scu.console import notice
from raytrain_scu.core.embed_quant import Int8Head, dequant_rows, slice_rows
from raytrain_scu.core.fp8 import Fp8FrozenLinear, fp8_head_grad, fp8_head_logits, quantize_rows, quantize_rows_
from raytrain_scu.core.model.families import HeadTransform, family_of, head_of_class
from raytrain_scu.core.model.packed import head_dim, packed_inputs
from raytrain_scu.core.model.parts import base_of, body_of
from raytrain_scu.core.offload import ActivationOffload


def fused_head(model) -> tuple[Optional[HeadTransform], str]:
    """Whether the fused loss can stand in for ``model``'s LM head: (its transform, why) or (None, why not)."""
    import transformers

    lm = base_of(model)
    cls = type(lm)
    make = head_of_class(cls.__name__)
    if make is None or getattr(transformers, cls.__name__, None) is not cls:
        return None, f"{cls.__module__}.{cls.__name__} is not in the model-family table's known LM heads"
    head = lm.get_output_embeddings()
    if not isinstance(head, (nn.Linear, Int8Head)):
        return None, f"{cls.__name__}'s lm_head is a {type(head).__name__}, not a plain Linear (LoRA on lm_head?)"
    if any(p.requires_grad for p in head.parameters()):
        return None, f"{cls.__name__}'s lm_head is trainable (the fused loss computes no weight gradient)"
    transform = make(lm.config)
    return transform, f"{cls.__name__}: logits = {transform} with z = lm_head(h), in the fused loss"


def _chunk_ce_fused(z, y, bias, scale: float, softcap: float, need_grad: bool, fp8_grad: bool = False):
    """One chunk's Σ CE nats (float32) of ``transform(z + bias)`` against ``y``, and with ``need_grad`` its gradient
    with respect to ``z`` in z's dtype (with ``fp8_grad``: in e4m3 with its row scales, :func:`quantize_rows`, for an
    FP8 head's product), written without in-place ops or a one-hot so that inductor fuses the float32 softmax into
    passes over ``z`` (:data:`_chunk_ce_compiled`). The same math as the eager loop of :class:`_ChunkedLinearCE`;
    tests/test_loss_arch.py holds the two together."""
    logits = z.float() if bias is None else z.float() + bias.float()
    logits = logits * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    valid = y != -100
    y_safe = torch.where(valid, y, torch.zeros_like(y))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    nats = ((lse.squeeze(1) - logits.gather(1, y_safe[:, None]).squeeze(1)) * valid).sum()
    if not need_grad:
        return nats, None
    target = torch.arange(logits.shape[1], device=z.device)[None, :] == y_safe[:, None]
    grad = (torch.exp(logits - lse) - target.float()) * valid[:, None] * scale
    if softcap:
        grad = grad * (1.0 - (logits / softcap) ** 2)
    return nats, quantize_rows(grad) if fp8_grad else grad.to(z.dtype)


def compile_options(mode: str = "default") -> dict:
    """torch.compile's backend: inductor with ``mode``, or the backend RAYTRAIN_SCU_COMPILE_BACKEND names. The CPU test
    suite names aot_eager_decomp_partition: dynamo's graphs, AOTAutograd and the min-cut partitioner as inductor gets
    them, without inductor's C++ code generation (hundreds of compiler processes a suite, minutes of its time), which
    is not the code a GPU run executes; the GPU tests and the bench compile with inductor."""
    backend = os.environ.get("RAYTRAIN_SCU_COMPILE_BACKEND", "inductor")
    return {"mode": mode} if backend == "inductor" else {"backend": backend}


# built on first use (compiling costs seconds): {False: every full chunk, one static graph; True: a batch's last,
# shorter chunk, one graph for any length, since padded micro-batches (data.packing=false) end in a new length nearly
# every step and static graphs would recompile until torch's recompile limit}
_chunk_ce_compiled: dict = {}


def _compiled_chunk_ce(dynamic: bool = False):
    if dynamic not in _chunk_ce_compiled:
        _chunk_ce_compiled[dynamic] = torch.compile(_chunk_ce_fused, dynamic=dynamic, **compile_options())
    return _chunk_ce_compiled[dynamic]


def _slice_stats(z, bias, yi, scale: float, softcap: float):
    """Pass 1 of the int8 head's loss over one slice of the vocabulary (:func:`_int8_head_ce`): the slice's logits
    ``transform(z + bias)`` in float32, and per row their max, Σ exp(logit - max), and the target's logit where the
    target ``yi`` (the label minus the slice's first row) falls in the slice, else 0. Functional, for inductor to
    fuse into passes over ``z``."""
    logits = z.float() if bias is None else z.float() + bias.float()
    logits = logits * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    top = logits.amax(dim=1)
    sumexp = torch.exp(logits - top[:, None]).sum(dim=1)
    inside = (yi >= 0) & (yi < logits.shape[1])
    picked = logits.gather(1, yi.clamp(0, logits.shape[1] - 1)[:, None]).squeeze(1)
    return top, sumexp, torch.where(inside, picked, torch.zeros_like(picked))


def _slice_grad(z, bias, yi, lse, valid, scale: float, softcap: float):
    """Pass 2 over one slice: the gradient of Σ CE with respect to ``z``, (softmax - onehot) · dlogits/dz, in z's
    dtype, from the rows' log-sum-exp over the whole vocabulary (``lse``); rows not ``valid`` (label -100) get 0."""
    logits = z.float() if bias is None else z.float() + bias.float()
    logits = logits * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    target = torch.arange(logits.shape[1], device=z.device)[None, :] == yi[:, None]
    grad = (torch.exp(logits - lse[:, None]) - target.float()) * valid[:, None] * scale
    if softcap:
        grad = grad * (1.0 - (logits / softcap) ** 2)
    return grad.to(z.dtype)


_slice_compiled: dict = {}  # built on first use, as the chunk's float32 part is


def _slice_fn(fn, compiled: bool):
    if not compiled:
        return fn
    if fn not in _slice_compiled:
        _slice_compiled[fn] = torch.compile(fn, dynamic=False, **compile_options())
    return _slice_compiled[fn]


def _int8_head_ce(h, q, s, bias, y, chunk_size: int, scale: float, softcap: float, compiled: bool, need_grad: bool):
    """Σ CE nats of an int8 head (rows ``q`` with scales ``s``, embed_quant.py) and, with ``need_grad``, their
    gradient with respect to ``h``: the vocabulary in the outer loop, so each slice of the table is dequantised once
    per pass (twice in all) instead of once per chunk of tokens per product. Pass 1 keeps a running log-sum-exp over
    the slices (an online softmax) and the target logits; pass 2 forms each slice's logit gradient again from its
    logits and the final log-sum-exp, and adds its product with the slice into a float32 gradient. The logits are
    computed twice: one more head GEMM, against 2 x (tokens / chunk) dequantisations of the whole table saved. A slice
    holds at most ``chunk_size`` x vocab logits (what a chunk of the other path holds) and dequantises to at most
    :data:`~raytrain_scu.core.embed_quant.SLICE_BYTES`."""
    n, vocab = h.shape[0], q.shape[0]
    rows = max(1, min(slice_rows(q.shape[1], h.element_size()), chunk_size * vocab // max(1, n)))
    slices = [(a, min(a + rows, vocab)) for a in range(0, vocab, rows)]
    valid = y != -100
    # as cross-entropy does (an error on the CPU, a device-side assert on a GPU, no host sync): a label outside the
    # vocabulary would otherwise add its row's log-sum-exp with no target logit
    torch._assert_async(((y >= 0) & (y < vocab) | ~valid).all(), "int8 head loss: a label is outside the vocabulary")
    top = torch.full((n,), float("-inf"), dtype=torch.float32, device=h.device)
    sumexp = torch.zeros(n, dtype=torch.float32, device=h.device)
    picked = torch.zeros(n, dtype=torch.float32, device=h.device)
    stats = _slice_fn(_slice_stats, compiled)
    for a, b in slices:
        z = h @ dequant_rows(q, s, a, b, h.dtype).t()
        t, e, p = stats(z, None if bias is None else bias[a:b], y - a, scale, softcap)
        new_top = torch.maximum(top, t)
        sumexp = sumexp * torch.exp(top - new_top) + e * torch.exp(t - new_top)
        top, picked = new_top, picked + p
    lse = top + torch.log(sumexp)
    nats = ((lse - picked) * valid).sum()
    if not need_grad:
        return nats, None
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    grad = _slice_fn(_slice_grad, compiled)
    for a, b in slices:
        w = dequant_rows(q, s, a, b, h.dtype)
        dz = grad(h @ w.t(), None if bias is None else bias[a:b], y - a, lse, valid, scale, softcap)
        grad_h += dz @ w
    return nats, grad_h.to(h.dtype)


class _ChunkedLinearCE(torch.autograd.Function):
    """Σ cross-entropy (nats) of ``head(h)`` against ``y`` without keeping the (tokens × vocab) logits.

    ``head(h) = softcap·tanh(scale·(h @ W.T + b) / softcap)`` (:class:`HeadTransform`; no tanh when softcap is 0).
    The forward pass walks chunks of tokens, computing each chunk's logits, its CE in float32 and at once the
    gradient with respect to ``h``, (softmax - onehot) · dlogits/dz · scale @ W; only that gradient (tokens ×
    hidden) is saved. The lm_head weight ``W`` (and bias ``b``) is frozen under LoRA, so it needs no gradient.
    With ``compiled``, each chunk's float32 part between the two GEMMs is :func:`_chunk_ce_fused` under
    torch.compile (no autograd in it: the gradient is computed here, by hand); otherwise in-place eager kernels.
    With ``fp8_head`` (``model.head_fp8``) both GEMMs run in FP8 from that module's copies (fp8.py): each chunk's
    ``h`` and its logit gradient are quantised per row, the gradient as it is formed. With ``weight_scale`` the
    weight is an int8 table with those row scales, and :func:`_int8_head_ce` walks the vocabulary instead.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, y, chunk_size: int, scale: float, softcap: float, compiled: bool,
                need_grad: bool, weight_scale, fp8_head):
        if weight_scale is not None:
            total, grad_h = _int8_head_ce(h, weight, weight_scale, bias, y, chunk_size, scale, softcap, compiled,
                                          need_grad)
            ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0))
            return total
        n = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grad else None
        for s in range(0, n, chunk_size):
            hc, yc = h[s:s + chunk_size], y[s:s + chunk_size]
            if compiled:
                nats, dz = _compiled_chunk_ce(hc.shape[0] != chunk_size)(
                    _head(hc, weight, fp8_head), yc, bias, scale, softcap, grad_h is not None, fp8_head is not None)
                total += nats
                if dz is not None:
                    grad_h[s:s + chunk_size] = _head_grad(dz, weight, fp8_head).to(h.dtype)
                continue
            logits = _head(hc, weight, fp8_head).float()
            if bias is not None:
                logits += bias.float()
            if scale != 1.0:
                logits.mul_(scale)
            if softcap:
                logits.div_(softcap).tanh_().mul_(softcap)
            valid = yc != -100
            yc_safe = torch.where(valid, yc, torch.zeros_like(yc))
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, yc_safe[:, None]).squeeze(1)
            total += ((lse - picked) * valid).sum()
            if grad_h is not None:
                # the softcap's derivative 1 - tanh² = 1 - (logits/cap)², taken before the buffer becomes the
                # softmax: one more chunk-sized float32 buffer, no more than logsumexp's own temporary above
                dcap = logits.div(softcap).square_().neg_().add_(1.0) if softcap else None
                probs = logits.sub_(lse[:, None]).exp_()
                probs[torch.arange(probs.shape[0], device=probs.device), yc_safe] -= 1.0
                probs.mul_(valid[:, None])
                if dcap is not None:
                    probs.mul_(dcap)
                    del dcap
                if scale != 1.0:
                    probs.mul_(scale)
                dz = probs if fp8_head is None else quantize_rows_(probs)
                grad_h[s:s + chunk_size] = _head_grad(dz, weight, fp8_head).to(h.dtype)
        ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), None, None, None, None, None, None, None, None, None, None


def _head(h, weight, fp8_head):
    """The head's product ``h @ W.T``; an FP8 head runs it from its e4m3 copy (bf16 out)."""
    return h @ weight.t() if fp8_head is None else fp8_head_logits(h, fp8_head)


def _head_grad(g, weight, fp8_head):
    """``g @ W`` in the weight's dtype; for an FP8 head ``g`` is (e4m3 rows, their scales) and the product bf16."""
    return g.to(weight.dtype) @ weight if fp8_head is None else fp8_head_grad(*g, fp8_head)


@torch.compiler.disable
def chunked_ce_sum(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, chunk_size: int = 4096, *,
                   bias: Optional[torch.Tensor] = None, transform: HeadTransform = HeadTransform(),
                   compiled: bool = False, weight_scale: Optional[torch.Tensor] = None,
                   fp8_head: Optional[Fp8FrozenLinear] = None) -> torch.Tensor:
    """Σ CE nats of the logits ``transform(h @ weight.T + bias)`` against ``y`` (-100 ignored), chunk by chunk.

    Never traced by the model's compile, on purpose: traced by dynamo/inductor on CUDA (torch 2.11) this
    autograd.Function returns an exactly zero gradient for ``h``, so under ``model.compile=true`` the LoRA B matrices
    would never leave zero (the CPU build compiles it correctly); the decoder before it stays compiled (one graph
    break). With ``compiled`` only the float32 softmax between each chunk's two GEMMs
    runs compiled, as a function with no autograd in it (:func:`_chunk_ce_fused`). With ``weight_scale`` the weight is
    an int8 table with those row scales (``quant.embedding_int8``, embed_quant.py); with ``fp8_head`` (the head
    module, ``model.head_fp8``) both products run in FP8 from its copies.
    """
    need_grad = h.requires_grad and torch.is_grad_enabled()  # an eval pass (no_grad) forms no gradient
    return _ChunkedLinearCE.apply(h, weight, bias, y, chunk_size, float(transform.scale), float(transform.softcap),
                                  compiled, need_grad, weight_scale, fp8_head)


def _fp8(head) -> Optional[Fp8FrozenLinear]:
    return head if isinstance(head, Fp8FrozenLinear) else None


_notes: set = set()


def _note_once(text: str) -> None:
    if text not in _notes:
        _notes.add(text)
        notice(f"note: {text}")  # the next report carries it to the driver's console


class CausalLMLoss(nn.Module):
    """forward(x, y, pos=None) -> (Σ CE nats, number of target tokens). What torch.compile wraps. ``pos``: packed
    rows' positions (:mod:`~raytrain_scu.core.model.packed`), each example attending only to itself.

    With ``fused`` the LM head and the cross-entropy are computed chunk by chunk (``_ChunkedLinearCE``), with the
    model's own logit transform (``core.model.families``); a model whose head is not known there, or whose lm_head
    is not a frozen Linear, uses its own logits in float32 instead, with a one-line note. ``self.fused`` says
    which path runs and ``self.fused_reason`` why.
    """

    def __init__(self, model, fused: bool = True, chunk_size: int = 4096):
        super().__init__()
        self.model = model
        self.transform, self.fused_reason = fused_head(model) if fused else (None, "model.fused_loss=false")
        self.fused = self.transform is not None
        if fused and not self.fused:
            _note_once(f"model.fused_loss: {self.fused_reason}; using the model's own logits "
                       f"(the full tokens x vocab logits are materialised)")
        self.chunk_size = chunk_size
        self.head_size = head_dim(model.config)  # packed rows' attention kernel depends on it
        self.compiled_ce = False  # compile_for_training turns it on: the loss' float32 part compiled per chunk
        self.offload: Optional[ActivationOffload] = None  # model.offload_activations: saved activations on the host

    def forward(self, x: torch.Tensor, y: torch.Tensor, pos: Optional[torch.Tensor] = None):
        n_tokens = (y != -100).sum()
        kw = {} if pos is None else packed_inputs(pos, head_size=self.head_size)
        if self.fused:
            with self._offloading():
                hidden = self.decoder()(input_ids=x, **kw).last_hidden_state
            head = self.model.get_output_embeddings()
            nats = chunked_ce_sum(hidden.reshape(-1, hidden.shape[-1]), head.weight, y.reshape(-1), self.chunk_size,
                                  bias=head.bias, transform=self.transform, compiled=self.compiled_ce,
                                  weight_scale=getattr(head, "weight_scale", None), fp8_head=_fp8(head))
        else:
            with self._offloading():
                logits = self.model(input_ids=x, return_dict=True, **kw).logits
            nats = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                   ignore_index=-100, reduction="sum")
        return nats, n_tokens

    def _offloading(self):
        """The model's forward (not the loss) under ``self.offload``'s hooks when a backward will follow."""
        if self.offload is None or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        return self.offload.hooks()

    def row_nats(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Σ cross-entropy nats of each row of (x, y), shape (rows,): forward's math, kept apart per row."""
        if self.fused:
            hidden = self.decoder()(input_ids=x).last_hidden_state
            head = self.model.get_output_embeddings()
            return torch.stack([chunked_ce_sum(h, head.weight, t, self.chunk_size, bias=head.bias,
                                               transform=self.transform, compiled=self.compiled_ce,
                                               weight_scale=getattr(head, "weight_scale", None), fp8_head=_fp8(head))
                                for h, t in zip(hidden, y)])
        logits = self.model(input_ids=x, return_dict=True).logits.float()
        return F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100, reduction="none").sum(dim=1)

    def decoder(self):
        """The transformer body under the LM head (peft injects LoRA into it in place)."""
        return body_of(self.model)


def compile_for_training(loss_model: CausalLMLoss, *, scope: str = "layers", mode: str = "default") -> nn.Module:
    """torch.compile for the training loop. ``layers``: every decoder layer is compiled in place and, being the same
    code on parameters that dynamo treats as inputs, all of them share one compiled graph, so warm-up costs one layer's
    compile (forward+backward, and again for eval under no_grad) instead of the whole unrolled model's. ``model``: one
    graph for the whole forward. Both leave the chunked loss untraced and compile only its float32 part per chunk
    (see :func:`chunked_ce_sum`)."""
    loss_model.compiled_ce = True
    layers = getattr(loss_model.decoder(), "layers", None)
    if scope == "model" or not isinstance(layers, nn.ModuleList):
        if scope == "layers":
            _note_once(f"{type(loss_model.decoder()).__name__} has no decoder `layers` list; compiling the whole "
                       f"model (model.compile_scope=model)")
        return torch.compile(loss_model, **compile_options(mode))
    for layer in layers:
        layer.compile(**compile_options(mode))
    return loss_model


# the partitioner's bans that keep elementwise ops from being recomputed in the backward (torch._functorch.config):
# lifted, the min-cut recomputes elementwise results (the norms' outputs, SiLU(gate)*up) beside the kernels that read
# them instead of saving them; still only ops on its recompute allowlist, never a matmul, attention or a custom
# (Triton) kernel
ELEMENTWISE_RECOMPUTE_BANS = ("ban_recompute_used_far_apart", "ban_recompute_long_fusible_chains",
                              "ban_recompute_materialized_backward")


def recompute_elementwise(setting: str, model) -> bool:
    """``model.recompute_elementwise`` for ``model``: ``always`` / ``never``, or with ``auto`` its family's choice
    (:class:`~raytrain_scu.core.model.families.Family`; a family not listed recomputes)."""
    if setting != "auto":
        return setting == "always"
    return family_of(model.config).recompute_elementwise


def compile_settings(recompute_elementwise: bool):
    """The context the training graphs are built in (compilation is lazy: the first step's forward and backward, and
    any recompile after): with ``recompute_elementwise`` the partitioner's :data:`ELEMENTWISE_RECOMPUTE_BANS` lifted
    (``model.recompute_elementwise``, :func:`recompute_elementwise`). A torch without those settings keeps its
    defaults, with a note. dynamo's guards do not read these settings: a later run in the same process reuses the
    graphs compiled under the first one's until ``torch._dynamo.reset()`` (the bench resets between parts)."""
    if not recompute_elementwise:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    missing = [k for k in ELEMENTWISE_RECOMPUTE_BANS if not hasattr(functorch_config, k)]
    if missing:
        _note_once(f"model.recompute_elementwise: torch {torch.__version__} has no {', '.join(missing)}; the compiled "
                   f"layers save their activations as torch's default partitioner chooses")
        return contextlib.nullcontext()
    return functorch_config.patch(**{k: False for k in ELEMENTWISE_RECOMPUTE_BANS})
