"""The Pythonic API of device memory by pointer and its IPC keys: `DeviceBuffer` (aclrtMalloc, shared with
`ipc_export`) and `ipc_open` (aclrtIpcMemImportByKey), each an object with views and an explicit `close()`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any

from .. import constants as C
from .._process import runtime
from ..errors import AclInvalidParamError, InvalidParamError, NoPermissionError
from ..runtime.blocks import IPC, MALLOC
from ..runtime.ipc import MAX_PIDS_PER_CALL
from ..wire.props import U64, check_device, check_int
from ._checks import _device, _pids
from .views import MemoryViews

__all__ = ["DeviceBuffer", "IpcMemory", "ipc_open"]


class DeviceBuffer(MemoryViews):
    """`size` bytes of a device's memory at `ptr` (aclrtMalloc, rounded up to the page size), zero-filled;
    `ipc_export` shares it with other processes by key. `close()` frees it (and revokes its key)."""

    def __init__(self, size: int, device: int = 0, policy: int = C.ACL_MEM_MALLOC_HUGE_FIRST) -> None:
        n = check_int("size", size, 0, U64)
        if n == 0:
            raise AclInvalidParamError("size is 0: ask for a positive number of bytes")
        rt = runtime()
        self._device = rt.device_id(check_device(device))
        pol = check_int("policy", policy, -(1 << 31), (1 << 31) - 1)
        self._ptr = rt.blocks.malloc(n, pol, self._device)
        block = rt.blocks.at(self._ptr, MALLOC)
        self._size = n
        self._on_gpu = block.alloc.backend.on_gpu
        self.key: str | None = None
        self._validate = True
        self._init_views()
        self._own(_quietly, _free_block, self._ptr)

    def __repr__(self) -> str:
        return f"<DeviceBuffer {self.size} bytes at {self.ptr:#x} on device {self.device}{self._state()}>"

    def _state(self) -> str:
        return ", closed" if self.closed else (f", key {self.key}" if self.key else "")

    def _live(self) -> int:
        if self.closed:
            raise InvalidParamError("this DeviceBuffer is closed")
        return self.ptr

    def ipc_export(self, pids: Iterable[int] = (), validate_pids: bool = True) -> str:
        """The IPC key of this memory, with `pids` (bare tgids) on its trustlist, in one call; `validate_pids`
        False lets any process import it. Exporting again gives the same key (each `ipc_close` takes one back)."""
        trust = _pids(pids, allow_empty=True)
        if not isinstance(validate_pids, bool):
            raise InvalidParamError(f"validate_pids must be True or False, got {validate_pids!r}")
        rt = runtime()
        key = rt.ipc.export(self._live(), self.size, validate_pids)
        try:
            for start in range(0, len(trust), MAX_PIDS_PER_CALL):
                rt.ipc.set_pids(key, trust[start:start + MAX_PIDS_PER_CALL])
        except BaseException:
            rt.ipc.close(key)
            raise
        self.key, self._validate = key, validate_pids
        return key

    def __reduce__(self) -> tuple[object, ...]:
        """Sent to another process, it arrives as the IpcMemory of its key (exported now when it has none)."""
        if self.closed:
            raise TypeError("this DeviceBuffer is closed: there is nothing to send")
        key = self.key if self.key is not None else self.ipc_export()
        return (_arrive_ipc, (key, self.device, os.getpid(), self._validate, self.size))

    def ipc_allow(self, pids: Iterable[int]) -> None:
        """Add processes to the trustlist of this memory's key."""
        if self.key is None:
            raise InvalidParamError("ipc_export() this memory before setting its trustlist")
        trust = _pids(pids, allow_empty=False)
        for start in range(0, len(trust), MAX_PIDS_PER_CALL):
            runtime().ipc.set_pids(self.key, trust[start:start + MAX_PIDS_PER_CALL])

    def ipc_close(self) -> None:
        """Take back one `ipc_export`: after the last, the key imports no more (importers keep their memory)."""
        if self.key is None:
            raise InvalidParamError("this memory has no IPC key: ipc_export() it first")
        runtime().ipc.close(self.key)

    def close(self) -> None:
        """Free the memory (its key is revoked; importers keep theirs); BufferError while views are alive."""
        if self._start_close() is None:
            return
        if not self._forked:
            runtime().blocks.free(self.ptr)


class IpcMemory(MemoryViews):
    """Memory another process shared by IPC key, mapped here at `ptr`; `close()` unmaps this import."""

    key: str

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("IpcMemory cannot be instantiated directly: use ipc_open(key)")

    @classmethod
    def _make(cls, key: str, ptr: int, size: int, device: int, on_gpu: bool) -> IpcMemory:
        """The object owning this process's import of `key`, mapped at `ptr`."""
        self = cls.__new__(cls)
        self.key, self._ptr, self._size, self._device, self._on_gpu = key, ptr, size, device, on_gpu
        self._init_views()
        self._own(_quietly, _close_key, key)
        return self

    def __reduce__(self) -> tuple[object, ...]:
        """Sent on, it arrives as another import of its key (the key's trustlist must admit the receiver)."""
        if self.closed:
            raise TypeError("this IpcMemory is closed: there is nothing to send")
        return (_arrive_ipc, (self.key, self.device, os.getpid(), None, self.size))

    def __repr__(self) -> str:
        return f"<IpcMemory {self.size} bytes at {self.ptr:#x}, key {self.key}{', closed' if self.closed else ''}>"

    def close(self) -> None:
        if self._start_close() is None:
            return
        if not self._forked:
            runtime().ipc.close(self.key)


def ipc_open(key: str, device: int | None = None) -> IpcMemory:
    """Map the memory an IPC key names (from `DeviceBuffer.ipc_export` or acl.rt.ipc_mem_get_export_key in another
    process) on `device` (default: this thread's device, else 0)."""
    if not isinstance(key, str):
        raise InvalidParamError(f"an IPC key is a str, got {type(key).__name__}")
    rt = runtime()
    dev = _device(device)
    ptr = rt.ipc.import_key(key, dev)
    block = rt.blocks.at(ptr, IPC)
    return IpcMemory._make(key, ptr, block.alloc.size, dev, block.alloc.backend.on_gpu)


def _arrive_ipc(key: str, device: int, sender: int, validated: bool | None, size: int) -> IpcMemory:
    """Unpickling a DeviceBuffer or IpcMemory: the import of its key here, viewing the `size` bytes the sender had
    (the import maps the whole block); a refusal says what the sender must do."""
    rt = runtime()
    dev = device if 0 <= device < rt.devices.count else 0
    try:
        memory = ipc_open(key, dev)
        memory._size = min(memory.size, size) if isinstance(size, int) and size > 0 else memory.size
        return memory
    except NoPermissionError:
        me = rt.sharing.bare_tgid()
        how = "its key was exported with pid validation" if validated is not False else "its exporter checks pids"
        raise NoPermissionError(
            f"the memory sent by process {sender} cannot be imported in process {me}: {how} and {me} is not on its "
            f"trustlist. Before sending it, call ipc_allow([{me}]) on the DeviceBuffer in the exporting process, or "
            "ipc_export(validate_pids=False) it") from None


def _free_block(ptr: int) -> None:
    runtime().blocks.free(ptr)


def _close_key(key: str) -> None:
    runtime().ipc.close(key)


def _quietly(fn: Callable[[Any], None], arg: Any) -> None:
    def run() -> None:
        with contextlib.suppress(Exception):
            fn(arg)

    with contextlib.suppress(Exception):  # e.g. at interpreter exit: nothing left to free
        runtime().when_safe(run)
