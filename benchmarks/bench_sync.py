"""Producer/consumer wake-up across two processes: an IPC event's record -> wait against a pipe's write -> read
between the same two processes (the part of `vmmshare bench` that measures synchronisation):
``python benchmarks/bench_sync.py [--reps N] [--json FILE]``."""

import sys

from vmmshare.cli.bench_sync import main

if __name__ == "__main__":
    sys.exit(main())
