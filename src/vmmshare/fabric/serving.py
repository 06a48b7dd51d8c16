"""The exporting side of the broker's fabric agent: the links other brokers open to this one, and the memory of
this node served to their importers.

A remote import is an import like any other, by the same ledger code (rules 11-14), for a `Client` record of the
importer's server and pid as its own broker reported them. Each remote hold gets a registration of its own with this
broker's transfer engine: a mapping of the export's memfd at a fresh random address, which only that hold's importer
is told. When the hold ends (released, or its lease ran out) that registration is unregistered at once, so the
address stops working for everyone, while other holds of the same export keep theirs; the mapping goes a fabric
timeout later (no transfer can still be landing by then). A dead link's holds wait LEASE_FACTOR fabric timeouts to
be adopted on a new link of the same server, and are released after that.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import hmac
import logging
import mmap
import secrets
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from .. import constants as C
from ..backends import mman
from ..books.ledger import Client, Ledger, LedgerError
from ..books.records import KIND_HOST, ChargedMemory
from ..config import Config
from ..errors import AclError, InternalError
from ..wire import peer as F
from .engine import Engine
from .link import Link, State
from .metadata import MetadataService

log = logging.getLogger("vmmshare.fabric")
LEASE_FACTOR = 4  # a dead link's remote holds wait this many fabric timeouts to be adopted on a new link
MAX_LINKS = 256  # accepted links at once
MAX_HANDSHAKES = 32  # accepted links that have not proved the key yet, at once
FABRIC = C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC


SERVED_SHARES = 4  # one (server id, uid) may have at most this fraction of the node's registrations (1/4)


MAX_SERVED = 4096  # registrations at once: the engine rewrites its whole descriptor (about 60 bytes each) at each
# one, in the broker's loop (measured: 2.2 ms at 1,000 registrations, 8.5 ms at 4,000, 17.5 ms at 8,000)


def map_budget() -> int:
    """How many registrations (one mapping each) this broker serves at once: MAX_SERVED, and at most half the
    mappings the kernel allows a process (vm.max_map_count), the other half left to the broker's own memory, which
    a process out of mappings can no longer grow."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            allowed = int(f.read())
    except (OSError, ValueError):
        allowed = 65530  # the kernel's default
    return max(SERVED_SHARES, min(MAX_SERVED, allowed // 2))


ALIAS_LOW, ALIAS_HIGH = 1 << 32, 1 << 46  # where a hold's mapping is placed: 2^34 page-aligned places at random
ALIAS_TRIES = 32
PAGE = mmap.PAGESIZE


@dataclass(eq=False)
class Served:
    """One remote hold's registration with this node's engine: a mapping of the export's memfd of its own."""

    address: int
    size: int


@dataclass(eq=False)
class RemoteHold:
    """A remote importer's hold on an export of this node, and the link that keeps it (None: leased)."""

    client: Client
    server: int
    memory: ChargedMemory
    link: Link | None
    expires: float = 0.0


class Serving:
    """The exporting side, mixed into the Agent (which owns the listener, the selector and the loop)."""

    config: Config
    ledger: Ledger
    sel: selectors.BaseSelector
    key: bytes
    server_id: int
    timeout: float
    listener: socket.socket | None
    engine: Engine | None
    accepted: set[Link]
    remote_clients: dict[tuple[int, int, int, int], Client]
    client_keys: dict[Client, tuple[int, int, int, int]]
    remote_holds: dict[int, RemoteHold]
    served: dict[int, Served]  # remote hold id -> its registration
    meta: MetadataService
    meta_token: bytes  # this broker's engine's namespace in the metadata service
    data_endpoint: str  # "<address>:<port>" where this broker's engine takes transfers
    unmaps: list[tuple[float, int, int]]
    map_budget: int  # registrations served at once, live and in their grace together (`map_budget()`)
    leases: list[tuple[float, int]]  # (expires, hold) of remote holds waiting to be adopted, a heap
    wake: Callable[[Link], None]  # the agent's: put a link's next deadline in its timer heap
    _closed: Callable[[Link], None]  # the agent's: a link closed
    _listens: Callable[[Link, F.Listens], F.PeerMessage]  # the agent's: a connecting broker named its endpoint

    # ------------------------------------------------------------ other brokers

    def _accept(self, mask: int) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    log.warning("fabric: cannot accept another broker: %s", exc.strerror)
                return
            handshaking = sum(1 for link in self.accepted if link.state is not State.READY)
            if len(self.accepted) >= MAX_LINKS or handshaking >= MAX_HANDSHAKES:
                log.warning("fabric: refused a connection from %s: too many links", peer[0])
                sock.close()
                continue
            self.accepted_link(sock, (peer[0], peer[1]))

    def accepted_link(self, sock: socket.socket, peer: tuple[str, int]) -> Link:
        """The link over `sock`, a connection another broker (at `peer`) made to this one: it must prove the key
        within the timeout, then serves that broker's requests."""
        sock.setblocking(False)
        sock.set_inheritable(False)
        link = Link(sock, self.sel, self.key, self.server_id, self.timeout, False, peer, on_ready=self._inbound_ready,
                    on_request=self._request, on_closed=self._closed,
                    listening=(self.config.fabric_addr, self.config.fabric_port))
        link.on_deadline = self.wake
        self.accepted.add(link)
        self.wake(link)  # its handshake's deadline
        return link

    def _inbound_ready(self, link: Link) -> None:
        """A broker that connected proved the key; an older link it made is stale now (it reconnected)."""
        for old in [o for o in self.accepted if o is not link and o.peer_id == link.peer_id]:
            old.close("the same server connected again")

    def _lease(self, link: Link) -> None:
        """The link closed: the remote holds taken or adopted over it wait a lease to be adopted on a new one."""
        expires = time.monotonic() + LEASE_FACTOR * self.timeout
        for hold in link.tied:
            rh = self.remote_holds.get(hold)
            if rh is not None and rh.link is link:
                rh.link, rh.expires = None, expires
                heapq.heappush(self.leases, (expires, hold))
        link.tied.clear()

    def _request(self, link: Link, req: int, m: F.PeerMessage) -> None:
        assert link.peer_id is not None
        reply: F.PeerMessage
        try:
            if isinstance(m, F.Import):
                reply = self._import_for(link, link.peer_id, m)
            elif isinstance(m, F.Release):
                reply = self._release_for(link, link.peer_id, m.hold)
            elif isinstance(m, F.Adopt):
                reply = self._adopt_for(link, link.peer_id, m.hold)
            elif isinstance(m, F.Listens):
                reply = self._listens(link, m)
            else:  # a heartbeat
                reply = F.Ok()
        except LedgerError as exc:  # e.g. a pid the ledger refuses: the peer gets the refusal, the link stays
            reply = F.Error(exc.code, exc.message)
        link.send(reply, req)

    def _import_for(self, link: Link, server: int, m: F.Import) -> F.PeerMessage:
        if m.server_id != server:
            return F.Error(C.ACL_ERROR_RT_NO_PERMISSION, f"server {server:#x} asked on behalf of server "
                                                         f"{m.server_id:#x}: a broker imports for its own processes")
        if m.share_type != FABRIC:
            return F.Error(C.ACL_ERROR_RT_PARAM_INVALID, "only FABRIC handles import across servers")
        key = (server, m.pid, m.uid, m.tag)
        client = self.remote_clients.get(key)
        if client is None:
            client = self.remote_clients[key] = self.ledger.connect(m.pid, m.uid, (None, None), server=server)
            self.client_keys[client] = key
        try:
            hold, share = self.ledger.admit(client, m.shareable, m.share_type, self._secret(link, m))
        except LedgerError as exc:
            self._forget_if_idle(client)
            return F.Error(exc.code, exc.message)
        memory = share.memory
        try:
            if memory.kind != KIND_HOST:
                raise AclError("this export is GPU memory, which this node's transfer engine cannot serve to other "
                               "servers: share host or device memory of the host backend across servers",
                               C.ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
            self._room_to_serve(server, m.uid)
            served = self._serve(hold, memory, share.fd)
        except (AclError, OSError) as exc:
            self.ledger.release(client, hold)
            self._forget_if_idle(client)
            code = exc.code if isinstance(exc, AclError) else C.ACL_ERROR_RT_INTERNAL_ERROR
            return F.Error(code, exc.message if isinstance(exc, AclError) else f"cannot serve the memory: {exc}")
        self.remote_holds[hold] = RemoteHold(client, server, memory, link)
        link.tied.add(hold)
        log.debug("fabric: pid %d of server %#x imported %#x", m.pid, server, m.shareable)
        # the hold's own registration and where the engine takes transfers: all the importer learns of this engine
        return F.Imported(hold, memory.size, memory.kind, *share.prop, served.address, self.data_endpoint)

    def _room_to_serve(self, server: int, uid: int) -> None:
        """Refuse (207005) a registration past the node's budget of mappings, or past a (server id, uid)'s share of
        it: each remote hold maps the memory once in this broker, and a broker out of mappings cannot grow its
        own memory either, so no importer may use them all up (its hold, just admitted, is counted in)."""
        budget = self.map_budget
        if len(self.served) + len(self.unmaps) >= budget:
            raise AclError(f"this node serves {len(self.served)} remote imports (and {len(self.unmaps)} just ended), "
                           f"all its broker serves at once ({budget}); try again "
                           "once some are released", C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL)
        held = self.ledger.usage.remote_holds[(server, uid)]
        if held > budget // SERVED_SHARES:
            raise AclError(f"uid {uid} of server {server:#x} holds {held - 1} remote imports here, its share of the "
                           f"{budget} this broker serves at once (a quarter): release some first",
                           C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL)

    def _secret(self, link: Link, m: F.Import) -> bytes:
        """The export's secret when the Import proved it for this link; otherwise something that is not it (the
        ledger then refuses the import as it refuses a wrong secret, with the same code and message)."""
        share = self.ledger.exports.get(m.shareable)
        if share is not None and share.secret and hmac.compare_digest(
                F.secret_proof(share.secret, link.session), m.secret_proof):
            return share.secret
        return b""

    def _holds_on(self, link: Link, server: int, hold: int) -> RemoteHold | None:
        """The remote hold `hold` if `link` may act on it: the link that took it or adopted it, or (while it waits on
        its lease) a new link of the same server, which proved the key again."""
        rh = self.remote_holds.get(hold)
        if rh is None or rh.server != server or (rh.link is not None and rh.link is not link):
            return None
        return rh

    def _release_for(self, link: Link, server: int, hold: int) -> F.PeerMessage:
        if self._holds_on(link, server, hold) is None:
            return F.Error(C.ACL_ERROR_RT_INVALID_HANDLE, f"no remote hold {hold:#x} taken over this link of "
                                                          f"server {server:#x} here")
        self._drop_remote(hold)
        return F.Ok()

    def _adopt_for(self, link: Link, server: int, hold: int) -> F.PeerMessage:
        rh = self._holds_on(link, server, hold)
        if rh is None:
            return F.Error(C.ACL_ERROR_RT_INVALID_HANDLE, f"remote hold {hold:#x} of server {server:#x} is gone "
                                                          "(released, or its lease ran out) or is not this link's")
        rh.link, rh.expires = link, 0.0
        link.tied.add(hold)
        return F.Ok()

    def _drop_remote(self, hold: int) -> None:
        rh = self.remote_holds.pop(hold)
        if rh.link is not None:
            rh.link.tied.discard(hold)
        with contextlib.suppress(LedgerError):
            self.ledger.release(rh.client, hold)
        if hold in self.served:
            self._unserve(hold, grace=True)
        self._forget_if_idle(rh.client)

    def _forget_if_idle(self, client: Client) -> None:
        if not client.holds:
            self.ledger.disconnect(client)
            key = self.client_keys.pop(client, None)
            if key is not None:
                self.remote_clients.pop(key, None)

    # ------------------------------------------------------------ serving memory

    def _serve(self, hold: int, memory: ChargedMemory, fd: int) -> Served:
        """Register a mapping of `fd` for `hold` alone, at an address of its own."""
        if self.engine is None:
            self._start_engine()
        assert self.engine is not None
        address = _alias(fd, memory.size)
        try:
            self.engine.register(address, memory.size)
        except BaseException:
            mman.unmap(address, memory.size)
            raise
        served = self.served[hold] = Served(address, memory.size)
        log.debug("fabric: serving %d bytes at %#x for remote hold %#x", memory.size, address, hold)
        return served

    def _start_engine(self) -> None:
        """This broker's engine, in the node's metadata service under the broker's own token (its descriptor,
        which lists every registration, is served to no one), and the data host and port importers are told."""
        engine = Engine(self.config.fabric_addr, self.config.fabric, self.timeout, self.meta.url(self.meta_token))
        try:
            desc = self.meta.get(self.meta_token, f"mooncake/ram/{engine.segment}")
            port = desc.get("tcp_data_port") if isinstance(desc, dict) else None
            if not isinstance(port, int) or not 0 < port < 65536:
                raise InternalError(f"the transfer engine published no data port ({desc!r})")
        except BaseException:
            engine.close()
            raise
        addr = self.config.fabric_addr
        self.data_endpoint = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        self.engine = engine

    def _unserve(self, hold: int, grace: bool) -> None:
        """Stop serving `hold`'s registration now; its mapping goes a fabric timeout later (`grace`) or now."""
        served = self.served.pop(hold)
        if self.engine is not None:
            self.engine.unregister(served.address)
        if grace:
            self.unmaps.append((time.monotonic() + self.timeout, served.address, served.size))
        else:
            with contextlib.suppress(OSError):
                mman.unmap(served.address, served.size)


def _alias(fd: int, size: int) -> int:
    """A shared read-write mapping of `fd` at a random page-aligned address in [ALIAS_LOW, ALIAS_HIGH): a peer
    that was never told it has 2^34 places to try (the kernel's own placement is predictable)."""
    pages = (ALIAS_HIGH - ALIAS_LOW - size) // PAGE
    for _ in range(ALIAS_TRIES):
        want = ALIAS_LOW + secrets.randbelow(pages) * PAGE
        if mman.ARENA_START - size < want < mman.ARENA_END:  # the runtime's own arena, in processes that have one
            continue
        try:
            got = mman.mmap_call(want, size, mman.PROT_READ | mman.PROT_WRITE,
                                 mman.MAP_SHARED | mman.MAP_FIXED_NOREPLACE, fd)
        except OSError as exc:
            if exc.errno == errno.EEXIST:  # something is mapped there: another place
                continue
            raise
        if got == want:
            return got
        mman.unmap(got, size)  # a kernel that took the flag as a hint placed it elsewhere
    return mman.map_file(fd, size)  # no free place found at random: where the kernel puts it
