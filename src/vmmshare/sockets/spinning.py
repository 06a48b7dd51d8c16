"""Whether a wait on a socket may spin: only while a core is free for it, else it blocks in the kernel at once.

Both ends poll briefly before they sleep (the client for the broker's reply, the broker for the next request), since
a wake-up from sleep costs more than the other end takes to answer, on an idle machine. On a busy one a spin takes the
core the other end needs: so a spin starts only while no more tasks are runnable, system-wide, than this process has
CPUs to run on (the spinner and the end it waits on, each on its own core, and nobody waiting for one). The count is
the kernel's own (the running field of /proc/loadavg, instantaneous, unlike the load averages), sampled at most once
every SAMPLE_EVERY seconds.
"""

from __future__ import annotations

import math
import os
import time

LOADAVG = "/proc/loadavg"  # "0.52 0.31 0.20 3/412 12345": the fourth field is runnable tasks / all tasks
SAMPLE_EVERY = 0.002  # seconds a sample stands for

_sampled_at = -math.inf  # no sample yet
_free = False


def runnable_tasks() -> int | None:
    """Tasks runnable on the whole machine right now (this one included); None when the kernel does not say."""
    try:
        fd = os.open(LOADAVG, os.O_RDONLY)
    except OSError:  # no /proc, or out of file descriptors: a reason not to spin, not an error
        return None
    try:
        text = os.read(fd, 128)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return int(text.split()[3].split(b"/")[0])
    except (IndexError, ValueError):
        return None


def core_free() -> bool:
    """Whether a spin now takes no core that a runnable task waits for: no more runnable tasks (this one and, likely,
    the end it waits on among them) than CPUs this process may use. False when it cannot tell: blocking is always
    correct."""
    global _sampled_at, _free
    now = time.perf_counter()
    if now - _sampled_at < SAMPLE_EVERY:
        return _free
    running = runnable_tasks()
    _free = running is not None and running <= len(os.sched_getaffinity(0))
    _sampled_at = now
    return _free
