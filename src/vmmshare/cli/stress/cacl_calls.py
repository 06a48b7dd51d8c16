"""The calls of the C library's binding (cacl.py), one maker each: it turns a pyACL call's Python arguments into
the C ones, and says what the call returns on failure (its neutral outputs) and how to read its outputs."""

from __future__ import annotations

import ctypes as C
from collections.abc import Callable, Mapping
from typing import Any

from cacl_args import (
    DEFAULT,
    PARAM,
    U64,
    AccessDesc,
    BadArgument,
    IpcEventHandle,
    Location,
    Prop,
    ServerPid,
    _field,
    _i32,
    _location,
    _pids,
    _prop,
    _ptr,
    _shareable,
    _text,
    _u32,
    _u64,
)

_NEUTRALS: dict[str, tuple[Any, ...]] = {}


def neutral_of(maker: Any) -> tuple[Any, ...]:
    return _NEUTRALS.get(maker.__name__, ())




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


def memcpy_batch(lib: Any, dsts: object, dest_maxs: object, srcs: object, sizes: object, num_batches: object,
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


def peek(lib: Any, level: object, clear: bool) -> int:
    """aclrtPeekAtLastError / aclrtGetLastError: the code itself is the result."""
    fn = lib.lib.aclrtGetLastError if clear else lib.lib.aclrtPeekAtLastError
    fn.restype = C.c_int
    return int(fn(_i32("level", level)))
