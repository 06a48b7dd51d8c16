"""The broker daemon: one process per node that holds every exported memfd and enforces the sharing rules.

It is a single-threaded event loop over an AF_UNIX SOCK_SEQPACKET socket. Peers are identified by the
kernel (SO_PEERCRED, plus a pidfd where offered), never by what a message claims, and every packet carries its
sender's pid (SO_PASSCRED), so a connection used by another process than the one that opened it is refused.
When a client's connection closes, or the process that opened it exits, everything it held is released and its
exports are revoked.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import logging
import os
import resource
import selectors
import socket
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import constants as C
from ..books.ledger import Client, Ledger, LedgerError
from ..config import Config, Quotas
from ..fabric.agent import Agent, endpoint_of
from ..sockets import packets
from ..sockets.poller import Poller
from ..sockets.spinning import RunQueue, spin
from ..wire import local as P
from ..wire.framing import KIND_AT
from ..wire.handles import MAX_TRUSTLIST
from ..wire.local import HEADER, LAYOUTS, MAX_FRAME, Msg, ProtocolError, decode, encode, peek_request_id
from ..wire.local import HOT_IMPORT as IMPORT
from ..wire.local import HOT_IMPORTED as IMPORTED
from ..wire.local import HOT_OK as OK
from ..wire.local import HOT_RELEASE as RELEASE
from . import system
from .closer import Closer
from .identity import CAN_PIN, PIDFS, identity_of_pid, identity_of_pidfd, live_pids
from .jobs import Job, Jobs, Pins
from .ratelog import RateLimitedLog
from .socketfile import bind_socket, retire_socket

log = logging.getLogger("vmmshare.broker")
WAKE = object()  # selector data of the socket a signal writes to (daemon.py): it wakes the loop
QUANTUM = 0.0005  # seconds of serving each user's requests gets per turn of the loop (the last one may overrun it)
REAP_AT_REFUSAL = 16  # ready connections of a user looked at for a closed one before it is refused another
INLINE_LOOKUPS = 64  # pids of one request looked up whole when it is received; more are pinned (jobs.py)
PIN_LIMIT = 8192  # pidfds pinned for requests in flight, all clients together
PIDS_AT = {int(kind): HEADER.size + LAYOUTS[kind].fixed.size for kind in (Msg.SET_PIDS, Msg.EXPORT)}  # their u32s
PINNED_FROM = min(PIDS_AT.values()) + 4 * INLINE_LOOKUPS  # a frame longer than this may carry more pids than that
LITTLE_ENDIAN = sys.byteorder == "little"  # the wire's u32s read in place
TRIM_AFTER = 16384  # trustlist entries released by clients that make the broker hand memory back


@dataclass(eq=False)
class Conn:
    """A connected client's socket and pidfd, and the ledger's record of it."""

    sock: socket.socket
    pidfd: int
    client: Client
    job: Job[Conn] | None = None  # a request waiting for its pid lookups (jobs.py)
    fd: int = field(init=False)  # the socket's fd, its key in Broker.conns (read once: fileno() is a call)

    def __post_init__(self) -> None:
        self.fd = self.sock.fileno()


class _Exit:
    """Selector data of a connection's pidfd: readable once the process that opened the connection exits."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn


class Broker:
    """The node's sharing authority on its socket: the event loop around the ledger (ledger.py), which keeps the
    books; this side accepts clients, names them by their kernel credentials, and passes fds."""

    def __init__(self, path: Path, config: Config, idle: float | None = None, multi_user: bool = False,
                 limits: Quotas | None = None) -> None:
        self.path = path
        self.config = config
        packets.use_pure(config.pure_python)
        self.idle = idle
        self.multi_user = multi_user
        self.closer = Closer()  # lets go of client fds; a lingering socket cannot block the loop (closer.py)
        self.ledger = Ledger(config.devices, config.device_memory, identify=identity_of_pid, close_fd=self.closer.close,
                             memfd_info=system.memfd_info, broker_pid=os.getpid(),
                             quotas=limits if limits is not None else config.quotas,
                             fd_budget=system.fd_budget(), endpoint=endpoint_of(config))
        self.conns: dict[int, Conn] = {}
        self.jobs: Jobs[Conn] = Jobs(self.closer.close)
        self.released = 0  # trustlist entries let go since the heap was last trimmed
        self.debt: dict[int, float] = {}  # uid -> seconds served past its quantum, paid back a quantum a turn
        self.vclock: dict[int, float] = {}  # uid -> virtual time of its processes (fair queuing among them)
        self.finish: dict[int, dict[int, float]] = {}  # uid -> pid -> when its last request ends in that time
        self.procs: Counter[tuple[int, int]] = Counter()  # (uid, pid) -> its connections
        self.listener: socket.socket | None = None
        self.sel = Poller()
        self._poll_now = functools.partial(self.sel.select, 0)  # what is ready now, without waiting
        self.fabric = Agent(config, self.ledger, self.sel)  # the cross-server side (SPEC §8), on this loop
        self.idle_since = time.monotonic()
        self.stopping = False
        self.uid = os.getuid()
        self.warn = RateLimitedLog(log)
        self.spare = system.spare_fd()  # given up to accept (and refuse) a client when the broker runs out of fds
        self.listen_paused_until = 0.0
        self.reaped = False  # whether `_drop_closed` looked in this turn of the loop
        self.run_queue = RunQueue()  # read afresh before each spin (sockets/spinning.py); opened last, as it can't fail

    # ------------------------------------------------------------ socket set-up

    def bind(self, passed: socket.socket | None = None) -> None:
        """Create the socket folder and socket with the SPEC §5 permissions (daemon.py), or take the one a service
        manager `passed` (inode 0: the broker never unlinks or renames a socket file it did not make), then the
        fabric side."""
        self.listener, self.inode = (passed, 0) if passed is not None else bind_socket(self.path, self.multi_user)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.fabric.start()
        log.info("broker %d serving %s (devices=%d, capacity=%d bytes each%s)", os.getpid(), self.path,
                 self.config.devices, self.config.device_memory, ", multi-user" if self.multi_user else "")

    # ------------------------------------------------------------ event loop

    def serve(self, ready_fd: int = -1) -> None:
        if self.listener is None:
            self.bind()
        if ready_fd >= 0:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        select, fabric, jobs, poll_briefly = self.sel.select, self.fabric, self.jobs.pending, self._poll_briefly
        while not self.stopping:
            events = select(self._timeout())
            fabric.tick()
            if self.listen_paused_until:
                self._resume_listening()
            while events or jobs:
                self._turn(events)
                events = select(0) if jobs else poll_briefly()
            if self.idle is not None and not self.conns and not self.ledger.holds \
                    and time.monotonic() - self.idle_since >= self.idle and self._retire():
                break
        self.close()

    def _turn(self, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        """One turn of the loop: the broker's own events, then each user's ready connections, one request each,
        until that user's QUANTUM of time is spent (docs/security.md, T9): a user with many connections, or costly
        requests, is served no longer in a turn than a user with one cheap request, and time past the quantum is
        paid back over the next turns. Among one user's processes, the one that has been served least (fair
        queuing on the time their requests took) goes first, so a process of the user gets its share of the
        user's time whatever its neighbour floods the broker with."""
        self.reaped = False  # `_drop_closed` has not looked in this turn
        if len(events) == 1 and not self.debt:
            conn = events[0][0].data
            if type(conn) is Conn:
                self._one(conn)
                return
        ready: dict[int, list[Conn]] = {}
        arrivals: list[tuple[selectors.SelectorKey, int]] = []  # accepted last: a connection closed first is gone
        for key, mask in events:
            data = key.data
            if type(data) is Conn:
                uid = data.client.uid
                waiting = ready.get(uid)
                if waiting is None:
                    ready[uid] = [data]
                else:
                    waiting.append(data)
            elif data is None:
                arrivals.append((key, mask))
            else:
                self._dispatch(key, mask)
        debt = self.debt
        if debt:
            for uid in [u for u in debt if u not in ready]:
                debt[uid] -= QUANTUM
                if debt[uid] <= 0:
                    del debt[uid]
        conns, clock, vclock, finishes = self.conns, time.perf_counter, self.vclock, self.finish
        readable, procs, users = self._readable, self.procs, self.ledger.usage.users
        for uid, queue in ready.items():
            credit = QUANTUM - debt.pop(uid, 0.0) if debt else QUANTUM
            if credit > 0:
                now = vclock.get(uid, 0.0)
                finish = finishes.get(uid)
                if finish is None:
                    finish = finishes[uid] = {}
                if len(queue) > 1:
                    queue.sort(key=lambda conn: max(finish.get(conn.client.pid, 0.0), now))
                for conn in queue:
                    if conns.get(conn.fd) is not conn:
                        continue  # it left during this turn
                    start = clock()
                    try:
                        readable(conn)
                    except Exception:  # nothing one client does may take the node's broker down
                        log.exception("unexpected error in the broker loop")
                        self._drop(conn)
                    spent = clock() - start
                    pid = conn.client.pid
                    if (uid, pid) in procs:  # not a process that left while served: _forget cleared its books
                        begun = finish.get(pid, 0.0)
                        if begun < now:
                            begun = now
                        finish[pid] = begun + spent
                        now = begun  # the later of the two: the user's virtual time moves on to this request's start
                    credit -= spent
                    if credit <= 0:
                        break
                if uid in users:  # nor a user whose last connection closed in this turn
                    vclock[uid] = now
            if credit < 0 and uid in users:
                debt[uid] = -credit
        for key, mask in arrivals:
            self._dispatch(key, mask)
        if self.jobs.pending:
            self._run_jobs()
        if self.listen_paused_until:
            self._resume_listening()

    def _one(self, conn: Conn) -> None:
        """`_turn` for the commonest turn, one ready connection and no user in debt: its one request, and the same
        accounting as `_turn` makes of it (the process's finish time, its user's virtual time and debt), without the
        queues."""
        if self.conns.get(conn.fd) is not conn:
            return  # it left since the select (the fabric's timers run in between)
        start = time.perf_counter()
        try:
            self._readable(conn)
        except Exception:  # nothing one client does may take the node's broker down
            log.exception("unexpected error in the broker loop")
            self._drop(conn)
        spent = time.perf_counter() - start
        client = conn.client
        uid = client.uid
        if uid in self.ledger.usage.users:  # not a user whose last connection closed while served: no books left
            begun = self.vclock.get(uid, 0.0)
            if (uid, client.pid) in self.procs:  # nor a process that did: _forget cleared its finish time
                finish = self.finish.get(uid)
                if finish is None:
                    finish = self.finish[uid] = {}
                before = finish.get(client.pid, 0.0)
                if begun < before:
                    begun = before
                finish[client.pid] = begun + spent
            self.vclock[uid] = begun
            if spent > QUANTUM:
                self.debt[uid] = spent - QUANTUM
        if self.jobs.pending:
            self._run_jobs()
        if self.listen_paused_until:
            self._resume_listening()

    def _timeout(self) -> float | None:
        timeout = None
        if self.idle is not None and not self.conns and not self.ledger.holds:
            timeout = max(0.0, self.idle_since + self.idle - time.monotonic())
        if self.listen_paused_until:
            paused = max(0.0, self.listen_paused_until - time.monotonic())
            timeout = paused if timeout is None else min(timeout, paused)
        fabric_wait = self.fabric.wait_time()
        if fabric_wait is not None:
            timeout = fabric_wait if timeout is None else min(timeout, fabric_wait)
        return timeout

    def _dispatch(self, key: selectors.SelectorKey, mask: int) -> None:
        try:
            if key.data is WAKE:
                system.drain(key.fileobj)  # type: ignore[arg-type]
            elif key.data is None:
                self._accept()
            elif isinstance(key.data, _Exit):
                self._drop(key.data.conn)  # the process that opened the connection exited
            elif isinstance(key.data, Conn):
                self._serve_conn(key.data)
            else:
                key.data(mask)  # a socket of the fabric agent
        except Exception:  # nothing one client does may take the node's broker down
            log.exception("unexpected error in the broker loop")

    def _serve_conn(self, conn: Conn) -> None:
        """A readable connection's next request; a bug met on the way drops that client, never the broker."""
        try:
            self._readable(conn)
        except Exception:  # nothing one client does may take the node's broker down
            log.exception("unexpected error in the broker loop")
            self._drop(conn)

    def _poll_briefly(self) -> list[tuple[selectors.SelectorKey, int]]:
        """After serving, poll for a short while before sleeping: requests come in bursts, and a wake-up
        from sleep costs several times what serving a request does. Not while another task wants the core (`spin`):
        the clients need the cores to send those requests."""
        poll_now = self._poll_now
        return poll_now() or spin(poll_now, self.config.broker_spin, self.run_queue.cores_free) or []

    def _retire(self) -> bool:
        """Leave after an idle spell, unless a client is on its way in (daemon.retire_socket)."""
        assert self.listener is not None
        leave, why = retire_socket(self.path, self.inode, self.listener)
        if not leave:
            if why:
                self.warn.log(logging.WARNING, "lock", "staying: %s", why)
            self.idle_since = time.monotonic()
            return False
        log.info("broker %d idle for %.0f s with nothing held: exiting%s", os.getpid(), self.idle, why)
        self.close()
        return True

    def close(self) -> None:
        self.fabric.close()
        self.run_queue.close()
        if self.listener is not None:
            with contextlib.suppress(OSError):
                if self.path.stat().st_ino == self.inode:
                    self.path.unlink()
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(self.listener)
            self.listener.close()
            self.listener = None
        for conn in list(self.conns.values()):
            self._drop(conn)

    def stop(self, *_: object) -> None:
        self.stopping = True

    # ------------------------------------------------------------ clients arrive

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._shed(exc)
                else:
                    self.warn.log(logging.WARNING, "accept", "accept failed: %s", exc)
                return
            try:
                sock.setblocking(False)
                # the listener's SO_PASSCRED reaches only connections made after it was set: one queued on a socket
                # the service manager passed before this broker started would carry no credentials without this
                packets.pass_credentials(sock)
                if not self._admit(sock):  # refused by the books (a quota): the next waits for the next turn, so a
                    return  # close that came before it is served first (_drop_closed looks once a turn)
            except Exception:
                sock.close()
                raise

    def _admit(self, sock: socket.socket) -> bool:
        """Name a new connection's process by its kernel credentials and hand it to the ledger, or refuse it; False
        when the ledger refused it (its user's quota), and nothing more is to be accepted in this turn."""
        pid, uid, _gid = packets.peer_credentials(sock)
        if not self.multi_user and uid not in (self.uid, 0):
            self.warn.log(logging.WARNING, "uid", "refused pid %d of uid %d: not this broker's user (start it with "
                          "--multi-user)", pid, uid)
            sock.close()
            return True
        pidfd = packets.peer_pidfd(sock) if pid > 0 else -1
        try:
            if PIDFS and pid > 0 and pidfd < 0:
                raise OSError(errno.EMFILE, "no pidfd for the process")
            identity = identity_of_pidfd(pid, pidfd)
            if pidfd >= 0 and packets.wait_readable(pidfd, 0):  # exited already: its pid may be reused
                raise ProcessLookupError
            try:
                client = self.ledger.connect(pid, uid, identity)
            except LedgerError:
                if not self._drop_closed(uid):
                    raise
                client = self.ledger.connect(pid, uid, identity)
        except ProcessLookupError:
            self._close_pidfd(pidfd)
            sock.close()
            return True
        except (OSError, LedgerError) as exc:
            self._close_pidfd(pidfd)
            if isinstance(exc, LedgerError):
                code, why = exc.code, exc.message
            else:
                code = C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL
                why = f"the broker could not tell which process connected ({exc.strerror or exc}): try again"
            self.warn.log(logging.WARNING, f"refuse:{code}", "refused pid %d of uid %d: %s", pid, uid, why)
            system.refuse(sock, code, why)
            return not isinstance(exc, LedgerError)
        conn = Conn(sock, pidfd, client)
        self.conns[conn.fd] = conn
        self.procs[client.uid, client.pid] += 1
        self.sel.register(sock, selectors.EVENT_READ, conn)
        if pidfd >= 0:
            self.sel.register(pidfd, selectors.EVENT_READ, _Exit(conn))
        log.debug("pid %d connected", pid)
        return True

    def _drop_closed(self, uid: int) -> bool:
        """Before a connection of `uid` is refused (its quota): drop those of its connections whose peer has closed
        but whose end the loop has not read yet (a turn the user spent in debt leaves them for the next, and new
        connections are taken at the end of every turn), so that a process that closes a connection and opens
        another is not refused for the one it closed. It looks once a turn at most, at connections the selector
        reports ready, and at no more than REAP_AT_REFUSAL of them: a flood of refused connections costs no more than
        the turns themselves do. Whether any was dropped."""
        if self.reaped:
            return False
        self.reaped = True
        looked, dropped = 0, False
        for key, _ in self._poll_now():
            conn = key.data
            if type(conn) is not Conn or conn.client.uid != uid:
                continue
            try:
                gone = conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                self._drop(conn)
                dropped = True
            looked += 1
            if looked >= REAP_AT_REFUSAL:
                break
        return dropped

    def _shed(self, exc: OSError) -> None:
        """Out of fds: accept one waiting client with the spare fd and tell it why it is refused; pause listening
        briefly if that is not possible, so the loop does not spin on a listener it cannot serve."""
        assert self.listener is not None
        self.warn.log(logging.WARNING, "emfile", "cannot accept clients: %s (the open-file limit is %d)", exc,
                      resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        sock = None
        if self.spare >= 0:
            os.close(self.spare)
            self.spare = -1
            with contextlib.suppress(OSError):
                sock, _ = self.listener.accept()
        if sock is not None:
            system.refuse(sock, C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, "the broker is out of file descriptors: its "
                          "clients hold all that its open-file limit allows; try again once some have closed")
            self.spare = system.spare_fd()
            return
        self.spare = system.spare_fd()
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(self.listener)
        self.listen_paused_until = time.monotonic() + 0.1

    def _resume_listening(self) -> None:
        if self.listen_paused_until and time.monotonic() >= self.listen_paused_until and self.listener is not None:
            self.listen_paused_until = 0.0
            self.sel.register(self.listener, selectors.EVENT_READ, None)

    # ------------------------------------------------------------ requests

    def _readable(self, conn: Conn) -> None:
        """Serve one packet of a readable connection (the selector reports it again if more are queued, so
        every client gets its turn)."""
        if self.jobs.pinned and self._wait_for_pins(conn):
            return
        try:
            data, fds, truncated, sender = packets.recv_request(conn.sock, packets.DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if len(data) > PINNED_FROM and not truncated:  # first of all: pin the pids a long trustlist names
            read = time.perf_counter()
            debug = log.isEnabledFor(logging.DEBUG)
            switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw if debug else 0
            early = self._pin_on_read(data, sender == conn.client.pid)
            if early is not None:
                if debug:  # the window of docs/security.md, T18, as this broker measures it
                    log.debug("pid %d request %d: its pids pinned %.0f us after the call was read (%d pinned, %d "
                              "preemptions in between)", conn.client.pid, peek_request_id(data),
                              (time.perf_counter() - read) * 1e6, len(early.fds),
                              resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - switches)
                self._serve(conn, data, fds, truncated, sender, early)
                return
        if not fds:
            size = len(data)
            if not size:
                self._drop(conn)
                return
            if (size == IMPORT.size or size == RELEASE.size) and sender == conn.client.pid and not truncated:
                hot = self._hot(conn, data)  # the owner's IMPORT or RELEASE, most likely
                if hot is not None:
                    self._send(conn, *hot)
                    return
        self._serve(conn, data, fds, truncated, sender)

    def _hot(self, conn: Conn, data: bytes) -> tuple[bytes, tuple[int, ...]] | None:
        """The reply to an IMPORT or a RELEASE of the connection's own process that has no fd (the requests every
        import and free makes), read and written straight from and into the frames' fields (wire/local.py's
        HotFrame); None for any other frame, which `_serve` decodes in full. The replies are the bytes `_serve`
        sends for the same request, refusals included; the ledger's checks are the same calls."""
        try:
            if len(data) == IMPORT.size:
                start, req, length, shareable, share_type, secret = IMPORT.struct.unpack(data)
                if start != IMPORT.start or length != IMPORT.length:
                    return None
                try:
                    hold, share = self.ledger.admit(conn.client, shareable, share_type, secret)
                except LedgerError as exc:
                    return encode(P.Error(exc.code, exc.message), req), ()
                memory = share.memory
                try:
                    reply = IMPORTED.struct.pack(IMPORTED.start, req, IMPORTED.length, hold, memory.size,
                                                 memory.kind, *share.prop)
                except struct.error:  # values that do not fit: the full encoder says so (a protocol error)
                    reply = encode(P.Imported(hold, memory.size, memory.kind, *share.prop), req)
                return reply, (share.fd,) if share.fd >= 0 else ()
            start, req, length, hold = RELEASE.struct.unpack(data)
            if start != RELEASE.start or length != RELEASE.length:
                return None
            try:
                self.ledger.release(conn.client, hold)
            except LedgerError as exc:
                return encode(P.Error(exc.code, exc.message), req), ()
            return OK.struct.pack(OK.start, req, OK.length), ()
        except ProtocolError as exc:
            self.warn.log(logging.INFO, "protocol", "protocol error from pid %d: %s", conn.client.pid, exc)
            return encode(P.Error(C.ACL_ERROR_RT_IPC_ERROR, f"protocol error: {exc}"), peek_request_id(data)), ()
        except Exception as exc:  # a bug must not take the node's broker down
            log.exception("internal error serving pid %d", conn.client.pid)
            return encode(P.Error(C.ACL_ERROR_RT_INTERNAL_ERROR, f"broker: {exc!r}"), peek_request_id(data)), ()

    def _pin_on_read(self, data: bytes, own: bool) -> Pins | None:
        """The pins of every pid of a long SET_PIDS or EXPORT just read (`own`: sent by the connection's process),
        taken before it is decoded or anything else is done with it (docs/security.md, T18): read straight off the
        frame's u32 tail, looked for in one snapshot of /proc, and pinned in one loop. None for any other frame, a
        list of no more than INLINE_LOOKUPS pids (looked up whole when served), or when the broker is short of fds
        to pin them (each is then looked up whole, now)."""
        start = PIDS_AT.get(data[KIND_AT])
        if start is None or not own or not CAN_PIN or not LITTLE_ENDIAN:
            return None
        count = (len(data) - start) >> 2
        if count <= INLINE_LOOKUPS or count > self._pin_room():
            return None
        pids = memoryview(data)[start : start + 4 * count].cast("I")
        collecting = gc.isenabled()
        gc.disable()  # no collection of the broker's heap inside the window (a full one takes milliseconds)
        try:
            return self.jobs.pin_now(pids, live_pids(count))
        finally:
            if collecting:
                gc.enable()

    def _serve(self, conn: Conn, data: bytes, fds: list[int], truncated: bool, sender: int,
               early: Pins | None = None) -> None:
        """Serve any request: decode it whole, and hand it to the fabric agent or the ledger (`early`: the pins of
        its pids, taken when it was read; this lets go of those it does not use)."""
        pid = conn.client.pid
        try:
            if truncated:
                raise ProtocolError(f"frame larger than {MAX_FRAME} bytes, or too many fds")
            req, request = decode(data, len(fds))
            if isinstance(request, P.RemoteImport) and sender == pid:  # the fabric agent answers now or later
                later = self.fabric.local(conn.client, request, lambda m: self._answer_later(conn, req, m))
                if later is None:
                    return
                self._send(conn, encode(later, req), ())
                return
            fd = fds.pop() if fds else -1  # the ledger's (or the job's) from here
            need = self.ledger.pids_to_bind(conn.client, request) if sender == pid else []
            if early is not None:  # each pid's process was pinned when the request was read
                job = Job(conn, req, request, fd, sender)
                self.jobs.adopt(job, need, early)
                if job.todo:
                    self._defer(job)
                    return
                answer, reply_fd = self.ledger.handle(conn.client, request, fd, sender, job.found)
            else:  # a few pids (or the broker short of fds): each is looked up whole, now
                answer, reply_fd = self.ledger.handle(conn.client, request, fd, sender)
            reply, reply_fds = encode(answer, req), (reply_fd,) if reply_fd >= 0 else ()
        except ProtocolError as exc:
            self.warn.log(logging.INFO, "protocol", "protocol error from pid %d: %s", pid, exc)
            reply = encode(P.Error(C.ACL_ERROR_RT_IPC_ERROR, f"protocol error: {exc}"), peek_request_id(data))
            reply_fds = ()
        except Exception as exc:  # a bug must not take the node's broker down
            log.exception("internal error serving pid %d", pid)
            reply = encode(P.Error(C.ACL_ERROR_RT_INTERNAL_ERROR, f"broker: {exc!r}"), peek_request_id(data))
            reply_fds = ()
        finally:
            self.closer.close_all(fds)
            if early is not None:
                self.jobs.unpin(early)  # those no job took (all of them, where the request was refused)
        self._send(conn, reply, reply_fds)

    def _pin_room(self) -> int:
        """How many more pids may be pinned now: PIN_LIMIT in all, and half the fds the broker has left."""
        room = PIN_LIMIT - self.jobs.pinned
        usage = self.ledger.usage
        if usage.fd_budget is not None:
            room = min(room, (usage.fd_budget - usage.fds) // 2 - self.jobs.pinned)
        return room

    def _wait_for_pins(self, conn: Conn) -> bool:
        """Whether to leave `conn`'s next request unread this turn: it may carry a long trustlist, and too few pids
        can be pinned until the requests in flight are done (it is received, and its pids pinned, then)."""
        if not self.jobs.pinned or self._pin_room() >= MAX_TRUSTLIST:
            return False
        try:
            size = conn.sock.recv_into(bytearray(1), 1, socket.MSG_PEEK | socket.MSG_TRUNC | socket.MSG_DONTWAIT)
        except OSError:
            return False  # read it, and find out
        return size > PINNED_FROM

    def _send(self, conn: Conn, reply: bytes, fds: tuple[int, ...]) -> None:
        try:
            packets.send_packet(conn.sock, reply, fds)
        except OSError as exc:
            if exc.errno == errno.ETOOMANYREFS and fds:
                self._no_fd_to_pass(conn, reply)
            else:
                self._drop(conn)

    def _no_fd_to_pass(self, conn: Conn, reply: bytes) -> None:
        """The kernel refused to pass another fd: more are in flight (sent, not yet received) than the broker's
        user may have open. That is no fault of this client: its import is undone and it gets 207005."""
        req = peek_request_id(reply)
        with contextlib.suppress(ProtocolError, LedgerError):
            answered = decode(reply, 1).message
            if isinstance(answered, P.Imported):
                self.ledger.release(conn.client, answered.hold)
        self.warn.log(logging.WARNING, "inflight", "cannot pass an fd to pid %d: too many fds in flight (clients "
                      "that do not read their replies); run a multi-user broker as root", conn.client.pid)
        self._send(conn, encode(P.Error(C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, (
            "the broker cannot pass another fd now: too many of its replies are in flight, unread (the kernel's "
            "limit for the broker's user); try again")), req), ())

    def _answer_later(self, conn: Conn, req: int, message: P.Message) -> None:
        """A reply the fabric agent had to wait for, to a client still connected."""
        if self.conns.get(conn.fd) is conn:
            self._send(conn, encode(message, req), ())

    def _defer(self, job: Job[Conn]) -> None:
        job.owner.job = job
        self.sel.unregister(job.owner.sock)  # its next request waits for this one's reply
        self.jobs.add(job)

    def _run_jobs(self) -> None:
        """Give the deferred requests their share of this turn, and answer those whose lookups are done."""
        for job in self.jobs.step():
            self._finish(job)

    def _finish(self, job: Job[Conn]) -> None:
        conn = job.owner
        conn.job = None
        try:
            answer, reply_fd = self.ledger.handle(conn.client, job.request, job.fd, job.sender, job.found)
            reply, fds = encode(answer, job.req), (reply_fd,) if reply_fd >= 0 else ()
        except Exception as exc:  # a bug must not take the node's broker down
            log.exception("internal error serving pid %d", conn.client.pid)
            reply, fds = encode(P.Error(C.ACL_ERROR_RT_INTERNAL_ERROR, f"broker: {exc!r}"), job.req), ()
        self.sel.register(conn.sock, selectors.EVENT_READ, conn)
        self._send(conn, reply, fds)

    def _drop(self, conn: Conn) -> None:
        """A client left (or died): release all it held and revoke its exports."""
        if self.conns.get(conn.fd) is not conn:  # dropped already (its fd may be another connection's now)
            return
        del self.conns[conn.fd]
        if conn.job is not None:
            self.jobs.cancel(conn.job)
            conn.job = None
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        before = self.ledger.usage.trust_entries()
        self.ledger.disconnect(conn.client)
        self.released += before - self.ledger.usage.trust_entries()
        if conn.client in self.fabric.client_tokens:  # its engine's metadata go now, not at the loop's next wake-up
            self.fabric.tick()
        if self.released >= TRIM_AFTER:  # large trustlists went away: give the memory back to the system
            self.released = 0
            system.trim_memory()
        self._forget(conn.client)
        conn.sock.close()
        self._close_pidfd(conn.pidfd)
        if not self.conns:
            self.idle_since = time.monotonic()
        log.debug("pid %d disconnected", conn.client.pid)

    def _forget(self, client: Client) -> None:
        """The fair-queuing state of a process whose last connection closed, and of a user who has none left."""
        uid, pid = client.uid, client.pid
        self.procs[uid, pid] -= 1
        if self.procs[uid, pid] <= 0:
            del self.procs[uid, pid]
            self.finish.get(uid, {}).pop(pid, None)
        if uid not in self.ledger.usage.users:
            self.vclock.pop(uid, None)
            self.finish.pop(uid, None)
            self.debt.pop(uid, None)

    def _close_pidfd(self, pidfd: int) -> None:
        if pidfd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(pidfd)
            os.close(pidfd)
