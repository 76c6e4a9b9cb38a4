"""What a finished run leaves in its output directory besides config.yaml and summary.json: the adapter(s) and the
control trace (plots, history). ``driver.run.summarize`` calls these."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from raytrain_scu.config.schema import Config
from raytrain_scu.plots import plot_history

BEST_ADAPTER = "adapter_best"  # beside adapter/ when the best checkpoint is not the last step's
HISTORY = "scu_history.json"  # the per-step rows the plots are drawn from (MLflow has the same artifact)


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


def export_adapters(last_checkpoint, last_step: Optional[int], best: Optional[tuple], out: Path) -> dict:
    """``adapter/``: the last step's; ``adapter_best/`` beside it when the best checkpoint (lowest held-out BPT) is
    another step, so neither is taken for the other. Returns the summary's ``adapter``, ``adapter_step`` and
    ``best_adapter`` (None when the last is the best)."""
    found = {"adapter_step": last_step, "best_adapter": None}
    if last_checkpoint is not None:
        found["adapter"] = str(export_adapter(last_checkpoint, out / "adapter"))
    best_step = best[1].get("step") if best is not None else None
    if best is not None and best_step != last_step:
        found["best_adapter"] = str(export_adapter(best[0], out / BEST_ADAPTER))
    else:  # an extended run's earlier best is no longer apart from the last
        shutil.rmtree(out / BEST_ADAPTER, ignore_errors=True)
    return found


def history_of(checkpoint) -> list[dict]:
    """The per-step rows a checkpoint carries (its ``state.pt``), from step 0 on."""
    with checkpoint.as_directory() as d:
        root = Path(d) / "ckpt" if (Path(d) / "ckpt").is_dir() else Path(d)
        return torch.load(root / "state.pt", map_location="cpu", weights_only=False)["history"]


def write_trace(cfg: Config, checkpoint, out: Path) -> list[str]:
    """The control trace in the output directory: ``scu_history.json`` and ``plots/`` (S and Ŝ against S*, λ,
    DataBPT and ParamBPT, held-out BPT, tokens/s), the same plots MLflow gets. Returns the plots' paths."""
    history = history_of(checkpoint)
    (out / HISTORY).write_text(json.dumps(history))
    return [str(p) for p in plot_history(history, out / "plots", target_s=cfg.controller.target_s,
                                         title=cfg.run.name)]
