"""The hot frames (IMPORT, IMPORTED, RELEASE, OK: what every import and free exchanges) read and written straight
from their fields: the same bytes as the full codec, and the broker's replies on that path the same bytes as the
full path's, refusals included, with the same checks (credentials, trustlist, share type, holds)."""

from __future__ import annotations

import fcntl
import itertools
import os
import random
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vmmshare import constants as C
from vmmshare.broker.identity import identity_of_pid
from vmmshare.broker.server import Broker, Conn
from vmmshare.client.connection import BrokerClient
from vmmshare.config import Config
from vmmshare.errors import AclError
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
        b"VB\x01\x07" + frame(P.Import(value, 1, bytes(32)), 10)[4:],  # IMPORT's size, version 1
        b"VB\x02\x07" + frame(P.Import(value, 1, bytes(32)), 11)[4:8] + b"\x28\0\0\0" + bytes(41),  # bad length
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


# ---------------------------------------------------------------- the client's side


@pytest.fixture
def wired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BrokerClient, socket.socket]]:
    """A BrokerClient whose connection is one end of a SEQPACKET pair (no broker: the test answers), and the other
    end; nothing at the socket path, so a reconnection fails at once."""
    monkeypatch.setenv("VMMSHARE_SOCKET", str(tmp_path / "none.sock"))
    client = BrokerClient(Config.from_env(), autostart=False)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client._sock = mine
    yield client, theirs
    client.close()
    theirs.close()


def answering(theirs: socket.socket, reply: Callable[[P.Frame], tuple[bytes, tuple[int, ...]]]) -> threading.Thread:
    """A thread that reads one request on `theirs` and answers it with what `reply` makes of it."""

    def serve() -> None:
        data, fds, _ = packets.recv_packet(theirs)
        packets.close_fds(fds)
        frame, attached = reply(P.decode(data))
        packets.send_packet(theirs, frame, attached)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def test_the_client_reads_an_imported_reply_from_its_fields(wired: tuple[BrokerClient, socket.socket]) -> None:
    client, theirs = wired
    fd = os.memfd_create("hot", os.MFD_CLOEXEC)
    asked: list[P.Frame] = []

    def reply(request: P.Frame) -> tuple[bytes, tuple[int, ...]]:
        asked.append(request)
        return P.encode(P.Imported(77, MiB2, 0, 0, 0, 5, 1, 3), request.req), (fd,)

    thread = answering(theirs, reply)
    got = client.import_handle(0xABCDEF, 1, b"")
    thread.join()
    os.close(fd)
    assert asked[0].message == P.Import(0xABCDEF, 1, bytes(32))
    prop = got.prop
    assert (got.size, got.gpu, prop.mem_attr, prop.location.type, prop.location.id) == (MiB2, False, 5, 1, 3)
    assert os.fstat(got.fd).st_size == 0 and got.fd != fd
    os.close(got.fd)
    assert client._holds[got.node_ref] == 77
    # and its release: RELEASE of hold 77, answered OK
    thread = answering(theirs, lambda request: (asked.append(request) or P.encode(P.Ok(), request.req), ()))
    client.release(got.node_ref)
    thread.join()
    assert asked[1].message == P.Release(77) and got.node_ref not in client._holds


@pytest.mark.parametrize(("answer", "error", "kept"), [
    (lambda req: (P.encode(P.Error(207006, "not trusted"), req), ()), "not trusted", True),
    (lambda req: (P.encode(P.Ok(), req), ()), "OK in reply to IMPORT", False),
    (lambda req: (P.encode(P.Imported(1, MiB2, 0, 0, 0, 5, 1, 0), req ^ 1), (0,)), "reply to request", False),
    (lambda req: (P.encode(P.Imported(1, MiB2, 0, 0, 0, 5, 1, 0), req), ()), "file descriptor", False),
    (lambda req: (P.encode(P.Imported(1, MiB2, 0, 0, 0, 5, 1, 0), req)[:-1], (0,)), "its header says", False),
], ids=["refused", "wrong-type", "wrong-request", "no-fd", "short"])
def test_a_reply_that_is_not_the_hot_frame_gets_the_full_checks(
    wired: tuple[BrokerClient, socket.socket], answer: Callable[[int], tuple[bytes, tuple[int, ...]]], error: str,
    kept: bool,
) -> None:
    client, theirs = wired
    before = set(os.listdir("/proc/self/fd"))
    thread = answering(theirs, lambda request: answer(request.req))
    with pytest.raises(AclError, match=error):
        client.import_handle(5, 1, b"")
    thread.join()
    assert (client._sock is not None) == kept  # a refusal keeps the connection; a broken reply drops it
    assert not client._holds
    assert set(os.listdir("/proc/self/fd")) <= before  # every fd a reply brought is closed (and a dropped socket)


def test_values_that_do_not_fit_an_import_frame_are_the_codecs_error(wired: tuple[BrokerClient, socket.socket]) -> None:
    client, _ = wired
    for shareable, share_type, secret in ((1 << 64, 1, b""), (-1, 1, b""), (1, 256, b""), (1, 1, bytes(33))):
        with pytest.raises(P.ProtocolError):
            client.import_handle(shareable, share_type, secret)
    assert client._sock is not None and not client._holds
