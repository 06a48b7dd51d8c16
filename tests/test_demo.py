"""`vmmshare demo`: three real processes on the broker; exit 0 only if every step behaved."""

from __future__ import annotations

import os
import subprocess
import sys


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmmshare.cli", "demo", *args], capture_output=True, text=True,
                          timeout=180, env=env)


def test_demo_succeeds_and_reports_each_step() -> None:
    out = run_demo("--size", "6M")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "6 MiB shared between three processes" in text
    assert "shareable handle 0x" in text
    assert "import -> 207006" in text
    assert "late import by importer-B -> 107017" in text
    assert "importer-A's memory is intact" in text
    assert "FAIL" not in text
    assert text.rstrip().endswith("all steps behaved")


def test_demo_rounds_odd_sizes_up_to_the_granularity() -> None:
    out = run_demo("--size", "3M")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 MiB shared" in out.stdout


def test_demo_fails_when_a_step_fails(tmp_path: object) -> None:
    env = dict(os.environ)
    env["VMMSHARE_SOCKET"] = os.path.join(str(tmp_path), "broker.sock")
    env["VMMSHARE_DEVICE_MEMORY"] = "4M"  # the 8 MiB allocation cannot fit
    out = run_demo("--size", "8M", env=env)
    assert out.returncode == 1
    assert "FAIL" in out.stdout and "207001" in out.stdout


def test_demo_rejects_a_bad_size() -> None:
    out = run_demo("--size", "lots")
    assert out.returncode == 2
    assert "not a size" in out.stderr


def test_doctor_reports_each_facility() -> None:
    import json

    out = subprocess.run([sys.executable, "-m", "vmmshare.cli", "doctor", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode in (0, 1), out.stderr
    findings = json.loads(out.stdout)
    items = {f["item"] for f in findings}
    assert {"hugetlb 2 MiB pool", "THP for shared memory", "pidfd peer identity", "pid namespaces",
            "broker socket", "backend"} <= items
    for f in findings:
        assert f["status"] in ("ok", "slow", "limit", "missing")
        if f["status"] != "ok":
            assert f["fix"] or f["item"] == "broker socket", f
    text = subprocess.run([sys.executable, "-m", "vmmshare.cli", "doctor"], capture_output=True, text=True, timeout=60)
    assert "hugetlb 2 MiB pool" in text.stdout


def test_stress_entry_lists_and_refuses_unknown_runs() -> None:
    listing = subprocess.run([sys.executable, "-m", "vmmshare.cli", "stress"], capture_output=True, text=True,
                             timeout=60)
    assert listing.returncode == 0 and "runs:" in listing.stdout and "fuzz_protocol" in listing.stdout
    unknown = subprocess.run([sys.executable, "-m", "vmmshare.cli", "stress", "no-such-run"], capture_output=True,
                             text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown run" in unknown.stderr
