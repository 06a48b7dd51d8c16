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
    monkeypatch.setattr(spinning, "BACK_OFF_RATIO", 1e6)
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
        queue = spinning.RunQueue()  # the broker's reading says so too
        try:
            assert not queue.cores_free()
        finally:
            queue.close()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


class _Clock:
    """perf_counter() for spinning.py that moves only when a yield gives the core away for `away` seconds."""

    def __init__(self, away: float) -> None:
        self.now = 100.0
        self.away = away

    def perf_counter(self) -> float:
        return self.now

    def sched_yield(self) -> None:
        self.now += self.away


@pytest.mark.parametrize(("away", "back_off"), [(100e-6, 200e-6), (3e-3, 6e-3), (0.5, spinning.BACK_OFF)])
def test_the_back_off_lasts_about_as_long_as_the_core_was_given_away(
        monkeypatch: pytest.MonkeyPatch, away: float, back_off: float) -> None:
    """A task that took the core for a moment (a process handed a message) holds the spins off for
    BACK_OFF_RATIO times that moment, not for the whole BACK_OFF that a task holding the core for its slices
    earns: the next requests still poll."""
    clock = _Clock(away)
    monkeypatch.setattr(spinning, "time", clock)
    monkeypatch.setattr(spinning.os, "sched_yield", clock.sched_yield)
    assert spin(lambda: None, 5.0) is None
    assert spinning._calm_after == pytest.approx(clock.now + back_off)
    clock.now += back_off * 0.99
    assert spin(lambda: pytest.fail("polled during the back-off"), 5.0) is None
    clock.now += back_off * 0.02
    assert spin(lambda: [1], 5.0) == [1]


def test_a_spin_asks_the_check_it_is_given_whether_a_core_is_free() -> None:
    """The broker's spins ask its own reading of the run queue (RunQueue), not the clients' one."""
    assert spin(lambda: pytest.fail("polled with every core taken"), 5.0, lambda: False) is None
    assert spin(lambda: [2], 0.001, lambda: True) == [2]


def test_a_run_queue_is_read_afresh_each_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RunQueue reads the count at the moment it is asked (no period): one passing wake-up does not stop the
    spins of the next milliseconds."""
    path = tmp_path / "loadavg"
    path.write_text(f"0.00 0.00 0.00 {spinning.CORES + 1}/300 1\n")
    monkeypatch.setattr(spinning, "LOADAVG", str(path))
    before = len(os.listdir("/proc/self/fd"))
    queue = spinning.RunQueue()
    try:
        assert not queue.cores_free()
        path.write_text(f"0.00 0.00 0.00 {spinning.CORES}/300 1\n")
        assert queue.cores_free()
        path.write_text(f"0.00 0.00 0.00 {spinning.CORES + 1}/300 1\n")
        assert not queue.cores_free()
        path.write_text("garbage\n")
        assert queue.cores_free()
    finally:
        queue.close()
        queue.close()  # twice is harmless
    assert len(os.listdir("/proc/self/fd")) == before
    assert queue.cores_free()  # closed: as where it cannot be read


def test_a_run_queue_that_cannot_be_opened_says_the_cores_are_free(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spinning, "LOADAVG", str(tmp_path / "missing"))
    queue = spinning.RunQueue()
    assert queue.cores_free()
    queue.close()



@pytest.mark.parametrize("free", [True, False])
def test_the_broker_spins_after_serving_only_when_its_fresh_reading_finds_a_core_free(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: bool) -> None:
    """After a turn the broker looks once for more requests, then spins only if its own reading of the run queue,
    made then, finds a core free; with every core busy it goes back to sleep in the kernel after that one look."""
    from vmmshare.broker.server import Broker
    from vmmshare.config import Config

    broker = Broker(tmp_path / "s", Config.from_env(broker=True))
    try:
        looks: list[int] = []
        asked: list[int] = []

        class Queue:
            def cores_free(self) -> bool:
                asked.append(1)
                return free

            def close(self) -> None:
                pass

        monkeypatch.setattr(broker, "run_queue", Queue())
        monkeypatch.setattr(broker, "_poll_now", lambda: looks.append(1) or [])
        assert broker._poll_briefly() == []
        assert asked == [1]
        assert (len(looks) > 1) is free, f"{len(looks)} looks"
    finally:
        broker.close()


def test_a_client_skips_polling_after_a_miss_for_twice_as_long_each_miss_in_a_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's waiter: a miss skips the next 1, then 3, 7, 15 and at most 16 polls; a poll that finds its
    reply starts the count over, so one busy moment costs one request's poll and a busy machine one in 17."""
    from vmmshare.client import connection

    windows: list[float] = []
    outcomes: list[bool] = []  # each poll's `missed`, in turn

    def fake_call(sock: object, frame: bytes, spin: float, timeout: float) -> tuple[bytes, list[int], bool, bool]:
        windows.append(spin)
        return b"", [], False, outcomes.pop(0) if spin else False

    monkeypatch.setattr(connection.packets, "call", fake_call)
    waiter = connection._Waiter(1e-4)

    def polls_after(misses: int) -> list[int]:
        """Run requests until `misses` polls have missed, then one that finds its reply: the requests skipped
        between polls."""
        outcomes[:] = [True] * misses + [False]
        windows.clear()
        while outcomes:
            waiter.call(None, b"")  # type: ignore[arg-type]
        gaps, run = [], 0
        for w in windows:
            if w:
                gaps.append(run)
                run = 0
            else:
                run += 1
        return gaps[1:]

    assert polls_after(6) == [1, 3, 7, 15, 16, 16]  # doubling, then one poll in 17 requests while it keeps missing
    assert polls_after(1) == [1]  # after a poll that found its reply, the next miss skips one request only
    assert polls_after(2) == [1, 3]
    assert waiter.misses == 0  # (the last poll found its reply)
