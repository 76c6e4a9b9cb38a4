"""The bench's parts, one table entry each: what a part runs, at which model shape, and whether it is a peer (its speed
counts toward the best peer) or must run in a process of its own (Liger patches transformers for the rest of its
process; Unsloth's part starts its own). A part named ``<base>_8b`` runs ``<base>`` at the Llama-3.1-8B shape;
``granite_*`` parts run at the Granite-4.0-H-1B shape; the others at ``--shape``."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from raytrain_scu.core.model.families import mamba_kernels, mamba_kernels_run
from raytrain_scu.studies.bench.attention import attention_bench
from raytrain_scu.studies.bench.ours import ours_bare, ours_ray
from raytrain_scu.studies.bench.reference import reference_loop
from raytrain_scu.studies.bench.sft_peers import padded_loop, trl_loop
from raytrain_scu.studies.bench.unsloth import unsloth_loop, unsloth_sft_loop

RAY_PART = re.compile(r"ray([1-9][0-9]*)")  # the Ray parts: rayN, N workers with one GPU each


@dataclass
class Ctx:
    """What a part is given: the CLI's arguments, its model preset and block, the training blocks the peers read,
    the timed step count, and ``cfg(**kw)``, our loop's config for this part (``ours.bench_config``)."""

    args: object
    preset: str
    block: int
    blocks: object
    steps: int
    compile: bool  # on a GPU unless --no-compile
    cfg: Callable = field(repr=False)
    # () -> (jsonl path, [(ids, target)], tokenizer): the SFT parts' examples (.sft_data), made once a bench run
    sft: Callable = field(default=None, repr=False)


@dataclass(frozen=True)
class Part:
    run: Callable[[Ctx], dict]
    peer: bool = False  # a peer in its strongest configuration: the fastest of these is the best peer
    isolated: bool = False  # patches transformers: runs in a subprocess
    loop: bool = False  # our loop: profile_<part> profiles it
    sft: bool = False  # on the SFT examples: judged against the SFT peers only, on target tokens/s


def _ref(**kw) -> Callable[[Ctx], dict]:
    def run(c: Ctx) -> dict:
        a = c.args
        return reference_loop(preset=c.preset, batch=a.batch, block=c.block, steps=a.steps,
                              warmup=a.warmup_reports * a.report_every, interval=a.report_every, blocks=c.blocks,
                              **kw)
    return run


def _unsloth(load_in_4bit: bool) -> Callable[[Ctx], dict]:
    def run(c: Ctx) -> dict:
        a = c.args
        return unsloth_loop(preset=c.preset, batch=a.mem_batch if load_in_4bit else a.batch, block=c.block,
                            steps=a.steps, warmup=a.warmup_reports * a.report_every, interval=a.report_every,
                            blocks=c.blocks, load_in_4bit=load_in_4bit)
    return run


def _ours(**kw) -> Callable[[Ctx], dict]:
    return lambda c: ours_bare(c.cfg(**kw), c.args.warmup_reports)


def _mem(load_in_4bit: bool, int8: bool | None = None, offload: bool = False, compiled: bool = False,
         acts: bool = False, dequant: str = "auto") -> Callable[[Ctx], dict]:
    """Peak memory at --mem-batch: gradient checkpointing, a small loss chunk; eager, or with ``compiled`` each decoder
    layer compiled (unless --no-compile); ``int8``: the embedding and head in int8 (default: on exactly when
    ``offload``, the input embedding in host memory); with ``acts`` the layers' saved inputs in host memory;
    ``dequant``: quant.dequant_4bit."""
    int8 = offload if int8 is None else int8
    return lambda c: ours_bare(c.cfg(batch=c.args.mem_batch, compile=compiled and c.compile, checkpointing=True,
                                     chunk=c.args.mem_chunk, load_in_4bit=load_in_4bit, embedding_int8=int8,
                                     offload_embedding=offload, offload_activations=acts, dequant_4bit=dequant),
                               c.args.warmup_reports)


def _granite(load_in_4bit: bool, eager: bool = False, recompute_elementwise: str = "auto") -> Callable[[Ctx], dict]:
    """Ours at the Granite shape, LoRA on all linear layers; checkpointing where the torch path's scan needs it."""
    def run(c: Ctx) -> dict:
        kernels = mamba_kernels()
        torch_path = not mamba_kernels_run()
        a = c.args
        batch = a.mem_batch * 2 if load_in_4bit else a.granite_batch
        r = ours_bare(c.cfg(batch=batch, block=c.block, targets=("all-linear",), load_in_4bit=load_in_4bit,
                            compile=c.compile and not load_in_4bit and not eager,
                            checkpointing=torch_path or load_in_4bit, recompute_elementwise=recompute_elementwise),
                      a.warmup_reports)
        return {**r, "mamba": kernels, "gradient_checkpointing": torch_path or load_in_4bit,
                "compiled": c.compile and not load_in_4bit and not eager}
    return run


def _sft_ours(packing: bool) -> Callable[[Ctx], dict]:
    """Our loop on the SFT examples, packed or one example a row (padded, length-grouped) at --batch rows."""
    return lambda c: ours_bare(c.cfg(data_path=str(c.sft()[0]), packing=packing), c.args.warmup_reports)


def _sft_padded(c: Ctx) -> dict:
    a = c.args
    _, examples, tok = c.sft()
    return padded_loop(preset=c.preset, examples=examples, batch=a.batch, block=c.block, steps=a.steps,
                       warmup=a.warmup_reports * a.report_every, interval=a.report_every, compile_=c.compile,
                       pad_id=tok.eos_token_id or 0)


def _sft_trl(attention: str, compile_: bool = False) -> Callable[[Ctx], dict]:
    def run(c: Ctx) -> dict:
        a = c.args
        _, examples, tok = c.sft()
        return trl_loop(preset=c.preset, examples=examples, tokenizer=tok, batch=a.batch, block=c.block,
                        steps=a.steps, warmup=a.warmup_reports * a.report_every, interval=a.report_every,
                        attention=attention, compile_=compile_)
    return run


def _sft_unsloth(gradient_checkpointing) -> Callable[[Ctx], dict]:
    def run(c: Ctx) -> dict:
        a = c.args
        _, examples, _ = c.sft()
        return unsloth_sft_loop(preset=c.preset, examples=examples, batch=a.batch, block=c.block, steps=a.steps,
                                warmup=a.warmup_reports * a.report_every, interval=a.report_every,
                                gradient_checkpointing=gradient_checkpointing)
    return run


def _ray(c: Ctx, n: int) -> dict:
    return ours_ray(c.cfg(workers=n), c.args.warmup_reports)


PEERS_AT_EVERY_SHAPE = {
    "ref_compile": Part(_ref(compile_scope="model", attention="causal"), peer=True),
    "ref_compile_default": Part(_ref(compile_scope="model", attention="default")),
    "ref_liger": Part(_ref(compile_scope="model", attention="causal", liger=True), peer=True, isolated=True),
    "ref_liger_layers": Part(_ref(compile_scope="layers", attention="causal", liger=True), peer=True, isolated=True),
    # unsloth_loop runs each in a fresh process of its own: Unsloth must be imported before transformers
    "ref_unsloth": Part(_unsloth(load_in_4bit=False), peer=True),
    "ref_unsloth_qlora": Part(_unsloth(load_in_4bit=True)),
    "ours": Part(_ours(), loop=True),
    "ours_fp8": Part(_ours(base_fp8=True), loop=True),
    "ours_fused": Part(_ours(fuse_lora=True), loop=True),
    # the compiled layers save every elementwise output, as torch's default partitioner chooses
    "ours_acts_kept": Part(_ours(recompute_elementwise="never"), loop=True),
    "ours_fp8_acts_kept": Part(_ours(base_fp8=True, recompute_elementwise="never"), loop=True),
    "ours_fp8_head": Part(_ours(base_fp8=True, head_fp8=True), loop=True),  # the LM head's GEMMs in FP8 too
    # the whole model's compiled forward and backward replayed as CUDA graphs (torch's cudagraph trees): fewer
    # launches from the host (per layer, config.checks refuses it: each layer's replay overwrites the last one's output)
    "ours_model_graphs": Part(_ours(compile_scope="model", compile_mode="reduce-overhead"), loop=True),
    "ours_fp8_model_graphs": Part(_ours(base_fp8=True, compile_scope="model", compile_mode="reduce-overhead"),
                                  loop=True),
    # the FP8 base with the whole model compiled as one graph (no CUDA graphs): one compiled call a forward and one a
    # backward where the per-layer compile makes one per layer each, for where the host falls behind the FP8 GEMMs
    "ours_fp8_compile_model": Part(_ours(base_fp8=True, compile_scope="model"), loop=True),
    # supervised fine-tuning on LIMA's lengths (.sft_data): ours packed and padded, HF + peft padded, TRL padding-free
    # (isolated: TRL's trainer leaves accelerate's state behind in its process)
    "sft_packed": Part(_sft_ours(packing=True), loop=True, sft=True),
    "sft_padded": Part(_sft_ours(packing=False), loop=True, sft=True),
    "sft_ref_padded": Part(_sft_padded, peer=True, sft=True),
    "sft_ref_trl": Part(_sft_trl("flex_attention"), peer=True, isolated=True, sft=True),
    "sft_ref_trl_sdpa": Part(_sft_trl("sdpa"), peer=True, isolated=True, sft=True),
    # Unsloth's model under the SFTTrainer it patches, with the TRL part's settings (its own subprocess); without
    # gradient checkpointing as the other SFT parts, and with Unsloth's recommended "unsloth" checkpointing
    "sft_ref_unsloth": Part(_sft_unsloth(False), peer=True, sft=True),
    "sft_ref_unsloth_gc": Part(_sft_unsloth("unsloth"), peer=True, sft=True),
    # the Trainer's torch_compile=True: Inductor fails on TRL's own LM-head kernel there (docs/log/benchmarks.md)
    "sft_ref_trl_compiled": Part(_sft_trl("flex_attention", compile_=True), peer=True, isolated=True, sft=True),
}
PARTS: dict[str, Part] = {
    **PEERS_AT_EVERY_SHAPE,
    **{f"{name}_8b": part for name, part in PEERS_AT_EVERY_SHAPE.items()},
    # the input embedding in host memory and a 1024-token loss chunk: what the untied 8B can shed (a tied head can't)
    "ours_lowmem_8b": Part(_ours(offload_embedding=True, chunk=1024), loop=True),
    # the first 2 GiB the forward saves (the bottom layers' activations) in pinned host memory until the backward
    "ours_acts_host_8b": Part(_ours(offload_activations=True, offload_activations_gib=2.0), loop=True),
    # half that, with a 1024-token loss chunk for the rest of the way: fewer bytes to copy
    "ours_acts_host_1g_8b": Part(_ours(offload_activations=True, offload_activations_gib=1.0, chunk=1024), loop=True),
    "attn": Part(lambda c: attention_bench(preset=c.preset, batch=c.args.batch, block=c.block)),
    "ref_eager": Part(_ref(compile_scope="none", attention="default")),
    "ours_best": Part(lambda c: ours_bare(c.cfg(batch=c.args.best_batch), c.args.warmup_reports), loop=True),
    "ours_compile_model": Part(_ours(compile_scope="model"), loop=True),
    "scu_none": Part(_ours(mode="none"), loop=True),
    "mem_bf16": Part(_mem(load_in_4bit=False), loop=True),
    "mem_qlora": Part(_mem(load_in_4bit=True), loop=True),
    "mem_qlora_emb8": Part(_mem(load_in_4bit=True, int8=True), loop=True),
    # the 4-bit base with its decoder layers compiled (the weights dequantised by torch ops in the layers' graphs) and
    # checkpointed, nothing offloaded: set beside ref_unsloth_qlora at one micro-batch (--mem-batch for both)
    "qlora_compiled": Part(_mem(load_in_4bit=True, compiled=True), loop=True),
    "mem_bf16_8b": Part(_mem(load_in_4bit=False), loop=True),
    "qlora_8b": Part(_mem(load_in_4bit=True), loop=True),
    "qlora_emb8_8b": Part(_mem(load_in_4bit=True, int8=True), loop=True),
    "qlora_offload_8b": Part(_mem(load_in_4bit=True, offload=True), loop=True),
    # the same with its decoder layers compiled: the 4-bit weights dequantised by torch ops in the layers' graphs
    # (quant.dequant_4bit=auto), or by bitsandbytes' kernels (its 4-bit ops as torch.library custom ops)
    "qlora_offload_compiled_8b": Part(_mem(load_in_4bit=True, offload=True, compiled=True), loop=True),
    "qlora_offload_compiled_bnb_8b": Part(_mem(load_in_4bit=True, offload=True, compiled=True,
                                               dequant="bitsandbytes"), loop=True),
    # and the decoder layers' saved inputs in pinned host memory (model.offload_activations)
    "qlora_offload_acts_8b": Part(_mem(load_in_4bit=True, offload=True, compiled=True, acts=True), loop=True),
    # the same with the LM head in bf16: one head GEMM a chunk and no dequantisation, for 0.49 GiB more than int8's
    "qlora_offload_acts_bf16head_8b": Part(_mem(load_in_4bit=True, int8=False, offload=True, compiled=True, acts=True),
                                           loop=True),
    "granite_h1b": Part(_granite(load_in_4bit=False), loop=True),
    "granite_h1b_eager": Part(_granite(load_in_4bit=False, eager=True), loop=True),
    # Granite's own choice (auto) is off: this part measures the recompute there
    "granite_h1b_recompute": Part(_granite(load_in_4bit=False, recompute_elementwise="always"), loop=True),
    "granite_qlora": Part(_granite(load_in_4bit=True), loop=True),
}
SCALE_NS = (2, 4, 8)  # the `scale` group: ray1 and rayN for these N up to the GPUs here
# named sets of parts; each fits one 10-minute call on one H100 or H200 (docs/log/benchmarks.md has the measured times)
GROUPS = {"1b": "attn,ref_eager,ref_compile_default,ref_compile,ours,ours_fp8,scu_none,ray1,mem_bf16,mem_qlora_emb8,"
                "ref_liger,ref_liger_layers",
          # the QLoRA part that meets the 8B QLoRA bounds: compiled, the offloaded embedding, the layers' inputs on
          # the host
          "8b": "ref_compile_8b,ours_8b,ours_fp8_8b,mem_bf16_8b,qlora_offload_acts_8b,ref_liger_8b",
          "unsloth": "ref_unsloth,ref_unsloth_8b,ref_unsloth_qlora_8b",
          "scale": "ray1,rayN",  # rayN: see expand_parts
          "granite": "granite_h1b,granite_h1b_eager,granite_qlora",
          # the ours/peer pair first: a call cut short keeps the comparison
          "sft": "sft_packed,sft_ref_trl,sft_ref_padded,sft_ref_unsloth,sft_ref_trl_sdpa,sft_padded,sft_ref_unsloth_gc"}


# profile_<part>: that part under train.profile_steps; idle_<part>: the same with train.profile_host=false (the device
# alone, whose idle stretches are close to an unprofiled step's)
PROFILING = ("profile_", "idle_")


def profiling(part: str) -> bool:
    """Whether ``part`` is a ``profile_``/``idle_`` part (or ``profile`` alone)."""
    return unprofiled(part) != part


def profiles_host(part: str) -> bool:
    """Whether a profiling part records the host's operators (``profile_``) or the device alone (``idle_``)."""
    return not part.startswith("idle_")


def unprofiled(part: str) -> str:
    """The part a ``profile_``/``idle_`` part profiles (``profile`` alone: ``ours``); any other part itself."""
    if part == "profile":
        return "ours"
    for prefix in PROFILING:
        if part.startswith(prefix):
            return part.removeprefix(prefix)
    return part


def shape_of(part: str, shape: str) -> str:
    """The --shape key a part runs at: the 8B and Granite parts name theirs, the others take ``shape``."""
    base = unprofiled(part)
    return "8b" if base.endswith("_8b") else "granite" if base.startswith("granite") else shape


def lookup(part: str) -> tuple[Part, int]:
    """(the table entry, Ray workers or 0) of a part name; ``profile_<part>`` and ``idle_<part>`` are that part."""
    base = unprofiled(part)
    ray = RAY_PART.fullmatch(base)
    if ray:
        n = int(ray.group(1))
        return Part(lambda c: _ray(c, n), loop=True), n
    return PARTS[base], 0


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
    loops = [n for n, p in PARTS.items() if p.loop]
    for p in filter(None, parts.split(",")):
        base = unprofiled(p)
        if not (p in PARTS or RAY_PART.fullmatch(base) or profiling(p) and base in loops):
            raise ValueError(f"--parts: unknown part {p!r}, expected rayN (N >= 1), one of {', '.join(PARTS)}, "
                             f"or profile_ or idle_ before rayN or one of {', '.join(loops)}")
        names.append(p)
    return list(dict.fromkeys(names))
