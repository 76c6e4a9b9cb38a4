"""``python -m raytrain_scu.bench``: raytrain_scu's loop against a plain HF + peft loop, side by side on one machine.

Measured in one process (Ray runs start their own workers), on the Llama-3.2-1B shape (random init), block 2048,
LoRA r=16 on all 7 projections:

  ref_eager / ref_compile   a 40-line HF LlamaForCausalLM + peft loop: bf16 weights, SDPA, fused AdamW,
                            ``model(input_ids, labels).loss`` (full fp32 logits), without / with torch.compile
  ref_liger                 ref_eager with Liger kernels (liger-kernel, the ``bench`` extra), what TRL users get
  ours                      raytrain_scu's per-worker loop, bare (no Ray), SCU on, compile, fused chunked CE
  ours_best / ours_fused    ours at the largest device batch that fits (``--best-batch``) / with model.fuse_lora=true
  ours_fp8 / ours_fp8_8b    ours with model.base_fp8=true (the frozen GEMMs in FP8 e4m3, rowwise scales), 1B / 8B
  ours_compile_model        ours with the whole model as one compiled graph (model.compile_scope=model)
  scu_none                  the same loop with controller.mode=none (controller overhead)
  ray1 / ray2 / rayN        the same loop under a TorchTrainer with N GPU workers, one GPU each (Ray overhead,
                            scaling); refused before any worker starts when the Ray cluster has fewer GPUs
  ref_8b / ours_8b          ref_compile and ours at the Llama-3.1-8B shape (random init, untied head)
  qlora_8b                  ours at the 8B shape with a 4-bit base (bitsandbytes NF4), gradient checkpointing, eager,
                            at ``--mem-batch``: its peak memory against the 7 GiB target
  granite_h1b               ours at the Granite-4.0-H-1B shape (GraniteMoeHybrid: 36 Mamba-2 + 4 attention layers,
                            random init, LoRA on all linear layers) at ``--granite-batch`` x ``--granite-block``;
                            records whether mamba_ssm / causal_conv1d were importable (their CUDA kernels ran) or
                            transformers' torch path ran (then with gradient checkpointing: see :func:`mamba_kernels`)
  mem_bf16 / mem_qlora      peak memory of bf16 LoRA vs QLoRA 4-bit at equal batch (eager, checkpointing on)
  mem_qlora_emb8 / qlora_emb8_8b / qlora_offload_8b   mem_qlora / qlora_8b with the embedding and LM head in int8
                            (quant.embedding_int8), or the input embedding in CPU memory and the head in int8
  profile_<part>            ``<part>`` (ours..., rayN) with its last steps under torch.profiler, each rank's table
                            beside --out (``train.profile_steps``); ``profile`` is ``profile_ours``
  attn                      causal SDPA alone at the model's attention shape: each fused backend first in turn,
                            both q/k/v layouts, and transformers' call sequence under torch.compile

Every part that times training must prove it trained (:func:`proof_of_training`): the LoRA B matrices left zero and the
BPT on a fixed set of blocks fell (ours: the validation set before step 1 and at the last step; the reference: its first
batch before and after). A part that fails this reports an error, not a speed. tokens/s are medians over timed intervals
after warm-up; MFU = tokens/s × FLOPs/token / peak, with FLOPs/token = 4·N_matmul + 12·L·d·T for a frozen base and the
card's dense bf16 peak. The GraniteMoeHybrid count is layer by layer (``model.flops_per_token``): its 4 attention layers
get the 12·d·T term, its Mamba-2 layers 3 x their chunked-scan (SSD) FLOPs instead.

``--group`` picks named sets of parts (:data:`GROUPS`; ``1b``, the default, fits one 10-minute call on one H100),
``--parts`` names parts (added after the groups'); ``--shape`` is the model of the parts that do not name one. The table
ends with every target of issues #17 and #19 as met / not met / not run. ``--smoke`` runs a tiny CPU version (the test
suite uses it): the same code paths on shrunken shapes of the same structure (``tiny``, ``tiny-llama-3.1-8b``,
``tiny-granite-4.0-h``).
"""
from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from raytrain_scu.core.model.families import mamba_kernels
from raytrain_scu.errors import DidNotTrain
from raytrain_scu.hardware.gpus import measured_memory_gib, mfu, peak_flops
from raytrain_scu.studies.bench.report import RAY_PART

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# --shape (and the parts that name their own shape) -> (preset on a GPU, its shrunken twin for --smoke)
SHAPES = {"1b": ("llama-3.2-1b-shape", "tiny"), "8b": ("llama-3.1-8b-shape", "tiny-llama-3.1-8b"),
          "granite": ("granite-4.0-h-1b-shape", "tiny-granite-4.0-h")}
QLORA_SMALL = ("mem_qlora_emb8", "qlora_emb8_8b", "qlora_offload_8b")  # QLoRA with a smaller embedding and head
# the parts with a name of their own (rayN: any N); a new part is added here and to run_parts' dispatch
PARTS = ("attn", "ref_eager", "ref_compile", "ref_liger", "ours", "ours_best", "ours_fused", "ours_fp8",
         "ours_compile_model", "scu_none", "profile", "mem_bf16", "mem_qlora", "ref_8b", "ours_8b", "ours_fp8_8b",
         "qlora_8b", "granite_h1b", *QLORA_SMALL)
# the parts our loop times (and rayN): ``profile_<part>`` runs one with train.profile_steps (``profile``: ours)
LOOP_PARTS = ("ours", "ours_best", "ours_fused", "ours_fp8", "ours_compile_model", "scu_none", "mem_bf16", "mem_qlora",
              "ours_8b", "ours_fp8_8b", "qlora_8b", "granite_h1b", *QLORA_SMALL)
SCALE_NS = (2, 4, 8)  # the `scale` group: ray1 and rayN for these N up to the GPUs here
# named sets of parts; each fits one 10-minute call on one H100 (docs/benchmarks.md has the measured times)
GROUPS = {"1b": "attn,ref_eager,ref_compile,ours,scu_none,ray1,ray2,mem_bf16,mem_qlora,mem_qlora_emb8",
          "8b": "ref_8b,ours_8b,qlora_8b,qlora_emb8_8b,qlora_offload_8b",
          "scale": "ray1,rayN",  # rayN: see expand_parts
          "granite": "granite_h1b"}


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


# ---------------------------------------------------------------- the plain reference loop

def reference_loop(*, preset: str, batch: int, block: int, steps: int, warmup: int, compile: bool, blocks,
                   lora_r: int = 16, liger: bool = False) -> dict:
    """A hand-written HF + peft LoRA loop, timed per step (synchronised) after ``warmup`` steps. ``liger``: Liger
    kernels (fused linear cross-entropy, RMSNorm, SwiGLU, RoPE) patched into transformers' Llama classes first, as
    TRL's ``use_liger_kernel=True`` does; the patch stays for the rest of the process (``ref_liger`` runs last)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # the `bench` extra

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    from raytrain_scu.core.model import PRESET_TOKENIZER_VOCAB, preset_config
    from raytrain_scu.core.regularizer import lora_b_norm

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):  # a preset that sets no vocabulary gets the Shakespeare BPE's
        model = AutoModelForCausalLM.from_config(preset_config(preset, PRESET_TOKENIZER_VOCAB), dtype=dtype,
                                                 attn_implementation="sdpa")
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=PROJ,
                                             task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=dev.type == "cuda")
    step_fn = torch.compile(model) if compile else model

    def batch_at(i):
        return torch.as_tensor(blocks[(i * batch) % (len(blocks) - batch):][:batch, :block].astype("int64")).to(dev)

    def fixed_batch_loss():  # the first training batch, scored in eager mode (no recompile for eval)
        with torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda"):
            return model(input_ids=batch_at(0), labels=batch_at(0)).loss.item() / math.log(2.0)

    loss_before = fixed_batch_loss()
    times = []
    _reset_mem()
    for i in range(warmup + steps):
        x = batch_at(i)
        _sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda"):
            loss = step_fn(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = _peak_mem()
    out = {"tokens_per_s": batch * block / statistics.median(times), "peak_mem_gib": peak, "batch": batch,
           **proof_of_training(loss_before, fixed_batch_loss(), lora_b_norm(model).item())}
    del model, opt, step_fn
    _free()
    return out


def attention_bench(*, preset: str, batch: int, block: int, reps: int = 20) -> dict:
    """Causal SDPA forward+backward at the model's attention shape, each fused backend put first in turn, with the
    key/value heads shared (``enable_gqa``, as transformers calls SDPA). Layouts: ``bhsd`` (contiguous heads-first)
    and ``bshd`` (the transposed projection outputs that transformers passes); ``hf_compiled`` runs transformers'
    view/transpose/SDPA/transpose sequence under torch.compile. TFLOP/s count the causal work the kernels do:
    2 products forward, 5 backward (recomputed scores), half the T x T square."""
    from raytrain_scu.core.model import preset_config

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
    ref = None
    variants = [(f"{b}_{lay}", b, fn) for b in ("auto", "cudnn", "flash", "efficient")
                for lay, fn in (("bshd", hf_attention), ("bhsd", bhsd_attention))]
    variants += [("auto_hf_compiled", "auto", "compile")] if dev.type == "cuda" else []
    for name, backend, fn in variants:
        try:
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
                if ref is None:
                    ref = (o.detach().float(), gq)
                err = max(((o.detach().float() - ref[0]).norm() / ref[0].norm()).item(),
                          ((gq - ref[1]).norm() / ref[1].norm()).item())
                times = _time_steps(step, (qs, ks, vs), reps)
                kernels = _top_kernels(step) if dev.type == "cuda" else ""
            qs.grad = ks.grad = vs.grad = None
            ms = 1e3 * statistics.median(times)
            out[name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "rel_err": float(f"{err:.2g}"),
                         "kernels": kernels}
        except RuntimeError as e:  # a backend that cannot run this shape/dtype here
            out[name] = {"error": str(e).splitlines()[0][:120]}
    timed = {n: r["ms"] for n, r in out.items() if isinstance(r, dict) and "ms" in r}
    out["fastest"] = min(timed, key=timed.get) if timed else "-"
    out["tokens_per_s"] = batch * block / (timed[out["fastest"]] / 1e3) if timed else 0.0
    out["peak_mem_gib"] = _peak_mem()
    return out


def _time_steps(step, leaves, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``step`` after 3 warm-up calls, gradients cleared before each."""
    times = []
    for i in range(3 + reps):
        for t in leaves:
            t.grad = None
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


def _top_kernels(step) -> str:
    """The 4 CUDA kernels that took the most device time in one call of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        _sync()
    top = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)[:4]
    return "; ".join(f"{e.key[:60]} {e.device_time_total / 1e3:.2f}ms" for e in top)


def _sdpa_first(backend: str):
    """SDPA with ``backend``'s kernel as first choice, the others as fallbacks ("auto": torch's own order)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "auto":
        return contextlib.nullcontext()
    enum = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([enum[backend]] + [v for k, v in enum.items() if k != backend], set_priority=True)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_mem():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_mem() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _free():  # a part's memory and compiled graphs (left, they slowed a later part at another batch to 0.64x)
    import gc
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def proof_of_training(bpt_before: float, bpt_after: float, b_norm: float) -> dict:
    """The evidence that a timed loop trained: LoRA B left zero and the loss on a fixed set of blocks fell.
    Raises :class:`DidNotTrain` otherwise (the part then shows an error instead of a speed)."""
    if not (b_norm > 0.0 and bpt_after < bpt_before):
        raise DidNotTrain(f"the loop did not train: LoRA B norm {b_norm:.3g}, fixed-batch BPT {bpt_before:.4f} -> "
                          f"{bpt_after:.4f}")
    return {"bpt_before": round(bpt_before, 4), "bpt_after": round(bpt_after, 4), "lora_b_norm": round(b_norm, 4)}


def _proof_from_reports(reports: list[dict]) -> dict:
    """The loop's own evidence: val BPT before training (step 0) and at the last step, and the final LoRA B norm."""
    last = reports[-1]
    return proof_of_training(last.get("val/data_bpt_start", float("nan")), last.get("val/data_bpt", float("nan")),
                             last.get("train/lora_b_norm", 0.0))


# ---------------------------------------------------------------- raytrain_scu's loop

def bench_config(*, preset: str, batch: int, block: int, steps: int, report_every: int, storage: str, name: str,
                 compile: bool, mode: str = "scu", load_in_4bit: bool = False, checkpointing: bool = False, chunk=4096,
                 workers: int = 1, compile_scope: str = "layers", targets=tuple(PROJ), fuse_lora: bool = False,
                 base_fp8: bool = False, profile_steps: int = 0, embedding_int8: bool = False,
                 offload_embedding: bool = False):
    from raytrain_scu.config.resolve import resolve

    gpu = torch.cuda.is_available()
    return resolve(None, [
        f"model.name={preset}", f"model.precision={'bf16' if gpu else 'fp32'}", f"model.compile={str(compile).lower()}",
        f"model.compile_scope={compile_scope}", f"model.fuse_lora={str(fuse_lora).lower()}",
        f"model.base_fp8={str(base_fp8).lower()}", f"model.gradient_checkpointing={str(checkpointing).lower()}",
        f"model.loss_chunk_size={chunk}", f"quant.load_in_4bit={str(load_in_4bit).lower()}", "lora.r=16",
        f"quant.embedding_int8={str(embedding_int8).lower()}",
        f"quant.offload_embedding={str(offload_embedding).lower()}",
        "lora.alpha=32", f"lora.target_modules={','.join(targets)}", "data.source=shakespeare",
        f"data.block_size={block}", f"data.batch_size={batch}", "data.grad_accum=1", "data.val_fraction=0.05",
        f"train.max_steps={steps}", f"train.report_every={report_every}", f"train.checkpoint_every={steps}",
        f"train.eval_every={steps}", f"train.eval_blocks={batch * workers}", f"controller.mode={mode}",
        f"scaling.num_workers={workers}", f"scaling.use_gpu={str(gpu).lower()}", f"run.storage_path={storage}",
        f"run.name={name}", "tracking.enabled=false", "optim.warmup_steps=2", f"train.profile_steps={profile_steps}"])


def _median_rate(reports: list[dict], warmup_reports: int) -> float:
    rates = [r["perf/tokens_per_s"] for r in reports if "perf/tokens_per_s" in r]
    timed = rates[warmup_reports:] or rates[-1:]
    return statistics.median(timed)


def _rates(reports: list[dict]) -> list[float]:
    return [round(r["perf/tokens_per_s"]) for r in reports if "perf/tokens_per_s" in r]


def ours_bare(cfg, warmup_reports: int) -> dict:
    """The loop in this process (``train.profile_steps`` writes its profile under the run directory); with what the
    built model held on the GPU before its first step, by kind (``hardware.measured_memory_gib``)."""
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    class Measuring(LocalHooks):
        def prepare_model(self, model, move_to_device: bool):
            model = super().prepare_model(model, move_to_device)
            self.built = measured_memory_gib(getattr(model, "_orig_mod", model).model)
            return model

    hooks = Measuring()
    _reset_mem()
    run_loop(cfg, hooks=hooks)
    out = {"tokens_per_s": _median_rate(hooks.reports, warmup_reports), "built_mem_gib": hooks.built,
           "peak_mem_gib": max(r.get("perf/max_mem_gib", 0.0) for r in hooks.reports), "batch": cfg.data.batch_size,
           "rates": _rates(hooks.reports), **_proof_from_reports(hooks.reports)}
    _free()
    return out


def ours_ray(cfg, warmup_reports: int) -> dict:
    """The loop on Ray Train (``launch.fit_and_collect``); tokens/s per worker from rank 0's reports."""
    from raytrain_scu.ray.launch import fit_and_collect

    reports = fit_and_collect(cfg, use_gpu=torch.cuda.is_available())
    world = cfg.scaling.num_workers
    return {"tokens_per_s": _median_rate(reports, warmup_reports) / world,
            "peak_mem_gib": max(r.get("perf/max_mem_gib", 0.0) for r in reports), "batch": cfg.data.batch_size,
            "workers": world, "rates": _rates(reports), **_proof_from_reports(reports)}


# ---------------------------------------------------------------- driver

def preset_of(shape: str, smoke: bool) -> str:
    return SHAPES[shape][1 if smoke else 0]


def part_shape(part: str, shape: str) -> str:
    """The --shape key a part runs at: the 8B and Granite parts name theirs, the others take ``shape``."""
    return "8b" if part.endswith("_8b") else "granite" if part == "granite_h1b" else shape


def expand_parts(groups: str, parts: str, gpus: int) -> list[str]:
    """The parts to run, in order, without repeats: the groups' (``rayN`` in ``scale``: ray2, ray4, ray8 up to
    ``gpus``, or ray2 with no GPU: CPU workers), then ``parts``'. Raises ValueError naming an unknown group or part."""
    most = gpus if gpus else 2
    names = []
    for g in filter(None, groups.split(",")):
        if g not in GROUPS:
            raise ValueError(f"--group: unknown group {g!r}, expected one of {', '.join(GROUPS)}")
        for p in GROUPS[g].split(","):
            names += [f"ray{n}" for n in SCALE_NS if n <= most] if p == "rayN" else [p]
    for p in filter(None, parts.split(",")):
        base = p.removeprefix("profile_")
        if not (p in PARTS or RAY_PART.fullmatch(base) or base != p and base in LOOP_PARTS):
            raise ValueError(f"--parts: unknown part {p!r}, expected rayN (N >= 1), one of {', '.join(PARTS)}, "
                             f"or profile_ before rayN or one of {', '.join(LOOP_PARTS)}")
        names.append(p)
    return list(dict.fromkeys(names))


def run_parts(args) -> dict:
    from raytrain_scu.core.data import prepare_data
    from raytrain_scu.core.model import flops_per_token, load_tokenizer, preset_config

    preset = preset_of(args.shape, args.smoke)
    tok = load_tokenizer(preset)
    data = prepare_data(tok, source="shakespeare", path="", block_size=args.block, val_fraction=0.05)
    fpt = flops_per_token(preset_config(preset, len(tok)), args.block)  # a preset's own vocabulary wins
    storage = tempfile.mkdtemp(prefix="rtscu_bench_")
    steps = args.warmup_reports * args.report_every + args.steps
    res = {"card": device_name(), "preset": preset, "block": args.block, "batch": args.batch,
           "flops_per_token": fpt, "peak_flops": peak_flops(device_name()), "versions": _versions(), "parts": {}}
    compile_ = not args.no_compile and torch.cuda.is_available()
    out_dir = Path(args.out).parent if args.out else Path(".")

    parts = args.part_list
    if "ref_liger" in parts:  # Liger patches transformers' Llama classes for the rest of the process
        parts = [p for p in parts if p != "ref_liger"] + ["ref_liger"]
    for part in parts:
        t0 = time.time()
        base = "ours" if part == "profile" else part.removeprefix("profile_")  # the part that runs (profiled?)
        shape = part_shape(base, args.shape)
        pre = preset_of(shape, args.smoke)
        block = args.granite_block if base == "granite_h1b" else args.block

        def cfg(**kw):
            kw = dict(preset=pre, batch=args.batch, block=args.block, steps=steps, report_every=args.report_every,
                      storage=storage, name=part, compile=compile_,
                      profile_steps=args.profile_steps if base != part else 0) | kw
            return bench_config(**kw)

        ray = RAY_PART.fullmatch(base)
        try:
            if base == "ref_eager":
                r = reference_loop(preset=pre, batch=args.batch, block=args.block, steps=args.steps,
                                   warmup=args.warmup_reports, compile=False, blocks=data.train)
            elif base in ("ref_compile", "ref_8b"):  # compiled where ours is: on a GPU without --no-compile
                r = reference_loop(preset=pre, batch=args.batch, block=args.block, steps=args.steps,
                                   warmup=max(3, args.warmup_reports), compile=compile_, blocks=data.train)
                r["compiled"] = compile_
            elif base == "ref_liger":
                r = reference_loop(preset=pre, batch=args.batch, block=args.block, steps=args.steps,
                                   warmup=max(3, args.warmup_reports), compile=False, blocks=data.train, liger=True)
            elif base in ("ours", "ours_8b", "ours_fused", "ours_fp8", "ours_fp8_8b"):
                r = ours_bare(cfg(fuse_lora=base == "ours_fused", base_fp8="fp8" in base), args.warmup_reports)
            elif base == "ours_best":
                r = ours_bare(cfg(batch=args.best_batch), args.warmup_reports)
            elif base == "ours_compile_model":
                r = ours_bare(cfg(compile_scope="model"), args.warmup_reports)
            elif base == "scu_none":
                r = ours_bare(cfg(mode="none"), args.warmup_reports)
            elif ray:
                r = ours_ray(cfg(workers=int(ray.group(1))), args.warmup_reports)
            elif base in ("mem_bf16", "mem_qlora", "qlora_8b", *QLORA_SMALL):
                r = ours_bare(cfg(batch=args.mem_batch, compile=False, checkpointing=True, chunk=args.mem_chunk,
                                  load_in_4bit=base != "mem_bf16", embedding_int8="emb8" in base or "offload" in base,
                                  offload_embedding="offload" in base), args.warmup_reports)
            elif base == "granite_h1b":
                kernels = mamba_kernels()
                r = ours_bare(cfg(batch=args.granite_batch, block=block, targets=("all-linear",),
                                  checkpointing=kernels["path"] == "torch path"), args.warmup_reports)
                r.update(mamba=kernels, gradient_checkpointing=kernels["path"] == "torch path")
            elif base == "attn":
                r = attention_bench(preset=pre, batch=args.batch, block=args.block)
            else:
                raise ValueError(f"unknown part {part!r}")
            part_fpt = flops_per_token(preset_config(pre, len(tok)), block)
            util = mfu(r["tokens_per_s"], part_fpt, res["peak_flops"]) if base != "attn" else None
            r["mfu"] = float("nan") if util is None else util
            r.update(shape_name=shape, preset=pre, block=block, flops_per_token=part_fpt)
            if base != part:  # each rank's table beside --out; the JSON keeps their first lines
                r["profile"] = collect_profile(Path(storage) / part / "profile", out_dir, part)
        except Exception as e:  # noqa: BLE001 - one failed part must not hide the others' numbers
            r = {"error": f"{type(e).__name__}: {str(e)[:300]}", "shape_name": shape}
        r["wall_s"] = round(time.time() - t0, 1)
        res["parts"][part] = r
        print(f"[bench] {part}: {json.dumps(r)}", flush=True)
        if args.out:  # after every part: a call cut short still returns what it measured
            Path(args.out).write_text(json.dumps(res, indent=1))
    return res


def collect_profile(src: Path, out_dir: Path, part: str) -> dict:
    """Each rank's profile table from ``src`` to ``<out_dir>/<part>_rank<k>.txt``; returns their first lines."""
    heads = {}
    for f in sorted(src.glob("rank*.txt")):
        text = f.read_text()
        (out_dir / f"{part}_{f.name}").write_text(text)
        heads[f.stem] = text.splitlines()[0]
    if not heads:
        raise RuntimeError(f"no profile table was written under {src}")
    return heads


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import peft
    import transformers

    try:
        ray_v = version("ray")
    except PackageNotFoundError:
        ray_v = "-"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "ray": ray_v, "cuda": torch.version.cuda or "-"}
