"""The transfer engine wrapper (fabric/engine.py) between real processes on this machine's loopback.

Every engine runs in a child process: an engine's threads and ports live as long as its process. Needs the
engine (`vmmshare[fabric]`); CI installs it, so there these tests must run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from conftest import require, run_child
from vmmshare.fabric.engine import missing

require(not missing(), missing() or "")

SERVER = """
import ctypes, mmap, os, sys
from vmmshare.fabric.engine import Engine
e = Engine("127.0.0.1", "tcp", 1.0)
size = 4 << 20
m = mmap.mmap(-1, size)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
m[:16] = b"served by engine"
e.register(addr, size)
print(e.segment, addr, " ".join(f"{a}:{p}" for a, p in e.listening), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "unregister":
        e.unregister(addr)
    elif cmd == "tail":
        print(bytes(m[size - 4 : size]).hex(), flush=True)
        continue
    elif cmd == "cloexec":
        import fcntl
        from vmmshare.fabric.engine import _socket_fds, listening_sockets
        ls = listening_sockets()
        mine = [fd for fd, ino in _socket_fds().items() if ino in ls]
        print(len(mine), all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in mine), flush=True)
        continue
    print("done", flush=True)
"""


class Server:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        segment, addr, *ports = self.proc.stdout.readline().split()
        self.segment, self.addr, self.ports = segment, int(addr), ports

    def say(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.close()


def client(code: str, server: Server) -> str:
    """Run `code` with `e` an engine, `seg`/`addr` the server's segment and address, `buf` a local 4 MiB buffer."""
    prelude = f"""
import ctypes, time
from vmmshare.fabric.engine import Engine
from vmmshare.errors import AclError
e = Engine("127.0.0.1", "tcp", 1.0)
seg, addr = {server.segment!r}, {server.addr}
buf = ctypes.create_string_buffer(4 << 20)
local = ctypes.addressof(buf)
"""
    proc = run_child(prelude + textwrap.dedent(code) + "\nprint('DONE')\n")
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def test_an_engine_reads_and_writes_another_process_memory_one_sided(server: Server) -> None:
    out = client("""
e.read(seg, local, addr, 16)
print(buf.raw[:16])
ctypes.memmove(local, b"\\xde\\xad\\xbe\\xef", 4)
e.write(seg, local, addr + (4 << 20) - 4, 4)   # the last bytes of the served memory
""", server)
    assert "b'served by engine'" in out
    assert server.say("tail") == "deadbeef"


def test_engine_listening_sockets_are_close_on_exec(server: Server) -> None:
    count, all_cloexec = server.say("cloexec").split()
    assert int(count) >= 2 and all_cloexec == "True"
    assert len(server.ports) >= 2


def test_a_transfer_to_memory_not_served_is_a_clear_507022(server: Server) -> None:
    server.say("unregister")
    out = client("""
try:
    e.read(seg, local, addr, 16)
except AclError as exc:
    print(exc.code, exc.message)
""", server)
    assert "507022" in out and server.segment in out and "no longer serves" in out


def test_an_unreachable_segment_is_a_clear_507022() -> None:
    out = run_child("""
import ctypes
from vmmshare.fabric.engine import Engine
from vmmshare.errors import AclError
e = Engine("127.0.0.1", "tcp", 1.0)
buf = ctypes.create_string_buffer(8)
try:
    e.read("127.0.0.1:1", ctypes.addressof(buf), 4096, 8)
except AclError as exc:
    print(exc.code, exc.message)
""")
    assert "507022" in out.stdout and "127.0.0.1:1" in out.stdout, out.stderr


def test_first_contact_with_a_frozen_peer_fails_within_the_timeout(server: Server) -> None:
    """The engine's own handshake waits 60 s on a frozen peer; the wrapper gives up after the fabric timeout."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        out = client("""
try:
    e.read(seg, local, addr, 16)
except AclError as exc:
    print(exc.code, exc.message)
""", server)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert "507022" in out and "did not answer the transfer engine within 1 s" in out  # the guard, not the 60 s


def test_without_the_engine_the_error_says_what_to_install() -> None:
    out = run_child("""
import sys
sys.modules["mooncake"] = None   # as if the package were not installed
from vmmshare.fabric.engine import Engine
from vmmshare.errors import AclError
try:
    Engine("127.0.0.1")
except AclError as exc:
    print(exc.code, exc.message)
""")
    assert "207000" in out.stdout and "vmmshare[fabric]" in out.stdout and "libibverbs1" in out.stdout


@pytest.mark.slow
def test_the_exporting_brokers_engine_serves_more_registrations_than_a_process_engines_value_holds() -> None:
    """The attack: each remote hold is a registration of its own, and the exporting engine writes its whole
    descriptor (every registration, about 60 bytes each) to the node's metadata service at each one; past 64 KiB
    (MAX_VALUE, about 1,100 registrations) the service refused it (413) and the engine refused to serve, so one
    user of another server holding 1,100 remote imports made every other user's fail. Under the broker's own token
    the descriptor may be as large as the registrations the broker serves; a process's token keeps MAX_VALUE."""
    from vmmshare.fabric.metadata import MAX_VALUE, MetadataService, new_token

    meta = MetadataService(5.0)
    meta.start()
    try:
        broker, process = new_token(), new_token()
        meta.add(broker, broker=True)
        meta.add(process)
        count = 2 * MAX_VALUE // 60
        out = run_child(f"""
import ctypes, mmap
from vmmshare.fabric.engine import Engine
e = Engine("127.0.0.1", "tcp", 2.0, {meta.url(broker)!r})
m = mmap.mmap(-1, {count} * 4096)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
for i in range({count}):
    e.register(base + i * 4096, 4096)
import json, urllib.request
with urllib.request.urlopen({meta.url(broker)!r} + "?key=mooncake/ram/" + e.segment, timeout=60) as reply:
    print("served", len(json.loads(reply.read())["buffers"]))
""")
        assert out.returncode == 0 and f"served {count}" in out.stdout, out.stdout + out.stderr[-2000:]
        big = json.dumps({"buffers": [{"addr": i, "length": 4096} for i in range(count)]}).encode()
        req = urllib.request.Request(f"{meta.url(process)}?key=mooncake/ram/x", data=big, method="PUT")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == 413, "a process's engine keeps the limit of MAX_VALUE a value"
    finally:
        meta.close()
