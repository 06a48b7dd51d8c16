"""``acl.rt`` IPC memory keys (aclrtIpcMem*, SPEC §2; reference/cann-api-ipc-memory-sharing.md), on the broker's
exports and trustlists like the VMM handles. pyACL's own argument orders; the acl layer's checks first (100000),
then the runtime's (107000, 107002, ...)."""

from __future__ import annotations

from .. import constants as C
from .._process import runtime
from ..errors import InvalidParamError
from ..runtime.ipc import KEY_BUFFER
from ..wire.props import U32, acl_require, check_int, check_pids, check_ptr, field_of
from ._args import read_list, read_pids, read_text
from ._call import acl_call

__all__ = [
    "ipc_mem_close", "ipc_mem_get_export_key", "ipc_mem_import_by_key", "ipc_mem_import_pid_inter_server",
    "ipc_mem_set_attr", "ipc_mem_set_import_pid",
]
MAX_KEY_LEN = 1024  # pyACL's bound on the key buffer it allocates
_LINKS = range(C.ACL_RT_IPC_MEM_ATTR_ACCESS_LINK_SIO, C.ACL_RT_IPC_MEM_ATTR_ACCESS_LINK_UB_MULTI_PORT_PATH + 1)


def _key(key: str | None) -> str:
    if key is None:
        raise InvalidParamError("key is NULL")
    return key


@acl_call("")
def ipc_mem_get_export_key(dev_ptr: int, size: int, key_len: int, flags: int) -> str:
    """aclrtIpcMemGetExportKey: the key of memory from acl.rt.malloc (at most `key_len` characters)."""
    p, n = check_ptr("devPtr", dev_ptr), check_int("size", size)
    length, f = check_int("len", key_len), check_int("flags", flags)
    if length >= MAX_KEY_LEN:
        raise InvalidParamError(f"len={length}: the key buffer is less than {MAX_KEY_LEN} characters")
    acl_require(p != 0, "devPtr is NULL")
    if n == 0 or length == 0:
        raise InvalidParamError(f"{'size' if n == 0 else 'len'} is 0")
    if f not in (C.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT, C.ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION):
        raise InvalidParamError(f"flags={f}: use ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT (0) or "
                                "DISABLE_PID_VALIDATION (1)")
    rt = runtime()
    rt.devices.current()
    if length < KEY_BUFFER:
        raise InvalidParamError(f"len={length}: the key buffer must hold at least {KEY_BUFFER} characters")
    return rt.ipc.export(p, n, f == C.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT)


@acl_call()
def ipc_mem_set_import_pid(key: str, pid_list: list[int]) -> None:
    """aclrtIpcMemSetImportPid: add processes (bare tgids) to the trustlist of a key this process exported."""
    k, pids = read_text("key", key), read_pids("pid_list", pid_list)
    acl_require(k is not None, "key is NULL")
    acl_require(pids is not None, "pid_list is NULL")
    assert pids is not None
    if not pids:
        raise InvalidParamError("pid_list is empty")
    rt = runtime()
    rt.devices.current()
    rt.ipc.set_pids(_key(k), check_pids(pids))


@acl_call()
def ipc_mem_import_pid_inter_server(key: str, server_pids: list[dict[str, object]]) -> None:
    """aclrtIpcMemImportPidInterServer: trust pids per server (`[{"sdid": server id, "pid": [...]}, ...]`); other
    servers' pids need the cross-server transport."""
    k, entries = read_text("key", key), read_list("server_pids", server_pids)
    parsed: list[tuple[int, list[int] | None]] = []
    for i, entry in enumerate(entries or []):
        sdid = check_int(f"server_pids[{i}].sdid", field_of(entry, "sdid", f"server_pids[{i}]"), 0, U32)
        parsed.append((sdid, read_pids(f"server_pids[{i}].pid", field_of(entry, "pid", f"server_pids[{i}]"))))
    _key(k)
    if entries is None or not entries:
        raise InvalidParamError(f"server_pids is {'NULL' if entries is None else 'empty'}")
    checked: list[tuple[int, list[int]]] = []
    for i, (sdid, pids) in enumerate(parsed):
        if pids is None:
            raise InvalidParamError(f"server_pids[{i}].pid is NULL")
        checked.append((sdid, check_pids(pids)))
    rt = runtime()
    rt.devices.current()
    rt.ipc.set_pids_on_servers(_key(k), checked)


@acl_call(0)
def ipc_mem_import_by_key(key: str, flags: int) -> int:
    """aclrtIpcMemImportByKey: map the memory a key names into this process; the pointer, ipc_mem_close frees it."""
    k, f = read_text("key", key), check_int("flags", flags)
    acl_require(k is not None, "key is NULL")
    assert k is not None
    if f not in (C.ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT, C.ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS):
        raise InvalidParamError(f"flags={f}: use ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT (0) or ENABLE_PEER_ACCESS (1)")
    rt = runtime()
    return rt.ipc.import_key(k, rt.devices.current())


@acl_call()
def ipc_mem_set_attr(key: str, type: int, attr: int) -> None:  # the C parameter's name
    """aclrtIpcMemSetAttr: the link later imports of `key` in this process use (one link on this machine)."""
    k = read_text("key", key)
    t, a = check_int("type", type, 0, U32), check_int("attr", attr)
    _key(k)
    if t != C.ACL_RT_IPC_MEM_ATTR_ACCESS_LINK:
        raise InvalidParamError(f"type={t}: the attribute is ACL_RT_IPC_MEM_ATTR_ACCESS_LINK (0)")
    if a not in _LINKS:
        raise InvalidParamError(f"attr={a}: use ACL_RT_IPC_MEM_ATTR_ACCESS_LINK_SIO (0), HCCS (1), "
                                "UB_ONE_PORT_PATH (2) or UB_MULTI_PORT_PATH (3)")
    runtime().ipc.set_attr(_key(k), a)


@acl_call()
def ipc_mem_close(key: str) -> None:
    """aclrtIpcMemClose: an importer unmaps its import; the exporter revokes the key (importers keep theirs)."""
    k = read_text("key", key)
    acl_require(k is not None, "key is NULL")
    assert k is not None
    runtime().ipc.close(k)
