"""``python -m raytrain_scu.ablation_report DIR``: see :mod:`raytrain_scu.studies.ablation.report`."""
import sys

from raytrain_scu.studies.ablation.report import main

if __name__ == "__main__":
    sys.exit(main())
