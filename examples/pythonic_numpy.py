"""The Pythonic API with numpy: a producer shares a float32 matrix with a consumer process, zero-copy.

The handle travels as text (``str(handle)``), the consumer's answer comes back through the same memory.
Needs numpy. Run from the repository root, after ``scripts/setup.sh``: ``.venv/bin/python examples/pythonic_numpy.py``.
"""

import subprocess
import sys

import numpy as np

import vmmshare

ROWS, COLS = 512, 1024


def consumer(text):
    with vmmshare.import_handle(vmmshare.ShareableHandle.parse(text)) as memory, memory.map() as mapping:
        matrix = mapping.numpy(np.float32, (2, ROWS, COLS))
        matrix[1] = matrix[0] * 2  # answer in the second half
        print(float(matrix[0].sum()))
        del matrix  # views must go before the mapping closes


def producer():
    device = vmmshare.Device(0)
    with device.allocate(2 * ROWS * COLS * 4) as memory, memory.map() as mapping:
        matrix = mapping.numpy(np.float32, (2, ROWS, COLS))
        matrix[0] = np.random.default_rng(0).standard_normal((ROWS, COLS), dtype=np.float32)
        child = subprocess.Popen([sys.executable, __file__, "--consumer"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        handle = memory.export(pids=[child.pid])  # trustlist the consumer in the export call
        out, _ = child.communicate(f"{handle}\n")
        assert child.returncode == 0
        assert np.isclose(float(out), float(matrix[0].sum()), rtol=1e-4)
        assert np.array_equal(matrix[1], matrix[0] * 2), "the consumer's answer is not visible"
        print(f"{handle} shared {memory.size >> 20} MiB; the consumer doubled the matrix in place")
        del matrix


if __name__ == "__main__":
    if "--consumer" in sys.argv:
        consumer(sys.stdin.readline().strip())
    else:
        producer()
