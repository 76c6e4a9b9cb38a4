"""``python -m raytrain_scu.config CONFIG.yaml key=value...``: the resolved config as YAML (2: a bad config)."""
from __future__ import annotations

import sys

from raytrain_scu.config.io import help_text, to_yaml
from raytrain_scu.driver.resolve import resolve
from raytrain_scu.errors import USER_ERRORS


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m raytrain_scu.config CONFIG.yaml [key=value ...]   (prints the resolved config)")
        if argv:
            print("\n" + help_text())
        return 0 if argv else 2
    try:
        cfg = resolve(argv[0], argv[1:])  # presets and the memory fit, as every CLI
    except USER_ERRORS as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(cfg, redact=True))
    return 0
