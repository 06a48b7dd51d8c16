"""The node's metadata service for its transfer engines (the engine's HTTP metadata mode), run by the broker in a
child process of its own (`metadata_service.py`); this module is the broker's side of it.

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
import fcntl
import json
import logging
import os
import secrets
import select
import subprocess
import sys
from typing import Any

from ..errors import IpcError

log = logging.getLogger("vmmshare.fabric")
TOKEN_BYTES = 16  # 128 bits: a path token is guessed with probability 2^-128 per try
MAX_VALUE = 64 << 10  # bytes of one value an engine may PUT (a descriptor with a few hundred buffers)
BROKER_MAX_VALUE = 16 << 20  # under the broker's own token: its engine's descriptor lists every remote hold's
# registration (about 60 bytes each), which must not be what bounds how many the node serves
MAX_PUT_KEYS = 16  # keys an engine may create under its token by PUT (its own: rpc_meta and ram)
MAX_PUT_BYTES = 16 << 20  # bytes the engines of one user (the connecting socket's uid) may have PUT, all tokens
REQUEST_TIMEOUT = 2.0  # seconds a connection has for each request (the engine's own HTTP timeout is 3 s)
MAX_OUTBOX = 256 << 10  # bytes of answers waiting for a connection to read them: past this it is not read from
PIPE_BYTES = 1 << 20  # the pipe to the service (the most an unprivileged process may ask for, by default)
MAX_CONNECTIONS = 64  # connections open at once; one more closes the oldest of the user that holds the most


def new_token() -> bytes:
    """A fresh path token."""
    return secrets.token_bytes(TOKEN_BYTES)


class MetadataService:
    """The broker's handle on its metadata service child: start it, install and remove entries, stop it."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._buffer = b""

    def start(self) -> None:
        """Start the child and learn its port (IpcError if it does not come up within the fabric timeout)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "vmmshare.fabric.metadata_service"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True, start_new_session=True, bufsize=0)
        assert self.proc.stdin is not None
        os.set_blocking(self.proc.stdin.fileno(), False)
        with contextlib.suppress(OSError):  # room for a burst of registrations while the service is off the CPU
            fcntl.fcntl(self.proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        try:
            self.port = int(self._line())
        except (IpcError, ValueError) as exc:
            self.close()
            raise IpcError(f"the node's metadata service for the transfer engines did not start: {exc}") from None
        log.debug("fabric: metadata service (pid %d) on 127.0.0.1:%d", self.proc.pid, self.port)

    def url(self, token: bytes) -> str:
        """The engine's metadata URL under `token`."""
        return f"http://127.0.0.1:{self.port}/{token.hex()}/metadata"

    # add, drop, put and delete are not answered: the service carries out what the broker wrote before it answers
    # any engine's request, so a process told of an entry finds it (no round trip in the broker's loop)

    def add(self, token: bytes, broker: bool = False) -> None:
        """A namespace for `token` (`broker`: the broker's own engine's, whose descriptor lists every remote hold's
        registration: values up to BROKER_MAX_VALUE)."""
        if broker:
            self._send("add", token.hex(), "broker")
        else:
            self._send("add", token.hex())

    def drop(self, token: bytes) -> None:
        self._send("drop", token.hex())

    def put(self, token: bytes, key: str, value: dict[str, Any]) -> None:
        self._send("put", token.hex(), key, json.dumps(value, separators=(",", ":")))

    def delete(self, token: bytes, key: str) -> None:
        self._send("del", token.hex(), key)

    def get(self, token: bytes, key: str) -> Any:
        """The JSON value under `token`'s `key` (None if absent)."""
        self._send("get", token.hex(), key)
        answer = self._line()
        if not answer.startswith(("none", "value ")):
            raise IpcError(f"the node's metadata service refused get: {answer}")
        return None if answer == "none" else json.loads(answer[6:])

    def _send(self, *cmd: str) -> None:
        proc = self.proc
        if proc is None or proc.stdin is None:
            raise IpcError("the node's metadata service for the transfer engines is not running")
        line = json.dumps(list(cmd)).encode() + b"\n"
        fd = proc.stdin.fileno()
        try:
            done = os.write(fd, line)  # non-blocking: a service that stopped reading never stalls the broker
            if done < len(line):  # only a line longer than the pipe's atomic size is split: the rest waits
                os.set_blocking(fd, True)
                try:
                    while done < len(line):
                        done += os.write(fd, line[done:])
                finally:
                    os.set_blocking(fd, False)
        except BlockingIOError:
            raise IpcError("the node's metadata service for the transfer engines is not keeping up") from None
        except OSError as exc:
            raise IpcError(f"the node's metadata service for the transfer engines is gone ({exc.strerror})") from None

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

