"""Per-process runtime state, split by concern behind one façade.

`Runtime` owns the configuration, the node (the broker client) and the lock over the memory tables; its parts
hold the state: `devices` (devices, contexts, streams), `memory` (allocations, reservations, mappings), `blocks`
(aclrtMalloc memory and IPC imports, behind plain pointers), `copies` (host blocks, memcpy, memset, now or on a
stream), `sharing` (exports and imports of handles) and `ipc` (IPC memory keys, on the same exports). The parts
take typed, already parsed values (the surfaces parse once) and raise `AclError` subclasses for what the runtime
itself refuses.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..backends.base import Backend
from ..backends.cuda import CudaBackend
from ..backends.host import HostBackend
from ..backends.remote import RemoteBackend
from ..config import Config
from ..errors import AclError
from .blocks import Blocks
from .copies import Copies
from .devices import Devices
from .ipc import Ipc
from .node import Node
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
        """Empty tables and a fresh lock: at start, and in a forked child, which must not use the parent's."""
        self.lock = threading.RLock()
        self.remote = RemoteBackend(lambda: self.node.transfers())  # other servers' memory (its engine: on first use)
        self.devices = Devices(self.gpu.count if self.gpu is not None else self.config.devices, self.gpu,
                               self.config.visible_devices, self.config.server_id)
        self.memory = Vmm(self)
        self.blocks = Blocks(self)
        self.copies = Copies(self)
        self.sharing = Sharing(self)
        self.ipc = Ipc(self)
        self.initialized = False
        self._deferred: list[Callable[[], None]] = []  # finalizers that came while the node was busy

    def device_id(self, device: int) -> int:
        """`device` if this process has it (107001 otherwise)."""
        return self.devices.device_id(device)

    def mem_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of `device`: the GPU's, as its driver counts them, or the node's capacity."""
        d = self.devices.logical(self.devices.device_id(device))  # the node's device: capacity is node-wide
        got = self.device_backend.mem_info(d)
        return got if got is not None else self.node.mem_info(d)

    # ------------------------------------------------------------ finalizers and node calls

    def when_safe(self, fn: Callable[[], None]) -> None:
        """Run a finalizer's clean-up now, or, if the garbage collector called it in the middle of a broker
        request in this thread, right after (a nested request would read the outer one's reply)."""
        if self.node.busy_in_this_thread():
            self._deferred.append(fn)
        else:
            fn()

    def run_deferred(self) -> None:
        while self._deferred and not self.node.busy_in_this_thread():
            fn = self._deferred.pop()
            with contextlib.suppress(Exception):
                fn()

    def safe_node_call(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except AclError as exc:  # the broker reclaims what a lost connection held
            log.warning("node call %s failed: %s", getattr(fn, "__name__", fn), exc)

    # ------------------------------------------------------------ process life

    def forget_after_fork(self) -> None:
        """In a forked child: let go of the parent's memory (its mappings stay, harmlessly) and start afresh.

        The backends stay: CUDA cannot be initialised again in a forked child."""
        self.memory.close_all_in_child()
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
