"""Device memory behind a plain pointer: aclrtMalloc blocks and imported IPC memory.

Each block is the runtime's own physical allocation, mapped read-write at the start of its own reservation, so it
is shared through the same broker exports as VMM handles. Its allocation and reservation carry an owner, which
keeps them out of the VMM calls (no handle to free, no range to unmap or release by hand).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import constants as C
from ..errors import InvalidParamError
from ..wire.props import Location, PhysicalProp
from .tables import Allocation

if TYPE_CHECKING:
    from .shared import Shared
    from .vmm import Vmm

MALLOC = "malloc"
IPC = "ipc"
MAX_MALLOC = (1 << 64) - 1 - C.HUGE1G_GRANULARITY  # beyond this, rounding up to the page size overflows size_t

# aclrtMemMallocPolicy (its low byte) -> the memory attribute of the physical allocation behind the block
_POLICY_ATTRS = {
    C.ACL_MEM_MALLOC_HUGE_FIRST: C.ACL_HBM_MEM_HUGE,
    C.ACL_MEM_MALLOC_HUGE_ONLY: C.ACL_HBM_MEM_HUGE,
    C.ACL_MEM_MALLOC_NORMAL_ONLY: C.ACL_HBM_MEM_NORMAL,
    C.ACL_MEM_MALLOC_HUGE_FIRST_P2P: C.ACL_MEM_P2P_HUGE,
    C.ACL_MEM_MALLOC_HUGE_ONLY_P2P: C.ACL_MEM_P2P_HUGE,
    C.ACL_MEM_MALLOC_NORMAL_ONLY_P2P: C.ACL_MEM_P2P_NORMAL,
    C.ACL_MEM_MALLOC_HUGE1G_ONLY: C.ACL_HBM_MEM_HUGE1G,
    C.ACL_MEM_MALLOC_HUGE1G_ONLY_P2P: C.ACL_MEM_P2P_HUGE1G,
}


def policy_attr(policy: int) -> int:
    """The memory attribute for an aclrtMalloc policy; an unknown policy is the default, HUGE_FIRST (as the
    runtime does); the bandwidth and read-only flags above the low byte change nothing here."""
    return _POLICY_ATTRS.get(policy & 0xFF, C.ACL_HBM_MEM_HUGE)


@dataclass(eq=False)
class Block:
    ptr: int
    size: int  # what the caller asked for
    alloc: Allocation  # mapped over [ptr, ptr + alloc.size)


class Blocks:
    """This process's aclrtMalloc blocks and IPC imports, by pointer; callers hold the runtime's lock for the table."""

    def __init__(self, s: Shared, memory: Vmm, forget_ipc: Callable[[Allocation], None]) -> None:
        self.s, self.memory = s, memory
        self._forget_ipc = forget_ipc  # the IPC key of a block's allocation, once the block is freed
        self.by_ptr: dict[int, Block] = {}

    def malloc(self, size: int, policy: int, device: int) -> int:
        """`size` bytes (rounded up to the page size) of `device`'s memory, mapped read-write."""
        if not 0 < size <= MAX_MALLOC:
            raise InvalidParamError(f"size={size} is out of range [1, {MAX_MALLOC}]")
        prop = PhysicalProp(C.ACL_MEM_HANDLE_TYPE_NONE, C.ACL_MEM_ALLOCATION_TYPE_PINNED, policy_attr(policy),
                            Location(C.ACL_MEM_LOCATION_TYPE_DEVICE, device))
        vmm = self.memory
        g = vmm.granularity(prop)
        alloc = vmm.create(-(-size // g) * g, prop, MALLOC)
        vmm.register(alloc)
        return self.map_new(alloc, size)

    def map_new(self, alloc: Allocation, size: int) -> int:
        """Map a fresh (registered, owned) allocation at the start of a reservation of its own; on failure the
        allocation is dropped."""
        vmm = self.memory
        try:
            ptr = vmm.map_new(alloc, C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE, owner=alloc.owner)
        except BaseException:
            vmm.drop(alloc)
            raise
        with self.s.lock:
            self.by_ptr[ptr] = Block(ptr, size, alloc)
        return ptr

    def at(self, ptr: int, owner: str = MALLOC) -> Block:
        """The block starting at `ptr` (107000 for any other pointer)."""
        block = self.by_ptr.get(ptr)
        if block is None or block.alloc.owner != owner:
            what = "acl.rt.malloc" if owner == MALLOC else "acl.rt.ipc_mem_import_by_key"
            raise InvalidParamError(f"{ptr:#x} is not a pointer {what} returned (or it was released already)")
        return block

    def free(self, ptr: int, owner: str = MALLOC) -> None:
        """Unmap and release a block and drop its allocation: an export of it is revoked, importers keep theirs."""
        with self.s.lock:
            block = self.at(ptr, owner)
            del self.by_ptr[ptr]
            if owner == MALLOC:
                self._forget_ipc(block.alloc)
            vmm = self.memory
            try:
                vmm.unmap_release(ptr, owner)
            finally:
                vmm.drop(block.alloc)
