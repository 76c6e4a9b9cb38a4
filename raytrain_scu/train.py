"""``python -m raytrain_scu.train``: see :mod:`raytrain_scu.cli.train` (``main`` is its function, for callers in a
process of their own)."""
from raytrain_scu.cli.train import entry, main

__all__ = ["main"]

if __name__ == "__main__":
    entry()
