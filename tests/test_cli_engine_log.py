"""The transfer engine's own log lines do not reach the user (issue: "WARNING: Logging before InitGoogleLogging()",
"E… Local segment descriptor not found" printed by `bench --fabric` and `stress fabric_faults`): vmmshare sets the
engine's own log threshold instead of sending fd 2 to /dev/null, so no other thread's stderr is lost meanwhile; a
user who sets MC_LOG_LEVEL gets the engine's lines, as the engine's documentation says.

Each case is a process of its own: the engine reads its settings once, when it is loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import require
from vmmshare.fabric.engine import missing

HANG_GUARD = 120  # seconds: a guard against a hang only, never part of an assertion
SCRIPT = """if True:
    import os, sys
    targets = []
    real = os.dup2
    os.dup2 = lambda a, b, *k: (targets.append(b), real(a, b, *k))[1]
    from vmmshare.errors import AclError
    from vmmshare.fabric.engine import Engine
    engine = Engine("127.0.0.1", timeout=2.0)   # the engine logs "Local segment descriptor not found" here
    try:
        engine.read("127.0.0.1:1", 0, 0, 16)    # and a refused connection here
    except AclError as exc:
        print("refused", exc.code, flush=True)
    os.write(2, b"vmmshare's own line\\n")
    print("fd 2 redirected", 2 in targets, flush=True)
    engine.close()
"""


def _run(**extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VMMSHARE_", "MC_", "GLOG_"))}
    env.update(extra)
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD)


@pytest.fixture(autouse=True)
def _engine() -> None:
    require(not missing(), missing() or "the transfer engine is missing")


def test_engine_lines_do_not_reach_the_user_and_fd_2_is_left_alone() -> None:
    out = _run()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["refused 507022", "fd 2 redirected False"], out.stdout
    assert out.stderr == "vmmshare's own line\n", out.stderr  # nothing of the engine's, ours intact


def test_a_user_who_sets_mc_log_level_sees_the_engine_lines() -> None:
    out = _run(MC_LOG_LEVEL="ERROR")
    assert out.returncode == 0, out.stderr
    assert "Local segment descriptor not found" in out.stderr, out.stderr
    assert "vmmshare's own line" in out.stderr


@pytest.mark.slow
def test_bench_fabric_shows_only_its_report() -> None:
    """`vmmshare bench --fabric` loads the engine as the broker does: its stderr is empty (no engine line), and a
    throughput size below the 2 MiB granule (1M) is carried by a 2 MiB allocation instead of failing the export."""
    from clirun import VMMSHARE
    from fabric_cluster import cluster_problem

    require(not cluster_problem(), cluster_problem() or "no test cluster here")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VMMSHARE_", "MC_", "GLOG_"))}
    out = subprocess.run([*VMMSHARE, "bench", "--fabric", "--latency-reps", "20", "--sizes", "1M", "--reps", "2"],
                         env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr == "", out.stderr
    assert "read 1 MiB" in out.stdout and "4 KiB read latency" in out.stdout
