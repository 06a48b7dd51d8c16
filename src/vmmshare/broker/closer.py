"""Letting go of the fds clients hand the broker, without ever blocking its event loop.

A client may attach any fd to a request, and closing a socket can block: the last close of a TCP socket with
SO_LINGER set waits up to the linger time for its unsent data. The broker turns lingering off on a socket it lets
go of (a setsockopt, which does not block) and closes it on a thread of its own; a close that blocks all the same
(the client set lingering again through another copy of the socket before letting that go) holds up only the sockets
queued behind it there. Every other fd (memfds, pipes, files) is closed at once, as before.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import struct
import threading
from collections.abc import Iterable

_LINGER_OFF = struct.pack("ii", 0, 0)


class Closer:
    """Closes client fds: sockets on a thread of its own, the rest at once."""

    def __init__(self) -> None:
        self._sockets: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def close(self, fd: int) -> None:
        """Let go of a client's fd (negative: nothing)."""
        if fd < 0:
            return
        if not _unlinger(fd):
            with contextlib.suppress(OSError):
                os.close(fd)
            return
        if self._thread is None:  # only the event loop's thread calls this
            self._thread = threading.Thread(target=self._run, name="vmmshare-closer", daemon=True)
            self._thread.start()
        self._sockets.put(fd)

    def close_all(self, fds: Iterable[int]) -> None:
        for fd in fds:
            self.close(fd)

    def _run(self) -> None:
        while True:
            fd = self._sockets.get()
            with contextlib.suppress(OSError):
                os.close(fd)


def _unlinger(fd: int) -> bool:
    """Whether `fd` is a socket; if so, with SO_LINGER turned off, so that closing it need not wait."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_OFF)
    except OSError:
        pass
    finally:
        sock.detach()
    return True
