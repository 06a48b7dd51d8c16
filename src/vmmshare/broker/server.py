"""The broker daemon: one process per node that holds every exported memfd and enforces the sharing rules.

It is a single-threaded event loop over an AF_UNIX SOCK_SEQPACKET socket. Peers are identified by the
kernel (SO_PEERCRED, plus a pidfd where offered), never by what a message claims. When a client's
connection closes, everything it held is released and its exports are revoked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import itertools
import json
import logging
import os
import resource
import secrets
import selectors
import signal
import socket
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import constants as C
from .. import protocol as P
from ..config import Config
from ..handles import FLAG_NO_PID_VALIDATION, MAX_TRUSTLIST, FabricHandle, default_bytes
from ..protocol import MAX_BODY, MAX_FRAME, ProtocolError, decode, encode, peek_request_id
from .wire import (
    DONTWAIT,
    Identity,
    close_fds,
    connect,
    identity_of_pid,
    identity_of_pidfd,
    peer_credentials,
    peer_pidfd,
    recv_packet,
    same_process,
    send_packet,
    wait_readable,
)

log = logging.getLogger("vmmshare.broker")
MAX_GPUS = 1024  # GPU ids the broker accepts for GPU charges (it cannot see the GPUs)
LIST_PAGE = 100
KIND_HOST, KIND_GPU = 0, 1
LIST_IMPORTERS = 1000  # importers listed per export (importer_count has them all)
SPIN_SECONDS = float(os.environ.get("VMMSHARE_BROKER_SPIN_US", "200")) / 1e6


class BrokerError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)
class Conn:
    sock: socket.socket
    pid: int
    uid: int
    identity: Identity
    pidfd: int
    holds: set[int] = field(default_factory=set)


@dataclass(eq=False)
class Alloc:
    device: int
    size: int
    holds: int = 0
    export: Export | None = None  # set once exported
    kind: int = KIND_HOST  # a sealed memfd, counted against the capacity; or KIND_GPU, which the driver caps


@dataclass(eq=False)
class Export:
    handle: int
    alloc: Alloc
    fd: int
    share_type: int
    flags: int
    prop: tuple[int, int, int, int, int]
    owner: Conn
    secret: bytes
    trust: dict[int, Identity] = field(default_factory=dict)
    importers: dict[int, Conn] = field(default_factory=dict)  # token -> importer


@dataclass(eq=False)
class Hold:
    conn: Conn
    alloc: Alloc


class Broker:
    """The node's sharing authority: capacity accounting, the table of shareable handles, trustlists."""

    def __init__(self, path: Path, config: Config, idle: float | None = None, multi_user: bool = False) -> None:
        self.path = path
        self.config = config
        self.idle = idle
        self.multi_user = multi_user
        self.used = [0] * config.devices  # host-backed device memory, per device (capped by device_memory)
        self.gpu_used: Counter[int] = Counter()  # GPU memory, per GPU (recorded only)
        self.holds: dict[int, Hold] = {}
        self.exports: dict[int, Export] = {}
        self.conns: dict[int, Conn] = {}
        self.listener: socket.socket | None = None
        self.sel = selectors.DefaultSelector()
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
            if self.idle is not None and not self.conns and not self.holds:
                timeout = max(0.0, self.idle_since + self.idle - time.monotonic())
            events = self.sel.select(timeout)
            while events:
                for key, _ in events:
                    try:
                        if key.data is _WAKE:
                            _drain(key.fileobj)  # type: ignore[arg-type]
                        elif key.data is None:
                            self._accept()
                        else:
                            self._readable(key.data)
                    except Exception:  # nothing one client does may take the node's broker down
                        log.exception("unexpected error in the broker loop")
                        if isinstance(key.data, Conn):
                            self._drop(key.data)
                events = self._poll_briefly()
            idle = self.idle is not None and not self.conns and not self.holds
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
            conn = Conn(sock, pid, uid, identity, pidfd)
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
        try:
            if truncated:
                raise ProtocolError(f"frame larger than {MAX_FRAME} bytes, or too many fds")
            req, message = decode(data, len(fds))
            answer, reply_fds = self.handle(conn, message, fds)
            fds = []  # handled: ownership of any received fd moved on
            reply = encode(answer, req)
        except ProtocolError as exc:
            log.info("protocol error from pid %d: %s", conn.pid, exc)
            reply = encode(P.Error(C.ACL_ERROR_RT_IPC_ERROR, f"protocol error: {exc}"), peek_request_id(data))
            reply_fds = ()
        except BrokerError as exc:
            reply, reply_fds = encode(P.Error(exc.code, exc.message), peek_request_id(data)), ()
        except Exception as exc:  # a bug must not take the node's broker down
            log.exception("internal error serving pid %d", conn.pid)
            reply = encode(P.Error(C.ACL_ERROR_RT_INTERNAL_ERROR, f"broker: {exc!r}"), peek_request_id(data))
            reply_fds = ()
        finally:
            close_fds(fds)
        try:
            send_packet(conn.sock, reply, reply_fds)
        except OSError:
            self._drop(conn)

    def _drop(self, conn: Conn) -> None:
        """A client left (or died): release all it held and revoke its exports."""
        if self.conns.pop(conn.sock.fileno(), None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        for token in list(conn.holds):
            self._release(conn, token)
        conn.sock.close()
        if conn.pidfd >= 0:
            os.close(conn.pidfd)
        if not self.conns:
            self.idle_since = time.monotonic()
        log.debug("pid %d disconnected", conn.pid)

    # ------------------------------------------------------------ requests

    def handle(self, conn: Conn, m: P.Message, fds: list[int]) -> tuple[P.Message, tuple[int, ...]]:
        """Serve one request; returns the reply and the fds to send with it."""
        if isinstance(m, P.Charge):
            return P.Token(self.charge(conn, m.device, m.size)), ()
        if isinstance(m, P.ChargeGpu):
            return P.Token(self.charge_gpu(conn, m.device, m.size)), ()
        if isinstance(m, P.Release):
            self._release(conn, m.hold, strict=True)
            return P.Ok(), ()
        if isinstance(m, P.MemInfo):
            device = self._device(m.device)
            total = self.config.device_memory
            return P.Mem(total - self.used[device], total), ()
        if isinstance(m, P.Export):
            fd = fds.pop()
            try:
                shareable = self.export(conn, m, fd)
            except BaseException:
                os.close(fd)
                raise
            return P.Exported(shareable), ()
        if isinstance(m, P.Revoke):
            alloc = self._own(conn, m.hold).alloc
            if alloc.export is not None and m.hold in alloc.export.importers:
                raise BrokerError(C.ACL_ERROR_RT_NO_PERMISSION, "only the exporter can revoke its handle")
            self.revoke(alloc)
            return P.Ok(), ()
        if isinstance(m, P.SetPids):
            self.set_pids(conn, m.shareable, m.share_type, m.pids)
            return P.Ok(), ()
        if isinstance(m, P.Import):
            token, exp = self.import_(conn, m.shareable, m.share_type, m.secret)
            return P.Imported(token, exp.alloc.size, exp.alloc.kind, *exp.prop), (exp.fd,)
        if isinstance(m, P.BareTgid):
            return P.Pid(conn.pid), ()
        if isinstance(m, P.List):
            return P.Listing(self.listing(m.offset, conn)), ()
        raise ProtocolError(f"{m.TYPE.name} is a reply, not a request")

    def _device(self, device: int) -> int:
        if not 0 <= device < self.config.devices:
            raise BrokerError(C.ACL_ERROR_RT_INVALID_DEVICEID, f"device {device} does not exist on this node")
        return device

    def _new_token(self) -> int:
        while True:
            token = secrets.randbits(63) | 1
            if token not in self.holds:
                return token

    def charge(self, conn: Conn, device: int, size: int) -> int:
        if device != -1:
            self._device(device)
            free = self.config.device_memory - self.used[device]
            if size > free:
                raise BrokerError(
                    C.ACL_ERROR_RT_MEMORY_ALLOCATION,
                    f"device {device} has {free} of {self.config.device_memory} bytes free on this node; "
                    f"{size} bytes do not fit (free memory, or raise VMMSHARE_DEVICE_MEMORY)",
                )
            self.used[device] += size
        return self._hold_new(conn, Alloc(device, size, holds=1))

    def charge_gpu(self, conn: Conn, device: int, size: int) -> int:
        """Record GPU memory (a CUDA-backend allocation): the GPU's own capacity applies, not this node's."""
        if device >= MAX_GPUS:
            raise BrokerError(C.ACL_ERROR_RT_INVALID_DEVICEID, f"GPU {device} is beyond {MAX_GPUS} GPUs")
        self.gpu_used[device] += size
        return self._hold_new(conn, Alloc(device, size, holds=1, kind=KIND_GPU))

    def _hold_new(self, conn: Conn, alloc: Alloc) -> int:
        token = self._new_token()
        self.holds[token] = Hold(conn, alloc)
        conn.holds.add(token)
        return token

    def _own(self, conn: Conn, token: int) -> Hold:
        hold = self.holds.get(token)
        if hold is None or hold.conn is not conn:
            raise BrokerError(C.ACL_ERROR_RT_INVALID_HANDLE, "unknown allocation token for this connection")
        return hold

    def _release(self, conn: Conn, token: int, strict: bool = False) -> None:
        if strict:
            self._own(conn, token)
        hold = self.holds.pop(token)
        conn.holds.discard(token)
        alloc = hold.alloc
        exp = alloc.export
        if exp is not None:
            if exp.owner is conn and token not in exp.importers:
                self.revoke(alloc)
            exp.importers.pop(token, None)
        alloc.holds -= 1
        if alloc.holds == 0:
            if alloc.kind == KIND_GPU:
                self.gpu_used[alloc.device] -= alloc.size
            elif alloc.device != -1:
                self.used[alloc.device] -= alloc.size

    def revoke(self, alloc: Alloc) -> None:
        """The exporter freed the allocation (or died): no new imports; importers keep what they hold."""
        exp = alloc.export
        if exp is None or exp.fd < 0:
            return
        self.exports.pop(exp.handle, None)
        os.close(exp.fd)
        exp.fd = -1
        log.debug("handle %#x revoked", exp.handle)

    def export(self, conn: Conn, m: P.Export, fd: int) -> bytes:
        token, size, flags, share_type, server_id, kind = m.hold, m.size, m.flags, m.share_type, m.server_id, \
            m.memory_kind
        prop = (m.handle_type, m.allocation_type, m.mem_attr, m.location_type, m.location_id)
        hold = self._own(conn, token)
        alloc = hold.alloc
        if alloc.export is not None:
            raise BrokerError(C.ACL_ERROR_RT_PARAM_INVALID, "this allocation was exported already")
        if flags not in (0, 1) or share_type not in (1, 2) or kind != alloc.kind:
            raise BrokerError(C.ACL_ERROR_RT_PARAM_INVALID, f"bad export flags {flags} or share type {share_type}, or "
                              f"memory kind {kind} for an allocation charged as kind {alloc.kind}")
        st = os.fstat(fd)
        if size != alloc.size or (kind == KIND_HOST and (not stat.S_ISREG(st.st_mode) or st.st_size != size)):
            raise BrokerError(C.ACL_ERROR_RT_PARAM_INVALID, "the attached fd is not the allocation's memory")
        trust = self._bind(m.pids, {})
        handle = secrets.randbits(64)
        while handle == 0 or handle in self.exports:
            handle = secrets.randbits(64)
        secret = secrets.token_bytes(32) if share_type == C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC else bytes(32)
        if share_type == C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC:
            shareable = FabricHandle(server_id, max(alloc.device, 0), handle, size, secret,
                                     FLAG_NO_PID_VALIDATION if flags else 0).pack()
        else:
            shareable = default_bytes(handle)
        exp = Export(handle, alloc, fd, share_type, flags, (prop[0], prop[1], prop[2], prop[3], prop[4]), conn,
                     secret, trust)
        alloc.export = exp
        self.exports[handle] = exp
        log.debug("pid %d exported %#x (%d bytes, share type %d, flags %d)", conn.pid, handle, size, share_type, flags)
        return shareable

    def _export_of(self, handle: int, share_type: int) -> Export:
        exp = self.exports.get(handle)
        if exp is None:
            raise BrokerError(
                C.ACL_ERROR_RT_INVALID_HANDLE,
                f"shareable handle {handle:#x} is unknown on this node, or revoked (its exporter freed it or exited)",
            )
        if exp.share_type != share_type:
            raise BrokerError(
                C.ACL_ERROR_RT_PARAM_INVALID,
                f"shareable handle {handle:#x} was exported with share type {exp.share_type}, not {share_type}",
            )
        return exp

    def set_pids(self, conn: Conn, handle: int, share_type: int, pids: tuple[int, ...]) -> None:
        exp = self._export_of(handle, share_type)
        if exp.owner is not conn:
            raise BrokerError(
                C.ACL_ERROR_RT_NO_PERMISSION,
                f"only the exporting process (pid {exp.owner.pid}) may set the trustlist of {handle:#x}",
            )
        exp.trust = self._bind(pids, exp.trust)

    def _bind(self, pids: tuple[int, ...], trust: dict[int, Identity]) -> dict[int, Identity]:
        """`trust` plus `pids`, each bound to the start time of the process that has it now (pid reuse)."""
        if any(p <= 0 or p > 0x7FFFFFFF for p in pids):
            raise BrokerError(C.ACL_ERROR_RT_PARAM_INVALID, "pids must be positive 32-bit ints")
        new = {p for p in pids if p not in trust}
        if len(trust) + len(new) > MAX_TRUSTLIST:
            raise BrokerError(C.ACL_ERROR_RT_PARAM_INVALID, f"a trustlist holds at most {MAX_TRUSTLIST} pids")
        return {**trust, **{pid: identity_of_pid(pid) for pid in pids}}

    def import_(self, conn: Conn, handle: int, share_type: int, secret: bytes) -> tuple[int, Export]:
        exp = self._export_of(handle, share_type)
        if share_type == C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC and not hmac.compare_digest(secret, exp.secret):
            raise BrokerError(C.ACL_ERROR_RT_INVALID_HANDLE, f"FABRIC handle {handle:#x} does not carry its secret")
        if conn.pid == exp.owner.pid:
            raise BrokerError(C.ACL_ERROR_RT_PARAM_INVALID, "the exporting process cannot import its own handle")
        if not exp.flags & C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION:
            if conn.pid not in exp.trust:
                raise BrokerError(
                    C.ACL_ERROR_RT_NO_PERMISSION,
                    f"process {conn.pid} is not on the trustlist of {handle:#x}: the exporter must add it with "
                    "mem_set_pid_to_shareable_handle(_v2)",
                )
            if not same_process(exp.trust[conn.pid], conn.identity):
                raise BrokerError(
                    C.ACL_ERROR_RT_NO_PERMISSION,
                    f"pid {conn.pid} was trustlisted for another process that had the same pid (pid reuse)",
                )
        token = self._hold_new(conn, exp.alloc)
        exp.alloc.holds += 1
        exp.importers[token] = conn
        log.debug("pid %d imported %#x", conn.pid, handle)
        return token, exp

    def listing(self, offset: int, viewer: Conn) -> str:
        """One page of `vmmshare ls` as JSON, starting at export number `offset`; pages fit in one frame.

        Handle values are shown in full only to the exporter's user (and root): on a multi-user node a
        handle exported without pid validation must not be handed to every user who can list.
        """
        total = len(self.exports)
        page = itertools.islice(self.exports.values(), offset, None)  # not a copy of every export for each page
        used = {str(d): u for d, u in enumerate(self.used) if u}
        gpu_used = {str(d): u for d, u in sorted(self.gpu_used.items()) if u}
        head = {"broker_pid": os.getpid(), "used": used, "capacity": self.config.device_memory,
                "gpu_used": gpu_used, "clients": len(self.conns)}
        rows: list[str] = []
        budget = MAX_BODY - len(json.dumps(head)) - 128
        at = offset
        for exp in page:
            if len(rows) >= LIST_PAGE:
                break
            importers = sorted(c.pid for c in exp.importers.values())
            row = json.dumps({
                "handle": f"{exp.handle:#018x}" if viewer.uid in (exp.owner.uid, 0) else "(hidden)",
                "share_type": "fabric" if exp.share_type == C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC else "default",
                "device": exp.alloc.device,
                "gpu": exp.alloc.kind == KIND_GPU,
                "size": exp.alloc.size,
                "owner_pid": exp.owner.pid,
                "pid_validation": not exp.flags & 1,
                "trustlist": sorted(exp.trust),
                "importers": importers[:LIST_IMPORTERS],
                "importer_count": len(importers),
            })
            if rows and budget - len(row) - 1 < 0:
                break
            budget -= len(row) + 1
            rows.append(row)
            at += 1
        head["next"] = at if at < total else None
        return json.dumps(head)[:-1] + ', "exports": [' + ",".join(rows) + "]}"


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
    except (OSError, RuntimeError) as exc:
        log.error("cannot serve %s: %s", broker.path, exc)
        return 1 if not isinstance(exc, OSError) or exc.errno != errno.EADDRINUSE else 2
    broker.serve(ready_fd)
    return 0
