"""The one runtime of this process, created on first use and wired to the node's broker."""

from __future__ import annotations

import os
import threading

from .client.connection import BrokerClient
from .config import Config
from .errors import InvalidParamError
from .runtime import Runtime

_lock = threading.Lock()
_runtime: Runtime | None = None


def runtime() -> Runtime:
    """This process's runtime (created on first call)."""
    global _runtime
    rt = _runtime
    if rt is not None:
        return rt
    with _lock:
        if _runtime is None:
            try:
                config = Config.from_env()
            except ValueError as exc:  # a bad VMMSHARE_* variable: say which, as a parameter error
                raise InvalidParamError(f"configuration: {exc}") from None
            _runtime = Runtime(config, BrokerClient(config))
        return _runtime


def _after_fork_in_child() -> None:
    if _runtime is not None:
        node = _runtime.node
        if isinstance(node, BrokerClient):
            node.after_fork()
        _runtime.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
