"""The full comparison run of `vmmshare bench` (same code): ``python benchmarks/bench_all.py [--quick]
[--json FILE] [--plot FILE.png]``."""

import sys

from vmmshare.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
