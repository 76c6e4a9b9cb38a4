"""The quieter faults (docs/reliability.md, "Faults, round two"): a disk that fills while a checkpoint is written, a
run on S3-compatible storage killed and resumed there, and running out of device memory. A hung worker and two
launches of one run are in test_reliability.py (they share its runs); an MLflow outage is in test_tracking.py.

The disk test mounts a small tmpfs when this process may (root with CAP_SYS_ADMIN), else it injects the full disk at
the checkpoint writer's fsync (RAYTRAIN_SCU_ENOSPC_AT_STEP). The S3 test runs a real S3 API server (moto's, from the
`dev` extra) on a local port. The GPU test runs where CUDA is (marked gpu).
"""
import contextlib
import json
import os
import re
import shutil
import socket
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
from raytrain_scu.errors import DeviceOutOfMemory, DiskFullError


def figures(**kw) -> None:
    """The numbers docs/reliability.md quotes; `pytest -s` shows them."""
    print("RELIABILITY " + json.dumps(kw))


def wait_for(predicate, timeout_s: float, what: str):
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


# ---------------------------------------------------------------- a full disk while a checkpoint is written

def test_a_hold_and_a_pause_happen_the_first_time_their_step_is_reached_and_need_a_directory(tmp_path, monkeypatch):
    """The hold writes rank<R>.pid and waits to be killed (here: its wait runs out at once), the pause writes
    rank<R>.paused and waits for ``go``; a restarted attempt that reaches the step again goes on. Without
    RAYTRAIN_SCU_HOLD_DIR either is refused: a shared default directory's leftover files would turn it off."""
    from raytrain_scu.errors import InjectedFault
    from raytrain_scu.worker.faults import Faults, hold_for_kill, pause_until_go

    monkeypatch.delenv("RAYTRAIN_SCU_HOLD_DIR", raising=False)
    for key in ("RAYTRAIN_SCU_HOLD_AT_STEP", "RAYTRAIN_SCU_PAUSE_AT_STEP"):
        monkeypatch.setenv(key, "3")
        with pytest.raises(ValueError, match=f"{key} needs RAYTRAIN_SCU_HOLD_DIR"):
            Faults.from_env()
        monkeypatch.delenv(key)
    monkeypatch.setenv("RAYTRAIN_SCU_HOLD_DIR", str(tmp_path))
    with pytest.raises(InjectedFault, match="held after step 3"):
        hold_for_kill(3, seconds=0)
    assert (tmp_path / "rank0.pid").read_text() == f"{os.getpid()} 3"
    hold_for_kill(3, seconds=0)  # reached again after a restart: goes on
    with pytest.raises(InjectedFault, match="paused after step 4"):
        pause_until_go(4, seconds=0)
    assert (tmp_path / "rank0.paused").read_text() == f"{os.getpid()} 4"
    (tmp_path / "rank0.paused").unlink()
    (tmp_path / "go").touch()
    pause_until_go(4, seconds=0)  # released: goes on, and writes nothing
    assert not (tmp_path / "rank0.paused").exists()


def test_a_full_disk_at_the_writer_leaves_the_previous_checkpoint_and_says_where(tmp_path):
    from raytrain_scu.core.model.build import apply_lora, build_model
    from raytrain_scu.worker.faults import Faults

    torch.manual_seed(0)
    model = apply_lora(build_model("tiny", vocab_size=256), r=2, alpha=4, targets=["q_proj"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def write(step, fsync=os.fsync):
        return ckpt.write_checkpoint(tmp_path / "checkpoint_00000010", model=model, optimizer=opt,
                                     scaler=torch.amp.GradScaler("cpu", enabled=False), controller_state={},
                                     step=step, position=0, structure={}, tokens_per_epoch=1, config_yaml="",
                                     history=[], fsync=fsync)

    good = write(10)
    before = {p.name: p.read_bytes() for p in good.rglob("*") if p.is_file()}
    fsync = Faults(enospc_at={20}).fsync(20)  # RAYTRAIN_SCU_ENOSPC_AT_STEP=20: the writer's fsync finds no space
    with pytest.raises(DiskFullError, match=r"no space left on device writing the checkpoint of step 20 to "
                       r".*checkpoint_00000010\.partial \(.* free of .*\); the checkpoints written before it are "
                       r"intact\. Free space, then re-run the same command"):
        write(20, fsync)
    assert not (tmp_path / "checkpoint_00000010.partial").exists()  # its space given back
    assert ckpt.verify(good) is None and {p.name: p.read_bytes() for p in good.rglob("*") if p.is_file()} == before


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "8m"):
    """A tmpfs of ``size`` at ``path`` (True), or nothing where this process may not mount one (False)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """Write a file under ``path`` until its filesystem is full; returns it."""
    filler = path / "filler"
    with open(filler, "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
    return filler


def test_a_full_staging_disk_under_remote_storage_names_the_local_path(tmp_path, monkeypatch):
    """Under s3:// storage the output is written to a local staging directory first: a full disk there names that
    directory and its free space, not the s3:// address (whose free space is unknown)."""
    import errno
    import tempfile

    from raytrain_scu.driver.run import _writing_output

    staging = tmp_path / "tmp"
    cfg = tiny_cfg("s3://runs/tiny", "staged", "tracking.enabled=false")
    with small_filesystem(staging, "1m") as mounted:
        staging.mkdir(exist_ok=True)
        monkeypatch.setattr(tempfile, "tempdir", str(staging))
        with pytest.raises(DiskFullError) as e, _writing_output(cfg) as out:
            if mounted:
                fill(out)
            raise OSError(errno.ENOSPC, "No space left on device")  # what the write into the full disk raises
    msg = str(e.value)
    assert f"to {staging}/raytrain_scu_output_" in msg and "staged for s3://runs/tiny/staged/output" in msg, msg
    assert "free of" in msg and "remote storage" not in msg, msg
    assert not list(staging.glob("raytrain_scu_output_*"))  # the staging directory is removed


@pytest.mark.slow
def test_a_disk_that_fills_during_a_checkpoint_stops_the_run_and_a_rerun_resumes(ray_local, tmp_path, monkeypatch,
                                                                                 capsys):
    """Checkpoint 2 written, then the storage fills: the checkpoint of step 4 cannot be written. One `error:` line
    naming the path and the free space, exit 1, checkpoint 2 intact, the MLflow run FAILED with the reason; once
    space is freed the same command resumes from checkpoint 2 and finishes."""
    from raytrain_scu.cli.train import main
    from raytrain_scu.tracking.store import FAILURE_TAG

    hold, storage = tmp_path / "hold", tmp_path / "small"
    args = [TINY, f"run.storage_path={storage}", "run.name=full", "scaling.num_workers=1", "train.max_steps=4",
            "train.checkpoint_every=2", "train.report_every=2", "run.max_failures=0",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]  # the MLflow store is elsewhere, as on a cluster
    with small_filesystem(storage) as mounted:
        if mounted:  # a real ENOSPC: filled once checkpoint 2 is in, so Ray's copy of checkpoint 4 finds no room
            monkeypatch.setenv("RAYTRAIN_SCU_PAUSE_AT_STEP", "2")
            monkeypatch.setenv("RAYTRAIN_SCU_HOLD_DIR", str(hold))
            box = {}

            def filler():
                wait_for(lambda: (hold / "rank0.paused").exists(), 300, "the pause after step 2")
                box["filler"] = fill(storage)
                (hold / "go").touch()
            threading.Thread(target=filler, daemon=True).start()
        else:  # injected at the writer's fsync, as a full disk under delayed allocation reports it
            monkeypatch.setenv("RAYTRAIN_SCU_ENOSPC_AT_STEP", "4")
        code = main(args)
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 1 and len(errors) == 1, err[-3000:]
        where = f"{storage}/full/checkpoint_00000004 (0 B free of 8.0 MiB)" if mounted else "checkpoint of step 4 to "
        assert errors[0].startswith("error: DiskFullError: no space left on device writing ") and where in errors[0]
        assert "the checkpoints written before it are intact" in errors[0]
        dirs = sorted(p.name for p in (storage / "full").glob("checkpoint_*") if p.is_dir())
        assert dirs == ["checkpoint_00000002"] and ckpt.verify(storage / "full" / dirs[0]) is None
        client, runs = mlflow_runs(tmp_path, "full")  # tracking.uri is the default store of storage tmp_path
        run = runs[0]
        assert len(runs) == 1 and run.info.status == "FAILED"
        assert run.data.tags[FAILURE_TAG] == errors[0][len("error: "):]  # the reason, as the console said it

        if mounted:
            box["filler"].unlink()  # space freed
        monkeypatch.delenv("RAYTRAIN_SCU_PAUSE_AT_STEP", raising=False)
        monkeypatch.delenv("RAYTRAIN_SCU_ENOSPC_AT_STEP", raising=False)
        assert main(args) == 0, capsys.readouterr().err[-3000:]
        out = capsys.readouterr().out
        assert "resuming from checkpoint_00000002" in out
        assert ckpt.read_meta(storage / "full" / "checkpoint_00000004")["resumed_at"] == [2]
        run = client.get_run(run.info.run_id)
        assert run.info.status == "FINISHED"
    figures(test="enospc", real_tmpfs=mounted, message=errors[0], steps_lost=2)


# ---------------------------------------------------------------- S3-compatible storage (moto's server)

@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A local S3 API server (moto) with one bucket; yields (endpoint, environment with its credentials)."""
    moto = Path(sys.executable).with_name("moto_server")
    if not moto.exists():
        pytest.skip("moto[server] is not installed (the dev extra)")
    port = free_port()
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    # moto accepts any key; a distinctive secret, so a test can grep for it (never in a log, an object or MLflow)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "awsS3SECRETkey314", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        wait_for(lambda: _listening(port), 60, "moto's S3 server")
        endpoint = f"http://127.0.0.1:{port}"
        with _environ(env):
            import pyarrow.fs as pafs

            fs, _ = pafs.FileSystem.from_uri(f"s3://runs?endpoint_override={endpoint}&allow_bucket_creation=true")
            fs.create_dir("runs")
        yield endpoint, env
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


@contextlib.contextmanager
def _environ(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.slow
def test_a_run_on_s3_storage_checkpoints_resumes_after_sigkill_exports_and_evaluates_there(s3_server, tmp_path,
                                                                                           capsys):
    """run.storage_path=s3://runs/...?endpoint_override=...: Ray Train's checkpoints go to the server, a worker killed
    after step 6 resumes from checkpoint 4 read back from it, the exported adapter is written there, the best
    checkpoint reaches MLflow, and `evaluate --adapter s3://...` scores the adapter from there. The S3 secret (in the
    environment) is in no object of the bucket, no file of the MLflow store, the console or the run's Ray session."""
    import tempfile

    import pyarrow.fs as pafs

    from raytrain_scu.core.storage import download_dir

    endpoint, env = s3_server
    query = f"?endpoint_override={endpoint}"
    hold = tmp_path / "hold"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rts3", dir="/tmp"))  # the run's Ray session, its log files; short path
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update(env, RAY_AUTH_MODE="disabled", RAYTRAIN_SCU_HOLD_AT_STEP="6", RAYTRAIN_SCU_HOLD_DIR=str(hold),
                    RAY_TMPDIR=str(ray_tmp))
    cmd = [sys.executable, "-m", "raytrain_scu.train", TINY, f"run.storage_path=s3://runs/tiny{query}",
           "run.name=s3run", "scaling.num_workers=1", "train.max_steps=8", "train.checkpoint_every=4",
           "train.report_every=2",
           "run.max_failures=1", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=open(tmp_path / "out", "w"),
                            stderr=open(tmp_path / "err", "w"), start_new_session=True)
    try:
        wait_for(lambda: (hold / "rank0.pid").exists() or proc.poll() is not None, 600, "step 6")
        if proc.poll() is None:
            os.kill(int((hold / "rank0.pid").read_text().split()[0]), 9)  # rank 0: the checkpoint writer
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert rc == 0, out[-2000:] + err[-3000:]
    run_s = time.time() - t0
    with _environ(env):
        fs, root = pafs.FileSystem.from_uri(f"s3://runs/tiny/s3run{query}")
        names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(root)))
        assert {"checkpoint_00000004", "checkpoint_00000008", "output"} <= set(names), names
        local = download_dir(f"s3://runs/tiny/s3run/checkpoint_00000008{query}", tmp_path / "ckpt8")
        assert ckpt.verify(local) is None and ckpt.read_meta(local)["resumed_at"] == [4]  # resumed from S3
        adapter = download_dir(f"s3://runs/tiny/s3run/output/adapter{query}", tmp_path / "adapter")
        exported = load_file(adapter / "adapter_model.safetensors")
        final = load_file(local / "adapter" / "adapter_model.safetensors")
        assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    assert "s3://runs/tiny/s3run/output/adapter" in out  # the summary says where it is
    assert re.search(r"^  plots +s3://runs/tiny/s3run/output/plots: s_tracking\.png", out, re.M), out
    from raytrain_scu.cli.runs import main as runs_main

    capsys.readouterr()
    assert runs_main(["s3://runs/tiny"]) == 2  # the listing's CLI names the remote storage it does not read
    assert "s3://runs/tiny is remote storage: the runs listing reads local run" in capsys.readouterr().err
    client, runs = mlflow_runs(tmp_path, "s3run")  # tracking.uri is the default store of storage tmp_path
    run = runs[0]
    assert len(runs) == 1 and run.info.status == "FINISHED"
    assert "best_checkpoint/manifest.json" in [a.path for a in client.list_artifacts(run.info.run_id,
                                                                                     "best_checkpoint")]
    # evaluate (its CLI's main, in this process) reads the adapter from the bucket
    from raytrain_scu.cli.evaluate import main as evaluate

    capsys.readouterr()
    with _environ(env):
        code = evaluate(["--config", TINY, "--adapter", f"s3://runs/tiny/s3run/output/adapter{query}",
                         "--batch-size", "64", "--json", str(tmp_path / "eval.json")])
    stdout = capsys.readouterr().out
    assert code == 0 and "s3://runs/tiny/s3run/output/adapter" in stdout and "held-out BPT" in stdout, stdout
    assert json.loads((tmp_path / "eval.json").read_text())["models"]["A"]["bpt"] > 0
    # the secret: grepped in every object in the bucket, the MLflow store, the console, the Ray session's files
    secret = {"AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"]}
    with _environ(env):
        fs, root = pafs.FileSystem.from_uri(f"s3://runs{query}")
        objects = [i.path for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
                   if i.type == pafs.FileType.File]
        assert len(objects) > 20 and not [o for o in objects if secret["AWS_SECRET_ACCESS_KEY"].encode()
                                          in fs.open_input_stream(o).read()]
    assert secret["AWS_SECRET_ACCESS_KEY"] not in out + err + stdout + mlflow_values(client, run)[0]
    worker_logs = [p for p in ray_tmp.rglob("worker-*") if p.suffix in (".out", ".err")]
    assert worker_logs and leaking_files(ray_tmp, secret) == {} and leaking_files(tmp_path, secret) == {}
    shutil.rmtree(ray_tmp, ignore_errors=True)
    figures(test="s3", kill_step=6, resumed_at=[4], steps_lost=2, run_s=round(run_s, 1))


# ---------------------------------------------------------------- out of device memory

def test_out_of_memory_in_the_first_step_names_the_micro_batch_the_estimate_and_a_batch_that_fits(tmp_path,
                                                                                                   monkeypatch):
    """Injected on the CPU (RAYTRAIN_SCU_OOM_AT=train:1): the message a card of a given size would give, with
    hardware.memory's estimate; the card's size is what the estimator needs to suggest a batch."""
    from raytrain_scu.hardware.shape import memory_kwargs, model_shape
    from raytrain_scu.hardware.memory import estimate_peak_memory_gib
    from raytrain_scu.worker import oom
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    cfg = tiny_cfg(tmp_path, "oom", "scaling.num_workers=1", "tracking.enabled=false", "train.max_steps=2")
    kwargs = {**model_shape(cfg), **memory_kwargs(cfg)}
    kwargs.pop("batch_size")
    at = {b: estimate_peak_memory_gib(batch_size=b, **kwargs)["total_gib"] for b in (2, 3, 4)}
    card = (at[2] + at[3]) / 2 / 0.9  # a card whose usable 90 % holds batch 2 but not 3 by the estimate
    monkeypatch.setattr(oom, "device_memory_gib", lambda device: card)
    monkeypatch.setenv("RAYTRAIN_SCU_OOM_AT", "train:1")
    with pytest.raises(DeviceOutOfMemory) as e:
        run_loop(cfg, hooks=LocalHooks(device=torch.device("cpu"), run_dir=tmp_path / "oom"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"out of memory on a {card:.1f} GiB card in the first training step "
                                              f"(step 1): micro-batch data.batch_size=4 x data.block_size=64")
    assert f"the estimator puts a step at ~{at[4]:.1f} GiB" in msg
    assert f"data.batch_size=2 fits by the estimate (~{at[2]:.1f} GiB), e.g. data.batch_size=2 data.grad_accum=4" in msg
    assert not list((tmp_path / "oom").glob("checkpoint_*"))


def test_out_of_memory_later_keeps_the_last_checkpoint_and_names_the_phase(tmp_path, monkeypatch):
    """An evaluation that runs out (RAYTRAIN_SCU_OOM_AT=eval:4, after checkpoint 2): the error names it, checkpoint 2
    is the newest on disk and verifies, and the next run resumes from it."""
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    args = ["scaling.num_workers=1", "tracking.enabled=false", "train.max_steps=4", "train.checkpoint_every=2",
            "train.report_every=2", "train.eval_every=2"]
    monkeypatch.setenv("RAYTRAIN_SCU_OOM_AT", "eval:4")
    with pytest.raises(DeviceOutOfMemory) as e:
        run_loop(tiny_cfg(tmp_path, "oom", *args), hooks=LocalHooks(device=torch.device("cpu"),
                                                                     run_dir=tmp_path / "oom"))
    msg = str(e.value)
    assert msg.startswith("out of memory on the cpu device in an evaluation at step 4 (micro-batch "
                          "data.batch_size=4 x data.block_size=64; the estimator puts a step at ~"), msg
    assert "the checkpoint of step 2 is kept and a re-run resumes from it" in msg and "\n" not in msg
    assert [p.name for p in (tmp_path / "oom").glob("checkpoint_*")] == ["checkpoint_00000002"]
    monkeypatch.delenv("RAYTRAIN_SCU_OOM_AT")
    hooks = LocalHooks(device=torch.device("cpu"), run_dir=tmp_path / "oom")
    run_loop(tiny_cfg(tmp_path, "oom", *args), hooks=hooks)
    assert [r["step"] for r in hooks.reports] == [4]  # resumed at 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_cuda_out_of_memory_is_said_in_one_line_on_the_gpu(tmp_path, monkeypatch):
    """On a GPU: the 1B shape at 64 x 2048 tokens per micro-batch does not fit an 80 or 141 GiB card, and the first
    step says so with the estimator's batch; then a run that fits has its evaluation at step 2 run out for real (the
    card filled but 32 MiB as the evaluation starts: RAYTRAIN_SCU_OOM_AT=eval:2 on CUDA), says which phase, and
    keeps checkpoint 1."""
    import gc

    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    def message(name, *overrides) -> str:
        """The DeviceOutOfMemory a run of these overrides ends with; the error and its frames (holding the
        activations that did fit) are dropped before the next run."""
        try:
            run_loop(tiny_cfg(tmp_path, name, *overrides),
                     hooks=LocalHooks(device=torch.device("cuda"), run_dir=tmp_path / name))
        except DeviceOutOfMemory as e:
            text = str(e)
        else:
            raise AssertionError(f"{name}: no out-of-memory error")
        gc.collect()
        torch.cuda.empty_cache()
        return text

    big = ["model.name=llama-3.2-1b-shape", "model.precision=bf16", "scaling.num_workers=1", "tracking.enabled=false",
           "train.max_steps=2"]
    msg = message("big", *big, "data.block_size=2048", "data.batch_size=64", "data.grad_accum=1")
    print(f"GPU_OOM first step: {msg}")
    assert "in the first training step (step 1): micro-batch data.batch_size=64 x data.block_size=2048" in msg
    assert "the estimator puts a step at ~" in msg and "fits by the estimate" in msg and "\n" not in msg
    monkeypatch.setenv("RAYTRAIN_SCU_OOM_AT", "eval:2")
    msg = message("later", *big, "data.block_size=512", "data.batch_size=4", "data.grad_accum=1",
                  "train.checkpoint_every=1", "train.report_every=1", "train.eval_every=1")
    print(f"GPU_OOM evaluation: {msg}")
    assert "in an evaluation at step 2" in msg and "the checkpoint of step 1 is kept" in msg
    assert [p.name for p in (tmp_path / "later").glob("checkpoint_*")] == ["checkpoint_00000001"]
    assert ckpt.verify(tmp_path / "later" / "checkpoint_00000001") is None
