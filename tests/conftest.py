import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments" / "tiny-cpu.yaml")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # tests only: users keep token auth on
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray Train's preemption watcher (a node-drain poller, one more actor process per run) watches for spot-instance
# reclaims, which never happen here: off in tests, one process start (~2 s of CPU on 2 cores) less per run
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# inductor compiles in the process that compiles, without a pool of compile workers (each a process that imports
# torch): on 2 cores the pool's start-up costs more CPU than its parallelism saves. Inherited by the Ray workers and
# CLI subprocesses the tests start.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# an MLflow server or UI a test starts runs without MLflow's job execution (GenAI jobs: a job runner and seven huey
# consumers, each a process importing MLflow), which serving a tracking store does not use
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")


def pytest_configure(config):
    """One intra-op thread for the torch work done in this (the pytest) process: scoring, in-process loops, tensor
    checks. Its default, one thread per core, spin-waits when Ray's actors or another job hold those cores: on 2 busy
    cores one tiny-model scoring pass took 19-50 s instead of 1.9 s. Ray's workers and the CLI subprocesses keep
    their own settings (Ray gives each worker as many threads as CPUs it holds)."""
    import torch

    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        # without a GPU, the package's torch.compile calls compile with dynamo, AOTAutograd and the min-cut partitioner
        # but not inductor's C++ code generation (core.loss.compile_options): the graphs, graph breaks, recompiles and
        # partitions the tests check are what inductor is given either way, and its C++ compiler processes cost the
        # suite minutes; on a GPU (the gpu-marked tests) inductor compiles. Inherited by Ray's workers and the CLIs.
        os.environ.setdefault("RAYTRAIN_SCU_COMPILE_BACKEND", "aot_eager_decomp_partition")
    # xdist's loadfile hands out the files with the most tests first by default, which puts the few-test files of
    # minutes (a local cluster) last, one process running them alone while the other idles: here it
    # takes them in the order pytest_collection_modifyitems gives (an explicit --loadscope-reorder keeps xdist's)
    if "--loadscope-reorder" not in config.invocation_params.args and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if _xdist_controller(config) and not config.option.collectonly:
        _start_shared_ray()


def pytest_unconfigure(config):
    if _xdist_controller(config) and SHARED_RAY in os.environ:
        import ray

        shutdown_ray(ray)


SHARED_RAY = "RAYTRAIN_SCU_TEST_RAY"  # the GCS address of the Ray that xdist's processes share


def _xdist_controller(config) -> bool:
    """True in the process that hands files to xdist's processes (``make test``'s ``-n 2``), not in those processes
    and not in a serial run."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def _start_shared_ray() -> None:
    """One local Ray for both of xdist's processes, started by the process that hands them files and stopped when it
    ends (:func:`ray_local` joins it through ``RAYTRAIN_SCU_TEST_RAY``, which they inherit). Ray's daemons poll while
    idle: measured on a 2-core machine, one local Ray with its dashboard keeps 0.2-0.45 of a core busy doing nothing,
    so a Ray per process spent that twice over for the suite's whole length. 8 logical CPUs, twice what one process's
    own Ray had (either process's runs may take them all). Its own driver runs nothing, so Ray starts no idle workers
    for it."""
    import ray

    os.environ["RAY_prestart_worker_first_driver"] = "false"
    try:
        ray.init(num_cpus=8, include_dashboard=True, dashboard_port=free_port(), log_to_driver=False)
    finally:
        del os.environ["RAY_prestart_worker_first_driver"]
    os.environ[SHARED_RAY] = ray.get_runtime_context().gcs_address


def pytest_collection_modifyitems(config, items):
    """The files whose every test is slow first, then those with the most slow tests, the files without any after
    them, each file's tests together and in their own order. `make test` (--dist loadfile) hands whole files to its
    processes in this order: the files of minutes start first and the files of seconds fill the end, so neither
    process sits idle while the other runs a long file alone."""
    def file_of(item):
        return item.nodeid.split("::")[0]

    slow, count = {}, {}
    for item in items:
        slow[file_of(item)] = slow.get(file_of(item), 0) + (item.get_closest_marker("slow") is not None)
        count[file_of(item)] = count.get(file_of(item), 0) + 1
    collected = {f: i for i, f in enumerate(slow)}  # the files in collection order
    # a file slow as a whole (a few end-to-end tests of minutes: a local cluster over SSH) before the rest
    items.sort(key=lambda item: (slow[file_of(item)] < count[file_of(item)], -slow[file_of(item)],
                                 collected[file_of(item)]))


@pytest.fixture(scope="session")
def ray_local():
    """The Ray of the in-process integration tests: under xdist the one its processes share (:func:`_start_shared_ray`),
    in a serial run one of this process's own; either has its dashboard on a port of its own.

    Ray Train's placement-group cleaner asks the State API, at the dashboard address this cluster records, whether
    the run's controller lives, and takes "not found" for dead. Without a dashboard that address is still
    127.0.0.1:8265, so while another Ray on this machine serves its dashboard there (a CLI test's local Ray), the
    cleaner finds no such controller and removes the live run's placement group: its workers die with "Destroying
    worker since its placement group was removed"."""
    import ray

    if not ray.is_initialized():
        if SHARED_RAY in os.environ:
            ray.init(address=os.environ[SHARED_RAY], log_to_driver=False)
        else:
            ray.init(num_cpus=4, include_dashboard=True, dashboard_port=free_port(), log_to_driver=False)
    yield ray
    shutdown_ray(ray)


@pytest.fixture(scope="session")
def ray_address(ray_local) -> str:
    """The GCS address of the tests' Ray (``ray_local``), for a CLI subprocess to join as RAY_ADDRESS: a test whose
    property is not Ray's start saves that start (seconds of CPU for its daemons and their idle polling)."""
    return ray_local.get_runtime_context().gcs_address


def shutdown_ray(ray, timeout_s: float = 60.0) -> None:
    """ray.shutdown() that cannot hang the test process: Ray's GCS subscribers can block for good while they close
    (ray-project/ray#45044; seen here at a session's end), so they are closed first, each in a daemon thread given
    ``timeout_s``, and shutdown then skips any subscriber or listening thread that did not finish."""
    import threading

    worker = ray._private.worker.global_worker
    if not worker.connected:
        return
    worker.threads_stopped.set()  # the listening threads leave their loops once their subscriber returns
    for name in ("gcs_error_subscriber", "gcs_log_subscriber"):
        sub = getattr(worker, name, None)
        if sub is not None:
            closing = threading.Thread(target=sub.close, daemon=True)
            closing.start()
            closing.join(timeout_s)
            delattr(worker, name)  # closed, or stuck: either way shutdown must not close it again
    for name in ("listener_thread", "logger_thread"):
        thread = getattr(worker, name, None)
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                delattr(worker, name)
    ray.shutdown()


# the plain run the fused-LoRA and FP8 tests compare against: the same config but for the key they switch on
PLAIN_RUN = ["train.max_steps=6", "train.report_every=3", "train.checkpoint_every=6", "train.eval_every=6"]


@pytest.fixture(scope="session")
def plain_run(ray_local, tmp_path_factory):
    """(storage, summary) of one plain 2-worker tiny run with MLflow (PLAIN_RUN), trained once per session. Under
    xdist its storage is the one both processes share (the parent of their temporary directories): the first to ask
    trains it, holding a lock, and the other waits for the lock (at most 15 minutes) and gets the finished run's
    summary the way a re-run does (driver.run: a finished run is reported without Ray)."""
    from filelock import FileLock

    from raytrain_scu.driver.run import run

    base = tmp_path_factory.getbasetemp()
    storage = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "plain-shared"
    with FileLock(f"{storage}.lock", timeout=900):
        return storage, run(tiny_cfg(storage, "plain", *PLAIN_RUN), quiet=True)


def in_process(cfg) -> dict:
    """The loop in this process (one rank, no Ray: what it computes does not depend on Ray); its last report."""
    import torch

    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    hooks = LocalHooks(device=torch.device("cpu"))
    run_loop(cfg, hooks=hooks)
    return hooks.reports[-1]


def metric_history(storage, run_name: str, key: str) -> list[float]:
    """Every logged value of ``key`` of the MLflow run ``run_name``, in step order."""
    client, runs = mlflow_runs(storage, run_name)
    assert len(runs) == 1, runs
    return [m.value for m in sorted(client.get_metric_history(runs[0].info.run_id, key), key=lambda m: m.step)]


def tiny_cfg(tmp_path, name, *overrides):
    from raytrain_scu.config.load import load_config

    return load_config(TINY, [f"run.storage_path={tmp_path}", f"run.name={name}", *overrides])


def cli(*overrides, env=None, timeout=600):
    """``python -m raytrain_scu.train experiments/tiny-cpu.yaml *overrides`` in a subprocess, output captured. It
    starts its own Ray unless ``env`` names a RAY_ADDRESS (one inherited from this process is dropped)."""
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update({"RAY_AUTH_MODE": "disabled", **(env or {})})
    return subprocess.run([sys.executable, "-m", "raytrain_scu.train", TINY, *overrides], capture_output=True,
                          text=True, cwd=ROOT, env=full_env, timeout=timeout)


def user_env(home: Path) -> dict:
    """The environment of a person's first run: Ray's token authentication at its default (RAY_AUTH_MODE unset: a
    new local Ray turns it on and says so), a fresh home (its token lands there); the package's and matplotlib's
    caches are this machine's, so a test does not rebuild them."""
    import matplotlib

    from raytrain_scu.core.model.source import default_cache_dir

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), "RAYTRAIN_SCU_CACHE": str(default_cache_dir()),
            "MPLCONFIGDIR": matplotlib.get_configdir()}


def free_port() -> int:
    """A loopback TCP port that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlflow_runs(storage, run_name: str, filter_string: str = ""):
    """(client, runs named ``run_name``) in the MLflow store a run with ``run.storage_path=storage`` uses by default,
    whatever experiment they are in (by default the config file's stem)."""
    from raytrain_scu.tracking.store import client_for, default_uri

    client = client_for(default_uri(str(storage)))
    exps = [e.experiment_id for e in client.search_experiments()]
    named = f"tags.`mlflow.runName` = '{run_name}'"
    return client, client.search_runs(exps, filter_string=f"{named} and {filter_string}" if filter_string else named)


# ---------------------------------------------------------------- tensors: the fused and FP8 paths against plain

def token_batch(vocab: int, seed=1, rows=2, cols=24):
    """(input_ids, labels) at random, the first 3 labels of row 0 ignored (-100)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, vocab, (rows, cols), generator=g), torch.randint(0, vocab, (rows, cols), generator=g)
    y[0, :3] = -100
    return x, y


def rel(a, b) -> float:
    """|a − b| / |b| (Frobenius), in float32."""
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def adapter_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def adapter_step(loss_model, model, x):
    """One forward and backward of ``loss_model`` on ``x`` (next-token labels, wrapping round): its Σ nats and every
    adapter gradient, flattened into one tensor (earlier gradients cleared first)."""
    import torch

    from raytrain_scu.core.regularizer import adapter_params

    for p in adapter_params(model):
        p.grad = None
    nats, _ = loss_model(x, torch.roll(x, -1, 1))
    nats.backward()
    return float(nats), torch.cat([p.grad.reshape(-1) for p in adapter_params(model)])


def autograd_nodes(loss, fn_name: str) -> int:
    """How many backward nodes of the autograd Function ``fn_name`` are in ``loss``'s graph."""
    seen, todo, count = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += fn_name in type(node).__name__
        todo += [n for n, _ in node.next_functions]
    return count


# ---------------------------------------------------------------- secrets: where a value must never be

def leaking_files(root: Path, secrets: dict) -> dict[str, list[str]]:
    """Every regular file under ``root`` that holds a secret's value: {secret's name: [paths]} (empty: none)."""
    files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    leaks = {name: [] for name in secrets}
    for p in files:
        data = p.read_bytes()
        for name, secret in secrets.items():
            if secret.encode() in data:
                leaks[name].append(str(p))
    return {name: paths for name, paths in leaks.items() if paths}


def mlflow_values(client, run) -> tuple[str, list[str]]:
    """A run's params, tags and every artifact's bytes as one text to search, and the artifacts' paths."""
    import json
    import tempfile

    texts = [json.dumps({**run.data.params, **run.data.tags})]
    with tempfile.TemporaryDirectory() as d:
        client.download_artifacts(run.info.run_id, "", d)
        files = [p for p in Path(d).rglob("*") if p.is_file()]
        texts += [p.read_bytes().decode("utf-8", "replace") for p in files]
        return "\n".join(texts), sorted(str(p.relative_to(d)) for p in files)
