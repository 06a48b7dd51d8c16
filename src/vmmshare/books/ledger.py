"""The broker's books, without I/O: what memory is charged, who holds it, what is exported and who may import it.

The ledger is fed one typed request at a time with the client that sent it (and the fd that came with it, as an
opaque int) and returns the typed reply; a refusal is an Error reply with the rule's code. Everything that
touches the system is handed in: naming the process that has a pid now (`identify`), closing an fd the books
let go of (`close_fd`), the size and seals of an exported memfd (`memfd_info`), and randomness. The server does
the sockets, the kernel's credentials and the fd passing (server.py).

Words: a *hold* is one client's claim on charged memory (its charge, or an import of it), named by a hold id
that means something only to this broker; a *share* is an export, named on the node by its handle value. What
the processes of one user hold together is limited by `Quotas` (usage.py).
"""

from __future__ import annotations

import fcntl
import hmac
import itertools
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from .. import constants as C
from ..config import Quotas
from ..wire import local as P
from ..wire.handles import FLAG_NO_PID_VALIDATION, Endpoint, FabricHandle, default_bytes
from . import trust as trustlists
from .listing import LIST_IMPORTERS, LIST_PAGE, LIST_TRUST, listing_page
from .records import KIND_GPU, KIND_HOST, ChargedMemory, Client, Hold, Identity, Lookups, Share
from .usage import LedgerError, Usage

__all__ = ["LIST_IMPORTERS", "LIST_PAGE", "LIST_TRUST", "Client", "Ledger", "LedgerError", "Lookups"]

log = logging.getLogger("vmmshare.broker")
MAX_GPUS = 1024  # GPU ids accepted for GPU charges (the broker cannot see the GPUs)
FABRIC = C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # an exported memfd keeps its size
WRITE_SEALS = fcntl.F_SEAL_WRITE | 0x10  # F_SEAL_FUTURE_WRITE: importers map the memory read-write

Answer = tuple[P.Message, int]  # a reply and the fd to send with it (-1: none; the ledger still owns it)
NO_ENDPOINT = Endpoint()  # a node without the cross-server transport

NOT_ITS_MEMFD = "the attached fd is not the allocation's memory (a memfd of its size, open read-write)"

class Ledger:
    """The node's sharing authority as plain data: capacity accounting, holds, exports and their trustlists."""

    def __init__(
        self, devices: int, capacity: int, *, identify: Callable[[int], Identity], close_fd: Callable[[int], None],
        memfd_info: Callable[[int], tuple[int, int] | None], broker_pid: int = 0,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes, quotas: Quotas | None = None,
        fd_budget: int | None = None, endpoint: Endpoint = NO_ENDPOINT,
    ) -> None:
        self.capacity = capacity
        self.used = [0] * devices  # host-backed device memory, per device (capped by `capacity`)
        self.gpu_used: Counter[int] = Counter()  # GPU memory, per GPU (recorded only)
        self.clients: set[Client] = set()
        self.holds: dict[int, Hold] = {}
        self.exports: dict[int, Share] = {}  # handle value -> share
        self.identify, self.close_fd, self.memfd_info = identify, close_fd, memfd_info
        self.broker_pid = broker_pid
        self.random_bytes = random_bytes
        self.usage = Usage(quotas or Quotas(), capacity, fd_budget)
        self.endpoint = endpoint  # where other servers reach this node (FABRIC handles carry it)
        # hold ids count up from a random start of each broker run: another server's broker that still names a
        # hold of an earlier run (the exporting broker restarted) never hits a hold of this one
        self._hold_ids = itertools.count((int.from_bytes(random_bytes(4), "little") >> 1 << 32) + 1)
        self._serve: dict[type[P.Message], Callable[[Client, Any, int, Lookups | None], Answer]] = {
            P.Charge: self._charge, P.ChargeGpu: self._charge_gpu, P.Release: self._release_request,
            P.MemInfo: self._mem_info, P.Export: self._export, P.Revoke: self._revoke_request,
            P.SetPids: self._set_pids, P.Import: self._import, P.BareTgid: self._bare_tgid, P.List: self._list,
            P.SetRemotePids: self._set_remote_pids,
        }

    # ------------------------------------------------------------ clients

    def connect(self, pid: int, uid: int, identity: Identity, server: int | None = None) -> Client:
        """A process connected (or, with `server`, another server's process imports through its broker);
        LedgerError when it may not (a pid the broker cannot see, its user's quota of connections)."""
        if pid <= 0:
            raise LedgerError(
                "the broker cannot see this process (the kernel gives it pid 0: the broker runs in a pid namespace "
                "that does not contain this process); run the broker in the host's pid namespace, or in yours",
                C.ACL_ERROR_RT_NO_PERMISSION,
            )
        if server is None:  # a remote importer holds no connection here: its holds count, not connections
            self.usage.connect(uid)
        client = Client(pid, uid, identity, server=server)
        self.clients.add(client)
        return client

    def disconnect(self, client: Client) -> None:
        """A client left (or died): release all it held and revoke its exports."""
        if client not in self.clients:
            return
        for hold in list(client.holds):
            self._release(client, hold)
        self.clients.discard(client)
        if client.server is None:
            self.usage.disconnect(client.uid)

    def handle(self, client: Client, request: P.Message, fd: int = -1, sender: int | None = None,
               found: Lookups | None = None) -> Answer:
        """Serve one request of `client`. `fd` came with it: the ledger owns it from here (an export keeps it,
        anything else closes it). `sender` is the pid the kernel stamped on the message (None: the client's own);
        `found` holds pid lookups made ahead of time for it (see `pids_to_bind`)."""
        if fd >= 0 and (type(request) is not P.Export or (sender is not None and sender != client.pid)):
            self.close_fd(fd)
            fd = -1
        if sender is not None and sender != client.pid:
            return P.Error(C.ACL_ERROR_RT_NO_PERMISSION, _not_the_owner(client, sender)), -1
        serve = self._serve.get(type(request))
        if serve is None:
            reason = f"protocol error: {request.TYPE.name} is a reply, not a request"
            return P.Error(C.ACL_ERROR_RT_IPC_ERROR, reason), -1
        try:
            return serve(client, request, fd, found)
        except LedgerError as exc:
            return P.Error(exc.code, exc.message), -1

    def pids_to_bind(self, client: Client, request: P.Message) -> list[int]:
        """The pids `request` would look up, each once and in its order (none for an entry bound already, or for a
        request that is refused before any lookup): the server looks them up when it receives the request
        (server.py) and hands the results to `handle` as `found`."""
        if not isinstance(request, (P.Export, P.SetPids)):
            return []  # nothing to look up
        trust: dict[int, Identity] = {}
        others = 0
        if isinstance(request, P.SetPids):
            share = self.exports.get(request.shareable)
            if share is None or share.exporter is not client:
                return []
            trust, others = share.trust, len(share.remote_trust)
        elif request.hold not in client.holds:
            return []
        wanted = trustlists.to_look_up(request.pids, trust)
        if wanted is None:
            return []  # refused before any lookup
        new = sum(pid not in trust for pid in wanted)
        try:
            trustlists.check_room(len(trust) + others, new)
            self.usage.check_trust(client.uid, new)
        except LedgerError:
            return []
        return wanted

    def look_up(self, pids: Iterable[int], into: Lookups | None = None) -> Lookups:
        """Who has each pid now, or the error that kept it from being known (added to `into`)."""
        return trustlists.look_up(self.identify, pids, into)

    # ------------------------------------------------------------ capacity

    def _charge(self, client: Client, m: P.Charge, fd: int, found: Lookups | None) -> Answer:
        if m.device != -1:
            free = self.capacity - self.used[self._device(m.device)]
            if m.size > free:
                raise LedgerError(
                    f"device {m.device} has {free} of {self.capacity} bytes free on this node; {m.size} bytes do not "
                    f"fit. The capacity is the broker's VMMSHARE_DEVICE_MEMORY, read when it started (broker pid "
                    f"{self.broker_pid}): free memory, or stop the broker and start it again with a larger value",
                    C.ACL_ERROR_RT_MEMORY_ALLOCATION,
                )
            self.usage.check_memory(client.uid, m.device, m.size)
        return P.Token(self._new_charge(ChargedMemory(client, m.device, m.size))), -1

    def _charge_gpu(self, client: Client, m: P.ChargeGpu, fd: int, found: Lookups | None) -> Answer:
        """GPU memory (a CUDA-backend allocation): the GPU's own capacity applies, not this node's."""
        if m.device >= MAX_GPUS:
            raise LedgerError(f"GPU {m.device} is beyond {MAX_GPUS} GPUs", C.ACL_ERROR_RT_INVALID_DEVICEID)
        return P.Token(self._new_charge(ChargedMemory(client, m.device, m.size, KIND_GPU))), -1

    def _mem_info(self, client: Client, m: P.MemInfo, fd: int, found: Lookups | None) -> Answer:
        return P.Mem(self.capacity - self.used[self._device(m.device)], self.capacity), -1

    def _device(self, device: int) -> int:
        if not 0 <= device < len(self.used):
            raise LedgerError(f"device {device} does not exist on this node", C.ACL_ERROR_RT_INVALID_DEVICEID)
        return device

    def _account(self, memory: ChargedMemory, sign: int) -> None:
        """Count charged memory in (sign 1) or out (-1) of the node's tallies and its charger's user's."""
        if memory.kind == KIND_GPU:
            self.gpu_used[memory.device] += sign * memory.size
            if not self.gpu_used[memory.device]:
                del self.gpu_used[memory.device]
        elif memory.device != -1:
            self.used[memory.device] += sign * memory.size
            self.usage.memory(memory.charger.uid, memory.device, sign * memory.size)

    def _new_charge(self, memory: ChargedMemory) -> int:
        hold = self._new_hold(memory.charger, memory)  # first: it checks the user's quota of holds
        self._account(memory, 1)
        return hold

    # ------------------------------------------------------------ holds

    def _new_hold(self, client: Client, memory: ChargedMemory) -> int:
        """A hold id: a count, not a secret (a hold is only ever honoured for the client that holds it)."""
        self.usage.add_hold(client.uid, client.server)
        hold = next(self._hold_ids)
        self.holds[hold] = Hold(client, memory)
        client.holds.add(hold)
        return hold

    def _own(self, client: Client, hold: int) -> Hold:
        found = self.holds.get(hold)
        if found is None or found.client is not client:
            raise LedgerError("unknown allocation token for this connection", C.ACL_ERROR_RT_INVALID_HANDLE)
        return found

    def _release_request(self, client: Client, m: P.Release, fd: int, found: Lookups | None) -> Answer:
        self.release(client, m.hold)
        return P.Ok(), -1

    def release(self, client: Client, hold: int) -> None:
        """Drop one of `client`'s holds (107017 if it has no such hold)."""
        self._own(client, hold)
        self._release(client, hold)

    def _release(self, client: Client, hold: int) -> None:
        """Drop a hold; the exporter's own hold revokes the export, and the last one uncharges the memory."""
        memory = self.holds.pop(hold).memory
        client.holds.discard(hold)
        self.usage.drop_hold(client.uid, client.server)
        share = memory.share
        self_import = False
        if share is not None:
            self_import = share.exporter is client and hold in share.importers
            if share.exporter is client and not self_import:
                self._revoke(share)
            share.importers.pop(hold, None)
        memory.holders -= 1
        if memory.holders == 0:
            self._account(memory, -1)
            if memory.gone is not None:
                memory.gone()
        elif share is not None and memory.charger is client and not self._still_holds(client, memory, self_import):
            heir = _heir(share, client)
            if heir is not client:
                self._recharge(memory, heir)

    def _still_holds(self, client: Client, memory: ChargedMemory, self_import: bool) -> bool:
        """Whether `client` keeps a hold of `memory` after one of them went: an import of it, or (when what went was
        the exporter's own import, rule 13: rare, so looked for) its charge."""
        share = memory.share
        if share is not None and client in share.importers.values():
            return True
        return self_import and any(self.holds[h].memory is memory for h in client.holds)

    def _recharge(self, memory: ChargedMemory, holder: Client) -> None:
        """The client charged for `memory` let go of it while others hold it: charge the holder that keeps it alive
        (`_heir`), as the driver's reference counts keep it alive for that holder. The charge may take another user
        past its quota of memory (its own next charges are refused until it frees); it never leaves the charged
        user while a process of that user still holds the memory."""
        if memory.kind == KIND_HOST and memory.device != -1:
            self.usage.memory(memory.charger.uid, memory.device, -memory.size)
            self.usage.memory(holder.uid, memory.device, memory.size)
        memory.charger = holder

    # ------------------------------------------------------------ exports

    def _export(self, client: Client, m: P.Export, fd: int, found: Lookups | None) -> Answer:
        try:
            shareable = self._share(client, m, fd, found)
        except BaseException:
            if fd >= 0:
                self.close_fd(fd)
            raise
        return P.Exported(shareable), -1

    def _share(self, client: Client, m: P.Export, fd: int, found: Lookups | None) -> bytes:
        memory = self._own(client, m.hold).memory
        if memory.share is not None:
            raise LedgerError("this allocation was exported already", C.ACL_ERROR_RT_PARAM_INVALID)
        if m.flags not in (0, 1) or m.share_type not in (1, 2) or m.memory_kind != memory.kind:
            raise LedgerError(f"bad export flags {m.flags} or share type {m.share_type}, or memory kind "
                              f"{m.memory_kind} for an allocation charged as kind {memory.kind}",
                              C.ACL_ERROR_RT_PARAM_INVALID)
        if fd < 0 or m.size != memory.size:
            raise LedgerError(NOT_ITS_MEMFD, C.ACL_ERROR_RT_PARAM_INVALID)
        if memory.kind == KIND_HOST:
            self._check_memfd(fd, m.size)
        self.usage.check_export(client.uid)
        trust = trustlists.bind(self.identify, self.usage, client, m.pids, {}, found)
        handle = 0
        while handle == 0 or handle in self.exports:
            handle = int.from_bytes(self.random_bytes(8), "little")
        secret = self.random_bytes(32) if m.share_type == FABRIC else bytes(32)
        prop = (m.handle_type, m.allocation_type, m.mem_attr, m.location_type, m.location_id)
        memory.share = self.exports[handle] = Share(handle, memory, fd, m.share_type, m.flags, prop, client, secret,
                                                     trust)
        self.usage.add_export(client.uid, len(trust))
        log.debug("pid %d exported %#x (%d bytes, share type %d, flags %d)", client.pid, handle, m.size,
                  m.share_type, m.flags)
        if m.share_type == FABRIC:
            return FabricHandle(m.server_id, max(memory.device, 0), handle, m.size, secret,
                                FLAG_NO_PID_VALIDATION if m.flags else 0, self.endpoint).pack()
        return default_bytes(handle)

    def _check_memfd(self, fd: int, size: int) -> None:
        """A host export must be a memfd of the allocation's size that nobody can resize: importers map it, and a
        file that shrinks under a mapping kills them with SIGBUS."""
        info = self.memfd_info(fd)
        if info is None or info[0] != size:
            raise LedgerError(NOT_ITS_MEMFD, C.ACL_ERROR_RT_PARAM_INVALID)
        seals = info[1]
        if seals < 0 or seals & SIZE_SEALS != SIZE_SEALS or seals & WRITE_SEALS:
            raise LedgerError(
                "the attached fd is not a memfd sealed against resizing (F_SEAL_SHRINK, F_SEAL_GROW and F_SEAL_SEAL, "
                f"and no write seal; it has {'none: not a memfd' if seals < 0 else f'seals {seals:#x}'}): "
                "importers of a file that can shrink would die of SIGBUS",
                C.ACL_ERROR_RT_PARAM_INVALID,
            )

    def _revoke_request(self, client: Client, m: P.Revoke, fd: int, found: Lookups | None) -> Answer:
        share = self._own(client, m.hold).memory.share
        if share is not None:
            if m.hold in share.importers:
                raise LedgerError("only the exporter can revoke its handle", C.ACL_ERROR_RT_NO_PERMISSION)
            self._revoke(share)
        return P.Ok(), -1

    def _revoke(self, share: Share) -> None:
        """The exporter freed the allocation (or died): no new imports; importers keep what they hold."""
        if share.fd < 0:
            return
        self.exports.pop(share.handle, None)
        self.close_fd(share.fd)
        share.fd = -1
        self.usage.drop_export(share.exporter.uid, len(share.trust) + len(share.remote_trust))
        share.trust, share.remote_trust = {}, set()  # nobody imports any more: the lists are dead weight
        log.debug("handle %#x revoked", share.handle)

    def _shared(self, handle: int, share_type: int) -> Share:
        share = self.exports.get(handle)
        if share is None:
            raise LedgerError(
                f"shareable handle {handle:#018x} is unknown on this node, or revoked (its exporter freed it or "
                "exited)",
                C.ACL_ERROR_RT_INVALID_HANDLE,
            )
        if share.share_type != share_type:
            raise LedgerError(
                f"shareable handle {handle:#018x} was exported with share type {share.share_type}, not {share_type}",
                C.ACL_ERROR_RT_PARAM_INVALID,
            )
        return share

    def _own_share(self, client: Client, m: P.SetPids | P.SetRemotePids) -> Share:
        """The export whose trustlist `m` sets, which only its exporting process may set."""
        share = self._shared(m.shareable, m.share_type)
        if share.exporter is not client:
            raise LedgerError(
                f"only the exporting process (pid {share.exporter.pid}) may set the trustlist of {m.shareable:#018x}",
                C.ACL_ERROR_RT_NO_PERMISSION,
            )
        return share

    def _set_pids(self, client: Client, m: P.SetPids, fd: int, found: Lookups | None) -> Answer:
        share = self._own_share(client, m)
        before = len(share.trust)
        share.trust = trustlists.bind(self.identify, self.usage, client, m.pids, share.trust, found,
                                     len(share.remote_trust))
        self.usage.add_trust(client.uid, len(share.trust) - before)
        return P.Ok(), -1

    def _set_remote_pids(self, client: Client, m: P.SetRemotePids, fd: int, found: Lookups | None) -> Answer:
        """Trust processes of another server: (server id, pid) pairs, each admitting that server's pid only."""
        if self.endpoint.family == 0:
            raise LedgerError(
                f"pids of server {m.server:#x} can only be trusted through the cross-server transport, which is not "
                "configured on this node (VMMSHARE_FABRIC, VMMSHARE_FABRIC_ADDR, VMMSHARE_CLUSTER_KEY_FILE)",
                C.ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
        share = self._own_share(client, m)
        if not trustlists.valid_pids(m.pids):
            raise LedgerError("pids must be positive 32-bit ints", C.ACL_ERROR_RT_PARAM_INVALID)
        new = {(m.server, p) for p in m.pids} - share.remote_trust
        trustlists.check_room(len(share.trust) + len(share.remote_trust), len(new))
        self.usage.check_trust(client.uid, len(new))
        share.remote_trust |= new
        self.usage.add_trust(client.uid, len(new))
        return P.Ok(), -1

    # ------------------------------------------------------------ imports

    def _import(self, client: Client, m: P.Import, fd: int, found: Lookups | None) -> Answer:
        hold, share = self.admit(client, m.shareable, m.share_type, m.secret)
        return P.Imported(hold, share.memory.size, share.memory.kind, *share.prop), share.fd

    def admit(self, client: Client, shareable: int, share_type: int, secret: bytes) -> tuple[int, Share]:
        """Rules 11-14 for an import by `client` (of this node, or a remote importer of another server): the new
        hold on the export's memory, and the export."""
        share = self._shared(shareable, share_type)
        if share_type == FABRIC and not hmac.compare_digest(secret, share.secret):
            raise LedgerError(f"FABRIC handle {shareable:#018x} does not carry its secret",
                              C.ACL_ERROR_RT_INVALID_HANDLE)
        own = client is share.exporter  # rule 13: the exporter may import its own handle, trustlist or not
        if not own and not share.flags & C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION:
            trustlists.admitted(client, share)
        memory = share.memory
        hold = self._new_hold(client, memory)
        memory.holders += 1
        share.importers[hold] = client
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pid %d%s imported %#x", client.pid, trustlists.of_server(client), shareable)
        return hold, share

    def adopt_remote(self, client: Client, size: int, gone: Callable[[], None]) -> int:
        """A hold of `client` on memory that another server holds for it (a remote import): not charged to this
        node; `gone` runs when the hold goes (released, or the client left)."""
        return self._new_hold(client, ChargedMemory(client, -1, size, gone=gone))

    # ------------------------------------------------------------ who asks, and what there is

    def _bare_tgid(self, client: Client, m: P.BareTgid, fd: int, found: Lookups | None) -> Answer:
        return P.Pid(client.pid), -1

    def _list(self, client: Client, m: P.List, fd: int, found: Lookups | None) -> Answer:
        return P.Listing(self.listing(m.offset, client)), -1

    def listing(self, offset: int, viewer: Client) -> str:
        """One page of `vmmshare ls` as JSON (listing.py); the viewer's own connection is not counted."""
        others = len(self.clients) - (viewer in self.clients)
        return listing_page(self, offset, viewer, others)


def _heir(share: Share, leaving: Client) -> Client:
    """Who is charged for exported memory once `leaving`, charged for it, holds it no more: a process of the same
    user that still imports it (memory a user still reads counts against that user's quota before any other's: a
    user cannot push its charge onto another by keeping the memory alive through a second process of its own), else
    the earliest remaining importer of this node (a user that chose to keep it alive), else its exporter (another
    server's user has no memory tally here, so memory only another server keeps alive stays charged to its
    exporter's user: no quota is escaped that way, and a local importer that freed it is not left paying for
    another server's hold)."""
    heir = None
    for importer in share.importers.values():
        if importer.server is None:
            if importer.uid == leaving.uid:
                return importer
            if heir is None:
                heir = importer
    return heir if heir is not None else share.exporter


def _not_the_owner(client: Client, sender: int) -> str:
    who = f"pid {sender}" if sender > 0 else "a process the broker cannot see (pid 0: outside its pid namespace)"
    return (f"this connection to the broker belongs to pid {client.pid}, but {who} sent the request on it (a "
            "connection inherited across fork() or passed on): each process must open a connection of its own")
