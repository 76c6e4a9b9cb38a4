"""Fused LoRA projections (model.fuse_lora, issue #17) against plain peft LoRA on the same weights.

Tolerances, fp32 on the CPU: the fused model sums the same products in another order (one GEMM over the
concatenated weight, the LoRA B-products in one GEMM), so losses agree to 1e-5 relative and each adapter gradient
to 2e-5 relative, tensor by tensor (measured: at most 5e-6, on the GQA model's smallest gradients); after
optimizer steps and under torch.compile, 1e-4 (measured: at most 7e-6).
"""
from functools import partial

import pytest
import torch
import transformers
from conftest import (
    PLAIN_RUN,
    TINY,
    adapter_grads,
    autograd_nodes,
    metric_history,
    mlflow_runs,
    rel,
    tiny_cfg,
    token_batch,
)

from raytrain_scu.config.load import load_config
from raytrain_scu.core import loss as loss_mod
from raytrain_scu.core.fused_lora import check_fusable_config, fuse_lora_projections
from raytrain_scu.core.loss import CausalLMLoss, compile_for_training
from raytrain_scu.core.model.build import apply_lora, build_model
from raytrain_scu.core.regularizer import adapter_params
from raytrain_scu.errors import ConfigError, ModelError

VOCAB = 256
batch = partial(token_batch, VOCAB)
TOL = 1e-5
GRAD_TOL = 2e-5


def tiny_base():
    return build_model("tiny", vocab_size=VOCAB, seed=0)


def gqa_base():
    """A Llama shape of its own: 6 query heads over 2 key/value heads of 16 (k/v a third of q), biases on q/k/v/o."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, attention_bias=True,
                                      vocab_size=VOCAB, max_position_embeddings=64)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    for name, p in model.named_parameters():  # transformers initialises biases to zero: make them count
        if name.endswith(".bias"):
            p.data.normal_(0.0, 0.1)
    return model.requires_grad_(False)


def with_lora(base, variant: str):
    """LoRA on all 7 projections with non-zero B (so the B-products count); ``ranks``: unequal ranks and alphas per
    branch (peft's rank_pattern / alpha_pattern), so each branch's slice and scale are its own."""
    if variant == "ranks":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                rank_pattern={"k_proj": 2, "up_proj": 6},
                                                alpha_pattern={"v_proj": 3, "gate_proj": 20}))
    else:
        model = apply_lora(base, r=4, alpha=8)
    g = torch.Generator().manual_seed(3)
    for p in adapter_params(model):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def pair(make_base, variant="plain"):
    """(plain peft model, the same model with fused projections), equal weights."""
    plain, fused = with_lora(make_base(), variant), with_lora(make_base(), variant)
    before = dict(fused.named_parameters())
    assert fuse_lora_projections(fused) == 2 * len(fused.get_base_model().model.layers)
    # the trainable tensors are peft's own parameters still: same names, same objects
    after = dict(fused.named_parameters())
    assert all(after[n] is p for n, p in before.items() if p.requires_grad)
    return plain, fused


def checkpointed_tiny_base():
    return build_model("tiny", vocab_size=VOCAB, seed=0, gradient_checkpointing=True)


CASES = [(tiny_base, "plain"), (gqa_base, "plain"), (gqa_base, "ranks"), (checkpointed_tiny_base, "plain")]
IDS = ["tiny", "gqa-bias", "gqa-unequal-ranks", "tiny-gradient-checkpointing"]


@pytest.mark.parametrize("make_base,variant", CASES, ids=IDS)
def test_loss_and_every_adapter_gradient_match_plain_peft(make_base, variant):
    plain, fused = pair(make_base, variant)
    x, y = batch()
    want, _ = CausalLMLoss(plain)(x, y)
    got, _ = CausalLMLoss(fused)(x, y)
    # q/k/v and gate/up of both layers went through the fused function
    assert autograd_nodes(got, "_FusedLoraLinear") == 4
    assert float(got) == pytest.approx(float(want), rel=TOL)
    want.backward()
    got.backward()
    ref, out = adapter_grads(plain), adapter_grads(fused)
    assert ref.keys() == out.keys() and len(ref) == 2 * 7 * 2  # 2 layers, 7 projections, A and B
    for name in ref:
        assert ref[name].norm() > 0 and rel(out[name], ref[name]) < GRAD_TOL, name
    assert all(p.grad is None for p in fused.parameters() if not p.requires_grad)


def test_the_frozen_weight_gets_no_gradient_even_when_it_asks_for_one():
    _, fused = pair(tiny_base)
    attn = fused.get_base_model().model.layers[1].self_attn
    attn.fused_qkv_weight.requires_grad_(True)  # the backward still never forms it
    x, y = batch()
    CausalLMLoss(fused)(x, y)[0].backward()
    assert attn.fused_qkv_weight.grad is None and attn.q_proj.lora_A["default"].weight.grad is not None


def parameter_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's parameters (views share one)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for _, p in model.named_parameters(remove_duplicate=False)}
    return sum(storages.values())


def test_the_base_weights_are_views_into_the_fused_weight():
    plain, fused = pair(gqa_base)
    assert parameter_bytes(fused) == parameter_bytes(plain)  # fusing costs no memory once built
    attn, mlp = (getattr(fused.get_base_model().model.layers[0], a) for a in ("self_attn", "mlp"))
    ref = plain.get_base_model().model.layers[0].self_attn
    assert attn.fused_qkv_weight.shape == (96 + 32 + 32, 96) and attn.fused_qkv_bias.shape == (160,)
    storage = attn.fused_qkv_weight.untyped_storage().data_ptr()
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(attn, name).base_layer.weight
        assert w.untyped_storage().data_ptr() == storage and not w.requires_grad
        assert torch.equal(w, getattr(ref, name).base_layer.weight)
    assert mlp.gate_proj.base_layer.weight.untyped_storage().data_ptr() == \
        mlp.fused_gate_up_weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("make_base,variant", CASES[:2], ids=IDS[:2])
def test_optimizer_steps_of_both_stay_together(make_base, variant):
    plain, fused = pair(make_base, variant)
    opts = [torch.optim.AdamW(adapter_params(m), lr=1e-2) for m in (plain, fused)]
    for step in range(4):
        x, y = batch(seed=step)
        losses = []
        for model, opt in zip((plain, fused), opts):
            loss = CausalLMLoss(model)(x, y)[0]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        assert losses[1] == pytest.approx(losses[0], rel=1e-4), step
    fp = dict(fused.named_parameters())
    for n, p in plain.named_parameters():
        if p.requires_grad:
            assert rel(fp[n].detach(), p.detach()) < 1e-4, n


def test_saved_adapter_of_a_fused_model_loads_into_a_plain_peft_model(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    plain, fused = pair(tiny_base)
    plain.save_pretrained(str(tmp_path / "plain"))
    fused.save_pretrained(str(tmp_path / "fused"))
    saved = {k: load_file(str(tmp_path / d / "adapter_model.safetensors")) for k, d in (("p", "plain"), ("f", "fused"))}
    assert saved["f"].keys() == saved["p"].keys()  # no fused_* weights in the adapter
    assert all(torch.equal(saved["f"][k], saved["p"][k]) for k in saved["p"])
    loaded = PeftModel.from_pretrained(tiny_base(), str(tmp_path / "fused"))
    x, _ = batch()
    with torch.no_grad():
        want, got = fused(input_ids=x).logits, loaded(input_ids=x).logits
    assert rel(got, want) < TOL


def test_bf16_base_with_float32_adapters_without_autocast():
    """model.precision=bf16 on a CPU: peft adds the float32 LoRA term to the bf16 base output in float32; so does the
    fused path (bf16 rounding: 2e-2 relative on the gradients, measured 7e-3)."""
    plain, fused = pair(lambda: build_model("tiny", vocab_size=VOCAB, dtype=torch.bfloat16, seed=0))
    x, y = batch()
    want, got = CausalLMLoss(plain)(x, y)[0], CausalLMLoss(fused)(x, y)[0]
    assert float(got) == pytest.approx(float(want), rel=1e-3)
    want.backward()
    got.backward()
    ref, out = adapter_grads(plain), adapter_grads(fused)
    for name in ref:
        assert out[name].dtype == torch.float32 and rel(out[name], ref[name]) < 2e-2, name


def test_disabled_adapters_give_the_base_model():
    plain, fused = pair(gqa_base)
    x, _ = batch()
    with torch.no_grad(), plain.disable_adapter(), fused.disable_adapter():
        want, got = plain(input_ids=x).logits, fused(input_ids=x).logits
    assert rel(got, want) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["layers", "model"])
def test_compiled_fused_model_agrees_with_eager(scope):
    torch._dynamo.reset()
    _, eager = pair(tiny_base)
    _, compiled = pair(tiny_base)
    x, y = batch(cols=16)
    want = CausalLMLoss(eager)(x, y)[0]
    want.backward()
    loss_model = compile_for_training(CausalLMLoss(compiled), scope=scope)
    loss_mod._chunk_ce_compiled.clear()
    got = loss_model(x, y)[0]
    # the loss' float32 part ran compiled too: a batch shorter than one chunk is a short last chunk, one dynamic graph
    assert list(loss_mod._chunk_ce_compiled) == [True]
    got.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-4)
    ref, out = adapter_grads(eager), adapter_grads(compiled)
    for name in ref:
        assert rel(out[name], ref[name]) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_autocast_eager_and_compiled_on_cuda():
    """As the loop runs on a GPU: a bf16 base, float32 adapters, bf16 autocast. Fused eager and fused compiled per
    layer against plain peft; bf16 tolerance 3e-2 relative. Under compile every adapter gradient must be non-zero
    (issue #14 found a traced autograd.Function returning zero gradients on CUDA)."""
    torch._dynamo.reset()

    def base():
        return build_model("tiny", vocab_size=VOCAB, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)

    plain, fused = pair(base)
    _, compiled = pair(base)
    x, y = (t.cuda() for t in batch(cols=64))
    results = []
    for model, loss_model in ((plain, CausalLMLoss(plain)), (fused, CausalLMLoss(fused)),
                              (compiled, compile_for_training(CausalLMLoss(compiled), scope="layers"))):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_model(x, y)[0]
        loss.backward()
        results.append((float(loss), adapter_grads(model)))
    (want, ref), *others = results
    for got, grads in others:
        assert got == pytest.approx(want, rel=3e-2)
        for name in ref:
            assert grads[name].norm() > 0 and rel(grads[name], ref[name]) < 3e-2, name


# ---------------------------------------------------------------- where it cannot apply

@pytest.mark.parametrize("override,needle", [
    ("quant.load_in_4bit=true", "not quant.load_in_4bit=true"),
    ("lora.dropout=0.1", "lora.dropout=0"),
    ("lora.target_modules=q_proj,v_proj,gate_proj,up_proj", "missing ['k_proj']"),
    ("lora.target_modules=q_proj,k_proj,v_proj,o_proj", "missing ['gate_proj', 'up_proj']"),
])
def test_config_refuses_fusion_where_it_cannot_apply(override, needle):
    with pytest.raises(ConfigError, match="model.fuse_lora") as e:
        load_config(TINY, ["model.fuse_lora=true", override])
    assert needle in str(e.value)


def test_config_default_is_off_and_all_linear_qualifies():
    assert load_config(TINY).model.fuse_lora is False
    assert load_config(TINY, ["model.fuse_lora=true", "lora.target_modules=all-linear"]).model.fuse_lora


def test_models_that_cannot_be_fused_are_refused_with_the_key():
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB)
    with pytest.raises(ModelError, match="model.fuse_lora=true.*'qwen2'"):
        check_fusable_config(config)
    check_fusable_config(gqa_base().config)
    qwen = apply_lora(transformers.AutoModelForCausalLM.from_config(config).requires_grad_(False), r=4)
    with pytest.raises(ModelError, match="model.fuse_lora=true: only transformers' own LlamaForCausalLM"):
        fuse_lora_projections(qwen)
    only_attention = apply_lora(tiny_base(), r=4, targets=["q_proj", "k_proj", "v_proj"])
    with pytest.raises(ModelError, match=r"model.fuse_lora=true: model.layers.0.mlp.gate_proj is a Linear"):
        fuse_lora_projections(only_attention)
    _, fused = pair(tiny_base)
    with pytest.raises(ModelError, match="fused already"):
        fuse_lora_projections(fused)


def test_preflight_refuses_a_model_that_is_not_a_llama(tmp_path):
    from raytrain_scu.driver.preflight import preflight
    from raytrain_scu.errors import PreflightError

    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "qwen2"))
    cfg = tiny_cfg(tmp_path, "qwen2-run", f"model.name={tmp_path / 'qwen2'}", "model.tokenizer=shakespeare-bpe",
                   "model.fuse_lora=true", "tracking.enabled=false")
    with pytest.raises(PreflightError, match="model.fuse_lora=true: .*'qwen2'"):
        preflight(cfg)


def test_dora_and_dropout_are_refused():
    from peft import LoraConfig, get_peft_model

    for kw, needle in ((dict(use_dora=True), "DoRA"), (dict(lora_dropout=0.1), "dropout")):
        model = get_peft_model(tiny_base(), LoraConfig(r=4, target_modules="all-linear", **kw))
        with pytest.raises(ModelError, match=f"model.layers.0.self_attn.q_proj: .*{needle}"):
            fuse_lora_projections(model)


@pytest.mark.slow
def test_bench_part_ours_fused_trains_like_ours(tmp_path):
    import json

    from raytrain_scu.studies.bench import cli as bench

    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--parts", "ours,ours_fused", "--out", str(out)]) == 0
    parts = json.loads(out.read_text())["parts"]
    assert parts["ours_fused"]["tokens_per_s"] > 0
    for key in ("bpt_after", "lora_b_norm"):  # the same training, to the bench's rounding
        assert parts["ours_fused"][key] == pytest.approx(parts["ours"][key], abs=2e-4), key


# ---------------------------------------------------------------- the real loop, on Ray, with MLflow

@pytest.mark.slow
def test_a_fused_run_on_ray_tracks_the_plain_run(plain_run, tmp_path):
    """Two CPU workers (gloo), a real MLflow sqlite store, real checkpoints: a fused run's DataBPT and λ
    follow the plain run's step by step, its exported adapter equals the plain run's, and MLflow records the key."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from raytrain_scu.core.model.source import load_tokenizer
    from raytrain_scu.driver.run import run

    plain_storage, plain = plain_run
    summaries = {"false": plain, "true": run(tiny_cfg(tmp_path, "fuse-true", "model.fuse_lora=true", *PLAIN_RUN),
                                             quiet=True)}
    client, runs = mlflow_runs(tmp_path, "fuse-true")
    assert len(runs) == 1 and runs[0].data.params["model.fuse_lora"] == "True"
    histories = {f: {k: metric_history(where, name, k) for k in ("train/data_bpt", "ctrl/lambda")}
                 for f, where, name in (("false", plain_storage, "plain"), ("true", tmp_path, "fuse-true"))}
    for k, want in histories["false"].items():
        assert len(want) >= 6 and histories["true"][k] == pytest.approx(want, rel=1e-4), k
    adapters = {f: load_file(f"{s['adapter']}/adapter_model.safetensors") for f, s in summaries.items()}
    assert adapters["true"].keys() == adapters["false"].keys()
    for k, v in adapters["false"].items():
        assert rel(adapters["true"][k], v) < 1e-3, k
    # CPU runs are bitwise reproducible (test_train's resume test): differing last bits show the workers fused
    assert any(not torch.equal(adapters["true"][k], v) for k, v in adapters["false"].items())
    tok = load_tokenizer("tiny")
    assert any(v.norm() > 0 for k, v in adapters["true"].items() if "lora_B" in k)  # it trained
    x = torch.randint(0, len(tok), (1, 16))
    loaded = PeftModel.from_pretrained(build_model("tiny", vocab_size=len(tok)), summaries["true"]["adapter"])
    with torch.no_grad():  # the exported adapter loads into a plain peft model and acts there
        assert not torch.allclose(loaded(input_ids=x).logits, build_model("tiny", vocab_size=len(tok))(x).logits)
