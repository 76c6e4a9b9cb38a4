"""MLflow tracking, in three parts: :mod:`.store` (where runs live, opening and ending them, tags), :mod:`.tracker`
(rank 0's retrying logger and the no-op every other rank gets) and :mod:`.revisions` (a re-run under a changed
config). Import names from the module that defines them."""
