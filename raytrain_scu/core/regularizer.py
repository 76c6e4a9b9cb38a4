"""ParamBPT: the description length of the LoRA weights under a Gaussian prior, as a differentiable tensor.

    ParamBPT = Σ_{LoRA factors} w² / (2 σ² N ln 2)      (bits per training token)

σ = ``sigma`` (prior_sigma), N = ``tokens_per_epoch`` (global training tokens in one pass). The penalty added to
the per-token loss in nats is ``λ · ParamBPT · ln 2 = λ · Σw² / (2 σ² N)``; it is NOT detached, so λ reaches the
adapters' gradients.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from raytrain_scu.core.dist import all_reduce_sum
from raytrain_scu.core.fsdp import is_sharded, local


class _SumOfSquares(torch.autograd.Function):
    """Σ (w − c)² over many float32 tensors (c a centre, or 0 where None): one fused norm forward, one fused multiply
    backward, 2·g·(w − c) for every tensor. Autograd through ``torch._foreach_norm`` would instead run a norm backward
    per tensor (a division, a zero test, a fill and a multiply each): about 2,000 small kernels a step at the 8B
    shape, and as many launches for the host."""

    @staticmethod
    def forward(ctx, centers, *params):
        diffs = list(params)
        centred = [i for i, c in enumerate(centers) if c is not None]
        if centred:  # one fused subtraction, not a kernel per tensor
            for i, d in zip(centred, torch._foreach_sub([params[i] for i in centred], [centers[i] for i in centred])):
                diffs[i] = d
        ctx.save_for_backward(*diffs)
        return torch.stack(torch._foreach_norm(diffs, 2)).square().sum()

    @staticmethod
    @once_differentiable  # the saved w − c are computed without a graph: a second derivative would be wrong
    def backward(ctx, grad):
        return (None, *torch._foreach_mul(list(ctx.saved_tensors), 2 * grad))


def sum_of_squares(params: Iterable[torch.Tensor],
                   center: Optional[Sequence[Optional[torch.Tensor]]] = None) -> torch.Tensor:
    """Σ (w − c)² over all tensors in float32 (c = ``center``'s entry, 0 where None or without ``center``),
    differentiable in the tensors, in one fused reduction forward and one fused multiply backward.

    FSDP's shards (DTensors; all ranks call it then): each rank sums its own shards and the sums are all-reduced, so
    every rank holds the sum over the whole tensors; each rank's gradient reaches its own shards alone, which is all
    of the sum's gradient there (no shard is held twice)."""
    params = list(params)
    if not params:
        raise ValueError("param_bpt needs at least one adapter tensor (is LoRA applied?)")
    if center is not None and len(center) != len(params):
        raise ValueError(f"center has {len(center)} entries for {len(params)} adapter tensors")
    sharded = is_sharded(params)
    if sharded:
        params = [local(p) for p in params]
        center = None if center is None else [local(c) for c in center]
    if any(p.dtype != torch.float32 for p in params):
        params = [p.float() for p in params]
    center = [None] * len(params) if center is None else [c if c is None else c.float() for c in center]
    total = _SumOfSquares.apply(center, *params)
    if sharded:  # the other ranks' sums, added as a constant: the value is global, the gradient stays local
        mine = total.detach()
        total = total + (all_reduce_sum(mine.clone()) - mine)
    return total


def param_bpt(adapter_params: Iterable[torch.Tensor], sigma: float = 0.01, tokens_per_epoch: int = 1,
              center: Optional[Sequence[Optional[torch.Tensor]]] = None) -> torch.Tensor:
    """Differentiable ParamBPT = Σw² / (2σ²N ln 2) in float32 (a 0-dim tensor).

    ``center`` (the documented option beside the spec's law, ``controller.prior_center=init``): one tensor or None per
    adapter tensor, and the prior is centred there: Σ(w − w₀)². None is a centre at 0 (a LoRA B, initialised at 0).
    """
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    if tokens_per_epoch <= 0:
        raise ValueError(f"tokens_per_epoch must be > 0, got {tokens_per_epoch}")
    return sum_of_squares(adapter_params, center) / (2.0 * sigma * sigma * tokens_per_epoch * math.log(2.0))


def is_factor_a(name: str) -> bool:
    """A LoRA A factor (``lora_A`` / ``lora_embedding_A``) by its parameter name; the rest are B factors."""
    return bool({"lora_A", "lora_embedding_A"}.intersection(name.split(".")))


def initial_centers(model: torch.nn.Module) -> list[Optional[torch.Tensor]]:
    """For each tensor of :func:`adapter_params` (same order): a detached float32 copy of an A factor as initialised,
    None for a B factor (initialised at 0). Taken right after the adapters are built; the build is seeded, so a resume
    rebuilds the same values before it loads the checkpoint."""
    return [p.detach().float().clone() if is_factor_a(n) else None
            for n, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def centers_fingerprint(centers: Sequence[Optional[torch.Tensor]]) -> float:
    """Σw² of the initial A factors in float64: a checkpoint records it, so a resume can tell that the seeded rebuild
    of the initial adapter (:func:`initial_centers`) gave the same values (another peft or torch might not)."""
    if not is_sharded(c for c in centers if c is not None):
        return float(sum(c.double().square().sum().item() for c in centers if c is not None))
    # FSDP's shards (all ranks call it then): each rank's sum, then their sum over the ranks
    mine = torch.zeros((), dtype=torch.float64)
    for c in centers:
        if c is not None:
            mine += local(c).double().square().sum().cpu()
    return float(all_reduce_sum(mine.to(local(next(c for c in centers if c is not None)).device)).item())


@torch.no_grad()
def param_bpt_parts(adapter_params: Sequence[torch.Tensor], centers: Sequence[Optional[torch.Tensor]], *,
                    sigma: float, tokens_per_epoch: int) -> torch.Tensor:
    """ParamBPT's parts, for telemetry: a float32 tensor [A part, B part, the update's ParamBPT Σ(w − w₀)²] in bits per
    token. With the zero-centred prior the first two add up to ParamBPT; the third is ParamBPT under the prior centred
    on the initial adapter (B's part is the same under both). FSDP's shards (all ranks call it then): each rank's
    parts, then their sum over the ranks."""
    sharded = is_sharded(adapter_params)
    if sharded:
        adapter_params, centers = [local(p) for p in adapter_params], [local(c) for c in centers]
    a = [p.float() for p, c in zip(adapter_params, centers) if c is not None]
    b = [p.float() for p, c in zip(adapter_params, centers) if c is None]
    # one fused subtraction over every A factor and one fused norm over A, B and A's update, not a kernel per tensor
    # every step
    updates = list(torch._foreach_sub(a, [c for c in centers if c is not None])) if a else []
    sq = torch.stack(torch._foreach_norm(a + b + updates, 2)).square()
    sa, sb, su = sq[:len(a)].sum(), sq[len(a):len(a) + len(b)].sum(), sq[len(a) + len(b):].sum()
    parts = torch.stack([sa, sb, su + sb])
    if sharded:
        all_reduce_sum(parts)
    return parts / (2.0 * sigma * sigma * tokens_per_epoch * math.log(2.0))


def penalty_nats(param_bpt_value: torch.Tensor, lam: float) -> torch.Tensor:
    """λ · ParamBPT · ln 2: the per-token penalty in nats that is added to the cross-entropy."""
    return param_bpt_value * (lam * math.log(2.0))


# The trainable tensors of a LoRA adapter: the A and B factors of adapted Linear/Conv layers, and of an adapted
# embedding (peft names those lora_embedding_A/B; lora.target_modules may name embed_tokens).
LORA_FACTORS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"})


def adapter_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every trainable tensor of a peft LoRA model, in a stable order: what the optimizer steps and ParamBPT counts.

    All of them must be LoRA factors (:data:`LORA_FACTORS`). ParamBPT's zero-mean Gaussian prior fits each factor
    alike: the adapter adds B·A·alpha/r to a frozen weight (an embedding's too), so every factor entry is a free
    parameter whose "no change" value is 0. Any other trainable tensor is refused with the names: a DoRA magnitude
    (lora_magnitude_vector) starts at the weight's column norms and a modules_to_save copy at the pretrained
    weights, so a prior centred on 0 would pull them away from the base model rather than towards it, and leaving
    them out of the optimizer would let them require grad yet never train.
    """
    out, other = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (out if LORA_FACTORS.intersection(name.split(".")) else other).append((name, p))
    if other:
        names = [n for n, _ in other]
        raise ValueError(f"{len(names)} trainable parameter(s) are not LoRA factors ({', '.join(sorted(LORA_FACTORS))})"
                         f", e.g. {names[:3]}: raytrain_scu trains and counts in ParamBPT only LoRA factors; "
                         f"DoRA magnitudes, modules_to_save copies and unfrozen base weights are not supported "
                         f"(check lora.target_modules)")
    if not out:
        raise ValueError("no trainable LoRA factors (lora_A/lora_B) found in the model (is LoRA applied?)")
    return [p for _, p in out]


def lora_b_norm(model: torch.nn.Module) -> torch.Tensor:
    """‖B‖ over every LoRA B factor (a 0-dim float32 tensor). B starts at exactly zero and any data gradient moves it
    at the first optimizer step, so a zero here after training steps means no gradient reached the adapters."""
    bs = [p for n, p in model.named_parameters() if {"lora_B", "lora_embedding_B"}.intersection(n.split("."))]
    if not bs:
        raise ValueError("no lora_B parameters found in the model")
    return sum_of_squares([b.detach() for b in bs]).sqrt()
