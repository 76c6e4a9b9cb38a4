"""The config: one dataclass tree (:mod:`.schema`, the only home of defaults), YAML and ``key=value`` text in and out
(:mod:`.io`), cross-field checks (:mod:`.checks`), the strict build (:mod:`.load`) and where a run lives
(:mod:`.paths`) — all pure, importing nothing of the package above :mod:`raytrain_scu.errors`.

:func:`raytrain_scu.config.resolve.resolve` is the front door every CLI uses: the build, then the hardware preset
and the memory fit, each once. It reads the card and the model's shape, so it sits above ``core`` and is not
imported here::

    from raytrain_scu.config.resolve import resolve
    cfg = resolve("experiments/tiny-cpu.yaml", ["train.max_steps=200", "controller.mode=fixed"])
"""
from raytrain_scu.config.checks import check_controller, validate, validate_space_entry
from raytrain_scu.config.io import (
                                    describe,
                                    explicit_keys,
                                    flatten,
                                    flatten_tree,
                                    get_dotted,
                                    help_text,
                                    load_raw,
                                    parse_override,
                                    redact_uri,
                                    set_dotted,
                                    to_dict,
                                    to_yaml,
)
from raytrain_scu.config.load import build_config, load_config
from raytrain_scu.config.paths import RunPaths, run_dir, storage_dir
from raytrain_scu.config.schema import (
                                    ALL_LINEAR,
                                    FUSED_LORA_TARGETS,
                                    SPACE_ONLY_KEYS,
                                    Config,
                                    ControllerConfig,
                                    DataConfig,
                                    HardwareConfig,
                                    LoraConfig,
                                    ModelConfig,
                                    OptimConfig,
                                    QuantConfig,
                                    RunConfig,
                                    ScalingConfig,
                                    TrackingConfig,
                                    TrainConfig,
                                    TuneConfig,
                                    global_batch_tokens,
                                    sequences_per_step,
)
from raytrain_scu.errors import ConfigError

__all__ = ["ALL_LINEAR", "FUSED_LORA_TARGETS", "SPACE_ONLY_KEYS", "Config", "ConfigError", "ControllerConfig",
           "DataConfig", "HardwareConfig", "LoraConfig", "ModelConfig", "OptimConfig", "QuantConfig", "RunConfig",
           "RunPaths", "ScalingConfig", "TrackingConfig", "TrainConfig", "TuneConfig", "build_config",
           "check_controller", "describe", "explicit_keys", "flatten", "flatten_tree", "get_dotted",
           "global_batch_tokens", "help_text", "load_config", "load_raw", "parse_override", "redact_uri", "run_dir",
           "sequences_per_step", "set_dotted", "storage_dir", "to_dict", "to_yaml", "validate",
           "validate_space_entry"]
