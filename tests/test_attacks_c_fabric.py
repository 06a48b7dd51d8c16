"""Attacks on the C library's copies across servers: a lying broker answers the remote import with the port of a
fake transfer engine (a TCP listener here, speaking the engine's data protocol, honestly or not), and
tests/c/fabric_attack.c (sanitized) drives the library."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from procs import clean_env
from test_c_library import RUN_ENV, TESTS_C, _answer_plain, _reply, cc, lying_broker

M2 = 2 << 20
ADDRESS = 0x7F0000000000
STATUS_OK = struct.pack("<Q", 0x4D435456 << 32)


def handle(size: int = M2) -> bytes:
    """A FABRIC handle of server 2 (this process says it is server 1), endpoint 127.0.0.1."""
    raw = bytearray(128)
    raw[0:4] = b"VMMF"
    raw[4], raw[5] = 1, 2
    struct.pack_into("<I", raw, 8, 2)
    struct.pack_into("<Q", raw, 16, 0x1234_5678_9ABC)
    struct.pack_into("<Q", raw, 24, size)
    raw[32] = 4
    struct.pack_into("<H", raw, 34, 9)
    raw[36:40] = bytes([127, 0, 0, 1])
    raw[64:96] = b"\x11" * 32
    return bytes(raw)


class Engine:
    """A fake transfer engine serving `memory` at ADDRESS; `behave(conn, size, addr, op)` may take over a request
    (return True when it did)."""

    def __init__(self, behave: Callable[[socket.socket, int, int, int, bytearray], bool] | None = None,
                 size: int = M2) -> None:
        self.memory = bytearray(size)
        self.behave = behave
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.port = self.server.getsockname()[1]
        self.stop = threading.Event()
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.server.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _recv(self, conn: socket.socket, n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = conn.recv(n - len(out))
            if not got:
                raise OSError("closed")
            out += got
        return out

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    head = self._recv(conn, 24)
                    size, addr, op = struct.unpack_from("<QQB", head)
                    self.requests += 1
                    if self.behave is not None and self.behave(conn, size, addr, op, self.memory):
                        continue
                    off = addr - ADDRESS
                    if off < 0 or off + size > len(self.memory):
                        conn.sendall(struct.pack("<Q", 0x4D435456 << 32 | 1))
                        return
                    if op & 0x7F == 0:
                        conn.sendall(STATUS_OK + bytes(self.memory[off:off + size]))
                    else:
                        self.memory[off:off + size] = self._recv(conn, size)
                        conn.sendall(STATUS_OK)
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.server.close()


def broker_for(engine: Engine, loc_type: int = 1) -> Callable[[socket.socket, bytes], None]:
    def answer(conn: socket.socket, request: bytes) -> None:
        if _answer_plain(conn, request):
            return
        if request[3] == 11:  # REMOTE_IMPORT
            fields = (77, len(engine.memory), 0, 0, 0, 4, loc_type, 0, ADDRESS, 1, b"t" * 16, engine.port)
            body = struct.pack("<QQBBBBBiQH16sH", *fields) + b"vmmshare-seg"
            conn.send(_reply(request, 72, body))
            return
        conn.send(_reply(request, 64, b""))

    return answer


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cc(tmp_path_factory.mktemp("c") / "fabric_attack", TESTS_C / "fabric_attack.c")


def drive(exe: Path, tmp_path: Path, engine: Engine, mode: str, loc_type: int = 1, timeout: str = "3",
          limit: float = 120) -> str:
    stop = lying_broker(tmp_path / "b", broker_for(engine, loc_type))
    try:
        env = {**clean_env(VMMSHARE_SOCKET=str(tmp_path / "b" / "broker.sock"), VMMSHARE_SERVER_ID="1",
                           VMMSHARE_FABRIC_TIMEOUT=timeout), **RUN_ENV}
        proc = subprocess.run([str(exe), handle(size=len(engine.memory)).hex(), mode], capture_output=True,
                              text=True, env=env, timeout=limit)
    finally:
        stop()
        engine.close()
    assert "AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout.strip()


def test_an_overlapping_copy_into_a_remote_range_keeps_memmove_semantics(exe: Path, tmp_path: Path) -> None:
    """src = a local mapping, dst = 4096 bytes above it, running into the remote mapping right after it (rule 7).
    The Python surface runs the chunks last-first when dst lies above src (copies._plan); the remote range's first
    page must get the local mapping's original last page (0xff), not one the copy's first chunk wrote over it."""
    out = drive(exe, tmp_path, Engine(), "overlap")
    assert out == "overlap 0 0 0xff", out


def _stall(conn: socket.socket, size: int, addr: int, op: int, memory: bytearray) -> bool:
    time.sleep(5)  # never answers within the fabric timeout (3 s)
    raise OSError("stalled")


@pytest.mark.parametrize("mode", ["synclock", "asynclock", "batchlock"])
def test_a_stalled_engine_never_holds_the_runtime_lock(exe: Path, tmp_path: Path, mode: str) -> None:
    """docs/c.md: the library "runs no transfer under its lock". An aclrtMemcpyAsync on an idle stream runs the
    copy in the caller's thread with the (recursive) runtime lock still held by aclrtMemcpyAsync itself: another
    thread's local copy waits for the whole stalled transfer. aclrtMemcpyBatch copies its pairs under the lock
    too."""
    out = drive(exe, tmp_path, Engine(_stall), mode)
    name, rc, waited, took = out.split()
    assert name == mode and int(rc) == 507022 and float(took) >= 2500, out
    assert float(waited) < 1000, out


def _trickle(conn: socket.socket, size: int, addr: int, op: int, memory: bytearray) -> bool:
    conn.sendall(STATUS_OK)
    for _ in range(size):
        time.sleep(0.15)
        conn.sendall(b"\x00")
    return True


def test_a_trickling_engine_is_bounded(exe: Path, tmp_path: Path) -> None:
    """A hostile engine that sends one byte every 0.15 s (under the 0.2 s no-progress timeout) would hold a 64-byte
    read for ~10 s, and a 64 MiB request for months: a request gets one fabric timeout per MiB and one more (0.2 s
    here), then fails with 507022. (The bound asserted is a hang guard, 25 times that.)"""
    out = drive(exe, tmp_path, Engine(_trickle), "trickle", timeout="0.2")
    _, rc, took = out.split()
    assert int(rc) == 507022 and float(took) < 5000, out


@pytest.mark.parametrize("loc_type", [0, 1])
def test_memcpy_kinds_of_remote_memory_follow_its_location_as_in_python(exe: Path, tmp_path: Path,
                                                                          loc_type: int) -> None:
    """docs/fabric.md: a remote range is device memory for the memcpy kinds, whatever its location (the C library
    does so; the Python surface, copies._on_device, goes by the location: see the cluster test below)."""
    out = drive(exe, tmp_path, Engine(), "kinds", loc_type=loc_type)
    assert out == "kinds 0 107000", out


# ---------------------------------------------------------------- the same calls on both surfaces, in a test cluster


def _cluster_needs() -> str | None:
    from fabric_cluster import cluster_problem

    return cluster_problem()


@pytest.fixture(params=["python", "c"])
def fab(request: pytest.FixtureRequest, shared_fabric):  # type: ignore[no-untyped-def]
    shared_fabric.surfaces = {1: request.param, 2: request.param}
    yield shared_fabric
    shared_fabric.surfaces = {}


def test_both_surfaces_copy_an_overlapping_range_into_remote_memory_as_memmove(fab) -> None:  # type: ignore[no-untyped-def]
    """A local mapping with the remote one right after it (rule 7); copy [p, p+M2) to p+4096: the remote range's
    first page gets the local mapping's original last page."""
    from procs import ok
    from test_fabric_sharing import PROP, export

    problem = _cluster_needs()
    if problem:
        pytest.skip(problem)
    a, b = fab.actor(1), fab.actor(2)
    _, s, ap = export(a, M2, pids=[b.pid])
    lh = ok(b, "rt.malloc_physical", M2, PROP, 0)
    p = ok(b, "rt.reserve_mem_address", 2 * M2, 0, 0, 0)
    ok(b, "rt.map_mem", p, M2, 0, lh, 0)
    ih = ok(b, "rt.mem_import_from_shareable_handle_v2", s, 2, 0)
    ok(b, "rt.map_mem", p + M2, M2, 0, ih, 0)
    b.call("!write", p, 0x00, M2)
    b.call("!write", p + M2 - 4096, 0xAA, 4096)
    ok(b, "rt.memcpy", p + 4096, 2 * M2 - 4096, p, M2, 3)
    assert a.call("!read", ap, 8) == b"\xaa" * 8


def test_both_surfaces_agree_on_memcpy_kinds_of_host_located_remote_memory(fab) -> None:  # type: ignore[no-untyped-def]
    """docs/fabric.md: "A remote range is device memory for the memcpy kinds" -- whatever the export's location."""
    from procs import ok, ret_of
    from test_fabric_sharing import HOST_PROP, export, import_map

    problem = _cluster_needs()
    if problem:
        pytest.skip(problem)
    a, b = fab.actor(1), fab.actor(2)
    _, s, _ = export(a, M2, pids=[b.pid], prop=HOST_PROP)
    _, rp = import_map(b, s)
    buf = ok(b, "rt.malloc_host", 4096)
    results = {kind: ret_of(b.call("rt.memcpy", buf, 64, rp, 64, kind)) for kind in (0, 2)}
    assert results == {0: 107000, 2: 0}, results


# ---------------------------------------------------------------- engines that lie


def _garbage(conn: socket.socket, size: int, addr: int, op: int, memory: bytearray) -> bool:
    conn.sendall(b"\xde\xad\xbe\xef" * 2 + b"\0" * size)
    return True


def _close(conn: socket.socket, size: int, addr: int, op: int, memory: bytearray) -> bool:
    raise OSError("closed")


def _reject(conn: socket.socket, size: int, addr: int, op: int, memory: bytearray) -> bool:
    conn.sendall(struct.pack("<Q", 0x4D435456 << 32 | 1))
    raise OSError("closed")


def _short(conn: socket.socket, size: int, addr: int, op: int, memory: bytearray) -> bool:
    if op & 0x7F == 0:
        conn.sendall(STATUS_OK + b"\0" * (size // 2))
    raise OSError("closed")


def _status_7(conn: socket.socket, size: int, addr: int, op: int, memory: bytearray) -> bool:
    conn.sendall(struct.pack("<Q", 0x4D435456 << 32 | 7))
    return True


@pytest.mark.parametrize("behave", [_garbage, _close, _reject, _short, _status_7])
def test_a_lying_engine_fails_each_copy_with_507022_and_leaves_no_fd(exe: Path, tmp_path: Path, behave) -> None:  # type: ignore[no-untyped-def]
    out = drive(exe, tmp_path, Engine(behave), "rw", timeout="1")
    _, a, b, c, before, after = out.split()
    assert (a, b, c) == ("507022",) * 3, out
    assert before == after, out


def _slow(conn: socket.socket, size: int, addr: int, op: int, memory: bytearray) -> bool:
    time.sleep(1)
    return False  # then answered as usual


def test_a_copy_in_flight_when_its_import_is_freed_keeps_no_connection(exe: Path, tmp_path: Path) -> None:
    """docs/fabric.md: idle connections "to an engine closed when the last import that engine serves it is freed"."""
    out = drive(exe, tmp_path, Engine(_slow), "freeinflight")
    _, u, f, rc, before, after = out.split()
    assert (u, f, rc) == ("0", "0", "0"), out
    assert before == after, out


def test_an_overlapping_remote_to_remote_copy_past_the_bounce_buffer_keeps_memmove_semantics(
        exe: Path, tmp_path: Path) -> None:
    size = 18 << 20
    engine = Engine(size=size)
    engine.memory[:] = bytes((i // 4096) & 0xFF for i in range(size))
    original = bytes(engine.memory)
    out = drive(exe, tmp_path, engine, "bigoverlap")
    assert out == "bigoverlap 0", out
    assert engine.memory[4096:] == original[:size - 4096]


def test_both_surfaces_copy_an_overlapping_remote_range_past_the_bounce_buffer_as_memmove(fab) -> None:  # type: ignore[no-untyped-def]
    """remote -> remote within one 18 MiB import, 4096 bytes up: the bounce buffer's (16 MiB) chunks go last first."""
    from procs import ok
    from test_fabric_sharing import export, import_map

    problem = _cluster_needs()
    if problem:
        pytest.skip(problem)
    size, m16 = 18 << 20, 16 << 20
    a, b = fab.actor(1), fab.actor(2)
    _, s, ap = export(a, size, pids=[b.pid])
    a.call("!write", ap, 0x00, size)
    a.call("!write", ap + m16 - 4096, 0xAA, 4096)
    a.call("!write", ap + m16, 0x55, 4096)
    _, rp = import_map(b, s, size)
    ok(b, "rt.memcpy", rp + 4096, size - 4096, rp, size - 4096, 3)
    assert a.call("!read", ap + m16 + 4096, 8) == b"\x55" * 8
    assert a.call("!read", ap + m16, 8) == b"\xaa" * 8


def test_a_child_forked_while_a_copy_is_in_flight_keeps_no_connection(exe: Path, tmp_path: Path) -> None:
    """vs_fabric_after_fork closed the idle connections only: one another thread had in flight stayed open in the
    child (without exec, for its life), keeping the engine's end open after the parent closed its own."""
    out = drive(exe, tmp_path, Engine(_slow), "forkinflight")
    _, parent, child = out.split()
    assert (parent, child) == ("1", "0"), out


GUESS = r"""
import os, random, socket, struct, sys, time
from vmmshare.client.connection import BrokerClient
from vmmshare.config import Config
from vmmshare.wire import messages as P
raw = bytes.fromhex(sys.argv[1])
client = BrokerClient(Config.from_env())
reply, _ = client.request(P.RemoteImport(raw), P.RemoteImported)
host = socket.inet_ntoa(raw[36:40])
def ask(address, size=8):
    with socket.create_connection((host, reply.data_port), timeout=5) as s:
        s.sendall(struct.pack("<QQB7x", size, address, 0x80))
        status = s.recv(8)
        return struct.unpack("<Q", status)[0] & 0xFFFFFFFF if len(status) == 8 else -1
assert ask(reply.address) == 0
n, refused, t0 = 2000, 0, time.monotonic()
for _ in range(n):
    refused += ask(random.randrange(1 << 20, 1 << 34) << 12) == 1
print(n, refused, round(n / (time.monotonic() - t0)))
"""


def test_a_raw_client_of_the_data_port_is_refused_each_wrong_guess_and_the_node_serves_on(shared_fabric) -> None:  # type: ignore[no-untyped-def]
    """docs/security.md: a client of the engine's data protocol (what fabric.c is) on another server guesses served
    addresses as fast as it connects; every wrong guess is refused (status 1, the connection closed), the one real
    address is served, and the exporting node serves its importer as before. The rate is printed, not asserted: the
    docs' price of a guess comes from it."""
    from procs import ok
    from test_fabric_sharing import export, import_map

    problem = _cluster_needs()
    if problem:
        pytest.skip(problem)
    shared_fabric.surfaces = {1: "python", 2: "python"}
    a, b = shared_fabric.actor(1), shared_fabric.actor(2)
    _, s, ap = export(a, M2, flags=1)
    proc = subprocess.run(
        shared_fabric.cluster.server(2).command([sys.executable, "-c", GUESS, bytes(s).hex()]),
        env=shared_fabric.env(2), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n, refused, rate = map(int, proc.stdout.split())
    print(f"{refused}/{n} wrong guesses refused, {rate} a second")
    assert refused == n
    a.call("!write_bytes", ap, b"still served")
    ih, rp = import_map(b, s)
    buf = ok(b, "rt.malloc_host", 4096)
    ok(b, "rt.memcpy", buf, 4096, rp, 4096, 2)
    assert b.call("!read", buf, 12) == b"still served"
    ok(b, "rt.unmap_mem", rp)
    ok(b, "rt.release_mem_address", rp)
    ok(b, "rt.free_physical", ih)
