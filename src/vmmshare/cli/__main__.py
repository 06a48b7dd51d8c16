"""``python -m vmmshare.cli``: the ``vmmshare`` command line."""

import sys

from .commands import main

sys.exit(main())
