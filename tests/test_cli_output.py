"""Where the `vmmshare` commands write: a reader that stops early (`| head`) ends a command quietly with status 141
and no traceback; long runs show a status line on a terminal's stderr and nothing when stderr is not a terminal;
scripts/setup.sh installs only when what it installs changed."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clirun import HANG_GUARD, ROOT, VMMSHARE, env_for, refused

PIPE_CLOSED = 141
TINY_BENCH = ["bench", "--quick", "--sizes", "4K", "--reps", "1", "--clients", "1", "--seconds", "0.1", "--no-torch"]


def with_closed_stdout(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run `vmmshare args` with stdout a pipe whose reader is gone before the first write (as `| head` leaves it
    once head has read its lines)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([*VMMSHARE, *args], env=env, stdout=w, stderr=subprocess.PIPE, text=True,
                              timeout=HANG_GUARD)
    finally:
        os.close(w)


def test_demo_into_a_closed_pipe_stops_quietly(tmp_path: Path) -> None:
    out = with_closed_stdout(env_for(tmp_path), "demo", "--size", "2M")
    assert out.returncode == PIPE_CLOSED and out.stderr == "", out.stderr


@pytest.mark.slow
def test_bench_into_a_closed_pipe_stops_quietly_and_keeps_its_json(tmp_path: Path) -> None:
    target = tmp_path / "bench.json"
    out = with_closed_stdout(env_for(tmp_path), *TINY_BENCH, "--json", str(target))
    assert out.returncode == PIPE_CLOSED and "Traceback" not in out.stderr and out.stderr == "", out.stderr
    assert "latency" in json.loads(target.read_text())


@pytest.mark.parametrize("args", [["stress"], ["stress", "fuzz_protocol", "--frames", "50", "--atheris-runs", "0"],
                                  ["version"]])
def test_other_output_into_a_closed_pipe_stops_quietly(tmp_path: Path, args: list[str]) -> None:
    out = with_closed_stdout(env_for(tmp_path), *args)
    assert out.returncode == PIPE_CLOSED and out.stderr == "", (args, out.stderr)


@pytest.mark.parametrize("args", [["demo", "--size", "2M"], ["version"], ["doctor"], ["stress"],
                                  ["stress", "fuzz_protocol", "--frames", "50", "--atheris-runs", "0"]])
def test_output_to_a_full_device_is_one_line_and_a_failure(tmp_path: Path, args: list[str]) -> None:
    """`> /dev/full` (a disk that fills up): the write fails with ENOSPC; the command says so on one line of
    stderr, naming standard output, and exits 1, with no traceback."""
    with open("/dev/full", "w") as full:
        out = subprocess.run([*VMMSHARE, *args], env=env_for(tmp_path), stdout=full, stderr=subprocess.PIPE,
                             text=True, timeout=HANG_GUARD)
    refused(out, 1, f"vmmshare {args[0]}: cannot write to standard output", "No space left on device")


@pytest.mark.parametrize("args", [["stress", "fuzz_protocol", "--frames", "50", "--atheris-runs", "0"],
                                  ["bench", "--quick", "--no-torch", "--sizes", "4K", "--reps", "1", "--clients", "1",
                                   "--seconds", "0.1"]])
def test_a_full_disk_under_a_json_file_is_one_line_naming_it(tmp_path: Path, args: list[str]) -> None:
    """The same refusal from the --json file on a full file system (a link to /dev/full): one line naming the
    file, exit 1."""
    link = tmp_path / "full.json"
    link.symlink_to("/dev/full")
    out = subprocess.run([*VMMSHARE, *args, "--json", str(link)], env=env_for(tmp_path), capture_output=True,
                         text=True, timeout=HANG_GUARD)
    refused(out, 1, f"vmmshare {args[0]}", f"cannot write {link}: No space left on device")


@pytest.mark.parametrize("args", [["--help"], ["broker", "--help"], ["bench", "--help"]])
def test_help_into_a_closed_pipe_is_quiet(tmp_path: Path, args: list[str]) -> None:
    """argparse drops help it cannot write and exits 0: quiet too, which is what matters."""
    out = with_closed_stdout(env_for(tmp_path), *args)
    assert out.returncode in (0, PIPE_CLOSED) and out.stderr == "", (args, out.stderr)


def test_shell_pipe_into_head(tmp_path: Path) -> None:
    """The case as typed: `vmmshare demo | head -4`; whichever side finishes first, no traceback and all 4 lines."""
    cmd = " ".join(VMMSHARE) + " demo --size 2M | head -4; echo ${PIPESTATUS[0]} >&2"
    out = subprocess.run(["bash", "-c", cmd], env=env_for(tmp_path), capture_output=True, text=True,
                         timeout=HANG_GUARD)
    assert len(out.stdout.splitlines()) == 4 and out.stdout.startswith("vmmshare demo:")
    assert out.stderr.strip() in ("0", str(PIPE_CLOSED)), out.stderr


def run_on_a_terminal(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run `vmmshare args` with stderr on a pseudo-terminal (stdout a pipe); return the result and what the
    terminal received."""
    master, slave = pty.openpty()
    seen = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer of the terminal has closed it
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        out = subprocess.run([*VMMSHARE, *args], env=env, stdout=subprocess.PIPE, stderr=slave, text=True,
                             timeout=HANG_GUARD)
    finally:
        os.close(slave)
        reader.join(HANG_GUARD)
        os.close(master)
    return out, seen.decode(errors="replace")


def test_demo_shows_progress_on_a_terminal_only(tmp_path: Path) -> None:
    out, terminal = run_on_a_terminal(env_for(tmp_path), "demo", "--size", "4M")
    assert out.returncode == 0, out.stdout
    assert "vmmshare demo: exporter: allocating, mapping and filling 4 MiB" in terminal
    assert terminal.rstrip("\r\n").endswith("\x1b[K"), "the status line is left on the terminal"
    assert "\x1b" not in out.stdout and out.stdout.rstrip().endswith("all steps behaved")
    piped = subprocess.run([*VMMSHARE, "demo", "--size", "4M"], env=env_for(tmp_path), capture_output=True,
                           text=True, timeout=HANG_GUARD)
    assert piped.returncode == 0 and piped.stderr == "", "progress written to a stderr that is not a terminal"


@pytest.mark.slow
def test_bench_shows_progress_on_a_terminal(tmp_path: Path) -> None:
    out, terminal = run_on_a_terminal(env_for(tmp_path), *TINY_BENCH)
    assert out.returncode == 0, out.stdout
    for step in ("vmmshare bench: share latency, 4KiB, warm-up round",
                 "vmmshare bench: share latency, 4KiB, round 1 of 1",
                 "broker throughput, 1 client(s)"):
        assert step in terminal, terminal
    assert "\x1b" not in out.stdout and "targets:" in out.stdout


def test_stress_shows_progress_on_a_terminal_and_passes_the_output_through(tmp_path: Path) -> None:
    out, terminal = run_on_a_terminal(env_for(tmp_path), "stress", "fuzz_protocol", "--frames", "50",
                                      "--atheris-runs", "0")
    assert out.returncode == 0, out.stdout
    assert "vmmshare stress fuzz_protocol: running" in terminal
    assert out.stdout.startswith("decoder: 50 frames")


def test_setup_skips_the_install_when_nothing_it_installs_changed() -> None:
    """A second scripts/setup.sh (as every scripts/demo.sh runs) leaves the installed package alone."""
    stamp = ROOT / ".venv" / ".vmmshare-setup"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "scripts" / "setup.sh").read_bytes())
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve() or not stamp.exists():
        pytest.skip("not running in this checkout's scripts/setup.sh venv")
    if stamp.read_text().strip() != f"{want.hexdigest()} test":
        pytest.skip("pyproject.toml or scripts/setup.sh changed since the last set-up: the next one installs")
    installed = sorted(Path(sys.prefix).glob("lib/python*/site-packages/vmmshare-*.dist-info"))
    assert installed, "no installed vmmshare metadata to watch"
    before = [p.stat().st_mtime_ns for p in installed]
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", (out.stdout, out.stderr)
    after = sorted(Path(sys.prefix).glob("lib/python*/site-packages/vmmshare-*.dist-info"))
    assert after == installed and [p.stat().st_mtime_ns for p in after] == before, "setup reinstalled vmmshare"


FAKE_PYTHON = """#!/bin/sh
echo "python $*" >> "$LOG"
case "$*" in *"-m pip"*|*version_info*) exit 0 ;; esac
exit 1
"""


def _setup_as_on_a_bare_machine(tmp_path: Path, script: str, *args: str) -> list[str]:
    """Run scripts/`script` in a copy of the scripts and pyproject.toml, on a machine where the fabric libraries
    and systemd-analyze are missing, as root would: apt-get, ldconfig, the venv's python and vmmshare are stand-ins
    that log their calls (and the venv's python answers that nothing is importable). The calls, in order."""
    tree, bin_ = tmp_path / "tree", tmp_path / "bin"
    (tree / "scripts").mkdir(parents=True)
    (tree / ".venv" / "bin").mkdir(parents=True)
    bin_.mkdir()
    for name in ("setup.sh", "demo.sh", "test.sh"):
        (tree / "scripts" / name).write_bytes((ROOT / "scripts" / name).read_bytes())
        (tree / "scripts" / name).chmod(0o755)
    for name in ("pyproject.toml", "setup.py"):  # with the C library's sources: what the set-up's stamp hashes
        (tree / name).write_bytes((ROOT / name).read_bytes())
    shutil.copytree(ROOT / "src" / "vmmshare" / "clib", tree / "src" / "vmmshare" / "clib")
    stand_ins = {"apt-get": 'echo "apt-get $*" >> "$LOG"', "ldconfig": "exit 0", "id": "echo 0",
                 **{f"/.venv/bin/{tool}": f'echo "{tool} $*" >> "$LOG"; exit 1'
                    for tool in ("vmmshare", "ruff", "mypy", "mkdocs")}}
    for name, body in stand_ins.items():
        path = tree / name[1:] if name.startswith("/") else bin_ / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    (tree / ".venv" / "bin" / "python").write_text(FAKE_PYTHON)
    (tree / ".venv" / "bin" / "python").chmod(0o755)
    for tool in ("bash", "sh", "cat", "sha256sum", "cut", "rm", "ls", "head", "dirname", "grep", "mktemp"):
        found = shutil.which(tool)
        assert found, tool
        (bin_ / tool).symlink_to(found)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {"PATH": str(bin_), "LOG": str(log), "HOME": str(tmp_path)}
    subprocess.run(["bash", str(tree / "scripts" / script), *args], cwd=tree, env=env, capture_output=True,
                   text=True, timeout=HANG_GUARD)
    return log.read_text().splitlines()


def test_the_demo_sets_up_only_the_package_and_installs_nothing_with_apt(tmp_path: Path) -> None:
    """scripts/demo.sh on a bare machine, as root: the package alone (no extras), no apt-get (the demo needs no
    systemd and no fabric libraries), then the demo."""
    calls = _setup_as_on_a_bare_machine(tmp_path, "demo.sh", "--size", "2M")
    assert not [c for c in calls if c.startswith("apt-get")], calls
    installs = [c for c in calls if "-m pip install" in c]
    assert len(installs) == 1 and installs[0].endswith(" -e ."), calls
    assert calls[-1] == "vmmshare demo --size 2M", calls


def test_the_tests_set_up_their_tools_docs_and_system_packages(tmp_path: Path) -> None:
    """scripts/test.sh's set-up, on the same machine: the test, docs, deploy and fabric extras, and what the tests use
    from apt (the fabric libraries, systemd-analyze); it stops at the first failing check (ruff, here)."""
    calls = _setup_as_on_a_bare_machine(tmp_path, "test.sh")
    apt = " ".join(c for c in calls if c.startswith("apt-get"))
    assert "libibverbs1" in apt and "systemd" in apt, calls
    installs = [c for c in calls if "-m pip install" in c]
    assert installs and installs[0].endswith("-e .[dev,fabric,docs,deploy]"), calls
    assert calls[-1] == "ruff check .", calls
