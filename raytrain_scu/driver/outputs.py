"""What a finished run leaves in its output directory besides config.yaml and summary.json: the adapter(s) and the
control trace (plots, history). ``driver.run.summarize`` calls these."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from raytrain_scu.config.schema import Config
from raytrain_scu.plots import plot_history

# the adapter that is not the primary one (run.primary_adapter), beside adapter/ when it is another step
OTHER_ADAPTER = {"best": "adapter_best", "last": "adapter_last"}
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


def export_adapters(last_dir: Optional[Path], last_step: Optional[int], best: Optional[tuple], out: Path,
                    primary: str) -> dict:
    """``adapter/``: the primary adapter, ``primary`` (run.primary_adapter): the best checkpoint's (``(local dir,
    metrics)``, lowest held-out BPT) or the last step's (from the local checkpoint directory ``last_dir``). The other
    one goes beside it, ``adapter_last/`` or ``adapter_best/``, when it is another step, so neither is taken for the
    other; without a best checkpoint the last step's is the primary. Returns the summary's ``adapter``,
    ``adapter_step``, ``primary_adapter`` (best | last: what ``adapter/`` holds) and ``last_adapter`` /
    ``best_adapter`` (the other one's path, None when it is not apart)."""
    best_step = best[1].get("step") if best is not None else None
    dirs = {"last": last_dir, "best": best[0] if best is not None else None}
    steps = {"last": last_step, "best": best_step}
    first = primary if dirs[primary] is not None else "last"
    other = "best" if first == "last" else "last"
    found = {"adapter_step": steps[first], "primary_adapter": first, "last_adapter": None, "best_adapter": None}
    if dirs[first] is not None:
        found["adapter"] = str(export_adapter(dirs[first], out / "adapter"))
    if dirs[other] is not None and steps[other] != steps[first]:
        found[f"{other}_adapter"] = str(export_adapter(dirs[other], out / OTHER_ADAPTER[other]))
    else:  # the other one is the primary's step (or absent): a copy left by an earlier export of this output goes
        shutil.rmtree(out / OTHER_ADAPTER[other], ignore_errors=True)
    shutil.rmtree(out / OTHER_ADAPTER[first], ignore_errors=True)  # left by a run under the other primary_adapter
    return found


def unexported_best(history: list[dict], best_step: Optional[int]) -> Optional[str]:
    """A note when the lowest held-out BPT of the run's evaluations was measured where no checkpoint was kept (the
    base model at step 0, or an evaluation between checkpoints), so the best adapter is not the best evaluation's;
    None when it is."""
    evals = [(r["val/data_bpt"], r["step"]) for r in history
             if isinstance(r.get("val/data_bpt"), (int, float)) and math.isfinite(r["val/data_bpt"])]
    if not evals or best_step is None:
        return None
    val, step = min(evals, key=lambda e: (e[0], -e[1]))
    if step == best_step or val >= next((v for v, s in evals if s == best_step), math.inf):
        return None
    if step == 0:
        return (f"the untrained adapter's held-out BPT ({val:.4g}, step 0) is lower than every checkpoint's: "
                f"training did not lower it")
    return (f"the lowest held-out BPT ({val:.4g}) was at step {step}, which has no checkpoint: the best adapter is "
            f"step {best_step}'s (train.checkpoint_every that divides train.eval_every keeps one at every "
            f"evaluation)")


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
