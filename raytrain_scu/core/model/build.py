"""Building the model a worker trains: the frozen base on its device (random-init preset, local directory, GGUF or
hub id; 4-bit, int8 or offloaded embedding as configured), transformers' SDPA with the causal shortcut, and the LoRA
adapters; the structure a checkpoint must match to be resumed."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

import torch


@contextlib.contextmanager
def _compile_on_first_call():
    """``torch.compile(fn)`` compiles when the result is first called, not when it is made. Importing peft imports
    bitsandbytes, whose CPU kernels are wrapped in ``torch.compile`` at import: that loads inductor (about a second of
    CPU) in every process that imports peft (each worker, each CLI), though a run compiles those kernels only where it
    calls them. Their wrappers call the compiled function inside their own fallback, so a compile that fails on the
    first call still falls back to the eager kernel."""
    real = torch.compile

    def deferred(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **options)
        if isinstance(model, torch.nn.Module):  # a module compiled at import stays what torch.compile makes of it
            return real(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


with _compile_on_first_call():
    from peft import LoraConfig, get_peft_model
from transformers import AttentionInterface, AutoModelForCausalLM, BitsAndBytesConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from raytrain_scu.core.embed_quant import (
    EMBEDDING_TARGETS,
    Int8Embedding,
    OffloadedEmbedding,
    embedding_targets,
    shrink_embeddings,
)
from raytrain_scu.core.model import packed
from raytrain_scu.core.model.families import family_of
from raytrain_scu.core.model.presets import PRESETS, is_preset, preset_config
from raytrain_scu.core.model.source import (
    default_cache_dir,
    file_lock,
    gguf_cache,
    model_config,
    no_progress_bars,
    resolve_name,
)
from raytrain_scu.core.nf4 import keep_4bit_layout, shard_ready_4bit, shard_ready_4bit_shells
from raytrain_scu.errors import ModelError


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The compute dtype: fp32 on CPU for ``auto`` (bf16 is emulated there), bf16 on GPUs that support it."""
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


CAUSAL_SDPA = "raytrain_sdpa"


@functools.cache
def causal_sdpa() -> str:
    """Register (once) and return the name of transformers' SDPA attention whose mask function returns no mask for a
    plain causal LM on whole blocks, so SDPA runs its causal kernel with shared key/value heads -- also under
    torch.compile. There transformers cannot rule out packed sequences (it would have to read position_ids), so it
    builds an explicit T x T mask, expands the KV heads and SDPA takes a ~3x slower masked kernel (cuDNN, H200,
    block 2048, batch 8: 2.7 ms vs 0.9 ms per layer backward). Contract: models built here are fed whole, unpacked
    blocks (this package never passes position_ids or a padding mask). A padding mask, a KV-cache offset, extra mask
    functions (use_vmap) or a sliding-window/chunked config get transformers' own SDPA mask. Packed rows pass their
    own mask (``packed_mask``, :mod:`~raytrain_scu.core.model.packed`), which this attention uses instead."""
    def mask(**kw):
        cfg, q_len = kw.get("config"), kw.get("q_length")
        if q_len is None and kw.get("cache_position") is not None:  # older transformers pass cache_position
            q_len = kw["cache_position"].shape[0]
        # as many keys as queries and no key offset: nothing cached, so the queries start at position 0
        plain = (kw.get("attention_mask") is None and q_len is not None and q_len == kw.get("kv_length")
                 and kw.get("kv_offset", 0) == 0 and not kw.get("use_vmap", False)
                 and not getattr(cfg, "sliding_window", None) and not getattr(cfg, "attention_chunk_size", None))
        return None if plain else sdpa_mask(**kw)

    def attention(module, query, key, value, attention_mask, packed_mask=None, **kw):
        # packed rows (core.model.packed): the mask the loss made from their positions, never transformers' mask
        if packed_mask is not None:
            return packed.attention(module, query, key, value, packed_mask, scaling=kw.get("scaling"),
                                    dropout=kw.get("dropout", 0.0), sliding_window=kw.get("sliding_window"),
                                    softcap=kw.get("softcap"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(CAUSAL_SDPA, attention)
    AttentionMaskInterface.register(CAUSAL_SDPA, mask)
    return CAUSAL_SDPA


def build_model(name: str, *, gguf_file: str = "", vocab_size: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device = torch.device("cpu"), attn_implementation: str = "sdpa",
                gradient_checkpointing: bool = False, load_in_4bit: bool = False, quant_type: str = "nf4",
                double_quant: bool = True, embedding_int8: bool = False, offload_embedding: bool = False,
                cache_dir: str = "", trust_remote_code: bool = False, seed: int = 0, shardable_4bit: bool = False):
    """The frozen base causal LM, on ``device``. With ``load_in_4bit`` it is NF4-quantised there
    (device_map={"": device}); ``embedding_int8`` / ``offload_embedding``: embed_quant.shrink_embeddings. On the meta
    device it is the modules of the model's config without weight memory, whatever the source (preset, directory,
    GGUF or hub id): what scaling.strategy=fsdp shards before any rank holds a weight (core.fsdp.shard fills them).
    ``shardable_4bit`` (fsdp's 4-bit base): its 4-bit layers are core.nf4's ShardedNF4Linear, the codes
    bitsandbytes quantised (empty on the meta device), in ``dtype``'s bytes."""
    if attn_implementation == "sdpa":  # the same kernels, with the causal shortcut also under torch.compile
        attn_implementation = causal_sdpa()
    kw = dict(dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    if device.type == "meta":
        model = _on_meta(name, gguf_file=gguf_file, vocab_size=vocab_size, cache_dir=cache_dir,
                         load_in_4bit=load_in_4bit and not shardable_4bit, offload_embedding=offload_embedding, **kw)
        if load_in_4bit and shardable_4bit:
            shard_ready_4bit_shells(model, dtype)
        return _frozen(model, load_in_4bit=False, gradient_checkpointing=gradient_checkpointing,
                       embedding_int8=embedding_int8, offload_embedding=False)
    if load_in_4bit:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=dtype if dtype != torch.float32 else torch.float32)
        kw["device_map"] = {"": device}  # one device per rank: never "auto" in data parallel
    if is_preset(name):
        with _seeded(seed):
            if load_in_4bit:
                path = _preset_on_disk(name, vocab_size, seed, cache_dir, device)
                with no_progress_bars():
                    model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
            else:  # initialised directly on the device: a 1B random init on a CPU takes many seconds
                with torch.device(device):
                    model = AutoModelForCausalLM.from_config(preset_config(name, vocab_size), dtype=dtype,
                                                             attn_implementation=attn_implementation)
    else:
        path = gguf_cache(name, gguf_file, cache_dir) if gguf_file else Path(os.path.expanduser(resolve_name(name)))
        src = str(path) if path.exists() else name
        try:
            with no_progress_bars():
                model = AutoModelForCausalLM.from_pretrained(src, **kw)
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"model.name={name}: could not load the model: {type(e).__name__}: {str(e)[:400]}") \
                from None
        if not load_in_4bit:  # what follows (FP8 quantisation, fused projections) works on the device's weights
            model = model.to(device)
    if load_in_4bit and shardable_4bit:
        shard_ready_4bit(model, dtype)
    return _frozen(model, load_in_4bit=load_in_4bit, gradient_checkpointing=gradient_checkpointing,
                   embedding_int8=embedding_int8, offload_embedding=offload_embedding)


def _on_meta(name: str, *, gguf_file: str, vocab_size: int, cache_dir: str, load_in_4bit: bool,
             offload_embedding: bool, **kw):
    """The model of ``name``'s config on the meta device (its config read, or a GGUF file converted once, never its
    weights). bitsandbytes' 4-bit layers are quantised as their weights load and an offloaded embedding is moved off
    the device it loads on: neither has a meta form, and both are refused by name (fsdp's 4-bit layers are
    ShardedNF4Linear, which has)."""
    refused = [k for k, on in (("quant.load_in_4bit", load_in_4bit), ("quant.offload_embedding", offload_embedding))
               if on]
    if refused:
        raise ModelError(f"{', '.join(refused)}: the base is built on the meta device under scaling.strategy=fsdp "
                         f"and this option needs its weights as they load; set scaling.strategy=ddp or turn it off")
    config = model_config(name, gguf_file=gguf_file, vocab_size=vocab_size, cache_dir=cache_dir,
                          trust_remote_code=kw["trust_remote_code"])
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kw)


def _frozen(model, *, load_in_4bit: bool, gradient_checkpointing: bool, embedding_int8: bool,
            offload_embedding: bool):
    """``model`` frozen, with its family's preparation, checkpointing and shrunken embeddings as configured."""
    model.requires_grad_(False)
    if load_in_4bit:  # bitsandbytes' CPU eval repacking breaks the backward and torch.compile: nf4.py
        keep_4bit_layout(model)
    prepare = family_of(model.config).prepare
    if prepare is not None:
        prepare(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    shrink_embeddings(model, int8=embedding_int8, offload=offload_embedding)  # the hook above moves with it
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def _seeded(seed: int):
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def _preset_on_disk(name: str, vocab_size: int, seed: int, cache_dir: str,
                    device: torch.device = torch.device("cpu")) -> Path:
    """Presets go through from_pretrained when quantised, so they are saved once (random init, seeded, in bf16: the
    8B shape is 16 GB on disk instead of 32). The name carries a hash of the preset's dimensions, so a changed preset
    is never served an old shape. On a CUDA ``device`` the random init runs there (the 8B shape's init on a CPU took
    minutes, past a 7-minute GPU call): CUDA's generator draws other numbers, so those files are named apart."""
    dims = hashlib.sha256(json.dumps(PRESETS[name], sort_keys=True).encode()).hexdigest()[:8]
    init_on = device if device.type == "cuda" else torch.device("cpu")
    suffix = "-cuda-init" if init_on.type == "cuda" else ""
    out = default_cache_dir(cache_dir) / "models" / f"preset-{name}-v{vocab_size}-s{seed}-{dims}-bf16{suffix}"
    with file_lock(out):
        if not (out / "config.json").is_file():
            torch.manual_seed(seed)
            with torch.device(init_on):
                m = AutoModelForCausalLM.from_config(preset_config(name, vocab_size), dtype=torch.bfloat16)
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            with no_progress_bars():
                m.save_pretrained(str(tmp), safe_serialization=True)
            del m
            os.replace(tmp, out)
    return out


def apply_lora(model, *, r: int = 16, alpha: int = 32, dropout: float = 0.0, targets=None, quantized: bool = False,
               gradient_checkpointing: bool = False):
    """Wrap the base model with trainable LoRA adapters (peft). Adapter weights are kept in float32."""
    # For a quantized base, peft's prepare_model_for_kbit_training is NOT used: besides checkpointing (which
    # build_model already set up) it upcasts every non-quantized weight to fp32 -- the 128k x d embedding among them --
    # which on a 1B model costs more memory than the 4-bit linears save (docs/benchmarks.md).
    targets = list(targets) if targets else "all-linear"
    shrunk = isinstance(model.get_input_embeddings(), (Int8Embedding, OffloadedEmbedding))
    hit = embedding_targets(model, targets) if isinstance(targets, list) and shrunk else []
    if hit:
        raise ModelError(EMBEDDING_TARGETS.format(hit=hit))
    if isinstance(targets, list):
        missing, present = missing_targets(model, targets)
        if missing:
            raise ModelError(f"lora.target_modules: {missing} not found in the model "
                             f"(it has e.g. {sorted(x for x in present if x.endswith('proj'))[:10]})")
        if targets == ["all-linear"]:
            targets = "all-linear"
    lcfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lcfg)


def keep_lora_inputs_in_autocast_dtype(model) -> int:
    """Stop peft's LoRA layers casting their input to the adapters' float32 before the adapter product; returns how
    many layers changed. For a model every forward of which runs under autocast (the loop's step and evaluation):
    autocast casts that float32 copy straight back to its own dtype for the matmul, so the cast only writes the
    activation at twice its size, and the separate copy the adapter's matmul then saves for the backward. Without
    dropout the adapter product is the same: a bf16 or fp16 number survives the round trip through float32 (the CPU
    test checks loss and gradients bit for bit); with lora.dropout > 0 the dropout runs on the autocast dtype. A
    forward outside autocast fails afterwards (a float32 adapter meets a bf16 input), so the loop calls this only
    when it trains under autocast."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    return len(layers)


def missing_targets(model, targets) -> tuple[list[str], set[str]]:
    """LoRA target names that no module of ``model`` has ("all-linear" always matches), and the names it has."""
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    return [t for t in targets if t not in present and t != "all-linear"], present


def preset_init_device(name: str, *, use_gpu: bool, strategy: str) -> str:
    """The device type a run draws its random-init preset on, from the seed: "cpu" under scaling.strategy=fsdp (rank
    0 builds the whole model on its host: worker.build.full_model), else the workers' own, "cuda" for GPU workers
    (:func:`build_model` draws there, a 4-bit preset's :func:`_preset_on_disk` too) and "cpu" for CPU workers; "" for
    a model that is read, not drawn (a checkpoint, a GGUF file, a hub id). CUDA's generator draws other numbers than
    the CPU's, so adapters trained on one draw are for that base only. A strategy never resolved (auto) runs ddp, as
    in the worker. The worker (the checkpoint's structure) and the driver (preflight, the base recipe) both ask here."""
    if not is_preset(name):
        return ""
    return "cuda" if use_gpu and strategy != "fsdp" else "cpu"


def structure_of(cfg, *, use_gpu: bool) -> dict:
    """:func:`structure_signature` of a Config run by GPU workers or not (``use_gpu``): what the loop writes and
    preflight checks."""
    m = cfg.model
    return structure_signature(name=m.name, gguf_file=m.gguf_file, r=cfg.lora.r, alpha=cfg.lora.alpha,
                               targets=cfg.lora.target_modules, block_size=cfg.data.block_size,
                               load_in_4bit=cfg.quant.load_in_4bit, embedding_int8=cfg.quant.embedding_int8,
                               law=cfg.controller.law,
                               init_device=preset_init_device(m.name, use_gpu=use_gpu, strategy=cfg.scaling.strategy))


def structure_signature(*, name: str, gguf_file: str, r: int, alpha: int, targets, block_size: int,
                        load_in_4bit: bool, embedding_int8: bool = False, law: str, init_device: str) -> dict:
    """What a checkpoint must match to be resumed (base model, LoRA shape, block size, the control law whose state it
    holds, and for a random-init preset the device type its base was drawn on: :func:`preset_init_device`, "" for
    any other model, which records no such key). ``law`` and ``init_device`` have no default: a caller names them,
    never one that a changed default would swap."""
    return {"model.name": name, "model.gguf_file": gguf_file, "lora.r": r, "lora.alpha": alpha,
            "lora.target_modules": list(targets), "data.block_size": block_size, "quant.load_in_4bit": load_in_4bit,
            "quant.embedding_int8": embedding_int8, "controller.law": law,
            **({"model.init_device": init_device} if init_device else {})}
