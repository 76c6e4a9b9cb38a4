"""``python -m raytrain_scu.ablation_report DIR``: see :mod:`raytrain_scu.studies.ablation.report_cli`."""
import sys

from raytrain_scu.studies.ablation.report_cli import main

if __name__ == "__main__":
    sys.exit(main())
