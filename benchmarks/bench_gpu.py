"""GPU sharing costs with the CUDA backend, against torch CUDA IPC, in one run: ``vmmshare bench --gpu``.

    python benchmarks/bench_gpu.py [--sizes 2M,1G] [--reps N] [--json FILE]
"""

import sys

from vmmshare.cli.bench_gpu import main

if __name__ == "__main__":
    sys.exit(main())
