"""The broker's socket file: made in a folder the broker owns, and given up when an idle broker leaves."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
from pathlib import Path

from ..config import ConfigError, check_socket_path
from ..sockets import packets
from ..sockets.folder import FolderError, _owner, check_serving_folder, make_serving_folder, open_private
from . import system


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
        packets.pass_credentials(sock)  # accepted sockets inherit it
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
    if inode == 0:  # passed by a service manager (passed_socket), which keeps it and starts the next broker
        return True, " (the service manager keeps its socket)"
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
        if packets.wait_readable(listener.fileno(), 0):  # a client got in before the rename: stay
            with contextlib.suppress(OSError):
                os.rename(aside, path)
            return False, ""
        with contextlib.suppress(OSError):
            aside.unlink()
        return True, ""
    finally:
        os.close(lock)


SD_LISTEN_FDS_START = 3  # the first fd a service manager passes (sd_listen_fds(3))


def passed_socket(path: Path, multi_user: bool = False) -> socket.socket | None:
    """The listening socket a service manager passed for `path` (systemd socket activation: LISTEN_PID is this
    process and LISTEN_FDS is 1), or None when none was passed. The variables are removed so children do not take
    the fd for theirs. A passed fd that is not a listening AF_UNIX SOCK_SEQPACKET socket bound to `path` is a
    configuration error (ConfigError), not something to serve on."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or "LISTEN_FDS" not in os.environ:
        return None
    count = os.environ.pop("LISTEN_FDS")
    for name in ("LISTEN_PID", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if count != "1":
        raise ConfigError(f"the service manager passed LISTEN_FDS={count!r} sockets; the broker takes exactly one "
                          "(one ListenSequentialPacket= line in the .socket unit)", "LISTEN_FDS")
    fd = SD_LISTEN_FDS_START
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigError(f"the passed fd {fd} is not a socket: {exc.strerror}", "LISTEN_FDS") from None
    try:
        bound = sock.getsockname()
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET or not listening:
            raise ConfigError(f"the passed fd {fd} is not a listening AF_UNIX SOCK_SEQPACKET socket: use "
                              "ListenSequentialPacket= in the .socket unit", "LISTEN_FDS")
        if os.fsdecode(bound) != str(path):
            raise ConfigError(f"the passed socket is bound to {os.fsdecode(bound)!r}, not to {str(path)!r}: give the "
                              "broker the same path with --socket or VMMSHARE_SOCKET", "LISTEN_FDS")
        _check_passed_path(path, multi_user)
        os.set_inheritable(fd, False)
        packets.pass_credentials(sock)  # the peers' credentials name them (accepted sockets inherit it)
        sock.setblocking(False)
        return sock
    except BaseException:
        sock.detach()  # the fd stays the service manager's to close; the broker exits on this error
        raise


def _check_passed_path(path: Path, multi_user: bool) -> None:
    """A passed socket is served only where the broker would bind one itself (SPEC §5): in a folder nobody else can
    replace it in, as a socket file of the broker's user or root. Elsewhere another user could swap the file for a
    socket of their own, and the clients the broker was meant to serve would talk to that one."""
    try:
        check_serving_folder(path.parent, multi_user)
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConfigError(f"the passed socket's file {path} (or its folder) is gone", "LISTEN_FDS") from None
    except FolderError as exc:
        raise ConfigError(f"the passed socket lies where the broker would not serve: {exc}", "LISTEN_FDS") from None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in (os.getuid(), 0):
        kind = "socket" if stat.S_ISSOCK(st.st_mode) else "file"
        raise ConfigError(f"{path} is not the passed socket's file (a {kind} of {_owner(st.st_uid)}): another user "
                          "may have replaced it", "LISTEN_FDS")
