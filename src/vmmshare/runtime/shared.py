"""What every part of the runtime works with, handed to each part by `Runtime` (the parts' peers come apart)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..backends.base import Backend
from ..backends.host import HostBackend
from ..backends.remote import RemoteBackend
from ..config import Config
from ..errors import AclError
from .devices import Devices
from .node import Node

log = logging.getLogger("vmmshare.runtime")


class Shared:
    """The configuration, the node (the broker client), the one lock over the memory tables, the devices, the
    backends, and what keeps node calls safe from finalizers that run in the middle of one."""

    def __init__(self, config: Config, node: Node, devices: Devices, host: HostBackend, device_backend: Backend,
                 remote: RemoteBackend) -> None:
        self.config, self.node, self.devices = config, node, devices
        self.host, self.device_backend, self.remote = host, device_backend, remote
        self.lock = threading.RLock()
        self._deferred: list[Callable[[], None]] = []  # finalizers that came while the node was busy

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
