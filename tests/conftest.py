import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments" / "tiny-cpu.yaml")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # tests only: users keep token auth on
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the in-process integration tests."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def tiny_cfg(tmp_path, name, *overrides):
    from raytrain_scu.config import load_config

    return load_config(TINY, [f"run.storage_path={tmp_path}", f"run.name={name}", *overrides])
