"""vmmshare bench's C row: a 2 MiB share between two C processes through libascendcl.so, beside C shm_open + mmap
and the floor of any brokered import (one request and a reply carrying an fd between the same two C processes),
measured in one run by bench_c.c, which is built here against `vmmshare prefix` with the system compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .bench_measures import Step, quiet, stats_of

SOURCE = Path(__file__).with_name("bench_c.c")


def build(folder: Path) -> Path | None:
    """bench_c.c built against the C library (None: no compiler, or the library was not built)."""
    from ..sdk import SdkError, root

    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    try:
        prefix = root()
    except SdkError:
        return None
    exe = folder / "bench_c"
    lib64 = prefix / "lib64"
    subprocess.run([compiler, "-std=c11", "-D_GNU_SOURCE", "-O2", f"-I{prefix / 'include'}", str(SOURCE),
                    f"-L{lib64}", "-lascendcl", f"-Wl,-rpath,{lib64}", "-o", str(exe)],
                   check=True, capture_output=True)
    return exe


def c_share(rounds: int, step: Step = quiet) -> dict[str, Any]:
    """Medians (p10-p90) in µs of the C importer's import + reserve + map and the C exporter's whole share,
    SharedMemory's C analogues, and the floor; empty where the C library or a compiler is missing."""
    step("the C library: a 2 MiB share between two C processes")
    with tempfile.TemporaryDirectory(prefix="vmmshare-bench-c-") as folder:
        exe = build(Path(folder))
        if exe is None:
            return {}
        proc = subprocess.run([str(exe), str(rounds)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the C share bench failed: {proc.stderr.strip()[-300:]}")
    out: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        name, *values = line.split()
        out[name] = stats_of([int(v) / 1000 for v in values])
    floor = out["floor"]["median"]
    out["importer_vs_floor"] = out["c_importer"]["median"] / floor
    out["exporter_vs_3_floors"] = out["c_exporter"]["median"] / (3 * floor)
    return out
