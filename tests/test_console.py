"""The console: plain lines without ANSI codes off a terminal, a bar on one, the workers' notices, a short aligned
summary."""
import io
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
    from raytrain_scu.tracking import MlflowTracker

    take_notices()
    tracker = MlflowTracker(tiny_cfg(tmp_path, "w"))
    with pytest.warns(UserWarning) as shown, relaying_warnings():
        tracker._warn("log metrics", ConnectionError("refused"))  # tracking.py warns: relayed
        warnings.warn("someone else's warning")  # not the package's: shown as usual, not relayed
    notices = take_notices()
    assert len(shown) == 2  # both still shown where they were issued (a worker's log file)
    assert len(notices) == 1 and notices[0].startswith("warning: MLflow log metrics failed (")
    assert "ConnectionError: refused" in notices[0]
