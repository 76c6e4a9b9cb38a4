"""Granite-4.0-H's Mamba-2 mixers with the field's kernels: a LoRA adapter on out_proj takes part in training (the
fused kernel would otherwise apply out_proj's base weight itself), and the kernel path computes what the torch path
does (GPU-marked: the kernels need CUDA)."""
import importlib.util

import pytest
import torch
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as modeling

from raytrain_scu.core.model.build import apply_lora, build_model
from raytrain_scu.core.model.mamba import keep_out_proj_a_module
from raytrain_scu.core.model.source import load_tokenizer
from raytrain_scu.core.regularizer import adapter_params

KERNELS = ("mamba2_split_conv1d_scan_combined", "causal_conv1d_fn", "causal_conv1d_update",
           "mamba2_chunk_scan", "mamba2_selective_state_update")


def tiny_granite(device="cpu", dtype=torch.float32, prepared=True):
    base = build_model("tiny-granite-4.0-h", vocab_size=len(load_tokenizer("tiny-granite-4.0-h")), dtype=dtype,
                       device=torch.device(device))
    if not prepared:  # transformers' own forward on every mixer, as without the family's prepare hook
        for module in base.modules():
            module.__dict__.pop("forward", None)
    torch.manual_seed(0)
    model = apply_lora(base, targets=["all-linear"])
    for n, p in model.named_parameters():  # every adapter in play: B at random instead of zero
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return model


def out_proj_grads(model, x) -> list:
    model.train()
    logits = model(input_ids=x).logits
    logits.float().pow(2).mean().backward()
    return [p.grad for n, p in model.named_parameters() if "mamba.out_proj.lora_B" in n]


def test_the_out_proj_adapter_takes_part_where_the_fused_kernel_runs(monkeypatch):
    calls = []
    x = torch.randint(0, 2000, (2, 16))
    model = tiny_granite()
    width = model.get_base_model().model.layers[0].mamba.intermediate_size
    monkeypatch.setattr(modeling, "mamba2_split_conv1d_scan_combined",
                        lambda z, *a, outproj_weight=None, **k: _kernel(z, width, outproj_weight, calls))
    grads = out_proj_grads(model, x)
    assert calls and all(w is None for w in calls)  # the kernel never saw out_proj's weight
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)

    calls.clear()
    stock = tiny_granite(prepared=False)  # transformers' forward: the kernel applies out_proj's base weight itself
    grads = out_proj_grads(stock, x)
    assert calls and all(w is not None for w in calls)
    assert all(g is None or g.abs().sum() == 0 for g in grads)


def _kernel(zxbcdt, width, outproj_weight, calls):
    """The fused kernel's contract in plain torch: it records what the mixer hands it and returns a differentiable
    output of the intermediate width, with ``outproj_weight`` the out projection applied inside, as the kernel does."""
    calls.append(outproj_weight)
    out = torch.tanh(zxbcdt[..., :width])
    return out @ outproj_weight.T if outproj_weight is not None else out


@pytest.mark.slow
def test_a_compiled_layer_compiles_the_mixer_projections_and_leaves_only_the_kernel_out(monkeypatch):
    """Under torch.compile the mixer's in_proj and out_proj (with their adapters) are traced into graphs and only the
    kernel call breaks the graph; the compiled decoder layers train to eager's loss and adapter gradients (fp32)."""
    from raytrain_scu.core.loss import CausalLMLoss, compile_for_training

    model = tiny_granite()
    width = model.get_base_model().model.layers[0].mamba.intermediate_size
    monkeypatch.setattr(modeling, "mamba2_split_conv1d_scan_combined",
                        lambda z, *a, outproj_weight=None, **k: _kernel(z, width, outproj_weight, []))
    model.train()
    mixer = model.get_base_model().model.layers[0].mamba
    torch._dynamo.reset()
    seen = torch._dynamo.explain(mixer)(torch.randn(2, 16, mixer.in_proj.in_features))
    assert seen.graph_count == 2 and seen.graph_break_count == 1, seen.break_reasons
    assert "disable" in seen.break_reasons[0].reason
    for graph in seen.graphs:  # in_proj before the kernel, out_proj after: base GEMM and both adapter GEMMs each
        assert sum(n.target is torch._C._nn.linear for n in graph.graph.nodes) == 3

    x = torch.randint(0, 2000, (2, 32))
    y = torch.roll(x, -1, 1)
    out = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = tiny_granite()
        loss_model = CausalLMLoss(model)
        if compiled:
            loss_model = compile_for_training(loss_model, scope="layers")
        model.train()
        nats, n = loss_model(x, y)
        (nats / n).backward()
        out.append(((nats / n).item(), [p.grad.clone() for p in adapter_params(model)]))
    torch._dynamo.reset()
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = out
    assert abs(eager_loss - compiled_loss) < 1e-5
    for e, c in zip(eager_grads, compiled_grads):
        assert (e - c).norm() <= 1e-4 * e.norm() + 1e-8


@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is not None, reason="the kernels are installed here")
def test_without_the_kernels_evaluation_and_training_are_transformers_own():
    """No mamba_ssm here: the prepared mixer falls back to transformers' torch path, computing the same numbers."""
    x = torch.randint(0, 2000, (2, 16))
    a, b = tiny_granite(), tiny_granite(prepared=False)
    for train in (False, True):
        a.train(train)
        b.train(train)
        assert torch.allclose(a(input_ids=x).logits, b(input_ids=x).logits, atol=1e-6)
    assert keep_out_proj_a_module(torch.nn.Linear(2, 2)) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and the mamba_ssm / causal_conv1d kernels")
def test_the_kernel_path_matches_the_torch_path(monkeypatch):
    """Loss within 1e-3 (fp32) and every adapter's gradient within 1e-3 relative, the kernel path (eager, and with
    each decoder layer compiled around the kernel) against the torch path."""
    pytest.importorskip("mamba_ssm")
    pytest.importorskip("causal_conv1d")
    x = torch.randint(0, 2000, (2, 64), device="cuda")

    def loss_and_grads(compiled=False):
        torch._dynamo.reset()
        model = tiny_granite("cuda")
        if compiled:  # each decoder layer, as the loop compiles it: the kernel runs between two graphs
            for layer in model.get_base_model().model.layers:
                layer.compile()
        model.train()
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits[:, :-1].flatten(0, 1).float(),
                                                 x[:, 1:].flatten())
        loss.backward()
        return loss.item(), [p.grad.detach().clone() for p in adapter_params(model)]

    kernel_loss, kernel_grads = loss_and_grads()
    compiled_loss, compiled_grads = loss_and_grads(compiled=True)
    for name in KERNELS:  # transformers' own torch functions, under the kernels' names
        monkeypatch.setattr(modeling, name, getattr(modeling, name).__wrapped__)
    torch_loss, torch_grads = loss_and_grads()
    for loss, grads in ((kernel_loss, kernel_grads), (compiled_loss, compiled_grads)):
        assert abs(loss - torch_loss) < 1e-3
        for k, t in zip(grads, torch_grads):
            assert (k - t).norm() <= 1e-3 * t.norm() + 1e-8


def test_the_mixer_forward_passes_both_transformers_call_conventions_through():
    """transformers 5.17 calls the mixer with ``cache_params=``, 5.24 with ``cache=``: outside the kernel's training
    branch the class's own forward gets exactly what the caller passed."""
    import types

    from raytrain_scu.core.model import mamba

    class Old(torch.nn.Module):  # 5.17's signature
        def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
            return ("old", cache_params, attention_mask, kwargs)

    class New(torch.nn.Module):  # 5.24's
        def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
            return ("new", cache, attention_mask, kwargs)

    for cls, key in ((Old, "cache_params"), (New, "cache")):
        layer = cls().eval()
        layer.forward = types.MethodType(mamba._forward, layer)
        x = torch.zeros(1, 2, 3)
        got = layer.forward(hidden_states=x, **{key: "c"}, attention_mask="m", output_attentions=None)
        assert got[1:] == ("c", "m", {"output_attentions": None}), got
        layer.train()  # training with a cache: transformers' path too
        assert layer.forward(x, **{key: "c"})[1] == "c"
