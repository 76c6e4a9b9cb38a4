"""``python -m raytrain_scu.evaluate``: see :mod:`raytrain_scu.cli.evaluate`."""
import sys

from raytrain_scu.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
