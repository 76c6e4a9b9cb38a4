"""The per-worker training function (nanoGPT-style): :func:`setup`, then one flat loop of ``train_step`` and
``after_step``. Ray is not imported here: the few calls into Ray Train are the ``hooks`` (``ray.hooks.RayHooks``, or
``worker.hooks.LocalHooks`` in one bare process), and so is fault injection (``hooks.faults``)."""
from __future__ import annotations

import time
from typing import Optional

import torch

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config
from raytrain_scu.core.data.cache import tokens_per_epoch_from
from raytrain_scu.core.dist import notice0, print0, world_size
from raytrain_scu.core.fsdp import GatheredAdapter
from raytrain_scu.core.loss import compile_settings, recompute_elementwise
from raytrain_scu.hardware.gpus import peak_flops
from raytrain_scu.tracking.tracker import derived_params
from raytrain_scu.worker.build import build, resume
from raytrain_scu.worker.meter import Meter
from raytrain_scu.worker.oom import Phase, out_of_memory
from raytrain_scu.worker.periodic import after_step, evaluate_now, finished
from raytrain_scu.worker.profiling import profiled
from raytrain_scu.worker.state import State
from raytrain_scu.worker.step import train_step


def device_peak_flops(device) -> float:
    """The card's dense bf16 peak FLOP/s (``hardware.gpus.PEAK_BF16_FLOPS``); 0 on a CPU or a card not in the table."""
    return peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else 0.0


def _say_no_mfu(device) -> None:
    text = (f"perf/mfu is not logged: no dense bf16 peak FLOP/s is known for "
            f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type} "
            f"(hardware.gpus.PEAK_BF16_FLOPS)")
    if device.type == "cuda":  # a GPU missing from the table: said on the console
        notice0(text)
    else:  # a CPU has no MFU to miss: its log file only
        print0(f"[raytrain_scu] {text}")


def setup(cfg: Config, hooks, run_id: Optional[str] = None, phase: Optional[Phase] = None) -> State:
    """All ranks: build, resume, start tracking, and (on a fresh start) the untrained adapter's held-out BPT."""
    s = build(cfg, hooks, run_id, phase)
    resume(s)
    n_from = tokens_per_epoch_from(cfg.controller.tokens_per_epoch, s.pos.data)
    s.tracker.start(params=derived_params(cfg, tokens_per_epoch=s.ctrl.tokens_per_epoch, world=world_size(),
                                          device=s.device, tokens_per_epoch_from=n_from), resumed_at=s.rec.start_step)
    eval_t0 = time.perf_counter()
    if s.rec.start_step == 0:  # the baseline every later eval is compared with
        s.rec.val_bpt, s.rec.val_step = evaluate_now(s, 0), 0
        s.metering.eval_s = time.perf_counter() - eval_t0  # what each later eval costs, for the ETA
        s.rec.history.append({"step": 0, "val/data_bpt": s.rec.val_bpt, "ctrl/lambda": s.ctrl.law.lam})
        s.tracker.log_step(s.rec.history[-1])
    first = s.rec.history[0] if s.rec.history else {}
    s.rec.val_bpt_start = first["val/data_bpt"] if first.get("step") == 0 else float("nan")
    s.metering.meter = Meter(s.device, cfg.scaling.poll_interval_s)
    s.metering.peak_flops = device_peak_flops(s.device)
    if s.metering.peak_flops == 0:
        _say_no_mfu(s.device)
    s.metering.loop_t0 = time.perf_counter()
    return s


def train(s: State) -> bool:
    """All ranks: the loop, from the resumed step to train.max_steps (or a stop, or a preemption: each ends with the
    checkpoint of its step). After each step: the heartbeat the driver's hang watchdog reads, and a fault test's pause
    point. Returns whether the run is over (train.max_steps, or λ saturated under train.stop_on_saturation), whatever
    else stopped it at the same step."""
    t = s.cfg.train
    step = s.rec.start_step - 1
    with profiled(steps=t.profile_steps, left=t.max_steps - s.rec.start_step, cuda=s.device.type == "cuda",
                  host=t.profile_host, out_dir=RunPaths.of(s.cfg).profile) as tick:  # off unless asked
        for step in range(s.rec.start_step, t.max_steps):
            row = train_step(s, step)
            tick()
            done = after_step(s, step, row)
            s.hooks.heartbeat(step + 1)
            s.hooks.faults.after_report(step + 1)
            if done:
                break
    return finished(s, step)


def run_loop(cfg: Config, *, hooks, run_id: Optional[str] = None) -> None:
    """Setup, then the training loop; ``hooks`` are Ray Train's calls (or their local stand-ins). Running out of
    device memory anywhere is a :class:`~raytrain_scu.errors.DeviceOutOfMemory` naming the phase."""
    phase, s = Phase(), None
    try:
        s = setup(cfg, hooks, run_id, phase)  # no backward here: the training graphs compile in the first steps
        m = cfg.model
        with compile_settings(m.compile and recompute_elementwise(m.recompute_elementwise, s.opt.model)):
            over = train(s)
    except torch.cuda.OutOfMemoryError as e:
        hooks.faults.ballast = None  # an injected fill of the card goes with the error
        raise out_of_memory(cfg, phase, hooks.get_device(), e) from e
    finally:
        if s is not None:  # a streamed source's loader threads stop with the loop, whatever ended it
            s.pos.data.close()
    hooks.heartbeat(None)  # done stepping: what follows (the tracker's artifacts) may take long and is no hang
    if s.preempting and not s.stopping and not over:  # this step's checkpoint is in: the run goes on from it
        s.tracker.pause()  # rank 0: the metrics sent, the system-metrics monitor stopped; the run stays open
        hooks.await_restart()
        return
    # all ranks: a sharded adapter is gathered whole on rank 0 first
    s.tracker.finish(history=s.rec.history, model=GatheredAdapter(s.opt.model) if s.opt.sharded else s.opt.model,
                     status="KILLED" if s.stopping and not over else "FINISHED")
