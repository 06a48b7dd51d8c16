"""What the runtime needs from the node-wide authority (the broker): capacity accounting and sharing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .props import PhysicalProp


@dataclass(frozen=True)
class Imported:
    """What the node hands an importer: the memfd, the node's token for it, and the exporter's properties."""

    fd: int
    token: int
    size: int
    prop: PhysicalProp
    gpu: bool = False  # the fd is a CUDA allocation's (import it with the CUDA backend)


class Node(Protocol):
    """The node-wide authority (the broker): capacity accounting and the table of shareable handles."""

    def charge(
        self, device: int, size: int, meanwhile: Callable[[], None] | None = None, gpu: bool = False
    ) -> int: ...
    def release(self, token: int) -> None: ...
    def mem_info(self, device: int) -> tuple[int, int]: ...
    def export(
        self, token: int, fd: int, prop: PhysicalProp, size: int, flags: int, share_type: int, pids: list[int],
        gpu: bool = False,
    ) -> bytes: ...
    def revoke(self, token: int) -> None: ...
    def set_pids(self, shareable: int, share_type: int, pids: list[int]) -> None: ...
    def import_handle(self, shareable: int, share_type: int, secret: bytes) -> Imported: ...
    def bare_tgid(self) -> int: ...
    def busy_in_this_thread(self) -> bool: ...


