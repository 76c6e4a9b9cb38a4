"""A memory estimator for LoRA/QLoRA fine-tuning of a decoder-only transformer (:func:`estimate_peak_memory_gib`)
and the largest device batch that fits a card (:func:`fit_batch_size`). Pure arithmetic on the model's shape.

The estimate of :func:`estimate_peak_memory_gib`, by part:

With ``a`` = bytes of the compute dtype (4 for fp32, else 2), ``tokens = batch_size * block_size``,
``H`` hidden, ``F`` ffn, ``L`` layers, ``V`` vocab::

    weights      = linear * (0.52 if 4-bit else a) + (n_params - linear) * a
                   linear = L * (2*H*q_out + 2*H*kv_out + 3*H*F): the projections bitsandbytes quantises;
                   embeddings, lm_head and norms stay in the compute dtype; with embedding_int8 the
                   V x H tables (one when tied, else two) take 1 byte + a 4-byte scale per row, and with
                   offload_embedding an untied model's input table is in CPU memory (0 here);
                   base_fp8 adds 2 bytes per adapted projection weight (its two e4m3 copies), head_fp8
                   2*V*H bytes (the LM head's), and its loss chunk's logit gradient takes 1 byte, not a
    adapters     = lora_params * 16   (fp32 weight, grad, AdamW exp_avg and exp_avg_sq)
                   lora_params = L * sum over targets of r * (in + out)
    per layer    = tokens * (a * (7H + 4F + n_targets*r) + 8H + 4 * sum of the targets' in-features)
                   7H: the two norm outputs, q/k/v/out kept by SDPA (GQA k/v repeated to all heads),
                   the o_proj input; 4F: gate, up, SiLU(gate) and the product; n_targets*r: LoRA A
                   outputs; 8H: the fp32 copies inside the two RMSNorms; the last term: the input copy
                   each adapted layer's LoRA matmul saves, a bytes under autocast (absent when a = 4 and
                   under torch.compile, which fuses it away). SDPA keeps no T x T matrix.
    activations  = L * per layer                      without checkpointing
                   - offload_activations_gib          with that budget in host memory (the bottom layers')
                 = tokens * L * H * a + per layer     with it (layer inputs + one layer recomputed)
                   with model.offload_activations two layer inputs stay in flight instead of L (a budget:
                   as many fewer as it holds)
                   torch.compile: a * (7H + 3F + n_targets*r) per token and layer (measured: no fp32 norm
                   copies, the SwiGLU product recomputed), and 2 GiB more overhead; with the backward
                   recomputing elementwise ops (model.recompute_elementwise) a * (5H + 2F + n_targets*r):
                   the norm outputs and SiLU(gate)*up recomputed (fitted to the H100 A/B at 1B and 8B)
    logits       = min(chunk, tokens) * V * (4 + a) + tokens * H * a
                                                      fused chunked loss (loss.CausalLMLoss): one
                                                      chunk's fp32 logits, their softmax-grad in the
                                                      compute dtype, and the saved grad wrt the hidden
                 = tokens * V * (a + 8)               otherwise (logits, fp32 copy, fp32 log-softmax)
    overhead     = 1 GiB (+ 2 GiB with torch.compile, + one dequantised projection with 4-bit, 12 bytes a weight
                   where torch's ops dequantise it eager: :func:`_overhead_bytes`)
    total        = the sum

Under FSDP over ``shards`` workers (scaling.strategy=fsdp) the weights and adapters are each worker's share,
plus two decoder layers' projections whole (the layer running and the one gathered ahead) and the root unit whole
(the embedding table and LM head, the head once where it is tied, held from the forward's start to the backward's
end)::

    weights      = weights / shards + 2 * linear / L * b + tables * (1 - 1 / shards)
    adapters     = adapters / shards

with ``b`` the bytes of a gathered weight: ``a``, or with 4-bit the nf4 codes and their float32 absmaxes (fsdp's
4-bit layers resolve the double quantisation, core.nf4: 0.5625 bytes a weight against 0.52). ``sharded_4bit`` says
a run's 4-bit layers are fsdp's (as they are wherever ``shards`` > 1), ``torch_dequant`` that torch's ops
dequantise them under ddp (quant.dequant_4bit=torch; eager unless ``compile``).

That term is arithmetic from FSDP2's design (one unit per decoder layer, one all-gather ahead), not yet measured
on a GPU.

The backward pass goes through the frozen base too, so activations are those of full fine-tuning;
only the weight gradients and optimizer states shrink to the adapters'.

A hybrid with Mamba-2 layers (Granite-4.0-H: ``mamba_layers`` of the ``L``, each with in_proj H -> P =
2I + 2GN + nH and out_proj I -> H, I the mixer width; its MLP one fused H -> 2F projection and F -> H)
keeps per Mamba layer and token, with the field's kernels (``mamba_ssm``, ``causal_conv1d``)::

    a * (4H + P + 2I + 3F + n_targets*r)              compiled (the mixer's projections compile with the layer)
    a * (4H + P + 2I + 4F + n_targets*r) + 8H         eager (the fp32 norm copies)
                   4H: the two norms' inputs and outputs; P: in_proj's output, which the fused kernel saves;
                   2I: the kernel's pre-norm output (saved) and its output (out_proj's input)

and on transformers' torch path (no kernels) 16·Q·I bytes more, Q the chunk: the chunked scan's fp32
(Q x I) intermediates per token (measured once: 2 x 1024 with checkpointing). Attention layers count as above;
``linear`` and ``lora_params`` sum over both kinds of layer, and with checkpointing the recomputed layer is the
larger kind. ``all-linear`` targets every linear layer of each kind.
"""
from __future__ import annotations

from typing import Any

from raytrain_scu.errors import MemoryFitError

GIB = 2**30


# Constants of the estimate. Its structure follows what PyTorch keeps alive in a training step; docs/log/deploy.md
# compares it with torch.cuda.max_memory_allocated() on the bench's shapes (1B and 8B, bf16, LoRA r16 on all seven
# projections, the loop's autocast and chunked loss): eager runs land at 0.96-1.07x the measured peak without the
# CUDA overhead term. Under autocast the input copies the LoRA matmuls save are in the compute dtype, and under
# torch.compile they are fused away. A compiled layer keeps neither the RMSNorms' fp32 copies nor the SwiGLU product
# (inductor recomputes SiLU(gate)*up in the backward): 3 ffn-wide tensors per token, not 4, and no 8H term. The
# 4-bit constants come from bitsandbytes' storage format, not from a measurement.
# Granite-4.0-H-1B's shape with the kernels, on an H200, against the estimate without its CUDA-context term: compiled
# 32 x 1024 79.5 GiB (1.03x), and with the whole mixer eager 8 x 2048 42.6 GiB (1.05x); eager 8 x 2048 54.0 GiB
# (1.05x); 4-bit with checkpointing 4 x 1024 4.85 GiB (0.90x) and 4 x 2048 6.90 GiB (0.76x: that case's recomputed
# layer holds more than modelled). The torch path's term is fitted on its one measured point.
MAMBA_TORCH_PATH_BYTES = 16  # per token, per chunk position and mixer channel: the torch path's fp32 scan intermediates
NF4_BYTES_PER_PARAM = 0.52  # 4 bits + blockwise absmax (64-blocks, double-quantised)
NF4_SHARDED_BYTES_PER_PARAM = 0.5625  # fsdp's 4-bit layers: 4 bits + one float32 absmax per 64 (core.nf4)
TORCH_DEQUANT_EAGER_BYTES = 12  # int32 index + float32 code value + float32 product, per weight (core.nf4.dequantize)
ADAPTER_BYTES_PER_PARAM = 16  # fp32 weight + fp32 grad + AdamW exp_avg + exp_avg_sq
COMPILE_EXTRA_GIB = 2.0  # torch.compile (inductor): its own buffers and workspaces
CUDA_OVERHEAD_GIB = 1.0  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, allocator slack
USABLE_FRACTION = 0.9  # plan for 90% of the card: fragmentation and the estimate's own error


def _dtype_bytes(precision: str) -> int:
    # "auto" means bf16/fp16 on a GPU, the case an estimate of GPU memory is for
    return 4 if precision == "fp32" else 2


def _lora_dims(hidden: int, heads: int, kv_heads: int, ffn: int, head_dim: int,
               fused_mlp: bool = False) -> dict[str, tuple[int, int]]:
    """(in, out) of an attention layer's linear layers by module name: q/k/v/o and the SwiGLU MLP (Llama's three
    projections, or Granite's fused gate+up ``input_linear`` and ``output_linear``)."""
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    mlp = ({"input_linear": (hidden, 2 * ffn), "output_linear": (ffn, hidden)} if fused_mlp else
           {"gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)})
    return {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden), **mlp}


def _mamba_dims(dims: dict, hidden: int, inner: int, in_proj: int) -> dict[str, tuple[int, int]]:
    """A Mamba-2 layer's linear layers: the attention layer's MLP, in_proj and out_proj."""
    mlp = {k: v for k, v in dims.items() if k not in ("q_proj", "k_proj", "v_proj", "o_proj")}
    return {"in_proj": (hidden, in_proj), "out_proj": (inner, hidden), **mlp}


def _targeted(dims: dict, lora_targets) -> list[str]:
    return list(dims) if "all-linear" in lora_targets else [t for t in lora_targets if t in dims]


def estimate_peak_memory_gib(*, n_params: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                             vocab: int, lora_r: int, lora_targets: list[str] | tuple[str, ...],
                             load_in_4bit: bool, precision: str, batch_size: int, block_size: int,
                             gradient_checkpointing: bool, compile: bool, fused_loss: bool = True,
                             loss_chunk_tokens: int = 4096, head_dim: int = 0, embedding_int8: bool = False,
                             offload_embedding: bool = False, fused_mlp: bool = False, mamba_layers: int = 0,
                             mamba_inner: int = 0, mamba_in_proj: int = 0, mamba_chunk: int = 0,
                             mamba_kernels: bool = True, recompute_elementwise: str = "never",
                             recompute_auto: bool = True, base_fp8: bool = False, head_fp8: bool = False,
                             offload_activations: bool = False, offload_activations_gib: float = 0.0, shards: int = 1,
                             torch_dequant: bool = False, sharded_4bit: bool = False) -> dict[str, float]:
    """Peak GPU memory (GiB) of one training step of LoRA/QLoRA on a Llama-style decoder, or a hybrid with
    ``mamba_layers`` Mamba-2 layers, by part: the formula is in the module docstring. ``recompute_elementwise`` is
    ``model.recompute_elementwise`` and ``recompute_auto`` what its ``auto`` picks for the model's family
    (``hardware.shape.shape_of`` reads it from core.model.families); only the attention layers' term models it."""
    a = _dtype_bytes(precision)
    head_dim = head_dim or hidden // heads
    tokens = batch_size * block_size
    dims = _lora_dims(hidden, heads, kv_heads, ffn, head_dim, fused_mlp)
    m_dims = _mamba_dims(dims, hidden, mamba_inner, mamba_in_proj) if mamba_layers else {}
    kinds = [(layers - mamba_layers, dims), (mamba_layers, m_dims)]  # (how many layers, their linear layers)
    linear_params = sum(n * sum(i * o for i, o in d.values()) for n, d in kinds)
    other_params = max(n_params - linear_params, 0)
    b = _projection_bytes(a, load_in_4bit=load_in_4bit, sharded=sharded_4bit or shards > 1)
    weights, root = _weight_bytes(linear_params, other_params, a=a, linear_bytes=b, layers=layers, hidden=hidden,
                                  vocab=vocab, embedding_int8=embedding_int8, offload_embedding=offload_embedding)

    lora_params = sum(n * sum(lora_r * sum(d[t]) for t in _targeted(d, lora_targets)) for n, d in kinds)
    if base_fp8:  # the adapted projections' two e4m3 copies (fp8.py), one byte a weight each; the bf16 base stays
        weights += 2 * sum(n * sum(d[t][0] * d[t][1] for t in _targeted(d, lora_targets)) for n, d in kinds)
    weights += 2 * vocab * hidden if head_fp8 else 0  # the head's two e4m3 copies
    adapters = lora_params * ADAPTER_BYTES_PER_PARAM

    common = {"tokens": tokens, "a": a, "hidden": hidden, "ffn": ffn, "lora_r": lora_r, "compile": compile}
    recomputes = compile and (recompute_elementwise == "always" or recompute_elementwise == "auto" and recompute_auto)
    per_attn = _attention_layer_bytes(targets=_targeted(dims, lora_targets), dims=dims, recomputes=recomputes,
                                      **common)
    per_mamba = (_mamba_layer_bytes(targets=_targeted(m_dims, lora_targets), inner=mamba_inner,
                                    in_proj=mamba_in_proj, torch_path_chunk=0 if mamba_kernels else mamba_chunk,
                                    **common) if mamba_layers else 0)
    per_layer = max(per_attn, per_mamba)
    if gradient_checkpointing:  # every layer's input, one layer recomputed
        activations = _kept_layer_inputs(layers, tokens * hidden * a, offload_activations,
                                         offload_activations_gib) + per_layer
    else:  # a budget's worth of the bottom layers' activations is on the host at the peak (the backward's start)
        activations = (layers - mamba_layers) * per_attn + mamba_layers * per_mamba
        activations -= min(offload_activations_gib * GIB if offload_activations else 0.0, activations)
    activations += tokens * (3 * hidden * a + 4 * hidden)  # embeddings out, final norm, lm_head input
    logits = _loss_bytes(tokens=tokens, vocab=vocab, hidden=hidden, a=a, fused_loss=fused_loss,
                         chunk=loss_chunk_tokens, head_fp8=head_fp8)

    overhead = _overhead_bytes(kinds, a=a, compile=compile, load_in_4bit=load_in_4bit,
                               torch_eager=torch_dequant or sharded_4bit or shards > 1)
    parts = {**_per_worker(weights, adapters, root, shards=shards, layer_bytes=linear_params / layers * b),
             "activations_gib": activations, "logits_gib": logits, "overhead_gib": overhead}
    out = {k: v / GIB for k, v in parts.items()}
    out["activation_per_layer_gib"] = per_layer / GIB
    out["total_gib"] = sum(parts.values()) / GIB
    out["lora_params"] = float(lora_params)
    return out


def _overhead_bytes(kinds, *, a: int, compile: bool, load_in_4bit: bool, torch_eager: bool) -> float:
    """CUDA's context and workspaces, inductor's with torch.compile, and with 4 bits the largest projection while it
    is dequantised: one weight in the compute dtype, or where torch's ops dequantise it eager (fsdp's layers,
    quant.dequant_4bit=torch; compiled, inductor fuses them) their int32 code indices, float32 values and float32
    product at once."""
    overhead = (CUDA_OVERHEAD_GIB + (COMPILE_EXTRA_GIB if compile else 0.0)) * GIB
    if load_in_4bit:
        per_weight = TORCH_DEQUANT_EAGER_BYTES if torch_eager and not compile else a
        overhead += max(i * o for _, d in kinds for i, o in d.values()) * per_weight
    return overhead


def _projection_bytes(a: int, *, load_in_4bit: bool, sharded: bool) -> float:
    """The bytes of one weight of a frozen projection: ``a``, or in 4 bits nf4's (fsdp's layers resolve the double
    quantisation: core.nf4)."""
    if not load_in_4bit:
        return a
    return NF4_SHARDED_BYTES_PER_PARAM if sharded else NF4_BYTES_PER_PARAM


def _per_worker(weights: float, adapters: float, root_bytes: float, *, shards: int,
                layer_bytes: float) -> dict[str, float]:
    """The weights and adapters on one card: all of them (``shards`` 1), or under FSDP over ``shards`` workers each
    worker's share of both plus two decoder layers' projections whole (the one running and the next, gathered
    ahead) and the root unit's embedding table and LM head whole (gathered from the forward's start to the
    backward's end)."""
    gathered = 2 * layer_bytes + root_bytes * (1 - 1 / shards) if shards > 1 else 0.0
    return {"weights_gib": weights / shards + gathered, "adapters_gib": adapters / shards}


def _kept_layer_inputs(layers: int, layer_input: int, offload: bool, budget_gib: float) -> int:
    """Bytes of the checkpointed layers' inputs on the device at the peak: all of them, or with the offload two in
    flight (a budget: as many fewer than all as it holds, at most all but two)."""
    if not offload:
        return layers * layer_input
    moved = min(layers - 2, int(budget_gib * GIB) // layer_input) if budget_gib else layers - 2
    return (layers - moved) * layer_input


def _loss_bytes(*, tokens: int, vocab: int, hidden: int, a: int, fused_loss: bool, chunk: int, head_fp8: bool) -> int:
    """The loss' buffers (:func:`estimate_peak_memory_gib`'s ``logits``): one chunk's with the fused loss (an FP8
    head's softmax writes the chunk's logit gradient in e4m3, one byte, not a), the whole logits without."""
    if fused_loss:
        return min(chunk, tokens) * vocab * (4 + (1 if head_fp8 else a)) + tokens * hidden * a
    return tokens * vocab * (a + 8)


def _adapter_inputs(a: int, targets: list, dims: dict) -> int:
    """Bytes per token of the input copies the adapted layers' eager LoRA matmuls save, when peft casts each input to
    float32 and autocast casts it back (torch.compile fuses them away: see the constants above). The loop turns that
    cast off under autocast (core.model.build.keep_lora_inputs_in_autocast_dtype), so its eager steps save no such
    copy: the term over-estimates them, which lowers a default batch or refuses an explicit one that would fit. The
    eager calibration points (docs/log/deploy.md) were measured with the copy, so the term is kept with them."""
    return 0 if a == 4 else a * sum(dims[t][0] for t in targets)


def _attention_layer_bytes(*, tokens: int, a: int, hidden: int, ffn: int, lora_r: int, targets: list, dims: dict,
                           compile: bool, recomputes: bool = False) -> int:
    """One attention layer's activations kept for the backward (the module docstring's per layer)."""
    if recomputes:  # the norm outputs and SiLU(gate)*up recomputed beside the kernels that read them
        return tokens * a * (5 * hidden + 2 * ffn + len(targets) * lora_r)
    if compile:  # inductor fuses the norms' fp32 copies and recomputes the SwiGLU product
        return tokens * a * (7 * hidden + 3 * ffn + len(targets) * lora_r)
    return tokens * (a * (7 * hidden + 4 * ffn + len(targets) * lora_r) + 8 * hidden
                     + _adapter_inputs(a, targets, dims))


def _mamba_layer_bytes(*, tokens: int, a: int, hidden: int, ffn: int, lora_r: int, targets: list,
                       compile: bool, inner: int, in_proj: int, torch_path_chunk: int) -> int:
    """One Mamba-2 layer's activations kept for the backward (the module docstring's hybrid terms)."""
    kept = 4 * hidden + in_proj + 2 * inner + len(targets) * lora_r
    # eager: no adapter input copy term (the loop keeps LoRA inputs in the autocast dtype; the eager point, measured
    # with peft's float32 casts still on, lands at 1.05x without it)
    per_token = a * (kept + 3 * ffn) if compile else a * (kept + 4 * ffn) + 8 * hidden
    return tokens * (per_token + MAMBA_TORCH_PATH_BYTES * torch_path_chunk * inner)


def _weight_bytes(linear_params: int, other_params: int, *, a: int, linear_bytes: float, layers: int, hidden: int,
                  vocab: int, embedding_int8: bool, offload_embedding: bool) -> float:
    """The frozen weights on the device (:func:`estimate_peak_memory_gib`'s ``weights``) and, of them, the
    embedding table and LM head's bytes (the head once where it is tied)."""
    # 1 table tied, 2 untied; a layer's other parameters (norms; a Mamba layer's conv and scan) are far fewer
    tables = max(0, round((other_params - (2 * layers + 1) * hidden) / (vocab * hidden)))
    on_gpu = tables - (1 if offload_embedding and tables == 2 else 0)
    table_bytes = vocab * (hidden + 4) if embedding_int8 else vocab * hidden * a
    return (linear_params * linear_bytes
            + (other_params - tables * vocab * hidden) * a + on_gpu * table_bytes), on_gpu * table_bytes


def shape_from_hf_config(hf_config: Any) -> dict[str, Any]:
    """Estimator shape keywords from a transformers config (object or dict): hidden, layers, heads,
    kv_heads, ffn, vocab, head_dim and n_params (counted from the shape, tied embeddings once); for a Mamba-2 hybrid
    (GraniteMoeHybrid) also its Mamba layers' count and widths (whether the field's kernels run, ``mamba_kernels``,
    is the caller's: ``hardware.shape.shape_of`` asks the model family). A hybrid it does not model is refused
    (ValueError naming why)."""
    get = hf_config.get if isinstance(hf_config, dict) else (lambda k, d=None: getattr(hf_config, k, d))
    text = get("text_config")  # multimodal configs nest the language model's
    if text is not None:
        return shape_from_hf_config(text)
    hidden, layers = int(get("hidden_size")), int(get("num_hidden_layers"))
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or heads)
    ffn, vocab = int(get("intermediate_size")), int(get("vocab_size"))
    head_dim = int(get("head_dim") or hidden // heads)
    hybrid = _mamba_shape(get, hidden)
    if hybrid:
        ffn = int(get("shared_intermediate_size"))
    dims = _lora_dims(hidden, heads, kv_heads, ffn, head_dim, fused_mlp=bool(hybrid))
    per_layer = sum(i * o for i, o in dims.values()) + 2 * hidden  # + two RMSNorm weights
    n_params = (layers - hybrid.get("mamba_layers", 0)) * per_layer
    if hybrid:  # a Mamba layer: in_proj, out_proj and the MLP, two norms, the depthwise conv, the gated norm, A, D, dt
        inner, proj, n_heads = hybrid["mamba_inner"], hybrid["mamba_in_proj"], int(get("mamba_n_heads"))
        conv = (proj - inner - n_heads) * (int(get("mamba_d_conv")) + 1)
        mixer = sum(i * o for i, o in _mamba_dims(dims, hidden, inner, proj).values())
        n_params += hybrid["mamba_layers"] * (mixer + 2 * hidden + conv + inner + 3 * n_heads)
    tied = bool(get("tie_word_embeddings", True))
    n_params += hidden + vocab * hidden * (1 if tied else 2)
    return {"n_params": n_params, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "ffn": ffn, "vocab": vocab, "head_dim": head_dim, **hybrid}


MAMBA_KEYS = ("shared_intermediate_size", "mamba_expand", "mamba_n_heads", "mamba_n_groups", "mamba_d_state",
              "mamba_d_conv", "mamba_chunk_size")


def _mamba_shape(get, hidden: int) -> dict[str, int]:
    """The Mamba-2 keywords of a GraniteMoeHybrid config; empty for a model without Mamba layers. Another Mamba
    hybrid, or one missing a key the estimate reads, is refused (ValueError naming it)."""
    kinds = get("layer_types") or []
    mamba = sum(k in ("mamba", "linear_attention") for k in kinds)
    if not mamba:
        return {}
    if get("model_type") != "granitemoehybrid":
        raise ValueError(f"a {get('model_type')!r} model with Mamba layers: the memory estimate models "
                         f"GraniteMoeHybrid's only")
    missing = [k for k in MAMBA_KEYS if get(k) is None]
    if missing:
        raise ValueError(f"GraniteMoeHybrid config without {', '.join(missing)}: no memory estimate")
    if int(get("num_local_experts") or 0):
        raise ValueError("a Mamba hybrid with routed experts: the memory estimate does not model them")
    inner = int(get("mamba_expand") * hidden)  # transformers' own rounding
    heads, groups, state = int(get("mamba_n_heads")), int(get("mamba_n_groups")), int(get("mamba_d_state"))
    return {"mamba_layers": mamba, "mamba_inner": inner, "mamba_in_proj": 2 * inner + 2 * groups * state + heads,
            "mamba_chunk": int(get("mamba_chunk_size")), "fused_mlp": True}


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
    four_bit = not kwargs["load_in_4bit"]
    if not kwargs["gradient_checkpointing"]:
        options.append(("model.gradient_checkpointing=true", {"gradient_checkpointing": True}))
    if four_bit:
        options.append(("quant.load_in_4bit=true", {"load_in_4bit": True}))
    if not kwargs["gradient_checkpointing"] and four_bit:
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
    if kwargs.get("shards", 1) > 1:
        return (msg + " Nothing fits even at batch 1 with gradient checkpointing: use more workers, a smaller "
                "data.block_size, a smaller model or a larger card.")
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
