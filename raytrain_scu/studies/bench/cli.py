"""``python -m raytrain_scu.bench [--group G,...] [--parts P,...] [--smoke] [--out FILE]``: timed training parts, our
loop against its peers on one GPU (or the CPU with ``--smoke``); a table and the targets at the end."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from raytrain_scu.studies.bench.parts import GROUPS, PARTS, expand_parts, profiling
from raytrain_scu.studies.bench.report import table
from raytrain_scu.studies.bench.run import run_parts


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m raytrain_scu.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU (seconds)")
    p.add_argument("--group", default="", help=f"named sets of parts, comma-separated: {', '.join(GROUPS)} "
                   f"(neither --group nor --parts: 1b)")
    p.add_argument("--parts", default="", help="comma-separated parts, after the groups': rayN or " + ", ".join(PARTS))
    p.add_argument("--shape", default="1b", choices=["1b", "8b"],
                   help="the model of the parts that do not name one (ray1, rayN, ours, ref_compile, ...)")
    p.add_argument("--granite-batch", type=int, default=32, help="device batch of granite_h1b (the seed's A100 one)")
    p.add_argument("--granite-block", type=int, default=1024, help="block of the granite parts")
    for flag, default in (("--batch", 8), ("--best-batch", 16), ("--mem-batch", 2)):  # device batches
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--mem-chunk", type=int, default=256, help="loss chunk (tokens) of the memory parts")
    p.add_argument("--block", type=int, default=2048)
    p.add_argument("--sft-examples", type=int, default=3000, help="examples the sft parts draw (LIMA's lengths)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (reference) / timed steps after warm-up")
    p.add_argument("--report-every", type=int, default=5)
    p.add_argument("--warmup-reports", type=int, default=2)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="steps the profile_<part> and idle_<part> parts profile")
    p.add_argument("--in-process", action="store_true", help="run isolated parts (Liger, Unsloth) in this process")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.block, args.batch, args.best_batch, args.mem_batch = 64, 2, 4, 2
        args.granite_batch, args.granite_block = 2, 64
        args.steps, args.report_every, args.warmup_reports = 4, 2, 1
        args.sft_examples = min(args.sft_examples, 200)
        if not args.parts and not args.group:
            args.parts = "attn,ref_eager,ref_compile_default,ref_compile,ours,scu_none"
    if args.profile_steps < 1 and any(profiling(p) for p in args.parts.split(",")):
        p.error("--profile-steps must be >= 1 for the profile_ and idle_ parts")
    try:
        args.part_list = expand_parts(args.group or ("" if args.parts else "1b"), args.parts, torch.cuda.device_count())
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.command = shlex.join(["python", "-m", "raytrain_scu.bench", *argv])
    res = run_parts(args)
    print(table(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0 if all("error" not in r for r in res["parts"].values()) else 1
