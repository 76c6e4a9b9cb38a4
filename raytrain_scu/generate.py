"""``python -m raytrain_scu.generate``: see :mod:`raytrain_scu.cli.generate`."""
import sys

from raytrain_scu.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
