"""The broker's fabric agent on its own, with links on socket pairs: what a peer that goes away, restarts, lies or
asks for what the ledger refuses does to the agent's books (nothing may raise into the broker's loop, nothing may stay
held, nobody's hold may be released by another). Two agents (an importing and an exporting node) talk through
socket pairs with the real key handshake; the exporting one has a stand-in for the transfer engine.

The same agent between real brokers in network namespaces is in test_fabric_sharing.py and test_fabric_faults.py."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import secrets
import selectors
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from vmmshare.books.ledger import SIZE_SEALS, Client, Ledger
from vmmshare.config import Config, Quotas
from vmmshare.fabric import agent as agent_module
from vmmshare.fabric.agent import Agent
from vmmshare.fabric.link import Link, State
from vmmshare.fabric.serving import LEASE_FACTOR, MAX_LINKS
from vmmshare.wire import local as P
from vmmshare.wire import peer as F
from vmmshare.wire.handles import Endpoint, FabricHandle

EP = ("10.0.0.2", 17017)
MiB2 = 2 << 20
IPC_ERROR, RESOURCE = 507022, 207005
KEY = b"k" * 32


class Far:
    """The far end of a proved link: the peer broker's socket, sealing and checking frames as a proved link does."""

    def __init__(self, sock: socket.socket, send: bytes, receive: bytes) -> None:
        self.sock, self.sealer, self.reader = sock, F.Sealer(send), F.FrameReader()
        self.reader.authenticate(receive)

    def send(self, *frames: tuple[F.PeerMessage, int]) -> None:
        self.sock.sendall(b"".join(self.sealer.seal(F.encode(m, req)) for m, req in frames))

    def close(self) -> None:
        self.sock.close()


@dataclass
class Node:
    """An agent with its ledger and selector, and the far ends of the links made for it."""

    agent: Agent
    ledger: Ledger
    sel: selectors.BaseSelector
    closed_fds: list[int] = field(default_factory=list)
    peers: list[Far] = field(default_factory=list)

    def link(self, outbound: bool) -> tuple[Link, Far]:
        """A proved link to EP (outbound: this node imports over it; else EP's broker connected to this one)."""
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        near.setblocking(False)
        a = self.agent
        link = a.dialed_link(near, EP) if outbound else a.accepted_link(near, EP)
        mine, theirs = secrets.token_bytes(32), secrets.token_bytes(32)  # the keys a handshake would have given
        link.state, link.peer_id, link.sealer, link.session = State.READY, 2, F.Sealer(mine), secrets.token_bytes(32)
        link.reader.authenticate(theirs)
        peer = Far(far, theirs, mine)
        self.peers.append(peer)
        return link, peer


@pytest.fixture
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    quotas = getattr(request, "param", None) or Quotas()
    closed: list[int] = []
    ledger = Ledger(1, 1 << 30, identify=lambda pid: (None, None), close_fd=closed.append,
                    memfd_info=lambda fd: (MiB2, 0), quotas=quotas)
    sel = selectors.DefaultSelector()
    config = dataclasses.replace(Config.from_env(), fabric="tcp", fabric_addr=EP_A[0], fabric_port=EP_A[1])
    n = Node(Agent(config, ledger, sel), ledger, sel, closed)
    n.agent.meta.start()  # the node's metadata service, where each import is described to its process's engine
    yield n
    n.agent.meta.close()
    for link in [*n.agent.links.values(), *n.agent.accepted]:
        link.close("the test is over")
    for far in n.peers:
        far.close()
    sel.close()


def frames(far: Far) -> list[F.PeerMessage]:
    """The frames waiting at the far end of a link (none: an empty list)."""
    return [m for _, m in requests(far)]


def release_of(node: Node, hold: int) -> Callable[[], None]:
    return lambda: node.agent._release_remote(EP, hold)


def imported(hold: int) -> F.Imported:
    return F.Imported(hold, MiB2, 0, 0, 0, 0, 1, 0, 0x1000, "10.0.0.2:15000")


def requests(far: Far) -> list[tuple[int, F.PeerMessage]]:
    """The requests waiting at the far end of a link, with their ids."""
    far.sock.setblocking(False)
    got: list[tuple[int, F.PeerMessage]] = []
    while True:
        try:
            data = far.sock.recv(1 << 16)
        except BlockingIOError:
            return got
        if not data:
            return got
        got += far.reader.feed(data)


@pytest.mark.parametrize("node", [Quotas(holds=1)], indirect=True)
def test_a_remote_import_the_importers_quota_refuses_is_released_at_the_exporter(node: Node) -> None:
    client = node.ledger.connect(1234, 1000, (1, 1))
    node.ledger.handle(client, P.Charge(0, MiB2))  # the user's one hold
    link, far = node.link(outbound=True)
    handle = FabricHandle(2, 0, 0x1234, MiB2, secrets.token_bytes(32), 0, Endpoint(4, *EP)).pack()
    answers: list[P.Message] = []
    assert node.agent.local(client, P.RemoteImport(handle), answers.append) is None  # asked over the link
    [(req, sent)] = requests(far)
    assert isinstance(sent, F.Import) and sent.pid == 1234
    far.send((imported(77), req))  # the exporting broker made hold 77 for it
    link.on_event(selectors.EVENT_READ)
    [reply] = answers
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
    far.send((F.Import(5, 2, bytes(32), 2, 0, 1000, 0), 1), (F.Heartbeat(), 2))
    link.on_event(selectors.EVENT_READ)  # pid 0: the ledger refuses such a client
    got = frames(far)
    assert len(got) == 2 and isinstance(got[0], F.Error) and "pid 0" in got[0].message
    assert got[1] == F.Ok() and link.state is State.READY


def test_a_reconnection_with_no_route_is_tried_again_later(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(address: str, port: int, source: str = "") -> socket.socket:
        raise OSError(errno.ENETUNREACH, f"cannot connect to {address}:{port}: Network is unreachable")

    monkeypatch.setattr(agent_module, "dial", unreachable)
    node.agent.held[EP] = {5}  # a remote import whose link died
    node.agent.reconnect_at[EP] = 0.0  # due now
    node.agent.tick()
    assert node.agent.reconnect_at[EP] > 0.0 and EP not in node.agent.links


def test_an_idle_link_with_holds_wakes_the_loop_never_and_the_kernel_watches_it(node: Node) -> None:
    """No heartbeats: a proved link with remote holds both ways has no deadline in the agent's heap, and its TCP
    socket has keepalive on, probing from half a fabric timeout of quiet and failing after three fabric timeouts
    without an answer (unacknowledged data too)."""
    server = socket.create_server(("127.0.0.1", 0))
    near = socket.create_connection(server.getsockname())
    far, _ = server.accept()
    server.close()
    near.setblocking(False)
    a = node.agent
    link = a.dialed_link(near, EP)
    link.state, link.peer_id = State.READY, 2
    a.held[EP] = {5}
    a._took(EP, 5, link)
    link.tied.add(9)
    a.tick()
    assert a.wait_time() is None, "an idle link with holds schedules nothing"
    opt = near.getsockopt
    assert opt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert opt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    quiet, every, probes = (opt(socket.IPPROTO_TCP, o) for o in
                            (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT))
    assert quiet == every == max(1, -(-a.timeout // 2))
    assert quiet + probes * every == pytest.approx(3 * a.timeout, abs=every)
    assert opt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(3 * a.timeout * 1000)
    link.request(F.Release(5), lambda _: None)  # a request has a deadline again: the heap holds it
    wait = a.wait_time()
    assert wait is not None and 0 < wait <= a.timeout
    far.close()


def test_a_link_is_dialed_from_the_brokers_fabric_address_so_its_endpoint_claim_matches() -> None:
    """On a host with several addresses the broker dials from VMMSHARE_FABRIC_ADDR, not the one the route picks:
    127.0.0.2 dialing 127.0.0.1 would come from 127.0.0.1 unbound, and the peer would refuse its Listens."""
    listener = socket.create_server(("127.0.0.1", 0))
    a = fabric_agent(1, ("127.0.0.2", 17017))
    try:
        link = a._link(listener.getsockname())
        peer, (source, _) = listener.accept()
        assert source == "127.0.0.2"
        assert link.claim == ("127.0.0.2", 17017)
        peer.close()
    finally:
        listener.close()
        a.close()


# ---------------------------------------------------------------- two nodes: an importer (server 1), an exporter (2)

EP_A = ("10.0.0.1", 17017)
FABRIC = 2


class StandInEngine:
    """What the exporting agent asks of its transfer engine: serve and stop serving a range."""

    segment = "10.0.0.2:15000"

    def __init__(self) -> None:
        self.served: set[int] = set()

    def register(self, address: int, size: int) -> None:
        self.served.add(address)

    def unregister(self, address: int) -> None:
        self.served.discard(address)

    def close(self) -> None:
        pass


def fabric_agent(server_id: int, ep: tuple[str, int]) -> Agent:
    config = dataclasses.replace(Config.from_env(), server_id=server_id, fabric="tcp", fabric_addr=ep[0],
                                 fabric_port=ep[1], fabric_timeout=1.0)
    ledger = Ledger(1, 1 << 30, identify=lambda pid: (None, None), close_fd=os.close,
                    memfd_info=lambda fd: (os.fstat(fd).st_size, SIZE_SEALS), endpoint=Endpoint(4, *ep))
    agent = Agent(config, ledger, selectors.DefaultSelector())
    agent.key = KEY
    agent.meta.start()
    agent.meta.add(agent.meta_token)
    return agent


class Cluster:
    """Importer `a` dials exporter `b` through socket pairs; `restart_b` replaces b by a new broker run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.a = fabric_agent(1, EP_A)
        self.b = self._exporter()
        monkeypatch.setattr(agent_module, "dial", self._dial)

    def _exporter(self) -> Agent:
        b = fabric_agent(2, EP)
        b.engine = StandInEngine()  # type: ignore[assignment]
        b.data_endpoint = StandInEngine.segment
        return b

    def _dial(self, address: str, port: int, source: str = "") -> socket.socket:
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        near.setblocking(False)
        far.setblocking(False)
        b = self.b
        b.accepted_link(far, EP_A)
        return near

    def pump(self) -> None:
        """Run both loops until neither has anything to read or write."""
        for _ in range(100):
            ready = [(key, mask) for sel in (self.a.sel, self.b.sel) for key, mask in sel.select(0)]
            if not ready:
                return
            for key, mask in ready:
                key.data(mask)
        raise AssertionError("the two agents never went quiet")

    def export(self) -> bytes:
        """A FABRIC export on b that any pid may import: the handle's 128 bytes."""
        ledger = self.b.ledger
        owner = ledger.connect(4321, 1000, (1, 1))
        token = ledger.handle(owner, P.Charge(0, MiB2))[0]
        assert isinstance(token, P.Token)
        fd = os.memfd_create("exported", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        os.ftruncate(fd, MiB2)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        reply = ledger.handle(owner, P.Export(token.hold, MiB2, 1, FABRIC, 2, 0, 0, 0, 0, 1, 0, ()), fd)[0]
        assert isinstance(reply, P.Exported), reply
        return reply.shareable

    def import_(self, client: Client, handle: bytes) -> P.Message:
        got: list[P.Message] = []
        now = self.a.local(client, P.RemoteImport(handle), got.append)
        self.pump()
        return now if now is not None else got[0]

    def restart_b(self) -> None:
        """b's broker dies (its links close) and a new run starts at the same endpoint."""
        for link in list(self.b.accepted):
            link.close("the broker was killed")
        self.pump()
        self.b.close()
        self.b = self._exporter()

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    c = Cluster(monkeypatch)
    yield c
    c.close()


def test_rule_14_a_hold_of_an_exporter_that_restarted_never_releases_another_importers_hold(cluster: Cluster) -> None:
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, cluster.export()), P.RemoteImported)
    cluster.restart_b()  # x's import died with the old run
    y = cluster.a.ledger.connect(2222, 1000, (2, 2))
    assert isinstance(cluster.import_(y, cluster.export()), P.RemoteImported)  # reconnects: Adopt of x's hold too
    assert len(cluster.b.remote_holds) == 1
    cluster.a.ledger.disconnect(x)  # x leaves: its Release names a hold of the old run
    cluster.pump()
    assert len(cluster.b.remote_holds) == 1 and len(cluster.b.served) == 1, "y's memory is still served"
    cluster.a.ledger.disconnect(y)
    cluster.pump()
    assert not cluster.b.remote_holds and not cluster.b.served and not cluster.a.held


def test_a_hold_the_exporter_refuses_to_adopt_is_no_longer_kept(cluster: Cluster) -> None:
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, cluster.export()), P.RemoteImported)
    cluster.restart_b()
    assert cluster.a.held.get(EP) and EP in cluster.a.reconnect_at
    cluster.a.reconnect_at[EP] = 0.0  # due now
    cluster.a.tick()
    cluster.pump()  # the new run answers the Adopt: that hold is gone
    assert not cluster.a.held, "no heartbeats, re-adoptions or reconnections for a hold that is gone"
    wait = cluster.a.wait_time()
    assert wait is None or wait > cluster.a.timeout  # nothing to keep up


def test_reconnections_stop_when_the_exporters_lease_has_ended(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    dials: list[tuple[str, int]] = []

    def unreachable(address: str, port: int, source: str = "") -> socket.socket:
        dials.append((address, port))
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(agent_module, "dial", unreachable)
    a = node.agent
    client = node.ledger.connect(1111, 1000, (1, 1))
    a.held[EP] = {7}
    node.ledger.adopt_remote(client, MiB2, release_of(node, 7))
    link, far = node.link(outbound=True)
    far.close()
    link.close("the exporter's node went away")
    a.reconnect_at[EP] = 0.0
    a.tick()  # within the lease: tried, and tried again later
    assert dials == [EP] and EP in a.reconnect_at and a.held[EP] == {7}
    a.lost_at[EP] -= LEASE_FACTOR * a.timeout  # the exporter's lease of the hold has ended by now
    a.reconnect_at[EP] = 0.0
    a.tick()
    assert dials == [EP] and EP not in a.reconnect_at and not a.held
    node.ledger.disconnect(client)  # freeing the lost import later is local only
    assert client not in node.ledger.clients


def _silent_peers(monkeypatch: pytest.MonkeyPatch) -> list[socket.socket]:
    """Every dial connects to a listener that never proves the key (a keyless user's own listener)."""
    peers: list[socket.socket] = []

    def silent_peer(address: str, port: int, source: str = "") -> socket.socket:
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        near.setblocking(False)
        peers.append(far)
        return near

    monkeypatch.setattr(agent_module, "dial", silent_peer)
    return peers


def _made_up(i: int) -> bytes:
    """A FABRIC handle naming a listener of its own (10.1.x.y:17017)."""
    return FabricHandle(2 + i, 0, 0x1234, MiB2, secrets.token_bytes(32), 0,
                        Endpoint(4, f"10.1.{i // 250}.{1 + i % 250}", 17017)).pack()


def test_one_client_cannot_make_the_broker_dial_without_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Links in all are bounded (MAX_LINKS), and so are the links one user's imports keep waiting on their key
    handshake (MAX_DIALS_PER_USER); every import waiting on a link fails with 507022 when the broker stops."""
    from vmmshare.fabric.agent import MAX_DIALS_PER_USER

    peers = _silent_peers(monkeypatch)
    a = fabric_agent(1, EP_A)
    try:
        users = MAX_LINKS // MAX_DIALS_PER_USER + 1
        clients = [a.ledger.connect(1000 + u, 1000 + u, (u, u)) for u in range(users)]
        answers: list[P.Message] = []
        for i in range(users * (MAX_DIALS_PER_USER + 1)):
            now = a.local(clients[i % users], P.RemoteImport(_made_up(i)), answers.append)
            if now is not None:
                answers.append(now)
        assert len(a.links) == MAX_LINKS
        refused = users * (MAX_DIALS_PER_USER + 1) - MAX_LINKS
        assert len(answers) == refused and all(isinstance(m, P.Error) and m.code == RESOURCE for m in answers)
        a.close()  # every import waiting on a link fails with 507022
        assert len(answers) == refused + MAX_LINKS and not a.links
        assert all(m.code == IPC_ERROR for m in answers[refused:])  # type: ignore[attr-defined]
    finally:
        a.close()
        for far in peers:
            far.close()


def test_one_user_filling_the_links_with_silent_listeners_does_not_keep_another_user_from_importing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack: a keyless local user hands its broker made-up FABRIC handles naming 256 listeners of its own,
    which accept and never answer, and hands it new ones as they time out: the broker held MAX_LINKS links, and every
    other user's import from a server it had no link to was refused (207005). One user's imports may keep at most
    MAX_DIALS_PER_USER links waiting on their key handshake; another user's import still dials."""
    peers = _silent_peers(monkeypatch)
    a = fabric_agent(1, EP_A)
    try:
        attacker, bystander = a.ledger.connect(1111, 1000, (1, 1)), a.ledger.connect(2222, 2000, (2, 2))
        answers: list[P.Message] = []
        for i in range(MAX_LINKS):
            now = a.local(attacker, P.RemoteImport(_made_up(i)), answers.append)
            if now is not None:
                answers.append(now)
        assert len(a.links) < MAX_LINKS, "one user's made-up handles hold every link"
        assert all(isinstance(m, P.Error) and m.code == RESOURCE and "uid 1000" in m.message for m in answers)
        waiting = a.local(bystander, P.RemoteImport(_made_up(MAX_LINKS)), answers.append)
        assert waiting is None, waiting  # dialed: its answer comes once the exporter's broker answers
    finally:
        a.close()
        for far in peers:
            far.close()


# ---------------------------------------------------------------- attackers between and beside the brokers (SPEC §8)


def accepted_link(agent: Agent, peer_id: int, source: tuple[str, int] = EP_A) -> tuple[Link, Far]:
    """A link `agent` accepted from `source` (the connection's address and port) and that proved the key as server
    `peer_id` (keys as a handshake gives them): what a broker holding the cluster key gets by connecting."""
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    near.setblocking(False)
    link = agent.accepted_link(near, source)
    mine, theirs = secrets.token_bytes(32), secrets.token_bytes(32)
    link.state, link.peer_id, link.sealer, link.session = State.READY, peer_id, F.Sealer(mine), secrets.token_bytes(32)
    link.reader.authenticate(theirs)
    return link, Far(far, theirs, mine)


def test_a_handshake_relayed_through_an_attackers_listener_gets_no_link(cluster: Cluster) -> None:
    """A keyless user gives its broker a made-up handle naming its own listener, which relays every byte to the
    exporting broker: the importing broker checks the proof for the endpoint it dialed and refuses."""
    handle = bytearray(cluster.export())
    handle[32:64] = Endpoint(4, "10.0.0.1", 40001).pack()  # the attacker's listener on the importer's server
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    reply = cluster.import_(x, bytes(handle))  # the stand-in dial connects to b: a relay that copies every byte
    assert isinstance(reply, P.Error) and reply.code == IPC_ERROR and "relay" in reply.message, reply
    cluster.pump()
    assert not cluster.b.remote_holds and not cluster.b.served
    assert all(link.state is not State.READY for link in cluster.b.accepted)


def test_a_frame_injected_into_a_proved_link_closes_it_and_releases_nothing(cluster: Cluster) -> None:
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, cluster.export()), P.RemoteImported)
    (hold,) = cluster.b.remote_holds
    forged = secrets.token_bytes(32)  # a MAC guessed by whoever holds the TCP connection (a relay, the network)
    cluster.a.links[EP].sock.sendall(F.encode(F.Release(hold), 99) + forged)
    cluster.pump()
    assert hold in cluster.b.remote_holds and cluster.b.remote_holds[hold].link is None, "kept, on its lease"
    assert not any(link.state is State.READY for link in cluster.b.accepted)


def test_a_hold_is_released_or_adopted_only_over_the_link_that_took_it(cluster: Cluster) -> None:
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, cluster.export()), P.RemoteImported)
    (hold,) = cluster.b.remote_holds
    _, other = accepted_link(cluster.b, 1)  # another proved link naming the same server
    other.send((F.Release(hold), 1), (F.Adopt(hold), 2))
    cluster.pump()
    got = frames(other)
    assert [type(m) for m in got] == [F.Error, F.Error] and all(m.code == 107017 for m in got)  # type: ignore[attr-defined]
    taker = cluster.b.remote_holds[hold].link
    assert taker is not None and taker in cluster.b.accepted and taker.state is State.READY
    other.close()
    cluster.pump()
    cluster.a.ledger.disconnect(x)  # the link that took it releases it
    cluster.pump()
    assert not cluster.b.remote_holds and not cluster.b.served


def test_remote_holds_count_against_the_server_and_uid_not_a_local_user(cluster: Cluster) -> None:
    """Uid 1000 of server 1 imports from server 2, where uid 1000 is at its quota of holds: neither is charged for the
    other (a peer naming another uid could otherwise spend that local user's quota)."""
    cluster.b.ledger.usage.quotas = Quotas(holds=1)
    handle = cluster.export()  # b's uid 1000 now holds its one allocation
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, handle), P.RemoteImported)
    assert cluster.b.ledger.usage.users[1000].holds == 1 and cluster.b.ledger.usage.remote_holds[(1, 1000)] == 1
    y = cluster.a.ledger.connect(2222, 1000, (2, 2))
    refused = cluster.import_(y, handle)  # the same (server, uid) past its own quota
    assert isinstance(refused, P.Error) and refused.code == RESOURCE and "server 0x1" in refused.message
    cluster.a.ledger.disconnect(x)
    cluster.pump()
    assert not cluster.b.ledger.usage.remote_holds


def _mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def test_one_remote_user_cannot_use_up_the_exporting_brokers_mappings(cluster: Cluster) -> None:
    """The attack: a user with a process on another server imports one export over and over (each remote hold maps
    the memory once in the exporting broker, and its quota of holds, 65536, is past vm.max_map_count): the broker
    would run out of mappings, and then of memory of its own. Each (server id, uid) gets at most a quarter of the
    broker's budget (4,096 registrations, and half of vm.max_map_count), refused with 207005 past it; another user
    still imports."""
    with open("/proc/sys/vm/max_map_count", "rb") as f:
        share = min(4096, int(f.read()) // 2) // 4  # a quarter of what the broker serves at once
    handle = cluster.export()
    attacker = cluster.a.ledger.connect(1111, 1000, (1, 1))
    before = _mappings()
    for n in range(share):
        got = cluster.import_(attacker, handle)
        assert isinstance(got, P.RemoteImported), (n, got)
    refused = cluster.import_(attacker, handle)
    assert isinstance(refused, P.Error) and refused.code == RESOURCE and "uid 1000 of server 0x1" in refused.message
    assert _mappings() - before <= share + 64, "one mapping per remote hold, and no more past the share"
    bystander = cluster.a.ledger.connect(2222, 2000, (2, 2))
    assert isinstance(cluster.import_(bystander, handle), P.RemoteImported)
    assert len(cluster.b.served) == share + 1
    cluster.a.ledger.disconnect(attacker)
    cluster.pump()
    assert len(cluster.b.served) == 1 and cluster.b.ledger.usage.remote_holds == {(1, 2000): 1}


def test_an_import_must_prove_the_secret_for_its_own_link(cluster: Cluster) -> None:
    raw = cluster.export()
    value, secret = int.from_bytes(raw[16:24], "little"), raw[64:96]
    link, far = accepted_link(cluster.b, 1)
    other_session = secrets.token_bytes(32)
    far.send((F.Import(value, FABRIC, secret, 1, 1111, 1000, 1), 1),  # the secret itself, as version 1 sent it
             (F.Import(value, FABRIC, F.secret_proof(secret, other_session), 1, 1111, 1000, 1), 2),  # another link's
             (F.Import(value, FABRIC, F.secret_proof(secret, link.session), 1, 1111, 1000, 1), 3))
    cluster.pump()
    got = frames(far)
    assert [type(m) for m in got] == [F.Error, F.Error, F.Imported], got
    assert all(m.code == 107017 and "secret" in m.message for m in got[:2])  # type: ignore[attr-defined]


def test_each_remote_hold_has_a_registration_of_its_own_that_goes_when_the_hold_ends(cluster: Cluster) -> None:
    """SPEC §8 (revocation reaches the data plane): two holds of one export are served at two addresses; the end of
    one (a release; a lease that runs out) unregisters its address at once and leaves the other's."""
    handle = cluster.export()
    x, y = cluster.a.ledger.connect(1111, 1000, (1, 1)), cluster.a.ledger.connect(2222, 1000, (2, 2))
    rx, ry = cluster.import_(x, handle), cluster.import_(y, handle)
    assert isinstance(rx, P.RemoteImported) and isinstance(ry, P.RemoteImported)
    engine = cluster.b.engine
    assert isinstance(engine, StandInEngine)
    assert rx.address != ry.address and engine.served == {rx.address, ry.address}
    assert all(a % 4096 == 0 and (1 << 32) <= a < (1 << 46) for a in engine.served)
    cluster.a.ledger.disconnect(x)
    cluster.pump()
    assert engine.served == {ry.address}, "the released hold's address is no longer served; the other's is"
    for link in list(cluster.b.accepted):  # y's server goes away: its hold waits on its lease
        link.close("the importing server went away")
    assert engine.served == {ry.address}
    for rh in cluster.b.remote_holds.values():
        rh.expires = 0.0  # the lease has run out
    cluster.b.leases = [(0.0, hold) for hold in cluster.b.remote_holds]
    cluster.b.tick()
    assert not engine.served and not cluster.b.served and not cluster.b.remote_holds


def test_a_handle_naming_another_server_than_the_broker_that_answers_is_refused(cluster: Cluster) -> None:
    handle = bytearray(cluster.export())
    handle[8:12] = (9).to_bytes(4, "little")  # server 9's handle, by its bytes; the endpoint is server 2's
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    reply = cluster.import_(x, bytes(handle))
    assert isinstance(reply, P.Error) and reply.code == 107017 and "proved it is server 0x2" in reply.message, reply
    cluster.pump()  # the hold server 2 gave is released at once
    assert not cluster.b.remote_holds and not cluster.b.served and not cluster.a.held


def test_each_importing_process_is_described_its_own_holds_under_its_own_token(cluster: Cluster) -> None:
    """SPEC §8: two processes of the importing node, each with a hold of the same export: each gets a metadata token
    of its own, under which its hold's segment alone is described (the exporting engine's data endpoint and that
    hold's address); the description goes when the hold ends, and the token when its process leaves."""
    meta = cluster.a.meta
    handle = cluster.export()
    x, y = cluster.a.ledger.connect(1111, 1000, (1, 1)), cluster.a.ledger.connect(2222, 1000, (2, 2))
    rx, ry = cluster.import_(x, handle), cluster.import_(y, handle)
    assert isinstance(rx, P.RemoteImported) and isinstance(ry, P.RemoteImported)
    assert rx.metadata_port == ry.metadata_port == meta.port and rx.metadata_token != ry.metadata_token
    assert rx.segment != ry.segment
    desc = meta.get(rx.metadata_token, f"mooncake/ram/{rx.segment}")
    assert (desc["tcp_data_host"], desc["tcp_data_port"]) == ("10.0.0.2", 15000)  # the exporter's data endpoint
    assert desc["buffers"] == [{"addr": rx.address, "length": MiB2, "name": rx.segment}]
    assert meta.get(rx.metadata_token, f"mooncake/ram/{ry.segment}") is None  # y's hold is not x's to see
    assert meta.get(ry.metadata_token, f"mooncake/ram/{rx.segment}") is None
    again = cluster.import_(x, handle)
    assert isinstance(again, P.RemoteImported) and again.metadata_token == rx.metadata_token
    cluster.a.ledger.handle(x, P.Release(again.hold))  # that hold ends: its description goes, the first stays
    assert meta.get(rx.metadata_token, f"mooncake/ram/{again.segment}") is None
    assert meta.get(rx.metadata_token, f"mooncake/ram/{rx.segment}") == desc
    cluster.a.ledger.disconnect(x)  # x leaves: its holds' descriptions go, and its token with the next sweep
    assert meta.get(rx.metadata_token, f"mooncake/ram/{rx.segment}") is None
    cluster.a.tick()
    assert x not in cluster.a.client_tokens and y in cluster.a.client_tokens
    assert meta.get(ry.metadata_token, f"mooncake/ram/{ry.segment}") is not None


# ---------------------------------------------------------------- one link per pair of servers, used both ways


def export_on(agent: Agent) -> bytes:
    """A FABRIC export on `agent`'s node that any pid may import (its engine a stand-in): the handle's 128 bytes."""
    if agent.engine is None:
        agent.engine = StandInEngine()  # type: ignore[assignment]
        agent.data_endpoint = f"{agent.config.fabric_addr}:15000"
    owner = agent.ledger.connect(4321, 1000, (1, 1))
    token = agent.ledger.handle(owner, P.Charge(0, MiB2))[0]
    assert isinstance(token, P.Token)
    fd = os.memfd_create("exported", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, MiB2)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
    reply = agent.ledger.handle(owner, P.Export(token.hold, MiB2, 1, FABRIC, agent.server_id, 0, 0, 0, 0, 1, 0, ()),
                                fd)[0]
    assert isinstance(reply, P.Exported), reply
    return reply.shareable


def test_the_link_one_server_dialed_carries_the_other_servers_imports_too(cluster: Cluster) -> None:
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, cluster.export()), P.RemoteImported)  # a dials b
    (link,) = cluster.b.accepted
    assert cluster.b.links.get(EP_A) is link, "a named its endpoint on the link: b's requests to a go on it"
    y = cluster.b.ledger.connect(2222, 1000, (2, 2))
    got: list[P.Message] = []
    now = cluster.b.local(y, P.RemoteImport(export_on(cluster.a)), got.append)
    assert now is None
    cluster.pump()
    assert len(got) == 1 and isinstance(got[0], P.RemoteImported), got
    assert list(cluster.b.links.values()) == [link] and len(cluster.a.links) == 1, "no second link either way"
    assert len(cluster.a.remote_holds) == 1 and len(cluster.b.remote_holds) == 1
    cluster.b.ledger.disconnect(y)  # the release goes back over the same link
    cluster.a.ledger.disconnect(x)
    cluster.pump()
    assert not cluster.a.remote_holds and not cluster.b.remote_holds and link.state is State.READY


def test_an_endpoint_named_for_another_address_is_refused(cluster: Cluster) -> None:
    """A broker that connected may name only an endpoint on the address its connection comes from: it cannot have
    another server's imports sent to it."""
    link, far = accepted_link(cluster.b, 7)  # it connected from 10.0.0.1 (EP_A)
    far.send((F.Listens(F.endpoint_bytes("10.0.0.9", 17017)), 1))
    link.on_event(selectors.EVENT_READ)
    (reply,) = frames(far)
    assert isinstance(reply, F.Error) and reply.code == 207006 and "10.0.0.1" in reply.message
    assert ("10.0.0.9", 17017) not in cluster.b.links and link.listens is None and link.state is State.READY
    far.close()


def test_a_request_that_times_out_fails_alone_and_its_late_answer_is_undone(cluster: Cluster) -> None:
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    handle = cluster.export()
    assert isinstance(cluster.import_(x, handle), P.RemoteImported)  # the link is up, one hold taken
    link = cluster.a.links[EP]
    slow: list[P.Message] = []
    assert cluster.a.local(x, P.RemoteImport(handle), slow.append) is None  # b does not answer yet
    for pending in link.pending.values():
        pending.deadline = 0.0  # its time is up
    cluster.a.wake(link)
    cluster.a.tick()
    assert len(slow) == 1 and isinstance(slow[0], P.Error) and slow[0].code == IPC_ERROR, slow
    assert "VMMSHARE_FABRIC_TIMEOUT" in slow[0].message
    assert link.state is State.READY and cluster.a.held[EP], "the link and the hold taken before it stay"
    cluster.pump()  # b answers late: the hold it took for nobody is released at once
    assert len(cluster.b.remote_holds) == 1 and link.state is State.READY and not link.pending
    cluster.a.ledger.disconnect(x)
    cluster.pump()
    assert not cluster.b.remote_holds and not cluster.b.served
