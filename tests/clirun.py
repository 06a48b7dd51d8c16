"""Running the `vmmshare` command line as a user does: the installed console script (or `python -m vmmshare`), in
its own process, with an environment of the test's own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from procs import clean_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "vmmshare"
VMMSHARE = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "vmmshare"]
HANG_GUARD = 120  # seconds: a guard against a hang only, never part of an assertion


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without VMMSHARE_* variables, a socket of the test's own, and `extra`."""
    return clean_env(**{"VMMSHARE_SOCKET": str(tmp_path / "s" / "broker.sock"), **extra})


def vmmshare(env: dict[str, str], *args: str, cmd: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """`vmmshare args` (or `cmd args`), its output captured as text."""
    return subprocess.run([*(cmd or VMMSHARE), *args], env=env, capture_output=True, text=True, timeout=HANG_GUARD)


def refused(out: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """Assert a clean refusal: exit `code`, no traceback, one line on stderr holding each of `words`; return it."""
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]
