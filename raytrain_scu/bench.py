"""``python -m raytrain_scu.bench``: see :mod:`raytrain_scu.studies.bench`."""
import sys

from raytrain_scu.studies.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
