"""Unsloth's bench parts (issue #33) on the CPU: the clear skip reason, the pure logic (which batch and base each part
runs at, the saved random-init model, the part's JSON), and the subprocess plumbing end to end with a stand-in
``unsloth`` package (plain HF + peft under Unsloth's API). The real Unsloth runs on a GPU only."""
import json
import os
import subprocess
import sys
import textwrap
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from raytrain_scu.studies.bench import unsloth as U
from raytrain_scu.studies.bench import unsloth_child as C

KW = dict(preset="tiny", batch=8, block=2048, steps=20, warmup=3, interval=5, blocks=None)
UNSLOTH_PARTS = ("ref_unsloth", "ref_unsloth_8b", "ref_unsloth_qlora", "ref_unsloth_qlora_8b")


def test_importing_the_parts_imports_neither_unsloth_nor_transformers():
    code = ("import sys; import raytrain_scu.studies.bench.unsloth, raytrain_scu.studies.bench.unsloth_child; "
            "print([m for m in ('unsloth', 'unsloth_zoo', 'trl', 'transformers', 'peft') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip is for machines without a CUDA GPU")
def test_without_cuda_each_part_is_skipped_with_the_reason_and_nothing_runs(tmp_path):
    for four_bit in (False, True):
        with pytest.raises(U.PartSkipped, match="no CUDA GPU here"):
            U.unsloth_loop(**KW, load_in_4bit=four_bit, root=str(tmp_path))
    with pytest.raises(U.PartSkipped, match="no CUDA GPU here"):
        U.unsloth_sft_loop(preset=KW["preset"], examples=[([1, 2, 3], [False, True, True])], batch=2, block=8,
                           steps=1, warmup=0, interval=1, root=str(tmp_path))
    assert "unsloth" not in sys.modules and not any(tmp_path.iterdir())
    assert isinstance(U.PartSkipped("x"), RuntimeError)  # a bench without a skip branch still shows it, as an error


def test_with_a_gpu_but_no_packages_the_reason_names_them(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    names = ("unsloth", "unsloth_zoo", "trl", "datasets", "bitsandbytes")
    absent = set(names)

    def find_spec(name, *a):  # the checked names: absent or present as this test says; the rest as they are
        return (None if name in absent else real("json")) if name in names else real(name, *a)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert U.skip_reason(False).startswith("not installed: unsloth, unsloth_zoo, trl, datasets (")
    assert "bitsandbytes" in U.skip_reason(True) and "docs/unsloth.md" in U.skip_reason(True)
    absent = {"bitsandbytes"}  # 16-bit LoRA needs no bitsandbytes, 4-bit does
    assert U.skip_reason(False) is None and U.skip_reason(True).startswith("not installed: bitsandbytes (")


def test_each_part_runs_at_its_shape_batch_and_base(monkeypatch):
    """The bench's table: bf16 at --batch, 4-bit at --mem-batch (where the bench's own QLoRA parts run, so memory
    compares at equal batch), the _8b parts at the 8B shape; only the bf16 parts are peers for speed."""
    from raytrain_scu.studies.bench import parts

    calls = {}
    monkeypatch.setattr(parts, "unsloth_loop", lambda **kw: kw)
    args = Namespace(batch=8, mem_batch=2, block=2048, steps=20, warmup_reports=2, report_every=5)
    for p in UNSLOTH_PARTS:
        ctx = parts.Ctx(args=args, preset="x", block=2048, blocks=None, steps=30, compile=True, cfg=None)
        calls[p] = parts.PARTS[p].run(ctx)
    assert {p: (k["batch"], k["load_in_4bit"]) for p, k in calls.items()} == {
        "ref_unsloth": (8, False), "ref_unsloth_8b": (8, False),
        "ref_unsloth_qlora": (2, True), "ref_unsloth_qlora_8b": (2, True)}
    assert all(k["warmup"] == 10 and k["block"] == 2048 and k["steps"] == 20 and k["interval"] == 5
               for k in calls.values())  # warmed up and timed as our loop: 2 reports of 5 steps, then intervals of 5
    assert [parts.shape_of(p, "1b") for p in UNSLOTH_PARTS] == ["1b", "8b", "1b", "8b"]
    assert [parts.PARTS[p].peer for p in UNSLOTH_PARTS] == [True, True, False, False]


def test_the_random_init_model_is_saved_with_a_tokenizer_unsloth_keeps_and_reused(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from raytrain_scu.core.model.presets import PRESETS

    out = C.save_random_model("tiny", tmp_path / "tiny")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", C.MARKER} <= names
    cfg, tok = AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(cfg, k) == PRESETS["tiny"][k], k
    # Unsloth swaps a pad token equal to EOS (and may resize the embedding): this one has its own, inside the table
    assert tok.pad_token == C.PAD_TOKEN != tok.eos_token and tok.pad_token_id < cfg.vocab_size == len(tok)
    assert (cfg.pad_token_id, cfg.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(any(n.endswith(p) for n, _ in model.named_modules()) for p in C.PROJ)
    marker = json.loads((out / C.MARKER).read_text())
    assert marker["preset"] == "tiny" and marker["dtype"] == "float32" and marker["vocab_size"] == cfg.vocab_size
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    time.sleep(0.01)
    assert C.save_random_model("tiny", out) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    C.save_random_model("tiny", out, seed=1)  # another seed: rebuilt in place
    assert json.loads((out / C.MARKER).read_text())["seed"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_the_part_json_has_the_reference_fields_versions_and_checkpointing():
    info = {"versions": {"unsloth": "2026.10.9"}, "gradient_checkpointing": {"requested": "unsloth"}, "loss": "x"}
    r = C.summarize([0.5, 0.25, 1.0], batch=8, block=2048, peak_mem_gib=12.5,
                    proof={"bpt_before": 17.0, "bpt_after": 14.0, "lora_b_norm": 2.4}, info=info)
    assert r["tokens_per_s"] == 8 * 2048 / 0.5 and r["peak_mem_gib"] == 12.5 and r["batch"] == 8
    assert (r["bpt_before"], r["bpt_after"], r["lora_b_norm"]) == (17.0, 14.0, 2.4)
    assert r["versions"] == {"unsloth": "2026.10.9"} and r["gradient_checkpointing"] == {"requested": "unsloth"}
    assert r["unsloth"] == {"loss": "x"} and "Unsloth's own" in r["compiled"]
    v = C.package_versions(("torch", "surely_not_a_package_xyz"))
    assert v["torch"] == torch.__version__.split("+")[0] or v["torch"] == torch.__version__
    assert v["surely_not_a_package_xyz"] == "-" and "cuda" in v


def test_the_subprocess_is_offline_and_imports_this_package_first(monkeypatch):
    env = U.child_env({"PYTHONPATH": os.pathsep.join(["/tmp/site-unsloth", "/tmp/site"]), "HF_HUB_OFFLINE": "0"})
    assert all(env[k] == "1" for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS"))
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/tmp/site-unsloth", "/tmp/site"]
    assert env["UNSLOTH_COMPILE_LOCATION"].endswith("unsloth_compiled_cache")


def test_a_failing_or_hanging_subprocess_is_an_error_with_its_last_lines():
    env = dict(os.environ)
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*the last words"):
        U._run_child([sys.executable, "-c", "print('the last words'); raise SystemExit(3)"], env, 60)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="ran past 1 s and was killed(.|\n)*started"):
        U._run_child([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], env, 1)
    assert time.monotonic() - t0 < 30


def test_check_says_why_it_would_skip_here(capsys):
    assert C.main(["--check"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"skip_bf16", "skip_4bit", "versions"} and "unsloth" in out["versions"]
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in out["skip_bf16"]


STAND_IN = '''
"""A stand-in for Unsloth's API on the CPU (plain HF + peft): the child's own code runs around it."""
from peft import LoraConfig, get_peft_model as _peft
from transformers import AutoModelForCausalLM, AutoTokenizer


class FastLanguageModel:
    @staticmethod
    def from_pretrained(model_name, max_seq_length, dtype, load_in_4bit=False):
        assert not load_in_4bit and max_seq_length == 64
        return (AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype),
                AutoTokenizer.from_pretrained(model_name))

    @staticmethod
    def get_peft_model(model, r, lora_alpha, target_modules, lora_dropout, bias, random_state,
                       use_gradient_checkpointing):
        model.requires_grad_(False)
        m = _peft(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules,
                                    lora_dropout=lora_dropout, bias=bias, task_type="CAUSAL_LM"))
        m._unsloth_gradient_checkpointing = use_gradient_checkpointing
        return m

    @staticmethod
    def for_training(model):
        model.train()
        return model
'''


@pytest.mark.slow
def test_a_part_runs_end_to_end_in_its_subprocess_with_a_stand_in_unsloth(tmp_path):
    """The child (model saved then loaded, the timed loop, the proof, the JSON) with the stand-in above: what the GPU
    run adds is only Unsloth itself."""
    import numpy as np

    from raytrain_scu.core.data.cache import prepare_data
    from raytrain_scu.core.model.source import load_tokenizer

    (tmp_path / "stub" / "unsloth").mkdir(parents=True)
    (tmp_path / "stub" / "unsloth" / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    data = prepare_data(load_tokenizer("tiny"), streaming="off", loader_workers=0,
                        source="shakespeare", path="", block_size=64, val_fraction=0.05)
    np.save(tmp_path / "blocks.npy", data.train)
    spec = dict(preset="tiny", batch=2, block=64, steps=4, warmup=3, interval=2, load_in_4bit=False, lora_r=16,
                gradient_checkpointing=U.GRADIENT_CHECKPOINTING,
                profile=True, blocks=str(tmp_path / "blocks.npy"), root=str(tmp_path / "models"),
                out=str(tmp_path / "result.json"))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = U.child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "stub"), env["PYTHONPATH"]])
    assert U.child_module() == "raytrain_scu.studies.bench.unsloth_child"
    r = subprocess.run([sys.executable, "-m", U.child_module(), "--child",
                        str(tmp_path / "spec.json")], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert "error" not in res, res
    assert res["tokens_per_s"] > 0 and res["batch"] == 2
    assert res["lora_b_norm"] > 0 and res["bpt_after"] < res["bpt_before"]  # the proof of training
    assert res["gradient_checkpointing"] == {"requested": "unsloth", "effective": "unsloth"}
    assert set(C.VERSIONED) <= set(res["versions"]) and res["versions"]["transformers"] != "-"
    u = res["unsloth"]
    assert u["fused_lora"] == {"layers": 2, "qkv": 0, "o": 0, "mlp": 0}  # the stand-in has none of Unsloth's kernels
    assert u["loss"].startswith("logits materialised") and u["load_in_4bit"] is False and u["quantization"] is None
    assert u["attention"]["backends_called"][0].startswith("not recorded")  # no unsloth.models.llama here
    assert {"unsloth", "transformers", "peft"} <= set(u["imported"]) and u["lora_dtype"] == "float32"
    assert u["imported_before_unsloth"] == []  # Unsloth came first, so its patches took
    assert (tmp_path / "models" / "tiny" / C.MARKER).is_file() and "kernels" not in u  # no profile on the CPU
    timed = u["interval_ms"]  # 4 timed steps after the warm-up, in 2 intervals of 2: ms per step of each
    assert len(timed) == 2 and res["tokens_per_s"] == pytest.approx(2 * 64 / ((timed[0] + timed[1]) / 2e3), rel=0.02)
    assert "intervals of 2 steps" in u["timing"]


def test_a_child_that_does_not_train_is_reported_as_did_not_train(tmp_path, monkeypatch):
    """The child's error JSON becomes the bench's DidNotTrain (a part with no speed), other errors RuntimeError."""
    def fake_child(cmd, env, timeout_s):
        spec = json.loads(Path(cmd[-1]).read_text())
        Path(spec["out"]).write_text(json.dumps({"error_type": "DidNotTrain", "error": "the loop did not train"}))

    monkeypatch.setattr(U, "skip_reason", lambda load_in_4bit=False: None)
    monkeypatch.setattr(U, "_run_child", fake_child)
    kw = {**KW, "blocks": [[1, 2], [3, 4], [5, 6]]}
    with pytest.raises(RuntimeError, match="did not train") as e:
        U.unsloth_loop(**kw, root=str(tmp_path))
    assert type(e.value).__name__ == "DidNotTrain"  # the package's own (raytrain_scu.errors)

    def failing_child(cmd, env, timeout_s):
        spec = json.loads(Path(cmd[-1]).read_text())
        Path(spec["out"]).write_text(json.dumps({"error_type": "ImportError", "error": "no module named trl"}))

    monkeypatch.setattr(U, "_run_child", failing_child)
    with pytest.raises(RuntimeError, match="ImportError: no module named trl"):
        U.unsloth_loop(**kw, root=str(tmp_path))
