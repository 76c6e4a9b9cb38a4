"""The console of real CLI runs (Ray on CPU workers, a real MLflow sqlite store), as a user on a fresh machine gets it
(Ray's token authentication at its default, a fresh home): only the package's own lines off a terminal for train and
generate, what happens before the first report, an honest ETA, a stale val marked, the summary's λ the last line's,
the plots and adapter(s) in the run directory, Ray's logs kept in files, the workers' notices relayed, no stray ANSI
codes on a terminal, a UI command that serves the run; the runs listing of every status; Ctrl-C to the process group
stops at a checkpoint, KILLED, exit 130, a second aborts at once, the same command resumes."""
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
from conftest import ROOT, TINY, cli, free_port, mlflow_runs, tiny_cfg, user_env

pytestmark = pytest.mark.slow

# a line of the package's own: a [raytrain_scu] line, or a row of its summary block
PACKAGE_LINE = re.compile(r"^(\[raytrain_scu\] |  \S)")
PROGRESS = re.compile(r"^\[raytrain_scu\] step (\d+)/(\d+)  .*  λ (\S+)  tok/s \S+  ETA (\S+)( +\[checkpoint\])?$",
                      re.M)


def foreign(text: str) -> list[str]:
    """The lines of ``text`` that are not the package's: Ray's, tqdm's, bitsandbytes', warnings."""
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip() and not PACKAGE_LINE.match(line)]


def runs_listing(capsys, *args) -> str:
    from raytrain_scu.cli.runs import main

    capsys.readouterr()
    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    """(output, storage path) of one piped 10-step run named ``quiet``, started as a user starts one: the tests below
    read its console, its run directory and its store, open the store in the UI and resume it."""
    storage = tmp_path_factory.mktemp("quiet")
    env = user_env(storage / "home")
    out = subprocess.run([sys.executable, "-m", "raytrain_scu.train", TINY, f"run.storage_path={storage}",
                          "run.name=quiet", "train.max_steps=10", "controller.target_s=0.2"],  # λ moves: see below
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    return out, storage


def test_piped_run_prints_only_the_package_lines_and_keeps_ray_logs_in_files(quiet_run):
    out, tmp_path = quiet_run
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    print(f"console bytes: {len(text.encode())}\n{text}")  # for the record (-s)
    # Ray's token warning, tqdm bars, bitsandbytes' kernel note, FutureWarnings: none of them, on either stream
    assert foreign(out.stdout) == [] and out.stderr == "", text
    assert "TrainingReport(" not in text and "\x1b[" not in text and "\r" not in text, text
    steps = re.findall(r"^\[raytrain_scu\] step (\d+)/10 .*$", out.stdout, re.M)
    assert steps == ["5", "10"], out.stdout  # one plain line per report (report_every 5)
    ray_logs = re.search(r"Ray's and the workers' logs: (\S+)", out.stdout)
    assert ray_logs and Path(ray_logs.group(1)).is_dir(), out.stdout
    kept = re.search(r"worker logs: (\S+)", out.stdout)
    assert kept and Path(kept.group(1)) == tmp_path / "quiet" / "logs", out.stdout
    logs = list(Path(kept.group(1)).glob("worker-*"))
    assert logs and any("TrainingReport(" in f.read_text() for f in logs)  # what the console no longer shows


def test_the_wait_before_the_first_report_is_said_and_the_progress_lines_can_be_trusted(quiet_run):
    """What happens before the first report (Ray starting, its token authentication in the same line, the workers
    starting); an ETA on every line, 0:00:00 only at the end; the baseline val marked stale at step 5; the summary's
    λ is the last line's (the λ that step's loss used, not the next step's)."""
    out, storage = quiet_run
    lines = out.stdout.splitlines()
    start = [i for i, line in enumerate(lines) if line.startswith("[raytrain_scu] starting a local Ray instance")]
    workers = [i for i, line in enumerate(lines) if re.match(r"\[raytrain_scu\] 2 worker\(s\) started: ", line)]
    first = next(i for i, line in enumerate(lines) if line.startswith("[raytrain_scu] step "))
    assert start and workers and start[0] < workers[0] < first, out.stdout
    assert "(token authentication on, Ray's default; RAY_AUTH_MODE=disabled turns it off)" in lines[start[0]]
    reports = PROGRESS.findall(out.stdout)
    assert [r[0] for r in reports] == ["5", "10"], out.stdout
    assert re.fullmatch(r"\d+:\d\d:\d\d", reports[0][3]) and reports[0][3] != "0:00:00", reports
    assert reports[-1][3] == "0:00:00" and reports[-1][4].strip() == "[checkpoint]"
    assert re.search(r"^\[raytrain_scu\] step 5/10 .*  val \S+ @0  ", out.stdout, re.M), out.stdout  # the baseline's
    assert re.search(r"^\[raytrain_scu\] step 10/10 .*  val [\d.]+  Ŝ", out.stdout, re.M), out.stdout  # fresh
    summary = json.loads((storage / "quiet" / "output" / "summary.json").read_text())
    printed = re.search(r"^  λ / S / Ŝ\s+(\S+) / ", out.stdout, re.M).group(1)
    assert printed == reports[-1][2]  # the same number on the last line and in the summary
    # and they are not the same by accident: with S* near the tiny run's S the default (logodds) law moves λ at every
    # update (far from it, it holds λ while the error closes)
    assert summary["lambda"] != summary["lambda_next"]


def test_the_run_directory_holds_the_plots_and_the_adapter_the_summary_names(quiet_run):
    out, storage = quiet_run
    output = storage / "quiet" / "output"
    plots = re.search(r"^  plots\s+(\S+): (.+)$", out.stdout, re.M)
    assert plots and Path(plots.group(1)) == output / "plots", out.stdout
    names = plots.group(2).split()
    assert {"s_tracking.png", "lambda.png", "val_bpt.png"} <= set(names)
    assert all((output / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    history = json.loads((output / "scu_history.json").read_text())
    assert [r["step"] for r in history] == list(range(0, 11))
    summary = json.loads((output / "summary.json").read_text())
    adapter = re.search(r"^  adapter\s+(\S+)(.*)$", out.stdout, re.M)
    assert adapter and Path(adapter.group(1)) == output / "adapter" and (output / "adapter").is_dir()
    # the best checkpoint here is the last one: one adapter (the primary, the best checkpoint's), said to be both
    assert (summary["primary_adapter"], summary["adapter_step"], summary["best_step"]) == ("best", 10, 10)
    assert summary["last_adapter"] is None and not (output / "adapter_last").exists()
    assert adapter.group(2).strip() == "(step 10, the last and the best)"


def _checkpoint(path: Path, step: int):
    """A Ray checkpoint directory as the loop writes one, with a marker in its adapter and a short history."""
    import torch
    from ray.train import Checkpoint

    (path / "adapter").mkdir(parents=True)
    (path / "adapter" / "adapter_config.json").write_text(json.dumps({"step": step}))
    history = [{"step": k, "ctrl/s": 0.02, "ctrl/s_hat": 0.02, "ctrl/lambda_applied": 1.0, "val/data_bpt": 5.0}
               for k in range(step + 1)]
    torch.save({"history": history}, path / "state.pt")
    return Checkpoint.from_directory(str(path))


def test_when_the_best_checkpoint_is_not_the_last_both_adapters_are_exported_and_named(tmp_path):
    """A run whose best held-out BPT was at step 20 of 200, under run.primary_adapter=last: adapter/ is step 200's,
    adapter_best/ step 20's, and the summary says which is which."""
    from types import SimpleNamespace

    from raytrain_scu.console import format_summary
    from raytrain_scu.core.checkpoint import BEST_METRIC
    from raytrain_scu.driver.run import summarize

    cfg = tiny_cfg(tmp_path, "both", "tracking.enabled=false", "train.max_steps=200", "run.primary_adapter=last")
    last, best = _checkpoint(tmp_path / "ck200", 200), _checkpoint(tmp_path / "ck20", 20)
    metrics = {"step": 200, "val/data_bpt": 4.9, BEST_METRIC: 4.9, "ctrl/lambda_applied": 1.5, "ctrl/lambda": 1.6}
    scored_20 = {"step": 20, "val/data_bpt": 4.7, BEST_METRIC: 4.7}
    result = SimpleNamespace(metrics=metrics, checkpoint=last, path=str(tmp_path / "both"),
                             best_checkpoints=[(last, metrics), (best, scored_20)])
    summary = summarize(cfg, result, None, {}, [], {"use_gpu": False, "vocab_size": 2048})
    out = tmp_path / "both" / "output"
    assert summary["adapter"] == str(out / "adapter") and summary["best_adapter"] == str(out / "adapter_best")
    assert json.loads((out / "adapter" / "adapter_config.json").read_text()) == {"step": 200}
    assert json.loads((out / "adapter_best" / "adapter_config.json").read_text()) == {"step": 20}
    text = format_summary(summary).splitlines()
    assert f"  adapter          {out / 'adapter'}   (step 200, the last)" in text
    assert f"  best adapter     {out / 'adapter_best'}   (step 20, lowest held-out BPT)" in text
    assert summary["lambda"] == 1.5 and summary["lambda_next"] == 1.6  # the last line's λ, and the next step's
    assert [Path(p).name for p in summary["plots"]][:2] == ["s_tracking.png", "lambda.png"]
    # extended until the last is the best again: one adapter, and no stale adapter_best beside it
    result.best_checkpoints = [(last, {**metrics, "val/data_bpt": 4.5, BEST_METRIC: 4.5}), (best, scored_20)]
    again = summarize(cfg, result, None, {}, [], {"use_gpu": False, "vocab_size": 2048})
    assert again["best_adapter"] is None and not (out / "adapter_best").exists()


def test_the_runs_listing_finds_the_finished_run(quiet_run, capsys):
    _, storage = quiet_run
    summary = json.loads((storage / "quiet" / "output" / "summary.json").read_text())
    text = runs_listing(capsys, storage)
    row = next(line for line in text.splitlines() if line.split()[:1] == ["quiet"])
    name, status, steps, best, at, val, s, _, lam, tokens_per_s, path = row.split()
    assert (status, steps, path) == ("finished", "10", str(storage / "quiet"))
    assert best == f"{summary['best_val_bpt']:.4g}" and at == f"@{summary['best_step']}"  # "10.96 @10"
    assert val == f"{summary['val_bpt']:.4g}" and s == f"{summary['s']:.4g}"
    assert lam == f"{summary['lambda']:.4g}" and tokens_per_s == f"{summary['tokens_per_s']:,.0f}"
    assert text.splitlines()[1].split() == ["name", "status", "steps", "best", "val", "val", "S", "/", "λ",
                                            "tokens/s", "path"]


def test_generate_prints_the_prompt_and_its_continuation_and_nothing_else(quiet_run):
    _, storage = quiet_run
    r = subprocess.run([sys.executable, "-m", "raytrain_scu.generate", str(storage / "quiet"), "To be, or not",
                        "--max-new-tokens", "8"], capture_output=True, text=True, cwd=ROOT,
                       env=user_env(storage / "home"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # no bitsandbytes kernel note, no weight-loading bar, no FutureWarning from peft's use of transformers
    assert r.stderr == "" and r.stdout.startswith("To be, or not") and r.stdout.count("\n") == 1, (r.stdout, r.stderr)


def _get(url: str) -> tuple[int, bytes]:
    # the UI server's first API answer can take tens of seconds on 2 cores shared with another test process
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.status, r.read()


def test_the_ui_command_the_summary_prints_serves_the_run(quiet_run):
    """The summary's `make ui CONFIG=... ARGS=...` works from a plain shell (make finds the venv; its setup installs
    the ui extra) and serves the run's store in one server process, with no job runner beside it."""
    import psutil

    assert importlib.util.find_spec("flask"), "no ui extra here (make setup installs it: pip install -e '.[ui]')"
    out, storage = quiet_run
    printed = re.search(r"^  open the UI\s+(.+)$", out.stdout, re.M)
    assert printed and shlex.split(printed.group(1)) == ["make", "ui", f"CONFIG={TINY}",
                                                         f"ARGS=run.storage_path={storage}"], out.stdout
    port = free_port()
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    # this venv, set up already: make is told not to redo its setup (-o the stamp)
    here = [f"VENV={sys.prefix}", f"PORT={port}", "-o", f"{sys.prefix}/.setup-stamp"]
    with open(storage / "ui.log", "w") as log:
        ui = subprocess.Popen(shlex.split(printed.group(1)) + here, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PATH": path}, start_new_session=True)
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
        commands = [" ".join(p.cmdline()) for p in psutil.Process(ui.pid).children(recursive=True)]
        assert not [c for c in commands if "huey" in c or "spawn_main" in c], commands  # no workers, no job runner
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
    """Resuming the quiet run on a terminal (on one worker): the bar, the worker's "resumed at step 10" above it (the
    workers' output is in files), and no escape sequence but tqdm's own cursor moves (Ray's colorama once left a stray
    \x1b[0m)."""
    _, storage = quiet_run
    code, text = _run_on_a_terminal(f"run.storage_path={storage}", "run.name=quiet", "train.max_steps=15",
                                    "scaling.num_workers=1")
    assert code == 0, text[-3000:]
    print(repr(text))  # for the record (-s)
    assert text.count("[raytrain_scu] resumed at step 10\r\n") == 1, text  # the worker's notice, once
    assert re.search(r"train: +100%\|.*\| 15/15 ", text), text  # the bar reached the end
    assert "pid=" not in text and "TrainingReport(" not in text
    escapes = re.findall(r"\x1b\[[0-9;?]*[A-Za-z]", text)
    assert set(escapes) <= {"\x1b[A"}, escapes  # tqdm's cursor up, nothing else: no colour codes


def test_a_failure_shows_what_the_worker_said_since_its_last_report(quiet_run, ray_address, capsys):
    """Resumed, then stopped by non-finite losses before its first report: the worker's "resumed at step N" comes
    with the failure (no report carried it), before the one-line error (exit 1, the root cause, not Ray's wrapping
    nor a traceback); the last good checkpoint is kept, the MLflow run is FAILED with that line as its reason, and the
    runs listing says it failed. The CLI joins the tests' Ray (RAY_ADDRESS): what is shown is the driver's, whichever
    Ray the workers run in. (That a skipped step leaves the weights as they were, and the count across ranks:
    test_reliability.py's non-finite tests.)"""
    from raytrain_scu.core.checkpoint import newest_good_local, read_meta, verify
    from raytrain_scu.tracking.store import FAILURE_TAG

    _, storage = quiet_run
    start = read_meta(newest_good_local(storage / "quiet")[0])["step"]  # 10, or 15 after the terminal test
    r = cli(f"run.storage_path={storage}", "run.name=quiet", f"train.max_steps={start + 5}", "train.report_every=5",
            "train.max_consecutive_skips=3", "run.max_failures=0", "scaling.num_workers=1",
            env={"RAYTRAIN_SCU_NAN_AT_STEPS": ",".join(str(start + k) for k in (1, 2, 3)), "RAY_ADDRESS": ray_address})
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.count(f"[raytrain_scu] resumed at step {start}\n") == 1, r.stdout
    assert "[raytrain_scu] step " not in r.stdout  # no report came: the notice travelled with the failure
    line = (f"error: NonFiniteError: 3 optimizer steps in a row had a non-finite loss or gradient (last at step "
            f"{start + 3}); the last good checkpoint is kept")
    errors = [e for e in r.stderr.splitlines() if e.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(line) and "Traceback" not in r.stderr, r.stderr[-3000:]
    newest = newest_good_local(storage / "quiet")[0]
    assert verify(newest) is None and read_meta(newest)["step"] == start  # kept, and nothing written after the stop
    _, runs = mlflow_runs(storage, "quiet")
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    assert runs[0].data.tags[FAILURE_TAG] == errors[0][len("error: "):]  # the reason, as the console said it
    row = next(line for line in runs_listing(capsys, storage).splitlines() if line.split()[:1] == ["quiet"])
    assert row.split()[1:3] == ["failed", str(start)], row  # the failed attempt wrote no checkpoint


def _train(tmp_path, ray_address, *overrides):
    """The train CLI in its own process group, as a shell gives a foreground job: os.killpg is the terminal's Ctrl-C.
    It joins the Ray at ``ray_address``: Ctrl-C reaches the driver alone, the workers live in that Ray."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ray_address}
    return subprocess.Popen([sys.executable, "-m", "raytrain_scu.train", TINY, f"run.storage_path={tmp_path}",
                             "run.name=ctrlc", *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, env=env, start_new_session=True)


def _settled_newest(run_dir: Path, quiet_s: float = 15.0, limit_s: float = 180.0) -> Path:
    """The newest good checkpoint in ``run_dir`` once its checkpoints have not changed for ``quiet_s`` (an aborted
    run's worker can write one after its driver exits, until Ray ends it)."""
    from raytrain_scu.core.checkpoint import newest_good_local

    seen, since, t0 = None, time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < limit_s:
        now = (sorted(p.name for p in run_dir.glob("checkpoint_*")), newest_good_local(run_dir)[0])
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            assert seen[1] is not None, f"no good checkpoint in {run_dir}: {seen[0]}"
            return seen[1]
        time.sleep(1.0)
    raise AssertionError(f"the checkpoints in {run_dir} kept changing for {limit_s:.0f} s: {seen[0]}")


def _press_ctrl_c(proc, presses: int, before=None) -> tuple[str, float]:
    """After the first progress line (and ``before()``, while the run goes on), SIGINT to the whole foreground group
    (as a terminal sends it) ``presses`` times; returns (all output, seconds from the last press to the exit)."""
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[raytrain_scu] step "):
                break
        if before is not None:
            before()
        for i in range(presses):
            if i:  # the second press once the driver has taken the first, as a person presses it: two signals a
                # few ms apart can reach a loaded driver as one (a pending signal is not counted twice)
                for line in proc.stdout:
                    lines.append(line)
                    if "Ctrl-C: stopping after this step" in line:
                        break
            os.killpg(proc.pid, signal.SIGINT)
        t0 = time.time()
        rest, _ = proc.communicate(timeout=300)
        return "".join(lines) + rest, time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _status(capsys, storage, name: str) -> list[str]:
    """(status, steps) of ``name`` in the runs listing."""
    return next(line.split()[1:3] for line in runs_listing(capsys, storage).splitlines()
                if line.split()[:1] == [name])


def test_ctrl_c_stops_at_a_checkpoint_a_second_aborts_at_once_and_the_same_command_resumes(quiet_run, ray_address,
                                                                                          capsys):
    """One run, three commands (in the quiet run's storage, beside it): Ctrl-C once (a checkpoint of the step, KILLED,
    exit 130, the command that resumes); that command, with Ctrl-C twice (no checkpoint, at once, still KILLED); the
    same command once more, to the end (FINISHED). The runs listing says running, killed and finished as it goes, and
    compares the run with the quiet one. λ is held at its upper bound here: the console says so, once. The commands
    join the tests' Ray (RAY_ADDRESS): Ctrl-C is the driver's to handle, whichever Ray the workers run in, and the
    aborting driver, which leaves fit()'s thread inside Ray's client, must still exit 130 (the interpreter's
    teardown of that thread can die of SIGSEGV)."""
    from raytrain_scu.core.checkpoint import read_meta, verify
    from raytrain_scu.tracking.store import client_for, default_uri

    _, storage = quiet_run
    args = ["train.max_steps=300", "train.report_every=5", "train.checkpoint_every=100", "train.eval_every=100",
            "scaling.num_workers=1", "controller.lambda_max=1.05", "controller.bound_notice_steps=2"]
    listed, proc = {}, _train(storage, ray_address, *args)
    text, _ = _press_ctrl_c(proc, presses=1, before=lambda: listed.update(running=_status(capsys, storage, "ctrlc")))
    assert proc.returncode == 130, text[-3000:]
    assert listed["running"][0] == "running", listed
    m = re.search(r"interrupted at step (\d+), checkpoint written; resume: (python -m raytrain_scu\.train .*)$",
                  text, re.M)
    assert m, text[-3000:]
    step = int(m.group(1))
    assert 5 <= step < 100 and m.group(2).endswith(f"run.storage_path={storage} run.name=ctrlc " + " ".join(args))
    notice = re.findall(r"^\[raytrain_scu\] λ has sat at its upper bound 1.05 \(controller.lambda_max\) since step "
                        r"\d+ \(3 steps; Ŝ \S+, S\* 0.01\): S\* is out of reach at these σ and N.*Try .*\.$",
                        text, re.M)
    assert len(notice) == 1, text
    run_dir = storage / "ctrlc"
    saved = run_dir / f"checkpoint_{step:08d}"
    assert verify(saved) is None and read_meta(saved)["step"] == step  # a checkpoint of the interrupted step
    assert not (run_dir / "STOP").exists()
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    client = client_for(default_uri(str(storage)))
    assert client.get_run(run_id).info.status == "KILLED"
    assert _status(capsys, storage, "ctrlc") == ["killed", f"{step}/300"]

    proc = _train(storage, ray_address, *args)  # the command it printed, and Ctrl-C twice: the driver exits at once
    text, took = _press_ctrl_c(proc, presses=2)
    assert proc.returncode == 130, text[-3000:]
    assert text.count(f"[raytrain_scu] resumed at step {step}\n") == 1, text
    assert re.search(r"interrupted at step \d+, no checkpoint of it; resume: python -m raytrain_scu\.train ", text)
    assert took < 60 and "Traceback" not in text, text[-3000:]
    assert client.get_run(run_id).info.status == "KILLED" and not (run_dir / "STOP").exists()

    # the aborted run's workers may still finish the step the first press asked for, with its checkpoint, after the
    # driver is gone: the run goes on from the newest checkpoint on disk once the checkpoints stop changing
    newest = read_meta(_settled_newest(run_dir))["step"]
    again = cli(f"run.storage_path={storage}", "run.name=ctrlc", *args[1:], f"train.max_steps={newest + 4}",
                env={"RAY_ADDRESS": ray_address})
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    # the worker's own notice, relayed with the reports: the console shows it without --verbose, once
    assert again.stdout.count(f"[raytrain_scu] resumed at step {newest}\n") == 1, again.stdout
    # 4 steps more at the bound, past bound_notice_steps: the stretch was checkpointed with its notice said
    assert "λ has sat" not in again.stdout, again.stdout
    last = run_dir / f"checkpoint_{newest + 4:08d}"
    resumed_at = read_meta(last)["resumed_at"]
    assert verify(last) is None and resumed_at[0] == step and resumed_at[-1] == newest  # on from the Ctrl-C one
    assert client.get_run(run_id).info.status == "FINISHED"
    assert _status(capsys, storage, "ctrlc") == ["finished", str(newest + 4)]

    side = runs_listing(capsys, storage, "ctrlc", "quiet").splitlines()
    assert side[0].split() == ["ctrlc", "quiet"] and side[1].split()[:2] == ["status", "finished"]
    differ = {line.split()[0]: line.split()[1:] for line in side[side.index("config keys that differ:") + 1:]}
    assert differ["controller.lambda_max"] == ["1.05", "10"] and "optim.lr" not in differ, side
