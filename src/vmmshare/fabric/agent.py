"""The broker's fabric side (SPEC §8), driven by the broker's event loop: no threads but the engine's own.

Importing: a client's RemoteImport is forwarded to the exporting node's broker over a link (one per pair of servers,
made on demand by whichever needs it first and then used both ways, the cluster key proved first); the reply reaches
the client when it comes, without holding up the loop.
The importing broker keeps a local hold for each remote import (ledger.adopt_remote): when the client frees the
memory or dies, the hold goes and the remote hold is released on the link.

Exporting (serving.py): a remote import is an import like any other, by the same ledger code, and this broker's
transfer engine serves the memory while remote imports of it live.

Remote holds are tied to the link they came on. The kernel watches each link (TCP keepalive, link.keep_alive): a
link whose peer's host or network is gone fails after SILENCE_FACTOR fabric timeouts, a peer broker that exits
resets it at once, and an idle link never wakes this loop. A link that dies leaves its holds for a lease of
LEASE_FACTOR fabric timeouts, within which the importing broker reconnects and adopts them again; what is not
adopted by then is released, so nothing stays behind a server that went away. Every deadline is in one heap: a
wake-up touches what is due, never every link or hold.
"""

from __future__ import annotations

import contextlib
import heapq
import ipaddress
import itertools
import logging
import os
import secrets
import selectors
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

from .. import constants as C
from ..backends import mman
from ..books.ledger import Client, Ledger, LedgerError
from ..config import Config
from ..errors import AclError, FeatureNotSupportedError
from ..wire import local as P
from ..wire import peer as F
from ..wire.handles import Endpoint, decode_fabric
from .engine import Engine, missing
from .link import Link, State, dial
from .metadata import MetadataService, new_token
from .serving import LEASE_FACTOR, MAX_LINKS, RemoteHold, Served, Serving, map_budget

log = logging.getLogger("vmmshare.fabric")
RETRY_FACTOR = 0.5  # a lost link to an exporter holding our holds is dialed again after this many fabric timeouts
MAX_DIALS_PER_USER = 16  # links one user's imports may have waiting on their key handshake at once
MIN_KEY, MAX_KEY = 32, 4096
FABRIC = C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC
Endpoint_ = tuple[str, int]
Answer = Callable[[P.Message], None]


class FabricSetupError(RuntimeError):
    """The fabric is on but cannot start (key file, address, engine); the message says what to fix."""


def endpoint_of(config: Config) -> Endpoint:
    """Where other servers reach this node: written into its FABRIC handles (zero when the fabric is off)."""
    if config.fabric == "off" or not config.fabric_addr:
        return Endpoint()
    return Endpoint(6 if ":" in config.fabric_addr else 4, config.fabric_addr, config.fabric_port)


def read_cluster_key(path: Path | None) -> bytes:
    """The cluster key: a regular file of the broker's own user, readable by nobody else, of 32 bytes or more."""
    if path is None:
        raise FabricSetupError("VMMSHARE_CLUSTER_KEY_FILE is not set: name a file holding the cluster's shared "
                               "secret (32 or more random bytes, mode 0600)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise FabricSetupError(f"cannot read the cluster key file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FabricSetupError(f"the cluster key file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise FabricSetupError(f"the cluster key file {path} belongs to uid {st.st_uid}, not to this broker's "
                                   f"user ({os.geteuid()}): chown it")
        if st.st_mode & 0o077:
            raise FabricSetupError(f"the cluster key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: others "
                                   f"could read the key; chmod 600 {path}")
        key = os.read(fd, MAX_KEY + 1)
    finally:
        os.close(fd)
    if not MIN_KEY <= len(key) <= MAX_KEY:
        raise FabricSetupError(f"the cluster key file {path} holds {len(key)} bytes: it takes {MIN_KEY} to {MAX_KEY} "
                               f"random bytes (head -c 48 /dev/urandom > {path})")
    return key


class Agent(Serving):
    """The broker's fabric side; with the fabric off it only answers remote imports with what to configure."""

    def __init__(self, config: Config, ledger: Ledger, sel: selectors.BaseSelector) -> None:
        self.config, self.ledger, self.sel = config, ledger, sel
        self.enabled = config.fabric != "off"
        self.server_id, self.timeout = config.server_id, config.fabric_timeout
        self.endpoint = endpoint_of(config)
        self.key = b""
        self.listener: socket.socket | None = None
        self.engine: Engine | None = None
        self.meta = MetadataService(self.timeout)  # the node's metadata service for every engine here
        self.meta_token = new_token()
        self.data_endpoint = ""
        self.client_tokens: dict[Client, bytes] = {}  # each importing process's namespace in the metadata service
        # importing side
        self.links: dict[Endpoint_, Link] = {}
        self.held: dict[Endpoint_, set[int]] = {}  # remote holds this node's clients have, by exporting broker
        self.taken: dict[tuple[Endpoint_, int], Link] = {}  # the link each of them was taken or adopted over
        self.held_from: dict[Endpoint_, int] = {}  # the server id that proved itself at an endpoint we hold at
        self.reconnect_at: dict[Endpoint_, float] = {}
        self.lost_at: dict[Endpoint_, float] = {}  # when the link to an exporter with our remote holds went down
        # exporting side
        self.accepted: set[Link] = set()
        self.remote_clients: dict[tuple[int, int, int, int], Client] = {}  # (server, pid, uid, tag) -> record
        self.client_keys: dict[Client, tuple[int, int, int, int]] = {}
        self.remote_holds: dict[int, RemoteHold] = {}
        self.served: dict[int, Served] = {}  # remote hold id -> its registration with the engine
        self.unmaps: list[tuple[float, int, int]] = []  # (when, address, size) of mappings no longer served
        self.map_budget = map_budget()
        self.dialed_by: dict[Endpoint_, int] = {}  # endpoint -> the uid whose import made this broker dial it
        self.timers: list[tuple[float, int, Link]] = []  # (when, order, link): the links' deadlines, a heap
        self.leases: list[tuple[float, int]] = []  # (expires, hold): remote holds waiting to be adopted, a heap
        self._order = itertools.count()

    # ------------------------------------------------------------ life

    def start(self) -> None:
        """Read the key and listen on VMMSHARE_FABRIC_ADDR:VMMSHARE_FABRIC_PORT (FabricSetupError if it cannot)."""
        if not self.enabled:
            return
        problem = missing()
        if problem:
            raise FabricSetupError(f"VMMSHARE_FABRIC={self.config.fabric}, but {problem}")
        if not self.config.fabric_addr:
            raise FabricSetupError("VMMSHARE_FABRIC is on but VMMSHARE_FABRIC_ADDR is not set: give this node's "
                                   "address on the fabric network")
        self.key = read_cluster_key(self.config.cluster_key_file)
        try:
            self.meta.start()
            self.meta.add(self.meta_token, broker=True)
            self._start_engine()  # now, with the broker: never in its loop at the first remote import
        except AclError as exc:
            self.meta.close()
            raise FabricSetupError(exc.message) from None
        addr, port = self.endpoint.address, self.endpoint.port
        family = socket.AF_INET6 if self.endpoint.family == 6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            if self.engine is not None:
                self.engine.close()
                self.engine = None
            self.meta.close()
            raise FabricSetupError(f"cannot listen for other brokers on {addr}:{port}: {exc.strerror} (check "
                                   "VMMSHARE_FABRIC_ADDR and VMMSHARE_FABRIC_PORT)") from None
        self.listener = sock
        self.sel.register(sock, selectors.EVENT_READ, self._accept)
        log.info("fabric: server %#x listening for other brokers on %s:%d over %s", self.server_id, addr, port,
                 self.config.fabric)

    def close(self) -> None:
        """Stop: links closed, every served export unregistered and unmapped, the engine stopped."""
        if self.listener is not None:
            self.sel.unregister(self.listener)
            self.listener.close()
            self.listener = None
        for link in [*self.links.values(), *self.accepted]:
            link.close("this broker is stopping")
        for hold in list(self.served):
            self._unserve(hold, grace=False)
        for _, address, size in self.unmaps:
            with contextlib.suppress(OSError):
                mman.unmap(address, size)
        self.unmaps.clear()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.client_tokens.clear()
        self.meta.close()

    # ------------------------------------------------------------ the event loop's side

    def wait_time(self) -> float | None:
        """Seconds until the agent has something to do (None: nothing scheduled)."""
        if not (self.timers or self.reconnect_at or self.leases or self.unmaps):
            return None  # the usual case (no fabric, or no link with a deadline): said at once, each loop turn
        while self.timers:  # a deadline that passed out of date (a handshake done, a link closed) is dropped here
            when, _, link = self.timers[0]
            due = self._next_due(link) if link.wake_at == when else None
            if due is not None and due <= when:
                break
            heapq.heappop(self.timers)
            if link.wake_at == when:
                link.wake_at = None
                if due is not None:
                    link.wake_at = due
                    heapq.heappush(self.timers, (due, next(self._order), link))
        times = [self.timers[0][0]] if self.timers else []
        times += self.reconnect_at.values()
        if self.leases:
            times.append(self.leases[0][0])
        if self.unmaps:
            times.append(self.unmaps[0][0])
        return max(0.0, min(times) - time.monotonic()) if times else None

    def tick(self) -> None:
        """Do what is due: timeouts, heartbeats, silent links, reconnections, expired leases, old mappings."""
        if not (self.timers or self.reconnect_at or self.leases or self.client_tokens or self.unmaps):
            return  # nothing scheduled at all: the usual case, each loop turn
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            when, _, link = heapq.heappop(self.timers)
            if link.wake_at == when:
                link.wake_at = None
                self._due(link, now)
        for endpoint, when in list(self.reconnect_at.items()):
            if when <= now:
                del self.reconnect_at[endpoint]
                if self.held.get(endpoint) and now - self.lost_at.get(endpoint, now) >= LEASE_FACTOR * self.timeout:
                    self._lose(endpoint, "its lease ended before the link came back")
                elif self.held.get(endpoint):
                    try:
                        self._link(endpoint, self.held_from.get(endpoint), quiet=True)
                    except OSError as exc:  # no route now: tried again later, until the exporter's lease ends
                        log.info("fabric: cannot reconnect to %s:%d: %s", *endpoint, exc.strerror or exc)
        while self.leases and self.leases[0][0] <= now:
            expires, hold = heapq.heappop(self.leases)
            rh = self.remote_holds.get(hold)
            if rh is not None and rh.link is None and rh.expires == expires:
                log.info("fabric: remote hold of pid %d of server %#x not adopted within its lease: released",
                         rh.client.pid, rh.server)
                self._drop_remote(hold)
        if self.client_tokens:
            self._forget_tokens()
        while self.unmaps and self.unmaps[0][0] <= now:  # appended in the order they are due
            _, address, size = self.unmaps.pop(0)
            with contextlib.suppress(OSError):
                mman.unmap(address, size)

    def _due(self, link: Link, now: float) -> None:
        """A link's wake-up: its timed-out requests fail, or its handshake's time is up."""
        link.expire(now)
        self.wake(link)

    def _next_due(self, link: Link) -> float | None:
        """When the link next has something to do: a request's or its handshake's deadline (None: nothing waits)."""
        return link.next_deadline()

    def wake(self, link: Link) -> None:
        """Put the link's next deadline (a request's, its handshake's) in the timer heap."""
        when = self._next_due(link)
        if when is not None and (link.wake_at is None or when < link.wake_at):
            link.wake_at = when
            heapq.heappush(self.timers, (when, next(self._order), link))

    # ------------------------------------------------------------ this node's clients

    def local(self, client: Client, request: P.Message, answer: Answer) -> P.Message | None:
        """Serve a client's fabric request: the reply now, or None when `answer` will get it later."""
        if isinstance(request, P.RemoteImport):
            return self._remote_import(client, request, answer)
        return P.Error(C.ACL_ERROR_RT_IPC_ERROR, f"{request.TYPE.name} is not a fabric request")

    def _remote_import(self, client: Client, m: P.RemoteImport, answer: Answer) -> P.Message | None:
        try:
            handle = decode_fabric(m.handle)
        except AclError as exc:
            return P.Error(exc.code, exc.message)
        if not self.enabled:
            return P.Error(C.ACL_ERROR_RT_FEATURE_NOT_SUPPORT, (
                f"this FABRIC handle comes from server {handle.server_id:#x}; importing across servers needs the "
                "cross-server transport, which is off on this node: start its broker with VMMSHARE_FABRIC=tcp, "
                "VMMSHARE_FABRIC_ADDR and VMMSHARE_CLUSTER_KEY_FILE set (an auto-started broker takes them from the "
                "environment of the process that starts it)"))
        ep = handle.endpoint
        if ep.family == 0:
            return P.Error(C.ACL_ERROR_RT_FEATURE_NOT_SUPPORT, (
                f"this FABRIC handle of server {handle.server_id:#x} carries no fabric endpoint: that server's broker "
                "runs without the cross-server transport (set VMMSHARE_FABRIC, VMMSHARE_FABRIC_ADDR and "
                "VMMSHARE_CLUSTER_KEY_FILE there, then export again)"))
        endpoint = (_canonical(ep.address), ep.port)
        if ep == self.endpoint:
            return P.Error(C.ACL_ERROR_RT_PARAM_INVALID, (
                f"this FABRIC handle was exported on this node (server id {handle.server_id:#x} in the handle, "
                f"{self.server_id:#x} here): import it in a process whose VMMSHARE_SERVER_ID matches its broker's"))
        fresh = self._reusable(endpoint, handle.server_id) is None
        if fresh and len(self.links) >= MAX_LINKS:
            return P.Error(C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, (
                f"this broker has links to {len(self.links)} other servers' brokers, its limit: the import from "
                f"{ep.address}:{ep.port} is refused (release imports of other servers first)"))
        unproved = [e for e, u in self.dialed_by.items() if u == client.uid and e in self.links
                    and self.links[e].state is not State.READY]
        if fresh and len(unproved) >= MAX_DIALS_PER_USER:  # a user cannot fill the links with silent listeners
            return P.Error(C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, (
                f"uid {client.uid} has {len(unproved)} links to other servers' brokers waiting on their key handshake, "
                f"its limit ({MAX_DIALS_PER_USER}): the import from {ep.address}:{ep.port} is refused until they are "
                "done"))
        try:
            link = self._link(endpoint, handle.server_id)
            if fresh:
                self.dialed_by[endpoint] = client.uid
        except OSError as exc:
            return P.Error(C.ACL_ERROR_RT_IPC_ERROR, f"cannot reach the broker of server {handle.server_id:#x} at "
                                                     f"{ep.address}:{ep.port}: {exc.strerror}")
        tag = client.identity[1] or client.identity[0] or 0
        sent: list[Link] = []  # the link it went on (another link of the same peer may carry it, see _listens)

        def request(on: Link) -> F.Import:  # made once the link is proved: the secret's proof is bound to it
            sent.append(on)
            return F.Import(handle.handle, FABRIC, F.secret_proof(handle.secret, on.session), self.server_id,
                            client.pid, client.uid, tag)

        def imported(reply: F.PeerMessage) -> None:
            on = sent[-1] if sent else link
            if isinstance(reply, F.Imported) and on.peer_id != handle.server_id:
                self._took(endpoint, reply.hold, on)
                self._release_remote(endpoint, reply.hold)
                reply = F.Error(C.ACL_ERROR_RT_INVALID_HANDLE, (
                    f"this FABRIC handle names server {handle.server_id:#x}, but the broker at {ep.address}:{ep.port} "
                    f"proved it is server {on.peer_id:#x}: the handle is forged or garbled"))
            answer(self._imported(client, endpoint, handle.size, reply, on))

        def late(reply: F.PeerMessage) -> None:  # the importer was told it timed out: undo what the exporter did
            if isinstance(reply, F.Imported) and sent:
                sent[-1].request(F.Release(reply.hold), _ignore)

        link.request(request, imported, late)
        return None

    def _imported(self, client: Client, endpoint: Endpoint_, size: int, reply: F.PeerMessage,
                  on: Link | None = None) -> P.Message:
        """The exporter's answer to a client's import (`on`: the link it came over; the endpoint's by default)."""
        if isinstance(reply, F.Error):
            return P.Error(reply.code, reply.message)
        if not isinstance(reply, F.Imported):
            return P.Error(C.ACL_ERROR_RT_IPC_ERROR, f"the exporting broker answered {reply.KIND.name} to an import")
        on = on if on is not None else self.links.get(endpoint)
        if on is not None:
            self._took(endpoint, reply.hold, on)
        self.held.setdefault(endpoint, set()).add(reply.hold)
        data = _data_endpoint(reply.segment)  # on the exporting broker's own address: nowhere else on the network
        if data is not None and ipaddress.ip_address(data[0]) != ipaddress.ip_address(endpoint[0]):
            data = None
        if reply.size != size:  # the handle's size field is not the exported memory's: not that handle (rule 16)
            self._release_remote(endpoint, reply.hold)
            return P.Error(C.ACL_ERROR_RT_INVALID_HANDLE, (
                f"this FABRIC handle says {size} bytes but the exporting broker at {endpoint[0]}:{endpoint[1]} "
                f"exported {reply.size}: it does not match what was exported (pass the 128 bytes the exporter "
                "produced)"))
        if reply.address == 0 or data is None:
            self._release_remote(endpoint, reply.hold)
            return P.Error(C.ACL_ERROR_RT_IPC_ERROR, (
                f"the exporting broker at {endpoint[0]}:{endpoint[1]} answered with an address or data endpoint "
                f"({reply.segment!r}) that does not match the handle ({size} bytes): refused"))
        if client not in self.ledger.clients:  # it left while we waited
            self._release_remote(endpoint, reply.hold)
            return P.Error(C.ACL_ERROR_RT_IPC_ERROR, "the importer left")
        try:
            token, segment = self._install(client, data, reply.address, reply.size)
        except AclError as exc:
            self._release_remote(endpoint, reply.hold)
            return P.Error(exc.code, exc.message)
        key = f"mooncake/ram/{segment}"

        def gone() -> None:
            self._release_remote(endpoint, reply.hold)
            if self.client_tokens.get(client) == token:
                with contextlib.suppress(AclError):
                    self.meta.delete(token, key)

        try:
            hold = self.ledger.adopt_remote(client, reply.size, gone)
        except LedgerError as exc:  # e.g. the user's quota of holds: the exporter's hold goes at once
            gone()
            return P.Error(exc.code, exc.message)
        return P.RemoteImported(hold, reply.size, reply.memory_kind, reply.handle_type, reply.allocation_type,
                                reply.mem_attr, reply.location_type, reply.location_id, reply.address,
                                self.meta.port, token, data[1], segment)

    def _install(self, client: Client, data: Endpoint_, address: int, size: int) -> tuple[bytes, str]:
        """Describe one remote hold to its importing process's engine alone: a segment of a fresh name under that
        process's token, listing only the hold's registration and the exporting engine's data host and port."""
        if self.config.fabric != "tcp":
            raise FeatureNotSupportedError(
                f"VMMSHARE_FABRIC={self.config.fabric}: remote imports describe each hold to its process's engine "
                "for the tcp transport only (rdma would need the exporting engine's devices and keys per hold); "
                "use VMMSHARE_FABRIC=tcp")
        self._forget_tokens()
        token = self.client_tokens.get(client)
        if token is None:
            token = new_token()
            self.meta.add(token)
            self.client_tokens[client] = token
        segment = f"vmmshare-{secrets.token_hex(8)}"
        self.meta.put(token, f"mooncake/ram/{segment}", {
            "name": segment, "protocol": "tcp", "rdma_server_name": "", "tcp_data_host": data[0],
            "tcp_data_port": data[1], "tcp_proto_version": 2, "timestamp": "",
            "buffers": [{"addr": address, "length": size, "name": segment}]})
        return token, segment

    def _forget_tokens(self) -> None:
        """Drop the metadata namespaces of importing processes that left."""
        for client in [c for c in self.client_tokens if c not in self.ledger.clients]:
            token = self.client_tokens.pop(client)
            with contextlib.suppress(AclError):
                self.meta.drop(token)

    def _release_remote(self, endpoint: Endpoint_, hold: int) -> None:
        """This node's client is done with a remote hold: tell the exporting broker, over the link the hold is tied
        to (if that link is down, the hold is not adopted again and the exporter releases it when its lease ends)."""
        link = self.taken.get((endpoint, hold))
        if link is None or link.state is State.CLOSED:
            link = self.links.get(endpoint)
        self._forget(endpoint, hold)
        if link is not None:
            link.request(F.Release(hold), _ignore)

    def _took(self, endpoint: Endpoint_, hold: int, link: Link) -> None:
        """A remote hold at `endpoint` is tied to `link` now (taken or adopted over it)."""
        old = self.taken.get((endpoint, hold))
        if old is not None:
            old.holding.discard(hold)
        self.taken[(endpoint, hold)] = link
        link.holding.add(hold)
        if link.peer_id is not None:
            self.held_from[endpoint] = link.peer_id

    def _forget(self, endpoint: Endpoint_, hold: int) -> None:
        link = self.taken.pop((endpoint, hold), None)
        if link is not None:
            link.holding.discard(hold)
        held = self.held.get(endpoint)
        if held is not None:
            held.discard(hold)
            if not held:
                del self.held[endpoint]
                self.held_from.pop(endpoint, None)
                self.lost_at.pop(endpoint, None)

    def _lose(self, endpoint: Endpoint_, why: str) -> None:
        """Stop keeping the remote holds at an exporter (its broker released them): no more heartbeats or
        reconnections for them; copies of that memory fail, and freeing it is local only."""
        holds = self.held.pop(endpoint, set())
        self.held_from.pop(endpoint, None)
        for hold in holds:
            link = self.taken.pop((endpoint, hold), None)
            if link is not None:
                link.holding.discard(hold)
        self.lost_at.pop(endpoint, None)
        self.reconnect_at.pop(endpoint, None)
        log.warning("fabric: %d remote import(s) of memory served at %s:%d are lost: %s", len(holds), *endpoint, why)

    def _reusable(self, endpoint: Endpoint_, server: int | None) -> Link | None:
        """The live link requests for `server` at `endpoint` may go on: one this broker dialed there, or one a broker
        named that endpoint on (Listens) if it proved it is `server`; a claim proves only the address, so another
        server's claimed link is never used for this one's handles or holds."""
        link = self.links.get(endpoint)
        if link is None or link.state is State.CLOSED:
            return None
        if link.outbound or server is None or link.peer_id == server:
            return link
        return None

    def _link(self, endpoint: Endpoint_, server: int | None = None, quiet: bool = False) -> Link:
        """The link requests for `server` at `endpoint` go on (see `_reusable`); dialed now if there is none."""
        link = self._reusable(endpoint, server)
        if link is not None:
            return link
        try:
            sock = dial(*endpoint, source=self.config.fabric_addr)
        except OSError:
            if quiet:
                self._retry_later(endpoint)
            raise
        return self.dialed_link(sock, endpoint, server)

    def dialed_link(self, sock: socket.socket, endpoint: Endpoint_, server: int | None = None) -> Link:
        """The link over `sock`, a connection this broker made to the broker at `endpoint`: once both proved the
        key, this node's requests for `server` there go on it."""
        claim = (self.config.fabric_addr, self.config.fabric_port) if self.config.fabric_addr else None
        link = Link(sock, self.sel, self.key, self.server_id, self.timeout, True, endpoint,
                    on_ready=self._outbound_ready, on_request=self._request, on_closed=self._closed, claim=claim)
        link.meant_for = server
        link.on_deadline = self.wake
        self.links[endpoint] = link
        self.wake(link)
        return link

    def _outbound_ready(self, link: Link) -> None:
        """A new link to an exporting broker: adopt there the remote holds made on a link before it."""
        self._usable(link, link.endpoint)

    def _usable(self, link: Link, endpoint: Endpoint_) -> None:
        """`link` carries this broker's requests to `endpoint` now: the remote holds there whose link is gone are
        adopted over it (those tied to another live link stay on theirs)."""
        if self.held_from.get(endpoint, link.peer_id) != link.peer_id:  # another server is at that endpoint now
            return
        self.lost_at.pop(endpoint, None)
        self.reconnect_at.pop(endpoint, None)
        for hold in sorted(self.held.get(endpoint, ())):
            tied = self.taken.get((endpoint, hold))
            if tied is None or tied.state is State.CLOSED:
                link.request(F.Adopt(hold), self._adopted(link, endpoint, hold))

    def _adopted(self, link: Link, endpoint: Endpoint_, hold: int) -> Callable[[F.PeerMessage], None]:
        def done(reply: F.PeerMessage) -> None:
            if isinstance(reply, F.Error) and reply.code != C.ACL_ERROR_RT_IPC_ERROR:  # refused, not a link failure
                log.warning("fabric: %s could not keep remote hold %#x: %s", link.name, hold, reply.message)
                self._forget(endpoint, hold)
            elif isinstance(reply, F.Ok) and hold in self.held.get(endpoint, ()):
                self._took(endpoint, hold, link)

        return done

    def _listens(self, link: Link, m: F.Listens) -> F.PeerMessage:
        """A broker that connected names its own endpoint: this broker's requests to it go over the same link (one
        link per pair). Taken only for the address the connection comes from, once; a link this broker dialed and
        that is still proving the key hands its requests over and closes."""
        if link.outbound or link.listens is not None:
            return F.Error(C.ACL_ERROR_RT_PARAM_INVALID, "an endpoint is named once, by the broker that connected")
        port = int.from_bytes(m.endpoint[16:18], "little")
        try:
            expected = F.endpoint_bytes(link.endpoint[0], port)
        except F.PeerProtocolError:
            expected = b""
        if not port or m.endpoint != expected:
            return F.Error(C.ACL_ERROR_RT_NO_PERMISSION, (
                f"the endpoint named is not on the address this connection comes from ({link.endpoint[0]}): requests "
                "to that broker go on a link of their own"))
        endpoint = (_canonical(link.endpoint[0]), port)
        owner = self.held_from.get(endpoint)
        if owner is not None and owner != link.peer_id:
            return F.Error(C.ACL_ERROR_RT_NO_PERMISSION, (
                f"{endpoint[0]}:{port} is where server {owner:#x} proved itself, and this node holds memory there: "
                "requests to it go on a link of their own"))
        link.listens = endpoint
        current = self.links.get(endpoint)
        if current is not None and current.state is not State.CLOSED and current.meant_for not in (None, link.peer_id):
            return F.Ok()  # this broker is dialing that endpoint for another server: its requests stay on that link
        if current is not None and current.state is State.READY:
            return F.Ok()  # both dialed at once and ours is proved: each side keeps its own (rare)
        self.links[endpoint] = link
        self.dialed_by.pop(endpoint, None)
        if current is not None and current.state is not State.CLOSED:
            link.adopt_queued(current.take_queued())
            current.close("the other broker connected first")
        self._usable(link, endpoint)
        return F.Ok()

    def _closed(self, link: Link) -> None:
        """A link closed: the holds the peer has here wait their lease; this node's holds there are kept for a
        reconnection within theirs."""
        self.accepted.discard(link)
        self._lease(link)
        link.holding.clear()
        endpoint = link.listens
        if endpoint is None or self.links.get(endpoint) is not link:
            return
        del self.links[endpoint]
        self.dialed_by.pop(endpoint, None)
        if self.held.get(endpoint):
            self.lost_at.setdefault(endpoint, time.monotonic())
            self._retry_later(endpoint)

    def _retry_later(self, endpoint: Endpoint_) -> None:
        self.reconnect_at[endpoint] = time.monotonic() + max(0.2, RETRY_FACTOR * self.timeout)


def _canonical(address: str) -> str:
    """An IP address as ipaddress writes it (what a link's peer address and a handle's endpoint are compared as)."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        return address


def _data_endpoint(text: str) -> Endpoint_ | None:
    """(address, port) of an exporting engine's data endpoint "<address>:<port>" ("[v6]:port"); None if garbled."""
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        return None
    return (host, number) if 0 < number < 65536 and port.isdigit() else None


def _ignore(reply: F.PeerMessage) -> None:
    if isinstance(reply, F.Error):
        log.debug("fabric: %s", reply.message)
