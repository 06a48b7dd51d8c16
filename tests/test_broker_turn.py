"""A turn of the broker's loop with one ready connection (`Broker._one`) keeps the same books as the general turn
(`Broker._turn`'s queues): the process's finish time, its user's virtual time and the debt past the quantum
(docs/security.md, T9), turn after turn; and neither turn keeps books for a process, or a user, whose last
connection closed while it was served (the commonest turn of all when a process exits)."""

from __future__ import annotations

import os
import selectors
import socket
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vmmshare.broker import server
from vmmshare.broker.identity import identity_of_pid
from vmmshare.broker.server import QUANTUM, Broker, Conn
from vmmshare.config import Config
from vmmshare.wire import local as P

OTHER_UID = 0x7FFF0000  # a user with no connection, whose debt makes the loop take the general turn


class _Clock:
    """server.py's `time`, moved on only by the requests served."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def _books(broker: Broker, uid: int) -> tuple[Any, ...]:
    return dict(broker.finish.get(uid, {})), broker.vclock.get(uid), broker.debt.get(uid)


@pytest.mark.parametrize("costs", [[1e-4, 2e-4, 3e-5], [7e-4, 1e-4, 1e-4, 9e-4], [QUANTUM, 2 * QUANTUM, 0.0]])
def test_a_turn_of_one_connection_keeps_the_books_the_general_turn_keeps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, costs: list[float]) -> None:
    clock = _Clock()
    monkeypatch.setattr(server, "time", clock)
    sides = []
    for name in ("one", "general"):
        broker = Broker(tmp_path / name, Config.from_env(broker=True))
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        me = os.getpid()
        conn = Conn(mine, -1, broker.ledger.connect(me, os.getuid(), identity_of_pid(me)))
        broker.conns[conn.fd] = conn
        broker.procs[conn.client.uid, conn.client.pid] += 1  # as _accept counts it
        served: list[float] = []
        sides.append(SimpleNamespace(broker=broker, conn=conn, theirs=theirs, served=served))
    ones: list[int] = []
    one = sides[0].broker._one
    monkeypatch.setattr(sides[0].broker, "_one", lambda conn: (ones.append(1), one(conn))[1])
    try:
        for cost in costs:
            books = []
            for side in sides:
                def serve(conn: Conn, side: SimpleNamespace = side, cost: float = cost) -> None:
                    assert conn is side.conn
                    side.served.append(cost)
                    clock.now += cost

                monkeypatch.setattr(side.broker, "_readable", serve)
                if side is sides[1]:
                    side.broker.debt[OTHER_UID] = 1e-9  # paid off by this turn: the general turn, every time
                key = selectors.SelectorKey(side.conn.sock, side.conn.fd, selectors.EVENT_READ, side.conn)
                side.broker._turn([(key, selectors.EVENT_READ)])
                assert OTHER_UID not in side.broker.debt
                books.append(_books(side.broker, os.getuid()))
            assert books[0] == books[1]
            assert books[0][0] and books[0][1] is not None  # a finish time and a virtual time were kept
        assert sides[0].served == sides[1].served == costs
        assert ones, "the turn of one connection was never taken"
    finally:
        for side in sides:
            side.theirs.close()
            side.broker.close()


def test_a_connection_gone_before_its_turn_is_not_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fabric's timers run between the select and the turn: a connection they dropped is not served."""
    broker = Broker(tmp_path / "s", Config.from_env(broker=True))
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    me = os.getpid()
    conn = Conn(mine, -1, broker.ledger.connect(me, os.getuid(), identity_of_pid(me)))
    try:
        monkeypatch.setattr(broker, "_readable", lambda c: pytest.fail("served a connection that left"))
        key = selectors.SelectorKey(conn.sock, conn.fd, selectors.EVENT_READ, conn)
        broker._turn([(key, selectors.EVENT_READ)])  # never in broker.conns: as one dropped since the select
    finally:
        mine.close()
        theirs.close()
        broker.close()


def _connected(broker: Broker) -> tuple[Conn, socket.socket]:
    """A connection of this process, registered as `_accept` registers one."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    me = os.getpid()
    conn = Conn(mine, -1, broker.ledger.connect(me, os.getuid(), identity_of_pid(me)))
    broker.conns[conn.fd] = conn
    broker.procs[conn.client.uid, conn.client.pid] += 1
    broker.sel.register(mine, selectors.EVENT_READ, conn)
    return conn, theirs


def _turn_of(broker: Broker, conn: Conn, general: bool) -> None:
    if general:
        broker.debt[OTHER_UID] = 1e-9  # paid off by this turn: the general turn
    key = selectors.SelectorKey(conn.sock, conn.fd, selectors.EVENT_READ, conn)
    broker._turn([(key, selectors.EVENT_READ)])
    assert OTHER_UID not in broker.debt


@pytest.mark.parametrize("general", [False, True], ids=["one", "general"])
def test_a_user_whose_last_connection_closes_leaves_no_finish_books(tmp_path: Path, general: bool) -> None:
    """The peer closed: `_readable` reads the end of the connection and drops it, and `_forget` clears the user's
    fair-queuing books (the user has no connection left); the turn that served it must not make them anew."""
    broker = Broker(tmp_path / "s", Config.from_env(broker=True))
    try:
        conn, theirs = _connected(broker)
        uid = conn.client.uid
        theirs.close()  # the process exited
        _turn_of(broker, conn, general)
        assert broker.conns.get(conn.fd) is not conn  # dropped by the turn, as a closed connection is
        assert uid not in broker.finish, f"books of a gone user kept: {broker.finish!r}"
    finally:
        broker.close()


def test_a_closing_connection_keeps_the_books_the_general_turn_keeps(tmp_path: Path) -> None:
    """The same closing turn served both ways: the books that `_one` leaves for the user (which processes have a
    finish time, whether the user has a virtual time and a debt) are those the general turn leaves."""
    books = []
    for general in (False, True):
        broker = Broker(tmp_path / ("general" if general else "one"), Config.from_env(broker=True))
        try:
            conn, theirs = _connected(broker)
            theirs.close()
            _turn_of(broker, conn, general)
            uid = conn.client.uid
            books.append((sorted(broker.finish.get(uid, {})), uid in broker.finish, uid in broker.vclock,
                          uid in broker.debt))
        finally:
            broker.close()
    assert books[0] == books[1], f"one: {books[0]}, general: {books[1]}"


@pytest.mark.parametrize("general", [False, True], ids=["one", "general"])
def test_a_process_whose_last_connection_closes_leaves_no_finish_time(tmp_path: Path, general: bool) -> None:
    """The user stays (another of its processes is connected), the process that closed does not: `_forget` drops
    its finish time, and the turn that served the closing request must not write it back (a long-lived user would
    leave one entry for every process of it that exited)."""
    broker = Broker(tmp_path / "s", Config.from_env(broker=True))
    try:
        conn, theirs = _connected(broker)
        parent = os.getppid()
        other = broker.ledger.connect(parent, os.getuid(), identity_of_pid(parent))  # the user's other process
        broker.procs[other.uid, other.pid] += 1
        theirs.close()
        _turn_of(broker, conn, general)
        assert broker.conns.get(conn.fd) is not conn
        assert conn.client.pid not in broker.finish.get(conn.client.uid, {}), \
            f"finish time of an exited process kept: {broker.finish!r}"
    finally:
        broker.close()


@pytest.mark.parametrize("closed", [True, False])
def test_a_connection_closed_while_its_user_is_in_debt_does_not_count_against_the_next(
        tmp_path: Path, closed: bool) -> None:
    """A user in debt has its ready connections left for a later turn, while new connections are taken at the end
    of every turn: a process that closed its connection and opened another at its quota of connections would be
    refused for the one it closed. Before refusing, the broker drops the user's connections it finds closed; one
    still open still counts (docs/security.md, T8)."""
    config = Config.from_env(broker=True)
    broker = Broker(tmp_path / "s", config, limits=replace(config.quotas, connections=1))
    try:
        conn, theirs = _connected(broker)
        broker.debt[conn.client.uid] = 1.0  # its next turns are spent paying this back
        if closed:
            theirs.close()  # the process closed it: the end is there to read
        mine, new = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            broker._admit(mine)
            if closed:
                assert broker.conns.get(conn.fd) is not conn and len(broker.conns) == 1  # the new one, admitted
                with pytest.raises(BlockingIOError):  # and told nothing: no refusal was sent
                    new.recv(4096, socket.MSG_DONTWAIT)
            else:
                assert list(broker.conns) == [conn.fd]  # refused: the open one still counts
                refusal = P.decode(new.recv(4096))
                assert isinstance(refusal.message, P.Error) and "VMMSHARE_QUOTA_CONNECTIONS" in refusal.message.message
        finally:
            new.close()
            if not closed:
                theirs.close()
    finally:
        broker.close()


def test_the_broker_looks_for_closed_connections_once_a_turn_at_most(tmp_path: Path) -> None:
    """A flood of connections past the quota costs one look a turn, not one a connection: a second refusal in the
    same turn does not look again (the closed connection is found in the next turn's look)."""
    config = Config.from_env(broker=True)
    broker = Broker(tmp_path / "s", config, limits=replace(config.quotas, connections=1))
    try:
        conn, theirs = _connected(broker)
        broker._turn([])  # a turn begins
        refused = []
        for close_first in (False, True):
            if close_first:
                theirs.close()
            mine, new = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            broker._admit(mine)
            refused.append(isinstance(P.decode(new.recv(4096)).message, P.Error))
            new.close()
        assert refused == [True, True] and conn.fd in broker.conns  # looked once, before the close
        broker._turn([])  # the next turn
        mine, new = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            broker._admit(mine)
            assert broker.conns.get(conn.fd) is not conn and len(broker.conns) == 1
        finally:
            new.close()
    finally:
        broker.close()


def test_after_a_refusal_for_the_quota_the_next_connection_waits_for_the_next_turn(tmp_path: Path) -> None:
    """Connections queued on the listener are taken one after another in a turn, but not past a refusal by the
    books: a process that was refused, closed one of its connections and connected again must not be taken in the
    same turn, before the loop has seen the close (it is, in the next turn, after the close is served)."""
    config = Config.from_env(broker=True)
    broker = Broker(tmp_path / "run" / "s", config, limits=replace(config.quotas, connections=1))
    broker.bind()
    try:
        conn, theirs = _connected(broker)
        first, second = (socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2))
        try:
            for client in (first, second):
                client.connect(str(broker.path))  # both wait in the listener's queue
            broker._turn([])
            broker._accept()
            assert isinstance(P.decode(first.recv(4096)).message, P.Error)  # refused: the quota
            with pytest.raises(BlockingIOError):
                second.recv(4096, socket.MSG_DONTWAIT)  # not taken yet
            theirs.close()  # the one that counted closes
            broker._turn(broker._poll_now())  # the next turn: the close, then the listener
            assert broker.conns.get(conn.fd) is not conn and len(broker.conns) == 1
            with pytest.raises(BlockingIOError):
                second.recv(4096, socket.MSG_DONTWAIT)  # admitted: told nothing
        finally:
            first.close()
            second.close()
    finally:
        broker.close()


def test_an_importing_process_that_leaves_takes_its_engines_metadata_with_it(tmp_path: Path) -> None:
    """A process that imported across servers has a namespace (a token) in the node's metadata service, where its
    transfer engine PUTs keys of its own. When it left, the namespace went only at the fabric's next sweep, which
    runs after the broker's loop next wakes (the next remote import on a quiet node): until then its keys stayed
    readable to anyone holding the token and counted against its user. They now go as the process is dropped."""
    import urllib.error
    import urllib.request

    from vmmshare.fabric.metadata import MetadataService, new_token

    broker = Broker(tmp_path / "s", Config.from_env(broker=True))
    meta, idle = MetadataService(5.0), broker.fabric.meta  # a node without the fabric does not start its own
    meta.start()
    try:
        broker.fabric.meta = meta
        conn, theirs = _connected(broker)
        token = new_token()
        meta.add(token)
        broker.fabric.client_tokens[conn.client] = token  # as its remote import made it
        url = f"{meta.url(token)}?key=mooncake/rpc_meta/engine"
        put = urllib.request.Request(url, data=b"{}", method="PUT")
        with urllib.request.urlopen(put, timeout=10) as reply:  # the engine writes a key of its own
            assert reply.status == 200
        theirs.close()  # the process exited
        _turn_of(broker, conn, False)
        assert broker.conns.get(conn.fd) is not conn
        with pytest.raises(urllib.error.HTTPError) as gone:
            urllib.request.urlopen(url, timeout=10)
        assert gone.value.code == 404, "the engine's keys outlived its process"
        assert conn.client not in broker.fabric.client_tokens
    finally:
        broker.fabric.meta = idle
        meta.close()
        broker.close()
