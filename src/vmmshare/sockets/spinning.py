"""The brief spin both ends make before they sleep, made only while a core is free for it.

Both ends poll briefly before they block (the client for the broker's reply, the broker for the next request), since
on an idle machine a wake-up from sleep costs more than the other end takes to answer. On a busy one a spin takes the
core another task needs, and loses besides: a task that sleeps is woken ahead of the busy ones when its answer comes,
while one that yields waits for the busy task's whole slice (milliseconds). So no spin starts while more tasks are
runnable than the machine has cores: the kernel's count of running tasks, read from /proc/loadavg. A reading must be
of the moment a spin would start, not of one milliseconds old that caught a passing wake-up: the broker reads it
afresh before each spin (a `RunQueue`, which keeps a descriptor open), and so does the client's compiled call
(`packets.call`, when the reply is not there at once); the waits made in Python read it at most every LOAD_PERIOD
(`cores_free`, which leaves no descriptor open). A spin yields the core between polls, and a yield that lets
another task run (it takes longer than YIELD_SLICE to come back) is the sign that the core is wanted after all: the
spin gives up, and no spin starts in this process for BACK_OFF_RATIO times as long as the yield gave away, at most
BACK_OFF seconds, during which every wait blocks in the kernel at once. A task that took the core for its whole slice
(a CPU hog: milliseconds) stops the spins for BACK_OFF; one woken for a moment (tens of microseconds: a process
handed a message on a machine with few cores) for about as long again, not for the many requests after it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import TypeVar

YIELD_SLICE = 50e-6  # seconds: a sched_yield that takes longer than this ran another task on this core
BACK_OFF = 0.02  # seconds without a spin, at most, after one found its core wanted
BACK_OFF_RATIO = 2  # ... and at most this many times the time its yield gave away

LOAD_PERIOD = 0.01  # seconds one reading of the run queue stands for
LOADAVG = "/proc/loadavg"  # its fourth field: runnable tasks (this one included) / all tasks
CORES = os.cpu_count() or 1

T = TypeVar("T")
_calm_after = -math.inf  # no spin starts before this perf_counter() time
_looked_at = -math.inf  # when the run queue was last read
_free = True  # what it said then


def cores_free() -> bool:
    """Whether no more tasks were runnable than there are cores (this one included) when last looked, at most
    LOAD_PERIOD ago; True where the count cannot be read (the spin's own yield check still stands)."""
    global _looked_at, _free
    now = time.perf_counter()
    if now - _looked_at < LOAD_PERIOD:
        return _free
    _looked_at = now
    try:
        fd = os.open(LOADAVG, os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 128)
        finally:
            os.close(fd)
        _free = _free_of(text)
    except (OSError, ValueError, IndexError):
        _free = True
    return _free


def _free_of(text: bytes) -> bool:
    return int(text.split()[3].split(b"/")[0]) <= CORES


class RunQueue:
    """The kernel's count of runnable tasks, read afresh on each `cores_free` through a descriptor kept open (procfs
    writes the line again for each read at offset 0): about a microsecond a reading, against five for an open and a
    close. Where /proc/loadavg cannot be read it says True, as `cores_free` does."""

    def __init__(self) -> None:
        try:
            self._fd = os.open(LOADAVG, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1

    def cores_free(self) -> bool:
        """Whether no more tasks are runnable now than there are cores (this one included)."""
        if self._fd < 0:
            return True
        try:
            return _free_of(os.pread(self._fd, 128, 0))
        except (OSError, ValueError, IndexError):
            return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def spin(poll: Callable[[], T], seconds: float, free: Callable[[], bool] | None = None) -> T | None:
    """Call `poll` (which must not block) until it returns something true, for up to `seconds`, yielding the core
    between calls; what it returned, or None when the window ends or as soon as another task wants this core (then
    the caller blocks in the kernel instead, and so do the waits of the next BACK_OFF seconds). No poll at all while
    every core has a task to run (`free`, by default `cores_free`)."""
    global _calm_after
    start = time.perf_counter()
    if seconds <= 0 or start < _calm_after or not (free or cores_free)():
        return None
    deadline = start + seconds
    while True:
        got = poll()
        if got:
            return got
        before = time.perf_counter()
        if before > deadline:
            return None
        os.sched_yield()  # let whoever is runnable here (the other end, on a machine with few cores) have the core
        after = time.perf_counter()
        if after - before > YIELD_SLICE:  # someone did: the core is wanted
            got = poll()
            if got:
                return got
            _calm_after = after + min(BACK_OFF, (after - before) * BACK_OFF_RATIO)
            return None
