"""``python -m clover_convert``: the clover-convert command."""

import sys

from .cli import main

sys.exit(main())
