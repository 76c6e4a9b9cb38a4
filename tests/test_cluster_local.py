"""`ray up` for real: cluster/local.yaml brings up a Ray head on this machine over SSH, a job trains on it
and `ray down` takes it away, through the Makefile's targets, as docs/deploy.md tells a user:
`make cluster-up CLUSTER=<file>` (token, `ray up`: file_mounts, the file's setup_commands, its head start command),
`ray dashboard <file>` (the SSH tunnel), `make submit` (token auth) of a tiny training run to SUCCEEDED, the run's
MLflow record and checkpoints where the docs say, `make cluster-down`.

This machine is the head (provider `local`, head_ip 127.0.0.1, no workers), reached over SSH:
- sshd is the test's own: on a free loopback port, with a host key and a client key made here. A cluster file has
  no SSH port, so the launcher reaches it with `auth.ssh_proxy_command: nc 127.0.0.1 <port>`. openssh-server,
  rsync (file_mounts) and netcat are installed with apt where they are missing.
- sshd runs in a PID namespace of its own. The cluster's `ray stop`s (node.sh's before `ray start`, `ray down`'s)
  stop every Ray process their user can see, and in there that is the test's alone: no other Ray instance on this
  machine is touched. A sentinel outside, which `ray stop` would match, proves it.
- The head's user is this user with a fresh home (a copy of /etc/skel) and TMPDIR (sshd's SetEnv), so the venv,
  the synced repository, the token, Ray's session files and the run land in the test's directory (on tmpfs where
  it has room). The user's pip settings come along as ~/.config/pip/pip.conf, with the pip cache `make setup`
  filled: what this user's own head would have, and where the pinned CPU torch is found. Byte-compiling is off.

The test's copy of local.yaml changes the cluster name, the addresses, the SSH user, key and proxy, and the head's
ports (free ones: another Ray on this machine may hold 6379, 8265, 52365 or 10001). Its setup and start commands
are the file's own: cluster/node.sh, which a100.yaml and h100.yaml run too. Only the client side (make, `ray up`,
`ray job submit`) runs from the suite's venv; the training runs in the venv the cluster file makes.
"""
import ast
import getpass
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import ROOT, free_port

pytestmark = [pytest.mark.slow,
              # MLflow's sqlite store, opened here to read the run's record, on the installed SQLAlchemy
              pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")]

# tool -> the Debian package that has it
TOOLS = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "rsync": "rsync",
         "nc": "netcat-openbsd", "unshare": "util-linux"}
SBIN_PATH = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"


def missing_packages() -> list[str]:
    return sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool, path=SBIN_PATH) is None})


def install_tools_or_skip():
    """openssh-server, rsync and netcat from apt where missing (CI's machine starts with none of them)."""
    missing = missing_packages()
    if not missing:
        return
    how = f"apt-get install {' '.join(missing)}"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"sshd cannot be installed here ({how} needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # openssh-server may upgrade openssh-client: keep its config files without asking
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "Dpkg::Options::=--force-confdef",
               "-o", "Dpkg::Options::=--force-confold", *missing]
    apt = dict(capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=600)
    out = subprocess.run(install, **apt)
    if out.returncode != 0:  # stale or absent package lists
        subprocess.run(["apt-get", "update", "-q"], **apt)
        out = subprocess.run(install, **apt)
    if missing_packages():
        pytest.skip(f"sshd cannot be installed here: {how} failed: {(out.stdout + out.stderr)[-1500:]}")


def pid_namespace_or_skip():
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "true"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip("no PID namespace for the test's sshd (unshare --pid needs root): without one, the cluster "
                    f"file's `ray stop` would stop every Ray process of this user: {out.stderr.strip()}")


def pip_conf(python: str) -> str:
    """The pip settings ``python``'s pip runs with (its config files and PIP_* variables, the variables winning as
    in pip), plus its cache directory, as one pip.conf. Byte-compiling off: it took half of pip's time for the
    venv (~80 of ~160 s here), for modules no one imports; Python compiles the ones the run imports."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=120)
    sections: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in listed.stdout.splitlines():
        m = re.match(r"^([^.=]*)\.([^=]+)=(.*)$", line)
        if not m:
            continue
        section, key, value = m.group(1), m.group(2), ast.literal_eval(m.group(3))
        (env if section == ":env:" else sections.setdefault(section, {}))[key] = value
    sections.setdefault("global", {}).update(env)
    cache = subprocess.run([python, "-m", "pip", "cache", "dir"], capture_output=True, text=True, timeout=120)
    if cache.returncode == 0 and cache.stdout.strip():
        sections["global"]["cache-dir"] = cache.stdout.strip()
    sections.setdefault("install", {})["compile"] = "false"
    lines = []
    for section, settings in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = " + value.replace("\n", "\n    ") for key, value in settings.items()]  # lists: indented
    return "\n".join(lines) + "\n"


def scratch() -> str:
    """tmpfs where it has room, else /tmp: the head's venv (~2 GiB in tens of thousands of files) is written faster
    and deleted in seconds instead of ~1.5 min on this machine's disk."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 8 * 2**30:
        return shm
    return "/tmp"


def wait_for(check, timeout: float, what: str, alive=None):
    deadline = time.time() + timeout
    while not check():
        assert alive is None or alive(), f"{what}: the process exited"
        assert time.time() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.5)


def accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=3)
    except urllib.error.HTTPError:  # it answered (401 without the token)
        return True
    except OSError:
        return False
    return True


def pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def processes_in(ns: str) -> list[str]:
    """Every process of PID namespace ``ns`` but sshd's own (the listener and its connections), as text."""
    left = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        if pid_ns(proc.info["pid"]) == ns and not (proc.info["name"] or "").startswith("sshd"):
            left.append(f"{proc.info['pid']} {proc.info['name']}: {' '.join(proc.info['cmdline'] or [])[:200]}")
    return left


def tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def test_local_cluster_file_runs_a_job_over_ssh():
    install_tools_or_skip()
    if os.geteuid() != 0:
        pytest.skip("sshd (privilege separation) and the PID namespace need root")
    pid_namespace_or_skip()
    venv = Path(sys.prefix)
    assert (venv / "bin" / "ray").exists(), f"the suite runs outside the venv make setup builds: {venv}"

    t0 = time.time()
    phases: dict[str, float] = {}

    def phase(name):  # printed as it goes: pytest shows it with a failure
        phases[name] = round(time.time() - t0 - sum(phases.values()), 1)
        print(f"{name}: {phases[name]} s")

    # short: Ray's AF_UNIX socket paths live under the head's TMPDIR and must stay under 107 bytes
    base = Path(tempfile.mkdtemp(prefix="rc", dir=scratch()))
    ssh, home, head_tmp, client, client_tmp, logs = (base / d for d in ("ssh", "home", "tmp", "client", "ctmp", "logs"))
    for d in (ssh, head_tmp, client, client_tmp, logs):
        d.mkdir()
    user = getpass.getuser()
    cluster_name = f"raytrain-scu-test-{uuid.uuid4().hex[:8]}"
    sshd = sentinel = tunnel = None
    try:
        # ---- this machine as an SSH host: keys, a fresh home, sshd in a PID namespace of its own
        for key in ("host_key", "id_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "raytrain-scu-test", "-f",
                            str(ssh / key)], check=True, capture_output=True, timeout=60)
        shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
        if Path("/etc/skel").is_dir():
            shutil.copytree("/etc/skel", home, symlinks=True)
        else:
            home.mkdir()
        (home / ".config" / "pip").mkdir(parents=True)
        (home / ".config" / "pip" / "pip.conf").write_text(pip_conf(sys.executable))
        ssh_port = free_port()
        (ssh / "sshd_config").write_text(
            f"Port {ssh_port}\nListenAddress 127.0.0.1\nHostKey {ssh}/host_key\nPidFile none\n"
            f"AuthorizedKeysFile {ssh}/authorized_keys\nAllowUsers {user}\nPermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nX11Forwarding no\nPermitUserEnvironment no\nLogLevel ERROR\n"
            f"SetEnv HOME={home} TMPDIR={head_tmp}\n")
        sshd_bin = shutil.which("sshd", path=SBIN_PATH)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation directory
        check = subprocess.run([sshd_bin, "-t", "-f", str(ssh / "sshd_config")], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        # --kill-child: when unshare goes, sshd (the namespace's init) goes, and with it everything in the namespace
        sshd = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sshd_bin, "-D", "-e",
                                 "-f", str(ssh / "sshd_config")], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=open(logs / "sshd.log", "w"), start_new_session=True)
        wait_for(lambda: accepts(ssh_port), 30, "sshd", alive=lambda: sshd.poll() is None)
        wait_for(lambda: psutil.Process(sshd.pid).children(), 10, "sshd in its namespace")
        ns = pid_ns(psutil.Process(sshd.pid).children()[0].pid)
        assert ns and ns != pid_ns(os.getpid())
        # a process outside that `ray stop` would stop (it matches "log_monitor.py" in a command line)
        sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", "log_monitor.py"],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)

        # ---- the test's copy of cluster/local.yaml: where the head is and how to log in; free ports for the head
        config = yaml.safe_load((ROOT / "cluster" / "local.yaml").read_text())
        config["cluster_name"] = cluster_name
        config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
        config["auth"] = {"ssh_user": user, "ssh_private_key": str(ssh / "id_ed25519"),
                          "ssh_proxy_command": f"nc 127.0.0.1 {ssh_port}"}
        gcs, dash, agent, ray_client = free_port(), free_port(), free_port(), free_port()
        [head_cmd] = config["head_start_ray_commands"]
        assert "cluster/node.sh" in head_cmd and " --port=6379" in head_cmd, head_cmd
        config["head_start_ray_commands"] = [
            head_cmd.replace(" --port=6379", f" --port={gcs}") + f" --node-ip-address=127.0.0.1 --dashboard-port={dash}"
            f" --dashboard-agent-listen-port={agent} --ray-client-server-port={ray_client}"]
        cluster_file = base / "local-test.yaml"
        cluster_file.write_text(yaml.safe_dump(config, sort_keys=False))
        phase("sshd")

        # ---- the client: a fresh home (its token), the suite's venv; make must not rebuild that venv mid-suite
        env = {k: v for k, v in os.environ.items()
               if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "RAY_ADDRESS", "RAY_AUTH_MODE")}
        env.update(HOME=str(client), TMPDIR=str(client_tmp), RAY_USAGE_STATS_ENABLED="0")
        make = ["make", "--no-print-directory", f"VENV={venv}", "-o", str(venv / ".setup-stamp")]

        def run(name, argv, timeout):
            with open(logs / f"{name}.log", "w") as log:
                out = subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, timeout=timeout)
            return out.returncode, tail(logs / f"{name}.log")

        rc, out = run("up", [*make, "cluster-up", f"CLUSTER={cluster_file}"], timeout=1500)
        assert rc == 0, f"make cluster-up failed:\n{out}\n--- sshd:\n{tail(logs / 'sshd.log', 2000)}"
        phase("cluster-up")
        # the token went to the head; the venv there has the pinned CPU torch and the package from the synced copy
        assert (client / ".ray" / "auth_token").read_text() == (home / ".ray" / "auth_token").read_text()
        head_python = str(home / "raytrain_scu_venv" / "bin" / "python")
        torch_version = subprocess.run([head_python, "-c", "import torch; print(torch.__version__)"],
                                       capture_output=True, text=True, timeout=300).stdout.strip()
        pin = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
        assert torch_version == f"{pin}+cpu", torch_version
        shown = subprocess.run([head_python, "-m", "pip", "show", "raytrain_scu"], capture_output=True, text=True,
                               timeout=120).stdout
        assert f"Editable project location: {home / 'raytrain_scu'}" in shown, shown
        assert (home / "raytrain_scu" / "cluster" / "node.sh").is_file()
        assert not (home / "raytrain_scu" / ".venv").exists() and not (home / "raytrain_scu" / ".git").exists()

        # ---- the docs' way in: `ray dashboard <file>` (an SSH tunnel), then `make submit` with token auth
        local_dash = free_port()
        tunnel = subprocess.Popen([str(venv / "bin" / "ray"), "dashboard", "--port", str(local_dash),
                                   "--remote-port", str(dash), str(cluster_file)], cwd=ROOT, env=env,
                                  stdin=subprocess.DEVNULL, stdout=open(logs / "dashboard.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        address = f"http://127.0.0.1:{local_dash}"
        wait_for(lambda: answers(f"{address}/api/version"), 120, "ray dashboard's tunnel",
                 alive=lambda: tunnel.poll() is None)
        phase("tunnel")
        with pytest.raises(urllib.error.HTTPError) as refused:  # the head enforces token auth
            urllib.request.urlopen(f"{address}/api/jobs/", timeout=30)
        assert refused.value.code in (401, 403), refused.value
        args = "run.name=cluster train.max_steps=6 train.report_every=3 train.checkpoint_every=3 scaling.num_workers=1"
        submit = [*make, "submit", "CONFIG=experiments/tiny-cpu.yaml", f"ARGS={args}", f"RAY_ADDRESS_SUBMIT={address}"]
        for attempt in range(40):  # the dashboard answers before its job agent is ready ("No available agent")
            rc, out = run("submit", submit, timeout=900)
            if "No available agent" not in out:
                break
            time.sleep(3)
        print(f"submitted at attempt {attempt + 1}")
        assert rc == 0 and "succeeded" in out.lower() and "[raytrain_scu] done" in out, out
        phase("job")

        # ---- where docs/deploy.md says: the default run.storage_path (~/raytrain_scu_runs) on the head
        storage = home / "raytrain_scu_runs"
        run_dir = storage / "cluster"
        checkpoints = sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir())
        assert checkpoints and any(checkpoints[-1].iterdir()), sorted(p.name for p in run_dir.iterdir())
        assert (run_dir / "output" / "adapter" / "adapter_model.safetensors").is_file()
        assert (run_dir / "output" / "summary.json").is_file()
        # read with the head's own MLflow, as `mlflow ui` on the head would: the node's venv resolves the package's
        # requirements when the cluster comes up, and may hold a newer MLflow (database schema) than this process
        query = ("import json, sys; from mlflow.tracking import MlflowClient; c = MlflowClient(sys.argv[1]); "
                 "e = [x.experiment_id for x in c.search_experiments()]; "
                 "r = c.search_runs(e, filter_string=\"tags.`mlflow.runName` = 'cluster'\"); "
                 "print(json.dumps([[x.info.status, len(x.data.metrics), len(x.data.params)] for x in r]))")
        got = subprocess.run([head_python, "-c", query, f"sqlite:///{storage / 'mlflow.db'}"], capture_output=True,
                             text=True, timeout=300)
        assert got.returncode == 0, got.stderr[-2000:]
        [[status, n_metrics, n_params]] = json.loads(got.stdout.strip().splitlines()[-1])
        assert status == "FINISHED" and n_metrics and n_params, got.stdout

        # ---- `make cluster-down`: the head's Ray goes, nothing outside the test's namespace was stopped
        assert any(" raylet:" in p for p in processes_in(ns)), processes_in(ns)  # the head ran in there
        os.killpg(tunnel.pid, signal.SIGTERM)
        tunnel.wait(timeout=30)
        rc, out = run("down", [*make, "cluster-down", f"CLUSTER={cluster_file}"], timeout=600)
        assert rc == 0, f"make cluster-down failed:\n{out}"
        phase("cluster-down")
        try:
            wait_for(lambda: not processes_in(ns), 30, "the head's processes")
        except AssertionError:
            pytest.fail("left after make cluster-down:\n" + "\n".join(processes_in(ns)) + f"\n--- ray down:\n{out}")
        assert sentinel.poll() is None, "a process outside the test's namespace that `ray stop` matches was stopped"
        assert sshd.poll() is None, "sshd went"

        # ---- and when the test's sshd goes, nothing of the test is left (tunnel, the launcher's SSH masters).
        # unshare ignores SIGTERM while it waits; killed, it takes sshd (--kill-child) and the namespace with it
        sshd.kill()
        sshd.wait(timeout=30)

        def ours():
            return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
                    if str(base) in " ".join(p.info["cmdline"] or [])]

        wait_for(lambda: not ours(), 30, "processes of the test")
        phase("checks")
    finally:
        for proc in (tunnel, sshd, sentinel):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        # the launcher's SSH control sockets: /tmp/ray_ssh_<user hash>/<cluster hash>
        control = Path(f"/tmp/ray_ssh_{hashlib.sha256(user.encode()).hexdigest()[:10]}")
        shutil.rmtree(control / hashlib.sha256(cluster_name.encode()).hexdigest()[:10], ignore_errors=True)
        try:
            control.rmdir()  # where no other cluster's are
        except OSError:
            pass
        shutil.rmtree(base, ignore_errors=True)
        print(f"cleanup: {time.time() - t0 - sum(phases.values()):.1f} s")
