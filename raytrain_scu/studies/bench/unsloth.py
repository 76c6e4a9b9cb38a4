"""Unsloth as a measured peer in the bench: the parts ``ref_unsloth``, ``ref_unsloth_8b``, ``ref_unsloth_qlora`` and
``ref_unsloth_qlora_8b``, and the SFT group's ``sft_ref_unsloth`` (:func:`unsloth_sft_loop`) (the bench side;
:mod:`.unsloth_child` is the process that runs one).

Each part is the reference loop (``reference_loop`` in the bench) with Unsloth's model in place of plain HF + peft:

- the part's random-init model (the same preset, the Shakespeare BPE's tokenizer beside it) is saved to a local
  directory first, since Unsloth loads with ``FastLanguageModel.from_pretrained(path)``; the directory is kept
  under :func:`model_root` and reused by the next part of the same shape (the 8B one is 16 GB);
- ``FastLanguageModel.from_pretrained(dir, max_seq_length=block, dtype=bf16, load_in_4bit=...)`` then
  ``FastLanguageModel.get_peft_model(r=16, lora_alpha=32, the 7 projections, lora_dropout=0, bias="none",
  use_gradient_checkpointing="unsloth")``: Unsloth's defaults and its recommended checkpointing (its own, which
  offloads the checkpointed activations to CPU memory; Unsloth turns it into plain checkpointing below 512 tokens);
- the same blocks, batch and steps as the reference, timed the same way (after ``warmup`` steps, intervals of
  ``interval`` steps synchronised at their ends, batches from pinned memory; tokens/s from the median), the same
  fused AdamW (lr 1e-4) under bf16 autocast (what Unsloth's trainer does with ``bf16=True``);
- the loss is Unsloth's own: ``model(input_ids, labels=input_ids).loss``, which in Unsloth's Llama forward runs
  ``unsloth_zoo``'s chunked fused cross-entropy (``unsloth_fused_ce_loss``; no logits are materialised);
- the same proof of training: the BPT of the first batch before and after, and the LoRA B norm.

Each part runs in a fresh Python subprocess: Unsloth must be imported before transformers, peft and trl to patch
them, and its patches (transformers, peft, torch) would otherwise stay in the bench process for every later part.
The bench process never imports ``unsloth``. The subprocess is offline (``HF_HUB_OFFLINE=1``,
``TRANSFORMERS_OFFLINE=1``, and ``UNSLOTH_DISABLE_STATISTICS=1``: Unsloth's ``from_pretrained`` downloads a
statistics file from the Hub otherwise) and keeps Unsloth's compiled-module cache in the temp directory
(``UNSLOTH_COMPILE_LOCATION``) instead of the working directory.

Without a CUDA GPU, or without the packages (unsloth, unsloth_zoo, trl, datasets; bitsandbytes for 4-bit), a part
raises :class:`PartSkipped` with the reason before anything is imported or built. docs/unsloth.md has the package
set, the carry and what the part JSON records.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path

from raytrain_scu.errors import DidNotTrain

GRADIENT_CHECKPOINTING = "unsloth"  # Unsloth's recommended setting (its get_peft_model default)

REQUIRED = ("unsloth", "unsloth_zoo", "trl", "datasets")  # what `import unsloth` needs beyond the GPU image
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "UNSLOTH_DISABLE_STATISTICS": "1"}


class PartSkipped(RuntimeError):
    """A part that cannot run here (no CUDA GPU, a package missing): the bench records the reason as skipped,
    not as an error."""


def skip_reason(load_in_4bit: bool = False) -> str | None:
    """Why an Unsloth part cannot run here, or None. Imports nothing of Unsloth (``find_spec`` only)."""
    import torch

    if not torch.cuda.is_available():
        return ("no CUDA GPU here: Unsloth trains with Triton kernels on a GPU (`import unsloth` without one picks "
                "its CPU backend, which has none of them)")
    wanted = REQUIRED + (("bitsandbytes",) if load_in_4bit else ())
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if missing:
        return (f"not installed: {', '.join(missing)} (the GPU image lacks them: carry the wheels of "
                f"docs/unsloth.md and put them on PYTHONPATH)")
    return None


def model_root() -> Path:
    """Where the saved random-init models live: ``$RTSCU_UNSLOTH_MODELS`` or ``<tmp>/rtscu_unsloth_models``."""
    return Path(os.environ.get("RTSCU_UNSLOTH_MODELS") or Path(tempfile.gettempdir()) / "rtscu_unsloth_models")


def unsloth_loop(*, preset: str, batch: int, block: int, steps: int, warmup: int, interval: int, blocks,
                 lora_r: int = 16, load_in_4bit: bool = False, gradient_checkpointing=GRADIENT_CHECKPOINTING,
                 root: str = "", timeout_s: float = 1800.0, profile: bool = True) -> dict:
    """Unsloth's LoRA (or QLoRA with ``load_in_4bit``) loop at the preset's shape, timed as ``reference_loop`` is,
    in a subprocess; returns the same fields (tokens_per_s, peak_mem_gib, batch, bpt_before, bpt_after,
    lora_b_norm) plus ``versions``, ``gradient_checkpointing``, ``compiled`` and ``unsloth`` (what ran: attention
    backend, loss path, fused LoRA layers, ...). Raises :class:`PartSkipped` (no GPU, packages missing) before
    anything runs, the bench's ``DidNotTrain`` when the proof fails, RuntimeError with the child's last lines when
    it fails otherwise."""
    import numpy as np

    def write(work: Path) -> dict:
        np.save(work / "blocks.npy", np.ascontiguousarray(blocks))
        return dict(preset=preset, batch=batch, block=block, steps=steps, warmup=warmup, interval=interval,
                    lora_r=lora_r, load_in_4bit=load_in_4bit, gradient_checkpointing=gradient_checkpointing,
                    profile=profile, blocks=str(work / "blocks.npy"), root=str(root or model_root()))
    return _in_child(write, load_in_4bit=load_in_4bit, timeout_s=timeout_s)


def unsloth_sft_loop(*, preset: str, examples, batch: int, block: int, steps: int, warmup: int, interval: int,
                     gradient_checkpointing=False, lora_r: int = 16, root: str = "", timeout_s: float = 1800.0) -> dict:
    """Unsloth's supervised fine-tuning as its users run it (the SFT group's ``sft_ref_unsloth``): its model and LoRA
    (as :func:`unsloth_loop` loads them; ``gradient_checkpointing`` off as in the other SFT parts, or Unsloth's
    ``"unsloth"``) trained by the
    ``trl.SFTTrainer`` that Unsloth patches, padding-free with TRL's packing, the loss on the answers only: the
    setup of the TRL part (``sft_peers.sft_trainer_run``), in a subprocess. ``examples``: (token ids, target per
    token) pairs. Returns the SFT parts' fields plus ``versions`` and ``unsloth`` (what ran); raises as
    :func:`unsloth_loop` does."""
    def write(work: Path) -> dict:
        (work / "examples.json").write_text(json.dumps([[list(map(int, ids)), [bool(t) for t in target]]
                                                        for ids, target in examples]))
        return dict(mode="sft", preset=preset, batch=batch, block=block, steps=steps, warmup=warmup,
                    interval=interval, lora_r=lora_r, load_in_4bit=False, gradient_checkpointing=gradient_checkpointing,
                    examples=str(work / "examples.json"), root=str(root or model_root()))
    return _in_child(write, load_in_4bit=False, timeout_s=timeout_s)


def _in_child(write, *, load_in_4bit: bool, timeout_s: float) -> dict:
    """One part in a fresh subprocess: ``write(work)`` puts its inputs in a temporary folder and returns the spec;
    the child writes ``result.json`` there."""
    reason = skip_reason(load_in_4bit)
    if reason:
        raise PartSkipped(reason)
    work = Path(tempfile.mkdtemp(prefix="rtscu_unsloth_"))
    try:
        spec = write(work) | {"out": str(work / "result.json")}
        (work / "spec.json").write_text(json.dumps(spec))
        _run_child([sys.executable, "-m", child_module(), "--child", str(work / "spec.json")], child_env(),
                   timeout_s)
        res = json.loads((work / "result.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "error" in res:
        if res.get("error_type") == "DidNotTrain":
            raise DidNotTrain(res["error"])
        raise RuntimeError(f"{res.get('error_type', 'Error')}: {res['error']}")
    return res


def child_env(base: dict | None = None) -> dict:
    """The subprocess' environment: offline, Unsloth's compile cache in the temp directory, this package first on
    PYTHONPATH (the carried site-packages stay after it)."""
    import raytrain_scu

    env = dict(os.environ if base is None else base)
    env.update(OFFLINE_ENV)
    env.setdefault("UNSLOTH_COMPILE_LOCATION", str(Path(tempfile.gettempdir()) / "unsloth_compiled_cache"))
    env["PYTHONUNBUFFERED"] = "1"
    pkg_root = str(Path(raytrain_scu.__file__).resolve().parent.parent)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != pkg_root]
    env["PYTHONPATH"] = os.pathsep.join([pkg_root, *rest])
    return env


def child_module() -> str:
    """The dotted name of the subprocess' module, beside this one."""
    here = __spec__.name if __spec__ is not None else "raytrain_scu.studies.bench.unsloth"
    return here.rsplit(".", 1)[0] + ".unsloth_child"


def _run_child(cmd: list[str], env: dict, timeout_s: float, tail: int = 40) -> None:
    """Run ``cmd``, its output passed through prefixed ``[unsloth]``; RuntimeError with its last ``tail`` lines when
    it exits non-zero or outlives ``timeout_s`` (then it is killed)."""
    last = deque(maxlen=tail)
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as p:
        expired = threading.Event()

        def kill():
            expired.set()
            p.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            for line in p.stdout:
                last.append(line.rstrip("\n"))
                print(f"[unsloth] {line}", end="", flush=True)
        finally:
            timer.cancel()
        rc = p.wait()
    if expired.is_set():
        raise RuntimeError(f"the Unsloth subprocess ran past {timeout_s:g} s and was killed; last lines:\n"
                           + "\n".join(last))
    if rc != 0:
        raise RuntimeError(f"the Unsloth subprocess exited with {rc}; last lines:\n" + "\n".join(last))
