"""The console: plain lines without ANSI codes off a terminal, a bar on one, the workers' notices, a short aligned
summary."""
import io
import os
import re
import warnings

import pytest
from conftest import tiny_cfg

from raytrain_scu.console import Progress, format_summary, notice, relaying_warnings, report_line, take_notices

ANSI = re.compile(r"\x1b\[")
REPORT = {"step": 10, "max_steps": 40, "train/data_bpt": 4.862634567, "val/data_bpt": 5.150371783314967,
          "ctrl/s_hat": 0.017531234, "ctrl/lambda": 1.4049, "ctrl/lambda_applied": 1.13412345,
          "perf/tokens_per_s": 18589.4}


def test_a_report_is_one_plain_line_with_rounded_values():
    out = io.StringIO()
    p = Progress(target_s=0.01, stream=out, tty=False)
    p.update(REPORT)
    p.update({**REPORT, "step": 20}, checkpoint=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and not ANSI.search(out.getvalue())
    assert lines[0] == ("[raytrain_scu] step 10/40  DataBPT 4.863  val 5.15  Ŝ 0.01753/0.01  λ 1.134  tok/s 18,589"
                        "  ETA unknown")
    assert lines[1].startswith("[raytrain_scu] step 20/40") and lines[1].endswith("[checkpoint]")
    assert "λ 1.134" in report_line(REPORT)  # the λ the step's loss used, not the next step's (1.405)


def test_on_a_terminal_it_is_a_progress_bar():
    out = io.StringIO()
    p = Progress(target_s=0.01, stream=out, tty=True)
    p.update(REPORT)
    p.update({**REPORT, "step": 40})
    p.close()
    text = out.getvalue()
    assert "40/40" in text and "DataBPT=4.863" in text and "Ŝ=0.01753/0.01" in text


def test_summary_is_short_aligned_and_rounded():
    text = format_summary({"run": "demo", "steps": 60, "val_bpt_start": 5.150371783314967,
                           "val_bpt": 4.7700436164419235, "lambda": 1.6585717819828252, "s": 0.0089703452197941,
                           "s_hat": 0.009278369445181199, "tokens_per_s": 110279.04280978437,
                           "run_dir": "/tmp/runs/demo", "adapter": "/tmp/runs/demo/output/adapter",
                           "best_step": 60, "best_val_bpt": 4.77004, "tracking_uri": "sqlite:////tmp/runs/mlflow.db",
                           "ui_command": "mlflow ui --backend-store-uri sqlite:////tmp/runs/mlflow.db", "notes": []})
    lines = text.splitlines()
    assert lines[0] == "[raytrain_scu] done: run demo"
    assert "  held-out BPT     5.15 -> 4.77" in lines and "  tokens/s         110,279" in lines
    value_columns = {re.match(r"  (.+?)\s{2,}(\S.*)", line).start(2) for line in lines[1:]}
    assert len(value_columns) == 1 and max(map(len, lines)) < 100  # one aligned column of values
    assert "5.150371783314967" not in text


def test_a_workers_notice_is_queued_for_the_next_report_and_shown_once_on_the_driver(capsys):
    take_notices()  # whatever an earlier test left
    notice("resumed at step 10")
    notice("note: model.fused_loss: ...")
    assert capsys.readouterr().out == "[raytrain_scu] resumed at step 10\n[raytrain_scu] note: model.fused_loss: ...\n"
    assert take_notices() == ["resumed at step 10", "note: model.fused_loss: ..."] and take_notices() == []

    out = io.StringIO()
    p = Progress(target_s=0.01, stream=out, tty=False)
    for text in ("resumed at step 10", "resumed at step 10", "warning: x"):  # a restarted worker says it again
        p.note(text)
    p.update(REPORT)
    assert out.getvalue().splitlines()[:2] == ["[raytrain_scu] resumed at step 10", "[raytrain_scu] warning: x"]
    assert len(out.getvalue().splitlines()) == 3

    out = io.StringIO()
    p = Progress(target_s=0.01, stream=out, tty=True)
    p.update(REPORT)
    p.note("resumed at step 10")  # on a terminal: a line of its own above the bar, which goes on below it
    p.update({**REPORT, "step": 20})
    p.close()
    text = out.getvalue()
    assert "[raytrain_scu] resumed at step 10\n" in text and text.rindex("resumed") < text.rindex("20/40")


def test_the_packages_own_warnings_on_a_worker_become_notices(tmp_path):
    from raytrain_scu.tracking.tracker import MlflowTracker

    take_notices()
    tracker = MlflowTracker(tiny_cfg(tmp_path, "w"))
    with pytest.warns(UserWarning) as shown, relaying_warnings():
        tracker._warn("log metrics", ConnectionError("refused"))  # tracking.py warns: relayed
        warnings.warn("someone else's warning")  # not the package's: shown as usual, not relayed
    notices = take_notices()
    assert len(shown) == 2  # both still shown where they were issued (a worker's log file)
    assert len(notices) == 1 and notices[0].startswith("warning: MLflow log metrics failed (")
    assert "ConnectionError: refused" in notices[0]


def test_the_eta_is_rank_0s_estimate_and_says_when_there_is_none():
    from raytrain_scu.console import fmt_eta

    line = report_line({**REPORT, "time/eta_s": 12.2}, eta=fmt_eta(12.2))
    assert line.endswith("ETA 0:00:13")  # rounded up: only nothing left reads 0:00:00
    assert fmt_eta(0.0) == "0:00:00" and fmt_eta(0.2) == "0:00:01" and fmt_eta(3725) == "1:02:05"
    assert fmt_eta(None) == "unknown" and fmt_eta(float("nan")) == "unknown"
    out = io.StringIO()
    p = Progress(stream=out, tty=False)
    p.update({**REPORT, "time/eta_s": 61.0})
    p.update(REPORT)  # a report without the worker's estimate
    assert [line.rsplit("ETA ", 1)[1] for line in out.getvalue().splitlines()] == ["0:01:01", "unknown"]


def test_a_val_repeated_between_evaluations_carries_the_step_it_was_measured_at():
    stale = report_line({**REPORT, "step": 15, "val/step": 10})
    fresh = report_line({**REPORT, "step": 20, "val/step": 20})
    assert "  val 5.15 @10  " in stale and "  val 5.15  " in fresh
    assert "  val 5.15 @0  " in report_line({**REPORT, "step": 5, "val/step": 0})  # the untrained baseline


def _pty_stream(columns: int):
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, os.fdopen(slave, "w")


def test_a_terminal_that_reports_0_columns_gets_plain_lines_not_an_empty_bar():
    """``script`` without a size gives a terminal of 0 columns, where tqdm draws nothing: plain lines there."""
    from raytrain_scu.console import draws_a_bar

    for columns, bar in ((0, False), (120, True)):
        master, stream = _pty_stream(columns)
        try:
            assert draws_a_bar(stream) is bar
            p = Progress(stream=stream)
            p.update(REPORT)
            p.close()
            stream.flush()
            received = os.read(master, 65536).decode()
            assert ("[raytrain_scu] step 10/40  DataBPT 4.863" in received) is not bar, received
            assert ("train:" in received) is bar, received
        finally:
            stream.close()
            os.close(master)
    assert not draws_a_bar(io.StringIO())  # a pipe, a file


def test_the_summary_names_both_adapters_and_the_plots_when_the_best_is_not_the_last():
    base = {"run": "r", "steps": 200, "adapter": "/r/output/adapter", "adapter_step": 200, "lambda": 1.0}
    both = format_summary({**base, "best_step": 20, "best_val_bpt": 4.7, "best_adapter": "/r/output/adapter_best",
                           "plots": ["/r/output/plots/s_tracking.png", "/r/output/plots/lambda.png"]})
    assert "  adapter          /r/output/adapter   (step 200, the last)" in both.splitlines()
    assert "  best adapter     /r/output/adapter_best   (step 20, lowest held-out BPT)" in both.splitlines()
    assert "  plots            /r/output/plots: s_tracking.png lambda.png" in both.splitlines()
    # run.primary_adapter=best (the default): adapter/ is the best checkpoint's, the last step's beside it
    best = format_summary({**base, "adapter_step": 20, "best_step": 20, "last_adapter": "/r/output/adapter_last"})
    assert "  adapter          /r/output/adapter   (step 20, lowest held-out BPT)" in best.splitlines()
    assert "  last adapter     /r/output/adapter_last   (step 200, the last)" in best.splitlines()
    one = format_summary({**base, "best_step": 200, "best_val_bpt": 4.7})
    assert "/r/output/adapter   (step 200, the last and the best)" in one and "best adapter" not in one


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_counter_estimates_once_its_rate_settles_then_shows_plain_progress_and_a_last_line(monkeypatch):
    from raytrain_scu import console

    clock = _Clock()
    monkeypatch.setattr(console.time, "monotonic", clock)
    out = io.StringIO()
    c = console.Counter(10_000, desc="evaluate", stream=out, tty=False, every_s=5.0, estimate=True, settle_s=2.0)
    c.advance(0)  # ready: the clock of the elapsed time starts
    clock.now += 3.0
    c.advance(1_000)  # the first batch (its one-time costs are not in the rate)
    for _ in range(4):  # 500 tokens a second from here on
        clock.now += 1.0
        c.advance(500)
    clock.now += 4.0
    c.advance(2_000)
    clock.now += 10.0
    c.advance(5_000)
    c.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == ("[raytrain_scu] evaluate: estimate 0:00:16 for 10,000 tokens at 500 tokens/s (measured over "
                        "the first 2 s)")  # 2 s after the first batch: 8,000 left at 500/s
    assert lines[1:3] == ["[raytrain_scu] evaluate: 2,000/10,000 tokens  500 tokens/s  ETA 0:00:16",  # 5 s in
                          "[raytrain_scu] evaluate: 5,000/10,000 tokens  500 tokens/s  ETA 0:00:10"]  # 5 s later
    assert lines[3] == "[raytrain_scu] evaluate: 10,000/10,000 tokens in 0:00:21, 476 tokens/s"  # from ready to done
    assert len(lines) == 4 and not ANSI.search(out.getvalue())


def test_the_workers_eta_counts_the_evaluations_left_at_their_measured_cost(monkeypatch):
    from types import SimpleNamespace

    from raytrain_scu.worker import periodic

    # eval every 10, checkpoint every 15 (each checkpoint evaluates too), the last step always: steps 21..40 hold
    # 30 (eval and checkpoint at once) and 40 (eval, and the last)
    assert periodic.evals_between(21, 40, eval_every=10, checkpoint_every=15) == 2
    assert periodic.evals_between(1, 31, eval_every=10, checkpoint_every=15) == 5  # 10, 15, 20, 30 and the last
    assert periodic.evals_between(41, 40, eval_every=10, checkpoint_every=15) == 0
    train = SimpleNamespace(max_steps=40, eval_every=10, checkpoint_every=15)
    s = SimpleNamespace(cfg=SimpleNamespace(train=train), rec=SimpleNamespace(start_step=0),
                        metering=SimpleNamespace(loop_t0=0.0, eval_s=3.0, eval_total_s=6.0))
    monkeypatch.setattr(periodic.time, "perf_counter", lambda: 26.0)
    # after step 20: 20 s of steps (26 s less two evals of 3 s), so 1 s a step, 20 steps and 2 evaluations left
    assert periodic.eta_s(s, 19) == 20 * 1.0 + 2 * 3.0
