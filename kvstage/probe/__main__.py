"""``python -m kvstage.probe``: the same as ``kvstage probe``."""

import sys

from kvstage.probe.cli import main

sys.exit(main())
