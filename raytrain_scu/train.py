"""``python -m raytrain_scu.train``: see :mod:`raytrain_scu.cli.train`."""
from raytrain_scu.cli.train import entry

if __name__ == "__main__":
    entry()
