"""The hot frames (IMPORT, IMPORTED, RELEASE, OK: what every import and free exchanges) read and written straight
from their fields: the same bytes as the full codec, and the broker's replies on that path the same bytes as the
full path's, refusals included, with the same checks (credentials, trustlist, share type, holds)."""

from __future__ import annotations

import fcntl
import itertools
import os
import random
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vmmshare import constants as C
from vmmshare.broker.identity import identity_of_pid
from vmmshare.broker.server import Broker, Conn
from vmmshare.config import Config
from vmmshare.sockets import packets
from vmmshare.wire import local as P

MiB2 = 2 << 20
HOT = [
    (P.HOT_IMPORT, P.Import(0xDEADBEEFCAFEF00D, 2, bytes(range(32)))),
    (P.HOT_IMPORT, P.Import(0, 255, bytes(32))),
    (P.HOT_IMPORTED, P.Imported(2**64 - 1, MiB2, 1, 0, 0, 5, 1, -1)),
    (P.HOT_IMPORTED, P.Imported(1, 2**40, 0, 255, 255, 255, 255, 2**31 - 1)),
    (P.HOT_RELEASE, P.Release(0x1122334455667788)),
    (P.HOT_OK, P.Ok()),
]


@pytest.mark.parametrize(("hot", "message"), HOT, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("req", [1, 0xFFFFFFFF])
def test_a_hot_frame_is_the_full_codecs_frame_both_ways(hot: P.HotFrame, message: P.Message, req: int) -> None:
    layout = P.LAYOUTS[hot.kind]
    packed = hot.struct.pack(hot.start, req, hot.length, *layout.values(message))
    assert packed == P.encode(message, req)
    assert hot.size == len(packed)
    assert hot.struct.unpack(packed) == (hot.start, req, hot.length, *layout.values(message))
    assert P.decode(packed, hot.fds) == P.Frame(req, message)


def test_no_other_frame_passes_for_a_hot_one() -> None:
    """A frame of another type of the same size (REVOKE is RELEASE's size) differs in its constant start."""
    for hot in (P.HOT_IMPORT, P.HOT_RELEASE, P.HOT_IMPORTED, P.HOT_OK):
        for layout in P.LAYOUTS.values():
            if layout.kind != hot.kind and layout.whole.size == hot.size:
                other = layout.whole.pack(P.MAGIC, P.VERSION, layout.kind, 1, layout.fixed.size,
                                          *layout.fixed.unpack(bytes(layout.fixed.size)))
                assert hot.struct.unpack(other)[0] != hot.start


# ---------------------------------------------------------------- the broker's two paths


class Side:
    """An in-process broker whose books are seeded (the same hold ids and handle values as its twin's), a client
    that exported a 2 MiB memfd to it, and an importer connected over a real SEQPACKET pair."""

    def __init__(self, tmp: Path, validate: bool) -> None:
        seeded = random.Random(7)
        self.broker = Broker(tmp / "s", Config.from_env(broker=True))
        ledger = self.broker.ledger
        ledger.random_bytes = seeded.randbytes
        ledger._hold_ids = itertools.count(1 << 40)
        me = os.getpid()
        self.exporter = ledger.connect(me, os.getuid(), identity_of_pid(me))
        self.peer, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        packets.pass_credentials(mine)
        mine.setblocking(False)
        self.conn = Conn(mine, -1, ledger.connect(me, os.getuid(), identity_of_pid(me)))
        self.broker.conns[mine.fileno()] = self.conn
        token = ledger.handle(self.exporter, P.Charge(0, MiB2))[0]
        assert isinstance(token, P.Token)
        fd = os.memfd_create("hot", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        os.ftruncate(fd, MiB2)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        flags = 0 if validate else C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION
        exported = ledger.handle(self.exporter, P.Export(token.hold, MiB2, flags, 1, 0, 0, 0, 0, 0, 1, 0, ()), fd)[0]
        assert isinstance(exported, P.Exported)
        self.value = int.from_bytes(exported.shareable, "little")

    def ask(self, frame: bytes, full: bool) -> tuple[bytes, int]:
        """The reply to `frame` (and the size of the fd it brought, -1: none), served by `_readable` (which takes the
        hot path for a hot frame) or by `_serve`, the full path."""
        self.peer.send(frame)
        if full:
            data, fds, truncated, sender = packets.recv_request(self.conn.sock, packets.DONTWAIT)
            self.broker._serve(self.conn, data, fds, truncated, sender)
        else:
            self.broker._readable(self.conn)
        reply, fds, _ = packets.recv_packet(self.peer)
        size = -1
        for fd in fds:
            size = os.fstat(fd).st_size
            os.close(fd)
        return reply, size

    def close(self) -> None:
        self.broker.close()
        self.peer.close()
        self.conn.sock.close()


@pytest.fixture
def twins(tmp_path: Path) -> Iterator[Callable[[bool], tuple[Side, Side]]]:
    made: list[Side] = []

    def make(validate: bool) -> tuple[Side, Side]:
        made.extend((Side(tmp_path / "hot", validate), Side(tmp_path / "full", validate)))
        return made[-2], made[-1]

    yield make
    for side in made:
        side.close()


def frame(message: P.Message, req: int) -> bytes:
    return P.encode(message, req)


def test_imports_and_releases_get_the_full_paths_bytes(twins: Callable[[bool], tuple[Side, Side]]) -> None:
    hot, full = twins(False)
    assert hot.value == full.value
    value = hot.value
    script: list[bytes] = [
        frame(P.Import(value, 1, bytes(32)), 1),  # imported: hold 1<<40 + 1 and the 2 MiB fd
        frame(P.Import(value, 1, bytes(32)), 2),  # a second hold
        frame(P.Import(value, 2, bytes(32)), 3),  # the wrong share type: 107000
        frame(P.Import(value ^ 1, 1, bytes(32)), 4),  # unknown: 107017
        frame(P.Release((1 << 40) + 2), 5),  # ok
        frame(P.Release((1 << 40) + 2), 6),  # released already: 107017
        frame(P.Release(0), 7),  # no such hold
        frame(P.Release(1 << 40), 8),  # the exporter's charge: not this connection's
        frame(P.Revoke((1 << 40) + 3), 9),  # RELEASE's size, another type: served in full
        b"VB\x02\x07" + frame(P.Import(value, 1, bytes(32)), 10)[4:],  # IMPORT's size, version 2
        b"VB\x01\x07" + frame(P.Import(value, 1, bytes(32)), 11)[4:8] + b"\x28\0\0\0" + bytes(41),  # bad length
        frame(P.Release((1 << 40) + 1), 0xFFFFFFFF),  # ok: the first import goes
    ]
    replies = []
    for packet in script:
        got = hot.ask(packet, full=False)
        assert got == full.ask(packet, full=True), packet.hex()
        replies.append(got)
    kinds = [P.decode(reply, int(size >= 0)).message for reply, size in replies]
    assert isinstance(kinds[0], P.Imported) and replies[0][1] == MiB2
    assert [type(k).__name__ for k in kinds[2:8]] == ["Error", "Error", "Ok", "Error", "Error", "Error"]
    assert isinstance(kinds[-1], P.Ok)
    assert hot.broker.ledger.holds.keys() == full.broker.ledger.holds.keys()
    assert hot.conn.client.holds == full.conn.client.holds == set()


def test_the_trustlist_and_the_sender_are_checked_on_the_hot_path(twins: Callable[[bool], tuple[Side, Side]]) -> None:
    hot, full = twins(True)
    packet = frame(P.Import(hot.value, 1, bytes(32)), 1)
    got = hot.ask(packet, full=False)
    assert got == full.ask(packet, full=True)
    refusal = P.decode(got[0]).message
    assert isinstance(refusal, P.Error) and refusal.code == C.ACL_ERROR_RT_NO_PERMISSION
    # a request sent by another process than the connection's: refused on either path, the hold untouched
    hot.conn.client.pid = full.conn.client.pid = os.getppid()
    got = hot.ask(frame(P.Release(1 << 40), 2), full=False)
    assert got == full.ask(frame(P.Release(1 << 40), 2), full=True)
    refusal = P.decode(got[0]).message
    assert isinstance(refusal, P.Error) and refusal.code == C.ACL_ERROR_RT_NO_PERMISSION
    assert not hot.broker.ledger.holds.keys() ^ full.broker.ledger.holds.keys()
