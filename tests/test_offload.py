"""model.offload_activations (core/offload.py): what the hooks move and what they leave, the same loss and adapter
gradients with and without them (eager and with compiled layers), and the config's refusals. The CPU tests let the
hooks move CPU tensors (a host copy stands in for pinned memory, no streams); the CUDA tests move them for real and
check the memory they free and that the hooks never sync."""
import pytest
import torch
from conftest import TINY, adapter_step, tiny_cfg
from torch.nn.attention import SDPBackend, sdpa_kernel

from raytrain_scu.config.load import load_config
from raytrain_scu.core.loss import CausalLMLoss, compile_for_training
from raytrain_scu.core.model.build import apply_lora, build_model
from raytrain_scu.core.offload import ActivationOffload
from raytrain_scu.core.regularizer import adapter_params
from raytrain_scu.errors import ConfigError

LAYERS = 2  # tiny-llama-3.1-8b


def _model(device="cpu", name="tiny-llama-3.1-8b", dtype=torch.float32, checkpointing=True):
    torch.manual_seed(0)
    model = apply_lora(build_model(name, vocab_size=512, gradient_checkpointing=checkpointing,
                                   device=torch.device(device), dtype=dtype),
                       r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    for p in adapter_params(model):
        p.data.normal_(0.0, 0.05)
    model.train()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_the_layers_saved_inputs_move_and_nothing_else_changes(compiled):
    """Each checkpointed layer's input crosses (and the final norm's), never a parameter; the loss and every adapter
    gradient are bit for bit those of the same model without the hooks, for two steps in a row."""
    torch._dynamo.reset()
    model = _model()
    loss_model = CausalLMLoss(model, chunk_size=16)
    if compiled:
        loss_model = compile_for_training(loss_model)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    want = [adapter_step(loss_model, model, x) for _ in range(2)]
    hidden_bytes = 2 * 24 * 128 * 4  # one layer input: batch x tokens x hidden, float32
    loss_model.offload = ActivationOffload(model, devices=("cpu",), min_bytes=hidden_bytes)
    got = [adapter_step(loss_model, model, x) for _ in range(2)]
    for (n_got, g_got), (n_want, g_want) in zip(got, want):
        assert n_got == n_want
        assert torch.equal(g_got, g_want)
    off = loss_model.offload
    assert off.moved >= LAYERS and off.moved_bytes == off.moved * hidden_bytes
    assert off.left_unused == 0 and off._held == []  # every moved tensor came back, and the list went at the end
    with torch.no_grad():  # an evaluation moves nothing: no backward follows
        loss_model(x, torch.roll(x, -1, 1))
    assert off.moved >= LAYERS  # still the last training forward's count


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_without_checkpointing_a_budget_moves_the_bottom_activations_and_nothing_else_changes(compiled):
    """No checkpointing, a budget of about one and a half layers' activations: the first tensors saved move until the
    next would pass it, every one of them is fetched ahead of its ask (a compiled layer's backward asks for its saved
    tensors lowest first, so the window must reach across a layer: it does once the budget holds one), and the loss
    and adapter gradients are bit for bit those of the same model without the hooks."""
    torch._dynamo.reset()
    model = _model(checkpointing=False)
    loss_model = CausalLMLoss(model, chunk_size=16)
    if compiled:
        loss_model = compile_for_training(loss_model)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    want = [adapter_step(loss_model, model, x) for _ in range(2)]
    budget = 600_000  # a layer saves about 400 kB of activations here
    loss_model.offload = ActivationOffload(model, budget_bytes=budget, ahead_bytes=budget, devices=("cpu",),
                                           min_bytes=1024)
    got = [adapter_step(loss_model, model, x) for _ in range(2)]
    for (n_got, g_got), (n_want, g_want) in zip(got, want):
        assert n_got == n_want
        assert torch.equal(g_got, g_want)
    off = loss_model.offload
    assert off.moved >= 3 and budget / 2 <= off.moved_bytes <= budget
    assert off.waited == 0 and off.left_unused == 0 and off._held == []


class _Logged(ActivationOffload):
    """The order of the backward's asks and the fetches they start, by offset."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    def _fetch(self, held):
        self.log.append(("fetch", held.start))
        super()._fetch(held)

    def _fetch_ahead(self, start, nbytes):
        self.log.append(("ask", start))
        super()._fetch_ahead(start, nbytes)


@pytest.mark.parametrize("ahead, lead", [(0, 1), (3, 3)])
def test_each_moved_tensor_is_fetched_once_the_backward_is_within_the_window_above_it(ahead, lead):
    """A chain of eight saved tanh outputs, the first three moved: each comes back when the backward asks for the
    tensor ``lead`` places above it (the window is ``ahead`` tensors, and at least the asked one), never sooner; the
    asks of tensors above every window are not watched."""
    unit = 64 * 64 * 4
    off = _Logged(torch.nn.Module(), budget_bytes=3 * unit, ahead_bytes=ahead * unit, devices=("cpu",), min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off.hooks():
        h = x
        for _ in range(8):
            h = torch.tanh(h)
    h.sum().backward()
    assert off.moved == 3 and off.left_unused == 0
    asks = [s // unit for kind, s in off.log if kind == "ask"]
    # tensors saved so far above the moved ones that their asks could start no fetch are not watched
    assert asks == list(range(2 + max(ahead, 1), -1, -1))
    for i in range(3):  # the fetch of tensor i comes right after the ask of tensor i + lead
        at = off.log.index(("fetch", i * unit))
        assert off.log[at - 1] == ("ask", (i + lead) * unit)
    assert off.waited == 0


def test_a_backward_that_asks_for_part_of_what_moved_leaves_nothing_fetched_behind():
    """A backward through only the first of two saved chains (the second's output is never used): the tensors it
    asks for come back in order, the other's are counted unused and released at the backward's end."""
    off = ActivationOffload(torch.nn.Module(), devices=("cpu",), min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off.hooks():
        a = torch.tanh(x * 2.0)
        b = torch.sigmoid(x * 3.0)  # saved too, never backpropagated
    (gx,) = torch.autograd.grad(a.sum(), x)
    torch.testing.assert_close(gx, 2.0 * (1 - torch.tanh(2.0 * x) ** 2))
    assert off.moved >= 2 and off.left_unused >= 1 and off._held == []
    del b


def _estimate_8b(overrides: list[str], **kw) -> dict:
    """The memory estimate of the 8B shape at 2 x 2048 in bf16 under ``overrides``, with estimator keywords ``kw``
    replacing the config's."""
    from raytrain_scu.hardware.shape import memory_kwargs
    from raytrain_scu.hardware.memory import estimate_peak_memory_gib

    shape = dict(n_params=8_030_000_000, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256)
    cfg = load_config(TINY, ["data.batch_size=2", "data.block_size=2048", "model.precision=bf16",
                             "scaling.use_gpu=null", *overrides])
    return estimate_peak_memory_gib(**{**shape, **memory_kwargs(cfg), **kw})


def test_the_memory_estimate_counts_two_layer_inputs_in_flight_when_they_wait_on_the_host():
    qlora = ["model.gradient_checkpointing=true", "quant.load_in_4bit=true"]
    kept = _estimate_8b(qlora)["activations_gib"]
    moved = _estimate_8b(qlora, offload_activations=True)["activations_gib"]
    assert kept - moved == pytest.approx(30 * 2 * 2048 * 4096 * 2 / 2**30)  # 30 of 32 layer inputs, bf16


def test_parameters_their_views_small_and_gapped_tensors_stay():
    model = _model()
    off = ActivationOffload(model, devices=("cpu",), min_bytes=1024)
    w = model.get_input_embeddings().weight
    assert not off._movable(w) and not off._movable(w.t()) and not off._movable(w[3:])
    act = torch.randn(64, 64)
    assert off._movable(act) and off._movable(act.t())  # dense in any order
    assert not off._movable(act[:, ::2])  # not dense: its copy would not keep its strides
    assert not off._movable(torch.randn(8, 8))  # under min_bytes
    assert not ActivationOffload(model)._movable(act)  # CUDA tensors only, by default


@pytest.mark.parametrize("overrides, need", [
    (["model.offload_activations=true"], "model.gradient_checkpointing=true or a budget"),
    (["model.offload_activations=true", "model.gradient_checkpointing=true", "model.compile=true",
      "model.compile_scope=model"], "model.compile_scope=layers"),
    (["model.offload_activations=true", "model.gradient_checkpointing=true", "scaling.use_gpu=false"], "a GPU"),
])
def test_the_config_refuses_what_it_cannot_run_with(overrides, need):
    with pytest.raises(ConfigError, match=rf"model\.offload_activations: needs {need}"):
        load_config(TINY, overrides)
    ok = load_config(TINY, ["model.offload_activations=true", "model.gradient_checkpointing=true",
                            "scaling.use_gpu=null"])  # a worker on a CPU is refused when it builds
    assert ok.model.offload_activations
    budget = load_config(TINY, ["model.offload_activations=true", "model.offload_activations_gib=1.5",
                                "scaling.use_gpu=null"])  # no checkpointing needed with a budget
    assert budget.model.offload_activations_gib == 1.5


@pytest.mark.parametrize("overrides, says", [
    (["model.offload_activations=true", "model.offload_activations_gib=-1"], "must be 0 or between"),
    (["model.offload_activations=true", "model.offload_activations_gib=1e-12"], "must be 0 or between"),
    (["model.offload_activations=true", "model.offload_activations_gib=inf"], "must be 0 or between"),
    (["model.offload_activations_gib=2"], "is a budget for model.offload_activations, which is off"),
])
def test_the_config_refuses_a_budget_it_cannot_use(overrides, says):
    with pytest.raises(ConfigError, match=rf"model\.offload_activations_gib: {says}"):
        load_config(TINY, [*overrides, "scaling.use_gpu=null"])


def test_the_memory_estimate_takes_the_budget_off_the_activations():
    budget = ["model.compile=true", "model.offload_activations=true", "model.offload_activations_gib=2"]
    moved, kept = _estimate_8b(budget), _estimate_8b(budget, offload_activations=False)
    assert kept["activations_gib"] - moved["activations_gib"] == pytest.approx(2.0)
    assert kept["total_gib"] - moved["total_gib"] == pytest.approx(2.0)
    # under checkpointing a budget moves as many whole layer inputs (32 MiB each here) as it holds: 0.5 GiB, 16
    half = _estimate_8b(budget, gradient_checkpointing=True, offload_activations_gib=0.5)["activations_gib"]
    none = _estimate_8b(budget, gradient_checkpointing=True, offload_activations=False)["activations_gib"]
    assert none - half == pytest.approx(16 * 2 * 2048 * 4096 * 2 / 2**30)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_inputs_cross_to_pinned_memory_and_free_the_card():
    """The 1B shape's 16 layers (a 512-token vocabulary), compiled, checkpointed, bf16 autocast: the loss and
    gradients of the same batch differ from the unmoved model's by no more than two unmoved runs differ from each
    other (nothing, where the kernels are deterministic: the copies are exact), and at least half the moved bytes
    are off the card's peak."""
    torch._dynamo.reset()
    model = _model("cuda", name="llama-3.2-1b-shape", dtype=torch.bfloat16)
    loss_model = compile_for_training(CausalLMLoss(model, chunk_size=1024))
    x = torch.randint(0, 512, (2, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = [adapter_step(loss_model, model, x) for _ in range(2)]
        base_peak = _peak(loss_model, model, x)
        loss_model.offload = ActivationOffload(model)
        got = [adapter_step(loss_model, model, x) for _ in range(2)]
        off_peak = _peak(loss_model, model, x)
    spread = float((want[0][1] - want[1][1]).abs().max())
    for n_got, g_got in got:
        assert abs(n_got - want[0][0]) <= abs(want[1][0] - want[0][0])
        assert float((g_got - want[0][1]).abs().max()) <= 2 * spread
    moved = loss_model.offload.moved_bytes
    assert moved >= 16 * 2 * 1024 * 2048 * 2  # every layer's input
    assert base_peak - off_peak >= 0.5 * moved, (base_peak, off_peak, moved)
    print(f"\n[gpu] {torch.cuda.get_device_name(0)}: peak {base_peak / 2**20:.1f} -> {off_peak / 2**20:.1f} MiB, "
          f"{moved / 2**20:.1f} MiB moved; gradient spread between two unmoved runs {spread:.3g}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_budget_without_checkpointing_frees_the_card_and_waits_for_no_copy():
    """The 1B shape's 16 layers (a 512-token vocabulary), compiled, not checkpointed, bf16 autocast, 0.5 GiB budget
    (a few layers' activations): the loss and gradients stay within two unmoved runs' spread (none, with the math
    attention kernel), every moved tensor comes back, and at least half the moved bytes are off the peak."""
    torch._dynamo.reset()
    model = _model("cuda", name="llama-3.2-1b-shape", dtype=torch.bfloat16, checkpointing=False)
    loss_model = compile_for_training(CausalLMLoss(model, chunk_size=1024))
    x = torch.randint(0, 512, (2, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    budget = 2**29
    # SDPA's math kernel: deterministic, where cuDNN's backward is not, so two unmoved runs agree and the moved run
    # (exact copies) must agree with them bit for bit
    with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.MATH):
        want = [adapter_step(loss_model, model, x) for _ in range(2)]
        base_peak, base_reserved = _peak(loss_model, model, x), _peak(loss_model, model, x, reserved=True)
        loss_model.offload = ActivationOffload(model, budget_bytes=budget, ahead_bytes=budget)
        got = [adapter_step(loss_model, model, x) for _ in range(2)]
        off_peak, off_reserved = _peak(loss_model, model, x), _peak(loss_model, model, x, reserved=True)
    spread = float((want[0][1] - want[1][1]).abs().max())
    for n_got, g_got in got:
        assert abs(n_got - want[0][0]) <= abs(want[1][0] - want[0][0])
        assert float((g_got - want[0][1]).abs().max()) <= 2 * spread
    off = loss_model.offload
    assert 0.5 * budget <= off.moved_bytes <= budget
    assert off.left_unused == 0
    assert base_peak - off_peak >= 0.5 * off.moved_bytes, (base_peak, off_peak, off.moved_bytes)
    print(f"\n[gpu] {torch.cuda.get_device_name(0)}: budget, no checkpointing: peak {base_peak / 2**20:.1f} -> "
          f"{off_peak / 2**20:.1f} MiB allocated, {base_reserved / 2**20:.1f} -> {off_reserved / 2**20:.1f} MiB "
          f"reserved, {off.moved_bytes / 2**20:.1f} MiB moved in {off.moved} tensors, {off.waited} asked before "
          f"their fetch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("checkpointed", [True, False])
def test_on_cuda_the_hooks_never_sync_the_host(checkpointed):
    """Layers of plain torch ops (no library code of its own that syncs), checkpointed (everything moves) or not (a
    budget of two layers' saves), through a forward and a backward under the hooks, in CUDA's sync debug mode: no
    copy out or fetch waits for the device."""
    from torch.utils.checkpoint import checkpoint

    model = torch.nn.ParameterList([torch.randn(512, 512, device="cuda") for _ in range(4)])
    ws = list(model)
    budget = None if checkpointed else 2 * 2 * 1024 * 512 * 4  # each layer saves t @ w and its tanh
    off = ActivationOffload(model, budget_bytes=budget, ahead_bytes=budget or 0)
    x = torch.randn(1024, 512, device="cuda", requires_grad=True)
    for _ in range(2):  # the second time from the pinned host allocator's cache
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with off.hooks():
                h = x
                for w in ws:
                    layer = (lambda t, w=w: torch.tanh(t @ w))
                    h = checkpoint(layer, h, use_reentrant=False) if checkpointed else layer(h)
            h.sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert off.moved == (len(ws) if checkpointed else 4) and off.left_unused == 0


def _peak(loss_model, model, x, reserved: bool = False) -> int:
    """The step's peak allocated memory, or with ``reserved`` its peak reserved from an emptied cache (what decides an
    out-of-memory error)."""
    torch.cuda.synchronize()
    if reserved:
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    adapter_step(loss_model, model, x)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()


def test_a_worker_on_a_cpu_refuses_it_before_its_firstadapter_step(tmp_path):
    """With scaling.use_gpu left to detection, a worker that lands on a CPU says so when it builds."""
    from raytrain_scu.errors import ModelError
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    cfg = tiny_cfg(tmp_path, "acts", "model.offload_activations=true", "model.gradient_checkpointing=true",
                   "scaling.use_gpu=null", "tracking.enabled=false", "train.max_steps=1")
    with pytest.raises(ModelError, match=r"model\.offload_activations=true moves activations from GPU to host "
                                         r"memory; this worker runs on cpu"):
        run_loop(cfg, hooks=LocalHooks(device=torch.device("cpu"), run_dir=tmp_path / "acts"))
