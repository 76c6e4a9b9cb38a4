"""ParamBPT and the differentiable penalty: the gradient of λ reaches the adapters."""
import math

import pytest
import torch

from raytrain_scu.core.regularizer import adapter_params, param_bpt, penalty_nats, sum_of_squares


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=g, requires_grad=True), torch.zeros(8, 4, requires_grad=True),
            torch.randn(3, generator=g, requires_grad=True)]


def test_matches_hand_formula():
    ps = tensors()
    n, sigma = 12345, 0.01
    hand = sum(float((p.detach().double() ** 2).sum()) for p in ps) / (2 * sigma ** 2 * n * math.log(2))
    assert float(param_bpt(ps, sigma=sigma, tokens_per_epoch=n)) == pytest.approx(hand, rel=1e-6)


def test_doubling_n_halves_it():
    ps = tensors()
    a = param_bpt(ps, sigma=0.02, tokens_per_epoch=1000)
    b = param_bpt(ps, sigma=0.02, tokens_per_epoch=2000)
    assert float(a) == pytest.approx(2 * float(b), rel=1e-6)


def test_float32_even_for_bf16_inputs():
    ps = [p.detach().bfloat16().requires_grad_() for p in tensors()]
    out = param_bpt(ps, tokens_per_epoch=10)
    assert out.dtype == torch.float32


def _grads(lam):
    torch.manual_seed(0)
    w = [torch.randn(5, 3, requires_grad=True), torch.zeros(3, 5, requires_grad=True)]
    x = torch.randn(7, 5)
    ce = ((x @ w[0] @ w[1]) ** 2).mean() + (x @ w[0]).sum() * 1e-3
    loss = ce + penalty_nats(param_bpt(w, sigma=0.01, tokens_per_epoch=100), lam)
    loss.backward()
    return [p.grad.clone() for p in w], w


def test_penalty_gradient_reaches_adapters():
    g0, _ = _grads(0.0)
    g1, w = _grads(1.0)
    assert not torch.allclose(g0[0], g1[0])
    # d/dw [λ Σw²/(2σ²N)] = λ w/(σ²N): the difference is exactly that
    expected = 1.0 * w[0].detach() / (0.01 ** 2 * 100)
    assert torch.allclose(g1[0] - g0[0], expected, rtol=1e-4, atol=1e-5)
    # a zero tensor (LoRA B at init) gets a finite, zero penalty gradient
    assert torch.isfinite(g1[1]).all()


def test_errors_are_clear():
    with pytest.raises(ValueError, match="adapter"):
        sum_of_squares([])
    with pytest.raises(ValueError, match="tokens_per_epoch"):
        param_bpt(tensors(), tokens_per_epoch=0)


def test_the_penalty_backward_is_one_node_whatever_the_tensor_count():
    """Autograd through a per-tensor norm would add a backward node (and its kernels) per adapter tensor: the penalty's
    backward is one node that feeds every tensor's gradient directly, and its gradients are the formula's,
    λ (w − c) / (σ² N), in float32 for bf16 tensors too."""
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(4, 6, generator=g).requires_grad_() for _ in range(40)] + [torch.zeros(6, 4, requires_grad=True)]
    centres = [torch.randn(4, 6, generator=g) if i % 2 else None for i in range(40)] + [None]
    pb = param_bpt(ws, sigma=0.02, tokens_per_epoch=50, center=centres)
    node = pb.grad_fn
    while type(node).__name__ != "_SumOfSquaresBackward":  # past the scaling by 1 / (2σ²N ln 2)
        (node, _), = [(f, i) for f, i in node.next_functions if f is not None]
    assert [type(f).__name__ for f, _ in node.next_functions] == ["AccumulateGrad"] * len(ws)
    penalty_nats(pb, 3.0).backward()
    for w, c in zip(ws, centres):
        want = 3.0 * (w.detach() - (0 if c is None else c)) / (0.02 ** 2 * 50)
        assert torch.allclose(w.grad, want, rtol=1e-5, atol=1e-6)
    assert ws[-1].grad.abs().max() == 0  # a LoRA B at zero: a zero gradient, no NaN
    bf = [w.detach().bfloat16().requires_grad_() for w in ws[:3]]
    param_bpt(bf, tokens_per_epoch=10).backward()
    assert all(w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad).all() for w in bf)


# ---- adapter_params: every trainable tensor reaches the optimizer and ParamBPT, or the model is refused

def _tiny_lora(targets, **lora_kw):
    """A tiny random Llama (tied embeddings, as the presets) with peft LoRA on ``targets``."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config).requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, **lora_kw))
    return model


def test_lora_on_embeddings_is_trained_and_counted():
    from raytrain_scu.core.loss import CausalLMLoss

    model = _tiny_lora(["q_proj", "embed_tokens"])
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_embedding_A" in n for n, _ in trainable)
    params = adapter_params(model)
    assert {id(p) for p in params} == {id(p) for _, p in trainable}  # nothing trainable is left out
    # ParamBPT is Σw² over all of them, the embedding factors included
    hand = sum(float((p.detach().double() ** 2).sum()) for _, p in trainable) / (2 * 0.01 ** 2 * 1000 * math.log(2))
    assert float(param_bpt(params, sigma=0.01, tokens_per_epoch=1000)) == pytest.approx(hand, rel=1e-6)
    # one optimizer step over adapter_params, as the loop builds it, moves every trainable tensor
    before = {n: p.detach().clone() for n, p in trainable}
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    x = torch.randint(0, 64, (2, 8))
    nats, n = CausalLMLoss(model, fused=True, chunk_size=5)(x, x.roll(-1, dims=1))
    (nats / n + penalty_nats(param_bpt(params, tokens_per_epoch=1000), 1.0)).backward()
    optimizer.step()
    unchanged = [n for n, p in trainable if torch.equal(p.detach(), before[n])]
    assert not unchanged


@pytest.mark.parametrize("lora_kw, culprit", [(dict(use_dora=True), "lora_magnitude_vector"),
                                               (dict(modules_to_save=["lm_head"]), "modules_to_save")])
def test_trainable_tensors_that_are_not_lora_factors_are_refused(lora_kw, culprit):
    model = _tiny_lora(["q_proj", "v_proj"], **lora_kw)
    assert any(culprit in n for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match=f"not LoRA factors.*{culprit}"):
        adapter_params(model)


def test_no_adapter_is_an_error():
    with pytest.raises(ValueError, match="no trainable LoRA factors"):
        adapter_params(torch.nn.Linear(3, 3).requires_grad_(False))


# ---------------------------------------------------------------- the prior centred on the update (issue #18)

def test_centred_prior_counts_the_update_only():
    w = [torch.tensor([3.0, 4.0], requires_grad=True), torch.tensor([1.0], requires_grad=True)]
    w0 = [torch.tensor([3.0, 2.0]), None]  # an A factor's initial value; a B factor (None: centred at 0)
    pb = param_bpt(w, sigma=1.0, tokens_per_epoch=1, center=w0)
    assert pb.item() == pytest.approx((0.0 + 4.0 + 1.0) / (2 * math.log(2)))  # (4-2)² + 1²
    pb.backward()  # the gradient is (w - w0) / (σ² N ln 2): zero where w is still at its initial value
    assert w[0].grad.tolist() == pytest.approx([0.0, 2.0 / math.log(2)])
    with pytest.raises(ValueError, match="center has 1 entries for 2"):
        param_bpt(w, center=[None])


def test_parts_split_parambpt_into_a_b_and_the_update():
    from peft import LoraConfig, get_peft_model

    from raytrain_scu.core.regularizer import initial_centers, param_bpt_parts

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 6))
    model = get_peft_model(m, LoraConfig(r=2, target_modules=["0"], init_lora_weights=True))
    params = adapter_params(model)
    centers = initial_centers(model)
    assert [c is None for c in centers] == ["lora_B" in n for n, p in model.named_parameters() if p.requires_grad]
    a0, b0, u0 = param_bpt_parts(params, centers, sigma=0.5, tokens_per_epoch=10).tolist()
    assert b0 == 0.0 and u0 == 0.0 and a0 == pytest.approx(param_bpt(params, 0.5, 10).item())
    with torch.no_grad():
        for p in params:
            p.add_(0.1)
    a, b, u = param_bpt_parts(params, centers, sigma=0.5, tokens_per_epoch=10).tolist()
    assert a + b == pytest.approx(param_bpt(params, 0.5, 10).item(), rel=1e-6)
    assert u == pytest.approx(param_bpt(params, 0.5, 10, center=centers).item(), rel=1e-6)
    n_a = sum(p.numel() for p, c in zip(params, centers) if c is not None)
    n_b = sum(p.numel() for p, c in zip(params, centers) if c is None)
    assert u == pytest.approx((n_a + n_b) * 0.01 / (2 * 0.25 * 10 * math.log(2)), rel=1e-5)
    assert b == pytest.approx(n_b * 0.01 / (2 * 0.25 * 10 * math.log(2)), rel=1e-5)
