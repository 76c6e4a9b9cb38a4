"""One optimizer step, all ranks: the learning rate, the micro-steps, one all-reduce of (nats, tokens, stop,
preempt), the optimizer step (or a skip), one host sync, the control update. Returns the step's metrics row.

The device is kept busy across the host sync: the step's numbers start back to the host, then the optimizer step is
launched (fused AdamW skips it on the device where DataBPT, ParamBPT or the gradient norm is non-finite) and the next
step's first batch is sent, and only then does the host wait, for the numbers alone; the control update and the next
forward follow while the optimizer runs."""
from __future__ import annotations

import torch

from raytrain_scu.core.bootstrap import LN2
from raytrain_scu.core.data.batches import step_counts, train_batch
from raytrain_scu.core.dist import all_reduce_sum, average_gradients, barrier, rank, world_size
from raytrain_scu.core.fsdp import clip_gradients
from raytrain_scu.core.model.flops import bits_per_token
from raytrain_scu.core.regularizer import param_bpt, param_bpt_parts
from raytrain_scu.core.schedule import lr_at
from raytrain_scu.errors import NonFiniteError
from raytrain_scu.worker.state import State


def loss_step(s: State, batch, *, step: int, lam: float, last: bool, scale: float):
    """One micro-batch's (x, y, pos) forward and backward; returns (nats, tokens, ParamBPT or None). ``scale``: the
    ranks' count over the step's target tokens, so that after the gradients' mean over the ranks every target token
    of the step weighs the same whichever micro-batch holds it (examples' micro-batches hold different numbers). The
    penalty's gradient enters on the last micro-step only, with full weight."""
    c = s.cfg.controller
    pbpt = None
    with s.opt.autocast:
        nats, n = s.opt.loss_model(*batch)
        nats = s.hooks.faults.poison(step + 1, nats)
        loss = nats * scale
        if last:
            pbpt = param_bpt(s.opt.params, sigma=c.prior_sigma, tokens_per_epoch=s.ctrl.tokens_per_epoch,
                             center=s.opt.centers if c.prior_center == "init" else None)
            loss = loss + lam * LN2 * pbpt
    s.opt.scaler.scale(loss).backward()
    return nats.detach().float(), n.float(), pbpt


def device_batch(s: State, micro: int):
    """(x, y, pos) of micro-step ``micro`` of the step at the current position, on the device (pos None for text
    blocks and padded rows): the one sent ahead (:func:`send_ahead`) where it is that batch."""
    key = (s.pos.position, micro)
    ahead, s.pos.ahead = s.pos.ahead, None
    if ahead is not None and ahead[0] == key:
        return ahead[1]
    d = s.cfg.data
    x, y, pos = train_batch(s.pos.data, position=s.pos.position, micro_step=micro, rank=rank(),
                            world_size=world_size(), batch_size=d.batch_size, seed=s.cfg.seed,
                            pin_memory=s.device.type == "cuda")
    x_dev = x.to(s.device, non_blocking=True)
    if s.opt.offloaded is not None:  # its rows looked up from the host ids now: the forward then needs no sync
        s.opt.offloaded.stage(x, x_dev)
    return x_dev, y.to(s.device, non_blocking=True), None if pos is None else pos.to(s.device, non_blocking=True)


def send_ahead(s: State) -> None:
    """The next step's first batch, gathered and pinned on the host while the device runs this step's last kernels;
    its copy is queued behind them."""
    s.pos.ahead = ((s.pos.position, 0), device_batch(s, 0))


def micro_steps(s: State, step: int, lam: float):
    """All ranks: the ``data.grad_accum`` micro-batches; returns this rank's summed nats and tokens, and ParamBPT.
    The meter counts the step's tokens over all ranks (its target tokens weigh the loss: :func:`loss_step`)."""
    d = s.cfg.data
    targets, processed = step_counts(s.pos.data, position=s.pos.position, count=s.pos.seqs_per_step,
                                     batch_size=d.batch_size, seed=s.cfg.seed)
    s.metering.meter.tokens += processed
    s.metering.meter.targets += targets
    scale = world_size() / max(targets, 1)
    nats_sum = torch.zeros((), dtype=torch.float32, device=s.device)
    tokens = torch.zeros((), dtype=torch.float32, device=s.device)
    for micro in range(d.grad_accum):
        nats, n, pbpt = loss_step(s, device_batch(s, micro), step=step, lam=lam, last=micro == d.grad_accum - 1,
                                  scale=scale)
        nats_sum += nats
        tokens += n
    return nats_sum, tokens, pbpt


def global_sums(s: State, nats_sum, tokens, pbpt, grad_norm):
    """All ranks: one all-reduce of (nats, tokens, stop, preempt), with ParamBPT, the gradient norm and ParamBPT's
    parts as one float32 tensor on the device, whose copy to the host has started; and whether any of DataBPT,
    ParamBPT and the norm is non-finite, on the device. Rank 0 adds whether a stop was asked for (Ctrl-C, the
    driver's SIGTERM) and every rank whether it was told its node is going (``hooks.preempt_notice``: a drain, its own
    SIGTERM), so every rank agrees on both without another collective."""
    # a fill on the device, not torch.tensor(): a host->device copy from pageable memory would sync mid-step
    stop = tokens.new_full((), float(rank() == 0 and s.stop_path is not None and s.stop_path.exists()))
    preempt = tokens.new_full((), float(s.hooks.preempt_notice()))
    stats = all_reduce_sum(torch.stack([nats_sum, tokens, stop, preempt]))
    parts = param_bpt_parts(s.opt.params, s.opt.centers, sigma=s.cfg.controller.prior_sigma,
                            tokens_per_epoch=s.ctrl.tokens_per_epoch)  # telemetry: ParamBPT's A and B parts
    sums = torch.cat([stats, pbpt.detach().float().reshape(1), grad_norm.float().reshape(1), parts])
    nonfinite = (~torch.isfinite(torch.stack([sums[0] / sums[1], sums[4], sums[5]]))).any().float()
    return _to_host(sums), nonfinite


def _to_host(t: torch.Tensor):
    """``t``'s copy to the host, started; :func:`_read` waits for it alone, not for what is queued after it."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    return host, done


def _read(copy) -> dict:
    """The one host sync of the step: the values of :func:`global_sums` as the row's numbers."""
    host, done = copy
    if done is not None:
        done.synchronize()
    nats, n, stop_f, preempt_f, pbpt_f, norm, pa, pb, pu = host.tolist()
    # no tokens: NaN, a skipped step, as the device's flag says
    return {"data_bpt": bits_per_token(nats, n), "param_bpt": pbpt_f, "grad_norm": norm, "stop": stop_f > 0,
            "preempt": preempt_f > 0, "param_bpt_a": pa, "param_bpt_b": pb, "param_bpt_update": pu}


def _refuse_repeated_skips(s: State, step: int) -> None:
    if s.opt.skipped_in_a_row < s.cfg.train.max_consecutive_skips:
        return
    s.tracker.finish(history=s.rec.history, status="FAILED")
    barrier()  # all ranks: rank 0's final MLflow flush lands before any rank raises and Ray stops the group
    raise NonFiniteError(f"{s.opt.skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                         f"(last at step {step + 1}); the last good checkpoint is kept. Lower optim.lr, use bf16 "
                         f"instead of fp16, or check the data.")


def train_step(s: State, step: int) -> dict:
    """All ranks: optimizer step ``step + 1``. Returns its row."""
    cfg = s.cfg
    s.phase.enter("train", step + 1, s.hooks.faults, s.device)
    lr = lr_at(step, lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps, max_steps=cfg.train.max_steps,
               min_lr_ratio=cfg.optim.min_lr_ratio)
    s.opt.set_lr(lr)
    lam = s.ctrl.law.lam  # constant within the step: the last control update's value
    nats_sum, tokens, pbpt = micro_steps(s, step, lam)
    s.pos.advance()
    if not s.opt.sharded:  # under FSDP the backward reduce-scattered them already
        average_gradients(s.opt.params)  # all ranks: one all-reduce of the adapters' gradients, their mean
    s.opt.scaler.unscale_(s.opt.optimizer)
    grad_norm = clip_gradients(s.opt.params, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 1e30)
    copy, nonfinite = global_sums(s, nats_sum, tokens, pbpt, grad_norm)
    if s.opt.steps_on_device:
        s.opt.launch(nonfinite)
    if step + 1 < cfg.train.max_steps:
        send_ahead(s)
    g = _read(copy)
    s.stopping, s.preempting = g["stop"], g["preempt"]
    s.opt.step(data_bpt=g["data_bpt"], param_bpt=g["param_bpt"], grad_norm=g["grad_norm"])
    _refuse_repeated_skips(s, step)
    s.ctrl.update(step + 1, data_bpt=g["data_bpt"], param_bpt=g["param_bpt"], lr_factor=lr / cfg.optim.lr)
    s.hooks.faults.after_step(step + 1, fresh=s.rec.fresh)
    return {"step": step + 1, "train/data_bpt": g["data_bpt"], "train/param_bpt": g["param_bpt"], **s.ctrl.row(),
            **s.opt.row(), "train/lr": lr, "train/grad_norm": g["grad_norm"], "ctrl/lambda_applied": lam,
            "train/param_bpt_a": g["param_bpt_a"], "train/param_bpt_b": g["param_bpt_b"],
            "train/param_bpt_update": g["param_bpt_update"]}
