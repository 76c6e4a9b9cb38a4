"""The fused loss equals cross-entropy on the model's own logits, family by family (issue #14 item 1).

Tiny random configs of the causal-LM families users fine-tune, with the logit knobs set to values that matter
(Granite logits_scaling, Gemma-2/3 final_logit_softcapping, Cohere logit_scale). For fused and unfused
CausalLMLoss, after LoRA: the summed nats, the per-row nats and the gradient wrt every adapter tensor match
``F.cross_entropy(model(input_ids).logits)``.
"""
import pytest
import torch
import torch.nn.functional as F
import transformers

from raytrain_scu.core import embed_quant
from raytrain_scu.core.fused_lora import fuse_lora_projections
from raytrain_scu.core.loss import CausalLMLoss, HeadTransform, chunked_ce_sum
from raytrain_scu.core.model.build import apply_lora
from raytrain_scu.core.model.families import FAMILIES as MODEL_FAMILIES
from raytrain_scu.core.regularizer import adapter_params

VOCAB = 96
BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2)
GRANITE = dict(logits_scaling=8.0, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.125)

# transformers ForCausalLM class -> (its Config class, config keywords beyond BASE)
FAMILIES = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {}),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=4, **MOE)),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=32,
                                                   shared_expert_intermediate_size=32, **MOE)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=8)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(head_dim=8, num_experts=4, moe_intermediate_size=32, **MOE)),
    "GemmaForCausalLM": ("GemmaConfig", dict(head_dim=8)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(head_dim=8, final_logit_softcapping=30.0, sliding_window=8,
                                               query_pre_attn_scalar=8)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(head_dim=8, final_logit_softcapping=30.0, sliding_window=8,
                                                   query_pre_attn_scalar=8)),
    "PhiForCausalLM": ("PhiConfig", {}),  # lm_head has a bias
    "Phi3ForCausalLM": ("Phi3Config", {}),
    "OlmoForCausalLM": ("OlmoConfig", {}),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "SmolLM3ForCausalLM": ("SmolLM3Config", {}),
    "StableLmForCausalLM": ("StableLmConfig", {}),
    "Starcoder2ForCausalLM": ("Starcoder2Config", {}),
    "GraniteForCausalLM": ("GraniteConfig", GRANITE),
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", dict(num_local_experts=4, **MOE, **GRANITE)),
    "GraniteMoeSharedForCausalLM": ("GraniteMoeSharedConfig", dict(num_local_experts=4, shared_intermediate_size=32,
                                                                   **MOE, **GRANITE)),
    # Granite-4.0-H: Mamba-2 and attention layers, a dense shared MLP (no routed experts), logits / logits_scaling
    "GraniteMoeHybridForCausalLM": ("GraniteMoeHybridConfig", dict(
        layer_types=["mamba", "attention"], num_local_experts=0, shared_intermediate_size=64, mamba_n_heads=4,
        mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8, **GRANITE)),
    "CohereForCausalLM": ("CohereConfig", dict(logit_scale=0.5)),
    "Cohere2ForCausalLM": ("Cohere2Config", dict(logit_scale=0.5, sliding_window=8)),
}


def build(name: str, seed: int = 0):
    """A tiny random model of the family, with LoRA on all linear layers and non-zero adapters."""
    config_cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert type(model).__name__ == name
    model.requires_grad_(False)
    # logits of order 10: the scaling and the softcap change the loss by far more than the tolerance
    model.get_output_embeddings().weight.data.normal_(0.0, 1.0)
    model = apply_lora(model, r=4, alpha=8, targets=["all-linear"])
    for p in adapter_params(model):  # B starts at zero: make the adapters act, so their gradients are all non-zero
        p.data.normal_(0.0, 0.05)
    return model


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, VOCAB, (2, 12), generator=g)
    y = torch.randint(3, VOCAB, (2, 12), generator=g)
    y[0, :3] = -100
    y[1, -2:] = -100
    return x, y


def flat_grad(loss, params):
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def assert_close(got, want, what):
    err = float((got - want).norm() / want.norm())
    assert err < 1e-4, f"{what}: relative error {err:.2e}"


def available(name: str) -> bool:
    return hasattr(transformers, name) and hasattr(transformers, FAMILIES[name][0])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_loss_and_gradient_match_the_models_own_logits(name):
    if not available(name):
        pytest.skip(f"{name} is not in transformers {transformers.__version__}")
    assert_loss_matches_own_logits(build(name))


def test_llama_with_fused_lora_projections():
    """The same with model.fuse_lora's fused q/k/v and gate/up projections (issue #17)."""
    model = build("LlamaForCausalLM")
    assert fuse_lora_projections(model) == 4
    assert_loss_matches_own_logits(model)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_int8_embedding_and_head_match_the_models_own_logits(name, monkeypatch):
    """quant.embedding_int8 on every family (a tied or untied head, a bias, a scaled embedding): the fused loss over
    the int8 head, dequantised 40 rows at a time, equals the int8 model's own logits."""
    if not available(name):
        pytest.skip(f"{name} is not in transformers {transformers.__version__}")
    monkeypatch.setattr(embed_quant, "SLICE_BYTES", BASE["hidden_size"] * 4 * 40)
    model = build(name)
    plain = model(input_ids=batch()[0]).logits
    embed_quant.shrink_embeddings(model, int8=True)
    assert isinstance(model.get_output_embeddings(), embed_quant.Int8Head)
    int8 = model(input_ids=batch()[0]).logits
    assert 0 < float((int8 - plain).abs().max()) < 0.05 * float(plain.abs().max())  # rounded, not broken
    assert_loss_matches_own_logits(model)


def assert_loss_matches_own_logits(model):
    params = adapter_params(model)
    x, y = batch()
    logits = model(input_ids=x).logits.float()
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
    ref_rows = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100, reduction="none").sum(dim=1)
    ref_grad = flat_grad(ref, params)
    for fused in (True, False):
        loss = CausalLMLoss(model, fused=fused, chunk_size=7)  # chunks that straddle rows
        assert loss.fused is fused, loss.fused_reason  # every family here has a known head
        nats, n = loss(x, y)
        assert int(n) == int((y != -100).sum())
        assert float(nats) == pytest.approx(float(ref), rel=1e-4), f"fused={fused}"
        assert torch.allclose(loss.row_nats(x, y), ref_rows, rtol=1e-4), f"row_nats, fused={fused}"
        assert_close(flat_grad(nats, params), ref_grad, f"gradient wrt the adapters, fused={fused}")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("transform", [HeadTransform(), HeadTransform(scale=0.125), HeadTransform(softcap=3.0),
                                       HeadTransform(scale=2.0, softcap=5.0)])
def test_chunked_kernel_applies_the_transform_and_its_derivative(transform, compiled):
    """Both ways of running each chunk's float32 part: the in-place eager kernels, and the functional version under
    torch.compile (what model.compile=true runs), with and without a bias, with an ignored label, in a gradient pass
    and in an eval pass."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # each case's graphs fresh: none may fall back to eager at the recompile limit
    counters.clear()
    torch.manual_seed(0)
    for b in (torch.randn(50), None):
        h = torch.randn(37, 16, requires_grad=True)
        w = torch.randn(50, 16)
        y = torch.randint(0, 50, (37,))
        y[3] = -100
        z = (h @ w.t() + (0.0 if b is None else b)) * transform.scale
        logits = transform.softcap * torch.tanh(z / transform.softcap) if transform.softcap else z
        ref = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
        (gref,) = torch.autograd.grad(ref, h)
        out = chunked_ce_sum(h, w, y, chunk_size=8, bias=b, transform=transform, compiled=compiled)
        (g,) = torch.autograd.grad(out * 2.0, h)
        assert float(out) == pytest.approx(float(ref), rel=1e-5)
        assert torch.allclose(g, 2.0 * gref, atol=1e-5)
        with torch.no_grad():
            evaluated = chunked_ce_sum(h, w, y, chunk_size=8, bias=b, transform=transform, compiled=compiled)
        assert float(evaluated) == pytest.approx(float(ref), rel=1e-5)
    # compiled: a graph per (bias or not, gradient or eval, chunk of 8 or the last 5), none when eager
    assert counters["stats"]["unique_graphs"] == (8 if compiled else 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("transform", [HeadTransform(), HeadTransform(scale=2.0, softcap=5.0)])
def test_an_int8_head_walks_the_vocabulary_slice_by_slice_and_matches_its_dequantised_table(transform, compiled,
                                                                                             device, monkeypatch,
                                                                                             request):
    """The int8 head's loss runs the vocabulary in the outer loop (an online log-sum-exp over slices of the table,
    then each slice's gradient): its nats and input gradient equal cross-entropy over the dequantised table's
    logits, with a bias, an ignored label and labels in every slice, however the slices fall (rows bounded by the
    dequantised bytes, or by the chunk's share of the logits), in a gradient pass and an eval pass."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32, which a loop built earlier in the process turns on
    request.addfinalizer(lambda: torch.set_float32_matmul_precision(precision))
    torch.manual_seed(0)
    h = torch.randn(37, 16, device=device, requires_grad=True)
    q, s = embed_quant.quantize_rows_int8(torch.randn(50, 16, device=device))
    dense = q.float() * s[:, None]
    b = torch.randn(50, device=device)
    y = torch.randint(0, 50, (37,), device=device)
    y[3] = -100
    z = (h @ dense.t() + b) * transform.scale
    logits = transform.softcap * torch.tanh(z / transform.softcap) if transform.softcap else z
    ref = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    (gref,) = torch.autograd.grad(ref, h)
    for slice_rows, chunk in ((12, 1000), (1000, 8)):  # 12 rows by bytes; 8 x 50 // 37 = 10 rows by the chunk
        monkeypatch.setattr(embed_quant, "SLICE_BYTES", 16 * 4 * slice_rows)
        out = chunked_ce_sum(h, q, y, chunk_size=chunk, bias=b, transform=transform, compiled=compiled,
                             weight_scale=s)
        (g,) = torch.autograd.grad(out * 2.0, h)
        assert float(out) == pytest.approx(float(ref), rel=1e-5)
        assert torch.allclose(g, 2.0 * gref, atol=1e-5)
        with torch.no_grad():
            evaluated = chunked_ce_sum(h, q, y, chunk_size=chunk, bias=b, transform=transform, compiled=compiled,
                                       weight_scale=s)
        assert float(evaluated) == pytest.approx(float(ref), rel=1e-5)
    # compiled: each pass's function per slice shape, 12 and 2 rows, then 10 (five equal slices); none when eager
    assert counters["stats"]["unique_graphs"] == (6 if compiled else 0)


@pytest.mark.parametrize("label", [50, -1])
def test_an_int8_heads_loss_refuses_a_label_outside_the_vocabulary(label):
    """As cross-entropy does: a label that is neither -100 nor a row of the table is an error, not a silent row."""
    h = torch.randn(6, 16, requires_grad=True)
    q, s = embed_quant.quantize_rows_int8(torch.randn(50, 16))
    y = torch.randint(0, 50, (6,))
    y[2] = label
    with pytest.raises(RuntimeError, match="int8 head loss: a label is outside the vocabulary"):
        chunked_ce_sum(h, q, y, chunk_size=8, weight_scale=s)
    y[2] = -100
    assert torch.isfinite(chunked_ce_sum(h, q, y, chunk_size=8, weight_scale=s))


def test_every_known_head_is_tested_here():
    known = {name for family in MODEL_FAMILIES.values() for name in family.classes}
    assert known and known <= set(FAMILIES), known - set(FAMILIES)


def test_each_family_is_keyed_by_its_classes_model_type():
    """model-family lookups go by the config's model_type: a family filed under another key would never be found."""
    for model_type, family in MODEL_FAMILIES.items():
        for name in family.classes:
            if hasattr(transformers, name):
                assert getattr(transformers, name).config_class.model_type == model_type, (name, model_type)


def test_the_knobs_matter():
    """The Granite scaling, Gemma softcap and Cohere scale change the loss: a fused path that skipped them fails."""
    x, y = batch()
    for name, knob in [("GraniteForCausalLM", "logits_scaling"), ("Gemma2ForCausalLM", "final_logit_softcapping"),
                       ("Gemma3ForCausalLM", "final_logit_softcapping"), ("CohereForCausalLM", "logit_scale"),
                       ("GraniteMoeHybridForCausalLM", "logits_scaling")]:
        if not available(name):
            continue
        model = build(name)
        with torch.no_grad():
            with_knob = float(CausalLMLoss(model, fused=False)(x, y)[0])
            setattr(model.get_base_model().config, knob, None if "softcapping" in knob else 1.0)
            if hasattr(model.get_base_model(), knob):  # some models copy the knob at init
                setattr(model.get_base_model(), knob, 1.0)
            without = float(CausalLMLoss(model, fused=False)(x, y)[0])
        assert abs(with_knob / without - 1) > 0.01, (name, with_knob, without)


class DoubledLogitsLlama(transformers.LlamaForCausalLM):
    """A head the table does not know (a subclass, as remote code would be): logits * 2."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_an_unknown_head_uses_the_models_own_logits_with_a_note(capsys):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**BASE)
    config.use_cache = False
    model = DoubledLogitsLlama(config)
    model.requires_grad_(False)
    model = apply_lora(model, r=4, alpha=8, targets=["q_proj", "v_proj"])
    x, y = batch()
    loss = CausalLMLoss(model, fused=True)
    assert not loss.fused and "DoubledLogitsLlama" in loss.fused_reason
    CausalLMLoss(model, fused=True)  # the note is printed once per process
    out = capsys.readouterr().out
    assert out.count("DoubledLogitsLlama") == 1 and "model.fused_loss" in out
    logits = model(input_ids=x).logits.float()
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
    assert float(loss(x, y)[0]) == pytest.approx(float(ref), rel=1e-5)


def test_lora_on_the_lm_head_is_not_fused():
    torch.manual_seed(0)
    config = transformers.GraniteConfig(**BASE, **GRANITE, tie_word_embeddings=False)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.requires_grad_(False)
    model = apply_lora(model, r=4, alpha=8, targets=["q_proj", "lm_head"])
    loss = CausalLMLoss(model, fused=True)
    assert not loss.fused and "lm_head" in loss.fused_reason
    x, y = batch()
    logits = model(input_ids=x).logits.float()
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
    assert float(loss(x, y)[0]) == pytest.approx(float(ref), rel=1e-5)
