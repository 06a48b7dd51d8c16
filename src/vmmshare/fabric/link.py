"""One TCP connection between two brokers, driven by the broker's event loop (non-blocking, no threads).

A link first proves the cluster key both ways (peer_protocol's Initiator/Responder, bound to the endpoint the
connecting side dialed), and carries nothing else until then; every frame after that is sealed with its direction's
key and sequence number, and one that fails its check closes the link. Then it carries requests both ways: the
connecting side names its own endpoint first (Listens), so that the accepting side sends its requests over the same
link, one link per pair of servers. Replies are told from requests by their kind and matched to their request.
A request not answered within the fabric timeout fails alone (507022): a reply that comes later is handed to the
request's `late` (which undoes what it did) and the link serves on. A handshake not done within the timeout, a frame
that breaks the protocol or a peer that does not read what it is sent closes the link, and every request waiting on
it fails with 507022 naming the peer. The link keeps no timers: `next_due` tells its owner when to call `expire`.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import itertools
import logging
import math
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from .. import constants as C
from ..wire import peer as F

log = logging.getLogger("vmmshare.fabric")
MAX_UNSENT = 1 << 20  # bytes queued for a peer that does not read: past this the link closes
RECV = 1 << 16

Reply = Callable[[F.PeerMessage], None]  # gets the peer's reply, or an Error(507022) when none came
Request = F.PeerMessage | Callable[["Link"], F.PeerMessage]  # a message, or one made for the link it goes on
MAX_ABANDONED = 1024  # requests timed out and still unanswered: past this the peer answers nothing, the link closes
REPLIES = (F.Ok, F.Error, F.Imported)
HANDSHAKE = (F.Hello, F.Challenge, F.Proof, F.Welcome)


class State(enum.Enum):
    CONNECTING = 0
    HANDSHAKE = 1
    READY = 2
    CLOSED = 3


@dataclass
class Pending:
    deadline: float
    reply: Reply
    late: Reply | None = None  # gets a reply that came after the timeout (to undo what the request did)


class Link:
    """A connection to one other broker (`outbound`: we connected to `endpoint`; else it connected to us)."""

    def __init__(self, sock: socket.socket, sel: selectors.BaseSelector, key: bytes, server_id: int,
                 timeout: float, outbound: bool, endpoint: tuple[str, int], *,
                 on_ready: Callable[[Link], None], on_request: Callable[[Link, int, F.PeerMessage], None],
                 on_closed: Callable[[Link], None], listening: tuple[str, int] | None = None,
                 claim: tuple[str, int] | None = None) -> None:
        """`endpoint`: where we connected (outbound) or who connected; `listening`: for an accepted link, the
        endpoint this broker listens on, which the connecting broker's handshake must name; `claim`: for an outbound
        link, this broker's own endpoint, named to the peer once the link is proved (Listens)."""
        self.sock, self.sel, self.timeout, self.outbound, self.endpoint = sock, sel, timeout, outbound, endpoint
        self.on_ready, self.on_request, self.on_closed = on_ready, on_request, on_closed
        self.state = State.CONNECTING if outbound else State.HANDSHAKE
        named = endpoint if outbound else listening
        if named is None:
            raise ValueError("an accepted link needs the endpoint this broker listens on")
        own = F.endpoint_bytes(*named)
        self.initiator = F.Initiator(key, server_id, own) if outbound else None
        self.responder = None if outbound else F.Responder(key, server_id, own)
        self.sealer: F.Sealer | None = None  # once the proofs are through: frames we send are sealed
        self.session = b""  # the link's id once proved (what an Import's secret proof is bound to)
        self.challenged = False  # the accepting side sent its challenge
        self.peer_id: int | None = None
        self.meant_for: int | None = None  # the server id the requests queued on a link being dialed are for
        self.reader = F.FrameReader()
        self.unsent = bytearray()
        now = time.monotonic()
        self.deadline = now + timeout  # for the handshake
        self.pending: dict[int, Pending] = {}  # in the order sent: the first has the earliest deadline
        self.abandoned: dict[int, Pending] = {}  # timed out, unanswered: a late reply goes to its `late`
        self.queued: list[tuple[Request, Pending]] = []  # requests made before the link was ready
        self.claim = claim
        self.listens: tuple[str, int] | None = endpoint if outbound else None  # the peer's endpoint, once known
        self.tied: set[int] = set()  # remote holds the peer took or adopted here over this link
        self.holding: set[int] = set()  # holds this broker's clients have at the peer, taken or adopted over it
        self.wake_at: float | None = None  # when the owner's timer heap next wakes this link
        self.on_deadline: Callable[[Link], None] | None = None  # the owner's: a new deadline to put in its heap
        self._ids = itertools.count(1)
        self._mask = 0
        keep_alive(sock, timeout)
        self._watch()

    @property
    def name(self) -> str:
        where = f"{self.endpoint[0]}:{self.endpoint[1]}"
        return f"server {self.peer_id:#x} at {where}" if self.peer_id is not None else where

    # ------------------------------------------------------------ requests and replies

    def request(self, message: Request, reply: Reply, late: Reply | None = None) -> None:
        """Send a request (queued until the link is ready; a callable makes it then, for a request bound to the
        proved link); `reply` gets the answer or, after the fabric timeout, an Error(507022), and `late` an answer
        that came after that."""
        pending = Pending(time.monotonic() + self.timeout, reply, late)
        if self.state is State.READY:
            self._send_request(message, pending)
        elif self.state is State.CLOSED:
            reply(F.Error(C.ACL_ERROR_RT_IPC_ERROR, f"the link to {self.name} is closed"))
            return
        else:
            self.queued.append((message, pending))
        if self.on_deadline is not None:
            self.on_deadline(self)

    def _send_request(self, message: Request, pending: Pending) -> None:
        req = next(self._ids) & 0xFFFFFFFF
        self.pending[req] = pending
        self.send(message if isinstance(message, F.PeerMessage) else message(self), req)

    def take_queued(self) -> list[tuple[Request, Pending]]:
        """The requests waiting for this link's handshake, handed over to another link of the same peer."""
        queued, self.queued = self.queued, []
        return queued

    def adopt_queued(self, queued: list[tuple[Request, Pending]]) -> None:
        """Carry requests another link of the same peer had queued (their deadlines as they were)."""
        for message, pending in queued:
            if self.state is State.READY:
                self._send_request(message, pending)
            elif self.state is State.CLOSED:
                pending.reply(F.Error(C.ACL_ERROR_RT_IPC_ERROR, f"the link to {self.name} is closed"))
            else:
                self.queued.append((message, pending))

    def send(self, message: F.PeerMessage, req: int) -> None:
        if self.state is State.CLOSED:
            return
        frame = F.encode(message, req)
        self.unsent += self.sealer.seal(frame) if self.sealer is not None else frame
        if len(self.unsent) > MAX_UNSENT:
            self.close("it does not read what it is sent")
            return
        try:
            self._flush()
        except OSError as exc:  # the peer reset the connection: whatever waits on it fails, nothing raises
            self.close(exc.strerror or str(exc))

    # ------------------------------------------------------------ the event loop's side

    def on_event(self, mask: int) -> None:
        """The selector found the socket ready (`mask`: selectors.EVENT_READ / EVENT_WRITE)."""
        try:
            if self.state is State.CONNECTING and mask & selectors.EVENT_WRITE:
                self._connected()
            if mask & selectors.EVENT_WRITE and self.state is not State.CLOSED:
                self._flush()
            if mask & selectors.EVENT_READ and self.state is not State.CLOSED:
                self._receive()
        except F.AuthError as exc:
            log.warning("fabric link %s refused: %s", self.name, exc)
            self.close(f"the cluster key check failed: {exc}")
        except F.PeerProtocolError as exc:
            log.warning("fabric link %s broke the protocol: %s", self.name, exc)
            self.close(f"protocol error: {exc}")
        except OSError as exc:
            self.close(exc.strerror or str(exc))

    def _connected(self) -> None:
        err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, f"cannot connect: {errno.errorcode.get(err, err)} ({_strerror(err)})")
        self.state = State.HANDSHAKE
        assert self.initiator is not None
        self.send(self.initiator.hello(), 0)

    def _flush(self) -> None:
        while self.unsent:
            try:
                sent = self.sock.send(self.unsent)
            except (BlockingIOError, InterruptedError):
                break
            del self.unsent[:sent]
        self._watch()

    def _receive(self) -> None:
        try:
            data = self.sock.recv(RECV)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self.close("it closed the connection")
            return
        self.reader.push(data)
        while self.state is not State.CLOSED and (frame := self.reader.next()) is not None:
            self._frame(*frame)  # one at a time: the handshake switches the reader to sealed frames mid-stream

    def _frame(self, req: int, message: F.PeerMessage) -> None:
        if self.state is State.READY:
            if isinstance(message, HANDSHAKE):
                raise F.PeerProtocolError(f"{message.KIND.name} on a proved link")
            if not isinstance(message, REPLIES):
                self.on_request(self, req, message)
                return
            pending = self.pending.pop(req, None)
            if pending is not None:
                pending.reply(message)
                return
            late = self.abandoned.pop(req, None)
            if late is None:
                raise F.PeerProtocolError(f"{message.KIND.name} answers no request of ours")
            if late.late is not None:
                late.late(message)
            return
        if self.responder is not None:  # the accepting side: hello, then proof
            if isinstance(message, F.Hello) and not self.challenged:
                self.send(self.responder.challenge(message), 0)
                self.challenged = True
            elif isinstance(message, F.Proof) and self.challenged and self.peer_id is None:
                self.peer_id = self.responder.verify(message)
                assert self.responder.keys is not None
                self._seal(self.responder.keys.responder_to_initiator, self.responder.keys.initiator_to_responder)
                self.send(F.Welcome(), 0)
                self._ready()
            else:
                raise F.PeerProtocolError(f"{message.KIND.name} during the key handshake")
        else:
            assert self.initiator is not None
            if isinstance(message, F.Challenge) and self.initiator.peer_id is None:
                self.send(self.initiator.answer(message), 0)
                assert self.initiator.keys is not None
                self._seal(self.initiator.keys.initiator_to_responder, self.initiator.keys.responder_to_initiator)
            elif isinstance(message, F.Welcome) and self.initiator.peer_id is not None:
                self.peer_id = self.initiator.peer_id
                self._ready()
            elif isinstance(message, F.Error):
                raise F.AuthError(message.message)
            else:
                raise F.PeerProtocolError(f"{message.KIND.name} during the key handshake")

    def _seal(self, send: bytes, receive: bytes) -> None:
        """From here on, frames are sealed both ways (the welcome is the first one)."""
        self.sealer = F.Sealer(send)
        self.reader.authenticate(receive)
        side = self.initiator if self.initiator is not None else self.responder
        assert side is not None and side.keys is not None
        self.session = side.keys.session

    def _ready(self) -> None:
        self.state = State.READY
        log.debug("fabric link to %s is up", self.name)
        if self.claim is not None:  # first: the accepting side may send its own requests over this link from now
            self.request(F.Listens(F.endpoint_bytes(*self.claim)), _claimed(self))
        queued, self.queued = self.queued, []
        for message, pending in queued:
            self._send_request(message, pending)
        self.on_ready(self)

    def expire(self, now: float) -> None:
        """What is due by `now`: a handshake past the fabric timeout closes the link; a request past it fails alone."""
        if self.state is State.CLOSED:
            return
        if self.state is not State.READY:
            if now >= self.deadline:
                self.close(f"no answer within {self.timeout:g} s (VMMSHARE_FABRIC_TIMEOUT): the peer's broker is "
                           "down, frozen or unreachable")
            return
        while self.pending:
            req, pending = next(iter(self.pending.items()))
            if pending.deadline > now:
                break
            del self.pending[req]
            self.abandoned[req] = pending
            pending.reply(F.Error(C.ACL_ERROR_RT_IPC_ERROR, (
                f"{self.name}: no answer within {self.timeout:g} s (VMMSHARE_FABRIC_TIMEOUT): the peer's broker is "
                "frozen, overloaded or unreachable")))
        if len(self.abandoned) > MAX_ABANDONED:
            self.close(f"{len(self.abandoned)} requests unanswered")

    def next_deadline(self) -> float | None:
        """When `expire` has something to do (None: nothing waits on a deadline)."""
        if self.state is State.CLOSED:
            return None
        if self.state is not State.READY:
            return self.deadline
        return next(iter(self.pending.values())).deadline if self.pending else None

    def close(self, why: str) -> None:
        """Close the socket; every request waiting on it fails with 507022 saying `why`."""
        if self.state is State.CLOSED:
            return
        proved = self.state is State.READY
        self.state = State.CLOSED
        if self._mask:
            self.sel.unregister(self.sock)
            self._mask = 0
        self.sock.close()
        if proved or self.outbound:
            log.info("fabric link to %s closed: %s", self.name, why)
        else:
            log.warning("fabric: a connection from %s closed before it proved the cluster key: %s", self.name, why)
        failed = [p for p in self.pending.values()] + [p for _, p in self.queued]
        self.pending.clear()
        self.queued.clear()
        self.abandoned.clear()
        error = F.Error(C.ACL_ERROR_RT_IPC_ERROR, f"{self.name}: {why}")
        for pending in failed:
            pending.reply(error)
        self.on_closed(self)

    def _watch(self) -> None:
        want = selectors.EVENT_READ
        if self.unsent or self.state is State.CONNECTING:
            want |= selectors.EVENT_WRITE
        if want != self._mask:
            if self._mask:
                self.sel.modify(self.sock, want, self.on_event)
            else:
                self.sel.register(self.sock, want, self.on_event)
            self._mask = want


def _claimed(link: Link) -> Reply:
    def done(reply: F.PeerMessage) -> None:
        if isinstance(reply, F.Error):
            log.info("fabric: %s sends its own requests on a link of its own: %s", link.name, reply.message)

    return done


def _strerror(err: int) -> str:
    import os

    return os.strerror(err)


SILENCE_FACTOR = 3  # a link whose peer's kernel does not answer for this many fabric timeouts is closed


def keep_alive(sock: socket.socket, timeout: float) -> None:
    """Let the kernel watch the link (TCP keepalive, and a bound on unacknowledged data): a peer whose host or
    network is gone fails the socket (ETIMEDOUT) after SILENCE_FACTOR fabric timeouts, and an idle link costs
    this broker no wake-ups. A peer broker that exits resets the connection at once; one merely frozen keeps it,
    as a frozen local process keeps what it holds (its requests still time out one by one)."""
    quiet = max(1, math.ceil(timeout / 2))  # seconds of quiet before the first probe, and between probes
    probes = max(2, math.ceil(SILENCE_FACTOR * timeout / quiet) - 1)
    with contextlib.suppress(OSError):  # a socket type without these (not TCP) is left as it is
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, quiet)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, quiet)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(SILENCE_FACTOR * timeout * 1000))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def dial(address: str, port: int, source: str = "") -> socket.socket:
    """A non-blocking, close-on-exec TCP socket connecting to (address, port) (the connect completes later), from
    `source` when given (this broker's VMMSHARE_FABRIC_ADDR): on a host with several addresses the kernel would
    otherwise pick one by route, and the peer takes the endpoint a link names (Listens) only for the address the
    connection comes from."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if source and (":" in source) == (family == socket.AF_INET6):
            sock.bind((source, 0))
        err = sock.connect_ex((address, port))
        if err not in (0, errno.EINPROGRESS):
            raise OSError(err, f"cannot connect to {address}:{port}: {_strerror(err)}")
    except BaseException:
        sock.close()
        raise
    return sock
