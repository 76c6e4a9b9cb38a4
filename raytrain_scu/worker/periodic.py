"""The loop's "once in a while" blocks: the held-out evaluation (all ranks), the report with its throughput figures
(all ranks) and the checkpoint (rank 0 writes it; under FSDP every rank writes its own shards)."""
from __future__ import annotations

import math
import shutil
import time

import torch

from raytrain_scu.config.io import to_yaml
from raytrain_scu.console import ETA, NOTICES, RESUMED_AT, VAL_STEP, resumed_text, take_notices
from raytrain_scu.core import checkpoint as ckpt
from raytrain_scu.core.data.batches import val_batches
from raytrain_scu.core.dist import all_gather_object, all_reduce_sum, rank, world_size
from raytrain_scu.core.model.flops import bits_per_token
from raytrain_scu.core.regularizer import centers_fingerprint, lora_b_norm
from raytrain_scu.errors import NotLearningError
from raytrain_scu.hardware.gpus import mfu
from raytrain_scu.worker.state import State


@torch.no_grad()
def evaluate(loss_model, data, *, device, batch_size: int, max_blocks: int, autocast) -> float:
    """Held-out DataBPT of one fixed set of validation blocks (``max_blocks``, 0 = all; see ``val_block_indices``),
    token-weighted over all ranks: the same number for any ``batch_size`` and world size, up to float noise (every
    rank runs the same number of batches)."""
    loss_model.eval()
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in val_batches(data, rank=rank(), world_size=world_size(), batch_size=batch_size,
                             max_blocks=max_blocks):
        with autocast:
            nats, n = loss_model(*(t if t is None else t.to(device, non_blocking=True) for t in batch))
        stats += torch.stack([nats.double(), n.double()])
    loss_model.train()
    root = getattr(loss_model, "_orig_mod", loss_model)
    if hasattr(root, "reshard"):  # FSDP keeps the root unit gathered after a forward without a backward: shard it
        root.reshard()  # again, or sums over the parameters count a LoRA factor of the root (head, embeddings) whole
    nats, n = all_reduce_sum(stats).tolist()
    return bits_per_token(nats, n)


def evaluate_now(s: State, step: int) -> float:
    """All ranks: the held-out DataBPT of the fixed validation blocks, after optimizer step ``step`` (0: before the
    first)."""
    s.phase.enter("eval", step, s.hooks.faults, s.device)
    return evaluate(s.opt.loss_model, s.pos.data, device=s.device, batch_size=s.cfg.data.batch_size,
                    max_blocks=s.cfg.train.eval_blocks, autocast=s.opt.autocast)


def perf_metrics(s: State, step: int) -> dict:
    """At a report (all ranks): throughput, memory, the adapters' norm, MFU where the card's peak is known. Refuses
    to report a loop whose LoRA B matrices never left zero."""
    meter = s.metering.meter
    tokens_per_s = meter.lap()
    b_norm = lora_b_norm(s.opt.model).item()
    if b_norm == 0.0 and step + 1 - s.rec.start_step > s.opt.skipped_total:
        # B starts at zero and any data gradient moves it at the first step: a loop whose B is still exactly zero
        # trains nothing (a zero gradient through a compiled loss looks like this), so it is refused
        m = s.cfg.model
        raise NotLearningError(f"after {step + 1 - s.rec.start_step} optimizer step(s) every LoRA B matrix is still "
                               f"exactly zero: no gradient reached the adapters (model.compile={m.compile}, "
                               f"model.fused_loss={m.fused_loss}, model.precision={m.precision})")
    perf = {"perf/tokens_per_s": tokens_per_s, "perf/target_tokens_per_s": meter.targets_per_s,
            "train/lora_b_norm": b_norm, "perf/max_mem_gib": meter.max_mem_gib(),
            "perf/max_reserved_gib": meter.max_reserved_gib(),
            "perf/report_wait_s": meter.report_wait}  # time the previous report (and checkpoint) took
    # perf/mfu as docs/benchmarks.md defines it: tokens/s per GPU x FLOPs/token of the frozen base / the card's peak
    util = mfu(tokens_per_s / world_size(), s.metering.flops_per_token, s.metering.peak_flops)
    if util is not None:  # no peak for this device: perf/mfu is left out (said once in setup)
        perf["perf/mfu"] = util
    return perf


def evals_between(first: int, last: int, *, eval_every: int, checkpoint_every: int) -> int:
    """How many of the steps ``first`` .. ``last`` end with a held-out evaluation: every ``eval_every``-th and every
    checkpoint's (every ``checkpoint_every``-th, and the last step's)."""
    def multiples(n: int) -> int:
        return last // n - (first - 1) // n

    both = eval_every * checkpoint_every // math.gcd(eval_every, checkpoint_every)
    count = multiples(eval_every) + multiples(checkpoint_every) - multiples(both)
    return count + (first <= last and last % eval_every != 0 and last % checkpoint_every != 0)


def eta_s(s: State, step: int) -> float:
    """The seconds left after step ``step + 1``: the loop's measured seconds per step so far (checkpoints and reports
    included, evaluations apart), times the steps left, plus the evaluations left at the last one's duration."""
    t, m = s.cfg.train, s.metering
    done = step + 1 - s.rec.start_step
    per_step = (time.perf_counter() - m.loop_t0 - m.eval_total_s) / done
    evals = evals_between(step + 2, t.max_steps, eval_every=t.eval_every, checkpoint_every=t.checkpoint_every)
    return per_step * (t.max_steps - step - 1) + evals * m.eval_s


def save_checkpoint(s: State, step: int, rng_states: list):
    """Rank 0 (every rank under FSDP, each its own shards): write the checkpoint of step ``step + 1`` to a fresh local
    directory; returns that directory (removed again when the write fails)."""
    s.phase.enter("checkpoint", step + 1, s.hooks.faults, s.device)
    local = ckpt.new_local_dir()
    extra = {**s.rec.saved(), **s.opt.saved(), **s.ctrl.saved(), "centers_sq": centers_fingerprint(s.opt.centers),
             **ckpt.data_facts(streamed=s.pos.data.streamed, plan=s.pos.data.plan)}
    try:
        ckpt.write_checkpoint(local / "ckpt", model=s.opt.model, optimizer=s.opt.optimizer, scaler=s.opt.scaler,
                              controller_state=s.ctrl.law.state_dict(), step=step + 1, position=s.pos.position,
                              structure=s.structure, tokens_per_epoch=s.ctrl.tokens_per_epoch,
                              config_yaml=to_yaml(s.cfg, redact=True), history=s.rec.history, rng_states=rng_states,
                              extra=extra, fsync=s.hooks.faults.fsync(step + 1), sharded=s.opt.sharded)
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise
    return local


def report(s: State, step: int, row: dict, is_ckpt: bool) -> None:
    """All ranks report the same number of times; rank 0 writes the checkpoint and passes it, the others None (under
    FSDP every rank writes and passes its own part, which Ray Train's upload puts together)."""
    perf = perf_metrics(s, step)
    row.update(perf)
    s.tracker.log_step(perf, step=step + 1)
    metrics = {**row, "val/data_bpt": s.rec.val_bpt, "val/data_bpt_start": s.rec.val_bpt_start, ETA: eta_s(s, step),
               "tokens_seen": s.pos.tokens_seen, "tokens_per_epoch": s.ctrl.tokens_per_epoch,
               "max_steps": s.cfg.train.max_steps, "world_size": world_size()}
    if s.rec.val_step is not None:  # None: resumed from a checkpoint that predates it
        metrics[VAL_STEP] = s.rec.val_step
    if s.rec.resumed_at:  # one text, as the notices: a sweep's table and MLflow say which trial restarted, from where
        metrics[RESUMED_AT] = resumed_text(s.rec.resumed_at)
    notices = take_notices()  # rank 0's reach the driver's console (ray.launch.fit)
    if notices:  # one text, not a list: Tune's TensorBoard logger warns about a list it cannot plot (sweeps)
        metrics[NOTICES] = "\n".join(notices)
    if is_ckpt:
        # the checkpoint's score, what Ray Train's top-k (run.num_to_keep) and the driver's best rank by: this step's
        # own held-out DataBPT, else UNSCORED, ranked last (a preemption's checkpoint: on the last evaluation's value
        # it would tie the checkpoint evaluated there and, the later one, displace it). Ray never deletes its latest
        # checkpoint, so an unscored one stays for the resume. val/data_bpt keeps the last measured value (console)
        own = s.rec.val_step == step + 1 and math.isfinite(s.rec.val_bpt)
        metrics[ckpt.BEST_METRIC] = s.rec.val_bpt if own else ckpt.UNSCORED
    rng_states = all_gather_object(ckpt.rng_state()) if is_ckpt else None  # all ranks: each rank's RNG
    local = save_checkpoint(s, step, rng_states) if is_ckpt and (rank() == 0 or s.opt.sharded) else None
    s.tracker.flush()
    with s.metering.meter.reporting(warn=not is_ckpt):
        s.hooks.report(metrics, local / "ckpt" if local else None,
                       f"checkpoint_{step + 1:08d}{s.rec.ckpt_suffix}" if is_ckpt else None)
    if local is not None:
        shutil.rmtree(local, ignore_errors=True)
    if is_ckpt:  # all ranks: the newest checkpoint, which an out-of-memory error names as kept
        s.phase.checkpoint_step = step + 1


def finished(s: State, step: int) -> bool:
    """Whether the run is over with step ``step + 1``: train.max_steps reached (or passed, by a run resumed under a
    lower one), or λ saturated under train.stop_on_saturation."""
    t = s.cfg.train
    return step + 1 >= t.max_steps or (t.stop_on_saturation and s.ctrl.law.saturated)


def after_step(s: State, step: int, row: dict) -> bool:
    """Once in a while: eval (all ranks), report (all ranks), checkpoint (rank 0 writes; under FSDP every rank writes
    its own shards). True when the run is done,
    or stops here (Ctrl-C, a preemption) with the checkpoint of this step. A preemption's checkpoint, short of the
    run's end, comes without an evaluation of its own (the grace window is for the checkpoint): its report carries the
    last evaluation's val/data_bpt and its val/step, and ranks last among the checkpoints (:func:`report`)."""
    t = s.cfg.train
    done = finished(s, step) or s.stopping or s.preempting
    is_ckpt = (step + 1) % t.checkpoint_every == 0 or done
    if (step + 1) % t.eval_every == 0 or (is_ckpt and (not s.preempting or finished(s, step))):
        t0 = time.perf_counter()
        with s.metering.meter.excluded():  # throughput counts training time only
            s.rec.evaluated(evaluate_now(s, step + 1), step + 1)
        s.metering.eval_s = time.perf_counter() - t0
        s.metering.eval_total_s += s.metering.eval_s
        row["val/data_bpt"] = s.rec.val_bpt
    s.rec.history.append(row)
    s.tracker.log_step(row)
    if (step + 1) % t.report_every == 0 or done:
        report(s, step, row, is_ckpt)
    return done
