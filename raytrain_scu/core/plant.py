"""A plant model of LoRA training under the SCU penalty: ParamBPT and DataBPT as λ and the learning rate move them.
Pure Python (NumPy only for the noise): no torch, ray or mlflow.

It is fitted to the GPU study's traces (``python -m raytrain_scu.studies.control.fit_plant``, docs/control.md) and
exists to screen control laws cheaply. ParamBPT has three parts, in bits per token at the study's σ and N:

- R, A's random init that is left. Under Adam every weight moves about one learning-rate step per step while the
  penalty dominates its gradient, so each |w| of A's uniform init shrinks linearly and R = R0·ρ³ with ρ falling by
  κ·ℓ·f per step (ℓ = lr / 2e-3). f = π/√(π² + ν²) is the penalty's share of the Adam-normalised gradient:
  π = λ·k·√R, ν = n_R·b + n0. Until B has grown (ν ≈ n0) any λ well above n0/(k√R) shrinks A at the full rate:
  λ acts as a switch, as measured.
- a² and b², the learned A and B norms. Each moves by η·ℓ·(g − π)/√(g² + π² + n0²) per step, the drive g less
  the penalty π = λ·k·norm, Adam-normalised against the gradient noise n0: at most η·ℓ per step (the slew limit),
  in proportion to g − π near equilibrium. B's drive is √(a² + ε_R·R)·h (A's columns, random or learned, are B's
  features), A's is b·h. The drive fades as the adapter fits: h = 1 / (1 + (a·b / s0)^p). At equilibrium
  h = λ·k, so ln P_eq falls by about 1/p per unit of ln λ: the static gain. A norm falls by at most a factor
  exp(−c_tail·ℓ) per step.
- DataBPT = D0 + noise − δ, δ = g_D·ln(1 + b²/s_D) + M, M += μ·ℓ·b² (memorising), and DataBPT ≥ ``data_floor``.
  The noise is the batch's: white, ``noise`` bits per step.

Perturbation knobs (``Plant`` fields) scale what the study could not vary: ``gain`` (λ enters as
0.1·(λ/0.1)^gain, so d ln P_eq / d ln λ scales by it and λ = 0.1 keeps its equilibrium),
``lag`` (λ reaches the plant through a first-order lag of that many steps), ``speed`` (the learned norms' η),
``init_scale`` (R0; LoRA r 64 has 4× the A entries of r 16), ``p_scale`` (σ²N: ParamBPT and the penalty per λ
both scale by it), ``noise``, ``data_bpt0``. The learning-rate schedule is the loop's (``core.schedule``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from raytrain_scu.core import laws
from raytrain_scu.core.schedule import lr_factors

LR_REF = 2e-3  # the learning rate the fit's rates are per step at
LOG_PIVOT = math.log(0.1)  # the gain knob turns ln λ about the study's best fixed λ, 0.1
# Copied from docs/control/plant_fit.json, which ``python -m raytrain_scu.studies.control.fit_plant`` writes (a test
# checks they agree): the fit on the study's seeds 0 and 1, seed 3 held out.
FITTED = {
    "remnant_init": 65.0, "feature_remnant": 9.9468, "fit_scale": 0.0018008, "fit_power": 0.77162,
    "penalty_scale": 0.1206, "speed_b": 0.29179, "speed_a": 0.021843, "grad_noise": 0.067873,
    "remnant_rate": 0.056117, "remnant_noise": 0.0010286, "a_init": 1.3673, "tail_rate": 0.18187,
    "drop_scale": 0.13678, "drop_knee": 0.078822, "memorise": 0.00022633, "noise": 0.15589, "data_bpt0": 5.0508,
    "data_floor": 0.03,
}

FITTED_FIRST_ORDER = {"a": -2.296, "b": 0.99627, "log_tau": -1.323, "s_down": 0.16258, "s_up": 0.10337}  # its baseline


@dataclass(frozen=True)
class Plant:
    """The fitted constants (``FITTED``) and the perturbation knobs; ``start`` gives a run's state."""
    params: dict = field(default_factory=lambda: dict(FITTED))
    gain: float = 1.0  # λ reaches the plant as LAM_PIVOT·(λ/LAM_PIVOT)^gain: multiplies the static gain
    lag: float = 0.0  # steps of first-order lag between λ and the plant (0 = none)
    speed: float = 1.0  # multiplies the learned norms' slew η
    init_scale: float = 1.0  # multiplies A's init part R0
    p_scale: float = 1.0  # σ²N relative to the study's: ParamBPT and the penalty per λ scale by it
    noise: Optional[float] = None  # DataBPT noise, bits per step (None = the fitted)
    kind: str = "mean_field"  # mean_field (above) | first_order (the one-state slew model, a check)
    data_bpt0: Optional[float] = None  # DataBPT of the bare base model (None = the fitted)

    def with_(self, **knobs) -> "Plant":
        return replace(self, **knobs)

    def start(self, seed: int = 0) -> "PlantState":
        return KINDS[self.kind](self, seed)


class PlantState:
    """One run of a ``Plant``: ``measure`` gives the step's (DataBPT, ParamBPT), ``advance`` applies the step."""

    def __init__(self, plant: Plant, seed: int):
        p = plant.params
        self.plant, self._p = plant, p
        self.rho, self.a, self.b, self.memo = 1.0, p["a_init"], 0.0, 0.0
        self.r0 = p["remnant_init"] * plant.init_scale
        self.log_lam_eff: Optional[float] = None
        self._rng = np.random.default_rng(seed)
        self._noise = p["noise"] if plant.noise is None else plant.noise
        self._d0 = p["data_bpt0"] if plant.data_bpt0 is None else plant.data_bpt0
        self._power = p["fit_power"]

    def parts(self) -> tuple[float, float]:
        """ParamBPT's A and B parts now."""
        c = self.plant.p_scale
        return c * (self.r0 * self.rho ** 3 + self.a * self.a), c * self.b * self.b

    def measure(self) -> tuple[float, float]:
        """(DataBPT, ParamBPT) of the coming step: ParamBPT of the weights as they stand, DataBPT with its noise."""
        pa, pb = self.parts()
        p = self._p
        drop = p["drop_scale"] * math.log1p(self.b * self.b / p["drop_knee"]) + self.memo
        data_bpt = self._d0 + self._noise * float(self._rng.standard_normal()) - drop
        return max(data_bpt, p["data_floor"]), pa + pb

    def advance(self, lam: float, lr: float) -> None:
        """One optimizer step at penalty weight ``lam`` and learning rate ``lr`` (absolute)."""
        plant = self.plant
        log_lam = math.log(lam) if lam > 0 else -math.inf
        if plant.lag > 0 and lam > 0:  # the first λ starts the lag where it stands
            prev = log_lam if self.log_lam_eff is None else self.log_lam_eff
            self.log_lam_eff = prev + (log_lam - prev) / (1.0 + plant.lag)
            log_lam = self.log_lam_eff
        if plant.gain != 1.0:
            log_lam = LOG_PIVOT + plant.gain * (log_lam - LOG_PIVOT)
        lam_c = (math.exp(log_lam) if log_lam > -math.inf else 0.0) * plant.p_scale
        b = self.b
        rho, a, b_new = norms_step(self.rho, self.a, b, self.r0, lam_c, lr / LR_REF, self._p,
                                   power=self._power, speed=plant.speed)
        self.rho, self.a, self.b = float(rho), float(a), float(b_new)
        self.memo += self._p["memorise"] * lr / LR_REF * b * b


class FirstOrderState(PlantState):
    """The one-state slew plant (docs/control.md's baseline), refitted like the model (``FITTED_FIRST_ORDER``):
    ln P moves towards a − b·ln λ by ℓ/τ of the gap per step, clipped to [−s_down·ℓ, +s_up·ℓ]. It has no A/B split
    (all of P is reported as A) and no DataBPT drop: a structurally different plant to check a law against, not a
    better one."""

    def __init__(self, plant: Plant, seed: int):
        super().__init__(plant, seed)
        self.log_p = math.log(self.r0)

    def parts(self) -> tuple[float, float]:
        return self.plant.p_scale * math.exp(self.log_p), 0.0

    def advance(self, lam: float, lr: float) -> None:
        q, plant = FITTED_FIRST_ORDER, self.plant
        log_lam = math.log(max(lam, 1e-12))
        if plant.lag > 0:
            prev = log_lam if self.log_lam_eff is None else self.log_lam_eff
            self.log_lam_eff = log_lam = prev + (log_lam - prev) / (1.0 + plant.lag)
        log_lam = LOG_PIVOT + plant.gain * (log_lam - LOG_PIVOT) + math.log(plant.p_scale)
        ell = lr / LR_REF
        gap = (q["a"] - q["b"] * log_lam - self.log_p) / math.exp(q["log_tau"]) * plant.speed
        self.log_p += ell * min(max(gap, -q["s_down"] * plant.speed), q["s_up"] * plant.speed)


def norms_step(rho, a, b, r0, lam, ell, p: dict, *, power, speed=1.0):
    """One step of A's init part (ρ) and the learned norms a, b (module docstring) under penalty weight ``lam``
    (already times p_scale) at ℓ = lr / LR_REF. NumPy-broadcasting: the fit runs it on arrays of runs and of
    parameter sets, the plant on floats. Returns (ρ, a, b)."""
    n0, lam_k = p["grad_noise"], lam * p["penalty_scale"]
    remnant = r0 * rho ** 3
    h = 1.0 / (1.0 + (a * b / p["fit_scale"]) ** power)
    features = np.sqrt(a * a + p["feature_remnant"] * remnant)
    b_new = b + p["speed_b"] * speed * ell * _adam(features * h, lam_k * b, n0)
    a_new = a + p["speed_a"] * speed * ell * _adam(b * h, lam_k * a, n0)
    # the init part has no drive of its own: only the penalty's pull, against the data gradient's noise on A
    rho = np.maximum(0.0, rho + p["remnant_rate"] * ell * _adam(0.0, lam_k * np.sqrt(remnant),
                                                               p["remnant_noise"] * b + n0))
    floor = np.exp(-p["tail_rate"] * ell)
    return rho, np.maximum(a_new, floor * a), np.maximum(b_new, floor * b)


def _adam(drive, penalty, noise):
    """The Adam-normalised pull of a norm: (drive − penalty) / √(drive² + penalty² + noise²), in [−1, 1]."""
    return (drive - penalty) / np.sqrt(drive * drive + penalty * penalty + noise * noise)


KINDS = {"mean_field": PlantState, "first_order": FirstOrderState}


def simulate(law, plant: Plant, steps: int, *, lr: float = LR_REF, warmup_steps: int = 20,
             min_lr_ratio: float = 0.1, seed: int = 0) -> dict:
    """Run ``law`` (any object with ``update(data_bpt, param_bpt, step=...)`` and ``lam``) in closed loop on
    ``plant`` for ``steps`` optimizer steps, as the training loop does: step t applies the λ of the last update,
    measures DataBPT and ParamBPT, steps the plant, then updates the law through ``laws.update`` (laws with
    ``takes_lr_factor`` also get the step's lr / peak lr). A fixed λ is ``SCUController(mode="fixed")``. Returns
    per-step lists: step, lr, lam_applied, lam (after the update), data_bpt, param_bpt, param_bpt_a, param_bpt_b,
    s, s_hat."""
    state = plant.start(seed)
    keys = ("step", "lr", "lam_applied", "lam", "data_bpt", "param_bpt", "param_bpt_a", "param_bpt_b", "s", "s_hat")
    out: dict = {k: [] for k in keys}
    for t, factor in enumerate(lr_factors(steps, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio)):
        lam = law.lam
        pa, pb = state.parts()
        data_bpt, param_bpt = state.measure()
        state.advance(lam, lr * factor)
        laws.update(law, data_bpt, param_bpt, step=t + 1, lr_factor=factor)
        row = (t + 1, lr * factor, lam, law.lam, data_bpt, param_bpt, pa, pb, law.s, law.s_hat)
        for k, v in zip(keys, row):
            out[k].append(v)
    return out

