"""``python -m raytrain_scu.bench``: raytrain_scu's loop against its peers in their strongest configurations, side by
side on one machine, one process (Ray runs start their own workers; a part that patches transformers runs in a
subprocess of its own).

The parts are :data:`~raytrain_scu.studies.bench.parts.PARTS`; ``--group`` picks named sets of them
(:data:`~raytrain_scu.studies.bench.parts.GROUPS`), ``--parts`` names parts. Every part that times training must
prove it trained (``measure.proof_of_training``): the LoRA B matrices left zero and the BPT on a fixed set of blocks
fell. A part that fails this reports an error, not a speed. tokens/s are medians over timed intervals after warm-up;
MFU = tokens/s x FLOPs/token / peak, with FLOPs/token = 4·N_matmul + 12·L·d·T for a frozen base (attention counted
over the full T x T square, not its causal half) and the card's dense bf16 peak; FP8 parts also against the FP8 peak.
``--smoke`` runs a tiny CPU version (the test suite uses it): the same code paths on shrunken shapes of the same
structure (``tiny``, ``tiny-llama-3.1-8b``, ``tiny-granite-4.0-h``).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from raytrain_scu.core.data.cache import prepare_data
from raytrain_scu.core.model.flops import flops_per_token
from raytrain_scu.core.model.presets import preset_config
from raytrain_scu.core.model.source import load_tokenizer
from raytrain_scu.hardware.gpus import mfu, peak_flops, peak_fp8_flops
from raytrain_scu.studies.bench.measure import device_name, versions
from raytrain_scu.studies.bench.ours import bench_config
from raytrain_scu.studies.bench.parts import Ctx, lookup, profiles_host, profiling, shape_of
from raytrain_scu.studies.bench.sft_data import draw, stats, token_examples, write_examples

# --shape (and the parts that name their own shape) -> (preset on a GPU, its shrunken twin for --smoke)
SHAPES = {"1b": ("llama-3.2-1b-shape", "tiny"), "8b": ("llama-3.1-8b-shape", "tiny-llama-3.1-8b"),
          "granite": ("granite-4.0-h-1b-shape", "tiny-granite-4.0-h")}
EXTRA_VERSIONS = ("liger-kernel", "unsloth", "unsloth-zoo", "bitsandbytes", "mamba-ssm", "causal-conv1d")


def preset_of(shape: str, smoke: bool) -> str:
    return SHAPES[shape][1 if smoke else 0]


def _ctx(args, part: str, *, storage: str, compile_: bool, blocks, sft=None) -> Ctx:
    shape = shape_of(part, args.shape)
    pre = preset_of(shape, args.smoke)
    block = args.granite_block if shape == "granite" else args.block
    steps = args.warmup_reports * args.report_every + args.steps
    profiled = profiling(part)

    def cfg(**kw):
        kw = dict(preset=pre, batch=args.batch, block=block, steps=steps, report_every=args.report_every,
                  storage=storage, name=part, compile=compile_,
                  profile_steps=args.profile_steps if profiled else 0, profile_host=profiles_host(part)) | kw
        return bench_config(**kw)

    return Ctx(args=args, preset=pre, block=block, blocks=blocks, steps=steps, compile=compile_, cfg=cfg, sft=sft)


def sft_examples(args, tok, blocks, storage: str, res: dict):
    """() -> (jsonl path, [(ids, target)], tokenizer): ``--sft-examples`` examples of LIMA's lengths
    (:mod:`.sft_data`), written and tokenised at the first call; their account goes into ``res["sft_data"]``."""
    made = {}

    def get():
        if not made:
            lengths = draw(args.sft_examples, seed=0, scale=args.block / 2048 if args.smoke else 1.0)
            path = write_examples(Path(storage) / "sft_examples.jsonl", tok, np.asarray(blocks).reshape(-1), lengths)
            examples = token_examples(path, tok, args.block)
            made["v"] = (path, examples, tok)
            res["sft_data"] = {"lengths": "LIMA's (prompt, answer) token lengths, drawn with replacement (seed 0): "
                                          "raytrain_scu/studies/bench/data/lima_lengths.json",
                               "text": "the Shakespeare token stream", **stats(examples)}
        return made["v"]
    return get


# a line that names why a process died: C++'s uncaught exception (torch's CUDA errors arrive as one) or Python's
_WHAT = re.compile(r"what\(\):|terminate called")
_RAISED = re.compile(r"^\s*[\w.]*(Error|Exception)(:|$)")  # not c10's "Exception raised from ..." lines


def failure_text(stderr: str, limit: int = 300) -> str:
    """What a failed subprocess said, in about ``2 * limit`` characters: the line naming its error (C++'s ``what():``
    line, else the last Python exception line) and the end of its output. A C++ abort ends with a stack of frames,
    so its end alone loses the cause."""
    text = stderr.strip()
    lines = text.splitlines()
    named = [ln.strip() for ln in lines if _WHAT.search(ln)][-1:] or \
        [ln.strip() for ln in lines if _RAISED.match(ln)][-1:]
    tail = text[-limit:]
    if named and named[0] not in tail:
        return f"{named[0][:limit]} [...] {tail}"
    return tail


def _isolated(args, part: str) -> dict:
    """A part in a subprocess of its own: it patches transformers for the rest of its process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("shape", "granite_batch", "granite_block", "batch", "best_batch", "mem_batch", "mem_chunk",
                          "block", "steps", "report_every", "warmup_reports", "profile_steps", "sft_examples")]
        flags += ["--smoke"] * args.smoke + ["--no-compile"] * args.no_compile
        proc = subprocess.run([sys.executable, "-m", "raytrain_scu.bench", "--in-process", "--parts", part,
                               "--out", str(out), *flags], capture_output=True, text=True)
        if not out.exists():
            return {"error": f"subprocess exited {proc.returncode}: {failure_text(proc.stderr)}"}
        return json.loads(out.read_text())["parts"][part]


def _measure(args, part: str, ctx: Ctx, res: dict, out_dir: Path, storage: str) -> dict:
    entry, _ = lookup(part)
    if entry.isolated and not args.in_process:
        return _isolated(args, part)
    r = entry.run(ctx)
    if part == "attn":
        return r
    fpt = flops_per_token(preset_config(ctx.preset, len(load_tokenizer(ctx.preset))), ctx.block)
    util = mfu(r["tokens_per_s"], fpt, res["peak_flops"])
    r["mfu"] = float("nan") if util is None else util
    if "fp8" in part:  # the FP8 GEMMs' own peak, beside the bf16-equivalent figure
        fp8 = mfu(r["tokens_per_s"], fpt, peak_fp8_flops(res["card"]))
        r["mfu_fp8_peak"] = float("nan") if fp8 is None else fp8
    r.update(preset=ctx.preset, block=ctx.block, flops_per_token=fpt)
    if profiling(part):  # each rank's table beside --out; the JSON keeps their first lines
        r["profile"] = collect_profile(Path(storage) / part / "profile", out_dir, part)
    return r


def run_parts(args) -> dict:
    """Every part of ``args.part_list`` in order; the results (written to ``--out`` after each part)."""
    preset = preset_of(args.shape, args.smoke)
    tok = load_tokenizer(preset)
    data = prepare_data(tok, streaming="off", loader_workers=0,
                        source="shakespeare", path="", block_size=args.block, val_fraction=0.05)
    storage = tempfile.mkdtemp(prefix="rtscu_bench_")
    # the default shape's preset and FLOPs; a part of another shape (..._8b, granite_...) records its own, and each
    # part its own batch
    res = {"card": device_name(), "default_preset": preset, "block": args.block, "batch": args.batch,
           "default_flops_per_token": flops_per_token(preset_config(preset, len(tok)), args.block),
           "peak_flops": peak_flops(device_name()), "versions": versions(*EXTRA_VERSIONS), "command": args.command,
           "parts": {}}
    compile_ = not args.no_compile and torch.cuda.is_available()
    out_dir = Path(args.out).parent if args.out else Path(".")
    sft = sft_examples(args, tok, data.train, storage, res)
    for part in args.part_list:
        t0 = time.time()
        ctx = _ctx(args, part, storage=storage, compile_=compile_, blocks=data.train, sft=sft)
        try:
            r = _measure(args, part, ctx, res, out_dir, storage)
        except Exception as e:  # noqa: BLE001 - one failed part must not hide the others' numbers
            r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        r.update(shape_name=shape_of(part, args.shape), wall_s=round(time.time() - t0, 1))
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
