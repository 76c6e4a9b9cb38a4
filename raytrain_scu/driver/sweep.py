"""The driver of a sweep: everything that can be checked before Ray starts, then the Ray Tune run
(``ray.tune.sweep``)."""
from __future__ import annotations

import sys
from pathlib import Path

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config
from raytrain_scu.driver.preflight import preflight
from raytrain_scu.errors import SweepError
from raytrain_scu.ray.tune.space import max_sequences_per_step, resolve_space
from raytrain_scu.ray.tune.sweep import run_sweep


def check_before_launch(cfg: Config, *, with_lr: bool = False, inputs_checked: bool = False) -> tuple[dict, bool]:
    """Everything the sweep can check before Ray starts: the space (returned, resolved), the storage, the data
    against the largest global batch (``inputs_checked``: the caller ran the storage's and the data's cheap checks,
    :func:`~raytrain_scu.driver.early.check_inputs`). Returns (space, whether the trials use GPUs). Raises SweepError
    and the preflight's errors."""
    if RunPaths.of(cfg).remote:
        raise SweepError("the sweep writes its table, best.yaml and plots beside its runs: run.storage_path must "
                         "be a local or shared-filesystem path")
    space = resolve_space(cfg, with_lr=with_lr)  # no I/O: a bad space fails at once
    t = cfg.tune
    if t.scheduler == "asha" and t.metric.startswith("val/") and cfg.train.report_every % cfg.train.eval_every:
        print(f"[raytrain_scu] warning: {t.metric} is measured every train.eval_every={cfg.train.eval_every} steps "
              f"but reported every train.report_every={cfg.train.report_every}: ASHA compares stale values in "
              f"between (set train.eval_every={cfg.train.report_every})", file=sys.stderr)
    facts = preflight(cfg, inputs_checked=inputs_checked)
    largest = max_sequences_per_step(cfg, space)
    if largest > facts["train_blocks"]:
        raise SweepError(f"a trial's global batch of {largest} sequences is more than the training split's "
                         f"{facts['train_blocks']} blocks: lower the swept batch sizes")
    out = RunPaths.of(cfg).run
    if (Path(out) / "mlflow_run.json").exists():
        raise SweepError(f"{out} is a training run's directory (python -m raytrain_scu.train): give the sweep "
                         f"another run.name")
    return space, facts["use_gpu"]


def sweep(cfg: Config, *, with_lr: bool = False, verbose: bool = False, inputs_checked: bool = False) -> dict:
    """Check, launch (or resume) the sweep, then print the table and write best.yaml and plots; returns its summary.
    ``verbose``: Ray's, Tune's and the trials' output on the console too; ``inputs_checked``: see
    :func:`check_before_launch`."""
    space, use_gpu = check_before_launch(cfg, with_lr=with_lr, inputs_checked=inputs_checked)
    return run_sweep(cfg, space, use_gpu=use_gpu, verbose=verbose)
