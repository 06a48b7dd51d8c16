"""Contexts, asynchronous streams, and the small pyACL calls programs use: get_device, get_run_mode, get_version,
get_soc_name, the last error, float16 conversions, acl.util threads.

Streams are held at a known point with a gate task (the runtime's own `Stream.submit`), so every assertion about
what has or has not run yet is exact, never a matter of timing.
"""

from __future__ import annotations

import ctypes
import errno
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import (
    ACL_PARAM,
    BAD_DEVICE,
    BAD_HANDLE,
    G2M,
    NO_CONTEXT,
    PARAM,
    expect_fail,
    ok,
    read,
)
from vmmshare._process import runtime

SYNC_TIMEOUT = 507046  # ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
STREAM_CONTEXT = 107003  # ACL_ERROR_RT_STREAM_CONTEXT


def in_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


class Gate:
    """A task that holds a stream until `open()`: everything queued behind it waits."""

    def __init__(self, stream: int) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.stream = runtime().devices.stream(stream)

        def hold() -> None:
            self.started.set()
            self.release.wait()

        self.stream.submit("gate", hold)

    def open(self) -> None:
        self.release.set()


@pytest.fixture
def host_buffers(vmm) -> Iterator[tuple[int, int]]:
    yield vmm.host(G2M), vmm.host(G2M)


# ---------------------------------------------------------------- asynchronous copies


def test_work_on_a_stream_runs_in_order_and_is_done_after_synchronize(vmm, host_buffers):
    s = vmm.stream()
    dev, _ = vmm.mapped()
    a, b = host_buffers
    gate = Gate(s)
    ok(vmm.rt.memset_async(dev, G2M, 1, 4096, s))
    ok(vmm.rt.memcpy_async(a, G2M, dev, 4096, 2, s))  # sees the 1s
    ok(vmm.rt.memset_async(dev, G2M, 2, 4096, s))
    ok(vmm.rt.memcpy_async(b, G2M, dev, 4096, 2, s))  # sees the 2s
    assert read(a, 4096) == bytes(4096), "queued, not done: the gate holds the stream"
    assert ok(vmm.rt.stream_query(s)) == 1  # ACL_STREAM_STATUS_NOT_READY
    gate.open()
    ok(vmm.rt.synchronize_stream(s))
    assert read(a, 4096) == b"\x01" * 4096 and read(b, 4096) == b"\x02" * 4096
    assert ok(vmm.rt.stream_query(s)) == 0  # ACL_STREAM_STATUS_COMPLETE


def test_the_default_stream_is_the_current_contexts(vmm, host_buffers):
    a, b = host_buffers
    ctypes.memset(a, 7, 64)
    ok(vmm.rt.memcpy_async(b, G2M, a, 64, 0, 0))
    ok(vmm.rt.memset_async(a, G2M, 9, 64, None))
    ok(vmm.rt.synchronize_stream(0))
    assert read(b, 64) == b"\x07" * 64 and read(a, 64) == b"\x09" * 64
    assert in_thread(lambda: vmm.rt.memset_async(a, G2M, 1, 1, 0)) == NO_CONTEXT


def test_arguments_are_checked_when_queued(vmm, host_buffers):
    rt = vmm.rt
    s = vmm.stream()
    a, _ = host_buffers
    reserved = vmm.reserve()
    assert rt.memcpy_async(0, 0, 0, 0, 99, s) == 0, "count 0 returns before any check, as the runtime does"
    assert rt.memset_async(0, 0, 0, 0, s) == 0
    expect_fail(ACL_PARAM, rt.memcpy_async, 0, G2M, a, 8, 0, s)
    expect_fail(ACL_PARAM, rt.memcpy_async, a, G2M, None, 8, 0, s)
    expect_fail(ACL_PARAM, rt.memcpy_async, a, G2M, a + 64, 8, 6, s)  # 0..5 are aclrtMemcpyKind
    expect_fail(ACL_PARAM, rt.memset_async, None, G2M, 0, 8, s)
    expect_fail(PARAM, rt.memcpy_async, a, 4, a + 64, 8, 0, s)  # count > destMax: the runtime's
    expect_fail(PARAM, rt.memcpy_async, reserved, G2M, a, 8, 4, s)  # reserved, not mapped
    expect_fail(PARAM, rt.memset_async, 0x10, 8, 0, 8, s)
    expect_fail(PARAM, rt.memcpy_async, a, G2M, a + 64, 8, "0", s)
    expect_fail(BAD_HANDLE, rt.memcpy_async, a, G2M, a + 64, 8, 0, 0x5700_0BAD)
    expect_fail(PARAM, rt.memcpy_async, a, G2M, a + 64, 8, 5, s)  # 5 copies host -> device: a is host memory
    dev, _ = vmm.mapped()
    ok(rt.memcpy_async(dev, G2M, a + 64, 8, 5, s))  # ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE
    ok(rt.synchronize_stream(s))


def test_a_failure_while_running_is_reported_by_synchronize(vmm, host_buffers):
    """The source is unmapped after the copy was queued: the copy fails when its turn comes, synchronize reports it
    (107000, naming the task), the task queued behind it does not run, and the stream works again afterwards."""
    s = vmm.stream()
    a, b = host_buffers
    dev, _ = vmm.mapped()
    gate = Gate(s)
    ok(vmm.rt.memcpy_async(a, G2M, dev, 4096, 2, s))
    ok(vmm.rt.memset_async(b, G2M, 5, 4096, s))
    vmm.unmap(dev)
    gate.open()
    msg = expect_fail(PARAM, vmm.rt.synchronize_stream, s)
    assert "memcpy_async on stream" in msg and "did not run" in msg, msg
    assert read(b, 4096) == bytes(4096), "the task behind the failed one did not run"
    ok(vmm.rt.synchronize_stream(s))  # reported once
    ok(vmm.rt.memset_async(b, G2M, 6, 16, s))
    ok(vmm.rt.synchronize_stream(s))
    assert read(b, 16) == b"\x06" * 16


def test_synchronize_with_a_timeout(vmm):
    s = vmm.stream()
    gate = Gate(s)
    gate.started.wait()
    msg = expect_fail(SYNC_TIMEOUT, vmm.rt.synchronize_stream_with_timeout, s, 10)
    assert "still has 1 task" in msg
    expect_fail(PARAM, vmm.rt.synchronize_stream_with_timeout, s, -2)
    gate.open()
    ok(vmm.rt.synchronize_stream_with_timeout(s, -1))


def _close_while_held(vmm, force: bool) -> tuple[bytes, int]:
    """Queue a fill behind a gate, destroy the stream from another thread, open the gate once the stream is
    closed: (what the fill's target held when destroy returned, destroy's ret)."""
    s = ok(vmm.rt.create_stream())
    target = vmm.host(4096)
    gate = Gate(s)
    ok(vmm.rt.memset_async(target, 4096, 5, 4096, s))
    seen: list[Any] = []
    name = "destroy_stream_force" if force else "destroy_stream"
    t = threading.Thread(target=lambda: seen.append((getattr(vmm.rt, name)(s), read(target, 4096))))
    t.start()
    with gate.stream._cv:  # the stream is closed (and, with force, its queue dropped) before the gate opens
        gate.stream._cv.wait_for(lambda: gate.stream._closed)
    gate.open()
    t.join()
    ret, data = seen[0]
    expect_fail(BAD_HANDLE, vmm.rt.synchronize_stream, s)
    return data, ret


def test_destroy_stream_waits_for_its_work(vmm):
    data, ret = _close_while_held(vmm, force=False)
    assert ret == 0 and data == b"\x05" * 4096


def test_destroy_stream_force_drops_work_not_started(vmm):
    data, ret = _close_while_held(vmm, force=True)
    assert ret == 0 and data == bytes(4096)


def test_synchronize_device_waits_for_every_stream_of_the_device(vmm, host_buffers):
    a, b = host_buffers
    s1, s2 = vmm.stream(), vmm.stream()
    gates = [Gate(s1), Gate(s2), Gate(0)]
    ok(vmm.rt.memset_async(a, G2M, 1, 8, s1))
    ok(vmm.rt.memset_async(a + 8, G2M, 2, 8, s2))
    ok(vmm.rt.memset_async(b, G2M, 3, 8, 0))
    for g in gates:
        g.open()
    ok(vmm.rt.synchronize_device())
    assert read(a, 16) == b"\x01" * 8 + b"\x02" * 8 and read(b, 8) == b"\x03" * 8
    ok(vmm.rt.synchronize_device_with_timeout(1000))


def test_reset_device_waits_for_and_drops_its_streams(acl):
    def other() -> tuple[int, bytes, int]:
        ok(acl.rt.set_device(3))
        s = ok(acl.rt.create_stream())
        buf = (ctypes.c_char * 64)()
        ok(acl.rt.memset_async(ctypes.addressof(buf), 64, 4, 64, s))
        ok(acl.rt.reset_device(3))
        return acl.rt.synchronize_stream(s), bytes(buf), acl.rt.get_device()[-1]

    ret, data, device_ret = in_thread(other)
    assert ret == BAD_HANDLE and data == b"\x04" * 64 and device_ret == NO_CONTEXT


# ---------------------------------------------------------------- contexts and devices


def test_get_device_and_run_mode(acl):
    assert acl.rt.get_device() == (0, 0)
    assert in_thread(acl.rt.get_device) == (0, NO_CONTEXT)
    assert in_thread(lambda: (acl.rt.set_device(5), acl.rt.get_device(), acl.rt.reset_device(5))) == (0, (5, 0), 0)
    assert acl.rt.get_run_mode() == (acl.ACL_HOST, 0) == (1, 0)


def test_a_stream_is_used_in_its_own_context(acl, host_buffers):
    """Async copies and destroy_stream on a stream of another context than the current one: 107003, as the
    runtime's stream/context check; synchronize_stream switches to the stream's context and works."""
    rt = acl.rt
    a, b = host_buffers
    default = ok(rt.get_context())
    s = ok(rt.create_stream())
    other = ok(rt.create_context(0))  # current now
    try:
        assert "set_current_context" in expect_fail(STREAM_CONTEXT, rt.memcpy_async, b, G2M, a, 64, 0, s)
        expect_fail(STREAM_CONTEXT, rt.memset_async, a, G2M, 1, 64, s)
        expect_fail(STREAM_CONTEXT, rt.destroy_stream, s)
        ok(rt.synchronize_stream(s))
        ok(rt.set_context(default))
        ok(rt.memset_async(a, G2M, 3, 64, s))
        ok(rt.synchronize_stream(s))
        assert read(a, 64) == b"\x03" * 64
        ok(rt.destroy_stream(s))
    finally:
        ok(rt.set_context(default))
        ok(rt.destroy_context(other))


def test_contexts(acl):
    rt = acl.rt
    default, ret = rt.get_context()
    assert ret == 0 and default != 0
    assert rt.get_current_context() == (default, 0)  # the C name, as well as pyACL's
    ctx = ok(rt.create_context(2))
    assert rt.get_context() == (ctx, 0) and rt.get_device() == (2, 0), "a new context is current"
    s = ok(rt.create_stream())
    ok(rt.set_context(default))
    assert rt.get_device() == (0, 0)
    assert in_thread(lambda: (rt.set_current_context(ctx), rt.get_device())) == (0, (2, 0)), "contexts are per process"
    msg = expect_fail(PARAM, rt.destroy_context, default)
    assert "reset_device" in msg
    ok(rt.destroy_context(ctx))
    expect_fail(BAD_HANDLE, rt.synchronize_stream, s)  # its streams went with it
    expect_fail(BAD_HANDLE, rt.destroy_context, ctx)
    expect_fail(BAD_HANDLE, rt.set_context, ctx)
    for null in (0, None):
        expect_fail(ACL_PARAM, rt.destroy_context, null)
        expect_fail(ACL_PARAM, rt.set_context, null)
        expect_fail(ACL_PARAM, rt.set_current_context, null)
    expect_fail(BAD_DEVICE, rt.create_context, 99)
    expect_fail(PARAM, rt.create_context, "0")
    assert in_thread(rt.get_context) == (0, NO_CONTEXT)


def test_destroying_the_current_context_leaves_the_thread_without_one(acl):
    def other() -> tuple[Any, ...]:
        ctx = ok(acl.rt.create_context(1))
        ok(acl.rt.destroy_context(ctx))
        return acl.rt.get_context(), acl.rt.create_stream()

    assert in_thread(other) == ((0, NO_CONTEXT), (0, NO_CONTEXT))


# ---------------------------------------------------------------- version, soc name, errors, conversions, threads


def test_version_and_soc_name(acl):
    assert acl.get_version() == (1, 17, 0, 0)
    assert acl.get_soc_name() == "vmmshare-host"


def test_the_last_error(acl):
    rt = acl.rt
    ok(rt.set_device(0))
    rt.get_last_error(0)  # whatever failed before in this thread, cleared
    assert rt.get_last_error(0) == 0
    rt.malloc_physical(0, None, 0)
    assert rt.peek_at_last_error(0) == ACL_PARAM and rt.peek_at_last_error(0) == ACL_PARAM
    assert rt.get_last_error(0) == ACL_PARAM and rt.get_last_error(0) == 0
    rt.free(0x1234)
    assert in_thread(lambda: rt.get_last_error(0)) == 0, "per thread"
    assert rt.get_last_error(0) == PARAM
    assert rt.get_last_error(1) == PARAM  # only the thread level is kept
    assert rt.get_last_error() == PARAM  # no level: pyACL would refuse the call


def test_float16_conversions(acl):
    assert acl.float16_to_float(0x3C00) == 1.0 and acl.float16_to_float(0xC000) == -2.0
    assert acl.float_to_float16(1.0) == 0x3C00 and acl.float_to_float16(-2.0) == 0xC000
    assert acl.float_to_float16(1e10) == 0x7C00  # beyond half precision: infinity
    assert acl.float16_to_float(1 << 16) == 0.0 and "value" in acl.get_recent_err_msg()
    assert acl.float_to_float16("1") == 0 and "float" in acl.get_recent_err_msg()


def test_util_threads(acl):
    got: list[Any] = []
    tid, ret = acl.util.start_thread(got.append, "payload")
    assert ret == 0 and tid != 0
    assert acl.util.stop_thread(tid) == 0 and got == ["payload"]
    assert acl.util.stop_thread(tid) == errno.ESRCH
    assert acl.util.start_thread(5, None) == (0, errno.EINVAL)
    assert acl.util.start_thread() == (0, errno.EINVAL)
    tid, ret = acl.util.start_thread(lambda: got.append("no args"))
    assert ret == 0 and acl.util.stop_thread(tid) == 0 and got[-1] == "no args"


def test_numpy_contiguous_to_ptr(acl):
    import numpy as np

    a = np.arange(8, dtype=np.uint8)
    assert acl.util.numpy_contiguous_to_ptr(a) == a.ctypes.data
    assert acl.util.numpy_contiguous_to_ptr(a[::2]) is None and "contiguous" in acl.get_recent_err_msg()
