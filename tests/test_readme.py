"""The README's code runs as written: each pair of snippets (`# exporter.py` / `# importer.py`, `# producer.py` /
`# consumer.py`) is saved as those files and run as the README says, in processes of their own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import HANG_GUARD, ROOT

SNIPPETS = dict(re.findall(r"```python\n# (\w+\.py)[^\n]*\n(.*?)```", (ROOT / "README.md").read_text(), re.S))


@pytest.mark.parametrize("main, other, says", [
    ("exporter.py", "importer.py", "importer exit status 0"),
    ("producer.py", "consumer.py", "(16777216,)"),
])
def test_readme_snippets_run(tmp_path: Path, main: str, other: str, says: str) -> None:
    for name in (main, other):
        (tmp_path / name).write_text(SNIPPETS[name])
    out = subprocess.run([sys.executable, main], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert says in out.stdout, out.stdout
