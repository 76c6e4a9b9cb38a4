"""The sweep's results, with no Ray: the trials table (printed, trials.csv), the best trial's config (best.yaml), the
plots, and the sweep's MLflow records (the parent run, each trial's child run, the parent's summary).

Every MLflow call of the sweep is in the last section of this module.
"""
from __future__ import annotations

import csv
import io
import math
import sys
import warnings
from pathlib import Path
from typing import Optional

from raytrain_scu.config.io import flatten, redact_uri, to_yaml
from raytrain_scu.config.paths import run_dir
from raytrain_scu.config.schema import Config, global_batch_tokens
from raytrain_scu.console import RESUMED_AT, resumed_steps, resumed_text
from raytrain_scu.ray.tune.space import (
    ARM,
    GLOBAL_BATCH,
    apply_params,
    arm_text,
    flat_params,
    plain_value,
    trial_config,
)
from raytrain_scu.tracking.store import (
    FAILURE_TAG,
    SWEEP_TAG,
    TRIAL_TAG,
    child_runs,
    client_for,
    end_run,
    log_params_once,
    open_run,
    param_text,
    tracking_uri,
)

RESUMED_TAG = "raytrain_scu.trial_resumed_at"  # a child run's tag: the steps its trial restarted from, "4,6"


def error_line(error: Optional[BaseException]) -> str:
    """A trial's failure in one line: the innermost cause's type and the last line of its message."""
    if error is None:
        return "unknown error"
    while True:  # Ray's task wrapping (.cause), Python's chaining, Ray Train's per-worker failures
        failures = getattr(error, "worker_failures", None) or {}
        inner = getattr(error, "cause", None) or error.__cause__ or (failures[min(failures)] if failures else None)
        if not isinstance(inner, BaseException) or inner is error:
            break
        error = inner
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return redact_uri(f"{type(error).__name__}: {lines[-1].strip() if lines else ''}".strip())


def trial_rows(results, base: Config, space: dict) -> list[dict]:
    """One row per trial, best first: id, swept values, grad_accum, global batch, metric, steps, status, the steps
    it restarted from (``resumed_at``: a worker lost and Ray Train's restart within run.max_failures, or a re-run of
    the sweep) and a failed trial's cause (``error``).

    The metric is the trial's last value reported to Tune, at step ``scored_step``, not its best (the adapter of a run
    under run.primary_adapter=best is its best checkpoint's: docs/sweep.md); ``steps`` is how far it trained
    (a stopped trial's workers may log a few steps more before they end: :func:`sync_with_mlflow`). Status, in
    MLflow's words so the table, trials.csv and the MLflow run agree: FINISHED (reached train.max_steps, or ended by
    train.stop_on_saturation), KILLED (stopped early by Tune: ASHA or the time budget), FAILED, PENDING (never
    reported).
    """
    rows = []
    for r in results:
        trial_id = Path(r.path).name
        params = {k: plain_value(v) for k, v in (r.config or {}).items() if k in space}
        cfg = trial_config(base, params, trial_id)
        m = r.metrics or {}
        step = m.get("step")
        saturated = base.train.stop_on_saturation and m.get("ctrl/saturated_step") is not None
        if r.error is not None:
            status = "FAILED"
        elif step is None:
            status = "PENDING"
        else:
            status = "FINISHED" if step >= base.train.max_steps or saturated else "KILLED"
        rows.append({"trial": trial_id, "params": params, "grad_accum": cfg.data.grad_accum,
                     "global_batch_tokens": global_batch_tokens(cfg),
                     "metric": float(m.get(base.tune.metric, math.nan)), "scored_step": step, "steps": step,
                     "tokens_seen": m.get("tokens_seen"), "status": status, "run_name": cfg.run.name,
                     "resumed_at": resumed_steps(m.get(RESUMED_AT)),
                     "error": error_line(r.error) if r.error is not None else None,
                     "time_s": m.get("time_total_s")})  # the trial's wall time, start-up included (Tune's)
    sign = 1.0 if base.tune.mode == "min" else -1.0
    rows.sort(key=lambda row: (not math.isfinite(row["metric"]),
                               sign * row["metric"] if math.isfinite(row["metric"]) else 0.0))
    return rows


def token_budget_note(rows: list[dict], best: Optional[dict]) -> Optional[str]:
    """When the trials that ran to the end trained on different numbers of tokens (train.max_steps counts optimizer
    steps, and a swept global batch puts more tokens in each): a note that "best" compares budgets as well as
    hyper-parameters. None when they all saw the same."""
    seen = sorted({r["tokens_seen"] for r in rows if r["status"] == "FINISHED" and r.get("tokens_seen")})
    if len(seen) < 2:
        return None
    where = (f"; the best trial, {best['trial']}, saw {best['tokens_seen']:,}"
             if best is not None and best.get("tokens_seen") else "")
    return (f"note: the finished trials trained on different token budgets, {seen[0]:,} to {seen[-1]:,} tokens "
            f"(train.max_steps counts optimizer steps, and the global batch differs){where}: a trial may be best "
            f"because it saw more data. Compare them at equal tokens_seen (MLflow, trials.csv), or sweep at one "
            f"global batch")


def best_row(rows: list[dict]) -> Optional[dict]:
    """The best trial that did not fail and has a finite metric (rows are sorted best first)."""
    return next((r for r in rows if r["status"] != "FAILED" and math.isfinite(r["metric"])), None)


def metric_digits(values) -> int:
    """The fewest significant digits (4 to 12) at which the distinct metric values still print distinctly, so trials
    that differ never look tied."""
    finite = {v for v in values if isinstance(v, float) and math.isfinite(v)}
    return next((d for d in range(4, 13) if len({f"{v:.{d}g}" for v in finite}) == len(finite)), 12)


def _fmt(v, digits: int = 4) -> str:
    if isinstance(v, dict):  # an arm
        return arm_text(v)
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return "-" if v is None else str(v)


def _columns(rows: list[dict], keys: list[str], metric: str) -> tuple[list[str], list[list]]:
    derives_accum = "data.batch_size" in keys or GLOBAL_BATCH in keys
    extra = ["data.grad_accum"] if derives_accum and "data.grad_accum" not in keys else []
    batch = [] if GLOBAL_BATCH in keys else ["global_batch_tokens"]  # a swept global batch is a key column already
    head = ["trial", *keys, *extra, *batch, metric, "scored_at", "steps", "tokens_seen", "status", "resumed_at"]
    body = [[r["trial"], *(r["params"].get(k) for k in keys), *([r["grad_accum"]] if extra else []),
             *([r["global_batch_tokens"]] if batch else []), r["metric"], r.get("scored_step", r["steps"]),
             r["steps"], r.get("tokens_seen"), r["status"],
             resumed_text(r.get("resumed_at")) or None] for r in rows]
    return head, body


def format_table(rows: list[dict], keys: list[str], metric: str) -> str:
    """The trials table as aligned text, best first."""
    head, body = _columns(rows, keys, metric)
    col = head.index(metric)
    digits = metric_digits([line[col] for line in body])
    lines = [head, *([_fmt(v, digits if i == col else 4) for i, v in enumerate(line)] for line in body)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def trials_csv(rows: list[dict], keys: list[str], metric: str) -> str:
    """The trials table as CSV, plus each trial's run name (its Train run and MLflow child run) and a failed trial's
    cause."""
    head, body = _columns(rows, keys, metric)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*head, "run_name", "error"])
    for line, r in zip(body, rows):
        w.writerow([*line, r["run_name"], r.get("error") or ""])
    return buf.getvalue()


def best_config(base: Config, row: dict) -> Config:
    """The best trial's full config as a plain training run named ``<sweep>-best`` (no space left to sweep)."""
    cfg = apply_params(base, row["params"])
    cfg.run.name = f"{base.run.name}-best"
    cfg.tune.space = {}
    return cfg


def plot_metric_vs_params(rows: list[dict], space: dict, metric: str, out_dir: Path,
                          best: Optional[dict]) -> list[Path]:
    """One PNG per swept parameter: every trial's metric against its value; the best trial is starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    shown = [r for r in rows if math.isfinite(r["metric"])]
    paths = []
    for key, spec in space.items():
        values = [r["params"].get(key) for r in shown]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        labels = sorted({_fmt(v) for v in values})
        xs = values if numeric else [labels.index(_fmt(v)) for v in values]
        fig, ax = plt.subplots(figsize=(6, 4))
        for status, marker in (("FINISHED", "o"), ("KILLED", "x"), ("FAILED", "^")):
            pts = [(x, r["metric"]) for x, r in zip(xs, shown) if r["status"] == status]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, s=40, label=status.lower())
        if best is not None and best in shown:
            i = shown.index(best)
            ax.scatter([xs[i]], [best["metric"]], marker="*", s=260, color="C3", zorder=3, label="best")
        if numeric and next(iter(spec)) == "loguniform":
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(labels)), labels, rotation=30 if key == ARM else 0, ha="right" if key == ARM else "center",
                          fontsize=6 if key == ARM else None)
        ax.set(xlabel=key, ylabel=metric, title=f"{metric} vs {key} ({len(shown)} trials)")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{metric.replace('/', '_')}_vs_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

def write_results(cfg: Config, space: dict, results, parent_run_id: Optional[str]) -> dict:
    """Print the table, write trials.csv, best.yaml and plots in the sweep's directory, close the parent run, and
    return the sweep's summary. ``results`` is Tune's ResultGrid (or anything with its rows' fields)."""
    t = cfg.tune
    out = Path(run_dir(cfg))
    rows = trial_rows(results, cfg, space)
    if parent_run_id:
        sync_with_mlflow(cfg, parent_run_id, rows)
    best = best_row(rows)
    keys = list(space)
    print(format_table(rows, keys, t.metric), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "trials.csv"]
    files[0].write_text(trials_csv(rows, keys, t.metric))
    best_path, best_yaml = out / "best.yaml", ""
    if best is not None:
        head = (f"# Best trial {best['trial']} of sweep {cfg.run.name}: {t.metric} = {best['metric']:.6g}\n"
                f"# Launch: python -m raytrain_scu.train {best_path}\n")
        best_cfg = best_config(cfg, best)
        best_path.write_text(head + to_yaml(best_cfg))
        best_yaml = head + to_yaml(best_cfg, redact=True)
    files += plot_metric_vs_params(rows, space, t.metric, out / "plots", best)
    if parent_run_id:
        try:
            close_parent_run(cfg, parent_run_id, rows, best, best_yaml, files)
        except Exception as e:  # noqa: BLE001 - the results are on disk either way
            print(f"[raytrain_scu] warning: MLflow parent run not completed: {type(e).__name__}: "
                  f"{redact_uri(str(e))[:200]}",
                  file=sys.stderr)
    failed = [r for r in rows if r["status"] == "FAILED"]
    errors = [r["trial"] for r in failed]
    if failed:  # each with its cause; the best is chosen among the others
        print(f"[raytrain_scu] {len(errors)} trial(s) failed ("
              + "; ".join(f"{r['trial']}: {r['error']}" for r in failed)
              + "): re-run the same command to resume them", flush=True)
    if best is not None:
        print(f"[raytrain_scu] best trial {best['trial']}: {t.metric}={best['metric']:.6g}; config {best_path}",
              flush=True)
    budgets = token_budget_note(rows, best)
    if budgets:
        print(f"[raytrain_scu] {budgets}", flush=True)
    return {"sweep_dir": str(out), "rows": rows, "best": best,
            "best_yaml": str(best_path) if best is not None else None, "parent_run_id": parent_run_id,
            "errors": errors, "files": [str(f) for f in files]}


# ---------------------------------------------------------------- MLflow: the sweep's parent run, each trial's child

def open_parent_run(cfg: Config) -> Optional[str]:
    """The sweep's MLflow run (found again on resume), with the base config (its tune.space the resolved space) and
    the global batch as params."""
    if not cfg.tracking.enabled:
        return None
    try:
        run_id = open_run(cfg)
        client = client_for(tracking_uri(cfg))
        client.set_tag(run_id, SWEEP_TAG, cfg.run.name)
        log_params_once(client, run_id, {**flatten(cfg),
                                                  "derived.global_batch_tokens": global_batch_tokens(cfg)})
        return run_id
    except Exception as e:  # noqa: BLE001 - the sweep runs without its parent run
        print(f"[raytrain_scu] warning: MLflow parent run not opened ({type(e).__name__}: {redact_uri(str(e))[:200]}); "
              f"trials are logged without a parent", file=sys.stderr)
        return None


def close_parent_run(cfg: Config, parent_run_id: str, rows: list[dict], best: Optional[dict], best_yaml: str,
                     files: list[Path]) -> None:
    """Mark each child with its outcome, and give the parent the best result, the table, best.yaml and plots.

    A child still RUNNING was cut off before its trial could end it: it gets the row's status (KILLED if Tune stopped
    the trial, FAILED if it failed). A trial whose training ended by itself (train.max_steps, train.stop_on_saturation)
    was ended FINISHED by ``sweep.run_trial``, and that stays. Tags repeat the row: status, steps trained and the step
    it was scored at, the steps it restarted from (``raytrain_scu.trial_resumed_at``) and a failed trial's cause
    (``raytrain_scu.failure``).
    """
    client = client_for(tracking_uri(cfg))
    children = {r.data.tags.get(TRIAL_TAG): r for r in child_runs(cfg, parent_run_id)}
    for row in rows:
        child = children.get(row["trial"])
        if child is None:
            continue
        client.set_tag(child.info.run_id, "raytrain_scu.trial_status", row["status"])
        for tag, key in (("raytrain_scu.trial_steps", "steps"), ("raytrain_scu.trial_scored_step", "scored_step")):
            if row.get(key) is not None:
                client.set_tag(child.info.run_id, tag, str(row[key]))
        if row.get("resumed_at"):
            client.set_tag(child.info.run_id, RESUMED_TAG, resumed_text(row["resumed_at"]))
        if row.get("error"):
            client.set_tag(child.info.run_id, FAILURE_TAG, param_text(row["error"]))
        if child.info.status == "RUNNING" and row["status"] in ("KILLED", "FAILED"):
            end_run(cfg, child.info.run_id, row["status"])
    if best is not None:
        client.log_metric(parent_run_id, f"best/{cfg.tune.metric}", best["metric"])
        client.set_tag(parent_run_id, "raytrain_scu.best_trial", best["trial"])
        if best["trial"] in children:
            client.set_tag(parent_run_id, "raytrain_scu.best_run_id", children[best["trial"]].info.run_id)
        client.log_text(parent_run_id, best_yaml, "best.yaml")
    client.log_metric(parent_run_id, "sweep/trials", len(rows))
    client.log_metric(parent_run_id, "sweep/errors", sum(r["status"] == "FAILED" for r in rows))
    for f in files:
        client.log_artifact(parent_run_id, str(f), artifact_path="plots" if f.suffix == ".png" else None)
    end_run(cfg, parent_run_id, "FINISHED" if best is not None else "FAILED")

def sync_with_mlflow(cfg: Config, parent_run_id: str, rows: list[dict]) -> None:
    """Each row's ``steps`` becomes the last step its child run logged when that is later than the step Tune scored
    (a trial Tune stops keeps training until its workers end), so the table, trials.csv and MLflow agree."""
    try:
        client = client_for(tracking_uri(cfg))
        children = {r.data.tags.get(TRIAL_TAG): r.info.run_id for r in child_runs(cfg, parent_run_id)}
        for row in rows:
            if row["trial"] in children:
                logged = [m.step for m in client.get_metric_history(children[row["trial"]], "ctrl/lambda")]
                row["steps"] = max([s for s in (row["steps"], *logged) if s is not None], default=None)
    except Exception as e:  # noqa: BLE001 - the table still shows what Tune saw
        print(f"[raytrain_scu] warning: MLflow not read for the trials' last steps ({type(e).__name__})",
              file=sys.stderr)


def open_child_run(cfg: Config, sweep_name: str, parent_run_id: Optional[str], params: dict,
                   trial_id: str) -> Optional[str]:
    """The trial's MLflow run, a child of the sweep's, with the swept values and the global batch as params."""
    try:
        run_id = open_run(cfg, parent_run_id=parent_run_id)
        client = client_for(tracking_uri(cfg))
        client.set_tag(run_id, SWEEP_TAG, sweep_name)
        client.set_tag(run_id, TRIAL_TAG, trial_id)
        flat = flatten(cfg)  # the same strings the worker logs, so the two never disagree
        params = flat_params(params)
        keys = [k for k in params if k != GLOBAL_BATCH]  # the global batch is derived.global_batch_tokens
        if "data.batch_size" in params or GLOBAL_BATCH in params:
            keys.append("data.grad_accum")
        log_params_once(client, run_id, {**{k: flat[k] for k in keys},
                                                  "derived.global_batch_tokens": global_batch_tokens(cfg)})
        return run_id
    except Exception as e:  # noqa: BLE001 - tracking never kills training; rank 0 retries (without the parent link)
        warnings.warn(f"MLflow child run for trial {trial_id} not opened: {type(e).__name__}: "
                      f"{redact_uri(str(e))[:200]}")
        return None

