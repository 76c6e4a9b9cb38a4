"""A worker's setup, all ranks: device, data, model with adapters, optimizer, control law, tracker (:func:`build`),
then the checkpoint a restart resumes from (:func:`resume`)."""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Optional

import psutil
import torch

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config, data_options, sequences_per_step
from raytrain_scu.core import checkpoint as ckpt
from raytrain_scu.core import laws
from raytrain_scu.core.bounds import BoundWatch
from raytrain_scu.core.data.batches import calibration_batches
from raytrain_scu.core.data.cache import prepare_data
from raytrain_scu.core.dist import broadcast_params, notice0, rank, world_size
from raytrain_scu.core.embed_quant import offloaded_embedding
from raytrain_scu.core.fp8 import Fp8FrozenLinear, convert_base_to_fp8, convert_head_to_fp8
from raytrain_scu.core.fp8_gptq import convert_base_to_fp8_gptq
from raytrain_scu.core.fsdp import FullModel, shard
from raytrain_scu.core.fused_lora import fuse_lora_projections
from raytrain_scu.core.loss import CausalLMLoss, compile_for_training
from raytrain_scu.core.model.build import (
    apply_lora,
    build_model,
    keep_lora_inputs_in_autocast_dtype,
    resolve_dtype,
    structure_of,
)
from raytrain_scu.core.model.flops import flops_per_token
from raytrain_scu.core.model.source import default_cache_dir, load_tokenizer, model_config
from raytrain_scu.core.nf4 import convert_4bit_to_torch_dequant, torch_dequant
from raytrain_scu.core.offload import ActivationOffload
from raytrain_scu.core.regularizer import adapter_params, centers_fingerprint, initial_centers
from raytrain_scu.errors import CheckpointError, ModelError
from raytrain_scu.hardware.memory import GIB
from raytrain_scu.hardware.shape import whole_model_bytes
from raytrain_scu.tracking.tracker import for_rank
from raytrain_scu.worker.oom import Phase
from raytrain_scu.worker.state import Control, Metering, Optimisation, Position, Record, State


def _peft_model(cfg: Config, *, vocab_size: int, dtype, device):
    """The frozen base on ``device`` with LoRA adapters, seeded so every rank builds the same one. On the meta device
    the modules alone: scaling.strategy=fsdp materialises each rank's shards and fills them (core.fsdp.shard)."""
    m, q = cfg.model, cfg.quant
    # frozen base weights are stored in the compute dtype; LoRA adapters stay float32 (peft's default)
    base = build_model(m.name, gguf_file=m.gguf_file, vocab_size=vocab_size, dtype=dtype, device=device,
                       attn_implementation=m.attn_implementation, gradient_checkpointing=m.gradient_checkpointing,
                       load_in_4bit=q.load_in_4bit, quant_type=q.quant_type, double_quant=q.double_quant,
                       embedding_int8=q.embedding_int8, offload_embedding=q.offload_embedding, cache_dir=m.cache_dir,
                       trust_remote_code=m.trust_remote_code, seed=cfg.seed,
                       shardable_4bit=cfg.scaling.strategy == "fsdp")
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank
    model = apply_lora(base, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                       targets=cfg.lora.target_modules, quantized=q.load_in_4bit,
                       gradient_checkpointing=m.gradient_checkpointing)
    return base, model


def full_model(cfg: Config, *, vocab_size: int, dtype) -> Optional[FullModel]:
    """Under scaling.strategy=fsdp, on rank 0: the whole model as a ddp run on the CPU builds it (the base read from
    its source or, for a preset, initialised from the seed; then the seeded LoRA factors), on the host, to fill
    every rank's shards with; None elsewhere. The CPU generator is left as it was; CUDA's are reseeded (the seeded
    LoRA factors), and :func:`build` seeds every generator of each rank right after. A host with less memory
    available than the whole model needs is refused before the build (:func:`check_rank0_host`).

    A preset is drawn on the CPU here (core.model.build.preset_init_device, which the checkpoint's structure and the
    base recipe record), so its values are a CPU ddp run's; a GPU ddp run draws a preset on its device, from CUDA's
    generator (other numbers, the same distribution). A random-init shape larger than rank 0's host memory (the
    Llama-3.1-70B shape is ~131 GiB in bf16) would instead need each rank to initialise its own shards
    (transformers' ``_init_weights`` on the DTensors, the LoRA factors from the seed): values no ddp run reproduces,
    not built here."""
    if cfg.scaling.strategy != "fsdp" or rank() != 0:
        return None
    check_rank0_host(cfg, vocab_size=vocab_size, dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        _, model = _peft_model(cfg, vocab_size=vocab_size, dtype=dtype, device=torch.device("cpu"))
    return FullModel.of(model)


def check_rank0_host(cfg: Config, *, vocab_size: int, dtype) -> None:
    """fsdp's rank 0, before it builds the whole model on its host: :func:`check_host_memory` of the bytes the model
    needs there (:func:`~raytrain_scu.hardware.shape.whole_model_bytes`, in ``dtype``) and the host's available
    memory. A model whose shape the memory estimator does not read is built unchecked."""
    m = cfg.model
    hf_config = model_config(m.name, gguf_file=m.gguf_file, vocab_size=vocab_size, cache_dir=m.cache_dir,
                             trust_remote_code=m.trust_remote_code)
    needed = whole_model_bytes(cfg, hf_config, dtype_bytes=dtype.itemsize)
    if needed is not None:
        check_host_memory(needed, available_memory())


# a container's memory limit and use: cgroup v2, then v1 (a pod's limit, which the host's free memory does not show)
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_memory(cgroup_files=CGROUP_FILES) -> int:
    """The bytes this process can still allocate: the host's available memory, or less where this process's cgroup
    (a container, a Kubernetes pod) limits it to its limit minus its use. No limit ("max", or v1's huge number) and
    unreadable files leave the host's figure."""
    available = psutil.virtual_memory().available
    for limit_file, usage_file in cgroup_files:
        try:
            limit, usage = (Path(f).read_text().strip() for f in (limit_file, usage_file))
            return available if limit == "max" else min(available, max(int(limit) - int(usage), 0))
        except (OSError, ValueError):
            continue
    return available


def check_host_memory(needed_bytes: int, available_bytes: int) -> None:
    """Refuse (ModelError) to build fsdp's whole model on rank 0's host when it needs more bytes than the host has
    available: the build would be OOM-killed, after minutes of reading or drawing the weights."""
    if needed_bytes > available_bytes:
        raise ModelError(f"scaling.strategy=fsdp: rank 0 builds the whole model on its host, which needs "
                         f"~{needed_bytes / GIB:.1f} GiB of host memory, and rank 0's node has "
                         f"{available_bytes / GIB:.1f} GiB available; give the workers' nodes that much free "
                         f"memory (Ray Train may place rank 0 on any of them), or train a smaller model (model.name)")


def _model(cfg: Config, *, data, vocab_size: int, dtype, device):
    """The base model with LoRA adapters, fused and FP8 as configured, seeded so every rank builds the same one (GPTQ's
    calibration blocks are the same on every rank too). Under scaling.strategy=fsdp on the meta device, every rank."""
    m, q = cfg.model, cfg.quant
    on = torch.device("meta") if cfg.scaling.strategy == "fsdp" else device
    base, model = _peft_model(cfg, vocab_size=vocab_size, dtype=dtype, device=on)
    if q.load_in_4bit and torch_dequant(q.dequant_4bit, q.quant_type, m.compile):
        convert_4bit_to_torch_dequant(model, q.dequant_4bit)
    if m.fuse_lora:  # on the device already: the base weights become views into the fused ones, not copies
        fuse_lora_projections(model)
    if m.base_fp8 and m.fp8_rounding == "gptq":  # on the device already: the weights are quantised there, once
        batches = calibration_batches(data, blocks=m.fp8_calibration_blocks, batch_size=cfg.data.batch_size,
                                      seed=cfg.seed)
        convert_base_to_fp8_gptq(model, [ids.to(device) for ids in batches], exclude=m.fp8_exclude,
                                 cache=default_cache_dir(m.cache_dir) / "fp8_gptq")
        share_rank0_codes(model)
    elif m.base_fp8:
        convert_base_to_fp8(model, exclude=m.fp8_exclude)
    if m.head_fp8:
        convert_head_to_fp8(model)
    return base, model


def share_rank0_codes(model) -> None:
    """All ranks: rank 0's FP8 codes in every rank's frozen base, so every rank runs the same base whatever rounding
    its own arithmetic took (GPTQ's codes come from float sums that may differ in their last bits between devices)."""
    broadcast_params([m.fp8_weight for m in model.modules() if isinstance(m, Fp8FrozenLinear)])


def _optimisation(cfg: Config, hooks, model, *, device, dtype, full: Optional[FullModel]) -> Optimisation:
    """The loss module (compiled, placed by the hooks and, under scaling.strategy=fsdp, sharded and filled with rank
    0's ``full`` model), AdamW over the adapters, the fp16 scaler, autocast."""
    m, o = cfg.model, cfg.optim
    params = adapter_params(model)
    use_amp = device.type == "cuda" and dtype != torch.float32
    if use_amp:  # before compiling: the traced graph then has no float32 copy of each LoRA input
        keep_lora_inputs_in_autocast_dtype(model)
    loss_model = CausalLMLoss(model, fused=m.fused_loss, chunk_size=m.loss_chunk_size)
    if m.offload_activations:
        if device.type != "cuda":
            raise ModelError(f"model.offload_activations=true moves activations from GPU to host memory; this worker "
                             f"runs on {device.type}: set it false")
        if m.compile and not isinstance(getattr(loss_model.decoder(), "layers", None), torch.nn.ModuleList):
            raise ModelError("model.offload_activations=true: this model has no decoder layers list, so it would be "
                             "compiled whole with the hooks inside its graph; set it false or model.compile=false")
        budget = int(m.offload_activations_gib * 2**30) if m.offload_activations_gib else None
        # with a budget the bottom layers start coming back while as many bytes of layers above them are still to run
        loss_model.offload = ActivationOffload(model, budget_bytes=budget, ahead_bytes=budget or 0)
    if m.compile:
        loss_model = compile_for_training(loss_model, scope=m.compile_scope, mode=m.compile_mode)
    sharded = cfg.scaling.strategy == "fsdp"  # resolve() decided auto before launch; never resolved, it is ddp
    # a quantized model is placed by device_map and must never be moved with .to(); under fsdp it is on the meta
    # device until shard() materialises each rank's shards there
    loss_model = hooks.prepare_model(loss_model, move_to_device=not (cfg.quant.load_in_4bit or sharded))
    if sharded:  # each rank keeps its shard of rank 0's values; the parameters are new (DTensor) tensors
        loss_model = shard(loss_model, model, device=device, dtype=dtype, full=full)
        params = adapter_params(model)
    else:
        broadcast_params(params)  # all ranks start from rank 0's adapters (the seeded init makes them equal already)
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                                  fused=True)  # CUDA and CPU: it skips a step on the device (Optimisation.launch)
    # on the adapters' device, before a resume loads the checkpoint: the seeded build's initial A factors
    return Optimisation(model=model, params=params, loss_model=loss_model, optimizer=optimizer,
                        scaler=torch.amp.GradScaler(device.type, enabled=use_amp and dtype == torch.float16),
                        autocast=torch.autocast(device_type=device.type, dtype=dtype, enabled=use_amp),
                        centers=initial_centers(model), offloaded=offloaded_embedding(model), sharded=sharded)


def build(cfg: Config, hooks, run_id: Optional[str] = None, phase: Optional[Phase] = None) -> State:
    """All ranks: device, data, model with adapters, optimizer, control law, tracker (rank 0's is real). ``phase``: the
    loop's phase record (:class:`~raytrain_scu.worker.oom.Phase`), new by default."""
    m, d = cfg.model, cfg.data
    device = hooks.get_device()
    torch.manual_seed(cfg.seed + rank())
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dtype = resolve_dtype(m.precision, device)
    tok = load_tokenizer(m.name, m.gguf_file, m.tokenizer, m.cache_dir)
    data = prepare_data(tok, **data_options(cfg))
    base, model = _model(cfg, data=data, vocab_size=len(tok), dtype=dtype, device=device)
    full = full_model(cfg, vocab_size=len(tok), dtype=dtype)  # fsdp, rank 0: what fills the shards
    ckpt.seed_all(ckpt.rank_seed(cfg.seed, rank()))  # then each rank its own stream: distinct dropout masks
    opt = _optimisation(cfg, hooks, model, device=device, dtype=dtype, full=full)
    control = Control(law=laws.build(cfg.controller), every=cfg.controller.control_every,
                      tokens_per_epoch=cfg.controller.tokens_per_epoch or data.tokens_per_epoch,
                      bounds=BoundWatch(cfg.controller))
    # get_text_config: a nested text config too
    metering = Metering(meter=None, flops_per_token=flops_per_token(base.config.get_text_config(), d.block_size))
    structure = structure_of(cfg, use_gpu=device.type == "cuda")  # a preset's draw device among it
    return State(cfg=cfg, hooks=hooks, device=device, tracker=for_rank(cfg, rank(), run_id=run_id),
                 structure=structure, opt=opt, ctrl=control, rec=Record(), metering=metering,
                 pos=Position(data=data, seqs_per_step=sequences_per_step(cfg, world_size()), block_size=d.block_size),
                 stop_path=RunPaths.of(cfg).stop_flag, phase=phase or Phase())


def resume(s: State) -> None:
    """All ranks: rank 0 picks the checkpoint the hooks hand over, every rank loads that one; nothing on a fresh
    start."""
    c = s.cfg.controller
    with contextlib.ExitStack() as stack:
        opened = s.hooks.open_checkpoint(stack)  # a bad latest falls back to an older one
        if opened is None:
            return
        local, problems = opened
        saved = ckpt.read_meta(local)
        ckpt.check_structure(saved, s.structure)
        note = ckpt.check_tokens_per_epoch(saved, measured=s.pos.data.tokens_per_epoch, override=c.tokens_per_epoch,
                                           streamed=s.pos.data.streamed, plan=s.pos.data.plan)
        meta = ckpt.load_training_state(local, model=s.opt.model, optimizer=s.opt.optimizer, scaler=s.opt.scaler,
                                        rank=rank(), world_size=world_size())
    check_centers(s, meta.get("centers_sq"))
    s.ctrl.law.load_state_dict(meta["controller"])
    s.ctrl.restore(meta)
    s.rec.restore(meta, problems=problems)
    s.pos.position = meta["position"]
    s.opt.restore(meta)
    s.phase.first_step, s.phase.checkpoint_step = s.rec.start_step + 1, s.rec.start_step
    notice0(f"resumed at step {s.rec.start_step}"
            + (f" after skipping {len(problems)} bad checkpoint(s)" if problems else ""))
    if note:
        notice0(f"warning: {note}")
    if meta["rng_ranks"] != world_size():  # else each rank's RNG goes on where it stopped
        notice0(f"warning: the checkpoint holds the RNG state of {meta['rng_ranks']} rank(s), this "
                f"run has {world_size()}: dropout draws restart from a seed of (seed, rank, step "
                f"{s.rec.start_step}), so the run no longer matches an uninterrupted one")
        ckpt.seed_all(ckpt.rank_seed(s.cfg.seed, rank(), s.rec.start_step))


def check_centers(s: State, saved_sq: Optional[float]) -> None:
    """The initial A factors, rebuilt from the seed, must be the checkpoint's: under controller.prior_center=init they
    are the prior's centre (a refusal), otherwise only train/param_bpt_update's reference (a warning)."""
    now = centers_fingerprint(s.opt.centers)
    if saved_sq is None or math.isclose(now, saved_sq, rel_tol=1e-6):
        return
    what = (f"the initial adapter rebuilt from seed {s.cfg.seed} differs from the checkpoint's (Σw² of the A factors "
            f"{now:.9g}, saved {saved_sq:.9g}): another torch or peft initialises LoRA differently")
    if s.cfg.controller.prior_center == "init":
        raise CheckpointError(f"{what}; controller.prior_center=init centres the prior there, so the run cannot "
                              f"go on with the same loss. Resume with the torch/peft versions that started it")
    notice0(f"warning: {what}; train/param_bpt_update now measures from the new values")
