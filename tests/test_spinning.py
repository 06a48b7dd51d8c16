"""Both ends spin for a reply or a request only while a core is free for it (sockets/spinning.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from vmmshare.sockets import spinning


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No sample taken yet, so the next core_free() reads the kernel's count."""
    monkeypatch.setattr(spinning, "_sampled_at", -math.inf)
    return monkeypatch


def test_the_kernel_counts_this_process_among_the_runnable() -> None:
    running = spinning.runnable_tasks()
    assert running is not None and running >= 1


def test_no_spin_while_more_tasks_are_runnable_than_cores(fresh: pytest.MonkeyPatch) -> None:
    """Real busy processes, one more than this process's cores: every one of them is runnable, so no spin."""
    cores = len(os.sched_getaffinity(0))
    code = "import sys; sys.stdout.write('x'); sys.stdout.flush()\nwhile True: pass"
    busy = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(cores + 1)]
    try:
        for proc in busy:
            assert proc.stdout is not None and proc.stdout.read(1) == b"x"  # it is in its loop
        running = spinning.runnable_tasks()
        assert running is not None and running > cores
        assert spinning.core_free() is False
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("running", "free"), [(1, True), (None, False), (10_000, False)])
def test_the_decision_and_its_sample(fresh: pytest.MonkeyPatch, running: int | None, free: bool) -> None:
    """Spin when no more tasks are runnable than cores; never when the kernel does not say. A sample stands for
    SAMPLE_EVERY seconds: calls within it do not read the count again."""
    reads = []

    def count() -> int | None:
        reads.append(1)
        return running

    fresh.setattr(spinning, "runnable_tasks", count)
    fresh.setattr(spinning, "SAMPLE_EVERY", 3600.0)
    assert spinning.core_free() is free
    assert spinning.core_free() is free
    assert len(reads) == 1
    fresh.setattr(spinning, "SAMPLE_EVERY", 0.0)
    spinning.core_free()
    assert len(reads) == 2


def test_as_many_runnable_as_cores_still_spins(fresh: pytest.MonkeyPatch) -> None:
    """The spinner and the end it waits on, each on a core of its own: that is what the spin is for."""
    cores = len(os.sched_getaffinity(0))
    fresh.setattr(spinning, "runnable_tasks", lambda: cores)
    assert spinning.core_free() is True
    fresh.setattr(spinning, "_sampled_at", -math.inf)
    fresh.setattr(spinning, "runnable_tasks", lambda: cores + 1)
    assert spinning.core_free() is False
