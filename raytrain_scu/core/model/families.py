"""What the package knows about each model family, one table entry per transformers ``model_type``: the LM head's
transform (the fused loss), the transformers classes whose heads it reproduces, whether q/k/v and gate/up fuse
(``model.fuse_lora``), how its layers count FLOPs, and the optional kernels it runs faster with. A family missing
here still trains: on the model's own logits, unfused, with the Llama FLOP count."""
from __future__ import annotations

import importlib
import importlib.metadata as md
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from raytrain_scu.core.model.mamba import keep_out_proj_a_module
from raytrain_scu.errors import ModelError


@dataclass(frozen=True)
class HeadTransform:
    """What a causal LM does to its LM head's output ``z = h @ W.T (+ b)``: ``logits = scale·z``, then, with a
    ``softcap``, ``logits = softcap·tanh(logits / softcap)``. The identity (1.0, 0.0) is a plain head."""
    scale: float = 1.0
    softcap: float = 0.0

    def __str__(self) -> str:
        z = "z" if self.scale == 1.0 else f"{self.scale:g}*z"
        return f"{self.softcap:g}*tanh({z}/{self.softcap:g})" if self.softcap else z


def plain_head(c) -> HeadTransform:
    return HeadTransform()


def granite_head(c) -> HeadTransform:  # logits / logits_scaling
    return HeadTransform(scale=1.0 / float(c.logits_scaling))


def gemma_head(c) -> HeadTransform:  # cap * tanh(logits / cap), or a plain head when final_logit_softcapping is None
    return HeadTransform(softcap=float(c.final_logit_softcapping or 0.0))


def cohere_head(c) -> HeadTransform:  # logits * logit_scale
    return HeadTransform(scale=float(c.logit_scale))


# config.json spells the layer types attention/mamba; transformers 5 rewrites them to full_/linear_attention
ATTENTION_LAYER, MAMBA_LAYER = ("attention", "full_attention"), ("mamba", "linear_attention")


def granite_hybrid_layers(c) -> list[tuple[int, float]]:
    """Per layer of a GraniteMoeHybrid config: (matmul parameters, forward FLOPs per token of its sequence mixer
    beyond its weights). Every layer has the shared SwiGLU MLP (3·d·shared_ffn) and, with routed experts, the router
    and its top-k experts (3·d·ffn each). An attention layer adds q/k/v/o; its mixer FLOPs are counted by
    ``flops.flops_per_token`` (they grow with T). A Mamba-2 layer adds in_proj (d -> 2·I + 2·G·N + H) and out_proj
    (I -> d), with I = mamba_expand·d; its SSD scan in chunks of Q tokens costs, per token, 2·Q·G·N (C·Bᵀ within the
    chunk) + 2·Q·I (the masked scores times x) + 2·N·I (the chunk's state from B and x) + 2·N·I (C times the carried
    state) -- full Q x Q blocks, as attention's T x T. The depthwise conv (2·k per channel) is left out, as norms are."""
    d = c.hidden_size
    mlp = 3 * d * c.shared_intermediate_size
    if c.num_local_experts:
        mlp += d * c.num_local_experts + c.num_experts_per_tok * 3 * d * c.intermediate_size
    head_dim = d // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    inner, groups, state, chunk = c.mamba_expand * d, c.mamba_n_groups, c.mamba_d_state, c.mamba_chunk_size
    mamba = d * (2 * inner + 2 * groups * state + c.mamba_n_heads) + inner * d
    ssd = 2 * chunk * groups * state + 2 * chunk * inner + 4 * state * inner
    out = []
    for kind in c.layer_types:
        if kind in ATTENTION_LAYER:
            out.append((mlp + d * q + 2 * d * kv + q * d, 0.0))
        elif kind in MAMBA_LAYER:
            out.append((mlp + mamba, float(ssd)))
        else:
            raise ModelError(f"GraniteMoeHybrid layer type {kind!r}: no FLOP count for it (attention, mamba)")
    return out


def granite_hybrid_preset() -> dict:
    """Granite-4.0-H on a card: gradient checkpointing only on transformers' torch path (its scan keeps each chunk's
    Q x Q scores for the backward); with the kernels none (measured: 8 x 2048 compiled peaks at 42.6 GiB on an
    H200). A compiled decoder layer compiles the mixer's projections and leaves only the kernel out (``mamba.py``), so
    the card's compile choice stands."""
    return {"model.gradient_checkpointing": not mamba_kernels_run()}


def mamba_kernels_run() -> bool:
    """Whether Granite-4.0-H's Mamba layers run the field's kernels here (:func:`mamba_kernels`), not the torch
    path."""
    return mamba_kernels()["path"] == "kernels"


def mamba_kernels() -> dict:
    """Which Mamba-2 code transformers' GraniteMoeHybrid runs: ``mamba_ssm`` and ``causal_conv1d`` when they import
    (the ``mamba`` extra), else its torch path, fp32 einsums keeping each chunk's Q x Q scores for the backward
    (~0.4 MB per token per layer at the 1B shape: more than a card holds at batch 32 x 1024 without checkpointing)."""
    out = {}
    for module, dist in (("mamba_ssm", "mamba-ssm"), ("causal_conv1d", "causal-conv1d")):
        try:
            importlib.import_module(module)
            try:
                out[module] = md.version(dist)
            except md.PackageNotFoundError:
                out[module] = "importable"
        except Exception as e:  # noqa: BLE001 - transformers treats any import failure as "not installed" too
            out[module] = f"not importable ({type(e).__name__})"
    usable = all(not v.startswith("not importable") for v in out.values())
    out["path"] = "kernels" if torch.cuda.is_available() and usable else "torch path"
    return out


@dataclass(frozen=True)
class Family:
    """One model family. ``classes``: the transformers CausalLM classes whose head the fused loss reproduces (the
    class must BE transformers' own, not a subclass or remote code); ``head``: its transform, read from the config;
    ``fusable``: ``model.fuse_lora`` applies; ``layers``: per-layer (matmul parameters, mixer FLOPs per token) where
    the Llama count does not hold; ``kernels``: the optional fast kernels and which path runs; ``prepare``: what a base
model of the family needs before training (Granite-4.0-H: its Mamba mixers keep out_proj a module, ``mamba.py``);
``preset``: the values a hardware preset sets for the family on top of the card's (driver.resolve);
``recompute_elementwise``: what ``model.recompute_elementwise=auto`` picks (off where it was measured slower)."""

    classes: tuple[str, ...]
    head: Callable = plain_head
    fusable: bool = False
    layers: Optional[Callable] = None
    kernels: Optional[Callable[[], dict]] = None
    prepare: Optional[Callable] = None  # run on every base model of the family as it is built
    preset: Optional[Callable[[], dict]] = None  # config values a hardware preset adds for the family
    recompute_elementwise: bool = True


def _plain(*classes: str, **kw) -> Family:
    return Family(classes=classes, **kw)


# tests/test_loss_arch.py checks every class here against model(input_ids).logits
FAMILIES: dict[str, Family] = {
    "llama": _plain("LlamaForCausalLM", fusable=True),
    "mistral": _plain("MistralForCausalLM"), "mixtral": _plain("MixtralForCausalLM"),
    "qwen2": _plain("Qwen2ForCausalLM"), "qwen2_moe": _plain("Qwen2MoeForCausalLM"),
    "qwen3": _plain("Qwen3ForCausalLM"), "qwen3_moe": _plain("Qwen3MoeForCausalLM"),
    "gemma": _plain("GemmaForCausalLM"), "phi": _plain("PhiForCausalLM"), "phi3": _plain("Phi3ForCausalLM"),
    "olmo": _plain("OlmoForCausalLM"), "olmo2": _plain("Olmo2ForCausalLM"), "smollm3": _plain("SmolLM3ForCausalLM"),
    "stablelm": _plain("StableLmForCausalLM"), "starcoder2": _plain("Starcoder2ForCausalLM"),
    "granite": Family(("GraniteForCausalLM",), head=granite_head),
    "granitemoe": Family(("GraniteMoeForCausalLM",), head=granite_head),
    "granitemoeshared": Family(("GraniteMoeSharedForCausalLM",), head=granite_head),
    "granitemoehybrid": Family(("GraniteMoeHybridForCausalLM",), head=granite_head, layers=granite_hybrid_layers,
                               kernels=mamba_kernels, prepare=keep_out_proj_a_module, preset=granite_hybrid_preset,
                               recompute_elementwise=False),  # 10.8% slower on an H100 (docs/log/benchmarks.md)
    "gemma2": Family(("Gemma2ForCausalLM",), head=gemma_head),
    "gemma3_text": Family(("Gemma3ForCausalLM",), head=gemma_head),
    "cohere": Family(("CohereForCausalLM",), head=cohere_head),
    "cohere2": Family(("Cohere2ForCausalLM",), head=cohere_head),
}
UNKNOWN = Family(classes=())


def family_of(config) -> Family:
    """The family of a transformers config (its text config's, for a multimodal one); ``UNKNOWN`` if not listed."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return FAMILIES.get(getattr(text, "model_type", ""), UNKNOWN)


def head_of_class(class_name: str) -> Optional[Callable]:
    """The head transform of a transformers CausalLM class name, or None when no family lists it."""
    for fam in FAMILIES.values():
        if class_name in fam.classes:
            return fam.head
    return None
