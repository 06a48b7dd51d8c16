"""``acl.rt`` calls about pointers: their attributes, host memory registered for the device, a reservation without
UC memory, and batches of copies. The acl layer's checks first (100000), then the runtime's (107000, 507910, ...),
in the runtime's order."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .. import constants as C
from .._process import runtime
from ..errors import AclError, InvalidParamError, set_recent_error
from ..runtime.pointers import SIZE_MAX, BatchAttr, BatchError
from ..wire.props import U32, acl_require, check_int, check_ptr, field_of
from ._args import read_list
from ._call import acl_call

__all__ = [
    "host_get_device_pointer", "host_register", "host_unregister", "memcpy_batch", "pointer_get_attributes",
    "reserve_mem_address_no_uc_memory",
]
_RSV = 16  # aclrtMemcpyBatchAttr.rsv's bytes, which must be 0
log = logging.getLogger("vmmshare.acl")


@acl_call(None)
def pointer_get_attributes(ptr: int) -> dict[str, Any]:
    """aclrtPointerGetAttributes: {"location": {"id", "type"}, "pageSize"}; ordinary host memory the runtime did
    not make is ACL_MEM_LOCATION_TYPE_UNREGISTERED (2), as the runtime reports it."""
    p = check_ptr("ptr", ptr)
    acl_require(p != 0, "ptr is NULL")
    return runtime().pointers.attributes(p)


@acl_call(0)
def reserve_mem_address_no_uc_memory(size: int, alignment: int, expect_ptr: int | None, flags: int) -> int:
    """aclrtReserveMemAddressNoUCMemory: a reservation as reserve_mem_address makes it, with its checks (host
    memory has no UC memory to leave out); release_mem_address releases it."""
    n, a = check_int("size", size), check_int("alignment", alignment)
    want, f = check_ptr("expectPtr", expect_ptr), check_int("flags", flags)
    acl_require(n != 0, "size is 0: reserve a positive multiple of the granularity")
    acl_require(f in (0, 1), f"flags={f}: must be 0 (1 is accepted for compatibility and means 0)")
    return runtime().memory.reserve(n, a, want)


@acl_call(0)
def host_register(ptr: int, size: int, type: int) -> int:  # the C parameter's name
    """aclrtHostRegister: make `[ptr, ptr+size)` of this process reachable by the current device; the device's
    pointer to it (on the host backend, `ptr` itself). host_unregister undoes it."""
    p, n, t = check_ptr("ptr", ptr), check_int("size", size), check_int("type", type, 0, U32)
    acl_require(p != 0, "ptr is NULL")
    acl_require(n != 0, "size is 0")
    return runtime().pointers.register(p, n, t)


@acl_call()
def host_unregister(ptr: int) -> None:
    """aclrtHostUnregister: the pointer host_register took (507911 for any other)."""
    p = check_ptr("ptr", ptr)
    acl_require(p != 0, "ptr is NULL")
    runtime().pointers.unregister(p)


@acl_call(0)
def host_get_device_pointer(p_host: int, flag: int) -> int:
    """aclrtHostGetDevicePointer: the device pointer of a registration, by the pointer host_register took."""
    p, f = check_ptr("pHost", p_host), check_int("flag", flag, 0, U32)
    acl_require(p != 0, "pHost is NULL")
    acl_require(f == 0, f"flag={f}: reserved, must be 0")
    return runtime().pointers.device_pointer(p)


def _batch_call(fn: Callable[..., None]) -> Callable[..., tuple[int, int]]:
    """aclrtMemcpyBatch's shape: `(failIndex, ret)`, never raising; failIndex names the pair that failed, or is
    SIZE_MAX when none did (or the failure is no pair's: an argument, the arity)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> tuple[int, int]:
        try:
            fn(*args, **kwargs)
        except BatchError as exc:
            set_recent_error(f"memcpy_batch: {exc.message}", exc.code)
            return exc.index, exc.code
        except AclError as exc:
            set_recent_error(f"memcpy_batch: {exc.message}", exc.code)
            return SIZE_MAX, exc.code
        except TypeError as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
                log.exception("internal error in memcpy_batch")
                set_recent_error(f"memcpy_batch: internal error: {exc}", C.ACL_ERROR_RT_INTERNAL_ERROR)
                return SIZE_MAX, C.ACL_ERROR_RT_INTERNAL_ERROR
            set_recent_error(f"memcpy_batch: {exc}", C.ACL_ERROR_RT_PARAM_INVALID)  # the arguments did not fit
            return SIZE_MAX, C.ACL_ERROR_RT_PARAM_INVALID
        except Exception as exc:
            log.exception("internal error in memcpy_batch")
            set_recent_error(f"memcpy_batch: internal error: {exc!r}", C.ACL_ERROR_RT_INTERNAL_ERROR)
            return SIZE_MAX, C.ACL_ERROR_RT_INTERNAL_ERROR
        return SIZE_MAX, C.ACL_SUCCESS

    return call


@_batch_call
def memcpy_batch(dsts: list[int], dest_maxs: list[int], srcs: list[int], sizes: list[int], num_batches: int,
                 attrs: list[dict[str, Any]], attrs_indexes: list[int], num_attrs: int) -> None:
    """aclrtMemcpyBatch: `num_batches` copies between host and device memory, in one call; returns
    (failIndex, ret): the pair that failed, or SIZE_MAX (2**64-1) when none did (or the failure is no pair's).

    `attrs[k]` ({"dstLoc": {"id", "type"}, "srcLoc": {...}, "rsv": optional 16 zeros}) applies from
    `attrs_indexes[k]` up to the next index. A batch whose sizes are all 0 succeeds before any other check."""
    _memcpy_batch(dsts, dest_maxs, srcs, sizes, num_batches, attrs, attrs_indexes, num_attrs)


def _ints(name: str, value: object, count: int, pointer: bool = False) -> list[int] | None:
    items = read_list(name, value)
    if items is None:
        return None
    if len(items) < count:
        raise InvalidParamError(f"{name} holds {len(items)} entries, fewer than the {count} the call reads")
    return [check_ptr(f"{name}[{i}]", v) if pointer else check_int(f"{name}[{i}]", v) for i, v in
            enumerate(items[:count])]


def _attr(i: int, value: object) -> tuple[BatchAttr, bool]:
    where = f"attrs[{i}]"
    dst, src = field_of(value, "dstLoc", where), field_of(value, "srcLoc", where)
    rsv = value.get("rsv", None) if isinstance(value, dict) else None
    zero = rsv is None or (isinstance(rsv, (list, tuple, bytes)) and len(rsv) <= _RSV and not any(rsv))
    attr = BatchAttr(check_int(f"{where}.dstLoc.type", field_of(dst, "type", f"{where}.dstLoc"), 0, U32),
                     check_int(f"{where}.dstLoc.id", field_of(dst, "id", f"{where}.dstLoc"), 0, U32),
                     check_int(f"{where}.srcLoc.type", field_of(src, "type", f"{where}.srcLoc"), 0, U32),
                     check_int(f"{where}.srcLoc.id", field_of(src, "id", f"{where}.srcLoc"), 0, U32))
    return attr, zero


def _memcpy_batch(dsts: object, dest_maxs: object, srcs: object, sizes: object, num_batches: object,
                  attrs: object, attrs_indexes: object, num_attrs: object) -> None:
    count, nattrs = check_int("numBatches", num_batches), check_int("numAttrs", num_attrs)
    n = _ints("sizes", sizes, count)
    acl_require(n is not None, "sizes is NULL")
    assert n is not None
    acl_require(count != 0, "numBatches is 0")
    if not any(n):
        return
    d, dm, s = _ints("dsts", dsts, count, True), _ints("destMaxs", dest_maxs, count), _ints("srcs", srcs, count, True)
    a, idx = read_list("attrs", attrs), _ints("attrsIndexes", attrs_indexes, nattrs)
    for name, got in (("dsts", d), ("destMaxs", dm), ("srcs", s), ("attrs", a), ("attrsIndexes", idx)):
        acl_require(got is not None, f"{name} is NULL")
    assert d is not None and dm is not None and s is not None and a is not None and idx is not None
    if len(a) < nattrs:
        raise InvalidParamError(f"attrs holds {len(a)} entries, fewer than numAttrs {nattrs}")
    for i in range(count):
        acl_require(dm[i] >= n[i], f"sizes[{i}]={n[i]} exceeds destMaxs[{i}]={dm[i]}")
    parsed = [_attr(i, a[i]) for i in range(nattrs)]
    for i, (_, zero) in enumerate(parsed):
        acl_require(zero, f"attrs[{i}].rsv must be 0")
    runtime().pointers.memcpy_batch(d, s, n, [p for p, _ in parsed], idx)
