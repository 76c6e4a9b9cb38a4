"""MLflow tracking, in three parts: :mod:`.store` (where runs live, opening and ending them, tags), :mod:`.tracker`
(rank 0's retrying logger and the no-op every other rank gets) and :mod:`.revisions` (a re-run under a changed
config). The names below are the ones the rest of the package uses."""
from raytrain_scu.tracking.revisions import config_changes, format_changes, record_config_revision, recorded_config
from raytrain_scu.tracking.store import (
                                         BEST_STEP_TAG,
                                         BEST_VAL_TAG,
                                         CHANGES_TAG,
                                         FAILURE_TAG,
                                         PARENT_TAG,
                                         REVISION_TAG,
                                         RUN_KEY_TAG,
                                         SWEEP_TAG,
                                         TRIAL_TAG,
                                         child_runs,
                                         client_for,
                                         default_uri,
                                         end_run,
                                         experiment_id,
                                         log_best_checkpoint,
                                         log_params_once,
                                         open_run,
                                         param_text,
                                         remember_run_id,
                                         run_key,
                                         tracking_uri,
                                         ui_command,
)
from raytrain_scu.tracking.tracker import MlflowTracker, NullTracker, derived_params, for_rank

__all__ = ["BEST_STEP_TAG", "BEST_VAL_TAG", "CHANGES_TAG", "FAILURE_TAG", "PARENT_TAG", "REVISION_TAG", "RUN_KEY_TAG",
           "SWEEP_TAG", "TRIAL_TAG", "MlflowTracker", "NullTracker", "child_runs", "client_for", "config_changes",
           "default_uri", "derived_params", "end_run", "experiment_id", "for_rank", "format_changes",
           "log_best_checkpoint", "log_params_once", "open_run", "param_text", "record_config_revision",
           "recorded_config", "remember_run_id", "run_key", "tracking_uri", "ui_command"]
