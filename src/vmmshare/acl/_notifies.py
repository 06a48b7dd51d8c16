"""``acl.rt`` notifies and IPC notifies (aclrtCreateNotify, aclrtRecordNotify, aclrtWaitAndResetNotify,
aclrtDestroyNotify, aclrtNotifyGetExportKey, aclrtNotifySetImportPid(InterServer), aclrtNotifyImportByKey): the acl
layer's checks (notify.cpp: 100000), then the runtime's (107000, 107017, 207006, ...)."""

from __future__ import annotations

from .. import constants as C
from .._process import runtime
from ..errors import InvalidParamError
from ..wire.props import U32, acl_require, check_int, check_pids, check_ptr, field_of
from ._args import read_list, read_pids, read_text
from ._call import acl_call
from ._ipc import MAX_KEY_LEN

__all__ = [
    "create_notify", "destroy_notify", "notify_get_export_key", "notify_import_by_key", "notify_set_import_pid",
    "notify_set_import_pid_inter_server", "record_notify", "wait_and_reset_notify",
]
_IMPORT_FLAGS = C.ACL_NOTIFY_DEVICE_USE_ONLY | C.ACL_RT_NOTIFY_IMPORT_FLAG_ENABLE_PEER_ACCESS


def _notify(notify: object) -> int:
    n = check_ptr("notify", notify)
    acl_require(n != 0, "notify is NULL")
    return n


@acl_call(0)
def create_notify(flag: int) -> int:
    """aclrtCreateNotify: a notify of the current device; `flag` ACL_NOTIFY_DEFAULT (0) or DEVICE_USE_ONLY (1)."""
    f = check_int("flag", flag)
    return runtime().notifies.create(f)


@acl_call()
def destroy_notify(notify: int) -> None:
    """aclrtDestroyNotify: every process that made or imported it destroys its own."""
    runtime().notifies.destroy(_notify(notify))


@acl_call()
def record_notify(notify: int, stream: int) -> None:
    """aclrtRecordNotify: set the notify when `stream` (0: the default stream) gets here."""
    n, st = _notify(notify), check_ptr("stream", stream)
    rt = runtime()
    rt.devices.current()
    rt.notifies.record(n, rt.devices.stream_here(st))


@acl_call()
def wait_and_reset_notify(notify: int, stream: int, timeout: int) -> None:
    """aclrtWaitAndResetNotify: `stream` waits until the notify is set, then resets it; `timeout` in seconds (0:
    no limit). A wait that runs out is 107019 at the stream's synchronize."""
    n, st = _notify(notify), check_ptr("stream", stream)
    t = check_int("timeout", timeout, 0, U32)
    rt = runtime()
    rt.devices.current()
    rt.notifies.wait_and_reset(n, rt.devices.stream_here(st), t)


@acl_call("")
def notify_get_export_key(notify: int, key_len: int, flags: int) -> str:
    """aclrtNotifyGetExportKey: the notify's key (at most `key_len` characters, at least 65): with its trustlist
    (ACL_RT_NOTIFY_EXPORT_FLAG_DEFAULT, 0) or without pid validation (DISABLE_PID_VALIDATION, 0x2)."""
    n, length, f = check_ptr("notify", notify), check_int("len", key_len), check_int("flags", flags)
    if length >= MAX_KEY_LEN:
        raise InvalidParamError(f"len={length}: the key buffer is less than {MAX_KEY_LEN} characters")
    acl_require(n != 0, "notify is NULL")
    notifies = runtime().notifies
    notifies.check(n)  # the handle's validity comes before the runtime's other checks
    if length == 0:
        raise InvalidParamError("len is 0")
    if f not in (C.ACL_RT_NOTIFY_EXPORT_FLAG_DEFAULT, C.ACL_RT_NOTIFY_EXPORT_FLAG_DISABLE_PID_VALIDATION):
        raise InvalidParamError(f"flags={f}: use ACL_RT_NOTIFY_EXPORT_FLAG_DEFAULT (0) or "
                                "DISABLE_PID_VALIDATION (0x2)")
    return notifies.export_key(n, length, f == C.ACL_RT_NOTIFY_EXPORT_FLAG_DEFAULT)


@acl_call()
def notify_set_import_pid(notify: int, pid_list: list[int]) -> None:
    """aclrtNotifySetImportPid: add processes (bare tgids) to the trustlist of a notify this process exported."""
    n, pids = check_ptr("notify", notify), read_pids("pid_list", pid_list)
    acl_require(n != 0, "notify is NULL")
    acl_require(pids is not None, "pid is NULL")
    assert pids is not None
    if not pids:
        raise InvalidParamError("pid_list is empty")
    runtime().notifies.set_pids(n, check_pids(pids))


@acl_call()
def notify_set_import_pid_inter_server(notify: int, server_pids: list[dict[str, object]]) -> None:
    """aclrtNotifySetImportPidInterServer: trust one pid per entry (`[{"sdid": server id, "pid": [pid]}, ...]`);
    other servers' pids need the cross-server transport."""
    n, entries = check_ptr("notify", notify), read_list("server_pids", server_pids)
    if n == 0:
        raise InvalidParamError("notify is NULL")
    if not entries:
        raise InvalidParamError(f"server_pids is {'NULL' if entries is None else 'empty'}")
    parsed: list[tuple[int, int]] = []
    for i, entry in enumerate(entries):
        where = f"server_pids[{i}]"
        sdid = check_int(f"{where}.sdid", field_of(entry, "sdid", where), 0, U32)
        pids = read_pids(f"{where}.pid", field_of(entry, "pid", where))
        if pids is None:
            raise InvalidParamError(f"{where}.pid is NULL")
        if len(pids) != 1:
            raise InvalidParamError(f"{where}.num is {len(pids)}: each entry names one pid")
        parsed.append((sdid, check_pids(pids)[0]))
    runtime().notifies.set_pids_on_servers(n, parsed)


@acl_call(0)
def notify_import_by_key(key: str, flags: int) -> int:
    """aclrtNotifyImportByKey: a notify of this process over the one `key` names (the broker checks the trustlist:
    207006 for a process not on it); this process may record it."""
    k, f = read_text("key", key), check_int("flags", flags)
    acl_require(k is not None, "key is NULL")
    assert k is not None
    if f & ~_IMPORT_FLAGS:
        raise InvalidParamError(f"flags={f:#x}: use ACL_RT_NOTIFY_IMPORT_FLAG_DEFAULT (0) or ENABLE_PEER_ACCESS "
                                "(0x2)")
    return runtime().notifies.import_key(k)
