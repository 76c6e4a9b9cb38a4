"""Config revisions: a re-run of a run name under a changed config is recorded as revision N of its MLflow run (the
tag ``raytrain_scu.config_revision``, the artifact ``config_revisions/rev_N.yaml`` and the changed keys as a tag);
revision 0 is the params, which MLflow never changes."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

from raytrain_scu.config.io import flatten_tree, to_yaml
from raytrain_scu.config.schema import Config
from raytrain_scu.tracking.store import CHANGES_TAG, REVISION_TAG, client_for, param_text, tracking_uri


def config_changes(before: dict, after: dict) -> dict[str, tuple[str, str]]:
    """``{key: (old, new)}`` of two flat configs (:func:`~raytrain_scu.config.flatten`), compared as param text. A key
    only one side has (one a newer package added) is no change."""
    return {k: (param_text(before[k]), param_text(v)) for k, v in after.items()
            if k in before and param_text(before[k]) != param_text(v)}


def format_changes(changes: dict[str, tuple[str, str]]) -> str:
    return "; ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items())


def recorded_config(cfg: Config, run_id: str) -> tuple[int, Optional[dict]]:
    """(revision, flat config) the MLflow run holds: revision 0 is its params, revision N the artifact
    ``config_revisions/rev_N.yaml``. (0, None) when no params are logged yet (no worker started)."""
    import yaml

    client = client_for(tracking_uri(cfg))
    run = client.get_run(run_id)
    rev = int(run.data.tags.get(REVISION_TAG, 0))
    if rev == 0:
        return 0, dict(run.data.params) or None
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run_id, f"config_revisions/rev_{rev}.yaml", tmp)
        return rev, flatten_tree(yaml.safe_load(Path(path).read_text()))


def record_config_revision(cfg: Config, run_id: str, rev: int, changes: dict[str, tuple[str, str]],
                           from_step: Optional[int]) -> None:
    """Driver side, before fit(): the run's config revision ``rev``, the whole config (redacted) with the changes in
    its header, then the tags (a revision tag always has its artifact)."""
    client = client_for(tracking_uri(cfg))
    head = (f"# config revision {rev} of run {cfg.run.name}"
            + (f", resuming at step {from_step}" if from_step is not None else "") + "\n"
            + "".join(f"# {k}: {old} -> {new}\n" for k, (old, new) in changes.items()))
    client.log_text(run_id, head + to_yaml(cfg, redact=True), f"config_revisions/rev_{rev}.yaml")
    client.set_tag(run_id, CHANGES_TAG, format_changes(changes)[:8000])
    client.set_tag(run_id, REVISION_TAG, str(rev))
