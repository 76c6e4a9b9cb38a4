"""One dataclass tree: the only home of raytrain_scu's defaults.

Loading is YAML -> dotted ``key=value`` overrides -> strict build -> cross-field checks::

    cfg = load_config("experiments/tiny-cpu.yaml", ["train.max_steps=200", "controller.mode=fixed"])

An unknown key or a value of the wrong type is a :class:`ConfigError` that names the key and what was expected.
Validation does no I/O. ``python -m raytrain_scu.config CONFIG.yaml key=value...`` prints the resolved config as YAML.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from raytrain_scu.config_io import (_coerce, _numeric_space, _type_name, default_run_name, describe,  # noqa: F401
                                    explicit_keys, flatten, flatten_tree, get_dotted, help_text, load_raw,
                                    parse_override, redact_uri, set_dotted, to_dict, to_yaml)


class ConfigError(ValueError):
    """A config problem; the message names the key and what was expected."""


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]  # what model.fuse_lora fuses

# keys that no longer exist -> what replaces them: a config that still sets one gets an error naming the replacement
REMOVED_KEYS = {
    "train.eval_batches": "train.eval_blocks (validation blocks scored at each eval, 0 = the whole split): "
                          "eval_batches scored eval_batches x data.batch_size x scaling.num_workers blocks, a "
                          "different validation set for every batch size and worker count",
}


@dataclass
class ModelConfig:
    # a built-in random-init preset (model.PRESETS: "tiny", "llama-3.2-1b-shape", ...), a hub id, or a local directory
    name: str = "tiny"
    gguf_file: str = ""  # a GGUF file inside `name` (a directory) or an absolute path
    tokenizer: str = ""  # "" = the model's own; presets use a BPE trained on the bundled Shakespeare
    precision: str = "auto"  # auto | bf16 | fp16 | fp32 (auto: bf16 on capable GPUs, fp16 on older, fp32 on CPU)
    # sdpa | eager | flash_attention_2 | any name transformers knows (sdpa gets a causal no-mask shortcut)
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, ~30 % slower
    compile: bool = False  # torch.compile the model (what hardware presets pick on A100/H100/H200/4090)
    # torch.compile mode: default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    compile_mode: str = "default"
    # layers: each decoder layer compiled alone, all sharing one compiled code (seconds); model: one graph (minutes)
    compile_scope: str = "layers"
    fused_loss: bool = True  # chunked linear + cross-entropy: logits are never materialised in fp32
    loss_chunk_size: int = 4096  # tokens per chunk of the fused loss
    fuse_lora: bool = False  # Llama: q/k/v, gate/up one frozen GEMM each + one of their LoRA A's (fused_lora.py)
    base_fp8: bool = False  # LoRA-base GEMMs in FP8 e4m3, rowwise (fp8.py): CUDA >= 8.9; CPU: torch 2.13, not 2.11
    trust_remote_code: bool = False  # allow a hub model's own Python code (transformers' trust_remote_code)
    cache_dir: str = ""  # where converted GGUF models and tokenizers are cached ("" = ~/.cache/raytrain_scu)


@dataclass
class LoraConfig:
    r: int = 16  # LoRA rank
    alpha: int = 32  # LoRA alpha: the update is scaled by alpha / r
    dropout: float = 0.0  # dropout on the LoRA input (each rank draws its own masks)
    # module names that get adapters (all-linear = every linear layer but the head)
    target_modules: list[str] = field(default_factory=lambda: list(ALL_LINEAR))


@dataclass
class QuantConfig:
    load_in_4bit: bool = False  # QLoRA: the frozen base in 4 bits (bitsandbytes; CUDA)
    quant_type: str = "nf4"  # nf4 | fp4
    double_quant: bool = True  # also quantise the 4-bit quantisation constants
    # the frozen token embedding and LM head (one table when tied) in int8, a scale per row: half their bf16 memory
    embedding_int8: bool = False
    offload_embedding: bool = False  # the input embedding in CPU memory, its rows copied per batch (untied models)


@dataclass
class DataConfig:
    # source: shakespeare | text (file, directory or glob) | jsonl | hf_disk | hf_hub | auto (from path)
    source: str = "shakespeare"
    path: str = ""  # file, directory or glob of the text/jsonl source; dataset name or directory for hf_*
    text_field: str = "text"  # the field holding the text (jsonl and hf_* sources)
    max_documents: int = 0  # 0 = all documents of the source
    block_size: int = 256  # tokens per training sequence
    batch_size: int = 8  # sequences per worker per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    val_fraction: float = 0.1  # share of documents held out for validation (split by document, seeded)
    cache_dir: str = ""  # token cache ("" = ~/.cache/raytrain_scu/tokens)
    loader_workers: int = 0  # background processes that read batches (0 = in the training process)


@dataclass
class OptimConfig:
    lr: float = 2e-4  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW decoupled weight decay (the SCU penalty is separate)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.999  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 10  # linear warm-up steps, then cosine decay
    min_lr_ratio: float = 0.1  # the cosine decay ends at lr x min_lr_ratio at train.max_steps
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 = off)


@dataclass
class TrainConfig:
    max_steps: int = 100  # optimizer steps; a larger value on a finished run's name extends it
    checkpoint_every: int = 50  # steps between checkpoints (and always at the end)
    report_every: int = 10  # steps between reports to Ray (progress, tokens/s, MFU)
    eval_every: int = 50  # steps between held-out evaluations
    # validation blocks each eval scores, spread evenly over the split (0 or more than it has = the whole split):
    # one fixed set, the same whatever data.batch_size, data.grad_accum and scaling.num_workers are
    eval_blocks: int = 0
    max_consecutive_skips: int = 10  # skipped steps in a row before the run stops (fp16 scaler overflows never count)
    stop_on_saturation: bool = False  # end the run once λ has settled (ctrl/saturated_step)
    profile_steps: int = 0  # the last N steps under torch.profiler, each rank's table in <run dir>/profile/ (0 = off)


@dataclass
class ControllerConfig:
    mode: str = "scu"  # scu | fixed | none
    target_s: float = 0.01  # S*: the information ratio ParamBPT / (DataBPT + ParamBPT) to hold
    kp: float = 0.8  # proportional gain
    ki: float = 0.15  # integral gain
    ema_alpha: float = 0.1  # smoothing of S into Ŝ (Ŝ ← α·S + (1−α)·Ŝ)
    deadband: float = 0.002  # |Ŝ − S*| at or below this leaves λ unchanged
    leak: float = 0.995  # the integral decays by this factor each update
    integral_limit: float = 0.2  # the integral is clipped to ± this
    lambda_init: float = 1.0  # λ at the start (scu), or the fixed λ (fixed)
    lambda_min: float = 1e-4  # λ's lower bound under the SCU law
    lambda_max: float = 10.0  # λ's upper bound under the SCU law
    prior_sigma: float = 0.01  # σ of the Gaussian prior on the LoRA weights in ParamBPT
    prior_center: str = "zero"  # zero: the spec's law, Σw² | init: Σ(w − w_init)², the update (an option beside it)
    control_every: int = 1  # optimizer steps between controller updates
    saturation_window: int = 100  # updates over which λ must stay flat to count as settled
    saturation_rel_tol: float = 0.01  # max(λ)/min(λ) − 1 below this over the window = settled
    # 0 = measured from the training split. A resume refuses a checkpoint whose tokens_per_epoch differs from the
    # measured one (changed data would rescale ParamBPT and S silently); set here, it wins over both.
    tokens_per_epoch: int = 0


@dataclass
class ScalingConfig:
    num_workers: int = 1  # Ray Train workers (one per GPU on a GPU cluster)
    use_gpu: Optional[bool] = None  # None = auto-detect
    cpus_per_worker: float = 1.0  # CPUs Ray reserves for each worker
    gpus_per_worker: float = 1.0  # GPUs Ray reserves for each worker
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (Ray placement group)
    # how often Ray Train's controller polls the workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, Ray's default 2 s): a
    # worker holds one unconsumed report, so reports more often stall training to the next poll; checkpoints register
    poll_interval_s: float = 0.25


@dataclass
class RunConfig:
    name: str = ""  # "" = the config file's stem
    # where run directories and the default MLflow store live (a path or s3:// / gs://)
    storage_path: str = "~/raytrain_scu_runs"
    max_failures: int = 3  # worker-group restarts Ray Train makes before the run fails
    num_to_keep: int = 2  # checkpoints kept: the best by val/data_bpt, plus the latest
    output_dir: str = ""  # "" = <storage_path>/<name>/output


@dataclass
class TrackingConfig:
    enabled: bool = True  # record the run in MLflow
    uri: str = ""  # "" = sqlite:///<storage_path>/mlflow.db
    experiment: str = ""  # "" = the config file's stem: one experiment per config, its runs side by side
    log_best_checkpoint: bool = True  # log the best checkpoint (lowest val/data_bpt) as an MLflow artifact
    system_metrics: Optional[bool] = None  # None = on for GPU runs


@dataclass
class TuneConfig:
    # key path -> {kind: args}, e.g. {"controller.kp": {"loguniform": [0.1, 2.0]}}
    space: dict[str, dict] = field(default_factory=dict)
    metric: str = "val/data_bpt"  # the metric trials are scored on (perf/tokens_per_s for micro-batch sweeps)
    mode: str = "min"  # min | max
    search: str = "random"  # random | grid | optuna
    scheduler: str = "asha"  # asha | none
    num_samples: int = 4  # trials (for grid: repeats of the grid)
    time_budget_s: float = 0.0  # stop launching trials after this many seconds (0 = no limit)
    grace_period: int = 1  # reports before ASHA may stop a trial
    max_concurrent_trials: int = 0  # 0 = from cluster resources
    keep_tokens_per_step: bool = True  # batch-size trials keep tokens per optimizer step by adjusting grad_accum


@dataclass
class HardwareConfig:
    preset: str = "none"  # none | auto | a100 | h100 | h200 | 4090 | 3090 | t4 | cpu


@dataclass
class Config:
    seed: int = 0  # seeds the data split and order, LoRA init and dropout
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)


# ---------------------------------------------------------------- typed build

def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    for k in data:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else str(k)
            _check_not_removed(where)
            raise ConfigError(f"unknown config key '{where}' (known keys here: {', '.join(sorted(names))})")
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name] if data[f.name] is not None else {}, key)
        else:
            kwargs[f.name] = _coerce(key, data[f.name], tp)
    return cls(**kwargs)


def _check_not_removed(key: str) -> None:
    if key in REMOVED_KEYS:
        raise ConfigError(f"config key '{key}' was removed: use {REMOVED_KEYS[key]}")


def _leaf_type(key: str):
    """The annotation of a dotted key, or ConfigError for an unknown (or removed) key."""
    _check_not_removed(key)
    cls, tp = Config, Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"unknown config key '{key}'")
        hints = typing.get_type_hints(cls)
        if part not in hints:
            raise ConfigError(f"unknown config key '{key}' (known keys here: {', '.join(sorted(hints))})")
        tp = hints[part]
        cls = tp
    return tp


def storage_dir(storage_path: str) -> str:
    """``run.storage_path`` made absolute (``~`` expanded); a remote URI (``s3://``, ``gs://``) unchanged."""
    return os.path.abspath(os.path.expanduser(storage_path)) if "://" not in storage_path else storage_path


def run_dir(cfg: Config) -> str:
    """A run's directory, ``<storage_path>/<run.name>``: Ray's run directory (checkpoints), the MLflow run key, and
    the parent of ``output/``. A string, since it may be a remote URI."""
    return f"{storage_dir(cfg.run.storage_path)}/{cfg.run.name}"


def build_config(tree: dict, default_name: str = "run") -> Config:
    """Strictly build and validate a Config from a nested dict."""
    cfg = _build(Config, tree, "")
    cfg.tune.space = _numeric_space(cfg.tune.space)
    if not cfg.run.name:
        cfg.run.name = default_name
    cfg.tracking.experiment = cfg.tracking.experiment or default_name  # one MLflow experiment per config file
    validate(cfg)
    return cfg


def load_config(path: Optional[str | Path] = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config, apply dotted overrides, build strictly and validate."""
    return build_config(load_raw(path, overrides), default_name=default_run_name(path))


# ---------------------------------------------------------------- cross-field checks

def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, f"expected one of {', '.join(allowed)}, got {value!r}")


TUNE_KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
# tune.space keys that are not config keys (sweep_space.apply_params maps them): global_batch_tokens, tokens per
# optimizer step (the optimisation knob); a trial's data.grad_accum = it / (batch_size x num_workers x block_size)
# arm: bundles {config key: value} set together, so unlike trials (the ablation's arms) run as one grid
SPACE_ONLY_KEYS = {"global_batch_tokens": int, "arm": dict}


def check_controller(c: "ControllerConfig") -> None:
    """The controller's checks, the only copy: ``validate`` runs them on a config and ``SCUController`` on its keyword
    arguments (both raise ConfigError naming the key)."""
    _one_of("controller.mode", c.mode, ("scu", "fixed", "none"))
    _check(0.0 < c.target_s < 1.0, "controller.target_s", f"must be in (0, 1), got {c.target_s}")
    _check(c.kp >= 0, "controller.kp", f"must be >= 0, got {c.kp}")
    _check(c.ki >= 0, "controller.ki", f"must be >= 0, got {c.ki}")
    _check(0.0 < c.ema_alpha <= 1.0, "controller.ema_alpha", f"must be in (0, 1], got {c.ema_alpha}")
    _check(c.deadband >= 0, "controller.deadband", f"must be >= 0, got {c.deadband}")
    _check(0.0 < c.leak <= 1.0, "controller.leak", f"must be in (0, 1], got {c.leak}")
    _check(c.integral_limit >= 0, "controller.integral_limit", f"must be >= 0, got {c.integral_limit}")
    _check(c.lambda_min > 0, "controller.lambda_min", f"must be > 0, got {c.lambda_min}")
    # in every mode: the bounds are part of the controller's state even when a fixed λ never meets them
    _check(c.lambda_min < c.lambda_max, "controller.lambda_max",
           f"must be > lambda_min, got lambda_min={c.lambda_min}, lambda_max={c.lambda_max}")
    if c.mode == "scu":  # the bounds clamp the law's updates; a fixed λ is never updated
        _check(c.lambda_min <= c.lambda_init <= c.lambda_max, "controller.lambda_init",
               f"need lambda_min <= lambda_init <= lambda_max, got {c.lambda_min} <= {c.lambda_init} <= "
               f"{c.lambda_max}")
    elif c.mode == "fixed":
        _check(c.lambda_init > 0, "controller.lambda_init", f"a fixed lambda_init must be > 0, got {c.lambda_init}")
    _check(c.prior_sigma > 0, "controller.prior_sigma", f"must be > 0, got {c.prior_sigma}")
    _one_of("controller.prior_center", c.prior_center, ("zero", "init"))
    _check(c.control_every >= 1, "controller.control_every", f"must be >= 1, got {c.control_every}")
    _check(c.saturation_window >= 1, "controller.saturation_window", f"must be >= 1, got {c.saturation_window}")
    _check(c.saturation_rel_tol > 0, "controller.saturation_rel_tol", f"must be > 0, got {c.saturation_rel_tol}")
    _check(c.tokens_per_epoch >= 0, "controller.tokens_per_epoch", f"must be >= 0, got {c.tokens_per_epoch}")


def validate(cfg: Config) -> None:
    """Cross-field checks. Pure: no I/O, no imports of heavy libraries."""
    check_controller(cfg.controller)
    _check_model_and_data(cfg)
    _check_run(cfg)


def _check_model_and_data(cfg: Config) -> None:
    """model, lora, quant, data and optim."""
    m = cfg.model
    _check(bool(m.name.strip()), "model.name", "must not be empty")
    _one_of("model.precision", m.precision, ("auto", "bf16", "fp16", "fp32"))
    _one_of("model.attn_implementation", m.attn_implementation, ("sdpa", "eager", "flash_attention_2"))
    _one_of("model.compile_scope", m.compile_scope, ("layers", "model"))
    _one_of("model.compile_mode", m.compile_mode, ("default", "reduce-overhead", "max-autotune",
                                                   "max-autotune-no-cudagraphs"))
    _check(m.loss_chunk_size >= 1, "model.loss_chunk_size", f"must be >= 1, got {m.loss_chunk_size}")

    lo = cfg.lora
    _check(lo.r >= 1, "lora.r", f"must be >= 1, got {lo.r}")
    _check(lo.alpha > 0, "lora.alpha", f"must be > 0, got {lo.alpha}")
    _check(0.0 <= lo.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {lo.dropout}")
    _check(len(lo.target_modules) > 0, "lora.target_modules", "must name at least one module")

    q = cfg.quant
    _one_of("quant.quant_type", q.quant_type, ("nf4", "fp4"))
    for bad, need in ((q.load_in_4bit, "an unquantised base, not quant.load_in_4bit=true"),
                      (m.fuse_lora, "model.fuse_lora=false (the fused GEMMs bypass the base Linears it converts)")):
        _check(not (m.base_fp8 and bad), "model.base_fp8", f"needs {need}")
    if m.fuse_lora:  # what fused_lora.py fuses: plain LoRA on q/k/v and gate/up of an unquantised base
        covered = ALL_LINEAR if "all-linear" in lo.target_modules else lo.target_modules
        missing = [t for t in FUSED_LORA_TARGETS if t not in covered]
        for bad, need in ((q.load_in_4bit, "a bf16/fp16/fp32 base, not quant.load_in_4bit=true"),
                          (lo.dropout > 0, f"lora.dropout=0 (q/k/v share one A-product input), got {lo.dropout}"),
                          (missing, f"lora.target_modules to cover {FUSED_LORA_TARGETS}, missing {missing}")):
            _check(not bad, "model.fuse_lora", f"needs {need}")

    d = cfg.data
    _one_of("data.source", d.source, ("shakespeare", "text", "jsonl", "hf_disk", "hf_hub", "auto"))
    _check(d.source in ("shakespeare",) or bool(d.path), "data.path",
           f"must be set for data.source={d.source}")
    _check(d.block_size >= 2, "data.block_size", f"must be >= 2, got {d.block_size}")
    _check(d.batch_size >= 1, "data.batch_size", f"must be >= 1, got {d.batch_size}")
    _check(d.grad_accum >= 1, "data.grad_accum", f"must be >= 1, got {d.grad_accum}")
    _check(0.0 < d.val_fraction < 1.0, "data.val_fraction", f"must be in (0, 1), got {d.val_fraction}")
    _check(d.max_documents >= 0, "data.max_documents", f"must be >= 0, got {d.max_documents}")
    _check(d.loader_workers >= 0, "data.loader_workers", f"must be >= 0, got {d.loader_workers}")

    o = cfg.optim
    _check(o.lr > 0 and math.isfinite(o.lr), "optim.lr", f"must be > 0, got {o.lr}")
    _check(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1", "betas must be in [0, 1)")
    _check(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _check(0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    _check(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 = off), got {o.grad_clip}")


def _check_run(cfg: Config) -> None:
    """train, scaling, run, tracking, tune and hardware."""
    m, q = cfg.model, cfg.quant
    t = cfg.train
    _check(t.max_steps >= 1, "train.max_steps", f"must be >= 1, got {t.max_steps}")
    _check(t.checkpoint_every >= 1, "train.checkpoint_every", f"must be >= 1, got {t.checkpoint_every}")
    _check(t.report_every >= 1, "train.report_every", f"must be >= 1, got {t.report_every}")
    _check(t.eval_every >= 1, "train.eval_every", f"must be >= 1, got {t.eval_every}")
    _check(t.eval_blocks >= 0, "train.eval_blocks", f"must be >= 0 (0 = the whole validation split), "
                                                     f"got {t.eval_blocks}")
    _check(t.profile_steps >= 0, "train.profile_steps", f"must be >= 0 (0 = off), got {t.profile_steps}")
    _check(not t.profile_steps or "://" not in cfg.run.storage_path, "train.profile_steps",
           f"writes its tables under the run directory, which must be a local path, not {cfg.run.storage_path!r}")
    _check(t.max_consecutive_skips >= 1, "train.max_consecutive_skips",
           f"must be >= 1, got {t.max_consecutive_skips}")
    _check(t.checkpoint_every % t.report_every == 0, "train.checkpoint_every",
           f"must be a multiple of train.report_every ({t.report_every}): checkpoints travel with reports, "
           f"got {t.checkpoint_every}")

    s = cfg.scaling
    _check(s.num_workers >= 1, "scaling.num_workers", f"must be >= 1, got {s.num_workers}")
    _check(s.cpus_per_worker > 0, "scaling.cpus_per_worker", f"must be > 0, got {s.cpus_per_worker}")
    _check(s.gpus_per_worker > 0, "scaling.gpus_per_worker", f"must be > 0, got {s.gpus_per_worker}")
    _one_of("scaling.placement_strategy", s.placement_strategy, ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    _check(0 < s.poll_interval_s <= 60, "scaling.poll_interval_s",
           f"must be in (0, 60] seconds, got {s.poll_interval_s}")
    if q.load_in_4bit:
        _check(m.precision != "fp32" or s.use_gpu is not True, "quant.load_in_4bit",
               "4-bit on GPU needs a bf16/fp16 compute precision (model.precision), not fp32")

    r = cfg.run
    _check(bool(r.name) and "/" not in r.name and r.name not in (".", ".."), "run.name",
           f"must be a plain name (no '/'), got {r.name!r}")
    _check(bool(r.storage_path.strip()), "run.storage_path", "must not be empty")
    _check(r.max_failures >= -1, "run.max_failures", f"must be >= -1 (-1 = unlimited), got {r.max_failures}")
    _check(r.num_to_keep >= 1, "run.num_to_keep", f"must be >= 1, got {r.num_to_keep}")

    tr = cfg.tracking
    _check(tr.uri == "" or tr.uri.startswith(("sqlite:///", "http://", "https://", "databricks", "postgresql",
                                              "mysql")), "tracking.uri",
           f"expected sqlite:///..., http(s)://... or a database URI, got {tr.uri!r}")

    tu = cfg.tune
    _one_of("tune.search", tu.search, ("random", "grid", "optuna"))
    _one_of("tune.scheduler", tu.scheduler, ("asha", "none"))
    _one_of("tune.mode", tu.mode, ("min", "max"))
    _check(tu.num_samples >= 1, "tune.num_samples", f"must be >= 1, got {tu.num_samples}")
    _check(tu.time_budget_s >= 0, "tune.time_budget_s", f"must be >= 0, got {tu.time_budget_s}")
    _check(tu.grace_period >= 1, "tune.grace_period", f"must be >= 1, got {tu.grace_period}")
    _check(tu.max_concurrent_trials >= 0, "tune.max_concurrent_trials", "must be >= 0")
    for key, spec in tu.space.items():
        validate_space_entry(key, spec)

    _one_of("hardware.preset", cfg.hardware.preset, ("none", "auto", "a100", "h100", "h200", "4090", "3090", "t4",
                                                     "cpu"))


def validate_space_entry(key: str, spec: Any) -> None:
    """One `tune.space` entry: a config key (or one of SPACE_ONLY_KEYS) -> {kind: args}."""
    where = f"tune.space.{key}"
    if key in REMOVED_KEYS:
        raise ConfigError(f"{where}: '{key}' was removed: use {REMOVED_KEYS[key]}")
    tp = SPACE_ONLY_KEYS.get(key)
    if tp is None:
        try:
            tp = _leaf_type(key)
        except ConfigError:
            raise ConfigError(f"{where}: '{key}' is not a config key") from None
    _check(isinstance(spec, dict) and len(spec) == 1, where,
           f"expected one of {{{', '.join(TUNE_KINDS)}: ...}}, got {spec!r}")
    (kind, args), = spec.items()
    _check(kind in TUNE_KINDS, where, f"unknown kind {kind!r}, expected one of {', '.join(TUNE_KINDS)}")
    if kind in ("choice", "grid"):
        _check(isinstance(args, list) and len(args) >= 1, where, f"{kind} needs a non-empty list of values")
        for i, v in enumerate(args):
            if tp is dict:
                _check_arm(f"{where}[{i}]", v)
            else:
                _coerce(f"{where}[{i}]", v, tp)
    else:
        _check(isinstance(args, list) and len(args) == 2 and all(isinstance(a, (int, float)) for a in args),
               where, f"{kind} needs [low, high], got {args!r}")
        lo, hi = args
        _check(lo < hi, where, f"{kind} needs low < high, got {args!r}")
        if kind == "loguniform":
            _check(lo > 0, where, f"loguniform needs low > 0, got {args!r}")
        _check(tp in (int, float), where, f"{kind} needs a numeric key, {key} is {_type_name(tp)}")


def _check_arm(where: str, arm: Any) -> None:
    """One value of ``tune.space.arm``: a non-empty mapping of config keys (not scaling.*, no space-only key) to values
    of their types."""
    _check(isinstance(arm, dict) and len(arm) >= 1, where, f"an arm is a mapping {{config key: value}}, got {arm!r}")
    for k, v in arm.items():
        _check(k not in SPACE_ONLY_KEYS and not str(k).startswith("scaling."), where,
               f"an arm cannot set {k!r} (scaling.* and space-only keys are not per-arm)")
        try:
            tp = _leaf_type(k)
        except ConfigError:
            raise ConfigError(f"{where}: {k!r} is not a config key") from None
        _coerce(f"{where}.{k}", v, tp)


def sequences_per_step(cfg: Config, world: Optional[int] = None) -> int:
    """Sequences per optimizer step over all workers (``world``: the live world size; default scaling.num_workers)."""
    return cfg.data.batch_size * cfg.data.grad_accum * (cfg.scaling.num_workers if world is None else world)


def global_batch_tokens(cfg: Config, world: Optional[int] = None) -> int:
    """Tokens per optimizer step over all workers: the global batch."""
    return sequences_per_step(cfg, world) * cfg.data.block_size


if __name__ == "__main__":  # python -m raytrain_scu.config CONFIG.yaml key=value...: the CLI lives in config_io
    from raytrain_scu.config_io import main

    sys.exit(main())
