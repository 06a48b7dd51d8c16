"""The records the runtime keeps per process: allocations, reservations, mappings."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import constants as C
from ..backends.base import Backend, Memory
from ..wire.handles import ShareableHandle
from ..wire.props import Location, PhysicalProp


@dataclass(eq=False)
class Allocation:
    """A physical allocation as this process sees it (made here, or imported)."""

    handle: int  # this process's aclrtDrvMemHandle for it
    mem: Memory
    backend: Backend
    prop: PhysicalProp
    size: int
    node_ref: int  # the node's reference for it (capacity, export, import), from the Node
    refs: int = 1  # handle references: malloc/import + each retain
    maps: int = 0  # live mappings in this process
    imported_from: int = 0  # the shareable handle's value it was imported from (0: made here)
    exported: ShareableHandle | None = None  # its export, once exported (a handle exports once)
    owner: str = ""  # "" for a VMM handle; "malloc" / "ipc" for memory behind an aclrtMalloc or IPC pointer

    @property
    def device(self) -> int:
        """The device the memory lives on (0 for host memory)."""
        return self.prop.location.id if self.prop.location.type == C.ACL_MEM_LOCATION_TYPE_DEVICE else 0


@dataclass(eq=False)
class Reservation:
    base: int
    size: int
    backend: Backend  # whose address space: host ranges for host memory, GPU ranges for GPU memory
    owner: str = ""  # "" when reserve_mem_address made it; else what holds it (an aclrtMalloc or IPC pointer)


@dataclass(eq=False)
class MappingEntry:
    ptr: int
    size: int
    alloc: Allocation
    access: dict[Location, int] = field(default_factory=dict)  # flags set per location (mem_set_access)
    effective: int = 0  # the flags in force for this process
