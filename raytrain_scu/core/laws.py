"""Control laws for λ beside the spec's, one table entry each (``LAWS``), chosen by ``controller.law``. Pure Python.

``spec`` is ``SCUController``, the exact law of SCU_SPEC.md, unchanged. ``logodds`` is a PI law in ln λ on the
log-odds error, designed on the fitted plant model (``raytrain_scu.core.plant``; docs/control.md says why each
piece is there). Per update, with DataBPT D, ParamBPT P and the learning rate over its peak ℓ (``lr_factor``)::

    1. D or P not finite -> change nothing, count a skipped update, return λ   (the spec's rule)
    2. D̂ <- D on the first update, else D̂ <- α·D + (1-α)·D̂             (only D is filtered: P has no sampling noise)
    3. Ŝ = P / (D̂ + P);  ε = clip(logit Ŝ - logit S*, -e_max, +e_max)   (logit Ŝ = ln P - ln D̂)
    4. hold = |ε_raw| > e_hold and ε_raw·(ε_raw - ε_raw_prev) < 0             (far from S* and already closing)
    5. v = Kp·(ε - ε_prev) + (0 if hold else Ki·ℓ·ε)                        (ε_prev = ε on the first update)
    6. ln λ <- clip(ln λ + clip(v, -r, +r), ln λmin, ln λmax)

ε_raw is the log-odds error before the clip of step 3.

Step 5 is the velocity form of ln λ = Kp·ε + I with I += Ki·ℓ·ε: the proportional term is a true proportional term
on ln λ, not the spec's integral. The state is ln λ itself, so the clips of step 6 (the rate limit r and the bounds)
are the anti-windup: nothing accumulates beyond what is applied. ``integral`` reports I = ln λ - Kp·ε, the
integrator a positional PI would hold after back-calculation.

Step 4 is the anti-windup that knows the plant is slew-limited. Under Adam a weight moves about one learning-rate
step per step whatever λ is, so while ParamBPT already falls (or grows) towards the target, more λ buys nothing and
integrating a large error only winds up. Far from the target (|ε_raw| > e_hold) the law integrates only while the
error is not closing; near it, it is a plain PI. The A matrices' random init, which keeps S far above any target for
the first tens of steps (hundreds at a low learning rate) whatever λ does, is the case this handles: λ stays where
it was instead of climbing to its bound, and B, which grows meanwhile, is not held down by a wound-up λ.

Modes: ``scu`` runs the law; ``fixed`` and ``none`` measure S and Ŝ only, as in the spec. The saturation signal is
the spec's window rule: over the last ``saturation_window`` updates max λ / min λ − 1 < ``saturation_rel_tol`` and
|Ŝ − S*| ≤ 0.05·S* (the spec's law widens that band to its deadband when the deadband is larger; this law has none);
its first step is kept.
"""
from __future__ import annotations

import math
from typing import Optional

from raytrain_scu.config.checks import check_controller
from raytrain_scu.config.schema import ControllerConfig
from raytrain_scu.core.controller import SaturationWindow, SCUController, info_ratio
from raytrain_scu.core.controller import from_config as spec_from_config

_D = ControllerConfig()
_S_CLAMP = 1e-12  # Ŝ is clamped into [this, 1 - this] before its logit: P = 0 gives a large finite error


class LogOddsController:
    """PI control of ln λ on logit Ŝ − logit S*, with slew-aware conditional integration (module docstring)."""

    takes_lr_factor = True  # update() scales the integral gain by lr / peak lr
    # metrics beyond the spec's (ctrl/s, ctrl/s_hat, ctrl/error, ctrl/lambda, ctrl/integral, ctrl/skipped)
    TELEMETRY = {"ctrl/log_odds_error": "log_odds_error", "ctrl/raw_error": "raw_error", "ctrl/d_hat": "d_hat",
                 "ctrl/held": "held"}

    def __init__(self, target_s: float = _D.target_s, kp: float = _D.logodds_kp, ki: float = _D.logodds_ki,
                 data_alpha: float = _D.logodds_data_alpha, max_error: float = _D.logodds_max_error,
                 max_step: float = _D.logodds_max_step, hold_error: float = _D.logodds_hold_error,
                 lambda_init: float = _D.lambda_init, lambda_min: float = _D.lambda_min,
                 lambda_max: float = _D.lambda_max, saturation_window: int = _D.saturation_window,
                 saturation_rel_tol: float = _D.saturation_rel_tol, mode: str = "scu"):
        check_controller(ControllerConfig(
            mode=mode, law="logodds", target_s=target_s, lambda_init=lambda_init, lambda_min=lambda_min,
            lambda_max=lambda_max, saturation_window=saturation_window, saturation_rel_tol=saturation_rel_tol,
            logodds_kp=kp, logodds_ki=ki, logodds_data_alpha=data_alpha, logodds_max_error=max_error,
            logodds_max_step=max_step, logodds_hold_error=hold_error))
        self.target_s, self.mode = float(target_s), mode
        self.kp, self.ki, self.data_alpha = float(kp), float(ki), float(data_alpha)
        self.max_error, self.max_step, self.hold_error = float(max_error), float(max_step), float(hold_error)
        self.lambda_init, self.lambda_min, self.lambda_max = float(lambda_init), float(lambda_min), float(lambda_max)
        self.saturation_window, self.saturation_rel_tol = int(saturation_window), float(saturation_rel_tol)
        self._target_logit = math.log(self.target_s / (1.0 - self.target_s))
        self._lam = 0.0 if mode == "none" else self.lambda_init
        self._d_hat = self._s = self._s_hat = self._error = self._log_odds_error = self._raw_error = 0.0
        self._held = False
        self._initialized = False
        self._n_updates = self._n_skipped = 0
        self._saturation = SaturationWindow(self.saturation_window, self.saturation_rel_tol)

    # read-only views of the state (the spec's telemetry, plus log_odds_error, d_hat and held)
    lam = property(lambda self: self._lam)
    s = property(lambda self: self._s, doc="S of the last accepted update (raw DataBPT)")
    s_hat = property(lambda self: self._s_hat, doc="Ŝ = P / (D̂ + P) of the last accepted update")
    error = property(lambda self: self._error, doc="Ŝ − S* of the last accepted update")
    log_odds_error = property(lambda self: self._log_odds_error, doc="ε = logit Ŝ − logit S*, clipped")
    raw_error = property(lambda self: self._raw_error, doc="ε_raw = logit Ŝ − logit S*, before the clip")
    d_hat = property(lambda self: self._d_hat, doc="the filtered DataBPT D̂")
    held = property(lambda self: self._held, doc="the last update skipped integration: the error was closing")
    n_updates = property(lambda self: self._n_updates)
    n_skipped = property(lambda self: self._n_skipped)
    saturated_step = property(lambda self: self._saturation.step)
    saturated = property(lambda self: self._saturation.step is not None)

    @property
    def integral(self) -> float:
        """I = ln λ − Kp·ε: the integrator of the equivalent positional PI (0 outside scu mode)."""
        if self.mode != "scu" or self._lam <= 0:
            return 0.0
        return math.log(self._lam) - self.kp * self._log_odds_error

    def update(self, data_bpt: float, param_bpt: float, step: Optional[int] = None,
               lr_factor: Optional[float] = None) -> float:
        """One control update from the optimizer step's global DataBPT and ParamBPT; returns the new λ.

        ``step`` is what the saturation detector records (default: the update count). ``lr_factor`` is the learning
        rate of the step over the configured peak (default 1.0); it scales the integral gain, so the loop's gain
        follows the plant, whose speed is the learning rate's.
        """
        data_bpt, param_bpt = float(data_bpt), float(param_bpt)
        if not (math.isfinite(data_bpt) and math.isfinite(param_bpt)):
            self._n_skipped += 1
            return self._lam
        ell = 1.0 if lr_factor is None else max(0.0, float(lr_factor))
        self._n_updates += 1
        self._s = info_ratio(data_bpt, param_bpt)
        first = not self._initialized
        self._d_hat = data_bpt if first else self.data_alpha * data_bpt + (1.0 - self.data_alpha) * self._d_hat
        self._initialized = True
        self._s_hat = info_ratio(self._d_hat, param_bpt)
        self._error = self._s_hat - self.target_s
        s_c = min(max(self._s_hat, _S_CLAMP), 1.0 - _S_CLAMP)
        raw = math.log(s_c / (1.0 - s_c)) - self._target_logit
        eps = min(max(raw, -self.max_error), self.max_error)
        raw_prev, eps_prev = (raw, eps) if first else (self._raw_error, self._log_odds_error)
        self._raw_error, self._log_odds_error = raw, eps
        if self.mode == "scu":
            self._held = abs(raw) > self.hold_error and raw * (raw - raw_prev) < 0
            self._pi_step(eps - eps_prev, 0.0 if self._held else self.ki * ell * eps)
        near = abs(self._s_hat - self.target_s) <= 0.05 * self.target_s
        self._saturation.record(self._lam, self._n_updates if step is None else int(step), near)
        return self._lam

    def _pi_step(self, d_eps: float, integral_step: float) -> None:
        v = min(max(self.kp * d_eps + integral_step, -self.max_step), self.max_step)
        log_lam = math.log(self._lam) + v
        if log_lam <= math.log(self.lambda_min):  # exactly at a bound, so that "at a bound" is an equality
            self._lam = self.lambda_min
        elif log_lam >= math.log(self.lambda_max):
            self._lam = self.lambda_max
        else:
            self._lam = math.exp(log_lam)

    def state_dict(self) -> dict:
        """JSON-serialisable state; ``load_state_dict`` of it continues identically."""
        return {"law": "logodds", "mode": self.mode, "lam": self._lam, "d_hat": self._d_hat, "s": self._s,
                "s_hat": self._s_hat, "error": self._error, "log_odds_error": self._log_odds_error,
                "raw_error": self._raw_error,
                "held": self._held, "initialized": self._initialized, "n_updates": self._n_updates,
                "n_skipped": self._n_skipped, **self._saturation.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("law", "logodds"), ("mode", self.mode)):
            if state.get(key, mine) != mine:
                raise ValueError(f"controller state is for {key} {state[key]!r}, this controller is {mine!r}")
        self._lam, self._d_hat = float(state["lam"]), float(state["d_hat"])
        self._s, self._s_hat, self._error = float(state["s"]), float(state["s_hat"]), float(state["error"])
        self._log_odds_error, self._held = float(state["log_odds_error"]), bool(state["held"])
        self._raw_error = float(state["raw_error"])
        self._initialized = bool(state["initialized"])
        self._n_updates, self._n_skipped = int(state["n_updates"]), int(state["n_skipped"])
        self._saturation.load_state_dict(state)

    def __repr__(self) -> str:
        return (f"LogOddsController(mode={self.mode}, lam={self._lam:.6g}, s_hat={self._s_hat:.6g}, "
                f"target_s={self.target_s}, updates={self._n_updates})")

    @classmethod
    def from_config(cls, c) -> "LogOddsController":
        """Build from a ``ControllerConfig`` (duck-typed)."""
        return cls(target_s=c.target_s, kp=c.logodds_kp, ki=c.logodds_ki, data_alpha=c.logodds_data_alpha,
                   max_error=c.logodds_max_error, max_step=c.logodds_max_step,
                   hold_error=c.logodds_hold_error, lambda_init=c.lambda_init, lambda_min=c.lambda_min,
                   lambda_max=c.lambda_max, saturation_window=c.saturation_window,
                   saturation_rel_tol=c.saturation_rel_tol, mode=c.mode)


LAWS = {"spec": SCUController, "logodds": LogOddsController}
_BUILDERS = {"spec": spec_from_config, "logodds": LogOddsController.from_config}


def build(c):
    """The controller ``c.law`` names, built from a ``ControllerConfig``."""
    if c.law not in _BUILDERS:
        raise ValueError(f"controller.law: expected one of {', '.join(LAWS)}, got {c.law!r}")
    return _BUILDERS[c.law](c)


def telemetry(ctrl) -> dict:
    """A law's metrics beyond the spec's common ones (its ``TELEMETRY``: metric name -> attribute); none for the
    spec's law."""
    return {name: float(getattr(ctrl, attr)) for name, attr in getattr(type(ctrl), "TELEMETRY", {}).items()}


def update(ctrl, data_bpt: float, param_bpt: float, *, step: Optional[int] = None, lr_factor: float = 1.0) -> float:
    """One update of any law: passes ``lr_factor`` to the laws that take it (``takes_lr_factor``), not the spec's."""
    if getattr(ctrl, "takes_lr_factor", False):
        return ctrl.update(data_bpt, param_bpt, step=step, lr_factor=lr_factor)
    return ctrl.update(data_bpt, param_bpt, step=step)
