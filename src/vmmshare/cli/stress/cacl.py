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
from collections.abc import Callable, Mapping
from typing import Any

PARAM = 107000
NOT_SUPPORTED = 207000
DEFAULT, FABRIC = 1, 2
U64 = (1 << 64) - 1


class Location(C.Structure):
    _fields_ = [("id", C.c_uint32), ("type", C.c_int)]


class Prop(C.Structure):
    _fields_ = [("handleType", C.c_int), ("allocationType", C.c_int), ("memAttr", C.c_int), ("location", Location),
                ("reserve", C.c_uint64)]


class AccessDesc(C.Structure):
    _fields_ = [("flags", C.c_int), ("location", Location), ("rsv", C.c_uint8 * 12)]


class ServerPid(C.Structure):
    _fields_ = [("sdid", C.c_uint32), ("pid", C.POINTER(C.c_int32)), ("num", C.c_size_t)]


class IpcEventHandle(C.Structure):
    _fields_ = [("reserved", C.c_char * 64)]


class BadArgument(Exception):
    """A Python value that does not fit the C argument (the binding's own refusal)."""


def _int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadArgument(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise BadArgument(f"{name}={value} is out of range [{lo}, {hi}]")
    return value


def _u64(name: str, v: object) -> int:
    return _int(name, v, 0, U64)


def _i32(name: str, v: object) -> int:
    return _int(name, v, -(1 << 31), (1 << 31) - 1)


def _u32(name: str, v: object) -> int:
    return _int(name, v, 0, (1 << 32) - 1)


def _ptr(name: str, v: object) -> int | None:
    return None if v is None or v == 0 else _u64(name, v)


def _field(struct: object, key: str, where: str) -> object:
    if not isinstance(struct, Mapping):
        raise BadArgument(f"{where} must be a dict with the C field names, got {type(struct).__name__}")
    if key not in struct:
        raise BadArgument(f"{where} lacks the field {key!r}")
    return struct[key]


def _location(loc: object, where: str) -> Location:
    ltype = _u32(f"{where}.type", _field(loc, "type", where))
    lid = _int(f"{where}.id", _field(loc, "id", where), -(1 << 31), (1 << 32) - 1)
    return Location(lid & 0xFFFFFFFF, ltype)


def _prop(prop: object) -> Any:
    if prop is None:
        return None
    p = Prop()
    p.handleType = _u32("prop.handleType", _field(prop, "handleType", "prop"))
    p.allocationType = _u32("prop.allocationType", _field(prop, "allocationType", "prop"))
    p.memAttr = _u32("prop.memAttr", _field(prop, "memAttr", "prop"))
    p.location = _location(_field(prop, "location", "prop"), "prop.location")
    p.reserve = _u64("prop.reserve", prop.get("reserve", 0) if isinstance(prop, Mapping) else 0)
    return C.byref(p)


def _pids(name: str, pids: object) -> tuple[Any, int]:
    if pids is None:
        return None, 0
    if not isinstance(pids, (list, tuple)):
        raise BadArgument(f"{name} must be a list, got {type(pids).__name__}")
    array = (C.c_int32 * max(len(pids), 1))(*[_i32(f"{name}[{i}]", p) for i, p in enumerate(pids)])
    return array, len(pids)


def _text(name: str, value: object) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str) or "\0" in value:
        raise BadArgument(f"{name} must be a str without NUL characters")
    return value.encode()


def _shareable(value: object, share_type: object) -> Any:
    """A V2 shareable handle argument: an int (DEFAULT, a uint64_t), bytes (FABRIC, 128 of them) or None; a value of
    the other kind's Python type is refused, as pyACL refuses it (in C both are a pointer)."""
    if value is None:
        return None
    if share_type == DEFAULT and isinstance(value, (bytes, bytearray, memoryview)):
        raise BadArgument(f"a DEFAULT shareable handle is an int, got {type(value).__name__}")
    if share_type == FABRIC and not isinstance(value, (bytes, bytearray, memoryview)):
        raise BadArgument(f"a FABRIC shareable handle is 128 bytes, got {type(value).__name__}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if share_type == FABRIC and len(raw) != 128:  # the C struct aclrtMemFabricHandle is 128 bytes
            raise BadArgument(f"a FABRIC handle is 128 bytes, got {len(raw)}")
        return C.create_string_buffer(raw, max(len(raw), 128))
    return C.byref(C.c_uint64(_u64("shareableHandle", value)))


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


_NEUTRALS: dict[str, tuple[Any, ...]] = {}


def neutral_of(maker: Any) -> tuple[Any, ...]:
    return _NEUTRALS.get(maker.__name__, ())


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


# ---------------------------------------------------------------- the calls: (C arguments, neutral outputs, outputs)


def _out(ctype: Any) -> Any:
    return ctype()


def _register(neutral: tuple[Any, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _NEUTRALS[fn.__name__] = neutral
        return staticmethod(fn)  # type: ignore[return-value]

    return deco


def _none(*args: Any) -> tuple[list[Any], tuple[()], Callable[[], tuple[()]]]:
    return list(args), (), lambda: ()


class _Calls:
    """One maker per pyACL call: it turns the Python arguments into C ones and says how to read the outputs."""

    @_register(())
    def set_device(d: object) -> Any:
        return _none(_i32("deviceId", d))

    @_register(())
    def reset_device(d: object) -> Any:
        return _none(_i32("deviceId", d))

    @_register(())
    def reset_device_force(d: object) -> Any:
        return _none(_i32("deviceId", d))

    @_register((0,))
    def get_device() -> Any:
        out = C.c_int32()
        return [C.byref(out)], (0,), lambda: (out.value,)

    @_register((0,))
    def get_device_count() -> Any:
        out = C.c_uint32()
        return [C.byref(out)], (0,), lambda: (out.value,)

    @_register((0,))
    def get_run_mode() -> Any:
        out = C.c_int()
        return [C.byref(out)], (0,), lambda: (out.value,)

    @_register((0,))
    def create_context(d: object) -> Any:
        out = C.c_void_p()
        return [C.byref(out), _i32("deviceId", d)], (0,), lambda: (out.value or 0,)

    @_register(())
    def destroy_context(c: object) -> Any:
        return _none(C.c_void_p(_ptr("context", c)))

    @_register(())
    def set_context(c: object) -> Any:
        return _none(C.c_void_p(_ptr("context", c)))

    @_register(())
    def set_current_context(c: object) -> Any:
        return _none(C.c_void_p(_ptr("context", c)))

    @_register((0,))
    def get_context() -> Any:
        out = C.c_void_p()
        return [C.byref(out)], (0,), lambda: (out.value or 0,)

    @_register((0,))
    def get_current_context() -> Any:
        out = C.c_void_p()
        return [C.byref(out)], (0,), lambda: (out.value or 0,)

    @_register((0,))
    def create_stream() -> Any:
        out = C.c_void_p()
        return [C.byref(out)], (0,), lambda: (out.value or 0,)

    @_register(())
    def destroy_stream(s: object) -> Any:
        return _none(C.c_void_p(_ptr("stream", s)))

    @_register(())
    def destroy_stream_force(s: object) -> Any:
        return _none(C.c_void_p(_ptr("stream", s)))

    @_register(())
    def synchronize_stream(s: object) -> Any:
        return _none(C.c_void_p(_ptr("stream", s)))

    @_register(())
    def synchronize_stream_with_timeout(s: object, t: object) -> Any:
        return _none(C.c_void_p(_ptr("stream", s)), _i32("timeout", t))

    @_register((0,))
    def stream_query(s: object) -> Any:
        out = C.c_int()
        return [C.c_void_p(_ptr("stream", s)), C.byref(out)], (0,), lambda: (out.value,)

    @_register(())
    def synchronize_device() -> Any:
        return _none()

    @_register(())
    def synchronize_device_with_timeout(t: object) -> Any:
        return _none(_i32("timeout", t))

    @_register((0,))
    def malloc_host(size: object) -> Any:
        out = C.c_void_p()
        return [C.byref(out), C.c_size_t(_u64("size", size))], (0,), lambda: (out.value or 0,)

    @_register(())
    def free_host(p: object) -> Any:
        return _none(C.c_void_p(_ptr("ptr", p)))

    @_register((0,))
    def malloc(size: object, policy: object) -> Any:
        out = C.c_void_p()
        return [C.byref(out), C.c_size_t(_u64("size", size)), _i32("policy", policy)], (0,), lambda: (out.value or 0,)

    @_register((0,))
    def malloc_align32(size: object, policy: object) -> Any:
        return _Calls.malloc(size, policy)

    @_register((0,))
    def malloc_cached(size: object, policy: object) -> Any:
        return _Calls.malloc(size, policy)

    @_register(())
    def free(p: object) -> Any:
        return _none(C.c_void_p(_ptr("devPtr", p)))

    @_register(())
    def memcpy(dst: object, dmax: object, src: object, count: object, kind: object) -> Any:
        return _none(C.c_void_p(_ptr("dst", dst)), C.c_size_t(_u64("destMax", dmax)), C.c_void_p(_ptr("src", src)),
                     C.c_size_t(_u64("count", count)), _i32("kind", kind))

    @_register(())
    def memcpy_async(dst: object, dmax: object, src: object, count: object, kind: object, stream: object) -> Any:
        return _none(C.c_void_p(_ptr("dst", dst)), C.c_size_t(_u64("destMax", dmax)), C.c_void_p(_ptr("src", src)),
                     C.c_size_t(_u64("count", count)), _i32("kind", kind), C.c_void_p(_ptr("stream", stream)))

    @_register(())
    def memset(p: object, mx: object, value: object, count: object) -> Any:
        return _none(C.c_void_p(_ptr("devPtr", p)), C.c_size_t(_u64("maxCount", mx)), _i32("value", value),
                     C.c_size_t(_u64("count", count)))

    @_register(())
    def memset_async(p: object, mx: object, value: object, count: object, stream: object) -> Any:
        return _none(C.c_void_p(_ptr("devPtr", p)), C.c_size_t(_u64("maxCount", mx)), _i32("value", value),
                     C.c_size_t(_u64("count", count)), C.c_void_p(_ptr("stream", stream)))

    @_register((0, 0))
    def get_mem_info(attr: object) -> Any:
        free, total = C.c_size_t(), C.c_size_t()
        return [_i32("attr", attr), C.byref(free), C.byref(total)], (0, 0), lambda: (free.value, total.value)

    @_register((0,))
    def mem_get_allocation_granularity(prop: object, option: object) -> Any:
        out = C.c_size_t()
        return [_prop(prop), _u32("option", option), C.byref(out)], (0,), lambda: (out.value,)

    @_register((0,))
    def malloc_physical(size: object, prop: object, flags: object) -> Any:
        out = C.c_void_p()
        args = [C.byref(out), C.c_size_t(_u64("size", size)), _prop(prop), C.c_uint64(_u64("flags", flags))]
        return args, (0,), lambda: (out.value or 0,)

    @_register(())
    def free_physical(h: object) -> Any:
        return _none(C.c_void_p(_ptr("handle", h)))

    @_register((0,))
    def reserve_mem_address(size: object, alignment: object, expect: object, flags: object) -> Any:
        out = C.c_void_p()
        args = [C.byref(out), C.c_size_t(_u64("size", size)), C.c_size_t(_u64("alignment", alignment)),
                C.c_void_p(_ptr("expectPtr", expect)), C.c_uint64(_u64("flags", flags))]
        return args, (0,), lambda: (out.value or 0,)

    @_register((0,))
    def reserve_mem_address_no_uc_memory(size: object, alignment: object, expect: object, flags: object) -> Any:
        return _Calls.reserve_mem_address(size, alignment, expect, flags)

    @_register(())
    def release_mem_address(p: object) -> Any:
        return _none(C.c_void_p(_ptr("ptr", p)))

    @_register(())
    def map_mem(p: object, size: object, offset: object, h: object, flags: object) -> Any:
        return _none(C.c_void_p(_ptr("ptr", p)), C.c_size_t(_u64("size", size)), C.c_size_t(_u64("offset", offset)),
                     C.c_void_p(_ptr("handle", h)), C.c_uint64(_u64("flags", flags)))

    @_register(())
    def mem_map_no_access(p: object, size: object, offset: object, h: object, flags: object) -> Any:
        return _Calls.map_mem(p, size, offset, h, flags)

    @_register(())
    def unmap_mem(p: object) -> Any:
        return _none(C.c_void_p(_ptr("ptr", p)))

    @_register(())
    def mem_set_access(p: object, size: object, desc_list: object) -> Any:
        if desc_list is None:
            descs: Any = None
            count = 0
        else:
            if not isinstance(desc_list, (list, tuple)):
                raise BadArgument(f"desc_list must be a list, got {type(desc_list).__name__}")
            descs = (AccessDesc * max(len(desc_list), 1))()
            for i, d in enumerate(desc_list):
                descs[i].flags = _u32(f"desc_list[{i}].flags", _field(d, "flags", f"desc_list[{i}]"))
                descs[i].location = _location(_field(d, "location", f"desc_list[{i}]"), f"desc_list[{i}].location")
            count = len(desc_list)
        return _none(C.c_void_p(_ptr("ptr", p)), C.c_size_t(_u64("size", size)), descs, C.c_size_t(count))

    @_register((0,))
    def mem_get_access(p: object, location: object) -> Any:
        out = C.c_uint64()
        loc = None if location is None else C.byref(_location(location, "location"))
        return [C.c_void_p(_ptr("ptr", p)), loc, C.byref(out)], (0,), lambda: (out.value,)

    @_register((0,))
    def mem_retain_allocation_handle(p: object) -> Any:
        out = C.c_void_p()
        return [C.c_void_p(_ptr("ptr", p)), C.byref(out)], (0,), lambda: (out.value or 0,)

    @_register((None,))
    def mem_get_allocation_properties_from_handle(h: object) -> Any:
        p = Prop()

        def read() -> tuple[dict[str, Any]]:
            return ({"handleType": p.handleType, "allocationType": p.allocationType, "memAttr": p.memAttr,
                     "location": {"id": p.location.id, "type": p.location.type}, "reserve": p.reserve},)

        return [C.c_void_p(_ptr("handle", h)), C.byref(p)], (None,), read

    @_register((0, 0))
    def mem_get_address_range(p: object) -> Any:
        base, size = C.c_void_p(), C.c_size_t()
        return ([C.c_void_p(_ptr("ptr", p)), C.byref(base), C.byref(size)], (0, 0),
                lambda: (base.value or 0, size.value))

    @_register((0,))
    def mem_export_to_shareable_handle(h: object, handle_type: object, flags: object) -> Any:
        out = C.c_uint64()
        args = [C.c_void_p(_ptr("handle", h)), _u32("handleType", handle_type), C.c_uint64(_u64("flags", flags)),
                C.byref(out)]
        return args, (0,), lambda: (out.value,)

    @_register(())
    def mem_set_pid_to_shareable_handle(sh: object, pids: object) -> Any:
        array, n = _pids("pid_list", pids)
        return _none(C.c_uint64(_u64("shareableHandle", sh)), array, C.c_size_t(n))

    @_register((0,))
    def mem_import_from_shareable_handle(sh: object, device: object) -> Any:
        out = C.c_void_p()
        return ([C.c_uint64(_u64("shareableHandle", sh)), _i32("deviceId", device), C.byref(out)], (0,),
                lambda: (out.value or 0,))

    @_register((0,))
    def mem_export_to_shareable_handle_v2(h: object, flags: object, st: object) -> Any:
        buf = C.create_string_buffer(128)
        share_type = _u32("shareType", st)

        def read() -> tuple[Any]:
            raw = buf.raw
            return (int.from_bytes(raw[:8], "little"),) if share_type == DEFAULT else (raw,)

        return [C.c_void_p(_ptr("handle", h)), C.c_uint64(_u64("flags", flags)), share_type, buf], (0,), read

    @_register(())
    def mem_set_pid_to_shareable_handle_v2(sh: object, st: object, pids: object) -> Any:
        array, n = _pids("pid_list", pids)
        return _none(_shareable(sh, st), _u32("shareType", st), array, C.c_size_t(n))

    @_register((0,))
    def mem_import_from_shareable_handle_v2(sh: object, st: object, flags: object) -> Any:
        out = C.c_void_p()
        return ([_shareable(sh, st), _u32("shareType", st), C.c_uint64(_u64("flags", flags)), C.byref(out)], (0,),
                lambda: (out.value or 0,))

    @_register((0,))
    def device_get_bare_tgid() -> Any:
        out = C.c_int32()
        return [C.byref(out)], (0,), lambda: (out.value,)

    @_register((0,))
    def device_can_access_peer(d: object, p: object) -> Any:
        out = C.c_int32()
        return [C.byref(out), _i32("deviceId", d), _i32("peerDeviceId", p)], (0,), lambda: (out.value,)

    @_register(())
    def device_enable_peer_access(p: object, flags: object) -> Any:
        return _none(_i32("peerDeviceId", p), _u32("flags", flags))

    @_register(())
    def device_disable_peer_access(p: object) -> Any:
        return _none(_i32("peerDeviceId", p))

    @_register(("",))
    def ipc_mem_get_export_key(p: object, size: object, key_len: object, flags: object) -> Any:
        length = _u64("len", key_len)
        buf = C.create_string_buffer(max(1, min(length, 1024)))
        args = [C.c_void_p(_ptr("devPtr", p)), C.c_size_t(_u64("size", size)), buf, C.c_size_t(length),
                C.c_uint64(_u64("flags", flags))]
        return args, ("",), lambda: (buf.value.decode(),)

    @_register(())
    def ipc_mem_set_import_pid(key: object, pids: object) -> Any:
        array, n = _pids("pid_list", pids)
        return _none(_text("key", key), array, C.c_size_t(n))

    @_register(())
    def ipc_mem_import_pid_inter_server(key: object, server_pids: object) -> Any:
        if server_pids is None:
            entries: Any = None
            n = 0
        else:
            if not isinstance(server_pids, (list, tuple)):
                raise BadArgument("server_pids must be a list")
            entries = (ServerPid * max(len(server_pids), 1))()
            keep = []
            for i, e in enumerate(server_pids):
                entries[i].sdid = _u32(f"server_pids[{i}].sdid", _field(e, "sdid", f"server_pids[{i}]"))
                array, count = _pids(f"server_pids[{i}].pid", _field(e, "pid", f"server_pids[{i}]"))
                keep.append(array)
                entries[i].pid = C.cast(array, C.POINTER(C.c_int32)) if array is not None else None
                entries[i].num = count
            entries._keep = keep
            n = len(server_pids)
        return _none(_text("key", key), entries, C.c_size_t(n))

    @_register((0,))
    def ipc_mem_import_by_key(key: object, flags: object) -> Any:
        out = C.c_void_p()
        return ([C.byref(out), _text("key", key), C.c_uint64(_u64("flags", flags))], (0,),
                lambda: (out.value or 0,))

    @_register(())
    def ipc_mem_set_attr(key: object, type: object, attr: object) -> Any:
        return _none(_text("key", key), _u32("type", type), C.c_uint64(_u64("attr", attr)))

    @_register(())
    def ipc_mem_close(key: object) -> Any:
        return _none(_text("key", key))

    @_register((0,))
    def get_logic_dev_id_by_user_dev_id(i: object) -> Any:
        out = C.c_int32()
        return [_i32("userDevid", i), C.byref(out)], (0,), lambda: (out.value,)

    @_register((0,))
    def get_user_dev_id_by_logic_dev_id(i: object) -> Any:
        out = C.c_int32()
        return [_i32("logicDevId", i), C.byref(out)], (0,), lambda: (out.value,)

    @_register((0,))
    def get_logic_dev_id_by_phy_dev_id(i: object) -> Any:
        out = C.c_int32()
        return [_i32("phyDevId", i), C.byref(out)], (0,), lambda: (out.value,)

    @_register((0,))
    def get_phy_dev_id_by_logic_dev_id(i: object) -> Any:
        out = C.c_int32()
        return [_i32("logicDevId", i), C.byref(out)], (0,), lambda: (out.value,)

    @_register((None,))
    def device_get_uuid(d: object) -> Any:
        buf = C.create_string_buffer(16)
        return [_i32("deviceId", d), buf], (None,), lambda: (buf.raw,)

    @_register((0,))
    def host_register(p: object, size: object, type: object) -> Any:
        out = C.c_void_p()
        return ([C.c_void_p(_ptr("ptr", p)), C.c_uint64(_u64("size", size)), _u32("type", type), C.byref(out)], (0,),
                lambda: (out.value or 0,))

    @_register(())
    def host_unregister(p: object) -> Any:
        return _none(C.c_void_p(_ptr("ptr", p)))

    @_register((0,))
    def host_get_device_pointer(p: object, flag: object) -> Any:
        out = C.c_void_p()
        return [C.c_void_p(_ptr("pHost", p)), C.byref(out), _u32("flag", flag)], (0,), lambda: (out.value or 0,)

    # ------------------------------------------------------------ events and notifies

    @_register((0,))
    def create_event() -> Any:
        out = C.c_void_p()
        return [C.byref(out)], (0,), lambda: (out.value or 0,)

    @_register((0,))
    def create_event_with_flag(flag: object) -> Any:
        out = C.c_void_p()
        return [C.byref(out), _u32("flag", flag)], (0,), lambda: (out.value or 0,)

    @_register((0,))
    def create_event_ex_with_flag(flag: object) -> Any:
        return _Calls.create_event_with_flag(flag)

    @_register(())
    def destroy_event(e: object) -> Any:
        return _none(C.c_void_p(_ptr("event", e)))

    @_register(())
    def record_event(e: object, s: object) -> Any:
        return _none(C.c_void_p(_ptr("event", e)), C.c_void_p(_ptr("stream", s)))

    @_register((0,))
    def query_event_status(e: object) -> Any:
        out = C.c_int()
        return [C.c_void_p(_ptr("event", e)), C.byref(out)], (0,), lambda: (out.value,)

    @_register(())
    def synchronize_event(e: object) -> Any:
        return _none(C.c_void_p(_ptr("event", e)))

    @_register(())
    def synchronize_event_with_timeout(e: object, t: object) -> Any:
        return _none(C.c_void_p(_ptr("event", e)), _i32("timeout", t))

    @_register(())
    def stream_wait_event(s: object, e: object) -> Any:
        return _none(C.c_void_p(_ptr("stream", s)), C.c_void_p(_ptr("event", e)))

    @_register((None,))
    def ipc_get_event_handle(e: object) -> Any:
        buf = C.create_string_buffer(64)
        return [C.c_void_p(_ptr("event", e)), buf], (None,), lambda: (buf.raw,)

    @_register((0,))
    def ipc_open_event_handle(handle: object) -> Any:
        if not isinstance(handle, (bytes, bytearray)) or len(handle) != 64:
            raise BadArgument("handle must be the 64 bytes of an aclrtIpcEventHandle")
        out = C.c_void_p()
        return [IpcEventHandle.from_buffer_copy(bytes(handle)), C.byref(out)], (0,), lambda: (out.value or 0,)

    @_register((0,))
    def create_notify(flag: object) -> Any:
        out = C.c_void_p()
        return [C.byref(out), C.c_uint64(_u64("flag", flag))], (0,), lambda: (out.value or 0,)

    @_register(())
    def destroy_notify(n: object) -> Any:
        return _none(C.c_void_p(_ptr("notify", n)))

    @_register(())
    def record_notify(n: object, s: object) -> Any:
        return _none(C.c_void_p(_ptr("notify", n)), C.c_void_p(_ptr("stream", s)))

    @_register(())
    def wait_and_reset_notify(n: object, s: object, timeout: object) -> Any:
        return _none(C.c_void_p(_ptr("notify", n)), C.c_void_p(_ptr("stream", s)), _u32("timeout", timeout))

    @_register(("",))
    def notify_get_export_key(n: object, key_len: object, flags: object) -> Any:
        length = _u64("len", key_len)
        buf = C.create_string_buffer(max(1, min(length, 1024)))
        return ([C.c_void_p(_ptr("notify", n)), buf, C.c_size_t(length), C.c_uint64(_u64("flags", flags))], ("",),
                lambda: (buf.value.decode(),))

    @_register(())
    def notify_set_import_pid(n: object, pids: object) -> Any:
        array, count = _pids("pid_list", pids)
        return _none(C.c_void_p(_ptr("notify", n)), array, C.c_size_t(count))

    @_register((0,))
    def notify_import_by_key(key: object, flags: object) -> Any:
        out = C.c_void_p()
        return [C.byref(out), _text("key", key), C.c_uint64(_u64("flags", flags))], (0,), lambda: (out.value or 0,)

    @_register((None,))
    def pointer_get_attributes(p: object) -> Any:
        class PtrAttributes(C.Structure):
            _fields_ = [("location", Location), ("pageSize", C.c_uint32), ("rsv", C.c_uint32 * 4)]

        out = PtrAttributes()
        return ([C.c_void_p(_ptr("ptr", p)), C.byref(out)], (None,),
                lambda: ({"location": {"id": out.location.id, "type": out.location.type},
                          "pageSize": out.pageSize},))


class BatchAttr(C.Structure):
    _fields_ = [("dstLoc", Location), ("srcLoc", Location), ("rsv", C.c_uint8 * 16)]


def memcpy_batch(lib: CAcl, dsts: object, dest_maxs: object, srcs: object, sizes: object, num_batches: object,
                 attrs: object, attrs_indexes: object, num_attrs: object) -> tuple[int, int]:
    """aclrtMemcpyBatch, as pyACL shapes it: (failIndex, ret), failIndex SIZE_MAX unless a pair failed."""
    lib._refused.message = None
    fail = C.c_size_t(U64)

    def array(name: str, value: object, ctype: Any, count: int) -> Any:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            raise BadArgument(f"{name} must be a list, got {type(value).__name__}")
        if len(value) < count:
            raise BadArgument(f"{name} holds {len(value)} entries, fewer than the {count} the call reads")
        return (ctype * max(count, 1))(*[_u64(f"{name}[{i}]", v) if v is not None else 0
                                         for i, v in enumerate(value[:count])])

    try:
        n, na = _u64("numBatches", num_batches), _u64("numAttrs", num_attrs)
        arrays = [array("dsts", dsts, C.c_void_p, n), array("destMaxs", dest_maxs, C.c_size_t, n),
                  array("srcs", srcs, C.c_void_p, n), array("sizes", sizes, C.c_size_t, n)]
        if attrs is None:
            a: Any = None
        else:
            if not isinstance(attrs, (list, tuple)) or len(attrs) < na:
                raise BadArgument(f"attrs must be a list of at least numAttrs ({na}) entries")
            a = (BatchAttr * max(na, 1))()
            for i in range(na):
                where = f"attrs[{i}]"
                a[i].dstLoc = _location(_field(attrs[i], "dstLoc", where), f"{where}.dstLoc")
                a[i].srcLoc = _location(_field(attrs[i], "srcLoc", where), f"{where}.srcLoc")
                rsv = attrs[i].get("rsv") if isinstance(attrs[i], Mapping) else None
                raw = bytes(rsv) if isinstance(rsv, (bytes, list, tuple)) else b""
                for k, v in enumerate(raw[:16]):
                    a[i].rsv[k] = v
                if len(raw) > 16:
                    a[i].rsv[0] = 1  # more than the struct's 16 bytes: not all zero, as the C caller would have it
        idx = array("attrsIndexes", attrs_indexes, C.c_size_t, na)
    except BadArgument as exc:
        lib._refused.message = f"aclrtMemcpyBatch: {exc}"
        return U64, PARAM
    fn = lib.lib.aclrtMemcpyBatch
    fn.restype = C.c_int
    ret = int(fn(*arrays, C.c_size_t(n), a, idx, C.c_size_t(na), C.byref(fail)))
    return fail.value, ret


def peek(lib: CAcl, level: object, clear: bool) -> int:
    """aclrtPeekAtLastError / aclrtGetLastError: the code itself is the result."""
    fn = lib.lib.aclrtGetLastError if clear else lib.lib.aclrtPeekAtLastError
    fn.restype = C.c_int
    return int(fn(_i32("level", level)))


_LOADED: dict[str, CAcl] = {}


def load(path: str | None = None) -> CAcl:
    """The C library at `path` (default: $VMMSHARE_CLIB, else the one `vmmshare prefix` holds), loaded once."""
    from vmmshare.sdk import library

    where = path or os.environ.get("VMMSHARE_CLIB") or str(library())
    if where not in _LOADED:
        _LOADED[where] = CAcl(where)
    return _LOADED[where]
