"""The memory behind an IPC event or notify: one page of a sealed memfd, charged to the node's host memory and
shared through the broker's exports, trustlists and imports like any physical allocation (as the runtime keeps an
IPC event's state in VMM memory it exports). An importer gets the memfd from the broker and maps it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import constants as C
from ..backends.host import HostMemory
from ..errors import InvalidHandleError, MemoryAllocationError
from ..wire.handles import ShareableHandle, ShareType
from ..wire.props import prop_of
from .syncpage import MAGIC, PAGE, SyncPage

if TYPE_CHECKING:
    from .shared import Shared

PROP = prop_of(0, 0, C.ACL_MEM_NORMAL, C.ACL_MEM_LOCATION_TYPE_HOST, 0)
MAGIC_EVENT = 0x45564E54  # "EVNT"
MAGIC_NOTIFY = 0x4E544659  # "NTFY"
_KINDS = {MAGIC_EVENT: "an IPC event", MAGIC_NOTIFY: "an IPC notify"}


@dataclass(eq=False)
class Backing:
    """A shared page: its mapping, its memfd, the node's reference for it and, once exported or imported, the
    broker's handle value."""

    page: SyncPage
    fd: int
    node_ref: int
    value: int = 0

    def close(self, s: Shared) -> None:
        """Unmap, close and let the node go (an exporter's release revokes its export: no new imports)."""
        if self.fd >= 0:
            self.fd = -1
            self.page.close(close_fd=True)
            s.safe_node_call(s.node.release, self.node_ref)


def create(s: Shared, magic: int) -> Backing:
    """A fresh page of this process, charged to the node, with `magic` in its kind word."""
    made: list[HostMemory] = []
    failed: list[BaseException] = []

    def make() -> None:  # runs while the broker checks the capacity: it must not raise (the reply is still to read)
        try:
            made.append(s.host.allocate(PAGE, -1, 0))
        except BaseException as exc:
            failed.append(exc)

    try:
        node_ref = s.node.charge(-1, PAGE, make)
    except BaseException:
        for mem in made:
            mem.close()
        raise
    if failed:
        s.safe_node_call(s.node.release, node_ref)
        exc = failed[0]
        if isinstance(exc, OSError):
            raise MemoryAllocationError(f"cannot create the event's or notify's page: {exc.strerror}") from None
        raise exc
    mem = made[0]
    try:
        page = SyncPage.of_fd(mem.fd)
    except BaseException:
        mem.close()
        s.safe_node_call(s.node.release, node_ref)
        raise
    page.put(MAGIC, magic)
    return Backing(page, mem.fd, node_ref)


def export(s: Shared, backing: Backing, pid_validation: bool) -> int:
    """Export the page through the broker (with its trustlist, or without pid validation); its handle value."""
    flags = 0 if pid_validation else C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION
    raw = s.node.export(backing.node_ref, backing.fd, PROP, PAGE, flags, ShareType.DEFAULT, [])
    backing.value = ShareableHandle.of(ShareType.DEFAULT, raw).value
    return backing.value


def open_page(s: Shared, value: int, magic: int) -> Backing:
    """Import the page the broker knows as `value` (107017 when revoked, 207006 when this process is not trusted)
    and map it; it must be a page of `magic`'s kind (107017 for any other memory)."""
    got = s.node.import_handle(value, C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, b"")

    def refuse(why: str) -> InvalidHandleError:
        os.close(got.fd)
        s.safe_node_call(s.node.release, got.node_ref)
        return InvalidHandleError(f"handle {value:#x} names {why}, not {_KINDS[magic]}")

    if got.gpu or got.size != PAGE:
        raise refuse(f"{got.size} bytes of {'GPU' if got.gpu else 'host'} memory")
    try:
        page = SyncPage.of_fd(got.fd)
    except BaseException:
        os.close(got.fd)
        s.safe_node_call(s.node.release, got.node_ref)
        raise
    kind = page.get(MAGIC)
    if kind != magic:
        page.close()
        raise refuse(_KINDS.get(kind, "memory of another kind"))
    return Backing(page, got.fd, got.node_ref, value)
