"""The spec's public import path for the SCU law (``from raytrain_scu.controller import SCUController``): pure Python,
no torch, ray or mlflow. The law lives in :mod:`raytrain_scu.core.controller`."""
from raytrain_scu.core.controller import SCUController, from_config, info_ratio

__all__ = ["SCUController", "from_config", "info_ratio"]
