"""A turn of the broker's loop with one ready connection (`Broker._one`) keeps the same books as the general turn
(`Broker._turn`'s queues): the process's finish time, its user's virtual time and the debt past the quantum
(docs/security.md, T9), turn after turn."""

from __future__ import annotations

import os
import selectors
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vmmshare.broker import server
from vmmshare.broker.identity import identity_of_pid
from vmmshare.broker.server import QUANTUM, Broker, Conn
from vmmshare.config import Config

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
