"""The peers: hand-written HF + peft LoRA loops, each in the configuration its users would pick. They share the shape,
random init, block, batch, LoRA r16/α32 on the 7 projections, bf16 autocast and fused AdamW with our loop, and its
timing: after warm-up, intervals of ``interval`` steps (our report interval) with the device synchronised only at
their ends, batches from pinned host memory copied without blocking (``measure.interval_times``).

- ``default``: ``model(input_ids, labels).loss`` with transformers' own SDPA. Under torch.compile transformers cannot
  rule out a padding mask while tracing, so it builds an explicit T x T mask and SDPA loses its causal kernel: this is
  what a user gets by wrapping the model in ``torch.compile`` and nothing else (``ref_compile_default``).
- ``causal``: the same, with an attention function registered through ``transformers.AttentionInterface`` that calls
  SDPA with ``is_causal=True, enable_gqa=True``; with no mask function registered for it transformers builds no mask.
  A few lines a careful user writes (``ref_compile``).
- Liger: Liger's fused linear cross-entropy, RMSNorm, SwiGLU and RoPE patched into transformers' Llama classes, as
  TRL's ``use_liger_kernel=True`` does, compiled as a whole or layer by layer (``ref_liger``, ``ref_liger_layers``).
"""
from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from raytrain_scu.config.schema import ALL_LINEAR as PROJ
from raytrain_scu.core.model.presets import PRESET_TOKENIZER_VOCAB, preset_config
from raytrain_scu.core.regularizer import lora_b_norm
from raytrain_scu.studies.bench.measure import (
    free,
    interval_times,
    kernel_profile,
    peak_mem,
    peak_reserved,
    pinned_batches,
    proof_of_training,
    reset_mem,
    timing_note,
)

CAUSAL_ATTENTION = "bench_causal_sdpa"


def causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What a careful user registers: SDPA's causal kernel, key/value heads shared, no mask."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register_causal() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(CAUSAL_ATTENTION, causal_attention)
    return CAUSAL_ATTENTION


def peer_model(preset: str, *, dev, dtype, attention: str, lora_r: int):
    """A peer's model: the preset at random init (seed 0, as every peer), ``attention`` (see below), peft LoRA on the 7
    projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    # "causal": the registered SDPA function; "default": transformers' SDPA; any other: that implementation's name
    attn = {"causal": _register_causal, "default": lambda: "sdpa"}.get(attention, lambda: attention)()
    torch.manual_seed(0)  # every peer starts from the same random init
    with torch.device(dev):  # a preset that sets no vocabulary gets the Shakespeare BPE's
        model = AutoModelForCausalLM.from_config(preset_config(preset, PRESET_TOKENIZER_VOCAB), dtype=dtype,
                                                 attn_implementation=attn)
    model.requires_grad_(False)
    return get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=PROJ,
                                            task_type="CAUSAL_LM"))


def _compiled(model, scope: str):
    """The whole model as one graph (``model``), each decoder layer alone (``layers``), or eager (``none``)."""
    if scope == "model":
        return torch.compile(model)
    if scope == "layers":
        for layer in model.get_base_model().model.layers:
            layer.compile()
    return model


def reference_loop(*, preset: str, batch: int, block: int, steps: int, warmup: int, interval: int, blocks,
                   compile_scope: str, attention: str = "causal", liger: bool = False, lora_r: int = 16) -> dict:
    """One peer loop: ``attention`` "causal" or "default", ``compile_scope`` "model", "layers" or "none", ``liger``:
    Liger's kernels patched in first (they stay patched for the rest of the process, so a Liger part runs in a
    process of its own)."""
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # the `bench` extra

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    out = _timed(preset=preset, batch=batch, block=block, steps=steps, warmup=warmup, interval=interval,
                 blocks=blocks, compile_scope=compile_scope, attention=attention, lora_r=lora_r)
    free()  # the model and its graphs went with _timed's frame
    return {**out, "attention": attention, "compile_scope": compile_scope, "liger": liger}


def _timed(*, preset, batch, block, steps, warmup, interval, blocks, compile_scope, attention, lora_r) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = peer_model(preset, dev=dev, dtype=dtype, attention=attention, lora_r=lora_r)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=dev.type == "cuda")
    step_fn = _compiled(model, compile_scope if dev.type == "cuda" else "none")
    batches = pinned_batches(blocks, batch, block, warmup + steps)

    def fixed_batch_loss():  # the first training batch, scored without a gradient
        x = batches[0].to(dev)
        with torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda"):
            return model(input_ids=x, labels=x).loss.item() / math.log(2.0)

    def train_step(i):
        x = batches[i].to(dev, non_blocking=True)  # the labels are the inputs: the model shifts them
        with torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda"):
            loss = step_fn(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    loss_before = fixed_batch_loss()
    reset_mem()
    times = interval_times(train_step, warmup=warmup, steps=steps, interval=interval)
    return {"tokens_per_s": batch * block / statistics.median(times), "peak_mem_gib": peak_mem(),
            "peak_reserved_gib": peak_reserved(), "batch": batch,
            "interval_ms": [round(1e3 * t, 2) for t in times], "timing": timing_note(interval),
            "kernels": kernel_profile(lambda: train_step(0)) if dev.type == "cuda" else "-",
            **proof_of_training(loss_before, fixed_batch_loss(), lora_b_norm(model).item())}
