"""Both ends spin for a reply or a request only while a core is free for it (sockets/spinning.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from vmmshare.sockets import spinning
from vmmshare.sockets.spinning import spin


@pytest.fixture(autouse=True)
def calm(monkeypatch: pytest.MonkeyPatch) -> None:
    """No back-off left over from an earlier spin of this process."""
    monkeypatch.setattr(spinning, "_calm_after", -math.inf)


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
