"""The config's dataclass tree: the only home of raytrain_scu's defaults, with each key's meaning beside it.

Loading (YAML, ``key=value`` overrides, the strict build) is :mod:`.io` and :mod:`.load`, the cross-field checks
:mod:`.checks`. Every module here is pure: no I/O at import or in validation, no heavy imports.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Optional

from raytrain_scu.errors import ConfigError

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
    # on a GPU: what the model's forward saves for the backward (each tensor of 1 MiB or more) in pinned host memory
    # until the backward, copied on a side stream (core/offload.py). With gradient_checkpointing: each layer's input
    # (the 8B shape at 2 x 2048 peaked 0.9 GiB lower on an H200); without it, offload_activations_gib is needed
    offload_activations: bool = False
    # at most this many GiB of them move, the first saved (the bottom layers'); 0 = all, which needs checkpointing.
    # The peak falls by about this much; the copies run beside the step and slow its GEMMs a little (measured on an
    # H200, 8B shape, 2 x 2048: 2 GiB takes 1.94 GiB off the peak at 1.3-1.7 % less speed; docs/log/benchmarks.md)
    offload_activations_gib: float = 0.0
    compile: bool = False  # torch.compile the model (what hardware presets pick on A100/H100/H200/4090)
    # torch.compile mode: default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs (the CUDA-graph
    # modes, reduce-overhead and max-autotune, need compile_scope=model on a GPU)
    compile_mode: str = "default"
    # layers: each decoder layer compiled alone, all sharing one compiled code (seconds); model: one graph (minutes)
    compile_scope: str = "layers"
    # under compile, the backward recomputes elementwise results (norm outputs, SiLU(gate)*up) instead of saving their
    # outputs (never a GEMM, attention or a custom kernel): auto | always | never. auto: on for every family but
    # Granite-4.0-H's Mamba hybrid, where it measured slower (core.model.families; docs/log/benchmarks.md, H100 A/Bs)
    recompute_elementwise: str = "auto"
    fused_loss: bool = True  # chunked linear + cross-entropy: logits are never materialised in fp32
    loss_chunk_size: int = 4096  # tokens per chunk of the fused loss
    fuse_lora: bool = False  # Llama: q/k/v, gate/up one frozen GEMM each + one of their LoRA A's (fused_lora.py)
    # LoRA-base GEMMs in FP8 e4m3, rowwise (fp8.py): CUDA >= 8.9; CPU: torch 2.13, not 2.11. Faster; on SmolLM2-135M
    # (with gptq codes) the run's own held-out BPT, through FP8, is 0.018 bits above bf16's, its adapters scored in
    # bf16 as good as bf16-trained ones (docs/log/benchmarks.md)
    base_fp8: bool = False
    # how base_fp8 picks each weight's e4m3 code: gptq (against the inputs of fp8_calibration_blocks training blocks,
    # so each layer's output moves least: about half nearest's held-out cost; same speed; calibrated once per model,
    # seed and card, then read from model.cache_dir: 45 s, then 3 s, for the 1B shape on an H200) | nearest
    fp8_rounding: str = "gptq"
    fp8_calibration_blocks: int = 32  # training blocks (seeded stream order) GPTQ calibrates on
    # adapted projections whose base stays bf16 under base_fp8: fnmatch patterns over their names in the base model,
    # e.g. model.layers.29.mlp.up_proj,model.layers.29.mlp.down_proj (SmolLM2's last up/down: -0.003 bits there)
    fp8_exclude: list[str] = field(default_factory=list)
    # the frozen LM head's two GEMMs in FP8 e4m3, rowwise (fp8.py), on base_fp8's devices. Faster, at a larger held-out
    # cost (with base_fp8: +0.09 bits, docs/log/benchmarks.md)
    head_fp8: bool = False
    trust_remote_code: bool = False  # allow a hub model's own Python code (transformers' trust_remote_code)
    # where converted GGUF models, tokenizers and GPTQ's FP8 codes are kept ("" = ~/.cache/raytrain_scu)
    cache_dir: str = ""


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
    # who dequantises the 4-bit weights: bitsandbytes (its kernels) | torch (torch ops that torch.compile fuses into
    # each layer's graph, core/nf4.py; nf4 only) | auto: torch for nf4 under model.compile, else bitsandbytes;
    # under scaling.strategy=fsdp torch always (its shards are core.nf4's ShardedNF4Linear)
    dequant_4bit: str = "auto"
    # the frozen token embedding and LM head (one table when tied) in int8, a scale per row: half their bf16 memory
    embedding_int8: bool = False
    offload_embedding: bool = False  # the input embedding in CPU memory, its rows copied per batch (untied models)


@dataclass
class DataConfig:
    # source: shakespeare | text (file, directory or glob) | jsonl | hf_disk | hf_hub | auto (from path) |
    # chat (jsonl of {"messages": [{"role", "content"}, ...]}) | prompt_completion (jsonl of {"prompt", "completion"})
    # | shakespeare_chat (the bundled plays' dialogue as conversations: a speech, then the reply)
    source: str = "shakespeare"
    path: str = ""  # file, directory or glob of the text/jsonl source; dataset name or directory for hf_*
    # what the source holds: text | chat | prompt_completion | auto (the source's kind; jsonl and hf_* by the first
    # record's fields: messages -> chat, prompt and completion -> prompt_completion, else text)
    format: str = "auto"
    text_field: str = "text"  # the field holding the text (jsonl and hf_* sources)
    max_documents: int = 0  # 0 = all documents (examples) of the source
    # conversations' template: a Jinja file or an inline template ("" = the tokenizer's own; one without is refused)
    chat_template: str = ""
    train_on: str = "answers"  # examples' target tokens: answers (assistant turns, completions) | all
    too_long: str = "truncate"  # an example beyond block_size + 1 tokens: truncate (counted in the run's first lines) | refuse
    # examples several to a row (each attending only to itself, positions restarting) | false: one a row, padded,
    # in length-grouped batches
    packing: bool = True
    block_size: int = 256  # tokens per training sequence
    batch_size: int = 8  # sequences per worker per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    val_fraction: float = 0.1  # share of documents held out for validation (split by document, seeded)
    cache_dir: str = ""  # token cache ("" = ~/.cache/raytrain_scu/tokens)
    # a text or jsonl source of text read in shards, each tokenised on first need into its own cache file
    # (core/data/stream.py), instead of tokenised whole before the first step: on | off | auto (on when its files hold
    # more than STREAM_ABOVE_BYTES and data.max_documents is 0). Streamed: one shard, picked by the seed, is the
    # validation split (data.val_fraction plays no part), each shard's blocks are shuffled within it, and
    # tokens_per_epoch (N) is estimated: the train shards' words x the validation shard's tokens per word
    streaming: str = "auto"
    shard_bytes: int = 4 * 2**20  # a streamed source's shard: this many bytes, cut at a blank line (text) or line end
    # background threads that tokenise a streamed source's next shards ahead of the training stream (the tokenizer
    # runs outside Python's lock); 0 = a shard is tokenised in the training step that first needs it
    loader_workers: int = 0


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
    # steps between checkpoints (and always at the end); every checkpoint is evaluated, and the best adapter
    # (run.primary_adapter=best) is chosen among them, so one at every evaluation makes it early stopping
    checkpoint_every: int = 10
    report_every: int = 10  # steps between reports to Ray (progress, tokens/s, MFU)
    eval_every: int = 10  # steps between held-out evaluations (study v3 evaluated every 10 of 200-300 steps)
    # validation blocks each eval scores, spread evenly over the split (0 or more than it has = the whole split):
    # one fixed set, the same whatever data.batch_size, data.grad_accum and scaling.num_workers are
    eval_blocks: int = 0
    max_consecutive_skips: int = 10  # skipped steps in a row before the run stops (fp16 scaler overflows never count)
    stop_on_saturation: bool = False  # end the run once λ has settled (ctrl/saturated_step)
    profile_steps: int = 0  # the last N steps under torch.profiler, each rank's table in <run dir>/profile/ (0 = off)
    # with profile_steps: record the host's operators too (the table by operator, what ended each idle stretch); they
    # slow the host enough that the device idles more than unprofiled. false (GPU only): the device's kernels alone,
    # whose idle stretches are close to an unprofiled step's
    profile_host: bool = True
    # seconds without a completed step before the driver kills the worker group, which Ray Train restarts from the
    # last checkpoint (within run.max_failures); null = per device (HANG_TIMEOUT_S: 300 on CPU, 1800 on GPU), 0 = off.
    # The clock of each worker group starts at its first completed step: loading, resuming, the first compile never
    # count
    hang_timeout_s: Optional[float] = None
    # seconds from a SIGTERM (to the driver, or to a worker's process) within which the run checkpoints the step in
    # flight: every rank finishes that step, rank 0 writes its checkpoint, then the driver exits 143 (its own SIGTERM)
    # or Ray Train restarts the worker group from it (a worker's). A re-run resumes there: at most the step in flight
    # is redone. Past it the driver exits 143 without waiting longer, and a worker waiting for Ray Train's restart
    # stops waiting. Ray's drain of a worker's node (a spot reclaim) runs to the drain's own deadline, not this one.
    # Kubernetes gives 30 s by default, a spot node's notice 30-120 s
    preempt_grace_s: float = 25.0


@dataclass
class ControllerConfig:
    # none (λ = 0) | fixed (λ = lambda_init) | scu (λ under the control law). none: with run.primary_adapter=best
    # this is early stopping, what study v3 found the best one-run choice across its plants; the grid-free SCU
    # target failed its pre-registered test on 2 of 3 plants (docs/ablation-v3.md, docs/scu.md)
    mode: str = "none"
    # the update law under scu (core.laws.LAWS): logodds (PI on ln λ, log-odds error; docs/control.md), the GPU
    # study v2's choice (docs/ablation-v2.md) | spec (SCU_SPEC.md, exact). Each reads its own gains (LAW_KEYS)
    law: str = "logodds"
    target_s: float = 0.01  # S*: the information ratio ParamBPT / (DataBPT + ParamBPT) to hold
    kp: float = 0.8  # spec law: proportional gain
    ki: float = 0.15  # spec law: integral gain
    ema_alpha: float = 0.1  # spec law: smoothing of S into Ŝ (Ŝ ← α·S + (1−α)·Ŝ)
    deadband: float = 0.002  # spec law: |Ŝ − S*| at or below this leaves λ unchanged
    leak: float = 0.995  # spec law: the integral decays by this factor each update
    integral_limit: float = 0.2  # spec law: the integral is clipped to ± this
    lambda_init: float = 1.0  # λ at the start (scu), or the fixed λ (fixed)
    lambda_min: float = 1e-4  # λ's lower bound under the SCU law
    lambda_max: float = 10.0  # λ's upper bound under the SCU law
    prior_sigma: float = 0.01  # σ of the Gaussian prior on the LoRA weights in ParamBPT
    prior_center: str = "zero"  # zero: the spec's law, Σw² | init: Σ(w − w_init)², the update (an option beside it)
    control_every: int = 1  # optimizer steps between controller updates
    saturation_window: int = 100  # updates over which λ must stay flat to count as settled
    saturation_rel_tol: float = 0.01  # max(λ)/min(λ) − 1 below this over the window = settled
    logodds_kp: float = 2.0  # logodds law: proportional gain on ln λ per unit of log-odds error
    logodds_ki: float = 0.2  # logodds law: integral gain per update at the peak learning rate (scaled by lr/peak)
    logodds_data_alpha: float = 0.1  # logodds law: EMA weight of DataBPT (ParamBPT is used unfiltered)
    logodds_max_error: float = 1.0  # logodds law: the log-odds error is clipped to ± this
    logodds_max_step: float = 0.25  # logodds law: ln λ moves by at most this per update
    logodds_hold_error: float = 1.0  # logodds law: beyond this log-odds error, no integration while it is closing
    # steps λ may sit at lambda_min or lambda_max (scu) before the console says which bound, since when, what it
    # means and what to try: once per stretch at a bound (0 = never)
    bound_notice_steps: int = 50
    # 0 = measured from the training split. A resume refuses a checkpoint whose tokens_per_epoch differs from the
    # measured one (changed data would rescale ParamBPT and S silently); set here, it wins over both.
    tokens_per_epoch: int = 0


# the keys only one law reads, by law (core.laws: each law's from_config reads its own and no other's): set or swept
# for a law that no run of a config uses, one changes nothing, and config.law_keys.check_law_keys refuses it
LAW_KEYS = {
    "spec": ("controller.kp", "controller.ki", "controller.ema_alpha", "controller.deadband", "controller.leak",
             "controller.integral_limit"),
    "logodds": ("controller.logodds_kp", "controller.logodds_ki", "controller.logodds_data_alpha",
                "controller.logodds_max_error", "controller.logodds_max_step", "controller.logodds_hold_error"),
}


STRATEGIES = ("ddp", "fsdp", "auto")  # scaling.strategy


@dataclass
class ScalingConfig:
    num_workers: int = 1  # Ray Train workers (one per GPU on a GPU cluster)
    use_gpu: Optional[bool] = None  # None = auto-detect
    cpus_per_worker: float = 1.0  # CPUs Ray reserves for each worker
    gpus_per_worker: float = 1.0  # GPUs Ray reserves for each worker
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (Ray placement group)
    # ddp: every worker holds the whole model, the adapters' gradients averaged | fsdp: FSDP2, the frozen base, the
    # adapters and their optimizer state sharded over the workers, one unit per decoder layer, the model built on the
    # meta device and filled from rank 0's host (no card holds it whole) | auto: fsdp where the memory estimator says
    # one replica does not fit the card, else ddp (a CPU run: ddp); see driver.resolve.choose_strategy. resolve()
    # decides it before launch, and a config never resolved (a test's own loop) runs ddp
    strategy: str = "auto"
    # how often Ray Train's controller polls the workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, Ray's default 2 s): a
    # worker holds one unconsumed report, so reports more often stall training to the next poll; checkpoints register
    poll_interval_s: float = 0.25
    # how long a collective (NCCL, gloo) waits for every rank before it fails the worker group (Ray Train's
    # TorchConfig.timeout_s): under fsdp the other ranks wait in rank 0's broadcast while rank 0 reads or draws the
    # whole model on its host, so a model that takes rank 0 longer than this to load needs more
    collective_timeout_s: float = 1800.0


@dataclass
class RunConfig:
    name: str = ""  # "" = the config file's stem
    # where run directories and the default MLflow store live (a path or s3:// / gs://)
    storage_path: str = "~/raytrain_scu_runs"
    max_failures: int = 3  # worker-group restarts Ray Train makes before the run fails
    num_to_keep: int = 2  # checkpoints kept: the best by their own step's held-out BPT, plus the latest
    # which checkpoint's adapter is the run's adapter (output/adapter, MLflow's "adapter", generate's): best (lowest
    # held-out BPT among the checkpoints: early stopping; the last step's goes to output/adapter_last when it is
    # another step) | last (the last step's; the best goes to output/adapter_best when it is another step)
    primary_adapter: str = "best"
    output_dir: str = ""  # "" = <storage_path>/<name>/output


@dataclass
class TrackingConfig:
    enabled: bool = True  # record the run in MLflow
    uri: str = ""  # "" = sqlite:///<storage_path>/mlflow.db
    experiment: str = ""  # "" = the config file's stem: one experiment per config, its runs side by side
    log_best_checkpoint: bool = True  # log the best checkpoint (lowest val/data_bpt) as an MLflow artifact
    system_metrics: Optional[bool] = None  # None = on for GPU runs
    # metric points rank 0 keeps on disk (<run dir>/mlflow_buffer.jsonl) until the store has them: a tracking server
    # that is down is caught up with when it is back; beyond this many the oldest are dropped, and counted
    buffer_max_points: int = 1_000_000


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


# train.hang_timeout_s when left None, by the workers' device. CPU: a step of the CPU configs here takes well under
# a second to a few seconds, an evaluation or a checkpoint seconds, so 5 minutes of silence is a hang, and a hung
# test run is noticed in minutes. GPU: 30 minutes covers a recompile for a new shape (an evaluation, a longer
# block), a long evaluation and a checkpoint upload to object storage; the first step's compile does not count.
HANG_TIMEOUT_S = {"cpu": 300.0, "gpu": 1800.0}
# where derived data (converted models, tokenizers, token blocks) and a remote run's machine-local state live;
# RAYTRAIN_SCU_CACHE overrides it
CACHE_DIR = "~/.cache/raytrain_scu"
# data.streaming=auto streams a text source larger than this: tokenised whole at the ~1-2.5 MB/s a BPE tokenizer
# manages on one CPU it would keep the first step minutes away, and its documents (Python strings) and token ids
# (Python ints) would take several times its size in memory
STREAM_ABOVE_BYTES = 256 * 2**20

TUNE_KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
# tune.space keys that are not config keys (sweep_space.apply_params maps them): global_batch_tokens, tokens per
# optimizer step (the optimisation knob); a trial's data.grad_accum = it / (batch_size x num_workers x block_size)
# arm: bundles {config key: value} set together, so unlike trials (the ablation's arms) run as one grid
GLOBAL_BATCH = "global_batch_tokens"  # the space key of the global batch, in tokens per step
ARM = "arm"  # the space key of a bundle of config values set together
SPACE_ONLY_KEYS = {GLOBAL_BATCH: int, ARM: dict}


def check_not_removed(key: str) -> None:
    """A key that no longer exists: an error naming what replaces it."""
    if key in REMOVED_KEYS:
        raise ConfigError(f"config key '{key}' was removed: use {REMOVED_KEYS[key]}")


def leaf_type(key: str):
    """The annotation of a dotted key, or ConfigError for an unknown (or removed) key."""
    check_not_removed(key)
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


# ---------------------------------------------------------------- values derived from the tree

def sequences_per_step(cfg: Config, world: Optional[int] = None) -> int:
    """Sequences per optimizer step over all workers (``world``: the live world size; default scaling.num_workers)."""
    return cfg.data.batch_size * cfg.data.grad_accum * (cfg.scaling.num_workers if world is None else world)


def global_batch_tokens(cfg: Config, world: Optional[int] = None) -> int:
    """Tokens per optimizer step over all workers: the global batch."""
    return sequences_per_step(cfg, world) * cfg.data.block_size


def data_options(cfg: Config) -> dict:
    """``prepare_data``'s keyword arguments (all but the tokenizer): the data section, the seed."""
    d = cfg.data
    return {"source": d.source, "path": d.path, "text_field": d.text_field, "max_documents": d.max_documents,
            "block_size": d.block_size, "val_fraction": d.val_fraction, "seed": cfg.seed, "cache_dir": d.cache_dir,
            "fmt": d.format, "chat_template": d.chat_template, "train_on": d.train_on, "too_long": d.too_long,
            "packing": d.packing, "streaming": d.streaming, "shard_bytes": d.shard_bytes,
            "loader_workers": d.loader_workers}


def hang_timeout_s(cfg: Config, *, use_gpu: bool) -> float:
    """``train.hang_timeout_s``, or its per-device default (:data:`HANG_TIMEOUT_S`); 0 = no hang watchdog."""
    t = cfg.train.hang_timeout_s
    return HANG_TIMEOUT_S["gpu" if use_gpu else "cpu"] if t is None else t
