"""``python -m raytrain_scu.sweep``: see :mod:`raytrain_scu.cli.sweep`."""
import sys

from raytrain_scu.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
