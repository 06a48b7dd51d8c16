"""``acl.rt`` device memory by pointer (aclrtMalloc), host memory, and copies and fills, now or on a stream."""

from __future__ import annotations

from .. import constants as C
from .._process import runtime
from ..runtime.blocks import MAX_MALLOC
from ..wire.props import acl_require, check_int, check_ptr
from ._args import I32
from ._call import acl_call

__all__ = [
    "free", "free_host", "malloc", "malloc_align32", "malloc_cached", "malloc_host", "memcpy", "memcpy_async",
    "memset", "memset_async",
]
_KINDS = range(C.ACL_MEMCPY_HOST_TO_HOST, C.ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE + 1)


def _malloc(size: object, policy: object) -> int:
    n, pol = check_int("size", size), check_int("policy", policy, *I32)
    acl_require(n != 0, "size is 0")
    acl_require(n <= MAX_MALLOC, f"size={n} overflows when rounded up to the page size")
    rt = runtime()
    return rt.blocks.malloc(n, pol, rt.devices.current())


@acl_call(0)
def malloc(size: int, policy: int) -> int:
    """aclrtMalloc: `size` bytes of the current device's memory (rounded up to its page size)."""
    return _malloc(size, policy)


@acl_call(0)
def malloc_align32(size: int, policy: int) -> int:
    """aclrtMallocAlign32: as `malloc` (every block is page-aligned, so 32-byte aligned too)."""
    return _malloc(size, policy)


@acl_call(0)
def malloc_cached(size: int, policy: int) -> int:
    """aclrtMallocCached: as `malloc` (host memory is cached memory)."""
    return _malloc(size, policy)


@acl_call()
def free(dev_ptr: int) -> None:
    """aclrtFree: a block of `malloc` (an IPC export of it is revoked; importers keep their memory)."""
    p = check_ptr("devPtr", dev_ptr)
    acl_require(p != 0, "devPtr is NULL")
    runtime().blocks.free(p)


@acl_call(0)
def malloc_host(size: int) -> int:
    """aclrtMallocHost: `size` bytes of page-locked host memory; size 0 is the acl layer's 100000 (§4a)."""
    n = check_int("size", size)
    acl_require(n != 0, "size is 0")
    return runtime().copies.malloc_host(n)


@acl_call()
def free_host(ptr: int) -> None:
    """aclrtFreeHost: memory of `malloc_host`; NULL is the acl layer's 100000 (§4a)."""
    p = check_ptr("ptr", ptr)
    acl_require(p != 0, "hostPtr is NULL")
    runtime().copies.free_host(p)


def _copy_args(dst: object, src: object, kind: object) -> tuple[int, int, int]:
    """The acl layer's checks of a copy (memory.cpp's aclrtMemcpy*Impl): dst, src, then the kind (0..5)."""
    d, s, k = check_ptr("dst", dst), check_ptr("src", src), check_int("kind", kind, *I32)
    acl_require(d != 0, "dst is NULL")
    acl_require(s != 0, "src is NULL")
    acl_require(k in _KINDS, f"kind={k} is not an aclrtMemcpyKind (0..{_KINDS[-1]})")
    return d, s, k


@acl_call()
def memcpy(dst: int, dest_max: int, src: int, count: int, kind: int) -> None:
    """aclrtMemcpy: a count of 0 succeeds before any other check, as the runtime's acl layer has it."""
    dmax, n = check_int("destMax", dest_max), check_int("count", count)
    if n == 0:
        check_ptr("dst", dst), check_ptr("src", src), check_int("kind", kind, *I32)
        return
    d, s, k = _copy_args(dst, src, kind)
    runtime().copies.memcpy(d, dmax, s, n, k)


@acl_call()
def memset(dev_ptr: int, max_count: int, value: int, count: int) -> None:
    """aclrtMemset: a count of 0 succeeds before any other check; a NULL devPtr is 100000 (§4a)."""
    p = check_ptr("devPtr", dev_ptr)
    mx, n = check_int("maxCount", max_count), check_int("count", count)
    v = check_int("value", value, *I32)
    if n == 0:
        return
    acl_require(p != 0, "devPtr is NULL")
    runtime().copies.memset(p, mx, v, n)


@acl_call()
def memcpy_async(dst: int, dest_max: int, src: int, count: int, kind: int, stream: int) -> None:
    """aclrtMemcpyAsync: queued on `stream` (0: the current context's default stream); done after
    synchronize_stream, which reports a failure while it ran."""
    dmax, n, st = check_int("destMax", dest_max), check_int("count", count), check_ptr("stream", stream)
    if n == 0:
        check_ptr("dst", dst), check_ptr("src", src), check_int("kind", kind, *I32)
        return
    d, s, k = _copy_args(dst, src, kind)
    runtime().copies.memcpy_async(d, dmax, s, n, k, st)


@acl_call()
def memset_async(dev_ptr: int, max_count: int, value: int, count: int, stream: int) -> None:
    """aclrtMemsetAsync: queued on `stream`, as `memcpy_async`."""
    p, mx = check_ptr("devPtr", dev_ptr), check_int("maxCount", max_count)
    v, n, st = check_int("value", value, *I32), check_int("count", count), check_ptr("stream", stream)
    if n == 0:
        return
    acl_require(p != 0, "devPtr is NULL")
    runtime().copies.memset_async(p, mx, v, n, st)

