"""``python -m raytrain_scu.tracking uri CONFIG.yaml [key=value ...]``: the tracking URI that config's runs use (what
``make ui`` opens)."""
from __future__ import annotations

import sys

from raytrain_scu.driver.resolve import resolve
from raytrain_scu.errors import USER_ERRORS
from raytrain_scu.tracking.store import tracking_uri


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "uri":
        print("usage: python -m raytrain_scu.tracking uri CONFIG.yaml [key=value ...]", file=sys.stderr)
        return 2
    try:
        print(tracking_uri(resolve(argv[1], argv[2:], announce=False)))
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
