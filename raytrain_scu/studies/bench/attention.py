"""The ``attn`` part: causal SDPA alone at the model's attention shape, each fused backend first in turn, both q/k/v
layouts, and transformers' call sequence under torch.compile."""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from raytrain_scu.core.model.presets import preset_config
from raytrain_scu.studies.bench.measure import kernel_profile, peak_mem, sync


def attention_bench(*, preset: str, batch: int, block: int, reps: int = 20) -> dict:
    """Causal SDPA forward+backward at the model's attention shape, each fused backend put first in turn, with the
    key/value heads shared (``enable_gqa``, as transformers calls SDPA). Layouts: ``bhsd`` (contiguous heads-first)
    and ``bshd`` (the transposed projection outputs that transformers passes); ``hf_compiled`` runs transformers'
    view/transpose/SDPA/transpose sequence under torch.compile. TFLOP/s count the causal work the kernels do:
    2 products forward, 5 backward (recomputed scores), half the T x T square."""
    cfg = preset_config(preset, 2048)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    B, T, D = batch, block, head_dim

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen).requires_grad_()

    qs, ks, vs = leaf(B, T, heads * D), leaf(B, T, kv_heads * D), leaf(B, T, kv_heads * D)  # projection outputs
    grad = torch.randn(B, T, heads * D, device=dev, dtype=dtype, generator=gen)
    F = torch.nn.functional

    def hf_attention(q, k, v, contiguous=False):  # transformers' sdpa path for a causal LM without padding
        q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))
        if contiguous:  # heads-first copies instead of the transposed views
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D ** -0.5, enable_gqa=True)
        return o.transpose(1, 2).reshape(B, T, heads * D)

    def bhsd_attention(q, k, v):
        return hf_attention(q, k, v, contiguous=True)

    flops = 7 * 2 * B * heads * T * T * D / 2
    out = {"shape": f"B{B} H{heads}/{kv_heads} T{T} D{D}", "batch": batch}
    variants = [(f"{b}_{lay}", b, fn) for b in ("auto", "cudnn", "flash", "efficient")
                for lay, fn in (("bshd", hf_attention), ("bhsd", bhsd_attention))]
    variants += [("auto_hf_compiled", "auto", "compile")] if dev.type == "cuda" else []
    ref = []
    for name, backend, fn in variants:
        try:
            out[name] = _variant(backend, fn, hf_attention, (qs, ks, vs), grad, ref, reps=reps, flops=flops)
        except RuntimeError as e:  # a backend that cannot run this shape/dtype here
            out[name] = {"error": str(e).splitlines()[0][:120]}
        qs.grad = ks.grad = vs.grad = None
    timed = {n: r["ms"] for n, r in out.items() if isinstance(r, dict) and "ms" in r}
    out["fastest"] = min(timed, key=timed.get) if timed else "-"
    out["tokens_per_s"] = batch * block / (timed[out["fastest"]] / 1e3) if timed else 0.0
    out["peak_mem_gib"] = peak_mem()
    return out


def _variant(backend: str, fn, hf_attention, leaves, grad, ref: list, *, reps: int, flops: float) -> dict:
    """One backend and layout: its time, TFLOP/s, relative error against the first variant run, top kernels."""
    qs, ks, vs = leaves
    with _sdpa_first(backend):
        if fn == "compile":
            torch._dynamo.reset()
            fn = torch.compile(hf_attention)

        def step():
            o = fn(qs, ks, vs)
            o.backward(grad)
            return o

        o = step()
        gq = qs.grad.detach().float()
        if not ref:
            ref += [o.detach().float(), gq]
        err = max(((o.detach().float() - ref[0]).norm() / ref[0].norm()).item(),
                  ((gq - ref[1]).norm() / ref[1].norm()).item())
        times = _time_steps(step, leaves, reps)
        kernels = "; ".join(kernel_profile(step, top=4)["top"]) if torch.cuda.is_available() else ""
    ms = 1e3 * statistics.median(times)
    return {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "rel_err": float(f"{err:.2g}"), "kernels": kernels}


def _time_steps(step, leaves, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``step`` after 3 warm-up calls, gradients cleared before each."""
    times = []
    for i in range(3 + reps):
        for t in leaves:
            t.grad = None
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


def _sdpa_first(backend: str):
    """SDPA with ``backend``'s kernel as first choice, the others as fallbacks ("auto": torch's own order)."""
    if backend == "auto":
        return contextlib.nullcontext()
    enum = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([enum[backend]] + [v for k, v in enum.items() if k != backend], set_priority=True)
