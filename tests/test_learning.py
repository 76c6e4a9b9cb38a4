"""A loop that trains nothing must never report a speed or a BPT (issue #14, item 0).

The CPU test injects the failure seen on the GPU (no gradient through the loss: LoRA B stays exactly zero) and checks
that the loop refuses to go on. The GPU test runs the real model through the real loop, compiled and eager, and checks
that both learn and agree.
"""
import math
import os
import time

import pytest
import torch
from conftest import TINY

from raytrain_scu.config.load import load_config
from raytrain_scu.core import loss as loss_mod
from raytrain_scu.errors import NotLearningError
from raytrain_scu.worker.hooks import LocalHooks
from raytrain_scu.worker.loop import run_loop


def _cfg(tmp_path, *overrides, path=TINY):
    return load_config(path, [f"run.storage_path={tmp_path}", "run.name=learn", "tracking.enabled=false",
                              "scaling.num_workers=1", *overrides])


def test_loop_reports_the_adapter_norm_and_it_grows(tmp_path):
    hooks = LocalHooks(torch.device("cpu"))
    run_loop(_cfg(tmp_path, "train.max_steps=6", "train.report_every=2", "train.checkpoint_every=6"), hooks=hooks)
    norms = [r["train/lora_b_norm"] for r in hooks.reports]
    assert len(norms) == 3 and 0.0 < norms[0] < norms[1] < norms[2]


def test_loop_refuses_to_go_on_when_no_gradient_reaches_the_adapters(tmp_path, monkeypatch):
    # the GPU failure, injected: an exactly zero gradient flows back from the loss, so B never leaves zero
    real = loss_mod.chunked_ce_sum
    monkeypatch.setattr(loss_mod, "chunked_ce_sum",
                        lambda h, w, y, chunk_size=4096, **kw: real(h.detach() + 0.0 * h, w, y, chunk_size, **kw))
    hooks = LocalHooks(torch.device("cpu"))
    with pytest.raises(NotLearningError, match="every LoRA B matrix is still exactly zero"):
        run_loop(_cfg(tmp_path, "train.max_steps=6", "train.report_every=2", "controller.mode=none"), hooks=hooks)
    assert hooks.reports == []  # nothing was reported as if it had trained


# ---------------------------------------------------------------- GPU: the real model, compiled and eager

REAL = os.path.join(os.path.dirname(TINY), "smollm2-shakespeare.yaml")
STEPS = 8
# tolerances, decided before the run: bf16 autocast rounds differently when inductor fuses, so per-step train BPT may
# differ by a few hundredths of a bit; the adapters' B norm after 8 steps must agree within 5 %
BPT_TOL = 0.05
B_NORM_REL_TOL = 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_gpu_loop_learns_like_eager_on_the_real_model(tmp_path):
    """SmolLM2-135M (the offline GGUF) + Shakespeare, block 1024 x batch 16, bf16 autocast, controller off: the
    default experiment as a user runs it on an H100/H200 (issue #14, item 0). Before the fix the compiled loop kept
    every LoRA B at zero and val BPT stayed at its start value to every digit. A third run, compiled with the first
    GiB of saved activations in host memory (model.offload_activations_gib, no checkpointing), learns like the
    compiled one at a lower peak."""
    runs = {}
    for label, extra in (("eager", ["model.compile=false"]), ("compiled", ["model.compile=true"]),
                         ("compiled-offloaded", ["model.compile=true", "model.offload_activations=true",
                                                 "model.offload_activations_gib=1"])):
        hooks = LocalHooks()
        run_loop(_cfg(tmp_path, f"run.name=real-{label}", "model.precision=bf16", *extra, "controller.mode=none",
                      "data.block_size=1024", "data.batch_size=16", "data.grad_accum=1", f"train.max_steps={STEPS}",
                      "train.report_every=1", f"train.eval_every={STEPS}", f"train.checkpoint_every={STEPS}",
                      "scaling.use_gpu=true", path=REAL), hooks=hooks)
        runs[label] = hooks.reports
        torch._dynamo.reset()
    for label, reports in runs.items():
        bpt = [r["train/data_bpt"] for r in reports]
        assert len(bpt) == STEPS and all(math.isfinite(v) for v in bpt)
        assert bpt[-1] < bpt[0] - 0.2, (label, bpt)  # the loss falls (eager: about 0.45 bits in 8 steps)
        assert reports[-1]["val/data_bpt"] < reports[-1]["val/data_bpt_start"] - 0.05, label
        assert reports[0]["train/lora_b_norm"] > 0.0
    peak = {label: max(r.get("perf/max_mem_gib", 0.0) for r in reports) for label, reports in runs.items()}
    for ref, label in (("eager", "compiled"), ("compiled", "compiled-offloaded")):
        for e, c in zip(runs[ref], runs[label]):
            assert abs(e["train/data_bpt"] - c["train/data_bpt"]) < BPT_TOL, (label, e["step"], e["train/data_bpt"],
                                                                              c["train/data_bpt"])
        b_e, b_c = runs[ref][-1]["train/lora_b_norm"], runs[label][-1]["train/lora_b_norm"]
        assert abs(b_c - b_e) / b_e < B_NORM_REL_TOL, (label, b_e, b_c)
    assert peak["compiled-offloaded"] < peak["compiled"], peak
    for label, reports in runs.items():
        print(f"\n[gpu] {torch.cuda.get_device_name(0)} {label}: train BPT "
              f"{[round(r['train/data_bpt'], 4) for r in reports]}; val {reports[-1]['val/data_bpt_start']:.4f} -> "
              f"{reports[-1]['val/data_bpt']:.4f}; B norm {reports[-1]['train/lora_b_norm']:.4f}; peak "
              f"{peak[label]:.2f} GiB")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_int8_embedding_learns_like_the_bf16_one_on_the_real_model(tmp_path):
    """quant.embedding_int8 on the GPU path (bf16 autocast, the fused loss over SmolLM2's tied table in int8), eager
    and compiled, and under a 4-bit base, eager and compiled with the layers' saved inputs in host memory: every run
    learns; the int8 runs' train BPT stays within BPT_TOL of the bf16 table's at every step (the int8 rows are not
    the GGUF's 4-bit grid, so not equal), and the compiled, offloaded QLoRA run's within BPT_TOL of the eager one's."""
    runs = {}
    qlora = ["quant.embedding_int8=true", "quant.load_in_4bit=true"]
    for label, extra in (("bf16", []), ("int8", ["quant.embedding_int8=true"]),
                         ("int8-compiled", ["quant.embedding_int8=true", "model.compile=true"]),
                         ("qlora-int8", qlora),
                         ("qlora-int8-compiled-offloaded", [*qlora, "model.compile=true",
                                                            "model.gradient_checkpointing=true",
                                                            "model.offload_activations=true"])):
        hooks = LocalHooks()
        run_loop(_cfg(tmp_path, f"run.name=real-{label}", "model.precision=bf16", "model.compile=false",
                      "controller.mode=none", "data.block_size=1024", "data.batch_size=16", "data.grad_accum=1",
                      f"train.max_steps={STEPS}", "train.report_every=1", f"train.eval_every={STEPS}",
                      f"train.checkpoint_every={STEPS}", "scaling.use_gpu=true", *extra, path=REAL), hooks=hooks)
        runs[label] = hooks.reports
        torch._dynamo.reset()
    for label, reports in runs.items():
        bpt = [r["train/data_bpt"] for r in reports]
        assert bpt[-1] < bpt[0] - 0.2 and reports[-1]["val/data_bpt"] < reports[-1]["val/data_bpt_start"] - 0.05, \
            (label, bpt)
        print(f"\n[gpu] {torch.cuda.get_device_name(0)} {label}: train BPT {[round(v, 4) for v in bpt]}; val "
              f"{reports[-1]['val/data_bpt_start']:.4f} -> {reports[-1]['val/data_bpt']:.4f}; peak "
              f"{max(r.get('perf/max_mem_gib', 0.0) for r in reports):.3f} GiB")
    for ref, label in (("bf16", "int8"), ("bf16", "int8-compiled"), ("qlora-int8", "qlora-int8-compiled-offloaded")):
        for a, b in zip(runs[ref], runs[label]):
            assert abs(a["train/data_bpt"] - b["train/data_bpt"]) < BPT_TOL, (label, a["step"])


# decided before the runs: an FP8 run learns within a hundredth of a bit of the bf16 run on held-out data
FP8_VAL_TOL = 0.01
# nearest and GPTQ-chosen e4m3 codes (the default), and GPTQ with the last layer's up/down projections kept in bf16
NEAREST = "model.fp8_rounding=nearest"
LAST_MLP = "model.fp8_exclude=model.layers.29.mlp.up_proj,model.layers.29.mlp.down_proj"
FP8_RUNS = (("bf16", []), ("fp8-base-nearest", ["model.base_fp8=true", NEAREST]),
            ("fp8-base-head-nearest", ["model.base_fp8=true", "model.head_fp8=true", NEAREST]),
            ("fp8-base-gptq", ["model.base_fp8=true", "model.fp8_rounding=gptq"]),
            ("fp8-base-gptq-last-mlp-bf16", ["model.base_fp8=true", "model.fp8_rounding=gptq", LAST_MLP]))


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    """The compiled loop on the real model (as above), once per FP8_RUNS arm (bf16, and base_fp8 with nearest or GPTQ
    codes, with the FP8 head, with the last MLP in bf16): each run's reports, its config and the directory of its
    checkpoints."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs a CUDA GPU of compute capability >= 8.9")
    tmp = tmp_path_factory.mktemp("fp8-real")
    runs = {}
    for label, extra in FP8_RUNS:
        cfg = _cfg(tmp, f"run.name=real-{label}", "model.precision=bf16", "model.compile=true", "controller.mode=none",
                   "data.block_size=1024", "data.batch_size=16", "data.grad_accum=1", f"train.max_steps={STEPS}",
                   "train.report_every=1", f"train.eval_every={STEPS}", f"train.checkpoint_every={STEPS}",
                   "scaling.use_gpu=true", *extra, path=REAL)
        hooks = LocalHooks(run_dir=tmp / label)
        began = time.perf_counter()
        run_loop(cfg, hooks=hooks)
        wall_s = time.perf_counter() - began
        runs[label] = (hooks.reports, cfg, max((tmp / label).glob("checkpoint_*")))  # the last step's
        torch._dynamo.reset()
        bpt = [r["train/data_bpt"] for r in hooks.reports]
        print(f"\n[gpu] {torch.cuda.get_device_name(0)} {label}: train BPT {[round(v, 4) for v in bpt]}; val "
              f"{hooks.reports[-1]['val/data_bpt_start']:.4f} -> {hooks.reports[-1]['val/data_bpt']:.4f}; B norm "
              f"{hooks.reports[-1]['train/lora_b_norm']:.4f}; peak "
              f"{max(r.get('perf/max_mem_gib', 0.0) for r in hooks.reports):.2f} GiB; {wall_s:.0f} s in all")
    return runs


@pytest.mark.gpu
def test_every_fp8_run_learns_on_the_real_model(fp8_runs):
    for label, (reports, _, _) in fp8_runs.items():
        bpt = [r["train/data_bpt"] for r in reports]
        assert bpt[-1] < bpt[0] - 0.2 and reports[-1]["val/data_bpt"] < reports[-1]["val/data_bpt_start"] - 0.05, \
            (label, bpt)
        assert reports[-1]["train/lora_b_norm"] > 0.0, label


def _missed(reason: str):
    return pytest.mark.xfail(strict=True, raises=AssertionError,
                             reason=f"measured on an H200 (docs/log/benchmarks.md): {reason}")


@pytest.mark.gpu
@pytest.mark.parametrize("label", [
    pytest.param("fp8-base-nearest", marks=_missed("+0.032 to +0.035 bits in three runs, +0.040 before training: in "
                                                   "the FP8 forward itself")),
    pytest.param("fp8-base-head-nearest", marks=_missed("+0.087 to +0.090 bits in three runs")),
    pytest.param("fp8-base-gptq", marks=_missed("+0.018 bits in two runs, as before training")),
    pytest.param("fp8-base-gptq-last-mlp-bf16", marks=_missed("+0.015 and +0.016 bits, +0.015 before training"))])
def test_fp8_runs_end_within_a_hundredth_of_a_bit_of_bf16_on_held_out_data(fp8_runs, label):
    """An FP8 run's in-loop held-out BPT after the last step (through its own FP8 products, so training and
    evaluation error together) is within FP8_VAL_TOL of the bf16 run's."""
    gap = fp8_runs[label][0][-1]["val/data_bpt"] - fp8_runs["bf16"][0][-1]["val/data_bpt"]
    start_gap = fp8_runs[label][0][-1]["val/data_bpt_start"] - fp8_runs["bf16"][0][-1]["val/data_bpt_start"]
    print(f"\n[gpu] {torch.cuda.get_device_name(0)} {label}: held-out BPT - bf16's {gap:+.4f} after training, "
          f"{start_gap:+.4f} before")
    assert abs(gap) < FP8_VAL_TOL, gap


@pytest.mark.gpu
@pytest.mark.parametrize("label", [
    pytest.param("fp8-base-nearest", marks=_missed("+0.0145 to +0.0155 bits in three runs (95% CIs from 0.0131 to "
                                                   "0.0172)")),
    pytest.param("fp8-base-head-nearest", marks=_missed("+0.0387 and +0.0395 bits (95% CIs from 0.0368 to 0.0419)")),
    "fp8-base-gptq", "fp8-base-gptq-last-mlp-bf16"])
def test_fp8_trained_adapters_score_within_a_hundredth_of_a_bit_of_bf16_ones_in_bf16(fp8_runs, label):
    """The adapters an FP8 run trained, scored in bf16 (no FP8 anywhere: the model a user deploys) by ``evaluate``
    on the held-out split against the bf16-trained adapters, on the same tokens: within FP8_VAL_TOL bits. This
    separates what FP8 does to training from what it does to the forward (the test above)."""
    from raytrain_scu.driver.evaluate import evaluate

    _, bf16_cfg, bf16_ckpt = fp8_runs["bf16"]
    result = evaluate(bf16_cfg, adapter=str(fp8_runs[label][2]), compare_adapter=str(bf16_ckpt), workers=0)
    c = result["comparison"]
    print(f"\n[gpu] {torch.cuda.get_device_name(0)} {label} adapters scored in bf16: "
          f"{result['models']['A']['bpt']:.4f} vs bf16-trained {result['models']['B']['bpt']:.4f} on "
          f"{result['tokens']:,} tokens: A - B {c['diff_bpt']:+.4f}, CI [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]")
    assert abs(c["diff_bpt"]) < FP8_VAL_TOL, c


@pytest.mark.slow
@pytest.mark.parametrize("compile_, setting, applied", [("true", "auto", True), ("true", "never", False),
                                                         ("false", "always", False)])
def test_the_loop_trains_inside_the_recompute_setting_it_resolved(tmp_path, monkeypatch, compile_, setting, applied):
    """model.recompute_elementwise reaches the steps: every training step runs with the partitioner's bans lifted
    exactly when the build resolved it on (auto: the Llama family's choice), eager runs have no compiled graphs to
    change, and torch's own settings are back once the run ends. The run with model.compile=true and never builds
    its loss uncompiled: the loop's choice is read from the config alone, and compiling the same layers again (the
    auto case's graphs) would only cost time."""
    import torch._functorch.config as functorch_config

    import raytrain_scu.worker.build as build_mod
    import raytrain_scu.worker.loop as loop_mod
    from raytrain_scu.core.loss import ELEMENTWISE_RECOMPUTE_BANS

    if compile_ == "true" and setting == "never":
        monkeypatch.setattr(build_mod, "compile_for_training", lambda loss_model, **kw: loss_model)

    real_step, seen = loop_mod.train_step, []

    def step_seeing_the_settings(s, step):
        seen.append(tuple(getattr(functorch_config, k) for k in ELEMENTWISE_RECOMPUTE_BANS))
        return real_step(s, step)

    monkeypatch.setattr(loop_mod, "train_step", step_seeing_the_settings)
    before = tuple(getattr(functorch_config, k) for k in ELEMENTWISE_RECOMPUTE_BANS)
    hooks = LocalHooks(torch.device("cpu"))
    try:
        run_loop(_cfg(tmp_path, f"model.compile={compile_}", f"model.recompute_elementwise={setting}",
                      "train.max_steps=2", "train.report_every=1", "train.checkpoint_every=2"), hooks=hooks)
    finally:
        torch._dynamo.reset()
    lifted = (False,) * len(ELEMENTWISE_RECOMPUTE_BANS)
    assert before != lifted and seen == [lifted if applied else before] * 2
    assert tuple(getattr(functorch_config, k) for k in ELEMENTWISE_RECOMPUTE_BANS) == before
    assert hooks.reports[-1]["train/lora_b_norm"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["layers", "model"])
def test_compiled_training_matches_eager_on_cpu(scope):
    """Both compile scopes give eager's losses and adapters (fp32 on the CPU; the GPU test above covers bf16)."""
    from raytrain_scu.core.loss import CausalLMLoss, compile_for_training
    from raytrain_scu.core.model.build import apply_lora, build_model
    from raytrain_scu.core.model.source import load_tokenizer
    from raytrain_scu.core.regularizer import adapter_params, lora_b_norm

    tok = load_tokenizer("tiny")
    x = torch.randint(0, len(tok), (2, 32), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    out = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = apply_lora(build_model("tiny", vocab_size=len(tok), seed=1), r=4, alpha=8,
                           targets=["q_proj", "v_proj", "down_proj"])
        loss_model = CausalLMLoss(model)
        if compiled:
            loss_model = compile_for_training(loss_model, scope=scope)
            layers = loss_model.decoder().layers if scope == "layers" else loss_model._orig_mod.decoder().layers
            assert all((layer._compiled_call_impl is not None) == (scope == "layers") for layer in layers)
        opt = torch.optim.AdamW(adapter_params(model), lr=1e-2)
        losses = []
        for _ in range(3):
            nats, n = loss_model(x, y)
            (nats / n).backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(nats / n))
        out.append((losses, float(lora_b_norm(model))))
    (eager, b_eager), (comp, b_comp) = out
    assert comp == pytest.approx(eager, rel=1e-5) and b_comp == pytest.approx(b_eager, rel=1e-4) and b_comp > 0


# ---------------------------------------------------------------- ParamBPT's parts and the prior centred on the update

def test_loop_logs_parambpt_parts_and_the_init_centred_prior_trains(tmp_path):
    """The zero-centred law's ParamBPT is its A and B parts; under controller.prior_center=init the law's ParamBPT is
    the update's (0 before the first step, so S starts at 0) and the run still trains."""
    rows = {}
    for center in ("zero", "init"):
        hooks = LocalHooks(torch.device("cpu"))
        cfg = _cfg(tmp_path, f"run.name=center-{center}", "train.max_steps=4", "train.report_every=2",
                   f"controller.prior_center={center}", "controller.mode=fixed", "controller.lambda_init=5")
        run_loop(cfg, hooks=hooks)
        rows[center] = hooks.reports
    for r in rows["zero"]:
        assert r["train/param_bpt"] == pytest.approx(r["train/param_bpt_a"] + r["train/param_bpt_b"], rel=1e-5)
        assert 0 < r["train/param_bpt_update"] < r["train/param_bpt"]  # the A init dominates Σw²
    for r in rows["init"]:
        assert r["train/param_bpt"] == pytest.approx(r["train/param_bpt_update"], rel=1e-5)
        assert r["ctrl/s"] < 0.5 * rows["zero"][0]["ctrl/s"]
    assert rows["init"][-1]["train/lora_b_norm"] > 0


class _KeepCheckpoints(LocalHooks):
    """LocalHooks that keep each reported checkpoint and resume from ``resume_from``."""

    def __init__(self, keep, resume_from=None):
        super().__init__(torch.device("cpu"))
        self.keep, self.resume_from = keep, resume_from

    def open_checkpoint(self, stack):
        return None if self.resume_from is None else (self.resume_from, [])

    def report(self, metrics, checkpoint_dir, checkpoint_dir_name):
        super().report(metrics, checkpoint_dir, checkpoint_dir_name)
        if checkpoint_dir is not None:
            import shutil

            shutil.copytree(checkpoint_dir, self.keep / checkpoint_dir_name)


def test_a_resume_refuses_an_initial_adapter_that_differs_from_the_checkpoints(tmp_path):
    """Under prior_center=init the prior's centre is the initial A, rebuilt from the seed on a resume: a checkpoint
    records its Σw², and a rebuild that differs (another peft or torch) is refused rather than trained on."""
    import json

    from raytrain_scu.errors import CheckpointError

    keep = tmp_path / "kept"
    common = ["train.max_steps=2", "train.report_every=2", "train.checkpoint_every=2", "controller.prior_center=init"]
    run_loop(_cfg(tmp_path, "run.name=c1", *common), hooks=_KeepCheckpoints(keep))
    ckpt, = keep.iterdir()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["centers_sq"] > 0
    longer = ["train.max_steps=3", "train.report_every=1", "train.checkpoint_every=3", "controller.prior_center=init"]
    hooks = _KeepCheckpoints(tmp_path / "kept2", resume_from=ckpt)
    run_loop(_cfg(tmp_path, "run.name=c1", *longer), hooks=hooks)  # the same rebuild: resumes
    assert [r["step"] for r in hooks.reports] == [3]
    meta["centers_sq"] *= 1.01
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="initial adapter rebuilt from seed 0 differs"):
        run_loop(_cfg(tmp_path, "run.name=c1", *longer), hooks=_KeepCheckpoints(tmp_path / "kept3", ckpt))


def test_profile_steps_profile_the_last_steps_or_say_why_not(tmp_path):
    """train.profile_steps: the last N steps' table under the run directory; with too few steps left, a notice and no
    file (never a table that claims steps it did not record)."""
    from raytrain_scu.console import NOTICES

    run_loop(_cfg(tmp_path, "run.name=prof", "train.max_steps=4", "train.profile_steps=2", "train.report_every=2",
                  "train.checkpoint_every=4", "controller.mode=none"), hooks=LocalHooks(torch.device("cpu")))
    table = (tmp_path / "prof" / "profile" / "rank0.txt").read_text()
    assert table.startswith("steps profiled: 2; wall per step: ") and "aten::mm" in table
    hooks = LocalHooks(torch.device("cpu"))
    run_loop(_cfg(tmp_path, "run.name=short", "train.max_steps=1", "train.profile_steps=2", "train.report_every=1",
                  "train.checkpoint_every=1", "controller.mode=none"), hooks=hooks)
    assert not (tmp_path / "short" / "profile").exists()
    assert "1 step(s) left to run, none profiled" in hooks.reports[0][NOTICES]
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "STOP").touch()  # as a Ctrl-C leaves it: the run stops after its first step
    run_loop(_cfg(tmp_path, "run.name=stopped", "train.max_steps=6", "train.profile_steps=2", "train.report_every=1",
                  "train.checkpoint_every=1", "controller.mode=none"), hooks=LocalHooks(torch.device("cpu")))
    assert not (tmp_path / "stopped" / "profile").exists()  # no table of a window it never reached, and no crash
