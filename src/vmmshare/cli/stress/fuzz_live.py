"""Fuzzing a live broker (``vmmshare stress fuzz_protocol --live``): the cases of fuzz_frames.py sent to a broker
started for the run, over several connections, some with real fds attached. Every packet must get a reply
addressed to its request id (an ERROR 507022 for every packet the codec refuses, a documented reply or error for
the valid ones) or, for an empty packet, a closed connection; afterwards the broker must be alive, serve a real
round trip between two processes, hold no fd it was handed, and have its fd count and RSS back near baseline."""


from __future__ import annotations

import array
import contextlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmmshare.wire import local as P
from vmmshare.wire.local import LAYOUTS, MAX_FRAME, Frame, Msg, ProtocolError

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import rawsock  # noqa: E402  (the test side's own packet code)

MiB2 = 2 << 20
HANG_GUARD = 30.0  # seconds: only a guard against a hang, never part of a result
IPC_ERROR = 507022
INTERNAL = 507000
# what a well-formed request may be refused with (SPEC §4); 507000 would be a bug, anything else unexpected
REQUEST_ERRORS = {107000, 107001, 107017, 207001, 207006}
REPLY_TO = {
    Msg.CHARGE: Msg.TOKEN, Msg.RELEASE: Msg.OK, Msg.MEM_INFO: Msg.MEM, Msg.EXPORT: Msg.EXPORTED,
    Msg.REVOKE: Msg.OK, Msg.SET_PIDS: Msg.OK, Msg.IMPORT: Msg.IMPORTED, Msg.BARE_TGID: Msg.PID,
    Msg.LIST: Msg.LISTING, Msg.CHARGE_GPU: Msg.TOKEN, Msg.REMOTE_IMPORT: Msg.REMOTE_IMPORTED,
    Msg.SET_REMOTE_PIDS: Msg.OK,
}
NOT_CONFIGURED = 207000  # a remote import or remote trust on a broker without the cross-server transport
RSS_LIMIT_KB = 5 * 1024
from fuzz_frames import Case, generate, tail_of  # noqa: E402

# ---------------------------------------------------------------- (b) a live broker


class Broker:
    """A broker on its own socket for this run (the procs.py BrokerProc pattern, with its log to a file)."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.socket = folder / "broker.sock"
        self.log_path = folder / "broker.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
        self.env = {**base, **(env or {}), "VMMSHARE_SOCKET": str(self.socket)}
        rfd, wfd = os.pipe()
        cmd = [sys.executable, "-m", "vmmshare.broker", "--socket", str(self.socket), "--ready-fd", str(wfd),
               "--log-level", "WARNING"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, pass_fds=(wfd,), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        os.close(wfd)
        with os.fdopen(rfd, "rb") as r:
            line = r.readline()  # "ready" once it listens; EOF when it failed
        if line != b"ready\n":
            self.proc.kill()
            self.proc.wait(10)
            raise RuntimeError(f"broker failed to start: {self.log_path.read_text()[-2000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def status_kb(self, key: str) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise KeyError(key)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(HANG_GUARD)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(HANG_GUARD)


class Conn:
    """One SOCK_SEQPACKET connection speaking raw frames.

    With `foreign`, a forked helper makes the connection and relays our packets over it: the broker sees
    (SO_PEERCRED, and SCM_CREDENTIALS on each packet) another process, so IMPORT from this connection of a handle
    exported on another one is allowed and the broker's import paths are reached. The helper exits when the
    connection is closed.
    """

    def __init__(self, path: Path, foreign: bool = False) -> None:
        self.helper = 0
        self._hold = -1
        if foreign:
            self.sock, self.helper, self._hold = _connect_from_helper(path)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self.sock.connect(str(path))
        self.sock.settimeout(HANG_GUARD)
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        self.tokens: dict[int, int] = {}  # token -> charged size
        self.req = 1

    @property
    def pid(self) -> int:
        return self.helper or os.getpid()

    def close(self) -> None:
        self.sock.close()
        if self.helper:
            os.close(self._hold)  # the helper reads EOF and exits
            os.waitpid(self.helper, 0)
            self.helper = 0

    def send(self, data: bytes, fds: list[int]) -> bool:
        return rawsock.send(self.sock, data, fds)

    def recv(self) -> tuple[bytes | None, list[int], bool]:
        """(packet, fds, truncated); packet None when the broker closed the connection."""
        return rawsock.recv(self.sock)

    def call(self, message: P.Message, fds: tuple[int, ...] = ()) -> Any:
        """A well-formed request of our own; returns the reply message (any fds it carries are closed)."""
        self.req += 1
        assert self.send(P.encode(message, self.req), list(fds)), "broker closed the connection"
        data, got, _ = self.recv()
        for fd in got:
            os.close(fd)
        assert data is not None, f"the broker closed the connection on a valid {message.TYPE.name}"
        frame = P.decode(data, len(got))
        assert frame.req == self.req, f"reply to {frame.req}, expected {self.req}"
        return frame.message


def _connect_from_helper(path: Path) -> tuple[socket.socket, int, int]:
    """Fork a helper that connects to `path` and relays packets (with their fds) between that connection and the
    socket returned to us, until either side closes; `hold` (returned) is closed to make it leave.

    The broker decides each packet by its sender (SCM_CREDENTIALS), so the helper itself sends them: to the broker
    this connection is another process's in every packet."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    hold_r, hold_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the helper: no Python-level cleanup, just the relay
        try:
            keep = {0, 1, 2, theirs.fileno(), hold_r, ready_w}
            for name in os.listdir("/proc/self/fd"):  # hold no copy of the parent's connections or pipes
                if int(name) not in keep:
                    with contextlib.suppress(OSError):
                        os.close(int(name))
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(str(path))
            os.write(ready_w, b"x")
            os.close(ready_w)
            _relay(theirs, s, hold_r)
        finally:
            os._exit(0)
    theirs.close()
    os.close(hold_r)
    os.close(ready_w)
    try:
        if os.read(ready_r, 1) != b"x":
            os.close(hold_w)
            os.waitpid(pid, 0)
            raise RuntimeError("the helper could not connect to the broker")
    finally:
        os.close(ready_r)
    return ours, pid, hold_w


def _relay(a: socket.socket, b: socket.socket, hold: int) -> None:
    """Pass packets and their fds both ways between `a` and `b` until one side closes or `hold` is closed."""
    peer = {a.fileno(): b, b.fileno(): a}
    poller = select.poll()
    for fd in (a.fileno(), b.fileno(), hold):
        poller.register(fd, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == hold:
                return
            src = a if fd == a.fileno() else b
            data, anc, _, _ = src.recvmsg(4 * MAX_FRAME, socket.CMSG_SPACE(4 * 64))
            fds = array.array("i")
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            if not data and not fds:
                return
            try:
                cmsg = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if fds else []
                peer[fd].sendmsg([data], cmsg)
            except OSError:
                return
            finally:
                for passed in fds:
                    os.close(passed)


def settled_fd_count(broker: Broker) -> int:
    """The broker's fds with one fresh connection open, after it processed every earlier close (two round trips:
    every close before our connect is reported no later than the select pass that serves our second request)."""
    c = Conn(broker.socket)
    try:
        for _ in range(2):
            assert isinstance(c.call(P.BareTgid()), P.Pid)
        return broker.fd_count()
    finally:
        c.close()


def broker_state(broker: Broker, devices: int = 8) -> dict[str, Any]:
    """What the broker holds: free/total per device and the number of exports it lists."""
    c = Conn(broker.socket)
    try:
        mem = {}
        for d in range(devices):
            f = c.call(P.MemInfo(d))
            mem[d] = (f.free, f.total) if isinstance(f, P.Mem) else None
        listing = json.loads(c.call(P.List(0)).page)
        return {"all_free": all(m is not None and m[0] == m[1] for m in mem.values()),
                "exports": len(listing["exports"]), "clients_seen": listing["clients"] + 1}  # + this one's own
    finally:
        c.close()


def round_trip(env: dict[str, str]) -> str:
    """Two real processes through the broker: malloc, map, write, export with a trustlist, import, map, read the
    same bytes. Returns "" on success, else what failed."""
    from procs import PROP, Actor  # the test suite's second-process helper

    exporter, importer = Actor(env), Actor(env)
    try:
        h, ret = exporter.call("rt.malloc_physical", MiB2, PROP, 0)
        if ret:
            return f"malloc_physical {ret}: {exporter.last_err}"
        p, ret = exporter.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        if ret or exporter.call("rt.map_mem", p, MiB2, 0, h, 0):
            return f"reserve/map failed: {exporter.last_err}"
        exporter.call("!write_bytes", p, b"fuzzed, still serving")
        shareable, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, 1)
        if ret:
            return f"export {ret}: {exporter.last_err}"
        if exporter.call("rt.mem_set_pid_to_shareable_handle_v2", shareable, 1, [importer.pid]):
            return f"set_pid: {exporter.last_err}"
        h2, ret = importer.call("rt.mem_import_from_shareable_handle_v2", shareable, 1, 0)
        if ret:
            return f"import {ret}: {importer.last_err}"
        p2, ret = importer.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        if ret or importer.call("rt.map_mem", p2, MiB2, 0, h2, 0):
            return f"importer map failed: {importer.last_err}"
        got = importer.call("!read", p2, 21)
        if got != b"fuzzed, still serving":
            return f"importer read {got!r}"
        return ""
    finally:
        exporter.close()
        importer.close()


@dataclass
class LiveStats:
    sent: int = 0
    replies: Counter[str] = field(default_factory=Counter)
    error_codes: Counter[int] = field(default_factory=Counter)
    closed_by_broker: int = 0
    closed_on_empty_packet: int = 0
    fds_attached: int = 0
    frames_with_fds: int = 0
    fd_kinds: Counter[str] = field(default_factory=Counter)
    substituted: Counter[str] = field(default_factory=Counter)
    reconnects: int = 0
    abandoned: int = 0
    exported: int = 0
    imported: int = 0
    fuzz_sent: int = 0
    scripted: Counter[str] = field(default_factory=Counter)
    defects: list[dict[str, Any]] = field(default_factory=list)
    internal_messages: Counter[str] = field(default_factory=Counter)

    def defect(self, what: str, case: Case, detail: str = "") -> None:
        if len(self.defects) < 50:
            self.defects.append({"what": what, "detail": detail[:500], "packet": case.packet[:128].hex(),
                                 "nfds": case.nfds, "origin": case.origin, "ops": list(case.ops)})
        else:
            self.defects.append({"what": what})


def _attach_fds(rng: random.Random, n: int, size_hint: int, stats: LiveStats) -> tuple[list[int], list[int]]:
    """`n` fds to send (ours to close after sending) and the read ends of the pipes among them (to check)."""
    fds: list[int] = []
    pipes: list[int] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            rd, wr = os.pipe2(os.O_CLOEXEC)
            fds.append(wr)
            pipes.append(rd)
            stats.fd_kinds["pipe"] += 1
        elif r < 0.85:
            fit = size_hint if size_hint <= 1 << 40 else MiB2  # sparse: a memfd's size costs no memory
            fd = rawsock.sealed_memfd(fit if rng.random() < 0.7 else rng.choice((0, 4096, MiB2)), "fuzz")
            fds.append(fd)
            stats.fd_kinds["memfd"] += 1
        else:
            fds.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            stats.fd_kinds["devnull"] += 1
    return fds, pipes


def _released(read_end: int) -> bool:
    """EOF on a pipe's read end: every copy of the write end (ours and the broker's) is closed."""
    ready, _, _ = select.select([read_end], [], [], 0)
    return bool(ready) and os.read(read_end, 1) == b""


def _substitute(rng: random.Random, case: Case, conn: Conn, exported: list[tuple[int, int, bytes]],
                stats: LiveStats, foreign_pid: int) -> tuple[Case, int]:
    """Now and then, point a valid request at a live object (a token of this connection, a handle exported on
    the node), so the fuzz reaches the broker's real paths. Returns the case to send and the size hint for fds."""
    size_hint = MiB2
    try:
        frame = P.decode(case.packet, case.nfds)
    except ProtocolError:
        return case, size_hint
    kind = frame.message.TYPE
    layout = LAYOUTS[kind]
    values = list(layout.values(frame.message))
    tail = tail_of(frame.message)
    if kind in (Msg.RELEASE, Msg.REVOKE, Msg.EXPORT) and conn.tokens and rng.random() < 0.6:
        token = rng.choice(list(conn.tokens))
        values[0] = token
        size_hint = conn.tokens[token]
        if kind is Msg.EXPORT:  # mostly plausible: right size, flags, share type, a host memfd
            values[1] = size_hint if rng.random() < 0.8 else values[1]
            values[2] = rng.choice((0, 1)) if rng.random() < 0.8 else values[2]
            values[3] = rng.choice((1, 2)) if rng.random() < 0.8 else values[3]
            values[5] = values[5] if rng.random() < 0.2 else 0
            pids = list(tail)[:8]
            if rng.random() < 0.5:
                pids.append(foreign_pid)  # trust the other process
            tail = tuple(pids)
        stats.substituted[kind.name] += 1
    elif kind in (Msg.IMPORT, Msg.SET_PIDS) and exported and rng.random() < 0.6:
        handle, share_type, secret = rng.choice(exported)
        values[0] = handle
        values[1] = share_type if rng.random() < 0.8 else values[1]
        if kind is Msg.IMPORT:
            values[2] = secret if rng.random() < 0.8 else values[2]
        else:
            tail = (*list(tail)[:8], foreign_pid)
        stats.substituted[kind.name] += 1
    else:
        return case, size_hint
    packet = P.encode(layout.build(tuple(values), tail), frame.req)
    return Case(packet, case.nfds, case.origin, case.kind, (*case.ops, "live-object")), size_hint


def _check_reply(case: Case, valid: Frame | None, data: bytes, got: list[int], truncated: bool,
                 stats: LiveStats, conn: Conn, exported: list[tuple[int, int, bytes]]) -> Frame | None:
    """Check one reply against what the packet deserved; returns the decoded reply (None if it did not decode)."""
    if truncated:
        stats.defect("over-long or fd-truncated reply", case)
        return None
    try:
        frame = P.decode(data, len(got))
    except ProtocolError as exc:
        stats.defect("reply does not decode", case, str(exc))
        return None
    reply = frame.message
    stats.replies[reply.TYPE.name] += 1
    if frame.req != P.peek_request_id(case.packet):
        stats.defect("reply addressed to another request id", case, f"{frame.req}")
    code = reply.code if isinstance(reply, P.Error) else 0
    if isinstance(reply, P.Error):
        stats.error_codes[code] += 1
        if not isinstance(reply.message, str) or not reply.message.strip():
            stats.defect("ERROR reply without a message", case)
        if code == INTERNAL:
            stats.internal_messages[reply.message[:300]] += 1
    if valid is None or valid.message.TYPE >= 64:  # the codec refuses it (or it is a reply): 507022 and nothing else
        if not isinstance(reply, P.Error) or code != IPC_ERROR:
            stats.defect("malformed packet not answered with ERROR 507022", case, repr(reply)[:300])
        return frame
    request = valid.message
    expected = REPLY_TO[request.TYPE]
    if isinstance(reply, P.Error):
        if code not in REQUEST_ERRORS and not (code == NOT_CONFIGURED and isinstance(request, (P.RemoteImport,
                                                                                               P.SetRemotePids))):
            stats.defect(f"valid {request.TYPE.name} refused with unexpected code {code}", case, reply.message)
        if code == 107017 and isinstance(request, (P.Import, P.SetPids)):  # revoked (or never was): stop using it
            exported[:] = [e for e in exported if e[0] != request.shareable]
        return frame
    if reply.TYPE is not expected:
        stats.defect(f"{request.TYPE.name} answered with {reply.TYPE.name}", case)
        return frame
    if isinstance(reply, P.Token) and isinstance(request, (P.Charge, P.ChargeGpu)):
        conn.tokens[reply.hold] = request.size
    elif isinstance(reply, P.Ok) and isinstance(request, P.Release):
        conn.tokens.pop(request.hold, None)
    elif isinstance(reply, P.Exported):
        stats.exported += 1
        raw = reply.shareable
        if len(raw) == 8:
            exported.append((int.from_bytes(raw, "little"), 1, bytes(32)))
        elif len(raw) == 128:
            exported.append((int.from_bytes(raw[16:24], "little"), 2, raw[64:96]))
        else:
            stats.defect("EXPORTED tail is neither 8 nor 128 bytes", case, raw.hex())
        del exported[:-64]
    elif isinstance(reply, P.Imported):
        stats.imported += 1
        if len(got) != 1:
            stats.defect("IMPORTED without exactly one fd", case)
        conn.tokens[reply.hold] = reply.size
    return frame


def _with_scripted(cases: Iterator[Case], rng: random.Random, rate: float) -> Iterator[Case | None]:
    """The fuzz cases, with a None (a scripted request goes there) before each one with probability `rate`."""
    for case in cases:
        while rng.random() < rate:
            yield None
        yield case


def _scripted(rng: random.Random, conn: Conn, exported: list[tuple[int, int, bytes]], foreign_pid: int) -> Case:
    """A well-formed request on live objects (charge, export with a memfd, import, trustlist, release, revoke),
    interleaved with the fuzz frames so that the broker holds real state while they arrive."""
    req = rng.randrange(1 << 32)
    r = rng.random()
    token = rng.choice(list(conn.tokens)) if conn.tokens else 0
    if not token or r < 0.3:
        device = rng.choice((-1, *range(8)))
        return Case(P.encode(P.Charge(device, rng.randrange(1, 5) * MiB2), req), 0, "scripted", Msg.CHARGE)
    if r < 0.55:
        size = conn.tokens[token]
        pids = [foreign_pid] if rng.random() < 0.5 else []
        packet = P.encode(P.Export(token, size, rng.choice((0, 1)), rng.choice((1, 2)), 0, 0, 0, 0, 5, 1, 0,
                                   tuple(pids)), req)
        return Case(packet, 1, "scripted", Msg.EXPORT, memfd_size=size if size <= 1 << 40 else MiB2)
    if r < 0.8 and exported:
        handle, share_type, secret = rng.choice(exported)
        return Case(P.encode(P.Import(handle, share_type, secret), req), 0, "scripted", Msg.IMPORT)
    if r < 0.88 and exported:
        handle, share_type, _ = rng.choice(exported)
        return Case(P.encode(P.SetPids(handle, share_type, (foreign_pid, os.getpid())), req), 0,
                    "scripted", Msg.SET_PIDS)
    message = P.Release(token) if rng.random() < 0.6 else P.Revoke(token)
    return Case(P.encode(message, req), 0, "scripted", message.TYPE)


def fuzz_live(broker: Broker, seed: int, count: int, seconds: float | None = None,
              connections: int = 8, scripted_rate: float = 0.03) -> dict[str, Any]:
    """Send the first `count` cases of `generate(seed, ...)` to `broker`, with well-formed requests on live
    objects interleaved (`scripted_rate` per fuzz frame); check every reply, and the broker afterwards."""
    rng = random.Random(seed ^ 0x5EED)
    stats = LiveStats()
    fd_base = settled_fd_count(broker)
    state_before = broker_state(broker)
    rss_base, hwm_base = broker.status_kb("VmRSS"), broker.status_kb("VmHWM")
    held_pipes: list[int] = []  # read ends whose write end the broker kept (a successful EXPORT)
    exported: list[tuple[int, int, bytes]] = []
    # the first connection belongs (as the broker sees it) to another process, so imports can succeed
    conns = [Conn(broker.socket, foreign=i == 0) for i in range(connections)]
    start = time.perf_counter()
    deadline = None if seconds is None else start + seconds
    try:
        for next_case in _with_scripted(generate(seed, count), rng, scripted_rate):
            if deadline is not None and stats.sent % 256 == 0 and time.perf_counter() > deadline:
                break
            i = rng.randrange(len(conns))
            if next_case is None and rng.random() < 0.3:
                i = 0  # the other process's connection: where imports can succeed
            conn = conns[i]
            if next_case is None:
                case, size_hint = _scripted(rng, conn, exported, conns[0].pid), MiB2
                stats.scripted[Msg(case.kind).name] += 1
            else:
                stats.fuzz_sent += 1
                case, size_hint = _substitute(rng, next_case, conn, exported, stats, conns[0].pid)
            try:
                valid: Frame | None = P.decode(case.packet, case.nfds)
            except ProtocolError:
                valid = None
            n = min(case.nfds, 7)  # the case's fd count, as real fds (the kernel takes at most 253 per message)
            if case.memfd_size is not None:
                fds, pipes = [rawsock.sealed_memfd(case.memfd_size, "fuzz-export")], []
            else:
                fds, pipes = _attach_fds(rng, n, size_hint, stats) if n else ([], [])
            stats.fds_attached += len(fds)
            stats.frames_with_fds += bool(fds)
            if n != case.nfds:  # the fd count is part of the packet as the broker sees it
                case = Case(case.packet, n, case.origin, case.kind, case.ops)
                valid = None  # more than one fd never decodes
            sent = conn.send(case.packet, fds)
            for fd in fds:
                os.close(fd)
            stats.sent += 1
            data: bytes | None = None
            got: list[int] = []
            reply: Frame | None = None
            if not sent:
                stats.defect("send failed: the broker had closed the connection", case)
            elif rng.random() < 0.001:  # leave without reading the reply
                stats.abandoned += 1
            else:
                if not select.select([conn.sock], [], [], HANG_GUARD)[0]:
                    stats.defect("no reply within the hang guard", case)
                    break
                data, got, truncated = conn.recv()
                if data is None:
                    if not case.packet and not case.nfds:
                        stats.closed_on_empty_packet += 1  # an empty SEQPACKET record reads as EOF: expected
                    else:
                        stats.closed_by_broker += 1
                else:
                    reply = _check_reply(case, valid, data, got, truncated, stats, conn, exported)
                for fd in got:
                    os.close(fd)
            # the broker answers only after closing every fd it does not keep, so this check needs no waiting;
            # it keeps one only for an EXPORT it accepted (a KIND_GPU export takes any fd of the right size)
            kept = [r for r in pipes if not _released(r)] if data is not None else []
            if kept and not (reply is not None and isinstance(reply.message, P.Exported)):
                stats.defect("the broker kept a pipe fd it was sent", case)
            for r in pipes:
                if r in kept or data is None:
                    held_pipes.append(r)  # checked once every connection is closed
                else:
                    os.close(r)
            if data is None or rng.random() < 0.004:  # connection churn (or the broker closed it)
                conn.close()
                conns[i] = Conn(broker.socket, foreign=i == 0)
                stats.reconnects += 1
            if stats.sent % 2000 == 0 and not broker.alive():
                stats.defect("the broker died", case)
                break
    finally:
        for c in conns:
            c.close()
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {
        "seed": seed, "frames_sent": stats.fuzz_sent, "requested": count, "connections": connections,
        "scripted_requests": dict(stats.scripted), "packets_sent": stats.sent,
        "seconds": round(elapsed, 3), "packets_per_s": round(stats.sent / elapsed) if elapsed else None,
        "replies": dict(stats.replies.most_common()), "error_codes": dict(stats.error_codes.most_common()),
        "closed_on_empty_packet": stats.closed_on_empty_packet, "closed_by_broker": stats.closed_by_broker,
        "reconnects": stats.reconnects, "abandoned_replies": stats.abandoned,
        "frames_with_fds": stats.frames_with_fds, "fds_attached": stats.fds_attached,
        "fd_kinds": dict(stats.fd_kinds), "live_object_substitutions": dict(stats.substituted),
        "exports_made": stats.exported, "imports_made": stats.imported,
        "internal_error_messages": dict(stats.internal_messages),
        "broker_fd_baseline": fd_base, "broker_rss_kb_before": rss_base, "broker_hwm_kb_before": hwm_base,
    }
    # afterwards: alive, serving, no fd kept, fd count and RSS back
    alive = broker.alive()
    result["broker_alive"] = alive
    if alive:
        fd_after = settled_fd_count(broker)
        unreleased = 0
        for r in held_pipes:
            unreleased += not _released(r)
            os.close(r)
        held_pipes = []
        state_after = broker_state(broker)
        result.update({
            "broker_fd_after": fd_after, "pipe_fds_still_held": unreleased,
            "state_before": state_before, "state_after": state_after,
            "broker_rss_kb_after": broker.status_kb("VmRSS"), "broker_hwm_kb_after": broker.status_kb("VmHWM"),
        })
        result["round_trip"] = round_trip(broker.env) or "ok"
        result["broker_fd_after_round_trip"] = settled_fd_count(broker)
        result["broker_rss_kb_after_round_trip"] = broker.status_kb("VmRSS")
        if fd_after != fd_base:
            stats.defects.append({"what": f"broker fd count {fd_base} -> {fd_after}"})
        if result["broker_fd_after_round_trip"] != fd_base:
            stats.defects.append({"what": f"broker fd count {fd_base} -> {result['broker_fd_after_round_trip']} "
                                          "after the round trip"})
        if unreleased:
            stats.defects.append({"what": f"{unreleased} pipe fds still held by the broker after all closed"})
        if not state_after["all_free"] or state_after["exports"]:
            stats.defects.append({"what": f"the broker still holds something: {state_after}"})
        growth = result["broker_rss_kb_after"] - rss_base
        result["broker_rss_growth_kb"] = growth
        if growth >= RSS_LIMIT_KB:
            stats.defects.append({"what": f"broker RSS grew by {growth} kB"})
        if result["round_trip"] != "ok":
            stats.defects.append({"what": f"round trip failed after the fuzz: {result['round_trip']}"})
    else:
        stats.defects.append({"what": f"the broker died (exit {broker.proc.returncode})"})
    for r in held_pipes:
        os.close(r)
    log = broker.log_text()
    result["broker_log_tracebacks"] = log.count("Traceback")
    if log.count("Traceback"):
        result["broker_log_tail"] = log[-3000:]
    result["defects"] = len(stats.defects)
    result["defect_samples"] = stats.defects[:50]
    return result
