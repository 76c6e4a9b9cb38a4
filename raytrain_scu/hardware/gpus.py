"""The cards this process sees (NVML), each card's dense bf16 peak, MFU, and what a built model holds on the GPU."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

GIB = 2**30


@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA card as NVML reports it."""
    name: str
    memory_gib: float
    compute_capability: tuple[int, int] = (0, 0)
    index: int = 0
    uuid: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""  # the newest CUDA the driver supports, e.g. "12.8"

    @property
    def bf16(self) -> bool:
        """bf16 tensor cores: Ampere (8.0) and newer."""
        return self.compute_capability >= (8, 0)

    @property
    def tf32(self) -> bool:
        """TF32 matmuls: Ampere (8.0) and newer."""
        return self.compute_capability >= (8, 0)

    def to_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "memory_gib": round(self.memory_gib, 1),
                "compute_capability": f"{self.compute_capability[0]}.{self.compute_capability[1]}",
                "bf16": self.bf16, "tf32": self.tf32, "uuid": self.uuid,
                "driver_version": self.driver_version, "cuda_driver_version": self.cuda_driver_version}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible(gpus: list[GpuInfo]) -> list[GpuInfo]:
    """Apply CUDA_VISIBLE_DEVICES (indices or UUIDs): NVML itself ignores it, torch and Ray workers don't."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return gpus
    wanted = [s.strip() for s in env.split(",") if s.strip()]
    return [g for g in gpus if str(g.index) in wanted or g.uuid in wanted]


def detect_gpus() -> list[GpuInfo]:
    """The NVIDIA GPUs visible to this process, through NVML. ``[]`` where there is no NVML library,
    no driver or no card: never raises for "no GPU"."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()  # e.g. 12080 -> "12.8"
        cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(GpuInfo(
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                memory_gib=pynvml.nvmlDeviceGetMemoryInfo(handle).total / GIB,
                compute_capability=(int(major), int(minor)),
                index=i,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                driver_version=driver,
                cuda_driver_version=cuda_version,
            ))
    except pynvml.NVMLError:
        # a driver that answers init but not queries (e.g. a GPU fallen off the bus) counts as no GPU here;
        # `python -m raytrain_scu.check` is where a half-working driver shows up
        return []
    finally:
        pynvml.nvmlShutdown()
    return _visible(gpus)


# dense (no sparsity) bf16 tensor-core peak per card, matched by name in this order; the bench and the loop's
# perf/mfu both divide by it (docs/benchmarks.md)
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12,
                   "3090": 71e12, "A10": 125e12, "T4": 65e12}


# dense FP8 (e4m3) tensor-core peak of the cards that have FP8 GEMMs: what an FP8 run's own MFU divides by
PEAK_FP8_FLOPS = {"H100": 1979e12, "H200": 1979e12, "L40S": 733e12, "4090": 330e12}


def peak_fp8_flops(device_name: str) -> float:
    """Dense FP8 peak FLOP/s of a card, from its name (0 when unknown or without FP8 GEMMs)."""
    for key, flops in PEAK_FP8_FLOPS.items():
        if key in device_name:
            return flops
    return 0.0


def peak_flops(device_name: str) -> float:
    """Dense bf16 peak FLOP/s of a card, from its name (0 when unknown, e.g. a CPU)."""
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return 0.0


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak: float) -> Optional[float]:
    """Model FLOPs utilisation: tokens/s per GPU x training FLOPs per token / the card's peak FLOP/s
    (``model.flops_per_token``, :func:`peak_flops`). None when the peak is unknown (0): never a made-up 0."""
    return tokens_per_s_per_gpu * flops_per_token / peak if peak > 0 else None


def measured_memory_gib(model) -> dict:
    """What a built (peft) model holds, in GiB: the input embedding and a separate LM head (buffers too: int8 tables),
    an offloaded embedding (CPU), the adapters, every other parameter (the frozen linears, norms, FP8 copies) and all
    that is allocated on its GPU then (the 4-bit constants too). The estimator's counterpart, measured."""
    import torch

    def gib(tensors) -> float:
        return round(sum(t.numel() * t.element_size() for t in tensors) / 2**30, 6)

    def held(module) -> dict:  # frozen, by identity (a tied table is one set); LoRA on it counts as adapters
        return {} if module is None else {id(t): t for t in [*module.parameters(), *module.buffers()]
                                          if not t.requires_grad}

    emb_mod, head_mod = model.get_input_embeddings(), model.get_output_embeddings()
    emb, head = held(emb_mod), {k: t for k, t in held(head_mod).items() if k not in held(emb_mod)}
    offloaded = getattr(emb_mod, "inner", None)
    device = next(model.parameters()).device
    return {"embedding": gib(emb.values()), "lm_head": gib(head.values()),
            "embedding_offloaded": gib(held(offloaded).values()) if offloaded is not None else 0.0,
            "adapters": gib(p for p in model.parameters() if p.requires_grad),
            "other_params": gib(p for p in model.parameters()
                                if not p.requires_grad and id(p) not in emb and id(p) not in head),
            "allocated": round(torch.cuda.memory_allocated(device) / 2**30, 3) if device.type == "cuda" else 0.0}
