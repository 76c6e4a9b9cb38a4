"""ParamBPT: the description length of the LoRA weights under a Gaussian prior, as a differentiable tensor.

    ParamBPT = Σ_{LoRA params} w² / (2 σ² N ln 2)      (bits per training token)

σ = ``sigma`` (prior_sigma), N = ``tokens_per_epoch`` (global training tokens in one pass). The penalty added to
the per-token loss in nats is ``λ · ParamBPT · ln 2 = λ · Σw² / (2 σ² N)``; it is NOT detached, so λ reaches the
adapters' gradients.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch


def sum_of_squares(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Σ w² over all tensors in float32, in one fused reduction (``torch._foreach_norm``)."""
    params = list(params)
    if not params:
        raise ValueError("param_bpt needs at least one adapter tensor (is LoRA applied?)")
    if any(p.dtype != torch.float32 for p in params):
        params = [p.float() for p in params]
    norms = torch._foreach_norm(params, 2)
    return torch.stack(norms).square().sum()


def param_bpt(adapter_params: Iterable[torch.Tensor], sigma: float = 0.01, tokens_per_epoch: int = 1) -> torch.Tensor:
    """Differentiable ParamBPT = Σw² / (2σ²N ln 2) in float32 (a 0-dim tensor)."""
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    if tokens_per_epoch <= 0:
        raise ValueError(f"tokens_per_epoch must be > 0, got {tokens_per_epoch}")
    return sum_of_squares(adapter_params) / (2.0 * sigma * sigma * tokens_per_epoch * math.log(2.0))


def penalty_nats(param_bpt_value: torch.Tensor, lam: float) -> torch.Tensor:
    """λ · ParamBPT · ln 2: the per-token penalty in nats that is added to the cross-entropy."""
    return param_bpt_value * (lam * math.log(2.0))


def adapter_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The trainable LoRA tensors (lora_A / lora_B weights) of a peft model, in a stable order."""
    out = [p for n, p in model.named_parameters() if p.requires_grad and ("lora_A" in n or "lora_B" in n)]
    if not out:
        raise ValueError("no trainable lora_A/lora_B parameters found in the model")
    return out


def lora_b_norm(model: torch.nn.Module) -> torch.Tensor:
    """‖B‖ over every LoRA B tensor (a 0-dim float32 tensor). B starts at exactly zero and any data gradient moves it
    at the first optimizer step, so a zero here after training steps means no gradient reached the adapters."""
    bs = [p for n, p in model.named_parameters() if "lora_B" in n or "lora_embedding_B" in n]
    if not bs:
        raise ValueError("no lora_B parameters found in the model")
    return sum_of_squares([b.detach() for b in bs]).sqrt()
