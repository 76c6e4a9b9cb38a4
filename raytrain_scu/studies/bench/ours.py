"""Our loop as bench parts: its config (:func:`bench_config`), run bare in this process (:func:`ours_bare`) or on
Ray Train with N workers (:func:`ours_ray`), its tokens/s the median over timed reports after warm-up."""
from __future__ import annotations

import statistics

import torch

from raytrain_scu.config.schema import ALL_LINEAR as PROJ
from raytrain_scu.driver.resolve import resolve
from raytrain_scu.hardware.gpus import measured_memory_gib
from raytrain_scu.studies.bench.measure import free, proof_of_training, reset_mem
from raytrain_scu.worker.hooks import LocalHooks
from raytrain_scu.worker.loop import run_loop


def proof_from_reports(reports: list[dict]) -> dict:
    """The loop's own evidence: val BPT before training (step 0) and at the last step, and the final LoRA B norm."""
    last = reports[-1]
    return proof_of_training(last.get("val/data_bpt_start", float("nan")), last.get("val/data_bpt", float("nan")),
                             last.get("train/lora_b_norm", 0.0))


def bench_config(*, preset: str, batch: int, block: int, steps: int, report_every: int, storage: str, name: str,
                 compile: bool, mode: str = "scu", load_in_4bit: bool = False, checkpointing: bool = False, chunk=4096,
                 workers: int = 1, compile_scope: str = "layers", targets=tuple(PROJ), fuse_lora: bool = False,
                 base_fp8: bool = False, profile_steps: int = 0, profile_host: bool = True,
                 embedding_int8: bool = False, offload_embedding: bool = False,
                 recompute_elementwise: str = "auto", head_fp8: bool = False,
                 compile_mode: str = "default", offload_activations: bool = False, dequant_4bit: str = "auto",
                 offload_activations_gib: float = 0.0, data_path: str = "", packing: bool = True):
    """Our loop's config for a part; with ``data_path``, prompt/completion examples from that jsonl file (packed
    with ``packing``, else one a row, padded) in place of the Shakespeare text blocks."""
    gpu = torch.cuda.is_available()
    return resolve(None, [
        f"model.name={preset}", f"model.precision={'bf16' if gpu else 'fp32'}", f"model.compile={str(compile).lower()}",
        f"model.compile_scope={compile_scope}", f"model.compile_mode={compile_mode}",
        f"model.fuse_lora={str(fuse_lora).lower()}", f"model.head_fp8={str(head_fp8).lower()}",
        f"model.recompute_elementwise={recompute_elementwise}",
        f"model.base_fp8={str(base_fp8).lower()}", f"model.gradient_checkpointing={str(checkpointing).lower()}",
        f"model.offload_activations={str(offload_activations).lower()}",
        f"model.offload_activations_gib={offload_activations_gib}",
        # the FP8 GEMMs are the same whichever codes fill them: nearest skips GPTQ's calibration (minutes at 8B)
        "model.fp8_rounding=nearest",
        f"model.loss_chunk_size={chunk}", f"quant.load_in_4bit={str(load_in_4bit).lower()}", "lora.r=16",
        f"quant.embedding_int8={str(embedding_int8).lower()}", f"quant.dequant_4bit={dequant_4bit}",
        f"quant.offload_embedding={str(offload_embedding).lower()}",
        "lora.alpha=32", f"lora.target_modules={','.join(targets)}",
        *(["data.source=jsonl", f"data.path={data_path}", "data.format=prompt_completion",
           f"data.packing={str(packing).lower()}"] if data_path else ["data.source=shakespeare"]),
        f"data.block_size={block}", f"data.batch_size={batch}", "data.grad_accum=1", "data.val_fraction=0.05",
        f"train.max_steps={steps}", f"train.report_every={report_every}", f"train.checkpoint_every={steps}",
        f"train.eval_every={steps}", f"train.eval_blocks={batch * workers}", f"controller.mode={mode}",
        f"scaling.num_workers={workers}", f"scaling.use_gpu={str(gpu).lower()}", f"run.storage_path={storage}",
        f"run.name={name}", "tracking.enabled=false", "optim.warmup_steps=2", f"train.profile_steps={profile_steps}",
        f"train.profile_host={str(profile_host).lower()}"])


def _median_rate(reports: list[dict], warmup_reports: int, key: str = "perf/tokens_per_s") -> float:
    rates = [r[key] for r in reports if key in r]
    timed = rates[warmup_reports:] or rates[-1:]
    return statistics.median(timed)


def _rates(reports: list[dict]) -> list[float]:
    return [round(r["perf/tokens_per_s"]) for r in reports if "perf/tokens_per_s" in r]


def _reserved(reports: list[dict]) -> dict:
    """The allocator's peak reserved memory (the allocated peak plus its cache of free blocks)."""
    return {"peak_reserved_gib": max(r.get("perf/max_reserved_gib", 0.0) for r in reports)}


def ours_bare(cfg, warmup_reports: int) -> dict:
    """The loop in this process (``train.profile_steps`` writes its profile under the run directory); with what the
    built model held on the GPU before its first step, by kind (``hardware.measured_memory_gib``)."""
    class Measuring(LocalHooks):
        def prepare_model(self, model, move_to_device: bool):
            model = super().prepare_model(model, move_to_device)
            self.built = measured_memory_gib(getattr(model, "_orig_mod", model).model)
            return model

    hooks = Measuring()
    reset_mem()
    run_loop(cfg, hooks=hooks)
    out = {"tokens_per_s": _median_rate(hooks.reports, warmup_reports), "built_mem_gib": hooks.built,
           "peak_mem_gib": max(r.get("perf/max_mem_gib", 0.0) for r in hooks.reports), "batch": cfg.data.batch_size,
           "rates": _rates(hooks.reports), **_reserved(hooks.reports),
           **proof_from_reports(hooks.reports)}
    if cfg.data.format == "prompt_completion":  # examples: their answers are the target tokens
        out["target_tokens_per_s"] = _median_rate(hooks.reports, warmup_reports, "perf/target_tokens_per_s")
        out["packing"] = cfg.data.packing
    free()
    return out


def ours_ray(cfg, warmup_reports: int) -> dict:
    """The loop on Ray Train (``launch.fit_and_collect``); tokens/s per worker from rank 0's reports."""
    from raytrain_scu.ray.launch import fit_and_collect  # only the Ray parts need Ray installed

    reports = fit_and_collect(cfg, use_gpu=torch.cuda.is_available())
    world = cfg.scaling.num_workers
    return {"tokens_per_s": _median_rate(reports, warmup_reports) / world,
            "peak_mem_gib": max(r.get("perf/max_mem_gib", 0.0) for r in reports), "batch": cfg.data.batch_size,
            "workers": world, "rates": _rates(reports), **_reserved(reports),
            **proof_from_reports(reports)}
