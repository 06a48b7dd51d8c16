"""acl.init/finalize, recent error messages per thread, devices, streams, peers, memcpy/memset, acl.util."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import vmmshare.acl as acl_module
from conftest import (
    ACL_PARAM,
    BAD_DEVICE,
    BAD_HANDLE,
    BAD_MEMORY_TYPE,
    G2M,
    HOST,
    NO_CONTEXT,
    PARAM,
    READ,
    MiB,
    child_ok,
    clear_err,
    desc,
    expect_fail,
    ok,
    private_broker_env,
    prop,
    read,
    write,
)
from vmmshare._process import runtime
from vmmshare.constants import DDR_MEM_ATTRS, HUGE1G_ATTRS, PHYSICAL_MEM_ATTRS

ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_INVALID_FILE = 100003
ACL_ERROR_REPEAT_FINALIZE = 100037


def in_thread(fn, *args):
    """Run fn in a fresh thread (no current device, no recent error); return its result or re-raise its error."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]


# ---------------------------------------------------------------- init / finalize


@pytest.fixture
def fresh_init():
    """Leaves the runtime un-initialized afterwards, whatever the test did."""
    assert not runtime().initialized, "a previous test left acl initialized"
    yield acl_module
    if runtime().initialized:
        acl_module.finalize()


def test_init_twice_is_100002_and_finalize_twice_is_100037(fresh_init):
    acl = fresh_init
    assert acl.init() == 0
    expect_fail(ACL_ERROR_REPEAT_INITIALIZE, acl.init)
    assert acl.finalize() == 0
    expect_fail(ACL_ERROR_REPEAT_FINALIZE, acl.finalize)
    assert acl.init() == 0, "init works again after finalize"
    assert acl.finalize() == 0


def test_finalize_without_init_is_100037(fresh_init):
    expect_fail(ACL_ERROR_REPEAT_FINALIZE, fresh_init.finalize)


def test_init_with_a_missing_config_file_is_100003(fresh_init, tmp_path):
    missing = str(tmp_path / "nope.json")
    msg = expect_fail(ACL_ERROR_INVALID_FILE, fresh_init.init, missing)
    assert "nope.json" in msg
    assert not runtime().initialized
    assert fresh_init.init() == 0


def test_init_with_a_config_file(fresh_init, tmp_path):
    cfg = tmp_path / "acl.json"
    cfg.write_text('{"dump": {"dump_list": []}}')
    assert fresh_init.init(str(cfg)) == 0
    assert fresh_init.finalize() == 0
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert fresh_init.init(str(empty)) == 0


def test_init_with_a_broken_config_file_fails_and_stays_uninitialized(fresh_init, tmp_path):
    cfg = tmp_path / "bad.json"
    cfg.write_text("{not json")
    clear_err()
    ret = fresh_init.init(str(cfg))
    assert ret == 100003 and "bad.json" in fresh_init.get_recent_err_msg()  # ACL_ERROR_INVALID_FILE
    assert fresh_init.init() == 0


@pytest.mark.parametrize("bad", [5, 1.5, ["a.json"]], ids=repr)
def test_init_with_a_non_string_path_fails(fresh_init, bad):
    clear_err()
    assert fresh_init.init(bad) == 100003
    assert fresh_init.get_recent_err_msg()
    assert not runtime().initialized


def test_init_wrong_argument_count_is_107000(fresh_init):
    expect_fail(PARAM, fresh_init.init, None, None)
    expect_fail(PARAM, fresh_init.finalize, 1)



# ---------------------------------------------------------------- recent error message per thread


def test_recent_error_message_is_per_thread(acl):
    expect_fail(PARAM, acl.rt.reserve_mem_address, 123, 0, 0, 0)
    mine = acl.get_recent_err_msg()

    def other() -> tuple[str, str]:
        before = acl.get_recent_err_msg()
        expect_fail(BAD_DEVICE, acl.rt.set_device, 1 << 20)
        return before, acl.get_recent_err_msg()

    before, theirs = in_thread(other)
    assert before == "", "a new thread has seen no failure"
    assert theirs != mine and "set_device" in theirs
    assert acl.get_recent_err_msg() == mine, "another thread's failure must not replace this thread's message"


def test_recent_error_messages_stay_apart_under_concurrency(acl):
    n = 6
    barrier = threading.Barrier(n)
    out: dict[int, tuple[str, str]] = {}

    def worker(i: int) -> None:
        acl.rt.malloc_physical(G2M * i + 1, prop(), 0)  # each fails with its own size in the message
        barrier.wait()  # every thread has failed before any reads its message
        out[i] = (str(G2M * i + 1), acl.get_recent_err_msg())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == list(range(n))
    for want, msg in out.values():
        assert want in msg, (want, msg)



# ---------------------------------------------------------------- devices


def test_device_count_defaults_to_8_and_follows_the_env():
    child_ok(
        """
        assert acl.rt.get_device_count() == (8, 0)
        assert acl.rt.set_device(7) == 0
        assert acl.rt.set_device(8) == 107001
        """,
        {"VMMSHARE_DEVICES": ""},
    )
    child_ok(
        """
        assert acl.rt.get_device_count() == (3, 0)
        assert acl.rt.set_device(2) == 0
        for bad in (3, 8, -1):
            assert acl.rt.set_device(bad) == 107001, bad
            assert "VMMSHARE_DEVICES" in acl.get_recent_err_msg() or "3" in acl.get_recent_err_msg()
        P3 = P(3)
        assert acl.rt.malloc_physical(2 * M, P3, 0) == (0, 107001)
        """,
        {"VMMSHARE_DEVICES": "3"},
    )


@pytest.mark.parametrize("fn_name", ["set_device", "reset_device", "reset_device_force"])
@pytest.mark.parametrize("dev", [-1, 8, 1 << 20])
def test_bad_device_id_is_107001(acl, fn_name, dev):
    expect_fail(BAD_DEVICE, getattr(acl.rt, fn_name), dev)


@pytest.mark.parametrize("fn_name", ["set_device", "reset_device", "reset_device_force"])
@pytest.mark.parametrize("bad", ["0", 0.0, None, True, [0], {"id": 0}], ids=repr)
def test_device_id_of_wrong_type_is_107000(acl, fn_name, bad):
    expect_fail(PARAM, getattr(acl.rt, fn_name), bad)


def _no_device_calls(acl) -> list[tuple[str, int]]:
    return [
        ("create_stream", acl.rt.create_stream()[-1]),
        ("get_mem_info", acl.rt.get_mem_info(0)[-1]),
        ("device_enable_peer_access", acl.rt.device_enable_peer_access(1, 0)),
        ("mem_import_from_shareable_handle_v2", acl.rt.mem_import_from_shareable_handle_v2(0x1234, 1, 0)[-1]),
    ]


def test_calls_needing_a_device_are_107002_in_a_thread_without_one(acl):
    got = in_thread(lambda: [(n, r, acl.get_recent_err_msg()) for n, r in _no_device_calls(acl)])
    for name, ret, _ in got:
        assert ret == NO_CONTEXT, (name, ret)
    assert "set_device" in got[-1][2]


def test_set_device_is_per_thread(acl):
    """Device 0 is current here; a thread that sets device 1 sees 1, and this thread still sees 0."""
    assert acl.rt.device_enable_peer_access(0, 0) == PARAM  # peer == current device
    ok(acl.rt.device_enable_peer_access(1, 0))

    def other() -> tuple[int, int, int]:
        ok(acl.rt.set_device(1))
        try:
            return (acl.rt.device_enable_peer_access(1, 0), acl.rt.device_enable_peer_access(0, 0),
                    acl.rt.create_stream()[-1] == 0)
        finally:
            acl.rt.reset_device(1)

    same, other_dev, _ = in_thread(other)
    assert same == PARAM and other_dev == 0
    assert acl.rt.device_enable_peer_access(0, 0) == PARAM


def test_reset_device_leaves_the_thread_without_a_device(acl):
    def other() -> list[tuple[str, int]]:
        ok(acl.rt.set_device(2))
        ok(acl.rt.reset_device(2))
        return _no_device_calls(acl)

    for name, ret in in_thread(other):
        assert ret == NO_CONTEXT, name


def test_mem_info_is_per_current_device(tmp_path):
    child_ok(
        """
        import threading
        ok(acl.rt.set_device(0))
        h = ok(acl.rt.malloc_physical(4 * M, P(0), 0))
        assert acl.rt.get_mem_info(0) == (60 * M, 64 * M, 0)
        out = {}
        def t():
            ok(acl.rt.set_device(1)); out["info"] = acl.rt.get_mem_info(0)
        th = threading.Thread(target=t); th.start(); th.join()
        assert out["info"] == (64 * M, 64 * M, 0), out
        ok(acl.rt.free_physical(h))
        """,
        private_broker_env(tmp_path, VMMSHARE_DEVICE_MEMORY="64M"),
    )


@pytest.mark.parametrize("attr", [-1, 18, 1 << 31, 1 << 64, "0", None])
def test_get_mem_info_attr_out_of_range_is_107016(acl, attr):
    """An int outside aclrtMemAttr is the runtime's invalid memory type (107016); no int at all (or none that fits
    the C enum) is 107000."""
    code = BAD_MEMORY_TYPE if attr in (-1, 18) else PARAM
    expect_fail(code, acl.rt.get_mem_info, attr)


# ---------------------------------------------------------------- streams


def test_stream_lifecycle(vmm):
    acl = acl_module
    n0 = runtime().counts()["streams"]
    s = ok(acl.rt.create_stream())
    assert s != 0
    s2 = ok(acl.rt.create_stream())
    assert s2 not in (0, s)
    assert runtime().counts()["streams"] == n0 + 2
    ok(acl.rt.synchronize_stream(s))
    ok(acl.rt.destroy_stream(s))
    expect_fail(BAD_HANDLE, acl.rt.destroy_stream, s)  # a destroyed stream is an unknown handle (107017)
    expect_fail(BAD_HANDLE, acl.rt.synchronize_stream, s)
    ok(acl.rt.destroy_stream_force(s2))
    expect_fail(BAD_HANDLE, acl.rt.destroy_stream_force, s2)
    assert runtime().counts()["streams"] == n0


def test_default_stream(acl):
    """§4a: destroying the NULL stream is the acl layer's 100000 (stream.cpp's aclrtDestroyStream*Impl)."""
    ok(acl.rt.synchronize_stream(0))
    expect_fail(ACL_PARAM, acl.rt.destroy_stream, 0)
    expect_fail(ACL_PARAM, acl.rt.destroy_stream_force, 0)
    expect_fail(ACL_PARAM, acl.rt.destroy_stream, None)


@pytest.mark.parametrize("timeout", [0, -2, -(1 << 31)])
def test_synchronize_with_timeout_takes_minus_1_or_a_positive_timeout(acl, timeout):
    """§4a: api_error.cc refuses a timeout of 0 or below -1 (107000), for a stream and for the device."""
    s = ok(acl.rt.create_stream())
    assert "timeout" in expect_fail(PARAM, acl.rt.synchronize_stream_with_timeout, s, timeout)
    expect_fail(PARAM, acl.rt.synchronize_device_with_timeout, timeout)
    ok(acl.rt.synchronize_stream_with_timeout(s, -1))
    ok(acl.rt.synchronize_stream_with_timeout(s, 1))
    ok(acl.rt.destroy_stream(s))


@pytest.mark.parametrize("fn_name", ["destroy_stream", "destroy_stream_force", "synchronize_stream"])
@pytest.mark.parametrize("stream", [12345, 1 << 63, -1, 1 << 64, "s", 1.0, [1]], ids=repr)
def test_unknown_or_bad_stream_is_107000(acl, fn_name, stream):
    """Not a stream at all: 107000; a stream handle that is not (or no longer) live: 107017 (SPEC §4 General)."""
    code = BAD_HANDLE if stream in (12345, 1 << 63) else PARAM
    expect_fail(code, getattr(acl.rt, fn_name), stream)



# ---------------------------------------------------------------- peers


def test_device_can_access_peer(acl):
    n = ok(acl.rt.get_device_count())
    assert acl.rt.device_can_access_peer(0, 1) == (1, 0)
    assert acl.rt.device_can_access_peer(n - 1, 0) == (1, 0)
    assert acl.rt.device_can_access_peer(3, 3) == (0, 0)
    for d, p in ((0, n), (n, 0), (-1, 0), (0, 1 << 20)):
        expect_fail(BAD_DEVICE, acl.rt.device_can_access_peer, d, p)
    for d, p in (("0", 1), (0, None), (0.0, 1)):
        expect_fail(PARAM, acl.rt.device_can_access_peer, d, p)


def test_device_enable_peer_access(acl):
    n = ok(acl.rt.get_device_count())
    ok(acl.rt.device_enable_peer_access(1, 0))
    for flags in (1, -1, 1 << 64, "0", None):
        expect_fail(PARAM, acl.rt.device_enable_peer_access, 2, flags)
    for peer in (n, -1):
        expect_fail(BAD_DEVICE, acl.rt.device_enable_peer_access, peer, 0)
    expect_fail(PARAM, acl.rt.device_enable_peer_access, "1", 0)


# ---------------------------------------------------------------- memcpy / memset

H2H, H2D, D2H, D2D, DEFAULT = range(5)


@pytest.fixture
def places(vmm):
    """Memory of every kind, 4 KiB each, with a distinct fill: (ptr, is_device, keepalive)."""
    d1, _ = vmm.mapped()
    d2, _ = vmm.mapped(dev=1)
    hm, _ = vmm.mapped(loc_type=HOST)
    hb = vmm.host(4096)
    arr = np.zeros(4096, dtype=np.uint8)
    ba = bytearray(4096)
    out = {
        "device": (d1, True, None),
        "device1": (d2, True, None),
        "host-mapping": (hm, False, None),
        "malloc_host": (hb, False, None),
        "numpy": (arr.ctypes.data, False, arr),
        "bytearray": (ctypes.addressof((ctypes.c_char * 4096).from_buffer(ba)), False, ba),
    }
    for i, (ptr, _, _) in enumerate(out.values()):
        ctypes.memset(ptr, 0x10 + i, 4096)
    return out


PLACES = ["device", "device1", "host-mapping", "malloc_host", "numpy", "bytearray"]


def _kind_ok(kind: int, dst_dev: bool, src_dev: bool) -> bool:
    return kind == DEFAULT or {H2H: (False, False), H2D: (True, False), D2H: (False, True),
                               D2D: (True, True)}[kind] == (dst_dev, src_dev)


@pytest.mark.parametrize("kind", range(5))
@pytest.mark.parametrize(("dst", "src"), [(d, s) for d in PLACES for s in PLACES if d != s])
def test_memcpy_kinds(acl, places, dst, src, kind):
    dptr, ddev, _ = places[dst]
    sptr, sdev, _ = places[src]
    before = read(dptr, 4096)
    payload = bytes(range(256)) * 4
    write(sptr + 1024, payload[:1024])
    src_bytes = read(sptr, 4096)
    if _kind_ok(kind, ddev, sdev):
        ok(acl.rt.memcpy(dptr + 16, 4080, sptr, 4000, kind))
        assert read(dptr, 4096) == before[:16] + src_bytes[:4000] + before[4016:]
    else:
        msg = expect_fail(PARAM, acl.rt.memcpy, dptr, 4096, sptr, 4096, kind)
        assert "kind" in msg
        assert read(dptr, 4096) == before


@pytest.mark.parametrize("kind", [6, -1, 100])
def test_memcpy_unknown_kind_is_100000(acl, places, kind):
    """§4a: a kind outside aclrtMemcpyKind is the acl layer's refusal (memory.cpp's MemcpyKindTranslate)."""
    d, s = places["device"][0], places["numpy"][0]
    assert "kind" in expect_fail(ACL_PARAM, acl.rt.memcpy, d, 16, s, 16, kind)
    expect_fail(ACL_PARAM, acl.rt.memcpy_async, d, 16, s, 16, kind, 0)
    expect_fail(PARAM, acl.rt.memcpy, d, 16, s, 16, 1 << 40)  # not a C int at all: pyACL's conversion


def test_memcpy_kind_5_host_to_buf_to_device_is_accepted(acl, places):
    """§4a: ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE (5) copies host memory to device memory."""
    d, s = places["device"][0], places["numpy"][0]
    write(s, b"through a buffer")
    ok(acl.rt.memcpy(d, 16, s, 16, 5))
    assert read(d, 16) == b"through a buffer"
    assert "kind" in expect_fail(PARAM, acl.rt.memcpy, s, 16, d, 16, 5)  # the wrong way round: below


def test_memcpy_count_over_dest_max_is_107000(acl, places):
    d, s = places["device"][0], places["malloc_host"][0]
    before = read(d, 64)
    expect_fail(PARAM, acl.rt.memcpy, d, 16, s, 17, DEFAULT)
    assert read(d, 64) == before


def test_memcpy_bad_pointers_are_107000_never_a_crash(vmm, places):
    d = places["device"][0]
    reserved = vmm.reserve()
    released = vmm.reserve()
    vmm.release(released)
    for bad in (8, reserved, released, reserved + 4096, 0xFFFF_FFFF_F000, (1 << 64) - 4096):
        expect_fail(PARAM, vmm.rt.memcpy, d, 64, bad, 64, DEFAULT)
        expect_fail(PARAM, vmm.rt.memcpy, bad, 64, d, 64, DEFAULT)
    for null in (0, None):  # NULL: the acl layer's (§4a)
        expect_fail(ACL_PARAM, vmm.rt.memcpy, d, 64, null, 64, DEFAULT)
        expect_fail(ACL_PARAM, vmm.rt.memcpy, null, 64, d, 64, DEFAULT)
    lone = vmm.reserve(2 * G2M)
    vmm.map(lone, G2M, vmm.alloc())
    expect_fail(PARAM, vmm.rt.memcpy, lone + G2M - 32, 64, places["numpy"][0], 64, DEFAULT)  # into the unmapped half
    hb = places["malloc_host"][0]
    expect_fail(PARAM, vmm.rt.memcpy, hb + 4064, 64, d, 64, DEFAULT)  # runs past the malloc_host block


def test_memcpy_and_memset_with_a_zero_count_succeed_before_any_other_check(acl, places):
    """§4a: count 0 returns 0 first in the synchronous calls too (NULL pointers, a bad kind, count > max)."""
    d = places["device"][0]
    ok(acl.rt.memcpy(0, 0, d, 0, DEFAULT))
    ok(acl.rt.memcpy(d, 0, 0, 0, DEFAULT))
    ok(acl.rt.memcpy(d, 0, d, 0, 99))
    ok(acl.rt.memset(0, 0, 0, 0))
    ok(acl.rt.memcpy_async(0, 0, 0, 0, 99, 0))
    ok(acl.rt.memset_async(0, 0, 0, 0, 0))
    expect_fail(ACL_PARAM, acl.rt.memset, 0, 16, 0, 16)
    expect_fail(ACL_PARAM, acl.rt.memset_async, None, 16, 0, 16, 0)
    expect_fail(PARAM, acl.rt.memcpy, d, 0, d, 0, "kind")  # pyACL's conversion comes before the call


def test_memcpy_zero_count_with_valid_pointers_is_ok(acl, places):
    d, s = places["device"][0], places["numpy"][0]
    before = read(d, 16)
    ok(acl.rt.memcpy(d, 0, s, 0, DEFAULT))
    assert read(d, 16) == before


def test_memcpy_respects_access(vmm):
    p, _ = vmm.mapped()
    hb = vmm.host(4096)
    ok(vmm.rt.mem_set_access(p, G2M, [desc(0)]))
    expect_fail(PARAM, vmm.rt.memcpy, hb, 4096, p, 4096, D2H)
    expect_fail(PARAM, vmm.rt.memset, p, 16, 0, 16)
    ok(vmm.rt.mem_set_access(p, G2M, [desc(READ)]))
    ok(vmm.rt.memcpy(hb, 4096, p, 4096, D2H))


def test_memcpy_within_one_device_mapping_overlapping(acl, places):
    d = places["device"][0]
    write(d, bytes(range(64)))
    ok(acl.rt.memcpy(d + 8, 64, d, 32, D2D))
    assert read(d, 40) == bytes(range(8)) + bytes(range(32))


@pytest.mark.parametrize("where", PLACES)
def test_memset_everywhere(acl, places, where):
    p = places[where][0]
    ok(acl.rt.memset(p + 100, 4000, 0xA5, 1000))
    got = read(p, 4096)
    fill = got[0:1]
    assert got == fill * 100 + b"\xa5" * 1000 + fill * 2996


def test_memset_checks(vmm, places):
    d = places["device"][0]
    before = read(d, 64)
    expect_fail(PARAM, vmm.rt.memset, d, 16, 0, 17)
    lone = vmm.reserve(2 * G2M)
    vmm.map(lone, G2M, vmm.alloc())
    expect_fail(PARAM, vmm.rt.memset, lone + G2M - 8, 16, 0, 16)  # into the unmapped half (rule 7)
    r = vmm.reserve()
    for bad in (r, 4096):
        expect_fail(PARAM, vmm.rt.memset, bad, 16, 0, 16)
    for null in (0, None):
        expect_fail(ACL_PARAM, vmm.rt.memset, null, 16, 0, 16)
    for value in ("1", 1.5, None, 1 << 40):
        expect_fail(PARAM, vmm.rt.memset, d, 16, value, 16)
    assert read(d, 64) == before


def test_malloc_host_and_free_host(vmm):
    p = ok(vmm.rt.malloc_host(10000))
    assert p % 4096 == 0
    write(p + 9990, b"0123456789")
    assert read(p + 9990, 10) == b"0123456789"
    ok(vmm.rt.free_host(p))
    expect_fail(PARAM, vmm.rt.free_host, p)
    for size in (-1, 1 << 64, "1", None):
        expect_fail(PARAM, vmm.rt.malloc_host, size)
    expect_fail(ACL_PARAM, vmm.rt.malloc_host, 0)  # §4a: the acl layer's
    expect_fail(ACL_PARAM, vmm.rt.free_host, 0)
    expect_fail(ACL_PARAM, vmm.rt.free_host, None)


# ---------------------------------------------------------------- granularity


def test_granularity_all_attrs_and_options(acl):
    """Every attribute the acl layer takes, on every location that takes it (1 GiB pages: devices only)."""
    for attr in sorted(PHYSICAL_MEM_ATTRS):
        for option in (0, 1):
            for loc_type in (0, 1, 4):
                if (loc_type == 1 and attr in DDR_MEM_ATTRS) or (loc_type != 1 and attr in HUGE1G_ATTRS):
                    continue  # refused: tests/test_acl_layer.py pins those
                g = ok(acl.rt.mem_get_allocation_granularity(prop(attr, loc_type=loc_type), option))
                assert g == (1 << 30 if attr in HUGE1G_ATTRS else G2M)


def test_granularity_rejects_what_malloc_rejects(acl):
    expect_fail(BAD_DEVICE, acl.rt.mem_get_allocation_granularity, prop(dev=1 << 20), 0)
    expect_fail(207000, acl.rt.mem_get_allocation_granularity, prop(loc_type=3), 0)
    expect_fail(ACL_PARAM, acl.rt.mem_get_allocation_granularity, prop(attr=18), 0)  # the acl layer's checks
    expect_fail(ACL_PARAM, acl.rt.mem_get_allocation_granularity, None, 0)


# ---------------------------------------------------------------- acl.util


def test_ptr_to_numpy_is_a_zero_copy_view(vmm):
    p, _ = vmm.mapped()
    view = acl_module.util.ptr_to_numpy(p, (4, 256), "uint8")
    assert view is not None and view.shape == (4, 256) and view.dtype == np.uint8
    view[1, :] = 7
    assert read(p + 256, 256) == b"\x07" * 256
    write(p, b"\x09" * 4)
    assert list(view[0, :4]) == [9, 9, 9, 9]
    f = acl_module.util.ptr_to_numpy(p + 4096, [16], np.float32)
    f[:] = np.arange(16, dtype=np.float32)
    assert read(p + 4096, 64) == np.arange(16, dtype=np.float32).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.float16])
def test_ptr_to_numpy_takes_a_numpy_type_number(vmm, dtype):
    """pyACL passes NPY_* type numbers (e.g. 11 for NPY_FLOAT32)."""
    p, _ = vmm.mapped()
    num = np.dtype(dtype).num
    clear_err()
    view = acl_module.util.ptr_to_numpy(p, (8,), num)
    assert view is not None, f"type number {num} refused: {acl_module.get_recent_err_msg()}"
    assert view.dtype == np.dtype(dtype) and view.shape == (8,)
    view[:] = 3
    assert read(p, view.nbytes) == np.full(8, 3, dtype=dtype).tobytes()


def test_ptr_to_numpy_bad_pointers_give_none_and_a_message(vmm):
    r = vmm.reserve()
    p, _ = vmm.mapped()
    h = vmm.alloc()
    hidden = vmm.map(vmm.reserve(), G2M, h, no_access=True)
    for ptr, shape, dtype in (
        (hidden, (4,), "uint8"),  # mapped but inaccessible: reading it would crash the process
        (0, (4,), "uint8"),
        (r, (4,), "uint8"),
        (8, (4,), "uint8"),
        (p + G2M - 2, (4,), "uint8"),  # runs past the mapping
        (p, (4,), "no-such-type"),
        (p, 5, "uint8"),
        (p, (-1,), "uint8"),
        ("p", (4,), "uint8"),
        (-1, (4,), "uint8"),
    ):
        clear_err()
        assert acl_module.util.ptr_to_numpy(ptr, shape, dtype) is None, (ptr, shape, dtype)
        assert "ptr_to_numpy" in acl_module.get_recent_err_msg()


def test_numpy_to_ptr_and_ptr_to_bytes(acl):
    arr = np.arange(100, dtype=np.int32)
    ptr = acl.util.numpy_to_ptr(arr)
    assert ptr == arr.ctypes.data
    assert acl.util.ptr_to_bytes(ptr, arr.nbytes) == arr.tobytes()
    assert acl.util.ptr_to_bytes(ptr, 0) == b""


def test_bytes_to_ptr(acl):
    data = b"hello vmmshare"
    ptr = acl.util.bytes_to_ptr(data)
    assert acl.util.ptr_to_bytes(ptr, len(data)) == data
    ba = bytearray(b"mutable")
    bptr = acl.util.bytes_to_ptr(ba)
    ctypes.memmove(bptr, b"M", 1)
    assert ba == bytearray(b"Mutable"), "bytes_to_ptr of a bytearray is zero-copy"


def test_util_round_trip_through_device_memory(vmm):
    p, _ = vmm.mapped()
    arr = np.arange(1024, dtype=np.float64)
    ok(vmm.rt.memcpy(p, G2M, acl_module.util.numpy_to_ptr(arr), arr.nbytes, H2D))
    assert acl_module.util.ptr_to_bytes(p, arr.nbytes) == arr.tobytes()
    back = np.empty_like(arr)
    ok(vmm.rt.memcpy(acl_module.util.numpy_to_ptr(back), back.nbytes, p, arr.nbytes, D2H))
    assert np.array_equal(back, arr)


def test_ptr_to_bytes_bad_input_gives_none_and_a_message(vmm):
    r = vmm.reserve()
    p, _ = vmm.mapped()
    h = vmm.alloc()
    hidden = vmm.map(vmm.reserve(), G2M, h, no_access=True)
    for ptr, size in ((0, 4), (r, 4), (8, 4), (p + G2M - 2, 4), (p, -1), ("p", 4), (p, "4"), (None, 4), (p, 1 << 64),
                      (hidden, 1)):
        clear_err()
        assert acl_module.util.ptr_to_bytes(ptr, size) is None, (ptr, size)
        assert "ptr_to_bytes" in acl_module.get_recent_err_msg()


@pytest.mark.parametrize("bad", [5, "text", None, 1.5, [1, 2]], ids=repr)
def test_util_converters_do_not_raise_on_bad_input(acl, bad):
    """numpy_to_ptr / bytes_to_ptr of something that is not an array / bytes: None and a message, no exception."""
    for fn in (acl.util.numpy_to_ptr, acl.util.bytes_to_ptr):
        clear_err()
        assert fn(bad) is None, f"{fn.__name__}({bad!r}) must not return a pointer"
        assert fn.__name__ in acl.get_recent_err_msg()


@pytest.mark.parametrize("dtype", [object, "O", [("a", "O")]], ids=repr)
def test_ptr_to_numpy_object_dtype_gives_none_and_a_message(vmm, dtype):
    """Raw memory cannot hold Python objects: refuse, do not raise."""
    p, _ = vmm.mapped()
    clear_err()
    assert acl_module.util.ptr_to_numpy(p, (4,), dtype) is None
    assert "ptr_to_numpy" in acl_module.get_recent_err_msg()


@pytest.mark.parametrize(
    ("fn_name", "args"),
    [("ptr_to_numpy", ()), ("ptr_to_numpy", (1,)), ("ptr_to_numpy", (1, (1,), "u1", 0)),
     ("ptr_to_bytes", ()), ("ptr_to_bytes", (1,)), ("ptr_to_bytes", (1, 1, 1)),
     ("numpy_to_ptr", ()), ("bytes_to_ptr", (b"x", b"y"))],
    ids=repr,
)
def test_util_wrong_argument_count_gives_none_and_a_message(acl, fn_name, args):
    clear_err()
    assert getattr(acl.util, fn_name)(*args) is None
    assert fn_name in acl.get_recent_err_msg()


def test_constants_are_module_attributes(acl):
    assert acl.ACL_SUCCESS == 0 and acl.ACL_RT_SUCCESS == 0
    assert acl.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC == 2 and acl.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT == 1
    assert acl.ACL_RT_MEM_ACCESS_FLAGS_READWRITE == 3 and acl.ACL_MEM_LOCATION_TYPE_DEVICE == 1
    assert acl.ACL_ERROR_RT_PARAM_INVALID == PARAM and acl.ACL_ERROR_RT_INVALID_HANDLE == 107017
    assert acl.ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED == 1 and acl.ACL_MEMCPY_DEFAULT == 4
    assert acl.ACL_HBM_MEM_HUGE1G == 10 and acl.ACL_MEM_P2P_HUGE1G == 17
    assert MiB == 1 << 20
