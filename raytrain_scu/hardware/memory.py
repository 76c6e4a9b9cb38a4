"""A memory estimator for LoRA/QLoRA fine-tuning of a decoder-only transformer (:func:`estimate_peak_memory_gib`)
and the largest device batch that fits a card (:func:`fit_batch_size`). Pure arithmetic on the model's shape.

The estimate of :func:`estimate_peak_memory_gib`, by part:

With ``a`` = bytes of the compute dtype (4 for fp32, else 2), ``tokens = batch_size * block_size``,
``H`` hidden, ``F`` ffn, ``L`` layers, ``V`` vocab::

    weights      = linear * (0.52 if 4-bit else a) + (n_params - linear) * a
                   linear = L * (2*H*q_out + 2*H*kv_out + 3*H*F): the projections bitsandbytes quantises;
                   embeddings, lm_head and norms stay in the compute dtype; with embedding_int8 the
                   V x H tables (one when tied, else two) take 1 byte + a 4-byte scale per row, and with
                   offload_embedding an untied model's input table is in CPU memory (0 here)
    adapters     = lora_params * 16   (fp32 weight, grad, AdamW exp_avg and exp_avg_sq)
                   lora_params = L * sum over targets of r * (in + out)
    per layer    = tokens * (a * (7H + 4F + n_targets*r) + 8H + 4 * sum of the targets' in-features)
                   7H: the two norm outputs, q/k/v/out kept by SDPA (GQA k/v repeated to all heads),
                   the o_proj input; 4F: gate, up, SiLU(gate) and the product; n_targets*r: LoRA A
                   outputs; 8H: the fp32 copies inside the two RMSNorms; the last term: the input copy
                   each adapted layer's LoRA matmul saves, a bytes under autocast (absent when a = 4 and
                   under torch.compile, which fuses it away). SDPA keeps no T x T matrix.
    activations  = L * per layer                      without checkpointing
                 = tokens * L * H * a + per layer     with it (layer inputs + one layer recomputed)
                   torch.compile: a * (7H + 3F + n_targets*r) per token and layer (measured: no fp32 norm
                   copies, the SwiGLU product recomputed), and 2 GiB more overhead
    logits       = min(chunk, tokens) * V * (4 + a) + tokens * H * a
                                                      fused chunked loss (loss.CausalLMLoss): one
                                                      chunk's fp32 logits, their softmax-grad in the
                                                      compute dtype, and the saved grad wrt the hidden
                 = tokens * V * (a + 8)               otherwise (logits, fp32 copy, fp32 log-softmax)
    overhead     = 1 GiB (+ 2 GiB with torch.compile, + one dequantised projection with 4-bit)
    total        = the sum

The backward pass goes through the frozen base too, so activations are those of full fine-tuning;
only the weight gradients and optimizer states shrink to the adapters'.
"""
from __future__ import annotations

from typing import Any

from raytrain_scu.errors import MemoryFitError

GIB = 2**30


# Constants of the estimate. Its structure follows what PyTorch keeps alive in a training step; docs/benchmarks.md
# compares it with torch.cuda.max_memory_allocated() on the bench's shapes (1B and 8B, bf16, LoRA r16 on all seven
# projections, the loop's autocast and chunked loss): eager runs land at 0.96-1.07x the measured peak without the
# CUDA overhead term. Under autocast the input copies the LoRA matmuls save are in the compute dtype, and under
# torch.compile they are fused away. A compiled layer keeps neither the RMSNorms' fp32 copies nor the SwiGLU product
# (inductor recomputes SiLU(gate)*up in the backward): 3 ffn-wide tensors per token, not 4, and no 8H term. The
# 4-bit constants come from bitsandbytes' storage format, not from a measurement.
NF4_BYTES_PER_PARAM = 0.52  # 4 bits + blockwise absmax (64-blocks, double-quantised)
ADAPTER_BYTES_PER_PARAM = 16  # fp32 weight + fp32 grad + AdamW exp_avg + exp_avg_sq
COMPILE_EXTRA_GIB = 2.0  # torch.compile (inductor): its own buffers and workspaces
CUDA_OVERHEAD_GIB = 1.0  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, allocator slack
USABLE_FRACTION = 0.9  # plan for 90% of the card: fragmentation and the estimate's own error


def _dtype_bytes(precision: str) -> int:
    # "auto" means bf16/fp16 on a GPU, the case an estimate of GPU memory is for
    return 4 if precision == "fp32" else 2


def _lora_dims(hidden: int, heads: int, kv_heads: int, ffn: int, head_dim: int) -> dict[str, tuple[int, int]]:
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden), "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn),
            "down_proj": (ffn, hidden)}


def estimate_peak_memory_gib(*, n_params: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                             vocab: int, lora_r: int, lora_targets: list[str] | tuple[str, ...],
                             load_in_4bit: bool, precision: str, batch_size: int, block_size: int,
                             gradient_checkpointing: bool, compile: bool, fused_loss: bool = True,
                             loss_chunk_tokens: int = 4096, head_dim: int = 0, embedding_int8: bool = False,
                             offload_embedding: bool = False) -> dict[str, float]:
    """Peak GPU memory (GiB) of one training step of LoRA/QLoRA on a Llama-style decoder, by part: the formula is in
    the module docstring."""
    a = _dtype_bytes(precision)
    head_dim = head_dim or hidden // heads
    tokens = batch_size * block_size
    dims = _lora_dims(hidden, heads, kv_heads, ffn, head_dim)
    linear_params = layers * sum(i * o for i, o in dims.values())
    other_params = max(n_params - linear_params, 0)
    weights = _weight_bytes(linear_params, other_params, a=a, load_in_4bit=load_in_4bit, layers=layers, hidden=hidden,
                            vocab=vocab, embedding_int8=embedding_int8, offload_embedding=offload_embedding)

    targets = [t for t in lora_targets if t in dims]
    lora_params = layers * sum(lora_r * sum(dims[t]) for t in targets)
    adapters = lora_params * ADAPTER_BYTES_PER_PARAM

    per_layer, activations = _activation_bytes(tokens=tokens, a=a, hidden=hidden, ffn=ffn, layers=layers,
                                               lora_r=lora_r, targets=targets, dims=dims, compile=compile,
                                               gradient_checkpointing=gradient_checkpointing)
    if fused_loss:
        logits = min(loss_chunk_tokens, tokens) * vocab * (4 + a) + tokens * hidden * a
    else:
        logits = tokens * vocab * (a + 8)

    overhead = (CUDA_OVERHEAD_GIB + (COMPILE_EXTRA_GIB if compile else 0.0)) * GIB
    if load_in_4bit:
        overhead += max(i * o for i, o in dims.values()) * a
    parts = {"weights_gib": weights, "adapters_gib": adapters, "activations_gib": activations,
             "logits_gib": logits, "overhead_gib": overhead}
    out = {k: v / GIB for k, v in parts.items()}
    out["activation_per_layer_gib"] = per_layer / GIB
    out["total_gib"] = sum(parts.values()) / GIB
    out["lora_params"] = float(lora_params)
    return out


def _activation_bytes(*, tokens: int, a: int, hidden: int, ffn: int, layers: int, lora_r: int, targets: list,
                      dims: dict, compile: bool, gradient_checkpointing: bool) -> tuple[float, float]:
    """(one layer's, all) activations kept for the backward: :func:`estimate_peak_memory_gib`'s per layer and
    activations terms."""
    # the copy of each adapted layer's input that the LoRA matmuls save when peft casts it to float32 and autocast
    # casts it back; torch.compile fuses it away (see the constants above). The loop turns that cast off under
    # autocast (core.model.build.keep_lora_inputs_in_autocast_dtype), so its eager steps save no such copy: the term
    # over-estimates them, which lowers a default batch or refuses an explicit one that would fit. The eager
    # calibration points (docs/benchmarks.md) were measured with the copy, so the term is kept with them.
    adapter_inputs = 0 if (a == 4 or compile) else a * sum(dims[t][0] for t in targets)
    if compile:  # inductor fuses the norms' fp32 copies and recomputes the SwiGLU product
        per_layer = tokens * a * (7 * hidden + 3 * ffn + len(targets) * lora_r)
    else:
        per_layer = tokens * (a * (7 * hidden + 4 * ffn + len(targets) * lora_r) + 8 * hidden + adapter_inputs)
    if gradient_checkpointing:
        activations = tokens * layers * hidden * a + per_layer
    else:
        activations = layers * per_layer
    activations += tokens * (3 * hidden * a + 4 * hidden)  # embeddings out, final norm, lm_head input
    return per_layer, activations


def _weight_bytes(linear_params: int, other_params: int, *, a: int, load_in_4bit: bool, layers: int, hidden: int,
                  vocab: int, embedding_int8: bool, offload_embedding: bool) -> float:
    """The frozen weights on the device (:func:`estimate_peak_memory_gib`'s ``weights``)."""
    tables = max(0, round((other_params - (2 * layers + 1) * hidden) / (vocab * hidden)))  # 1 tied, 2 untied
    on_gpu = tables - (1 if offload_embedding and tables == 2 else 0)
    table_bytes = vocab * (hidden + 4) if embedding_int8 else vocab * hidden * a
    return (linear_params * (NF4_BYTES_PER_PARAM if load_in_4bit else a)
            + (other_params - tables * vocab * hidden) * a + on_gpu * table_bytes)


def shape_from_hf_config(hf_config: Any) -> dict[str, int]:
    """Estimator shape keywords from a transformers config (object or dict): hidden, layers, heads,
    kv_heads, ffn, vocab, head_dim and n_params (counted from the shape, tied embeddings once)."""
    get = hf_config.get if isinstance(hf_config, dict) else (lambda k, d=None: getattr(hf_config, k, d))
    text = get("text_config")  # multimodal configs nest the language model's
    if text is not None:
        return shape_from_hf_config(text)
    hidden, layers = int(get("hidden_size")), int(get("num_hidden_layers"))
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or heads)
    ffn, vocab = int(get("intermediate_size")), int(get("vocab_size"))
    head_dim = int(get("head_dim") or hidden // heads)
    dims = _lora_dims(hidden, heads, kv_heads, ffn, head_dim)
    per_layer = sum(i * o for i, o in dims.values()) + 2 * hidden  # + two RMSNorm weights
    tied = bool(get("tie_word_embeddings", True))
    n_params = layers * per_layer + hidden + vocab * hidden * (1 if tied else 2)
    return {"n_params": n_params, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "ffn": ffn, "vocab": vocab, "head_dim": head_dim}


# ---------------------------------------------------------------- fit

def fit_check(estimate_total_gib: float, gpu_mem_gib: float, usable_fraction: float = USABLE_FRACTION) -> bool:
    """Whether an estimated peak fits in ``usable_fraction`` of a card of ``gpu_mem_gib``."""
    return estimate_total_gib <= usable_fraction * gpu_mem_gib


def largest_batch(gpu_mem_gib: float, max_batch_size: int, usable_fraction: float, **kwargs) -> int:
    """Largest batch in [1, max_batch_size] that fits, 0 if none (the estimate grows with the batch)."""
    best = 0
    for b in range(1, max_batch_size + 1):
        total = estimate_peak_memory_gib(batch_size=b, **kwargs)["total_gib"]
        if not fit_check(total, gpu_mem_gib, usable_fraction):
            break
        best = b
    return best


def _alternatives(gpu_mem_gib: float, batch_size: int, usable_fraction: float, kwargs: dict) -> list[str]:
    """What would fit, tried in order of cost: a smaller batch, checkpointing, 4-bit, both."""
    options = [("a smaller batch", {})]
    if not kwargs["gradient_checkpointing"]:
        options.append(("model.gradient_checkpointing=true", {"gradient_checkpointing": True}))
    if not kwargs["load_in_4bit"]:
        options.append(("quant.load_in_4bit=true", {"load_in_4bit": True}))
    if not kwargs["gradient_checkpointing"] and not kwargs["load_in_4bit"]:
        options.append(("model.gradient_checkpointing=true quant.load_in_4bit=true",
                        {"gradient_checkpointing": True, "load_in_4bit": True}))
    out = []
    for label, change in options:
        best = largest_batch(gpu_mem_gib, batch_size, usable_fraction, **{**kwargs, **change})
        if best >= 1:
            out.append(f"{label} with data.batch_size={best}" if change else f"data.batch_size={best}")
    return out


def no_fit_message(batch_size: int, gpu_mem_gib: float, usable_fraction: float, kwargs: dict) -> str:
    est = estimate_peak_memory_gib(batch_size=batch_size, **kwargs)
    parts = ", ".join(f"{k[:-4]} {v:.1f}" for k, v in est.items()
                      if k.endswith("_gib") and k not in ("total_gib", "activation_per_layer_gib"))
    msg = (f"data.batch_size={batch_size} needs ~{est['total_gib']:.1f} GiB ({parts}) but "
           f"{usable_fraction:.0%} of the {gpu_mem_gib:.0f} GiB card is {usable_fraction * gpu_mem_gib:.1f} GiB.")
    alternatives = _alternatives(gpu_mem_gib, batch_size, usable_fraction, kwargs)
    if alternatives:
        return msg + " Would fit: " + "; or ".join(alternatives) + "."
    return (msg + " Nothing fits even at batch 1 with gradient checkpointing and 4-bit: use a smaller "
            "data.block_size, a smaller model or a larger card.")


def fit_batch_size(*, gpu_mem_gib: float, max_batch_size: int, usable_fraction: float = USABLE_FRACTION,
                   **estimate_kwargs) -> int:
    """The largest device batch in [1, max_batch_size] whose estimated peak fits in ``usable_fraction`` of
    the card. ``estimate_kwargs`` are :func:`estimate_peak_memory_gib`'s keywords except ``batch_size``.
    Raises :class:`MemoryFitError` naming the alternatives (checkpointing, 4-bit) when not even batch 1 fits."""
    best = largest_batch(gpu_mem_gib, max_batch_size, usable_fraction, **estimate_kwargs)
    if best < 1:
        raise MemoryFitError(no_fit_message(1, gpu_mem_gib, usable_fraction, estimate_kwargs))
    return best
