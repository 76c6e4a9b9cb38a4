"""An FP8 frozen base (``model.base_fp8``): the frozen GEMMs under each peft LoRA Linear in e4m3 with rowwise scales,
on plain ``torch._scaled_mm``; the LoRA products stay in their own dtype. No ray, mlflow or torch.distributed.

The frozen weight W [N, K] never gets a gradient, so a base layer has two products only, both in FP8:

    forward      y  = x @ W.T      x quantised per token (row of x) now, W per output row (once, at the swap)
    input-grad   gx = g @ W        g quantised per token now, W per input column (a second copy, once)

W is quantised once, into two e4m3 copies (one per product, each scaled along the axis its product reduces over):
2 bytes per weight, as much again as the bf16 base. Only activations and output-gradients are quantised per step;
under torch.compile inductor fuses that (amax, scale, cast) into the neighbouring kernels, where eager it costs more
than the FP8 GEMM saves (docs/benchmarks.md: 10.0 ms/layer eager vs 2.77 fused vs 5.09 bf16 at the 1B shape). The
forward saves nothing for the backward but the weight's second copy, which the module holds anyway.

The LM head (``model.head_fp8``) is converted the same way (:func:`convert_head_to_fp8`): the fused loss (loss.py)
runs its two products from the copies, chunk by chunk, quantising each chunk's hidden rows before the forward product
and its logit gradient as the softmax forms it; the model's own forward runs :class:`Fp8FrozenLinear`'s. Its errors
name model.head_fp8.

Both copies and their scales are frozen Parameters on the base Linear (``fp8_weight``, ``fp8_weight_t`` and their
``*_scale``), computed by each rank from its own base (no DDP wrapper broadcasts them: dist.average_gradients). The
copies are held as uint8 bits, viewed as e4m3 in the forward (from when DDP broadcast them, over gloo on CPUs, which
refuses float8). The bf16 weight stays as it was, and saved adapters hold only the LoRA weights, so a model rebuilt
from one is plain; the in-loop evaluation and peft's disable_adapter() still run the FP8 base. Errors name
model.base_fp8.

Devices: CUDA GPUs of compute capability 8.9 or more (Ada, Hopper, Blackwell). The CPU where torch's CPU _scaled_mm
takes rowwise scales: torch 2.13 does, 2.11's is per-tensor only, and :func:`check_fp8_device` refuses it there.
"""
from __future__ import annotations

import fnmatch
from typing import Optional

import torch
import torch.nn as nn

from raytrain_scu.core.model.parts import base_of
from raytrain_scu.errors import ModelError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
MM_ALIGN = 16  # torch._scaled_mm wants both dimensions of its second operand divisible by 16


def quantize_rows(t: torch.Tensor):
    """``t`` (2-D) in e4m3, each row scaled so its largest magnitude maps to 448, and the float32 inverse scales
    [rows, 1] that undo it. The amax is clamped (a zero row divides by 1e-12, not 0): no branch on tensor values,
    so torch.compile traces it without a graph break."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    q = (t.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, amax / E4M3_MAX


def quantize_rows_(t: torch.Tensor):
    """:func:`quantize_rows` of a float32 buffer that is not needed afterwards: scaled and clamped in place, so no
    second buffer of its size is made (the fused loss' eager path, whose buffer is a chunk of logit gradients)."""
    amax = torch.linalg.vector_norm(t, ord=float("inf"), dim=-1, keepdim=True).clamp_(min=1e-12)
    q = t.mul_(E4M3_MAX / amax).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, amax / E4M3_MAX


class _Fp8FrozenLinear(torch.autograd.Function):
    """``x @ W.T (+ b)`` from the pre-quantised ``w_q`` [N, K] (scales [1, N]) and its input-gradient ``g @ W`` from
    ``wt_q`` [K, N] (scales [1, K]); both GEMMs return bf16, cast to ``out_dtype``. No gradient for W or b."""

    @staticmethod
    def forward(ctx, x, w_q, w_scale, wt_q, wt_scale, bias, out_dtype):
        x2 = x.reshape(-1, x.shape[-1])
        xq, x_scale = quantize_rows(x2)
        out = torch._scaled_mm(xq, w_q.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
        out = out.to(out_dtype)
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(wt_q, wt_scale)
        ctx.x_dtype = x.dtype
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        wt_q, wt_scale = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            gq, g_scale = quantize_rows(grad_out.reshape(-1, grad_out.shape[-1]))
            gx = torch._scaled_mm(gq, wt_q.t(), scale_a=g_scale, scale_b=wt_scale, out_dtype=torch.bfloat16)
            gx = gx.to(ctx.x_dtype).view(*grad_out.shape[:-1], gx.shape[-1])
        return gx, None, None, None, None, None, None


def _fp8_linear_forward(self, x):
    """nn.Linear.forward through :class:`_Fp8FrozenLinear`; the output dtype is what F.linear would give (the autocast
    dtype under autocast, else the input's)."""
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return _Fp8FrozenLinear.apply(x, self.fp8_weight.view(E4M3), self.fp8_weight_scale,
                                  self.fp8_weight_t.view(E4M3), self.fp8_weight_t_scale, self.bias, out_dtype)


class Fp8FrozenLinear(nn.Linear):
    """A frozen nn.Linear whose forward runs in FP8 (see the module docstring); its own weight is kept unchanged."""
    forward = _fp8_linear_forward


def check_fp8_device(device: torch.device, *, probe: bool = True, key: str = "model.base_fp8") -> None:
    """Raise ModelError naming ``key`` where ``device`` cannot run e4m3 rowwise ``_scaled_mm``: a CUDA GPU
    below compute capability 8.9 (no FP8 tensor cores), or (``probe``: one tiny GEMM) a torch whose kernel refuses
    the product here (a CPU torch without it, say). The driver's preflight skips the probe on a GPU: it would give
    the driver a CUDA context, memory on the GPU the workers train on, for the whole run."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ModelError(f"{key}=true needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper "
                             f"or newer); {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}; set "
                             f"{key}=false")
    if not probe:
        return
    a, b = torch.ones(MM_ALIGN, MM_ALIGN, device=device), torch.ones(MM_ALIGN, MM_ALIGN, device=device)
    try:
        aq, sa = quantize_rows(a)
        bq, sb = quantize_rows(b)
        torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        raise ModelError(f"{key}=true: torch {torch.__version__} cannot run an e4m3 rowwise "
                         f"torch._scaled_mm on {device.type} ({str(e).splitlines()[0]}); set {key}=false"
                         ) from None


def _unconvertible(linear: nn.Module) -> str:
    """Why :func:`to_fp8` cannot convert ``linear`` (a phrase after "is"), or "" where it can: it must be a plain
    frozen nn.Linear, not converted yet, with both dimensions multiples of 16 (torch._scaled_mm's)."""
    if isinstance(linear, Fp8FrozenLinear):
        return "converted already"
    if type(linear) is not nn.Linear:
        return f"of type {type(linear).__name__}, not a plain nn.Linear (4-bit, LoRA or int8 on it?)"
    if linear.weight.requires_grad:
        return "trainable"
    if linear.in_features % MM_ALIGN or linear.out_features % MM_ALIGN:
        return (f"{linear.out_features} x {linear.in_features}: both must be multiples of {MM_ALIGN} for "
                f"torch._scaled_mm")
    return ""


def fp8_targets(model, exclude=()) -> list[tuple[str, nn.Linear]]:
    """The frozen base Linear under every peft LoRA Linear of ``model`` that ``model.base_fp8`` converts, in model
    order, each with the LoRA module's name in the base model (``model.layers.0.self_attn.q_proj``): all but those
    whose name matches an fnmatch pattern of ``exclude`` (``model.fp8_exclude``). Raises ModelError (naming the key)
    where there is no LoRA Linear, a pattern matches none of them (a typo keeps nothing out), a base is not a plain
    frozen nn.Linear (4-bit, converted already), its weight is trainable, or its dimensions are not multiples of 16."""
    from peft.tuners.lora import Linear as LoraLinear

    lm = base_of(model)
    adapted = [(name, m) for name, m in lm.named_modules() if isinstance(m, LoraLinear)]
    if not adapted:
        raise ModelError("model.base_fp8=true: the model has no peft LoRA Linear whose base could run in FP8 "
                         "(lora.target_modules names no nn.Linear?); set model.base_fp8=false")
    for pattern in exclude:
        if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in adapted):
            raise ModelError(f"model.fp8_exclude: {pattern!r} matches none of the adapted projections (names like "
                             f"{adapted[0][0]!r}, {adapted[-1][0]!r})")
    out = []
    for name, m in adapted:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude):
            continue
        problem = _unconvertible(m.base_layer)
        if problem:
            raise ModelError(f"model.base_fp8=true: {name}.base_layer is {problem}; set model.base_fp8=false")
        out.append((name, m.base_layer))
    if not out:
        raise ModelError(f"model.fp8_exclude {list(exclude)} keeps every adapted projection out of FP8; drop it or "
                         f"set model.base_fp8=false")
    return out


def unmatched_exclude(model, exclude, targets) -> tuple[list[str], list[str]]:
    """Preflight's check of ``model.fp8_exclude`` before any worker, on ``model`` (a meta-device skeleton will do):
    the patterns of ``exclude`` that match none of the Linears LoRA adapts under ``targets`` (lora.target_modules), and
    the first and last of those names to show; :func:`fp8_targets` checks the built model the same way."""
    lm = base_of(model)
    head = lm.get_output_embeddings()
    names = [name for name, m in lm.named_modules() if isinstance(m, nn.Linear) and m is not head
             and ("all-linear" in targets or name.rsplit(".", 1)[-1] in targets)]
    unmatched = [p for p in exclude if not any(fnmatch.fnmatchcase(name, p) for name in names)]
    return unmatched, names[:1] + names[-1:]


def convert_base_to_fp8(model, exclude=()) -> int:
    """Give the frozen bases :func:`fp8_targets` picks an FP8 forward, in place, on the device the model is on, each
    weight rounded to its nearest e4m3 code; returns how many were converted. Raises ModelError (naming
    model.base_fp8) as :func:`fp8_targets` does, or where the device cannot run FP8."""
    targets = fp8_targets(model, exclude)
    check_fp8_device(targets[0][1].weight.device)
    for _, base in targets:
        to_fp8(base)
    return len(targets)


def convert_head_to_fp8(model) -> Fp8FrozenLinear:
    """``model.head_fp8``: the LM head (``get_output_embeddings()``) made an :class:`Fp8FrozenLinear` in place, on the
    device the model is on. The fused loss (loss.py) then runs both of the head's products in FP8 from its two copies;
    the model's own forward (generation, the unfused loss) runs the same FP8 forward. A tied head keeps its bf16 weight
    shared with the input embedding, which looks its rows up in bf16 as before. Raises ModelError (naming
    model.head_fp8) for a head that is not a plain frozen nn.Linear with dimensions multiples of 16."""
    lm = base_of(model)
    head = lm.get_output_embeddings()
    problem = "missing (the model has no output embeddings)" if head is None else _unconvertible(head)
    if problem:
        raise ModelError(f"model.head_fp8=true: the LM head is {problem}; set model.head_fp8=false")
    check_fp8_device(head.weight.device, key="model.head_fp8")
    return to_fp8(head)


def check_fp8_head_config(hf_config) -> None:
    """Before any model is built: raise ModelError naming model.head_fp8 where the config's LM head (vocab x hidden)
    cannot run ``torch._scaled_mm``."""
    text = hf_config.get_text_config()
    vocab, hidden = getattr(text, "vocab_size", 0) or 0, getattr(text, "hidden_size", 0) or 0
    if not vocab or not hidden:
        raise ModelError("model.head_fp8=true: the model's config gives no vocab_size and hidden_size to check its LM "
                         "head by; set model.head_fp8=false")
    if vocab % MM_ALIGN or hidden % MM_ALIGN:
        raise ModelError(f"model.head_fp8=true: the LM head is {vocab} x {hidden}: both must be multiples of "
                         f"{MM_ALIGN} for torch._scaled_mm; set model.head_fp8=false")


def fp8_head_logits(h: torch.Tensor, head: Fp8FrozenLinear) -> torch.Tensor:
    """``h @ W.T`` (no bias) of an FP8 head, bf16: h quantised per row now, W per output row (its ``fp8_weight``)."""
    hq, h_scale = quantize_rows(h)
    return torch._scaled_mm(hq, head.fp8_weight.view(E4M3).t(), scale_a=h_scale, scale_b=head.fp8_weight_scale,
                            out_dtype=torch.bfloat16)


def fp8_head_grad(gq: torch.Tensor, g_scale: torch.Tensor, head: Fp8FrozenLinear) -> torch.Tensor:
    """``g @ W`` of an FP8 head, bf16, from ``g`` already quantised per row (``gq``, ``g_scale``: the fused loss writes
    its logit gradient that way) and W per input column (its ``fp8_weight_t``)."""
    return torch._scaled_mm(gq, head.fp8_weight_t.view(E4M3).t(), scale_a=g_scale, scale_b=head.fp8_weight_t_scale,
                            out_dtype=torch.bfloat16)


def to_fp8(linear: nn.Linear, codes: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Fp8FrozenLinear:
    """``linear`` (frozen, dimensions multiples of 16: :func:`fp8_targets` checks) made an :class:`Fp8FrozenLinear` in
    place: its weight quantised into the two e4m3 copies and their scales. ``codes``: the forward copy's e4m3 codes
    [N, K] and row scales [N, 1] chosen elsewhere (fp8_gptq.py) instead of each weight's nearest; the input-grad copy
    is always the nearest rounding of the weight itself."""
    with torch.no_grad():
        w = linear.weight.detach()
        w_q, w_scale = codes if codes is not None else quantize_rows(w)  # per output row: the forward reduces over K
        wt_q, wt_scale = quantize_rows(w.t().contiguous())  # per input column: the input-grad reduces over N
    for attr, t in (("fp8_weight", w_q.view(torch.uint8)), ("fp8_weight_scale", w_scale.t().contiguous()),
                    ("fp8_weight_t", wt_q.view(torch.uint8)), ("fp8_weight_t_scale", wt_scale.t().contiguous())):
        linear.register_parameter(attr, nn.Parameter(t, requires_grad=False))
    linear.__class__ = Fp8FrozenLinear
    return linear
