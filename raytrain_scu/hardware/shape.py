"""What the memory estimator (:mod:`.memory`) needs to know of a run: the model's shape, read from its transformers
config through ``core.model`` with what its family decides (:func:`model_shape`), and the keywords the rest of the
config decides (:func:`memory_kwargs`). The front door's fit (``driver.resolve``) and the worker's out-of-memory
message (``worker.oom``) both estimate from these, and fsdp's rank 0 counts its host's whole model with them
(:func:`whole_model_bytes`).
"""
from __future__ import annotations

from typing import Any, Optional

from raytrain_scu.config.schema import Config
from raytrain_scu.hardware.memory import GIB, estimate_peak_memory_gib, shape_from_hf_config


def read_model_config(cfg: Config) -> Any:
    """The transformers config of the config's model, or None when it cannot be read here (the run's own pre-flight
    check then says why)."""
    # core.model imports torch and transformers (seconds): only when a shape is asked for, so that a bad config
    # still fails within a fraction of a second
    from raytrain_scu.core.model.source import model_config

    try:
        m = cfg.model
        return model_config(m.name, gguf_file=m.gguf_file, cache_dir=m.cache_dir, trust_remote_code=m.trust_remote_code)
    except Exception:  # noqa: BLE001 - a missing model is reported by the pre-flight check, with its reason
        return None


def shape_of(hf_config: Any) -> Optional[dict[str, int]]:
    """The estimator's shape of a transformers config, with what its family decides (the Mamba path, and what
    ``model.recompute_elementwise=auto`` picks), or None for none or one it cannot read."""
    if hf_config is None:
        return None
    try:
        shape = shape_from_hf_config(hf_config)
    except Exception:  # noqa: BLE001 - no estimate; the pre-flight check reports a model it cannot use
        return None
    from raytrain_scu.core.model.families import family_of, mamba_kernels_run  # torch: only with a config to read

    if shape.get("mamba_layers"):  # the path the family's preset chose checkpointing by: kernels or torch
        shape["mamba_kernels"] = mamba_kernels_run()
    shape["recompute_auto"] = family_of(hf_config).recompute_elementwise
    return shape


def model_shape(cfg: Config) -> Optional[dict[str, int]]:
    """The estimator's shape of the config's model, or None when its config cannot be read here."""
    return shape_of(read_model_config(cfg))


def memory_kwargs(cfg: Config) -> dict[str, Any]:
    """The estimator keywords a Config decides (everything but the model shape)."""
    return {"lora_r": cfg.lora.r, "lora_targets": list(cfg.lora.target_modules),
            "load_in_4bit": cfg.quant.load_in_4bit, "precision": cfg.model.precision,
            "batch_size": cfg.data.batch_size, "block_size": cfg.data.block_size,
            "gradient_checkpointing": cfg.model.gradient_checkpointing, "compile": cfg.model.compile,
            "recompute_elementwise": cfg.model.recompute_elementwise,
            "fused_loss": cfg.model.fused_loss, "loss_chunk_tokens": cfg.model.loss_chunk_size,
            "embedding_int8": cfg.quant.embedding_int8, "offload_embedding": cfg.quant.offload_embedding,
            "base_fp8": cfg.model.base_fp8, "head_fp8": cfg.model.head_fp8,
            "offload_activations": cfg.model.offload_activations,
            "offload_activations_gib": cfg.model.offload_activations_gib,
            "shards": cfg.scaling.num_workers if cfg.scaling.strategy == "fsdp" else 1,
            "torch_dequant": cfg.quant.dequant_4bit == "torch", "sharded_4bit": cfg.scaling.strategy == "fsdp"}


def whole_model_bytes(cfg: Config, hf_config: Any, *, dtype_bytes: int) -> Optional[int]:
    """Bytes of the whole model with its adapters in one process' memory (fsdp's rank 0 builds it on its host): every
    parameter of ``hf_config``'s shape in ``dtype_bytes`` each, and the LoRA factors in float32 (peft's), both as the
    memory estimator counts them; None where the estimator cannot read the shape. A 4-bit model read from disk is
    quantised as it loads: its weights as the estimator counts fsdp's 4-bit layers instead; a random-init preset is
    drawn whole first, in bf16."""
    shape = shape_of(hf_config)
    if shape is None:
        return None
    estimate = estimate_peak_memory_gib(**{**shape, **memory_kwargs(cfg), "batch_size": 1, "shards": 1})
    lora_bytes = estimate["lora_params"] * 4
    if cfg.quant.load_in_4bit:
        from raytrain_scu.core.model.presets import is_preset  # as read_model_config: transformers, when asked

        if not is_preset(cfg.model.name):
            return int(estimate["weights_gib"] * GIB + lora_bytes)
        return int(shape["n_params"] * 2 + lora_bytes)  # core.model.build._preset_on_disk's bf16 draw
    return int(shape["n_params"] * dtype_bytes + lora_bytes)
