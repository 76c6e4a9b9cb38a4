"""The Mamba-2 mixers of a GraniteMoeHybrid model with the field's kernels (``mamba_ssm``, ``causal_conv1d``), with
their out projection kept a module.

transformers' training path hands the fused kernel ``self.out_proj.weight`` and lets the kernel do the out projection
itself: a LoRA adapter on ``out_proj`` then takes no part in the forward and gets no gradient, and a 4-bit ``out_proj``
hands over packed storage. :func:`keep_out_proj_a_module` makes each mixer call the kernel without the projection and
apply ``out_proj`` (with its adapter, or its 4-bit weight) after it. Where the kernel is absent transformers' torch path
runs, which applies ``out_proj`` as a module already.
"""
from __future__ import annotations

import types

import torch


def _modeling():
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid

    return modeling_granitemoehybrid


@torch.compiler.disable
def _own_forward(self, hidden_states, *args, **kwargs):
    """transformers' own forward, out of torch.compile: inductor cannot compile the torch path's chunked scan."""
    return type(self).forward(self, hidden_states, *args, **kwargs)


@torch.compiler.disable
def _scan(self, projected, seq_idx):
    """The fused kernel from the split of in_proj's output to the gated RMSNorm, without the out projection; None
    where the kernel is absent. Out of torch.compile: the kernels are compiled already (Triton and CUDA)."""
    A = -torch.exp(self.A_log.float())
    extra = {"seq_idx": seq_idx} if seq_idx is not None else {}
    return _modeling().mamba2_split_conv1d_scan_combined(
        projected, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, A, D=self.D,
        chunk_size=self.chunk_size, activation=self.activation, rmsnorm_weight=self.norm.weight,
        rmsnorm_eps=self.norm.variance_epsilon, outproj_weight=None, outproj_bias=None, headdim=self.head_dim,
        ngroups=self.n_groups, norm_before_gate=False, return_final_states=False, dt_limit=self.time_step_limit,
        **extra)


def _forward(self, hidden_states, *args, **kwargs):
    """GraniteMoeHybridMambaLayer.forward's training branch with the out projection as a module; every other case
    (a cache, evaluation, no kernel) is transformers' own forward. transformers names the cache ``cache`` (5.24) or
    ``cache_params`` (5.17): both are read. Under a compiled decoder layer, in_proj and out_proj (with their adapters)
    compile, each in a graph of its own (dynamo traces this method as a frame of its own and breaks it at the
    kernel), and only the kernel runs outside a graph."""
    cache = kwargs.get("cache", kwargs.get("cache_params", args[0] if args else None))
    attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if not (self.training and cache is None):
        return _own_forward(self, hidden_states, *args, **kwargs)
    projected = self.in_proj(_modeling().apply_mask_to_padding_states(hidden_states, attention_mask))
    out = _scan(self, projected, kwargs.get("seq_idx"))
    if out is None:  # no kernel: the torch path, which applies out_proj as a module
        return _own_forward(self, hidden_states, *args, **kwargs)
    return self.out_proj(out)


def keep_out_proj_a_module(model) -> int:
    """Give every Mamba-2 mixer of ``model`` the forward above (an instance attribute: the class stays as it is);
    returns how many mixers changed."""
    cls = getattr(_modeling(), "GraniteMoeHybridMambaLayer", None)
    n = 0
    for module in model.modules():
        if cls is not None and isinstance(module, cls):
            module.forward = types.MethodType(_forward, module)
            n += 1
    return n
