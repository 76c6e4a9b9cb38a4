"""``python -m raytrain_scu.train CONFIG.yaml key=value...``: validate, then run the per-worker loop on Ray Train.

Connects to a running cluster when ``RAY_ADDRESS`` is set (so ``ray job submit`` works), else starts a local one.
Re-running the same ``run.name`` with the same ``run.storage_path`` resumes from its latest good checkpoint.
A re-run whose config changed (a larger ``train.max_steps`` extends the run) prints the changed keys and records
them in MLflow as a config revision: the run's params keep their first values.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Optional

from raytrain_scu.config import Config, ConfigError, redact_uri, run_dir, sequences_per_step, to_yaml
from raytrain_scu.console import format_summary
from raytrain_scu.hardware import MemoryFitError, resolve


class PreflightError(ValueError):
    """A problem found before any Ray worker starts."""


# bad input found before launch: the CLIs print "error: ..." and exit 2
USER_ERRORS = (ConfigError, PreflightError, MemoryFitError)

def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def _local_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _skeleton(hf_config, trust_remote_code: bool):
    """The model as a weightless (meta-device) skeleton, for checks by module name; None if it cannot be built here
    (the workers check again while building the real model)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001
        return None


def _check_machine(cfg: Config) -> tuple[bool, int]:
    """Storage writable, GPUs and CPUs enough for a local Ray, precision and 4-bit supported; returns (use_gpu,
    visible GPUs)."""
    m, s = cfg.model, cfg.scaling
    local_ray = not os.environ.get("RAY_ADDRESS") and not ("ray" in sys.modules and sys.modules["ray"].is_initialized())
    # storage must be writable (local paths; remote URIs are checked by Ray)
    if "://" not in cfg.run.storage_path:
        p = Path(os.path.expanduser(cfg.run.storage_path))
        try:
            p.mkdir(parents=True, exist_ok=True)
            probe = p / f".write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise PreflightError(f"run.storage_path={cfg.run.storage_path}: not writable ({e.strerror})") from None
    # GPUs: asked for but absent, or more workers than GPUs on a local machine
    gpus = _gpu_count()
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
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise PreflightError("quant.load_in_4bit=true needs bitsandbytes: pip install bitsandbytes")
        if m.compile:
            raise PreflightError("quant.load_in_4bit=true with model.compile=true is not supported "
                                 "(bitsandbytes 4-bit layers do not compile); turn one off")
    return use_gpu, gpus


def _resume_point(cfg: Config) -> tuple[Optional[Path], Optional[dict]]:
    """Re-running a run name resumes it: its newest good checkpoint (local storage) and that one's meta, checked
    against this config's structure; (None, None) with none."""
    from raytrain_scu.checkpoint import CheckpointError, check_structure, newest_good_local, read_meta
    from raytrain_scu.model import structure_of

    good, resume_meta = None, None
    if "://" not in cfg.run.storage_path:  # (a Path of "s3://b" would read "s3:/b")
        run_path = Path(run_dir(cfg))
        try:
            good, problems = newest_good_local(run_path)
            if good is not None:
                resume_meta = read_meta(good)
                check_structure(resume_meta, structure_of(cfg))
        except CheckpointError as e:
            raise PreflightError(str(e)) from None
        if problems:
            print(f"[raytrain_scu] warning: bad checkpoint(s) in {run_path}: {'; '.join(problems)}; "
                  f"resuming from {good.name}", file=sys.stderr, flush=True)
    return good, resume_meta


def preflight(cfg: Config) -> dict:
    """Checks that need I/O, run on the driver before Ray starts. Returns derived facts (tokens_per_epoch, ...).

    Every problem found here is a PreflightError naming the key at fault; no Ray worker has started.
    """
    from raytrain_scu.checkpoint import CheckpointError, check_tokens_per_epoch
    from raytrain_scu.data import DataError, check_source, prepare_data
    from raytrain_scu.model import (ModelError, check_model_source, load_tokenizer, max_positions, missing_targets,
                                    model_config)

    m, d, s = cfg.model, cfg.data, cfg.scaling
    use_gpu, gpus = _check_machine(cfg)
    try:
        where = check_model_source(m.name, m.gguf_file)
        tok = load_tokenizer(m.name, m.gguf_file, m.tokenizer, m.cache_dir)
        hf_config = model_config(m.name, gguf_file=m.gguf_file, vocab_size=len(tok), cache_dir=m.cache_dir,
                                 trust_remote_code=m.trust_remote_code)
    except ModelError as e:
        raise PreflightError(str(e)) from None
    positions = max_positions(hf_config)
    if positions and d.block_size > positions:
        raise PreflightError(f"data.block_size={d.block_size} is beyond the model's {positions} positions "
                             f"(max_position_embeddings of {m.name})")
    skeleton = _skeleton(hf_config, m.trust_remote_code)
    missing = missing_targets(skeleton, cfg.lora.target_modules)[0] if skeleton is not None else []
    if missing:
        raise PreflightError(f"lora.target_modules: {missing} not found in {m.name}")
    if m.fuse_lora:
        from raytrain_scu.fused_lora import check_fusable_config

        try:
            check_fusable_config(hf_config)
        except ModelError as e:
            raise PreflightError(str(e)) from None
    if cfg.quant.offload_embedding or cfg.quant.embedding_int8:
        from raytrain_scu.embed_quant import EMBEDDING_TARGETS, TIED_OFFLOAD, embedding_targets, ties_embeddings

        if cfg.quant.offload_embedding and ties_embeddings(hf_config):
            raise PreflightError(TIED_OFFLOAD)
        hit = embedding_targets(skeleton, cfg.lora.target_modules) if skeleton is not None else []
        if hit:
            raise PreflightError(EMBEDDING_TARGETS.format(hit=hit))
    # a remote cluster's GPUs, and the GEMM probe on any GPU: each worker checks its own as it converts
    if m.base_fp8 and (gpus or not use_gpu):
        import torch

        from raytrain_scu.fp8 import check_fp8_device

        try:
            check_fp8_device(torch.device("cuda" if use_gpu else "cpu"), probe=not use_gpu)
        except ModelError as e:
            raise PreflightError(str(e)) from None
    # re-running a run name resumes it: its newest good checkpoint must fit this config (local storage)
    good, resume_meta = _resume_point(cfg)
    try:
        check_source(d.source, d.path, d.text_field)
        data = prepare_data(tok, source=d.source, path=d.path, text_field=d.text_field,
                            max_documents=d.max_documents, block_size=d.block_size, val_fraction=d.val_fraction,
                            seed=cfg.seed, cache_dir=d.cache_dir)
    except DataError as e:
        raise PreflightError(str(e)) from None
    if resume_meta is not None:  # and the data must give the checkpoint's tokens_per_epoch (the loop checks it too)
        try:
            check_tokens_per_epoch(resume_meta, measured=data.tokens_per_epoch,
                                   override=cfg.controller.tokens_per_epoch)
        except CheckpointError as e:
            raise PreflightError(str(e)) from None
    global_batch = sequences_per_step(cfg)
    if len(data.train) < global_batch:
        raise PreflightError(f"the training split has {len(data.train)} blocks of {d.block_size} tokens, fewer than "
                             f"one global batch ({global_batch} = batch_size x grad_accum x num_workers)")
    return {"model": where, "use_gpu": use_gpu, "tokens_per_epoch": data.tokens_per_epoch,
            "train_blocks": len(data.train), "val_blocks": len(data.val), "gpus": gpus, "resume_from": good,
            "vocab_size": len(tok)}


def output_dir(cfg: Config) -> Path:
    """Where the adapter, config.yaml and summary.json go: ``run.output_dir``, else ``<run dir>/output``."""
    if cfg.run.output_dir:
        return Path(os.path.expanduser(cfg.run.output_dir))
    return Path(run_dir(cfg)) / "output"


def export_adapter(checkpoint, dest: Path) -> Path:
    """Copy the adapter of a Ray checkpoint to ``dest`` (loadable by ``PeftModel.from_pretrained``)."""
    with checkpoint.as_directory() as d:
        src = Path(d) / "adapter"
        if not src.is_dir():
            raise FileNotFoundError(f"checkpoint {checkpoint.path} has no adapter/")
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    return dest


def best_checkpoint(best_checkpoints) -> Optional[tuple]:
    """The ``(checkpoint, metrics)`` of ``Result.best_checkpoints`` with the lowest finite ``val/data_bpt`` (the
    latest step on a tie); None when none has one. Ray keeps that list sorted by score, worst first, so its first
    entry is the worst of the kept top-k: never pick by position."""
    from raytrain_scu.checkpoint import BEST_METRIC

    scored = [(m[BEST_METRIC], -int(m.get("step", 0)), i) for i, (_, m) in enumerate(best_checkpoints or [])
              if isinstance(m.get(BEST_METRIC), (int, float)) and math.isfinite(m[BEST_METRIC])]
    return best_checkpoints[min(scored)[2]] if scored else None


def record_config_change(cfg: Config, run_id: Optional[str], resume_from: Optional[Path], notes: list) -> dict:
    """A re-run of a run name under a changed config (``train.max_steps`` raised to extend it, ...): print the changed
    keys and record them as the MLflow run's next config revision (its params keep their first values: MLflow never
    changes a param). The previous config is the MLflow run's latest revision; with no MLflow run, the config.yaml of
    ``resume_from``, the checkpoint the run resumes from. Returns ``{key: (old, new)}``."""
    import yaml

    from raytrain_scu import tracking
    from raytrain_scu.checkpoint import read_meta
    from raytrain_scu.config import flatten, flatten_tree, redact_uri

    rev, previous = 0, None
    if run_id:
        try:
            rev, previous = tracking.recorded_config(cfg, run_id)
        except Exception as e:  # noqa: BLE001 - tracking never kills training
            notes.append(f"config changes not checked: MLflow run {run_id} unreadable ({type(e).__name__}: "
                         f"{redact_uri(str(e))[:200]})")
            print(f"[raytrain_scu] warning: {notes[-1]}", file=sys.stderr, flush=True)
            return {}
    elif resume_from is not None:
        previous = flatten_tree(yaml.safe_load((resume_from / "config.yaml").read_text()))
    changes = tracking.config_changes(previous, flatten(cfg)) if previous else {}
    if not changes:
        return {}
    from_step = read_meta(resume_from)["step"] if resume_from is not None else None
    if run_id:
        try:
            tracking.record_config_revision(cfg, run_id, rev + 1, changes, from_step)
            where = f"config revision {rev + 1} recorded in MLflow run {run_id}; its params keep the first values"
        except Exception as e:  # noqa: BLE001
            where = f"NOT recorded in MLflow: {type(e).__name__}: {redact_uri(str(e))[:200]}"
            notes.append(f"config revision {rev + 1} {where}")
    else:
        where = "not recorded: " + ("tracking.enabled=false" if not cfg.tracking.enabled else "MLflow unreachable")
    old_steps, new_steps = changes.get("train.max_steps", ("0", "0"))
    what = "extended" if int(new_steps) > int(old_steps) else "resumed with a changed config"
    print(f"[raytrain_scu] run {cfg.run.name} {what}: {tracking.format_changes(changes)}"
          + (f" (from step {from_step})" if from_step is not None else "") + f"; {where}", flush=True)
    return changes


def run(cfg: Config, *, quiet: bool = False, verbose: bool = False) -> dict:
    """Validate, train, export. Returns a summary dict (also printed unless ``quiet``).

    The one owner of the run's MLflow run: opens it before launch (or finds it again on a re-run) and ends it,
    FINISHED after the summary, FAILED when training or the summary fails, KILLED on Ctrl-C (``launch.fit``); the
    workers only log into it. ``verbose``: Ray's and the workers' output on the console too."""
    from raytrain_scu import launch, tracking
    from raytrain_scu.console import Progress

    finished = finished_summary(cfg)
    if finished is not None:  # before any check that loads the model or data, and before Ray
        if not quiet:
            print(f"[raytrain_scu] run {cfg.run.name} already finished at step {finished['steps']} "
                  f"(raise train.max_steps to extend it)", flush=True)
            print(format_summary(finished, title="finished earlier"), flush=True)
        return finished
    facts = preflight(cfg)
    run_id, notes = None, []
    if cfg.tracking.enabled:
        try:
            run_id = tracking.open_run(cfg)
            tracking.remember_run_id(cfg, run_id)
        except Exception as e:  # noqa: BLE001 - tracking never kills training; rank 0 retries
            notes.append(f"MLflow unreachable at start ({type(e).__name__}); rank 0 will retry")
            print(f"[raytrain_scu] warning: {notes[-1]}", file=sys.stderr)
    status, ray_logs = "FAILED", None
    try:
        changes = record_config_change(cfg, run_id, facts["resume_from"], notes)
        if facts["resume_from"] is not None:  # the workers say it too, in their log files
            print(f"[raytrain_scu] resuming from {facts['resume_from'].name}", flush=True)
        launch.init_ray(cfg, verbose=verbose)
        # the cluster the run joined (RAY_ADDRESS, or a Ray already up), which preflight could not see: refused
        # before any worker starts, rather than waited for forever
        launch.check_capacity(cfg, use_gpu=facts["use_gpu"])
        print(f"[raytrain_scu] run {cfg.run.name}: {facts['model']}, {cfg.scaling.num_workers} worker(s) "
              f"({'GPU' if facts['use_gpu'] else 'CPU'}), {facts['train_blocks']} train / {facts['val_blocks']} val "
              f"blocks, tokens_per_epoch={facts['tokens_per_epoch']}", flush=True)
        ray_logs = launch.logs_dir()
        if not verbose:
            print(f"[raytrain_scu] Ray's and the workers' logs: {ray_logs} (--verbose shows them here)", flush=True)
        sink = launch.Sink()
        trainer = launch.build_trainer(cfg, use_gpu=facts["use_gpu"], run_id=run_id, callbacks=[sink])
        result = launch.fit(trainer, cfg, sink, Progress(target_s=cfg.controller.target_s))  # raises on failure
        summary = summarize(cfg, result, run_id, changes, notes, facts)
        status = "FINISHED"
    except (KeyboardInterrupt, launch.Interrupted):
        status = "KILLED"
        raise
    finally:
        kept = launch.keep_logs(cfg, ray_logs)
        if kept is not None:
            print(f"[raytrain_scu] worker logs: {kept}", flush=True)
        if run_id:
            tracking.end_run(cfg, run_id, status)
    if not quiet:
        print(format_summary(summary), flush=True)
    return summary


def finished_summary(cfg: Config) -> Optional[dict]:
    """The summary of this run name when it already reached train.max_steps with this very config (local storage): its
    output/summary.json, if output/config.yaml is this config and the newest checkpoint on disk is that step. None
    otherwise: a new run, an unfinished one, an extension, or a changed config (which preflight then checks)."""
    from raytrain_scu.checkpoint import CheckpointError, newest_good_local, read_meta

    path = output_dir(cfg) / "summary.json"
    if "://" in cfg.run.storage_path or not path.is_file():
        return None
    saved = output_dir(cfg) / "config.yaml"
    if not saved.is_file() or saved.read_text() != to_yaml(cfg, redact=True):
        return None
    try:
        summary = json.loads(path.read_text())
        newest, _ = newest_good_local(Path(run_dir(cfg)))
    except (ValueError, CheckpointError):
        return None  # unreadable: preflight says what is wrong
    steps = summary.get("steps")
    if newest is None or steps is None or read_meta(newest)["step"] != steps or steps < cfg.train.max_steps:
        return None
    return summary


def summarize(cfg: Config, result, run_id: Optional[str], changes: dict, notes: list, facts: dict) -> dict:
    """After fit(): export the adapter, log the best checkpoint, write config.yaml, summary.json and base_model.json
    (what rebuilds the base model: generate) to the output directory; returns the summary."""
    from raytrain_scu import tracking
    from raytrain_scu.checkpoint import BEST_METRIC
    from raytrain_scu.generate import BASE_RECIPE, base_recipe

    out = output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    last = result.metrics or {}
    summary = {"run": cfg.run.name, "steps": last.get("step"), "val_bpt_start": last.get("val/data_bpt_start"),
               "val_bpt": last.get("val/data_bpt"),
               "lambda": last.get("ctrl/lambda"), "s": last.get("ctrl/s"), "s_hat": last.get("ctrl/s_hat"),
               "tokens_per_s": last.get("perf/tokens_per_s"), "run_dir": result.path, "mlflow_run_id": run_id,
               "config_changes": changes or None, "notes": notes}
    if cfg.tracking.enabled:
        uri, ui = redact_uri(tracking.tracking_uri(cfg)), tracking.ui_command(cfg)
        summary["tracking_uri"] = f"{uri} (experiment {cfg.tracking.experiment})"
        if ui is not None:
            needs = importlib.util.find_spec("flask") is None  # mlflow-skinny alone has no UI server
            summary["ui_command"] = ui + ("   (needs the ui extra: pip install 'raytrain_scu[ui]')" if needs
                                          else "   (or: make ui CONFIG=<this config>)")
    if result.checkpoint is not None:
        summary["adapter"] = str(export_adapter(result.checkpoint, out / "adapter"))
    best = best_checkpoint(result.best_checkpoints)
    if best is None and result.best_checkpoints:
        notes.append(f"no checkpoint has a finite {BEST_METRIC}: no best checkpoint")
    if best is not None:
        summary["best_step"], summary["best_val_bpt"] = best[1].get("step"), best[1][BEST_METRIC]
        if run_id and cfg.tracking.log_best_checkpoint:
            with best[0].as_directory() as d:
                warn = tracking.log_best_checkpoint(cfg, run_id, d, step=summary["best_step"],
                                                    val_bpt=summary["best_val_bpt"])
            if warn:
                notes.append(warn)
    (out / "config.yaml").write_text(to_yaml(cfg, redact=True))
    (out / BASE_RECIPE).write_text(json.dumps(base_recipe(cfg, use_gpu=facts["use_gpu"],
                                                          vocab_size=facts["vocab_size"]), indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


USAGE = "usage: python -m raytrain_scu.train [--verbose] CONFIG.yaml [key=value ...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    resume_cmd = shlex.join(["python", "-m", "raytrain_scu.train", *argv])
    verbose = "--verbose" in argv  # Ray's and the workers' logs on the console, as well as in their files
    argv = [a for a in argv if a != "--verbose"]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        if argv:  # --help: every key, its default and meaning, generated from config.py's tree
            from raytrain_scu.config import help_text

            print("\n" + help_text())
        return 0 if argv else 2
    try:
        cfg = resolve(argv[0], argv[1:])  # presets, memory fit and checks, once
        run(cfg, verbose=verbose)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:  # noqa: BLE001 - a failed run: its root cause in one line, not Ray's wrapping
        from raytrain_scu.launch import Interrupted, failure_notices, root_cause

        if isinstance(e, (Interrupted, KeyboardInterrupt)):  # Ctrl-C: the MLflow run is KILLED, exit 130
            step = getattr(e, "step", None)
            done = ", checkpoint written" if getattr(e, "checkpointed", False) else ", no checkpoint of it"
            print("[raytrain_scu] interrupted" + (f" at step {step}{done}" if step is not None else "")
                  + f"; resume: {resume_cmd}", flush=True)
            return 130
        cause = root_cause(e)
        if cause is None:
            raise
        for text in failure_notices(e):  # what rank 0 said that no report carried: the failure's context
            print(f"[raytrain_scu] {text}", flush=True)
        print(f"error: {cause}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
