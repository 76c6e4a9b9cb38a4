"""``python -m raytrain_scu.sweep [--lr] [--verbose] CONFIG.yaml key=value...``: a Ray Tune sweep whose trials are Ray
Train runs (``ray.tune.sweep`` says how)."""
from __future__ import annotations

import sys

from raytrain_scu.config.io import help_text
from raytrain_scu.driver.early import check_inputs
from raytrain_scu.driver.resolve import resolve
from raytrain_scu.errors import USER_ERRORS

USAGE = "usage: python -m raytrain_scu.sweep [--lr] [--verbose] CONFIG.yaml [key=value ...]"
FLAGS = {"--lr": "also sweep optim.lr, log-uniform over a decade either side of the config's",
         "--verbose": "Ray's, Tune's and the trials' own output on the console too (it is always in <sweep dir>/logs "
                      "and Ray's session logs)"}
ABOUT = """\
Runs the config's tune.space (left empty: a space chosen by tune.metric) as Ray Tune trials, each a Ray Train run of
the config with the trial's values. The console has one line per trial event (started, each report, stopped by ASHA,
finished, failed) with the trial's values, then the trials table, best first. The sweep's directory
(<run.storage_path>/<run.name>) gets trials.csv, best.yaml (the best trial's config, ready for
python -m raytrain_scu.train), plots/ and logs/; MLflow gets a parent run with a child run per trial. Re-running the
same command resumes an interrupted sweep. Exit 0 when every trial ran, 1 when some failed, 2 for a bad config.

Any config key can be set as key=value (python -m raytrain_scu.train --help lists them all). The sweep's own keys:"""


def help_message() -> str:
    """``--help``: the sweep's own flags, what it does and its tune.* keys (defaults and meanings from the config
    tree)."""
    flags = "\n".join(f"  {flag:<10} {text}" for flag, text in FLAGS.items())
    tune_keys = [line for line in help_text().splitlines() if line.lstrip().startswith("tune.")]
    return f"{USAGE}\n\noptions:\n{flags}\n\n{ABOUT}\n" + "\n".join(tune_keys)


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 when every trial ran, 1 when some failed (re-run to resume), 2 for errors found before launch."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with_lr, verbose = "--lr" in argv, "--verbose" in argv
    args = [a for a in argv if a not in FLAGS]
    if not args or args[0] in ("-h", "--help"):
        print(help_message() if args else USAGE)
        return 0 if args else 2
    unknown = [a for a in args if a.startswith("--")]
    if unknown:
        print(f"error: unknown option(s) {' '.join(unknown)}; {USAGE}", file=sys.stderr)
        return 2
    try:
        cfg = resolve(args[0], args[1:], early=check_inputs)  # the storage path and the data before the model
        # the driver imports torch, transformers and Ray: only once the config and its inputs are known to be good
        from raytrain_scu.driver.sweep import sweep

        summary = sweep(cfg, with_lr=with_lr, verbose=verbose, inputs_checked=True)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if summary["errors"] or summary["best"] is None else 0
