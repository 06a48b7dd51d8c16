"""The node's metadata service for its transfer engines: the child process the broker starts (`metadata.py` says
what it is for and holds the broker's side). It serves the engines' GET, PUT and DELETE on 127.0.0.1 under the
tokens the broker tells it over its standard input, one JSON command a line, and stops at the end of that input.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
import urllib.parse
from collections import Counter
from typing import Any

from .metadata import (
    BROKER_MAX_VALUE,
    MAX_CONNECTIONS,
    MAX_OUTBOX,
    MAX_PUT_BYTES,
    MAX_PUT_KEYS,
    MAX_VALUE,
    REQUEST_TIMEOUT,
)


class Store:
    """The keys of each token: those the broker installed, and those the token's engine PUT itself (counted against
    the user whose engine PUT them: at most MAX_PUT_BYTES a user, whatever tokens it has)."""

    def __init__(self) -> None:
        self.tokens: dict[str, dict[str, bytes]] = {}
        self.put_keys: dict[str, set[str]] = {}
        self.put_by: dict[tuple[str, str], tuple[int | None, int]] = {}  # (token, key) -> (uid, bytes) of a PUT
        self.put_bytes: Counter[int | None] = Counter()  # uid -> bytes its engines have PUT
        self.broker_tokens: set[str] = set()  # the broker's own engine's: larger values, not counted against a user

    def _unput(self, token: str, key: str) -> None:
        """An engine's key went: its bytes no longer count against the user that PUT it."""
        uid, size = self.put_by.pop((token, key), (None, 0))
        self.put_bytes[uid] -= size
        if self.put_bytes[uid] <= 0:
            del self.put_bytes[uid]

    def command(self, cmd: list[Any]) -> str:
        """One command of the broker's (add, drop, put, del, get); the answer line."""
        op, token = cmd[0], str(cmd[1])
        if op == "add":
            self.tokens.setdefault(token, {})
            self.put_keys.setdefault(token, set())
            if cmd[2:] == ["broker"]:
                self.broker_tokens.add(token)
            return "ok"
        if op == "drop":
            self.tokens.pop(token, None)
            self.broker_tokens.discard(token)
            for key in self.put_keys.pop(token, set()):
                self._unput(token, key)
            return "ok"
        keys = self.tokens.get(token)
        if keys is None:
            return "none" if op == "get" else "no such token"
        if op == "put":
            keys[str(cmd[2])] = str(cmd[3]).encode()
            return "ok"
        if op == "del":
            keys.pop(str(cmd[2]), None)
            if str(cmd[2]) in self.put_keys[token]:
                self.put_keys[token].discard(str(cmd[2]))
                self._unput(token, str(cmd[2]))
            return "ok"
        if op == "get":
            value = keys.get(str(cmd[2]))
            return "none" if value is None else "value " + value.decode(errors="replace")
        return f"unknown command {op!r}"

    def request(self, method: str, target: str, body: bytes, uid: int | None = None) -> tuple[int, bytes]:
        """An engine's request (`uid`: whose socket sent it): (status, body). Anything not under a known token's
        path is 404."""
        url = urllib.parse.urlsplit(target)
        parts = url.path.split("/")
        key = urllib.parse.parse_qs(url.query).get("key", [""])[0]
        keys = self.tokens.get(parts[1]) if len(parts) == 3 and not parts[0] and parts[2] == "metadata" else None
        if keys is None or not key:
            return 404, b"metadata not found"
        token = parts[1]
        mine = self.put_keys[token]
        if method == "GET":
            value = keys.get(key)
            return (404, b"metadata not found") if value is None else (200, value)
        if method == "PUT":
            if key not in keys:
                if len(mine) >= MAX_PUT_KEYS:
                    return 404, b"too many keys"
            elif key not in mine:  # the broker's entries are not the engine's to change (answered 200 all the same)
                return 200, b""
            if token in self.broker_tokens:  # the broker's engine: bounded by BROKER_MAX_VALUE a key only
                mine.add(key)
                keys[key] = body
                return 200, b""
            earlier = self.put_by.get((token, key), (uid, 0))
            held = self.put_bytes[uid] - (earlier[1] if earlier[0] == uid else 0)
            if held + len(body) > MAX_PUT_BYTES:
                return 413, b"this user's engines hold all the metadata they may"
            self._unput(token, key)
            mine.add(key)
            keys[key] = body
            self.put_by[token, key] = (uid, len(body))
            self.put_bytes[uid] += len(body)
            return 200, b""
        if method == "DELETE":
            if key in mine:
                mine.discard(key)
                keys.pop(key, None)
                self._unput(token, key)
            return 200, b""
        return 405, b"method not allowed"


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large"}
MAX_HEAD = 8 << 10  # bytes of a request line and headers
BACKLOG = 1 << 16  # connections the kernel may queue for accept() (capped at net.core.somaxconn: 4,096 by default)
ACCEPTS_PER_TURN = 256  # connections taken from the kernel's queue in one turn of the loop
PER_TURN = 8  # requests of one connection answered in one turn of the loop; the rest wait for the next turn
QUANTUM = 0.002  # seconds of answering each user's connections get in a turn (the last request may overrun it)


class _Connection:
    """One engine's connection: what it sent so far, what is left to send it, and when its request must be done."""

    def __init__(self, sock: socket.socket, uid: int | None) -> None:
        self.sock = sock
        self.uid = uid  # the connecting socket's owner, as the kernel says (None: it could not be told)
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.deadline = time.monotonic() + REQUEST_TIMEOUT
        self.closing = False
        self.continued = False  # "100 Continue" sent for the request in the inbox


_DIAG = struct.Struct("=IHHIIBBBBI")  # nlmsghdr and inet_diag_req_v2 up to its inet_diag_sockid
_SOCKID = struct.Struct("!HH16s16sIII")  # inet_diag_sockid: ports and addresses in network order, if, cookie
SOCK_DIAG_BY_FAMILY, NETLINK_SOCK_DIAG, DIAG_UID = 20, 4, 16 + 64  # the uid's offset in the reply (inet_diag_msg)
_SEQ = itertools.count(1)


def peer_uid(diag: socket.socket | None, port: int, peer: tuple[str, int]) -> int | None:
    """The uid that owns the socket which connected from `peer` to this service's `port` on 127.0.0.1, asked of
    the kernel (sock_diag, which any user may ask about one socket by its addresses); None where it cannot tell."""
    if diag is None:
        return None
    try:
        addr = socket.inet_aton(peer[0]).ljust(16, b"\0")
        here = socket.inet_aton("127.0.0.1").ljust(16, b"\0")
        seq = next(_SEQ)
        sockid = _SOCKID.pack(peer[1], port, addr, here, 0, 0xFFFFFFFF, 0xFFFFFFFF)  # the connecting side's view
        diag.send(_DIAG.pack(_DIAG.size + len(sockid), SOCK_DIAG_BY_FAMILY, 1, seq, 0, socket.AF_INET,
                             socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid)  # the kernel answers within the send
        while True:
            reply = diag.recv(1 << 12)
            if len(reply) >= 12 and struct.unpack_from("=I", reply, 8)[0] == seq:
                break  # (an answer to an earlier question that was given up on is passed over)
    except OSError:
        return None
    if len(reply) < DIAG_UID + 4 or struct.unpack_from("=H", reply, 4)[0] != SOCK_DIAG_BY_FAMILY:
        return None
    uid: int = struct.unpack_from("=I", reply, DIAG_UID)[0]
    return uid


def _diag_socket() -> socket.socket | None:
    try:
        diag = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
        diag.settimeout(1.0)
        diag.connect((0, 0))
    except OSError:
        return None
    return diag


class Service:
    """The HTTP side, one thread and one selector: the listener, the broker's pipe and every connection. Each
    request must arrive and be answered within REQUEST_TIMEOUT of the connection's last answer (or its start), so
    a client that trickles its bytes or sits idle is cut off. At most MAX_CONNECTIONS are open at once, shared
    among the local users whose engines connect: a connection past that closes the oldest connection of the user
    (by the kernel's uid of the connecting socket) that holds the most, so another user who keeps every slot busy
    with whole requests cannot keep an engine out; each user is owed its share of the slots.

    Fair at the door: each turn of the loop takes the connections waiting in the kernel's queue first (a deep one,
    so that a user whose closed connections come straight back cannot keep it full and another user's connection
    out; ACCEPTS_PER_TURN at most, so that they cannot keep the turn from ending either), then gives each user at
    most QUANTUM of answering, and each connection at most PER_TURN answers, so that
    one user's hundreds of connections pipelining requests make no turn longer than a few milliseconds a user:
    another user's request is answered within a turn of arriving, well inside the engine's HTTP timeout."""

    def __init__(self, store: Store, commands: int, answers: Any) -> None:
        self.store, self.commands, self.answers = store, commands, answers
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(BACKLOG)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.sel.register(commands, selectors.EVENT_READ)
        self.conns: dict[socket.socket, _Connection] = {}  # in the order they were accepted
        self.owed: dict[_Connection, None] = {}  # connections with whole requests left unanswered last turn
        self.diag = _diag_socket()
        self.listening = True
        self.pending = b""
        self.running = True

    def run(self) -> None:
        while self.running:
            now = time.monotonic()
            wait = min((c.deadline for c in self.conns.values()), default=now + 60.0) - now
            self._turn(self.sel.select(0.0 if self.owed else max(0.0, wait)))
            now = time.monotonic()
            for conn in [c for c in self.conns.values() if c.deadline <= now]:
                self._close(conn)

    def _turn(self, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        """One turn: the broker's commands, every connection waiting to be accepted, then each user's connections
        that are ready (or were left answers owed), for at most QUANTUM a user."""
        ready: dict[int | None, dict[_Connection, int]] = {}
        accept = False
        for key, mask in events:
            if key.fileobj is self.listener:
                accept = True
            elif key.fileobj == self.commands:
                self._commands()
            else:
                conn = self.conns.get(key.fileobj)  # type: ignore[call-overload]
                if conn is not None:
                    ready.setdefault(conn.uid, {})[conn] = mask
        if accept:
            self._accept()
        owed, self.owed = self.owed, {}
        for conn in owed:
            ready.setdefault(conn.uid, {}).setdefault(conn, 0)
        clock = time.perf_counter
        for queue in ready.values():
            end = clock() + QUANTUM
            for conn, mask in queue.items():
                if conn.sock not in self.conns:
                    continue  # closed during this turn
                if clock() >= end:  # this user's time is up: the rest of its connections go next turn
                    if conn.inbox:
                        self.owed[conn] = None
                    continue
                self._serve(conn, mask)

    def _accept(self) -> None:
        """Take the connections waiting in the kernel's queue, ACCEPTS_PER_TURN at most: a user whose connections
        come back as fast as they are taken cannot keep the turn from ending (the rest wait for the next turn)."""
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of fds: the connections wait in the queue until one closes
                self.sel.unregister(self.listener)
                self.listening = False
                return
            sock.setblocking(False)
            conn = _Connection(sock, peer_uid(self.diag, self.port, peer))
            if len(self.conns) >= MAX_CONNECTIONS:
                self._close(self._oldest_of_the_busiest(conn.uid))
            self.conns[sock] = conn
            self.sel.register(sock, selectors.EVENT_READ)

    def _oldest_of_the_busiest(self, newcomer: int | None) -> _Connection:
        """The connection to give up for a newcomer's: the oldest of the user that holds the most (the newcomer's
        own counted in), or the oldest of all when each user holds one."""
        held = Counter(c.uid for c in self.conns.values())
        held[newcomer] += 1
        busiest = max(held.values())
        return next(c for c in self.conns.values() if held[c.uid] == busiest or busiest == 1)

    def _commands(self) -> None:
        """Carry out the broker's commands that have arrived (also before each request is answered: a command the
        broker wrote before it replied to a process is in force when that process's engine asks)."""
        while True:
            try:
                data = os.read(self.commands, 1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                self.running = False
                break
            self.pending += data
        while b"\n" in self.pending:
            line, _, self.pending = self.pending.partition(b"\n")
            try:
                cmd = json.loads(line)
                answer = self.store.command(cmd) if isinstance(cmd, list) and len(cmd) >= 2 else "bad command"
            except (ValueError, IndexError, TypeError):
                answer = "bad command"
            if isinstance(cmd, list) and cmd and cmd[0] == "get":  # the one command the broker waits on
                self.answers.write((answer.replace("\n", " ") + "\n").encode())
            elif answer != "ok":
                print(f"vmmshare metadata service: {answer}", file=sys.stderr, flush=True)

    def _serve(self, conn: _Connection, mask: int) -> None:
        """A connection's turn: answer what its inbox holds (PER_TURN at most) or read more, and send."""
        if conn.inbox and not conn.closing:
            before = len(conn.inbox)
            self._answer_inbox(conn)
            if conn in self.owed or len(conn.inbox) != before:
                self._flush(conn)  # it was owed answers: it reads more once they are given
                return
        if mask & selectors.EVENT_READ and len(conn.outbox) < MAX_OUTBOX:
            try:
                data = conn.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._close(conn)
                return
            if data:
                conn.inbox += data
                self._answer_inbox(conn)
        self._flush(conn)

    def _answer_inbox(self, conn: _Connection) -> None:
        """Answer the whole requests in the inbox, PER_TURN at most (the connection is then owed the rest, next
        turn) and until the answers waiting to be read reach MAX_OUTBOX (the rest waits until the client has read
        them: one that never reads costs the service no more than that)."""
        for _ in range(PER_TURN):
            if conn.closing or len(conn.outbox) >= MAX_OUTBOX or not self._one(conn):
                return
        if conn.inbox and not conn.closing and len(conn.outbox) < MAX_OUTBOX:
            self.owed[conn] = None

    def _one(self, conn: _Connection) -> bool:
        """Answer the first whole request in the inbox; False when there is none yet."""
        end = conn.inbox.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.inbox) > MAX_HEAD:
                self._answer(conn, 400, b"bad request", close=True)
            return False
        lines = bytes(conn.inbox[:end]).decode("latin-1").split("\r\n")
        request = lines[0].split(" ")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        if len(request) != 3 or not request[2].startswith("HTTP/1.") or length < 0:
            self._answer(conn, 400, b"bad request", close=True)
            return False
        if length > self._max_value(request[1]):
            self._answer(conn, 413, b"too large", close=True)
            return False
        if len(conn.inbox) < end + 4 + length:
            if headers.get("expect", "").lower() == "100-continue" and not conn.continued:
                conn.outbox += b"HTTP/1.1 100 Continue\r\n\r\n"  # the engine's HTTP client waits for it (1 s)
                conn.continued = True
            return False
        conn.continued = False
        body = bytes(conn.inbox[end + 4 : end + 4 + length])
        del conn.inbox[: end + 4 + length]
        self._commands()
        status, reply = self.store.request(request[0], request[1], body, conn.uid)
        close = headers.get("connection", "").lower() == "close" or request[2] == "HTTP/1.0"
        self._answer(conn, status, reply, close)
        conn.deadline = time.monotonic() + REQUEST_TIMEOUT
        return True

    def _max_value(self, target: str) -> int:
        """The most bytes a request body may have: MAX_VALUE, or BROKER_MAX_VALUE under the broker's own token."""
        self._commands()  # a token the broker has just added is known
        parts = urllib.parse.urlsplit(target).path.split("/")
        return BROKER_MAX_VALUE if len(parts) == 3 and parts[1] in self.store.broker_tokens else MAX_VALUE

    def _answer(self, conn: _Connection, status: int, body: bytes, close: bool = False) -> None:
        kind = "application/json" if status == 200 and body else "text/plain"
        last = "Connection: close\r\n" if close else ""
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\n{last}\r\n")
        conn.outbox += head.encode() + body
        conn.closing = conn.closing or close

    def _flush(self, conn: _Connection) -> None:
        while conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            del conn.outbox[:sent]
            if len(conn.outbox) < MAX_OUTBOX and conn.inbox and not conn.closing:
                self.owed[conn] = None  # requests left waiting while their answers could not be queued: next turn
        if conn.closing and not conn.outbox:
            self._close(conn)
            return
        want = (selectors.EVENT_READ if len(conn.outbox) < MAX_OUTBOX else 0) | (
            selectors.EVENT_WRITE if conn.outbox else 0)
        self.sel.modify(conn.sock, want)

    def _close(self, conn: _Connection) -> None:
        if self.conns.pop(conn.sock, None) is None:
            return
        self.owed.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.sock.close()
        if not self.listening:
            self.listening = True
            self.sel.register(self.listener, selectors.EVENT_READ)


def main() -> int:
    """The child: serve on 127.0.0.1 (the port goes to stdout first), obey the broker's commands on stdin, one JSON
    list a line, each answered with one line; stop at end of input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the broker's ^C is the broker's to handle: the pipe says when
    answers = os.fdopen(1, "wb", buffering=0)
    os.set_blocking(0, False)
    service = Service(Store(), 0, answers)
    answers.write(f"{service.port}\n".encode())
    service.run()
    return 0



if __name__ == "__main__":
    sys.exit(main())
