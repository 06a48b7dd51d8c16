"""What the broker asks of the system outside its loop's sockets: the seals of an exported memfd, its open-file
limit, a spare fd for clients it must refuse when out of fds, and giving freed memory back."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import resource
import socket
import stat
from pathlib import Path

from ..sockets import packets
from ..wire import local as P
from ..wire.local import encode

FD_RESERVE = 64  # file descriptors kept back from clients: the listener, the selector, lookups, the log
_LIBC = ctypes.CDLL(None)


def memfd_info(fd: int) -> tuple[int, int] | None:
    """(size, seals) of the regular file at `fd` (seals -1: a file that takes no seals, so not a memfd); None for
    anything else (a pipe, a socket), and for a file not open read-write (importers map it read-write)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        return None
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = -1
    return st.st_size, seals


def refuse(sock: socket.socket, code: int, why: str) -> None:
    """Tell a connection the broker will not serve it (an ERROR addressed to request 0), and close it."""
    with contextlib.suppress(OSError):
        sock.send(encode(P.Error(code, why), 0), packets.DONTWAIT)
    sock.close()


def trim_memory() -> None:
    """Return freed heap memory to the system (glibc's malloc_trim; nothing elsewhere)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def spare_fd() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def drain(sock: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError):
        while sock.recv(512):
            pass


def answers(path: Path) -> bool:
    """Whether a broker listens at `path` (one whose queue is full counts: it is there, only stuck)."""
    try:
        packets.connect(path, 2.0).close()
    except TimeoutError:
        return True
    except OSError:
        return False
    return True


def fd_budget() -> int:
    """The fds the broker may hold for its clients: its open-file limit (raised to the hard limit), less a reserve."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return max(0, soft - FD_RESERVE - len(os.listdir("/proc/self/fd")))
