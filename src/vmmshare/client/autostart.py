"""Reaching the node's broker: connect to it, or start the embedded default broker when none answers.

Nothing is sent to a broker before it is known to be the right one: its folder must be one that only this user,
root or VMMSHARE_BROKER_USER controls, and the process listening must run as one of them (SO_PEERCRED), so that a
socket another user put in the way never sees a request or a memfd (folder.py).

Starting is race-free: under a lock file next to the socket, so that many processes starting at once get one
broker. The broker tells its starter it serves over a pipe (``--ready-fd``); every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..config import ConfigError, check_socket_path, trusted_uids
from ..errors import IpcError, NoPermissionError
from ..sockets.folder import FolderError, check_client_folder, check_starting_folder, open_private
from ..sockets.packets import connect, peer_credentials, wait_readable

log = logging.getLogger("vmmshare.client")
START_TIMEOUT = 20.0
CONNECT_TIMEOUT = 10.0


def reach_broker(path: Path, start: bool) -> socket.socket:
    """A connection to the broker at `path`; when none answers, start one (with `start`) or raise IpcError."""
    sock = _try_connect(path)
    if sock is None:
        if not start:
            raise IpcError(f"no broker answers at {path}: start one with `vmmshare broker`")
        sock = start_broker(path)
    return sock


def _try_connect(path: Path) -> socket.socket | None:
    """A connection to the broker at `path`, checked to be a broker this user may trust; None when no broker
    listens there."""
    try:
        trusted = trusted_uids()
    except ConfigError as exc:
        raise IpcError(str(exc)) from None
    try:
        check_client_folder(path.parent, trusted)
        sock = connect(path, CONNECT_TIMEOUT)
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except FolderError as exc:
        raise NoPermissionError(str(exc)) from None
    except TimeoutError:
        raise IpcError(f"the broker at {path} does not take connections (stopped, or overloaded) "
                       f"within {CONNECT_TIMEOUT:.0f} s") from None
    except OSError as exc:
        raise IpcError(f"cannot reach the broker at {path}: {exc.strerror or exc}") from None
    pid, uid, _gid = peer_credentials(sock)
    if uid not in trusted:
        sock.close()
        raise NoPermissionError(
            f"the process listening at {path} (pid {pid}) runs as uid {uid}, not as you, root or "
            "VMMSHARE_BROKER_USER: it is not a broker to trust with your memory; nothing was sent to it")
    return sock


def start_broker(path: Path) -> socket.socket:
    """Start the embedded default broker (idle-exiting) unless another process just did; connect to it."""
    folder = path.parent
    try:
        check_socket_path(path, "VMMSHARE_SOCKET")
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)  # the socket's own folder only, never the ones above it
        check_starting_folder(folder)
        lock = open_private(folder / "broker.lock", os.O_RDWR)
    except (FolderError, ConfigError) as exc:
        raise NoPermissionError(str(exc)) from None
    except OSError as exc:
        raise IpcError(f"cannot prepare {folder} for the broker: {exc.strerror or exc}") from None
    try:
        _lock_within(lock, START_TIMEOUT, folder / "broker.lock")
        sock = _try_connect(path)  # somebody else may have started one while we waited
        if sock is not None:
            return sock
        _spawn(path)
        sock = _try_connect(path)
        if sock is None:
            raise IpcError(f"the broker started but does not answer at {path}")
        return sock
    finally:
        os.close(lock)


def _lock_within(fd: int, seconds: float, what: Path) -> None:
    """Take the start lock, waiting at most `seconds` for whoever holds it (flock itself has no timeout)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise IpcError(f"{what} stayed locked for {seconds:.0f} s: another process is stuck starting "
                               "the broker") from None
            time.sleep(0.005)


def _spawn(path: Path) -> None:
    rfd, wfd = os.pipe2(os.O_CLOEXEC)
    log_path = path.parent / "broker.log"
    # the broker writes its log lines to broker.log itself, rotating it at 1 MiB (broker.log.1 keeps the previous
    # MiB); its stdout and stderr are opened on the same file for anything said before logging is set up
    cmd = [sys.executable, "-m", "vmmshare.broker", "--socket", str(path), "--auto", "--ready-fd", str(wfd),
           "--log-file", str(log_path)]
    try:
        logfd = open_private(log_path, os.O_WRONLY | os.O_APPEND)
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logfd, stderr=logfd, pass_fds=(wfd,),
                start_new_session=True, close_fds=True,
            )
        finally:
            os.close(logfd)
    except FolderError as exc:
        os.close(rfd)
        os.close(wfd)
        raise NoPermissionError(str(exc)) from None
    except OSError as exc:
        os.close(rfd)
        os.close(wfd)
        raise IpcError(f"cannot start the broker ({' '.join(cmd)}): {exc.strerror or exc}") from None
    os.close(wfd)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not wait_readable(rfd, left):
                proc.kill()
                proc.wait()
                raise IpcError(f"the broker did not start within {START_TIMEOUT:.0f} s; see {log_path}")
            chunk = os.read(rfd, 64)
            if not chunk:
                code = proc.wait()
                raise IpcError(f"the broker exited ({code}) before serving {path}; see {log_path}")
            line += chunk
    finally:
        os.close(rfd)
    threading.Thread(target=proc.wait, daemon=True).start()  # reap it if it exits while we live
