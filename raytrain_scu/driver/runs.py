"""The runs under a storage path, found again afterwards (``python -m raytrain_scu.runs``): one row per run (name,
status, steps, best held-out BPT and its step, the last S and λ, tokens/s, path), or two and more runs side by side
with the config keys they differ in.

Everything is read from the run directories (``output/summary.json`` of a finished run, else the newest checkpoint's
``meta.json`` and ``controller.json``) and the status from the run's MLflow run (FINISHED, RUNNING, KILLED, FAILED);
without one, a run is ``finished`` when its summary is its newest checkpoint's and ``stopped`` otherwise. Nothing
loads a model, verifies a checkpoint or starts Ray.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import yaml

from raytrain_scu.config.io import flatten_tree, redact_uri
from raytrain_scu.config.load import build_config
from raytrain_scu.config.paths import is_remote, storage_dir
from raytrain_scu.errors import RunsError
from raytrain_scu.tracking.store import RUN_KEY_TAG, client_for, run_key, tracking_uri

CHECKPOINT_PREFIX = "checkpoint_"


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def newest_checkpoint(run: Path) -> Optional[Path]:
    """The newest complete-looking ``checkpoint_*`` (it has meta.json; names sort by step), unverified."""
    found = sorted(p for p in run.glob(f"{CHECKPOINT_PREFIX}*")
                   if p.is_dir() and not p.name.endswith(".partial") and (p / "meta.json").is_file())
    return found[-1] if found else None


def is_run(path: Path) -> bool:
    """A training run's directory: a checkpoint, a summary or an MLflow run record in it."""
    return path.is_dir() and (newest_checkpoint(path) is not None or (path / "output" / "summary.json").is_file()
                              or (path / "mlflow_run.json").is_file())


def _config_tree(run: Path, newest: Optional[Path]) -> dict:
    """The run's config as it last ran: output/config.yaml, or the newest checkpoint's when that is newer."""
    sources = [p for p in (newest / "config.yaml" if newest else None, run / "output" / "config.yaml")
               if p is not None and p.is_file()]
    if not sources:
        return {}
    try:
        return yaml.safe_load(max(sources, key=lambda p: p.stat().st_mtime).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _mlflow_run(run: Path, tree: dict, clients: dict):
    """The run's MLflow run (its status and latest metrics): the one ``mlflow_run.json`` names (in the store it
    names: a run that has no checkpoint yet has no config on disk), else the one tagged with its run key (a sweep's
    trial); None with tracking off, no such run, or an unreadable store."""
    record = _json(run / "mlflow_run.json")
    try:
        cfg = build_config(tree) if tree else None
        if cfg is not None and not cfg.tracking.enabled:
            return None
        uri = record.get("tracking_uri", "") if "***" not in record.get("tracking_uri", "***") else None
        uri = uri or tracking_uri(cfg)
        if uri not in clients:
            clients[uri] = client_for(uri)
        client, run_id = clients[uri], record.get("run_id")
        if run_id:
            return client.get_run(run_id)
        exp = client.get_experiment_by_name(cfg.tracking.experiment)
        found = exp and client.search_runs([exp.experiment_id], max_results=1,
                                           filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key(cfg)}'")
        return found[0] if found else None
    except Exception:  # noqa: BLE001 - a listing shows what it can
        return None


def _num(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def read_run(run: Path, clients: Optional[dict] = None) -> dict:
    """One run's row: name, status, steps (and max_steps), best held-out BPT and its step, the last held-out BPT, S
    and λ, tokens/s, path, and its flat config (for side-by-side comparisons)."""
    newest = newest_checkpoint(run)
    meta = _json(newest / "meta.json") if newest else {}
    control = _json(newest / "controller.json") if newest else {}
    summary = _json(run / "output" / "summary.json")
    tree = _config_tree(run, newest)
    flat = flatten_tree(tree)
    steps = meta.get("step", summary.get("steps"))
    current = bool(summary) and summary.get("steps") == steps  # the summary is of the newest checkpoint
    mlflow_run = _mlflow_run(run, tree, {} if clients is None else clients)
    metrics = mlflow_run.data.metrics if mlflow_run is not None else {}
    if mlflow_run is not None:
        status = mlflow_run.info.status.lower()
    else:
        status = "finished" if current else "stopped"
    row = {"name": run.name, "status": status, "steps": steps, "max_steps": flat.get("train.max_steps"),
           "best_val": _num(meta.get("best_val")), "best_step": meta.get("best_step"),
           "val": _num(meta.get("val_bpt")), "s": _num(control.get("s")), "lambda": _num(control.get("lam")),
           "tokens_per_s": _num(metrics.get("perf/tokens_per_s")), "path": str(run), "config": flat}
    if current:  # a finished run's summary: λ as its last line showed it, the best checkpoint Ray kept
        row.update(best_val=_num(summary.get("best_val_bpt")), best_step=summary.get("best_step"),
                   val=_num(summary.get("val_bpt")), s=_num(summary.get("s")), tokens_per_s=_num(
                       summary.get("tokens_per_s")) or row["tokens_per_s"],
                   **{"lambda": _num(summary.get("lambda"))})
    return row


def _local_root(storage: str) -> Path:
    """The storage directory as a local path; remote storage (s3://, gs://) is a RunsError: the listing reads run
    directories from disk."""
    if is_remote(storage):
        raise RunsError(f"{redact_uri(storage)} is remote storage: the runs listing reads local run directories only "
                        f"(list the runs in MLflow, or give a local or NFS run.storage_path)")
    return Path(storage_dir(storage))


def list_runs(storage: str) -> tuple[list[dict], list[str]]:
    """(the runs directly under ``storage``, by name; the sweeps there, whose trials are under ``<sweep>/trials``)."""
    root = _local_root(storage)
    if not root.is_dir():
        raise RunsError(f"no runs here: {root} is not a directory (give the run.storage_path the runs used)")
    clients: dict = {}
    runs = [read_run(p, clients) for p in sorted(root.iterdir()) if is_run(p)]
    sweeps = sorted(p.name for p in root.iterdir() if (p / "trials").is_dir() and not is_run(p))
    return runs, sweeps


def find_runs(storage: str, names: list[str]) -> list[dict]:
    """The rows of the named runs: names under ``storage``, or run directories given as paths."""
    root, clients, rows = _local_root(storage), {}, []
    for name in names:
        path = next((p for p in (root / name, Path(name).expanduser()) if is_run(p)), None)
        if path is None:
            raise RunsError(f"no run {name!r} under {root} (and no run directory at that path)")
        rows.append(read_run(path.resolve(), clients))
    return rows


# ---------------------------------------------------------------- as text

def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if value == "":
        return '""'  # an empty config value, not a missing one
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _cells(r: dict) -> dict[str, str]:
    steps = f"{r['steps']}/{r['max_steps']}" if r["max_steps"] not in (None, r["steps"]) else _fmt(r["steps"])
    best = f"{_fmt(r['best_val'])} @{r['best_step']}" if r["best_val"] is not None else "-"
    return {"status": r["status"], "steps": steps, "best val": best, "val": _fmt(r["val"]),
            "S / λ": f"{_fmt(r['s'])} / {_fmt(r['lambda'])}",
            "tokens/s": f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-", "path": r["path"]}


def format_list(storage: str, runs: list[dict], sweeps: list[str]) -> str:
    """One aligned row per run (best val ``@N``: measured at step N; S and λ: the last step's)."""
    where = storage_dir(storage)
    if not runs:
        lines = [f"no runs in {where}"]
    else:
        table = [["name", *_cells(runs[0])]] + [[r["name"], *_cells(r).values()] for r in runs]
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [f"{len(runs)} run(s) in {where}:"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    if sweeps:
        name = sweeps[0] if len(sweeps) == 1 else "<sweep>"
        lines.append(f"sweeps: {', '.join(sweeps)} (their trials: python -m raytrain_scu.runs {where}/{name}/trials)")
    return "\n".join(lines)


def format_side_by_side(runs: list[dict]) -> str:
    """The runs as columns: their results, then every config key whose values differ."""
    rows = [["", *(r["name"] for r in runs)]]
    rows += [[key, *(_cells(r)[key] for r in runs)] for key in _cells(runs[0])]
    keys = sorted({k for r in runs for k in r["config"]})
    differ = [k for k in keys if len({json.dumps(r["config"].get(k), default=str) for r in runs}) > 1]
    rows += [[k, *(_fmt(r["config"].get(k)) for r in runs)] for k in differ if k != "run.name"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(len(_cells(runs[0])) + 1, "config keys that differ:" if len(differ) > 1 else "same config")
    return "\n".join(lines)
