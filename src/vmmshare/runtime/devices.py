"""Devices, the current device of each thread, and streams."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from ..backends.cuda import CudaBackend
from ..errors import ContextNullError, FeatureNotSupportedError, InvalidDeviceError, InvalidParamError


@dataclass(eq=False)
class Stream:
    handle: int
    device: int


class Devices:
    """The devices this process sees (the GPUs under the CUDA backend, else VMMSHARE_DEVICES) and their streams."""

    def __init__(self, count: int, gpu: CudaBackend | None) -> None:
        self.count = count
        self.gpu = gpu  # the GPUs' topology answers peer questions
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._refs: dict[int, int] = {}
        self._streams: dict[int, Stream] = {}
        self._ids = itertools.count(1)

    def device_id(self, device: int) -> int:
        """`device` if it exists, else 107001."""
        if not 0 <= device < self.count:
            raise InvalidDeviceError(
                f"device {device} does not exist: there are {self.count} (0..{self.count - 1})"
                + ("" if self.gpu else "; set VMMSHARE_DEVICES for more")
            )
        return device

    def current(self) -> int:
        """This thread's device (set_device), else ContextNullError."""
        device: int | None = getattr(self._tls, "device", None)
        if device is None or self._refs.get(device, 0) == 0:
            raise ContextNullError("no current device in this thread: call set_device(id) first")
        return device

    def set(self, device: int) -> None:
        d = self.device_id(device)
        with self._lock:
            self._refs[d] = self._refs.get(d, 0) + 1
        self._tls.device = d

    def reset(self, device: int, force: bool = False) -> None:
        d = self.device_id(device)
        with self._lock:
            refs = 0 if force else max(0, self._refs.get(d, 0) - 1)
            self._refs[d] = refs
            if refs == 0:
                for s in [s for s in self._streams.values() if s.device == d]:
                    del self._streams[s.handle]
        if refs == 0 and getattr(self._tls, "device", None) == d:
            self._tls.device = None

    def create_stream(self) -> int:
        device = self.current()
        with self._lock:
            handle = 0x5700_0000 + next(self._ids)
            self._streams[handle] = Stream(handle, device)
            return handle

    def stream(self, stream: int) -> Stream | None:
        """The live stream `stream` (None for the default stream, 0)."""
        if stream == 0:
            return None
        found = self._streams.get(stream)
        if found is None:
            raise InvalidParamError(f"stream {stream:#x} is not a live stream of this process")
        return found

    def destroy_stream(self, stream: int) -> None:
        with self._lock:
            s = self.stream(stream)
            if s is None:
                raise InvalidParamError("the default stream (0) cannot be destroyed")
            del self._streams[s.handle]

    def synchronize_stream(self, stream: int) -> None:
        self.stream(stream)  # work on a stream runs synchronously: nothing is ever pending

    def can_access_peer(self, device: int, peer: int) -> int:
        d, p = self.device_id(device), self.device_id(peer)
        if self.gpu is not None and d != p:
            return int(self.gpu.can_access_peer(d, p))  # the GPUs' topology says
        return int(d != p)

    def enable_peer_access(self, peer: int) -> None:
        p = self.device_id(peer)
        d = self.current()
        if p == d:
            raise InvalidParamError(f"device {d} cannot enable peer access to itself")
        if self.gpu is not None and not self.gpu.can_access_peer(d, p):
            raise FeatureNotSupportedError(f"GPU {d} cannot access GPU {p}'s memory (cuDeviceCanAccessPeer says no)")
        # nothing to record: host memory is reachable from every device, and a GPU mapping's access is granted
        # per mapping (mem_set_access), as the runtime's VMM memory is

    def stream_count(self) -> int:
        return len(self._streams)
