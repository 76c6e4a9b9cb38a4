"""The environment checks behind ``python -m raytrain_scu.check``: can this machine (or the cluster in RAY_ADDRESS)
run raytrain_scu? One :class:`Row` per requirement with pass / warn / fail / skip.
"No GPU" is a warning, not a failure (CPU training works), unless ``--require-gpu``. The config (optional)
supplies ``run.storage_path`` for the disk check and is shown with the preset ``auto`` would pick here.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import re
import shutil
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from raytrain_scu.config.schema import Config, RunConfig
from raytrain_scu.hardware.gpus import GIB, GpuInfo, detect_gpus
from raytrain_scu.hardware.presets import PRESETS, preset_for

NO_GPU_MESSAGE = "no GPU found (CPU training only)"
MIN_FREE_GIB, WARN_FREE_GIB = 1.0, 10.0
PROBE_TIMEOUT_S = 3.0

# distribution -> (lowest version, version below which it is too new or None, required)
PACKAGES = {
    "torch": ((2, 4), None, True),
    "transformers": ((4, 56), None, True),
    "peft": ((0, 17), None, True),
    "ray": ((2, 60), (2, 61), True),
    "mlflow-skinny": ((3, 13), None, True),
    "bitsandbytes": ((0, 45), None, False),  # only 4-bit needs it: a warning
}


@dataclass
class Row:
    name: str
    status: str  # pass | warn | fail | skip
    detail: str
    data: dict = field(default_factory=dict)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def check_python() -> Row:
    v = sys.version_info
    ok = (v.major, v.minor) >= (3, 10)
    return Row("python", "pass" if ok else "fail", f"{v.major}.{v.minor}.{v.micro} (need >= 3.10)")


def check_package(dist: str) -> Row:
    low, high, required = PACKAGES[dist]
    want = f">= {_fmt(low)}" + (f", < {_fmt(high)}" if high else "")
    name = "mlflow" if dist == "mlflow-skinny" else dist
    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        if dist == "mlflow-skinny":  # the full mlflow package carries the same client
            try:
                version = md.version("mlflow")
            except md.PackageNotFoundError:
                version = ""
        else:
            version = ""
    if not version:
        return Row(name, "fail" if required else "warn", f"not installed (need {want})")
    v = _version_tuple(version)
    ok = v >= low and (high is None or v < high)
    bad = "fail" if required else "warn"
    return Row(name, "pass" if ok else bad, f"{version} (need {want})", {"version": version})


def check_bitsandbytes() -> Row:
    """Installed is not enough: 4-bit loading imports it, so import it here too."""
    row = check_package("bitsandbytes")
    if row.status != "pass":
        return Row(row.name, "warn", row.detail + "; quant.load_in_4bit will not work", row.data)
    try:
        importlib.import_module("bitsandbytes")
    except Exception as e:  # a broken native library raises anything
        return Row(row.name, "warn", f"{row.detail} but import failed: {e}; quant.load_in_4bit will not work")
    return row


def check_torch_cuda(gpus: list[GpuInfo]) -> list[Row]:
    """CUDA as torch sees it, and NCCL where there are GPUs to use it."""
    try:
        import torch
    except Exception as e:
        return [Row("cuda", "fail", f"torch import failed: {e}")]
    built = torch.version.cuda
    available = torch.cuda.is_available()
    if available:
        rows = [Row("cuda", "pass", f"available, torch built for CUDA {built}, "
                                    f"{torch.cuda.device_count()} device(s)", {"cuda": built})]
    elif gpus:
        rows = [Row("cuda", "fail", f"{len(gpus)} GPU(s) visible to NVML but torch.cuda.is_available() is "
                                    f"False (torch built for CUDA {built}; a CPU-only wheel or a driver older "
                                    f"than CUDA {built} needs?)")]
    else:
        rows = [Row("cuda", "skip", f"not available (torch built for CUDA {built})" if built
                    else "not available (CPU-only torch build)")]
    if gpus:
        import torch.distributed as tdist
        nccl = tdist.is_available() and tdist.is_nccl_available()
        rows.append(Row("nccl", "pass" if nccl else "fail",
                        "available" if nccl else "torch.distributed has no NCCL: multi-GPU training fails"))
    else:
        rows.append(Row("nccl", "skip", "no GPU: CPU workers use gloo"))
    return rows


def check_gpus(gpus: list[GpuInfo], require_gpu: bool) -> list[Row]:
    if not gpus:
        return [Row("gpu", "fail" if require_gpu else "warn", NO_GPU_MESSAGE)]
    rows = []
    for g in gpus:
        cc = f"{g.compute_capability[0]}.{g.compute_capability[1]}"
        rows.append(Row(f"gpu{g.index}", "pass", f"{g.name}, {g.memory_gib:.1f} GiB, cc {cc}, "
                                                 f"bf16 {'yes' if g.bf16 else 'no'}", g.to_dict()))
    g = gpus[0]
    rows.append(Row("driver", "pass", f"{g.driver_version} (supports CUDA {g.cuda_driver_version})"))
    return rows


def _existing_ancestor(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_status(free_gib: float) -> str:
    return "fail" if free_gib < MIN_FREE_GIB else "warn" if free_gib < WARN_FREE_GIB else "pass"


def check_disk(storage_path: str) -> Row:
    if "://" in storage_path:
        return Row("disk", "skip", f"{storage_path}: remote storage, not checked here")
    where = _existing_ancestor(Path(storage_path))
    free_gib = shutil.disk_usage(where).free / GIB
    status = disk_status(free_gib)
    note = {"fail": f" (need >= {MIN_FREE_GIB:.0f} GiB)", "warn": f" (< {WARN_FREE_GIB:.0f} GiB: checkpoints "
            "may not fit)", "pass": ""}[status]
    return Row("disk", status, f"{free_gib:.1f} GiB free at {where} for run.storage_path={storage_path}{note}",
               {"free_gib": round(free_gib, 2)})


def _auth_token() -> Optional[str]:
    """The token a Ray client would send: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _probe_http(address: str, timeout_s: float) -> Row:
    """GET /api/version of a dashboard/jobs address, with the token if there is one."""
    request = urllib.request.Request(address.rstrip("/") + "/api/version")
    token = _auth_token()
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            return Row("ray cluster", "fail", f"{address} answered {e.code}: the token was "
                       f"{'rejected' if token else 'missing'} (RAY_AUTH_MODE=token needs the cluster's "
                       "token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)")
        return Row("ray cluster", "fail", f"{address} answered HTTP {e.code}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        return Row("ray cluster", "fail", f"{address} unreachable within {timeout_s:.0f}s: {e}")
    version = str(body.get("ray_version", "?"))
    local = md.version("ray") if _installed("ray") else "?"
    status = "pass" if version == local else "warn"
    note = "" if status == "pass" else f" (local ray is {local}: client and cluster should match)"
    return Row("ray cluster", status, f"{address} reachable, ray {version}{note}", {"ray_version": version})


def _installed(dist: str) -> bool:
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


def _probe_tcp(address: str, host: str, port: int, timeout_s: float) -> Row:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        return Row("ray cluster", "fail", f"{address} unreachable within {timeout_s:.0f}s: {e}")
    return Row("ray cluster", "pass", f"{address} accepts connections (TCP only: token not checked)")


def check_ray_cluster(address: Optional[str], timeout_s: float = PROBE_TIMEOUT_S) -> Row:
    """Reachability of RAY_ADDRESS: http(s):// (dashboard/jobs API), ray://host:port (client), host:port
    (GCS) or auto (the cluster this machine started). Skipped when RAY_ADDRESS is unset."""
    if not address:
        return Row("ray cluster", "skip", "RAY_ADDRESS not set (training starts a local Ray)")
    if address.startswith(("http://", "https://")):
        return _probe_http(address, timeout_s)
    target = address
    if address in ("auto", "local"):
        # `ray start --head` records the GCS address of the cluster it started here
        tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"  # Ray's own lookup order
        current = Path(tmp) / "ray" / "ray_current_cluster"
        try:
            target = current.read_text().strip()
        except OSError:
            return Row("ray cluster", "fail", f"RAY_ADDRESS={address} but no local Ray cluster is running "
                                              f"({current} missing)")
    parsed = urllib.parse.urlsplit(target if "://" in target else f"gcs://{target}")
    if not parsed.hostname or not parsed.port:
        return Row("ray cluster", "fail", f"RAY_ADDRESS={address}: expected http(s)://host:port, "
                                          "ray://host:port, host:port or auto")
    return _probe_tcp(address, parsed.hostname, parsed.port, timeout_s)


def check_preset(gpus: list[GpuInfo], cfg: Optional[Config]) -> Row:
    name = preset_for(gpus)
    values = " ".join(f"{k}={v}" for k, v in PRESETS[name].items())
    detail = f"auto would pick '{name}': {values}"
    if cfg is not None and cfg.hardware.preset not in ("none", "auto"):
        detail += f" (config sets hardware.preset={cfg.hardware.preset})"
    return Row("preset", "pass", detail, {"auto": name, "values": PRESETS[name]})


def run_checks(cfg: Optional[Config] = None, require_gpu: bool = False,
               gpus: Optional[list[GpuInfo]] = None) -> list[Row]:
    """Every check, in the order printed."""
    gpus = detect_gpus() if gpus is None else gpus
    storage_path = cfg.run.storage_path if cfg is not None else RunConfig().storage_path
    rows = [check_python()]
    rows += [check_package(dist) for dist in ("torch", "transformers", "peft", "ray", "mlflow-skinny")]
    rows += check_torch_cuda(gpus)
    rows += check_gpus(gpus, require_gpu)
    rows.append(check_bitsandbytes())
    rows.append(check_disk(storage_path))
    rows.append(check_ray_cluster(os.environ.get("RAY_ADDRESS")))
    rows.append(check_preset(gpus, cfg))
    return rows
