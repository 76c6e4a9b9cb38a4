"""quant.dequant_4bit=torch (core/nf4.py): the torch dequantisation equals bitsandbytes' bit for bit, with and
without double quantisation; a converted model's loss and adapter gradients equal the bitsandbytes model's (eager:
exactly; compiled: within float32 rounding, in one graph per layer); the config's choices and refusals."""
import pytest
import torch
from conftest import TINY, adapter_step

from raytrain_scu.config.load import load_config
from raytrain_scu.core import nf4
from raytrain_scu.core.loss import CausalLMLoss, compile_for_training
from raytrain_scu.core.model.build import apply_lora, build_model
from raytrain_scu.core.regularizer import adapter_params
from raytrain_scu.errors import ConfigError

bnb = pytest.importorskip("bitsandbytes")
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(tmp_path, double_quant: bool, device: str = "cpu"):
    torch.manual_seed(0)
    model = apply_lora(build_model("tiny-llama-3.1-8b", load_in_4bit=True, vocab_size=512, double_quant=double_quant,
                                   cache_dir=str(tmp_path), gradient_checkpointing=True, device=torch.device(device)),
                       r=4, alpha=8, targets=PROJ, quantized=True)
    for p in adapter_params(model):
        p.data.normal_(0.0, 0.05)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("double_quant", [True, False])
def test_torch_dequantises_as_bitsandbytes_and_the_model_trains_the_same(tmp_path, double_quant, device, request,
                                                                        monkeypatch):
    """On CUDA against bitsandbytes' CUDA kernels (float32 compute without TF32: the comparison is of the
    dequantisation, not of bf16 or TF32 rounding)."""
    from bitsandbytes import functional as bf
    from torch._dynamo.utils import counters

    dequantize = nf4.dequantize

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    request.addfinalizer(lambda: torch.set_float32_matmul_precision(precision))
    model = _model(tmp_path, double_quant, device)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    reference = [bf.dequantize_4bit(m.weight, m.weight.quant_state) for m in layers]
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    want = adapter_step(CausalLMLoss(model, chunk_size=16), model, x)
    assert nf4.convert_4bit_to_torch_dequant(model) == len(layers) == 2 * len(PROJ)
    calls = []
    monkeypatch.setattr(nf4, "dequantize", lambda *a: calls.append(1) or dequantize(*a))
    for m, ref in zip(layers, reference):
        assert type(m).__name__ == "TorchLinear4bit" and isinstance(m, bnb.nn.Linear4bit)
        absmax = (nf4.nested_absmax(m.nf4_absmax_q, m.nf4_absmax_code, m.nf4_absmax_scale, m.nf4_absmax_offset)
                  if double_quant else m.nf4_absmax)
        assert torch.equal(nf4.dequantize(m.weight, m.nf4_code, absmax, m.nf4_blocksize, m.nf4_shape, ref.dtype), ref)
    nats, grad = adapter_step(CausalLMLoss(model, chunk_size=16), model, x)
    assert nats == want[0] and torch.equal(grad, want[1])
    # every 4-bit layer's forward, its checkpointed recompute and its backward dequantised with torch's ops
    assert len(calls) == 3 * len(layers)
    monkeypatch.undo()
    assert nf4.convert_4bit_to_torch_dequant(model) == 0  # converted once
    torch._dynamo.reset()
    counters.clear()
    nats, grad = adapter_step(compile_for_training(CausalLMLoss(model, chunk_size=16)), model, x)
    assert nats == pytest.approx(want[0], rel=1e-6)
    torch.testing.assert_close(grad, want[1], rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # each layer one graph


def test_the_setting_resolves_and_the_config_refuses_what_torch_cannot_read():
    assert nf4.torch_dequant("auto", "nf4", compiled=True)
    assert not nf4.torch_dequant("auto", "nf4", compiled=False)
    assert not nf4.torch_dequant("auto", "fp4", compiled=True)
    assert nf4.torch_dequant("torch", "nf4", compiled=False)
    assert not nf4.torch_dequant("bitsandbytes", "nf4", compiled=True)
    with pytest.raises(ConfigError, match=r"quant\.dequant_4bit: torch dequantises a 4-bit base: needs "
                                          r"quant\.load_in_4bit=true"):
        load_config(TINY, ["quant.dequant_4bit=torch"])
    with pytest.raises(ConfigError, match=r"quant\.dequant_4bit: torch reads nf4 codes, not quant\.quant_type=fp4"):
        load_config(TINY, ["quant.dequant_4bit=torch", "quant.load_in_4bit=true", "quant.quant_type=fp4"])
    with pytest.raises(ConfigError, match=r"quant\.dequant_4bit"):
        load_config(TINY, ["quant.dequant_4bit=triton"])


def test_an_eval_forward_leaves_the_4bit_layers_as_they_train(tmp_path, monkeypatch):
    """bitsandbytes repacks a Linear4bit for its fused CPU inference kernel on its first eval forward without grad,
    where the CPU has AVX512-BF16; a repacked layer's forward has no backward (the LoRA layers below it stop learning)
    and a compiled layer meets a weight of another shape. build_model keeps every 4-bit layer in its trained layout:
    here as on a CPU that has the kernel, the weights keep their shape and the input's gradient survives the eval."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)  # as on such a CPU, whatever this one is
    model = _model(tmp_path, double_quant=True)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    shapes = [tuple(m.weight.shape) for m in layers]
    assert layers and all(s[1] == 1 for s in shapes)  # bitsandbytes' packed [N*K/2, 1] codes
    x = torch.randint(0, 512, (1, 8))
    model.eval()
    with torch.no_grad():
        model(input_ids=x)
    assert [tuple(m.weight.shape) for m in layers] == shapes
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    model.train()
    emb = model.get_input_embeddings()(x).detach().requires_grad_(True)
    model(inputs_embeds=emb).logits.float().square().mean().backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0
