"""`ray start --head` on loopback, then `ray job submit --working-dir . -- python -m raytrain_scu.train`.

Every port the head listens on is a free one: with another Ray instance up on this machine (a parallel suite,
PYTEST_ARGS="-n 3"), the default dashboard agent port 52365 is that instance's, and the head's job agent then never
registered ("No available agent to submit job"). The file name once made it run first, before any other Ray started.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, free_port

pytestmark = pytest.mark.slow


def test_ray_job_submit_runs_training(tmp_path):
    bin_dir = Path(sys.executable).parent
    ray = str(bin_dir / "ray")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    gcs, dash, agent = free_port(), free_port(), free_port()
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # AF_UNIX socket paths must stay under 107 bytes
    # --block keeps this head in one process group that the test stops alone (`ray stop` would stop every Ray
    # instance on the machine, other tests' included)
    head = subprocess.Popen([ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                             f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
                             f"--dashboard-agent-listen-port={agent}", "--num-cpus=3",
                             "--include-dashboard=true", f"--temp-dir={temp}", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{dash}/api/version", timeout=2)
            break
        except OSError:
            assert head.poll() is None and time.time() < deadline, "ray head did not come up"
            time.sleep(1)
    try:
        storage = tmp_path / "runs"
        runtime_env = json.dumps({"excludes": [".venv", ".git", "runs", "*.egg-info", ".carry*", ".whl", ".pytest_cache",
                                               ".hypothesis"]})
        submit = (
            [ray, "job", "submit", f"--address=http://127.0.0.1:{dash}", "--working-dir", str(ROOT),
             f"--runtime-env-json={runtime_env}", "--",
             "python", "-m", "raytrain_scu.train", "experiments/tiny-cpu.yaml", f"run.storage_path={storage}",
             "run.name=submitted", "train.max_steps=6", "train.report_every=3", "train.checkpoint_every=3",
             "tracking.enabled=false"])
        for _ in range(60):  # the dashboard answers before its job agent is ready ("No available agent")
            job = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
            out = job.stdout + job.stderr
            if "No available agent" not in out:
                break
            time.sleep(3)
        assert job.returncode == 0, out[-4000:]
        assert "succeeded" in out.lower() and "[raytrain_scu] done" in out, out[-3000:]
        assert (storage / "submitted" / "output" / "adapter" / "adapter_model.safetensors").is_file()
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
