"""``python -m raytrain_scu.train``: see :mod:`raytrain_scu.cli.train`."""
import sys

from raytrain_scu.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
