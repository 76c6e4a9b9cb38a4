"""quant.embedding_int8 and quant.offload_embedding (embed_quant.py): the int8 table's arithmetic, slice by slice; a
built model's loss and adapter gradients against the plain model's; the offloaded embedding leaves nothing on the
model's device and changes no number; the errors; the memory estimate. The fused loss against the int8 model's own
logits, family by family, is in test_loss_arch.py."""
import pytest
import torch

from raytrain_scu.config.load import build_config
from raytrain_scu.core import embed_quant
from raytrain_scu.core.embed_quant import (
    Int8Embedding,
    Int8Head,
    OffloadedEmbedding,
    int8_grad_input,
    int8_logits,
    quantize_rows_int8,
)
from raytrain_scu.core.loss import CausalLMLoss
from raytrain_scu.core.model.build import apply_lora, build_model
from raytrain_scu.core.regularizer import adapter_params
from raytrain_scu.errors import ModelError
from raytrain_scu.hardware import gpus, memory
from raytrain_scu.hardware.shape import memory_kwargs

TIED, UNTIED = "tiny", "tiny-llama-3.1-8b"


def test_int8_rows_round_trip_within_half_a_step_and_slices_change_nothing(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 48, generator=g) * torch.logspace(-3, 1, 300)[:, None]  # rows of very different scales
    w[7] = 0.0
    q, s = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and int(q.abs().max()) == 127
    assert torch.all((w - q.float() * s[:, None]).abs() <= s[:, None] / 2 + 1e-7)
    assert torch.all(q[7] == 0) and torch.isfinite(s).all()
    h, grad = torch.randn(5, 48, generator=g), torch.randn(5, 300, generator=g)
    dense = q.float() * s[:, None]
    whole = int8_logits(h, q, s), int8_grad_input(grad, q, s)
    monkeypatch.setattr(embed_quant, "SLICE_BYTES", 48 * 4 * 64)  # 64 rows a slice: 5 slices, the last short
    assert len(embed_quant.row_slices(300, 48, 4)) == 5
    q2, s2 = quantize_rows_int8(w)
    assert torch.equal(q2, q) and torch.equal(s2, s)
    for got, want in ((int8_logits(h, q, s), h @ dense.t()), (int8_grad_input(grad, q, s), grad @ dense)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole[0], int8_logits(h, q, s), rtol=1e-6, atol=1e-6)  # the same columns
    torch.testing.assert_close(whole[1], int8_grad_input(grad, q, s), rtol=1e-5, atol=1e-5)  # summed in 5 parts


def loss_and_grads(name: str, **kw):
    """Σ nats and the adapters' gradient of one batch, on a seeded tiny preset with non-zero adapters."""
    torch.manual_seed(0)
    model = apply_lora(build_model(name, vocab_size=512, gradient_checkpointing=True, **kw), r=4, alpha=8,
                       targets=["q_proj", "v_proj", "down_proj"])
    for p in adapter_params(model):
        p.data.normal_(0.0, 0.05)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    nats, _ = CausalLMLoss(model, chunk_size=16)(x, torch.roll(x, -1, 1))
    nats.backward()
    return model, float(nats), torch.cat([p.grad.reshape(-1) for p in adapter_params(model)])


@pytest.mark.parametrize("name", [TIED, UNTIED])
def test_an_int8_embedding_and_head_train_as_the_plain_base_does(name):
    """The same loss to 1e-4 and the same gradient direction; a tied model keeps one table for both."""
    _, nats, grad = loss_and_grads(name)
    model, nats8, grad8 = loss_and_grads(name, embedding_int8=True)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, Int8Embedding) and isinstance(head, Int8Head)
    assert (head.table is emb.table) == (name == TIED)
    assert emb.weight.dtype == torch.int8 and not any(p.requires_grad for p in emb.parameters())
    assert nats8 == pytest.approx(nats, rel=1e-4) and nats8 != nats  # int8 rounding moves it, a little
    assert float(torch.nn.functional.cosine_similarity(grad8, grad, dim=0)) > 0.999
    # checkpointing's input-requires-grad hook came along (peft adds its own copy)
    assert emb._forward_hooks and emb(torch.tensor([[1, 2]])).requires_grad


def test_an_offloaded_embedding_changes_no_number_and_stays_off_the_device():
    _, nats, grad = loss_and_grads(UNTIED)
    model, nats_off, grad_off = loss_and_grads(UNTIED, offload_embedding=True)
    emb = model.get_input_embeddings()
    assert isinstance(emb, OffloadedEmbedding) and not list(emb.parameters()) and not list(emb.buffers())
    assert nats_off == nats and torch.equal(grad_off, grad)
    model.to(torch.float64)  # moving the model leaves the CPU table alone: it is outside the module tree
    assert emb.inner.weight.dtype == torch.float32
    mem = gpus.measured_memory_gib(model)
    table = emb.inner.weight.numel() * 4 / 2**30
    assert mem["embedding"] == 0.0 and mem["embedding_offloaded"] == pytest.approx(table, abs=1e-6) and table > 0


def staged_model(device: str = "cpu"):
    model = apply_lora(build_model(UNTIED, vocab_size=512, gradient_checkpointing=True, offload_embedding=True,
                                   device=torch.device(device)), r=4, alpha=8, targets=["q_proj"])
    return model, model.get_input_embeddings()


def test_the_forward_takes_the_rows_staged_for_its_ids_and_looks_up_any_others():
    """The forward given the very device ids a batch was staged for returns the staged rows (here deliberately another
    batch's, to see which it took), once; other ids in between (an evaluation's) are looked up and leave the stage
    for its batch; the same ids a second time are looked up."""
    model, emb = staged_model()
    g = torch.Generator().manual_seed(2)
    x, other = torch.randint(0, 512, (2, 24), generator=g), torch.randint(0, 512, (2, 24), generator=g)
    x_dev = x.clone()
    emb.stage(other, x_dev)
    assert torch.equal(emb(x.clone()), emb.inner(x))  # equal ids, another tensor: looked up
    assert torch.equal(emb(x_dev), emb.inner(other))  # the staged rows, still there
    assert torch.equal(emb(x_dev), emb.inner(x))  # consumed: looked up
    assert emb._staged is None
    # checkpointing's input-requires-grad hook still applies to staged rows
    emb.stage(x, x_dev)
    assert emb(x_dev).requires_grad


@pytest.mark.slow
def test_the_loop_stages_every_training_batch_and_trains(tmp_path, monkeypatch):
    from conftest import tiny_cfg

    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    taken = []
    forward = OffloadedEmbedding.forward

    def counting(self, ids):
        taken.append(self._staged is not None and self._staged[0] is ids)
        return forward(self, ids)

    monkeypatch.setattr(OffloadedEmbedding, "forward", counting)
    hooks = LocalHooks()
    run_loop(tiny_cfg(tmp_path, "staged", f"model.name={UNTIED}", "quant.offload_embedding=true",
                      "scaling.num_workers=1", "train.max_steps=4", "train.report_every=2", "train.eval_every=2",
                      "train.checkpoint_every=4", "controller.mode=none"), hooks=hooks)
    assert hooks.reports[-1]["train/lora_b_norm"] > 0
    # grad_accum 2 (tiny-cpu.yaml): every training batch staged, also the one sent ahead before the evaluation after
    # step 2; the evaluations (at the start, after steps 2 and 4: 32 blocks, 8 batches each) look theirs up
    ev, step = [False] * 8, [True] * 2
    assert taken == ev + step + step + ev + step + step + ev, taken


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_staged_forward_on_cuda_never_syncs_and_changes_no_number():
    model, emb = staged_model("cuda")
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3)).pin_memory()
    x_dev = x.to("cuda", non_blocking=True)
    want = emb(x_dev)  # looked up: a device-to-host copy of the ids
    emb.stage(x, x_dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = emb(x_dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="synchroniz"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            emb(x_dev)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_a_tied_model_cannot_offload_its_embedding():
    with pytest.raises(ModelError, match=r"quant.offload_embedding: this model ties its input embedding"):
        build_model(TIED, vocab_size=512, offload_embedding=True)


def test_a_trainable_or_unknown_embedding_is_refused():
    from raytrain_scu.core.embed_quant import shrink_embeddings

    model = build_model(UNTIED, vocab_size=512)
    model.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(ModelError, match="quant.embedding_int8: the input embedding is trainable"):
        shrink_embeddings(model, int8=True)
    model.set_input_embeddings(torch.nn.Linear(4, 4))
    with pytest.raises(ModelError, match="quant.offload_embedding: the input embedding is a Linear"):
        shrink_embeddings(model, offload=True)


def test_the_options_are_config_keys_and_the_estimate_shrinks_by_the_tables():
    cfg = build_config({"quant": {"embedding_int8": True, "offload_embedding": True}})
    kw = memory_kwargs(cfg)
    assert kw["embedding_int8"] is True and kw["offload_embedding"] is True
    shape = dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256)
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    for tables in (1, 2):
        n = linear + (2 * 32 + 1) * 4096 + tables * 128256 * 4096
        est = {(i8, off): memory.estimate_peak_memory_gib(
            n_params=n, **shape, lora_r=16, lora_targets=["q_proj"], load_in_4bit=True, precision="bf16",
            batch_size=2, block_size=2048, gradient_checkpointing=True, compile=False, embedding_int8=i8,
            offload_embedding=off)["weights_gib"] for i8 in (False, True) for off in (False, True)}
        bf16, int8 = 128256 * 4096 * 2 / 2**30, 128256 * (4096 + 4) / 2**30
        assert est[True, False] == pytest.approx(est[False, False] - tables * (bf16 - int8), rel=1e-9)
        # offloading takes the input table off the device only where it is not also the head
        assert est[False, True] == pytest.approx(est[False, False] - (bf16 if tables == 2 else 0.0), rel=1e-9)


def test_fp16_logits_do_not_overflow_and_gradients_keep_their_precision():
    """The slice is dequantised before the product: ``h @ q.T`` alone reaches 127/max|w| times a logit, past fp16's
    65504 for a row the hidden state points at (found in review: inf, so a NaN loss)."""
    torch.manual_seed(0)
    h = torch.nn.functional.normalize(torch.randn(4, 4096), dim=-1) * 4096 ** 0.5  # RMS-normed, as before the head
    w = torch.randn(256, 4096) * 0.02
    w[0] = w[0] * 0.5 + h[0] * 0.01
    q, s = quantize_rows_int8(w)
    dense = q.float() * s[:, None]
    got, want = int8_logits(h.half(), q, s).float(), h @ dense.t()
    assert torch.isfinite(got).all() and float(want[0, 0]) > 30
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0.05)
    g = torch.randn(4, 256)
    torch.testing.assert_close(int8_grad_input(g.half(), q, s).float(), g @ dense, rtol=2e-2, atol=2e-3)


def test_the_heads_own_forward_saves_the_int8_table_not_a_dequantised_copy():
    """model.fused_loss=false (or an unknown head) runs Int8Head.forward under autograd: it must keep only the int8
    table and its scales for the backward, and its input-gradient must be the dense one."""
    torch.manual_seed(0)
    head = Int8Head(embed_quant.Int8Table(torch.randn(3000, 64)))
    x = torch.randn(5, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = head(x)
    assert {t.dtype for t in saved} <= {torch.int8, torch.float32} and sum(t.numel() for t in saved
                                                                             if t.dtype != torch.int8) <= 3000 + 5 * 64
    g = torch.randn_like(out)
    out.backward(g)
    dense = head.weight.float() * head.weight_scale[:, None]
    torch.testing.assert_close(x.grad, g @ dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, x.detach() @ dense.t(), rtol=1e-5, atol=1e-5)


def test_offloading_moves_the_input_grad_hook_off_the_cpu_table():
    model = build_model(UNTIED, vocab_size=512, gradient_checkpointing=True, offload_embedding=True)
    emb = model.get_input_embeddings()
    assert emb._forward_hooks and not emb.inner._forward_hooks  # no gradient is accumulated on the CPU copy
    assert emb(torch.tensor([[1, 2]])).requires_grad


def test_lora_on_a_replaced_table_is_refused_and_a_resume_must_keep_the_table():
    from raytrain_scu.core.checkpoint import check_structure
    from raytrain_scu.core.model.build import structure_signature
    from raytrain_scu.errors import CheckpointError

    base = build_model(UNTIED, vocab_size=512, embedding_int8=True)
    with pytest.raises(ModelError, match=r"lora.target_modules: \['embed_tokens'\] would put LoRA on the embedding"):
        apply_lora(base, r=4, alpha=8, targets=["q_proj", "embed_tokens"])
    sig = dict(name="tiny", gguf_file="", r=4, alpha=8, targets=["q_proj"], block_size=64, load_in_4bit=False,
               law="logodds", init_device="cpu")
    old = {"structure": {k: v for k, v in structure_signature(**sig).items() if k != "quant.embedding_int8"}}
    check_structure(old, structure_signature(**sig))  # a checkpoint from before the key: made with the bf16 table
    with pytest.raises(CheckpointError, match="quant.embedding_int8: checkpoint has False, config has True"):
        check_structure(old, structure_signature(**sig, embedding_int8=True))


def test_measured_memory_counts_lora_on_the_embedding_once():
    model = apply_lora(build_model(UNTIED, vocab_size=512), r=4, alpha=8, targets=["q_proj", "embed_tokens"])
    got = gpus.measured_memory_gib(model)
    total = sum(p.numel() * 4 for p in model.parameters()) / 2**30
    assert sum(got[k] for k in ("embedding", "lm_head", "adapters", "other_params")) == pytest.approx(total, abs=4e-6)
