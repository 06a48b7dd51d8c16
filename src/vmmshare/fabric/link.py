"""One TCP connection between two brokers, driven by the broker's event loop (non-blocking, no threads).

A link first proves the cluster key both ways (peer_protocol's Initiator/Responder, bound to the endpoint the
connecting side dialed), and carries nothing else until then; every frame after that is sealed with its direction's
key and sequence number, and one that fails its check closes the link. The connecting side then sends requests
and matches the replies to them; the accepting side hands each request to the agent, which replies on the link. A
request not answered within the fabric timeout, a handshake not done within it, a frame that breaks the protocol
or a peer that does not read what it is sent closes the link, and every request waiting on it fails with 507022
naming the peer.
"""

from __future__ import annotations

import enum
import errno
import itertools
import logging
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
Request = F.PeerMessage | Callable[[], F.PeerMessage]  # a message, or one made when the link is proved


class State(enum.Enum):
    CONNECTING = 0
    HANDSHAKE = 1
    READY = 2
    CLOSED = 3


@dataclass
class Pending:
    deadline: float
    reply: Reply


class Link:
    """A connection to one other broker (`outbound`: we connected to `endpoint`; else it connected to us)."""

    def __init__(self, sock: socket.socket, sel: selectors.BaseSelector, key: bytes, server_id: int,
                 timeout: float, outbound: bool, endpoint: tuple[str, int], *,
                 on_ready: Callable[[Link], None], on_request: Callable[[Link, int, F.PeerMessage], None],
                 on_closed: Callable[[Link], None], listening: tuple[str, int] | None = None) -> None:
        """`endpoint`: where we connected (outbound) or who connected; `listening`: for an accepted link, the
        endpoint this broker listens on, which the connecting broker's handshake must name."""
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
        self.reader = F.FrameReader()
        self.unsent = bytearray()
        now = time.monotonic()
        self.deadline = now + timeout  # for the handshake
        self.last_heard = self.last_sent = now
        self.pending: dict[int, Pending] = {}
        self.queued: list[tuple[Request, Pending]] = []  # requests made before the link was ready
        self._ids = itertools.count(1)
        self._mask = 0
        self._watch()

    @property
    def name(self) -> str:
        where = f"{self.endpoint[0]}:{self.endpoint[1]}"
        return f"server {self.peer_id:#x} at {where}" if self.peer_id is not None else where

    # ------------------------------------------------------------ requests and replies

    def request(self, message: Request, reply: Reply) -> None:
        """Send a request (queued until the link is ready; a callable makes it then, for a request bound to the
        proved link); `reply` gets the answer or, after the fabric timeout, an Error(507022)."""
        pending = Pending(time.monotonic() + self.timeout, reply)
        if self.state is State.READY:
            self._send_request(message, pending)
        elif self.state is State.CLOSED:
            reply(F.Error(C.ACL_ERROR_RT_IPC_ERROR, f"the link to {self.name} is closed"))
        else:
            self.queued.append((message, pending))

    def _send_request(self, message: Request, pending: Pending) -> None:
        req = next(self._ids) & 0xFFFFFFFF
        self.pending[req] = pending
        self.send(message if isinstance(message, F.PeerMessage) else message(), req)

    def send(self, message: F.PeerMessage, req: int) -> None:
        if self.state is State.CLOSED:
            return
        frame = F.encode(message, req)
        self.unsent += self.sealer.seal(frame) if self.sealer is not None else frame
        self.last_sent = time.monotonic()
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
        self.last_heard = time.monotonic()
        self.reader.push(data)
        while self.state is not State.CLOSED and (frame := self.reader.next()) is not None:
            self._frame(*frame)  # one at a time: the handshake switches the reader to sealed frames mid-stream

    def _frame(self, req: int, message: F.PeerMessage) -> None:
        if self.state is State.READY:
            if self.outbound:
                pending = self.pending.pop(req, None)
                if pending is None or isinstance(message, (F.Hello, F.Challenge, F.Proof, F.Welcome)):
                    raise F.PeerProtocolError(f"{message.KIND.name} answers no request of ours")
                pending.reply(message)
            else:
                if isinstance(message, (F.Hello, F.Challenge, F.Proof, F.Welcome, F.Ok, F.Error, F.Imported)):
                    raise F.PeerProtocolError(f"{message.KIND.name} is not a request")
                self.on_request(self, req, message)
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
        queued, self.queued = self.queued, []
        for message, pending in queued:
            self._send_request(message, pending)
        self.on_ready(self)

    def check(self, now: float) -> None:
        """Close the link if its handshake, or a request on it, has run past the fabric timeout."""
        if self.state is State.CLOSED:
            return
        if self.state is not State.READY and now >= self.deadline:
            self.close(f"no answer within {self.timeout:g} s (VMMSHARE_FABRIC_TIMEOUT): the peer's broker is down, "
                       "frozen or unreachable")
        elif any(p.deadline <= now for p in self.pending.values()) or any(
                p.deadline <= now for _, p in self.queued):
            self.close(f"no answer within {self.timeout:g} s (VMMSHARE_FABRIC_TIMEOUT): the peer's broker is "
                       "frozen, overloaded or unreachable")

    def next_deadline(self) -> float | None:
        times = [p.deadline for p in self.pending.values()] + [p.deadline for _, p in self.queued]
        if self.state is not State.READY:
            times.append(self.deadline)
        return min(times) if times else None

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


def _strerror(err: int) -> str:
    import os

    return os.strerror(err)


def dial(address: str, port: int) -> socket.socket:
    """A non-blocking, close-on-exec TCP socket connecting to (address, port) (the connect completes later)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = sock.connect_ex((address, port))
        if err not in (0, errno.EINPROGRESS):
            raise OSError(err, f"cannot connect to {address}:{port}: {_strerror(err)}")
    except BaseException:
        sock.close()
        raise
    return sock
