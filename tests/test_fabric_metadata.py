"""The node's metadata service for the transfer engines (fabric/metadata.py and metadata_service.py), a child
process of the broker: what it answers under which path, what an engine may and may not change there, and that it
never outlives its broker."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric_cluster import HANG_GUARD, TestCluster, cluster_problem, eventually
from vmmshare.errors import IpcError
from vmmshare.fabric.metadata import MAX_PUT_KEYS, MAX_VALUE, MetadataService, new_token

KEY = "mooncake/ram/vmmshare-0123456789abcdef"
DESC = {"name": "vmmshare-0123456789abcdef", "protocol": "tcp", "tcp_data_host": "10.0.0.1", "tcp_data_port": 15001,
        "buffers": [{"addr": 1 << 40, "length": 4096, "name": "vmmshare-0123456789abcdef"}]}


@pytest.fixture
def service() -> Iterator[MetadataService]:
    m = MetadataService(5.0)
    m.start()
    yield m
    m.close()


def http(m: MetadataService, method: str, path: str, key: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{m.port}{path}?key={key}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=HANG_GUARD) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def path(token: bytes) -> str:
    return f"/{token.hex()}/metadata"


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_an_entry_is_served_under_its_token_alone(service: MetadataService) -> None:
    mine, other = new_token(), new_token()
    service.add(mine)
    service.add(other)
    service.put(mine, KEY, DESC)
    status, body = http(service, "GET", path(mine), KEY)
    assert status == 200 and json.loads(body) == DESC
    assert service.get(mine, KEY) == DESC
    for where in (path(other), path(new_token()), "/metadata", "//metadata", f"/{mine.hex()}/metadata/x",
                  f"/{mine.hex()[:-1]}/metadata", f"/{mine.hex().upper()}/metadata", f"/x/../{mine.hex()}/metadata"):
        assert http(service, "GET", where, KEY)[0] == 404, where
    service.delete(mine, KEY)  # the hold ended
    assert http(service, "GET", path(mine), KEY)[0] == 404
    assert service.get(mine, KEY) is None
    service.put(mine, KEY, DESC)
    service.drop(mine)  # the process left
    assert http(service, "GET", path(mine), KEY)[0] == 404
    service.put(mine, KEY, DESC)  # under a token dropped: nothing is made
    assert http(service, "GET", path(mine), KEY)[0] == 404 and service.get(mine, KEY) is None


def test_an_engine_cannot_change_what_its_broker_installed_nor_write_without_bounds(
        service: MetadataService) -> None:
    """An importing process may write its own engine's keys under its token, not replace or remove the
    descriptions its broker installed there (it could only hurt itself, but the broker's entries stay the broker's),
    and neither a large value nor many keys are taken."""
    mine = new_token()
    service.add(mine)
    service.put(mine, KEY, DESC)
    forged = json.dumps({**DESC, "tcp_data_port": 1}).encode()
    assert http(service, "PUT", path(mine), KEY, forged)[0] == 200  # answered as the engine expects ...
    assert service.get(mine, KEY) == DESC  # ... and nothing changed
    assert http(service, "DELETE", path(mine), KEY)[0] == 200
    assert service.get(mine, KEY) == DESC
    own = "mooncake/ram/10.0.0.2"
    assert http(service, "PUT", path(mine), own, b'{"buffers":[]}')[0] == 200
    assert http(service, "GET", path(mine), own) == (200, b'{"buffers":[]}')
    assert http(service, "PUT", path(mine), own, b"x" * (MAX_VALUE + 1))[0] == 413
    for i in range(MAX_PUT_KEYS - 1):
        assert http(service, "PUT", path(mine), f"k{i}", b"{}")[0] == 200
    assert http(service, "PUT", path(mine), "one-too-many", b"{}")[0] == 404
    assert http(service, "DELETE", path(mine), own)[0] == 200
    assert http(service, "GET", path(mine), own)[0] == 404
    assert http(service, "PUT", path(new_token()), own, b"{}")[0] == 404  # no namespace made by a PUT


def test_the_service_stops_with_the_broker_even_when_it_is_killed() -> None:
    """A broker killed with SIGKILL closes its end of the pipe: the service exits, nothing is left listening."""
    code = ("from vmmshare.fabric.metadata import MetadataService\nm = MetadataService(5.0)\nm.start()\n"
            "print(m.proc.pid, m.port, flush=True)\nimport sys\nsys.stdin.readline()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child, _ = map(int, parent.stdout.readline().split())
        assert not gone(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(HANG_GUARD)
        eventually(lambda: gone(child), "the metadata service outlived its broker")
    finally:
        parent.kill()
        parent.wait(HANG_GUARD)


def test_close_stops_the_service_and_later_calls_are_clear_errors(service: MetadataService) -> None:
    assert service.proc is not None
    proc = service.proc
    service.close()
    assert proc.returncode == 0
    with pytest.raises(IpcError, match="not running"):
        service.add(new_token())
    service.close()  # twice is harmless


@pytest.mark.skipif(bool(cluster_problem()), reason=cluster_problem() or "")
def test_a_brokers_metadata_service_goes_with_it(fabric: TestCluster) -> None:
    """Each broker with the fabric on runs one, in its own network namespace (127.0.0.1 is the node's own), and it
    goes when the broker stops (SIGTERM) or is killed (SIGKILL)."""
    from test_fabric_security import metadata_service

    for n, sig in ((1, signal.SIGTERM), (2, signal.SIGKILL)):
        child = metadata_service(fabric, n)
        fabric.brokers[n].signal(sig)
        eventually(lambda child=child: gone(child), f"server {n}'s metadata service outlived its broker")


@pytest.mark.slow
def test_connections_that_trickle_their_requests_do_not_keep_the_engines_out(service: MetadataService) -> None:
    """A local user holds every connection slot open by sending its requests a byte at a time: each is cut off once
    its request has taken REQUEST_TIMEOUT, and an engine's GET is answered (rather than waiting while they trickle)."""
    import threading

    from vmmshare.fabric.metadata import MAX_CONNECTIONS, REQUEST_TIMEOUT

    mine = new_token()
    service.add(mine)
    service.put(mine, KEY, DESC)
    done = threading.Event()
    cut = []

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", service.port)) as s:
            try:
                for byte in b"GET /" + b"a" * 10_000:
                    s.sendall(bytes([byte]))
                    if done.wait(REQUEST_TIMEOUT / 10):  # the attack's own pace
                        return
            except OSError:
                cut.append(1)

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(MAX_CONNECTIONS + 8)]
    for t in threads:
        t.start()
    try:
        assert http(service, "GET", path(mine), KEY)[0] == 200
        eventually(lambda: len(cut) >= MAX_CONNECTIONS, "trickling connections were not cut off")
    finally:
        done.set()
        for t in threads:
            t.join(HANG_GUARD)


HOLD_SLOTS = """
import select, socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
ask = b"GET /x/metadata?key=k HTTP/1.1\\r\\nHost: a\\r\\n\\r\\n"
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
for c in conns:  # each one answered: the service accepted it
    c.sendall(ask)
    c.recv(4096)
print("holding", flush=True)
while not select.select([sys.stdin], [], [], 0.5)[0]:  # the attack's own pace: a whole request well within the limit
    for c in list(conns):
        try:
            c.sendall(ask)
            c.recv(4096)
        except OSError:
            conns.remove(c)
"""


def test_another_user_keeping_every_connection_busy_with_whole_requests_does_not_keep_the_engines_out(
        service: MetadataService, as_nobody: list[str]) -> None:
    """Another local user opens as many connections as the service keeps open at once and keeps each one busy with
    whole requests, answered well within REQUEST_TIMEOUT (so none is cut off): an engine of another user connecting
    then is still answered. Each user is owed a share of the connections: the new one closes the oldest connection
    of the user that holds the most."""
    from vmmshare.fabric.metadata import MAX_CONNECTIONS

    mine = new_token()
    service.add(mine)
    service.put(mine, KEY, DESC)
    attacker = subprocess.Popen([*as_nobody, sys.executable, "-c", HOLD_SLOTS, str(service.port),
                                 str(MAX_CONNECTIONS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline() == "holding\n"
        for _ in range(3):
            assert http(service, "GET", path(mine), KEY) == (200, json.dumps(DESC, separators=(",", ":")).encode())
        assert attacker.poll() is None
    finally:
        attacker.kill()
        attacker.wait(HANG_GUARD)
    assert http(service, "GET", path(mine), KEY)[0] == 200


CROWD = """
import socket, sys, threading, time
port, count = int(sys.argv[1]), int(sys.argv[2])
ask = b"GET /x/metadata?key=k HTTP/1.1\\r\\nHost: a\\r\\n\\r\\n"


def hold(kind: int) -> None:  # one connection held open, and opened again as soon as the service closes it
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                if kind == 0:  # whole requests, pipelined, answers never read
                    while True:
                        s.sendall(ask * 512)
                elif kind == 1:  # a slow sender
                    for byte in b"GET /" + b"a" * 100_000:
                        s.sendall(bytes([byte]))
                        time.sleep(0.1)
                else:  # whole requests, each answered
                    while True:
                        s.sendall(ask)
                        if not s.recv(4096):
                            break
        except OSError:
            pass


for i in range(count):
    threading.Thread(target=hold, args=(i % 3,), daemon=True).start()
print("holding", flush=True)
sys.stdin.read()
"""
CROWD_RUNS = 4  # floods, each a fresh attacker
ENGINE_ASKS = 12  # an engine's requests during each flood, each on a connection of its own
ENGINE_TIMEOUT = 3.0  # the transfer engine's own HTTP timeout: a request answered later fails its start (507022)


@pytest.mark.alone  # its flood takes the machine's cores, and the engine's 3 s timeout is wall-clock time
def test_another_user_holding_hundreds_of_connections_does_not_keep_an_engine_out(
        service: MetadataService, as_nobody: list[str]) -> None:
    """The bystander: another local user holds 300 connections (whole requests pipelined and never read, slow
    senders, whole requests answered), each opened again as soon as the service closes it. The service kept 64
    and closed the rest, which came straight back and kept the kernel's queue of 128 connections waiting to be
    accepted full, and it spent seconds a turn answering pipelined requests: an engine's connection was dropped
    or answered after its HTTP timeout, in a few runs out of ten. The queue is now deep and taken first each turn,
    and each user gets a bounded share of each turn: in every run of the flood, every request of an engine (a PUT
    of its own key and GETs, each on a connection of its own) is answered within the engine's timeout."""
    mine = new_token()
    service.add(mine)
    service.put(mine, KEY, DESC)
    expected = json.dumps(DESC, separators=(",", ":")).encode()
    for run in range(CROWD_RUNS):
        attacker = subprocess.Popen([*as_nobody, sys.executable, "-c", CROWD, str(service.port), "300"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert attacker.stdout is not None
            assert attacker.stdout.readline() == "holding\n"
            for ask in range(ENGINE_ASKS):
                own = f"mooncake/rpc_meta/engine-{ask % 4}"  # rewritten: within the keys an engine may PUT
                for method, key, body, want in (("PUT", own, b"{}", b""), ("GET", own, None, b"{}"),
                                                ("GET", KEY, None, expected)):
                    req = urllib.request.Request(f"http://127.0.0.1:{service.port}{path(mine)}?key={key}",
                                                 data=body, method=method)
                    try:
                        with urllib.request.urlopen(req, timeout=ENGINE_TIMEOUT) as reply:
                            got = (reply.status, reply.read())
                    except OSError as exc:
                        raise AssertionError(f"flood {run + 1}, request {ask + 1}: the engine's {method} was not "
                                             f"answered within its {ENGINE_TIMEOUT:.0f} s timeout ({exc!r})") from None
                    assert got == (200, want), (run, ask, method, got)
            assert attacker.poll() is None, "the attack gave up"
        finally:
            attacker.kill()
            attacker.wait(HANG_GUARD)


FILL = """
import socket, sys
port, value, tokens = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
body = b"x" * value
refused = 0
with socket.create_connection(("127.0.0.1", port)) as s:
    for token in tokens:
        for k in range(16):
            s.sendall(f"PUT /{token}/metadata?key=k{k} HTTP/1.1\\r\\nContent-Length: {value}\\r\\n\\r\\n".encode()
                      + body)
            reply = b""
            while b"\\r\\n\\r\\n" not in reply:
                reply += s.recv(4096)
            head, _, rest = reply.partition(b"\\r\\n\\r\\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\\r")[0])
            while len(rest) < length:
                rest += s.recv(4096)
            refused += not head.startswith(b"HTTP/1.1 200 ")
print(refused, flush=True)
"""


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) << 10


def test_another_user_with_many_tokens_cannot_fill_the_services_memory(service: MetadataService,
                                                                       as_nobody: list[str]) -> None:
    """The attack: a local user with many connections to its broker gets a token for each (one remote import
    each) and has each engine PUT its 16 keys of 64 KiB: a MiB a token, a GiB for the 1,024 connections its quota
    allows, in the service's memory. What one user's engines may PUT is bounded in all (MAX_PUT_BYTES), past which
    a PUT is refused (413); another user's engine still writes its own keys."""
    from vmmshare.fabric.metadata import MAX_PUT_KEYS as KEYS

    assert service.proc is not None
    tokens = [new_token() for _ in range(96)]
    for token in tokens:
        service.add(token)
    before = _rss(service.proc.pid)
    out = subprocess.run([*as_nobody, sys.executable, "-c", FILL, str(service.port), str(MAX_VALUE),
                          *(t.hex() for t in tokens)], capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, out.stderr
    refused = int(out.stdout)
    grown = _rss(service.proc.pid) - before
    assert refused > 0, "every PUT of the other user's engines was taken"
    assert grown < 32 * MiB_, f"the service grew by {grown >> 20} MiB for one user's engines"
    mine = new_token()
    service.add(mine)
    assert http(service, "PUT", path(mine), "mooncake/rpc_meta/me", b"{}")[0] == 200
    assert http(service, "GET", path(mine), "mooncake/rpc_meta/me")[0] == 200
    assert len(tokens) * KEYS * MAX_VALUE > 64 * MiB_  # the attack asked for far more


MiB_ = 1 << 20


UNREAD = """
import socket, sys
port, total = int(sys.argv[1]), int(sys.argv[2])
ask = b"GET /x/metadata?key=k HTTP/1.1\\r\\n\\r\\n" * 1024  # each answered 404, and none of the answers read
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
s.settimeout(1.0)  # the attack's own pace: it stops once the service stops taking its requests
sent = 0
try:
    while sent < total:
        sent += s.send(ask)
except (TimeoutError, OSError):
    pass
print(sent, flush=True)
sys.stdin.read()
"""


def test_another_user_that_never_reads_its_answers_cannot_fill_the_services_memory(
        service: MetadataService, as_nobody: list[str]) -> None:
    """The attack: a local user (no token needed) pipelines requests on one connection and never reads the answers.
    The service read every request and queued every answer (each longer than its request), so its memory grew as
    long as the attacker kept sending. A connection whose answers wait unread is not read from until they are
    sent, and is cut off when they have not gone within REQUEST_TIMEOUT."""
    assert service.proc is not None
    mine = new_token()
    service.add(mine)
    service.put(mine, KEY, DESC)
    before = _rss(service.proc.pid)
    attacker = subprocess.Popen([*as_nobody, sys.executable, "-c", UNREAD, str(service.port), str(64 * MiB_)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout is not None
        sent = int(attacker.stdout.readline())
        grown = _rss(service.proc.pid) - before
        assert http(service, "GET", path(mine), KEY)[0] == 200
    finally:
        attacker.kill()
        attacker.wait(HANG_GUARD)
    assert grown < 16 * MiB_, f"the service grew by {grown >> 20} MiB for {sent >> 20} MiB of requests"


def raw(m: MetadataService, data: bytes) -> bytes:
    """What the service answers to `data` sent on a connection of its own, up to its close."""
    with socket.create_connection(("127.0.0.1", m.port), timeout=HANG_GUARD) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(1 << 16):
            got += chunk
        return got


def test_garbled_oversized_and_pipelined_requests(service: MetadataService) -> None:
    """Garbage is answered 400 and the connection closed; an unknown method 405; two requests sent at once are both
    answered in order; a PUT that asks for 100 Continue gets it; the service serves on after each."""
    mine = new_token()
    service.add(mine)
    service.put(mine, KEY, DESC)
    where = f"{path(mine)}?key={KEY}".encode()
    assert raw(service, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(service, b"GET / HTTP/1.1\r\nX: " + b"a" * 20_000).startswith(b"HTTP/1.1 400 ")
    assert raw(service, b"GET " + where + b" HTTP/1.1\r\nContent-Length: -5\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(service, b"POST " + where + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    big = f"PUT {path(mine)}?key=k HTTP/1.1\r\nContent-Length: {MAX_VALUE + 1}\r\n\r\n".encode()
    assert raw(service, big).startswith(b"HTTP/1.1 413 ")
    two = raw(service, b"GET " + where + b" HTTP/1.1\r\n\r\nGET " + where + b" HTTP/1.0\r\n\r\n")
    assert two.count(b"HTTP/1.1 200 OK") == 2 and two.count(json.dumps(DESC, separators=(",", ":")).encode()) == 2
    put = (f"PUT {path(mine)}?key=own HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", service.port), timeout=HANG_GUARD) as s:
        s.sendall(put)
        assert s.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"{}")
        assert s.recv(256).startswith(b"HTTP/1.1 200 OK")
    assert http(service, "GET", path(mine), "own") == (200, b"{}")
