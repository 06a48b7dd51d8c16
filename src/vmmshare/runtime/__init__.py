"""Per-process runtime state, split by concern behind one façade.

`Runtime` is the composition root: it owns the configuration, the node (the broker client) and the backends, and
hands its parts what they share (`Shared`: those, the lock over the memory tables and the devices) and the peers
each calls, by name, so that what depends on what is read from `_fresh`. The parts hold the state: `devices`
(devices, contexts, streams), `memory` (allocations, reservations, mappings), `blocks`
(aclrtMalloc memory and IPC imports, behind plain pointers), `copies` (host blocks, memcpy, memset, now or on a
stream), `sharing` (exports and imports of handles), `ipc` (IPC memory keys, on the same exports),
`pointers` (what a pointer is, host registration, batched copies), `events` and `notifies` (events, notifies
and their IPC forms, on shared pages the broker exports). The parts
take typed, already parsed values (the surfaces parse once) and raise `AclError` subclasses for what the runtime
itself refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..backends.base import Backend
from ..backends.cuda import CudaBackend
from ..backends.host import HostBackend
from ..backends.remote import RemoteBackend
from ..config import Config
from ..errors import AclError
from .blocks import Blocks
from .copies import Copies
from .devices import Devices
from .events import Events
from .ipc import Ipc
from .node import Node
from .notifies import Notifies
from .pointers import Pointers
from .shared import Shared
from .sharing import Sharing
from .tables import Allocation, MappingEntry, Reservation
from .vmm import Vmm

__all__ = ["Allocation", "MappingEntry", "Reservation", "Runtime"]
log = logging.getLogger("vmmshare.runtime")


class Runtime:
    """All VMM state of this process; one lock keeps the memory tables consistent across threads."""

    def __init__(self, config: Config, node: Node) -> None:
        self.config = config
        self.node = node
        self.host = HostBackend()
        self.gpu: CudaBackend | None = _gpu_backend(config.backend)
        self.device_backend: Backend = self.gpu if self.gpu is not None else self.host
        self._fresh()

    def _fresh(self) -> None:
        """Empty tables and a fresh lock: at start, and in a forked child, which must not use the parent's. Each
        part gets what every part works with (`Shared`) and, by name, the peers it calls; the two that call back
        into a later part (a freed allocation's exports, a freed block's IPC key) get a function for it."""
        remote = RemoteBackend(lambda: self.node.transfers())  # other servers' memory (its engine: on first use)
        devices = Devices(self.gpu.count if self.gpu is not None else self.config.devices, self.gpu,
                          self.config.visible_devices, self.config.server_id)
        self.shared = shared = Shared(self.config, self.node, devices, self.host, self.device_backend, remote)
        self.lock, self.remote, self.devices = shared.lock, remote, devices
        self.memory = Vmm(shared, forget_exports=lambda alloc: self.sharing.forget(alloc))
        self.sharing = Sharing(shared, self.memory)
        self.blocks = Blocks(shared, self.memory, forget_ipc=lambda alloc: self.ipc.forget_block(alloc))
        self.copies = Copies(shared, self.memory)
        self.ipc = Ipc(shared, self.memory, self.sharing, self.blocks)
        self.pointers = Pointers(shared, self.memory, self.copies)
        self.events = Events(shared)
        self.notifies = Notifies(shared)
        self.initialized = False

    def device_id(self, device: int) -> int:
        """`device` if this process has it (107001 otherwise)."""
        return self.devices.device_id(device)

    def mem_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of `device`: the GPU's, as its driver counts them, or the node's capacity."""
        d = self.devices.logical(self.devices.device_id(device))  # the node's device: capacity is node-wide
        got = self.device_backend.mem_info(d)
        return got if got is not None else self.node.mem_info(d)

    # ------------------------------------------------------------ finalizers

    def when_safe(self, fn: Callable[[], None]) -> None:
        """Run a finalizer's clean-up now, or right after the broker request this thread is in (see `Shared`)."""
        self.shared.when_safe(fn)

    # ------------------------------------------------------------ process life

    def forget_after_fork(self) -> None:
        """In a forked child: let go of the parent's memory (its mappings stay, harmlessly) and start afresh.

        The backends stay: CUDA cannot be initialised again in a forked child."""
        self.memory.close_all_in_child()
        self.events.close_all()
        self.notifies.close_all()
        self._fresh()

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {
                "allocations": len(self.memory.allocs),
                "handles": len(self.memory.handles),
                "reservations": len(self.memory.reservations),
                "mappings": len(self.memory.mappings),
                "host_blocks": len(self.copies.host_blocks),
                "streams": self.devices.stream_count(),
                "device_blocks": len(self.blocks.by_ptr),
                "contexts": self.devices.context_count(),
                "host_registrations": len(self.pointers.registered),
                "events": len(self.events.live),
                "notifies": len(self.notifies.live),
            }


def _gpu_backend(choice: str) -> CudaBackend | None:
    """The CUDA backend for VMMSHARE_BACKEND=cuda (errors if unusable) or auto (when a GPU is there)."""
    if choice == "host":
        return None
    try:
        return CudaBackend()
    except AclError as exc:
        if choice == "cuda":
            raise
        log.info("VMMSHARE_BACKEND=auto: no usable GPU (%s); device memory is host memory", exc.message)
        return None
