"""ParamBPT and the differentiable penalty: the gradient of λ reaches the adapters."""
import math

import pytest
import torch

from raytrain_scu.regularizer import param_bpt, penalty_nats, sum_of_squares


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
