"""Every example runs to success as its own process (exporter and importer processes, the session broker).

The GPU examples (`gpu_*.py`) run in tests/test_cuda.py, with the CUDA backend."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted(p for p in (Path(__file__).resolve().parent.parent / "examples").glob("*.py")
                  if not p.name.startswith("gpu_"))


def test_there_are_examples() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"share_with_trustlist", "share_without_trustlist", "share_fabric_handle", "pythonic_numpy",
            "share_ipc_memory", "ipc_memory_withpid", "ipc_memory_withoutpid", "torch_weight_sync"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path: Path) -> None:
    if path.stem.startswith("torch_") and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install 'vmmshare[torch]')")
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip(), "an example says what it did"
