"""Attacks on the fabric's shared links (docs/security.md, across servers): the `Listens` claim that lets one link
carry requests both ways, two brokers dialing each other at once, requests that time out alone and their late
answers, per-link heartbeats. Two agents talk through socket pairs with the real handshake and sealed frames (the
harness of test_fabric_agent.py); an attacker with the cluster key is the far end of a proved link (`Far`).

An attack that works today (a hole) is a strict xfail: it passes while the hole is open and fails the build once the
hole is closed, so whoever closes it removes the mark."""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import selectors
import socket
from collections.abc import Iterator

import pytest

from test_fabric_agent import EP, EP_A, Cluster, Far, MiB2, accepted_link, export_on, fabric_agent, frames, requests
from vmmshare.fabric import agent as agent_module
from vmmshare.fabric.agent import Agent
from vmmshare.fabric.link import MAX_UNSENT, Link, State
from vmmshare.wire import local as P
from vmmshare.wire import peer as F
from vmmshare.wire.handles import Endpoint, FabricHandle

IPC_ERROR, NO_PERMISSION, PARAM_INVALID, BAD_HANDLE = 507022, 207006, 107000, 107017
B_ADDRESS = EP[0]  # the exporting server b listens on 10.0.0.2:17017


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    c = Cluster(monkeypatch)
    yield c
    c.close()


def claim(cluster: Cluster, link: Link, far: Far, endpoint: tuple[str, int], req: int = 1) -> F.PeerMessage:
    """`far` names `endpoint` as its own on `link` (of agent a); a's answer."""
    far.send((F.Listens(F.endpoint_bytes(*endpoint)), req))
    cluster.pump()
    got = [m for m in frames(far) if isinstance(m, (F.Ok, F.Error))]
    assert len(got) == 1, got
    return got[0]


# ---------------------------------------------------------------- the Listens claim


def test_a_claim_is_taken_once_per_link(cluster: Cluster) -> None:
    link, far = accepted_link(cluster.a, 7, ("10.0.0.7", 40001))
    assert isinstance(claim(cluster, link, far, ("10.0.0.7", 17017)), F.Ok)
    second = claim(cluster, link, far, ("10.0.0.7", 17018), req=2)
    assert isinstance(second, F.Error) and "once" in second.message
    assert cluster.a.links.get(("10.0.0.7", 17017)) is link and ("10.0.0.7", 17018) not in cluster.a.links
    assert link.listens == ("10.0.0.7", 17017) and link.state is State.READY


def test_a_claim_by_the_broker_that_was_dialed_is_refused(cluster: Cluster) -> None:
    """The accepting side of a link a dialed cannot name an endpoint: it would move a's requests for that endpoint
    onto a link whose far end proved another endpoint."""
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, cluster.export()), P.RemoteImported)
    (accepted,) = cluster.b.accepted
    got: list[F.PeerMessage] = []
    accepted.request(F.Listens(F.endpoint_bytes(B_ADDRESS, 17099)), got.append)  # b names another of its ports
    cluster.pump()
    assert len(got) == 1 and isinstance(got[0], F.Error) and got[0].code == PARAM_INVALID
    assert (B_ADDRESS, 17099) not in cluster.a.links and cluster.a.links[EP].state is State.READY


def test_a_claim_before_the_handshake_closes_the_connection_unanswered(cluster: Cluster) -> None:
    """A keyless host sends a Listens (unsealed: it has no key) as its first frame: nothing is taken."""
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    near.setblocking(False)
    a = cluster.a
    link = a.accepted_link(near, (B_ADDRESS, 40002))
    far.sendall(F.encode(F.Listens(F.endpoint_bytes(*EP)), 1))
    cluster.pump()
    assert link.state is State.CLOSED and EP not in a.links
    far.settimeout(5)
    assert far.recv(1 << 16) == b"", "nothing is answered before the proof"
    far.close()


def test_a_claim_for_another_address_moves_no_request(cluster: Cluster) -> None:
    """A keyed peer on 10.0.0.7 names b's endpoint (10.0.0.2): refused; a's import from b still goes to b."""
    link, far = accepted_link(cluster.a, 7, ("10.0.0.7", 40003))
    refused = claim(cluster, link, far, EP)
    assert isinstance(refused, F.Error) and refused.code == NO_PERMISSION
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, cluster.export()), P.RemoteImported)
    assert not [m for m in frames(far) if isinstance(m, F.Import)]


def test_a_claim_for_an_ipv4_mapped_address_is_not_taken_for_the_plain_one(cluster: Cluster) -> None:
    """A connection from ::ffff:10.0.0.2 (a dual-stack listener) naming 10.0.0.2: the claim is for another address
    as the link compares them, and nothing of b's moves to it."""
    link, far = accepted_link(cluster.a, 7, ("::ffff:10.0.0.7", 40004))
    refused = claim(cluster, link, far, ("10.0.0.7", 17017))
    assert isinstance(refused, F.Error) and ("10.0.0.7", 17017) not in cluster.a.links


def test_a_server_behind_the_same_address_cannot_take_another_servers_endpoint(cluster: Cluster) -> None:
    """Server 3 connects to a from b's address (10.0.0.2, another port) before a has a link to b, and names b's
    endpoint 10.0.0.2:17017. a's clients' imports of b's handles must not go to server 3 (it would learn each
    importer's pid, uid and tag and the handle's value): a claimed link carries requests only for the server that
    proved itself on it, so a dials b and the import works."""
    handle = cluster.export()
    link, far = accepted_link(cluster.a, 3, (B_ADDRESS, 40005))
    claim(cluster, link, far, EP)
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    got: list[P.Message] = []
    now = cluster.a.local(x, P.RemoteImport(handle), got.append)
    cluster.pump()
    stolen = [(req, m) for req, m in requests(far) if isinstance(m, F.Import)]
    for req, _ in stolen:  # the claimer answers as an exporter would
        far.send((F.Imported(777, MiB2, 0, 0, 0, 0, 1, 0, 0x10000000, f"{B_ADDRESS}:15000"), req))
    cluster.pump()
    reply = now if now is not None else (got[0] if got else None)
    assert not stolen, f"server 3 got a's import of server 2's handle: {stolen}"
    assert isinstance(reply, P.RemoteImported), reply


def test_a_claim_while_this_broker_dials_that_endpoint_for_another_server_takes_none_of_its_requests(
        cluster: Cluster) -> None:
    """a is dialing b for an import of b's handle (the key handshake not done yet) when server 3, from b's address,
    names b's endpoint: the import queued on a's own link stays there and goes to b, not to the claimer."""
    handle = cluster.export()
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    got: list[P.Message] = []
    assert cluster.a.local(x, P.RemoteImport(handle), got.append) is None
    assert cluster.a.links[EP].state is not State.READY
    link, far = accepted_link(cluster.a, 3, (B_ADDRESS, 40007))
    far.send((F.Listens(F.endpoint_bytes(*EP)), 1))
    cluster.a.sel.get_key(link.sock).data(selectors.EVENT_READ)  # a reads the claim before its handshake with b ends
    cluster.pump()
    assert not [m for m in frames(far) if isinstance(m, F.Import)]
    assert len(got) == 1 and isinstance(got[0], P.RemoteImported), got


def test_a_server_behind_the_same_address_cannot_adopt_another_servers_holds(cluster: Cluster) -> None:
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, cluster.export()), P.RemoteImported)
    (hold,) = cluster.b.remote_holds
    cluster.a.links[EP].close("a blip on the network")  # b keeps the hold on its lease; a will reconnect
    cluster.pump()
    assert EP in cluster.a.reconnect_at and cluster.b.remote_holds[hold].link is None
    _, far = accepted_link(cluster.a, 3, (B_ADDRESS, 40006))
    far.send((F.Listens(F.endpoint_bytes(*EP)), 1))
    cluster.pump()
    adopts = [(req, m) for req, m in requests(far) if isinstance(m, F.Adopt)]
    far.send(*[(F.Ok(), req) for req, _ in adopts])  # server 3 keeps whatever it is asked to keep
    cluster.pump()
    cluster.a.reconnect_at = {e: 0.0 for e in cluster.a.reconnect_at}  # any reconnection due now
    cluster.a.tick()
    cluster.pump()
    rh = cluster.b.remote_holds.get(hold)
    assert rh is not None and rh.link is not None and rh.link.state is State.READY, (
        f"b's hold is left to its lease, while a asked server 3 to keep it: {adopts}")


@pytest.mark.xfail(strict=True, reason=(
    "serving.py _inbound_ready/_holds_on: every broker proves the one cluster key, so a server id is only a claim; "
    "a compromised server that says it is server 1 closes server 1's link (a newer one replaces it), and its holds, "
    "now on their lease, are released by the claimer (hold ids count up from one start, its own import shows where)"))
def test_a_keyed_server_claiming_another_servers_id_cannot_release_its_holds(cluster: Cluster) -> None:
    handle = cluster.export()
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, handle), P.RemoteImported)
    (victims,) = cluster.b.remote_holds
    link, far = accepted_link(cluster.b, 3, ("10.0.0.3", 40007))  # server 3 imports once: its hold id is next to a's
    value, secret = int.from_bytes(handle[16:24], "little"), handle[64:96]
    far.send((F.Import(value, 2, F.secret_proof(secret, link.session), 3, 3333, 1000, 3), 1))
    cluster.pump()
    (mine,) = [m for m in frames(far) if isinstance(m, F.Imported)]
    impostor, fake = accepted_link(cluster.b, 1, ("10.0.0.3", 40008))  # then says it is server 1
    cluster.b._inbound_ready(impostor)  # as a proved handshake of server 1 would
    fake.send(*[(F.Release(h), i + 1) for i, h in enumerate(range(mine.hold - 4, mine.hold))])
    cluster.pump()
    assert victims in cluster.b.remote_holds, "server 3 released server 1's hold at server 2"


# ---------------------------------------------------------------- both brokers dialing at once


class BothWays:
    """Servers 1 (a) and 2 (b), each importing the other's export, whose dials reach each other (socket pairs from
    a source port of their own); `pump` runs the two loops one ready event at a time, in an order the seed picks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
        self.a, self.b = fabric_agent(1, EP_A), fabric_agent(2, EP)
        self.rng = random.Random(seed)
        self.ports = iter(range(50000, 60000))
        monkeypatch.setattr(agent_module, "dial", self._dial)

    def _dial(self, address: str, port: int, source: str | None = None) -> socket.socket:
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        near.setblocking(False)
        far.setblocking(False)
        there, came_from = (self.b, EP_A[0]) if (address, port) == EP else (self.a, EP[0])
        there.accepted_link(far, (came_from, next(self.ports)))
        return near

    def pump(self) -> None:
        for _ in range(10000):
            ready = [(key, mask) for sel in (self.a.sel, self.b.sel) for key, mask in sel.select(0)]
            if not ready:
                return
            key, mask = self.rng.choice(ready)
            key.data(mask)
        raise AssertionError("the two agents never went quiet")

    def links(self) -> list[Link]:
        """Every link not closed, on either side."""
        ends = {id(link): link for agent in (self.a, self.b) for link in (*agent.links.values(), *agent.accepted)}
        return [link for link in ends.values() if link.state is not State.CLOSED]

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _kept_on_live_links(w: BothWays) -> None:
    """Every remote hold at either exporter is tied to a proved link, and so is each importer's record of it."""
    for exporter in (w.a, w.b):
        for hold, rh in exporter.remote_holds.items():
            assert rh.link is not None and rh.link.state is State.READY, f"hold {hold:#x} is on its lease"
    for importer in (w.a, w.b):
        for (endpoint, hold), link in importer.taken.items():
            assert link.state is State.READY, f"{endpoint} {hold:#x} is tied to a closed link"
            assert hold in importer.held[endpoint]


@pytest.mark.parametrize("seed", range(24))
def test_both_brokers_dialing_at_once_keep_every_hold_on_a_live_link_and_release_it(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Server 1 imports server 2's export while server 2 imports server 1's, before either has a link: both dial.
    In any order of events both imports work, every hold is on a proved link, at most two connections are left
    (one each way, when both were proved before either's claim), and freeing leaves nothing held on either side.
    Then the links drop and both reconnect at once: every hold is adopted again on a live link, none is lost."""
    w = BothWays(monkeypatch, seed)
    try:
        from_b, from_a = export_on(w.b), export_on(w.a)
        x, y = w.a.ledger.connect(1111, 1000, (1, 1)), w.b.ledger.connect(2222, 1000, (2, 2))
        got: list[P.Message] = []
        assert w.a.local(x, P.RemoteImport(from_b), got.append) is None
        assert w.b.local(y, P.RemoteImport(from_a), got.append) is None
        w.pump()
        assert len(got) == 2 and all(isinstance(m, P.RemoteImported) for m in got), got
        assert len(w.links()) <= 4, "at most two connections (a link has two ends)"
        _kept_on_live_links(w)
        for link in w.links():  # the network drops every connection at once
            link.close("a blip on the network")
        w.pump()
        assert len(w.a.remote_holds) == len(w.b.remote_holds) == 1, "each on its lease"
        for agent in (w.a, w.b):
            agent.reconnect_at = {e: 0.0 for e in agent.reconnect_at}
        w.a.tick()
        w.b.tick()
        w.pump()
        _kept_on_live_links(w)
        assert len(w.a.remote_holds) == len(w.b.remote_holds) == 1
        w.a.ledger.disconnect(x)
        w.b.ledger.disconnect(y)
        w.pump()
        assert not w.a.remote_holds and not w.b.remote_holds and not w.a.served and not w.b.served
        assert not w.a.held and not w.b.held
    finally:
        w.close()


# ---------------------------------------------------------------- requests that time out alone


def test_an_import_that_timed_out_leaves_nothing_at_the_exporter_once_its_late_answer_comes(cluster: Cluster) -> None:
    """The exporter answers y's import after a's timeout: y got 507022 and holds nothing; at b the late hold is
    released with its registration, its charge to (server 1, uid 2000) and its client record."""
    handle = cluster.export()
    x, y = cluster.a.ledger.connect(1111, 1000, (1, 1)), cluster.a.ledger.connect(2222, 2000, (2, 2))
    assert isinstance(cluster.import_(x, handle), P.RemoteImported)
    link = cluster.a.links[EP]
    late: list[P.Message] = []
    assert cluster.a.local(y, P.RemoteImport(handle), late.append) is None
    for pending in link.pending.values():
        pending.deadline = 0.0
    cluster.a.wake(link)
    cluster.a.tick()
    assert len(late) == 1 and isinstance(late[0], P.Error) and late[0].code == IPC_ERROR
    assert not y.holds and len(cluster.a.held[EP]) == 1
    cluster.pump()  # b answers now, and a undoes it
    b = cluster.b
    assert len(b.remote_holds) == 1 and len(b.served) == 1 and len(b.engine.served) == 1  # type: ignore[union-attr]
    assert dict(b.ledger.usage.remote_holds) == {(1, 1000): 1}, "the late hold's charge is gone"
    assert [key[1] for key in b.remote_clients] == [1111], "and its client record"
    assert len(late) == 1 and link.state is State.READY and not link.abandoned


def _outbound_to_far(agent: Agent) -> tuple[Link, Far]:
    """A proved link `agent` dialed to EP, whose far end (server 2) the test plays."""
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    near.setblocking(False)
    link = agent.dialed_link(near, EP, 2)
    mine, theirs = secrets.token_bytes(32), secrets.token_bytes(32)
    link.state, link.peer_id, link.sealer, link.session = State.READY, 2, F.Sealer(mine), secrets.token_bytes(32)
    link.reader.authenticate(theirs)
    return link, Far(far, theirs, mine)


def _answer(hold: int) -> F.Imported:
    return F.Imported(hold, MiB2, 0, 0, 0, 0, 1, 0, 0x10000000 + hold * 4096, f"{EP[0]}:15000")


@pytest.mark.parametrize("then", ["duplicate", "replay"])
def test_a_late_answer_goes_to_its_own_request_never_to_a_newer_one(then: str) -> None:
    """x's import times out; y's import follows on the same link. The exporter answers x's request id late, then
    y's: the late hold is released, y gets its own. An answer to x's id again (sealed anew, or the bytes of an
    earlier answer replayed) closes the link and binds nothing: y keeps its one hold, kept for the reconnection."""
    a = fabric_agent(1, EP_A)
    try:
        link, far = _outbound_to_far(a)
        handle = FabricHandle(2, 0, 0x1234, MiB2, secrets.token_bytes(32), 0, Endpoint(4, *EP)).pack()
        x, y = a.ledger.connect(1111, 1000, (1, 1)), a.ledger.connect(2222, 1000, (2, 2))
        gx: list[P.Message] = []
        gy: list[P.Message] = []
        assert a.local(x, P.RemoteImport(handle), gx.append) is None
        for pending in link.pending.values():
            pending.deadline = 0.0
        a.wake(link)
        a.tick()
        assert len(gx) == 1 and isinstance(gx[0], P.Error) and gx[0].code == IPC_ERROR
        assert a.local(y, P.RemoteImport(handle), gy.append) is None
        (rx, _), (ry, _) = requests(far)
        assert rx != ry
        far.send((_answer(77), rx))
        link.on_event(selectors.EVENT_READ)
        assert not gy and [m for _, m in requests(far)] == [F.Release(77)]
        sealed = far.sealer.seal(F.encode(_answer(78), ry))
        far.sock.sendall(sealed)
        link.on_event(selectors.EVENT_READ)
        assert len(gy) == 1 and isinstance(gy[0], P.RemoteImported) and a.held[EP] == {78}
        if then == "duplicate":
            far.send((_answer(79), rx))
        else:
            far.sock.sendall(sealed)
        link.on_event(selectors.EVENT_READ)
        assert link.state is State.CLOSED and a.held[EP] == {78} and len(y.holds) == 1 and not x.holds
        assert len(gx) == len(gy) == 1 and EP in a.reconnect_at
    finally:
        a.close()


# ---------------------------------------------------------------- heartbeats per link


def test_a_heartbeat_flood_from_a_peer_that_does_not_read_closes_its_link_alone(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """A keyed peer floods b with heartbeats and never reads the answers: b queues at most MAX_UNSENT bytes for
    it and closes that link; a's link and hold at b are untouched, and a's release still goes through."""
    x = cluster.a.ledger.connect(1111, 1000, (1, 1))
    assert isinstance(cluster.import_(x, cluster.export()), P.RemoteImported)
    flooder, far = accepted_link(cluster.b, 3, ("10.0.0.3", 40009))
    far.sock.setblocking(False)
    caplog.set_level(logging.INFO, "vmmshare.fabric")
    unsent, sent, req = b"", 0, 0
    while flooder.state is not State.CLOSED and sent < 100 * MAX_UNSENT:
        if not unsent:  # the next thousand heartbeats, sealed in order
            unsent = b"".join(far.sealer.seal(F.encode(F.Heartbeat(), req + i)) for i in range(1, 1001))
            req += 1000
        with contextlib.suppress(BlockingIOError):
            n = far.sock.send(unsent)
            sent, unsent = sent + n, unsent[n:]
        cluster.pump()
    assert flooder.state is State.CLOSED, f"b still answers after {sent} bytes of heartbeats"
    assert "does not read" in caplog.text
    (hold,) = cluster.b.remote_holds
    rh = cluster.b.remote_holds[hold]
    assert rh.link is not None and rh.link.state is State.READY and cluster.a.links[EP].state is State.READY
    cluster.a.ledger.disconnect(x)
    cluster.pump()
    assert not cluster.b.remote_holds and not cluster.b.served


