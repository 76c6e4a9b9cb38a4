"""``python -m raytrain_scu.sweep CONFIG.yaml key=value... [--lr]``: a Ray Tune sweep whose trials are Ray Train runs.

Each trial is a small driver function (:func:`run_trial`) that builds the trial's TorchTrainer with
``launch.build_trainer`` and calls ``fit()``; ``TuneReportCallback`` hands every ``ray.train.report`` to Tune, so ASHA
sees ``val/data_bpt`` while the run trains. The space is the config's ``tune.space`` (key -> {choice | grid | uniform
| loguniform | randint: args}); left empty it is chosen by the metric (``sweep_space.default_space``). ``--lr`` adds
optim.lr (log-uniform over a decade either side of the config's).

This module is the Tune wiring; the checks before launch are ``driver.sweep``, the space and a trial's config
``space.py``, the table, best.yaml, plots and the MLflow records ``results.py``.

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

import contextlib
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import ray
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import BasicVariantGenerator
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.queue import Queue

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config
from raytrain_scu.errors import SweepError
from raytrain_scu.ray.callbacks import NotePlacementGroup
from raytrain_scu.ray.launch import build_trainer, driver_logs_to_file, init_ray, keep_logs, logs_dir, scu_env
from raytrain_scu.ray.tune.events import TrialEvents
from raytrain_scu.ray.tune.results import open_child_run, open_parent_run, write_results
from raytrain_scu.ray.tune.space import GLOBAL_BATCH, space_value, tokens_per_step_bounds, trial_config
from raytrain_scu.tracking.store import end_run

ASHA_REDUCTION_FACTOR = 2  # ASHA keeps the best half at each rung
AIR_NEW_OUTPUT = "RAY_AIR_NEW_OUTPUT"  # Tune's switch between its two consoles
DRIVER_CPU = 0.01  # what a trial's driver function holds; its Train workers ask for their own resources


# ---------------------------------------------------------------- the space as Tune domains

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

class PlacementGroupReaper:
    """In the sweep's driver, beside Tune: removes the placement group of every Train run whose controller died.

    It runs in a thread of its own for the whole sweep, so nothing that fails in it may end it: a check, a removal or
    a read of the queue that fails is printed once and tried again on the next pass. Otherwise every placement group
    noted after the failure would keep its CPUs/GPUs until the job ends."""

    def __init__(self, queue):
        self.queue = queue
        self.watched: list = []
        self.said: set = set()  # the failures printed so far: one that repeats every pass is printed once

    def release(self) -> int:
        """One pass over the runs noted so far; returns how many are still watched (a live controller's, or one
        whose check or removal failed)."""
        try:
            while not self.queue.empty():
                self.watched.append(self.queue.get_nowait())
        except Exception as e:  # noqa: BLE001
            self._say("the queue of trials' placement groups", "could not be read", e)
        self.watched = [(controller, pg) for controller, pg in self.watched if not self._released(controller, pg)]
        return len(self.watched)

    def _released(self, controller, pg) -> bool:
        """Whether ``pg`` is gone now: its controller died and the group is removed."""
        try:
            ray.get(controller.__ray_ready__.remote(), timeout=5)
            return False  # alive: a run that ends by itself removes its own placement group
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return False  # unreachable for now (a restart, the network) or busy: not dead
        except ray.exceptions.RayActorError:  # the controller died: its workers' placement group is left behind
            return self.remove(pg)
        except Exception as e:  # noqa: BLE001
            self._say(f"placement group {_pg_id(pg)}", "could not ask whether its controller lives", e)
            return False

    def remove(self, pg) -> bool:
        """Remove ``pg`` unless it is gone already; False when the GCS refused or did not answer."""
        try:
            if placement_group_table(pg).get("state", "REMOVED") != "REMOVED":
                remove_placement_group(pg)
            return True
        except Exception as e:  # noqa: BLE001
            self._say(f"placement group {_pg_id(pg)}", "could not be removed", e)
            return False

    def _say(self, what: str, failed: str, e: Exception) -> None:
        if (what, failed) not in self.said:
            self.said.add((what, failed))
            print(f"[raytrain_scu] sweep: {what} {failed}; tried again on every pass: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)

    def run(self, stop: threading.Event, every_s: float = 2.0) -> None:
        """Release every ``every_s`` seconds until ``stop`` (set when Tune has ended every trial); then wait up to 30 s
        for the last controllers to end, and remove the placement groups of those still up: no trial uses them any
        more, and a controller that is slow to die on a loaded machine would otherwise keep its workers' resources
        until the job ends."""
        while not stop.wait(every_s):
            self.release()
        deadline = time.monotonic() + 30
        while self.release() and time.monotonic() < deadline:
            time.sleep(1)
        for _, pg in self.watched:
            self.remove(pg)


def _pg_id(pg) -> str:
    """A placement group's id as placement_group_table keys it (what a user can look up), else what was noted."""
    return pg.id.hex() if hasattr(pg, "id") else repr(pg)


# ---------------------------------------------------------------- one trial

@dataclass
class TrialSetup:
    """What every trial's driver function needs besides its sampled values."""

    base: Config
    parent_run_id: Optional[str]
    use_gpu: bool
    env: dict  # the sweep command's RAYTRAIN_SCU_* variables
    placement_groups: object  # a ray.util.queue.Queue that PlacementGroupReaper reads


TRAIN_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # read by the Train controller fit() starts
TRIAL_START_TIMEOUT_S = 2 * 3600  # longer than any queue of trials for a GPU seen so far (13 min)


def run_trial(params: dict, setup: TrialSetup) -> None:
    """Tune's trainable: one trial is one Ray Train run, whose reports reach Tune through TuneReportCallback."""
    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(setup.base, params, trial_id)
    run_id = None
    if cfg.tracking.enabled:
        run_id = open_child_run(cfg, setup.base.run.name, setup.parent_run_id, params, trial_id)
    # same run.name and storage_path on a resumed sweep: Ray Train continues from this trial's latest checkpoint
    callbacks = [TuneReportCallback(), NotePlacementGroup(setup.placement_groups)]
    # a trial whose workers find no free GPU waits for one rather than failing at Ray Train's 60 s start-up timeout:
    # a restored sweep starts every unfinished trial at once (Ray does not keep max_concurrent_trials across
    # Tuner.restore with resume_errored, ray-project/ray#40652) and on a 4-GPU run the extra trials looped through
    # WorkerGroupStartupTimeoutError. The resources were checked against the cluster before launch, so a wait ends
    # when a running trial does; a trial that still cannot start after TRIAL_START_TIMEOUT_S (a node lost) fails
    os.environ[TRAIN_START_TIMEOUT_ENV] = str(TRIAL_START_TIMEOUT_S)
    # this actor inherited the cluster's environment: the workers get the sweep command's RAYTRAIN_SCU_* variables
    build_trainer(cfg, use_gpu=setup.use_gpu, run_id=run_id, callbacks=callbacks, env=setup.env).fit()
    if run_id:  # the sweep opened the trial's run, so it ends it; a stopped or failed trial is closed by the parent
        end_run(cfg, run_id, "FINISHED")


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
    lo, hi = tokens_per_step_bounds(cfg, space)
    # the metric and mode reach it from tune.TuneConfig (Tune refuses them in both places)
    return ASHAScheduler(time_attr="tokens_seen", max_t=cfg.train.max_steps * hi,
                         grace_period=cfg.tune.grace_period * cfg.train.report_every * lo,
                         reduction_factor=ASHA_REDUCTION_FACTOR, stop_last_trials=False)


def make_tuner(cfg: Config, space: dict, setup: TrialSetup, max_concurrent: int, *, verbose: bool = False):
    """A new Tuner, or the interrupted one restored from the sweep's directory (same run.name and storage_path). Its
    console is :class:`TrialEvents`' lines; ``verbose`` adds Tune's own status tables."""
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"CPU": DRIVER_CPU})
    path = RunPaths.of(cfg).run
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
        run_config=tune.RunConfig(name=cfg.run.name, storage_path=RunPaths.of(cfg).storage,
                                  callbacks=[TrialEvents(cfg, space)], verbose=1 if verbose else 0),
    )


# ---------------------------------------------------------------- the sweep

def _global_batch_note(cfg: Config, space: dict) -> str:
    """How the trials' tokens per step are set, for the launch line."""
    lo, hi = tokens_per_step_bounds(cfg, space)
    if lo == hi:
        return f"{lo} tokens/step in every trial"
    how = f"tune.space.{GLOBAL_BATCH}" if GLOBAL_BATCH in space else "the swept keys"
    return f"{lo}-{hi} tokens/step (from {how}); ASHA compares trials at equal tokens seen"


@contextlib.contextmanager
def tune_console(verbose: bool):
    """Tune's newer console (RAY_AIR_NEW_OUTPUT, read when fit() starts) prints an experiment box and paths even at
    verbose=0, the older one nothing: the older inside, unless ``verbose``."""
    old = os.environ.get(AIR_NEW_OUTPUT)
    if not verbose:
        os.environ[AIR_NEW_OUTPUT] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(AIR_NEW_OUTPUT, None)
        else:
            os.environ[AIR_NEW_OUTPUT] = old


def run_sweep(cfg: Config, space: dict, *, use_gpu: bool, verbose: bool = False) -> dict:
    """Launch (or resume) the sweep of the checked ``space`` on Ray Tune, then print the table and write best.yaml and
    plots (``driver.sweep`` checks it first). ``verbose``: Ray's, Tune's and the trials' output on the console too,
    not only in the log files."""
    cfg.tune.space = space
    t = cfg.tune
    parent_run_id = open_parent_run(cfg)
    init_ray(cfg, verbose=verbose)

    need = trial_need(cfg, use_gpu)
    max_concurrent = t.max_concurrent_trials or concurrent_trials(ray.cluster_resources(), need)
    print(f"[raytrain_scu] sweep {cfg.run.name}: {', '.join(space)}; search={t.search}, scheduler={t.scheduler}, "
          f"{max_concurrent} trial(s) at a time, each holding "
          f"{', '.join(f'{r}={n:g}' for r, n in need.items())}; global batch {_global_batch_note(cfg, space)}",
          flush=True)
    ray_logs = logs_dir()
    if not verbose:
        print(f"[raytrain_scu] Ray's and the trials' logs: {ray_logs} (--verbose shows them here)", flush=True)
    setup = TrialSetup(base=cfg, parent_run_id=parent_run_id, use_gpu=use_gpu, env=scu_env(),
                       placement_groups=Queue(actor_options={"num_cpus": 0}))
    reaper, stop = PlacementGroupReaper(setup.placement_groups), threading.Event()
    watcher = threading.Thread(target=reaper.run, args=(stop,), daemon=True)
    watcher.start()
    try:
        with driver_logs_to_file(RunPaths.of(cfg).logs, enabled=not verbose), tune_console(verbose):
            results = make_tuner(cfg, space, setup, max_concurrent, verbose=verbose).fit()
    finally:
        stop.set()
        watcher.join()
        setup.placement_groups.shutdown()
        kept = keep_logs(cfg, ray_logs)
        if kept is not None:
            print(f"[raytrain_scu] the trials' logs: {kept}", flush=True)
    return write_results(cfg, space, results, parent_run_id)
