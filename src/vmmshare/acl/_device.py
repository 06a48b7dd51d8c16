"""``acl.rt`` devices, contexts, streams and peers (SPEC §2)."""

from __future__ import annotations

from .. import constants as C
from .._process import runtime
from ..errors import InvalidParamError, last_error
from ..wire.props import acl_require, check_device, check_int, check_ptr
from ._args import I32
from ._call import acl_call, code_call

__all__ = [
    "create_context", "create_stream", "destroy_context", "destroy_stream", "destroy_stream_force",
    "device_can_access_peer", "device_disable_peer_access", "device_enable_peer_access", "device_get_uuid",
    "get_context", "get_current_context", "get_device", "get_device_count", "get_last_error",
    "get_logic_dev_id_by_phy_dev_id", "get_logic_dev_id_by_user_dev_id", "get_phy_dev_id_by_logic_dev_id",
    "get_run_mode", "get_user_dev_id_by_logic_dev_id", "peek_at_last_error", "reset_device", "reset_device_force",
    "set_context", "set_current_context", "set_device", "stream_query", "synchronize_device",
    "synchronize_device_with_timeout", "synchronize_stream", "synchronize_stream_with_timeout",
]


@acl_call()
def set_device(device_id: int) -> None:
    runtime().devices.set(check_device(device_id))


@acl_call()
def reset_device(device_id: int) -> None:
    runtime().devices.reset(check_device(device_id))


@acl_call()
def reset_device_force(device_id: int) -> None:
    runtime().devices.reset(check_device(device_id), force=True)


@acl_call(0)
def get_device() -> int:
    """aclrtGetDevice: the calling thread's current device (107002 without one)."""
    return runtime().devices.current()


@acl_call(0)
def get_device_count() -> int:
    """aclrtGetDeviceCount: the devices this process sees (ASCEND_RT_VISIBLE_DEVICES applied); 207004 when that
    variable names none, repeats one or is not in ascending order (api_impl.cc `GetDeviceCount`)."""
    return runtime().devices.visible_count()


# ---------------------------------------------------------------- device-id conversions


@acl_call(0)
def get_logic_dev_id_by_user_dev_id(user_dev_id: int) -> int:
    """aclrtGetLogicDevIdByUserDevId: the node's device number behind a user id (ASCEND_RT_VISIBLE_DEVICES)."""
    return runtime().devices.logic_of_user(check_int("userDevid", user_dev_id, *I32))


@acl_call(0)
def get_user_dev_id_by_logic_dev_id(logic_dev_id: int) -> int:
    """aclrtGetUserDevIdByLogicDevId: the user id this process sees a node device by."""
    return runtime().devices.user_of_logic(check_int("logicDevId", logic_dev_id, *I32))


@acl_call(0)
def get_logic_dev_id_by_phy_dev_id(phy_dev_id: int) -> int:
    """aclrtGetLogicDevIdByPhyDevId: as the runtime, the index this process sees a physical device by."""
    return runtime().devices.logic_of_phy(check_int("phyDevId", phy_dev_id, *I32))


@acl_call(0)
def get_phy_dev_id_by_logic_dev_id(logic_dev_id: int) -> int:
    """aclrtGetPhyDevIdByLogicDevId: the physical device (this node's device number) behind an index."""
    return runtime().devices.phy_of_logic(check_int("logicDevId", logic_dev_id, *I32))


@acl_call(None)
def device_get_uuid(device_id: int) -> bytes:
    """aclrtDeviceGetUuid: the device's 16-byte id, stable per (server, device) across processes and restarts."""
    return runtime().devices.uuid(check_int("deviceId", device_id, *I32))


@acl_call(0)
def get_run_mode() -> int:
    """aclrtGetRunMode: ACL_HOST (1), the host drives the devices."""
    return C.ACL_HOST


# ---------------------------------------------------------------- contexts


@acl_call(0)
def create_context(device_id: int) -> int:
    """aclrtCreateContext: a new context on `device_id`, current in this thread from now on."""
    return runtime().devices.create_context(check_device(device_id))


@acl_call()
def destroy_context(context: int) -> None:
    c = check_ptr("context", context)
    acl_require(c != 0, "context is NULL")
    runtime().devices.destroy_context(c)


@acl_call()
def set_context(context: int) -> None:
    """aclrtSetCurrentContext (pyACL's name): make `context` this thread's current context."""
    c = check_ptr("context", context)
    acl_require(c != 0, "context is NULL")
    runtime().devices.set_context(c)


@acl_call(0)
def get_context() -> int:
    """aclrtGetCurrentContext (pyACL's name): this thread's current context (107002 without one)."""
    return runtime().devices.context().handle


@acl_call()
def set_current_context(context: int) -> None:
    """aclrtSetCurrentContext under its C name (pyACL calls it `set_context`)."""
    c = check_ptr("context", context)
    acl_require(c != 0, "context is NULL")
    runtime().devices.set_context(c)


@acl_call(0)
def get_current_context() -> int:
    """aclrtGetCurrentContext under its C name (pyACL calls it `get_context`)."""
    return runtime().devices.context().handle


# ---------------------------------------------------------------- streams


def _timeout(timeout: object) -> float | None:
    """A timeout in milliseconds, -1 to wait for ever; 0 and other negatives are 107000 (api_error.cc)."""
    t = check_int("timeout", timeout, *I32)
    if t < -1 or t == 0:
        raise InvalidParamError(f"timeout={t}: a positive number of milliseconds, or -1 to wait until done")
    return None if t == -1 else t / 1000


@acl_call(0)
def create_stream() -> int:
    return runtime().devices.create_stream()


@acl_call()
def destroy_stream(stream: int) -> None:
    """aclrtDestroyStream: the tasks queued on it run first; NULL is the acl layer's 100000 (§4a)."""
    s = check_ptr("stream", stream)
    acl_require(s != 0, "stream is NULL")
    runtime().devices.destroy_stream(s)


@acl_call()
def destroy_stream_force(stream: int) -> None:
    """aclrtDestroyStreamForce: the tasks not started yet are dropped (a running one finishes); NULL: 100000."""
    s = check_ptr("stream", stream)
    acl_require(s != 0, "stream is NULL")
    runtime().devices.destroy_stream(s, force=True)


@acl_call()
def synchronize_stream(stream: int) -> None:
    runtime().devices.synchronize_stream(check_ptr("stream", stream))


@acl_call()
def synchronize_stream_with_timeout(stream: int, timeout: int) -> None:
    s, t = check_ptr("stream", stream), _timeout(timeout)
    runtime().devices.synchronize_stream(s, t)


@acl_call()
def synchronize_device() -> None:
    """aclrtSynchronizeDevice: every stream of the current device (in this process) has run its tasks."""
    runtime().devices.synchronize_device()


@acl_call()
def synchronize_device_with_timeout(timeout: int) -> None:
    runtime().devices.synchronize_device(_timeout(timeout))


@acl_call(0)
def stream_query(stream: int) -> int:
    """aclrtStreamQuery: ACL_STREAM_STATUS_COMPLETE (0) when its tasks have run, else NOT_READY (1)."""
    busy = runtime().devices.stream(check_ptr("stream", stream)).busy()
    return C.ACL_STREAM_STATUS_NOT_READY if busy else C.ACL_STREAM_STATUS_COMPLETE


# ---------------------------------------------------------------- peers and errors


@acl_call(0)
def device_can_access_peer(device_id: int, peer_device_id: int) -> int:
    return runtime().devices.can_access_peer(check_device(device_id), check_device(peer_device_id))


@acl_call()
def device_enable_peer_access(peer_device_id: int, flags: int) -> None:
    peer = check_device(peer_device_id)
    check_int("flags", flags, 0, 0)
    runtime().devices.enable_peer_access(peer)


@acl_call()
def device_disable_peer_access(peer_device_id: int) -> None:
    """aclrtDeviceDisablePeerAccess: the same checks as enabling it; there is nothing to switch off."""
    runtime().devices.enable_peer_access(check_device(peer_device_id))


def _level(level: object) -> None:
    lvl = check_int("level", level, *I32)
    if lvl != 0:
        raise InvalidParamError(f"level={lvl}: the last error is kept per thread (ACL_RT_THREAD_LEVEL, 0)")


@code_call
def peek_at_last_error(level: int) -> int:
    """aclrtPeekAtLastError: the code of this thread's last failed call (0 if none), kept."""
    _level(level)
    return last_error(clear=False)


@code_call
def get_last_error(level: int) -> int:
    """aclrtGetLastError: the code of this thread's last failed call (0 if none), then cleared."""
    _level(level)
    return last_error(clear=True)
