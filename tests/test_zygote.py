"""The harness's zygote (stress/zygote.py): a child it forks is what a fresh `python -c` would be to the tests — its
own pid, environment, working folder, stdio and nothing else open, its exit status as subprocess reports it, and a
runtime and broker connection of its own."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import child_ok, run_child
from procs import Actor, clean_env, zygote_for
from zygote import Zygote


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote(clean_env())
    yield z
    z.close()


def test_a_child_has_the_environment_folder_and_fds_it_was_given(zygote: Zygote, tmp_path: Path) -> None:
    env = clean_env(ZYGOTE_PROBE="x y")
    os.chdir(tmp_path)
    try:
        child = zygote.spawn({"kind": "code", "code": (
            "import json, os, sys\n"
            "print(json.dumps({'pid': os.getpid(), 'probe': os.environ.get('ZYGOTE_PROBE'), 'cwd': os.getcwd(),"
            " 'fds': sorted(int(f) for f in os.listdir('/proc/self/fd')), 'argv': sys.argv,"
            " 'line': sys.stdin.readline()}))\n")}, env, stderr_pipe=True)
    finally:
        os.chdir(Path(__file__).parent)
    assert child.stdin is not None
    child.stdin.write("hello\n")
    out, err = child.communicate(timeout=60)
    got = json.loads(out)
    assert child.returncode == 0, err
    assert got["pid"] == child.pid != os.getpid()
    assert got["probe"] == "x y" and got["cwd"] == str(tmp_path) and got["argv"] == ["-c"]
    assert got["fds"] == [0, 1, 2, 3]  # stdio, and the listing's own fd
    assert got["line"] == "hello\n"


@pytest.mark.parametrize(("code", "status"), [("raise SystemExit(7)", 7), ("import os; os.kill(os.getpid(), 9)",
                                                                            -signal.SIGKILL), ("1/0", 1)])
def test_a_child_ends_with_the_status_subprocess_would_report(zygote: Zygote, code: str, status: int) -> None:
    child = zygote.spawn({"kind": "code", "code": code}, clean_env(), stderr_pipe=True)
    _, err = child.communicate(timeout=60)
    assert child.returncode == status
    if status == 1:  # the traceback starts at the code, as `python -c` prints it
        assert err.splitlines()[1].strip() == 'File "<string>", line 1, in <module>', err


def test_a_child_is_killed_by_its_pidfd_and_reported(zygote: Zygote) -> None:
    child = zygote.spawn({"kind": "code", "code": "import sys; sys.stdin.readline()"}, clean_env())
    assert child.poll() is None
    child.kill()
    assert child.wait(60) == -signal.SIGKILL
    child.kill()  # once it is gone: nothing happens


def test_children_of_the_tests_zygote_have_a_runtime_and_broker_connection_of_their_own() -> None:
    """run_child children come from the zygote here (the env fits) and each gets a private broker of its own."""
    assert zygote_for(dict(os.environ)) is not None
    code = "ok(acl.rt.set_device(0)); print('PID', os.getpid(), ok(acl.rt.get_mem_info(0))[1])"
    pids = {child_ok(code).split()[1] for _ in range(2)}
    assert len(pids) == 2
    assert run_child("import vmmshare._process as p; print(p._runtime)").stdout.strip() == "None"


def test_an_actor_from_the_zygote_serves_calls_and_dies_as_a_process() -> None:
    a = Actor(dict(os.environ))
    try:
        assert a.call("!pid") == a.pid
        _, ret = a.call("rt.malloc_physical", 2 << 20, {"handleType": 0, "allocationType": 0, "memAttr": 5,
                                                      "location": {"id": 0, "type": 1}, "reserve": 0}, 0)
        assert ret == 0, a.last_err
    finally:
        a.kill()
    assert a.proc.returncode == -signal.SIGKILL
