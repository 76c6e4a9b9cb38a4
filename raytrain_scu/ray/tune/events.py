"""The sweep's console: one line per trial event (started, a report, stopped by the scheduler, finished, failed), each
naming the trial and its values, in place of Tune's own status tables (:class:`TrialEvents`, a Tune callback in the
sweep's driver)."""
from __future__ import annotations

import math
import sys
from typing import Optional, TextIO

from ray import cloudpickle, tune

from raytrain_scu.config.schema import Config
from raytrain_scu.console import RESUMED_AT, VAL_STEP, fmt_eta, resumed_steps
from raytrain_scu.ray.tune.results import error_line
from raytrain_scu.ray.tune.space import arm_text, plain_value


def _value(v) -> str:
    v = plain_value(v)
    if isinstance(v, dict):  # an arm
        return arm_text(v)
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def params_text(config: dict, space: dict) -> str:
    """A trial's swept values, ``key=value`` with the keys as the space names them, in its order."""
    return " ".join(f"{key}={_value(config[key])}" for key in space if key in config)


def _metric(result: dict, metric: str) -> str:
    value = result.get(metric)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{metric} -"
    at = result.get(VAL_STEP)
    stale = metric.startswith("val/") and at is not None and int(at) != int(result.get("step", at))
    return f"{metric} {value:.4g}" + (f" @{int(at)}" if stale else "")


def trial_error(trial) -> Optional[BaseException]:
    """The exception a trial failed with, as Tune pickled it beside the trial (read locally: the copy in the sweep's
    storage may not be synced yet when the callback runs); None if there is none."""
    path = trial.pickled_error_file
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    except Exception:  # noqa: BLE001 - the line then says "unknown error"
        return None


class TrialEvents(tune.Callback):
    """Tune callback in the sweep's driver: a ``[raytrain_scu] trial ...`` line when a trial starts, at each report,
    and when it ends (finished, stopped early by the scheduler, failed)."""

    def __init__(self, cfg: Config, space: dict, stream: Optional[TextIO] = None):
        self.cfg, self.space, self.stream = cfg, space, stream
        self.last: dict[str, dict] = {}

    def _say(self, text: str) -> None:
        print(f"[raytrain_scu] {text}", file=self.stream or sys.stdout, flush=True)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._say(f"trial {trial.trial_id} started: {params_text(trial.config, self.space)}")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if "step" not in result:
            return
        before = resumed_steps((self.last.get(trial.trial_id) or {}).get(RESUMED_AT))
        resumed = resumed_steps(result.get(RESUMED_AT))
        if len(resumed) > len(before):  # its Train run restarted (a worker lost, a re-run of the sweep)
            self._say(f"trial {trial.trial_id} resumed from its checkpoint at step {resumed[-1]} (restart "
                      f"{len(resumed)}); {params_text(trial.config, self.space)}")
        self.last[trial.trial_id] = result
        tokens = result.get("tokens_seen")
        self._say(f"trial {trial.trial_id} step {int(result['step'])}/{self.cfg.train.max_steps}  "
                  f"{_metric(result, self.cfg.tune.metric)}"
                  + (f"  tokens {int(tokens):,}" if tokens is not None else "")
                  + (f"  ETA {fmt_eta(result['time/eta_s'])}" if "time/eta_s" in result else ""))

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = self.last.get(trial.trial_id) or trial.last_result or {}
        step = r.get("step")
        ended = step is not None and (step >= self.cfg.train.max_steps or r.get("ctrl/saturated_step") is not None)
        t = self.cfg.tune
        how = "finished" if ended else (f"stopped by {'ASHA' if t.scheduler == 'asha' else 'Tune'}"
                                        + ("" if t.scheduler == "asha" else " (tune.time_budget_s)"))
        self._say(f"trial {trial.trial_id} {how} at step {step}: {_metric(r, t.metric)}; "
                  f"{params_text(trial.config, self.space)}")

    def on_trial_error(self, iteration, trials, trial, **info):
        step = (self.last.get(trial.trial_id) or {}).get("step")
        self._say(f"trial {trial.trial_id} failed" + (f" at step {step}" if step is not None else "")
                  + f": {error_line(trial_error(trial))}; {params_text(trial.config, self.space)}")

