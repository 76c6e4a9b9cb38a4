"""``python -m raytrain_scu.generate RUN_DIR "prompt"``: try a trained adapter on its base model.

RUN_DIR is a run directory (``<run.storage_path>/<run.name>``), its ``output/``, or one checkpoint directory. A
finished run supplies ``output/config.yaml`` and ``output/adapter``, its primary adapter (``run.primary_adapter``: by
default the best checkpoint's); an unfinished one its newest good checkpoint, which is not necessarily the best (the
best is chosen when the run finishes): give a checkpoint directory to try another one.
The base model is rebuilt from the run's config: a real model from the same local path, GGUF file or hub id (offline
with ``HF_HUB_OFFLINE=1`` once cached), a random-init preset from ``output/base_model.json``, which records the seed,
dtype and device its weights were drawn with.
"""
from __future__ import annotations

import raytrain_scu.cli.passive_omp  # noqa: F401  # isort: skip - first: OMP_WAIT_POLICY before torch loads

import argparse
import sys

import torch

from raytrain_scu.driver.generate import chat_ids, complete, find_run, load_for_generation, trained_on_chat
from raytrain_scu.errors import EvalError, GenerateError, ModelError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raytrain_scu.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="<run.storage_path>/<run.name> (finished: its output/adapter; unfinished: its "
                                   "newest good checkpoint, not necessarily the best), its output/, or a checkpoint "
                                   "directory")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="the prompt as a user turn in the run's chat template, the reply as the assistant's "
                        "(default: on for a run trained on conversations)")
    args = p.parse_args(argv)
    try:
        cfg, adapter, recipe = find_run(args.run_dir)
        chat = trained_on_chat(cfg) if args.chat is None else args.chat
        if chat is None:
            print(f"note: the run's data ({cfg.data.source} {cfg.data.path}) is not readable here, so whether it "
                  f"trained on conversations is unknown: completing the prompt as text (--chat: as a chat turn)",
                  file=sys.stderr)
            chat = False
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, tok = load_for_generation(cfg, adapter, recipe, device)
        prompt_ids = chat_ids(cfg, tok, args.prompt) if chat else None
    except (GenerateError, EvalError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = complete(model, tok, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_p=args.top_p, seed=args.seed, prompt_ids=prompt_ids)
    print(f"user: {args.prompt}\nassistant: {text.strip()}" if chat else args.prompt + text, flush=True)
    return 0

