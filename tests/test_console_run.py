"""The console of a real CLI run (Ray on CPU workers, a real MLflow sqlite store): only the package's own lines off a
terminal, Ray's logs kept in files, the workers' notices relayed, no stray ANSI codes on a terminal, a UI command that
serves the run; Ctrl-C to the process group stops at a checkpoint, KILLED, exit 130, resumable."""
import fcntl
import importlib.util
import json
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, TINY, cli, free_port, tiny_cfg

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    """(output, storage path) of one piped 10-step run named ``quiet``: the tests below read its console, open its
    store in the UI and resume it on a terminal."""
    storage = tmp_path_factory.mktemp("quiet")
    out = cli(f"run.storage_path={storage}", "run.name=quiet", "train.max_steps=10", env={"RAY_DEDUP_LOGS": "1"})
    return out, storage


def test_piped_run_prints_only_the_package_lines_and_keeps_ray_logs_in_files(quiet_run):
    out, tmp_path = quiet_run
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    print(f"console bytes: {len(text.encode())}\n{text}")  # for the record (-s)
    assert "TrainingReport(" not in text and "\x1b[" not in text and "pid=" not in text, text
    steps = re.findall(r"^\[raytrain_scu\] step (\d+)/10 .*$", out.stdout, re.M)
    assert steps == ["5", "10"], out.stdout  # one plain line per report (report_every 5)
    ray_logs = re.search(r"Ray's and the workers' logs: (\S+)", out.stdout)
    assert ray_logs and Path(ray_logs.group(1)).is_dir(), out.stdout
    kept = re.search(r"worker logs: (\S+)", out.stdout)
    assert kept and Path(kept.group(1)) == tmp_path / "quiet" / "logs", out.stdout
    logs = list(Path(kept.group(1)).glob("worker-*"))
    assert logs and any("TrainingReport(" in f.read_text() for f in logs)  # what the console no longer shows


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


def test_the_ui_command_the_summary_prints_serves_the_run(quiet_run):
    """`pip install raytrain_scu[ui]` (make setup installs it) gives a working `mlflow ui` for the printed store."""
    from raytrain_scu.tracking import ui_command

    assert importlib.util.find_spec("flask"), "no ui extra here (make setup installs it: pip install -e '.[ui]')"
    out, storage = quiet_run
    printed = re.search(r"^  open the UI\s+(.+?)(?:   \(.*\))?$", out.stdout, re.M)
    assert printed and printed.group(1) == ui_command(tiny_cfg(storage, "quiet")), out.stdout
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)  # the venv's `mlflow`, as an activated venv finds it
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    with open(storage / "ui.log", "w") as log:
        serve = ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # one worker: no child to lose
        ui = subprocess.Popen(shlex.split(printed.group(1)) + serve,
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert ui.poll() is None, (storage / "ui.log").read_text()[-3000:]
            try:
                status, _ = _get(base + "/")
                break
            except OSError:
                assert time.time() < deadline, (storage / "ui.log").read_text()[-3000:]
                time.sleep(1)
        assert status == 200
        status, body = _get(base + "/ajax-api/2.0/mlflow/experiments/search?max_results=100")
        experiments = {e["name"]: e["experiment_id"] for e in json.loads(body)["experiments"]}
        assert status == 200 and "tiny-cpu" in experiments, experiments  # the config file's stem
        query = json.dumps({"experiment_ids": [experiments["tiny-cpu"]]}).encode()
        req = urllib.request.Request(base + "/ajax-api/2.0/mlflow/runs/search", data=query,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            runs = json.loads(r.read())["runs"]
        assert [r["info"]["run_name"] for r in runs] == ["quiet"] and runs[0]["info"]["status"] == "FINISHED"
    finally:
        os.killpg(ui.pid, signal.SIGTERM)  # the server and the workers it started: its own process group only
        try:
            ui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait()


def _run_on_a_terminal(*args, columns: int = 120) -> tuple[int, str]:
    """The train CLI with a pseudo-terminal of ``columns`` columns as its stdin, stdout and stderr, as a person
    runs it; returns (exit code, everything the terminal received)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_scu.train", TINY, *args], stdin=slave, stdout=slave,
                            stderr=slave, cwd=ROOT, env={**env, "RAY_AUTH_MODE": "disabled"}, start_new_session=True)
    os.close(slave)
    received = b""
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                received += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=60), received.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_on_a_terminal_a_bar_the_workers_notices_and_no_stray_escape_codes(quiet_run):
    """Resuming the quiet run on a terminal: the bar, the worker's "resumed at step 10" above it (the workers' output
    is in files), and no escape sequence but tqdm's own cursor moves (Ray's colorama once left a stray \x1b[0m)."""
    _, storage = quiet_run
    code, text = _run_on_a_terminal(f"run.storage_path={storage}", "run.name=quiet", "train.max_steps=15")
    assert code == 0, text[-3000:]
    print(repr(text))  # for the record (-s)
    assert text.count("[raytrain_scu] resumed at step 10\r\n") == 1, text  # the worker's notice, once
    assert re.search(r"train: +100%\|.*\| 15/15 ", text), text  # the bar reached the end
    assert "pid=" not in text and "TrainingReport(" not in text
    escapes = re.findall(r"\x1b\[[0-9;?]*[A-Za-z]", text)
    assert set(escapes) <= {"\x1b[A"}, escapes  # tqdm's cursor up, nothing else: no colour codes


def test_a_failure_shows_what_the_worker_said_since_its_last_report(quiet_run):
    """Resumed, then stopped by non-finite losses before its first report: the worker's "resumed at step N" comes
    with the failure (no report carried it), before the one-line error."""
    from raytrain_scu.core.checkpoint import newest_good_local, read_meta

    _, storage = quiet_run
    start = read_meta(newest_good_local(storage / "quiet")[0])["step"]  # 10, or 15 after the terminal test
    r = cli(f"run.storage_path={storage}", "run.name=quiet", f"train.max_steps={start + 5}", "train.report_every=5",
            "train.max_consecutive_skips=3", "run.max_failures=0",
            env={"RAYTRAIN_SCU_NAN_AT_STEPS": ",".join(str(start + k) for k in (1, 2, 3))})
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.count(f"[raytrain_scu] resumed at step {start}\n") == 1, r.stdout
    assert "[raytrain_scu] step " not in r.stdout  # no report came: the notice travelled with the failure
    assert "error: NonFiniteError: 3 optimizer steps in a row" in r.stderr, r.stderr[-3000:]


def _train(tmp_path, *overrides):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # its own process group, as a shell gives a foreground job: os.killpg is the terminal's Ctrl-C
    return subprocess.Popen([sys.executable, "-m", "raytrain_scu.train", TINY, f"run.storage_path={tmp_path}",
                             "run.name=ctrlc", *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, env={**env, "RAY_AUTH_MODE": "disabled"}, start_new_session=True)


def _press_ctrl_c(proc, presses: int) -> tuple[str, float]:
    """After the first progress line, SIGINT to the whole foreground group (as a terminal sends it) ``presses`` times;
    returns (all output, seconds from the last press to the exit)."""
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[raytrain_scu] step "):
                break
        for i in range(presses):
            if i:
                time.sleep(0.05)  # the second press, before any worker could finish its step
            os.killpg(proc.pid, signal.SIGINT)
        t0 = time.time()
        rest, _ = proc.communicate(timeout=300)
        return "".join(lines) + rest, time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctrl_c_stops_at_a_checkpoint_marks_the_run_killed_and_the_same_command_resumes(tmp_path):
    from raytrain_scu.core.checkpoint import read_meta, verify
    from raytrain_scu.tracking import client_for, default_uri

    proc = _train(tmp_path, "train.max_steps=300", "train.report_every=5", "train.checkpoint_every=100",
                  "train.eval_every=100")
    text, _ = _press_ctrl_c(proc, presses=1)
    assert proc.returncode == 130, text[-3000:]
    m = re.search(r"interrupted at step (\d+), checkpoint written; resume: (python -m raytrain_scu\.train .*)$",
                  text, re.M)
    assert m, text[-3000:]
    step = int(m.group(1))
    assert 5 <= step < 100 and m.group(2).endswith(f"run.storage_path={tmp_path} run.name=ctrlc "
                                                   "train.max_steps=300 train.report_every=5 "
                                                   "train.checkpoint_every=100 train.eval_every=100")
    run_dir = tmp_path / "ctrlc"
    saved = run_dir / f"checkpoint_{step:08d}"
    assert verify(saved) is None and read_meta(saved)["step"] == step  # a checkpoint of the interrupted step
    assert not (run_dir / "STOP").exists()
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    client = client_for(default_uri(str(tmp_path)))
    assert client.get_run(run_id).info.status == "KILLED"

    again = cli(f"run.storage_path={tmp_path}", "run.name=ctrlc", f"train.max_steps={step + 2}",
                "train.report_every=5", "train.checkpoint_every=100", "train.eval_every=100")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    # the worker's own notice, relayed with the reports: the console shows it without --verbose, once
    assert again.stdout.count(f"[raytrain_scu] resumed at step {step}\n") == 1, again.stdout
    last = run_dir / f"checkpoint_{step + 2:08d}"
    assert verify(last) is None and read_meta(last)["resumed_at"] == [step]  # it went on from the Ctrl-C checkpoint
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_second_ctrl_c_aborts_at_once_and_still_marks_the_run_killed(tmp_path):
    from raytrain_scu.tracking import client_for, default_uri

    proc = _train(tmp_path, "train.max_steps=300", "train.report_every=5", "train.checkpoint_every=100")
    text, took = _press_ctrl_c(proc, presses=2)
    assert proc.returncode == 130, text[-3000:]
    assert re.search(r"interrupted at step \d+, no checkpoint of it; resume: python -m raytrain_scu\.train ", text)
    assert took < 60 and "Traceback" not in text, text[-3000:]
    run_id = json.loads((tmp_path / "ctrlc" / "mlflow_run.json").read_text())["run_id"]
    assert client_for(default_uri(str(tmp_path))).get_run(run_id).info.status == "KILLED"
    assert not (tmp_path / "ctrlc" / "STOP").exists()
