"""``python -m vmmshare``: the ``vmmshare`` command line."""

import sys

from .cli import main

sys.exit(main())
