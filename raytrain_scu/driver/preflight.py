"""Checks that need I/O, run on the driver before Ray starts: the machine, the model, the data and the checkpoint a
re-run resumes from. Every problem is a PreflightError naming the key at fault; no Ray worker has started."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoModelForCausalLM

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.config.schema import Config, data_options, sequences_per_step
from raytrain_scu.core.checkpoint import (
    check_sharding,
    check_structure,
    check_tokens_per_epoch,
    newest_good_local,
    read_meta,
)
from raytrain_scu.core.data import sft
from raytrain_scu.core.data.blocks import max_documents_hint
from raytrain_scu.core.data.cache import prepare_data, tokens_per_epoch_from
from raytrain_scu.core.data.scan import scan_source
from raytrain_scu.core.data.sources import resolve_format, resolve_source, source_files
from raytrain_scu.core.data.stream import use_streaming
from raytrain_scu.core.embed_quant import (
    EMBEDDING_TARGETS,
    TIED_OFFLOAD,
    embedding_targets,
    embedding_targets_of,
    ties_embeddings,
)
from raytrain_scu.core.fp8 import check_fp8_device, check_fp8_head_config, unmatched_exclude
from raytrain_scu.core.fused_lora import check_fusable_config
from raytrain_scu.core.model.build import missing_targets, structure_of
from raytrain_scu.core.model.packed import check_packing
from raytrain_scu.core.model.source import check_model_source, load_tokenizer, max_positions, model_config
from raytrain_scu.driver.early import as_preflight, check_inputs
from raytrain_scu.errors import CheckpointError, DataError, ModelError, PreflightError

MIN_BLOCK_SUGGESTED = 32  # a shorter block holds too little context to be worth suggesting as a fix
BNB_COMPILES = (0, 50)  # the bitsandbytes whose 4-bit layers were measured compiled (docs/log/benchmarks.md)


def visible_gpus() -> int:
    """CUDA GPUs this process sees."""
    return torch.cuda.device_count()


def _local_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _skeleton(hf_config, trust_remote_code: bool):
    """The model as a weightless (meta-device) skeleton, for checks by module name; None if it cannot be built here
    (the workers check again while building the real model)."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001
        return None


def check_machine(cfg: Config) -> tuple[bool, int]:
    """GPUs and CPUs enough for a local Ray, precision and 4-bit supported; returns (use_gpu, visible GPUs)."""
    m, s = cfg.model, cfg.scaling
    local_ray = not os.environ.get("RAY_ADDRESS") and not ("ray" in sys.modules and sys.modules["ray"].is_initialized())
    gpus = visible_gpus()
    use_gpu = s.use_gpu if s.use_gpu is not None else gpus > 0
    if use_gpu and gpus == 0 and local_ray:
        raise PreflightError("scaling.use_gpu=true but no CUDA GPU is visible on this machine "
                             "(set scaling.use_gpu=false for CPU training, or submit to a GPU cluster)")
    if use_gpu and local_ray and s.num_workers * s.gpus_per_worker > gpus:
        raise PreflightError(f"scaling.num_workers={s.num_workers} x gpus_per_worker={s.gpus_per_worker:g} needs "
                             f"{s.num_workers * s.gpus_per_worker:g} GPUs but this machine has {gpus}")
    # a local Ray instance would wait forever for workers it cannot place
    if local_ray and s.num_workers * s.cpus_per_worker > _local_cpus():
        raise PreflightError(f"scaling.num_workers={s.num_workers} x cpus_per_worker={s.cpus_per_worker:g} needs "
                             f"{s.num_workers * s.cpus_per_worker:g} CPUs but this machine has {_local_cpus()} "
                             f"(lower them, or set RAY_ADDRESS to a cluster)")
    if m.precision == "fp16" and not use_gpu:
        raise PreflightError("model.precision=fp16 needs CUDA workers (fp16 loss scaling runs under CUDA autocast "
                             "only); use fp32 or bf16 on CPU" + (", also with quant.load_in_4bit" if
                                                                 cfg.quant.load_in_4bit else ""))
    if cfg.quant.load_in_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise PreflightError("quant.load_in_4bit=true needs bitsandbytes: pip install bitsandbytes")
        if m.compile:
            check_4bit_compiles(importlib.metadata.version("bitsandbytes"))
    return use_gpu, gpus


def check_4bit_compiles(bnb_version: str) -> None:
    """quant.load_in_4bit with model.compile needs a bitsandbytes whose 4-bit ops torch.compile traces (torch.library
    custom ops): the version measured, or newer."""
    have = tuple(int(p) for p in re.findall(r"\d+", bnb_version)[:2])
    if have < BNB_COMPILES:
        raise PreflightError(f"quant.load_in_4bit=true with model.compile=true needs bitsandbytes >= "
                             f"{'.'.join(map(str, BNB_COMPILES))} (its 4-bit layers compile; measured with 0.50.2), "
                             f"found {bnb_version}: pip install -U bitsandbytes, or turn one off")


def _check_model(cfg: Config, *, use_gpu: bool, gpus: int):
    """The model exists, takes the block size, has the LoRA targets, and supports the chosen fast paths; returns
    (where it comes from, its tokenizer, its transformers config)."""
    m = cfg.model
    with as_preflight(ModelError):
        where = check_model_source(m.name, m.gguf_file)
        tok = load_tokenizer(m.name, m.gguf_file, m.tokenizer, m.cache_dir)
        hf_config = model_config(m.name, gguf_file=m.gguf_file, vocab_size=len(tok), cache_dir=m.cache_dir,
                                 trust_remote_code=m.trust_remote_code)
        if m.fuse_lora:
            check_fusable_config(hf_config)
        if m.head_fp8:
            check_fp8_head_config(hf_config)
        # a remote cluster's GPUs, and the GEMM probe on any GPU: each worker checks its own as it converts
        fp8_keys = [f"model.{k}" for k in ("base_fp8", "head_fp8") if getattr(m, k)]
        if fp8_keys and (gpus or not use_gpu):  # one device, one check: the first key set names it
            check_fp8_device(torch.device("cuda" if use_gpu else "cpu"), probe=not use_gpu, key=fp8_keys[0])
    positions = max_positions(hf_config)
    if positions and cfg.data.block_size > positions:
        raise PreflightError(f"data.block_size={cfg.data.block_size} is beyond the model's {positions} positions "
                             f"(max_position_embeddings of {m.name})")
    skeleton = _skeleton(hf_config, m.trust_remote_code)
    missing = missing_targets(skeleton, cfg.lora.target_modules)[0] if skeleton is not None else []
    if missing:
        raise PreflightError(f"lora.target_modules: {missing} not found in {m.name}")
    if cfg.quant.offload_embedding and ties_embeddings(hf_config):
        raise PreflightError(TIED_OFFLOAD)
    hit = embedding_targets(skeleton, cfg.lora.target_modules) if skeleton is not None else []
    if hit and (cfg.quant.offload_embedding or cfg.quant.embedding_int8):
        raise PreflightError(EMBEDDING_TARGETS.format(hit=hit))
    unmatched, names = (unmatched_exclude(skeleton, m.fp8_exclude, cfg.lora.target_modules) if skeleton is not None
                        else ([], []))
    if unmatched:
        raise PreflightError(f"model.fp8_exclude: {unmatched} match none of the projections LoRA adapts in {m.name} "
                             f"(names like {', '.join(names)}); correct or drop them")
    head = (embedding_targets_of(skeleton, cfg.lora.target_modules, head_only=True)
            if skeleton is not None and m.head_fp8 else [])
    if head:
        raise PreflightError(f"model.head_fp8=true: lora.target_modules {head} puts LoRA on the LM head, whose frozen "
                             f"product the FP8 head replaces; drop it from the targets or set model.head_fp8=false")
    return where, tok, hf_config


def resume_point(cfg: Config, *, use_gpu: bool) -> tuple[Optional[Path], Optional[dict]]:
    """Re-running a run name resumes it: its newest good checkpoint (local storage) and that one's meta, checked
    against this config's structure on GPU workers or not (``use_gpu``); (None, None) with none."""
    run_path = RunPaths.of(cfg).local
    if run_path is None:
        return None, None
    with as_preflight(CheckpointError):
        good, problems = newest_good_local(run_path)
        resume_meta = read_meta(good) if good is not None else None
        if resume_meta is not None:
            check_structure(resume_meta, structure_of(cfg, use_gpu=use_gpu))
            check_sharding(good, sharded=cfg.scaling.strategy == "fsdp")
    if problems:
        print(f"[raytrain_scu] warning: bad checkpoint(s) in {run_path}: {'; '.join(problems)}; "
              + (f"resuming from {good.name}" if good is not None
                 else "each a copy cut short that the run never registered: starting afresh"),
              file=sys.stderr, flush=True)
    return good, resume_meta


def preflight(cfg: Config, *, inputs_checked: bool = False) -> dict:
    """Every check that needs I/O, before Ray starts, the storage path's and the data source's cheap ones first
    (:func:`~raytrain_scu.driver.early.check_inputs`; skipped when the caller ran them already: ``inputs_checked``).
    Returns derived facts: where the model comes from, use_gpu, tokens_per_epoch (the one the run uses) and where it
    comes from (config, measured or estimated), the split sizes, visible GPUs, the checkpoint a re-run resumes from
    and the vocabulary size."""
    d = cfg.data
    if not inputs_checked:
        check_inputs(cfg)
    use_gpu, gpus = check_machine(cfg)
    where, tok, hf_config = _check_model(cfg, use_gpu=use_gpu, gpus=gpus)
    good, resume_meta = resume_point(cfg, use_gpu=use_gpu)
    with as_preflight(DataError):
        source = resolve_source(d.source, d.path)
        fmt = resolve_format(source, d.path, d.format, d.text_field)
        examples = fmt != "text"
        if use_streaming(source=source, fmt=fmt, streaming=d.streaming, max_documents=d.max_documents,
                         files=source_files(source, d.path)):
            scan_source(source, d.path, d.text_field)  # all of it, in bounded memory: no worker reads it whole first
    if examples and d.packing:  # before the tokenization: the model alone decides it
        with as_preflight(ModelError):
            check_packing(hf_config, cfg.model.name, gpu=use_gpu)
    with as_preflight(DataError):
        data = prepare_data(tok, **data_options(cfg))
    if resume_meta is not None:  # the data must give the checkpoint's tokens_per_epoch (the loop checks it too)
        with as_preflight(CheckpointError):
            check_tokens_per_epoch(resume_meta, measured=data.tokens_per_epoch,
                                   override=cfg.controller.tokens_per_epoch, streamed=data.streamed, plan=data.plan)
    data.close()  # the driver reads no batch: a streamed source's loader threads are never needed here
    unit = "rows" if examples else "blocks"
    global_batch = sequences_per_step(cfg)
    if len(data.train) < global_batch:
        tokens = data.meta["n_train_tokens"] if unit == "blocks" and not data.streamed else None
        fits = fitting_overrides(len(data.train), cfg, tokens=tokens)
        more = ("lower data.shard_bytes (the validation split is one shard, held out whole) or add data"
                if data.streamed else "lower data.val_fraction or add data")
        fix = f"{' or '.join(fits)} fits, or {more}" if fits else more
        hint = max_documents_hint(d.max_documents, data.meta.get("n_train_docs", 0) + data.meta.get("n_val_docs", 0),
                                  d.source)
        fix = f"{hint}; or {fix}" if hint else fix  # the likeliest cause, said first
        raise PreflightError(f"the training split has {len(data.train)} {unit} of {d.block_size} tokens, fewer than "
                             f"one global batch ({global_batch} = data.batch_size {d.batch_size} x data.grad_accum "
                             f"{d.grad_accum} x scaling.num_workers {cfg.scaling.num_workers}): " + fix)
    return {"model": where, "use_gpu": use_gpu,
            "tokens_per_epoch": cfg.controller.tokens_per_epoch or data.tokens_per_epoch,
            "tokens_per_epoch_from": tokens_per_epoch_from(cfg.controller.tokens_per_epoch, data),
            "train_blocks": len(data.train), "val_blocks": len(data.val), "gpus": gpus, "resume_from": good,
            "vocab_size": len(tok), "unit": unit, "examples": sft.summary(data.meta) if examples else ""}


def fitting_overrides(rows: int, cfg: Config, *, tokens: Optional[int] = None) -> list[str]:
    """The overrides, one key each with the rest as configured, under which a training split of ``rows`` rows (or
    blocks) holds one global batch: the largest data.batch_size, data.grad_accum or scaling.num_workers below the
    configured one that fits, and with ``tokens`` (the training split's tokens, text read whole) the largest
    data.block_size whose blocks are enough (from ``MIN_BLOCK_SUGGESTED``)."""
    d, workers = cfg.data, cfg.scaling.num_workers
    out = []
    for key, have, per_unit in (("data.batch_size", d.batch_size, d.grad_accum * workers),
                                ("data.grad_accum", d.grad_accum, d.batch_size * workers),
                                ("scaling.num_workers", workers, d.batch_size * d.grad_accum)):
        fits = rows // per_unit
        if 1 <= fits < have:
            out.append(f"{key}={fits}")
    if tokens:
        block = tokens // sequences_per_step(cfg) - 1  # a block holds block_size + 1 tokens: inputs and targets
        if MIN_BLOCK_SUGGESTED <= block < d.block_size:
            out.append(f"data.block_size={block}")
    return out
