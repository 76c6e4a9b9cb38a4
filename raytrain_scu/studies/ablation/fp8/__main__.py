import sys

from raytrain_scu.studies.ablation.fp8.cli import main

if __name__ == "__main__":
    sys.exit(main())
