"""``python -m raytrain_scu.check``: see :mod:`raytrain_scu.cli.check`."""
import sys

from raytrain_scu.cli.check import main

if __name__ == "__main__":
    sys.exit(main())
