"""Two Ray nodes on one multi-GPU host (training across nodes): a head and a worker node started with
`ray start`, the host's GPUs split between them through CUDA_VISIBLE_DEVICES.

    python tools/two_node.py bench  --out DIR [--gpus-per-node 2] [-- BENCH ARGS]
        `python -m raytrain_scu.bench BENCH ARGS` (default: --parts ray4) joined to the two-node cluster: a rayN
        part whose N workers need both nodes' GPUs. Compare its per-GPU tokens/s with the same part on one node.

    python tools/two_node.py resume CONFIG --out DIR [--hold-at 30] [--down-s 10] [--repeat] [OVERRIDES]
        The same run twice on the two-node cluster, one worker per GPU (2 x --gpus-per-node workers):
        "straight", uninterrupted; then "interrupted", whose workers hold after step --hold-at
        (RAYTRAIN_SCU_HOLD_AT_STEP) while the worker node is killed (SIGKILL to its process group), left down --down-s
        seconds and started again.
        Writes DIR/two_node.json: the nodes each run's workers ran on, where it resumed, and the two runs' per-step
        lambda (read from each run's last checkpoint) compared step by step.

--gpus-per-node 0 runs the same scenario on CPU nodes (--cpus-per-node each; set scaling.num_workers yourself).
The nodes take the GPUs this process sees (CUDA_VISIBLE_DEVICES, if set), the first half each in order. --out must
be a new or empty folder (a run name resumes: an old run there would not start fresh). Relative paths in BENCH ARGS
are relative to the repo root. Auth: RAY_AUTH_MODE as set, else token (a token is created in ~/.ray/auth_token if there
is none). Only the Ray processes this script started are stopped (never `ray stop`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodes:
    """A head and a worker node on 127.0.0.1, each `ray start --block` in its own process group (so a signal to this
    script does not reach them: :meth:`stop` does, and main's handlers make sure it runs)."""

    def __init__(self, gpus_per_node: int, cpus_per_node: int, log_dir: Path):
        self.gpn, self.cpn, self.log_dir = gpus_per_node, cpus_per_node, log_dir
        self.gcs = free_port()
        self.temp = tempfile.mkdtemp(prefix="r2n", dir="/tmp")  # AF_UNIX socket paths must stay under 107 bytes
        self.address = f"127.0.0.1:{self.gcs}"
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # what a user's cluster runs; tests alone disable it
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        if self.env["RAY_AUTH_MODE"] == "token":  # `ray start` does not create one
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                           env=self.env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.gpu_ids = visible.split(",") if visible else [str(g) for g in range(2 * gpus_per_node)]
        self.procs: list[subprocess.Popen] = []
        try:
            # no dashboard: its packages need not be installed; this process asks the GCS (a driver of its own)
            self.head = self._start(0, ["--head", f"--port={self.gcs}", "--include-dashboard=false",
                                        f"--temp-dir={self.temp}"])
            self._connect()
            self._wait_nodes(1)
            self.head_id = next(iter(self.node_ids()))
            self.worker = self.start_worker()
        except BaseException:  # a signal or a node that never came up: nothing left running
            self.stop()
            raise

    def _start(self, index: int, args: list[str]) -> subprocess.Popen:
        gpus = ",".join(self.gpu_ids[index * self.gpn:(index + 1) * self.gpn])
        env = {**self.env, "CUDA_VISIBLE_DEVICES": gpus}
        with open(self.log_dir / f"node{index}.log", "a") as log:
            p = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                                  "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpn}", f"--num-gpus={self.gpn}",
                                  f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats", *args],
                                 env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def start_worker(self) -> subprocess.Popen:
        # a node just killed stays "alive" until the GCS misses its heartbeats: wait for a new id, not a count
        before = self.node_ids()
        worker = self._start(1, [f"--address={self.address}"])
        self.worker_id = wait_until(lambda: next(iter(self.node_ids() - before), None), 180, "the worker node",
                                    worker)
        return worker

    def _connect(self, timeout_s: float = 120) -> None:
        import ray

        deadline = time.time() + timeout_s
        while True:
            try:
                ray.init(address=self.address, log_to_driver=False, logging_level="WARNING")
                return
            except Exception:  # noqa: BLE001 - the GCS is not up yet
                if self.head.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the head node did not come up: see {self.log_dir / 'node0.log'}")
                time.sleep(1)

    def node_ids(self) -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def _wait_nodes(self, n: int, timeout_s: float = 180) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if len(self.node_ids()) >= n:
                    return
            except Exception:  # noqa: BLE001 - a node not registered yet
                pass
            if self.head.poll() is not None:
                raise RuntimeError(f"the head node exited: see {self.log_dir / 'node0.log'}")
            time.sleep(1)
        raise TimeoutError(f"waited {timeout_s:.0f} s for {n} Ray node(s)")

    def kill_worker(self) -> None:
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait()

    def workers(self) -> dict[int, str]:
        """pid -> node id of the RayTrainWorker actors alive now (the GCS's actor table: ray._private, as Ray is
        pinned below 2.61; the public state API needs the dashboard)."""
        from ray._private import state

        alive = state.actors(actor_state_name="ALIVE").values()
        return {a["Pid"]: a["Address"]["NodeID"] for a in alive if a["ActorClassName"] == "RayTrainWorker"}

    def stop(self) -> None:
        """Every node this object started (a killed one too), then its temp dir."""
        import ray

        ray.shutdown()
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(self.temp, ignore_errors=True)


def train(nodes: TwoNodes, config: str, overrides: list[str], name: str, out: Path, **env) -> subprocess.Popen:
    """``python -m raytrain_scu.train`` on the two-node cluster, its output in ``out/<name>.log``."""
    cmd = [sys.executable, "-m", "raytrain_scu.train", config, *overrides, f"run.name={name}"]
    with open(out / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env={**nodes.env, "RAY_ADDRESS": nodes.address, **env},
                                stdout=log, stderr=subprocess.STDOUT)


def end(proc: subprocess.Popen) -> None:
    """A training driver still running when the scenario failed: stopped (its Ctrl-C path first)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    """The first truthy ``predicate()`` (an exception counts as not yet); TimeoutError after ``timeout_s``, and
    RuntimeError as soon as ``proc`` has exited."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - a busy GCS: not yet
            value = None
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{' '.join(proc.args[2:4])} exited ({proc.returncode}) before {what}")
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


def last_state(run_dir: Path) -> tuple[str, dict]:
    """The newest checkpoint that verifies: its name, history and resume points."""
    from raytrain_scu import checkpoint as ckpt

    last, _ = ckpt.newest_good_local(run_dir)
    if last is None:
        raise RuntimeError(f"no checkpoint in {run_dir}")
    state = torch.load(last / "state.pt", map_location="cpu", weights_only=False)
    return last.name, {"history": state["history"], "resumed_at": ckpt.read_meta(last).get("resumed_at")}


def compare(a: list[dict], b: list[dict], key: str = "ctrl/lambda") -> dict:
    """Step-by-step comparison of ``key`` in two runs' histories (steps where both have it)."""
    xa = {r["step"]: r[key] for r in a if key in r}
    xb = {r["step"]: r[key] for r in b if key in r}
    steps = sorted(set(xa) & set(xb))
    rel = [abs(xa[s] - xb[s]) / max(abs(xa[s]), 1e-30) for s in steps]
    return {"steps_compared": len(steps), "steps_only_in_one": sorted(set(xa) ^ set(xb)),
            "identical_steps": sum(xa[s] == xb[s] for s in steps), "max_rel_diff": max(rel) if rel else math.nan,
            "first_diff_step": next((s for s, r in zip(steps, rel) if r > 0), None),
            "final": [xa[steps[-1]], xb[steps[-1]]] if steps else None}


def straight_run(nodes: TwoNodes, args, overrides: list[str], name: str, out: Path) -> dict:
    """An uninterrupted run; the nodes its workers ran on, polled every 2 s."""
    t0, seen = time.time(), {}
    proc = train(nodes, args.config, overrides, name, out)
    try:
        while proc.poll() is None:
            try:
                seen.update(nodes.workers())
            except Exception:  # noqa: BLE001 - a busy GCS
                pass
            time.sleep(2)
    finally:
        end(proc)
    if proc.returncode:
        raise RuntimeError(f"the {name} run failed ({proc.returncode}): see {out / (name + '.log')}")
    return {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1), "nodes": sorted(set(seen.values()))}


def resume_scenario(nodes: TwoNodes, args, out: Path, result: dict, save) -> None:
    """Fills ``result`` (``save()`` after each run): straight, interrupted, then with --repeat a second straight
    run, the GPU's run-to-run difference that the interrupted run's is set beside."""
    storage = out / "runs"
    world = 2 * args.gpus_per_node
    overrides = [f"run.storage_path={storage}", "run.max_failures=3", *args.overrides]
    if world:
        overrides += [f"scaling.num_workers={world}", "scaling.use_gpu=true"]
    result.update(head=nodes.head_id, worker_node=nodes.worker_id, overrides=overrides)
    result["straight"] = straight_run(nodes, args, overrides, "straight", out)
    save()

    hold = out / "hold"
    t0 = time.time()
    run = train(nodes, args.config, overrides, "interrupted", out, RAYTRAIN_SCU_HOLD_AT_STEP=str(args.hold_at),
                RAYTRAIN_SCU_HOLD_DIR=str(hold))
    n_workers = world or int(next((o.split("=")[1] for o in overrides if o.startswith("scaling.num_workers=")), 2))
    try:
        wait_until(lambda: len(list(hold.glob("rank*.pid"))) >= n_workers, 900,
                   f"the workers to hold at step {args.hold_at}", run)
        before = nodes.workers()
        t_kill = time.time()
        nodes.kill_worker()
        time.sleep(args.down_s)
        old_worker = nodes.worker_id
        nodes.worker = nodes.start_worker()
        after = wait_until(lambda: (w := nodes.workers()) and len(w) == n_workers and not set(w) & set(before) and w,
                           600, "a new worker group", run)
        restarted_s = round(time.time() - t_kill, 1)
        rc = run.wait(timeout=1800)
    finally:
        end(run)
    result["interrupted"] = {"rc": rc, "wall_s": round(time.time() - t0, 1), "killed_node": old_worker,
                             "restarted_node": nodes.worker_id, "nodes_before": sorted(set(before.values())),
                             "nodes_after": sorted(set(after.values())), "down_s": args.down_s,
                             "kill_to_new_workers_s": restarted_s, "hold_at": args.hold_at}
    save()
    if rc:
        raise RuntimeError(f"the interrupted run failed ({rc}): see {out / 'interrupted.log'}")
    runs = {name: collect(result, storage, name) for name in ("straight", "interrupted")}
    result["lambda"] = compare(runs["straight"]["history"], runs["interrupted"]["history"])
    result["data_bpt"] = compare(runs["straight"]["history"], runs["interrupted"]["history"], "train/data_bpt")
    save()
    if args.repeat:
        result["straight2"] = straight_run(nodes, args, overrides, "straight2", out)
        runs["straight2"] = collect(result, storage, "straight2")
        result["lambda_straight_vs_straight2"] = compare(runs["straight"]["history"], runs["straight2"]["history"])
        result["data_bpt_straight_vs_straight2"] = compare(runs["straight"]["history"], runs["straight2"]["history"],
                                                           "train/data_bpt")
    result["lambda_trajectory"] = {name: [[r["step"], r["ctrl/lambda"]] for r in runs[name]["history"]
                                          if "ctrl/lambda" in r] for name in runs}


def collect(result: dict, storage: Path, name: str) -> dict:
    """The run's last checkpoint: its name, resume points, steps and last val BPT into ``result[name]``; its state."""
    last, state = last_state(storage / name)
    result[name].update(last_checkpoint=last, resumed_at=state["resumed_at"],
                        steps=max(r["step"] for r in state["history"]),
                        final_val_bpt=next((r["val/data_bpt"] for r in reversed(state["history"])
                                            if "val/data_bpt" in r), None))
    return state

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/two_node.py", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["bench", "resume"])
    p.add_argument("config", nargs="?", help="resume: the run's YAML")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--cpus-per-node", type=int, default=0, help="default: 6 per GPU, or 2 with no GPU")
    p.add_argument("--hold-at", type=int, default=30)
    p.add_argument("--down-s", type=float, default=10.0)
    p.add_argument("--repeat", action="store_true", help="resume: a second straight run (run-to-run noise)")
    args, rest = p.parse_known_args(argv)
    args.overrides = [a for a in rest if a != "--"]
    if args.what == "resume" and not args.config:
        p.error("resume needs CONFIG")
    if args.gpus_per_node and torch.cuda.device_count() < 2 * args.gpus_per_node:
        p.error(f"--gpus-per-node {args.gpus_per_node} needs {2 * args.gpus_per_node} GPUs; "
                f"this machine has {torch.cuda.device_count()}")
    args.cpus_per_node = args.cpus_per_node or (6 * args.gpus_per_node or 2)
    if args.out.exists() and any(args.out.iterdir()):
        p.error(f"--out {args.out}: not empty; use a new folder (its runs would resume, not start fresh)")
    args.out.mkdir(parents=True, exist_ok=True)
    # `ray start --block` runs in its own session: on SIGTERM/SIGHUP, unwind through the finally below to stop it
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))

    result: dict = {"gpus_per_node": args.gpus_per_node,
                    "card": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}

    def save():
        (args.out / "two_node.json").write_text(json.dumps(result, indent=1))

    nodes = None
    t0 = time.time()
    try:
        nodes = TwoNodes(args.gpus_per_node, args.cpus_per_node, args.out)
        result["cluster_start_s"] = round(time.time() - t0, 1)
        if args.what == "bench":
            bench_args = args.overrides or ["--parts", f"ray{2 * args.gpus_per_node or 2}",
                                            "--out", str(args.out / "bench.json")]
            r = subprocess.run([sys.executable, "-m", "raytrain_scu.bench", *bench_args], cwd=ROOT,
                               env={**nodes.env, "RAY_ADDRESS": nodes.address})
            result["bench"] = {"args": bench_args, "rc": r.returncode}
            if r.returncode:
                result["error"] = f"the bench exited {r.returncode}"
        else:
            resume_scenario(nodes, args, args.out, result, save)
    except Exception as e:  # noqa: BLE001 - written beside what was measured
        result["error"] = repr(e)
    finally:
        if nodes is not None:
            nodes.stop()
    save()
    print("TWO_NODE " + json.dumps({k: v for k, v in result.items() if k != "lambda_trajectory"}), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
