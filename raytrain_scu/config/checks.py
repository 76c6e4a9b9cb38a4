"""Cross-field checks of a built Config: each names the key at fault. Pure: no I/O, no heavy imports."""
from __future__ import annotations

import math
from typing import Any

from raytrain_scu.config.io import coerce, flatten, type_name
from raytrain_scu.config.schema import (
    ALL_LINEAR,
    FUSED_LORA_TARGETS,
    REMOVED_KEYS,
    SPACE_ONLY_KEYS,
    STRATEGIES,
    TUNE_KINDS,
    Config,
    ControllerConfig,
    leaf_type,
)
from raytrain_scu.config.secrets import refuse_credentials
from raytrain_scu.errors import ConfigError


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, f"expected one of {', '.join(allowed)}, got {value!r}")


def check_controller(c: ControllerConfig) -> None:
    """The controller's checks, the only copy: ``validate`` runs them on a config and ``SCUController`` on its keyword
    arguments (both raise ConfigError naming the key)."""
    _one_of("controller.mode", c.mode, ("scu", "fixed", "none"))
    _one_of("controller.law", c.law, ("spec", "logodds"))
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
    for key in ("logodds_kp", "logodds_ki"):
        _check(getattr(c, key) >= 0, f"controller.{key}", f"must be >= 0, got {getattr(c, key)}")
    _check(0.0 < c.logodds_data_alpha <= 1.0, "controller.logodds_data_alpha",
           f"must be in (0, 1], got {c.logodds_data_alpha}")
    for key in ("logodds_max_error", "logodds_max_step", "logodds_hold_error"):
        _check(getattr(c, key) > 0, f"controller.{key}", f"must be > 0, got {getattr(c, key)}")
    _check(c.bound_notice_steps >= 0, "controller.bound_notice_steps", f"must be >= 0, got {c.bound_notice_steps}")


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs


def validate(cfg: Config) -> None:
    """Cross-field checks. Pure: no I/O, no imports of heavy libraries."""
    # first: the other checks' messages repeat values, and a credential must be refused before any is repeated
    refuse_credentials(flatten(cfg, redact=False))
    check_controller(cfg.controller)
    _check_model_and_data(cfg)
    _check_fast_paths(cfg)
    _check_run(cfg)


def _check_fast_paths(cfg: Config) -> None:
    """The opt-in fast paths (CUDA graphs, the FP8 base and head, fused LoRA) against what they cannot run with."""
    m, q, lo = cfg.model, cfg.quant, cfg.lora
    # both replay the compiled code as CUDA graphs on a GPU; per layer, every decoder layer replays the same graph and
    # each replay overwrites the outputs the next layer still reads (a RuntimeError at once on an H200)
    _check(not (m.compile and m.compile_mode in CUDA_GRAPH_MODES and m.compile_scope == "layers"
                and cfg.scaling.use_gpu is not False), "model.compile_mode",
           f"{m.compile_mode} replays CUDA graphs, which needs model.compile_scope=model on a GPU (with layers each "
           f"layer's replay overwrites the previous layer's output); or use model.compile_mode=default / "
           f"max-autotune-no-cudagraphs, or scaling.use_gpu=false on a CPU")
    for bad, need in ((q.load_in_4bit, "an unquantised base, not quant.load_in_4bit=true"),
                      (m.fuse_lora, "model.fuse_lora=false (the fused GEMMs bypass the base Linears it converts)")):
        _check(not (m.base_fp8 and bad), "model.base_fp8", f"needs {need}")
    _check(m.base_fp8 or not m.fp8_exclude, "model.fp8_exclude",
           f"keeps projections out of model.base_fp8, which is off; set model.base_fp8=true or drop {m.fp8_exclude}")
    for bad, need in ((q.embedding_int8, "quant.embedding_int8=false (the int8 table is the head then)"),
                      (q.load_in_4bit, "an unquantised base, not quant.load_in_4bit=true (it would add to, not "
                                       "shrink, a QLoRA run's memory)")):
        _check(not (m.head_fp8 and bad), "model.head_fp8", f"needs {need}")
    gib = m.offload_activations_gib
    _check(gib == 0 or 2**-10 <= gib < math.inf, "model.offload_activations_gib",
           f"must be 0 or between 1/1024 (1 MiB, the smallest tensor that moves) and a finite size in GiB "
           f"(0 = every saved activation), got {gib}")
    _check(m.offload_activations or not m.offload_activations_gib, "model.offload_activations_gib",
           f"is a budget for model.offload_activations, which is off; set model.offload_activations=true or drop "
           f"model.offload_activations_gib={m.offload_activations_gib}")
    for bad, need in ((not m.gradient_checkpointing and not m.offload_activations_gib,
                       "model.gradient_checkpointing=true or a budget, model.offload_activations_gib > 0 (without "
                       "either every activation of the forward would cross to the host and back)"),
                      (m.compile and m.compile_scope == "model", "model.compile_scope=layers (its hooks are entered "
                                                                 "around the compiled layers, not inside one graph)"),
                      (cfg.scaling.use_gpu is False, "a GPU: it moves activations from GPU to host memory, and "
                                                     "scaling.use_gpu=false")):
        _check(not (m.offload_activations and bad), "model.offload_activations", f"needs {need}")
    if m.fuse_lora:  # what fused_lora.py fuses: plain LoRA on q/k/v and gate/up of an unquantised base
        covered = ALL_LINEAR if "all-linear" in lo.target_modules else lo.target_modules
        missing = [t for t in FUSED_LORA_TARGETS if t not in covered]
        for bad, need in ((q.load_in_4bit, "a bf16/fp16/fp32 base, not quant.load_in_4bit=true"),
                          (lo.dropout > 0, f"lora.dropout=0 (q/k/v share one A-product input), got {lo.dropout}"),
                          (missing, f"lora.target_modules to cover {FUSED_LORA_TARGETS}, missing {missing}")):
            _check(not bad, "model.fuse_lora", f"needs {need}")


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
    _one_of("model.recompute_elementwise", m.recompute_elementwise, ("auto", "always", "never"))
    _one_of("model.fp8_rounding", m.fp8_rounding, ("nearest", "gptq"))
    _check(m.fp8_calibration_blocks >= 1, "model.fp8_calibration_blocks",
           f"must be >= 1, got {m.fp8_calibration_blocks}")

    lo = cfg.lora
    _check(lo.r >= 1, "lora.r", f"must be >= 1, got {lo.r}")
    _check(lo.alpha > 0, "lora.alpha", f"must be > 0, got {lo.alpha}")
    _check(0.0 <= lo.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {lo.dropout}")
    _check(len(lo.target_modules) > 0, "lora.target_modules", "must name at least one module")

    q = cfg.quant
    _one_of("quant.quant_type", q.quant_type, ("nf4", "fp4"))
    _one_of("quant.dequant_4bit", q.dequant_4bit, ("auto", "bitsandbytes", "torch"))
    if q.dequant_4bit == "torch":
        _check(q.load_in_4bit, "quant.dequant_4bit", "torch dequantises a 4-bit base: needs quant.load_in_4bit=true")
        _check(q.quant_type == "nf4", "quant.dequant_4bit", f"torch reads nf4 codes, not quant.quant_type="
                                                            f"{q.quant_type}; set quant.dequant_4bit=bitsandbytes")

    d = cfg.data
    _one_of("data.source", d.source, ("shakespeare", "text", "jsonl", "hf_disk", "hf_hub", "auto", "chat",
                                      "prompt_completion", "shakespeare_chat"))
    _check(d.source in ("shakespeare", "shakespeare_chat") or bool(d.path), "data.path",
           f"must be set for data.source={d.source}")
    _one_of("data.format", d.format, ("auto", "text", "chat", "prompt_completion"))
    _one_of("data.train_on", d.train_on, ("answers", "all"))
    _one_of("data.too_long", d.too_long, ("truncate", "refuse"))
    _check(d.block_size >= 2, "data.block_size", f"must be >= 2, got {d.block_size}")
    _check(d.batch_size >= 1, "data.batch_size", f"must be >= 1, got {d.batch_size}")
    _check(d.grad_accum >= 1, "data.grad_accum", f"must be >= 1, got {d.grad_accum}")
    _check(0.0 < d.val_fraction < 1.0, "data.val_fraction", f"must be in (0, 1), got {d.val_fraction}")
    _check(d.max_documents >= 0, "data.max_documents", f"must be >= 0, got {d.max_documents}")
    _check(d.loader_workers >= 0, "data.loader_workers", f"must be >= 0, got {d.loader_workers}")
    _one_of("data.streaming", d.streaming, ("auto", "on", "off"))
    # at most 256 MiB: a shard is read, decoded and tokenised whole in one worker's memory
    _check(4096 <= d.shard_bytes <= 256 * 2**20, "data.shard_bytes",
           f"must be in [4096, 268435456] (4 KiB to 256 MiB), got {d.shard_bytes}")
    _check(d.streaming != "on" or d.max_documents == 0, "data.max_documents",
           f"must be 0 with data.streaming=on (a streamed source is read whole), got {d.max_documents}")

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
    t = cfg.train
    _check(t.max_steps >= 1, "train.max_steps", f"must be >= 1, got {t.max_steps}")
    _check(t.checkpoint_every >= 1, "train.checkpoint_every", f"must be >= 1, got {t.checkpoint_every}")
    _check(t.report_every >= 1, "train.report_every", f"must be >= 1, got {t.report_every}")
    _check(t.eval_every >= 1, "train.eval_every", f"must be >= 1, got {t.eval_every}")
    _check(t.eval_blocks >= 0, "train.eval_blocks", f"must be >= 0 (0 = the whole validation split), "
                                                     f"got {t.eval_blocks}")
    _check_profile(cfg)
    _check(t.hang_timeout_s is None or t.hang_timeout_s >= 0, "train.hang_timeout_s",
           f"must be >= 0 seconds (0 = off; unset = per device), got {t.hang_timeout_s}")
    _check(t.preempt_grace_s > 0 and math.isfinite(t.preempt_grace_s), "train.preempt_grace_s",
           f"must be > 0 seconds, got {t.preempt_grace_s}")
    _check(t.max_consecutive_skips >= 1, "train.max_consecutive_skips",
           f"must be >= 1, got {t.max_consecutive_skips}")
    _check(t.checkpoint_every % t.report_every == 0, "train.checkpoint_every",
           f"must be a multiple of train.report_every ({t.report_every}): checkpoints travel with reports, "
           f"got {t.checkpoint_every}")

    _check_scaling(cfg)

    r = cfg.run
    _check(bool(r.name) and "/" not in r.name and r.name not in (".", ".."), "run.name",
           f"must be a plain name (no '/'), got {r.name!r}")
    _check(bool(r.storage_path.strip()), "run.storage_path", "must not be empty")
    # a URI here would be taken for a local path (a directory named 's3:' under the working directory)
    _check("://" not in r.output_dir, "run.output_dir",
           f"must be a local path, not {r.output_dir!r}: for output on remote storage leave it empty and set "
           f"run.storage_path to the remote URI (the output goes to <storage_path>/<run.name>/output)")
    _check(r.max_failures >= -1, "run.max_failures", f"must be >= -1 (-1 = unlimited), got {r.max_failures}")
    _check(r.num_to_keep >= 1, "run.num_to_keep", f"must be >= 1, got {r.num_to_keep}")
    _one_of("run.primary_adapter", r.primary_adapter, ("best", "last"))

    _check_tracking(cfg)

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


def fsdp_untried(cfg: Config) -> list[str]:
    """The options set on ``cfg`` that fsdp has not been run with: scaling.strategy=fsdp refuses them by name rather
    than run them untried, and scaling.strategy=auto picks ddp beside them. Its 4-bit layers are nf4 dequantised by
    torch (core.nf4)."""
    m, q = cfg.model, cfg.quant
    four_bit = q.load_in_4bit
    return [k for k, on in (("model.fuse_lora", m.fuse_lora), ("model.base_fp8", m.base_fp8),
                            ("model.head_fp8", m.head_fp8), ("model.offload_activations", m.offload_activations),
                            ("quant.offload_embedding", q.offload_embedding),
                            (f"quant.quant_type={q.quant_type}", four_bit and q.quant_type != "nf4"),
                            ("quant.dequant_4bit=bitsandbytes", four_bit and q.dequant_4bit == "bitsandbytes")) if on]


def _check_scaling(cfg: Config) -> None:
    """scaling, and what 4-bit needs of it."""
    m, q = cfg.model, cfg.quant
    s = cfg.scaling
    _check(s.num_workers >= 1, "scaling.num_workers", f"must be >= 1, got {s.num_workers}")
    _check(s.cpus_per_worker > 0, "scaling.cpus_per_worker", f"must be > 0, got {s.cpus_per_worker}")
    _check(s.gpus_per_worker > 0, "scaling.gpus_per_worker", f"must be > 0, got {s.gpus_per_worker}")
    _one_of("scaling.placement_strategy", s.placement_strategy, ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    _one_of("scaling.strategy", s.strategy, STRATEGIES)
    if s.strategy == "fsdp" and q.load_in_4bit:  # fsdp's 4-bit layers are torch's nf4 (core.nf4)
        _check(q.quant_type == "nf4", "quant.quant_type", f"fsdp shards nf4 codes that torch dequantises, not "
               f"{q.quant_type}: set quant.quant_type=nf4 or scaling.strategy=ddp")
        _check(q.dequant_4bit != "bitsandbytes", "quant.dequant_4bit",
               "bitsandbytes' kernels do not run on fsdp's shards, which torch dequantises: set "
               "quant.dequant_4bit=auto (or torch), or scaling.strategy=ddp")
    if s.strategy == "fsdp":
        untried = fsdp_untried(cfg)
        _check(not untried, "scaling.strategy", f"fsdp is not built for {', '.join(untried)} yet: set "
               f"scaling.strategy=ddp, or turn {'it' if len(untried) == 1 else 'them'} off")
    _check(0 < s.poll_interval_s <= 60, "scaling.poll_interval_s",
           f"must be in (0, 60] seconds, got {s.poll_interval_s}")
    _check(s.collective_timeout_s > 0, "scaling.collective_timeout_s",
           f"must be > 0 seconds, got {s.collective_timeout_s}")
    if q.load_in_4bit:
        _check(m.precision != "fp32" or s.use_gpu is not True, "quant.load_in_4bit",
               "4-bit on GPU needs a bf16/fp16 compute precision (model.precision), not fp32")


def _check_profile(cfg: Config) -> None:
    """train.profile_steps and what it records."""
    t = cfg.train
    _check(t.profile_steps >= 0, "train.profile_steps", f"must be >= 0 (0 = off), got {t.profile_steps}")
    _check(not t.profile_steps or "://" not in cfg.run.storage_path, "train.profile_steps",
           f"writes its tables under the run directory, which must be a local path, not {cfg.run.storage_path!r}")
    _check(not t.profile_steps or t.profile_host or cfg.scaling.use_gpu is not False, "train.profile_host",
           "false records the GPU's kernels alone and needs a GPU, not scaling.use_gpu=false (a CPU run has only host "
           "operators)")


def _check_tracking(cfg: Config) -> None:
    """tracking.*: a URI MLflow accepts (not the refused file: store), the buffer's bound, and a tracking.uri for remote
    storage."""
    tr = cfg.tracking
    _check(tr.uri == "" or tr.uri.startswith(("sqlite:///", "http://", "https://", "databricks", "postgresql",
                                              "mysql")), "tracking.uri",
           f"expected sqlite:///..., http(s)://... or a database URI, got {tr.uri!r}")
    # the default store is a sqlite file beside the runs, which a bucket cannot hold
    _check(not tr.enabled or bool(tr.uri) or "://" not in cfg.run.storage_path, "tracking.uri",
           f"must be set (an MLflow server every node reaches, or a local sqlite:///... file) when run.storage_path "
           f"is remote ({cfg.run.storage_path!r}), or set tracking.enabled=false")
    _check(tr.buffer_max_points >= 1, "tracking.buffer_max_points", f"must be >= 1, got {tr.buffer_max_points}")


def validate_space_entry(key: str, spec: Any) -> None:
    """One `tune.space` entry: a config key (or one of SPACE_ONLY_KEYS) -> {kind: args}."""
    where = f"tune.space.{key}"
    if key in REMOVED_KEYS:
        raise ConfigError(f"{where}: '{key}' was removed: use {REMOVED_KEYS[key]}")
    tp = SPACE_ONLY_KEYS.get(key)
    if tp is None:
        try:
            tp = leaf_type(key)
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
                coerce(f"{where}[{i}]", v, tp)
    else:
        _check(isinstance(args, list) and len(args) == 2 and all(isinstance(a, (int, float)) for a in args),
               where, f"{kind} needs [low, high], got {args!r}")
        lo, hi = args
        _check(lo < hi, where, f"{kind} needs low < high, got {args!r}")
        if kind == "loguniform":
            _check(lo > 0, where, f"loguniform needs low > 0, got {args!r}")
        _check(tp in (int, float), where, f"{kind} needs a numeric key, {key} is {type_name(tp)}")


def _check_arm(where: str, arm: Any) -> None:
    """One value of ``tune.space.arm``: a non-empty mapping of config keys (not scaling.*, no space-only key) to values
    of their types."""
    _check(isinstance(arm, dict) and len(arm) >= 1, where, f"an arm is a mapping {{config key: value}}, got {arm!r}")
    for k, v in arm.items():
        _check(k not in SPACE_ONLY_KEYS and not str(k).startswith("scaling."), where,
               f"an arm cannot set {k!r} (scaling.* and space-only keys are not per-arm)")
        try:
            tp = leaf_type(k)
        except ConfigError:
            raise ConfigError(f"{where}: {k!r} is not a config key") from None
        coerce(f"{where}.{k}", v, tp)
