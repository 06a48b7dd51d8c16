"""``acl.rt`` events and IPC events (aclrtCreateEvent*, aclrtRecordEvent, aclrtSynchronizeEvent*,
aclrtQueryEventStatus, aclrtStreamWaitEvent, aclrtIpcGetEventHandle, aclrtIpcOpenEventHandle, aclrtDestroyEvent):
the acl layer's checks (event.cpp: 100000), then the runtime's (107000, 107017, ...)."""

from __future__ import annotations

from .._process import runtime
from ..errors import InvalidParamError
from ..runtime.events import DEFAULT_FLAGS, HANDLE_SIZE
from ..wire.props import U32, acl_require, check_int, check_ptr
from ._args import I32
from ._call import acl_call

__all__ = [
    "create_event", "create_event_ex_with_flag", "create_event_with_flag", "destroy_event", "ipc_get_event_handle",
    "ipc_open_event_handle", "query_event_status", "record_event", "stream_wait_event", "synchronize_event",
    "synchronize_event_with_timeout",
]


def _event(event: object) -> int:
    e = check_ptr("event", event)
    acl_require(e != 0, "event is NULL")
    return e


@acl_call(0)
def create_event() -> int:
    """aclrtCreateEvent: an event of the current device (107002 without one)."""
    return runtime().events.create(DEFAULT_FLAGS, ex=False)


@acl_call(0)
def create_event_with_flag(flag: int) -> int:
    """aclrtCreateEventWithFlag: ACL_EVENT_SYNC (1), CAPTURE_STREAM_PROGRESS (2) and TIME_LINE (8) combined; it
    refuses ACL_EVENT_IPC (107000), which create_event_ex_with_flag takes."""
    return runtime().events.create(check_int("flag", flag, 0, U32), ex=False)


@acl_call(0)
def create_event_ex_with_flag(flag: int) -> int:
    """aclrtCreateEventExWithFlag: as create_event_with_flag, or ACL_EVENT_IPC (0x40) alone for an event other
    processes open by its handle."""
    return runtime().events.create(check_int("flag", flag, 0, U32), ex=True)


@acl_call()
def destroy_event(event: int) -> None:
    """aclrtDestroyEvent: the event goes once the work using it has run; later calls with it fail with 107017."""
    runtime().events.destroy(_event(event))


@acl_call()
def record_event(event: int, stream: int) -> None:
    """aclrtRecordEvent: the event completes when `stream` (0: the default stream) reaches this point."""
    e, st = _event(event), check_ptr("stream", stream)
    rt = runtime()
    rt.devices.current()
    rt.events.record(e, rt.devices.stream_here(st))


@acl_call(0)
def query_event_status(event: int) -> int:
    """aclrtQueryEventStatus: ACL_EVENT_RECORDED_STATUS_COMPLETE (1) when the last record completed (or none was
    made), else NOT_READY (0)."""
    return runtime().events.query_status(_event(event))


@acl_call()
def synchronize_event(event: int) -> None:
    """aclrtSynchronizeEvent: wait for the event's last record, without a time limit."""
    runtime().events.synchronize(_event(event), None)


@acl_call()
def synchronize_event_with_timeout(event: int, timeout: int) -> None:
    """aclrtSynchronizeEventWithTimeout: at most `timeout` ms (-1: no limit; 0 is 107000); 507047 when it runs
    out."""
    t = check_int("timeout", timeout, *I32)
    if t < -1:
        raise InvalidParamError(f"timeout={t}: must be in [-1, INT_MAX]")
    e = _event(event)
    if t == 0:
        raise InvalidParamError("timeout=0: must be -1 (no limit) or a positive number of milliseconds")
    runtime().events.synchronize(e, None if t == -1 else t / 1000)


@acl_call()
def stream_wait_event(stream: int, event: int) -> None:
    """aclrtStreamWaitEvent: work queued on `stream` after this waits until the event's last record completes."""
    st, e = check_ptr("stream", stream), check_ptr("event", event)
    if e == 0:
        raise InvalidParamError("event is NULL")
    rt = runtime()
    rt.devices.current()
    rt.events.stream_wait(rt.devices.stream_here(st), e)


@acl_call(None)
def ipc_get_event_handle(event: int) -> bytes:
    """aclrtIpcGetEventHandle: the 64 bytes (aclrtIpcEventHandle) another process opens the event by."""
    return runtime().events.ipc_handle(_event(event))


@acl_call(0)
def ipc_open_event_handle(handle: bytes) -> int:
    """aclrtIpcOpenEventHandle: an event of this process over another process's IPC event."""
    if not isinstance(handle, (bytes, bytearray, memoryview)):
        raise InvalidParamError(f"handle must be the {HANDLE_SIZE} bytes of an aclrtIpcEventHandle, got "
                                f"{type(handle).__name__}")
    data = bytes(handle)
    if len(data) != HANDLE_SIZE:
        raise InvalidParamError(f"handle holds {len(data)} bytes: an aclrtIpcEventHandle is {HANDLE_SIZE}")
    return runtime().events.ipc_open(data)

