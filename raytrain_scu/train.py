"""``python -m raytrain_scu.train``: see :mod:`raytrain_scu.cli.train`; ``main`` is there for callers in this
process."""
from raytrain_scu.cli.train import entry, main

__all__ = ["main"]

if __name__ == "__main__":
    entry()
