"""What a finished run leaves in its output directory besides config.yaml and summary.json: the adapter(s) and the
control trace (plots, history). ``driver.run.summarize`` calls these."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from raytrain_scu.config.schema import Config
from raytrain_scu.plots import plot_history

BEST_ADAPTER = "adapter_best"  # beside adapter/ when the best checkpoint is not the last step's
HISTORY = "scu_history.json"  # the per-step rows the plots are drawn from (MLflow has the same artifact)


def local_checkpoints(stack) -> Callable[[object], Path]:
    """``local(checkpoint)``: a Ray checkpoint's local directory, downloaded (from remote storage) the first time it
    is asked for and kept until ``stack`` closes; asked again, the same directory, so no checkpoint is downloaded
    twice (the last one gives the adapter and the trace, the best one the adapter and MLflow's artifact)."""
    opened: dict[str, Path] = {}

    def local(checkpoint) -> Path:
        if checkpoint.path not in opened:
            opened[checkpoint.path] = Path(stack.enter_context(checkpoint.as_directory()))
        return opened[checkpoint.path]

    return local


def export_adapter(checkpoint_dir: Path, dest: Path) -> Path:
    """Copy the adapter of a local checkpoint directory to ``dest`` (loadable by ``PeftModel.from_pretrained``)."""
    src = checkpoint_dir / "adapter"
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint {checkpoint_dir} has no adapter/")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    return dest


def export_adapters(last_dir: Optional[Path], last_step: Optional[int], best: Optional[tuple], out: Path) -> dict:
    """``adapter/``: the last step's (from the local checkpoint directory ``last_dir``); ``adapter_best/`` beside it
    when the best checkpoint (``(local dir, metrics)``, lowest held-out BPT) is another step, so neither is taken
    for the other. Returns the summary's ``adapter``, ``adapter_step`` and ``best_adapter`` (None when the last is
    the best)."""
    found = {"adapter_step": last_step, "best_adapter": None}
    if last_dir is not None:
        found["adapter"] = str(export_adapter(last_dir, out / "adapter"))
    best_step = best[1].get("step") if best is not None else None
    if best is not None and best_step != last_step:
        found["best_adapter"] = str(export_adapter(best[0], out / BEST_ADAPTER))
    else:  # an extended run's earlier best is no longer apart from the last
        shutil.rmtree(out / BEST_ADAPTER, ignore_errors=True)
    return found


def history_of(checkpoint_dir: Path) -> list[dict]:
    """The per-step rows a local checkpoint directory carries (its ``state.pt``), from step 0 on."""
    root = checkpoint_dir / "ckpt" if (checkpoint_dir / "ckpt").is_dir() else checkpoint_dir
    return torch.load(root / "state.pt", map_location="cpu", weights_only=False)["history"]


def write_trace(cfg: Config, checkpoint_dir: Path, out: Path) -> list[str]:
    """The control trace in the output directory: ``scu_history.json`` and ``plots/`` (S and Ŝ against S*, λ,
    DataBPT and ParamBPT, held-out BPT, tokens/s), the same plots MLflow gets. Returns the plots' paths."""
    history = history_of(checkpoint_dir)
    (out / HISTORY).write_text(json.dumps(history))
    return [str(p) for p in plot_history(history, out / "plots", target_s=cfg.controller.target_s,
                                         title=cfg.run.name)]
