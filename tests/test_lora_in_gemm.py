"""model.lora_in_gemm: every plain LoRA Linear as one autograd function, the B-product inside the frozen GEMM where the
output is at least as wide as the input, against plain peft on the same weights.

Tolerances, fp32 on the CPU: the same products summed in another order (inside one GEMM), so losses agree to 1e-5
relative and each adapter gradient to 2e-5 relative, tensor by tensor; compiled against eager, 1e-4.
"""
from functools import partial

import pytest
import torch
import transformers
from conftest import TINY, adapter_grads, autograd_nodes, rel, token_batch
from test_fused_lora import gqa_base, pair, tiny_base, with_lora
from test_mamba import tiny_granite

from raytrain_scu.config.load import load_config
from raytrain_scu.core.fused_lora import _in_gemm, lora_in_gemm
from raytrain_scu.core.loss import CausalLMLoss, compile_for_training
from raytrain_scu.core.model.build import apply_lora
from raytrain_scu.errors import ConfigError

VOCAB = 256
batch = partial(token_batch, VOCAB)
TOL = 1e-5
GRAD_TOL = 2e-5


def in_gemm_pair(make_model):
    """(plain peft model, the same model with lora_in_gemm), equal weights; every LoRA Linear changed."""
    plain, model = make_model(), make_model()
    lora = [m for m in model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
    before = dict(model.named_parameters())
    assert lora_in_gemm(model) == (len(lora), [])
    assert all(dict(model.named_parameters())[n] is p for n, p in before.items())  # peft's own parameters still
    return plain, model


def both_widths(model) -> set:
    """Which of the two forms the model's LoRA Linears take: True (inside the GEMM), False (added after it)."""
    return {_in_gemm(m.base_layer.weight, m.base_layer.weight.dtype) for m in model.modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


CASES = [(lambda: with_lora(tiny_base(), "plain")), (lambda: with_lora(gqa_base(), "plain")),
         (lambda: with_lora(gqa_base(), "ranks")), (lambda: tiny_granite())]
IDS = ["tiny", "gqa-bias", "gqa-unequal-ranks", "granite-hybrid"]


def loss_of(model, x, y):
    if hasattr(model.get_base_model().config, "mamba_n_heads"):  # the hybrid's own vocabulary
        return CausalLMLoss(model)(x % model.get_base_model().config.vocab_size, y)[0]
    return CausalLMLoss(model)(x, y)[0]


@pytest.mark.parametrize("make", CASES, ids=IDS)
def test_loss_and_every_adapter_gradient_match_plain_peft(make):
    plain, model = in_gemm_pair(make)
    assert both_widths(model) == {True, False}  # both forms are checked: wide outputs in the GEMM, narrow after it
    x, y = batch()
    want, got = loss_of(plain, x, y), loss_of(model, x, y)
    n_lora = sum(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in model.modules())
    assert autograd_nodes(got, "_FusedLoraLinear") == n_lora
    assert float(got) == pytest.approx(float(want), rel=TOL)
    want.backward()
    got.backward()
    ref, out = adapter_grads(plain), adapter_grads(model)
    assert ref.keys() == out.keys() and len(ref) == 2 * n_lora
    for name in ref:
        assert ref[name].norm() > 0 and rel(out[name], ref[name]) < GRAD_TOL, name
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_with_fused_projections_the_rest_run_in_the_gemm():
    """model.fuse_lora and model.lora_in_gemm together: q/k/v and gate/up fused per group, o/down alone."""
    plain, fused = pair(tiny_base)
    lora_in_gemm(fused)
    x, y = batch()
    want, got = CausalLMLoss(plain)(x, y)[0], CausalLMLoss(fused)(x, y)[0]
    assert autograd_nodes(got, "_FusedLoraLinear") == 2 * (2 + 2)  # 2 layers: qkv, gate_up, o, down
    assert float(got) == pytest.approx(float(want), rel=TOL)
    want.backward()
    got.backward()
    ref, out = adapter_grads(plain), adapter_grads(fused)
    for name in ref:
        assert rel(out[name], ref[name]) < GRAD_TOL, name


def test_disabled_and_merged_adapters_take_peft_own_paths():
    plain, model = in_gemm_pair(lambda: with_lora(tiny_base(), "plain"))
    x, _ = batch()
    with torch.no_grad():
        with plain.disable_adapter(), model.disable_adapter():
            assert rel(model(input_ids=x).logits, plain(input_ids=x).logits) < TOL
        want = plain(input_ids=x).logits
        model.merge_adapter()
        assert rel(model(input_ids=x).logits, want) < TOL
        model.unmerge_adapter()
        assert rel(model(input_ids=x).logits, want) < TOL


@pytest.mark.parametrize("scope", ["layers", "model"])
def test_compiled_agrees_with_eager(scope):
    torch._dynamo.reset()
    _, eager = in_gemm_pair(lambda: with_lora(tiny_base(), "plain"))
    _, compiled = in_gemm_pair(lambda: with_lora(tiny_base(), "plain"))
    x, y = batch(cols=16)
    want = CausalLMLoss(eager)(x, y)[0]
    want.backward()
    got = compile_for_training(CausalLMLoss(compiled), scope=scope)(x, y)[0]
    got.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-4)
    ref, out = adapter_grads(eager), adapter_grads(compiled)
    for name in ref:
        assert rel(out[name], ref[name]) < 1e-4, name


def test_linears_that_do_not_qualify_are_named_and_keep_peft_forward():
    """GPT-2's projections are transformers' Conv1D, not nn.Linear: each is left on peft's forward, with the reason."""
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=64)
    gpt2 = apply_lora(transformers.AutoModelForCausalLM.from_config(config).requires_grad_(False), r=4,
                      targets=["c_attn", "c_proj"])
    changed, left = lora_in_gemm(gpt2)
    assert changed == 0 and len(left) == 3
    assert all("its base is not a plain nn.Linear" in line for line in left) and "h.0.attn.c_attn" in left[0]


@pytest.mark.parametrize("override,needle", [
    ("quant.load_in_4bit=true", "not quant.load_in_4bit=true"),
    ("lora.dropout=0.1", "lora.dropout=0"),
])
def test_config_refuses_it_where_it_cannot_apply(override, needle):
    with pytest.raises(ConfigError, match="model.lora_in_gemm") as e:
        load_config(TINY, ["model.lora_in_gemm=true", override])
    assert needle in str(e.value)
    with pytest.raises(ConfigError, match="model.base_fp8.*model.lora_in_gemm=false"):
        load_config(TINY, ["model.lora_in_gemm=true", "model.base_fp8=true"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "granite"])
def test_bf16_autocast_eager_and_compiled_on_cuda(family):
    """As the loop runs on a GPU: a bf16 base, float32 adapters, bf16 autocast; eager and each decoder layer compiled
    against plain peft, bf16 tolerance 3e-2 relative, every adapter gradient non-zero."""
    from raytrain_scu.core.model.build import build_model

    def make():
        if family == "granite":
            return tiny_granite("cuda", dtype=torch.bfloat16)
        return with_lora(build_model("tiny", vocab_size=VOCAB, dtype=torch.bfloat16, device=torch.device("cuda"),
                                     seed=0), "plain").cuda()

    torch._dynamo.reset()
    plain, model = in_gemm_pair(make)
    _, compiled = in_gemm_pair(make)
    x, y = (t.cuda() for t in batch(cols=64))
    results = []
    for m, loss_model in ((plain, CausalLMLoss(plain)), (model, CausalLMLoss(model)),
                          (compiled, compile_for_training(CausalLMLoss(compiled), scope="layers"))):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_model(x % m.get_base_model().config.vocab_size, y)[0]
        loss.backward()
        results.append((float(loss), adapter_grads(m)))
    (want, ref), *others = results
    for got, grads in others:
        assert got == pytest.approx(want, rel=3e-2)
        for name in ref:
            assert grads[name].norm() > 0 and rel(grads[name], ref[name]) < 3e-2, name
