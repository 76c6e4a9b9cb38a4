"""What a person sees: one progress bar on a terminal (plain lines otherwise), the workers' notices, and a short
aligned summary.

No ray, torch or mlflow here: the driver feeds it the metrics of each report. The worker side is :func:`notice`: a
line for the person at the console, which the next report carries to the driver (``notices`` in its metrics).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Optional, TextIO

NOTICES = "notices"  # the reported metrics' key: the notices since the previous report, one a line, oldest first
ETA = "time/eta_s"  # the reported metrics' key: rank 0's estimate of the seconds left (worker.periodic.eta_s)
VAL_STEP = "val/step"  # the reported metrics' key: the step whose end val/data_bpt was measured at
RESUMED_AT = "resumed_at"  # the reported metrics' key: the steps the run restarted from, "4,6" (absent: none)


def resumed_text(steps) -> str:
    """The steps a run restarted from as ``RESUMED_AT`` carries them: "4,6"; "" for none."""
    return ",".join(str(step) for step in steps or [])


def resumed_steps(text) -> list[int]:
    """``RESUMED_AT``'s text ("4,6") as a list; [] for none."""
    return [int(step) for step in str(text).split(",") if step.strip()] if text not in (None, "") else []

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


def fmt_eta(seconds: Optional[float]) -> str:
    """``H:MM:SS`` rounded up (so only nothing left reads 0:00:00), or ``unknown`` when there is no estimate."""
    if seconds is None or not math.isfinite(seconds):
        return "unknown"
    seconds = int(math.ceil(max(0.0, seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _val(r: dict) -> str:
    """The held-out BPT, and ``@N`` when it was measured at an earlier step N (reports between evaluations repeat
    the last value)."""
    val = _num(r.get("val/data_bpt"))
    at = r.get(VAL_STEP)
    return val if at is None or val == "-" or int(at) == int(r["step"]) else f"{val} @{int(at)}"


def report_fields(r: dict, target_s: Optional[float] = None) -> dict[str, str]:
    """The fields a person follows: DataBPT, held-out BPT (``@N``: measured at step N), Ŝ against S*, the λ the
    step's loss used, tokens/s."""
    s_hat = _num(r.get("ctrl/s_hat"))
    out = {"DataBPT": _num(r.get("train/data_bpt")), "val": _val(r),
           "Ŝ": s_hat + (f"/{target_s:g}" if target_s else ""), "λ": _num(r.get("ctrl/lambda_applied"))}
    if r.get("perf/tokens_per_s"):
        out["tok/s"] = f"{r['perf/tokens_per_s']:,.0f}"
    return out


def report_line(r: dict, *, eta: str = "unknown", target_s: Optional[float] = None,
                checkpoint: bool = False) -> str:
    """One plain line per report (no ANSI codes): what a log file or a pipe gets."""
    fields = "  ".join(f"{k} {v}" for k, v in report_fields(r, target_s).items())
    return (f"[raytrain_scu] step {int(r['step'])}/{int(r['max_steps'])}  {fields}  ETA {eta}"
            + ("  [checkpoint]" if checkpoint else ""))


def draws_a_bar(stream: TextIO) -> bool:
    """A bar on a terminal that says how wide it is; plain lines on a pipe, in a file, and on a terminal that reports
    0 columns (``script`` without a size), where tqdm would draw nothing at all."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """Renders each report: a tqdm bar (ETA, tokens/s, DataBPT, Ŝ vs S*, λ) on a terminal, a plain line elsewhere.
    The ETA is rank 0's (``time/eta_s``): measured time per step, evaluations and checkpoints included."""

    def __init__(self, *, target_s: Optional[float] = None, stream: Optional[TextIO] = None,
                 tty: Optional[bool] = None):
        self.stream = stream or sys.stdout
        self.tty = draws_a_bar(self.stream) if tty is None else tty
        self.target_s = target_s
        self.bar = None
        self.noted: set[str] = set()

    def note(self, text: str) -> None:
        """A line of the package's (a worker's notice, each text once; a stage of the start): above the bar on a
        terminal, a plain line elsewhere."""
        if text in self.noted:
            return
        self.noted.add(text)
        if self.bar is not None:
            self.bar.write(f"[raytrain_scu] {text}", file=self.stream)
        else:
            print(f"[raytrain_scu] {text}", file=self.stream, flush=True)

    def update(self, r: dict, checkpoint: bool = False) -> None:
        step, max_steps = int(r["step"]), int(r["max_steps"])
        eta = fmt_eta(r.get(ETA))
        if not self.tty:
            print(report_line(r, eta=eta, target_s=self.target_s, checkpoint=checkpoint), file=self.stream,
                  flush=True)
            return
        if self.bar is None:
            from tqdm.auto import tqdm  # transformers' dependency

            # tqdm's own remaining time is off: it extrapolates from when the bar appeared, not the run's steps
            self.bar = tqdm(total=max_steps, initial=step, file=self.stream, unit="step", dynamic_ncols=True,
                            desc="train", bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}"
                                                     "{postfix}]")
        self.bar.n = step
        self.bar.set_postfix({**report_fields(r, self.target_s), "ETA": eta}, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Counter:
    """Progress toward a total count (evaluate's tokens): a tqdm bar on a terminal; elsewhere a plain line every
    ``every_s`` seconds and one at the end. The rate runs from the first count on, so the first batch's one-time
    costs do not weigh on the ETA. With ``estimate``, one line once the rate has been measured over ``settle_s``
    seconds: the whole job's estimate."""

    def __init__(self, total: int, *, desc: str, unit: str = "tokens", stream: Optional[TextIO] = None,
                 tty: Optional[bool] = None, every_s: float = 15.0, estimate: bool = False,
                 settle_s: float = 2.0):
        self.total, self.desc, self.unit, self.every_s, self.estimate = total, desc, unit, every_s, estimate
        self.settle_s, self.estimated = settle_s, False
        self.stream = stream or sys.stdout
        self.tty = draws_a_bar(self.stream) if tty is None else tty
        self.done, self.t0, self.first, self.shown, self.bar = 0, None, None, 0.0, None

    def rate(self) -> float:
        """Counted per second after the first count (0 until a second one)."""
        if self.first is None:
            return 0.0
        t1, n1 = self.first
        elapsed = time.monotonic() - t1
        return (self.done - n1) / elapsed if elapsed > 0 and self.done > n1 else 0.0

    def eta(self) -> str:
        rate = self.rate()
        return fmt_eta((self.total - self.done) / rate if rate > 0 else None)

    def advance(self, n: int) -> None:
        """``n`` more counted (0: the work is ready to start, the clock of the elapsed time)."""
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = self.shown = now
        if n <= 0:
            return
        self.done += n
        if self.first is None:
            self.first = (now, self.done)
        elif self.estimate and not self.estimated and now - self.first[0] >= self.settle_s:
            self.estimated = True
            self._say(f"{self.desc}: estimate {self.eta()} for {self.total:,} {self.unit} at {self.rate():,.0f} "
                      f"{self.unit}/s (measured over the first {self.settle_s:g} s)")
        if self.tty:
            self._draw()
        elif now - self.shown >= self.every_s and self.done < self.total and self.rate() > 0:
            self.shown = now
            self._say(f"{self.desc}: {self.done:,}/{self.total:,} {self.unit}  {self.rate():,.0f} {self.unit}/s  "
                      f"ETA {self.eta()}")

    def _say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(f"[raytrain_scu] {text}", file=self.stream)
        else:
            print(f"[raytrain_scu] {text}", file=self.stream, flush=True)

    def _draw(self) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm  # transformers' dependency

            self.bar = tqdm(total=self.total, file=self.stream, unit=f" {self.unit}", unit_scale=True,
                            dynamic_ncols=True, desc=self.desc)
        self.bar.n = self.done
        self.bar.refresh()

    def close(self) -> None:
        """The last line: how many, in how long (from ready to done), how fast."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        seconds = time.monotonic() - self.t0 if self.t0 is not None else 0.0
        rate = f", {self.done / seconds:,.0f} {self.unit}/s" if seconds > 0 else ""
        self._say(f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} in {fmt_eta(seconds)}{rate}")


def _adapter_rows(summary: dict) -> list[tuple[str, Optional[str]]]:
    """The exported adapter(s): the primary one (run.primary_adapter: the best checkpoint's or the last step's), and
    the other beside it when that is another step."""
    adapter = summary.get("adapter")
    if not adapter:
        return []
    step, best_step, last_step = summary.get("adapter_step"), summary.get("best_step"), summary.get("steps")
    if summary.get("last_adapter"):
        return [("adapter", f"{adapter}   (step {step}, lowest held-out BPT)"),
                ("last adapter", f"{summary['last_adapter']}   (step {last_step}, the last)")]
    if summary.get("best_adapter"):
        return [("adapter", f"{adapter}   (step {step}, the last)"),
                ("best adapter", f"{summary['best_adapter']}   (step {best_step}, lowest held-out BPT)")]
    same = step is not None and step == best_step
    return [("adapter", f"{adapter}" + (f"   (step {step}, the last and the best)" if same else ""))]


def format_summary(summary: dict, *, title: str = "done") -> str:
    """The end of a run as a short aligned block: rounded values, where things are, how to look at them. λ / S / Ŝ
    are the last step's, as its progress line shows them (λ: the value that step's loss used)."""
    plots = summary.get("plots") or []
    rows = [("steps", summary.get("steps")),
            ("held-out BPT", f"{_num(summary.get('val_bpt_start'))} -> {_num(summary.get('val_bpt'))}"),
            ("best checkpoint", (f"step {summary['best_step']} (val {_num(summary.get('best_val_bpt'))})"
                                 if summary.get("best_step") is not None else None)),
            ("λ / S / Ŝ", " / ".join(_num(summary.get(k)) for k in ("lambda", "s", "s_hat"))),
            ("tokens/s", f"{summary['tokens_per_s']:,.0f}" if summary.get("tokens_per_s") else None),
            ("run directory", summary.get("run_dir")),
            *_adapter_rows(summary),
            # split as text: a remote address (s3://...) keeps its double slash
            ("plots", f"{plots[0].rsplit('/', 1)[0]}: {' '.join(p.rsplit('/', 1)[-1] for p in plots)}"
             if plots else None),
            ("MLflow", summary.get("tracking_uri")),
            ("open the UI", summary.get("ui_command"))]
    rows = [(k, v) for k, v in rows if v not in (None, "", "- -> -")]
    width = max(len(k) for k, _ in rows)
    lines = [f"[raytrain_scu] {title}: run {summary.get('run')}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"  note: {n}" for n in summary.get("notes") or []]
    return "\n".join(lines)
