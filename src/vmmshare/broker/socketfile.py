"""The broker's socket file: made in a folder the broker owns, and given up when an idle broker leaves."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from ..config import check_socket_path
from . import system, wire
from .folder import FolderError, make_serving_folder, open_private


class InUse(RuntimeError):
    """Another broker answers on the path already."""


def bind_socket(path: Path, multi_user: bool) -> tuple[socket.socket, int]:
    """The listening socket at `path` (and its inode), made under a temporary name and renamed into place so no
    client sees it half set up, in a folder the broker owns; a dead socket there is replaced."""
    check_socket_path(path, "--socket")
    folder = path.parent
    tmp = folder / f".b{os.getpid():x}"
    check_socket_path(tmp, "--socket (its folder, for the broker's temporary name)")
    make_serving_folder(folder, multi_user)
    if system.answers(path):
        raise InUse(f"a broker already serves {path}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(tmp))
        os.chmod(tmp, 0o666 if multi_user else 0o600)
        wire.pass_credentials(sock)  # accepted sockets inherit it
        sock.listen(512)
        os.replace(tmp, path)
        sock.setblocking(False)
        return sock, path.stat().st_ino
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def retire_socket(path: Path, inode: int, listener: socket.socket) -> tuple[bool, str]:
    """Whether an idle broker may leave now, and why not (or how it left).

    Under the start lock, so no client is mid-way through starting a broker, the socket is renamed away so no new
    client can reach it; a client that connected just before is noticed in the accept queue, and then the broker
    stays. A broker whose socket or folder is gone (deleted, or replaced by another broker's) cannot be reached by
    anyone new: it leaves without the lock.
    """
    try:
        if path.stat().st_ino != inode:
            return True, " (its socket was replaced)"
    except FileNotFoundError:
        if not path.parent.is_dir():
            return True, " (its folder is gone)"
        return True, " (its socket is gone)"
    try:
        lock = open_private(path.parent / "broker.lock", os.O_RDWR)
    except FolderError as exc:
        return False, str(exc)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False, ""
        aside = path.with_name(f".retiring.{os.getpid()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return True, " (its socket is gone)"
        if wire.wait_readable(listener.fileno(), 0):  # a client got in before the rename: stay
            with contextlib.suppress(OSError):
                os.rename(aside, path)
            return False, ""
        with contextlib.suppress(OSError):
            aside.unlink()
        return True, ""
    finally:
        os.close(lock)
