"""Hardware presets: ``hardware.preset`` names a set of config values for a kind of card; ``auto`` picks one from the
detected cards (:func:`preset_for`). Values set explicitly in the YAML file or on the command line always win over
the preset (``driver.resolve.apply_preset``).

======  =========  ==========  ==========  =======  ======  ========  =====================================
preset  precision  batch_size  grad_accum  compile  4-bit   ckpt      source
======  =========  ==========  ==========  =======  ======  ========  =====================================
a100    bf16       32          1           yes      no      no        seed: A100 40GB bf16, batch 32, compile
h100    bf16       64          1           yes      no      no        80 GB: twice the A100 batch
h200    bf16       96          1           yes      no      no        141 GB: 1.5x the H100 batch, headroom
4090    bf16       16          2           yes      no      no        seed: RTX 4090 bf16, 16 x 2, compile
3090    bf16       16          2           no       no      no        seed: 3090 starts at 16, compile off
t4      fp16       4           8           no       yes     no        seeds: T4 fp16 (no bf16); 10-16 GB
                                                                      cards (3080-class) fp16 4-bit 4 x 8
cpu     fp32       4           1           no       no      no        CPU: fp32, eager, small batch
======  =========  ==========  ==========  =======  ======  ========  =====================================

(precision = ``model.precision``, batch_size/grad_accum = ``data.*``, compile = ``model.compile``,
4-bit = ``quant.load_in_4bit``, ckpt = ``model.gradient_checkpointing``.) A preset's batch is sized for
the ~1B-parameter models this package targets at the default ``data.block_size`` of 256; longer blocks or
bigger models are what ``driver.resolve.fit_to_gpu`` is for.
"""
from __future__ import annotations

import re
from typing import Any

from raytrain_scu.hardware.gpus import GpuInfo

PRESETS: dict[str, dict[str, Any]] = {
    "a100": {"model.precision": "bf16", "data.batch_size": 32, "data.grad_accum": 1, "model.compile": True,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "h100": {"model.precision": "bf16", "data.batch_size": 64, "data.grad_accum": 1, "model.compile": True,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "h200": {"model.precision": "bf16", "data.batch_size": 96, "data.grad_accum": 1, "model.compile": True,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "4090": {"model.precision": "bf16", "data.batch_size": 16, "data.grad_accum": 2, "model.compile": True,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "3090": {"model.precision": "bf16", "data.batch_size": 16, "data.grad_accum": 2, "model.compile": False,
             "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
    "t4": {"model.precision": "fp16", "data.batch_size": 4, "data.grad_accum": 8, "model.compile": False,
           "quant.load_in_4bit": True, "model.gradient_checkpointing": False},
    "cpu": {"model.precision": "fp32", "data.batch_size": 4, "data.grad_accum": 1, "model.compile": False,
            "quant.load_in_4bit": False, "model.gradient_checkpointing": False},
}

# name patterns, most specific first ("T4" as a word so it never matches inside another model name)
_NAME_PATTERNS = [("h200", r"H200"), ("h100", r"H100"), ("a100", r"A100"), ("4090", r"4090"),
                  ("3090", r"3090"), ("t4", r"\bT4\b")]


def preset_for(gpus: list[GpuInfo]) -> str:
    """The preset for these cards: by name (H200, H100, A100, 4090, 3090, T4), else by the smallest card's
    memory and bf16 support; ``cpu`` when there is no GPU."""
    if not gpus:
        return "cpu"
    name = gpus[0].name.upper()
    for preset, pattern in _NAME_PATTERNS:
        if re.search(pattern, name):
            return preset
    mem_gib = min(g.memory_gib for g in gpus)
    if not all(g.bf16 for g in gpus):
        return "t4"  # pre-Ampere (V100, T4-class): fp16 and the conservative batch
    if mem_gib >= 120:
        return "h200"
    if mem_gib >= 70:
        return "h100"
    if mem_gib >= 32:
        return "a100"
    if mem_gib >= 20:
        return "3090"  # 24 GB Ampere/Ada (A10G, L4, A5000): the 24 GB batch without betting on compile
    return "t4"
