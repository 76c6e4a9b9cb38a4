"""The Shannon Control Unit: a PI controller on the LoRA regularisation weight λ. Pure Python.

The law (../SCU_SPEC.md), applied once per control update with DataBPT and ParamBPT of the optimizer step::

    S  = ParamBPT / (DataBPT + ParamBPT)          (0 when the denominator is 0)
    1. DataBPT or ParamBPT not finite -> change nothing, count a skipped update, return λ
    2. Ŝ <- S on the first update, else Ŝ <- α·S + (1-α)·Ŝ
    3. e <- Ŝ - S*
    4. |e| <= deadband -> I <- leak·I, return λ unchanged
    5. I <- leak·I
    6. unless (λ <= λmin and e < 0) or (λ >= λmax and e > 0):  I <- clip(I + Ki·e, -I_lim, +I_lim)
    7. u <- Kp·e + I
    8. λ <- clip(λ·exp(u), λmin, λmax)

S above target means e > 0, so λ grows, the adapter weights shrink and S falls.

Modes share this one code path: ``scu`` runs the law; ``fixed`` keeps λ = lambda_init and ``none`` keeps
λ = 0, both still measuring S and Ŝ (steps 1-3) for telemetry.

Saturation: after each update, saturated when over the last ``saturation_window`` updates
max(λ)/min(λ) - 1 < ``saturation_rel_tol`` and |Ŝ - S*| <= max(deadband, 0.05·S*); the first such step is kept.

This module imports no torch, ray or mlflow (only config.py, for its defaults and checks): tools outside the
package use it on plain floats.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional

from raytrain_scu.config.checks import check_controller
from raytrain_scu.config.schema import ControllerConfig

MODES = ("scu", "fixed", "none")
_D = ControllerConfig()  # the keyword defaults of SCUController (SCU_SPEC's public API) are the config's


def info_ratio(data_bpt: float, param_bpt: float) -> float:
    """S = ParamBPT / (DataBPT + ParamBPT), 0 when the denominator is 0."""
    den = data_bpt + param_bpt
    return param_bpt / den if den != 0 else 0.0


class SaturationWindow:
    """The spec's "λ has settled" signal, shared by every law: over the last ``size`` updates
    max(λ)/min(λ) − 1 < ``rel_tol`` (equal values count, λ = 0 included), while the law's own band on Ŝ holds.
    Keeps the first step at which both hold."""

    def __init__(self, size: int, rel_tol: float):
        self.size, self.rel_tol = int(size), float(rel_tol)
        self.lams: deque = deque(maxlen=self.size)
        self.step: Optional[int] = None

    def flat(self) -> bool:
        """Whether the window is full and λ moved less than ``rel_tol`` across it."""
        if len(self.lams) < self.size:
            return False
        hi, lo = max(self.lams), min(self.lams)
        return hi == lo or (lo > 0 and hi / lo - 1.0 < self.rel_tol)

    def record(self, lam: float, step: int, near: bool) -> None:
        """Add an update's λ; ``near``: Ŝ is within the law's band around S*."""
        self.lams.append(lam)
        if self.step is None and near and self.flat():
            self.step = step

    def state_dict(self) -> dict:
        return {"lam_window": list(self.lams), "saturated_step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.lams = deque((float(x) for x in state["lam_window"]), maxlen=self.size)
        sat = state["saturated_step"]
        self.step = None if sat is None else int(sat)


class SCUController:
    """PI control of λ so that the information ratio S tracks ``target_s`` (see the module docstring)."""

    def __init__(self, target_s: float = _D.target_s, kp: float = _D.kp, ki: float = _D.ki,
                 ema_alpha: float = _D.ema_alpha, deadband: float = _D.deadband, leak: float = _D.leak,
                 integral_limit: float = _D.integral_limit, lambda_init: float = _D.lambda_init,
                 lambda_min: float = _D.lambda_min, lambda_max: float = _D.lambda_max,
                 saturation_window: int = _D.saturation_window, saturation_rel_tol: float = _D.saturation_rel_tol,
                 mode: str = "scu"):
        # defaults and checks live in config.py alone (ControllerConfig, check_controller): one truth for both. The
        # mode is the exception: this class is the SCU, so it is one unless told otherwise, whatever a run's default
        # controller.mode is
        check_controller(ControllerConfig(
            mode=mode, law="spec", target_s=target_s, kp=kp, ki=ki, ema_alpha=ema_alpha, deadband=deadband,
            leak=leak, integral_limit=integral_limit, lambda_init=lambda_init, lambda_min=lambda_min,
            lambda_max=lambda_max, saturation_window=saturation_window, saturation_rel_tol=saturation_rel_tol))
        self.target_s = float(target_s)
        self.kp, self.ki = float(kp), float(ki)
        self.ema_alpha, self.deadband, self.leak = float(ema_alpha), float(deadband), float(leak)
        self.integral_limit = float(integral_limit)
        self.lambda_init, self.lambda_min, self.lambda_max = float(lambda_init), float(lambda_min), float(lambda_max)
        self.saturation_window, self.saturation_rel_tol = int(saturation_window), float(saturation_rel_tol)
        self.mode = mode
        self._lam = 0.0 if mode == "none" else self.lambda_init
        self._integral = 0.0
        self._s_hat = 0.0
        self._s = 0.0
        self._error = 0.0
        self._initialized = False
        self._n_updates = 0
        self._n_skipped = 0
        self._saturation = SaturationWindow(self.saturation_window, self.saturation_rel_tol)

    # read-only views of the state
    @property
    def lam(self) -> float:
        return self._lam

    @property
    def integral(self) -> float:
        return self._integral

    @property
    def s_hat(self) -> float:
        return self._s_hat

    @property
    def s(self) -> float:
        """S of the last accepted update."""
        return self._s

    @property
    def error(self) -> float:
        """Ŝ - S* of the last accepted update."""
        return self._error

    @property
    def n_updates(self) -> int:
        return self._n_updates

    @property
    def n_skipped(self) -> int:
        return self._n_skipped

    @property
    def saturated_step(self) -> Optional[int]:
        return self._saturation.step

    @property
    def saturated(self) -> bool:
        return self._saturation.step is not None

    def update(self, data_bpt: float, param_bpt: float, step: Optional[int] = None) -> float:
        """One control update from the optimizer step's global DataBPT and ParamBPT; returns the new λ.

        ``step`` (the optimizer step) is what the saturation detector records; it defaults to the update count.
        """
        data_bpt, param_bpt = float(data_bpt), float(param_bpt)
        # 1. non-finite input: change nothing
        if not (math.isfinite(data_bpt) and math.isfinite(param_bpt)):
            self._n_skipped += 1
            return self._lam
        self._n_updates += 1
        s = info_ratio(data_bpt, param_bpt)
        self._s = s
        # 2. EMA
        if not self._initialized:
            self._s_hat = s
            self._initialized = True
        else:
            self._s_hat = self.ema_alpha * s + (1.0 - self.ema_alpha) * self._s_hat
        # 3. error
        e = self._s_hat - self.target_s
        self._error = e
        if self.mode == "scu":
            self._pi_step(e)
        near = abs(self._s_hat - self.target_s) <= max(self.deadband, 0.05 * self.target_s)
        self._saturation.record(self._lam, self._n_updates if step is None else int(step), near)
        return self._lam

    def _pi_step(self, e: float) -> None:
        # 4. deadband with leak
        if abs(e) <= self.deadband:
            self._integral = self.leak * self._integral
            return
        # 5. leak
        self._integral = self.leak * self._integral
        # 6. conditional integration (anti-windup at both bounds)
        lam = self._lam
        if not ((lam <= self.lambda_min and e < 0) or (lam >= self.lambda_max and e > 0)):
            self._integral = min(max(self._integral + self.ki * e, -self.integral_limit), self.integral_limit)
        # 7-8. multiplicative update, clamped
        u = self.kp * e + self._integral
        self._lam = min(max(lam * math.exp(u), self.lambda_min), self.lambda_max)

    def state_dict(self) -> dict:
        """JSON-serialisable state; ``load_state_dict`` of it continues identically."""
        return {
            "mode": self.mode,
            "lam": self._lam,
            "integral": self._integral,
            "s_hat": self._s_hat,
            "s": self._s,
            "error": self._error,
            "initialized": self._initialized,
            "n_updates": self._n_updates,
            "n_skipped": self._n_skipped,
            **self._saturation.state_dict(),  # lam_window, saturated_step
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode", self.mode) != self.mode:
            raise ValueError(f"controller state is for mode {state['mode']!r}, this controller is {self.mode!r}")
        self._lam = float(state["lam"])
        self._integral = float(state["integral"])
        self._s_hat = float(state["s_hat"])
        self._s = float(state.get("s", 0.0))
        self._error = float(state.get("error", 0.0))
        self._initialized = bool(state["initialized"])
        self._n_updates = int(state["n_updates"])
        self._n_skipped = int(state["n_skipped"])
        self._saturation.load_state_dict(state)

    def __repr__(self) -> str:
        return (f"SCUController(mode={self.mode}, lam={self._lam:.6g}, s_hat={self._s_hat:.6g}, "
                f"target_s={self.target_s}, integral={self._integral:.6g}, updates={self._n_updates})")


def from_config(c) -> SCUController:
    """Build from a ``ControllerConfig`` (duck-typed: any object with its attribute names)."""
    return SCUController(target_s=c.target_s, kp=c.kp, ki=c.ki, ema_alpha=c.ema_alpha, deadband=c.deadband,
                         leak=c.leak, integral_limit=c.integral_limit, lambda_init=c.lambda_init,
                         lambda_min=c.lambda_min, lambda_max=c.lambda_max,
                         saturation_window=c.saturation_window, saturation_rel_tol=c.saturation_rel_tol,
                         mode=c.mode)
