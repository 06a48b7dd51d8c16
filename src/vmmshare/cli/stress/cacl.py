"""The C library (libascendcl.so) behind pyACL-shaped calls, through ctypes: `cacl.load().rt.malloc_physical(size,
prop, 0)` returns ``(handle, ret)`` as ``vmmshare.acl.rt.malloc_physical`` does, so one test drives either surface.

A thin binding: it converts Python values to the C arguments and reads the outputs back, and decides nothing. A
value that does not fit its C type (a str for a size, a pid beyond int32) is refused here with 107000 and a message,
as pyACL refuses what it cannot convert; everything else is the library's to check. Set VMMSHARE_CLIB to load
another build of the library (the sanitizer build of the tests).
"""

from __future__ import annotations

import ctypes as C
import os
import threading
from collections.abc import Callable
from typing import Any

from cacl_args import PARAM, BadArgument, _text
from cacl_calls import _Calls, memcpy_batch, neutral_of, peek


class _Rt:
    """`acl.rt` of the C library."""

    def __init__(self, lib: C.CDLL, owner: CAcl) -> None:
        self._lib, self._owner = lib, owner

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name in ("peek_at_last_error", "get_last_error"):
            return lambda level: peek(self._owner, level, name == "get_last_error")
        if name == "memcpy_batch":
            return lambda *args: memcpy_batch(self._owner, *args)
        maker = getattr(_Calls, name, None)
        if maker is None:
            from vmmshare.acl import _unsupported

            shape = _unsupported.RT.get(name)
            if shape is None:
                raise AttributeError(name)
            return self._owner.stand_in(name, shape)
        fn = self._owner.wrap(name, maker)
        setattr(self, name, fn)
        return fn


class CAcl:
    """The C library, shaped as `vmmshare.acl` (`rt`, `get_recent_err_msg`, `init`, `finalize`, ...)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = C.CDLL(path, mode=C.RTLD_GLOBAL)
        self.lib.aclGetRecentErrMsg.restype = C.c_char_p
        self.lib.aclrtGetSocName.restype = C.c_char_p
        self._refused = threading.local()
        self.rt = _Rt(self.lib, self)

    def c_name(self, name: str) -> str:
        return c_name(name)

    def get_recent_err_msg(self) -> str:
        refused = getattr(self._refused, "message", None)
        if refused is not None:
            return str(refused)
        raw = self.lib.aclGetRecentErrMsg()
        return raw.decode("utf-8", "replace") if raw else ""

    def wrap(self, name: str, maker: Callable[..., tuple[Callable[[], Any], Any, Callable[[], Any]]]) -> Any:
        cfunc = getattr(self.lib, self.c_name(name))
        cfunc.restype = C.c_int

        def call(*args: Any) -> Any:
            self._refused.message = None
            try:
                arguments, neutral, outputs = maker(*args)
            except BadArgument as exc:
                self._refused.message = f"{self.c_name(name)}: {exc}"
                return (*neutral_of(maker), PARAM) if neutral_of(maker) else PARAM
            except TypeError as exc:  # the wrong number of arguments
                self._refused.message = f"{self.c_name(name)}: {exc}"
                return (*neutral_of(maker), PARAM) if neutral_of(maker) else PARAM
            ret = int(cfunc(*arguments))
            if not neutral:
                return ret
            got = outputs() if ret == 0 else neutral
            return (*got, ret)

        call.__name__ = name
        return call

    def stand_in(self, name: str, shape: str) -> Callable[..., Any]:
        from vmmshare.acl import _unsupported

        cname = _stand_in_name(self.lib, name)
        neutral = tuple(_unsupported._NEUTRAL[c] for c in shape.lstrip("="))

        def call(*args: Any) -> Any:
            self._refused.message = None
            fn = getattr(self.lib, cname)
            fn.restype = C.c_int
            ret = int(fn())
            if shape.startswith("="):
                return neutral[0]
            return (*neutral, ret) if neutral else ret

        return call

    def __getattr__(self, name: str) -> Any:
        """The constants, as pyACL has them (acl.ACL_MEMCPY_DEVICE_TO_HOST, ...)."""
        from vmmshare import constants

        if name.startswith("ACL_") and hasattr(constants, name):
            return getattr(constants, name)
        raise AttributeError(name)

    # ---------------------------------------------------------------- acl.*

    def init(self, config_path: str | None = None) -> int:
        return int(self.lib.aclInit(_text("config_path", config_path)))

    def finalize(self) -> int:
        return int(self.lib.aclFinalize())

    def get_soc_name(self) -> str:
        raw = self.lib.aclrtGetSocName()
        return raw.decode() if raw else ""

    def get_version(self) -> tuple[int, int, int, int]:
        a, b, c = C.c_int32(), C.c_int32(), C.c_int32()
        ret = int(self.lib.aclrtGetVersion(C.byref(a), C.byref(b), C.byref(c)))
        return (a.value, b.value, c.value, ret) if ret == 0 else (0, 0, 0, ret)


def c_name(name: str) -> str:
    """The C function behind a pyACL call name (`rt.`'s; acl.init is aclInit and so on)."""
    name = name.rsplit(".", 1)[-1]
    return _C_NAMES.get(name) or "aclrt" + "".join(p[:1].upper() + p[1:] for p in name.split("_"))


_C_NAMES = {
    "set_context": "aclrtSetCurrentContext", "get_context": "aclrtGetCurrentContext",
    "mem_export_to_shareable_handle_v2": "aclrtMemExportToShareableHandleV2",
    "mem_import_from_shareable_handle_v2": "aclrtMemImportFromShareableHandleV2",
    "mem_set_pid_to_shareable_handle_v2": "aclrtMemSetPidToShareableHandleV2",
    "malloc_align32": "aclrtMallocAlign32", "get_mem_info": "aclrtGetMemInfo",
    "device_get_uuid": "aclrtDeviceGetUuid", "ipc_mem_get_export_key": "aclrtIpcMemGetExportKey",
    "ipc_mem_set_import_pid": "aclrtIpcMemSetImportPid", "ipc_mem_import_pid_inter_server":
    "aclrtIpcMemImportPidInterServer", "ipc_mem_import_by_key": "aclrtIpcMemImportByKey",
    "ipc_mem_set_attr": "aclrtIpcMemSetAttr", "ipc_mem_close": "aclrtIpcMemClose",
    "reserve_mem_address_no_uc_memory": "aclrtReserveMemAddressNoUCMemory",
}


def _stand_in_name(lib: C.CDLL, name: str) -> str:
    """The exported C name of a pyACL stand-in (its words, case aside: aclrtBinaryUnLoad for binary_unload)."""
    from vmmshare.sdk import LIBRARIES  # noqa: F401  (the package is importable: the names list below is its)

    want = name.replace("_", "").lower()
    for cname in exported_names(lib):
        bare = cname[5:] if cname.startswith("aclrt") else cname[3:]
        if bare.lower() == want:
            return cname
    raise AttributeError(f"the C library exports no stand-in for {name}")


_EXPORTED: dict[str, list[str]] = {}


def exported_names(lib: C.CDLL) -> list[str]:
    """The names the library exports (read from its dynamic symbol table with nm, once)."""
    path = lib._name
    if path not in _EXPORTED:
        import subprocess

        out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
        _EXPORTED[path] = [line.split()[-1] for line in out.splitlines() if line.strip()]
    return _EXPORTED[path]


_LOADED: dict[str, CAcl] = {}


def load(path: str | None = None) -> CAcl:
    """The C library at `path` (default: $VMMSHARE_CLIB, else the one `vmmshare prefix` holds), loaded once."""
    from vmmshare.sdk import library

    where = path or os.environ.get("VMMSHARE_CLIB") or str(library())
    if where not in _LOADED:
        _LOADED[where] = CAcl(where)
    return _LOADED[where]
