"""The per-worker training function (nanoGPT-style): :func:`setup`, then one flat loop of :func:`train_step` and
:func:`after_step`. Ray is not imported here: the few calls into Ray Train are the ``hooks`` (``launch.RayHooks``, or
:class:`LocalHooks` in one bare process), and so is fault injection (``hooks.faults``)."""
from __future__ import annotations

import contextlib
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from raytrain_scu import tracking
from raytrain_scu.config import Config, RunPaths, sequences_per_step, to_yaml
from raytrain_scu.console import NOTICES, take_notices
from raytrain_scu.core import checkpoint as ckpt
from raytrain_scu.core.controller import from_config as build_controller
from raytrain_scu.core.data import prepare_data, train_batch, val_batches
from raytrain_scu.core.dist import (
    all_gather_object,
    all_reduce_sum,
    average_gradients,
    barrier,
    broadcast_params,
    notice0,
    print0,
    rank,
    world_size,
)
from raytrain_scu.core.fp8 import convert_base_to_fp8
from raytrain_scu.core.fused_lora import fuse_lora_projections
from raytrain_scu.core.loss import CausalLMLoss, compile_for_training
from raytrain_scu.core.model import (
    apply_lora,
    build_model,
    flops_per_token,
    load_tokenizer,
    resolve_dtype,
    structure_of,
)
from raytrain_scu.core.regularizer import (
    adapter_params,
    centers_fingerprint,
    initial_centers,
    lora_b_norm,
    param_bpt,
    param_bpt_parts,
)
from raytrain_scu.errors import NonFiniteError, NotLearningError
from raytrain_scu.hardware.gpus import mfu, peak_flops
from raytrain_scu.worker.faults import Faults
from raytrain_scu.worker.profiling import profiled

LN2 = math.log(2.0)


def step_outcome(data_bpt: float, param_bpt: float, grad_norm: float, *, loss_scaling: bool) -> str:
    """What becomes of one optimizer step, from its global DataBPT, ParamBPT and (unscaled) gradient norm.

    ``"skipped"``: a non-finite loss, or non-finite gradients with no loss scaling to recover from them; no
    optimizer step, counted in train/skipped_steps and toward train.max_consecutive_skips. ``"overflow"``: under
    fp16 loss scaling, a finite loss with inf/NaN gradients, the ordinary way GradScaler finds its scale too high;
    it skips the step and lowers the scale, counted apart in train/scaler_overflows, never as a failure.
    ``"ok"``: the optimizer steps.
    """
    if not (math.isfinite(data_bpt) and math.isfinite(param_bpt)):
        return "skipped"
    if math.isfinite(grad_norm):
        return "ok"
    return "overflow" if loss_scaling else "skipped"


def optimizer_step(optimizer, scaler, *, data_bpt: float, param_bpt: float, grad_norm: float) -> str:
    """Step (or skip) after ``scaler.unscale_(optimizer)``, update the scaler, zero the gradients; returns
    :func:`step_outcome`."""
    outcome = step_outcome(data_bpt, param_bpt, grad_norm, loss_scaling=scaler.is_enabled())
    if outcome != "skipped":
        scaler.step(optimizer)  # on an "overflow" GradScaler skips the step by itself
    # unscale_ recorded whether the gradients were finite: the scale backs off after inf/NaN gradients even when we
    # skipped the step ourselves, and the scaler is ready for the next unscale_
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return outcome


def device_peak_flops(device) -> float:
    """The card's dense bf16 peak FLOP/s (hardware.PEAK_BF16_FLOPS); 0 on a CPU or a card not in the table."""
    return peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else 0.0


def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(loss_model, data, *, device, batch_size: int, max_blocks: int, autocast) -> float:
    """Held-out DataBPT of one fixed set of validation blocks (``max_blocks``, 0 = all; see ``val_block_indices``),
    token-weighted over all ranks: the same number for any ``batch_size`` and world size, up to float noise (every
    rank runs the same number of batches)."""
    loss_model.eval()
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in val_batches(data, rank=rank(), world_size=world_size(), batch_size=batch_size,
                            max_blocks=max_blocks):
        with autocast:
            nats, n = loss_model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        stats += torch.stack([nats.double(), n.double()])
    loss_model.train()
    nats, n = all_reduce_sum(stats).tolist()
    return nats / n / LN2 if n > 0 else float("nan")


class LocalHooks:
    """One process, no Ray: the same loop, for benchmarks (Ray overhead) and debugging. Reports are kept; there is
    no checkpoint to resume from."""

    def __init__(self, device=None):
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.reports: list[dict] = []
        self.faults = Faults.from_env()

    def get_device(self):
        return self.device

    def open_checkpoint(self, stack):
        return None

    def prepare_model(self, model, move_to_device: bool):
        return model.to(self.device) if move_to_device else model

    def report(self, metrics: dict, checkpoint_dir, checkpoint_dir_name):
        self.reports.append(dict(metrics))


class Meter:
    """Training throughput between reports (evals excluded) and how long each report blocked the loop."""

    def __init__(self, device, tokens_per_step: int, poll_interval_s: float):
        self.device, self.tokens_per_step, self.poll_interval_s = device, tokens_per_step, poll_interval_s
        self.t_last, self.steps, self.interval, self.report_wait, self.warned = time.perf_counter(), 0, 0.0, 0.0, False
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def excluded(self):
        """Time spent inside (an eval) does not count as training time."""
        t0 = time.perf_counter()
        yield
        self.t_last += time.perf_counter() - t0

    def lap(self) -> float:
        """Tokens/s over all ranks since the last lap; starts the next one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.interval, self.t_last = now - self.t_last, now
        tokens_per_s, self.steps = self.tokens_per_step * self.steps / self.interval, 0
        return tokens_per_s

    def max_mem_gib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0

    @contextlib.contextmanager
    def reporting(self, warn: bool):
        """Time a report; with ``warn``, say once when it blocked training for long (Ray's poll is too slow)."""
        t0 = time.perf_counter()
        yield
        self.report_wait = time.perf_counter() - t0
        if warn and not self.warned and self.report_wait > max(0.05, 0.1 * self.interval):
            self.warned = True
            notice0(f"warning: reporting to Ray blocked training for {self.report_wait:.2f} s after a "
                    f"{self.interval:.2f} s interval: reports come faster than Ray's controller takes them (every "
                    f"scaling.poll_interval_s={self.poll_interval_s} s). Raise train.report_every or lower "
                    f"scaling.poll_interval_s.")


@dataclass
class State:
    """What one worker's loop carries from step to step."""

    cfg: Config
    hooks: object
    device: torch.device
    autocast: object
    data: object
    model: object  # the peft model: adapters, save_pretrained
    params: list  # its trainable (adapter) parameters
    loss_model: object  # the loss module (compiled, on the device), as the hooks prepared it
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    controller: object
    tracker: object
    structure: dict
    tokens_per_epoch: int
    seqs_per_step: int  # sequences per optimizer step, over all ranks
    flops_per_token: float  # of the frozen base, for perf/mfu
    peak_flops: float = 0.0  # the card's dense bf16 peak; 0: unknown, no perf/mfu
    meter: Meter = None
    history: list = field(default_factory=list)
    start_step: int = 0
    fresh: bool = True  # no checkpoint to resume from (fault injection acts on fresh starts only)
    position: int = 0
    val_bpt: float = float("nan")
    best_val: float = float("inf")
    val_bpt_start: float = float("nan")
    resumed_at: list = field(default_factory=list)
    centers: list = field(default_factory=list)  # per adapter tensor: its initial value (A), or None (B, from 0)
    skipped_total: int = 0
    skipped_in_a_row: int = 0
    overflows_total: int = 0
    ckpt_suffix: str = ""
    stop_path: Optional[Path] = None  # rank 0 stops the run (all ranks, after a checkpoint) when this file exists
    stopping: bool = False


def build(cfg: Config, hooks, run_id=None) -> State:
    """All ranks: device, data, model with adapters, optimizer, controller, tracker (rank 0's is real)."""
    m, d, q = cfg.model, cfg.data, cfg.quant
    device = hooks.get_device()
    torch.manual_seed(cfg.seed + rank())
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dtype = resolve_dtype(m.precision, device)
    use_amp = device.type == "cuda" and dtype != torch.float32
    tok = load_tokenizer(m.name, m.gguf_file, m.tokenizer, m.cache_dir)
    data = prepare_data(tok, source=d.source, path=d.path, text_field=d.text_field, max_documents=d.max_documents,
                        block_size=d.block_size, val_fraction=d.val_fraction, seed=cfg.seed, cache_dir=d.cache_dir)
    # frozen base weights are stored in the compute dtype; LoRA adapters stay float32 (peft's default)
    base = build_model(m.name, gguf_file=m.gguf_file, vocab_size=len(tok), dtype=dtype, device=device,
                       attn_implementation=m.attn_implementation, gradient_checkpointing=m.gradient_checkpointing,
                       load_in_4bit=q.load_in_4bit, quant_type=q.quant_type, double_quant=q.double_quant,
                       embedding_int8=q.embedding_int8, offload_embedding=q.offload_embedding, cache_dir=m.cache_dir,
                       trust_remote_code=m.trust_remote_code, seed=cfg.seed)
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank
    model = apply_lora(base, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                       targets=cfg.lora.target_modules, quantized=q.load_in_4bit,
                       gradient_checkpointing=m.gradient_checkpointing)
    if m.fuse_lora:  # on the device already: the base weights become views into the fused ones, not copies
        fuse_lora_projections(model)
    if m.base_fp8:  # on the device already: the weights are quantised there, once
        convert_base_to_fp8(model)
    ckpt.seed_all(ckpt.rank_seed(cfg.seed, rank()))  # then each rank its own stream: distinct dropout masks
    params = adapter_params(model)
    loss_model = CausalLMLoss(model, fused=m.fused_loss, chunk_size=m.loss_chunk_size)
    if m.compile:
        loss_model = compile_for_training(loss_model, scope=m.compile_scope, mode=m.compile_mode)
    # a quantized model is placed by device_map and must never be moved with .to()
    loss_model = hooks.prepare_model(loss_model, move_to_device=not q.load_in_4bit)
    broadcast_params(params)  # all ranks start from rank 0's adapters (the seeded init makes them equal already)
    # on the adapters' device, before a resume loads the checkpoint: the seeded build's initial A factors
    centers = initial_centers(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
                                  fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=use_amp and dtype == torch.float16)
    return State(cfg=cfg, hooks=hooks, device=device, data=data, model=model, params=params, loss_model=loss_model,
                 autocast=torch.autocast(device_type=device.type, dtype=dtype, enabled=use_amp),
                 optimizer=optimizer, scaler=scaler, controller=build_controller(cfg.controller), centers=centers,
                 tracker=tracking.for_rank(cfg, rank(), run_id=run_id), structure=structure_of(cfg),
                 tokens_per_epoch=cfg.controller.tokens_per_epoch or data.tokens_per_epoch,
                 seqs_per_step=sequences_per_step(cfg, world_size()),
                 # get_text_config: a nested text config too
                 flops_per_token=flops_per_token(base.config.get_text_config(), d.block_size))


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
        note = ckpt.check_tokens_per_epoch(saved, measured=s.data.tokens_per_epoch, override=c.tokens_per_epoch)
        meta = ckpt.load_training_state(local, model=s.model, optimizer=s.optimizer, scaler=s.scaler, rank=rank(),
                                        world_size=world_size())
    check_centers(s, meta.get("centers_sq"))
    s.fresh = False
    s.controller.load_state_dict(meta["controller"])
    s.start_step, s.position, s.history = meta["step"], meta["position"], meta["history"]
    s.val_bpt, s.best_val = meta.get("val_bpt", float("nan")), meta.get("best_val", float("inf"))
    s.resumed_at = meta.get("resumed_at", []) + [s.start_step]
    s.skipped_total, s.skipped_in_a_row = meta.get("skipped_steps", 0), meta.get("skipped_in_a_row", 0)
    s.overflows_total = meta.get("scaler_overflows", 0)
    # after a fallback, never reuse the name of a skipped bad checkpoint: Ray still lists it
    s.ckpt_suffix = f"_from{s.start_step:08d}" if problems else ""
    notice0(f"resumed at step {s.start_step}"
            + (f" after skipping {len(problems)} bad checkpoint(s)" if problems else ""))
    if note:
        notice0(f"warning: {note}")
    if meta["rng_ranks"] != world_size():  # else each rank's RNG goes on where it stopped
        notice0(f"warning: the checkpoint holds the RNG state of {meta['rng_ranks']} rank(s), this "
                f"run has {world_size()}: dropout draws restart from a seed of (seed, rank, step {s.start_step}), "
                f"so the run no longer matches an uninterrupted one")
        ckpt.seed_all(ckpt.rank_seed(s.cfg.seed, rank(), s.start_step))


def check_centers(s: State, saved_sq: Optional[float]) -> None:
    """The initial A factors, rebuilt from the seed, must be the checkpoint's: under controller.prior_center=init they
    are the prior's centre (a refusal), otherwise only train/param_bpt_update's reference (a warning)."""
    now = centers_fingerprint(s.centers)
    if saved_sq is None or math.isclose(now, saved_sq, rel_tol=1e-6):
        return
    what = (f"the initial adapter rebuilt from seed {s.cfg.seed} differs from the checkpoint's (Σw² of the A factors "
            f"{now:.9g}, saved {saved_sq:.9g}): another torch or peft initialises LoRA differently")
    if s.cfg.controller.prior_center == "init":
        raise ckpt.CheckpointError(f"{what}; controller.prior_center=init centres the prior there, so the run cannot "
                                   f"go on with the same loss. Resume with the torch/peft versions that started it")
    notice0(f"warning: {what}; train/param_bpt_update now measures from the new values")


def evaluate_now(s: State) -> float:
    """All ranks: the held-out DataBPT of the fixed validation blocks."""
    return evaluate(s.loss_model, s.data, device=s.device, batch_size=s.cfg.data.batch_size,
                    max_blocks=s.cfg.train.eval_blocks, autocast=s.autocast)


def setup(cfg: Config, hooks, run_id=None) -> State:
    """All ranks: build, resume, start tracking, and (on a fresh start) the untrained adapter's held-out BPT."""
    s = build(cfg, hooks, run_id)
    resume(s)
    s.tracker.start(params=tracking.derived_params(cfg, tokens_per_epoch=s.tokens_per_epoch, world=world_size(),
                                                   device=s.device), resumed_at=s.start_step)
    if s.start_step == 0:  # the baseline every later eval is compared with
        s.val_bpt = evaluate_now(s)
        s.history.append({"step": 0, "val/data_bpt": s.val_bpt, "ctrl/lambda": s.controller.lam})
        s.tracker.log_step(s.history[-1])
    s.val_bpt_start = s.history[0]["val/data_bpt"] if s.history and s.history[0]["step"] == 0 else float("nan")
    s.meter = Meter(s.device, s.seqs_per_step * cfg.data.block_size, cfg.scaling.poll_interval_s)
    s.peak_flops = device_peak_flops(s.device)
    s.stop_path = RunPaths.of(cfg).stop_flag
    if s.peak_flops == 0:
        text = (f"perf/mfu is not logged: no dense bf16 peak FLOP/s is known for "
                f"{torch.cuda.get_device_name(s.device) if s.device.type == 'cuda' else s.device.type} "
                f"(hardware.PEAK_BF16_FLOPS)")
        if s.device.type == "cuda":  # a GPU missing from the table: said on the console
            notice0(text)
        else:  # a CPU has no MFU to miss: its log file only
            print0(f"[raytrain_scu] {text}")
    return s


def micro_steps(s: State, step: int, lam: float):
    """All ranks: forward and backward over ``data.grad_accum`` micro-batches; returns this rank's summed nats and
    tokens, and ParamBPT (its gradient enters once, on the last micro-step)."""
    d, c = s.cfg.data, s.cfg.controller
    nats_sum = torch.zeros((), dtype=torch.float32, device=s.device)
    tokens = torch.zeros((), dtype=torch.float32, device=s.device)
    for micro in range(d.grad_accum):
        x, y = train_batch(s.data, position=s.position, micro_step=micro, rank=rank(), world_size=world_size(),
                           batch_size=d.batch_size, seed=s.cfg.seed, pin_memory=s.device.type == "cuda")
        x, y = x.to(s.device, non_blocking=True), y.to(s.device, non_blocking=True)
        last = micro == d.grad_accum - 1
        with s.autocast:
            nats, n = s.loss_model(x, y)
            nats = s.hooks.faults.poison(step + 1, nats)
            loss = nats / n / d.grad_accum
            if last:  # the penalty's gradient enters once per optimizer step, with full weight
                pbpt = param_bpt(s.params, sigma=c.prior_sigma, tokens_per_epoch=s.tokens_per_epoch,
                                 center=s.centers if c.prior_center == "init" else None)
                loss = loss + lam * LN2 * pbpt
        s.scaler.scale(loss).backward()
        nats_sum += nats.detach().float()
        tokens += n.float()
    return nats_sum, tokens, pbpt


def train_step(s: State, step: int) -> dict:
    """All ranks: lr, the micro-steps, one all-reduce, one host sync, the optimizer step (or a counted skip), the
    controller update. Returns the step's row."""
    cfg, t = s.cfg, s.cfg.train
    lr = lr_at(step, lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps, max_steps=t.max_steps,
               min_lr_ratio=cfg.optim.min_lr_ratio)
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    lam = s.controller.lam  # constant within the step: the last controller update's value
    nats_sum, tokens, pbpt = micro_steps(s, step, lam)
    s.position += s.seqs_per_step
    average_gradients(s.params)  # all ranks: one all-reduce of the adapters' gradients, their data-parallel mean

    # one all-reduce of (nats, tokens): DataBPT is global and identical on every rank
    s.scaler.unscale_(s.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(s.params, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 1e30)
    # rank 0's third element: a stop was asked for (Ctrl-C), so every rank agrees without another collective
    # (a fill on the device, not torch.tensor(): a host->device copy from pageable memory would sync mid-step)
    stop = tokens.new_full((), float(rank() == 0 and s.stop_path is not None and s.stop_path.exists()))
    stats = all_reduce_sum(torch.stack([nats_sum, tokens, stop]))
    # the one host sync per optimizer step: the controller needs these as floats
    parts = param_bpt_parts(s.params, s.centers, sigma=cfg.controller.prior_sigma,
                            tokens_per_epoch=s.tokens_per_epoch)  # telemetry: ParamBPT's A and B parts, the update's
    nats_f, tokens_f, stop_f, pbpt_f, norm_f, pa_f, pb_f, pu_f = torch.cat(
        [stats, pbpt.detach().float().reshape(1), grad_norm.float().reshape(1), parts]).tolist()
    s.stopping = stop_f > 0
    data_bpt = nats_f / tokens_f / LN2
    outcome = optimizer_step(s.optimizer, s.scaler, data_bpt=data_bpt, param_bpt=pbpt_f, grad_norm=norm_f)
    s.skipped_in_a_row = s.skipped_in_a_row + 1 if outcome == "skipped" else 0
    s.skipped_total += outcome == "skipped"
    s.overflows_total += outcome == "overflow"  # fp16 only: GradScaler's own skip, not a failure
    if s.skipped_in_a_row >= t.max_consecutive_skips:
        s.tracker.finish(history=s.history, status="FAILED")
        barrier()  # all ranks: rank 0's final MLflow flush lands before any rank raises and Ray stops the group
        raise NonFiniteError(f"{s.skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                             f"(last at step {step + 1}); the last good checkpoint is kept. Lower optim.lr, "
                             f"use bf16 instead of fp16, or check the data.")
    ctrl = s.controller
    if (step + 1) % cfg.controller.control_every == 0:  # a non-finite loss: counted in ctrl/skipped, nothing else
        ctrl.update(data_bpt, pbpt_f, step=step + 1)
    s.meter.steps += 1
    row = {"step": step + 1, "train/data_bpt": data_bpt, "train/param_bpt": pbpt_f, "ctrl/s": ctrl.s,
           "ctrl/s_hat": ctrl.s_hat, "ctrl/error": ctrl.error, "ctrl/lambda": ctrl.lam,
           "ctrl/integral": ctrl.integral, "ctrl/skipped": ctrl.n_skipped,
           "train/skipped_steps": s.skipped_total, "train/scaler_overflows": s.overflows_total, "train/lr": lr,
           "train/grad_norm": norm_f, "ctrl/lambda_applied": lam, "train/param_bpt_a": pa_f,
           "train/param_bpt_b": pb_f, "train/param_bpt_update": pu_f}
    s.hooks.faults.after_step(step + 1, fresh=s.fresh)
    if ctrl.saturated_step is not None:
        row["ctrl/saturated_step"] = ctrl.saturated_step
    return row


def perf_metrics(s: State, step: int) -> dict:
    """At a report (all ranks): throughput, memory, the adapters' norm, MFU where the card's peak is known. Refuses
    to report a loop whose LoRA B matrices never left zero."""
    tokens_per_s = s.meter.lap()
    b_norm = lora_b_norm(s.model).item()
    if b_norm == 0.0 and step + 1 - s.start_step > s.skipped_total:
        # B starts at zero and any data gradient moves it at the first step (a silent no-op loop once did exactly
        # this under torch.compile on CUDA): refuse to report a run that trains nothing
        m = s.cfg.model
        raise NotLearningError(f"after {step + 1 - s.start_step} optimizer step(s) every LoRA B matrix is still "
                               f"exactly zero: no gradient reached the adapters (model.compile={m.compile}, "
                               f"model.fused_loss={m.fused_loss}, model.precision={m.precision})")
    perf = {"perf/tokens_per_s": tokens_per_s, "train/lora_b_norm": b_norm, "perf/max_mem_gib": s.meter.max_mem_gib(),
            "perf/report_wait_s": s.meter.report_wait}  # time the previous report (and checkpoint) took
    # perf/mfu as docs/benchmarks.md defines it: tokens/s per GPU x FLOPs/token of the frozen base / the card's peak
    util = mfu(tokens_per_s / world_size(), s.flops_per_token, s.peak_flops)
    if util is not None:  # no peak for this device: perf/mfu is left out (said once in setup)
        perf["perf/mfu"] = util
    return perf


def save_checkpoint(s: State, step: int, rng_states: list):
    """Rank 0: write the checkpoint of step ``step + 1`` to a fresh local directory; returns that directory."""
    local = ckpt.new_local_dir()
    ckpt.write_checkpoint(local / "ckpt", model=s.model, optimizer=s.optimizer, scaler=s.scaler,
                          controller_state=s.controller.state_dict(), step=step + 1, position=s.position,
                          structure=s.structure, tokens_per_epoch=s.tokens_per_epoch,
                          config_yaml=to_yaml(s.cfg, redact=True), history=s.history, rng_states=rng_states,
                          extra={"val_bpt": s.val_bpt, "best_val": s.best_val, "resumed_at": s.resumed_at,
                                 "skipped_steps": s.skipped_total, "skipped_in_a_row": s.skipped_in_a_row,
                                 "scaler_overflows": s.overflows_total, "centers_sq": centers_fingerprint(s.centers)})
    return local


def report(s: State, step: int, row: dict, is_ckpt: bool) -> None:
    """All ranks report the same number of times; rank 0 writes the checkpoint and passes it, the others None."""
    t = s.cfg.train
    perf = perf_metrics(s, step)
    row.update(perf)
    s.tracker.log_step(perf, step=step + 1)
    metrics = {**row, "val/data_bpt": s.val_bpt, "val/data_bpt_start": s.val_bpt_start,
               "tokens_seen": s.position * s.cfg.data.block_size,  # the sweep's ASHA time axis (exact across resumes)
               "tokens_per_epoch": s.tokens_per_epoch, "max_steps": t.max_steps, "world_size": world_size()}
    notices = take_notices()  # rank 0's reach the driver's console (launch.fit)
    if notices:  # one text, not a list: Tune's TensorBoard logger warns about a list it cannot plot (sweeps)
        metrics[NOTICES] = "\n".join(notices)
    rng_states = all_gather_object(ckpt.rng_state()) if is_ckpt else None  # all ranks: each rank's RNG
    local = save_checkpoint(s, step, rng_states) if is_ckpt and rank() == 0 else None
    s.tracker.flush()
    with s.meter.reporting(warn=not is_ckpt):
        s.hooks.report(metrics, local / "ckpt" if local else None,
                       f"checkpoint_{step + 1:08d}{s.ckpt_suffix}" if is_ckpt else None)
    if local is not None:
        shutil.rmtree(local, ignore_errors=True)


def after_step(s: State, step: int, row: dict) -> bool:
    """Once in a while: eval (all ranks), report (all ranks), checkpoint (rank 0 writes). True when the run is done."""
    t = s.cfg.train
    done = step + 1 == t.max_steps or (t.stop_on_saturation and s.controller.saturated) or s.stopping
    is_ckpt = (step + 1) % t.checkpoint_every == 0 or done
    if (step + 1) % t.eval_every == 0 or is_ckpt:
        with s.meter.excluded():  # throughput counts training time only
            s.val_bpt = evaluate_now(s)
        row["val/data_bpt"] = s.val_bpt
        s.best_val = min(s.best_val, s.val_bpt)
    s.history.append(row)
    s.tracker.log_step(row)
    if (step + 1) % t.report_every == 0 or done:
        report(s, step, row, is_ckpt)
    return done


def run_loop(cfg: Config, *, hooks, run_id=None) -> None:
    """Setup, then the training loop; ``hooks`` are Ray Train's calls (or their local stand-ins)."""
    s = setup(cfg, hooks, run_id)
    with profiled(steps=cfg.train.profile_steps, left=cfg.train.max_steps - s.start_step,
                  cuda=s.device.type == "cuda", out_dir=RunPaths.of(cfg).profile) as tick:  # off unless asked
        for step in range(s.start_step, cfg.train.max_steps):
            row = train_step(s, step)
            tick()
            if after_step(s, step, row):
                break
    s.tracker.finish(history=s.history, model=s.model, status="KILLED" if s.stopping else "FINISHED")
