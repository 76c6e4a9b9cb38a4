"""λ held at a bound of the SCU law: a stretch longer than ``controller.bound_notice_steps`` steps is said once, with
which bound, since when, what it means and what to try (:class:`BoundWatch`). Pure Python, like the controller."""
from __future__ import annotations

from typing import Optional

from raytrain_scu.config.schema import ControllerConfig

# (bound, Ŝ on the side the bound pushes it toward?) -> what it means, what to try. The two "crossed" cases are the
# spec's law's (its integral holds λ); LOGODDS_CROSSED replaces them under controller.law=logodds.
MEANINGS = {
    ("upper", False): ("S* is out of reach at these σ and N: even the largest λ leaves Ŝ above S* (ParamBPT = "
                       "Σw²/(2σ²N ln 2) is large against DataBPT)",
                       "a larger controller.prior_sigma (ParamBPT scales as 1/σ²), a larger controller.target_s, or "
                       "a larger controller.lambda_max"),
    ("upper", True): ("Ŝ is already below S*, yet λ stays up: the plant is saturated (the adapters are pressed "
                      "so far that more λ no longer moves S) and the integral, wound up while Ŝ was above S*, "
                      "holds λ there until the leak unwinds it",
                      "smaller controller.ki or controller.integral_limit, a smaller controller.lambda_max, or a "
                      "controller.target_s near the S a fixed λ settles at"),
    ("lower", False): ("S* is out of reach at these σ and N: even the smallest λ leaves Ŝ below S* (the adapters "
                       "do not grow enough for ParamBPT to take S*'s share)",
                       "a smaller controller.target_s, a smaller controller.prior_sigma, or a smaller "
                       "controller.lambda_min"),
    ("lower", True): ("Ŝ is already above S*, yet λ stays down: the plant is saturated and the integral, wound "
                      "down while Ŝ was below S*, holds λ there until the leak unwinds it",
                      "smaller controller.ki or controller.integral_limit, or a larger controller.lambda_min"),
}
# the logodds law holds no integral apart from ln λ: past S*, λ leaves the bound at its integral rate, Ki·ℓ·ε per
# update, which a decayed learning rate (ℓ = lr / peak) makes slow, and not at all while a large error
# (|ε| > logodds_hold_error) is closing
LOGODDS_CROSSED = {
    "upper": ("Ŝ is already below S*, yet λ stays up: the plant is saturated (more λ no longer moves S) and the "
              "logodds law moves ln λ back by its integral term, which the decayed learning rate keeps small (and "
              "which holds while a large error is closing)",
              "a larger controller.logodds_ki or controller.logodds_hold_error, a smaller controller.lambda_max, or a "
              "controller.target_s near the S a fixed λ settles at"),
    "lower": ("Ŝ is already above S*, yet λ stays down: the plant is saturated and the logodds law moves ln λ "
              "back by its integral term, which the decayed learning rate keeps small (and which holds while a large "
              "error is closing)",
              "a larger controller.logodds_ki or controller.logodds_hold_error, or a larger controller.lambda_min"),
}


class BoundWatch:
    """Counts the consecutive steps λ sits at ``lambda_min`` or ``lambda_max``; :meth:`update` returns the notice
    once per stretch, at the step the stretch passes ``bound_notice_steps``."""

    def __init__(self, c: ControllerConfig):
        self.c = c
        self.bound: Optional[str] = None  # "upper" | "lower" while λ sits at one
        self.since = 0  # the first step of the stretch
        self.said = False

    def state_dict(self) -> dict:
        """The stretch so far (checkpointed, so a resumed run neither restarts it nor says it again)."""
        return {"bound": self.bound, "since": self.since, "said": self.said}

    def load_state_dict(self, state: dict) -> None:
        self.bound, self.since, self.said = state["bound"], int(state["since"]), bool(state["said"])

    def update(self, step: int, lam: float, s_hat: float) -> Optional[str]:
        """After optimizer step ``step``, whose update left λ at ``lam`` and Ŝ at ``s_hat``: the notice, or None."""
        c = self.c
        if c.mode != "scu" or c.bound_notice_steps == 0:
            return None
        bound = "upper" if lam >= c.lambda_max else "lower" if lam <= c.lambda_min else None
        if bound != self.bound:
            self.bound, self.since, self.said = bound, step, False
        if bound is None or self.said or step - self.since + 1 <= c.bound_notice_steps:
            return None
        self.said = True
        crossed = s_hat < c.target_s if bound == "upper" else s_hat > c.target_s
        meaning, tries = LOGODDS_CROSSED[bound] if crossed and c.law == "logodds" else MEANINGS[(bound, crossed)]
        value, key = (c.lambda_max, "lambda_max") if bound == "upper" else (c.lambda_min, "lambda_min")
        return (f"λ has sat at its {bound} bound {value:g} (controller.{key}) since step {self.since} "
                f"({step - self.since + 1} steps; Ŝ {s_hat:.3g}, S* {c.target_s:g}): {meaning}. Try {tries}.")
