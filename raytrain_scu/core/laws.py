"""The control laws on λ, one table entry each (``controller.law``): every law keeps the quantities, telemetry,
state-in-checkpoint and exact-resume rules of SCU_SPEC.md and states its own update in its docstring."""
from __future__ import annotations

from raytrain_scu.config.schema import ControllerConfig
from raytrain_scu.core.controller import SCUController, from_config

# controller.law -> a builder from the controller's config section
LAWS = {"spec": from_config}


def build_law(c: ControllerConfig):
    """The law ``controller.law`` names, built from its config section."""
    return LAWS[c.law](c)


__all__ = ["LAWS", "SCUController", "build_law"]
