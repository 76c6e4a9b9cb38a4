"""``python -m raytrain_scu.sweep CONFIG.yaml key=value... [--lr]``: a Ray Tune sweep whose trials are Ray Train runs.

Each trial is a small driver function (:func:`run_trial`) that builds the trial's TorchTrainer with
``train.build_trainer`` and calls ``fit()``; ``TuneReportCallback`` hands every ``ray.train.report`` to Tune, so ASHA
sees ``val/data_bpt`` while the run trains. The space is the config's ``tune.space`` (key -> {choice | grid | uniform
| loguniform | randint: args}); left empty it is chosen by the metric (:func:`default_space`). ``--lr`` adds optim.lr
(log-uniform over a decade either side of the config's).

- Two batch knobs, kept apart. The global batch (``global_batch_tokens`` in the space: tokens per optimizer step over
  all workers) is the optimisation knob, scored on the loss; a trial's data.grad_accum is set from it. The micro-batch
  (data.batch_size) is a throughput and memory knob: with ``tune.keep_tokens_per_step`` (the default) a trial's
  data.grad_accum keeps batch_size x grad_accum at the base config's, so it cannot change the loss beyond float noise,
  and sweeping it while scoring a loss is an error: it is scored on ``perf/tokens_per_s`` (mode max). A batch that does
  not divide the tokens per step is an error before launch. The global batch is in the table and in MLflow.
- ASHA's time is ``tokens_seen`` (reported by the loop), so trials whose global batches differ are compared at equal
  tokens, not equal steps.
- MLflow: one parent run for the sweep; each trial is a child run (tag ``mlflow.parentRunId``) that the trial's
  rank-0 worker fills with the trial's params and metrics.
- Outputs in ``<run.storage_path>/<run.name>/``: trials.csv, best.yaml (the best trial's full config, ready for
  ``python -m raytrain_scu.train``) and plots/ (the metric against each swept parameter), also logged to the parent.
- Re-running the same command (same run.name and storage_path) resumes an interrupted sweep: finished trials are
  kept, unfinished and failed ones continue from their own Ray Train checkpoints.
- A trial ASHA stops gives its workers' CPUs/GPUs back at once (:class:`PlacementGroupReaper`), so the next trial
  does not wait for them.
"""
from __future__ import annotations

import csv
import io
import itertools
import math
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import ray
from ray import tune
from ray.train.v2._internal.execution.callback import WorkerGroupCallback
from ray.util.placement_group import placement_group_table, remove_placement_group

from raytrain_scu import tracking
from raytrain_scu.config import (Config, ConfigError, build_config, flatten, get_dotted, global_batch_tokens,
                                 redact_uri, set_dotted, to_yaml)

ASHA_REDUCTION_FACTOR = 2  # ASHA keeps the best half at each rung
GLOBAL_BATCH = "global_batch_tokens"  # the space key of the global batch (config.SPACE_ONLY_KEYS), in tokens per step
THROUGHPUT_PREFIX = "perf/"  # metrics that score speed, not the loss (the loop reports perf/tokens_per_s)
DRIVER_CPU = 0.01  # what a trial's driver function holds; its Train workers ask for their own resources


class SweepError(ValueError):
    """A sweep problem found before Ray starts: the space, the search, the resources."""


# ---------------------------------------------------------------- the space

def default_space(cfg: Config) -> dict:
    """What is swept when ``tune.space`` is empty, by what the sweep scores.

    On a throughput metric (``perf/...``): the micro-batch (data.batch_size), half, same and double the config's. On
    a loss: the global batch (``global_batch_tokens``: half, same and double the config's, those a whole
    data.grad_accum reaches at the config's micro-batch), or with ``tune.keep_tokens_per_step=false`` the micro-batch,
    which then moves the global batch; and the SCU's gains and target when it is on.
    """
    b, per_step = cfg.data.batch_size, cfg.data.batch_size * cfg.data.grad_accum
    batches = sorted({x for x in (b // 2, b, 2 * b) if x >= 1})
    if cfg.tune.keep_tokens_per_step:  # only batches that keep the tokens per optimizer step
        batches = [x for x in batches if per_step % x == 0]
    if cfg.tune.metric.startswith(THROUGHPUT_PREFIX):
        return {"data.batch_size": {"choice": batches}}
    if cfg.tune.keep_tokens_per_step:
        g = global_batch_tokens(cfg)
        micro = g // cfg.data.grad_accum  # tokens of one micro-step over all workers
        space = {GLOBAL_BATCH: {"choice": [x for x in (g // 2, g, 2 * g) if x >= micro and x % micro == 0]}}
    else:
        space = {"data.batch_size": {"choice": batches}}
    if cfg.controller.mode == "scu":
        space["controller.kp"] = {"loguniform": [0.2, 3.2]}
        space["controller.ki"] = {"loguniform": [0.02, 0.6]}
        space["controller.target_s"] = {"loguniform": [0.002, 0.05]}
    return space


def _plain(value):
    return value.item() if hasattr(value, "item") else value  # numpy scalars from Tune's samplers


def apply_params(base: Config, params: dict) -> Config:
    """The base config with one trial's values set (and validated).

    A swept ``global_batch_tokens`` (tokens per optimizer step over all workers) sets data.grad_accum to
    global_batch_tokens / (data.batch_size x scaling.num_workers x data.block_size), the trial's micro-batch and block
    size; one that is not a whole number of micro-steps is a ConfigError. Otherwise, with
    ``tune.keep_tokens_per_step`` a swept data.batch_size sets data.grad_accum to
    base batch_size x base grad_accum / batch_size; a batch that does not divide that product is a ConfigError.
    """
    tree = asdict(base)
    for key, value in params.items():
        if key != GLOBAL_BATCH:
            set_dotted(tree, key, _plain(value))
    if GLOBAL_BATCH in params:
        tokens, d = _plain(params[GLOBAL_BATCH]), tree["data"]
        if isinstance(tokens, float) and tokens.is_integer():
            tokens = int(tokens)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise ConfigError(f"{GLOBAL_BATCH}: expected a positive int (tokens per optimizer step), got {tokens!r}")
        micro = d["batch_size"] * tree["scaling"]["num_workers"] * d["block_size"]
        if isinstance(micro, int) and micro >= 1:  # anything else: build_config names the bad key
            if tokens < micro or tokens % micro:
                raise ConfigError(f"{GLOBAL_BATCH}={tokens} is not a whole number of micro-steps of "
                                  f"data.batch_size={d['batch_size']} x scaling.num_workers="
                                  f"{tree['scaling']['num_workers']} x data.block_size={d['block_size']} = {micro} "
                                  f"tokens: pick global batches that are multiples of {micro}")
            d["grad_accum"] = tokens // micro
    elif base.tune.keep_tokens_per_step and "data.batch_size" in params:
        per_step = base.data.batch_size * base.data.grad_accum
        batch = tree["data"]["batch_size"]
        if isinstance(batch, int) and batch >= 1:  # anything else: build_config names the problem
            if per_step % batch:
                raise ConfigError(f"data.batch_size={batch} does not divide the base config's {per_step} sequences "
                                  f"per worker per optimizer step (data.batch_size x data.grad_accum): with "
                                  f"tune.keep_tokens_per_step=true every swept batch must divide it (or set "
                                  f"tune.keep_tokens_per_step=false)")
            tree["data"]["grad_accum"] = per_step // batch
    return build_config(tree, default_name=base.run.name)


def resolve_space(cfg: Config, *, with_lr: bool = False) -> dict:
    """The space to sweep, checked against the search, the scheduler and the config. Raises SweepError.

    Each entry's form was checked when the config was built (``config.validate_space_entry``); here every listed
    value, and both ends of every range, must make a valid config; listed values get their key's type.
    """
    t = cfg.tune
    space = dict(t.space) or default_space(cfg)
    if with_lr and "optim.lr" not in space:
        space["optim.lr"] = {"loguniform": [float(f"{cfg.optim.lr / 10:.3g}"), float(f"{cfg.optim.lr * 10:.3g}")]}
    if not space:
        raise SweepError("tune.space is empty: nothing to sweep")
    scaling = [k for k in space if k.startswith("scaling.")]
    if scaling:
        # one trial's resources size the concurrency and are checked against the cluster once, from the base config
        raise SweepError(f"tune.space cannot sweep {', '.join(scaling)}: every trial takes the base config's "
                         f"scaling.* (set them as overrides, one sweep per setting)")
    kinds = {key: next(iter(spec)) for key, spec in space.items()}
    ranges = [k for k, kind in kinds.items() if kind not in ("choice", "grid")]
    grids = [k for k, kind in kinds.items() if kind == "grid"]
    if t.search == "grid" and ranges:
        raise SweepError(f"tune.search=grid runs every combination of listed values, but {', '.join(ranges)} "
                         f"{'is a range' if len(ranges) == 1 else 'are ranges'}: give choice/grid values in "
                         f"tune.space, or use tune.search=random or optuna")
    if t.search == "optuna":
        if grids:
            raise SweepError(f"tune.search=optuna picks values itself: use choice instead of grid for "
                             f"{', '.join(grids)}")
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise SweepError("tune.search=optuna needs optuna, an extra: pip install 'raytrain_scu[optuna]' "
                             "(or use tune.search=random)") from None
    if t.keep_tokens_per_step:
        if "data.grad_accum" in space:
            raise SweepError(f"tune.keep_tokens_per_step=true sets data.grad_accum from data.batch_size (or "
                             f"{GLOBAL_BATCH}): remove data.grad_accum from tune.space (sweep the global batch with "
                             f"{GLOBAL_BATCH}), or set tune.keep_tokens_per_step=false")
        if kinds.get("data.batch_size") not in (None, "choice", "grid"):
            raise SweepError("tune.keep_tokens_per_step=true needs data.batch_size as choice or grid values (each "
                             "must divide the base batch_size x grad_accum), not a range")
        if "data.batch_size" in space and not t.metric.startswith(THROUGHPUT_PREFIX):
            # the micro-batch only regroups the same sequences of each step: the loss moves by float noise
            raise SweepError(f"data.batch_size is the micro-batch, a throughput and memory knob: with "
                             f"tune.keep_tokens_per_step=true every trial takes the same tokens per optimizer step "
                             f"whatever its micro-batch, so {t.metric} differs between them only by float noise and "
                             f"the sweep would select noise. Tune the micro-batch on speed (tune.metric="
                             f"perf/tokens_per_s tune.mode=max, data.batch_size alone in tune.space) or let the memory "
                             f"estimate fit it (docs/sweep.md); tune the global batch with {GLOBAL_BATCH} in "
                             f"tune.space")
    if GLOBAL_BATCH in space:
        if not t.keep_tokens_per_step:
            raise SweepError(f"tune.space.{GLOBAL_BATCH} sets each trial's tokens per step and derives data.grad_accum "
                             f"from it, but tune.keep_tokens_per_step=false keeps data.grad_accum: set "
                             f"tune.keep_tokens_per_step=true")
        linked = [k for k in (GLOBAL_BATCH, "data.batch_size", "data.block_size") if k in space]
        if any(kinds[k] not in ("choice", "grid") for k in linked):
            raise SweepError(f"{GLOBAL_BATCH} / (data.batch_size x scaling.num_workers x data.block_size) is a trial's "
                             f"data.grad_accum and must be whole: give {', '.join(linked)} as choice or grid values, "
                             f"not ranges")
        for combo in itertools.product(*(next(iter(space[k].values())) for k in linked)):
            try:
                apply_params(cfg, dict(zip(linked, combo)))
            except ConfigError as e:
                raise SweepError(f"tune.space {', '.join(f'{k}={v}' for k, v in zip(linked, combo))}: {e}") from None
    if t.metric == "perf/tokens_per_s" and t.mode != "max":
        raise SweepError("tune.metric=perf/tokens_per_s is better when higher: set tune.mode=max")
    if t.scheduler == "asha" and t.grace_period * cfg.train.report_every > cfg.train.max_steps:
        raise SweepError(f"tune.grace_period={t.grace_period} reports x train.report_every={cfg.train.report_every} "
                         f"is beyond train.max_steps={cfg.train.max_steps}: ASHA could never stop a trial")
    typed = {}
    for key, spec in space.items():
        (kind, args), = spec.items()
        values = []
        for v in args:
            try:
                values.append(space_value(apply_params(cfg, {key: v}), key))
            except ConfigError as e:
                raise SweepError(f"tune.space.{key} value {v!r}: {e}") from None
        typed[key] = {kind: values if kind in ("choice", "grid") else list(args)}
    return typed


def space_value(cfg: Config, key: str):
    """A trial config's value of a space key: a config key's value, or the global batch in tokens."""
    return global_batch_tokens(cfg) if key == GLOBAL_BATCH else get_dotted(cfg, key)


def _bounds(cfg: Config, space: dict, key: str) -> tuple:
    """(lowest, highest) value a trial can take for ``key``: the listed values' or the range's ends, or the base's."""
    spec = space.get(key)
    if not spec:
        value = space_value(cfg, key)
        return value, value
    values = next(iter(spec.values()))
    return min(values), max(values)


def tokens_per_step_bounds(cfg: Config, space: dict) -> tuple[int, int]:
    """(smallest, largest) tokens per optimizer step any trial takes (scaling.* is never swept)."""
    if GLOBAL_BATCH in space:
        lo, hi = _bounds(cfg, space, GLOBAL_BATCH)
        return int(lo), int(hi)
    block = _bounds(cfg, space, "data.block_size")
    if cfg.tune.keep_tokens_per_step:  # the base's sequences per step, whatever the micro-batch
        seqs = (cfg.data.batch_size * cfg.data.grad_accum,) * 2
    else:
        batch, accum = _bounds(cfg, space, "data.batch_size"), _bounds(cfg, space, "data.grad_accum")
        seqs = (batch[0] * accum[0], batch[1] * accum[1])
    workers = cfg.scaling.num_workers
    return int(seqs[0] * workers * block[0]), int(seqs[1] * workers * block[1])


def max_sequences_per_step(cfg: Config, space: dict) -> int:
    """The largest global batch (sequences per optimizer step) any trial can take."""
    if GLOBAL_BATCH in space:
        return tokens_per_step_bounds(cfg, space)[1] // int(_bounds(cfg, space, "data.block_size")[0])
    if cfg.tune.keep_tokens_per_step:
        per_worker = cfg.data.batch_size * cfg.data.grad_accum
    else:
        per_worker = _bounds(cfg, space, "data.batch_size")[1] * _bounds(cfg, space, "data.grad_accum")[1]
    return int(per_worker * cfg.scaling.num_workers)  # scaling.* is never swept


def tune_space(cfg: Config, space: dict) -> dict:
    """``tune.space`` as Ray Tune domains; randint's high is inclusive, and ranges over int keys sample ints."""
    out = {}
    for key, spec in space.items():
        (kind, args), = spec.items()
        value = space_value(cfg, key)
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if kind == "grid" or (kind == "choice" and cfg.tune.search == "grid"):
            out[key] = tune.grid_search(list(args))
        elif kind == "choice":
            out[key] = tune.choice(list(args))
        elif kind == "randint" or (kind == "uniform" and is_int):
            out[key] = tune.randint(int(args[0]), int(args[1]) + 1)
        elif kind == "loguniform":
            out[key] = tune.lograndint(int(args[0]), int(args[1]) + 1) if is_int else tune.loguniform(*args)
        else:
            out[key] = tune.uniform(*args)
    return out


# ---------------------------------------------------------------- resources

def trial_need(cfg: Config, use_gpu: bool) -> dict:
    """Logical resources one trial holds while it trains: its driver's sliver of CPU plus its Train workers'."""
    s = cfg.scaling
    need = {"CPU": s.num_workers * s.cpus_per_worker + DRIVER_CPU}
    if use_gpu:
        need["GPU"] = s.num_workers * s.gpus_per_worker
    return need


def concurrent_trials(cluster: dict, need: dict) -> int:
    """How many trials fit on the cluster at once: the floor over every resource a trial needs."""
    fits = min(math.floor(cluster.get(r, 0.0) / n + 1e-9) for r, n in need.items() if n > 0)
    if fits < 1:
        have = ", ".join(f"{r}={cluster.get(r, 0.0):g}" for r in need)
        want = ", ".join(f"{r}={n:g}" for r, n in need.items())
        raise SweepError(f"one trial needs {want} but the cluster has {have}: lower scaling.num_workers or "
                         f"scaling.cpus_per_worker/gpus_per_worker, or set tune.max_concurrent_trials for a cluster "
                         f"that scales up")
    return fits


# ---------------------------------------------------------------- stopped trials give their resources back

class NotePlacementGroup(WorkerGroupCallback):
    """In a trial's Train controller: hand (this controller, its workers' placement group) to the sweep's driver.

    A Train run's placement group outlives its controller while the job lives, and Ray Train's own cleaner finds
    dead controllers through the state API, which is not always there (no dashboard, several Ray instances on a
    node). Without a cleanup, every trial ASHA stops keeps its workers' CPUs/GPUs until the sweep ends, and later
    trials wait for them forever.
    """

    def __init__(self, queue):
        self.queue = queue

    def after_worker_group_start(self, worker_group):
        pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
        self.queue.put((ray.get_runtime_context().current_actor, pg))


class PlacementGroupReaper:
    """In the sweep's driver, beside Tune: removes the placement group of every Train run whose controller died."""

    def __init__(self, queue):
        self.queue = queue
        self.watched: list = []

    def release(self) -> int:
        """One pass over the runs noted so far; returns how many are still alive."""
        while not self.queue.empty():
            self.watched.append(self.queue.get_nowait())
        alive = []
        for controller, pg in self.watched:
            try:
                ray.get(controller.__ray_ready__.remote(), timeout=5)
            except ray.exceptions.RayActorError:  # the controller died: its workers' placement group is left behind
                if placement_group_table(pg).get("state", "REMOVED") != "REMOVED":
                    remove_placement_group(pg)
                continue
            except ray.exceptions.GetTimeoutError:  # busy, not dead
                pass
            alive.append((controller, pg))  # a run that ends by itself removes its own placement group
        self.watched = alive
        return len(alive)

    def run(self, stop: threading.Event, every_s: float = 2.0) -> None:
        """Release every ``every_s`` seconds until ``stop``; then wait up to 30 s for the last controllers to die."""
        while not stop.wait(every_s):
            self.release()
        deadline = time.monotonic() + 30
        while self.release() and time.monotonic() < deadline:
            time.sleep(1)


# ---------------------------------------------------------------- one trial

def sweep_dir(cfg: Config) -> str:
    """Where the Tune experiment, the trials' Train runs and the sweep's outputs live."""
    return f"{tracking.storage_dir(cfg.run.storage_path)}/{cfg.run.name}"


def trial_config(base: Config, params: dict, trial_id: str) -> Config:
    """A trial's full config: its values, its own Train run under the sweep's directory, the sweep's MLflow store."""
    cfg = apply_params(base, params)
    cfg.run.name = f"{base.run.name}-{trial_id}"
    cfg.run.storage_path = f"{sweep_dir(base)}/trials"
    # the store and experiment are the sweep's, not derived from the trial's own storage path and name
    cfg.tracking.uri = tracking.tracking_uri(base)
    cfg.tracking.experiment = base.tracking.experiment or base.run.name
    return cfg


@dataclass
class TrialSetup:
    """What every trial's driver function needs besides its sampled values."""

    base: Config
    parent_run_id: Optional[str]
    use_gpu: bool
    env: dict  # the sweep command's RAYTRAIN_SCU_* variables
    placement_groups: object  # a ray.util.queue.Queue that PlacementGroupReaper reads


def open_child_run(cfg: Config, sweep_name: str, parent_run_id: Optional[str], params: dict,
                   trial_id: str) -> Optional[str]:
    """The trial's MLflow run, a child of the sweep's, with the swept values and the global batch as params."""
    try:
        run_id = tracking.get_or_create_run(cfg, parent_run_id=parent_run_id)
        client = tracking.client_for(tracking.tracking_uri(cfg))
        client.set_tag(run_id, tracking.SWEEP_TAG, sweep_name)
        client.set_tag(run_id, tracking.TRIAL_TAG, trial_id)
        flat = flatten(cfg)  # the same strings the worker logs, so the two never disagree
        keys = [k for k in params if k != GLOBAL_BATCH]  # the global batch is derived.global_batch_tokens
        if "data.batch_size" in params or GLOBAL_BATCH in params:
            keys.append("data.grad_accum")
        tracking.log_params_once(client, run_id, {**{k: flat[k] for k in keys},
                                                  "derived.global_batch_tokens": global_batch_tokens(cfg)})
        return run_id
    except Exception as e:  # noqa: BLE001 - tracking never kills training; rank 0 retries (without the parent link)
        warnings.warn(f"MLflow child run for trial {trial_id} not opened: {type(e).__name__}: "
                      f"{redact_uri(str(e))[:200]}")
        return None


def run_trial(params: dict, setup: TrialSetup) -> None:
    """Tune's trainable: one trial is one Ray Train run, whose reports reach Tune through TuneReportCallback."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_scu.train import build_trainer

    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(setup.base, params, trial_id)
    run_id = None
    if cfg.tracking.enabled:
        run_id = open_child_run(cfg, setup.base.run.name, setup.parent_run_id, params, trial_id)
    # same run.name and storage_path on a resumed sweep: Ray Train continues from this trial's latest checkpoint
    callbacks = [TuneReportCallback(), NotePlacementGroup(setup.placement_groups)]
    # this actor inherited the cluster's environment: the workers get the sweep command's RAYTRAIN_SCU_* variables
    build_trainer(cfg, use_gpu=setup.use_gpu, run_id=run_id, callbacks=callbacks, env=setup.env).fit()


def trial_dirname(trial) -> str:
    """Tune's directory for a trial: just its id, which names its Train run and MLflow child too."""
    return trial.trial_id


# ---------------------------------------------------------------- the Tune experiment

def asha_scheduler(cfg: Config, space: dict):
    """ASHA on ``tokens_seen``: trials are compared at equal tokens trained on, not equal steps.

    Trials whose global batches differ would otherwise be compared after unequal amounts of data, and the small
    batches stopped for having seen less. A resumed trial is judged where it really is (the loop's tokens_seen is
    exact across resumes). The grace period is ``tune.grace_period`` reports of the trial with the smallest global
    batch, in tokens, so every trial trains on as many tokens before it can be stopped. A trial that reaches
    train.max_steps ends by itself (stopping it there would cut its Train run's shutdown short).
    """
    from ray.tune.schedulers import ASHAScheduler

    lo, hi = tokens_per_step_bounds(cfg, space)
    # the metric and mode reach it from tune.TuneConfig (Tune refuses them in both places)
    return ASHAScheduler(time_attr="tokens_seen", max_t=cfg.train.max_steps * hi,
                         grace_period=cfg.tune.grace_period * cfg.train.report_every * lo,
                         reduction_factor=ASHA_REDUCTION_FACTOR, stop_last_trials=False)


def make_tuner(cfg: Config, space: dict, setup: TrialSetup, max_concurrent: int):
    """A new Tuner, or the interrupted one restored from the sweep's directory (same run.name and storage_path)."""
    from ray.tune.search import BasicVariantGenerator

    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"CPU": DRIVER_CPU})
    path = sweep_dir(cfg)
    if tune.Tuner.can_restore(path):
        print(f"[raytrain_scu] resuming sweep {path}: finished trials are kept, unfinished and failed ones continue "
              f"(the space and tune settings are the first run's)", flush=True)
        return tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=True)
    t = cfg.tune
    scheduler = asha_scheduler(cfg, space) if t.scheduler == "asha" else None
    if t.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search_alg, limit = OptunaSearch(seed=cfg.seed), max_concurrent  # Tune wraps it in a ConcurrencyLimiter
    else:  # random and grid: the generator limits itself (Tune ignores max_concurrent_trials for it)
        search_alg, limit = BasicVariantGenerator(random_state=cfg.seed, max_concurrent=max_concurrent), None
    return tune.Tuner(
        trainable,
        param_space=tune_space(cfg, space),
        tune_config=tune.TuneConfig(metric=t.metric, mode=t.mode, search_alg=search_alg, scheduler=scheduler,
                                    num_samples=1 if t.search == "grid" else t.num_samples,
                                    max_concurrent_trials=limit, time_budget_s=t.time_budget_s or None,
                                    trial_dirname_creator=trial_dirname),
        run_config=tune.RunConfig(name=cfg.run.name, storage_path=tracking.storage_dir(cfg.run.storage_path)),
    )


# ---------------------------------------------------------------- results

def trial_rows(results, base: Config, space: dict) -> list[dict]:
    """One row per trial, best first: id, swept values, grad_accum, global batch, metric, steps, status.

    The metric is the trial's last reported value. Status: DONE (reached train.max_steps), STOPPED (ended early:
    ASHA, the time budget, or saturation), ERROR, PENDING (never reported).
    """
    rows = []
    for r in results:
        trial_id = Path(r.path).name
        params = {k: _plain(v) for k, v in (r.config or {}).items() if k in space}
        cfg = trial_config(base, params, trial_id)
        m = r.metrics or {}
        step = m.get("step")
        if r.error is not None:
            status = "ERROR"
        elif step is None:
            status = "PENDING"
        else:
            status = "DONE" if step >= base.train.max_steps else "STOPPED"
        rows.append({"trial": trial_id, "params": params, "grad_accum": cfg.data.grad_accum,
                     "global_batch_tokens": global_batch_tokens(cfg),
                     "metric": float(m.get(base.tune.metric, math.nan)), "steps": step,
                     "tokens_seen": m.get("tokens_seen"), "status": status, "run_name": cfg.run.name})
    sign = 1.0 if base.tune.mode == "min" else -1.0
    rows.sort(key=lambda row: (not math.isfinite(row["metric"]),
                               sign * row["metric"] if math.isfinite(row["metric"]) else 0.0))
    return rows


def best_row(rows: list[dict]) -> Optional[dict]:
    """The best trial that did not fail and has a finite metric (rows are sorted best first)."""
    return next((r for r in rows if r["status"] != "ERROR" and math.isfinite(r["metric"])), None)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _columns(rows: list[dict], keys: list[str], metric: str) -> tuple[list[str], list[list]]:
    derives_accum = "data.batch_size" in keys or GLOBAL_BATCH in keys
    extra = ["data.grad_accum"] if derives_accum and "data.grad_accum" not in keys else []
    batch = [] if GLOBAL_BATCH in keys else ["global_batch_tokens"]  # a swept global batch is a key column already
    head = ["trial", *keys, *extra, *batch, metric, "steps", "tokens_seen", "status"]
    body = [[r["trial"], *(r["params"].get(k) for k in keys), *([r["grad_accum"]] if extra else []),
             *([r["global_batch_tokens"]] if batch else []), r["metric"], r["steps"], r.get("tokens_seen"),
             r["status"]] for r in rows]
    return head, body


def format_table(rows: list[dict], keys: list[str], metric: str) -> str:
    """The trials table as aligned text, best first."""
    head, body = _columns(rows, keys, metric)
    lines = [head, *([_fmt(v) for v in line] for line in body)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def trials_csv(rows: list[dict], keys: list[str], metric: str) -> str:
    """The trials table as CSV, plus each trial's run name (its Train run and MLflow child run)."""
    head, body = _columns(rows, keys, metric)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*head, "run_name"])
    for line, r in zip(body, rows):
        w.writerow([*line, r["run_name"]])
    return buf.getvalue()


def best_config(base: Config, row: dict) -> Config:
    """The best trial's full config as a plain training run named ``<sweep>-best`` (no space left to sweep)."""
    cfg = apply_params(base, row["params"])
    cfg.run.name = f"{base.run.name}-best"
    cfg.tune.space = {}
    return cfg


def plot_metric_vs_params(rows: list[dict], space: dict, metric: str, out_dir: Path,
                          best: Optional[dict]) -> list[Path]:
    """One PNG per swept parameter: every trial's metric against its value; the best trial is starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    shown = [r for r in rows if math.isfinite(r["metric"])]
    paths = []
    for key, spec in space.items():
        values = [r["params"].get(key) for r in shown]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        labels = sorted({str(v) for v in values})
        xs = values if numeric else [labels.index(str(v)) for v in values]
        fig, ax = plt.subplots(figsize=(6, 4))
        for status, marker in (("DONE", "o"), ("STOPPED", "x"), ("ERROR", "^")):
            pts = [(x, r["metric"]) for x, r in zip(xs, shown) if r["status"] == status]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, s=40, label=status.lower())
        if best is not None and best in shown:
            i = shown.index(best)
            ax.scatter([xs[i]], [best["metric"]], marker="*", s=260, color="C3", zorder=3, label="best")
        if numeric and next(iter(spec)) == "loguniform":
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(labels)), labels)
        ax.set(xlabel=key, ylabel=metric, title=f"{metric} vs {key} ({len(shown)} trials)")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{metric.replace('/', '_')}_vs_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------- MLflow parent run

def open_parent_run(cfg: Config) -> Optional[str]:
    """The sweep's MLflow run (found again on resume), with the base config (its tune.space the resolved space) and
    the global batch as params."""
    if not cfg.tracking.enabled:
        return None
    try:
        run_id = tracking.get_or_create_run(cfg)
        client = tracking.client_for(tracking.tracking_uri(cfg))
        client.set_tag(run_id, tracking.SWEEP_TAG, cfg.run.name)
        tracking.log_params_once(client, run_id, {**flatten(cfg),
                                                  "derived.global_batch_tokens": global_batch_tokens(cfg)})
        client.set_terminated(run_id, status="RUNNING")
        return run_id
    except Exception as e:  # noqa: BLE001 - the sweep runs without its parent run
        print(f"[raytrain_scu] warning: MLflow parent run not opened ({type(e).__name__}: {redact_uri(str(e))[:200]}); "
              f"trials are logged without a parent", file=sys.stderr)
        return None


def close_parent_run(cfg: Config, parent_run_id: str, rows: list[dict], best: Optional[dict], best_yaml: str,
                     files: list[Path]) -> None:
    """Mark each child with its outcome, and give the parent the best result, the table, best.yaml and plots.

    A child still RUNNING was cut off before its worker could end it: KILLED if Tune stopped the trial (ASHA, the time
    budget), FAILED if it failed. A worker that ends its run itself (train.max_steps, train.stop_on_saturation) has
    marked it FINISHED, and that stays.
    """
    client = tracking.client_for(tracking.tracking_uri(cfg))
    children = {r.data.tags.get(tracking.TRIAL_TAG): r for r in tracking.child_runs(cfg, parent_run_id)}
    for row in rows:
        child = children.get(row["trial"])
        if child is None:
            continue
        client.set_tag(child.info.run_id, "raytrain_scu.trial_status", row["status"])
        if child.info.status != "RUNNING":
            continue
        if row["status"] == "STOPPED":
            client.set_terminated(child.info.run_id, status="KILLED")
        elif row["status"] == "ERROR":
            tracking.mark_failed(cfg, child.info.run_id)
    if best is not None:
        client.log_metric(parent_run_id, f"best/{cfg.tune.metric}", best["metric"])
        client.set_tag(parent_run_id, "raytrain_scu.best_trial", best["trial"])
        if best["trial"] in children:
            client.set_tag(parent_run_id, "raytrain_scu.best_run_id", children[best["trial"]].info.run_id)
        client.log_text(parent_run_id, best_yaml, "best.yaml")
    client.log_metric(parent_run_id, "sweep/trials", len(rows))
    client.log_metric(parent_run_id, "sweep/errors", sum(r["status"] == "ERROR" for r in rows))
    for f in files:
        client.log_artifact(parent_run_id, str(f), artifact_path="plots" if f.suffix == ".png" else None)
    client.set_terminated(parent_run_id, status="FINISHED" if best is not None else "FAILED")


# ---------------------------------------------------------------- the sweep

def _global_batch_note(cfg: Config, space: dict) -> str:
    """How the trials' tokens per step are set, for the launch line."""
    lo, hi = tokens_per_step_bounds(cfg, space)
    if lo == hi:
        return f"{lo} tokens/step in every trial"
    how = f"tune.space.{GLOBAL_BATCH}" if GLOBAL_BATCH in space else "the swept keys"
    return f"{lo}-{hi} tokens/step (from {how}); ASHA compares trials at equal tokens seen"


def run_sweep(cfg: Config, *, with_lr: bool = False) -> dict:
    """Check, launch (or resume) the sweep on Ray Tune, then print the table and write best.yaml and plots."""
    from raytrain_scu.train import init_ray, preflight, scu_env

    if "://" in cfg.run.storage_path:
        raise SweepError("the sweep writes its table, best.yaml and plots beside its runs: run.storage_path must "
                         "be a local or shared-filesystem path")
    space = resolve_space(cfg, with_lr=with_lr)  # no I/O: a bad space fails at once
    cfg.tune.space = space
    t = cfg.tune
    if t.scheduler == "asha" and t.metric.startswith("val/") and cfg.train.report_every % cfg.train.eval_every:
        print(f"[raytrain_scu] warning: {t.metric} is measured every train.eval_every={cfg.train.eval_every} steps "
              f"but reported every train.report_every={cfg.train.report_every}: ASHA compares stale values in "
              f"between (set train.eval_every={cfg.train.report_every})", file=sys.stderr)
    facts = preflight(cfg)
    largest = max_sequences_per_step(cfg, space)
    if largest > facts["train_blocks"]:
        raise SweepError(f"a trial's global batch of {largest} sequences is more than the training split's "
                         f"{facts['train_blocks']} blocks: lower the swept batch sizes")
    out = Path(sweep_dir(cfg))
    if (out / "mlflow_run.json").exists():
        raise SweepError(f"{out} is a training run's directory (python -m raytrain_scu.train): give the sweep "
                         f"another run.name")
    parent_run_id = open_parent_run(cfg)
    init_ray(cfg)
    from ray.util.queue import Queue

    need = trial_need(cfg, facts["use_gpu"])
    max_concurrent = t.max_concurrent_trials or concurrent_trials(ray.cluster_resources(), need)
    print(f"[raytrain_scu] sweep {cfg.run.name}: {', '.join(space)}; search={t.search}, scheduler={t.scheduler}, "
          f"{max_concurrent} trial(s) at a time, each holding "
          f"{', '.join(f'{r}={n:g}' for r, n in need.items())}; global batch {_global_batch_note(cfg, space)}",
          flush=True)
    setup = TrialSetup(base=cfg, parent_run_id=parent_run_id, use_gpu=facts["use_gpu"], env=scu_env(),
                       placement_groups=Queue(actor_options={"num_cpus": 0}))
    reaper, stop = PlacementGroupReaper(setup.placement_groups), threading.Event()
    watcher = threading.Thread(target=reaper.run, args=(stop,), daemon=True)
    watcher.start()
    try:
        results = make_tuner(cfg, space, setup, max_concurrent).fit()
    finally:
        stop.set()
        watcher.join()
        setup.placement_groups.shutdown()

    rows = trial_rows(results, cfg, space)
    best = best_row(rows)
    keys = list(space)
    print(format_table(rows, keys, t.metric), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "trials.csv"]
    files[0].write_text(trials_csv(rows, keys, t.metric))
    best_path, best_yaml = out / "best.yaml", ""
    if best is not None:
        head = (f"# Best trial {best['trial']} of sweep {cfg.run.name}: {t.metric} = {best['metric']:.6g}\n"
                f"# Launch: python -m raytrain_scu.train {best_path}\n")
        best_cfg = best_config(cfg, best)
        best_path.write_text(head + to_yaml(best_cfg))
        best_yaml = head + to_yaml(best_cfg, redact=True)
    files += plot_metric_vs_params(rows, space, t.metric, out / "plots", best)
    if parent_run_id:
        try:
            close_parent_run(cfg, parent_run_id, rows, best, best_yaml, files)
        except Exception as e:  # noqa: BLE001 - the results are on disk either way
            print(f"[raytrain_scu] warning: MLflow parent run not completed: {type(e).__name__}: "
                  f"{redact_uri(str(e))[:200]}",
                  file=sys.stderr)
    errors = [r["trial"] for r in rows if r["status"] == "ERROR"]
    if best is not None:
        print(f"[raytrain_scu] best trial {best['trial']}: {t.metric}={best['metric']:.6g}; config {best_path}",
              flush=True)
    if errors:
        print(f"[raytrain_scu] {len(errors)} trial(s) failed ({', '.join(errors)}): re-run the same command to "
              f"resume them", flush=True)
    return {"sweep_dir": str(out), "rows": rows, "best": best,
            "best_yaml": str(best_path) if best is not None else None, "parent_run_id": parent_run_id,
            "errors": errors, "files": [str(f) for f in files]}


USAGE = "usage: python -m raytrain_scu.sweep CONFIG.yaml [key=value ...] [--lr]"


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 when every trial ran, 1 when some failed (re-run to resume), 2 for errors found before launch."""
    from raytrain_scu.hardware import resolve
    from raytrain_scu.train import USER_ERRORS

    argv = list(sys.argv[1:] if argv is None else argv)
    with_lr = "--lr" in argv
    args = [a for a in argv if a != "--lr"]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        if args:  # --help: every key, its default and meaning, generated from config.py's tree
            from raytrain_scu.config import help_text

            print("\n" + help_text())
        return 0 if args else 2
    try:
        cfg = resolve(args[0], args[1:])
        summary = run_sweep(cfg, with_lr=with_lr)
    except USER_ERRORS + (SweepError,) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if summary["errors"] or summary["best"] is None else 0


if __name__ == "__main__":
    sys.exit(main())
