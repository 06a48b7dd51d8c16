"""Packets to and from a broker by hand: the test side's own socket code, independent of `vmmshare.sockets.packets`
so that the suites can catch its bugs. Used by the raw clients of tests/test_broker_robustness.py and stress/."""

from __future__ import annotations

import array
import fcntl
import os
import socket
from pathlib import Path
from typing import Any

from vmmshare.wire.local import MAX_FRAME


def sealed_memfd(size: int, name: str = "vmmshare-test") -> int:
    """A memfd of `size` bytes sealed as the broker wants an export (its size fixed for good)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def send(sock: socket.socket, data: bytes, fds: tuple[int, ...] | list[int] = ()) -> bool:
    """Send one packet (with `fds` attached); False when the broker had closed the connection."""
    try:
        if fds:
            sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            sock.send(data)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def recv(sock: socket.socket) -> tuple[bytes | None, list[int], bool]:
    """(packet, fds, truncated) of the next packet; packet None when the broker closed the connection."""
    try:
        data, anc, flags, _ = sock.recvmsg(MAX_FRAME + 1, socket.CMSG_SPACE(4 * 8))  # room for more fds than
        # the broker may send, so that an extra one shows
    except ConnectionResetError:
        return None, [], False
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    if not data and not fds:
        return None, [], False
    return data, fds, bool(flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC))


class Connection:
    """One SOCK_SEQPACKET connection to the broker at `path`, closed on leaving a `with`; `timeout` (seconds) only
    guards against a hang. `req` numbers the requests the subclass sends."""

    def __init__(self, path: Path | str, timeout: float, req: int = 0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except BaseException:
            self.sock.close()
            raise
        self.req = req

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()
