"""Which process a pid names: a pid can be reused, so a trustlist entry is bound to one process's identity.

An identity is a process's start time (clock ticks since boot) or, on kernels with pidfs (Linux 6.9+), the
inode of a pidfd for it, which no other process ever gets.
"""

from __future__ import annotations

import errno
import functools
import os
import select
from collections.abc import Iterable

from ..books.records import Identity


def _pidfs_ino(fd: int) -> int:
    return os.fstat(fd).st_ino


def _pidfs_unique() -> bool:
    """Whether pidfds carry a per-process inode (pidfs, Linux 6.9+), so an inode names one process for good."""
    try:
        a, b = os.pidfd_open(os.getpid()), os.pidfd_open(os.getppid())
    except (OSError, AttributeError):
        return False
    try:
        return _pidfs_ino(a) != _pidfs_ino(b)
    finally:
        os.close(a)
        os.close(b)


PIDFS = _pidfs_unique()
CAN_PIN = hasattr(os, "pidfd_open")  # pidfd_open(2), Linux 5.3+ (a kernel without it: ENOSYS, see `pin`)
DEAD: Identity = (-1, None)  # the identity of a pinned process that exited before it could be named: nobody's
# pidfd_open's answers for a pid that no process has: none at all, a thread's id or a kernel thread's (ENOENT), one
# beyond the pid range (EINVAL)
_NO_PROCESS = (errno.ESRCH, errno.ENOENT, errno.EINVAL)
MAX_PID = 0x7FFFFFFF


def identity_of_pidfd(pid: int, pidfd: int) -> Identity:
    """Who a connected peer is: its start time and, on pidfs kernels, its pidfd's inode."""
    if PIDFS and pidfd >= 0:
        return None, _pidfs_ino(pidfd)
    return process_start_time(pid), None


def identity_of_pid(pid: int) -> Identity:
    """Who has `pid` right now ((None, None) when nobody does).

    Fails closed: any error but "no such process" (out of fds, out of memory) raises OSError, so that a trustlist
    entry is never left bound to nothing by accident.
    """
    if not PIDFS:
        return process_start_time(pid), None
    try:
        fd = os.pidfd_open(pid)  # first: the inode then names the process that has the pid now
    except OSError as exc:
        if exc.errno in _NO_PROCESS:
            return None, None
        raise
    try:
        return None, _pidfs_ino(fd)  # the inode alone decides (see same_process)
    finally:
        os.close(fd)


def pin(pid: int) -> int:
    """A pidfd for the process that has `pid` now (-1: no process has it), which keeps naming that process after
    it exits and its pid goes to another: what a trustlist entry is bound to is taken when the call is received,
    and named later (`identity_of_pinned`). Fails closed, as `identity_of_pid` does."""
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno in _NO_PROCESS:
            return -1
        raise


def pin_all(pids: Iterable[int], alive: set[int] | None) -> tuple[dict[int, int], tuple[int, OSError] | None]:
    """Pin every pid of a call at once, before anything else is done with it: pid -> a pidfd for the process that
    has it now, for each pid a process has (`alive`: the pids that have a process, from one snapshot of /proc,
    where known: the others need no system call). One `pidfd_open` a live pid, in a loop with nothing else in it,
    so that the time between reading a call and pinning its last pid is that of the system calls. On a failure
    other than "no such process" (out of fds) every pidfd taken is closed and the pid and its error are returned
    instead (fail closed)."""
    live = alive.intersection(pids) if alive is not None else [p for p in dict.fromkeys(pids) if 0 < p <= MAX_PID]
    fds: dict[int, int] = {}
    pidfd_open = os.pidfd_open
    pid = 0
    try:
        for pid in live:
            try:
                fds[pid] = pidfd_open(pid)
            except OSError as exc:
                if exc.errno not in _NO_PROCESS:
                    raise
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        return {}, (pid, exc)
    return fds, None


HIDING = {"2", "invisible", "4", "ptraceable"}  # hidepid= values under which /proc lists others' processes not


@functools.cache
def _proc_is_ours() -> bool:
    """Whether /proc shows every process of this process's own pid namespace: not another namespace's (a broker in
    a container may see the host's), and not only this user's (/proc mounted with hidepid=invisible, for a broker
    that is not root)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return False
        with open("/proc/self/mountinfo", "rb") as f:
            mounts = [line.split(b" - ", 1) for line in f.read().splitlines()]
    except OSError:
        return False
    options = [after.split()[2] for before, after in mounts if before.split()[4:5] == [b"/proc"] and after.split()[2:]]
    if not options:
        return False
    hidepid = [o.split(b"=", 1)[1].decode() for o in options[-1].split(b",") if o.startswith(b"hidepid=")]
    return not (hidepid and hidepid[0] in HIDING and os.geteuid() != 0)


def live_pids(wanted: int) -> set[int] | None:
    """The pids of every process now (a snapshot of /proc), where reading it costs less than looking `wanted` pids
    up one by one (fewer tasks on the system than that, /proc/loadavg says); None otherwise, or where /proc is not
    this pid namespace's. A pid outside the snapshot had no process when it was taken."""
    if not _proc_is_ours():
        return None
    try:
        with open("/proc/loadavg", "rb") as f:
            tasks = int(f.read().split()[3].split(b"/")[1])
        if tasks >= wanted:
            return None
        return {int(name) for name in os.listdir("/proc") if name.isdigit()}
    except (OSError, IndexError, ValueError):
        return None


def identity_of_pinned(pid: int, pidfd: int) -> Identity:
    """Who had `pid` when `pidfd` was pinned: its pidfs inode (good after it exited); without pidfs, its start time
    if it still runs (the pid is then still its), else DEAD, which no process matches."""
    if PIDFS:
        return None, _pidfs_ino(pidfd)
    start = process_start_time(pid)
    exited = bool(select.select([pidfd], [], [], 0)[0])  # checked after the read: the start time was its own
    return DEAD if start is None or exited else (start, None)



def process_start_time(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22), None if it is gone; any other
    failure to read it raises OSError."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        if not stat:  # the process went away while being read
            return None
        raise OSError(errno.EIO, f"/proc/{pid}/stat has no start time") from None
