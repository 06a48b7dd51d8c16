"""Devices, contexts (each thread's current one) and the streams created in them.

`set_device` makes the device's default context current in the calling thread (and counts a reference to the
device); `create_context` makes a context of its own. A thread's current device is its current context's device.

Device ids in calls are *user* ids: what the process sees after ASCEND_RT_VISIBLE_DEVICES, parsed as the runtime
parses it (`src/runtime/core/src/runtime.cc`, `Runtime::GetVisibleDevices`). The node's own device numbers (the
runtime's logical ids, here also the physical ids) are what the broker charges and the backends address.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from dataclasses import dataclass, field

from .. import constants as C
from ..backends.cuda import CudaBackend
from ..errors import (
    AclError,
    ContextNullError,
    FeatureNotSupportedError,
    InvalidDeviceError,
    InvalidHandleError,
    InvalidParamError,
    StreamContextError,
)
from .streams import Stream

VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
_VISIBLE_MAX_LEN = 128  # the runtime reads this many characters of the variable (RT_SET_DEVICE_STR_MAX_LEN)
_DIGITS = "0123456789"
_UUIDS = uuid.UUID("6c1d3f0e-5a4b-4e8e-9d7a-766d6d736872")  # the namespace of vmmshare's device uuids


def _split_visible(text: str) -> list[str]:
    """The runtime's SplitString: runs of digits separated by single commas, up to the first other character
    (or a second comma in a row); nothing unless the text starts with a digit."""
    tokens: list[str] = []
    if not text or text[0] not in _DIGITS:
        return tokens
    run, commas = "", 0
    for ch in text:
        if ch in _DIGITS:
            run, commas = run + ch, 0
            continue
        if run:
            tokens.append(run)
            run = ""
        if ch != ",":
            break
        commas += 1
        if commas > 1:
            break
    if run:
        tokens.append(run)
    return tokens


def parse_visible(text: str | None, count: int) -> tuple[list[int] | None, str]:
    """ASCEND_RT_VISIBLE_DEVICES over `count` node devices, as `Runtime::GetVisibleDevices` reads it: the ids up to
    the first one that is not a device (or not a number); they must ascend without repeats. Returns (the node
    devices in user order, None when the variable is unset; the error, "" when it is usable)."""
    if text is None:
        return None, ""
    ids: list[int] = []
    for token in _split_visible(text[:_VISIBLE_MAX_LEN]):
        n = int(token)
        if n > count - 1:
            break
        if ids and n < ids[-1]:
            return [], "it must be configured in ascending order"
        if n in ids:
            return [], "its device ids cannot be duplicated"
        ids.append(n)
        if len(ids) >= count:
            break
    if not ids:
        return [], f"it names no device in [0, {count})"
    return ids, ""


@dataclass(eq=False)
class Context:
    handle: int
    device: int
    default: bool  # the device's default context (set_device's), released by the last reset_device
    stream: Stream | None = field(default=None, repr=False)  # its default stream (stream 0), made on first use


class Devices:
    """The devices this process sees (the GPUs under the CUDA backend, else VMMSHARE_DEVICES), contexts, streams."""

    def __init__(self, count: int, gpu: CudaBackend | None, visible: str | None = None, server_id: int = 0) -> None:
        self.node_count = count  # this node's devices (logical ids 0..node_count-1)
        self.visible, self.visible_error = parse_visible(visible, count)
        self._visible_text = visible
        self.count = count if self.visible is None else len(self.visible)  # what the process sees (user ids)
        self.server_id = server_id
        self.gpu = gpu  # the GPUs' topology answers peer questions
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._refs: dict[int, int] = {}
        self._contexts: dict[int, Context] = {}
        self._defaults: dict[int, Context] = {}  # device -> its default context
        self._streams: dict[int, Stream] = {}
        self._ids = itertools.count(1)

    def device_id(self, device: int) -> int:
        """`device` (a user id) if this process sees it, else 107001."""
        if self.visible_error:
            raise InvalidDeviceError(f"device {device} is not visible: {VISIBLE_ENV}={self._visible_text!r} is "
                                     f"invalid ({self.visible_error}), so this process sees no device")
        if not 0 <= device < self.count:
            if self.visible is not None:
                raise InvalidDeviceError(f"device {device} does not exist: {VISIBLE_ENV}={self._visible_text!r} "
                                         f"makes {self.count} visible (0..{self.count - 1})")
            raise InvalidDeviceError(
                f"device {device} does not exist: there are {self.count} (0..{self.count - 1})"
                + ("" if self.gpu else "; set VMMSHARE_DEVICES for more")
            )
        return device

    def visible_count(self) -> int:
        """aclrtGetDeviceCount: the devices this process sees (207004 when ASCEND_RT_VISIBLE_DEVICES is invalid)."""
        if self.visible_error:
            raise AclError(f"{VISIBLE_ENV}={self._visible_text!r} is invalid: {self.visible_error}",
                           C.ACL_ERROR_RT_NO_DEVICE)
        return self.count

    def logical(self, device: int) -> int:
        """The node's device number for user id `device` (checked by the caller): what the broker and backends use."""
        if self.visible is not None and 0 <= device < len(self.visible):
            return self.visible[device]
        return device

    # ------------------------------------------------------------ id conversions (api_error.cc, api_c_device.cc)

    def logic_of_user(self, user: int) -> int:
        """rtsGetLogicDevIdByUserDevId: the node's device behind user id `user`."""
        _non_negative("userDevId", user)
        if self.visible is not None:
            if self.visible_error or user >= len(self.visible):
                raise InvalidDeviceError(f"user device {user} is not visible: {self._visible_summary()}")
            return self.visible[user]
        return self._node_device(user, "logicDevId")

    def user_of_logic(self, logic: int) -> int:
        """rtsGetUserDevIdByLogicDevId: the user id this process sees node device `logic` as."""
        _non_negative("logicDevId", logic)
        self._node_device(logic, "logicDevId")
        if self.visible is None:
            return logic
        if logic not in self.visible or self.visible_error:
            raise InvalidDeviceError(f"node device {logic} is not visible to this process: {self._visible_summary()}")
        return self.visible.index(logic)

    def phy_of_logic(self, logic: int) -> int:
        """rtsGetPhyDevIdByLogicDevId: the runtime converts its argument as a user id first (`GetDevicePhyIdByIndex`
        in api_error.cc), then asks the driver; this node's physical ids are its device numbers."""
        _non_negative("logicDevId", logic)
        if self.visible is not None:
            return self.logic_of_user(logic)
        return self._node_device(logic, "logicDevId")

    def logic_of_phy(self, phy: int) -> int:
        """rtsGetLogicDevIdByPhyDevId: the driver's index of physical device `phy`, as the user id this process
        sees it by (`GetDeviceIndexByPhyId` in api_error.cc converts it back)."""
        _non_negative("phyDevId", phy)
        return self.user_of_logic(self._node_device(phy, "phyDevId"))

    def uuid(self, user: int) -> bytes:
        """aclrtDeviceGetUuid: 16 bytes, stable per (server, node device), the same in every process."""
        if user < 0:
            raise InvalidDeviceError(f"deviceId={user} must be greater than or equal to 0")
        logic = self.logical(self.device_id(user))
        return uuid.uuid5(_UUIDS, f"{self.server_id:08x}/{logic}").bytes

    def _node_device(self, device: int, name: str) -> int:
        if device >= self.node_count:
            raise InvalidDeviceError(f"{name}={device} is not a device of this node: it has {self.node_count} "
                                     f"(0..{self.node_count - 1})")
        return device

    def _visible_summary(self) -> str:
        if self.visible_error:
            return f"{VISIBLE_ENV}={self._visible_text!r} is invalid ({self.visible_error})"
        assert self.visible is not None
        return f"{VISIBLE_ENV}={self._visible_text!r} makes node devices {self.visible} visible as 0..{self.count - 1}"

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

    def current_or(self, default: int) -> int:
        """This thread's device, else `default` (as `current` would find it, with no error made and caught)."""
        ctx: Context | None = getattr(self._tls, "context", None)
        if ctx is None or self._contexts.get(ctx.handle) is not ctx:
            return default
        return ctx.device

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
            return int(self.gpu.can_access_peer(self.logical(d), self.logical(p)))  # the GPUs' topology says
        return int(d != p)

    def enable_peer_access(self, peer: int) -> None:
        p = self.device_id(peer)
        d = self.current()
        if p == d:
            raise InvalidParamError(f"device {d} cannot enable peer access to itself")
        if self.gpu is not None and not self.gpu.can_access_peer(self.logical(d), self.logical(p)):
            raise FeatureNotSupportedError(f"GPU {d} cannot access GPU {p}'s memory (cuDeviceCanAccessPeer says no)")
        # nothing to record: host memory is reachable from every device, and a GPU mapping's access is granted
        # per mapping (mem_set_access), as the runtime's VMM memory is


def _non_negative(name: str, value: int) -> None:
    """The rts layer's own check of a device id (api_c_device.cc): a negative one is 107000."""
    if value < 0:
        raise InvalidParamError(f"{name}={value} must be greater than or equal to 0")
