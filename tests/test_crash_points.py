"""Crash at every point: rank 0 killed with SIGKILL at points of its write paths (each checkpoint file, its sync and
commit, the copy into the run directory, the metric spool's append and state, the MLflow calls), drawn at random
with a kept seed from every (point, occurrence) an uninterrupted run reaches (``core.crashpoints``). After each kill
the same command resumes in the same run directory, and nothing is lost or doubled: the final adapter, optimizer
state, controller state and history (the λ trajectory) equal the uninterrupted run's bit for bit (CPU, one thread),
and the MLflow store (a real sqlite one) has every step's metrics exactly once, with the same values.

Each attempt is the real loop (``run_loop`` with ``LocalHooks``, rank 0 of one, its tracker logging to the store) in
a child process that can be killed, forked from a helper (:class:`Attempts`) started fresh with multiprocessing's
``spawn``: it sets torch to one thread before any torch operation, runs the uninterrupted run itself, so every
attempt starts warm (torch, transformers, MLflow, matplotlib loaded once), and forks only while it runs a single
torch thread, so no OpenMP pool is lost in a fork whatever ran in the test process before. Each attempt opens its own
sqlite store and ends with ``os._exit``. A failure names its point and the seed: ``RAYTRAIN_SCU_CRASH_SEED`` and
``RAYTRAIN_SCU_CRASH_POINTS`` replay or widen the draw. ``make test`` runs 30 points; ``RAYTRAIN_SCU_CRASH_MORE=all``
(or a count) runs the rest of the draw too.
"""
import json
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
from conftest import tiny_cfg
from safetensors.torch import load_file

from raytrain_scu.config.paths import RunPaths
from raytrain_scu.core import checkpoint as ckpt
from raytrain_scu.core import crashpoints

SEED = int(os.environ.get("RAYTRAIN_SCU_CRASH_SEED", "54"))
POINTS = int(os.environ.get("RAYTRAIN_SCU_CRASH_POINTS", "30"))
# the points past the first POINTS that test_a_crash_at_many_more_points runs: "all" (every point the run reaches),
# a count, or unset (none: that test is skipped)
MORE_POINTS = os.environ.get("RAYTRAIN_SCU_CRASH_MORE", "")
NAME = "crash"
# 4 steps, a report (spool append, MLflow batch) after each, a checkpoint every 2; one micro-batch a step and 8
# held-out blocks: the write paths are what is tested
OVERRIDES = ("scaling.num_workers=1", "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=2",
             "train.report_every=1", "tracking.system_metrics=false", "data.grad_accum=1", "train.eval_blocks=8")
ATTEMPT_TIMEOUT_S = 120


def launch(root: Path) -> None:
    """The command every attempt runs: the loop as rank 0 of one, its checkpoints and metric spool in the run
    directory under ``root``, MLflow in ``root/mlflow.db``."""
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    cfg = tiny_cfg(root, NAME, *OVERRIDES)
    run_loop(cfg, hooks=LocalHooks(device=torch.device("cpu"), run_dir=RunPaths.of(cfg).local))


def run_attempt(root: str, crash_at: str) -> None:
    """In a forked child: one launch with RAYTRAIN_SCU_CRASH_AT=``crash_at`` ("" for none), its output in
    ``root/attempts.log``. Ends the process itself, 0 when the launch returned."""
    code = 1
    try:
        fd = os.open(Path(root) / "attempts.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)
        print(f"--- attempt, {crashpoints.ENV}={crash_at!r}")
        os.environ.pop(crashpoints.ENV, None)
        if crash_at:
            os.environ[crashpoints.ENV] = crash_at
        crashpoints.reached.clear()
        tempfile.tempdir = str(Path(root) / "tmp")  # what a killed writer leaves in its temp directory stays here
        launch(Path(root))
        code = 0
    except BaseException:  # noqa: BLE001 - the child reports through its exit code and log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def reference_run(root: str, counts: str) -> int:
    """In the helper itself: the uninterrupted run, counting the points it reaches (written to ``counts``)."""
    os.environ[crashpoints.ENV] = "count:0"
    crashpoints.reached.clear()
    try:
        launch(Path(root))
    finally:
        os.environ.pop(crashpoints.ENV)
    Path(counts).write_text(json.dumps(dict(crashpoints.reached)))
    crashpoints.reached.clear()
    return 0


def wait_for_child(pid: int) -> int | str:
    """The forked attempt's exit code (-9: SIGKILL), or what went wrong: it ran past ATTEMPT_TIMEOUT_S."""
    deadline = time.time() + ATTEMPT_TIMEOUT_S
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return f"ran past {ATTEMPT_TIMEOUT_S} s"


def serve(conn) -> None:
    """The helper's loop: ``(root, crash_at, counts)`` from ``conn``, None to end. With ``counts``, the reference
    runs here (warming every import and cache the attempts use); otherwise an attempt is forked from here and its exit
    code sent back. Torch runs one thread here from before its first operation, so its OpenMP pool never started and
    a fork loses none of its workers (the libraries' idle threads from import, jemalloc's among them, are as in any
    process that imports them)."""
    torch.set_num_threads(1)  # before any torch operation: the same kernels everywhere, so the same bits, and no pool
    while (job := conn.recv()) is not None:
        root, crash_at, counts = job
        try:
            if counts:
                conn.send(reference_run(root, counts))
                continue
            if torch.get_num_threads() != 1:
                conn.send(f"torch runs {torch.get_num_threads()} threads in the helper: no attempt is forked from it")
                continue
            pid = os.fork()
            if pid == 0:
                run_attempt(root, crash_at)
            conn.send(wait_for_child(pid))
        except Exception:  # noqa: BLE001 - said by the test process
            conn.send(traceback.format_exc())


class Attempts:
    """Where every launch runs: a helper process started fresh (multiprocessing's ``spawn``: none of the test
    process's threads, OpenMP pool or earlier tests' state goes with it), which sets torch to one thread before any
    torch operation, runs the uninterrupted reference itself, then forks each attempt from itself, warm (torch,
    transformers, MLflow, the tokenizer and matplotlib's fonts loaded once), checking that torch still runs one
    thread there."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.helper = ctx.Process(target=serve, args=(theirs,), daemon=True)
        self.helper.start()

    def run(self, root: Path, crash_at: str, counts: str = "") -> int:
        """One launch (``counts``: the reference, in the helper); returns its exit code (-9: SIGKILL)."""
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        self.conn.send((str(root), crash_at, counts))
        if not self.conn.poll(ATTEMPT_TIMEOUT_S * 2):
            raise AssertionError(f"the helper did not answer for {crash_at or 'no crash'}; log: {log_tail(root)}")
        code = self.conn.recv()
        if isinstance(code, str):
            raise AssertionError(f"an attempt ({crash_at or 'no crash'}) {code}; log: {log_tail(root)}")
        return code

    def close(self) -> None:
        self.conn.send(None)
        self.helper.join(30)
        if self.helper.is_alive():
            self.helper.kill()


def log_tail(root: Path, chars: int = 3000) -> str:
    path = root / "attempts.log"
    return path.read_text()[-chars:] if path.exists() else "(no log)"


def tensors(obj, prefix=""):
    """``{path: (dtype, shape, bytes)}`` of every tensor in a nested state, and the other leaves as they are."""
    if isinstance(obj, torch.Tensor):
        return {prefix: (str(obj.dtype), tuple(obj.shape), obj.detach().cpu().contiguous().numpy().tobytes())}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in tensors(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in tensors(value, f"{prefix}/{i}").items()}
    return {prefix: obj}


def outcome(root: Path) -> dict:
    """What a finished run left: its final checkpoint's adapter, optimizer, controller and history (timing metrics,
    ``perf/*``, left out), and each MLflow metric's (step, value) points (timing metrics: steps only)."""
    from raytrain_scu.tracking.store import client_for, default_uri

    final, _ = ckpt.newest_good_local(root / NAME)
    state = torch.load(final / "state.pt", weights_only=False)
    client = client_for(default_uri(str(root)))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    metrics = {}
    for run in runs:
        for key in sorted(run.data.metrics):
            points = client.get_metric_history(run.info.run_id, key)
            metrics[key] = sorted((m.step, None if key.startswith("perf/") else m.value) for m in points)
    return {"step": ckpt.read_meta(final)["step"],
            "adapter": tensors(load_file(final / "adapter" / "adapter_model.safetensors")),
            "optimizer": tensors(state["optimizer"]),
            "controller": json.loads((final / "controller.json").read_text()),
            "history": [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in state["history"]],
            "runs": [(run.info.run_name, run.info.status) for run in runs], "metrics": metrics}


def differences(got: dict, want: dict) -> list[str]:
    """What of ``got`` is not ``want``, part by part; of the MLflow metrics, the steps doubled, missing or with
    other values, each with the keys it happens to."""
    out = []
    for part in ("step", "runs", "adapter", "optimizer", "controller", "history"):
        if got[part] != want[part]:
            keys = [k for k in set(got[part]) | set(want[part]) if got[part].get(k) != want[part].get(k)] \
                if isinstance(want[part], dict) else []
            out.append(f"{part} differs" + (f" at {sorted(keys)[:4]}" if keys else ""))
    wrong = {}  # (what, steps) -> keys
    for key in sorted(set(got["metrics"]) | set(want["metrics"])):
        have, expected = got["metrics"].get(key, []), want["metrics"].get(key, [])
        steps = [s for s, _ in have]
        for what, bad in (("doubled", {s for s in steps if steps.count(s) > 1}),
                          ("missing", {s for s, _ in expected} - set(steps)),
                          ("with other values", {s for s, _ in set(have) ^ set(expected)} & set(steps))):
            if bad:
                wrong.setdefault((what, tuple(sorted(bad))), []).append(key)
    out += [f"MLflow: steps {list(steps)} {what} in {len(keys)} metrics ({', '.join(keys[:3])}, ...)"
            for (what, steps), keys in wrong.items()]
    return out


def draw(reached: dict, count: int, seed: int) -> list[tuple[str, int]]:
    """``count`` (point, occurrence) pairs of those reached, drawn with ``seed``: a round over the points (in a
    shuffled order) takes an occurrence of each not drawn yet, so every point is hit before any twice."""
    rng = random.Random(seed)
    names = sorted(reached)
    rng.shuffle(names)
    left = {name: rng.sample(range(1, reached[name] + 1), reached[name]) for name in names}
    out = []
    while len(out) < count and any(left.values()):
        out += [(name, left[name].pop()) for name in names if left[name]][:count - len(out)]
    return out


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run, in the attempts' helper (which warms it for them), counting the points it reaches; and
    an empty MLflow store each attempt starts from (a copy: MLflow builds a new store's schema in ~1 s). Nothing of
    the loop runs in the test process (its torch threads stay as they are).

    Every run writes to a tmpfs (/dev/shm) where there is one: a killed process leaves its written pages to the
    kernel whether or not it synced them, so the syncs that cost ~25 ms each on this disk (sqlite commits, checkpoint
    files) decide nothing a SIGKILL tests."""
    from raytrain_scu.tracking.store import client_for

    base = Path(tempfile.mkdtemp(prefix="raytrain_scu_crash_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    (base / "empty").mkdir()
    client_for(f"sqlite:///{base / 'empty'}/mlflow.db").search_experiments()
    root = base / "reference"
    root.mkdir()
    shutil.copy(base / "empty" / "mlflow.db", root / "mlflow.db")
    attempts = Attempts()
    try:
        code = attempts.run(root, "count:0", counts=str(base / "reached.json"))
        assert code == 0, f"the uninterrupted run failed (exit code {code})"
        reached = json.loads((base / "reached.json").read_text())
        yield base, reached, outcome(root), attempts
    finally:
        attempts.close()
        shutil.rmtree(base, ignore_errors=True)


def crash_and_resume(reference, count: int, skip: int = 0) -> None:
    """The draw's points from ``skip`` to ``count``: each killed once, then resumed to the end and compared."""
    base, reached, want, attempts = reference
    points = draw(reached, count, SEED)
    assert len(points) == min(count, sum(reached.values()))
    failures = []
    for i, (name, n) in enumerate(points[skip:], start=skip):
        root = base / f"{i:03d}-{name}-{n}"
        root.mkdir()
        shutil.copy(base / "empty" / "mlflow.db", root / "mlflow.db")
        killed = attempts.run(root, f"{name}:{n}")
        resumed = attempts.run(root, "") if killed == -signal.SIGKILL else None
        if killed != -signal.SIGKILL:
            failures.append(f"{name}:{n} was not killed there (exit code {killed}): {log_tail(root)}")
        elif resumed != 0:
            failures.append(f"{name}:{n}: the resumed run failed (exit code {resumed}): {log_tail(root)}")
        else:
            failures += [f"{name}:{n}: {d}" for d in differences(outcome(root), want)]
    assert not failures, (f"seed {SEED} (RAYTRAIN_SCU_CRASH_SEED), {len(points)} points of {sum(reached.values())}; "
                          + "\n".join(failures))


@pytest.mark.slow
def test_the_points_cover_every_write_path(reference):
    """The uninterrupted run reaches every kind of point: before, inside and after the checkpoint's files, sync and
    manifest, its copy into the run directory, the spool's append and state, and the MLflow calls."""
    _, reached, want, _ = reference
    assert set(reached) >= {
        "checkpoint.begin", "checkpoint.adapter", "checkpoint.state", "checkpoint.controller", "checkpoint.meta",
        "checkpoint.config", "checkpoint.manifest", "checkpoint.fsync", "checkpoint.renamed", "hooks.copy",
        "spool.append", "spool.line", "spool.state", "spool.reset", "mlflow.connect", "mlflow.run_created",
        "mlflow.params", "mlflow.log_batch", "mlflow.logged", "mlflow.artifact", "mlflow.terminate"}, reached
    assert reached["checkpoint.begin"] == 2 and want["step"] == 4
    assert [s for s, _ in want["metrics"]["ctrl/lambda"]] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_crash_at_any_point_of_a_write_loses_nothing_and_doubles_nothing(reference):
    """30 points of the draw (each of the 21 points at least once): killed there, resumed by the same command, and
    the run ends as the uninterrupted one, bit for bit, with every metric of every step in MLflow once."""
    crash_and_resume(reference, POINTS)


@pytest.mark.slow
@pytest.mark.skipif(not MORE_POINTS, reason="RAYTRAIN_SCU_CRASH_MORE=all (or a count) runs it: make test runs the "
                                            "30 points of the test above")
def test_a_crash_at_many_more_points(reference):
    """The same draw's points past the first 30: every point the run reaches (188, ~4 min) with
    RAYTRAIN_SCU_CRASH_MORE=all, or that many more with a count."""
    more = sum(reference[1].values()) if MORE_POINTS == "all" else POINTS + int(MORE_POINTS)
    crash_and_resume(reference, more, skip=POINTS)


# ---------------------------------------------------------------- the rules the crashes showed, unit level

def test_an_append_counts_once_its_state_is_saved(tmp_path):
    """The spool's append is whole or absent after a crash: lines on disk past the saved state's ``end`` (an append
    that died before its state was saved, or part-way) are cut when the spool opens, and their steps are not counted
    as logged; with no state saved at all, no line counts."""
    from types import SimpleNamespace

    from raytrain_scu.tracking.spool import MetricSpool

    def points(step):
        return [SimpleNamespace(key=k, value=float(step), timestamp=1000 + step, step=step) for k in ("a", "b")]

    path = tmp_path / "mlflow_buffer.jsonl"
    spool = MetricSpool(path, 100)
    spool.append(points(1))
    saved = spool.state_path.read_text()
    spool.append(points(2))
    spool.state_path.write_text(saved)  # the process died after step 2's lines, before their state
    again = MetricSpool(path, 100)
    assert (again.waiting, again.through) == (2, 1) and [p["s"] for _, p in again._lines()] == [1, 1]
    again.append(points(2))
    assert [p["s"] for _, p in MetricSpool(path, 100)._lines()] == [1, 1, 2, 2]
    spool.state_path.unlink()  # lines, and no state ever saved: the first append died
    fresh = MetricSpool(path, 100)
    assert (fresh.waiting, fresh.through, path.read_bytes()) == (0, -1, b"")


def test_a_spool_whose_file_is_shorter_than_its_sent_offset_sends_what_comes_next(tmp_path):
    """A state that says more was sent than the file holds (the file gone) counts what the file holds as sent: the
    points appended next are sent, not skipped by a read past the file's end."""
    from types import SimpleNamespace

    from raytrain_scu.tracking.spool import MetricSpool

    path = tmp_path / "mlflow_buffer.jsonl"
    spool = MetricSpool(path, 100)
    for step in (1, 2):
        spool.append([SimpleNamespace(key="a", value=float(step), timestamp=1000 + step, step=step)])
    offset, batch = next(spool.batches(size=1))
    spool.mark_sent(offset, len(batch))  # step 1 sent, step 2 waiting: the state's sent offset is past 0
    path.unlink()
    again = MetricSpool(path, 100)
    assert (again.sent, again.end, again.waiting) == (0, 0, 0)
    again.append([SimpleNamespace(key="a", value=3.0, timestamp=1003, step=3)])
    assert [[m.step for m in b] for _, b in again.batches()] == [[3]]


def test_a_checkpoint_copy_cut_short_is_no_checkpoint_but_a_registered_or_corrupt_one_is_an_error(tmp_path):
    """A run directory whose only checkpoint is a copy cut short (the manifest there, a file it lists missing or
    short) that the run never registered starts afresh, as under Ray, which hands the workers no checkpoint then:
    ``newest_good_local`` gives none (and the problem), ``LocalHooks`` no checkpoint. The same damage to a checkpoint
    the run did register (in Ray Train's snapshot, or LocalHooks' record), or with a record that cannot be read, is
    an error, as the workers would meet it; so is a whole copy with a flipped byte."""
    from raytrain_scu.core.model.build import apply_lora, build_model
    from raytrain_scu.core.registered import LOCAL_RECORD, RAY_SNAPSHOT, record_committed
    from raytrain_scu.worker.hooks import LocalHooks

    torch.manual_seed(0)
    model = apply_lora(build_model("tiny", vocab_size=256), r=2, alpha=4, targets=["q_proj", "v_proj"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    src = ckpt.write_checkpoint(tmp_path / "src", model=model, optimizer=opt,
                                scaler=torch.amp.GradScaler("cpu", enabled=False), controller_state={"lam": 1.0},
                                step=2, position=16, structure={}, tokens_per_epoch=1000, config_yaml="seed: 0\n",
                                history=[])
    run = tmp_path / "run"
    cut = run / "checkpoint_00000002"
    shutil.copytree(src, cut)
    (cut / "state.pt").write_bytes((src / "state.pt").read_bytes()[:100])  # the copy stopped inside state.pt
    (cut / "meta.json").unlink()  # and never reached meta.json
    assert ckpt.incomplete_copy(cut)
    good, problems = ckpt.newest_good_local(run)
    assert good is None and len(problems) == 1 and "checkpoint_00000002" in problems[0]
    assert LocalHooks(device=torch.device("cpu"), run_dir=run).open_checkpoint(None) is None
    snapshot = {"checkpoint_results": [{"checkpoint_dir_name": cut.name, "metrics": {}}],
                "latest_checkpoint_result": {"checkpoint_dir_name": cut.name, "metrics": {}}}
    for record, text in ((RAY_SNAPSHOT, json.dumps(snapshot)), (LOCAL_RECORD, ""), (RAY_SNAPSHOT, "{not json")):
        if record == LOCAL_RECORD:
            record_committed(run, cut.name)
        else:
            (run / record).write_text(text)
        with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint.*checkpoint_00000002"):
            ckpt.newest_good_local(run)  # registered (or no telling): damaged after Ray took it, not cut short
        (run / record).unlink()
    shutil.rmtree(cut)
    shutil.copytree(src, cut)
    data = bytearray((cut / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (cut / "state.pt").write_bytes(bytes(data))
    assert not ckpt.incomplete_copy(cut)
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint.*checksum mismatch"):
        ckpt.newest_good_local(run)
