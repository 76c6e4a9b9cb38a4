"""Model building blocks on the tiny preset with the real Shakespeare BPE tokenizer."""
import math

import pytest
import torch

from raytrain_scu.model import (CausalLMLoss, ModelError, apply_lora, build_model, check_model_source,
                                chunked_ce_sum, load_tokenizer)
from raytrain_scu.regularizer import adapter_params


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def test_preset_tokenizer_is_real_bpe(tok):
    ids = tok("To be, or not to be")["input_ids"]
    assert 1 < len(ids) < 19 and tok.decode(ids) == "To be, or not to be"
    assert tok.eos_token_id is not None


def test_chunked_ce_matches_reference():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16)
    y = torch.randint(0, 50, (37,))
    y[3] = -100
    ref = torch.nn.functional.cross_entropy(h @ w.t(), y, ignore_index=-100, reduction="sum")
    (gref,) = torch.autograd.grad(ref, h)
    out = chunked_ce_sum(h, w, y, chunk_size=8)
    (g,) = torch.autograd.grad(out * 2.0, h)
    assert float(out) == pytest.approx(float(ref), rel=1e-5)
    assert torch.allclose(g, 2.0 * gref, atol=1e-5)


def test_fused_and_plain_loss_agree_and_only_lora_trains(tok):
    base = build_model("tiny", vocab_size=len(tok), seed=1)
    model = apply_lora(base, r=4, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                    "up_proj", "down_proj"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(adapter_params(model)) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    x = torch.randint(0, len(tok), (2, 16))
    y = torch.randint(0, len(tok), (2, 16))
    fused, n1 = CausalLMLoss(model, fused=True, chunk_size=5)(x, y)
    plain, n2 = CausalLMLoss(model, fused=False)(x, y)
    assert int(n1) == int(n2) == 32
    assert float(fused) == pytest.approx(float(plain), rel=1e-5)
    assert 0 < float(fused) / 32 / math.log(2) < 20


def test_unknown_target_module_is_named(tok):
    base = build_model("tiny", vocab_size=len(tok))
    with pytest.raises(ModelError, match="not_a_proj"):
        apply_lora(base, targets=["not_a_proj"])


def test_check_model_source_errors(tmp_path, monkeypatch):
    assert check_model_source("tiny") == "preset tiny"
    with pytest.raises(ModelError, match="does not exist"):
        check_model_source("./no/such/dir")
    with pytest.raises(ModelError, match="GGUF file not found"):
        check_model_source(str(tmp_path), gguf_file="missing.gguf")
    with pytest.raises(ModelError, match="no config.json"):
        check_model_source(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE"):
        check_model_source("no-such-org/no-such-model-xyz")
