"""``python -m raytrain_scu.sweep CONFIG.yaml key=value... [--lr]``: a Ray Tune sweep whose trials are Ray Train runs
(``ray.tune.sweep`` says how). ``--lr`` adds optim.lr (log-uniform over a decade either side of the config's)."""
from __future__ import annotations

import sys

from raytrain_scu.config.io import help_text
from raytrain_scu.config.resolve import resolve
from raytrain_scu.errors import USER_ERRORS

USAGE = "usage: python -m raytrain_scu.sweep CONFIG.yaml [key=value ...] [--lr]"


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 when every trial ran, 1 when some failed (re-run to resume), 2 for errors found before launch."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with_lr = "--lr" in argv
    args = [a for a in argv if a != "--lr"]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        if args:  # --help: every key, its default and meaning, generated from the config tree
            print("\n" + help_text())
        return 0 if args else 2
    try:
        cfg = resolve(args[0], args[1:])
        # the driver imports torch, transformers and Ray: only once the config is known to be good
        from raytrain_scu.driver.sweep import sweep

        summary = sweep(cfg, with_lr=with_lr)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if summary["errors"] or summary["best"] is None else 0

