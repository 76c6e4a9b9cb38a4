"""What GPUs are here, which preset suits them, and whether a run fits in their memory.

Four pieces, all pure Python (no torch, ray or mlflow imports; NVML is imported inside :func:`detect_gpus`):

1. :func:`detect_gpus` lists the NVIDIA cards through NVML (``pynvml`` from nvidia-ml-py). No driver, no
   library or no card is not an error: it returns ``[]``.
2. Presets: ``hardware.preset`` names a set of config values for a kind of card. ``auto`` picks one from the
   detected cards (:func:`preset_for`). Values set explicitly in the YAML file or on the command line always
   win over the preset (:func:`apply_preset`, :func:`resolve_config`).

   ======  =========  ==========  ==========  =======  ======  ========  =====================================
   preset  precision  batch_size  grad_accum  compile  4-bit   ckpt      source
   ======  =========  ==========  ==========  =======  ======  ========  =====================================
   a100    bf16       32          1           yes      no      no        seed: A100 40GB bf16, batch 32, compile
   h100    bf16       64          1           yes      no      no        80 GB: twice the A100 batch
   h200    bf16       96          1           yes      no      no        141 GB: 1.5x the H100 batch, headroom
   4090    bf16       16          2           yes      no      no        seed: RTX 4090 bf16, 16 x 2, compile
   3090    bf16       16          2           no       no      no        seed: 3090 starts at 16, compile off
   t4      fp16       4           8           no       yes     no        seeds: T4 fp16 (no bf16); 10-16 GB
                                                                         cards (3080-class) fp16 4-bit 4 x 8
   cpu     fp32       4           1           no       no      no        CPU: fp32, eager, small batch
   ======  =========  ==========  ==========  =======  ======  ========  =====================================

   (precision = ``model.precision``, batch_size/grad_accum = ``data.*``, compile = ``model.compile``,
   4-bit = ``quant.load_in_4bit``, ckpt = ``model.gradient_checkpointing``.) A preset's batch is sized for
   the ~1B-parameter models this package targets at the default ``data.block_size`` of 256; longer blocks or
   bigger models are what :func:`fit_to_gpu` is for.

3. A memory estimator (:func:`estimate_peak_memory_gib`) for LoRA/QLoRA fine-tuning of a decoder-only
   transformer, and :func:`fit_batch_size` / :func:`fit_to_gpu`, which pick the largest device batch that
   fits in ~90% of the card or fail up front, naming what would fit, instead of OOM-ing an hour in.
4. Each card's dense bf16 peak (:data:`PEAK_BF16_FLOPS`, :func:`peak_flops`) and :func:`mfu`, which the bench and
   the training loop's ``perf/mfu`` share.

On a Ray cluster the driver usually runs on a CPU head node: ``auto`` must be resolved with the GPUs of a
worker, e.g. ``ray.get(ray.remote(num_gpus=1)(detect_gpus).remote())`` passed as ``gpus=`` (the caller
owns the Ray call; this module never imports ray).
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from raytrain_scu import config as C

GIB = 2**30


# ---------------------------------------------------------------- detection

@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA card as NVML reports it."""
    name: str
    memory_gib: float
    compute_capability: tuple[int, int] = (0, 0)
    index: int = 0
    uuid: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""  # the newest CUDA the driver supports, e.g. "12.8"

    @property
    def bf16(self) -> bool:
        """bf16 tensor cores: Ampere (8.0) and newer."""
        return self.compute_capability >= (8, 0)

    @property
    def tf32(self) -> bool:
        """TF32 matmuls: Ampere (8.0) and newer."""
        return self.compute_capability >= (8, 0)

    def to_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "memory_gib": round(self.memory_gib, 1),
                "compute_capability": f"{self.compute_capability[0]}.{self.compute_capability[1]}",
                "bf16": self.bf16, "tf32": self.tf32, "uuid": self.uuid,
                "driver_version": self.driver_version, "cuda_driver_version": self.cuda_driver_version}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible(gpus: list[GpuInfo]) -> list[GpuInfo]:
    """Apply CUDA_VISIBLE_DEVICES (indices or UUIDs): NVML itself ignores it, torch and Ray workers don't."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return gpus
    wanted = [s.strip() for s in env.split(",") if s.strip()]
    return [g for g in gpus if str(g.index) in wanted or g.uuid in wanted]


def detect_gpus() -> list[GpuInfo]:
    """The NVIDIA GPUs visible to this process, through NVML. ``[]`` where there is no NVML library,
    no driver or no card: never raises for "no GPU"."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()  # e.g. 12080 -> "12.8"
        cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(GpuInfo(
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                memory_gib=pynvml.nvmlDeviceGetMemoryInfo(handle).total / GIB,
                compute_capability=(int(major), int(minor)),
                index=i,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                driver_version=driver,
                cuda_driver_version=cuda_version,
            ))
    except pynvml.NVMLError:
        # a driver that answers init but not queries (e.g. a GPU fallen off the bus) counts as no GPU here;
        # `python -m raytrain_scu.check` is where a half-working driver shows up
        return []
    finally:
        pynvml.nvmlShutdown()
    return _visible(gpus)


# ---------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, Any]] = {
    "a100": {"model.precision": "bf16", "data.batch_size": 32, "data.grad_accum": 1, "model.compile": True,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "h100": {"model.precision": "bf16", "data.batch_size": 64, "data.grad_accum": 1, "model.compile": True,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "h200": {"model.precision": "bf16", "data.batch_size": 96, "data.grad_accum": 1, "model.compile": True,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "4090": {"model.precision": "bf16", "data.batch_size": 16, "data.grad_accum": 2, "model.compile": True,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "3090": {"model.precision": "bf16", "data.batch_size": 16, "data.grad_accum": 2, "model.compile": False,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "t4": {"model.precision": "fp16", "data.batch_size": 4, "data.grad_accum": 8, "model.compile": False,
           "quant.load_in_4bit": True, "model.gradient_checkpointing": False},
    "cpu": {"model.precision": "fp32", "data.batch_size": 4, "data.grad_accum": 1, "model.compile": False,
            "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
}

# name patterns, most specific first ("T4" as a word so it never matches inside another model name)
_NAME_PATTERNS = [("h200", r"H200"), ("h100", r"H100"), ("a100", r"A100"), ("4090", r"4090"),
                  ("3090", r"3090"), ("t4", r"\bT4\b")]


def preset_for(gpus: list[GpuInfo]) -> str:
    """The preset for these cards: by name (H200, H100, A100, 4090, 3090, T4), else by the smallest card's
    memory and bf16 support; ``cpu`` when there is no GPU."""
    if not gpus:
        return "cpu"
    name = gpus[0].name.upper()
    for preset, pattern in _NAME_PATTERNS:
        if re.search(pattern, name):
            return preset
    mem_gib = min(g.memory_gib for g in gpus)
    if not all(g.bf16 for g in gpus):
        return "t4"  # pre-Ampere (V100, T4-class): fp16 and the conservative batch
    if mem_gib >= 120:
        return "h200"
    if mem_gib >= 70:
        return "h100"
    if mem_gib >= 32:
        return "a100"
    if mem_gib >= 20:
        return "3090"  # 24 GB Ampere/Ada (A10G, L4, A5000): the 24 GB batch without betting on compile
    return "t4"


def _set(cfg: C.Config, key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    node: Any = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, leaf, value)


def apply_preset(cfg: C.Config, preset_name: str, explicit: set[str],
                 gpus: Optional[list[GpuInfo]] = None) -> dict[str, tuple[Any, Any]]:
    """Set ``preset_name``'s values on ``cfg`` in place, except keys in ``explicit`` (explicit config values
    always win). ``auto`` resolves through :func:`preset_for` on ``gpus`` (default: :func:`detect_gpus`; none
    with ``scaling.use_gpu=false``) and writes the resolved name to ``hardware.preset`` so the recorded
    config says which preset ran. Returns ``{key: (old, new)}`` for every value that changed."""
    if preset_name == "none":
        return {}
    changes: dict[str, tuple[Any, Any]] = {}
    if preset_name == "auto":
        if cfg.scaling.use_gpu is False:
            gpus = []
        preset_name = preset_for(detect_gpus() if gpus is None else gpus)
        changes["hardware.preset"] = ("auto", preset_name)
        cfg.hardware.preset = preset_name
    if preset_name not in PRESETS:
        raise C.ConfigError(f"hardware.preset: unknown preset {preset_name!r}, expected one of "
                            f"none, auto, {', '.join(PRESETS)}")
    for key, value in PRESETS[preset_name].items():
        if key in explicit:
            continue
        old = C.get_dotted(cfg, key)
        if old != value:
            _set(cfg, key, value)
            changes[key] = (old, value)
    return changes


def resolve_config(path: Optional[str | Path], overrides: list[str] | tuple[str, ...] = (),
                   gpus: Optional[list[GpuInfo]] = None) -> tuple[C.Config, dict[str, tuple[Any, Any]]]:
    """Load a config like :func:`config.load_config`, then apply ``hardware.preset`` under the keys the
    YAML file and overrides did not set. Returns ``(cfg, {key: (old, new)})``."""
    tree = C.load_raw(path, overrides)
    explicit = C.explicit_keys(tree)
    cfg = C.build_config(tree, default_name=C.default_run_name(path))
    changes: dict[str, tuple[Any, Any]] = {}
    found = [] if cfg.scaling.use_gpu is False else (detect_gpus() if gpus is None else gpus)
    if cfg.hardware.preset != "none":  # (no preset sets scaling.use_gpu: `found` stays right)
        changes = apply_preset(cfg, cfg.hardware.preset, explicit, gpus=found)
        C.validate(cfg)
    shape = model_shape(cfg) if found else None
    if shape is not None:  # before launch: lower a default/preset batch, or refuse an explicit one that can't fit
        changes.update(fit_to_gpu(cfg, shape, min(g.memory_gib for g in found), explicit))
        C.validate(cfg)
    return cfg, changes


def resolve(path: Optional[str | Path], overrides: list[str] | tuple[str, ...] = (), *,
            gpus: Optional[list[GpuInfo]] = None, announce: bool = True) -> C.Config:
    """THE way a CLI turns a YAML file and ``key=value`` overrides into the final config: strict build and checks,
    the hardware preset, the memory fit, each once (:func:`resolve_config`). With ``announce`` every value a preset
    or the fit changed is printed (stderr), so a run never silently differs from its file."""
    cfg, changes = resolve_config(path, overrides, gpus=gpus)
    if announce:
        for key, (old, new) in changes.items():
            print(f"[raytrain_scu] preset {cfg.hardware.preset}: {key} {old!r} -> {new!r}", file=sys.stderr,
                  flush=True)
    return cfg


def model_shape(cfg: C.Config) -> Optional[dict[str, int]]:
    """The estimator's shape of the config's model, or None when its config cannot be read here (the run's own
    pre-flight check then says why)."""
    try:
        from raytrain_scu.model import model_config

        m = cfg.model
        return shape_from_hf_config(model_config(m.name, gguf_file=m.gguf_file, cache_dir=m.cache_dir,
                                                 trust_remote_code=m.trust_remote_code))
    except Exception:  # noqa: BLE001 - a missing model is reported by the pre-flight check, with its reason
        return None


# ---------------------------------------------------------------- peak FLOP/s and MFU

# dense (no sparsity) bf16 tensor-core peak per card, matched by name in this order; the bench and the loop's
# perf/mfu both divide by it (docs/benchmarks.md)
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12,
                   "3090": 71e12, "A10": 125e12, "T4": 65e12}


def peak_flops(device_name: str) -> float:
    """Dense bf16 peak FLOP/s of a card, from its name (0 when unknown, e.g. a CPU)."""
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return 0.0


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak: float) -> Optional[float]:
    """Model FLOPs utilisation: tokens/s per GPU x training FLOPs per token / the card's peak FLOP/s
    (``model.flops_per_token``, :func:`peak_flops`). None when the peak is unknown (0): never a made-up 0."""
    return tokens_per_s_per_gpu * flops_per_token / peak if peak > 0 else None


# ---------------------------------------------------------------- memory estimate

# Constants of the estimate. The structure follows what PyTorch keeps alive. Checked once against
# torch.cuda.max_memory_allocated() on an H200 (torch 2.11, transformers 5.17, peft 0.21; Llama-3.2-1B shape,
# bf16, LoRA r=16 on all seven projections, loss.CausalLMLoss): without the CUDA overhead term the estimate
# was 0.96-1.07x the measured peak over batch 4-32, block 256-1024, with/without checkpointing and the fused
# loss, and 1.03x with torch.compile (batch 8 and 16, block 512) -- those runs had no autocast, so peft's fp32
# input copies were saved. The training loop runs under autocast: with it, at block 2048 (bench runs, compile on,
# batch 8 and 16; eager with checkpointing, batch 2) the saved input copies are bf16 or fused away by compile,
# which is what the adapter-input term below now says (docs/benchmarks.md). Compiled runs were re-measured on
# 2026-11-26 after the compile fix (issue #14: the chunked loss left out of the graph, one compiled decoder layer
# shared by all): 28.16 GiB at batch 8 and 47.94 GiB at batch 16 (block 2048). Inductor keeps neither the
# RMSNorms' fp32 copies nor the SwiGLU product (it recomputes SiLU(gate)*up in the backward), so a compiled layer
# keeps 3 ffn-wide tensors, not 4, and no 8H term. The 4-bit constants are not measured.
NF4_BYTES_PER_PARAM = 0.52  # 4 bits + blockwise absmax (64-blocks, double-quantised)
ADAPTER_BYTES_PER_PARAM = 16  # fp32 weight + fp32 grad + AdamW exp_avg + exp_avg_sq
COMPILE_EXTRA_GIB = 2.0  # torch.compile (inductor): its own buffers and workspaces
CUDA_OVERHEAD_GIB = 1.0  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, allocator slack
USABLE_FRACTION = 0.9  # plan for 90% of the card: fragmentation and the estimate's own error


def measured_memory_gib(model) -> dict:
    """What a built (peft) model holds, in GiB: the input embedding and a separate LM head (buffers too: int8 tables),
    an offloaded embedding (CPU), the adapters, every other parameter (the frozen linears, norms, FP8 copies) and all
    that is allocated on its GPU then (the 4-bit constants too). The estimator's counterpart, measured."""
    import torch

    def gib(tensors) -> float:
        return round(sum(t.numel() * t.element_size() for t in tensors) / 2**30, 6)

    def held(module) -> dict:  # frozen, by identity (a tied table is one set); LoRA on it counts as adapters
        return {} if module is None else {id(t): t for t in [*module.parameters(), *module.buffers()]
                                          if not t.requires_grad}

    emb_mod, head_mod = model.get_input_embeddings(), model.get_output_embeddings()
    emb, head = held(emb_mod), {k: t for k, t in held(head_mod).items() if k not in held(emb_mod)}
    offloaded = getattr(emb_mod, "inner", None)
    device = next(model.parameters()).device
    return {"embedding": gib(emb.values()), "lm_head": gib(head.values()),
            "embedding_offloaded": gib(held(offloaded).values()) if offloaded is not None else 0.0,
            "adapters": gib(p for p in model.parameters() if p.requires_grad),
            "other_params": gib(p for p in model.parameters()
                                if not p.requires_grad and id(p) not in emb and id(p) not in head),
            "allocated": round(torch.cuda.memory_allocated(device) / 2**30, 3) if device.type == "cuda" else 0.0}


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
    """Peak GPU memory (GiB) of one training step of LoRA/QLoRA on a Llama-style decoder, by part.

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

    # the copy of each adapted layer's input that the LoRA matmuls save: bf16 under the loop's autocast (peft's
    # fp32 cast is cast back); torch.compile fuses it away (measured at block 2048, see the constants above)
    adapter_inputs = 0 if (a == 4 or compile) else a * sum(dims[t][0] for t in targets)
    if compile:  # measured: inductor fuses the norms' fp32 copies and recomputes the SwiGLU product
        per_layer = tokens * a * (7 * hidden + 3 * ffn + len(targets) * lora_r)
    else:
        per_layer = tokens * (a * (7 * hidden + 4 * ffn + len(targets) * lora_r) + 8 * hidden + adapter_inputs)
    if gradient_checkpointing:
        activations = tokens * layers * hidden * a + per_layer
    else:
        activations = layers * per_layer
    activations += tokens * (3 * hidden * a + 4 * hidden)  # embeddings out, final norm, lm_head input

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


def memory_kwargs(cfg: C.Config) -> dict[str, Any]:
    """The estimator keywords a Config decides (everything but the model shape)."""
    return {"lora_r": cfg.lora.r, "lora_targets": list(cfg.lora.target_modules),
            "load_in_4bit": cfg.quant.load_in_4bit, "precision": cfg.model.precision,
            "batch_size": cfg.data.batch_size, "block_size": cfg.data.block_size,
            "gradient_checkpointing": cfg.model.gradient_checkpointing, "compile": cfg.model.compile,
            "fused_loss": cfg.model.fused_loss, "loss_chunk_tokens": cfg.model.loss_chunk_size,
            "embedding_int8": cfg.quant.embedding_int8, "offload_embedding": cfg.quant.offload_embedding}


# ---------------------------------------------------------------- fit

class MemoryFitError(ValueError):
    """The run cannot fit on the card; the message names what would."""


def fit_check(estimate_total_gib: float, gpu_mem_gib: float, usable_fraction: float = USABLE_FRACTION) -> bool:
    """Whether an estimated peak fits in ``usable_fraction`` of a card of ``gpu_mem_gib``."""
    return estimate_total_gib <= usable_fraction * gpu_mem_gib


def _largest_batch(gpu_mem_gib: float, max_batch_size: int, usable_fraction: float, **kwargs) -> int:
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
        best = _largest_batch(gpu_mem_gib, batch_size, usable_fraction, **{**kwargs, **change})
        if best >= 1:
            out.append(f"{label} with data.batch_size={best}" if change else f"data.batch_size={best}")
    return out


def _no_fit_message(batch_size: int, gpu_mem_gib: float, usable_fraction: float, kwargs: dict) -> str:
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
    best = _largest_batch(gpu_mem_gib, max_batch_size, usable_fraction, **estimate_kwargs)
    if best < 1:
        raise MemoryFitError(_no_fit_message(1, gpu_mem_gib, usable_fraction, estimate_kwargs))
    return best


def fit_to_gpu(cfg: C.Config, shape: dict[str, int], gpu_mem_gib: float, explicit: set[str] = frozenset(),
               usable_fraction: float = USABLE_FRACTION) -> dict[str, tuple[Any, Any]]:
    """Make ``cfg`` fit the card before training starts, in place. If the configured batch fits, nothing
    changes. If ``data.batch_size`` came from a default or a preset, it drops to the largest batch that
    fits and ``data.grad_accum`` (unless explicit) rises to keep the sequences per step. An explicit batch
    that does not fit is an error naming what would. Returns ``{key: (old, new)}``."""
    kwargs = {**shape, **memory_kwargs(cfg)}
    batch_size = kwargs.pop("batch_size")
    total = estimate_peak_memory_gib(batch_size=batch_size, **kwargs)["total_gib"]
    if fit_check(total, gpu_mem_gib, usable_fraction):
        return {}
    if "data.batch_size" in explicit:
        raise MemoryFitError(_no_fit_message(batch_size, gpu_mem_gib, usable_fraction, kwargs))
    best = _largest_batch(gpu_mem_gib, batch_size, usable_fraction, **kwargs)
    if best < 1:
        raise MemoryFitError(_no_fit_message(batch_size, gpu_mem_gib, usable_fraction, kwargs))
    changes: dict[str, tuple[Any, Any]] = {"data.batch_size": (batch_size, best)}
    cfg.data.batch_size = best
    if "data.grad_accum" not in explicit:
        accum = math.ceil(batch_size * cfg.data.grad_accum / best)
        changes["data.grad_accum"] = (cfg.data.grad_accum, accum)
        cfg.data.grad_accum = accum
    return changes
