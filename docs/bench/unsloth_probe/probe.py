"""Does Unsloth run on the GPU image? Standalone (no raytrain_scu): probe.sh puts the carried packages on PYTHONPATH.

Stages, each reported as OK or FAILED with its traceback:
  import  `import unsloth` first (before transformers / peft / trl), with every network connection refused and
          listed; the versions of what it needs and of the optional pieces, and which of them got imported
  bf16    a tiny Llama (2 layers, GQA 4:1, random init, its own tokenizer) saved to a local directory, then
          FastLanguageModel.from_pretrained(dir, dtype=bf16, load_in_4bit=False, max_seq_length=1024),
          get_peft_model(r=16, lora_alpha=32, the 7 projections, lora_dropout=0, bias="none",
          use_gradient_checkpointing="unsloth"), for_training, then 5 steps of a plain torch loop (loss from
          model(input_ids, labels=input_ids), backward, fused AdamW) under bf16 autocast on one fixed batch of
          2 x 1024: the loss must fall and LoRA B must leave zero. Prints which attention backend Unsloth's dispatch
          chose and called, the attention kernels the profiler saw, whether the fused cross-entropy ran (no logits),
          how many layers run Unsloth's fused LoRA kernels, and the gradient checkpointing in force
  4bit    the same with load_in_4bit=True (bitsandbytes NF4)
Exit status 0 when every stage passed, 1 otherwise. --out DIR also writes DIR/probe.json.
"""
import argparse
import json
import math
import os
import socket
import sys
import time
import traceback

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VERSIONED = ("unsloth", "unsloth_zoo", "trl", "datasets", "dill", "multiprocess", "bitsandbytes", "torch", "triton",
             "transformers", "peft", "accelerate", "huggingface_hub", "tokenizers", "safetensors", "xformers",
             "flash_attn", "cut_cross_entropy", "torchao", "tyro", "msgspec", "hf_transfer", "diffusers", "pydantic")
ATTENTION_WORDS = ("flash", "fmha", "sdpa", "attention", "attn", "cudnn", "cutlass")
CONNECTS = []


def refuse_network():
    """Every outgoing connection fails at once and is listed (the machine has no network anyway: this makes an
    attempt visible instead of a timeout)."""
    inet = (socket.AF_INET, socket.AF_INET6)  # local (Unix) sockets stay: multiprocessing uses them
    orig_connect, orig_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def connect(self, address, *a):
        if self.family not in inet:
            return orig_connect(self, address, *a)
        CONNECTS.append(str(address))
        raise OSError(f"probe: network refused ({address})")

    def connect_ex(self, address):
        if self.family not in inet:
            return orig_connect_ex(self, address)
        CONNECTS.append(str(address))
        return 111  # ECONNREFUSED

    def create_connection(address, *a, **k):
        CONNECTS.append(str(address))
        raise OSError(f"probe: network refused ({address})")

    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex
    socket.create_connection = create_connection


def versions():
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for n in VERSIONED:
        out[n] = "-"
        for dist in dict.fromkeys((n.replace("_", "-"), n)):
            try:
                out[n] = version(dist)
                break
            except PackageNotFoundError:
                pass
    return out


def stage_import(report):
    t0 = time.time()
    import unsloth  # noqa: F401 - first, as Unsloth requires
    from unsloth import FastLanguageModel  # noqa: F401

    import torch

    gpu = torch.cuda.is_available()
    report.update(import_s=round(time.time() - t0, 1), versions=versions(), cuda=torch.version.cuda,
                  device=torch.cuda.get_device_name(0) if gpu else "none (no CUDA GPU)",
                  capability=list(torch.cuda.get_device_capability(0)) if gpu else None,
                  imported=sorted(n for n in VERSIONED if n in sys.modules),
                  unsloth_file=unsloth.__file__)
    try:
        from unsloth.utils import attention_dispatch as ad

        report["attention_dispatch"] = {"dense_choice": str(ad.select_attention_backend(False)),
                                        "has_flash_attention": bool(ad.HAS_FLASH_ATTENTION),
                                        "has_xformers": bool(ad.HAS_XFORMERS)}
    except Exception as e:  # noqa: BLE001 - a record
        report["attention_dispatch"] = f"not read: {type(e).__name__}: {e}"


def tiny_model_dir(path):
    """A random-init Llama with Llama-3's GQA ratio, and a word-level tokenizer with its own pad token."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    vocab_size = 4096
    vocab = {f"w{i}": i for i in range(vocab_size - 3)}
    vocab.update({"<unk>": vocab_size - 3, "<|endoftext|>": vocab_size - 2, "<|pad|>": vocab_size - 1})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|endoftext|>",
                                  pad_token="<|pad|>")
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, vocab_size=vocab_size, max_position_embeddings=4096,
                      tie_word_embeddings=True, rope_theta=500000.0, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def fused_lora_counts(model):
    n = {"layers": 0, "qkv": 0, "o": 0, "mlp": 0}
    for m in model.modules():
        if hasattr(m, "self_attn") and hasattr(m, "mlp"):
            n["layers"] += 1
            n["qkv"] += getattr(getattr(m.self_attn, "apply_qkv", None), "__name__", "") == "apply_lora_qkv"
            n["o"] += getattr(getattr(m.self_attn, "apply_o", None), "__name__", "") == "apply_lora_o"
            fwd = vars(m.mlp).get("_unsloth_forward") or vars(m.mlp).get("forward")
            n["mlp"] += getattr(fwd, "__name__", "").startswith("apply_lora_mlp")
    return n


def attention_recorder(seen):
    """Wraps unsloth.models.llama.run_attention to record each call's backend; returns the undo."""
    import unsloth.models.llama as mod

    orig = mod.run_attention

    def run_attention(*args, **kwargs):
        seen.add(str(getattr(kwargs.get("config"), "backend", "?")))
        return orig(*args, **kwargs)

    mod.run_attention = run_attention
    return lambda: setattr(mod, "run_attention", orig)


def stage_train(report, model_dir, load_in_4bit, steps=5, batch=2, seq=1024):
    import torch
    from torch.profiler import ProfilerActivity, profile
    from unsloth import FastLanguageModel

    t0 = time.time()
    model, _tok = FastLanguageModel.from_pretrained(model_name=model_dir, max_seq_length=seq, dtype=torch.bfloat16,
                                                    load_in_4bit=load_in_4bit)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, target_modules=PROJ, lora_dropout=0,
                                             bias="none", use_gradient_checkpointing="unsloth", random_state=3407)
    FastLanguageModel.for_training(model)
    report["load_s"] = round(time.time() - t0, 1)
    report["gradient_checkpointing"] = str(getattr(model, "_unsloth_gradient_checkpointing", "?"))
    report["fused_lora"] = fused_lora_counts(model)
    report["embedding_device"] = str(model.get_input_embeddings().weight.device)
    q = getattr(model.config, "quantization_config", None)
    report["quantization"] = None if q is None else {k: str(v) for k, v in (q if isinstance(q, dict) else
                                                                            q.to_dict()).items()
                                                     if k.startswith(("bnb_4bit", "load_in", "quant_method"))}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3, fused=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, 4093, (batch, seq), device="cuda", generator=g)
    seen, losses, step_s = set(), [], []
    undo = attention_recorder(seen)
    try:
        for i in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            prof = profile(activities=[ProfilerActivity.CUDA]) if i == steps - 1 else None
            if prof:
                prof.__enter__()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=x, labels=x)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if prof:
                prof.__exit__(None, None, None)
            step_s.append(round(time.perf_counter() - t, 3))
            losses.append(round(out.loss.item() / math.log(2.0), 4))
            if i == 0:  # Unsloth's fused loss returns a placeholder (EmptyLogits, raising on use) for the logits
                lg = out.logits
                report["logits_returned"] = (f"tensor {list(lg.shape)}" if isinstance(lg, torch.Tensor)
                                             else type(lg).__name__)
    finally:
        undo()
    kernels = sorted(((e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0),
                     key=lambda kv: -kv[1])
    b_norm = math.sqrt(sum(float(p.detach().float().pow(2).sum()) for n, p in model.named_parameters()
                           if "lora_B" in n))
    report.update(bits_per_token=losses, step_s=step_s, lora_b_norm=round(b_norm, 4),
                  attention_backends_called=sorted(seen),
                  loss_path="logits materialised" if report["logits_returned"].startswith("tensor [") and
                  report["logits_returned"] != "tensor [0]" else "unsloth fused CE (no logits)",
                  attention_kernels=[f"{k[:90]} {t / 1e3:.2f}ms" for k, t in kernels
                                     if any(w in k.lower() for w in ATTENTION_WORDS)][:6],
                  top_kernels=[f"{k[:90]} {t / 1e3:.2f}ms" for k, t in kernels[:8]],
                  peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3))
    if not (b_norm > 0 and losses[-1] < losses[0]):
        raise RuntimeError(f"did not train: bits/token {losses}, LoRA B norm {b_norm:.3g}")
    del model, opt
    torch.cuda.empty_cache()


def run(args):
    refuse_network()
    results, ok = {}, True
    stages = [("import", lambda r: stage_import(r))]
    model_dir = os.path.join(args.work, "tiny-llama")
    for name in filter(None, args.stages.split(",")):
        if name not in ("bf16", "4bit"):
            raise SystemExit(f"probe: unknown stage {name!r} (bf16, 4bit)")
        four_bit = name == "4bit"
        stages.append((name, lambda r, f=four_bit: stage_train(r, tiny_model_dir(model_dir), f)))
    for name, fn in stages:
        r = results[name] = {}
        t0 = time.time()
        try:
            fn(r)
            r["status"] = "OK"
        except BaseException as e:  # noqa: BLE001 - report every stage, exit non-zero at the end
            ok = False
            r.update(status="FAILED", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            print(f"=== STAGE {name}: FAILED\n{traceback.format_exc()}", flush=True)
            if name == "import":
                break
        r["wall_s"] = round(time.time() - t0, 1)
        print(f"=== STAGE {name}: {r['status']} {json.dumps({k: v for k, v in r.items() if k != 'traceback'})}",
              flush=True)
    results["network_attempts"] = CONNECTS
    results["ok"] = ok and not CONNECTS
    print("=== PROBE " + ("OK" if results["ok"] else "FAILED") + " " + json.dumps(
        {k: (v.get("status") if isinstance(v, dict) else v) for k, v in results.items()}), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="also write probe.json here")
    p.add_argument("--stages", default="bf16,4bit", help="training stages after the import: bf16, 4bit")
    p.add_argument("--work", default="/tmp/unsloth_probe", help="where the tiny model is saved")
    sys.exit(run(p.parse_args()))
