"""Rank 0's MLflow tracker (its metric points buffered on disk until the store has them: :mod:`.spool`) and the no-op
every other rank gets, so the loop never branches on rank to log."""
from __future__ import annotations

import json
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

from raytrain_scu.config.io import flatten, redact_uri, to_yaml
from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config, global_batch_tokens
from raytrain_scu.core.crashpoints import crash_point
from raytrain_scu.plots import plot_history
from raytrain_scu.tracking.spool import SEND_BATCH, MetricSpool
from raytrain_scu.tracking.store import client_for, log_params_once, open_run, tracking_uri


def _version_of(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:  # the loop runs without Ray in one bare process (worker.hooks.LocalHooks)
        return "-"


def derived_params(cfg: Config, *, tokens_per_epoch: int, world: int, device,
                   tokens_per_epoch_from: str) -> dict:
    """Flattened resolved config plus the values derived at run time; ``tokens_per_epoch_from``: config, measured or
    estimated (a streamed source: core.data.cache.tokens_per_epoch_from)."""
    import peft
    import torch
    import transformers

    gpu_name, gpu_count = "none", 0
    if device.type == "cuda":
        gpu_name, gpu_count = torch.cuda.get_device_name(device), world
    out = flatten(cfg, redact=True)
    out.update({"derived.tokens_per_epoch": tokens_per_epoch, "derived.tokens_per_epoch_from": tokens_per_epoch_from,
                "derived.world_size": world,
                "derived.global_batch_tokens": global_batch_tokens(cfg, world),
                "derived.gpu_name": gpu_name, "derived.gpu_count": gpu_count,
                "version.torch": torch.__version__, "version.transformers": transformers.__version__,
                "version.peft": peft.__version__, "version.ray": _version_of("ray")})
    return out


class NullTracker:
    """What ranks other than 0 (and runs with tracking off) get."""

    run_id = None

    def start(self, params: dict, resumed_at: int = 0) -> None:
        pass

    def log_step(self, row: dict, step: Optional[int] = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def finish(self, history: list, model=None, status: str = "FINISHED") -> None:
        pass


class MlflowTracker(NullTracker):
    """Rank 0's MLflow client. Metric points wait in memory until the next report, then on disk
    (:class:`~raytrain_scu.tracking.spool.MetricSpool`, in the run directory; under remote storage in the run's
    machine-local state directory on rank 0's machine) until the store has them, with their own steps and timestamps:
    a tracking server that is down is caught up with when it is back, and after a crash the next rank 0 on that
    machine sends what is left. It logs into the run its driver opened (``run_id``); only with none (no
    driver, or MLflow was unreachable when the driver tried) does it open the run itself, and then it also ends it in
    :meth:`finish`."""

    def __init__(self, cfg: Config, run_id: Optional[str] = None, parent_run_id: Optional[str] = None):
        self.cfg, self.run_id, self.parent_run_id = cfg, run_id, parent_run_id
        self.owns_run = False  # True once this tracker opened the run: then it ends it too
        self.uri = tracking_uri(cfg)
        self.client = None
        self.pending: list = []  # logged since the last report, not on disk yet
        self.lost = 0  # points dropped from memory past tracking.buffer_max_points while the disk had no room
        self.spool = MetricSpool(RunPaths.of(cfg).metric_buffer, cfg.tracking.buffer_max_points)
        self.logged_through = self.spool.through  # steps <= this are recorded already (a restarted rank 0)
        self.params: dict = {}
        self.params_logged = False
        self.failures = 0
        self.sysmon = None

    def _connect(self) -> bool:
        if self.client is not None and self.run_id is not None:
            return True
        try:
            crash_point("mlflow.connect")
            self.client = client_for(self.uri)
            if self.run_id is None:
                self.run_id, self.owns_run = open_run(self.cfg, self.parent_run_id), True
            # a run logged before its metrics went through the buffer: what the store has counts too
            hist = self.client.get_metric_history(self.run_id, "ctrl/lambda")
            self.logged_through = max([self.logged_through, *(m.step for m in hist)])
            return True
        except Exception as e:  # noqa: BLE001 - tracking must never kill training
            self._warn("connect", e)
            self.client = None if self.run_id is None else self.client
            return False

    def _warn(self, what: str, e: Exception) -> None:
        self.failures += 1
        if self.failures <= 3 or self.failures % 50 == 0:
            warnings.warn(f"MLflow {what} failed ({redact_uri(self.uri)}): {type(e).__name__}: "
                          f"{redact_uri(str(e))[:200]}; {self.waiting()} wait and are sent at the next report")

    def waiting(self) -> str:
        """Where the unsent points wait, in words: on disk (the spool), and in memory when the disk had no room."""
        in_memory = f" and {len(self.pending)} in memory (no room on disk)" if self.pending else ""
        return f"{self.spool.waiting} metric points in {self.spool.path}{in_memory}"

    def start(self, params: dict, resumed_at: int = 0) -> None:
        self.params = params
        if self._connect():
            self._log_params()
            self._start_system_metrics()

    def _log_params(self) -> None:
        if self.params_logged:
            return
        try:
            log_params_once(self.client, self.run_id, self.params)
            self.params_logged = True
        except Exception as e:  # noqa: BLE001
            self._warn("log params", e)

    def _start_system_metrics(self) -> None:
        on = self.cfg.tracking.system_metrics
        if on is None:
            import torch

            on = torch.cuda.is_available()
        if not on or self.sysmon is not None:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.sysmon = SystemMetricsMonitor(self.run_id, sampling_interval=10, resume_logging=True,
                                               tracking_uri=self.uri)
            self.sysmon.start()
        except Exception as e:  # noqa: BLE001
            self._warn("system metrics", e)

    def log_step(self, row: dict, step: Optional[int] = None) -> None:
        from mlflow.entities import Metric

        step = int(row["step"] if step is None else step)
        if step <= self.logged_through:
            return  # already recorded before a restart: no duplicate steps
        ts = int(time.time() * 1000)
        self.pending.extend(Metric(k, float(v), ts, step) for k, v in row.items()
                            if k != "step" and isinstance(v, (int, float)))

    def flush(self) -> None:
        """The points since the last report to disk, then every waiting point to the store, oldest first."""
        try:
            self.spool.append(self.pending)
            self.pending = []
        except OSError as e:  # no room for the buffer: they wait in memory (bounded) for the next report
            over = max(0, len(self.pending) - self.cfg.tracking.buffer_max_points)
            del self.pending[:over]
            self.lost += over
            self._warn("buffer to disk", e)
        if not (self.spool.waiting or self.pending) or not self._connect():
            return
        self._log_params()
        try:
            for offset, batch in self.spool.batches():
                crash_point("mlflow.log_batch")
                self.client.log_batch(self.run_id, metrics=batch)
                crash_point("mlflow.logged")  # the store has the batch, the spool does not know yet
                self.spool.mark_sent(offset, len(batch))
            while self.pending:  # newer than the spool's, held in memory: they go straight to the store
                batch = self.pending[:SEND_BATCH]
                self.client.log_batch(self.run_id, metrics=batch)
                del self.pending[:len(batch)]
        except Exception as e:  # noqa: BLE001
            self._warn("log metrics", e)

    def _stop_system_metrics(self) -> None:
        if self.sysmon is not None:
            try:
                self.sysmon.finish()
            except Exception as e:  # noqa: BLE001
                self._warn("system metrics", e)
            self.sysmon = None

    def pause(self) -> None:
        """The loop stops for a preemption's restart, the run not over: the metrics so far to the store and the
        system-metrics monitor stopped (the restarted loop starts its own), the run left open."""
        self.flush()
        self._stop_system_metrics()

    def finish(self, history: list, model=None, status: str = "FINISHED") -> None:
        """The last metrics and the artifacts; ``status`` ends the run only if this tracker opened it."""
        self.flush()
        self._stop_system_metrics()
        unrecorded = []
        if self.client is None or self.run_id is None:
            unrecorded.append("everything (no connection to the tracking server)")
        else:
            try:
                self._log_artifacts(history, model)
                if self.owns_run:
                    crash_point("mlflow.terminate")
                    self.client.set_terminated(self.run_id, status=status)
            except Exception as e:  # noqa: BLE001
                self._warn("log artifacts", e)
                unrecorded.append("artifacts (config, history, plots, adapter)")
        if self.spool.waiting:
            unrecorded.append(f"{self.spool.waiting} metric points (kept in {self.spool.path}: the next run of this "
                              f"name on this machine sends them)")
        if self.pending:  # in memory only, with no room on disk: they end with this process
            unrecorded.append(f"{len(self.pending)} metric points lost (no room on disk to keep them)")
        if self.spool.dropped + self.lost:
            unrecorded.append(f"{self.spool.dropped + self.lost} metric points dropped from a full buffer "
                              f"(tracking.buffer_max_points)")
        if unrecorded:
            warnings.warn(f"MLflow ({redact_uri(self.uri)}) did not record: " + "; ".join(unrecorded))

    def _log_artifacts(self, history: list, model) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            (t / "config.yaml").write_text(to_yaml(self.cfg, redact=True))
            (t / "scu_history.json").write_text(json.dumps(history))
            crash_point("mlflow.artifact")
            self.client.log_artifact(self.run_id, str(t / "config.yaml"))
            self.client.log_artifact(self.run_id, str(t / "scu_history.json"))
            plots = t / "plots"
            plot_history(history, plots, target_s=self.cfg.controller.target_s, title=self.cfg.run.name)
            crash_point("mlflow.artifact")
            self.client.log_artifacts(self.run_id, str(plots), artifact_path="plots")
            # the last step's adapter: "adapter" under primary_adapter=last (output/adapter is the last step's then);
            # else "adapter_last", and the driver logs output/adapter as "adapter" (the best checkpoint's, or with
            # no best checkpoint the last step's)
            if model is not None:
                name = "adapter" if self.cfg.run.primary_adapter == "last" else "adapter_last"
                model.save_pretrained(str(t / name), safe_serialization=True)
                crash_point("mlflow.artifact")
                self.client.log_artifacts(self.run_id, str(t / name), artifact_path=name)


def for_rank(cfg: Config, rank: int, run_id: Optional[str] = None, parent_run_id: Optional[str] = None):
    """A real tracker on rank 0 when tracking is on, else a no-op."""
    if rank != 0 or not cfg.tracking.enabled:
        return NullTracker()
    return MlflowTracker(cfg, run_id=run_id, parent_run_id=parent_run_id)
