"""Export, trustlists and import of shareable handles (SPEC §4 rules 9-17), through the node's broker."""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from .. import constants as C
from ..backends.base import Memory
from ..errors import FeatureNotSupportedError, InvalidHandleError, InvalidParamError, NoPermissionError
from ..wire.handles import ShareableHandle, ShareType
from ..wire.props import PhysicalProp, prop_of
from .node import Imported
from .tables import Allocation

if TYPE_CHECKING:
    from .shared import Shared
    from .vmm import Vmm

log = logging.getLogger("vmmshare.runtime")
_PENDING: Any = object()  # an import under way: a second import of the same handle waits for it


class Sharing:
    """What this process exported and imported, keyed by the node's handle value (not the handle's bytes: the
    bytes a FABRIC handle carries besides the value must not make one handle look like another, rule 13)."""

    def __init__(self, s: Shared, memory: Vmm) -> None:
        self.s, self.memory = s, memory
        self.imports: dict[int, Allocation] = {}  # handle value imported here -> allocation
        self.exported: set[int] = set()  # handle values this process exported and has not freed
        self._settled = threading.Condition(s.lock)  # an import under way has finished (or failed)
        self._waiting = 0  # threads waiting on `_settled` (under the lock): none, and there is no one to notify
        self._told_fabric = threading.Event()  # the FABRIC-on-GPU log line is written once

    def export(self, handle: int, share_type: ShareType, pid_validation: bool = True,
               pids: list[int] | None = None) -> ShareableHandle:
        """Export an allocation made here, once; `pids` go on the trustlist in the same round trip."""
        with self.s.lock:
            return self._export_locked(self.memory.allocation(handle), share_type, pid_validation, pids)

    def export_alloc(self, alloc: Allocation, share_type: ShareType, pid_validation: bool = True,
                     pids: list[int] | None = None) -> ShareableHandle:
        """`export` of an allocation the caller holds already."""
        with self.s.lock:
            return self._export_locked(alloc, share_type, pid_validation, pids)

    def _export_locked(self, alloc: Allocation, share_type: ShareType, pid_validation: bool,
                       pids: list[int] | None) -> ShareableHandle:
        """`export_alloc`, under the lock (taken once per export)."""
        if alloc.imported_from:
            raise InvalidParamError("an imported allocation cannot be exported again; the exporter owns it")
        if alloc.exported is not None:
            raise InvalidParamError(f"handle {alloc.handle:#x} was exported already; a handle exports once")
        on_gpu = alloc.backend.on_gpu
        if on_gpu and share_type is ShareType.FABRIC and not self._told_fabric.is_set():
            self._told_fabric.set()
            log.warning("FABRIC export of GPU memory: the handle is vmmshare's FABRIC format and the memory "
                        "travels as a POSIX fd through the node broker, not as a CUDA fabric handle (those "
                        "need an IMEX channel)")
        fd = alloc.backend.export_fd(alloc.mem)
        flags = 0 if pid_validation else C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION
        raw = self.s.node.export(alloc.node_ref, fd, alloc.prop, alloc.size, flags, share_type, pids or [], on_gpu)
        alloc.exported = ShareableHandle.of(share_type, raw)
        self.exported.add(alloc.exported.value)
        return alloc.exported

    def set_pids(self, shareable: ShareableHandle, pids: list[int]) -> None:
        fabric = shareable.fabric
        if fabric is not None and fabric.server_id != self.s.config.server_id:
            raise NoPermissionError(f"this FABRIC handle was exported on server {fabric.server_id:#x}: only its "
                                    "exporting process, there, may set its trustlist")
        self.s.node.set_pids(shareable.value, shareable.share_type, pids)

    def set_remote_pids(self, shareable: ShareableHandle, server: int, pids: list[int]) -> None:
        """Trust processes of another server (server id, pid): those pids, as that server's broker reports them,
        may import this export through the cross-server transport (pids of this server: `set_pids`)."""
        if server == self.s.config.server_id:
            self.set_pids(shareable, pids)
        else:
            self.s.node.set_remote_pids(shareable.value, shareable.share_type, server, pids)

    def import_handle(self, shareable: ShareableHandle, device: int) -> Allocation:
        """Import a shareable handle as memory of `device` (one this process has: its callers check that, 107001);
        returns the allocation, registered: its `handle` is the caller's (rule 13). An import in the exporting
        process gives a second handle to the same memory; importing a handle this process holds an import of
        already returns that allocation with a reference added, which needs its own free_physical."""
        s = self.s
        value, imports = shareable.value, self.imports
        lock = s.lock  # (the condition's lock: `_settled` is waited on and notified under it)
        with lock:
            done = imports.get(value)
            while done is _PENDING:  # another thread's import of it: wait for its outcome
                self._waiting += 1
                try:
                    self._settled.wait()
                finally:
                    self._waiting -= 1
                done = imports.get(value)
            if done is not None and done.refs > 0:
                done.refs += 1  # the reference this import adds, held while the broker is asked again
            else:
                done = None
                imports[value] = _PENDING
        if done is not None:
            try:
                self._still_admitted(shareable)  # as the driver checks the handle on each import (not under the lock)
            except BaseException:
                self.memory.drop(done)
                raise
            return done
        try:
            if shareable.fabric is None:  # (`_import_any`'s first case, asked here: most imports)
                alloc = self._import_here(shareable, b"", device, "")
            else:
                alloc = self._import_any(shareable, device, "")
            with lock:
                self.memory.register_locked(alloc)
                imports[value] = alloc
                if self._waiting:
                    self._settled.notify_all()
            return alloc
        except BaseException:
            with lock:
                imports.pop(value, None)
                if self._waiting:
                    self._settled.notify_all()
            raise

    def import_alloc(self, shareable: ShareableHandle, device: int, owner: str = "") -> Allocation:
        """A new import of a shareable handle as memory of `device` (not yet registered), for memory behind a
        pointer of its own (an IPC import); the exporting process may import its own export too (rule 13)."""
        self.s.devices.device_id(device)
        return self._import_any(shareable, device, owner)

    def _still_admitted(self, shareable: ShareableHandle) -> None:
        """Raise as a new import would (107017 revoked, 207006 not trusted any more); the hold it took goes again."""
        s = self.s
        fabric = shareable.fabric
        if fabric is not None and fabric.server_id != s.config.server_id:
            ref = s.node.import_remote(shareable.raw).node_ref
        else:
            got = s.node.import_handle(shareable.value, shareable.share_type, fabric.secret if fabric else b"")
            os.close(got.fd)
            ref = got.node_ref
            if fabric is not None and fabric.size != got.size:  # as a first import refuses it (rule 16)
                s.safe_node_call(s.node.release, ref)
                raise _altered(fabric.size, got.size)
        s.safe_node_call(s.node.release, ref)

    def _import_any(self, shareable: ShareableHandle, device: int, owner: str) -> Allocation:
        """Of this node through its broker, or of another server through the cross-server transport (SPEC §8)."""
        fabric = shareable.fabric
        if fabric is None:
            return self._import_here(shareable, b"", device, owner)
        if fabric.server_id != self.s.config.server_id:
            return self._import_remote(shareable, device, owner)
        return self._import_here(shareable, fabric.secret, device, owner)

    def _import_here(self, shareable: ShareableHandle, secret: bytes, device: int, owner: str) -> Allocation:
        """Of this node: the broker's memfd (a FABRIC handle presents its `secret`, and its size must be the
        memory's, rule 16), adopted by the backend of the memory's kind."""
        s = self.s
        got = s.node.import_handle(shareable.value, shareable.share_type, secret)
        fabric = shareable.fabric
        if fabric is not None and fabric.size != got.size:
            os.close(got.fd)  # not adopted: nothing else holds it
            s.safe_node_call(s.node.release, got.node_ref)
            raise _altered(fabric.size, got.size)
        node_device = s.devices.logical(device)  # the backends address the node's devices
        try:
            if got.gpu:
                backend, mem = s.device_backend, self._adopt_gpu(got, node_device)
            else:
                backend, mem = s.host, s.host.adopt(got.fd, got.size, node_device)
        except BaseException:
            s.safe_node_call(s.node.release, got.node_ref)
            raise
        return Allocation(0, mem, backend, _on_device(got.prop, device), got.size, got.node_ref,
                          imported_from=shareable.value, owner=owner)

    def _import_remote(self, shareable: ShareableHandle, device: int, owner: str) -> Allocation:
        """Another server's memory: its broker serves it to this process's transfer engine, one-sided."""
        s = self.s
        got = s.node.import_remote(shareable.raw)  # the importing broker checks the size the exporter answers
        try:  # no engine made here: a process that only imports and maps needs none (its first copy makes it)
            mem = s.remote.adopt_remote(got.segment, got.address, got.size)
        except BaseException:
            s.safe_node_call(s.node.release, got.node_ref)
            raise
        return Allocation(0, mem, s.remote, _on_device(got.prop, device), got.size, got.node_ref,
                          imported_from=shareable.value, owner=owner)

    def _adopt_gpu(self, got: Imported, node_device: int) -> Memory:
        """GPU memory, adopted by the CUDA backend (refused, its fd closed, in a process without it)."""
        if not self.s.device_backend.on_gpu:
            self.s.host.adopt(got.fd, got.size, node_device).close()
            raise FeatureNotSupportedError(
                "this handle is GPU memory: import it in a process with VMMSHARE_BACKEND=cuda"
            )
        return self.s.device_backend.adopt(got.fd, got.size, node_device)

    def revoke(self, alloc: Allocation) -> None:
        """Stop new imports of `alloc`'s export (those made keep their memory); the allocation stays exported."""
        if alloc.exported is not None and alloc.exported.value in self.exported:
            self.exported.discard(alloc.exported.value)
            self.s.node.revoke(alloc.node_ref)

    def forget(self, alloc: Allocation) -> None:
        """The last handle to `alloc` was freed: an export of it is revoked, an import of it may come again."""
        imported = alloc.imported_from
        if imported and self.imports.get(imported) is alloc:
            del self.imports[imported]
        elif alloc.exported is not None:
            self.exported.discard(alloc.exported.value)
            if alloc.maps:  # still mapped here: revoke now (unmapped, the node's release revokes it too)
                self.s.safe_node_call(self.s.node.revoke, alloc.node_ref)

    def bare_tgid(self) -> int:
        return self.s.node.bare_tgid()


def _altered(claimed: int, exported: int) -> InvalidHandleError:
    """A FABRIC handle whose size field is not the exported memory's: not the handle that was exported (107017)."""
    return InvalidHandleError(f"this FABRIC handle says {claimed} bytes but its memory was exported with {exported}: "
                              "it does not match what was exported (pass the 128 bytes the exporter produced)")


def _on_device(prop: PhysicalProp, device: int) -> PhysicalProp:
    """The exporter's properties, with device memory placed on the importer's `device`."""
    location = prop.location
    if location.type != C.ACL_MEM_LOCATION_TYPE_DEVICE or location.id == device:
        return prop
    return prop_of(prop.handle_type, prop.allocation_type, prop.mem_attr, location.type, device)
