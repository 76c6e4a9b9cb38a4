"""cluster/*.yaml: valid for the installed Ray's cluster launcher (offline: no AWS), and our own rules:
integer GPUs, the package installed from the synced directory, no Ray port open to the world, the Ray image
of the installed Ray version, token auth on every node. Also the Makefile's cluster recipes."""
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
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


def start_commands(config: dict) -> list[str]:
    return [c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"]
            if "ray start" in c]


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
def test_setup_installs_the_synced_package_with_pinned_torch(path):
    config = load(path)
    assert config["file_mounts"]["~/raytrain_scu"] == "."
    setup = config["setup_commands"]
    assert any(re.search(r"pip install .*-e ~/raytrain_scu(\s|$)", c) for c in setup), setup
    pins = [c for c in setup if re.search(r"pip install .*torch==", c)]
    assert pins and all(makefile_torch_pin() in c for c in pins), pins
    assert ".venv" in config["rsync_exclude"]


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
def test_token_auth_is_on(path):
    config = load(path)
    starts = start_commands(config)
    assert len(starts) == 2
    assert all("RAY_AUTH_MODE=token" in c for c in starts), starts
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    text = path.read_text()
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


def test_make_cluster_up_and_down(make):
    up = make("cluster-up", "CLUSTER=cluster/h100.yaml")
    assert "ray get-auth-token --generate" in up and ".venv/bin/ray up -y cluster/h100.yaml" in up
    assert ".venv/bin/ray down -y cluster/a100.yaml" in make("cluster-down")


def test_make_submit(make):
    out = make("submit", "CONFIG=experiments/tiny-cpu.yaml", "ARGS=train.max_steps=5")
    line = " ".join(out.replace("\\\n", " ").splitlines()[-1:])
    assert line.startswith("RAY_AUTH_MODE=token .venv/bin/ray job submit --address http://127.0.0.1:8265")
    argv = shlex.split(line)
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    assert {".venv", "runs"} <= set(runtime_env["excludes"])
    assert argv[argv.index("--") + 1:] == ["python", "-m", "raytrain_scu.train", "experiments/tiny-cpu.yaml",
                                           "train.max_steps=5"]
