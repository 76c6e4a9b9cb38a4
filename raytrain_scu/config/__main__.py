"""``python -m raytrain_scu.config CONFIG.yaml key=value...``: the resolved config as YAML."""
import sys

from raytrain_scu.cli.config import main

sys.exit(main())
