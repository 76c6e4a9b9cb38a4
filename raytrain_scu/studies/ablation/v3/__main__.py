import sys

from raytrain_scu.studies.ablation.v3.cli import main

if __name__ == "__main__":
    sys.exit(main())
