"""``python -m raytrain_scu.ablation_report DIR [--doc FILE]``: a study's report from its ``results.json``, without
running anything: v1's (``report``) or the study v2's (``v2.report``), as the file says."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from raytrain_scu.studies.ablation import report as v1_report
from raytrain_scu.studies.ablation.v2 import report as v2_report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raytrain_scu.ablation_report", description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the ablation's --out directory (holds results.json)")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--doc", default="", help="also write this document: DIR/notes.md, then the generated tables")
    a = ap.parse_args(argv)
    path = Path(a.dir) / "results.json"
    if not path.exists():
        print(f"error: no {path}", file=sys.stderr)
        return 2
    results = json.loads(path.read_text())
    writer = v2_report if results.get("protocol") == "v2" else v1_report
    print(writer.write(results, Path(a.dir), n_boot=a.bootstrap, doc=Path(a.doc) if a.doc else None))
    return 0
