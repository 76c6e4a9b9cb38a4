"""The Mamba-2 mixers of a GraniteMoeHybrid model with the field's kernels (``mamba_ssm``, ``causal_conv1d``), with
their out projection kept a module.

transformers' training path hands the fused kernel ``self.out_proj.weight`` and lets the kernel do the out projection
itself: a LoRA adapter on ``out_proj`` then takes no part in the forward and gets no gradient, and a 4-bit ``out_proj``
hands over packed storage. :func:`keep_out_proj_a_module` makes each mixer call the kernel without the projection and
apply ``out_proj`` (with its adapter, or its 4-bit weight) after it. Where the kernel is absent the torch path runs as
before: it applies ``out_proj`` as a module already.
"""
from __future__ import annotations

import types

import torch


def _modeling():
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid

    return modeling_granitemoehybrid


def _forward(self, hidden_states, *args, **kwargs):
    """GraniteMoeHybridMambaLayer.forward's training branch with the out projection as a module; every other case
    (a cache, evaluation, no kernel) is transformers' own forward. transformers names the cache ``cache`` (5.24) or
    ``cache_params`` (5.17): both are read."""
    m = _modeling()
    cache = kwargs.get("cache", kwargs.get("cache_params", args[0] if args else None))
    attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if not (self.training and cache is None):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    projected = self.in_proj(m.apply_mask_to_padding_states(hidden_states, attention_mask))
    A = -torch.exp(self.A_log.float())
    extra = {"seq_idx": kwargs["seq_idx"]} if kwargs.get("seq_idx") is not None else {}
    out = m.mamba2_split_conv1d_scan_combined(
        projected, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, A, D=self.D,
        chunk_size=self.chunk_size, activation=self.activation, rmsnorm_weight=self.norm.weight,
        rmsnorm_eps=self.norm.variance_epsilon, outproj_weight=None, outproj_bias=None, headdim=self.head_dim,
        ngroups=self.n_groups, norm_before_gate=False, return_final_states=False, dt_limit=self.time_step_limit,
        **extra)
    if out is None:  # no kernel: the torch path, which applies out_proj as a module
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return self.out_proj(out)


def keep_out_proj_a_module(model) -> int:
    """Give every Mamba-2 mixer of ``model`` the forward above (an instance attribute: the class stays as it is);
    returns how many mixers changed."""
    cls = getattr(_modeling(), "GraniteMoeHybridMambaLayer", None)
    n = 0
    for module in model.modules():
        if cls is not None and isinstance(module, cls):
            # left out of torch.compile: inductor cannot compile the torch path's chunked scan, and the kernels are
            # compiled already; a compiled decoder layer runs its norms, attention and MLP compiled around this call
            module.forward = torch.compiler.disable(types.MethodType(_forward, module))
            n += 1
    return n
