"""The broker daemon: one process per node that holds every exported memfd and enforces the sharing rules.

It is a single-threaded event loop over an AF_UNIX SOCK_SEQPACKET socket. Peers are identified by the
kernel (SO_PEERCRED, plus a pidfd where offered), never by what a message claims. When a client's
connection closes, everything it held is released and its exports are revoked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import resource
import selectors
import signal
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .. import constants as C
from .. import protocol as P
from ..config import Config
from ..fabric.agent import Agent, FabricSetupError, endpoint_of
from ..protocol import MAX_FRAME, ProtocolError, decode, encode, peek_request_id
from .identity import identity_of_pid, identity_of_pidfd
from .ledger import Client, Ledger
from .wire import DONTWAIT, close_fds, connect, peer_credentials, peer_pidfd, recv_packet, send_packet, wait_readable

log = logging.getLogger("vmmshare.broker")
SPIN_SECONDS = float(os.environ.get("VMMSHARE_BROKER_SPIN_US", "200")) / 1e6


@dataclass(eq=False)
class Conn:
    """A connected client's socket and pidfd, and the ledger's record of it."""

    sock: socket.socket
    pidfd: int
    client: Client


def memfd_size(fd: int) -> int | None:
    """The size of the regular file (an exported memfd) at `fd`; None for anything else (a pipe, a socket)."""
    st = os.fstat(fd)
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class Broker:
    """The node's sharing authority on its socket: the event loop around the ledger (ledger.py), which keeps the
    books; this side accepts clients, names them by their kernel credentials, and passes fds."""

    def __init__(self, path: Path, config: Config, idle: float | None = None, multi_user: bool = False) -> None:
        self.path = path
        self.config = config
        self.idle = idle
        self.multi_user = multi_user
        self.ledger = Ledger(config.devices, config.device_memory, identify=identity_of_pid, close_fd=os.close,
                             memfd_size=memfd_size, broker_pid=os.getpid(), endpoint=endpoint_of(config))
        self.conns: dict[int, Conn] = {}
        self.listener: socket.socket | None = None
        self.sel = selectors.DefaultSelector()
        self.fabric = Agent(config, self.ledger, self.sel)  # the cross-server side (SPEC §8), on this loop
        self.idle_since = time.monotonic()
        self.stopping = False
        self.uid = os.getuid()

    # ------------------------------------------------------------ socket set-up

    def bind(self) -> None:
        """Create the socket folder and socket with the SPEC §5 permissions, replacing a dead socket."""
        folder = self.path.parent
        try:
            folder.mkdir(mode=0o700, parents=True)
            os.chmod(folder, 0o755 if self.multi_user else 0o700)  # ours: exactly SPEC §5's modes
        except FileExistsError:  # someone's folder (maybe /tmp): use it as it is, and say when it is loose
            st = folder.stat()
            loose = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
            if loose:
                log.warning("%s is writable by others without the sticky bit: they could replace the socket", folder)
        if _answers(self.path):
            raise RuntimeError(f"a broker already serves {self.path}")
        self.fabric.start()
        tmp = folder / f".broker.{os.getpid()}.sock"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.bind(str(tmp))
        os.chmod(tmp, 0o666 if self.multi_user else 0o600)
        sock.listen(512)
        os.replace(tmp, self.path)
        sock.setblocking(False)
        self.listener = sock
        self.inode = self.path.stat().st_ino
        self.sel.register(sock, selectors.EVENT_READ, None)
        log.info("broker %d serving %s (devices=%d, capacity=%d bytes each%s)", os.getpid(), self.path,
                 self.config.devices, self.config.device_memory, ", multi-user" if self.multi_user else "")

    # ------------------------------------------------------------ event loop

    def serve(self, ready_fd: int = -1) -> None:
        if self.listener is None:
            self.bind()
        _raise_fd_limit()
        if ready_fd >= 0:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        while not self.stopping:
            timeout = None
            if self.idle is not None and not self.conns and not self.ledger.holds:
                timeout = max(0.0, self.idle_since + self.idle - time.monotonic())
            fabric_wait = self.fabric.wait_time()
            if fabric_wait is not None:
                timeout = fabric_wait if timeout is None else min(timeout, fabric_wait)
            events = self.sel.select(timeout)
            self.fabric.tick()
            while events:
                for key, mask in events:
                    try:
                        if key.data is _WAKE:
                            _drain(key.fileobj)  # type: ignore[arg-type]
                        elif key.data is None:
                            self._accept()
                        elif isinstance(key.data, Conn):
                            self._readable(key.data)
                        else:
                            key.data(mask)  # a socket of the fabric agent
                    except Exception:  # nothing one client does may take the node's broker down
                        log.exception("unexpected error in the broker loop")
                        if isinstance(key.data, Conn):
                            self._drop(key.data)
                events = self._poll_briefly()
            idle = self.idle is not None and not self.conns and not self.ledger.holds
            if idle and time.monotonic() - self.idle_since >= (self.idle or 0) and self._retire():
                break
        self.close()

    def _poll_briefly(self) -> list[tuple[selectors.SelectorKey, int]]:
        """After serving, poll for a short while before sleeping: requests come in bursts, and a wake-up
        from sleep costs several times what serving a request does."""
        deadline = time.perf_counter() + SPIN_SECONDS
        while time.perf_counter() < deadline:
            events = self.sel.select(0)
            if events:
                return events
            os.sched_yield()  # clients preparing their next request may need this core
        return []

    def _retire(self) -> bool:
        """Leave after an idle spell, under the start lock so no client is mid-way through starting one.

        The socket is first renamed away, so no new client can reach it; a client that connected just
        before is noticed in the accept queue, and then the broker stays.
        """
        assert self.listener is not None
        lock = os.open(self.path.parent / "broker.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self.idle_since = time.monotonic()
                return False
            aside = self.path.with_name(f".retiring.{os.getpid()}")
            try:
                if self.path.stat().st_ino != self.inode:
                    raise FileNotFoundError  # someone replaced our socket: just leave
                os.rename(self.path, aside)
            except FileNotFoundError:
                pass
            if wait_readable(self.listener.fileno(), 0):  # a client got in before the rename: stay
                with contextlib.suppress(OSError):
                    os.rename(aside, self.path)
                self.idle_since = time.monotonic()
                return False
            log.info("broker %d idle for %.0f s with nothing held: exiting", os.getpid(), self.idle)
            with contextlib.suppress(OSError):
                aside.unlink()
            self.close()
            return True
        finally:
            os.close(lock)

    def close(self) -> None:
        self.fabric.close()
        if self.listener is not None:
            with contextlib.suppress(OSError):
                if self.path.stat().st_ino == self.inode:
                    self.path.unlink()
            self.sel.unregister(self.listener)
            self.listener.close()
            self.listener = None
        for conn in list(self.conns.values()):
            self._drop(conn)

    def stop(self, *_: object) -> None:
        self.stopping = True

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            sock.setblocking(False)
            pid, uid, _gid = peer_credentials(sock)
            if not self.multi_user and uid not in (self.uid, 0):
                log.warning("refused pid %d of uid %d: not this broker's user (start it with --multi-user)", pid, uid)
                sock.close()
                continue
            pidfd = peer_pidfd(sock)
            identity = identity_of_pidfd(pid, pidfd)
            if pidfd >= 0 and wait_readable(pidfd, 0):  # exited already: its pid may be reused
                os.close(pidfd)
                sock.close()
                continue
            conn = Conn(sock, pidfd, self.ledger.connect(pid, uid, identity))
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)
            log.debug("pid %d connected", pid)

    def _readable(self, conn: Conn) -> None:
        """Serve one packet of a readable connection (the selector reports it again if more are queued, so
        every client gets its turn)."""
        try:
            data, fds, truncated = recv_packet(conn.sock, DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data and not fds:
            self._drop(conn)
            return
        pid = conn.client.pid
        try:
            if truncated:
                raise ProtocolError(f"frame larger than {MAX_FRAME} bytes, or too many fds")
            req, request = decode(data, len(fds))
            if isinstance(request, P.RemoteImport):  # the fabric agent answers now, or later when the peer does
                later = self.fabric.local(conn.client, request, lambda m: self._answer_later(conn, req, m))
                if later is None:
                    return
                answer, fd = later, -1
            else:
                answer, fd = self.ledger.handle(conn.client, request, fds.pop() if fds else -1)  # the fd is its now
            reply, reply_fds = encode(answer, req), (fd,) if fd >= 0 else ()
        except ProtocolError as exc:
            log.info("protocol error from pid %d: %s", pid, exc)
            reply = encode(P.Error(C.ACL_ERROR_RT_IPC_ERROR, f"protocol error: {exc}"), peek_request_id(data))
            reply_fds = ()
        except Exception as exc:  # a bug must not take the node's broker down
            log.exception("internal error serving pid %d", pid)
            reply = encode(P.Error(C.ACL_ERROR_RT_INTERNAL_ERROR, f"broker: {exc!r}"), peek_request_id(data))
            reply_fds = ()
        finally:
            close_fds(fds)
        try:
            send_packet(conn.sock, reply, reply_fds)
        except OSError:
            self._drop(conn)

    def _answer_later(self, conn: Conn, req: int, message: P.Message) -> None:
        """A reply the fabric agent had to wait for, to a client still connected."""
        if self.conns.get(conn.sock.fileno()) is not conn:
            return
        try:
            send_packet(conn.sock, encode(message, req))
        except OSError:
            self._drop(conn)

    def _drop(self, conn: Conn) -> None:
        """A client left (or died): release all it held and revoke its exports."""
        if self.conns.pop(conn.sock.fileno(), None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        self.ledger.disconnect(conn.client)
        conn.sock.close()
        if conn.pidfd >= 0:
            os.close(conn.pidfd)
        if not self.conns:
            self.idle_since = time.monotonic()
        log.debug("pid %d disconnected", conn.client.pid)


_WAKE = object()


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError):
        while sock.recv(512):
            pass


def _answers(path: Path) -> bool:
    """Whether a broker listens at `path` (one whose queue is full counts: it is there, only stuck)."""
    try:
        connect(path, 2.0).close()
    except TimeoutError:
        return True
    except OSError:
        return False
    return True


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(path: Path | None = None, idle: float | None = None, multi_user: bool = False, ready_fd: int = -1,
        auto: bool = False) -> int:
    """Run a broker in this process until it is stopped (SIGTERM/SIGINT) or, with `idle`, goes idle. An auto-started
    broker (`auto`) lingers VMMSHARE_BROKER_IDLE seconds unless `idle` says otherwise."""
    try:
        config = Config.from_env()
    except ValueError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    if auto and idle is None:
        idle = config.broker_idle
    broker = Broker(path or config.socket_path, config, idle, multi_user)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)  # a signal wakes the event loop
    broker.sel.register(wake_r, selectors.EVENT_READ, _WAKE)
    signal.signal(signal.SIGTERM, broker.stop)
    signal.signal(signal.SIGINT, broker.stop)
    try:
        broker.bind()
    except FabricSetupError as exc:
        log.error("cannot serve %s: %s", broker.path, exc)
        broker.close()
        return 2
    except (OSError, RuntimeError) as exc:
        log.error("cannot serve %s: %s", broker.path, exc)
        return 1 if not isinstance(exc, OSError) or exc.errno != errno.EADDRINUSE else 2
    broker.serve(ready_fd)
    return 0
