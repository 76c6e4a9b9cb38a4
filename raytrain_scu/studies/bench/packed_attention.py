"""Packed-sequence attention alone: which kernel keeps each example to itself fastest on this GPU.

Rows of ``block`` tokens are filled with examples whose lengths are drawn from ``lengths`` (best-fit decreasing, as
``core.data.packing`` packs them); every variant computes the same thing, causal attention within each example and
none across, forward and backward, at the model's attention shape:

- ``causal``: plain causal SDPA over whole rows, which lets examples attend to each other: the speed to aim at;
- ``mask``: SDPA with a boolean block-diagonal causal mask (what transformers builds from restarting position ids);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` on the flattened tokens with cumulative sequence lengths;
- ``flex``: compiled FlexAttention with a document-causal BlockMask (built once per batch);
- ``varlen_compiled``: ``varlen`` inside a compiled function, as in a compiled decoder layer.

Each variant's output and input gradients are checked against ``mask`` (max abs difference, bf16).

    python -m raytrain_scu.studies.bench.packed_attention --preset llama-1b --batch 8 --block 2048
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import torch
import torch.nn.functional as F

from raytrain_scu.core.model.presets import preset_config


def draw_lengths(total: int, *, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    """Log-normal lengths (``median``, ``sigma``) clipped to [lo, hi], drawn until they sum to ``total`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        out.append(int((torch.exp(torch.randn(1, generator=gen) * sigma) * median).clamp(lo, hi).round()))
    return out


def pack_rows(lengths: list[int], block: int, rows: int) -> list[list[int]]:
    """Best-fit decreasing of ``lengths`` into ``rows`` rows of ``block`` tokens (what does not fit is dropped); the
    rest of a row is one more segment of its own."""
    bins: list[list[int]] = [[] for _ in range(rows)]
    free = [block] * rows
    for n in sorted(lengths, reverse=True):
        fits = [i for i in range(rows) if free[i] >= n]
        if fits:
            i = min(fits, key=lambda j: free[j])
            bins[i].append(n)
            free[i] -= n
    return [b + ([free[i]] if free[i] else []) for i, b in enumerate(bins)]


def varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, "torch.nn.attention.varlen missing"
    params = inspect.signature(varlen_attn).parameters

    def call(q, k, v, cu, max_len, scale):
        kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:  # expand the shared heads ourselves
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if "scale" in params:
            kw["scale"] = scale
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)
    return call, str(inspect.signature(varlen_attn))


def _variants(seg: torch.Tensor, cu: torch.Tensor, max_len: int, D: int, out: dict) -> dict:
    """The attention variants over packed rows whose tokens' example numbers are ``seg`` (B, T); ``cu``: the
    cumulative example lengths of the flattened rows. What cannot be built here goes into ``out``."""
    B, T = seg.shape
    dev = seg.device
    scale = D ** -0.5
    ar = torch.arange(T, device=dev)
    mask = (seg[:, None, :, None] == seg[:, None, None, :]) & (ar[None, None, :, None] >= ar[None, None, None, :])

    def bhtd_to_flat(t):  # (B, h, T, D) -> (B*T, h, D)
        return t.transpose(1, 2).reshape(B * T, t.shape[1], D)

    def flat_to_bhtd(t):
        return t.view(B, T, -1, D).transpose(1, 2)

    variants = {
        "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
        "mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True),
    }
    vfn, out["varlen_signature"] = varlen_fn()
    if vfn is not None:
        def varlen(q, k, v):
            return flat_to_bhtd(vfn(bhtd_to_flat(q), bhtd_to_flat(k), bhtd_to_flat(v), cu, max_len, scale))
        variants["varlen"] = varlen
        variants["varlen_compiled"] = torch.compile(varlen)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def doc_causal(b, h, qi, ki):
            return (seg[b, qi] == seg[b, ki]) & (qi >= ki)
        bm = create_block_mask(doc_causal, B, None, T, T, device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            bm = create_block_mask(doc_causal, B, None, T, T, device=dev)
        torch.cuda.synchronize()
        out["block_mask_ms"] = round((time.perf_counter() - t0) * 100, 3)
        flex = torch.compile(flex_attention)
        variants["flex"] = lambda q, k, v: flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True)
    except Exception as e:  # noqa: BLE001
        out["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"

    return variants


def _time_variants(variants: dict, qkv, grad, out: dict, *, reps: int) -> None:
    """Each variant's forward and backward: the median of ``reps`` timed calls after 3 warm-up ones, and its output
    and gradients' largest difference from ``mask``'s, into ``out``."""
    got = {}
    for name, fn in variants.items():
        q, k, v = (t.clone().requires_grad_() for t in qkv)
        try:
            for _ in range(3):
                fn(q, k, v).backward(grad)
            q.grad = k.grad = v.grad = None
            o = fn(q, k, v)
            o.backward(grad)
            got[name] = (o.detach(), q.grad, k.grad, v.grad)
            times = []
            for _ in range(reps):
                q.grad = k.grad = v.grad = None
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(q, k, v).backward(grad)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            out[name] = {"ms": round(statistics.median(times), 3)}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    ref = got.get("mask")
    for name, tensors in got.items():
        if ref is not None and name != "causal":
            out[name]["max_abs_diff_vs_mask"] = max(float((a - b).abs().max()) for a, b in zip(tensors, ref))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=2048)
    p.add_argument("--median", type=float, default=300.0)
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    cfg = preset_config(a.preset, 2048)
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    B, T = a.batch, a.block
    dev = torch.device("cuda")
    dt = torch.bfloat16
    rows = pack_rows(draw_lengths(B * T, median=a.median, sigma=a.sigma, lo=8, hi=T, seed=0), T, B)
    seg_lens = [n for r in rows for n in r]
    max_len = max(seg_lens)
    seg = torch.cat([torch.full((n,), i, device=dev) for i, n in enumerate(seg_lens)]).view(B, T)
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "shape": f"B{B} T{T} H{H}/{KV} D{D}", "segments": len(seg_lens),
                 "mean_len": round(sum(seg_lens) / len(seg_lens), 1), "max_len": max_len}
    gen = torch.Generator(device=dev).manual_seed(0)
    q0 = torch.randn(B, H, T, D, device=dev, dtype=dt, generator=gen)
    k0 = torch.randn(B, KV, T, D, device=dev, dtype=dt, generator=gen)
    v0 = torch.randn(B, KV, T, D, device=dev, dtype=dt, generator=gen)
    g0 = torch.randn(B, H, T, D, device=dev, dtype=dt, generator=gen)
    variants = _variants(seg, torch.tensor([0] + seg_lens, device=dev).cumsum(0).to(torch.int32), max_len, D,
                         out)
    _time_variants(variants, (q0, k0, v0), g0, out, reps=a.reps)
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
