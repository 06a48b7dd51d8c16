"""Devices, contexts (each thread's current one) and the streams created in them.

`set_device` makes the device's default context current in the calling thread (and counts a reference to the
device); `create_context` makes a context of its own. A thread's current device is its current context's device.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

from ..backends.cuda import CudaBackend
from ..errors import (
    ContextNullError,
    FeatureNotSupportedError,
    InvalidDeviceError,
    InvalidHandleError,
    InvalidParamError,
    StreamContextError,
)
from .streams import Stream


@dataclass(eq=False)
class Context:
    handle: int
    device: int
    default: bool  # the device's default context (set_device's), released by the last reset_device
    stream: Stream | None = field(default=None, repr=False)  # its default stream (stream 0), made on first use


class Devices:
    """The devices this process sees (the GPUs under the CUDA backend, else VMMSHARE_DEVICES), contexts, streams."""

    def __init__(self, count: int, gpu: CudaBackend | None) -> None:
        self.count = count
        self.gpu = gpu  # the GPUs' topology answers peer questions
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._refs: dict[int, int] = {}
        self._contexts: dict[int, Context] = {}
        self._defaults: dict[int, Context] = {}  # device -> its default context
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

    # ------------------------------------------------------------ devices and contexts

    def context(self) -> Context:
        """This thread's current context, else ContextNullError."""
        ctx: Context | None = getattr(self._tls, "context", None)
        if ctx is None or self._contexts.get(ctx.handle) is not ctx:
            raise ContextNullError("no current context in this thread: call set_device(id) (or create_context) first")
        return ctx

    def current(self) -> int:
        """This thread's device, else ContextNullError."""
        return self.context().device

    def set(self, device: int) -> None:
        d = self.device_id(device)
        with self._lock:
            self._refs[d] = self._refs.get(d, 0) + 1
            ctx = self._defaults.get(d)
            if ctx is None:
                ctx = self._defaults[d] = self._new_context(d, default=True)
        self._tls.context = ctx

    def reset(self, device: int, force: bool = False) -> None:
        """One reference fewer (all, with `force`); at none, the default context goes, with its streams."""
        d = self.device_id(device)
        with self._lock:
            refs = 0 if force else max(0, self._refs.get(d, 0) - 1)
            self._refs[d] = refs
            ctx = self._defaults.pop(d, None) if refs == 0 else None
            streams = self._forget_context(ctx) if ctx is not None else []
        for s in streams:
            s.close()

    def create_context(self, device: int) -> int:
        d = self.device_id(device)
        with self._lock:
            ctx = self._new_context(d, default=False)
        self._tls.context = ctx
        return ctx.handle

    def destroy_context(self, handle: int) -> None:
        with self._lock:
            ctx = self._live_context(handle)
            if ctx.default:
                raise InvalidParamError(f"context {handle:#x} is device {ctx.device}'s default context: reset_device "
                                        "releases it, destroy_context only those create_context made")
            streams = self._forget_context(ctx)
        for s in streams:
            s.close()

    def set_context(self, handle: int) -> None:
        with self._lock:
            self._tls.context = self._live_context(handle)

    def _new_context(self, device: int, default: bool) -> Context:
        ctx = Context(0xC700_0000 + next(self._ids), device, default)
        self._contexts[ctx.handle] = ctx
        return ctx

    def _live_context(self, handle: int) -> Context:
        ctx = self._contexts.get(handle)
        if ctx is None:
            raise InvalidHandleError(f"context {handle:#x} is not a live context of this process")
        return ctx

    def _forget_context(self, ctx: Context) -> list[Stream]:
        """Drop `ctx` and its streams from the tables (under the lock); returns the streams to close."""
        del self._contexts[ctx.handle]
        gone = [s for s in self._streams.values() if s.context == ctx.handle]
        for s in gone:
            del self._streams[s.handle]
        return gone + ([ctx.stream] if ctx.stream is not None else [])

    # ------------------------------------------------------------ streams

    def create_stream(self) -> int:
        ctx = self.context()
        with self._lock:
            handle = 0x5700_0000 + next(self._ids)
            self._streams[handle] = Stream(handle, ctx.handle, ctx.device)
            return handle

    def stream(self, stream: int) -> Stream:
        """The live stream `stream`; 0 is the current context's default stream."""
        if stream == 0:
            ctx = self.context()
            with self._lock:
                if ctx.stream is None:
                    ctx.stream = Stream(0, ctx.handle, ctx.device)
                return ctx.stream
        found = self._streams.get(stream)
        if found is None:
            raise InvalidHandleError(f"stream {stream:#x} is not a live stream of this process")
        return found

    def stream_here(self, stream: int) -> Stream:
        """The live stream `stream`, which must belong to this thread's current context when it has one (as the
        runtime checks for async copies and for destroying a stream: 107003 otherwise)."""
        s = self.stream(stream)
        current: Context | None = getattr(self._tls, "context", None)
        if current is not None and s.context != current.handle:
            raise StreamContextError(f"stream {stream:#x} belongs to context {s.context:#x}, but context "
                                     f"{current.handle:#x} is current in this thread: set_current_context first")
        return s

    def destroy_stream(self, stream: int, force: bool = False) -> None:
        """Destroy a stream once its queued tasks have run (`force`: dropping those not started)."""
        if stream == 0:
            raise InvalidParamError("the default stream (0) cannot be destroyed")
        self.stream_here(stream)
        with self._lock:
            s = self._streams.pop(stream, None)
        if s is None:
            raise InvalidHandleError(f"stream {stream:#x} is not a live stream of this process")
        s.close(force)

    def synchronize_stream(self, stream: int, timeout: float | None = None) -> None:
        self.stream(stream).synchronize(timeout)

    def synchronize_device(self, timeout: float | None = None) -> None:
        """Wait for every stream of the current device (in this process); the first failure is reported."""
        device = self.current()
        with self._lock:
            streams = [s for s in self._streams.values() if s.device == device]
            streams += [c.stream for c in self._contexts.values() if c.device == device and c.stream is not None]
        failure: BaseException | None = None
        for s in streams:
            try:
                s.synchronize(timeout)
            except BaseException as exc:  # every stream is waited for; the first failure is the one reported
                failure = failure or exc
        if failure is not None:
            raise failure

    def stream_count(self) -> int:
        return len(self._streams)

    def context_count(self) -> int:
        """The contexts create_context made and nobody destroyed yet."""
        return sum(not c.default for c in self._contexts.values())

    # ------------------------------------------------------------ peers

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
