"""``python -m raytrain_scu.check [CONFIG.yaml] [key=value ...] [--require-gpu] [--json]``: can this machine (or the
cluster in RAY_ADDRESS) run raytrain_scu?

Prints one row per requirement with pass / warn / fail / skip. Exit status 1 when any row fails, else 0; 2 for a bad
config or option. "No GPU" is a warning, not a failure (CPU training works), unless ``--require-gpu``. The config
(optional) supplies ``run.storage_path`` for the disk check and is shown with the preset ``auto`` would pick here.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

from raytrain_scu.driver.resolve import resolve
from raytrain_scu.errors import USER_ERRORS
from raytrain_scu.hardware.envcheck import Row, run_checks


def format_table(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'STATUS':<6}  {'CHECK':<{width}}  DETAIL"]
    lines += [f"{r.status:<6}  {r.name:<{width}}  {r.detail}" for r in rows]
    failed = sum(r.status == "fail" for r in rows)
    warned = sum(r.status == "warn" for r in rows)
    lines.append(f"{'FAILED' if failed else 'OK'}: {failed} failed, {warned} warning(s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    as_json = "--json" in argv
    require_gpu = "--require-gpu" in argv
    rest = [a for a in argv if a not in ("--json", "--require-gpu")]
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        print(f"unknown option(s): {' '.join(unknown)}", file=sys.stderr)
        return 2
    cfg = None
    if rest:
        path = None if "=" in rest[0] else rest[0]
        overrides = rest[1:] if path is not None else rest
        try:
            cfg = resolve(path, overrides)
        except USER_ERRORS as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
    rows = run_checks(cfg, require_gpu=require_gpu)
    ok = not any(r.status == "fail" for r in rows)
    if as_json:
        print(json.dumps({"ok": ok, "checks": [asdict(r) for r in rows]}, indent=2, default=str))
    else:
        print(format_table(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
