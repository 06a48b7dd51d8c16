"""VMMSHARE_BACKEND on a machine without a usable GPU: `cuda` refuses clearly (207000), `auto` falls back to host
memory, anything else is a configuration error. (GPU machines run tests/test_cuda.py instead.)"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest

CODE = textwrap.dedent("""
    import vmmshare.acl as acl
    prop = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
    ret = acl.rt.set_device(0)
    handle, ret2 = acl.rt.malloc_physical(2 << 20, prop, 0)
    print(ret, ret2, acl.get_recent_err_msg())
""")


def run(backend: str) -> list[str]:
    env = {**os.environ, "VMMSHARE_BACKEND": backend}
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split(maxsplit=2)


@functools.cache
def gpu_usable() -> bool:
    """Whether a GPU is usable here (asked in a child process, once, at the first test that needs to know)."""
    out = subprocess.run([sys.executable, "-c", "from vmmshare.backends.cuda import available; print(available())"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() == "True"


@pytest.fixture
def no_gpu() -> None:
    """Skips a test of the no-GPU paths where a GPU is usable."""
    if gpu_usable():
        pytest.skip("a GPU is usable here: tests/test_cuda.py covers it")


without_gpu = pytest.mark.usefixtures("no_gpu")


@without_gpu
def test_cuda_without_a_gpu_is_refused_with_the_reason() -> None:
    ret, ret2, message = run("cuda")
    assert (ret, ret2) == ("207000", "207000")
    assert "CUDA" in message or "cuda" in message


@without_gpu
def test_auto_without_a_gpu_uses_host_memory() -> None:
    ret, ret2, *_ = run("auto")
    assert (ret, ret2) == ("0", "0")


def test_an_unknown_backend_is_refused() -> None:
    ret, ret2, message = run("tpu")
    assert (ret, ret2) == ("107000", "107000")
    assert "VMMSHARE_BACKEND" in message and "'host', 'cuda' or 'auto'" in message


@pytest.mark.parametrize("auto", [False, True], ids=["foreground", "auto_started"])
def test_a_broker_with_a_bad_configuration_says_so_and_exits(tmp_path: object, auto: bool) -> None:
    env = {**os.environ, "VMMSHARE_DEVICES": "0"}
    cmd = [sys.executable, "-m", *(["vmmshare.broker", "--auto"] if auto else ["vmmshare.cli", "broker"]),
           "--socket", f"{tmp_path}/b.sock"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "VMMSHARE_DEVICES" in out.stderr and "Traceback" not in out.stderr, out.stderr


@without_gpu
@pytest.mark.parametrize("backend", ["cuda", "auto"])
def test_doctor_says_why_there_is_no_gpu(backend: str) -> None:
    import json

    env = {**os.environ, "VMMSHARE_BACKEND": backend}
    out = subprocess.run([sys.executable, "-m", "vmmshare.cli", "doctor", "--json"], env=env, capture_output=True,
                         text=True, timeout=60)
    finding = next(f for f in json.loads(out.stdout) if f["item"] == "backend")
    if backend == "cuda":
        assert finding["status"] == "missing" and finding["fix"], finding
        assert "no usable GPU" in finding["detail"] or "not installed" in finding["detail"], finding
    else:
        assert finding["status"] == "ok" and "host memory" in finding["detail"], finding
