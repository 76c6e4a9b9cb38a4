"""The per-worker training function that Ray Train runs on every rank (nanoGPT-style: setup, then one flat loop)."""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

import ray.train
import ray.train.torch

from raytrain_scu import checkpoint as ckpt
from raytrain_scu import tracking
from raytrain_scu.config import build_config, to_yaml
from raytrain_scu.controller import from_config as build_controller
from raytrain_scu.data import prepare_data, train_batch, val_batches
from raytrain_scu.dist import all_gather_object, all_reduce_sum, barrier, print0, rank, world_size
from raytrain_scu.hardware import mfu, peak_flops
from raytrain_scu.model import (CausalLMLoss, apply_lora, build_model, compile_for_training, flops_per_token,
                                load_tokenizer, resolve_dtype, structure_of)
from raytrain_scu.regularizer import adapter_params, lora_b_norm, param_bpt

LN2 = math.log(2.0)


class InjectedFault(RuntimeError):
    """Raised by RAYTRAIN_SCU_FAULT_AT_STEP=N (fault-tolerance tests): a crash after step N of a fresh start."""


def hold_for_kill(step: int, seconds: float = 120.0) -> None:
    """RAYTRAIN_SCU_HOLD_AT_STEP=N: after step N of a fresh start, write ``rank<R>.pid`` under RAYTRAIN_SCU_HOLD_DIR
    and wait to be killed from outside (SIGKILL, node removal), so a test kills at a known step."""
    hold_dir = Path(os.environ.get("RAYTRAIN_SCU_HOLD_DIR") or tempfile.gettempdir())
    hold_dir.mkdir(parents=True, exist_ok=True)
    (hold_dir / f"rank{rank()}.pid").write_text(f"{os.getpid()} {step}")
    time.sleep(seconds)
    raise InjectedFault(f"held after step {step} for {seconds:.0f} s and nobody killed this worker")


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row were skipped: a non-finite loss, or (without fp16 loss scaling) a non-finite
    gradient."""


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


class NotLearningError(RuntimeError):
    """The LoRA B matrices are still exactly zero after optimizer steps: no data gradient reached the adapters."""


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


class RayHooks:
    """The handful of calls that touch Ray Train; ``LocalHooks`` stands in for them in one bare process."""

    get_device = staticmethod(lambda: ray.train.torch.get_device())
    get_checkpoint = staticmethod(lambda: ray.train.get_checkpoint())

    @staticmethod
    def prepare_model(model, move_to_device: bool):
        return ray.train.torch.prepare_model(model, move_to_device=move_to_device,
                                             parallel_strategy_kwargs={"gradient_as_bucket_view": True})

    @staticmethod
    def report(metrics: dict, checkpoint_dir, checkpoint_dir_name):
        checkpoint = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_dir_name)
        if checkpoint is not None:
            # wait until the controller has registered it: a worker lost from here on restarts from this checkpoint
            # (Ray registers reports asynchronously, one health-check poll at a time)
            ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


class LocalHooks:
    """One process, no Ray: the same loop, for benchmarks (Ray overhead) and debugging. Reports are kept."""

    def __init__(self, device=None):
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.reports: list[dict] = []

    def get_device(self):
        return self.device

    def get_checkpoint(self):
        return None

    def prepare_model(self, model, move_to_device: bool):
        return model.to(self.device) if move_to_device else model

    def report(self, metrics: dict, checkpoint_dir, checkpoint_dir_name):
        self.reports.append(dict(metrics))


def train_func(config: dict) -> None:
    """Ray Train per-worker entry point. ``config`` is ``asdict(Config)`` plus ``_mlflow_run_id``."""
    config = dict(config)
    run_id = config.pop("_mlflow_run_id", None)
    run_loop(build_config(config), hooks=RayHooks(), run_id=run_id)


def run_loop(cfg, *, hooks, run_id=None) -> None:
    """Setup, resume, then the training loop; ``hooks`` are Ray Train's calls (or their local stand-ins)."""
    d, m, c, t = cfg.data, cfg.model, cfg.controller, cfg.train

    # ---- setup (all ranks)
    device = hooks.get_device()
    torch.manual_seed(cfg.seed + rank())
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dtype = resolve_dtype(m.precision, device)
    use_amp = device.type == "cuda" and dtype != torch.float32
    autocast = torch.autocast(device_type=device.type, dtype=dtype, enabled=use_amp)
    tok = load_tokenizer(m.name, m.gguf_file, m.tokenizer, m.cache_dir)
    data = prepare_data(tok, source=d.source, path=d.path, text_field=d.text_field, max_documents=d.max_documents,
                        block_size=d.block_size, val_fraction=d.val_fraction, seed=cfg.seed, cache_dir=d.cache_dir)
    tokens_per_epoch = c.tokens_per_epoch or data.tokens_per_epoch
    # frozen base weights are stored in the compute dtype; LoRA adapters stay float32 (peft's default)
    base = build_model(m.name, gguf_file=m.gguf_file, vocab_size=len(tok), dtype=dtype, device=device,
                       attn_implementation=m.attn_implementation, gradient_checkpointing=m.gradient_checkpointing,
                       load_in_4bit=cfg.quant.load_in_4bit, quant_type=cfg.quant.quant_type,
                       double_quant=cfg.quant.double_quant, cache_dir=m.cache_dir,
                       trust_remote_code=m.trust_remote_code, seed=cfg.seed)
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank
    model = apply_lora(base, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                       targets=cfg.lora.target_modules, quantized=cfg.quant.load_in_4bit,
                       gradient_checkpointing=m.gradient_checkpointing)
    ckpt.seed_all(ckpt.rank_seed(cfg.seed, rank()))  # then each rank its own stream: distinct dropout masks
    params = adapter_params(model)
    loss_model = CausalLMLoss(model, fused=m.fused_loss, chunk_size=m.loss_chunk_size)
    if m.compile:
        loss_model = compile_for_training(loss_model, scope=m.compile_scope, mode=m.compile_mode)
    # a quantized model is placed by device_map and must never be moved with .to()
    ddp_model = hooks.prepare_model(loss_model, move_to_device=not cfg.quant.load_in_4bit)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
                                  fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=use_amp and dtype == torch.float16)
    controller = build_controller(c)
    structure = structure_of(cfg)
    tracker = tracking.for_rank(cfg, rank(), run_id=run_id)
    history: list[dict] = []
    start_step, position, val_bpt, best_val = 0, 0, float("nan"), float("inf")

    # ---- resume (all ranks: rank 0 picks the checkpoint, every rank loads that one)
    resume = hooks.get_checkpoint()
    resumed_at, skipped_total, skipped_in_a_row, overflows_total, ckpt_suffix = [], 0, 0, 0, ""
    if resume is not None:
        with contextlib.ExitStack() as stack:
            local, problems = ckpt.open_good_checkpoint(resume, stack)  # a bad latest falls back to an older one
            saved = ckpt.read_meta(local)
            ckpt.check_structure(saved, structure)
            note = ckpt.check_tokens_per_epoch(saved, measured=data.tokens_per_epoch, override=c.tokens_per_epoch)
            meta = ckpt.load_training_state(local, model=model, optimizer=optimizer, scaler=scaler, rank=rank(),
                                            world_size=world_size())
        controller.load_state_dict(meta["controller"])
        start_step, position, history = meta["step"], meta["position"], meta["history"]
        val_bpt, best_val = meta.get("val_bpt", float("nan")), meta.get("best_val", float("inf"))
        resumed_at = meta.get("resumed_at", []) + [start_step]
        skipped_total, skipped_in_a_row = meta.get("skipped_steps", 0), meta.get("skipped_in_a_row", 0)
        overflows_total = meta.get("scaler_overflows", 0)
        # after a fallback, never reuse the name of a skipped bad checkpoint: Ray still lists it
        ckpt_suffix = f"_from{start_step:08d}" if problems else ""
        print0(f"[raytrain_scu] resumed at step {start_step}"
               + (f" after skipping {len(problems)} bad checkpoint(s)" if problems else ""))
        if note:
            print0(f"[raytrain_scu] warning: {note}")
        if meta["rng_ranks"] != world_size():  # else each rank's RNG goes on where it stopped
            print0(f"[raytrain_scu] warning: the checkpoint holds the RNG state of {meta['rng_ranks']} rank(s), this "
                   f"run has {world_size()}: dropout draws restart from a seed of (seed, rank, step {start_step}), so "
                   f"the run no longer matches an uninterrupted one")
            ckpt.seed_all(ckpt.rank_seed(cfg.seed, rank(), start_step))
    tracker.start(params=tracking.derived_params(cfg, tokens_per_epoch=tokens_per_epoch, world=world_size(),
                                                 device=device), resumed_at=start_step)

    # fault injection for the reliability tests (docs/reliability.md); RAYTRAIN_SCU_* reach every worker
    fault_at_step = int(os.environ.get("RAYTRAIN_SCU_FAULT_AT_STEP", "0") or 0)
    hold_at_step = int(os.environ.get("RAYTRAIN_SCU_HOLD_AT_STEP", "0") or 0)
    nan_at_steps = {int(s) for s in os.environ.get("RAYTRAIN_SCU_NAN_AT_STEPS", "").split(",") if s.strip()}
    ddp = isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel)
    if start_step == 0:  # the untrained adapter's held-out BPT: the baseline every later eval is compared with
        val_bpt = evaluate(ddp_model, data, device=device, batch_size=d.batch_size, max_blocks=t.eval_blocks,
                           autocast=autocast)
        history.append({"step": 0, "val/data_bpt": val_bpt, "ctrl/lambda": controller.lam})
        tracker.log_step(history[-1])
    val_bpt_start = history[0]["val/data_bpt"] if history and history[0]["step"] == 0 else float("nan")
    tokens_per_step = d.batch_size * d.grad_accum * world_size() * d.block_size
    t_last, steps_since, report_wait, warned_wait = time.perf_counter(), 0, 0.0, False
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # perf/mfu as docs/benchmarks.md defines it: tokens/s per GPU x FLOPs/token of the frozen base / the card's peak
    model_flops_per_token = flops_per_token(base.config.get_text_config(), d.block_size)  # a nested text config too
    peak = device_peak_flops(device)
    if peak == 0:
        print0(f"[raytrain_scu] perf/mfu is not logged: no dense bf16 peak FLOP/s is known for "
               f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type} "
               f"(hardware.PEAK_BF16_FLOPS)")

    # ---- training loop
    for step in range(start_step, t.max_steps):
        lr = lr_at(step, lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps, max_steps=t.max_steps,
                   min_lr_ratio=cfg.optim.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        lam = controller.lam  # constant within the step: the last controller update's value
        nats_sum = torch.zeros((), dtype=torch.float32, device=device)
        tokens = torch.zeros((), dtype=torch.float32, device=device)
        for micro in range(d.grad_accum):
            x, y = train_batch(data, position=position, micro_step=micro, rank=rank(), world_size=world_size(),
                               batch_size=d.batch_size, seed=cfg.seed, pin_memory=device.type == "cuda")
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last = micro == d.grad_accum - 1
            # DDP all-reduces gradients only on the last micro-step
            with (ddp_model.no_sync() if ddp and not last else contextlib.nullcontext()), autocast:
                nats, n = ddp_model(x, y)
                if step + 1 in nan_at_steps:
                    nats = nats * float("nan")  # injected: a non-finite loss (and gradient) on the real path
                loss = nats / n / d.grad_accum
                if last:  # the penalty's gradient enters once per optimizer step, with full weight
                    pbpt = param_bpt(params, sigma=c.prior_sigma, tokens_per_epoch=tokens_per_epoch)
                    loss = loss + lam * LN2 * pbpt
            scaler.scale(loss).backward()
            nats_sum += nats.detach().float()
            tokens += n.float()
        position += d.batch_size * d.grad_accum * world_size()

        # one all-reduce of (nats, tokens): DataBPT is global and identical on every rank
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 1e30)
        stats = all_reduce_sum(torch.stack([nats_sum, tokens]))
        # the one host sync per optimizer step: the controller needs these as floats
        nats_f, tokens_f, pbpt_f, norm_f = torch.stack([stats[0], stats[1], pbpt.detach().float(),
                                                        grad_norm.float()]).tolist()
        data_bpt = nats_f / tokens_f / LN2
        outcome = optimizer_step(optimizer, scaler, data_bpt=data_bpt, param_bpt=pbpt_f, grad_norm=norm_f)
        skipped_in_a_row = skipped_in_a_row + 1 if outcome == "skipped" else 0
        skipped_total += outcome == "skipped"
        overflows_total += outcome == "overflow"  # fp16 only: GradScaler's own skip, not a failure
        if skipped_in_a_row >= t.max_consecutive_skips:
            tracker.finish(history=history, status="FAILED")
            barrier()  # all ranks: rank 0's final MLflow flush lands before any rank raises and Ray stops the group
            raise NonFiniteError(f"{skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                                 f"(last at step {step + 1}); the last good checkpoint is kept. Lower optim.lr, "
                                 f"use bf16 instead of fp16, or check the data.")
        if (step + 1) % c.control_every == 0:  # a non-finite loss: the controller counts ctrl/skipped, changes nothing
            controller.update(data_bpt, pbpt_f, step=step + 1)
        steps_since += 1

        row = {"step": step + 1, "train/data_bpt": data_bpt, "train/param_bpt": pbpt_f, "ctrl/s": controller.s,
               "ctrl/s_hat": controller.s_hat, "ctrl/error": controller.error, "ctrl/lambda": controller.lam,
               "ctrl/integral": controller.integral, "ctrl/skipped": controller.n_skipped,
               "train/skipped_steps": skipped_total, "train/scaler_overflows": overflows_total, "train/lr": lr,
               "train/grad_norm": norm_f, "ctrl/lambda_applied": lam}
        if fault_at_step and resume is None and step + 1 == fault_at_step:
            raise InjectedFault(f"fault injected after step {step + 1} (RAYTRAIN_SCU_FAULT_AT_STEP)")
        if hold_at_step and resume is None and step + 1 == hold_at_step:
            hold_for_kill(step + 1)
        if controller.saturated_step is not None:
            row["ctrl/saturated_step"] = controller.saturated_step
        done = step + 1 == t.max_steps or (t.stop_on_saturation and controller.saturated)

        # ---- once in a while: eval (all ranks), report (all ranks), checkpoint (rank 0 writes)
        is_ckpt = (step + 1) % t.checkpoint_every == 0 or done
        if (step + 1) % t.eval_every == 0 or is_ckpt:
            t_eval = time.perf_counter()
            val_bpt = evaluate(ddp_model, data, device=device, batch_size=d.batch_size,
                               max_blocks=t.eval_blocks, autocast=autocast)
            t_last += time.perf_counter() - t_eval  # throughput counts training time only
            row["val/data_bpt"] = val_bpt
            best_val = min(best_val, val_bpt)
        history.append(row)
        tracker.log_step(row)
        if (step + 1) % t.report_every == 0 or done:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            interval, t_last = now - t_last, now
            b_norm = lora_b_norm(model).item()
            if b_norm == 0.0 and step + 1 - start_step > skipped_total:
                # B starts at zero and any data gradient moves it at the first step (a silent no-op loop once did
                # exactly this under torch.compile on CUDA): refuse to report a run that trains nothing
                raise NotLearningError(f"after {step + 1 - start_step} optimizer step(s) every LoRA B matrix is still "
                                       f"exactly zero: no gradient reached the adapters (model.compile="
                                       f"{m.compile}, model.fused_loss={m.fused_loss}, model.precision={m.precision})")
            perf = {"perf/tokens_per_s": tokens_per_step * steps_since / interval, "train/lora_b_norm": b_norm,
                    "perf/max_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                         if device.type == "cuda" else 0.0),
                    "perf/report_wait_s": report_wait}  # time the previous report (and checkpoint) took
            util = mfu(perf["perf/tokens_per_s"] / world_size(), model_flops_per_token, peak)
            if util is not None:  # no peak for this device: perf/mfu is left out (said once before the loop)
                perf["perf/mfu"] = util
            steps_since = 0
            row.update(perf)
            tracker.log_step(perf, step=step + 1)
            metrics = {**row, "val/data_bpt": val_bpt, "val/data_bpt_start": val_bpt_start,
                       "tokens_seen": position * d.block_size,  # the sweep's ASHA time axis (exact across resumes)
                       "tokens_per_epoch": tokens_per_epoch,
                       "max_steps": t.max_steps, "world_size": world_size()}
            local = None
            rng_states = all_gather_object(ckpt.rng_state()) if is_ckpt else None  # all ranks: each rank's RNG
            if is_ckpt and rank() == 0:
                local = ckpt.new_local_dir()
                ckpt.write_checkpoint(local / "ckpt", model=model, optimizer=optimizer, scaler=scaler,
                                      controller_state=controller.state_dict(), step=step + 1, position=position,
                                      structure=structure, tokens_per_epoch=tokens_per_epoch,
                                      config_yaml=to_yaml(cfg, redact=True), history=history,
                                      rng_states=rng_states,
                                      extra={"val_bpt": val_bpt, "best_val": best_val, "resumed_at": resumed_at,
                                             "skipped_steps": skipped_total, "skipped_in_a_row": skipped_in_a_row,
                                             "scaler_overflows": overflows_total})
            tracker.flush()
            t_report = time.perf_counter()
            hooks.report(metrics, local / "ckpt" if local else None,
                         f"checkpoint_{step + 1:08d}{ckpt_suffix}" if is_ckpt else None)
            report_wait = time.perf_counter() - t_report
            if not is_ckpt and not warned_wait and report_wait > max(0.05, 0.1 * interval):
                warned_wait = True
                print0(f"[raytrain_scu] warning: reporting to Ray blocked training for {report_wait:.2f} s after a "
                       f"{interval:.2f} s interval: reports come faster than Ray's controller takes them (every "
                       f"scaling.poll_interval_s={cfg.scaling.poll_interval_s} s). Raise train.report_every or lower "
                       f"scaling.poll_interval_s.")
            if local is not None:
                shutil.rmtree(local, ignore_errors=True)
        if done:
            break

    tracker.finish(history=history, model=model, status="FINISHED")
