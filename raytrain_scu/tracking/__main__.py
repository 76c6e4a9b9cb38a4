"""``python -m raytrain_scu.tracking uri CONFIG.yaml [key=value ...]``: the tracking URI that config's runs use."""
import sys

from raytrain_scu.cli.tracking import main

sys.exit(main())
