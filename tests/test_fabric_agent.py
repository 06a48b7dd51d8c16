"""The broker's fabric agent on its own, with links on socket pairs: what a peer that goes away, lies or asks for
what the ledger refuses does to the agent's books (nothing may raise into the broker's loop, nothing may stay held).

The same agent between real brokers in network namespaces is in test_fabric_sharing.py and test_fabric_faults.py."""

from __future__ import annotations

import errno
import selectors
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from vmmshare import protocol as P
from vmmshare.broker.ledger import Ledger
from vmmshare.config import Config, Quotas
from vmmshare.fabric import agent as agent_module
from vmmshare.fabric import peer_protocol as F
from vmmshare.fabric.agent import Agent
from vmmshare.fabric.link import Link, State

EP = ("10.0.0.2", 17017)
MiB2 = 2 << 20
IPC_ERROR, RESOURCE = 507022, 207005
KEY = b"k" * 32


@dataclass
class Node:
    """An agent with its ledger and selector, and the far ends of the links made for it."""

    agent: Agent
    ledger: Ledger
    sel: selectors.BaseSelector
    closed_fds: list[int] = field(default_factory=list)
    peers: list[socket.socket] = field(default_factory=list)

    def link(self, outbound: bool) -> tuple[Link, socket.socket]:
        """A proved link to EP (outbound: this node imports over it; else EP's broker connected to this one)."""
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        near.setblocking(False)
        a = self.agent
        if outbound:
            link = Link(near, self.sel, KEY, 1, a.timeout, True, EP, on_ready=lambda _: None,
                        on_request=lambda *_: None, on_closed=a._outbound_closed)
            a.links[EP] = link
        else:
            link = Link(near, self.sel, KEY, 1, a.timeout, False, EP, on_ready=lambda _: None,
                        on_request=a._request, on_closed=a._inbound_closed)
            a.accepted.add(link)
        link.state, link.peer_id = State.READY, 2
        self.peers.append(far)
        return link, far


@pytest.fixture
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    quotas = getattr(request, "param", None) or Quotas()
    closed: list[int] = []
    ledger = Ledger(1, 1 << 30, identify=lambda pid: (None, None), close_fd=closed.append,
                    memfd_info=lambda fd: (MiB2, 0), quotas=quotas)
    sel = selectors.DefaultSelector()
    n = Node(Agent(Config.from_env(), ledger, sel), ledger, sel, closed)
    yield n
    for link in [*n.agent.links.values(), *n.agent.accepted]:
        link.close("the test is over")
    for far in n.peers:
        far.close()
    sel.close()


def frames(far: socket.socket) -> list[F.PeerMessage]:
    """The frames waiting at the far end of a link (none: an empty list)."""
    far.setblocking(False)
    reader, got = F.FrameReader(), list[F.PeerMessage]()
    while True:
        try:
            data = far.recv(1 << 16)
        except BlockingIOError:
            return got
        if not data:
            return got
        got += [m for _, m in reader.feed(data)]


def release_of(node: Node, hold: int) -> Callable[[], None]:
    return lambda: node.agent._release_remote(EP, hold)


def imported(hold: int) -> F.Imported:
    return F.Imported(hold, MiB2, 0, 0, 0, 0, 1, 0, 0x1000, "10.0.0.2:15000")


@pytest.mark.parametrize("node", [Quotas(holds=1)], indirect=True)
def test_a_remote_import_the_importers_quota_refuses_is_released_at_the_exporter(node: Node) -> None:
    client = node.ledger.connect(1234, 1000, (1, 1))
    node.ledger.handle(client, P.Charge(0, MiB2))  # the user's one hold
    _, far = node.link(outbound=True)
    reply = node.agent._imported(client, EP, MiB2, imported(77))
    assert isinstance(reply, P.Error) and reply.code == RESOURCE and "VMMSHARE_QUOTA_HOLDS" in reply.message
    assert not node.agent.held.get(EP), "nothing is kept alive by heartbeats for an import that was refused"
    assert [m for m in frames(far) if isinstance(m, F.Release)] == [F.Release(77)]


def test_releasing_on_a_link_whose_peer_reset_neither_raises_nor_stops_the_clients_clean_up(node: Node) -> None:
    client = node.ledger.connect(1234, 1000, (1, 1))
    link, far = node.link(outbound=True)
    for hold in (5, 6):
        node.agent.held.setdefault(EP, set()).add(hold)
        node.ledger.adopt_remote(client, MiB2, release_of(node, hold))
    charged = node.ledger.handle(client, P.Charge(0, MiB2))[0]
    assert isinstance(charged, P.Token)  # and a hold of its own, freed with the rest
    far.close()  # the exporting broker went away: sending the releases fails with EPIPE
    node.ledger.disconnect(client)
    assert client not in node.ledger.clients and not client.holds
    assert link.state is State.CLOSED and EP not in node.agent.links
    assert not node.agent.held.get(EP)


def test_a_peer_import_the_ledger_refuses_gets_an_error_and_the_link_serves_on(node: Node) -> None:
    link, far = node.link(outbound=False)
    far.sendall(F.encode(F.Import(5, 2, bytes(32), 2, 0, 1000, 0), 1) + F.encode(F.Heartbeat(), 2))
    link.on_event(selectors.EVENT_READ)  # pid 0: the ledger refuses such a client
    got = frames(far)
    assert len(got) == 2 and isinstance(got[0], F.Error) and "pid 0" in got[0].message
    assert got[1] == F.Ok() and link.state is State.READY


def test_a_reconnection_with_no_route_is_tried_again_later(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(address: str, port: int) -> socket.socket:
        raise OSError(errno.ENETUNREACH, f"cannot connect to {address}:{port}: Network is unreachable")

    monkeypatch.setattr(agent_module, "dial", unreachable)
    node.agent.held[EP] = {5}  # a remote import whose link died
    node.agent.reconnect_at[EP] = 0.0  # due now
    node.agent.tick()
    assert node.agent.reconnect_at[EP] > 0.0 and EP not in node.agent.links


def test_a_heartbeat_to_a_reset_peer_closes_the_link_quietly(node: Node) -> None:
    link, far = node.link(outbound=True)
    node.agent.held[EP] = {5}
    link.last_sent -= 10 * node.agent.timeout  # quiet long enough for a heartbeat
    far.close()
    node.agent.tick()
    assert link.state is State.CLOSED and EP not in node.agent.links and EP in node.agent.reconnect_at
