"""Both ends spin for a reply or a request only while a core is free for it (sockets/spinning.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vmmshare.sockets import spinning
from vmmshare.sockets.spinning import spin


@pytest.fixture(autouse=True)
def calm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No back-off left over from an earlier spin of this process, and a run queue with a core free (whatever else
    runs on the machine now), unless a test says otherwise."""
    monkeypatch.setattr(spinning, "_calm_after", -math.inf)
    _loadavg(tmp_path, monkeypatch, "0.00 0.00 0.00 1/300 4242\n")


def test_what_the_poll_found_is_returned_at_once() -> None:
    calls: list[int] = []

    def ready() -> list[int]:
        calls.append(1)
        return [7]

    assert spin(ready, 0.001) == [7]
    assert len(calls) == 1


def test_a_window_of_zero_never_polls() -> None:
    """VMMSHARE_SPIN_US=0 and VMMSHARE_BROKER_SPIN_US=0: the wait blocks in the kernel at once."""
    assert spin(lambda: pytest.fail("polled"), 0.0) is None


def test_a_spin_gives_up_when_another_task_wants_its_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy process on this thread's only core: the first yield runs it, so the spin stops long before its
    window ends, and no spin starts during the back-off that follows (made long here, for a loaded machine)."""
    monkeypatch.setattr(spinning, "BACK_OFF", 3600.0)
    code = "import sys; sys.stdout.write('x'); sys.stdout.flush()\nwhile True: pass"
    cpu = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        os.sched_setaffinity(busy.pid, {cpu})
        assert busy.stdout is not None and busy.stdout.read(1) == b"x"  # it is in its loop
        os.sched_setaffinity(0, {cpu})
        assert spin(lambda: None, 5.0) is None
        assert spinning._calm_after > -math.inf, "the spin ran out its window: it did not see the core was wanted"
        assert spin(lambda: pytest.fail("polled during the back-off"), 5.0) is None
    finally:
        os.sched_setaffinity(0, saved)
        busy.kill()
        busy.wait()


def test_a_window_that_ends_without_an_answer_returns_none() -> None:
    polls: list[int] = []
    assert spin(lambda: polls.append(1), 0.0005) is None
    assert polls


def _loadavg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    path = tmp_path / "loadavg"
    path.write_text(text)
    monkeypatch.setattr(spinning, "LOADAVG", str(path))
    monkeypatch.setattr(spinning, "_looked_at", -math.inf)


def test_no_spin_starts_while_more_tasks_are_runnable_than_there_are_cores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task that yields to a busy one waits out its whole slice, and one that sleeps is woken ahead of it: so
    with every core taken the wait blocks at once, without a single poll."""
    _loadavg(tmp_path, monkeypatch, f"3.00 2.00 1.00 {spinning.CORES + 1}/300 4242\n")
    assert not spinning.cores_free()
    assert spin(lambda: pytest.fail("polled with every core taken"), 5.0) is None
    _loadavg(tmp_path, monkeypatch, f"0.00 0.00 0.00 {spinning.CORES}/300 4242\n")
    assert spinning.cores_free()
    assert spin(lambda: [1], 0.001) == [1]


def test_a_reading_of_the_run_queue_stands_for_its_period(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spinning, "LOAD_PERIOD", 3600.0)
    _loadavg(tmp_path, monkeypatch, f"0.00 0.00 0.00 {spinning.CORES + 5}/300 1\n")
    assert not spinning.cores_free()
    (tmp_path / "loadavg").write_text("0.00 0.00 0.00 1/300 1\n")
    assert not spinning.cores_free(), "read again within its period"
    monkeypatch.setattr(spinning, "_looked_at", -math.inf)
    assert spinning.cores_free()


@pytest.mark.parametrize("text", [None, "", "garbage", "0.1 0.2 0.3 x/y 1"])
def test_a_run_queue_that_cannot_be_read_leaves_the_yield_check_to_decide(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str | None) -> None:
    if text is None:
        monkeypatch.setattr(spinning, "LOADAVG", str(tmp_path / "missing"))
    else:
        _loadavg(tmp_path, monkeypatch, text)
    before = len(os.listdir("/proc/self/fd"))
    assert spinning.cores_free()
    assert len(os.listdir("/proc/self/fd")) == before  # nothing left open


def test_with_a_busy_task_on_every_core_the_run_queue_says_so() -> None:
    """The real kernel's count: one CPU hog per core, and this process, are more runnable tasks than cores."""
    spinning.LOADAVG = "/proc/loadavg"  # the fixture's fake is put back by monkeypatch's undo
    code = "import sys; sys.stdout.write('x'); sys.stdout.flush()\nwhile True: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(spinning.CORES)]
    try:
        for hog in hogs:
            assert hog.stdout is not None and hog.stdout.read(1) == b"x"  # in its loop
        spinning._looked_at = -math.inf
        assert not spinning.cores_free()
        assert spin(lambda: pytest.fail("polled with every core busy"), 5.0) is None
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
