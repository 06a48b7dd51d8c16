"""The brief spin both ends make before they sleep, made only while a core is free for it.

Both ends poll briefly before they block (the client for the broker's reply, the broker for the next request), since
on an idle machine a wake-up from sleep costs more than the other end takes to answer. On a busy one a spin takes the
core another task needs, and loses besides: a task that sleeps is woken ahead of the busy ones when its answer comes,
while one that yields waits for the busy task's whole slice (milliseconds). So no spin starts while more tasks are
runnable than the machine has cores (`cores_free`: the kernel's count of running tasks, read from /proc/loadavg at
most every LOAD_PERIOD, which leaves no descriptor open). A spin yields the core between polls, and a yield that lets
another task run (it takes longer than YIELD_SLICE to come back) is the sign that the core is wanted after all: the
spin gives up, and no spin starts in this process for BACK_OFF seconds, during which every wait blocks in the kernel
at once.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import TypeVar

YIELD_SLICE = 50e-6  # seconds: a sched_yield that takes longer than this ran another task on this core
BACK_OFF = 0.02  # seconds without a spin after one found its core wanted

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
        _free = int(text.split()[3].split(b"/")[0]) <= CORES
    except (OSError, ValueError, IndexError):
        _free = True
    return _free


def spin(poll: Callable[[], T], seconds: float) -> T | None:
    """Call `poll` (which must not block) until it returns something true, for up to `seconds`, yielding the core
    between calls; what it returned, or None when the window ends or as soon as another task wants this core (then
    the caller blocks in the kernel instead, and so do the waits of the next BACK_OFF seconds). No poll at all while
    every core has a task to run (`cores_free`)."""
    global _calm_after
    start = time.perf_counter()
    if seconds <= 0 or start < _calm_after or not cores_free():
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
        if time.perf_counter() - before > YIELD_SLICE:  # someone did: the core is wanted
            got = poll()
            if got:
                return got
            _calm_after = time.perf_counter() + BACK_OFF
            return None
