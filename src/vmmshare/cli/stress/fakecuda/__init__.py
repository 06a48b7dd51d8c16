"""The CPU stand-in for libcuda (`fakecuda.c`): build it, and the environment that makes a new process load it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fakecuda.c"


def build(folder: Path, devices: int = 2) -> dict[str, str]:
    """Compile the stand-in as `folder`/libcuda.so.1 with $CC (default cc); the variables a child process needs."""
    lib = folder / "libcuda.so.1"
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                    str(SOURCE)], check=True, capture_output=True, timeout=120)
    prior = os.environ.get("LD_LIBRARY_PATH")
    return {"LD_LIBRARY_PATH": str(folder) + (os.pathsep + prior if prior else ""), "FAKECUDA_DEVICES": str(devices)}
