"""The C library's CUDA backend (VMMSHARE_BACKEND=cuda from C): GPU memory made, shared, mapped and copied through
the CUDA driver the library loads at run time (dlopen of libcuda.so.1), with C processes on both sides and with a C
process on one side and a Python one on the other, through one broker.

On a machine with a usable NVIDIA GPU these run on it; elsewhere on `fakecuda/`, the CPU stand-in for libcuda (the
C library loads it as it would load the driver). The actors here run the C surface (VMMSHARE_ACTOR_SURFACE=c,
stress/cacl.py) unless a test names the Python one. The module skips where neither a GPU nor the stand-in can run
(and fails where VMMSHARE_REQUIRE_CUDA_TESTS=1, as in CI).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import CUDA_GATE, require
from procs import PROP, Actor, BrokerProc, MiB2, share_and_map
from test_c_library import cc
from test_cuda import (
    BINDINGS,
    D2H,
    DEFAULT,
    FABRIC,
    H2D,
    NO_BACKEND,
    alloc_map,
    backend_mode,  # noqa: F401  (fixtures shared with the Python surface's tests)
    broker_env,  # noqa: F401
    cuda_env,  # noqa: F401
    download,
    driver_allocations,
    drop,
    listing,
    mode,
    upload,
)
from vmmshare.sdk import LIBRARIES, ROOT

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")
NO_PERMISSION, REVOKED, PARAM, UNSUPPORTED = 207006, 107017, 107000, 207000

require(BINDINGS, NO_BACKEND, CUDA_GATE)  # the stand-in's check and the Python side need cuda-bindings
require(all((ROOT / "lib64" / name).exists() for name in LIBRARIES), "the C library is not built", CUDA_GATE)
pytestmark = [pytest.mark.gpu]


@pytest.fixture
def actor(broker: BrokerProc) -> Iterator[Callable[..., Actor]]:
    """`actor(surface="c", **env)`: an Actor with the CUDA backend on the C (or Python) surface."""
    made: list[Actor] = []

    def make(surface: str = "c", device: int | None = 0, **over: str) -> Actor:
        env = {**broker.env, "VMMSHARE_BACKEND": "cuda", "VMMSHARE_ACTOR_SURFACE": surface, **over}
        a = Actor(env, device=device)
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()


def system_driver(empty: Path) -> bool:
    """Whether libcuda.so.1 loads without the stand-in's folder on the library path (a driver is installed)."""
    code = "import ctypes; ctypes.CDLL('libcuda.so.1')"
    env = {**os.environ, "LD_LIBRARY_PATH": str(empty)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60).returncode == 0


def map_lines(pid: int) -> int:
    """The address-space ranges of `pid` (GPU reservations of the stand-in show as ranges of their own)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)


def gpu_prop(device: int = 0) -> dict[str, object]:
    return {**PROP, "location": {"id": device, "type": 1}}


# ---------------------------------------------------------------- memory in one C process


def test_c_gpu_memory_round_trip(actor: Callable[..., Actor]) -> None:
    """Allocate, reserve, map, copy in and out, fill, read the properties back, unmap, release, free: the driver's
    allocation is gone at the end."""
    a = actor()
    assert a.call("get_soc_name") == "vmmshare-cuda"
    count, ret = a.call("rt.get_device_count")
    assert ret == 0 and count >= 1
    h, ptr = alloc_map(a)
    if mode() == "fake":
        assert driver_allocations(a.pid) == 1
    upload(a, ptr, b"c-gpu" * 800)
    assert download(a, ptr, 4000) == b"c-gpu" * 800
    assert a.call("rt.memset", ptr, MiB2, 0x41, 16) == 0, a.last_err
    assert download(a, ptr, 16) == b"A" * 16
    prop, ret = a.call("rt.mem_get_allocation_properties_from_handle", h)
    assert ret == 0 and prop["location"] == {"id": 0, "type": 1}
    free, total = a.call("rt.get_mem_info", 0)[:2]
    assert 0 < free <= total
    drop(a, h, ptr)
    if mode() == "fake":
        assert driver_allocations(a.pid) == 0


def test_c_aclrt_malloc_is_gpu_memory_on_a_stream(actor: Callable[..., Actor]) -> None:
    """aclrtMalloc blocks are GPU memory: filled on a stream, copied asynchronously, freed with the driver's
    allocation."""
    a = actor()
    ptr, ret = a.call("rt.malloc", MiB2, 0)
    assert ret == 0, a.last_err
    if mode() == "fake":
        assert driver_allocations(a.pid) == 1
    s, ret = a.call("rt.create_stream")
    assert ret == 0, a.last_err
    assert a.call("rt.memset_async", ptr, MiB2, 0x3C, MiB2, s) == 0, a.last_err
    host, ret = a.call("rt.malloc_host", 64)
    assert ret == 0
    assert a.call("rt.memcpy_async", host, 64, ptr, 64, D2H, s) == 0, a.last_err
    assert a.call("rt.synchronize_stream", s) == 0, a.last_err
    assert a.call("!read", host, 64) == b"\x3c" * 64
    assert a.call("rt.free_host", host) == 0
    assert a.call("rt.free", ptr) == 0 and a.call("rt.destroy_stream", s) == 0
    if mode() == "fake":
        assert driver_allocations(a.pid) == 0


def test_c_host_location_memory_stays_host_memory(actor: Callable[..., Actor]) -> None:
    """Host-location memory is the host backend's memfd: it does not go into GPU address space (207000)."""
    a = actor()
    h, ret = a.call("rt.malloc_physical", MiB2, {**PROP, "location": {"id": 0, "type": 0}}, 0)
    assert ret == 0, a.last_err
    if mode() == "fake":
        assert driver_allocations(a.pid) == 0
    ptr, ret = a.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
    assert ret == 0
    assert a.call("rt.map_mem", ptr, MiB2, 0, h, 0) == UNSUPPORTED
    assert "reservation" in a.last_err
    assert a.call("rt.release_mem_address", ptr) == 0
    assert a.call("rt.free_physical", h) == 0


def test_c_gpu_access_flags_take_effect(actor: Callable[..., Actor]) -> None:
    """Rules 4 and 5 on GPU memory from C: no access until set; READ refuses writes; NONE refuses reads."""
    a = actor()
    h, _ = a.call("rt.malloc_physical", MiB2, gpu_prop(), 0)
    ptr, _ = a.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
    assert a.call("rt.mem_map_no_access", ptr, MiB2, 0, h, 0) == 0, a.last_err
    host, _ = a.call("rt.malloc_host", 16)
    assert a.call("rt.memcpy", host, 16, ptr, 16, D2H) == PARAM and "not readable" in a.last_err
    loc = {"type": 1, "id": 0}
    assert a.call("rt.mem_set_access", ptr, MiB2, [{"flags": 3, "location": loc}]) == 0, a.last_err
    upload(a, ptr, b"now mapped")
    assert a.call("rt.mem_set_access", ptr, MiB2, [{"flags": 1, "location": loc}]) == 0, a.last_err
    assert a.call("rt.mem_get_access", ptr, loc) == (1, 0)
    assert a.call("rt.memcpy", ptr, 16, host, 16, H2D) == PARAM
    assert download(a, ptr, 10) == b"now mapped"
    assert a.call("rt.mem_set_access", ptr, MiB2, [{"flags": 0, "location": loc}]) == 0
    assert a.call("rt.memcpy", host, 16, ptr, 16, D2H) == PARAM
    assert a.call("rt.free_host", host) == 0
    drop(a, h, ptr)


def test_c_gpu_reservation_at_a_taken_address_is_refused(actor: Callable[..., Actor]) -> None:
    a = actor()
    ptr, ret = a.call("rt.reserve_mem_address", 2 * MiB2, 0, 0, 0)
    assert ret == 0, a.last_err
    assert a.call("rt.reserve_mem_address", MiB2, 0, ptr, 0) == (0, PARAM)
    assert "not free" in a.last_err
    assert a.call("rt.release_mem_address", ptr) == 0


# ---------------------------------------------------------------- sharing: C and C, C and Python


@pytest.mark.parametrize("share_type", [DEFAULT, FABRIC], ids=["default", "fabric"])
@pytest.mark.parametrize("sides", [("c", "c"), ("c", "python"), ("python", "c")], ids=["c-c", "c-py", "py-c"])
def test_gpu_memory_shared_between_surfaces(actor: Callable[..., Actor], sides: tuple[str, str],
                                            share_type: int) -> None:
    """The exporter's bytes are the importer's and the other way round; a process off the trustlist is refused
    (207006); once the exporter frees, new imports are refused (107017) and the importer keeps its memory."""
    exporter, importer, stranger = actor(sides[0]), actor(sides[1]), actor(sides[1])
    size = 4 * MiB2
    h, ptr = alloc_map(exporter, size)
    pattern = bytes(range(256)) * 64
    upload(exporter, ptr, pattern)
    sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, share_type)
    assert ret == 0, exporter.last_err
    assert exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, share_type)[-1] == PARAM  # rule 9
    assert stranger.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)[-1] == NO_PERMISSION
    assert exporter.call("rt.mem_set_pid_to_shareable_handle_v2", sh, share_type, [importer.pid]) == 0
    ih, ret = importer.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)
    assert ret == 0, importer.last_err
    iptr, ret = importer.call("rt.reserve_mem_address", size, 0, 0, 0)
    assert ret == 0, importer.last_err
    assert importer.call("rt.map_mem", iptr, size, 0, ih, 0) == 0, importer.last_err
    assert download(importer, iptr, len(pattern)) == pattern
    upload(importer, iptr + MiB2, b"back from the importer")
    assert download(exporter, ptr + MiB2, 22) == b"back from the importer"
    assert importer.call("rt.mem_export_to_shareable_handle_v2", ih, 0, DEFAULT)[-1] == PARAM  # rule 10
    drop(exporter, h, ptr)
    assert stranger.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)[-1] == REVOKED
    assert download(importer, iptr + MiB2, 22) == b"back from the importer"
    drop(importer, ih, iptr)
    if mode() == "fake":
        assert driver_allocations(exporter.pid) == driver_allocations(importer.pid) == 0


def test_c_threads_importing_one_gpu_handle_share_one_import(actor: Callable[..., Actor]) -> None:
    """Rule 13 from C threads at once: a Python exporter's GPU handle, imported by six threads of a C process,
    is one import (one driver allocation) with six references."""
    exporter, importer = actor("python"), actor("c")
    h, ptr = alloc_map(exporter)
    upload(exporter, ptr, b"one import")
    sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, DEFAULT)
    assert ret == 0, exporter.last_err
    assert exporter.call("rt.mem_set_pid_to_shareable_handle_v2", sh, DEFAULT, [importer.pid]) == 0
    handles = importer.call("!threads_import", sh, DEFAULT, 6)
    assert len(set(handles)) == 1 and handles[0], handles
    if mode() == "fake":
        assert driver_allocations(importer.pid) == 1
    iptr, _ = importer.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
    assert importer.call("rt.map_mem", iptr, MiB2, 0, handles[0], 0) == 0, importer.last_err
    assert download(importer, iptr, 10) == b"one import"
    assert importer.call("rt.unmap_mem", iptr) == 0 and importer.call("rt.release_mem_address", iptr) == 0
    for _ in range(6):
        assert importer.call("rt.free_physical", handles[0]) == 0, importer.last_err
    assert importer.call("rt.free_physical", handles[0]) == 107017
    if mode() == "fake":
        assert driver_allocations(importer.pid) == 0
    drop(exporter, h, ptr)


def test_c_exporter_python_importer_by_ipc_key(actor: Callable[..., Actor]) -> None:
    """aclrtMalloc GPU memory of a C process shared by IPC key with a Python process, which reads and writes it."""
    a, b = actor("c"), actor("python")
    ptr, ret = a.call("rt.malloc", MiB2, 0)
    assert ret == 0, a.last_err
    assert a.call("rt.memset", ptr, MiB2, 0x5A, MiB2) == 0, a.last_err
    key, ret = a.call("rt.ipc_mem_get_export_key", ptr, MiB2, 65, 0)
    assert ret == 0, a.last_err
    assert a.call("rt.ipc_mem_set_import_pid", key, [b.pid]) == 0, a.last_err
    q, ret = b.call("rt.ipc_mem_import_by_key", key, 0)
    assert ret == 0, b.last_err
    assert download(b, q, 16) == b"\x5a" * 16
    upload(b, q + 16, b"from python")
    assert download(a, ptr + 16, 11) == b"from python"
    assert b.call("rt.ipc_mem_close", key) == 0 and a.call("rt.ipc_mem_close", key) == 0
    assert a.call("rt.free", ptr) == 0
    if mode() == "fake":
        assert driver_allocations(a.pid) == driver_allocations(b.pid) == 0


def test_the_broker_counts_c_gpu_memory_as_gpu_memory(actor: Callable[..., Actor], broker: BrokerProc) -> None:
    """A C allocation is charged as GPU memory (CHARGE_GPU) and its export is a GPU export (the broker's listing)."""
    a = actor()
    h, ptr = alloc_map(a, 2 * MiB2)
    assert listing(broker)["gpu_used"] == {"0": 2 * MiB2}
    sh, ret = a.call("rt.mem_export_to_shareable_handle_v2", h, 1, DEFAULT)
    assert ret == 0, a.last_err
    host_only = actor("c", VMMSHARE_BACKEND="host")
    assert host_only.call("rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0)[-1] == UNSUPPORTED
    assert "VMMSHARE_BACKEND=cuda" in host_only.last_err
    drop(a, h, ptr)
    assert listing(broker)["gpu_used"] == {}


def test_c_peer_access_is_the_gpus_topology(actor: Callable[..., Actor]) -> None:
    """cuDeviceCanAccessPeer answers (the stand-in's two GPUs can, unless FAKECUDA_NO_PEER); host registration is
    refused under the CUDA backend, as from Python."""
    peers, lonely = actor(), actor(FAKECUDA_NO_PEER="1")
    count, ret = peers.call("rt.get_device_count")
    assert ret == 0
    if count < 2:
        assert mode() == "gpu", "the CPU stand-in has two devices"
        pytest.skip("one GPU only")
    assert peers.call("rt.device_can_access_peer", 0, 0) == (0, 0)
    can, ret = peers.call("rt.device_can_access_peer", 0, 1)
    assert ret == 0 and can in (0, 1)
    assert peers.call("rt.device_enable_peer_access", 1, 0) == (0 if can else UNSUPPORTED)
    if mode() == "fake":
        assert can == 1
        assert lonely.call("rt.device_can_access_peer", 0, 1) == (0, 0)
        assert lonely.call("rt.device_enable_peer_access", 1, 0) == UNSUPPORTED
        assert "cuDeviceCanAccessPeer" in lonely.last_err
    host, _ = peers.call("rt.malloc_host", 4096)
    assert peers.call("rt.host_register", host, 4096, 0)[-1] == UNSUPPORTED
    assert peers.call("rt.free_host", host) == 0


# ---------------------------------------------------------------- lifetimes, bad input and leaks


def test_c_share_cycles_leak_no_fd_and_no_allocation(actor: Callable[..., Actor]) -> None:
    exporter, importer = actor(), actor()
    h, ptr = alloc_map(exporter)
    _, ih, iptr = share_and_map(exporter, importer, h, MiB2)  # warm both sides (contexts, broker connection)
    drop(importer, ih, iptr)
    drop(exporter, h, ptr)
    fds = exporter.call("!fd_count"), importer.call("!fd_count")
    maps = map_lines(exporter.pid), map_lines(importer.pid)
    for _ in range(10):
        h, ptr = alloc_map(exporter)
        _, ih, iptr = share_and_map(exporter, importer, h, MiB2)
        drop(exporter, h, ptr)  # the exporter goes first: the importer's memory outlives it
        upload(importer, iptr, b"still here")
        assert download(importer, iptr, 10) == b"still here"
        drop(importer, ih, iptr)
    assert (exporter.call("!fd_count"), importer.call("!fd_count")) == fds
    assert (map_lines(exporter.pid), map_lines(importer.pid)) == maps  # no reservation or mapping left
    if mode() == "fake":
        assert driver_allocations(exporter.pid) == driver_allocations(importer.pid) == 0


def test_c_bad_gpu_input_gets_its_code_and_leaks_nothing(actor: Callable[..., Actor]) -> None:
    a = actor()
    drop(a, *alloc_map(a))  # connected, the context made
    fds = a.call("!fd_count")
    g, ret = a.call("rt.mem_get_allocation_granularity", gpu_prop(), 0)
    assert ret == 0 and g >= MiB2
    assert a.call("rt.malloc_physical", g + 4096, gpu_prop(), 0)[-1] == PARAM  # not a multiple of the granularity
    assert a.call("rt.malloc_physical", MiB2, gpu_prop(7), 0)[-1] == 107001  # no such device
    h, ptr = alloc_map(a, 2 * MiB2)
    assert a.call("rt.map_mem", ptr, MiB2, 0, h, 0) == PARAM  # the wrong size
    host, _ = a.call("rt.malloc_host", 64)
    assert a.call("rt.memcpy", ptr, 16, host, 64, H2D) == PARAM  # count > destMax
    assert a.call("rt.memcpy", ptr + 2 * MiB2 - 8, 64, host, 64, H2D) == PARAM  # past the mapping
    assert a.call("rt.memset", ptr, 16, 0, 64) == PARAM
    assert a.call("rt.release_mem_address", ptr) == PARAM  # still mapped (rule 6)
    assert a.call("rt.unmap_mem", ptr + MiB2) == PARAM  # not the start of a mapping
    assert a.call("rt.free_host", host) == 0
    drop(a, h, ptr)
    assert a.call("rt.free_physical", h) == 107017  # freed already
    assert a.call("!fd_count") == fds
    if mode() == "fake":
        assert driver_allocations(a.pid) == 0


def test_c_without_a_driver_every_call_says_what_to_install(broker: BrokerProc, tmp_path: Path) -> None:
    """VMMSHARE_BACKEND=cuda where libcuda.so.1 cannot be loaded: 207000, and the message names the driver."""
    if system_driver(tmp_path):
        pytest.skip("a CUDA driver is installed here")
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda", "VMMSHARE_ACTOR_SURFACE": "c",
           "LD_LIBRARY_PATH": str(tmp_path)}  # no libcuda.so.1 there (the stand-in is not on the path)
    a = Actor(env, device=None)
    try:
        assert a.call("rt.set_device", 0) == UNSUPPORTED
        assert "libcuda.so.1" in a.last_err and "install the NVIDIA driver" in a.last_err, a.last_err
        assert a.call("rt.malloc_physical", MiB2, gpu_prop(), 0)[-1] == UNSUPPORTED
        assert "libcuda.so.1" in a.last_err
    finally:
        a.kill()


def test_c_auto_backend_is_the_gpu_where_one_is_usable(actor: Callable[..., Actor]) -> None:
    """VMMSHARE_BACKEND=auto from C, as from Python: the GPUs when the driver loads and sees one."""
    a = actor(VMMSHARE_BACKEND="auto")
    assert a.call("get_soc_name") == "vmmshare-cuda"
    h, ptr = alloc_map(a)
    if mode() == "fake":
        assert driver_allocations(a.pid) == 1
    drop(a, h, ptr)


def test_c_auto_backend_without_a_driver_is_host_memory(broker: BrokerProc, tmp_path: Path) -> None:
    """VMMSHARE_BACKEND=auto where libcuda.so.1 cannot be loaded: device memory is host memory, nothing fails."""
    if system_driver(tmp_path):
        pytest.skip("a CUDA driver is installed here")
    env = {**broker.env, "VMMSHARE_BACKEND": "auto", "VMMSHARE_ACTOR_SURFACE": "c", "LD_LIBRARY_PATH": str(tmp_path)}
    a = Actor(env)
    try:
        assert a.call("get_soc_name") == "vmmshare-host"
        h, ptr = alloc_map(a)
        a.call("!write_bytes", ptr, b"host memory")  # the CPU reaches it: a memfd, not GPU memory
        assert download(a, ptr, 11) == b"host memory"
        drop(a, h, ptr)
    finally:
        a.kill()


# ---------------------------------------------------------------- a C program under the sanitizers


def test_c_program_shares_gpu_memory_under_sanitizers(broker: BrokerProc, tmp_path: Path) -> None:
    """tests/c/gpu_share.c, built with -fsanitize=address,undefined and the library's sources: two C processes
    share GPU memory (a trustlist, copies both ways, revocation, bad input) and nothing leaks."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    exe = cc(tmp_path / "gpu_share", HERE / "c" / "gpu_share.c")
    # a real driver needs ASan's shadow gap unprotected, and what it keeps at exit is not this library's to free
    asan = "detect_leaks=1" if mode() == "fake" else "detect_leaks=0:protect_shadow_gap=0"
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda", "UBSAN_OPTIONS": "print_stacktrace=1",
           "ASAN_OPTIONS": f"{asan}:abort_on_error=0"}
    out = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
