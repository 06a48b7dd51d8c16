"""What a backend is: where physical memory lives and how it is mapped, copied and shared.

The runtime drives every backend through this one protocol; each allocation and reservation carries the
backend that made it, so the runtime never asks what kind of memory it holds.
"""

from __future__ import annotations

import enum
from typing import Protocol


class MemoryKind(enum.IntEnum):
    """What an exported fd is, as the broker records it (the wire's `kind` field)."""

    HOST = 0  # a sealed memfd, counted against the node's device capacity
    GPU = 1  # a GPU driver's allocation fd; the GPU's own capacity applies
    REMOTE = 2  # memory of another server, reached through the transfer engine (never exported: no fd)


class Memory(Protocol):
    """A physical allocation held by a backend."""

    size: int
    pages: str  # how it is backed: "hugetlb-2M", "hugetlb-1G", "thp", "normal", "gpu"

    def close(self) -> None: ...


class Backend(Protocol):
    """Allocate, adopt, export, reserve, map, protect, copy and fill memory of one kind."""

    kind: MemoryKind  # what the broker records an export of its memory as
    name: str  # how messages name its memory: "host", "GPU", "remote"
    on_gpu: bool  # a GPU driver's memory: exported as a GPU fd, capped by the GPU (not the node), not CPU-addressable
    remote: bool  # another server's memory: copies only, through the transfer engine, mapped into host reservations
    cpu_access: bool  # the CPU can load and store its mappings (and so copy and view them directly)

    def granularity(self, device: int) -> int:
        """The smallest allocation and mapping unit on `device`."""
        ...

    def mem_info(self, device: int) -> tuple[int, int] | None:
        """(free, total) bytes as the backend's driver counts them; None when the node's broker counts them."""
        ...

    def allocate(self, size: int, device: int, huge_page: int, numa_node: int | None = None) -> Memory:
        """`size` bytes on `device` (-1: host memory), on NUMA node `numa_node` when given (host memory only)."""
        ...

    def adopt(self, fd: int, size: int, device: int) -> Memory:
        """The memory behind an imported fd (the fd is the memory's from now on, or closed on failure)."""
        ...

    def export_fd(self, mem: Memory) -> int:
        """The fd the broker holds for an export (owned by `mem`)."""
        ...

    def forget(self, mem: Memory) -> None:
        """In a forked child: let go of what the parent's memory holds in this process, if it can be."""
        ...

    def reserve(self, size: int, alignment: int, expect_ptr: int) -> int:
        """A reserved, inaccessible range (OSError when it cannot be had, at `expect_ptr` exactly if non-zero)."""
        ...

    def release(self, ptr: int, size: int) -> None: ...

    def map(self, ptr: int, size: int, mem: Memory, access: int, prepopulate: bool) -> None:
        """Map `mem` over reserved `[ptr, ptr+size)` with ACL access flags `access`."""
        ...

    def unmap(self, ptr: int, size: int) -> None:
        """Return a mapping to the reserved state."""
        ...

    def reserve_mapped(self, size: int, alignment: int, mem: Memory, access: int, prepopulate: bool) -> int:
        """A new range with `mem` mapped over it, in as few steps as the backend can (what reserve then map do)."""
        ...

    def release_mapped(self, ptr: int, size: int) -> None:
        """Give back a range made by `reserve_mapped`, mapping and all (what unmap then release do)."""
        ...

    def protect(self, ptr: int, size: int, access: int, device: int) -> None: ...

    def copy(self, dst: int, src: int, count: int, device: int) -> None:
        """Copy synchronously, as aclrtMemcpy does."""
        ...

    def fill(self, ptr: int, value: int, count: int, device: int) -> None:
        """Set bytes synchronously, as aclrtMemset does."""
        ...
