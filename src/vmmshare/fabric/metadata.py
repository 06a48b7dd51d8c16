"""The node's metadata service for its transfer engines (the engine's HTTP metadata mode), run by the broker in a
child process of its own.

Every engine on a node (the broker's, and each importing process's) is started with a URL of this service,
``http://127.0.0.1:<port>/<token>/metadata``, instead of answering peers' descriptor requests itself
(P2PHANDSHAKE): an engine in that mode no longer hands its segment descriptor, which lists every registered
address, to whoever asks its RPC port. Each token is a namespace of its own: an engine reads and writes only the
keys under the token of its URL, and a request under any other path is answered 404 like a missing key.

- The broker's engine has a token of its own; what that engine publishes (its descriptor) is never served under
  any other token, so no peer and no local process learns the exporting side's addresses from it.
- Each importing process gets a token of its own, made by its broker and told only to it (in its RemoteImported
  reply). Under it the broker installs one descriptor per remote hold of that process: the hold's own registration
  (address, length) and the exporting engine's data host and port, removed when the hold ends.

Tokens travel from the broker to this process over a pipe, never on a command line or in the environment (both of
which other users can read in /proc). The service stops when the pipe closes (the broker stopped or died).

The engine does its HTTP calls holding Python's GIL, so the service cannot run in an engine's own process: it
would deadlock on its first request.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Any

from ..errors import IpcError

log = logging.getLogger("vmmshare.fabric")
TOKEN_BYTES = 16  # 128 bits: a path token is guessed with probability 2^-128 per try
MAX_VALUE = 64 << 10  # bytes of one value an engine may PUT (a descriptor with a few hundred buffers)
MAX_PUT_KEYS = 16  # keys an engine may create under its token by PUT (its own: rpc_meta and ram)
REQUEST_TIMEOUT = 5.0  # seconds a connection may take to send its request (a slow client holds only its thread)
MAX_CONNECTIONS = 64  # connections served at once; more wait in the listen queue


def new_token() -> bytes:
    """A fresh path token."""
    return secrets.token_bytes(TOKEN_BYTES)


# ---------------------------------------------------------------- the service (the child process)


class Store:
    """The keys of each token: those the broker installed, and those the token's engine PUT itself."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens: dict[str, dict[str, bytes]] = {}
        self.put_keys: dict[str, set[str]] = {}

    def command(self, cmd: list[Any]) -> str:
        """One command of the broker's (add, drop, put, del, get); the answer line."""
        op, token = cmd[0], str(cmd[1])
        with self.lock:
            if op == "add":
                self.tokens.setdefault(token, {})
                self.put_keys.setdefault(token, set())
                return "ok"
            if op == "drop":
                self.tokens.pop(token, None)
                self.put_keys.pop(token, None)
                return "ok"
            keys = self.tokens.get(token)
            if keys is None:
                return "no such token"
            if op == "put":
                keys[str(cmd[2])] = str(cmd[3]).encode()
                return "ok"
            if op == "del":
                keys.pop(str(cmd[2]), None)
                self.put_keys[token].discard(str(cmd[2]))
                return "ok"
            if op == "get":
                value = keys.get(str(cmd[2]))
                return "none" if value is None else "value " + value.decode(errors="replace")
        return f"unknown command {op!r}"


def _handler(store: Store) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT
        protocol_version = "HTTP/1.1"
        server: _Server

        def handle_one_request(self) -> None:
            """One request, which must arrive and be answered within REQUEST_TIMEOUT in all (a client that trickles
            its bytes is cut off by the server's reaper, not kept for as long as it trickles)."""
            self.server.deadlines[self.connection] = time.monotonic() + REQUEST_TIMEOUT
            try:
                super().handle_one_request()
            finally:
                self.server.deadlines.pop(self.connection, None)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: a request is nothing to log."""

        def _where(self) -> tuple[dict[str, bytes], str, str] | None:
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.split("/")
            key = urllib.parse.parse_qs(url.query).get("key", [""])[0]
            if len(parts) != 3 or parts[0] or parts[2] != "metadata" or not key:
                return None
            keys = store.tokens.get(parts[1])
            return None if keys is None else (keys, parts[1], key)

        def _answer(self, code: int, body: bytes = b"") -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if code == 200 and body else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            with store.lock:
                where = self._where()
                value = None if where is None else where[0].get(where[2])
            if value is None:
                self._answer(404, b"metadata not found")
            else:
                self._answer(200, value)

        def do_PUT(self) -> None:
            try:
                length = int(self.headers.get("Content-Length", "-1"))
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_VALUE:
                self.close_connection = True
                self._answer(413, b"too large")
                return
            body = self.rfile.read(length)
            with store.lock:
                where = self._where()
                if where is not None:
                    keys, token, key = where
                    mine = store.put_keys[token]
                    if key not in keys and len(mine) >= MAX_PUT_KEYS:
                        where = None
                    elif key not in keys or key in mine:  # the broker's entries are not the engine's to change
                        keys[key] = body
                        mine.add(key)
            self._answer(200 if where is not None else 404)

        def do_DELETE(self) -> None:
            with store.lock:
                where = self._where()
                if where is not None and where[2] in store.put_keys[where[1]]:
                    where[0].pop(where[2], None)
                    store.put_keys[where[1]].discard(where[2])
            self._answer(200 if where is not None else 404)

    return Handler


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, store: Store) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.deadlines: dict[socket.socket, float] = {}  # connections in a request, and when it must be done
        self.stopping = threading.Event()
        super().__init__(("127.0.0.1", 0), _handler(store))
        threading.Thread(target=self._reap, name="vmmshare-metadata-reaper", daemon=True).start()

    def _reap(self) -> None:
        """Cut off every connection whose request ran past its deadline (its handler then ends)."""
        while not self.stopping.wait(REQUEST_TIMEOUT / 5):
            now = time.monotonic()
            for conn, deadline in list(self.deadlines.items()):
                if deadline <= now:
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def main() -> int:
    """The child: serve on 127.0.0.1 (the port goes to stdout first), obey the broker's commands on stdin, one JSON
    list a line, each answered with one line; stop at end of input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the broker's ^C is the broker's to handle: the pipe says when
    store = Store()
    server = _Server(store)
    server.socket.set_inheritable(False)
    threading.Thread(target=server.serve_forever, name="vmmshare-metadata", daemon=True).start()
    out = sys.stdout
    out.write(f"{server.server_address[1]}\n")
    out.flush()
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            answer = store.command(cmd) if isinstance(cmd, list) and len(cmd) >= 2 else "bad command"
        except (ValueError, IndexError, TypeError):
            answer = "bad command"
        out.write(answer.replace("\n", " ") + "\n")
        out.flush()
    server.stopping.set()
    server.shutdown()
    return 0


# ---------------------------------------------------------------- the broker's side


class MetadataService:
    """The broker's handle on its metadata service child: start it, install and remove entries, stop it."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._buffer = b""

    def start(self) -> None:
        """Start the child and learn its port (IpcError if it does not come up within the fabric timeout)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "vmmshare.fabric.metadata"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True, start_new_session=True)
        try:
            self.port = int(self._line())
        except (IpcError, ValueError) as exc:
            self.close()
            raise IpcError(f"the node's metadata service for the transfer engines did not start: {exc}") from None
        log.debug("fabric: metadata service (pid %d) on 127.0.0.1:%d", self.proc.pid, self.port)

    def url(self, token: bytes) -> str:
        """The engine's metadata URL under `token`."""
        return f"http://127.0.0.1:{self.port}/{token.hex()}/metadata"

    def add(self, token: bytes) -> None:
        self._call("add", token.hex())

    def drop(self, token: bytes) -> None:
        self._call("drop", token.hex())

    def put(self, token: bytes, key: str, value: dict[str, Any]) -> None:
        self._call("put", token.hex(), key, json.dumps(value, separators=(",", ":")))

    def delete(self, token: bytes, key: str) -> None:
        self._call("del", token.hex(), key)

    def get(self, token: bytes, key: str) -> Any:
        """The JSON value under `token`'s `key` (None if absent)."""
        answer = self._call("get", token.hex(), key, ok=("none", "value "))
        return None if answer == "none" else json.loads(answer[6:])

    def _call(self, *cmd: str, ok: tuple[str, ...] = ("ok",)) -> str:
        proc = self.proc
        if proc is None or proc.stdin is None:
            raise IpcError("the node's metadata service for the transfer engines is not running")
        try:
            proc.stdin.write(json.dumps(list(cmd)).encode() + b"\n")
            proc.stdin.flush()
        except OSError as exc:
            raise IpcError(f"the node's metadata service for the transfer engines is gone ({exc.strerror})") from None
        answer = self._line()
        if not answer.startswith(ok):
            raise IpcError(f"the node's metadata service refused {cmd[0]}: {answer}")
        return answer

    def _line(self) -> str:
        """One line from the child, waited for at most the fabric timeout."""
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], self.timeout)
            if not ready:
                raise IpcError(f"the node's metadata service did not answer within {self.timeout:g} s")
            data = os.read(fd, 1 << 16)
            if not data:
                raise IpcError("the node's metadata service exited")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(errors="replace")

    def close(self) -> None:
        """Stop the child: its input closed (it exits), killed if it does not within the fabric timeout."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
