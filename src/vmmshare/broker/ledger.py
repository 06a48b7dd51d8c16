"""The broker's books, without I/O: what memory is charged, who holds it, what is exported and who may import it.

The ledger is fed one typed request at a time with the client that sent it (and the fd that came with it, as an
opaque int) and returns the typed reply; a refusal is an Error reply with the rule's code. Everything that
touches the system is handed in: naming the process that has a pid now (`identify`), closing an fd the books
let go of (`close_fd`), the size of an exported memfd (`memfd_size`), and randomness. The server does the
sockets, the kernel's credentials and the fd passing (server.py).

Words: a *hold* is one client's claim on charged memory (its charge, or an import of it), named by a hold id
that means something only to this broker; a *share* is an export, named on the node by its handle value.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import constants as C
from .. import protocol as P
from ..handles import FLAG_NO_PID_VALIDATION, MAX_TRUSTLIST, Endpoint, FabricHandle, default_bytes
from .identity import Identity, same_process

log = logging.getLogger("vmmshare.broker")
KIND_HOST, KIND_GPU = 0, 1
MAX_GPUS = 1024  # GPU ids accepted for GPU charges (the broker cannot see the GPUs)
LIST_PAGE = 100  # exports per listing page, at most
LIST_IMPORTERS = 1000  # importers listed per export (importer_count has them all)
FABRIC = C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC
NO_ENDPOINT = Endpoint()  # a node without the cross-server transport

Answer = tuple[P.Message, int]  # a reply and the fd to send with it (-1: none; the ledger still owns it)


class LedgerError(Exception):
    """A refused request: the client gets an Error reply with this code and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)
class Client:
    """Who sends requests: a process as the kernel named it (pid, uid, identity), apart from any socket."""

    pid: int
    uid: int
    identity: Identity
    holds: set[int] = field(default_factory=set)  # hold ids
    server: int | None = None  # another server's process (a remote importer, as its own broker named it)


@dataclass(eq=False)
class ChargedMemory:
    """One allocation charged to the node, alive while any hold on it is."""

    charger: Client  # who charged it (the exporter, if it is exported)
    device: int  # -1: host memory (not capped)
    size: int
    kind: int = KIND_HOST  # a memfd, counted against the node's capacity; or KIND_GPU, which the driver caps
    holders: int = 1
    share: Share | None = None  # once exported
    gone: Callable[[], None] | None = None  # called when the last hold goes (memory held on another server)


@dataclass(eq=False)
class Share:
    """An export: the handle value that names it on the node, the memory's fd, and who may import it."""

    handle: int
    memory: ChargedMemory
    fd: int  # -1 once revoked
    share_type: int
    flags: int
    prop: tuple[int, int, int, int, int]  # handleType, allocationType, memAttr, location type, location id
    exporter: Client
    secret: bytes  # a FABRIC handle's; zeros for DEFAULT
    trust: dict[int, Identity] = field(default_factory=dict)  # pid -> the process it was bound to
    remote_trust: set[tuple[int, int]] = field(default_factory=set)  # (server id, pid) of other servers' processes
    importers: dict[int, Client] = field(default_factory=dict)  # hold id -> importer


@dataclass(eq=False)
class Hold:
    """One client's claim on charged memory: its charge, or one import of it."""

    client: Client
    memory: ChargedMemory


class Ledger:
    """The node's sharing authority as plain data: capacity accounting, holds, exports and their trustlists."""

    def __init__(
        self, devices: int, capacity: int, *, identify: Callable[[int], Identity], close_fd: Callable[[int], None],
        memfd_size: Callable[[int], int | None], broker_pid: int = 0,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes, endpoint: Endpoint = NO_ENDPOINT,
    ) -> None:
        self.capacity = capacity
        self.used = [0] * devices  # host-backed device memory, per device (capped by `capacity`)
        self.gpu_used: Counter[int] = Counter()  # GPU memory, per GPU (recorded only)
        self.clients: set[Client] = set()
        self.holds: dict[int, Hold] = {}
        self.exports: dict[int, Share] = {}  # handle value -> share
        self.identify, self.close_fd, self.memfd_size = identify, close_fd, memfd_size
        self.broker_pid = broker_pid
        self.random_bytes = random_bytes
        self.endpoint = endpoint  # where other servers reach this node (FABRIC handles carry it)
        self._serve: dict[type[P.Message], Callable[[Client, Any, int], Answer]] = {
            P.Charge: self._charge, P.ChargeGpu: self._charge_gpu, P.Release: self._release_request,
            P.MemInfo: self._mem_info, P.Export: self._export, P.Revoke: self._revoke_request,
            P.SetPids: self._set_pids, P.Import: self._import, P.BareTgid: self._bare_tgid, P.List: self._list,
            P.SetRemotePids: self._set_remote_pids,
        }

    # ------------------------------------------------------------ clients

    def connect(self, pid: int, uid: int, identity: Identity, server: int | None = None) -> Client:
        client = Client(pid, uid, identity, server=server)
        self.clients.add(client)
        return client

    def disconnect(self, client: Client) -> None:
        """A client left (or died): release all it held and revoke its exports."""
        for hold in list(client.holds):
            self._release(client, hold)
        self.clients.discard(client)

    def handle(self, client: Client, request: P.Message, fd: int = -1) -> Answer:
        """Serve one request of `client`. `fd` came with it: the ledger owns it from here (an export keeps it,
        anything else closes it)."""
        if fd >= 0 and type(request) is not P.Export:
            self.close_fd(fd)
            fd = -1
        serve = self._serve.get(type(request))
        if serve is None:
            reason = f"protocol error: {request.TYPE.name} is a reply, not a request"
            return P.Error(C.ACL_ERROR_RT_IPC_ERROR, reason), -1
        try:
            return serve(client, request, fd)
        except LedgerError as exc:
            return P.Error(exc.code, exc.message), -1

    # ------------------------------------------------------------ capacity

    def _charge(self, client: Client, m: P.Charge, fd: int) -> Answer:
        if m.device != -1:
            free = self.capacity - self.used[self._device(m.device)]
            if m.size > free:
                raise LedgerError(
                    C.ACL_ERROR_RT_MEMORY_ALLOCATION,
                    f"device {m.device} has {free} of {self.capacity} bytes free on this node; "
                    f"{m.size} bytes do not fit (free memory, or raise VMMSHARE_DEVICE_MEMORY)",
                )
        return P.Token(self._new_charge(ChargedMemory(client, m.device, m.size))), -1

    def _charge_gpu(self, client: Client, m: P.ChargeGpu, fd: int) -> Answer:
        """GPU memory (a CUDA-backend allocation): the GPU's own capacity applies, not this node's."""
        if m.device >= MAX_GPUS:
            raise LedgerError(C.ACL_ERROR_RT_INVALID_DEVICEID, f"GPU {m.device} is beyond {MAX_GPUS} GPUs")
        return P.Token(self._new_charge(ChargedMemory(client, m.device, m.size, KIND_GPU))), -1

    def _mem_info(self, client: Client, m: P.MemInfo, fd: int) -> Answer:
        return P.Mem(self.capacity - self.used[self._device(m.device)], self.capacity), -1

    def _device(self, device: int) -> int:
        if not 0 <= device < len(self.used):
            raise LedgerError(C.ACL_ERROR_RT_INVALID_DEVICEID, f"device {device} does not exist on this node")
        return device

    def _account(self, memory: ChargedMemory, sign: int) -> None:
        """Count charged memory in (sign 1) or out (-1) of the node's tallies (per-client or per-uid ones too)."""
        if memory.kind == KIND_GPU:
            self.gpu_used[memory.device] += sign * memory.size
        elif memory.device != -1:
            self.used[memory.device] += sign * memory.size

    def _new_charge(self, memory: ChargedMemory) -> int:
        self._account(memory, 1)
        return self._new_hold(memory.charger, memory)

    # ------------------------------------------------------------ holds

    def _new_hold(self, client: Client, memory: ChargedMemory) -> int:
        while True:
            hold = int.from_bytes(self.random_bytes(8), "little") >> 1 | 1
            if hold not in self.holds:
                break
        self.holds[hold] = Hold(client, memory)
        client.holds.add(hold)
        return hold

    def _own(self, client: Client, hold: int) -> Hold:
        found = self.holds.get(hold)
        if found is None or found.client is not client:
            raise LedgerError(C.ACL_ERROR_RT_INVALID_HANDLE, "unknown allocation token for this connection")
        return found

    def _release_request(self, client: Client, m: P.Release, fd: int) -> Answer:
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
        share = memory.share
        if share is not None:
            if share.exporter is client and hold not in share.importers:
                self._revoke(share)
            share.importers.pop(hold, None)
        memory.holders -= 1
        if memory.holders == 0:
            self._account(memory, -1)
            if memory.gone is not None:
                memory.gone()

    # ------------------------------------------------------------ exports

    def _export(self, client: Client, m: P.Export, fd: int) -> Answer:
        try:
            shareable = self._share(client, m, fd)
        except BaseException:
            if fd >= 0:
                self.close_fd(fd)
            raise
        return P.Exported(shareable), -1

    def _share(self, client: Client, m: P.Export, fd: int) -> bytes:
        memory = self._own(client, m.hold).memory
        if memory.share is not None:
            raise LedgerError(C.ACL_ERROR_RT_PARAM_INVALID, "this allocation was exported already")
        if m.flags not in (0, 1) or m.share_type not in (1, 2) or m.memory_kind != memory.kind:
            raise LedgerError(C.ACL_ERROR_RT_PARAM_INVALID, f"bad export flags {m.flags} or share type {m.share_type}, "
                              f"or memory kind {m.memory_kind} for an allocation charged as kind {memory.kind}")
        if fd < 0 or m.size != memory.size or (memory.kind == KIND_HOST and self.memfd_size(fd) != m.size):
            raise LedgerError(C.ACL_ERROR_RT_PARAM_INVALID, "the attached fd is not the allocation's memory")
        trust = self._bind(m.pids, {})
        handle = 0
        while handle == 0 or handle in self.exports:
            handle = int.from_bytes(self.random_bytes(8), "little")
        secret = self.random_bytes(32) if m.share_type == FABRIC else bytes(32)
        prop = (m.handle_type, m.allocation_type, m.mem_attr, m.location_type, m.location_id)
        memory.share = self.exports[handle] = Share(handle, memory, fd, m.share_type, m.flags, prop, client, secret,
                                                     trust)
        log.debug("pid %d exported %#x (%d bytes, share type %d, flags %d)", client.pid, handle, m.size,
                  m.share_type, m.flags)
        if m.share_type == FABRIC:
            return FabricHandle(m.server_id, max(memory.device, 0), handle, m.size, secret,
                                FLAG_NO_PID_VALIDATION if m.flags else 0, self.endpoint).pack()
        return default_bytes(handle)

    def _revoke_request(self, client: Client, m: P.Revoke, fd: int) -> Answer:
        share = self._own(client, m.hold).memory.share
        if share is not None:
            if m.hold in share.importers:
                raise LedgerError(C.ACL_ERROR_RT_NO_PERMISSION, "only the exporter can revoke its handle")
            self._revoke(share)
        return P.Ok(), -1

    def _revoke(self, share: Share) -> None:
        """The exporter freed the allocation (or died): no new imports; importers keep what they hold."""
        if share.fd < 0:
            return
        self.exports.pop(share.handle, None)
        self.close_fd(share.fd)
        share.fd = -1
        log.debug("handle %#x revoked", share.handle)

    def _shared(self, handle: int, share_type: int) -> Share:
        share = self.exports.get(handle)
        if share is None:
            raise LedgerError(
                C.ACL_ERROR_RT_INVALID_HANDLE,
                f"shareable handle {handle:#x} is unknown on this node, or revoked (its exporter freed it or exited)",
            )
        if share.share_type != share_type:
            raise LedgerError(
                C.ACL_ERROR_RT_PARAM_INVALID,
                f"shareable handle {handle:#x} was exported with share type {share.share_type}, not {share_type}",
            )
        return share

    def _set_pids(self, client: Client, m: P.SetPids, fd: int) -> Answer:
        share = self._shared(m.shareable, m.share_type)
        if share.exporter is not client:
            raise LedgerError(
                C.ACL_ERROR_RT_NO_PERMISSION,
                f"only the exporting process (pid {share.exporter.pid}) may set the trustlist of {m.shareable:#x}",
            )
        share.trust = self._bind(m.pids, share.trust)
        return P.Ok(), -1

    def _set_remote_pids(self, client: Client, m: P.SetRemotePids, fd: int) -> Answer:
        """Trust processes of another server: (server id, pid) pairs, each admitting that server's pid only."""
        if self.endpoint.family == 0:
            raise LedgerError(C.ACL_ERROR_RT_FEATURE_NOT_SUPPORT, (
                f"pids of server {m.server:#x} can only be trusted through the cross-server transport, which is not "
                "configured on this node (VMMSHARE_FABRIC, VMMSHARE_FABRIC_ADDR, VMMSHARE_CLUSTER_KEY_FILE)"))
        share = self._shared(m.shareable, m.share_type)
        if share.exporter is not client:
            raise LedgerError(
                C.ACL_ERROR_RT_NO_PERMISSION,
                f"only the exporting process (pid {share.exporter.pid}) may set the trustlist of {m.shareable:#x}",
            )
        if any(p <= 0 or p > 0x7FFFFFFF for p in m.pids):
            raise LedgerError(C.ACL_ERROR_RT_PARAM_INVALID, "pids must be positive 32-bit ints")
        new = {(m.server, p) for p in m.pids} - share.remote_trust
        if len(share.trust) + len(share.remote_trust) + len(new) > MAX_TRUSTLIST:
            raise LedgerError(C.ACL_ERROR_RT_PARAM_INVALID, f"a trustlist holds at most {MAX_TRUSTLIST} pids")
        share.remote_trust |= new
        return P.Ok(), -1

    def _bind(self, pids: tuple[int, ...], trust: dict[int, Identity]) -> dict[int, Identity]:
        """`trust` plus `pids`, each bound to the process that has it now (pid reuse)."""
        if any(p <= 0 or p > 0x7FFFFFFF for p in pids):
            raise LedgerError(C.ACL_ERROR_RT_PARAM_INVALID, "pids must be positive 32-bit ints")
        new = {p for p in pids if p not in trust}
        if len(trust) + len(new) > MAX_TRUSTLIST:
            raise LedgerError(C.ACL_ERROR_RT_PARAM_INVALID, f"a trustlist holds at most {MAX_TRUSTLIST} pids")
        return {**trust, **{pid: self.identify(pid) for pid in pids}}

    # ------------------------------------------------------------ imports

    def _import(self, client: Client, m: P.Import, fd: int) -> Answer:
        hold, share = self.admit(client, m.shareable, m.share_type, m.secret)
        return P.Imported(hold, share.memory.size, share.memory.kind, *share.prop), share.fd

    def admit(self, client: Client, shareable: int, share_type: int, secret: bytes) -> tuple[int, Share]:
        """Rules 11-14 for an import by `client` (of this node, or a remote importer of another server): the new
        hold on the export's memory, and the export."""
        share = self._shared(shareable, share_type)
        if share_type == FABRIC and not hmac.compare_digest(secret, share.secret):
            raise LedgerError(C.ACL_ERROR_RT_INVALID_HANDLE,
                              f"FABRIC handle {shareable:#x} does not carry its secret")
        if client.server is None and client.pid == share.exporter.pid:
            raise LedgerError(C.ACL_ERROR_RT_PARAM_INVALID, "the exporting process cannot import its own handle")
        if not share.flags & C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION:
            self._trusted(client, share)
        memory = share.memory
        hold = self._new_hold(client, memory)
        memory.holders += 1
        share.importers[hold] = client
        log.debug("pid %d%s imported %#x", client.pid, _of_server(client), shareable)
        return hold, share

    def _trusted(self, client: Client, share: Share) -> None:
        """Rule 11: `client` is on the trustlist. A remote importer is admitted by a pid of the V2 trustlist (its pid
        as its own broker reports it: this node cannot bind another server's pid to a process) or by its
        (server id, pid) pair; a local one by its pid, bound to the process that had it when it was listed."""
        if client.server is not None:
            if client.pid in share.trust or (client.server, client.pid) in share.remote_trust:
                return
        elif client.pid in share.trust:
            if not same_process(share.trust[client.pid], client.identity):
                raise LedgerError(
                    C.ACL_ERROR_RT_NO_PERMISSION,
                    f"pid {client.pid} was trustlisted for another process that had the same pid (pid reuse)",
                )
            return
        raise LedgerError(
            C.ACL_ERROR_RT_NO_PERMISSION,
            f"process {client.pid}{_of_server(client)} is not on the trustlist of {share.handle:#x}: the exporter "
            "must add it with mem_set_pid_to_shareable_handle(_v2)",
        )

    def adopt_remote(self, client: Client, size: int, gone: Callable[[], None]) -> int:
        """A hold of `client` on memory that another server holds for it (a remote import): not charged to this
        node; `gone` runs when the hold goes (released, or the client left)."""
        return self._new_hold(client, ChargedMemory(client, -1, size, gone=gone))

    # ------------------------------------------------------------ who asks, and what there is

    def _bare_tgid(self, client: Client, m: P.BareTgid, fd: int) -> Answer:
        return P.Pid(client.pid), -1

    def _list(self, client: Client, m: P.List, fd: int) -> Answer:
        return P.Listing(self.listing(m.offset, client)), -1

    def listing(self, offset: int, viewer: Client) -> str:
        """One page of `vmmshare ls` as JSON, starting at export number `offset`; pages fit in one frame.

        Handle values are shown in full only to the exporter's user (and root): on a multi-user node a
        handle exported without pid validation must not be handed to every user who can list.
        """
        total = len(self.exports)
        page = itertools.islice(self.exports.values(), offset, None)  # not a copy of every export for each page
        used = {str(d): u for d, u in enumerate(self.used) if u}
        gpu_used = {str(d): u for d, u in sorted(self.gpu_used.items()) if u}
        head = {"broker_pid": self.broker_pid, "used": used, "capacity": self.capacity,
                "gpu_used": gpu_used, "clients": len(self.clients)}
        rows: list[str] = []
        budget = P.MAX_BODY - len(json.dumps(head)) - 128
        at = offset
        for share in page:
            if len(rows) >= LIST_PAGE:
                break
            row = json.dumps(self._row(share, viewer))
            if rows and budget - len(row) - 1 < 0:
                break
            budget -= len(row) + 1
            rows.append(row)
            at += 1
        head["next"] = at if at < total else None
        return json.dumps(head)[:-1] + ', "exports": [' + ",".join(rows) + "]}"

    @staticmethod
    def _row(share: Share, viewer: Client) -> dict[str, Any]:
        importers = sorted(c.pid for c in share.importers.values())
        remote = sorted(f"{c.server:#x}:{c.pid}" for c in share.importers.values() if c.server is not None)
        row: dict[str, Any] = {
            "handle": f"{share.handle:#018x}" if viewer.uid in (share.exporter.uid, 0) else "(hidden)",
            "share_type": "fabric" if share.share_type == FABRIC else "default",
            "device": share.memory.device,
            "gpu": share.memory.kind == KIND_GPU,
            "size": share.memory.size,
            "owner_pid": share.exporter.pid,
            "pid_validation": not share.flags & 1,
            "trustlist": sorted(share.trust),
            "importers": importers[:LIST_IMPORTERS],
            "importer_count": len(importers),
        }
        if remote or share.remote_trust:  # processes of other servers (SPEC §8), as "<server id>:<pid>"
            row["remote_importers"] = remote[:LIST_IMPORTERS]
            row["remote_trustlist"] = [f"{s:#x}:{p}" for s, p in sorted(share.remote_trust)]
        return row


def _of_server(client: Client) -> str:
    return "" if client.server is None else f" of server {client.server:#x}"
