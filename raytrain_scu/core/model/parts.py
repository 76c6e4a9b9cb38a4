"""Where a causal LM, bare or under peft, keeps its parts: the transformers model itself, the body under its LM head,
and that body's decoder layers. No ray, mlflow or torch.distributed."""
from __future__ import annotations

import torch.nn as nn


def base_of(model) -> nn.Module:
    """The transformers model: under a peft model its base (peft injects LoRA into it in place), else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def body_of(model) -> nn.Module:
    """The transformer body under the LM head (``base_model_prefix``: ``model`` for Llama)."""
    lm = base_of(model)
    return getattr(lm, lm.base_model_prefix)


def decoder_layers(model) -> list[nn.Module]:
    """The body's decoder layers in order (its ``layers`` list), or [] where it has none."""
    layers = getattr(body_of(model), "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []
