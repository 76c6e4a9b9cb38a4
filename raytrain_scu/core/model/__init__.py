"""Model building blocks: where a model comes from (:mod:`.source`), the random-init presets (:mod:`.presets`),
what the package knows per model family (:mod:`.families`), building the base and its LoRA adapters (:mod:`.build`)
and the FLOP count (:mod:`.flops`). No ray, mlflow or torch.distributed."""
from raytrain_scu.core.model.build import (
                                           CAUSAL_SDPA,
                                           apply_lora,
                                           build_model,
                                           causal_sdpa,
                                           missing_targets,
                                           resolve_dtype,
                                           structure_of,
                                           structure_signature,
)
from raytrain_scu.core.model.families import FAMILIES, Family, HeadTransform, family_of
from raytrain_scu.core.model.flops import bits_per_token, flops_per_token, matmul_params
from raytrain_scu.core.model.presets import (
                                           PRESET_TOKENIZER_VOCAB,
                                           PRESETS,
                                           granite_hybrid_preset,
                                           is_preset,
                                           llama_preset,
                                           preset_config,
)
from raytrain_scu.core.model.source import (
                                           check_model_source,
                                           default_cache_dir,
                                           load_tokenizer,
                                           max_positions,
                                           model_config,
                                           resolve_name,
                                           shakespeare_bpe,
)

__all__ = ["CAUSAL_SDPA", "FAMILIES", "PRESETS", "PRESET_TOKENIZER_VOCAB", "Family", "HeadTransform", "apply_lora",
           "bits_per_token", "build_model", "causal_sdpa", "check_model_source", "default_cache_dir", "family_of",
           "flops_per_token", "granite_hybrid_preset", "is_preset", "llama_preset", "load_tokenizer", "matmul_params",
           "max_positions", "missing_targets", "model_config", "preset_config", "resolve_dtype", "resolve_name",
           "shakespeare_bpe", "structure_of", "structure_signature"]
