"""``python -m raytrain_scu.runs [STORAGE] [RUN RUN ...] [--json]``: the runs under a storage path, or two and more
side by side.

STORAGE is a ``run.storage_path`` (default: the config's default, ~/raytrain_scu_runs). With no RUN: one row per run
(name, status finished / running / killed / failed, steps, best held-out BPT and its step, the last S and λ, tokens/s,
path). With RUNs (names under STORAGE, or run directories): their results and the config keys they differ in, side by
side. ``--json``: the rows as JSON. Exit 2 when STORAGE or a RUN is not there.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from raytrain_scu.config.paths import is_remote
from raytrain_scu.config.schema import RunConfig
from raytrain_scu.driver.runs import find_runs, format_list, format_side_by_side, is_run, list_runs
from raytrain_scu.errors import USER_ERRORS


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    as_json = "--json" in argv
    args = [a for a in argv if a != "--json"]
    unknown = [a for a in args if a.startswith("--")]
    if unknown:
        print(f"error: unknown option(s) {' '.join(unknown)}", file=sys.stderr)
        return 2
    storage = RunConfig().storage_path
    # a remote URI is a storage path too: the listing then says it reads local storage only
    if args and (is_remote(args[0]) or Path(args[0]).expanduser().is_dir() and not is_run(Path(args[0]).expanduser())):
        storage, args = args[0], args[1:]
    try:
        if len(args) == 1:
            print("error: give two or more runs to compare, or none to list them all", file=sys.stderr)
            return 2
        if args:
            runs = find_runs(storage, args)
            print(json.dumps(runs, indent=1, default=str) if as_json else format_side_by_side(runs))
        else:
            runs, sweeps = list_runs(storage)
            print(json.dumps(runs, indent=1, default=str) if as_json else format_list(storage, runs, sweeps))
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
