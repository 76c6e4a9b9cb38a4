"""Fused LoRA projections (``model.fuse_lora``): q/k/v as one frozen GEMM and gate/up as another, each with the LoRA
A-products of its group in one more GEMM on the same input. No ray, mlflow or torch.distributed.

Per decoder layer, peft's separate ``base(x) + B(A(x))·s`` for q, k and v (and gate, up) become

    out = x @ [Wq; Wk; Wv].T (+ bias)          one GEMM over the concatenated frozen weight
    xa  = x @ [Aq; Ak; Av].T                    one GEMM for every A of the group  (tokens x Σr)
    out += xa @ blockdiag(s_q·Bq, s_k·Bk, s_v·Bv).T   the B-products, one GEMM, in place

in :class:`_FusedLoraLinear`, whose backward returns the input gradient and the A/B gradients and never a gradient
for the frozen weight. The trainable tensors stay peft's own ``lora_A``/``lora_B`` parameters (same names, same
objects), so the optimizer, ParamBPT, checkpoints and saved adapters are those of the plain model.

Memory: the concatenated weight is built once per layer and the base ``q_proj``/``k_proj``/... weights become views
into it, so the base's parameters cost no more than before (one layer's q/k/v or gate/up is held twice for a moment
while it is built). The training step's peak is higher: +1.3 GiB on an H100 at the bench's 1B shape
(docs/log/benchmarks.md), from what the function saves for its backward (the input, the A-products and the scaled
block-diagonal of the B's).
The concatenation is a frozen Parameter (not a buffer: DDP broadcasts buffers at every forward); it
appears in ``state_dict()`` under ``fused_qkv_weight``/``fused_gate_up_weight`` but never in a saved adapter.

Only transformers' own ``LlamaForCausalLM`` (Llama, SmolLM, ...) is fused: its attention and MLP forwards are
rewritten here, and tests/test_fused_lora.py checks them against the plain model.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_scu.config.schema import FUSED_LORA_TARGETS
from raytrain_scu.core.model.families import family_of
from raytrain_scu.core.model.parts import base_of
from raytrain_scu.errors import ModelError


class _FusedLoraLinear(torch.autograd.Function):
    """``x @ W.T + b`` of a concatenated frozen weight plus, for each branch i, ``s_i · (x @ A_i.T) @ B_i.T`` on its
    columns. ``factors`` are A_1..A_k then B_1..B_k. The base product runs in ``weight.dtype``, the LoRA products in
    ``lora_dtype`` (under autocast both are the autocast dtype, as peft's own layers get them).

    The B-products are one GEMM too, against the block-diagonal matrix of the s_i·B_i (tokens x Σr times Σr x N):
    added in place to the whole output, not to column slices, which torch.compile would turn into a copy of the
    output per branch. Its zero blocks cost 2·tokens·N·Σr FLOPs, under 3 % of the frozen GEMM at r=16, d=2048."""

    @staticmethod
    def forward(ctx, x, weight, bias, scales, lora_dtype, *factors):
        k = len(scales)
        a_s, b_s = factors[:k], factors[k:]
        x2 = x.reshape(-1, x.shape[-1])
        xw = x2.to(weight.dtype)
        out = torch.mm(xw, weight.t()) if bias is None else torch.addmm(bias.to(weight.dtype), xw, weight.t())
        xl = x2.to(lora_dtype)
        a_cat = torch.cat([a.to(lora_dtype) for a in a_s])  # [Σr, d]: one GEMM for the group's A-products
        xa = torch.mm(xl, a_cat.t())
        b_diag = torch.block_diag(*[b.to(lora_dtype) * s for b, s in zip(b_s, scales)])  # [N, Σr]
        if lora_dtype == out.dtype:
            out.addmm_(xa, b_diag.t())
        else:  # peft adds a float32 LoRA term to a lower-precision base output in float32, then rounds
            out = (out + torch.mm(xa, b_diag.t())).to(out.dtype)
        ctx.save_for_backward(xl, weight, a_cat, xa, b_diag)
        ctx.scales, ctx.shapes, ctx.x_dtype = scales, [b.shape for b in b_s], x.dtype
        ctx.factor_dtypes = [f.dtype for f in factors]
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xl, weight, a_cat, xa, b_diag = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        gl = g.to(xl.dtype)
        gxa = torch.mm(gl, b_diag)  # [tokens, Σr], the scales included
        gbs, col, rank = [], 0, 0
        for (n, r), s in zip(ctx.shapes, ctx.scales):  # each B's own block only
            gbs.append(torch.mm(gl[:, col:col + n].t(), xa[:, rank:rank + r]).mul_(s))
            col, rank = col + n, rank + r
        gas = torch.mm(gxa.t(), xl).split([r for _, r in ctx.shapes])
        gx = None
        if ctx.needs_input_grad[0]:  # the frozen weight's own gradient is never formed
            gx = torch.mm(g.to(weight.dtype), weight)
            gx = gx.addmm_(gxa, a_cat) if gx.dtype == xl.dtype else gx + torch.mm(gxa, a_cat).to(gx.dtype)
            gx = gx.to(ctx.x_dtype).view(*grad_out.shape[:-1], gx.shape[-1])
        grads = [t.to(dt) for t, dt in zip([*gas, *gbs], ctx.factor_dtypes)]
        return gx, None, None, None, None, *grads


def fused_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias, branches) -> torch.Tensor:
    """The concatenated outputs of the peft LoRA Linear ``branches`` whose frozen weights are ``weight`` (rows in
    branch order): the frozen product and the adapters' products as in :class:`_FusedLoraLinear`."""
    if all(m.disable_adapters for m in branches):  # peft's disable_adapter(): the base model alone
        return F.linear(x, weight, bias)
    names = [_active_adapter(m) for m in branches]
    a_s = [m.lora_A[a].weight for m, a in zip(branches, names)]
    b_s = [m.lora_B[a].weight for m, a in zip(branches, names)]
    scales = tuple(float(m.scaling[a]) for m, a in zip(branches, names))
    dev = x.device.type
    autocast = torch.is_autocast_enabled(dev)
    lora_dtype = torch.get_autocast_dtype(dev) if autocast else a_s[0].dtype
    if autocast:  # as F.linear under autocast: the base product in the autocast dtype too (a no-op for a bf16 base)
        weight = weight.to(lora_dtype)
    return _FusedLoraLinear.apply(x, weight, bias, scales, lora_dtype, *a_s, *b_s)


def _active_adapter(m) -> str:
    """The one active, unmerged adapter of ``m``; anything else is an error (the fused forward computes exactly one)."""
    if m.merged or m.disable_adapters or len(m.active_adapters) != 1:
        raise RuntimeError(f"model.fuse_lora: a fused projection needs exactly one active, unmerged adapter on every "
                           f"branch; got active={m.active_adapters}, merged={m.merged}, "
                           f"disabled={m.disable_adapters}")
    return m.active_adapters[0]


def _fused_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                             past_key_values=None, **kwargs):
    """transformers' LlamaAttention.forward with q, k and v from one :func:`fused_lora_linear`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    cache = cache if cache is not None else past_key_values
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    qkv = fused_lora_linear(hidden_states, self.fused_qkv_weight, self.fused_qkv_bias,
                            (self.q_proj, self.k_proj, self.v_proj))
    q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in qkv.split(self.fused_qkv_sizes, dim=-1))
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    dropout = 0.0 if not self.training else self.attention_dropout
    out, weights = attention(self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _fused_mlp_forward(self, x):
    """transformers' LlamaMLP.forward with gate and up from one :func:`fused_lora_linear`."""
    gate_up = fused_lora_linear(x, self.fused_gate_up_weight, self.fused_gate_up_bias, (self.gate_proj, self.up_proj))
    gate, up = gate_up.split(self.fused_gate_up_sizes, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _fused_class(cls: type, forward) -> type:
    """A subclass of ``cls`` whose forward is ``forward`` (one per class; the module keeps its state)."""
    key = (cls, forward)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"FusedLora{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return _CLASSES[key]


_CLASSES: dict = {}


def check_fusable_config(hf_config) -> None:
    """Preflight, on the model's config alone: a family whose q/k/v and gate/up fuse (Llama). Raises ModelError naming
    the key."""
    if not family_of(hf_config).fusable:
        raise ModelError(f"model.fuse_lora=true: fused LoRA projections are built for Llama-style models "
                         f"(model_type llama), this one is {getattr(hf_config, 'model_type', '?')!r}; "
                         f"set model.fuse_lora=false")


def fuse_lora_projections(model) -> int:
    """Fuse q/k/v and gate/up of every decoder layer of a peft LoRA ``LlamaForCausalLM`` in place; returns the
    number of fused groups. Raises ModelError (naming model.fuse_lora) where the model does not qualify: not
    transformers' own Llama classes, a branch without a plain LoRA adapter (not targeted, 4-bit, DoRA, dropout,
    a LoRA bias), or a layer fused already."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

    lm = base_of(model)
    if type(lm) is not LlamaForCausalLM:
        raise ModelError(f"model.fuse_lora=true: only transformers' own LlamaForCausalLM is fused, this model is "
                         f"{type(lm).__module__}.{type(lm).__name__}; set model.fuse_lora=false")
    groups = 0
    for i, layer in enumerate(lm.model.layers):
        for attr, cls, tag, names, forward in (
                ("self_attn", LlamaAttention, "qkv", FUSED_LORA_TARGETS[:3], _fused_attention_forward),
                ("mlp", LlamaMLP, "gate_up", FUSED_LORA_TARGETS[3:], _fused_mlp_forward)):
            module, where = getattr(layer, attr), f"model.layers.{i}.{attr}"
            if type(module) is not cls:
                raise ModelError(f"model.fuse_lora=true: {where} is a {type(module).__name__}, not transformers' "
                                 f"{cls.__name__} (fused already, or a patched model?)")
            _fuse_group(module, tag, names, where)
            module.__class__ = _fused_class(cls, forward)
            groups += 1
    return groups


def _fuse_group(module: nn.Module, tag: str, names, where: str) -> None:
    """Concatenate the frozen weights (and biases) of ``names`` into ``fused_<tag>_weight``/``_bias`` and make the
    branches' own weights views into it: the base's memory is not doubled."""
    branches = [_plain_lora_branch(getattr(module, n, None), f"{where}.{n}") for n in names]
    bases = [b.base_layer for b in branches]
    if len({(w.weight.dtype, w.weight.device, w.in_features) for w in bases}) != 1:
        raise ModelError(f"model.fuse_lora=true: {where}: {list(names)} differ in dtype, device or input size")
    if len({w.bias is None for w in bases}) != 1:
        raise ModelError(f"model.fuse_lora=true: {where}: some of {list(names)} have a bias and some not")
    sizes = tuple(w.out_features for w in bases)
    for kind in ("weight", "bias"):
        parts = [getattr(w, kind) for w in bases]
        fused = None if parts[0] is None else nn.Parameter(torch.cat([p.detach() for p in parts]),
                                                             requires_grad=False)
        module.register_parameter(f"fused_{tag}_{kind}", fused)
        for w, view in zip(bases, [] if fused is None else fused.detach().split(sizes)):
            setattr(w, kind, nn.Parameter(view, requires_grad=False))  # frees the original
    setattr(module, f"fused_{tag}_sizes", sizes)


def _plain_lora_branch(m, where: str):
    """``m`` if it is a peft LoRA Linear with one plain adapter over a frozen nn.Linear, else ModelError."""
    from peft.tuners.lora import Linear as LoraLinear

    if type(m) is not LoraLinear:
        raise ModelError(f"model.fuse_lora=true: {where} is a {type(m).__name__}, not a peft LoRA Linear over a "
                         f"plain Linear (lora.target_modules must cover {', '.join(FUSED_LORA_TARGETS)}; no 4-bit "
                         f"base)")
    adapters = list(m.lora_A)
    problem = ("it has several adapters" if len(adapters) != 1 else
               "its base is not a plain nn.Linear" if type(m.base_layer) is not nn.Linear else
               "its base weight is trainable" if m.base_layer.weight.requires_grad else
               "DoRA (or another LoRA variant) is not fused" if m.lora_variant.get(adapters[0]) else
               "a LoRA bias is not fused" if m.lora_bias.get(adapters[0]) else
               "lora.dropout > 0 is not fused" if not isinstance(m.lora_dropout[adapters[0]], nn.Identity) else
               "it is merged" if m.merged else "")
    if problem:
        raise ModelError(f"model.fuse_lora=true: {where}: {problem}")
    return m
