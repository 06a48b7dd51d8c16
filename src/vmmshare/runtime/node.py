"""What the runtime needs from the node-wide authority (the broker): capacity accounting and sharing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..backends.remote import Transfers
from ..wire.props import PhysicalProp


@dataclass(slots=True)
class Imported:
    """What the node hands an importer: the memfd, the node's reference for it, and the exporter's properties."""

    fd: int
    node_ref: int
    size: int
    prop: PhysicalProp
    gpu: bool = False  # the fd is a CUDA allocation's (import it with the CUDA backend)


@dataclass(frozen=True)
class RemoteImported:
    """A remote import (SPEC §8): the node's reference for it, the memory, and where another server's transfer
    engine serves it (`segment`, `address`)."""

    node_ref: int
    size: int
    prop: PhysicalProp
    segment: str
    address: int
    metadata: str = ""  # the metadata service URL this process's engine finds `segment` in


class Node(Protocol):
    """The node-wide authority (the broker): capacity accounting and the table of shareable handles."""

    def charge(
        self, device: int, size: int, meanwhile: Callable[[], None] | None = None, gpu: bool = False
    ) -> int:
        """Charge `size` bytes of `device` (-1: host memory) node-wide; returns the node's reference for them.
        `meanwhile` runs while the node decides (the memory is made then)."""
        ...

    def release(self, node_ref: int) -> None: ...
    def mem_info(self, device: int) -> tuple[int, int]: ...
    def export(
        self, node_ref: int, fd: int, prop: PhysicalProp, size: int, flags: int, share_type: int, pids: list[int],
        gpu: bool = False,
    ) -> bytes: ...
    def revoke(self, node_ref: int) -> None: ...
    def set_pids(self, shareable: int, share_type: int, pids: list[int]) -> None: ...
    def import_handle(self, shareable: int, share_type: int, secret: bytes) -> Imported: ...
    def bare_tgid(self) -> int: ...
    def busy_in_this_thread(self) -> bool: ...
    def import_remote(self, handle: bytes) -> RemoteImported:
        """Import a FABRIC handle of another server, through this node's broker and the exporter's."""
        ...

    def set_remote_pids(self, shareable: int, share_type: int, server: int, pids: list[int]) -> None:
        """Trust pids of another server's processes, (server id, pid) pairs, on an export of this process."""
        ...

    def transfers(self) -> Transfers:
        """This process's transfer engine, for copies to and from memory of other servers (made on first use)."""
        ...


