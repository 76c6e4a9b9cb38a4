"""The bench's results as text: the markdown table of parts, the best peer of each shape, the ratios against it, and
every target judged met / not met / not run (``python -m raytrain_scu.bench`` prints them).

The best peer at a shape is the fastest peer part (``parts.Part.peer``: ref_compile, ref_liger, ref_liger_layers,
ref_unsloth) of the same run, and every ratio and target is against it, the memory target too (at equal device
batch). The smallest peak among the peers at our batch is shown beside it, not judged: a peer can trade speed for
memory (Unsloth offloads its checkpointed activations to host memory)."""
from __future__ import annotations

import math
from typing import Optional

from raytrain_scu.studies.bench.parts import PARTS, RAY_PART, shape_of

SHAPE_SUFFIX = {"1b": "", "8b": "_8b"}


def ratio(res: dict, a: str, b: str, key: str = "tokens_per_s") -> float:
    pa, pb = res["parts"].get(a, {}), res["parts"].get(b, {})
    return pa[key] / pb[key] if key in pa and key in pb and pb[key] else float("nan")


def peers(res: dict, shape: str, sft: bool = False) -> list[str]:
    """The peer parts of ``res`` at ``shape``: the text bench's, or with ``sft`` the SFT group's."""
    return [n for n, r in res["parts"].items()
            if n in PARTS and PARTS[n].peer and PARTS[n].sft == sft and r.get("shape_name") == shape]


def best_peer(res: dict, shape: str, key: str = "tokens_per_s", batch=None) -> tuple[str, float]:
    """(part, value) of the best peer at ``shape``: the highest ``key`` (tokens/s), or the lowest peak memory when
    ``key`` is peak_mem_gib (only peers at device batch ``batch``). ("", nan) when no peer ran."""
    got = [(res["parts"][n][key], n) for n in peers(res, shape)
           if key in res["parts"][n] and (batch is None or res["parts"][n].get("batch") == batch)]
    if not got:
        return "", float("nan")
    value, name = (min if key == "peak_mem_gib" else max)(got)
    return name, value


def _cell(r: dict, key: str, fmt: str) -> str:
    v = r.get(key, float("nan"))
    return format(v, fmt) if isinstance(v, (int, float)) and v == v else "-"


def _row(name: str, r: dict) -> str:
    if "error" in r:
        return f"| {name} | - | error: {r['error'][:80]} | - | - | - |"
    if name == "attn":  # SDPA alone: ms and TFLOP/s per backend, not a training rate
        cells = ", ".join(f"{k} {v['ms']} ms / {v['tflops']} TF/s" for k, v in r.items()
                          if isinstance(v, dict) and "ms" in v)
        return f"| attn ({r['shape']}, fwd+bwd) | {r['batch']} | fastest: {r['fastest']}: {cells} | - | - | - |"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu", float("nan")) == r.get("mfu") else "-"
    if "mfu_fp8_peak" in r and r["mfu_fp8_peak"] == r["mfu_fp8_peak"]:
        mfu += f" ({100 * r['mfu_fp8_peak']:.1f}% of FP8 peak)"
    proof = f"{r['bpt_before']:.3f} -> {r['bpt_after']:.3f}, {r['lora_b_norm']:.3g}"
    speed = f"{r['tokens_per_s']:.0f}" + (f" (answers {r['target_tokens_per_s']:.0f})"
                                           if "target_tokens_per_s" in r else "")
    return (f"| {_variant(name, r)} | {r['batch']} | {speed} | {mfu} | {r['peak_mem_gib']:.2f} | "
            f"{proof} |")


def _variant(name: str, r: dict) -> str:
    """A part's name with its model and block, its attention path (peers) and its Mamba path (Granite)."""
    notes = [f"{r['preset']}, block {r['block']}"] if "preset" in r else []
    if "attention" in r:
        notes.append(f"attention {r['attention']}, compile {r['compile_scope']}")
    if isinstance(r.get("kernels"), dict):
        notes.append(f"SDPA kernels: {r['kernels']['attention'][:80]}")
    if "mamba" in r:
        notes.append(f"LoRA on all linear layers; Mamba: {r['mamba']['path']}"
                     + (", checkpointing" if r["gradient_checkpointing"] else "")
                     + (", compiled per layer" if r.get("compiled") else ", eager"))
    return f"{name} ({'; '.join(notes)})" if notes else name


def table(res: dict) -> str:
    """The results as a markdown table, the best peers, and the targets."""
    lines = [f"card: {res['card']}  ({', '.join(f'{k} {v}' for k, v in res['versions'].items())})",
             f"command: {res.get('command', '-')}",
             "LoRA r=16, alpha 32 on the 7 projections unless noted; FLOPs/token = 4*N_matmul + 12*L*d*T (attention "
             f"over the full T x T square); peak = {res['peak_flops'] / 1e12:g} TFLOP/s (dense bf16)", "",
             "| variant | device batch | tokens/s per GPU | MFU | peak mem (GiB) | trained: fixed-set BPT, LoRA B norm |",
             "|---|---|---|---|---|---|"]
    lines += [_row(name, r) for name, r in res["parts"].items()]
    lines += ["", "| shape | best peer (speed) | tokens/s | smallest peer peak at our batch (GiB) |",
              "|---|---|---|---|"]
    for shape in ("1b", "8b"):
        name, v = best_peer(res, shape)
        if name:
            ours = res["parts"].get("ours" + SHAPE_SUFFIX[shape], {})
            low, gib = best_peer(res, shape, key="peak_mem_gib", batch=ours["batch"]) if "batch" in ours else ("", 0)
            lines.append(f"| {shape} | {name} | {v:.0f} | {f'{low} {gib:.2f}' if low else '-'} |")
    lines += ["", "| target | measured | bound | status |", "|---|---|---|---|"]
    lines += [f"| {label} | {measured} | {bound} | {status} |" for label, measured, bound, status in target_rows(res)]
    return "\n".join(lines)


def _missing(res: dict, names) -> str:
    failed = [n for n in names if "error" in res["parts"].get(n, {})]
    return f"not run ({', '.join(failed)} failed)" if failed else "not run"


def _vs_peer(res: dict, label: str, ours: str, shape: str, bound: float, mfu_bound: float = 0.0) -> tuple:
    """Our part's tokens/s over the best peer's at the same shape, in the same run."""
    r = res["parts"].get(ours, {})
    peer, v = best_peer(res, shape)
    target = f">= {bound:g}x best peer" + (f", MFU >= {100 * mfu_bound:g}%" if mfu_bound else "")
    if "tokens_per_s" not in r or not peer or not v:
        # the peers that ran at this shape: a peer that failed at another shape does not explain this row
        return label, "-", target, _missing(res, [ours, *peers(res, shape)])
    x = r["tokens_per_s"] / v
    met = x >= bound and (not mfu_bound or r["mfu"] >= mfu_bound)
    mfu = f", MFU {100 * r['mfu']:.1f}%" if mfu_bound else ""
    return label, f"{x:.3f} ({ours} {r['tokens_per_s']:.0f} / {peer} {v:.0f}{mfu})", target, \
        "met" if met else "not met"


def _peak_vs_peer(res: dict, part: str, shape: str) -> tuple[Optional[float], str]:
    """``part``'s peak over the best peer's at ``shape`` in the same run, with its text; (None, why not) when they
    ran at different batches, or either has no peak (a failed part, or no device memory on a CPU)."""
    r = res["parts"].get(part, {})
    peer, _ = best_peer(res, shape)
    p = res["parts"].get(peer, {})
    if "peak_mem_gib" in r and peer and p.get("batch") != r.get("batch"):
        return None, f"not comparable ({peer} ran at batch {p.get('batch')}, {part} at {r.get('batch')})"
    v = p.get("peak_mem_gib")
    if "peak_mem_gib" not in r or not peer or not v:
        return None, _missing(res, [part])
    x = r["peak_mem_gib"] / v
    return x, f"{x:.3f} ({r['peak_mem_gib']:.2f} / {peer} {v:.2f} GiB)"


def _memory_vs_peer(res: dict, shape: str) -> tuple:
    label = f"{shape}: our peak memory / the best peer's at equal batch"
    x, text = _peak_vs_peer(res, "ours" + SHAPE_SUFFIX[shape], shape)
    if x is None:
        return label, "-", "<= 0.75", text
    return label, text, "<= 0.75", "met" if x <= 0.75 else "not met"


# opt-in 8B settings judged against the memory bound at our speed, with the settings they add to ours_8b's
MEMORY_OPT_IN = (("ours_acts_host_8b", "model.offload_activations_gib=2"),
                 ("ours_acts_host_1g_8b", "model.offload_activations_gib=1 model.loss_chunk_size=1024"))


def _memory_opt_in(res: dict, part: str, setting: str, speed_bound: float = 0.99) -> tuple:
    """An opt-in setting's 8B part against the same memory bound, with its speed over ``ours_8b``'s in the same run:
    it meets the target at our speed only at ``speed_bound`` or above."""
    b = res["parts"].get("ours_8b", {})
    label = f"8b with {setting}: peak / the best peer's at equal batch, tokens/s / ours_8b"
    bound = f"<= 0.75, >= {speed_bound:g}"
    x, text = _peak_vs_peer(res, part, "8b")
    if x is None or "tokens_per_s" not in b:
        return label, "-", bound, text if x is None else _missing(res, ["ours_8b"])
    speed = res["parts"][part]["tokens_per_s"] / b["tokens_per_s"]
    return label, f"{text}, {speed:.3f}", bound, "met" if x <= 0.75 and speed >= speed_bound else "not met"


# the 8B QLoRA parts the target row judges, in the order it prefers one that meets both bounds
QLORA_8B = ("qlora_offload_acts_8b", "qlora_offload_compiled_8b", "qlora_offload_compiled_bnb_8b", "qlora_offload_8b")


def _qlora_8b(res: dict) -> tuple:
    """The first of :data:`QLORA_8B` that ran and meets both bounds, else the fastest that ran, named."""
    parts = res["parts"]
    label = "8B QLoRA (offloaded embedding, int8 head) 2 x 2048: speed / our bf16 LoRA, peak"
    b = parts.get("ours_8b", {})
    ran = [n for n in QLORA_8B if "tokens_per_s" in parts.get(n, {})]
    if not ran or "tokens_per_s" not in b:
        return label, "-", ">= 0.6, <= 6 GiB", _missing(res, [*(ran or QLORA_8B), "ours_8b"])

    def met(n: str) -> bool:
        return parts[n]["tokens_per_s"] / b["tokens_per_s"] >= 0.6 and parts[n]["peak_mem_gib"] <= 6.0

    name = next((n for n in ran if met(n)), max(ran, key=lambda n: parts[n]["tokens_per_s"]))
    q = parts[name]
    return label, f"{q['tokens_per_s'] / b['tokens_per_s']:.3f}, {q['peak_mem_gib']:.2f} GiB ({name})", \
        ">= 0.6, <= 6 GiB", "met" if met(name) else "not met"


def _granite(res: dict) -> list[tuple]:
    g, q = res["parts"].get("granite_h1b", {}), res["parts"].get("granite_qlora", {})
    rows = []
    if "tokens_per_s" in g:
        mfu = g["mfu"] if g["mfu"] == g["mfu"] else float("nan")
        rows.append(("Granite-4.0-H-1B bf16 LoRA tokens/s", f"{g['tokens_per_s']:.0f} (batch {g['batch']} x "
                     f"{g['block']}, Mamba: {g['mamba']['path']})", ">= 50,000",
                     "met" if g["tokens_per_s"] >= 50_000 else "not met"))
        rows.append(("Granite-4.0-H-1B MFU (bf16)", "-" if math.isnan(mfu) else f"{100 * mfu:.1f}%", ">= 40%",
                     "met" if mfu >= 0.4 else "not met"))
    else:
        rows.append(("Granite-4.0-H-1B bf16 LoRA tokens/s and MFU", "-", ">= 50,000, >= 40%",
                     _missing(res, ["granite_h1b"])))
    if "peak_mem_gib" in q:
        gb = q["peak_mem_gib"] * 2**30 / 1e9
        rows.append(("Granite-4.0-H-1B 4-bit QLoRA peak", f"{gb:.2f} GB at batch {q['batch']} x {q['block']}",
                     "<= 6 GB at batch 4", "met" if gb <= 6.0 and q["batch"] == 4 else "not met"))
    return rows


def _sft(res: dict, shape: str, bound: float = 1.5) -> tuple:
    """Ours packed over the fastest SFT peer at ``shape`` on target (answer) tokens a second, on the same examples."""
    sfx = SHAPE_SUFFIX[shape]
    label, target = f"{shape} SFT (LIMA lengths): sft_packed / best SFT peer, answer tokens/s", f">= {bound:g}x"
    key = "target_tokens_per_s"
    got = [(res["parts"][n][key], n) for n in peers(res, shape, sft=True) if key in res["parts"][n]]
    ours = res["parts"].get("sft_packed" + sfx, {})
    if key not in ours or not got:
        return label, "-", target, _missing(res, ["sft_packed" + sfx, *peers(res, shape, sft=True)])
    v, peer = max(got)
    x = ours[key] / v
    return label, f"{x:.3f} (sft_packed{sfx} {ours[key]:.0f} / {peer} {v:.0f})", target, \
        "met" if x >= bound else "not met"


def target_rows(res: dict) -> list[tuple[str, str, str, str]]:
    """Every target as (target, measured, bound, met / not met / not run)."""
    rows = [_vs_peer(res, "1B bf16: ours / best peer", "ours", "1b", 1.15),
            _vs_peer(res, "8B bf16: ours / best peer", "ours_8b", "8b", 1.08, mfu_bound=0.54),
            _vs_peer(res, "1B FP8 base: ours_fp8 / best peer", "ours_fp8", "1b", 1.45),
            _vs_peer(res, "8B FP8 base: ours_fp8_8b / best peer", "ours_fp8_8b", "8b", 1.35),
            _memory_vs_peer(res, "1b"), _memory_vs_peer(res, "8b"), _qlora_8b(res), *_granite(res),
            _sft(res, "1b"), _sft(res, "8b")]
    rows += [_memory_opt_in(res, part, setting) for part, setting in MEMORY_OPT_IN if part in res["parts"]]
    ray = sorted((p for p in res["parts"] if RAY_PART.fullmatch(p)), key=lambda p: int(p[3:]))
    for n in [p for p in ray if p != "ray1"]:
        x = ratio(res, n, "ray1")
        rows.append((f"{n} / ray1 per GPU", "-" if x != x else f"{x:.3f}", ">= 0.95",
                     _missing(res, [n, "ray1"]) if x != x else "met" if x >= 0.95 else "not met"))
    return rows


__all__ = ["best_peer", "ratio", "shape_of", "table", "target_rows"]
