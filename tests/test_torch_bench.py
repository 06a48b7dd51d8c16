"""`vmmshare bench --torch`: the CI-sized run measures every row it reports, and usage errors end without a
traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmmshare", "bench", "--torch", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_quick_run_reports_every_measure(tmp_path: Path) -> None:
    out = tmp_path / "torch.json"
    got = bench("--quick", "--json", str(out))
    assert got.returncode == 0, got.stdout + got.stderr
    assert "Traceback" not in got.stderr
    res = json.loads(out.read_text())
    assert res["state_dict"]["tensors"] == 200
    for way in ("vmmshare_bucket_ms", "torch_multiprocessing_ms", "pickle_ms"):
        assert res["first_usable"][way]["median"] > 0
    assert res["already_shared"]["vmmshare_bucket_ms"]["median"] > 0
    for row in res["update"].values():
        assert row["vmmshare_bucket_ms"]["median"] > 0 and row["memcpy_ms"]["median"] > 0
    assert res["small"]["tensors"] == 1000 and res["small"]["one_bucket_ms"]["median"] > 0
    for line in ("first usable tensor", "per update", "1000 small tensors"):
        assert line in got.stdout


def test_usage_errors_are_short(tmp_path: Path) -> None:
    got = bench("--reps", "0")
    assert got.returncode == 2 and "Traceback" not in got.stderr
    got = bench("--json", str(tmp_path / "no" / "x.json"))  # refused before anything is measured
    assert got.returncode == 2 and "does not exist" in got.stderr and "Traceback" not in got.stderr
    helped = bench("--help")
    assert helped.returncode == 0 and "``" not in helped.stdout and "--quick" in helped.stdout


def test_without_torch_it_says_which_extra_to_install() -> None:
    """`python -S` leaves site-packages out: this interpreter then has no torch, as on a bare install."""
    import os

    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": src}
    if subprocess.run([sys.executable, "-S", "-c", "import torch"], env=env, capture_output=True).returncode == 0:
        pytest.skip("torch is importable without site-packages here")
    got = subprocess.run([sys.executable, "-S", "-m", "vmmshare", "bench", "--torch", "--quick"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 2 and "pip install 'vmmshare[torch]'" in got.stderr and "Traceback" not in got.stderr
