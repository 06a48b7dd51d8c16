"""Packets over an AF_UNIX SOCK_SEQPACKET socket, with file descriptors passed by SCM_RIGHTS.

`recv_packet`, `recv_request`, `send_packet`, `call` (a request and its reply) and `wait` (a reply) run in C (the
`_fastpackets` extension) where it was built, and in pure Python where it was not, or once `use_pure(True)` was
called (the broker client and the broker do, from their Config, when VMMSHARE_PURE_PYTHON is set); both behave
alike, and both are tested. Call them as attributes of this module (`packets.recv_packet`), so that the choice applies.
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

from ..wire.local import MAX_FDS, MAX_FRAME
from . import spinning
from .spinning import spin as _spin

_ANC = socket.CMSG_SPACE(4 * (MAX_FDS + 4))  # room to notice (and close) fds nobody asked for
_CREDS = struct.Struct("iII")  # struct ucred: pid, uid, gid
_ANC_CREDS = _ANC + socket.CMSG_SPACE(_CREDS.size)
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_CUT = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
DONTWAIT = int(socket.MSG_DONTWAIT)
_SOL_SOCKET, _SCM_RIGHTS = int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS)
_SCM_CREDENTIALS = int(getattr(socket, "SCM_CREDENTIALS", 2))
_SO_PASSCRED = int(getattr(socket, "SO_PASSCRED", 16))


def pure_recv_packet(sock: socket.socket, flags: int = 0) -> tuple[bytes, list[int], bool]:
    """One packet, the fds that came with it (close-on-exec), and whether it was cut short.

    A packet larger than MAX_FRAME, or one whose fds did not fit, comes back truncated=True; the caller
    must close the fds. An empty packet with no fds means the peer closed the connection.
    """
    data, anc, msg_flags, _ = sock.recvmsg(MAX_FRAME + 1, _ANC, _CLOEXEC | flags)
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    truncated = bool(msg_flags & _CUT) or len(data) > MAX_FRAME
    return data, fds, truncated


def pass_credentials(sock: socket.socket) -> None:
    """Have the kernel stamp every packet that arrives on `sock` with its sender's pid, uid and gid (SO_PASSCRED:
    a sender cannot forge them without privilege); a socket accepted from a listener set so inherits it."""
    sock.setsockopt(_SOL_SOCKET, _SO_PASSCRED, 1)


def pure_recv_request(sock: socket.socket, flags: int = 0) -> tuple[bytes, list[int], bool, int]:
    """`recv_packet` on a socket with SO_PASSCRED, plus the pid of the process that sent the packet (-1 when the
    kernel attached no credentials)."""
    data, anc, msg_flags, _ = sock.recvmsg(MAX_FRAME + 1, _ANC_CREDS, _CLOEXEC | flags)
    fds: list[int] = []
    sender = -1
    for level, kind, payload in anc:
        if level != _SOL_SOCKET:
            continue
        if kind == _SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
        elif kind == _SCM_CREDENTIALS and len(payload) >= _CREDS.size:
            sender = _CREDS.unpack_from(payload)[0]
    truncated = bool(msg_flags & _CUT) or len(data) > MAX_FRAME
    return data, fds, truncated, sender


def pure_send_packet(sock: socket.socket, data: bytes, fds: tuple[int, ...] = ()) -> None:
    """Send one packet, with `fds` attached."""
    if fds:
        sock.sendmsg([data], [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def poller_now(poller: select.poll) -> Callable[[], list[tuple[int, int]]]:
    """What `poller` finds ready now, without waiting."""
    return lambda: poller.poll(0)


def pure_call(sock: socket.socket, data: bytes, spin: float, timeout: float) -> tuple[bytes, list[int], bool, bool]:
    """Send one packet without fds on a blocking socket and receive the packet that answers it (`recv_packet`'s
    three values), polling for up to `spin` seconds first while a core is free for it (spinning.py: the compiled
    call reads the run queue afresh each time, when the reply is not there at once), then waiting in poll(2) for up
    to `timeout` seconds (TimeoutError after); the fourth value says whether the poll ran and did not find the
    reply, so that the caller can stop polling for a while."""
    pure_send_packet(sock, data)
    return pure_wait(sock, spin, timeout)


def pure_wait(sock: socket.socket, spin: float, timeout: float) -> tuple[bytes, list[int], bool, bool]:
    """`call`'s second half, for a request sent otherwise (with fds, or with work done between): the packet that
    answers it, polled for and waited for as `call` does."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    ready = _spin(poller_now(poller), spin) if spin > 0 else None
    if ready:
        return (*pure_recv_packet(sock, DONTWAIT), False)
    if not poller.poll(timeout * 1000):
        raise TimeoutError(f"the broker did not answer within {timeout:.0f} s")
    return (*pure_recv_packet(sock, DONTWAIT), spin > 0)


# ---------------------------------------------------------------- the compiled fast path

try:
    from . import _fastpackets as _fast
except ImportError:  # not built: no compiler where it was installed
    _fast = None  # type: ignore[assignment]

FAST_AVAILABLE = _fast is not None

# The C functions go by the socket's own blocking mode, as the pure ones do on a socket without a timeout: the
# broker's sockets are non-blocking, the client's blocking, and none has a timeout.
if FAST_AVAILABLE:  # the same functions in C, called straight from the caller (no Python frame in between)
    _fast.configure(MAX_FRAME, MAX_FDS + 4)  # the room _ANC gives: the same packets come back truncated
    _fast.watch_load(spinning.LOADAVG, spinning.CORES)  # call's spins: the run queue it reads before each
    fast_recv_packet = _fast.recv
    fast_recv_request = _fast.recv_request
    fast_send_packet = _fast.send
    fast_call = _fast.call
    fast_wait = _fast.wait

FAST = FAST_AVAILABLE  # whether this process's packets go through C
recv_packet = fast_recv_packet if FAST else pure_recv_packet
recv_request = fast_recv_request if FAST else pure_recv_request
send_packet = fast_send_packet if FAST else pure_send_packet
call = fast_call if FAST else pure_call
wait = fast_wait if FAST else pure_wait


def use_pure(pure: bool) -> None:
    """Send and receive in pure Python (`pure`), or in C where the extension is built: for the whole process."""
    global FAST, recv_packet, recv_request, send_packet, call, wait
    FAST = FAST_AVAILABLE and not pure
    recv_packet = fast_recv_packet if FAST else pure_recv_packet
    recv_request = fast_recv_request if FAST else pure_recv_request
    send_packet = fast_send_packet if FAST else pure_send_packet
    call = fast_call if FAST else pure_call
    wait = fast_wait if FAST else pure_wait


def connect(path: Path | str, timeout: float) -> socket.socket:
    """A blocking SOCK_SEQPACKET connection to the broker at `path` (or OSError; TimeoutError after `timeout`).

    A blocking connect would wait forever on a broker that stopped accepting, once its listen queue is full. A
    non-blocking one to a Unix socket completes at once or fails with EAGAIN while the queue is full, so it is
    tried again until the queue has room or the time is up.
    """
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.connect(str(path))
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{path}: the listen queue stayed full for {timeout:g} s") from None
            time.sleep(pause)  # the queue has no wake-up to wait on: try again shortly
            pause = min(pause * 2, 0.05)
            continue
        except BaseException:
            sock.close()
            raise
        sock.setblocking(True)
        return sock


def wait_readable(fd: int, timeout: float | None) -> bool:
    """Whether `fd` becomes readable within `timeout` seconds (poll(2): any fd number, unlike select)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer as the kernel recorded them at connect time (SO_PEERCRED); uid and gid unsigned,
    as os.getuid() gives them, so an id of 2**31 or more compares equal to it."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    pid, uid, gid = _CREDS.unpack(raw)
    return int(pid), int(uid), int(gid)


SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def peer_pidfd(sock: socket.socket) -> int:
    """A pidfd for the peer process (Linux 6.5+), or -1 where the kernel does not offer one."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4)
    except OSError:
        return -1
    return int(array.array("i", raw)[0])
