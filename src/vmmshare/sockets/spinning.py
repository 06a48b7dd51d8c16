"""The brief spin both ends make before they sleep, made only while a core is free for it.

Both ends poll briefly before they block (the client for the broker's reply, the broker for the next request), since
on an idle machine a wake-up from sleep costs more than the other end takes to answer. On a busy one a spin takes the
core another task needs. So a spin yields the core between polls, and a yield that lets another task run (it takes
longer than YIELD_SLICE to come back) is the sign that the core is wanted: the spin gives up, and no spin starts in
this process for BACK_OFF seconds, during which every wait blocks in the kernel at once. It needs no file or system
call beyond the yield, so it costs nothing when the machine is idle and leaves no descriptor open in either end.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import TypeVar

YIELD_SLICE = 50e-6  # seconds: a sched_yield that takes longer than this ran another task on this core
BACK_OFF = 0.02  # seconds without a spin after one found its core wanted

T = TypeVar("T")
_calm_after = -math.inf  # no spin starts before this perf_counter() time


def spin(poll: Callable[[], T], seconds: float) -> T | None:
    """Call `poll` (which must not block) until it returns something true, for up to `seconds`, yielding the core
    between calls; what it returned, or None when the window ends or as soon as another task wants this core (then
    the caller blocks in the kernel instead, and so do the waits of the next BACK_OFF seconds)."""
    global _calm_after
    start = time.perf_counter()
    if seconds <= 0 or start < _calm_after:
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
