"""``python -m raytrain_scu.runs``: see :mod:`raytrain_scu.cli.runs`."""
import sys

from raytrain_scu.cli.runs import main

if __name__ == "__main__":
    sys.exit(main())
