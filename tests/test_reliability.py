"""Reliability: checkpoints that verify or fall back, worker and node loss survived through Ray, non-finite steps
skipped and bounded, secrets kept out of logs and dumps, old checkpoints removed. Figures: docs/reliability.md.

Unit tests need no Ray. The integration tests (marked slow, run by `make test`) train the tiny model on CPU workers;
the fault tests hold the workers at a known step (RAYTRAIN_SCU_HOLD_AT_STEP) and kill them from outside.
Run as a script, ``python tests/test_reliability.py two-node STORAGE`` is the two-node scenario (own Ray cluster), and
``drain STORAGE STEP`` a worker node drained for preemption (own Ray cluster; its test runs with
RAYTRAIN_SCU_DRAIN_TEST=1).
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, free_port, leaking_files, mlflow_runs, mlflow_values, tiny_cfg
from safetensors.torch import load_file

from raytrain_scu.core import checkpoint as ckpt

SECRETS = {"HF_TOKEN": "hf_SECRETtoken123", "MLFLOW_TRACKING_PASSWORD": "mlflowSECRETpw456",
           "AWS_SECRET_ACCESS_KEY": "awsSECRETkey789"}


# ---------------------------------------------------------------- helpers

def tiny_peft():
    from raytrain_scu.core.model.build import apply_lora, build_model

    torch.manual_seed(0)
    return apply_lora(build_model("tiny", vocab_size=256), r=2, alpha=4, targets=["q_proj", "v_proj"])


def write(out, model, step=10):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return ckpt.write_checkpoint(out, model=model, optimizer=opt, scaler=torch.amp.GradScaler("cpu", enabled=False),
                                 controller_state={"lam": 1.5}, step=step, position=step * 8,
                                 structure={"lora.r": 2}, tokens_per_epoch=1000, config_yaml="seed: 0\n",
                                 history=[{"step": step}])


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def drop_size_of_state(d: Path) -> None:
    manifest = json.loads((d / "manifest.json").read_text())
    del manifest["files"]["state.pt"]["size"]
    (d / "manifest.json").write_text(json.dumps(manifest))


def adapter(d) -> dict:
    return load_file(f"{d}/adapter_model.safetensors" if Path(d, "adapter_model.safetensors").exists()
                     else f"{d}/adapter/adapter_model.safetensors")


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def controller_state(d: Path) -> dict:
    """The control law's state (λ, its integral, its filters) in checkpoint ``d``."""
    return json.loads((d / "controller.json").read_text())


def checkpoint_dirs(run_dir) -> list[Path]:
    return sorted(p for p in Path(run_dir).glob("checkpoint_*") if p.is_dir())


def wait_for(predicate, timeout_s: float, what: str):
    """The first truthy value of ``predicate()``; an exception counts as not yet (a busy state API, say)."""
    t0, last_error = time.time(), None
    while time.time() - t0 < timeout_s:
        try:
            value = predicate()
        except Exception as e:  # noqa: BLE001
            value, last_error = None, e
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what} (last error: {last_error!r})")


def held_pids(hold_dir: Path, world: int, kind: str = "pid") -> dict[int, int]:
    """rank -> pid of the workers that reached the hold step (``rank<R>.pid``, written by faults.hold_for_kill) or
    the pause step (``rank<R>.paused``, by faults.pause_until_go)."""
    files = sorted(hold_dir.glob(f"rank*.{kind}"))
    if len(files) < world:
        return {}
    return {int(f.name[4:].split(".")[0]): int(f.read_text().split()[0]) for f in files}


def mlflow_run(storage, name):
    """(the only MLflow run of this run name, its client); fails if there is not exactly one."""
    client, runs = mlflow_runs(storage, name)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0], client


# ---------------------------------------------------------------- checkpoints (no Ray)

def test_write_checkpoint_is_atomic_and_verifies(tmp_path, monkeypatch):
    model = tiny_peft()
    out = write(tmp_path / "checkpoint_00000010", model)
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(ckpt.REQUIRED) <= set(manifest["files"]) and manifest["step"] == 10
    assert ckpt.verify(out) is None
    assert not (tmp_path / "checkpoint_00000010.partial").exists()
    # a write that dies half-way leaves the previous checkpoint at that path untouched
    before = (out / "state.pt").read_bytes()

    def crash(*a, **k):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(OSError, match="injected"):
        write(out, model, step=20)
    monkeypatch.undo()
    assert ckpt.verify(out) is None and (out / "state.pt").read_bytes() == before
    assert ckpt.newest_good_local(tmp_path) == (out, [])  # the leftover .partial is ignored


@pytest.mark.parametrize("damage, reason", [
    (lambda d: truncate(d / "state.pt"), "truncated"),
    (lambda d: flip_byte(d / "adapter" / "adapter_model.safetensors"), "checksum mismatch"),
    (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    (lambda d: (d / "controller.json").unlink(), "missing file controller.json"),
    (lambda d: (d / "manifest.json").write_text("{not json"), "unreadable manifest"),
    (lambda d: (d / "manifest.json").write_text('{"files": {}}'), "manifest lists no"),
    (drop_size_of_state, "unreadable manifest: KeyError"),
], ids=["truncated", "bit-flip", "no-manifest", "file-missing", "manifest-not-json", "manifest-empty",
        "manifest-entry-malformed"])
def test_verify_names_what_is_wrong(tmp_path, damage, reason):
    out = write(tmp_path / "c", tiny_peft())
    damage(out)
    assert reason in ckpt.verify(out)


def test_fallback_to_previous_good_checkpoint_and_clear_error_when_none(tmp_path):
    from ray.train import Checkpoint

    from raytrain_scu.ray import hooks as launch

    model = tiny_peft()
    old, new = write(tmp_path / "checkpoint_00000010", model, 10), write(tmp_path / "checkpoint_00000020", model, 20)
    newest = write(tmp_path / "checkpoint_00000030", model, 30)  # newer than Ray's latest: on disk, so a candidate
    truncate(new / "state.pt")
    with contextlib.ExitStack() as stack:
        local, problems = launch.open_checkpoint(Checkpoint.from_directory(str(new)), stack)
    assert local == newest and problems == []  # the newest good one on disk (issue #16), not Ray's latest
    truncate(newest / "state.pt")
    with contextlib.ExitStack() as stack, pytest.warns(UserWarning, match="skipped bad checkpoint.*truncated"):
        local, problems = launch.open_checkpoint(Checkpoint.from_directory(str(new)), stack)
    assert local == old and len(problems) == 2 and "checkpoint_00000030" in problems[0]
    write(newest, model, 30)
    good, problems = ckpt.newest_good_local(tmp_path)
    assert good.name == "checkpoint_00000030" and problems == []
    for d in checkpoint_dirs(tmp_path):
        flip_byte(d / "meta.json")
    with contextlib.ExitStack() as stack, pytest.raises(ckpt.CheckpointError, match="no usable checkpoint"):
        launch.open_checkpoint(Checkpoint.from_directory(str(new)), stack)
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint.*checkpoint_00000030.*use a new run.name"):
        ckpt.newest_good_local(tmp_path)
    assert ckpt.newest_good_local(tmp_path / "nothing-here") == (None, [])


def test_open_good_checkpoint_takes_plain_directories_and_opens_only_what_it_looks_at(tmp_path):
    """checkpoint.py without Ray: (name, open) pairs, newest first; an older one is opened only after a bad newer."""
    model = tiny_peft()
    dirs = {step: write(tmp_path / f"checkpoint_{step:08d}", model, step) for step in (10, 20, 30)}
    opened = []

    def candidates():
        def opener(d):
            return lambda: opened.append(d.name) or d
        return [(d.name, opener(d)) for _, d in sorted(dirs.items(), reverse=True)]

    assert ckpt.open_good_checkpoint(candidates()) == (dirs[30], []) and opened == ["checkpoint_00000030"]
    truncate(dirs[30] / "state.pt")
    opened.clear()
    with pytest.warns(UserWarning, match="skipped bad checkpoint"):
        local, problems = ckpt.open_good_checkpoint(candidates())
    assert local == dirs[20] and opened == ["checkpoint_00000030", "checkpoint_00000020"]
    assert len(problems) == 1 and problems[0].startswith("checkpoint_00000030: ")


def dropout_mask(model) -> torch.Tensor:
    """The mask the first LoRA dropout draws now (from the global torch RNG, as in training)."""
    drop = next(m for n, m in model.named_modules() if n.endswith("lora_dropout.default"))
    return drop.train()(torch.ones(4096)) != 0


def test_ranks_share_the_lora_init_but_draw_distinct_dropout_masks():
    from raytrain_scu.core.model.build import apply_lora, build_model

    def rank_model(r):  # the loop's seeding: one init seed for every rank, then a stream of the rank's own
        torch.manual_seed(0)
        model = apply_lora(build_model("tiny", vocab_size=256), r=2, alpha=4, dropout=0.1, targets=["q_proj"])
        ckpt.seed_all(ckpt.rank_seed(0, r))
        return model, dropout_mask(model)

    (m0, mask0), (m1, mask1), (_, mask0_again) = rank_model(0), rank_model(1), rank_model(0)
    lora0, lora1 = ({n: p for n, p in m.named_parameters() if "lora_" in n} for m in (m0, m1))
    assert lora0 and all(torch.equal(lora0[n], lora1[n]) for n in lora0)
    assert not torch.equal(mask0, mask1) and torch.equal(mask0, mask0_again)
    assert 0.05 < 1 - mask0.float().mean() < 0.15  # the dropout rate
    # distinct per rank and per restart step, and not the init seed's own stream
    assert len({ckpt.rank_seed(0, r, s) for r in range(4) for s in (0, 10)} | {0}) == 9


def test_each_rank_restores_its_own_rng_and_a_changed_world_size_restores_none(tmp_path):
    model = tiny_peft()
    states = []
    for r in range(2):  # two ranks' RNG, as the loop gathers them before rank 0 writes
        ckpt.seed_all(ckpt.rank_seed(0, r))
        states.append(ckpt.rng_state())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    out = ckpt.write_checkpoint(tmp_path / "c", model=model, optimizer=opt, scaler=scaler, controller_state={},
                                step=10, position=0, structure={}, tokens_per_epoch=1000, config_yaml="",
                                history=[], rng_states=states)
    for r in range(2):
        ckpt.seed_all(123)
        meta = ckpt.load_training_state(out, model=model, optimizer=opt, scaler=scaler, rank=r, world_size=2)
        assert meta["rng_ranks"] == 2 and torch.equal(torch.random.get_rng_state(), states[r]["torch"])
    ckpt.seed_all(123)
    before = torch.random.get_rng_state()
    meta = ckpt.load_training_state(out, model=model, optimizer=opt, scaler=scaler, rank=0, world_size=3)
    assert meta["rng_ranks"] == 2 and torch.equal(torch.random.get_rng_state(), before)  # the loop reseeds


def test_changed_tokens_per_epoch_is_refused_unless_overridden():
    meta = {"step": 10, "tokens_per_epoch": 204544}
    assert ckpt.check_tokens_per_epoch(meta, measured=204544, override=0, streamed=False, plan="") is None
    with pytest.raises(ckpt.CheckpointError, match=r"tokens_per_epoch=204544 but the data now gives "
                       r"tokens_per_epoch=140416.*set controller.tokens_per_epoch=204544"):
        ckpt.check_tokens_per_epoch(meta, measured=140416, override=0, streamed=False, plan="")
    # an explicit controller.tokens_per_epoch wins: as the checkpoint's, silently; else with a warning
    assert ckpt.check_tokens_per_epoch(meta, measured=140416, override=204544, streamed=False, plan="") is None
    note = ckpt.check_tokens_per_epoch(meta, measured=204544, override=102272, streamed=False, plan="")
    assert "controller.tokens_per_epoch=102272 overrides the checkpoint's tokens_per_epoch=204544" in note
    assert "x2 from step 10" in note


def resume_pick_worker(r: int, port: int, roots: list, out: str) -> None:
    """Rank ``r`` of a two-process gloo group: each rank sees its own copy of the run directory (as after each
    rank's own download), opens the given latest checkpoint and records the step it would resume from."""
    from datetime import timedelta

    import torch.distributed as tdist

    from raytrain_scu.worker.hooks import LocalHooks

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                             timeout=timedelta(seconds=60))
    results = {}
    for case in sorted(os.listdir(roots[r])):
        # the run directory's checkpoints, newest first, as Ray's candidates are (without importing Ray in the two
        # spawned processes: the candidates' listing is test_resume_considers_every_checkpoint_on_disk_newest_first)
        hooks = LocalHooks(device=torch.device("cpu"), run_dir=Path(roots[r]) / case)
        try:
            with contextlib.ExitStack() as stack:
                local, _ = hooks.open_checkpoint(stack)
                results[case] = ckpt.read_meta(local)["step"]
        except ckpt.CheckpointError as e:
            results[case] = str(e)
    Path(out, f"rank{r}.json").write_text(json.dumps(results))
    tdist.destroy_process_group()


@pytest.mark.slow
def test_ranks_resume_from_the_checkpoint_rank0_picks_or_all_fail_loudly(tmp_path):
    import torch.multiprocessing as mp

    model = tiny_peft()
    roots = [tmp_path / "rank0", tmp_path / "rank1"]
    for case in ("rank0-latest-bad", "rank1-latest-bad"):
        for step in (10, 20):
            write(roots[0] / case / f"checkpoint_{step:08d}", model, step)
        shutil.copytree(roots[0] / case, roots[1] / case)
    truncate(roots[0] / "rank0-latest-bad" / "checkpoint_00000020" / "state.pt")  # rank 0's download failed
    truncate(roots[1] / "rank1-latest-bad" / "checkpoint_00000020" / "state.pt")  # rank 1's download failed
    mp.start_processes(resume_pick_worker, args=(free_port(), [str(r) for r in roots], str(tmp_path)), nprocs=2,
                       start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # rank 1 alone would take its good step 20: it follows rank 0's fallback to 10
    assert [g["rank0-latest-bad"] for g in got] == [10, 10]
    # rank 1 cannot read rank 0's pick: both ranks stop, naming it, instead of resuming from 20 and 10
    for g in got:
        assert isinstance(g["rank1-latest-bad"], str), got
        assert "rank 0 picked checkpoint_00000020 (step 20)" in g["rank1-latest-bad"]
        assert "rank 1: state.pt has" in g["rank1-latest-bad"] and "truncated" in g["rank1-latest-bad"]


def assert_close_tree(a, b, tol=1e-6, where="controller"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_close_tree(a[k], b[k], tol, f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_tree(x, y, tol, f"{where}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, abs=tol), where
    else:
        assert a == b, where


def figures(**kw) -> None:
    """The numbers docs/reliability.md quotes; `pytest -s` shows them."""
    print("RELIABILITY " + json.dumps(kw))


# ---------------------------------------------------------------- workers killed (SIGKILL) or hung (SIGSTOP)

# the last step's adapter is the run's output (run.primary_adapter=last), so the faulty run's end is compared
FAULT_RUN = ["train.max_steps=30", "train.checkpoint_every=10", "train.report_every=5", "run.max_failures=2",
             "run.primary_adapter=last"]
PREEMPT_SEED = 54  # the seed of the steps the preemption tests signal at: kept, so that a failure is reproducible


@pytest.fixture(scope="module")
def clean_run(ray_local, tmp_path_factory):
    """(summary, seconds) of one uninterrupted 2-worker run of FAULT_RUN: the run that the run with a killed and a
    hung worker must end equal to."""
    from raytrain_scu.driver.run import run

    t0 = time.time()
    clean = run(tiny_cfg(tmp_path_factory.mktemp("clean"), "clean", "tracking.enabled=false", *FAULT_RUN),
                quiet=True)
    return clean, time.time() - t0


def assert_same_end(clean: dict, faulty: dict) -> float:
    """The faulty run ended where the uninterrupted one did: final adapter and controller state within 1e-6; returns
    the adapter's max |Δ|."""
    diff = max_abs_diff(adapter(clean["adapter"]), adapter(faulty["adapter"]))
    assert diff <= 1e-6
    ends = [checkpoint_dirs(s["run_dir"])[-1] for s in (clean, faulty)]
    assert_close_tree(*(json.loads((d / "controller.json").read_text()) for d in ends))
    return diff


def stop_one_worker(hold: Path, out: dict, rank: int = 1) -> None:
    """Once both workers paused (RAYTRAIN_SCU_PAUSE_AT_STEP): SIGSTOP rank ``rank``, let the other go on (into the next
    step's all-reduce, where it waits for the stopped one), and wait for the watchdog to kill the stopped process. A
    watchdog that never fires fails the test instead of hanging it: after 300 s this kills it."""
    import psutil

    try:
        pids = wait_for(lambda: held_pids(hold, 2, "paused"), 300, "both workers to pause")
        # the clock: the later rank's file, written just after its heartbeat of the pause step
        out.update(pid=pids[rank], cmdline=" ".join(psutil.Process(pids[rank]).cmdline()),
                   t=max(f.stat().st_mtime for f in hold.glob("rank*.paused")))
        os.kill(pids[rank], signal.SIGSTOP)
        (hold / "go").touch()
        t0 = time.time()
        while psutil.pid_exists(pids[rank]) and psutil.Process(pids[rank]).status() != psutil.STATUS_ZOMBIE:
            if time.time() - t0 > 300:
                out["error"] = "the stopped worker was never killed"
                os.kill(pids[rank], signal.SIGKILL)
                return
            time.sleep(0.5)
        out["killed_after_s"] = time.time() - out["t"]
    except Exception as e:  # noqa: BLE001 - reported by the test body
        out["error"] = repr(e)


def kill_rank0_at_the_hold(hold: Path, run_dir: Path, out: dict) -> None:
    """Once both workers hold after step 15 (RAYTRAIN_SCU_HOLD_AT_STEP): SIGKILL rank 0, the checkpoint writer and
    MLflow client; ``out`` gets its pid, the step it finished and the checkpoints on disk at that moment."""
    import psutil

    try:
        pids = wait_for(lambda: held_pids(hold, 2), 300, "both workers to reach step 15")
        step = int((hold / "rank0.pid").read_text().split()[1])  # the step rank 0 had finished
        out.update(pid=pids[0], step=step, cmdline=" ".join(psutil.Process(pids[0]).cmdline()), t=time.time(),
                   ckpts=[p.name for p in checkpoint_dirs(run_dir)])
        os.kill(pids[0], signal.SIGKILL)
    except Exception as e:  # noqa: BLE001 - reported by the test body
        out["error"] = repr(e)


@pytest.mark.slow
def test_a_killed_worker_then_a_hung_one_and_the_run_recovers_exactly(clean_run, tmp_path, monkeypatch, capsys):
    """One 2-worker run of 30 steps, two faults, each followed by a restart from the newest checkpoint:
    - killed: both ranks hold after step 15; rank 0 (the checkpoint writer and MLflow client) is SIGKILLed 5 steps
      after checkpoint 10, which this attempt wrote: the restart resumes from it (Ray had committed it) and redoes
      the 5 steps;
    - hung: the restarted ranks pause after step 20 and its checkpoint; rank 1 is stopped (SIGSTOP) and rank 0 goes
      on into step 21's all-reduce, where it waits. The driver's watchdog sees no step for train.hang_timeout_s,
      kills the worker group from outside (a stopped process runs nothing) and says so in one line; the restart
      resumes from checkpoint 20: no step is lost.
    The run ends where the uninterrupted one does (adapter and controller state within 1e-6), with one MLflow run
    that logged every step exactly once."""
    import psutil

    from raytrain_scu.driver.run import run

    clean, clean_s = clean_run
    hold = tmp_path / "hold"
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_AT_STEP", "15")  # after step 15, the first time: wait to be killed
    monkeypatch.setenv("RAYTRAIN_SCU_PAUSE_AT_STEP", "20")  # after step 20 and its checkpoint, until hold/go
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_DIR", str(hold))
    kill, stop = {}, {}

    def faults():
        kill_rank0_at_the_hold(hold, tmp_path / "faulty", kill)
        if "error" not in kill:
            stop_one_worker(hold, stop)

    threading.Thread(target=faults, daemon=True).start()
    t0 = time.time()
    faulty = run(tiny_cfg(tmp_path, "faulty", *FAULT_RUN, "train.hang_timeout_s=30"), quiet=True)
    faulty_s = time.time() - t0
    out = capsys.readouterr().out

    # killed: rank 0 after step 15, while checkpoint 10 (this attempt's own) was the newest
    assert "error" not in kill and "RayTrainWorker" in kill["cmdline"], kill
    assert kill["step"] == 15 and kill["ckpts"] == ["checkpoint_00000010"], kill
    assert not psutil.pid_exists(kill["pid"]) or psutil.Process(kill["pid"]).status() == psutil.STATUS_ZOMBIE

    # hung: a worker of the restarted group, found from outside after the timeout, not much later, and said once
    assert "error" not in stop and "RayTrainWorker" in stop["cmdline"] and stop["pid"] != kill["pid"], stop
    assert 29.5 <= stop["killed_after_s"] < 30 + 60, stop
    notice = [line for line in out.splitlines() if "no step completed in" in line]
    assert len(notice) == 1 and "train.hang_timeout_s=30" in notice[0] and str(stop["pid"]) in notice[0], out
    assert "killed the worker group" in notice[0] and "last completed step 20" in notice[0]

    # it completed; the restarts resumed from checkpoint 10 (not from step 0) and then from checkpoint 20
    assert faulty["steps"] == 30
    last = checkpoint_dirs(tmp_path / "faulty")[-1]
    assert last.name == "checkpoint_00000030"
    resumed_at = ckpt.read_meta(last)["resumed_at"]
    assert resumed_at == [10, 20]
    steps_lost = [kill["step"] - resumed_at[0], 20 - resumed_at[1]]  # redone after each fault
    assert steps_lost == [5, 0]  # bound: train.checkpoint_every

    # same final adapter and controller state as the uninterrupted run, within 1e-6 (figures() prints the max |Δ|)
    diff = assert_same_end(clean, faulty)

    # one MLflow run; every step logged exactly once
    mrun, client = mlflow_run(tmp_path, "faulty")
    assert mrun.info.status == "FINISHED"
    for key in ("ctrl/lambda", "train/data_bpt"):
        steps = [m.step for m in client.get_metric_history(mrun.info.run_id, key)]
        assert sorted(steps) == list(range(0 if key == "ctrl/lambda" else 1, 31)), key
    figures(test="sigkill+sigstop", kill_step=kill["step"], stop_step=20, resumed_at=resumed_at,
            steps_lost=steps_lost, adapter_max_abs_diff=diff, killed_after_s=round(stop["killed_after_s"], 1),
            clean_s=round(clean_s, 1), faulty_run_s=round(faulty_s, 1))


def sigterm_at_the_pause(hold: Path, ray_logs: Path, out: dict, world: int = 2, rank: int = 1) -> None:
    """Once all ``world`` workers paused (RAYTRAIN_SCU_PAUSE_AT_STEP): SIGTERM rank ``rank``'s process and, once its
    log says it took the signal for a preemption notice (the worker's main thread runs the handler at its next task:
    the controller's poll), let all go on, so the next step's all-reduce reads the notice."""
    import psutil

    try:
        pids = wait_for(lambda: held_pids(hold, world, "paused"), 300, "the workers to pause")
        out.update(pid=pids[rank], cmdline=" ".join(psutil.Process(pids[rank]).cmdline()))
        os.kill(pids[rank], signal.SIGTERM)
        took, logs = f"rank {rank} got SIGTERM", f"worker-*-{pids[rank]}.err"
        wait_for(lambda: any(took in f.read_text(errors="replace") for f in ray_logs.glob(logs)), 60,
                 f"rank {rank} to take the notice")
        (hold / "go").touch()
    except Exception as e:  # noqa: BLE001 - reported by the test body
        out["error"] = repr(e)


@pytest.mark.slow
def test_sigterm_to_the_driver_then_to_a_worker_checkpoints_the_step_in_flight_and_ends_as_the_clean_run(
        clean_run, ray_address, tmp_path, monkeypatch, capsys):
    """Two preemptions of one 2-worker run of FAULT_RUN, each at a step drawn with a kept seed (PREEMPT_SEED), neither
    a report nor a checkpoint step:
    - the driver (a CLI joined to the session's Ray) gets SIGTERM while both workers are paused after step k1: it
      writes STOP, the workers finish step k1 + 1 and rank 0 checkpoints it, and the driver exits 143 within
      train.preempt_grace_s, saying so and how to resume;
    - the same run, re-run (here in this process), resumes at k1 + 1; rank 1's process gets SIGTERM while both are
      paused after step k2, which Ray Train takes for its preemption notice: both ranks finish step k2 + 1, rank 0
      checkpoints it, and Ray Train restarts the group from it (its preemption path, not a failure).
    Each time the step in flight was checkpointed, so nothing before it is redone; the run ends with the clean run's
    final adapter and controller state (λ), bit for bit."""
    import random

    import psutil

    from raytrain_scu.driver.run import run
    from raytrain_scu.ray.launch import logs_dir

    clean, _ = clean_run
    rng = random.Random(PREEMPT_SEED)
    k1 = rng.choice([k for k in range(11, 20) if k % 5])
    k2 = rng.choice([k for k in range(k1 + 3, 29) if k % 5])
    hold1, hold2 = tmp_path / "hold1", tmp_path / "hold2"
    args = [f"run.storage_path={tmp_path}", "run.name=pre", "tracking.enabled=false", *FAULT_RUN]
    t0 = time.time()
    driver = launch_cli(*args, env={"RAY_ADDRESS": ray_address, "RAYTRAIN_SCU_PAUSE_AT_STEP": str(k1),
                                    "RAYTRAIN_SCU_HOLD_DIR": str(hold1)}, out=tmp_path / "driver")
    try:
        wait_for(lambda: held_pids(hold1, 2, "paused") or driver.poll() is not None, 300, "the workers to pause")
        assert driver.poll() is None, (tmp_path / "driver.err").read_text()[-3000:]
        os.kill(driver.pid, signal.SIGTERM)
        t_term = time.time()
        wait_for(lambda: (tmp_path / "pre" / "STOP").exists(), 30, "the driver to write STOP")
        (hold1 / "go").touch()
        rc = driver.wait(timeout=120)
        exit_s = time.time() - t_term
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    first_s = time.time() - t0
    out, err = (tmp_path / "driver.out").read_text(), (tmp_path / "driver.err").read_text()
    assert rc == 143, out[-2000:] + err[-3000:]
    assert exit_s < 25, exit_s  # train.preempt_grace_s
    line = [x for x in out.splitlines() if "preempted at step" in x]
    assert len(line) == 1 and f"preempted at step {k1 + 1}; checkpoint written; re-run the same command to resume: " \
        f"python -m raytrain_scu.train {TINY}" in line[0], out[-2000:]
    assert checkpoint_dirs(tmp_path / "pre")[-1].name == f"checkpoint_{k1 + 1:08d}"
    assert not (tmp_path / "pre" / "STOP").exists()

    monkeypatch.setenv("RAYTRAIN_SCU_PAUSE_AT_STEP", str(k2))
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_DIR", str(hold2))
    term = {}
    threading.Thread(target=sigterm_at_the_pause, args=(hold2, logs_dir(), term), daemon=True).start()
    t1 = time.time()
    summary = run(tiny_cfg(tmp_path, "pre", "tracking.enabled=false", *FAULT_RUN), quiet=True)
    second_s = time.time() - t1
    console = capsys.readouterr().out
    assert "error" not in term and "RayTrainWorker" in term["cmdline"], term
    assert not psutil.pid_exists(term["pid"]) or psutil.Process(term["pid"]).status() == psutil.STATUS_ZOMBIE
    assert f"resuming from checkpoint_{k1 + 1:08d}" in console and "started again (attempt 2)" in console, console
    assert summary["steps"] == 30
    last = checkpoint_dirs(tmp_path / "pre")[-1]
    assert last.name == "checkpoint_00000030"
    resumed_at = ckpt.read_meta(last)["resumed_at"]
    assert resumed_at == [k1 + 1, k2 + 1]  # the steps in flight at each SIGTERM: none before them redone
    # the restart was Ray Train's preemption path (its own retry budget), not a worker failure: its controller says so
    said = "".join(f.read_text(errors="replace") for f in (tmp_path / "pre" / "logs").glob("*.err"))
    assert "ray.train.PreemptionError: Training was interrupted by node preemption (preempted_ranks=[1]" in said
    assert max_abs_diff(adapter(clean["adapter"]), adapter(summary["adapter"])) == 0.0
    ends = [checkpoint_dirs(s["run_dir"])[-1] for s in (clean, summary)]
    assert controller_state(ends[0]) == controller_state(ends[1])
    figures(test="preempt", k1=k1, k2=k2, resumed_at=resumed_at, driver_exit_after_sigterm_s=round(exit_s, 1),
            first_run_s=round(first_s, 1), second_run_s=round(second_s, 1))


def test_rays_checkpoint_manager_ranks_an_unscored_checkpoint_last_and_reads_it_back(tmp_path):
    """What a checkpoint's score (ckpt.BEST_METRIC) relies on in Ray Train's own checkpoint manager, under the run's
    CheckpointConfig (ray.launch.build_trainer) with run.num_to_keep=1: after step 2's (the best) and step 3's, which
    has no evaluation of its own, which checkpoints are kept; then, in a new manager on the same run directory (a
    re-run of the run name reads Ray's snapshot back), after step 4's. UNSCORED ranks last, is kept while it is the
    latest and survives the snapshot. A missing score ranks best and step 3's last evaluation's value ties step 2's,
    each displacing the evaluated best; NaN ranks last but comes back from the snapshot as null, which Ray cannot
    rank: the re-run's next checkpoint fails."""
    import asyncio

    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.context import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    from raytrain_scu.ray.launch import build_trainer

    config = build_trainer(tiny_cfg(tmp_path, "ranks", "run.num_to_keep=1"), use_gpu=False,
                           run_id=None).run_config.checkpoint_config

    async def kept(name: str, step3: dict) -> tuple[list, object]:
        storage = StorageContext(storage_path=str(tmp_path), experiment_dir_name=name)

        def register(manager, step: int, metrics: dict) -> list:
            (tmp_path / name / f"checkpoint_{step:08d}").mkdir(parents=True)
            checkpoint = Checkpoint(str(tmp_path / name / f"checkpoint_{step:08d}"))
            manager.register_checkpoint(_TrainingReport(checkpoint, {"step": step, **metrics}, False))
            return [int(d.name[-8:]) for d in checkpoint_dirs(tmp_path / name)]

        manager = CheckpointManager(config, storage)
        for step, score in ((1, 2.0), (2, 1.0)):
            register(manager, step, {ckpt.BEST_METRIC: score})
        after3 = register(manager, 3, step3)
        try:
            return after3, register(CheckpointManager(config, storage), 4, {ckpt.BEST_METRIC: 1.5})
        except TypeError as e:
            return after3, e

    after3, rerun = asyncio.run(kept("unscored", {ckpt.BEST_METRIC: ckpt.UNSCORED}))
    assert after3 == [2, 3] and rerun == [2, 4]
    assert asyncio.run(kept("missing", {}))[0] == [3]
    assert asyncio.run(kept("tie", {ckpt.BEST_METRIC: 1.0}))[0] == [3]
    after3, rerun = asyncio.run(kept("nan", {ckpt.BEST_METRIC: float("nan")}))
    assert after3 == [2, 3] and "NoneType" in str(rerun)


@pytest.mark.parametrize("scored", [True, False])
def test_a_snapshot_of_checkpoints_reported_without_their_score_is_scored_before_ray_reads_it_back(tmp_path, scored):
    """A run whose checkpoints were reported without ckpt.BEST_METRIC: steps 1 and 2 evaluated at their own step
    (held-out BPT 2.0, 1.0), step 3 a preemption's (its report carries step 2's evaluation). registered.score_snapshot
    gives each its own step's value or UNSCORED, so that the re-run's manager (run.num_to_keep=1) keeps the evaluated
    best (step 2) and the latest after step 4's (1.5); left as they were, the unscored ones rank best under "min" and
    the evaluated best goes."""
    import asyncio

    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.context import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    from raytrain_scu.core.registered import score_snapshot
    from raytrain_scu.ray.launch import build_trainer

    def config(keep: int):
        return build_trainer(tiny_cfg(tmp_path, "old", f"run.num_to_keep={keep}"), use_gpu=False,
                             run_id=None).run_config.checkpoint_config

    async def run() -> list:
        storage = StorageContext(storage_path=str(tmp_path), experiment_dir_name="old")

        def register(manager, step: int, metrics: dict) -> None:
            (tmp_path / "old" / f"checkpoint_{step:08d}").mkdir(parents=True)
            checkpoint = Checkpoint(str(tmp_path / "old" / f"checkpoint_{step:08d}"))
            manager.register_checkpoint(_TrainingReport(checkpoint, {"step": step, **metrics}, False))

        old = CheckpointManager(config(3), storage)
        for step, (val, val_step) in ((1, (2.0, 1)), (2, (1.0, 2)), (3, (1.0, 2))):
            register(old, step, {"val/data_bpt": val, "val/step": val_step})
        if scored:
            assert score_snapshot(tmp_path / "old", ckpt.BEST_METRIC, ckpt.UNSCORED) == 3
        register(CheckpointManager(config(1), storage), 4, {ckpt.BEST_METRIC: 1.5, "val/data_bpt": 1.5,
                                                            "val/step": 4})
        return [int(d.name[-8:]) for d in checkpoint_dirs(tmp_path / "old")]

    assert asyncio.run(run()) == ([2, 4] if scored else [3, 4])
    if scored:
        assert score_snapshot(tmp_path / "old", ckpt.BEST_METRIC, ckpt.UNSCORED) == 0  # every one has its score now


# one worker, a checkpoint and an evaluation every 2 steps, one checkpoint kept besides the latest; at this learning
# rate the held-out BPT is lowest at step 6 and higher again at step 8
RANKED_RUN = ["tracking.enabled=false", "scaling.num_workers=1", "train.max_steps=8", "train.checkpoint_every=2",
              "train.eval_every=2", "train.report_every=2", "optim.lr=0.1", "run.num_to_keep=1"]


@pytest.mark.slow
def test_a_preemptions_checkpoint_is_kept_for_the_resume_and_never_displaces_the_evaluated_best(
        ray_local, tmp_path, monkeypatch):
    """The worker's SIGTERM after step 6 (Ray Train's preemption path) makes step 7's checkpoint a preemption's, with
    no evaluation of its own: its val/data_bpt is step 6's. Scored on it, it would tie step 6's checkpoint and, the
    later one, displace it under run.num_to_keep=1. Ranked last, it is kept while it is the newest, the restart
    resumes from it, and it goes once step 8's is in; step 6's, the lowest held-out BPT, stays and is the run's
    adapter (run.primary_adapter=best)."""
    from raytrain_scu.driver.run import run
    from raytrain_scu.ray.launch import logs_dir

    hold, term = tmp_path / "hold", {}
    monkeypatch.setenv("RAYTRAIN_SCU_PAUSE_AT_STEP", "6")
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_DIR", str(hold))
    threading.Thread(target=sigterm_at_the_pause, args=(hold, logs_dir(), term, 1, 0), daemon=True).start()
    summary = run(tiny_cfg(tmp_path, "ranked", *RANKED_RUN), quiet=True)
    assert "error" not in term, term
    dirs = checkpoint_dirs(tmp_path / "ranked")
    rows = {r["step"]: r for r in torch.load(dirs[-1] / "state.pt", weights_only=False)["history"]}
    val = {k: rows[k]["val/data_bpt"] for k in (2, 4, 6, 8)}
    assert min(val, key=val.get) == 6 and val[8] > val[6], val  # the run this test needs
    assert ckpt.read_meta(dirs[-1])["resumed_at"] == [7]  # the restart resumed from the preemption's checkpoint
    assert [int(d.name[-8:]) for d in dirs] == [6, 8]  # the evaluated best and the latest
    assert (summary["best_step"], summary["best_val_bpt"], summary["adapter_step"]) == (6, val[6], 6)
    assert max_abs_diff(adapter(summary["adapter"]), adapter(dirs[0])) == 0.0


def test_the_drivers_sigterm_writes_stop_and_past_the_grace_or_again_it_exits_without_waiting(tmp_path, capsys):
    """The driver's SIGTERM (ray.stops.Stops, no Ray): the first writes the STOP flag the workers read, and the poll
    loop (not the handler) says so; once fit() returns short of max_steps it is a Preempted with the last report's
    checkpoint; past train.preempt_grace_s, or at a second SIGTERM, it is a Preempted at once, which still says
    whether the last report had a checkpoint and why it did not wait. Remote storage has no flag: the first one is.
    The console line names each case, and says no step before the first report."""
    from raytrain_scu.cli.train import preempted_line
    from raytrain_scu.console import Progress
    from raytrain_scu.errors import Preempted
    from raytrain_scu.ray.stops import Stops

    last = {"step": 15, "checkpoint": True}
    cfg = tiny_cfg(tmp_path, "stops", "train.preempt_grace_s=0.2")
    flag = tmp_path / "stops" / "STOP"
    said = "SIGTERM: stopping after this step and writing its checkpoint, then exiting 143 (within " \
           "train.preempt_grace_s=0.2 s)"
    with Stops(cfg, Progress(), last) as stops:
        stops.handle(signal.SIGTERM, None)
        assert flag.read_text() == "stop\n"
        assert said not in capsys.readouterr().out  # nothing printed inside the signal handler
        stops.check()  # within the grace: the workers are checkpointing; the poll loop says what the signal did
        assert capsys.readouterr().out.count(said) == 1
        with pytest.raises(Preempted) as after:
            stops.raise_after(cfg.train.max_steps)
        assert (after.value.step, after.value.checkpointed, after.value.why) == (15, True, "")
        assert preempted_line(after.value, "CMD") == \
            "[raytrain_scu] preempted at step 15; checkpoint written; re-run the same command to resume: CMD"
        time.sleep(0.3)
        with pytest.raises(Preempted) as late:
            stops.check()
        assert (late.value.step, late.value.checkpointed) == (15, True)  # step 15's report carried its checkpoint
        assert preempted_line(late.value, "CMD") == (
            "[raytrain_scu] preempted at step 15; checkpoint written (train.preempt_grace_s=0.2 s ran out before the "
            "step in flight was checkpointed); re-run the same command to resume: CMD")
        last.update(step=16, checkpoint=False)
        with pytest.raises(Preempted) as again:
            stops.handle(signal.SIGTERM, None)
        assert (again.value.step, again.value.checkpointed, again.value.why) == (16, False, "a second SIGTERM")
        assert "preempted at step 16; no checkpoint of it (a second SIGTERM); re-run" in preempted_line(again.value, "")
    assert not flag.exists()  # a leftover would stop the next run at its first step
    last["step"] = cfg.train.max_steps
    stops.raise_after(cfg.train.max_steps)  # the run finished before it stopped: nothing to raise
    remote = tiny_cfg("s3://bucket/runs?endpoint_override=http://127.0.0.1:1", "stops", "tracking.enabled=false")
    last.update(step=None, checkpoint=False)
    with Stops(remote, Progress(), last) as stops, pytest.raises(Preempted) as at_once:
        stops.handle(signal.SIGTERM, None)
    assert preempted_line(at_once.value, "CMD") == (
        "[raytrain_scu] preempted before the first report (remote storage has no stop flag: the run cannot stop "
        "after a step); re-run the same command to resume: CMD")


class FakeHeartbeats:
    """Stands in for the Heartbeats actor's handle: ``beat.remote(...)`` records the step sent."""

    def __init__(self):
        self.steps = []
        self.beat = self
        self.remote = lambda rank, pid, node, step: self.steps.append(step)


def test_heartbeats_are_throttled_but_the_first_a_reported_and_the_last_are_always_sent():
    from raytrain_scu.ray.watchdog import Heartbeat, beat_every_s, stalled

    assert beat_every_s(30) == 1.0 and beat_every_s(2) == pytest.approx(0.2)
    actor, now = FakeHeartbeats(), [0.0]
    beat = Heartbeat(actor, rank=0, node_id="n", every_s=1.0, clock=lambda: now[0])
    for step in range(1, 11):  # 0.25 s a step: one beat a second, not one a step
        beat(step)
        now[0] += 0.25
    assert actor.steps == [1, 5, 9]
    beat.reported()  # a reporting step's beat goes out within the interval
    beat(11)
    beat(12)
    beat(None)  # done stepping: always sent
    assert actor.steps == [1, 5, 9, 11, None]
    # the watchdog waits the interval beyond the timeout: a beat 30.5 s old is no hang at a 30 s timeout
    beats = {0: (1, "n", 26, 30.5)}
    assert stalled(1, beats, 30 + beat_every_s(30)) is None and stalled(1, {0: (1, "n", 26, 31.5)}, 31) == 31.5


def test_an_attempt_with_an_exited_rank_on_this_node_is_a_crash_the_watchdog_leaves_to_ray():
    """A rank killed while the other waits in a collective: the survivor is quiet past the timeout until Ray Train
    tears the group down, which on a loaded machine can take longer than the timeout. The watchdog sees the exited
    rank (a zombie or gone) and gives the teardown another timeout before it kills what is left; a rank on another
    node is not looked at from here."""
    import subprocess
    import sys

    from raytrain_scu.ray.watchdog import crashed

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        import psutil

        wait_for(lambda: psutil.Process(dead.pid).status() == psutil.STATUS_ZOMBIE, 30, "the short process to exit")
        assert not crashed({0: (live.pid, "here", 15, 40.0), 1: (os.getpid(), "here", 15, 40.0)}, "here")
        assert crashed({0: (dead.pid, "here", 15, 40.0), 1: (live.pid, "here", 15, 40.0)}, "here")
        dead.wait()
        assert crashed({0: (dead.pid, "here", 15, 40.0), 1: (live.pid, "here", 15, 40.0)}, "here")  # reaped: gone
        assert not crashed({0: (dead.pid, "elsewhere", 15, 40.0), 1: (live.pid, "here", 15, 40.0)}, "here")
    finally:
        live.kill()
        live.wait()

    from raytrain_scu.ray.watchdog import HangWatchdog

    dog = object.__new__(HangWatchdog)  # its decision alone: no heartbeat actor, no thread
    dog.timeout_s, dog.crash_seen = 30.0, {}
    assert dog.due(1, False, 100.0)  # stalled and every rank alive: a hang, killed at once
    assert not dog.due(2, True, 100.0) and not dog.due(2, True, 130.0)  # a crash: Ray gets another timeout
    assert dog.due(2, True, 130.5)  # a teardown that never finishes is killed after it


def test_the_watchdog_actor_is_killed_when_building_the_trainer_fails(ray_local, tmp_path, monkeypatch):
    """The hang watchdog's heartbeat actor starts before the trainer is built: an error there still kills it."""
    import ray

    from raytrain_scu.driver import run as run_mod
    from raytrain_scu.ray import launch

    seen = {}

    def failing_build(cfg, *, watchdog, **kwargs):
        seen["actor"] = watchdog.actor
        assert ray.get(watchdog.actor.read.remote(), timeout=60)[0] == 0  # alive while the trainer is built
        raise RuntimeError("no trainer")

    monkeypatch.setattr(launch, "build_trainer", failing_build)
    cfg = tiny_cfg(tmp_path, "leak", "train.hang_timeout_s=30", "tracking.enabled=false")
    facts = {"use_gpu": False, "model": "tiny", "train_blocks": 1, "val_blocks": 1, "tokens_per_epoch": 1,
             "tokens_per_epoch_from": "measured", "unit": "blocks", "examples": ""}
    with pytest.raises(RuntimeError, match="no trainer"):
        run_mod._launch(cfg, facts, None, verbose=False)
    deadline = time.monotonic() + 60  # ray.kill is asynchronous: a call may still land before the kill does
    while True:
        try:
            ray.get(seen["actor"].read.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the heartbeat actor outlived the failed launch"
        time.sleep(0.5)


# ---------------------------------------------------------------- non-finite loss or gradients

@pytest.mark.parametrize("data_bpt,param_bpt,grad_norm,loss_scaling,outcome", [
    (3.0, 0.1, 1.0, True, "ok"), (3.0, 0.1, 1.0, False, "ok"),
    (3.0, 0.1, float("inf"), True, "overflow"),     # fp16: GradScaler's ordinary overflow, not a failure
    (3.0, 0.1, float("nan"), True, "overflow"),
    (3.0, 0.1, float("inf"), False, "skipped"),     # bf16/fp32: nothing lowers a scale, so it is skipped
    (float("nan"), 0.1, float("nan"), True, "skipped"),  # a non-finite loss is skipped, with or without a scaler
    (3.0, float("inf"), 1.0, True, "skipped"), (float("inf"), 0.1, 1.0, False, "skipped")])
def test_step_outcome_tells_an_fp16_overflow_from_a_nonfinite_loss(data_bpt, param_bpt, grad_norm, loss_scaling,
                                                                   outcome):
    from raytrain_scu.worker.state import step_outcome

    assert step_outcome(data_bpt, param_bpt, grad_norm, loss_scaling=loss_scaling) == outcome


def test_a_real_grad_scaler_overflow_is_an_overflow_not_a_skipped_step():
    """The loop's optimizer step with a real GradScaler (on CPU; fp16 runs need CUDA): an inf gradient under a
    finite loss is skipped by the scaler, which halves its scale; a NaN loss is skipped by us and also backs off."""
    from raytrain_scu.worker.state import optimizer_step

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x = torch.randn(8, 4)

    def step(inf_grad=False, nan_loss=False):
        loss = layer(x).pow(2).mean() * (float("nan") if nan_loss else 1.0)
        scaler.scale(loss).backward()
        if inf_grad:
            layer.weight.grad[0, 0] = float("inf")  # what an fp16 overflow in the backward pass leaves
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(layer.parameters(), 1e30)
        return optimizer_step(opt, scaler, data_bpt=float(loss.detach()), param_bpt=0.1, grad_norm=float(norm))

    w0 = layer.weight.detach().clone()
    assert step(inf_grad=True) == "overflow"
    assert torch.equal(layer.weight, w0) and scaler.get_scale() == 2.0**15 and not opt.state
    assert step() == "ok"
    w1 = layer.weight.detach().clone()
    assert not torch.equal(w1, w0) and scaler.get_scale() == 2.0**15
    assert step(nan_loss=True) == "skipped"
    assert torch.equal(layer.weight, w1) and scaler.get_scale() == 2.0**14
    assert step() == "ok" and not torch.equal(layer.weight, w1)  # the scaler is ready for the next step
    # no loss scaling (bf16/fp32): an inf gradient is a skipped step, the weights stay
    plain = torch.amp.GradScaler("cpu", enabled=False)
    loss = layer(x).pow(2).mean()
    loss.backward()
    layer.bias.grad[0] = float("inf")
    w2 = layer.weight.detach().clone()
    norm = torch.nn.utils.clip_grad_norm_(layer.parameters(), 1e30)
    assert optimizer_step(opt, plain, data_bpt=float(loss.detach()), param_bpt=0.1, grad_norm=float(norm)) == "skipped"
    assert torch.equal(layer.weight, w2) and layer.weight.grad is None


def test_a_step_launched_on_the_device_is_skipped_there_when_a_number_is_nonfinite():
    """The loop's path without a host sync (bf16/fp32, fused AdamW): the step is launched before the host reads the
    step's numbers, and a non-finite flag leaves the weights, AdamW's moments and its step count as they were; fp16's
    loss scaler keeps the host path."""
    from raytrain_scu.worker.state import Optimisation

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    opt = Optimisation(model=layer, params=list(layer.parameters()), loss_model=layer, centers=[None, None],
                       optimizer=torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True),
                       scaler=torch.amp.GradScaler("cpu", enabled=False), autocast=None)
    assert opt.steps_on_device
    x = torch.randn(8, 4)

    def step(nonfinite: float):
        layer(x).pow(2).mean().backward()
        opt.launch(torch.tensor(nonfinite))
        return [p.detach().clone() for p in layer.parameters()], {k: v.clone() for k, v in
                                                                 opt.optimizer.state[layer.weight].items()}

    w0 = [p.detach().clone() for p in layer.parameters()]
    w1, state1 = step(0.0)
    assert not torch.equal(w1[0], w0[0]) and float(state1["step"]) == 1 and layer.weight.grad is None
    w2, state2 = step(1.0)
    assert all(torch.equal(a, b) for a, b in zip(w1, w2)) and all(torch.equal(state1[k], state2[k]) for k in state1)
    assert not hasattr(opt.optimizer, "found_inf")  # the flag is the launch's alone
    assert opt.step(data_bpt=float("nan"), param_bpt=0.1, grad_norm=1.0) == "skipped"
    assert opt.skipped_total == 1
    opt.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    assert not opt.steps_on_device


@pytest.mark.parametrize("bad", ["nats", "tokens", "pbpt", "grad_norm", None])
def test_the_device_flag_skips_exactly_where_the_host_outcome_says_skipped(bad):
    """global_sums' device-side flag (what the launched optimizer step reads) against step_outcome on the values the
    host then reads: each of DataBPT (a NaN loss, or no tokens), ParamBPT and the gradient norm alone."""
    from types import SimpleNamespace

    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.state import step_outcome
    from raytrain_scu.worker.step import _read, global_sums

    params = [torch.randn(3, 4), torch.zeros(4, 3)]
    s = SimpleNamespace(stop_path=None, hooks=LocalHooks(),
                        opt=SimpleNamespace(params=params, centers=[params[0].clone(), None]),
                        cfg=SimpleNamespace(controller=SimpleNamespace(prior_sigma=0.01)),
                        ctrl=SimpleNamespace(tokens_per_epoch=1000))
    value = {"nats": 5.0, "tokens": 10.0, "pbpt": 0.1, "grad_norm": 1.0}
    if bad is not None:
        value[bad] = 0.0 if bad == "tokens" else float("nan")
    t = {k: torch.tensor(v) for k, v in value.items()}
    copy, nonfinite = global_sums(s, t["nats"], t["tokens"], t["pbpt"], t["grad_norm"])
    g = _read(copy)
    outcome = step_outcome(g["data_bpt"], g["param_bpt"], g["grad_norm"], loss_scaling=False)
    assert outcome == ("ok" if bad is None else "skipped")
    assert float(nonfinite) == float(outcome == "skipped")


def test_the_batch_sent_ahead_is_the_one_its_step_would_build():
    """The next step's first batch, sent ahead, is used only by the step at that position and micro-step; any other
    step builds its own, as train_batch gives it."""
    from types import SimpleNamespace

    from raytrain_scu.core.data.batches import train_batch
    from raytrain_scu.worker.state import Position
    from raytrain_scu.worker.step import device_batch, send_ahead

    data = SimpleNamespace(train=torch.arange(40 * 5).reshape(40, 5).numpy())
    s = SimpleNamespace(pos=Position(data=data, seqs_per_step=4, block_size=4, position=8), device=torch.device("cpu"),
                        cfg=SimpleNamespace(data=SimpleNamespace(batch_size=2), seed=3),
                        opt=SimpleNamespace(offloaded=None))  # no offloaded embedding to stage rows for

    def built(position, micro):
        return train_batch(data, position=position, micro_step=micro, rank=0, world_size=1, batch_size=2, seed=3)

    def same(a, b):  # (x, y, pos) batches; pos is None for text blocks
        return all(u is v if u is None or v is None else torch.equal(u, v) for u, v in zip(a, b))

    send_ahead(s)
    ahead = s.pos.ahead[1]
    assert same(ahead, built(8, 0))
    got = device_batch(s, 0)
    assert got[0] is ahead[0] and s.pos.ahead is None  # used once
    send_ahead(s)
    s.pos.advance()  # a batch sent for another position is never used
    got = device_batch(s, 0)
    assert got[0] is not ahead[0] and same(got, built(12, 0))
    send_ahead(s)
    got = device_batch(s, 1)  # nor for another micro-step
    assert same(got, built(12, 1)) and s.pos.ahead is None


def test_each_batch_is_built_once_and_each_step_steps_the_optimizer_once(tmp_path, monkeypatch):
    """The loop with accumulation: every micro-batch is gathered once (the next step's first is the one sent ahead,
    not built again) and fused AdamW steps once per optimizer step."""
    from raytrain_scu.worker import step as step_mod

    calls = []
    real = step_mod.train_batch

    def counted(data, **kw):
        calls.append((kw["position"], kw["micro_step"]))
        return real(data, **kw)

    monkeypatch.setattr(step_mod, "train_batch", counted)
    local_run(tmp_path, "once", "tracking.enabled=false", "train.max_steps=4", "train.checkpoint_every=4",
              "train.report_every=2", "data.grad_accum=2")
    assert len(calls) == len(set(calls)) == 4 * 2, calls
    (last,) = [d for d in checkpoint_dirs(tmp_path / "once") if d.name.endswith("00000004")]
    state = torch.load(last / "state.pt", weights_only=False)["optimizer"]["state"]
    assert state and all(float(v["step"]) == 4 for v in state.values())


def local_run(tmp_path, name, *overrides):
    """The loop in this process (no Ray), one worker, its checkpoints kept in ``<tmp_path>/<name>`` as Ray would keep
    them, resuming from the newest good one there; returns its hooks (the reports)."""
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    hooks = LocalHooks(device=torch.device("cpu"), run_dir=tmp_path / name)
    run_loop(tiny_cfg(tmp_path, name, "scaling.num_workers=1", *overrides), hooks=hooks)
    return hooks


@pytest.mark.parametrize("law", ["spec", "logodds"])
def test_nonfinite_steps_are_skipped_and_counted(tmp_path, monkeypatch, law):
    # the loop in this process: what a skipped step leaves unchanged needs no Ray (the ranks agree on a skip
    # because the skip is decided on all-reduced values: the two-rank test below)
    monkeypatch.setenv("RAYTRAIN_SCU_NAN_AT_STEPS", "5,6")  # the loss of steps 5 and 6 is multiplied by NaN
    # both laws skip alike; the spec's moves λ at every update outside its deadband, so under it step 7's λ also shows
    # that the updates resumed (the logodds law may hold λ on an update while a large error is closing)
    hooks = local_run(tmp_path, "nan", "tracking.enabled=false", "train.max_steps=8", "train.checkpoint_every=2",
                      "train.report_every=2", f"controller.law={law}", "controller.target_s=0.2")
    assert [r["step"] for r in hooks.reports] == [2, 4, 6, 8]
    c = {int(d.name[-8:]): d for d in checkpoint_dirs(tmp_path / "nan")}
    assert sorted(c) == [2, 4, 6, 8]
    # no optimizer step and no controller update on the skipped steps: state after 6 == state after 4
    assert max_abs_diff(adapter(c[4]), adapter(c[6])) == 0.0 and max_abs_diff(adapter(c[6]), adapter(c[8])) > 0
    ctrl4, ctrl6 = (json.loads((c[k] / "controller.json").read_text()) for k in (4, 6))
    # the controller saw both non-finite steps (control_every=1) and counted them as skipped updates, nothing else
    assert ctrl6 == {**ctrl4, "n_skipped": 2} and ctrl6["n_updates"] == 4 and ctrl4["n_skipped"] == 0
    opt = [torch.load(c[k] / "state.pt", weights_only=False)["optimizer"]["state"] for k in (4, 6)]
    assert opt[0] and opt[0].keys() == opt[1].keys()
    for i in opt[0]:  # AdamW's moments and its step count
        assert all(torch.equal(opt[0][i][k], opt[1][i][k]) for k in ("exp_avg", "exp_avg_sq", "step")), i
    rows = {r["step"]: r for r in torch.load(c[8] / "state.pt", weights_only=False)["history"]}
    assert [rows[k]["train/skipped_steps"] for k in range(1, 9)] == [0, 0, 0, 0, 1, 2, 2, 2]
    assert [rows[k]["ctrl/skipped"] for k in range(1, 9)] == [0, 0, 0, 0, 1, 2, 2, 2]  # the same count, every step
    assert all(rows[k]["train/scaler_overflows"] == 0 for k in range(1, 9))  # fp32: no loss scaler, no overflows
    assert rows[5]["train/data_bpt"] != rows[5]["train/data_bpt"]  # NaN, recorded as such
    assert rows[4]["ctrl/lambda"] == rows[5]["ctrl/lambda"] == rows[6]["ctrl/lambda"]
    if law == "spec":
        assert rows[6]["ctrl/lambda"] != rows[7]["ctrl/lambda"]
    assert ckpt.read_meta(c[8])["skipped_steps"] == 2


PREEMPT_LOCAL = ["tracking.enabled=false", "train.max_steps=12", "train.checkpoint_every=6", "train.report_every=3",
                 "scaling.num_workers=1", "run.primary_adapter=last"]


def test_a_preemption_notice_checkpoints_the_step_in_flight_and_the_resumed_run_ends_bit_identical(tmp_path):
    """The loop in this process: a notice during a step after checkpoint 6 that is neither a checkpoint nor a report
    step (drawn with a kept seed) ends the loop with that step's checkpoint, without an evaluation of its own (its
    report carries the last one's), and waits for a restart; a new loop resumes there, not at 6. A notice during
    that loop's last step ends the run as usual (its final evaluation, no restart to wait for). The run ends with the
    adapter, AdamW state, controller state and λ trajectory of an uninterrupted run, bit for bit."""
    import random

    from raytrain_scu.console import VAL_STEP
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    class Told(LocalHooks):
        """Told that their node is going during their ``at``-th step: the loop asks once a step, at its all-reduce;
        counts the restarts the loop waits for."""

        def __init__(self, at: int, run_dir):
            super().__init__(device=torch.device("cpu"), run_dir=run_dir)
            self.at, self.asked, self.restarts = at, 0, 0

        def preempt_notice(self) -> bool:
            self.asked += 1
            return self.asked >= self.at

        def await_restart(self) -> None:
            self.restarts += 1

    at = random.Random(PREEMPT_SEED).choice([k for k in range(7, 12) if k % 3])
    told = Told(at, tmp_path / "pre")
    run_loop(tiny_cfg(tmp_path, "pre", *PREEMPT_LOCAL), hooks=told)
    assert told.reports[-1]["step"] == at and told.beats[-1] is None and told.restarts == 1
    # no evaluation of its own: the last one's (step 6's checkpoint, or a scheduled one every 10), and no score
    assert told.reports[-1][VAL_STEP] == max(k for k in (6, 10) if k <= at)
    assert told.reports[-1][ckpt.BEST_METRIC] == ckpt.UNSCORED
    assert [int(d.name[-8:]) for d in checkpoint_dirs(tmp_path / "pre")] == [6, at]
    resumed = Told(12 - at, tmp_path / "pre")  # told during step 12, the last
    run_loop(tiny_cfg(tmp_path, "pre", *PREEMPT_LOCAL), hooks=resumed)
    assert resumed.restarts == 0 and resumed.reports[-1]["step"] == 12 and resumed.reports[-1][VAL_STEP] == 12
    assert resumed.reports[-1][ckpt.BEST_METRIC] == resumed.reports[-1]["val/data_bpt"] < ckpt.UNSCORED
    local_run(tmp_path, "clean", *PREEMPT_LOCAL)  # the uninterrupted run
    ends = [checkpoint_dirs(tmp_path / n)[-1] for n in ("pre", "clean")]
    assert [d.name for d in ends] == ["checkpoint_00000012"] * 2 and ckpt.read_meta(ends[0])["resumed_at"] == [at]
    assert resumed.reports[0]["step"] > at  # nothing before the notice's step was redone
    assert max_abs_diff(adapter(ends[0]), adapter(ends[1])) == 0.0
    assert controller_state(ends[0]) == controller_state(ends[1])
    opt = [torch.load(d / "state.pt", weights_only=False)["optimizer"]["state"] for d in ends]
    for i in opt[1]:
        assert all(torch.equal(opt[0][i][k], opt[1][i][k]) for k in ("exp_avg", "exp_avg_sq", "step")), i
    lams = [[r["ctrl/lambda"] for r in torch.load(d / "state.pt", weights_only=False)["history"]] for d in ends]
    assert lams[0] == lams[1]
    figures(test="preempt_local", at=at, resumed_at=at, steps_lost=0)


def test_before_a_preemptions_restart_rank0_stops_its_system_metrics_and_leaves_the_run_open(tmp_path):
    """What the loop does before it waits for a preemption's restart (tracker.pause): rank 0's metrics reach the
    store and MLflow's system-metrics monitor stops (the restarted loop starts its own: under LocalHooks in this same
    process), while the run stays RUNNING for the restarted group to log into."""
    from raytrain_scu.tracking.tracker import MlflowTracker

    def monitors() -> set:
        return {t for t in threading.enumerate() if t.name == "SystemMetricsMonitor" and t.is_alive()}

    before = monitors()
    tracker = MlflowTracker(tiny_cfg(tmp_path, "pause", "tracking.system_metrics=true"))
    tracker.start({"seed": 0})
    mine = monitors() - before
    assert tracker.sysmon is not None and mine
    tracker.log_step({"step": 1, "ctrl/lambda": 2.0})
    tracker.pause()
    assert tracker.sysmon is None and not monitors() & mine
    assert [m.step for m in tracker.client.get_metric_history(tracker.run_id, "ctrl/lambda")] == [1]
    assert tracker.client.get_run(tracker.run_id).info.status == "RUNNING"


NAN_ON_RANK1 = {3, 5, 6, 7}  # rank 1's loss only: one skipped step, later three in a row


def nan_on_one_rank_worker(r: int, port: int, tmp: str) -> None:
    """Rank ``r`` of a two-process gloo group running the real loop (LocalHooks, no Ray: the skip is decided by the
    loop's own all-reduce, which is what is tested): the loss is poisoned on rank 1 only, at NAN_ON_RANK1. Keeps, at
    every report, the row and this rank's adapter values, and the error that ended the loop."""
    from datetime import timedelta

    import torch.distributed as tdist

    from raytrain_scu.core.regularizer import adapter_params
    from raytrain_scu.errors import NonFiniteError
    from raytrain_scu.worker.faults import Faults
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    class Snapshots(LocalHooks):
        def prepare_model(self, model, move_to_device):
            self.loss_model = model
            return super().prepare_model(model, move_to_device)

        def report(self, metrics, checkpoint_dir, checkpoint_dir_name):
            super().report(metrics, checkpoint_dir, checkpoint_dir_name)
            self.reports[-1]["adapter"] = torch.cat([p.detach().flatten().clone()
                                                     for p in adapter_params(self.loss_model.model)])

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                             timeout=timedelta(seconds=60))  # ranks that disagree hang in a collective: fail instead
    hooks = Snapshots(device=torch.device("cpu"))
    hooks.faults = Faults(nan_at=NAN_ON_RANK1 if r == 1 else set())
    cfg = tiny_cfg(tmp, "nan-rank1", "tracking.enabled=false", "scaling.num_workers=2", "train.max_steps=8",
                   "train.report_every=1", "train.eval_every=8", "train.checkpoint_every=8",
                   "train.max_consecutive_skips=3", "controller.law=spec")  # λ moves at every update: see above
    error = None
    try:
        run_loop(cfg, hooks=hooks)
    except NonFiniteError as e:
        error = str(e)
    keys = ("step", "train/data_bpt", "train/skipped_steps", "ctrl/skipped", "ctrl/lambda", "adapter")
    torch.save({"error": error, "rows": [{k: m[k] for k in keys} for m in hooks.reports]}, Path(tmp, f"rank{r}.pt"))
    tdist.destroy_process_group()


@pytest.mark.slow
def test_a_nonfinite_loss_on_one_rank_is_skipped_on_both_and_counts_toward_the_stop(tmp_path):
    """Two ranks, rank 1's loss NaN at steps 3, 5, 6, 7: both skip step 3 (rank 0's own loss was finite) and keep
    identical adapters, both count it, and both stop with the same error after the third skip in a row (no rank left
    waiting in a collective)."""
    import math

    import torch.multiprocessing as mp

    mp.start_processes(nan_on_one_rank_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for g in got:
        assert g["error"] is not None and g["error"].startswith(
            "3 optimizer steps in a row had a non-finite loss or gradient (last at step 7)"), g["error"]
        rows = {row["step"]: row for row in g["rows"]}
        assert sorted(rows) == [1, 2, 3, 4, 5, 6]  # step 7 stopped the run before its report
        assert [rows[k]["train/skipped_steps"] for k in rows] == [0, 0, 1, 1, 2, 3]
        assert [rows[k]["ctrl/skipped"] for k in rows] == [0, 0, 1, 1, 2, 3]
        assert [math.isnan(rows[k]["train/data_bpt"]) for k in rows] == [False, False, True, False, True, True]
        assert rows[2]["ctrl/lambda"] == rows[3]["ctrl/lambda"] != rows[4]["ctrl/lambda"]
        a = {k: rows[k]["adapter"] for k in rows}
        assert all(torch.isfinite(v).all() for v in a.values())
        # no optimizer step on a skipped step, on either rank: rank 0 did not step on its own finite loss
        assert torch.equal(a[3], a[2]) and torch.equal(a[5], a[4]) and torch.equal(a[6], a[4])
        assert not torch.equal(a[2], a[1]) and not torch.equal(a[4], a[3])
    for r0, r1 in zip(got[0]["rows"], got[1]["rows"]):  # the same adapters and controller on both ranks, every step
        assert r0["step"] == r1["step"] and torch.equal(r0["adapter"], r1["adapter"])
        assert r0["ctrl/lambda"] == r1["ctrl/lambda"]
    assert got[0]["error"] == got[1]["error"]


# ---------------------------------------------------------------- corrupt or truncated checkpoints in a real run

def test_corrupt_latest_checkpoint_falls_back_then_none_good_is_a_clear_error(tmp_path, capfd):
    # the loop in this process resumes as under Ray (the newest good checkpoint in the run directory; Ray's own
    # candidates: test_fallback_... and test_resume_considers_...); the driver's checks before Ray are the real ones
    from raytrain_scu.driver.preflight import resume_point
    from raytrain_scu.driver.run import run
    from raytrain_scu.errors import PreflightError

    args = ["tracking.enabled=false", "train.max_steps=20", "train.checkpoint_every=10", "train.report_every=5"]
    local_run(tmp_path, "c", *args)
    run_dir = tmp_path / "c"
    assert [d.name for d in checkpoint_dirs(run_dir)] == ["checkpoint_00000010", "checkpoint_00000020"]
    good_adapter = adapter(run_dir / "checkpoint_00000020")
    truncate(run_dir / "checkpoint_00000020" / "state.pt")

    capfd.readouterr()
    assert resume_point(tiny_cfg(tmp_path, "c", *args), use_gpu=False)[0].name == "checkpoint_00000010"
    assert "bad checkpoint(s)" in capfd.readouterr().err  # the driver's warning, before any worker starts
    again = local_run(tmp_path, "c", *args)
    redone = run_dir / "checkpoint_00000020_from00000010"  # resumed at 10, redid 11..20 under a new name
    assert again.reports[-1]["step"] == 20 and ckpt.verify(redone) is None
    assert ckpt.read_meta(redone)["resumed_at"] == [10]
    assert max_abs_diff(good_adapter, adapter(redone)) <= 1e-6

    for d in checkpoint_dirs(run_dir):
        flip_byte(d / "adapter" / "adapter_model.safetensors")
    with pytest.raises(PreflightError, match="no usable checkpoint in .*checksum mismatch.*use a new run.name"):
        run(tiny_cfg(tmp_path, "c", *args), quiet=True)  # before Ray: this process has none


# ---------------------------------------------------------------- secrets, disk, a structurally different resume

def launch_cli(*overrides, env: dict, out: Path) -> subprocess.Popen:
    """``python -m raytrain_scu.train experiments/tiny-cpu.yaml *overrides`` in a session of its own (setsid), its own
    Ray, stdout and stderr to ``out``.{out,err}."""
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update({"RAY_AUTH_MODE": "disabled", **env})
    return subprocess.Popen([sys.executable, "-m", "raytrain_scu.train", TINY, *overrides], cwd=ROOT, env=full_env,
                            stdout=open(f"{out}.out", "w"), stderr=open(f"{out}.err", "w"), start_new_session=True)


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    """Two launches of one run name started at the same moment, each a real CLI in its own session with secrets in
    the environment of the driver, raylet and workers. The one that takes the run's lock trains it (its own Ray, whose
    session and log files are under a private RAY_TMPDIR; MLflow on sqlite; one worker; checkpoints at 2, 4, 6, 8
    with run.num_to_keep=2); the other must exit 2 before Ray. Yields (storage, the winner, the loser), each a dict of
    rc, pid, out, err and seconds; the winner's ``ray_tmp`` is that RAY_TMPDIR."""
    import tempfile

    storage, logs = tmp_path_factory.mktemp("secret"), tmp_path_factory.mktemp("secret-logs")
    ray_tmp = tempfile.mkdtemp(prefix="rts", dir="/tmp")  # short: Ray's socket paths live under it
    args = [f"run.storage_path={storage}", "run.name=sec", "scaling.num_workers=1", "train.max_steps=8",
            "train.checkpoint_every=2", "train.report_every=2", "run.num_to_keep=2"]
    t0 = time.time()
    procs = [launch_cli(*args, env={**SECRETS, "RAY_TMPDIR": ray_tmp}, out=logs / f"launch{i}") for i in range(2)]
    runs = [{"pid": p.pid} for p in procs]
    while any(p.poll() is None for p in procs) and time.time() - t0 < 900:
        for r, p in zip(runs, procs):
            if p.poll() is not None and "seconds" not in r:
                r.update(seconds=time.time() - t0, others_running=[q.poll() is None for q in procs if q is not p])
        time.sleep(0.2)
    for i, (r, p) in enumerate(zip(runs, procs)):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        r.update(rc=p.wait(), out=(logs / f"launch{i}.out").read_text(), err=(logs / f"launch{i}.err").read_text())
        r.setdefault("seconds", time.time() - t0)
    winner, loser = sorted(runs, key=lambda r: r["rc"] != 0)
    winner["ray_tmp"] = Path(ray_tmp)
    try:
        assert winner["rc"] == 0, winner["err"][-3000:]
        yield storage, winner, loser
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_two_launches_of_one_run_one_trains_and_the_other_exits_2_naming_it(secret_run):
    import socket

    storage, winner, loser = secret_run
    assert loser["rc"] == 2, loser["err"][-3000:]
    lock = storage / "sec" / ".lock"
    errors = [line for line in loser["err"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: run sec is already being trained: its lock {lock} is held by pid {winner['pid']} on host "
        f"{socket.gethostname()} since "), loser["err"]
    assert "raytrain_scu/train.py" in errors[0] and "run.name=sec" in errors[0]  # and its command
    # at once, before Ray: while the winner was still training
    assert loser["others_running"] == [True] and loser["seconds"] < 60, loser
    assert "Started a local Ray instance" not in loser["out"] + loser["err"]
    mrun, _ = mlflow_run(storage, "sec")  # exactly one MLflow run, and it finished
    assert mrun.info.status == "FINISHED" and "run sec" in winner["out"]
    assert lock.read_text() == ""  # a clean end leaves no holder record to take over
    figures(test="two_launches", loser_exit_s=round(loser["seconds"], 1), winner_s=round(winner["seconds"], 1))


def test_a_held_run_lock_is_refused_and_a_stale_one_taken_over(tmp_path, capsys, monkeypatch):
    """The lock alone (no training): a live holder in another process is named; once that process is killed (the
    kernel drops its flock, its record stays), the next taker says whose lock it took over. Remote storage: the lock
    lives on this machine, keyed by the run's URI."""
    import socket

    from raytrain_scu.driver.lock import run_lock
    from raytrain_scu.errors import RunLocked

    monkeypatch.setenv("RAYTRAIN_SCU_CACHE", str(tmp_path / "cache"))
    for storage in (str(tmp_path / "runs"), "s3://bucket/runs?endpoint_override=http://127.0.0.1:1"):
        holder = subprocess.Popen([sys.executable, "-c", (
            "import sys, time; sys.path.insert(0, 'tests'); from conftest import tiny_cfg; "
            "from raytrain_scu.driver.lock import acquire; "
            f"acquire(tiny_cfg({storage!r}, 'x', 'tracking.enabled=false')); print('held', flush=True); "
            "time.sleep(300)")], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            cfg = tiny_cfg(storage, "x", "tracking.enabled=false")
            with pytest.raises(RunLocked, match=f"held by pid {holder.pid} on host {socket.gethostname()} since "):
                with run_lock(cfg):
                    pass
        finally:
            holder.kill()
            holder.wait()
        capsys.readouterr()
        with run_lock(cfg):
            with run_lock(cfg):  # nested in one process: no second flock, no refusal of itself
                pass
        err = capsys.readouterr().err
        assert f"took over the stale lock of run x: its holder, pid {holder.pid} on host" in err and "is gone" in err
        with run_lock(cfg):  # released cleanly: nothing stale to say
            pass
        assert "stale" not in capsys.readouterr().err


@pytest.mark.slow
def test_secrets_from_the_environment_are_never_logged_or_dumped(secret_run):
    """Grep for each secret's value: the run directory (checkpoints, output, the run's copy of its logs), the MLflow
    store (sqlite database, params, tags, artifacts), both consoles, and the Ray session of the run (the workers',
    the controller's, the raylet's and the GCS's log files)."""
    storage, winner, loser = secret_run
    files = [p for p in storage.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files) and any(p.name == "config.yaml" for p in files)
    mrun, client = mlflow_run(storage, "sec")
    assert len(mrun.data.params) > 50  # the params were logged, just not the secrets
    artifacts, artifact_paths = mlflow_values(client, mrun)
    worker_logs = list(winner["ray_tmp"].rglob("worker-*.out")) + list(winner["ray_tmp"].rglob("worker-*.err"))
    assert any("step 8" in p.read_text(errors="replace") or "checkpoint_00000008" in p.read_text(errors="replace")
               for p in worker_logs), [str(p) for p in worker_logs]  # the train worker's own log is among them
    assert "best_checkpoint/manifest.json" in artifact_paths and "config.yaml" in artifact_paths, artifact_paths
    assert leaking_files(storage, SECRETS) == {}  # MLflow db and artifacts, checkpoints, output, logs/
    assert leaking_files(winner["ray_tmp"], SECRETS) == {}  # Ray's session: every log file of the run's Ray
    for name, secret in SECRETS.items():
        assert all(secret not in r["out"] + r["err"] for r in (winner, loser)), name
        assert secret not in artifacts, name


def test_a_credential_in_the_config_is_refused_before_ray_naming_the_environment_variable(tmp_path, capsys):
    """An S3 endpoint_override carrying credentials, and an MLflow URI with a password: the train CLI exits 2 at the
    config, before Ray starts or anything is written, and the message names the environment variables to use; the
    secret is in neither the console nor the storage."""
    from raytrain_scu.cli.train import main

    cases = {"run.storage_path": ("s3://runs/tiny?endpoint_override=http://minio:epSECRET42@127.0.0.1:9000",
                                  "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
             "tracking.uri": ("https://alice:mlSECRET43@mlflow.example.invalid/",
                              "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")}
    for key, (value, env) in cases.items():
        overrides = [f"run.storage_path={tmp_path}", f"{key}={value}", "run.name=cred"]
        assert main([TINY, *overrides]) == 2
        out, err = capsys.readouterr()
        assert err.startswith(f"error: {key}: ") and env in err and "in the environment" in err, err
        assert "SECRET4" not in out + err and "Ray" not in out, out + err
    assert list(tmp_path.iterdir()) == []
    from raytrain_scu.cli.evaluate import main as evaluate  # a storage URI given as a flag: the same rule

    assert evaluate(["--config", TINY, "--adapter", "s3://runs/tiny/cred/output/adapter?endpoint_override="
                                                    "http://minio:epSECRET44@127.0.0.1:9000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --adapter: ") and "AWS_SECRET_ACCESS_KEY" in err and "SECRET44" not in err, err


def test_tracking_uri_credentials_are_redacted_in_params_dumps_and_run_file(tmp_path):
    # behind the refusal (the test above), the redaction: a URI with credentials set in code, after the checks
    from raytrain_scu.config.io import to_yaml
    from raytrain_scu.tracking.store import remember_run_id
    from raytrain_scu.tracking.tracker import derived_params

    cfg = tiny_cfg(tmp_path, "uri")
    cfg.tracking.uri = "https://alice:pw_SECRET@mlflow.example.invalid/"
    params = derived_params(cfg, tokens_per_epoch=1, world=1, device=torch.device("cpu"),
                            tokens_per_epoch_from="measured")
    assert params["tracking.uri"] == "https://alice:***@mlflow.example.invalid/"
    remember_run_id(cfg, "0123")
    dumps = [to_yaml(cfg, redact=True), json.dumps(params, default=str),
             (tmp_path / "uri" / "mlflow_run.json").read_text()]
    assert all("pw_SECRET" not in d for d in dumps)


def test_tracking_uri_credentials_are_redacted_in_warnings(tmp_path):
    # MLflow's exception text holds the full URI: the tracker's warnings must redact it too
    import warnings

    from raytrain_scu.tracking.tracker import MlflowTracker

    cfg = tiny_cfg(tmp_path, "uri")
    cfg.tracking.uri = "https://alice:pw_SECRET@mlflow.example.invalid/"  # past the config's refusal: set in code
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = MlflowTracker(cfg)  # the server cannot be reached: every call warns
        tracker.start({"seed": 0})
        tracker.log_step({"step": 1, "train/data_bpt": 1.0})
        tracker.flush()
        tracker.finish([])
    messages = [str(w.message) for w in caught if "MLflow" in str(w.message)]
    assert messages and not any("pw_SECRET" in m for m in messages), messages


@pytest.mark.slow
def test_old_checkpoints_beyond_num_to_keep_are_removed(secret_run):
    storage, winner, _ = secret_run
    run_s = winner["seconds"]
    dirs = checkpoint_dirs(storage / "sec")
    # 4 checkpoints reported (2, 4, 6, 8); Ray keeps the 2 best by val/data_bpt plus always the latest
    rows = torch.load(dirs[-1] / "state.pt", weights_only=False)["history"]
    val_bpt = {r["step"]: r["val/data_bpt"] for r in rows if r["step"] in (2, 4, 6, 8)}
    best_two = sorted(val_bpt, key=val_bpt.get)[:2]
    assert len(val_bpt) == 4 and [int(d.name[-8:]) for d in dirs] == sorted({*best_two, 8}), (
        val_bpt, [d.name for d in dirs])
    assert all(ckpt.verify(d) is None for d in dirs)
    size = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in dirs}
    figures(test="disk", checkpoints_reported=4, checkpoints_left=len(dirs), checkpoint_bytes=size,
            run_dir_bytes=sum(f.stat().st_size for f in (storage / "sec").rglob("*") if f.is_file()),
            cli_run_s=round(run_s, 1))


@pytest.fixture
def no_ray(monkeypatch):
    """The CLI's main in this process, where starting Ray fails the test (as in test_bad_inputs.py)."""
    from raytrain_scu.cli.train import main
    from raytrain_scu.ray import launch

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was about to start: the bad input was not caught early")

    monkeypatch.setattr(launch, "init_ray", refuse)
    # preflight checks this machine's CPUs and GPUs only when no Ray is up here (a Ray up is a cluster it defers
    # to): an earlier test file in this process may have left one, which these checks must not see
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
    return main


@pytest.mark.slow
def test_resuming_a_structurally_different_checkpoint_is_refused_before_ray(secret_run, no_ray, capsys):
    storage, _, _ = secret_run
    code = no_ray([TINY, f"run.storage_path={storage}", "run.name=sec", "train.max_steps=8", "lora.r=8"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "lora.r: checkpoint has 4, config has 8" in err and "use a new run.name" in err.lower()
    print(f"BAD_INPUT {json.dumps({'case': 'resume with a different lora.r', 'message': err.strip()})}")


@pytest.mark.slow
def test_resuming_with_changed_data_is_refused_before_ray(secret_run, no_ray, capsys):
    # fewer documents: another tokens_per_epoch, which would rescale ParamBPT and S from the resumed step on
    storage, _, _ = secret_run
    code = no_ray([TINY, f"run.storage_path={storage}", "run.name=sec", "train.max_steps=8", "data.max_documents=5"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert ("the checkpoint was written with tokens_per_epoch=204544 but the data now gives tokens_per_epoch=140416"
            in err and "set controller.tokens_per_epoch=204544" in err)
    print(f"BAD_INPUT {json.dumps({'case': 'resume with changed data', 'message': err.strip()})}")


# ---------------------------------------------------------------- a node lost from a two-node cluster

def two_node_cluster():
    """(cluster, worker node): a head (1 CPU) and a worker node (2 CPUs) on this machine, this process's Ray joined to
    them. The state API needs the head's dashboard; 8265 may be another Ray's on this box. The GCS checks each node's
    health every second and takes 3 failed checks in a row for a lost node (Ray's defaults: every 3 s, 5 in a row;
    each check's timeout stays Ray's 10 s, so a live node that is slow to answer is not taken for a lost one). A dead
    node's checks fail at once. Measured on an idle 2-core machine: the new worker group started 5.4 s after the
    node's loss, against 9.0 s with the defaults (38 s against 43 s in all)."""
    import ray
    from ray.cluster_utils import Cluster

    health = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "dashboard_port": free_port(),
                                                            "_system_config": health})
    worker_node = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster, worker_node


def two_node_scenario(storage: str) -> dict:
    """Two Ray nodes on this machine, one training worker on each (STRICT_SPREAD); the worker node is removed after
    step 15 (checkpoint at 10) and a replacement node added. Prints and returns what happened.

    Training runs in a thread; the main thread changes the cluster (Ray starts node processes from the main thread)."""
    import ray
    from ray.util.state import list_actors

    from raytrain_scu.driver.run import run

    hold = Path(storage) / "hold"
    os.environ.update(RAYTRAIN_SCU_HOLD_AT_STEP="15", RAYTRAIN_SCU_HOLD_DIR=str(hold))
    t0 = time.time()
    cluster, worker_node = two_node_cluster()
    out = {"head": cluster.head_node.node_id, "worker_node": worker_node.node_id,
           "cluster_start_s": round(time.time() - t0, 1)}

    def workers_if(condition) -> dict:
        alive = list_actors(address=cluster.address,
                            filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
        w = {a.pid: a.node_id for a in alive}
        return w if condition(w) else {}

    def train():
        try:
            cfg = tiny_cfg(storage, "two-node", "train.max_steps=20", "train.checkpoint_every=10",
                           "train.report_every=5", "scaling.placement_strategy=STRICT_SPREAD", "run.max_failures=3")
            out["summary"] = run(cfg, quiet=True)
        except Exception as e:  # noqa: BLE001 - reported in the output
            out["error"] = repr(e)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        pids = wait_for(lambda: held_pids(hold, 2), 300, "both workers to reach step 15")
        before = wait_for(lambda: workers_if(lambda w: set(pids.values()) <= set(w)), 90, "actor states")
        out["nodes_before"] = sorted({before[p] for p in pids.values()})
        t_lost = time.time()
        cluster.remove_node(worker_node, allow_graceful=False)
        out["replacement"] = cluster.add_node(num_cpus=2).node_id
        after = wait_for(lambda: workers_if(lambda w: len(w) == 2 and not set(w) & set(before)), 300,
                         "a new worker group")
        out["nodes_after"] = sorted(set(after.values()))
        out["restarted_s"] = round(time.time() - t_lost, 1)
        trainer.join(timeout=300)
        out["recovered_s"] = round(time.time() - t_lost, 1)
    except Exception as e:  # noqa: BLE001
        out["error"] = repr(e)
    if trainer.is_alive():
        out.setdefault("error", "training did not finish")
    last = checkpoint_dirs(Path(storage) / "two-node")[-1]
    out.update(steps=out.pop("summary", {}).get("steps"), last_checkpoint=last.name,
               resumed_at=ckpt.read_meta(last).get("resumed_at"), total_s=round(time.time() - t0, 1))
    print("TWO_NODE " + json.dumps(out), flush=True)
    if "error" in out:
        os._exit(1)  # a stuck trainer thread must not keep the process alive
    ray.shutdown()
    cluster.shutdown()
    return out


@pytest.mark.slow
def test_two_node_cluster_survives_losing_a_node(tmp_path):
    import tempfile

    # its own Ray cluster in its own process; a private RAY_TMPDIR keeps other ray.init() calls on this machine
    # from finding (and joining) it through /tmp/ray/ray_current_cluster
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    try:
        r = subprocess.run([sys.executable, __file__, "two-node", str(tmp_path)], capture_output=True, text=True,
                           cwd=ROOT, env=env, timeout=600)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in r.stdout.splitlines() if line.startswith("TWO_NODE ")]
    assert lines, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(lines[-1][len("TWO_NODE "):])
    assert "error" not in out and r.returncode == 0, json.dumps(out) + r.stderr[-3000:]
    assert out["nodes_before"] == sorted([out["head"], out["worker_node"]])  # training spanned both nodes
    assert out["nodes_after"] == sorted([out["head"], out["replacement"]])  # and recovered onto the new one
    assert out["steps"] == 20 and out["last_checkpoint"] == "checkpoint_00000020"
    assert out["resumed_at"] == [10]  # from the checkpoint written before the node was lost: 5 steps redone
    figures(test="two_node", steps_lost=15 - out["resumed_at"][0], **{k: out[k] for k in (
        "cluster_start_s", "restarted_s", "recovered_s", "total_s")})


def drain_scenario(storage: str, at: int) -> dict:
    """The spot-cluster path for real: two Ray nodes on this machine, one training worker on each (STRICT_SPREAD),
    Ray Train's preemption watcher on (polling every 0.5 s), FAULT_RUN with run.max_failures=0, so that only Ray's
    preemption budget can restart it. Both workers pause after step ``at``; a replacement node is added and the worker
    node is drained as a spot reclaim is (``GcsClient.drain_node``, reason PREEMPTION, 60 s deadline: what
    ``ray start`` does on SIGTERM and autoscaler v2 on a reclaim); once both workers logged Ray's notice they go on.
    Prints and returns what happened."""
    import ray
    from ray.core.generated import autoscaler_pb2

    from raytrain_scu.driver.run import run

    hold = Path(storage) / "hold"
    os.environ.update(RAYTRAIN_SCU_PAUSE_AT_STEP=str(at), RAYTRAIN_SCU_HOLD_DIR=str(hold),
                      RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="1", RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="0.5")
    t0 = time.time()
    cluster, worker_node = two_node_cluster()
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # every node's, on this machine
    out = {"worker_node": worker_node.node_id, "cluster_start_s": round(time.time() - t0, 1)}

    def train():
        try:
            cfg = tiny_cfg(storage, "drain", "tracking.enabled=false", *FAULT_RUN,
                           "scaling.placement_strategy=STRICT_SPREAD", "run.max_failures=0")
            out["summary"] = run(cfg, quiet=True)
        except Exception as e:  # noqa: BLE001 - reported in the output
            out["error"] = repr(e)

    def told() -> int:
        return sum("received preemption signal" in f.read_text(errors="replace") for f in logs.glob("worker-*.err"))

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        wait_for(lambda: held_pids(hold, 2, "paused"), 300, f"both workers to pause after step {at}")
        out["replacement"] = cluster.add_node(num_cpus=2).node_id
        t_drain = time.time()
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        out["drain_accepted"], _ = ray._raylet.GcsClient(address=cluster.address).drain_node(
            worker_node.node_id, reason, "spot reclaim", int((t_drain + 60) * 1000))
        wait_for(lambda: told() >= 2, 60, "Ray's preemption notice on both workers")
        out["notice_s"] = round(time.time() - t_drain, 1)
        (hold / "go").touch()
        trainer.join(timeout=300)
        out["recovered_s"] = round(time.time() - t_drain, 1)
    except Exception as e:  # noqa: BLE001
        out["error"] = repr(e)
    if trainer.is_alive():
        out.setdefault("error", "training did not finish")
    run_dir = Path(storage) / "drain"
    said = "".join(f.read_text(errors="replace") for f in (run_dir / "logs").glob("*.err"))
    out.update(summary=out.get("summary"), checkpoints=[d.name for d in checkpoint_dirs(run_dir)],
               resumed_at=ckpt.read_meta(checkpoint_dirs(run_dir)[-1]).get("resumed_at"),
               preemption_restart="Source: preemption" in said and "ray.train.PreemptionError" in said,
               total_s=round(time.time() - t0, 1))
    print("DRAIN " + json.dumps(out, default=str), flush=True)
    os._exit(1 if "error" in out else 0)  # a stuck trainer thread must not keep the process alive


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RAYTRAIN_SCU_DRAIN_TEST") != "1",
                    reason="a two-node Ray cluster of its own (~45 s): RAYTRAIN_SCU_DRAIN_TEST=1 runs it")
def test_a_drained_node_checkpoints_the_step_in_flight_and_ray_restarts_the_group(clean_run, tmp_path):
    """Ray's own preemption path (docs/reliability.md, Preemption): a worker node drained for preemption at a step
    drawn with the kept seed; both ranks checkpoint the step in flight, Ray Train restarts the group on the other
    nodes as a preemption (run.max_failures=0: no failure retry could have), the run resumes at that step and ends
    with the clean run's adapter and controller state, bit for bit."""
    import random
    import tempfile

    clean, _ = clean_run
    at = random.Random(PREEMPT_SEED).choice([k for k in range(11, 20) if k % 5])
    ray_tmp = tempfile.mkdtemp(prefix="rtd", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    try:
        r = subprocess.run([sys.executable, __file__, "drain", str(tmp_path), str(at)], capture_output=True,
                           text=True, cwd=ROOT, env=env, timeout=600)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in r.stdout.splitlines() if line.startswith("DRAIN ")]
    assert lines, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(lines[-1][len("DRAIN "):])
    assert "error" not in out and r.returncode == 0 and out["drain_accepted"], json.dumps(out) + r.stderr[-3000:]
    assert out["summary"]["steps"] == 30 and out["preemption_restart"], out
    assert out["checkpoints"][-1] == "checkpoint_00000030" and out["resumed_at"] == [at + 1], out
    assert max_abs_diff(adapter(clean["adapter"]), adapter(out["summary"]["adapter"])) == 0.0
    ends = [checkpoint_dirs(s["run_dir"])[-1] for s in (clean, out["summary"])]
    assert controller_state(ends[0]) == controller_state(ends[1])
    figures(test="drain", at=at, resumed_at=out["resumed_at"], **{k: out[k] for k in (
        "cluster_start_s", "notice_s", "recovered_s", "total_s")})


if __name__ == "__main__":
    if sys.argv[1:2] == ["two-node"]:
        two_node_scenario(sys.argv[2])
    if sys.argv[1:2] == ["drain"]:
        drain_scenario(sys.argv[2], int(sys.argv[3]))


def test_resume_considers_every_checkpoint_on_disk_newest_first(tmp_path):
    """Ctrl-C once left checkpoint_00000050 on disk, unregistered by Ray, and the next run resumed from 40."""
    import contextlib

    from ray.train import Checkpoint

    from raytrain_scu.ray.hooks import checkpoint_candidates

    for name in ("checkpoint_00000010", "checkpoint_00000020", "checkpoint_00000030_from00000010",
                 "checkpoint_00000050", "checkpoint_00000060.partial"):
        (tmp_path / name).mkdir()
    with contextlib.ExitStack() as stack:
        names = [n for n, _ in checkpoint_candidates(Checkpoint(str(tmp_path / "checkpoint_00000020")), stack)]
    assert names == ["checkpoint_00000050", "checkpoint_00000030_from00000010", "checkpoint_00000020",
                     "checkpoint_00000010"]
