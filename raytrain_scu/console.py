"""What a person sees: one progress bar on a terminal (plain lines otherwise), the workers' notices, and a short
aligned summary.

No ray, torch or mlflow here: the driver feeds it the metrics of each report. The worker side is :func:`notice`: a
line for the person at the console, which the next report carries to the driver (``notices`` in its metrics).
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Optional, TextIO

NOTICES = "notices"  # the reported metrics' key: the notices since the previous report, one a line, oldest first

_pending: list[str] = []
_PACKAGE = str(Path(__file__).resolve().parent)


def notice(text: str) -> None:
    """Worker side: a line for the person running the job (a resume, a fallback, a warning). Printed here, in the
    worker's log file, and kept until the next report carries it to the driver's console (:func:`take_notices`):
    without ``--verbose`` the workers' own output never reaches the console."""
    print(f"[raytrain_scu] {text}", flush=True)
    _pending.append(text)


def take_notices() -> list[str]:
    """The notices since the last call, oldest first: what the next report carries."""
    taken = list(_pending)
    _pending.clear()
    return taken


@contextlib.contextmanager
def relaying_warnings():
    """Inside, a warning that the package's own code issues (an MLflow call that failed, a skipped bad checkpoint) is
    shown as usual and also becomes a :func:`notice`."""
    with warnings.catch_warnings():
        show = warnings.showwarning

        def relay(message, category, filename, lineno, file=None, line=None):
            show(message, category, filename, lineno, file, line)
            if str(Path(filename).resolve()).startswith(_PACKAGE):
                _pending.append(f"warning: {message}")

        warnings.showwarning = relay
        yield


def _num(v, digits: int = 4) -> str:
    """A value rounded for reading: ``digits`` significant digits, '-' when missing or NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def report_fields(r: dict, target_s: Optional[float] = None) -> dict[str, str]:
    """The fields a person follows: DataBPT, held-out BPT, Ŝ against S*, the λ the step's loss used, tokens/s."""
    s_hat = _num(r.get("ctrl/s_hat"))
    out = {"DataBPT": _num(r.get("train/data_bpt")), "val": _num(r.get("val/data_bpt")),
           "Ŝ": s_hat + (f"/{target_s:g}" if target_s else ""), "λ": _num(r.get("ctrl/lambda_applied"))}
    if r.get("perf/tokens_per_s"):
        out["tok/s"] = f"{r['perf/tokens_per_s']:,.0f}"
    return out


def report_line(r: dict, *, eta: str = "?", target_s: Optional[float] = None, checkpoint: bool = False) -> str:
    """One plain line per report (no ANSI codes): what a log file or a pipe gets."""
    fields = "  ".join(f"{k} {v}" for k, v in report_fields(r, target_s).items())
    return (f"[raytrain_scu] step {int(r['step'])}/{int(r['max_steps'])}  {fields}  ETA {eta}"
            + ("  [checkpoint]" if checkpoint else ""))


class Progress:
    """Renders each report: a tqdm bar (ETA, tokens/s, DataBPT, Ŝ vs S*, λ) on a terminal, a plain line elsewhere."""

    def __init__(self, *, target_s: Optional[float] = None, stream: Optional[TextIO] = None,
                 tty: Optional[bool] = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.target_s = target_s
        self.bar = None
        self.t0: Optional[float] = None
        self.step0 = 0
        self.noted: set[str] = set()

    def note(self, text: str) -> None:
        """A worker's notice, each text once: above the bar on a terminal, a plain line elsewhere."""
        if text in self.noted:
            return
        self.noted.add(text)
        if self.bar is not None:
            self.bar.write(f"[raytrain_scu] {text}", file=self.stream)
        else:
            print(f"[raytrain_scu] {text}", file=self.stream, flush=True)

    def update(self, r: dict, checkpoint: bool = False) -> None:
        step, max_steps = int(r["step"]), int(r["max_steps"])
        now = time.time()
        if self.t0 is None:
            self.t0, self.step0 = now, step
        rate = (step - self.step0) / (now - self.t0) if step > self.step0 else 0.0
        eta = fmt_eta((max_steps - step) / rate) if rate > 0 else "?"
        if not self.tty:
            print(report_line(r, eta=eta, target_s=self.target_s, checkpoint=checkpoint), file=self.stream,
                  flush=True)
            return
        if self.bar is None:
            from tqdm.auto import tqdm  # transformers' dependency

            self.bar = tqdm(total=max_steps, initial=step, file=self.stream, unit="step", dynamic_ncols=True,
                            desc="train")
        self.bar.n = step
        self.bar.set_postfix(report_fields(r, self.target_s), refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def format_summary(summary: dict, *, title: str = "done") -> str:
    """The end of a run as a short aligned block: rounded values, where things are, how to look at them."""
    rows = [("steps", summary.get("steps")),
            ("held-out BPT", f"{_num(summary.get('val_bpt_start'))} -> {_num(summary.get('val_bpt'))}"),
            ("best checkpoint", (f"step {summary['best_step']} (val {_num(summary.get('best_val_bpt'))})"
                                 if summary.get("best_step") is not None else None)),
            ("λ / S / Ŝ", " / ".join(_num(summary.get(k)) for k in ("lambda", "s", "s_hat"))),
            ("tokens/s", f"{summary['tokens_per_s']:,.0f}" if summary.get("tokens_per_s") else None),
            ("run directory", summary.get("run_dir")),
            ("adapter", summary.get("adapter")),
            ("MLflow", summary.get("tracking_uri")),
            ("open the UI", summary.get("ui_command"))]
    rows = [(k, v) for k, v in rows if v not in (None, "", "- -> -")]
    width = max(len(k) for k, _ in rows)
    lines = [f"[raytrain_scu] {title}: run {summary.get('run')}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"  note: {n}" for n in summary.get("notes") or []]
    return "\n".join(lines)
