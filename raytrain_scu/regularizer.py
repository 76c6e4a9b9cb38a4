"""The spec's public import path for ParamBPT (``from raytrain_scu.regularizer import param_bpt``). It lives in
:mod:`raytrain_scu.core.regularizer`."""
from raytrain_scu.core.regularizer import adapter_params, param_bpt, penalty_nats

__all__ = ["adapter_params", "param_bpt", "penalty_nats"]
