"""Malformed traffic sent straight to a live broker socket (SPEC §5): the broker answers with an ERROR frame
(or closes that one connection), never crashes, never keeps a file descriptor it was handed, and goes on
serving real clients.

Each test measures the broker's open fds first, with a round trip on a fresh connection so that every earlier
close has been processed, and checks that it returns there once the test's connections are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import rawsock
from procs import PROP, Actor, BrokerProc, MiB2, clean_env, share_and_map
from vmmshare.wire import local as P
from vmmshare.wire.local import HEADER, LAYOUTS, MAGIC, MAX_FRAME, VERSION, Frame, Msg, ProtocolError

IPC_ERROR = 507022
PARAM = 107000
BAD_HANDLE = 107017
NO_PERMISSION = 207006
NO_MEMORY = 207001
BAD_DEVICE = 107001
DEFAULT, FABRIC = 1, 2
NO_PID_CHECK = 1
HANG_GUARD = 30.0  # seconds; only ever a guard against a hang, never part of an assertion
CAPACITY = 64 << 20
PROP_FIELDS = (0, 0, 5, 1, 0)  # handleType, allocationType, memAttr, location.type, location.id


@pytest.fixture(scope="module")
def broker_env() -> dict[str, str]:
    """The tests' broker (conftest's `broker`, one for the module) has CAPACITY."""
    return clean_env(VMMSHARE_DEVICE_MEMORY=str(CAPACITY))


@pytest.fixture
def broker(request: pytest.FixtureRequest, broker: Any, tmp_path: Path) -> Iterator[Any]:
    """conftest's broker; under BOTH_PATHS' "pure", one of the test's own whose packets go through pure Python."""
    if getattr(request, "param", "compiled") != "pure":
        yield broker
        return
    b = BrokerProc(tmp_path, env=clean_env(VMMSHARE_DEVICE_MEMORY=str(CAPACITY), VMMSHARE_PURE_PYTHON="1"))
    try:
        yield b
    finally:
        b.kill()


BOTH_PATHS = pytest.mark.parametrize("broker", ["compiled", "pure"], indirect=True)


# ---------------------------------------------------------------- a raw client


class Raw(rawsock.Connection):
    """One SOCK_SEQPACKET connection to the broker, speaking frames by hand."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, HANG_GUARD, req=100)

    def send(self, data: bytes, fds: tuple[int, ...] | list[int] = ()) -> bool:
        """Send one packet; False when the broker had closed the connection."""
        return rawsock.send(self.sock, data, fds)

    def recv(self) -> tuple[Frame | None, list[int]]:
        """The next reply and the fds that came with it; (None, []) when the broker closed the connection."""
        data, fds, truncated = rawsock.recv(self.sock)
        if data is None:
            return None, []
        assert not truncated, "the broker sent an over-long reply"
        try:
            frame = P.decode(data, len(fds))
        except ProtocolError:
            for fd in fds:
                os.close(fd)
            raise
        return frame, fds

    def ask(self, data: bytes, fds: tuple[int, ...] | list[int] = ()) -> Frame | None:
        """Send a packet and return the reply (closing any fd it carries); None when the connection closed."""
        if not self.send(data, fds):
            return None
        frame, got = self.recv()
        for fd in got:
            os.close(fd)
        return frame

    def request(self, message: P.Message, fds: tuple[int, ...] = ()) -> tuple[Any, list[int]]:
        """A well-formed request; returns the reply message (whose frame must address it) and its fds."""
        self.req += 1
        assert self.send(P.encode(message, self.req), fds), "the broker closed the connection"
        frame, got = self.recv()
        assert frame is not None, f"the broker closed the connection on a valid {message.TYPE.name}"
        assert frame.req == self.req
        return frame.message, got

    def ok(self, message: P.Message, fds: tuple[int, ...] = ()) -> Any:
        reply, got = self.request(message, fds=fds)
        for fd in got:
            os.close(fd)
        assert not isinstance(reply, P.Error), f"{message.TYPE.name} failed: {reply}"
        return reply

    def refused(self, message: P.Message, fds: tuple[int, ...] = ()) -> int:
        reply, got = self.request(message, fds=fds)
        for fd in got:
            os.close(fd)
        assert isinstance(reply, P.Error), f"{message.TYPE.name} was accepted: {reply!r}"
        assert isinstance(reply.message, str) and reply.message.strip()
        return reply.code


def expect_error_or_close(conn: Raw, packet: bytes, fds: tuple[int, ...] | list[int] = (),
                          code: int | None = IPC_ERROR) -> bool:
    """The broker answers `packet` with an ERROR (addressed to its request id when the header parses) or closes
    the connection. True when the connection is still usable."""
    frame = conn.ask(packet, fds)
    if frame is None:
        return False
    reply = frame.message
    assert isinstance(reply, P.Error), f"{packet[:16]!r}... was answered with {reply!r}"
    assert frame.req == P.peek_request_id(packet)
    assert isinstance(reply.message, str) and reply.message.strip(), "an error reply says what was wrong"
    if code is not None:
        assert reply.code == code, f"expected {code}, got {reply.code}: {reply.message}"
    return True


def settled_fd_count(broker: BrokerProc) -> int:
    """The broker's open fds, with one fresh connection open, after it has processed every earlier close.

    Two round trips: the broker handles a request only in a select pass after the one that accepted the
    connection, and every close that happened before the connect is reported no later than that pass.
    """
    with Raw(broker.socket) as c:
        for _ in range(2):
            reply = c.ok(P.BareTgid())
            assert reply == P.Pid(os.getpid())
        return broker.fd_count()


def free_capacity(broker: BrokerProc, device: int = 0) -> int:
    with Raw(broker.socket) as c:
        reply = c.ok(P.MemInfo(device))
        assert isinstance(reply, P.Mem) and reply.total == CAPACITY
        return int(reply.free)


def pipe_for_broker() -> tuple[int, int]:
    """(read end, write end); hand the write end to the broker, then `assert_released(read end)`."""
    r, w = os.pipe2(os.O_CLOEXEC)
    return r, w


def assert_released(r: int) -> None:
    """Once we closed our write end, EOF on the read end means the broker closed the copy it was sent."""
    try:
        ready, _, _ = select.select([r], [], [], HANG_GUARD)
        assert ready, "the broker still holds a pipe fd it was sent"
        assert os.read(r, 1) == b""
    finally:
        os.close(r)


def memfd_of(size: int, fill: bytes = b"") -> int:
    fd = rawsock.sealed_memfd(size)
    if fill:
        os.pwrite(fd, fill, 0)
    return fd


def export_values(token: int, size: int = MiB2, flags: int = NO_PID_CHECK, kind: int = 0) -> tuple[int, ...]:
    """EXPORT's fixed fields for a DEFAULT export on device 0: token, size, flags, share type, then whatever the
    format carries before the five prop fields (the exporter's server id: 0 here; last, the memory kind: 0 host,
    1 GPU), then the prop."""
    head = (token, size, flags, DEFAULT)
    n = len(LAYOUTS[Msg.EXPORT].fields)
    return (*head, *(0,) * (n - len(head) - len(PROP_FIELDS) - 1), kind, *PROP_FIELDS)


def charge(conn: Raw, size: int = MiB2, device: int = 0) -> int:
    reply = conn.ok(P.Charge(device, size))
    assert isinstance(reply, P.Token)
    return int(reply.hold)


def assert_serves(broker: BrokerProc) -> None:
    """Two real clients: malloc, map, write, export with a trustlist, import, map, read the same bytes."""
    exporter, importer = Actor(broker.env), Actor(broker.env)
    try:
        h, ret = exporter.call("rt.malloc_physical", MiB2, PROP, 0)
        assert ret == 0, exporter.last_err
        p, ret = exporter.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        assert ret == 0
        assert exporter.call("rt.map_mem", p, MiB2, 0, h, 0) == 0
        exporter.call("!write", p, 0x3C, MiB2)
        exporter.call("!write_bytes", p, b"still serving")
        _, _, p2 = share_and_map(exporter, importer, h, MiB2, DEFAULT)
        assert importer.call("!read", p2, 13) == b"still serving"
        assert importer.call("!sha256", p2, MiB2) == exporter.call("!sha256", p, MiB2)
    finally:
        exporter.close()
        importer.close()


def assert_healthy(broker: BrokerProc, baseline: int) -> None:
    """No fd kept from the test's connections, nothing charged, and real clients still served."""
    assert broker.alive(), "the broker died"
    assert settled_fd_count(broker) == baseline, "the broker kept file descriptors of closed connections"
    assert free_capacity(broker) == CAPACITY, "capacity charged by closed connections was not released"
    assert_serves(broker)
    assert settled_fd_count(broker) == baseline, "serving real clients left file descriptors behind"


@pytest.fixture
def baseline(broker: BrokerProc) -> int:
    return settled_fd_count(broker)


# ---------------------------------------------------------------- a positive control for the raw client


def test_raw_client_speaks_the_protocol(broker: BrokerProc, baseline: int) -> None:
    """The hand-made frames below are right: a raw export is imported by a real client, byte for byte."""
    with Raw(broker.socket) as c:
        assert c.ok(P.BareTgid()) == P.Pid(os.getpid())
        token = charge(c, 2 * MiB2)
        assert free_capacity(broker) == CAPACITY - 2 * MiB2
        fd = memfd_of(2 * MiB2, b"raw export")
        try:
            reply = c.ok(P.Export(*export_values(token, 2 * MiB2)), fds=(fd,))
        finally:
            os.close(fd)
        assert isinstance(reply, P.Exported) and len(reply.shareable) == 8
        shareable = int.from_bytes(reply.shareable, "little")
        listing = json.loads(c.ok(P.List(0)).page)
        assert [e["handle"] for e in listing["exports"]] == [f"{shareable:#018x}"]
        importer = Actor(broker.env)
        try:
            h, ret = importer.call("rt.mem_import_from_shareable_handle_v2", shareable, DEFAULT, 0)
            assert ret == 0, importer.last_err
            p, _ = importer.call("rt.reserve_mem_address", 2 * MiB2, 0, 0, 0)
            assert importer.call("rt.map_mem", p, 2 * MiB2, 0, h, 0) == 0
            assert importer.call("!read", p, 10) == b"raw export"
        finally:
            importer.close()
        assert c.ok(P.Release(token)) == P.Ok()
        assert c.refused(P.Release(token)) == BAD_HANDLE
    assert_healthy(broker, baseline)


# ---------------------------------------------------------------- malformed frames


GOOD_CHARGE = P.encode(P.Charge(0, MiB2), 0x1234)
REQUESTS = [m for m in Msg if m < 64 and LAYOUTS[m].fds == 0]


def _header(kind: int, length: int, req: int = 0x55, version: int = VERSION, magic: bytes = MAGIC) -> bytes:
    return HEADER.pack(magic, version, kind, req, length)


BAD_FRAMES = {
    "one_byte": b"V",
    "header_cut_short": GOOD_CHARGE[:11],
    "header_only": GOOD_CHARGE[:12],
    "body_cut_short": GOOD_CHARGE[:-3],
    "length_says_more": GOOD_CHARGE[:8] + struct.pack("<I", 13) + GOOD_CHARGE[12:],
    "length_says_less": GOOD_CHARGE[:8] + struct.pack("<I", 11) + GOOD_CHARGE[12:],
    "trailing_bytes": _header(Msg.CHARGE, 13, 0x66) + GOOD_CHARGE[12:] + b"\0",
    "bad_magic": b"XY" + GOOD_CHARGE[2:],
    "version_0": GOOD_CHARGE[:2] + b"\x00" + GOOD_CHARGE[3:],
    "version_1": GOOD_CHARGE[:2] + b"\x01" + GOOD_CHARGE[3:],  # the version before REMOTE_IMPORTED's port
    "version_255": GOOD_CHARGE[:2] + b"\xff" + GOOD_CHARGE[3:],
    "bare_tgid_version_1": P.encode(P.BareTgid(), 0x77)[:2] + b"\x01" + P.encode(P.BareTgid(), 0x77)[3:],
    "unknown_type_0": _header(0, 0),
    "unknown_type_10": _header(10, 0),
    "unknown_type_200": _header(200, 0),
    "set_pids_ragged_tail": _header(Msg.SET_PIDS, 12) + struct.pack("<QB", 1, 1) + b"\1\0\0",
    "set_pids_over_4096": _header(Msg.SET_PIDS, 9 + 4097 * 4) + struct.pack("<QB", 1, 1) + bytes(4097 * 4),
    "import_short": _header(Msg.IMPORT, 9) + struct.pack("<QB", 1, 1),
}


@BOTH_PATHS
@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_malformed_frame_gets_an_error_reply(broker: BrokerProc, baseline: int, name: str) -> None:
    packet = BAD_FRAMES[name]
    with pytest.raises(ProtocolError):
        P.decode(packet)
    with Raw(broker.socket) as c:
        if expect_error_or_close(c, packet):
            assert c.ok(P.BareTgid()) == P.Pid(os.getpid()), "the connection kept working after the error"
    assert_healthy(broker, baseline)


def test_many_malformed_frames_on_one_connection(broker: BrokerProc, baseline: int) -> None:
    with Raw(broker.socket) as c:
        for name, packet in BAD_FRAMES.items():
            assert expect_error_or_close(c, packet), f"{name}: the broker closed a connection it answered before"
        charge(c)
        assert free_capacity(broker) == CAPACITY - MiB2
    assert_healthy(broker, baseline)


@BOTH_PATHS
@pytest.mark.parametrize("size", [MAX_FRAME + 1, 70_000, 200_000])
def test_oversized_frame(broker: BrokerProc, baseline: int, size: int) -> None:
    """More than 64 KiB, with a header whose length even agrees: refused, and a fd riding on it is closed."""
    packet = _header(Msg.LISTING, size - HEADER.size, 0x99) + b"{" * (size - HEADER.size)
    with Raw(broker.socket) as c:
        with contextlib.suppress(OSError):
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * size)
        r, w = pipe_for_broker()
        try:
            alive = expect_error_or_close(c, packet, (w,))
        finally:
            os.close(w)
        assert_released(r)
        if alive:
            alive = expect_error_or_close(c, _header(Msg.CHARGE, size - HEADER.size, 0x9A) + bytes(size - 12))
        if alive:
            assert c.ok(P.BareTgid()) == P.Pid(os.getpid())
    assert_healthy(broker, baseline)


@pytest.mark.parametrize("kind", [m for m in Msg if m >= 64], ids=lambda m: m.name)
def test_reply_sent_as_a_request_is_refused(broker: BrokerProc, baseline: int, kind: Msg) -> None:
    layout = LAYOUTS[kind]
    values = tuple(bytes(n) if code == "s" else 1 for code, n in _codes(layout.fixed.format))
    packet = P.encode(layout.build(values, b""), 0x4242)
    r, w = pipe_for_broker()
    try:
        with Raw(broker.socket) as c:
            fds = (w,) * layout.fds
            alive = expect_error_or_close(c, packet, fds)
            os.close(w)
            w = -1
            assert_released(r)
            if alive:
                assert c.ok(P.BareTgid()) == P.Pid(os.getpid())
    finally:
        if w >= 0:
            os.close(w)
    assert_healthy(broker, baseline)


def _codes(fmt: str) -> list[tuple[str, int]]:
    out = []
    for count, code in re.findall(r"(\d*)([a-zA-Z])", fmt.lstrip("<")):
        n = int(count or 1)
        out.extend([(code, n)] if code == "s" else [(code, 1)] * n)
    return out


def _random_packet(rng: random.Random) -> bytes:
    style = rng.randrange(4)
    if style == 0:  # noise
        return rng.randbytes(rng.randrange(1, 300))
    kind = rng.choice([*range(256)] if style == 1 else [int(m) for m in Msg])
    body = rng.randbytes(rng.choice([0, 1, 4, 8, 9, 12, 17, 24, 41, 43, 44, 45, rng.randrange(200)]))
    version = VERSION if rng.random() < 0.9 else rng.randrange(256)
    length = len(body) if rng.random() < 0.8 else rng.randrange(1 << 32)
    if style == 3:  # a valid request with one byte changed
        kind = rng.choice(REQUESTS)
        values = tuple(rng.randbytes(n) if code == "s" else rng.randrange(0, 200) for code, n in
                       _codes(LAYOUTS[kind].fixed.format))
        good = P.encode(LAYOUTS[kind].build(values, ()), rng.randrange(1 << 32))
        at = rng.randrange(len(good))
        return good[:at] + bytes([rng.randrange(256)]) + good[at + 1 :]
    return _header(kind, length, rng.randrange(1 << 32), version) + body


def test_seeded_random_packets(broker: BrokerProc, baseline: int) -> None:
    """Hundreds of random packets: each gets a reply addressed to its request id (an ERROR for every packet
    the protocol refuses), or the connection is closed; then the broker is as it was."""
    rng = random.Random(20240611)
    conn = Raw(broker.socket)
    errors = closes = 0
    try:
        for i in range(400):
            packet = _random_packet(rng)
            try:
                P.decode(packet)
                valid = True
            except ProtocolError:
                valid = False
            frame = conn.ask(packet)
            if frame is None:
                closes += 1
                conn.close()
                conn = Raw(broker.socket)
                continue
            assert frame.req == P.peek_request_id(packet), f"packet {i}: reply addressed to {frame.req}"
            reply = frame.message
            if not valid:
                assert isinstance(reply, P.Error) and reply.code == IPC_ERROR, f"packet {i}: {reply!r}"
                errors += 1
            else:
                assert isinstance(reply, (P.Error, P.Ok, P.Token, P.Mem, P.Pid, P.Listing)), f"{reply!r}"
            if i % 50 == 49:
                assert conn.ok(P.BareTgid()) == P.Pid(os.getpid()), f"packet {i}: connection stopped working"
        assert errors > 300, "the random packets were not malformed enough to test anything"
        assert closes < 400
    finally:
        conn.close()
    assert_healthy(broker, baseline)


# ---------------------------------------------------------------- file descriptors where none belong


@BOTH_PATHS
@pytest.mark.parametrize(
    ("kind", "values"),
    [(Msg.BARE_TGID, ()), (Msg.CHARGE, (0, MiB2)), (Msg.MEM_INFO, (0,)), (Msg.LIST, (0,)),
     (Msg.RELEASE, (1,)), (Msg.IMPORT, (1, 1, bytes(32)))],
    ids=lambda v: v.name if isinstance(v, Msg) else "",
)
def test_fd_attached_to_a_request_that_takes_none(broker: BrokerProc, baseline: int, kind: Msg,
                                                  values: tuple) -> None:
    with Raw(broker.socket) as c:
        r, w = pipe_for_broker()
        try:
            alive = expect_error_or_close(c, P.encode(LAYOUTS[kind].build(values), 0x321), (w,))
        finally:
            os.close(w)
        assert_released(r)
        if alive:
            assert c.ok(P.BareTgid()) == P.Pid(os.getpid())
    assert free_capacity(broker) == CAPACITY, "a refused CHARGE charged the device anyway"
    assert_healthy(broker, baseline)


@BOTH_PATHS
def test_too_many_fds(broker: BrokerProc, baseline: int) -> None:
    """Eight fds (more than the broker's control buffer takes) on a BARE_TGID: all of them are let go."""
    with Raw(broker.socket) as c:
        pipes = [pipe_for_broker() for _ in range(8)]
        try:
            alive = expect_error_or_close(c, P.encode(P.BareTgid(), 0x808), [w for _, w in pipes])
        finally:
            for _, w in pipes:
                os.close(w)
        for r, _ in pipes:
            assert_released(r)
        if alive:
            assert c.ok(P.BareTgid()) == P.Pid(os.getpid())
    assert_healthy(broker, baseline)


def _export_frame(token: int, size: int = MiB2, flags: int = NO_PID_CHECK, req: int = 0xE0, kind: int = 0) -> bytes:
    return P.encode(P.Export(*export_values(token, size, flags, kind)), req)


@BOTH_PATHS
def test_export_without_fd(broker: BrokerProc, baseline: int) -> None:
    with Raw(broker.socket) as c:
        token = charge(c)
        assert expect_error_or_close(c, _export_frame(token)), "the broker dropped a client for a bad EXPORT"
        fd = memfd_of(MiB2)
        try:  # nothing was half-exported: the allocation still exports, once
            reply = c.ok(P.Export(*export_values(token)), fds=(fd,))
            assert isinstance(reply, P.Exported)
            assert c.refused(P.Export(*export_values(token)), fds=(fd,)) == PARAM
        finally:
            os.close(fd)
    assert_healthy(broker, baseline)


@BOTH_PATHS
def test_export_with_three_fds(broker: BrokerProc, baseline: int) -> None:
    with Raw(broker.socket) as c:
        token = charge(c)
        fd = memfd_of(MiB2)
        (r1, w1), (r2, w2) = pipe_for_broker(), pipe_for_broker()
        try:
            alive = expect_error_or_close(c, _export_frame(token), (fd, w1, w2))
        finally:
            os.close(w1)
            os.close(w2)
        assert_released(r1)
        assert_released(r2)
        assert alive, "the broker dropped a client for a bad EXPORT"
        try:
            assert isinstance(c.ok(P.Export(*export_values(token)), fds=(fd,)), P.Exported)
        finally:
            os.close(fd)
    assert_healthy(broker, baseline)


def test_export_of_a_pipe_with_a_valid_token(broker: BrokerProc, baseline: int) -> None:
    """An fd that is not the allocation's memory (a pipe, a memfd of another size) is refused with 107000."""
    with Raw(broker.socket) as c:
        token = charge(c)
        r, w = pipe_for_broker()
        try:
            assert expect_error_or_close(c, _export_frame(token), (w,), code=PARAM)
        finally:
            os.close(w)
        assert_released(r)
        wrong = memfd_of(2 * MiB2)
        try:
            assert expect_error_or_close(c, _export_frame(token), (wrong,), code=PARAM)
            assert expect_error_or_close(c, _export_frame(token, size=2 * MiB2), (wrong,), code=PARAM)
        finally:
            os.close(wrong)
        assert c.ok(P.List(0)).page and not json.loads(c.ok(P.List(0)).page)["exports"]
    assert_healthy(broker, baseline)


@pytest.mark.parametrize("mode", [os.O_RDONLY, os.O_WRONLY])
def test_export_of_the_right_memfd_open_read_only_or_write_only(broker: BrokerProc, baseline: int, mode: int) -> None:
    """The memory reopened through /proc without write (or read) access passes every seal check, but importers
    map it read-write: refused with 107000, so no importer gets an fd it cannot map."""
    with Raw(broker.socket) as c:
        token = charge(c)
        good = memfd_of(MiB2)
        reopened = os.open(f"/proc/self/fd/{good}", mode | os.O_CLOEXEC)
        try:
            frame = c.ask(_export_frame(token), (reopened,))
            assert frame is not None and isinstance(frame.message, P.Error), frame
            assert frame.message.code == PARAM and "read-write" in frame.message.message
            assert isinstance(c.ok(P.Export(*export_values(token)), fds=(good,)), P.Exported)
        finally:
            os.close(reopened)
            os.close(good)
    assert_healthy(broker, baseline)


def test_export_must_be_of_the_memory_kind_charged(broker: BrokerProc, baseline: int) -> None:
    """The broker cannot look inside a GPU export's fd, so host memory must not pass as GPU memory (a pipe would then
    reach importers), nor GPU memory as host memory: the kind is the one the allocation was charged as."""
    with Raw(broker.socket) as c:
        host = charge(c)
        gpu = int(c.ok(P.ChargeGpu(0, MiB2)).hold)
        r, w = pipe_for_broker()
        try:
            assert expect_error_or_close(c, _export_frame(host, kind=1), (w,), code=PARAM)
        finally:
            os.close(w)
        assert_released(r)
        memfd = memfd_of(MiB2)
        try:
            assert expect_error_or_close(c, _export_frame(gpu, kind=0), (memfd,), code=PARAM)
            assert isinstance(c.ok(P.Export(*export_values(host)), fds=(memfd,)), P.Exported)  # the right kind
        finally:
            os.close(memfd)
        assert len(json.loads(c.ok(P.List(0)).page)["exports"]) == 1
    assert_healthy(broker, baseline)


def test_export_with_another_connections_token(broker: BrokerProc, baseline: int) -> None:
    """Tokens belong to the connection that was given them: another client cannot export (or free) them."""
    with Raw(broker.socket) as owner, Raw(broker.socket) as thief:
        token = charge(owner)
        fd = memfd_of(MiB2)
        try:
            assert expect_error_or_close(thief, _export_frame(token), (fd,), code=BAD_HANDLE)
            assert thief.refused(P.Release(token)) == BAD_HANDLE
            assert thief.refused(P.Revoke(token)) == BAD_HANDLE
            reply = owner.ok(P.Export(*export_values(token)), fds=(fd,))
            assert isinstance(reply, P.Exported)
        finally:
            os.close(fd)
    assert_healthy(broker, baseline)


def test_importer_cannot_revoke_the_exporters_handle(broker: BrokerProc, baseline: int) -> None:
    """REVOKE is the exporter's act (it frees the allocation): an importer sending REVOKE with its own import token
    must not take the handle away from everybody else."""
    exporter = Actor(broker.env)
    try:
        h, ret = exporter.call("rt.malloc_physical", MiB2, PROP, 0)
        assert ret == 0
        shareable, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, NO_PID_CHECK, DEFAULT)
        assert ret == 0
        with Raw(broker.socket) as importer:
            reply, got = importer.request(P.Import(shareable, DEFAULT, bytes(32)))
            assert isinstance(reply, P.Imported) and len(got) == 1, reply
            os.close(got[0])
            import_token = int(reply.hold)
            reply, got = importer.request(P.Revoke(import_token))
            assert not got
            assert isinstance(reply, P.Error) and reply.code == 207006, reply  # only the exporter revokes
            listing = json.loads(importer.ok(P.List(0)).page)
            assert [e["handle"] for e in listing["exports"]] == [f"{shareable:#018x}"], "an importer revoked it"
        other = Actor(broker.env)
        try:
            h2, ret = other.call("rt.mem_import_from_shareable_handle_v2", shareable, DEFAULT, 0)
            assert ret == 0, f"an importer's REVOKE took the handle away: {other.last_err}"
            assert other.call("rt.free_physical", h2) == 0
        finally:
            other.close()
    finally:
        exporter.close()
    assert_healthy(broker, baseline)


# ---------------------------------------------------------------- connections that say little


def test_client_that_connects_and_sends_nothing(broker: BrokerProc, baseline: int) -> None:
    for _ in range(3):
        Raw(broker.socket).close()
    assert_healthy(broker, baseline)


def test_client_that_leaves_without_reading_its_reply(broker: BrokerProc, baseline: int) -> None:
    c = Raw(broker.socket)
    charge(c)
    assert c.send(P.encode(P.Charge(0, MiB2), 1))
    assert c.send(P.encode(P.List(0), 2))
    c.close()
    assert_healthy(broker, baseline)


def test_fifty_connections_opened_and_closed(broker: BrokerProc, baseline: int) -> None:
    conns = [Raw(broker.socket) for _ in range(50)]
    try:
        for i, c in enumerate(conns):
            if i % 2:
                charge(c)
            if i % 3 == 0:
                assert expect_error_or_close(c, b"nonsense")
        assert free_capacity(broker) == CAPACITY - 25 * MiB2
        assert broker.fd_count() >= baseline + 49  # one socket each (plus a pidfd where the kernel has them)
    finally:
        for c in conns:
            c.close()
    assert_healthy(broker, baseline)


def test_capacity_cannot_be_overcharged_by_a_raw_client(broker: BrokerProc, baseline: int) -> None:
    with Raw(broker.socket) as c:
        assert c.refused(P.Charge(0, CAPACITY + 1)) == NO_MEMORY
        assert c.refused(P.Charge(8, MiB2)) == BAD_DEVICE
        assert c.refused(P.MemInfo(0xFFFFFFFF)) == BAD_DEVICE
        charge(c, CAPACITY)
        assert c.refused(P.Charge(0, 1)) == NO_MEMORY
        assert free_capacity(broker) == 0
    assert_healthy(broker, baseline)


def test_gpu_charges_are_recorded_not_capped_and_released_with_the_connection(broker: BrokerProc,
                                                                              baseline: int) -> None:
    """CHARGE_GPU: GPU memory is the driver's to cap; the broker records it (ls) and frees the record on close."""
    with Raw(broker.socket) as c:
        assert c.refused(P.ChargeGpu(1024, MiB2)) == BAD_DEVICE
        token = int(c.ok(P.ChargeGpu(3, 4 * CAPACITY)).hold)
        assert free_capacity(broker) == CAPACITY  # not the node's host-backed device memory
        listing = json.loads(c.ok(P.List(0)).page)
        assert listing["gpu_used"] == {"3": 4 * CAPACITY}
        c.ok(P.Release(token))
        assert json.loads(c.ok(P.List(0)).page)["gpu_used"] == {}
        c.ok(P.ChargeGpu(0, MiB2))
    with Raw(broker.socket) as c:
        c.ok(P.BareTgid())  # a second round trip: every earlier close has been processed (settled_fd_count)
        assert json.loads(c.ok(P.List(0)).page)["gpu_used"] == {}
    assert_healthy(broker, baseline)


# ---------------------------------------------------------------- the listing always fits a frame


def test_listing_of_exports_with_full_trustlists(broker: BrokerProc, baseline: int) -> None:
    """`vmmshare ls --json` with three exports whose trustlists hold 4096 pids each (about 90 kB of JSON): every
    row comes back whole, however the broker pages it."""
    actor = Actor(broker.env)
    try:
        handles = []
        for i in range(3):
            h, ret = actor.call("rt.malloc_physical", MiB2, PROP, 0)
            assert ret == 0
            shareable, ret = actor.call("rt.mem_export_to_shareable_handle_v2", h, 0, DEFAULT)
            assert ret == 0
            pids = list(range(1_000_000 + 5000 * i, 1_000_000 + 5000 * i + 4096))
            assert actor.call("rt.mem_set_pid_to_shareable_handle_v2", shareable, DEFAULT, pids) == 0, actor.last_err
            handles.append(f"{shareable:#018x}")
        out = subprocess.run([sys.executable, "-m", "vmmshare.cli", "ls", "--json"], env=broker.env,
                             capture_output=True, text=True, timeout=HANG_GUARD)
        assert out.returncode == 0, out.stderr[-2000:]
        listing = json.loads(out.stdout)
        rows = {e["handle"]: e for e in listing["exports"]}
        assert sorted(rows) == sorted(handles)
        for i, handle in enumerate(handles):
            assert rows[handle]["trustlist"] == list(range(1_000_000 + 5000 * i, 1_000_000 + 5000 * i + 4096))
            assert rows[handle]["owner_pid"] == actor.pid
    finally:
        actor.close()
    assert_healthy(broker, baseline)


# ---------------------------------------------------------------- import checks a raw client would get past


def test_a_fabric_export_cannot_be_imported_as_a_default_handle(broker: BrokerProc, baseline: int) -> None:
    """A FABRIC export made with DISABLE_PID_VALIDATION is named on the node by its 64-bit value (bytes 16-23). A raw
    client in another process that sends that value as a DEFAULT handle, with no secret, must be refused (107000) and
    get no fd: the FABRIC secret would mean nothing otherwise. (The runtime refuses this before it asks the broker;
    a raw client does not go through the runtime.)"""
    exporter = Actor(broker.env)
    try:
        h, ret = exporter.call("rt.malloc_physical", MiB2, PROP, 0)
        assert ret == 0, exporter.last_err
        fabric, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, NO_PID_CHECK, FABRIC)
        assert ret == 0, exporter.last_err
        assert len(fabric) == 128
        value = int.from_bytes(fabric[16:24], "little")
        with Raw(broker.socket) as thief:
            reply, got = thief.request(P.Import(value, DEFAULT, bytes(32)))
            for fd in got:
                os.close(fd)
            assert isinstance(reply, P.Error) and reply.code == PARAM, reply
            assert not got, "the broker handed over the memory"
            reply, got = thief.request(P.Import(value, FABRIC, bytes(32)))  # as FABRIC, without the secret
            for fd in got:
                os.close(fd)
            assert isinstance(reply, P.Error) and reply.code == BAD_HANDLE and not got, reply
            reply, got = thief.request(P.Import(value, FABRIC, bytes(fabric[64:96])))  # a positive control
            for fd in got:
                os.close(fd)
            assert isinstance(reply, P.Imported) and len(got) == 1, reply
            assert thief.ok(P.Release(reply.hold)) == P.Ok()
    finally:
        exporter.close()
    assert_healthy(broker, baseline)


@pytest.mark.parametrize("share_type", [DEFAULT, FABRIC])
def test_the_exporting_connection_imports_its_own_handle(broker: BrokerProc, baseline: int, share_type: int) -> None:
    """Rule 13 at the broker: the exporting client imports its own handle (exported with pid validation and no
    trustlist) and gets the same memory; another connection, even of the same process, is judged by the
    trustlist (207006); once the exporter releases its allocation, its own import is refused too (107017) and the
    memory it imported stays until that hold goes."""
    with Raw(broker.socket) as c, Raw(broker.socket) as again:
        token = charge(c)
        fd = memfd_of(MiB2, b"own memory")
        try:
            values = (token, MiB2, 0, share_type, *export_values(token)[4:])
            reply = c.ok(P.Export(*values), fds=(fd,))
            assert isinstance(reply, P.Exported)
            raw = reply.shareable
            value = int.from_bytes(raw[16:24] if share_type == FABRIC else raw, "little")
            secret = bytes(raw[64:96]) if share_type == FABRIC else bytes(32)
            reply, got = c.request(P.Import(value, share_type, secret))
            assert isinstance(reply, P.Imported), reply
            assert len(got) == 1
            try:
                assert os.fstat(got[0]).st_ino == os.fstat(fd).st_ino, "the exporter got other memory than its own"
                assert os.pread(got[0], 10, 0) == b"own memory"
            finally:
                os.close(got[0])
        finally:
            os.close(fd)
        other, fds = again.request(P.Import(value, share_type, secret))
        for f in fds:
            os.close(f)
        assert isinstance(other, P.Error) and other.code == NO_PERMISSION, other
        listing = json.loads(c.ok(P.List(0)).page)
        assert [e["importer_count"] for e in listing["exports"]] == [1]
        c.ok(P.Release(token))  # the exporter frees its allocation: revoked
        late, fds = c.request(P.Import(value, share_type, secret))
        for f in fds:
            os.close(f)
        assert isinstance(late, P.Error) and late.code == BAD_HANDLE, late
        c.ok(P.Release(reply.hold))
    assert_healthy(broker, baseline)
