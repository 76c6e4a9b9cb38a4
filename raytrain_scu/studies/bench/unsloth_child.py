"""One Unsloth bench part in its own process: ``python -m <this module> --child SPEC`` (what
:func:`.unsloth.unsloth_loop` starts), or ``--check`` (why the parts would be skipped here, and the versions).

``unsloth`` is imported first, before transformers, peft and trl, as Unsloth requires; nothing at this module's top
imports any of them. The result (or the error) is written as JSON to the spec's ``out``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from raytrain_scu.config.schema import ALL_LINEAR as PROJ
from raytrain_scu.studies.bench.unsloth import GRADIENT_CHECKPOINTING, OFFLINE_ENV, skip_reason

LR = 1e-4  # the reference loop's
PAD_TOKEN = "<|pad|>"  # Unsloth replaces a pad token equal to EOS; the saved tokenizer has its own
MARKER = "rtscu_model.json"  # written last into a saved model directory: what it holds
# packages whose versions the part records ("-": not installed); the optional ones say what was absent
VERSIONED = ("unsloth", "unsloth_zoo", "trl", "datasets", "dill", "multiprocess", "bitsandbytes", "torch",
             "triton", "transformers", "peft", "accelerate", "huggingface_hub", "safetensors", "tokenizers",
             "xformers", "flash_attn", "cut_cross_entropy", "torchao", "tyro", "msgspec", "hf_transfer", "diffusers")


# ---------------------------------------------------------------- pure pieces (the CPU tests check them)

def save_random_model(preset: str, out: Path, *, device: str = "cpu", dtype=None, seed: int = 0) -> Path:
    """The preset's random-init Llama (``seed``) and the Shakespeare BPE tokenizer (plus a pad token of its own),
    saved to ``out`` for ``FastLanguageModel.from_pretrained``; built on ``device`` in ``dtype``. A directory whose
    marker matches is reused as it is; another one is replaced. A preset whose vocabulary is exactly the tokenizer's
    (the tiny CPU twins) gets one row more for the pad token. Returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from raytrain_scu.core.model.presets import (  # transformers: after unsloth, in the part's process
        PRESET_TOKENIZER_VOCAB,
        preset_config,
    )
    from raytrain_scu.core.model.source import load_tokenizer
    dtype = dtype or torch.float32
    want = {"preset": preset, "seed": seed, "dtype": str(dtype).removeprefix("torch.")}
    out = Path(out)
    if (out / MARKER).is_file():
        got = json.loads((out / MARKER).read_text())
        if {k: got.get(k) for k in want} == want:
            return out
    tok = load_tokenizer(preset)
    if tok.pad_token is None or tok.pad_token == tok.eos_token:
        tok.add_special_tokens({"pad_token": PAD_TOKEN})
    cfg = preset_config(preset, PRESET_TOKENIZER_VOCAB)
    cfg.vocab_size = max(cfg.vocab_size, len(tok))
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / MARKER).write_text(json.dumps(want | {"vocab_size": cfg.vocab_size, "tokenizer_len": len(tok)}))
    del model
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def package_versions(names=VERSIONED) -> dict:
    """Installed version of each distribution ("-": not installed), and CUDA as torch was built for it."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for n in names:
        for dist in dict.fromkeys((n.replace("_", "-"), n)):
            try:
                out[n] = version(dist)
                break
            except PackageNotFoundError:
                out[n] = "-"
    import torch

    out["cuda"] = torch.version.cuda or "-"
    return out


def summarize(times: list[float], *, batch: int, block: int, peak_mem_gib: float, proof: dict, info: dict) -> dict:
    """A part's JSON: the reference loop's fields (tokens/s from the median step, peak memory, batch, the proof of
    training) and what this run of Unsloth was: its versions and gradient checkpointing at the top, the rest
    under ``unsloth``."""
    info = dict(info)
    return {"tokens_per_s": batch * block / statistics.median(times), "peak_mem_gib": peak_mem_gib, "batch": batch,
            **proof, "versions": info.pop("versions", {}),
            "gradient_checkpointing": info.pop("gradient_checkpointing", GRADIENT_CHECKPOINTING),
            "compiled": "Unsloth's own (its kernels and compiled pieces; no torch.compile of the model)",
            "unsloth": info}


# ---------------------------------------------------------------- the part

def _import_unsloth() -> dict:
    """``import unsloth`` first, before transformers, peft and trl: Unsloth patches them as it is imported. Returns
    what the part records of it."""
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    before = [m for m in ("transformers", "peft", "trl") if m in sys.modules]  # [] unless a package __init__ grew
    t0 = time.time()
    import unsloth  # noqa: F401 - for its patches

    # unsloth_zoo sets the allocator's expandable segments on import when nothing is set: part of Unsloth's setup
    return {"import_s": round(time.time() - t0, 1), "imported_before_unsloth": before,
            "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF") or "-"}


def run_part(spec: dict) -> dict:
    """One part, in this (fresh) process: Unsloth imported first, the model saved and loaded, the timed loop. On a
    GPU (the bench's case) in bf16; without one in float32 with no autocast (the CPU test's stand-in ``unsloth``
    runs this path)."""
    if spec.get("mode") == "sft":
        return run_sft_part(spec)
    info = _import_unsloth()
    model, opt, ctx = _load(spec, info)
    from raytrain_scu.core.regularizer import lora_b_norm  # peft and transformers: after unsloth
    from raytrain_scu.studies.bench import measure as bench
    with _recording_attention() as backends:  # only around this untimed pass: a wrapper could change compiled code
        loss_before, logits = _fixed_batch_loss(model, ctx)
    bench.reset_mem()
    batches = bench.pinned_batches(ctx["blocks"], spec["batch"], spec["block"], spec["warmup"] + spec["steps"])
    times = bench.interval_times(lambda i: _step(model, opt, batches[i].to(ctx["dev"], non_blocking=True), ctx),
                                 warmup=spec["warmup"], steps=spec["steps"], interval=spec["interval"])
    peak = bench.peak_mem()
    info.update(interval_ms=[round(1e3 * t, 2) for t in times], timing=bench.timing_note(spec["interval"]))
    proof = bench.proof_of_training(loss_before, _fixed_batch_loss(model, ctx)[0], lora_b_norm(model).item())
    info.update(versions=package_versions(), imported=_imported(), attention=_attention_info(backends),
                loss=_loss_path(logits), **_what_ran(model, spec, ctx["gpu"]))
    if spec.get("profile") and ctx["gpu"]:  # one more step, after the proof, untimed
        info["kernels"] = _kernels(lambda: _step(model, opt, ctx["batch_at"](0), ctx))
    return summarize(times, batch=spec["batch"], block=spec["block"], peak_mem_gib=peak, proof=proof,
                     info=info)


def run_sft_part(spec: dict) -> dict:
    """The SFT part, in this (fresh) process: Unsloth imported first, its model and LoRA loaded as for the other
    parts, then ``sft_peers.sft_trainer_run``: the TRL part's trainer and settings, with the ``trl.SFTTrainer`` that
    Unsloth has patched. CUDA only (TRL's and Unsloth's kernels)."""
    info = _import_unsloth()
    model, tok, gpu, _, _ = _unsloth_model(spec, info)  # the trainer makes its own optimiser
    from raytrain_scu.studies.bench.sft_peers import sft_trainer_run  # peft and transformers: after unsloth

    examples = [(ids, target) for ids, target in json.loads(Path(spec["examples"]).read_text())]
    with _recording_attention() as backends:
        out = sft_trainer_run(model, examples=examples, tokenizer=tok, batch=spec["batch"], block=spec["block"],
                              steps=spec["steps"], warmup=spec["warmup"], interval=spec["interval"])
    info.update(versions=package_versions(), imported=_imported(), attention=_attention_info(backends),
                **_what_ran(model, spec, gpu))
    return {**out, "versions": info.pop("versions"), "gradient_checkpointing": info.pop("gradient_checkpointing"),
            "compiled": "Unsloth's own (its kernels and compiled pieces; no torch.compile of the model)",
            "compile_scope": "Unsloth's own (each decoder layer compiled as one region)",
            "attention": ", ".join(info["attention"]["backends_called"]), "unsloth": info}


def _load(spec: dict, info: dict):
    """Unsloth's model and LoRA (:func:`_unsloth_model`), the optimiser, the batches."""
    import numpy as np
    import torch

    from raytrain_scu.studies.bench import measure as bench

    model, _tok, gpu, dev, dtype = _unsloth_model(spec, info)
    batch, block = spec["batch"], spec["block"]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, fused=gpu)
    blocks = np.load(spec["blocks"], mmap_mode="r")

    def batch_at(i):  # the reference loop's batches
        return bench.batch_rows(blocks, i, batch, block).to(dev)

    return model, opt, dict(gpu=gpu, dev=dev, dtype=dtype, batch_at=batch_at, blocks=blocks)


def _unsloth_model(spec: dict, info: dict):
    """The saved random-init model through Unsloth's loader and its LoRA: (model, tokenizer, gpu, device, dtype).
    Records the
    times and the model's directory in ``info``."""
    import torch
    from unsloth import FastLanguageModel

    gpu = torch.cuda.is_available()
    dev, dtype = torch.device("cuda" if gpu else "cpu"), torch.bfloat16 if gpu else torch.float32
    block, r = spec["block"], spec["lora_r"]
    t0 = time.time()
    mdir = save_random_model(spec["preset"], Path(spec["root"]) / spec["preset"], device=dev.type, dtype=dtype)
    _free_memory()
    info.update(build_s=round(time.time() - t0, 1), model_dir=str(mdir))
    t0 = time.time()
    model, tok = FastLanguageModel.from_pretrained(model_name=str(mdir), max_seq_length=block, dtype=dtype,
                                                    load_in_4bit=spec["load_in_4bit"])
    model = FastLanguageModel.get_peft_model(model, r=r, lora_alpha=2 * r, target_modules=PROJ, lora_dropout=0,
                                             bias="none", random_state=3407,
                                             use_gradient_checkpointing=spec["gradient_checkpointing"])
    FastLanguageModel.for_training(model)
    info["load_s"] = round(time.time() - t0, 1)
    return model, tok, gpu, dev, dtype


def _fixed_batch_loss(model, ctx):
    """The first training batch's BPT (no gradient), and the logits the forward returned."""
    import torch

    x = ctx["batch_at"](0)
    with torch.no_grad(), torch.autocast(ctx["dev"].type, dtype=ctx["dtype"], enabled=ctx["gpu"]):
        out = model(input_ids=x, labels=x)
    return out.loss.item() / math.log(2.0), out.logits


def _step(model, opt, x, ctx):
    import torch

    with torch.autocast(ctx["dev"].type, dtype=ctx["dtype"], enabled=ctx["gpu"]):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _what_ran(model, spec: dict, gpu: bool) -> dict:
    return {"gradient_checkpointing": {"requested": spec["gradient_checkpointing"],
                                       "effective": _json_safe(getattr(model, "_unsloth_gradient_checkpointing",
                                                                       "?"))},
            "load_in_4bit": spec["load_in_4bit"], "quantization": _quantization(model),
            "fused_lora": _fused_lora_counts(model), "lora_dtype": _lora_dtype(model),
            "embedding_device": str(model.get_input_embeddings().weight.device),
            "autocast": "bf16" if gpu else "off (CPU, float32)", "optimizer": f"torch AdamW{' fused' * gpu}, lr {LR}",
            "warmup_steps": spec["warmup"], "timed_steps": spec["steps"]}


def _free_memory():
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _recording_attention:
    """Records the backend of each Unsloth attention call (``unsloth.models.llama.run_attention``'s config) while
    active; yields the set of backend names."""

    def __enter__(self):
        self.seen, self.mod, self.orig = set(), None, None
        try:
            import unsloth.models.llama as mod

            orig, seen = mod.run_attention, self.seen

            def run_attention(*args, **kwargs):
                packed = getattr(kwargs.get("context"), "seq_info", None) is not None
                seen.add(str(getattr(kwargs.get("config"), "backend", "?")) + " (packed examples)" * packed)
                return orig(*args, **kwargs)

            mod.run_attention, self.mod, self.orig = run_attention, mod, orig
        except Exception as e:  # noqa: BLE001 - a record, not a requirement
            self.seen.add(f"not recorded: {type(e).__name__}: {e}")
        return self.seen

    def __exit__(self, *exc):
        if self.mod is not None:
            self.mod.run_attention = self.orig
        return False


def _attention_info(seen: set) -> dict:
    out = {"backends_called": sorted(seen)}
    try:
        from unsloth.utils import attention_dispatch as ad

        out.update(dense_choice=str(ad.select_attention_backend(False)),
                   has_flash_attention=bool(ad.HAS_FLASH_ATTENTION), has_xformers=bool(ad.HAS_XFORMERS))
    except Exception as e:  # noqa: BLE001
        out["dispatch"] = f"not read: {type(e).__name__}: {e}"
    return out


def _loss_path(logits) -> str:
    """Which loss ran, read off the logits the forward returned: Unsloth's fused loss returns a placeholder
    (``EmptyLogits``, which raises on any use, or an empty tensor) instead of logits."""
    import torch

    if not isinstance(logits, torch.Tensor) or logits.numel() == 0:
        return (f"unsloth_fused_ce_loss (chunked fused CE through model(labels=...); no logits materialised: "
                f"{type(logits).__name__})")
    return f"logits materialised {tuple(logits.shape)}: Unsloth's fast_cross_entropy_loss on full logits"


def _fused_lora_counts(model) -> dict:
    """How many decoder layers run Unsloth's fused LoRA kernels for QKV, O and the MLP."""
    n = {"layers": 0, "qkv": 0, "o": 0, "mlp": 0}
    for m in model.modules():
        if hasattr(m, "self_attn") and hasattr(m, "mlp"):
            n["layers"] += 1
            n["qkv"] += getattr(getattr(m.self_attn, "apply_qkv", None), "__name__", "") == "apply_lora_qkv"
            n["o"] += getattr(getattr(m.self_attn, "apply_o", None), "__name__", "") == "apply_lora_o"
            fwd = vars(m.mlp).get("_unsloth_forward") or vars(m.mlp).get("forward")
            n["mlp"] += getattr(fwd, "__name__", "").startswith("apply_lora_mlp")
    return n


def _lora_dtype(model) -> str:
    for n, p in model.named_parameters():
        if "lora_A" in n:
            return str(p.dtype).removeprefix("torch.")
    return "-"


def _quantization(model) -> dict | None:
    q = getattr(model.config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    keys = ("quant_method", "load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
            "bnb_4bit_compute_dtype", "llm_int8_skip_modules")
    return {k: _json_safe(q.get(k)) for k in keys if k in q}


def _imported() -> list[str]:
    """Which of the versioned packages this process imported."""
    return sorted(n for n in VERSIONED if n in sys.modules)


def _kernels(step) -> dict | str:
    """:func:`.measure.kernel_profile` of one call of ``step`` (untimed), its 40 largest entries: the table to set
    beside our loop's profile."""
    from raytrain_scu.studies.bench.measure import kernel_profile

    try:
        return kernel_profile(step, top=40)
    except Exception as e:  # noqa: BLE001 - a record, not a requirement
        return f"not profiled: {type(e).__name__}: {e}"


def _json_safe(v):
    return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raytrain_scu.studies.bench.unsloth_child",
                                description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--child", metavar="SPEC", help="run one part as the bench's subprocess (SPEC: its JSON)")
    g.add_argument("--check", action="store_true", help="print why the parts would be skipped here, and versions")
    args = p.parse_args(argv)
    if args.check:
        print(json.dumps({"skip_bf16": skip_reason(False), "skip_4bit": skip_reason(True),
                          "versions": package_versions()}, indent=1))
        return 0
    spec = json.loads(Path(args.child).read_text())
    try:
        res = run_part(spec)
    except Exception as e:  # noqa: BLE001 - the parent reports it as the part's error
        import traceback

        traceback.print_exc()
        res = {"error_type": type(e).__name__, "error": str(e)[:2000]}
    Path(spec["out"]).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
