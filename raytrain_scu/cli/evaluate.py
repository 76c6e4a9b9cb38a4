"""``python -m raytrain_scu.evaluate``: held-out bits per token of a base model with or without a LoRA adapter, and a
paired bootstrap interval between two of them (``driver.evaluate`` does the scoring)."""
from __future__ import annotations

import raytrain_scu.cli.passive_omp  # noqa: F401  # isort: skip - first: OMP_WAIT_POLICY before torch loads

import argparse
import json
import sys
from pathlib import Path

from raytrain_scu.config.paths import split_query
from raytrain_scu.config.schema import Config
from raytrain_scu.config.secrets import refuse_credential
from raytrain_scu.driver.evaluate import DEFAULT_BOOTSTRAP, DEFAULT_CI, DEFAULT_MAX_TOKENS, evaluate
from raytrain_scu.driver.resolve import resolve
from raytrain_scu.errors import USER_ERRORS, DataError, EvalError, ModelError

FEW_DOCUMENTS = 20  # below this a resampling interval over documents is too coarse to lean on


def format_table(result: dict) -> str:
    """The result as a few readable lines: one row per model, then the comparison."""
    where = f" {result['path']}" if result["path"] else ""
    split = (f"val split (fraction {result['val_fraction']}, seed {result['seed']})" if result["split"] == "val"
             else "all documents")
    # each adapter's path whole (a remote URI without its options), the column as wide as the longest
    adapters = {label: split_query(m["adapter"])[0] if m["adapter"] else "(base)"
                for label, m in result["models"].items()}
    width = max(len("adapter"), *map(len, adapters.values()))
    lines = [f"held-out BPT of {result['model']} on {result['source']}{where}: {split}, "
             f"{result['documents']} documents, {result['tokens']:,} tokens, block {result['block_size']}",
             f"  {'':5} {'adapter':<{width}} {'BPT':>9} {'tokens':>12} {'docs':>7}"]
    for label, m in result["models"].items():
        lines.append(f"  {label:5} {adapters[label]:<{width}} {m['bpt']:9.4f} {m['tokens']:12,} {m['documents']:7}")
    c = result["comparison"]
    if c:
        lines.append(f"  A − B {c['diff_bpt']:+.4f} BPT, {c['ci']:.0%} CI [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}], "
                     f"bootstrap mean {c['mean_diff_bpt']:+.4f}, sign flipped in {c['p_sign_flip']:.4f} of "
                     f"{c['n_boot']} paired resamples of {c['documents']} documents")
        if c["documents"] < FEW_DOCUMENTS:
            lines.append(f"  (only {c['documents']} documents: the interval is rough; use more held-out documents)")
    lines.append(ran_line(result))
    return "\n".join(lines)


def ran_line(result: dict) -> str:
    """How the scoring ran: where, how long, how fast, and how much of the split it covered."""
    ran = result.get("ran") or {}
    if not ran:
        return ""
    rate = f", {ran['tokens_per_s']:,.0f} tokens/s" if ran.get("tokens_per_s") else ""
    cover = (f"; --max-tokens {ran['max_tokens']:,} of the split's {ran['tokens_available']:,} tokens "
             f"(--max-tokens 0 scores them all)" if result["tokens"] < ran.get("tokens_available", 0) else "")
    return f"  scored in {ran['where']}: {len(result['models'])} x {result['tokens']:,} tokens in " \
           f"{ran['seconds']:.0f} s{rate}{cover}"


# ---------------------------------------------------------------- CLI

# CLI flag -> config key: a flag overrides --config, which overrides config.py's defaults
FLAG_KEYS = {"model": "model.name", "gguf_file": "model.gguf_file", "tokenizer": "model.tokenizer",
             "precision": "model.precision", "source": "data.source", "path": "data.path",
             "text_field": "data.text_field", "max_documents": "data.max_documents",
             "val_fraction": "data.val_fraction", "seed": "seed", "block_size": "data.block_size",
             "batch_size": "data.batch_size"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m raytrain_scu.evaluate",
                                description="Held-out bits per token of a base model with or without a LoRA "
                                            "adapter; paired bootstrap CI between two of them. Flags left out "
                                            "take the --config file's values, else config.py's defaults.")
    p.add_argument("--config", help="a training config: model, data, val_fraction and seed come from it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted config override, as for the train CLI (repeatable)")
    p.add_argument("--model", help="preset, pkg:NAME, local directory or hub id (model.name)")
    p.add_argument("--gguf-file")
    p.add_argument("--tokenizer")
    p.add_argument("--precision", help="auto | fp32 | bf16 | fp16")
    p.add_argument("--adapter", default="", help="peft adapter directory (or a training checkpoint) for model A")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--compare-adapter", default="", help="model B: the base with this adapter")
    group.add_argument("--compare-base", action="store_true", help="model B: the bare base model")
    p.add_argument("--source", help="shakespeare | text | jsonl | hf_disk | hf_hub | auto")
    p.add_argument("--path")
    p.add_argument("--text-field")
    p.add_argument("--max-documents", type=int)
    p.add_argument("--split", default="val", choices=("val", "all"),
                   help="val: the documents training held out (val_fraction, seed); all: every document")
    p.add_argument("--val-fraction", type=float)
    p.add_argument("--seed", type=int, help="picks the val documents and seeds the bootstrap")
    p.add_argument("--block-size", type=int)
    p.add_argument("--batch-size", type=int, help="windows per forward pass")
    p.add_argument("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP, help="paired bootstrap resamples")
    p.add_argument("--ci", type=float, default=DEFAULT_CI, help="confidence level of the interval")
    p.add_argument("--json", help="write the result here as JSON")
    p.add_argument("--per-document", action="store_true", help="keep per-document nats and tokens in the JSON")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="score at most this many tokens per model: the beginning of every held-out document, the "
                        f"same share of each (default {DEFAULT_MAX_TOKENS:,}: minutes on a laptop CPU; 0: every "
                        "token of the split, for a GPU)")
    p.add_argument("--workers", type=int, default=None,
                   help="Ray tasks to spread the documents over (0: this process; default: one per GPU on a machine "
                        "with several, scaling.num_workers on the cluster at RAY_ADDRESS, else 0)")
    p.add_argument("--gpus-per-worker", type=float, help="GPUs per Ray task (default: from scaling.*)")
    p.add_argument("--verbose", action="store_true", help="Ray's and the tasks' output on the console too")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    """--config (optional) + the explicit flags + --set overrides, built and validated by config.py."""
    if not args.config and not args.model:
        raise EvalError("give --model (and a data source) or --config")
    for flag in ("adapter", "compare_adapter"):  # storage URIs, held to the config's rule on credentials
        refuse_credential(f"--{flag.replace('_', '-')}", getattr(args, flag))
    overrides = [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None]
    return resolve(args.config, overrides + list(args.set))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = config_from_args(args)
        result = evaluate(cfg, split=args.split, adapter=args.adapter, compare_adapter=args.compare_adapter,
                          compare_base=args.compare_base, n_boot=args.bootstrap, ci=args.ci, workers=args.workers,
                          gpus_per_worker=args.gpus_per_worker, max_tokens=args.max_tokens, verbose=args.verbose)
    except USER_ERRORS + (DataError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result), flush=True)
    if args.json:
        if not args.per_document:
            result.pop("per_document")
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return 0

