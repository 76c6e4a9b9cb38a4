"""``python -m raytrain_scu.ablation``: see :mod:`raytrain_scu.studies.ablation`."""
import sys

from raytrain_scu.studies.ablation.cli import main

if __name__ == "__main__":
    sys.exit(main())
