#!/usr/bin/env python3
"""Probe of the field's Mamba kernels (mamba_ssm, causal_conv1d) under transformers' GraniteMoeHybrid (Granite-4.0-H).
Self-contained (torch, transformers, peft; bitsandbytes for ``qlora``): it does not import the
package. Every result is one JSON line, printed after ``RESULT`` and appended to $PROBE_OUT (results.jsonl).

  check                 versions; which implementation transformers bound to each Mamba kernel symbol
  warm DTYPE            compile mamba_ssm's Triton chunked-scan kernels into Triton's disk cache (no causal_conv1d
                        needed: runs while causal-conv1d's CUDA build is still compiling)
  corr                  kernel path vs torch path, same weights and input, fp32 and bf16: loss and LoRA gradients
  bench                 forward+backward+AdamW of a LoRA fine-tune at the Granite-4.0-H-1B shape, random init, on a
                        fixed batch: tokens/s, MFU, peak memory, loss and LoRA-B norm before/after
  qlora                 the same with a 4-bit (NF4) base from bitsandbytes: peak memory

How transformers 5.17 picks the path (there is no ``is_fast_path_available`` in GraniteMoeHybrid any more): each of the
five Mamba functions in modeling_granitemoehybrid is decorated with ``use_kernel_func_from_hub_with_fallback``, which,
when the module is first imported, tries ``import mamba_ssm`` / ``import causal_conv1d`` and binds the package's
function if that works, else the torch reference (``mamba2_split_conv1d_scan_combined``'s torch version returns None,
which sends the layer down the unfused path). The bound function sits in the wrapper's closure (``implementation``);
``__wrapped__`` is the torch one. So the torch path is forced by rebinding the module globals to ``__wrapped__``.

The fused training kernel (``mamba_split_conv1d_scan_combined``) is handed ``self.out_proj.weight`` and does the out
projection itself: a LoRA adapter on ``out_proj`` (peft's lora.Linear exposes the base ``.weight``) is then silently
skipped in forward and gets no gradient, and a 4-bit ``out_proj`` passes its packed uint8 storage. ``--outproj module``
(the default here) runs the fused kernel without the out projection and calls the ``out_proj`` module after it.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

OUT = os.environ.get("PROBE_OUT", "results.jsonl")
DEV = os.environ.get("PROBE_DEVICE", "cuda")
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # as raytrain_scu.hardware.gpus.PEAK_BF16_FLOPS


def emit(**rec):
    rec.setdefault("t", round(time.time(), 1))
    line = json.dumps(rec, default=str)
    print("RESULT " + line, flush=True)
    with open(OUT, "a") as f:
        f.write(line + "\n")


# ------------------------------------------------------------------ the Granite-4.0-H shapes
# raytrain_scu/core/model/presets.py's granite_hybrid_preset: Granite-4.0-H-1B's config.json dimensions, random init.
SHAPES = {
    "h1b": dict(hidden=1536, layers=40, attention_at=[5, 15, 25, 35], heads=12, kv_heads=4, ffn=4096, vocab=100352,
                mamba_heads=48, mamba_head_dim=64, mamba_state=128, mamba_chunk=256),
    # the real layer widths, 3 Mamba-2 layers + 1 attention layer, small vocab: the kernels at the shapes they run at
    "h1b-4layer": dict(hidden=1536, layers=4, attention_at=[2], heads=12, kv_heads=4, ffn=4096, vocab=2048,
                       mamba_heads=48, mamba_head_dim=64, mamba_state=128, mamba_chunk=256),
    # the package's tiny-granite-4.0-h (the CPU tests' twin)
    "tiny": dict(hidden=64, layers=3, attention_at=[1], heads=4, kv_heads=2, ffn=128, vocab=2048, mamba_heads=8,
                 mamba_head_dim=16, mamba_state=16, mamba_chunk=16),
}


def granite_config(s: dict):
    from transformers import AutoConfig
    return AutoConfig.for_model(
        "granitemoehybrid", hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        layer_types=["attention" if i in s["attention_at"] else "mamba" for i in range(s["layers"])],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], intermediate_size=s["ffn"],
        shared_intermediate_size=s["ffn"], num_local_experts=0, num_experts_per_tok=0, vocab_size=s["vocab"],
        tie_word_embeddings=True, position_embedding_type="nope", max_position_embeddings=131072,
        mamba_n_heads=s["mamba_heads"], mamba_d_head=s["mamba_head_dim"], mamba_d_state=s["mamba_state"],
        mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=s["mamba_chunk"], mamba_conv_bias=True,
        mamba_proj_bias=False, rms_norm_eps=1e-5, use_cache=False)


def flops_per_token(c, seq_len: int) -> float:
    """raytrain_scu.core.model.flops_per_token for a GraniteMoeHybrid config (frozen base): 4 x matmul params
    + 12·d·T per attention layer + 3 x the Mamba-2 layers' chunked-scan FLOPs."""
    d = c.hidden_size
    mlp = 3 * d * c.shared_intermediate_size
    head_dim = d // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    inner, groups, state, chunk = c.mamba_expand * d, c.mamba_n_groups, c.mamba_d_state, c.mamba_chunk_size
    mamba = d * (2 * inner + 2 * groups * state + c.mamba_n_heads) + inner * d
    ssd = 2 * chunk * groups * state + 2 * chunk * inner + 4 * state * inner
    params, scan, attn = c.hidden_size * c.vocab_size, 0.0, 0
    for kind in c.layer_types:
        if kind in ("attention", "full_attention"):
            params += mlp + d * q + 2 * d * kv + q * d
            attn += 1
        else:
            params += mlp + mamba
            scan += ssd
    return 4.0 * params + 12.0 * attn * d * seq_len + 3.0 * scan


# ------------------------------------------------------------------ kernel / torch path switching
M = None
FUNCS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_split_conv1d_scan_combined",
         "mamba2_selective_state_update", "mamba2_chunk_scan")
KERNEL, TORCHF, ORIG_FWD = {}, {}, None
CALLS = collections.Counter()


def load_modeling():
    global M, ORIG_FWD
    if M is None:
        M = importlib.import_module("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
        for n in FUNCS:
            KERNEL[n] = getattr(M, n)
            TORCHF[n] = getattr(KERNEL[n], "__wrapped__", KERNEL[n])
        ORIG_FWD = M.GraniteMoeHybridMambaLayer.forward
    return M


def impl_info(fn) -> dict:
    try:
        nl = inspect.getclosurevars(fn).nonlocals
        impl = nl["implementation"]
        return {"impl": f"{impl.__module__}.{impl.__qualname__}", "kernel": bool(nl.get("is_new_implementation"))}
    except Exception as e:  # a transformers whose wrapper differs
        return {"impl": f"? {type(e).__name__}: {e}", "kernel": None}


def fwd_outproj_module(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """GraniteMoeHybridMambaLayer.forward, training branch: the fused kernel WITHOUT the out projection, then the
    out_proj module (so a LoRA adapter or a 4-bit weight on out_proj takes part). Other branches: the original."""
    if not (self.training and cache_params is None):
        return ORIG_FWD(self, hidden_states, cache_params, attention_mask, **kwargs)
    hs = M.apply_mask_to_padding_states(hidden_states, attention_mask)
    zxbcdt = self.in_proj(hs)
    A = -torch.exp(self.A_log.float())
    out = M.mamba2_split_conv1d_scan_combined(
        zxbcdt, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, A, D=self.D,
        chunk_size=self.chunk_size, activation=self.activation, rmsnorm_weight=self.norm.weight,
        rmsnorm_eps=self.norm.variance_epsilon, outproj_weight=None, outproj_bias=None, headdim=self.head_dim,
        ngroups=self.n_groups, norm_before_gate=False, return_final_states=False, dt_limit=self.time_step_limit)
    if out is None:  # torch path: no fused function
        return ORIG_FWD(self, hidden_states, cache_params, attention_mask, **kwargs)
    return self.out_proj(out)


def use(path: str, outproj: str = "module", count: bool = False, disable_fused: bool = False):
    """path kernel|torch; outproj module (the fix above) | stock (transformers' own forward)."""
    load_modeling()
    for n in FUNCS:
        f = KERNEL[n] if path == "kernel" else TORCHF[n]
        if disable_fused and n == "mamba2_split_conv1d_scan_combined":
            f = torch.compiler.disable(f)
        if count:
            f = _counted(n, f)
        setattr(M, n, f)
    M.GraniteMoeHybridMambaLayer.forward = fwd_outproj_module if outproj == "module" else ORIG_FWD


def _counted(name, f):
    def g(*a, **k):
        r = f(*a, **k)
        CALLS[name] += 1
        if r is None:
            CALLS[name + ":returned_None"] += 1
        return r
    return g


# ------------------------------------------------------------------ model, LoRA, loss
def build(shape: str, dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM
    load_modeling()
    torch.manual_seed(seed)
    cfg = granite_config(SHAPES[shape])
    with torch.device(DEV):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    m.config.use_cache = False
    return m


def add_lora(m, r=16, alpha=32, targets="all-linear"):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(m, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none",
                                        task_type="CAUSAL_LM"))


def lora_b_norm(pm) -> float:
    return math.sqrt(sum(float(p.detach().float().pow(2).sum()) for n, p in pm.named_parameters() if "lora_B" in n))


def _ce(h, w, y, scale: float):
    return F.cross_entropy(F.linear(h, w).float() / scale, y, reduction="sum")


def chunked_loss(base, ids, chunk: int = 4096):
    """Mean next-token CE through Granite's head (logits / logits_scaling), the logits made chunk by chunk and
    recomputed in backward (a 100k vocabulary: the full logits of 16k tokens would be 6.6 GB in fp32)."""
    h = base.model(input_ids=ids, use_cache=False).last_hidden_state
    h = h[:, :-1].reshape(-1, h.shape[-1])
    y = ids[:, 1:].reshape(-1)
    w, s = base.lm_head.weight, float(base.config.logits_scaling)
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, y.numel(), chunk):
        total = total + torch.utils.checkpoint.checkpoint(_ce, h[i:i + chunk], w, y[i:i + chunk], s,
                                                          use_reentrant=False)
    return total / y.numel()


def gib(x) -> float:
    return round(x / 2**30, 2)


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------ phases
def phase_check(_):
    import transformers
    import peft
    rec = {"phase": "check", "device": device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "peft": peft.__version__, "python": sys.version.split()[0]}
    for mod in ("triton", "einops", "mamba_ssm", "causal_conv1d", "causal_conv1d_cuda", "kernels", "bitsandbytes"):
        try:
            rec[mod] = getattr(importlib.import_module(mod), "__version__", "ok")
        except Exception as e:
            rec[mod] = f"NO ({type(e).__name__}: {e})"[:200]
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined  # noqa
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update  # noqa
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update  # noqa
        rec["imports"] = "ok"
    except Exception as e:
        rec["imports"] = f"FAILED {type(e).__name__}: {e}"
    from transformers.utils import import_utils as iu
    for f in ("is_mamba_2_ssm_available", "is_causal_conv1d_available", "is_kernels_available"):
        rec[f] = getattr(iu, f)() if hasattr(iu, f) else "absent"
    load_modeling()
    rec["is_fast_path_available_attr"] = getattr(M, "is_fast_path_available", "absent")
    rec["bound"] = {n: impl_info(KERNEL[n]) for n in FUNCS}
    rec["fast_path"] = all(v["kernel"] for v in rec["bound"].values())
    emit(**rec)


def phase_warm(a):
    """Triton JIT of mamba_ssm's chunked-scan kernels (forward and backward) into the disk cache."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    dt_ = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    t0 = time.time()
    for h, p, n, c, b, T in ((48, 64, 128, 256, 2, 512), (8, 16, 16, 16, 2, 128)):
        g = torch.Generator(device=DEV).manual_seed(0)
        mk = lambda *s, dtype=dt_: torch.randn(*s, device=DEV, dtype=dtype, generator=g).requires_grad_()  # noqa
        x, dt, B, C = mk(b, T, h, p), mk(b, T, h), mk(b, T, 1, n), mk(b, T, 1, n)
        A = (-torch.rand(h, device=DEV, generator=g) - 0.5).requires_grad_()
        D, dtb = mk(h), mk(h)
        y = mamba_chunk_scan_combined(x, dt, A, B, C, c, D=D, z=None, dt_bias=dtb, dt_softplus=True)
        y.float().square().sum().backward()
    torch.cuda.synchronize()
    emit(phase="warm", dtype=a.dtype, seconds=round(time.time() - t0, 1))


def _grads(pm):
    return {n: (None if p.grad is None else p.grad.detach().float().clone())
            for n, p in pm.named_parameters() if p.requires_grad}


def _group(name: str) -> str:
    parts = name.split(".")
    ab = "A" if "lora_A" in parts else "B" if "lora_B" in parts else "?"
    mod = next((x for x in reversed(parts) if x.endswith(("proj", "linear"))), parts[-2])
    return f"{mod}.{ab}"


def _compare(ga: dict, gb: dict, la: float, lb: float) -> dict:
    """ga vs the reference gb: |loss diff|, global relative grad error, per group the relative error and the
    largest max|diff| / max|ref| of a tensor, and the adapters that got no gradient on one side only."""
    num = den = 0.0
    groups = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    missing = []
    for n, ref in gb.items():
        got = ga.get(n)
        if (ref is None) != (got is None):
            missing.append(n)
            got = torch.zeros_like(ref) if got is None else got
            ref = torch.zeros_like(got) if ref is None else ref
        if ref is None:
            continue
        d2, r2 = float((got - ref).pow(2).sum()), float(ref.pow(2).sum())
        num, den = num + d2, den + r2
        g = groups[_group(n)]
        g[0] += d2
        g[1] += r2
        g[2] = max(g[2], float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-30))
    return {"loss": la, "loss_ref": lb, "loss_abs_diff": abs(la - lb),
            "grad_rel_err": math.sqrt(num / den) if den else None,
            "groups": {k: {"rel": round(math.sqrt(v[0] / v[1]), 6) if v[1] else None, "max_rel": round(v[2], 6)}
                       for k, v in sorted(groups.items())},
            "no_grad_one_side": len(missing), "no_grad_examples": missing[:3]}


def phase_corr(a):
    for shape in a.shapes.split(","):
        s = SHAPES[shape]
        T = 128 if shape == "tiny" else 512
        m = build(shape, torch.float32)
        pm = add_lora(m)
        g = torch.Generator(device=DEV).manual_seed(1)
        with torch.no_grad():  # nonzero B: the adapters change the forward and both A and B get gradients
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.02, generator=g)
        pm.train()
        ids = torch.randint(0, s["vocab"], (2, T), device=DEV, generator=g)
        runs = {}
        for prec in ("fp32", "bf16"):
            if prec == "bf16":  # the base in bf16 as a bf16 model has it; adapters stay fp32 (peft's default)
                for n, p in pm.named_parameters():
                    if "lora_" not in n:
                        p.data = p.data.to(torch.bfloat16)
            for path, outproj in (("torch", "module"), ("kernel", "module"), ("kernel", "stock")):
                use(path, outproj, count=True)
                CALLS.clear()
                pm.zero_grad(set_to_none=True)
                try:
                    with torch.autocast(DEV, dtype=torch.bfloat16, enabled=prec == "bf16"):
                        loss = pm(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    runs[(prec, path, outproj)] = (float(loss), _grads(pm), dict(CALLS))
                except Exception as e:
                    emit(phase="corr", shape=shape, prec=prec, path=path, outproj=outproj,
                         error=f"{type(e).__name__}: {e}"[:600], tb=traceback.format_exc()[-1500:])
        ref32 = runs.get(("fp32", "torch", "module"))
        for (prec, path, outproj), (loss, grads, calls) in runs.items():
            if path == "torch" and prec == "fp32":
                continue
            refs = {"vs_torch_same_prec": runs.get((prec, "torch", "module"))}
            if prec == "bf16":
                refs["vs_torch_fp32"] = ref32
            for label, ref in refs.items():
                if ref is None or (path == "torch" and label == "vs_torch_same_prec"):
                    continue
                emit(phase="corr", shape=shape, T=T, batch=2, prec=prec, path=path, outproj=outproj, ref=label,
                     calls=calls, **_compare(grads, ref[1], loss, ref[0]))
        del m, pm, runs
        torch.cuda.empty_cache()


def _train(pm, base, ids, steps: int, warm: int, lr: float):
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=DEV == "cuda")
    b0 = lora_b_norm(pm)
    if DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = chunked_loss(base, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if DEV == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if DEV == "cuda" else 0
    timed = times[warm:] or times
    return {"step_s_median": round(statistics.median(timed), 4), "step_s_first": round(times[0], 2),
            "step_s_all": [round(t, 3) for t in times], "loss_first": round(float(losses[0]), 4),
            "loss_last": round(float(losses[-1]), 4), "loss_min": round(min(float(x) for x in losses), 4),
            "lora_B_norm_before": b0, "lora_B_norm_after": lora_b_norm(pm), "peak_gib": gib(peak)}


def _result(a, name, cfg, r, extra):
    tok = a.batch * a.block
    tps = tok / r["step_s_median"]
    fpt = flops_per_token(cfg, a.block)
    peak = next((v for k, v in PEAK_BF16.items() if k in device_name()), 0)
    emit(phase=name, device=device_name(), batch=a.batch, block=a.block, tokens_per_s=round(tps),
         flops_per_token=fpt, mfu=round(tps * fpt / peak, 4) if peak else None, **extra, **r)


def phase_bench(a):
    import torch._dynamo
    from torch._dynamo.utils import counters
    m = build(a.shape, torch.bfloat16)
    if a.ckpt:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm = add_lora(m)
    pm.train()  # the fused kernel is the training branch (self.training and no cache)
    base = pm.get_base_model()
    use(a.path, a.outproj, count=a.compile == "none", disable_fused=a.compile == "layers_nokernel")
    CALLS.clear()
    if a.compile != "none":
        for k in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, k):
                setattr(torch._dynamo.config, k, 64)
        for layer in base.model.layers:
            layer.compile()
    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (a.batch, a.block), device=DEV, generator=g)
    t0 = time.time()
    try:
        r = _train(pm, base, ids, a.steps, a.warm, a.lr)
    except Exception as e:
        emit(phase="bench", device=device_name(), batch=a.batch, block=a.block, path=a.path, outproj=a.outproj,
             compile=a.compile, ckpt=a.ckpt, error=f"{type(e).__name__}: {e}"[:800], tb=traceback.format_exc()[-2500:])
        return
    extra = {"path": a.path, "outproj": a.outproj, "compile": a.compile, "ckpt": a.ckpt, "shape": a.shape,
             "wall_s": round(time.time() - t0, 1), "calls": dict(CALLS)}
    if a.compile != "none":
        extra["graph_breaks"] = sum(counters["graph_break"].values())
        extra["graph_break_reasons"] = {k[:300]: v for k, v in list(counters["graph_break"].items())[:8]}
        extra["unique_graphs"] = counters["stats"].get("unique_graphs")
    _result(a, "bench", base.config, r, extra)


def phase_qlora(a):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    load_modeling()
    d = f"/tmp/granite-{a.shape}-shape-bf16"
    if not os.path.isfile(os.path.join(d, "config.json")):
        m = build(a.shape, torch.bfloat16)
        m.save_pretrained(d)
        del m
        torch.cuda.empty_cache()
    m = AutoModelForCausalLM.from_pretrained(
        d, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                  bnb_4bit_use_double_quant=True,
                                                  bnb_4bit_compute_dtype=torch.bfloat16),
        dtype=torch.bfloat16, device_map={"": 0 if DEV == "cuda" else DEV}, attn_implementation="sdpa")
    m.requires_grad_(False)
    m.config.use_cache = False
    if a.ckpt:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm = add_lora(m)
    pm.train()  # from_pretrained returns eval mode: no fused kernel, no checkpointing
    base = pm.get_base_model()
    static = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (a.batch, a.block), device=DEV, generator=g)
    for outproj in a.outproj.split(","):
        use(a.path, outproj, count=True)
        CALLS.clear()
        try:
            r = _train(pm, base, ids, a.steps, a.warm, a.lr)
        except Exception as e:
            emit(phase="qlora", batch=a.batch, block=a.block, outproj=outproj, ckpt=a.ckpt,
                 error=f"{type(e).__name__}: {e}"[:800], tb=traceback.format_exc()[-2000:])
            torch.cuda.empty_cache()
            continue
        _result(a, "qlora", base.config, r, {"path": a.path, "outproj": outproj, "ckpt": a.ckpt, "load_in_4bit": True,
                                             "static_gib": gib(static), "calls": dict(CALLS)})


def phase_summary(_):
    """A short table of results.jsonl (the end of the device call's output)."""
    for line in open(OUT):
        r = json.loads(line)
        ph = r.get("phase")
        if "error" in r:
            print(f"{ph} {r.get('shape', '')} {r.get('prec', '')} {r.get('batch', '')}x{r.get('block', '')} "
                  f"{r.get('path', '')}/{r.get('outproj', '')} compile={r.get('compile')} ERROR {r['error'][:300]}")
        elif ph == "check":
            print(f"check: {r['device']} torch {r['torch']} transformers {r['transformers']} triton {r['triton']} "
                  f"mamba_ssm {r['mamba_ssm']} causal_conv1d {r['causal_conv1d']} imports {r['imports']} "
                  f"fast_path {r['fast_path']}")
        elif ph == "warm":
            print(f"warm {r['dtype']}: {r['seconds']} s")
        elif ph == "corr":
            print(f"corr {r['shape']:10s} {r['prec']} {r['path']:6s} outproj={r['outproj']:6s} {r['ref']:18s} "
                  f"dloss={r['loss_abs_diff']:.2e} grad_rel={r['grad_rel_err']} no_grad={r['no_grad_one_side']} "
                  f"worst_group={max(r['groups'].items(), key=lambda kv: kv[1]['rel'] or 0)}")
        elif ph in ("bench", "qlora"):
            print(f"{ph} {r['batch']}x{r['block']} {r['path']}/{r['outproj']} compile={r.get('compile', '-')} "
                  f"ckpt={r['ckpt']}: {r['tokens_per_s']} tok/s, MFU {r['mfu']}, peak {r['peak_gib']} GiB "
                  f"(static {r.get('static_gib', '-')}), step {r['step_s_median']} s (first {r['step_s_first']} s), "
                  f"loss {r['loss_first']} -> {r['loss_last']}, B {r['lora_B_norm_before']:.3g} -> "
                  f"{r['lora_B_norm_after']:.3g}, breaks {r.get('graph_breaks', '-')}")
        else:
            print(r)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["check", "warm", "corr", "bench", "qlora", "summary"])
    p.add_argument("dtype", nargs="?", default="bf16")
    p.add_argument("--shapes", default="tiny,h1b-4layer")
    p.add_argument("--shape", default="h1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--path", default="kernel", choices=["kernel", "torch"])
    p.add_argument("--outproj", default="module")
    p.add_argument("--compile", default="none", choices=["none", "layers", "layers_nokernel"])
    p.add_argument("--ckpt", action="store_true")
    a = p.parse_args()
    t0 = time.time()
    globals()["phase_" + a.phase](a)
    print(f"phase {a.phase} done in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
