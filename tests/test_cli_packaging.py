"""What a user gets from the distributions: the sdist is self-contained (its own tests collect and run from the
unpacked tree, outside any git checkout, these included), carries LICENSE and PEP 639 license metadata, and the
wheel built from it runs `vmmshare stress`.

Built with setuptools' own PEP 517 hooks (no network, no build isolation): the sdist from this checkout, the wheel
from the unpacked sdist, as `pip install` of the sdist would.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from procs import clean_env

# On one worker of a parallel run: the sdist is built once for the module.
pytestmark = pytest.mark.xdist_group("sdist")

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD = 600  # seconds: a guard against a hang only, never part of an assertion


def _hook(hook: str, source: Path, out: Path) -> Path:
    """Run setuptools.build_meta.`hook` in `source` (a process of its own), writing into `out`; the file made."""
    code = f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True,
                          timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "deprecat" not in (done.stdout + done.stderr).lower(), done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's sdist, unpacked: the tree a user of `pip download --no-binary` gets."""
    out = tmp_path_factory.mktemp("sdist")
    sdist = _hook("build_sdist", _tracked_copy(out / "checkout"), out)
    with tarfile.open(sdist) as tar:
        tar.extractall(out, filter="data")
    tree = out / sdist.name.removesuffix(".tar.gz")
    assert tree.is_dir()
    return tree


def _source_files(root: Path) -> list[str]:
    """The files of a clean source tree at `root`: in an unpacked sdist (PKG-INFO at its top, and no git), the ones
    the sdist lists (its egg-info's SOURCES.txt); in a checkout, the ones git tracks."""
    if (root / "PKG-INFO").is_file():
        return (root / "src" / "vmmshare.egg-info" / "SOURCES.txt").read_text().splitlines()
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=HANG_GUARD)
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.decode().split("\0")


def _tracked_copy(folder: Path) -> Path:
    """The files of this source tree (`_source_files`), copied to `folder`: what a clean clone holds, built apart
    from the tree, where the other tests of a parallel run write and remove files while setuptools walks it."""
    for name in filter(None, _source_files(ROOT)):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not there to copy
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
    return folder


def _pytest(tree: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VMMSHARE_", "PYTEST"))}
    env["PYTHONPATH"] = str(tree / "src")  # the unpacked tree's own code, not this checkout's
    env.update(extra)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD)


def test_sdist_carries_the_license_and_its_pep_639_metadata(unpacked: Path) -> None:
    text = (unpacked / "LICENSE").read_text()
    assert text == (ROOT / "LICENSE").read_text() and "Apache License" in text and "Version 2.0" in text
    meta = email.parser.Parser().parsestr((unpacked / "PKG-INFO").read_text())
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    assert meta["License"] is None  # the deprecated free-text field is gone
    assert (unpacked / "src/vmmshare/sockets/_fastpackets.c").is_file() and (unpacked / "setup.py").is_file()


@pytest.mark.slow
def test_sdist_test_suite_collects_and_runs_from_the_unpacked_tree(unpacked: Path) -> None:
    """Every test file collects (conftest, the harness in src/vmmshare/cli/stress/, fakecuda, examples and docs are
    there), and a few run green against the unpacked tree's own package."""
    collected = _pytest(unpacked, "--collect-only", "tests")
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert "error" not in collected.stdout.splitlines()[-1], collected.stdout[-3000:]
    which = subprocess.run([sys.executable, "-c", "import vmmshare; print(vmmshare.__file__)"],
                           env={**os.environ, "PYTHONPATH": str(unpacked / "src")}, capture_output=True, text=True,
                           timeout=HANG_GUARD)
    assert which.stdout.strip().startswith(str(unpacked)), which.stdout
    ran = _pytest(unpacked, "tests/test_cli_ls.py", "tests/test_cli_service.py", "-k",
                  "not namespaces and not passed")
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert " passed" in ran.stdout.splitlines()[-1] and "failed" not in ran.stdout.splitlines()[-1]


@pytest.mark.slow
def test_the_unpacked_sdist_builds_its_own_sdist_with_no_git_around(unpacked: Path) -> None:
    """The sdist's own copy of these tests builds an sdist from the unpacked tree (no git checkout above it, as a
    user's download): they list its files from the sdist's own list, not with git, and the tree they build holds
    the same files as this one."""
    env = {"GIT_CEILING_DIRECTORIES": str(unpacked.parent)}  # git must not find a checkout above the tree
    ran = _pytest(unpacked, "tests/test_cli_packaging.py", "-k", "license", **env)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "1 passed" in ran.stdout.splitlines()[-1], ran.stdout[-3000:]
    assert {"setup.py", "MANIFEST.in", "tests/test_cli_packaging.py"} <= set(_source_files(unpacked))


@pytest.mark.slow
def test_wheel_built_from_the_sdist_runs_vmmshare_stress(unpacked: Path, tmp_path: Path) -> None:
    """The wheel carries the stress runs and their harness: `vmmshare stress` lists them and one runs to a clean
    exit, from an install that has no source checkout anywhere near it."""
    wheel = _hook("build_wheel", unpacked, tmp_path)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(site)
    assert "vmmshare/cli/stress/fakecuda/fakecuda.c" in names and "vmmshare/cli/stress/procs.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]):  # the fast path is built where it can be
        assert any(n.startswith("vmmshare/sockets/_fastpackets.") and n.endswith(".so") for n in names), names
    env = clean_env(PYTHONPATH=str(site), VMMSHARE_SOCKET=str(tmp_path / "s" / "broker.sock"))

    def stress(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vmmshare", "stress", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=HANG_GUARD)

    listing = stress()
    assert listing.returncode == 0 and "source checkout" not in listing.stdout + listing.stderr, listing
    assert "faults" in listing.stdout and "fuzz_api" in listing.stdout
    run = stress("fuzz_api", "--calls", "200")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stdout + run.stderr
    assert "counts back: True" in run.stdout
    fast = subprocess.run([sys.executable, "-c", "from vmmshare.sockets import packets; print(packets.FAST)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert fast.stdout.strip() == str(any(n.endswith(".so") for n in names)), fast.stderr
