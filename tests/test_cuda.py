"""The CUDA backend: the same rules, with device memory.

On a machine with a usable NVIDIA GPU these run on it. Elsewhere they run on `fakecuda/`, a CPU stand-in for
libcuda driven through the real cuda-bindings, which checks how vmmshare uses the driver API (and nothing about a
GPU); the tests that need torch or cupy on a GPU skip there. Without cuda-bindings or a C compiler the module skips
(and fails where VMMSHARE_REQUIRE_CUDA_TESTS=1, as in CI).
Every actor runs with VMMSHARE_BACKEND=cuda, on the module's broker (conftest's `broker`) unless its test kills it.
The tests marked BOTH_SURFACES run twice: with Python actors, and with actors calling the C library (its CUDA
backend, clib/cuda.c; tests/test_c_cuda.py has the C library's own and the mixed C / Python cases).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import fakecuda
from conftest import CUDA_GATE, require
from procs import PROP, Actor, BrokerProc, MiB2, clean_env, share_and_map

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")


def _gpu_usable(extra_env: dict[str, str] | None = None) -> bool:
    code = "from vmmshare.backends.cuda import available; print(available())"
    env = {**os.environ, "PYTHONPATH": SRC, **(extra_env or {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return out.stdout.strip() == "True"


BINDINGS = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


@functools.cache
def mode() -> str | None:
    """'gpu' with a real GPU, 'fake' where the CPU stand-in can run, else None. Asked (in a child process that
    loads the driver) at the first test that needs it, not while the suite is collected."""
    if not BINDINGS:
        return None
    if _gpu_usable():
        return "gpu"
    return "fake" if shutil.which(os.environ.get("CC", "cc")) else None


# CI sets VMMSHARE_REQUIRE_CUDA_TESTS=1: there the backend's tests never skip
NO_BACKEND = "no usable NVIDIA GPU, and no CPU stand-in (it needs cuda-bindings and a C compiler)"
require(BINDINGS, NO_BACKEND, CUDA_GATE)
pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module", autouse=True)
def backend_mode() -> str | None:
    """Skips (fails in CI) every test here where neither a GPU nor the stand-in can run."""
    found = mode()
    if os.environ.get("VMMSHARE_REQUIRE_GPU") == "1" and found != "gpu":
        pytest.fail("VMMSHARE_REQUIRE_GPU=1 but no usable GPU: vmmshare.backends.cuda.available() is False",
                    pytrace=False)
    require(found is not None, NO_BACKEND, CUDA_GATE)
    return found


@pytest.fixture
def real_gpu() -> None:
    """Skips a test that needs a real GPU where the stand-in runs."""
    if mode() != "gpu":
        pytest.skip("needs a real GPU (torch / cupy CUDA tensors)")


@pytest.fixture
def stand_in() -> None:
    """Skips a test that sizes the stand-in's device memory where a real GPU runs."""
    if mode() != "fake":
        pytest.skip("sizes the stand-in's device memory")


needs_real_gpu = pytest.mark.usefixtures("real_gpu")
needs_stand_in = pytest.mark.usefixtures("stand_in")


@pytest.fixture(scope="module")
def cuda_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What a process needs in its environment to see the GPUs (nothing on a real GPU)."""
    if mode() != "fake":
        return {}
    env = fakecuda.build(tmp_path_factory.mktemp("fakecuda"))
    assert _gpu_usable(env), "the CPU stand-in for libcuda did not load"
    return env


@pytest.fixture(scope="module")
def broker_env(cuda_env: dict[str, str]) -> dict[str, str]:
    """The tests' brokers (conftest's `broker`, one for the module, and `own_broker`) and their clients see the
    GPUs."""
    return clean_env(**{"PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **cuda_env})


@pytest.fixture
def surface(request: pytest.FixtureRequest) -> str:
    """The actors' surface: Python, or the C library for a test marked BOTH_SURFACES (SPEC §9: one rule, both)."""
    return str(getattr(request, "param", "python"))


BOTH_SURFACES = pytest.mark.parametrize("surface", ["python", "c"], indirect=True)


@pytest.fixture
def gpu_actor(broker: BrokerProc, surface: str) -> Iterator[Callable[..., Actor]]:
    """`gpu_actor(on=None, **env)`: an Actor with the CUDA backend on `surface`, a client of `on` (else of
    `broker`)."""
    made: list[Actor] = []

    def make(on: BrokerProc | None = None, **over: str) -> Actor:
        env = {**(on or broker).env, "VMMSHARE_BACKEND": "cuda", "VMMSHARE_ACTOR_SURFACE": surface, **over}
        a = Actor(env)
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()


DEFAULT, FABRIC = 1, 2
H2D, D2H = 1, 2


# ---------------------------------------------------------------- helpers


def alloc_map(a: Actor, size: int = MiB2, loc_type: int = 1) -> tuple[int, int]:
    prop = {**PROP, "location": {"id": 0, "type": loc_type}}
    h, ret = a.call("rt.malloc_physical", size, prop, 0)
    assert ret == 0, a.last_err
    ptr, ret = a.call("rt.reserve_mem_address", size, 0, 0, 0)
    assert ret == 0, a.last_err
    assert a.call("rt.map_mem", ptr, size, 0, h, 0) == 0, a.last_err
    return h, ptr


def upload(a: Actor, ptr: int, data: bytes) -> None:
    host, ret = a.call("rt.malloc_host", len(data))
    assert ret == 0
    a.call("!write_bytes", host, data)
    assert a.call("rt.memcpy", ptr, len(data), host, len(data), H2D) == 0, a.last_err
    assert a.call("rt.free_host", host) == 0


def download(a: Actor, ptr: int, n: int) -> bytes:
    host, ret = a.call("rt.malloc_host", n)
    assert ret == 0
    assert a.call("rt.memcpy", host, n, ptr, n, D2H) == 0, a.last_err
    data: bytes = a.call("!read", host, n)
    assert a.call("rt.free_host", host) == 0
    return data


def share_once(exporter: Actor, importer: Actor, size: int = MiB2) -> tuple[int, int, int, int]:
    """Allocate and map in `exporter`, share with `importer`, map there: (h, ptr, imported h, imported ptr)."""
    h, ptr = alloc_map(exporter, size)
    _, ih, iptr = share_and_map(exporter, importer, h, size)
    return h, ptr, ih, iptr


def drop(a: Actor, h: int, ptr: int) -> None:
    assert a.call("rt.unmap_mem", ptr) == 0, a.last_err
    assert a.call("rt.release_mem_address", ptr) == 0, a.last_err
    assert a.call("rt.free_physical", h) == 0, a.last_err


def driver_allocations(pid: int) -> int:
    """Physical allocations the CPU stand-in holds in `pid` (its memfds show in the process's maps)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum("/memfd:fakecuda-dev" in line for line in f)


def listing(broker: BrokerProc) -> dict[str, object]:
    code = "from vmmshare.cli.commands import main; main(['ls', '--json'])"
    out = subprocess.run([sys.executable, "-c", code], env=broker.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


# ---------------------------------------------------------------- memory and the rules


def test_gpu_memory_round_trip(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    count, ret = a.call("rt.get_device_count")
    assert ret == 0 and count >= 1
    h, ptr = alloc_map(a)
    upload(a, ptr, b"gpu!" * 1024)
    assert download(a, ptr, 4096) == b"gpu!" * 1024
    assert a.call("rt.memset", ptr, MiB2, 0x41, 16) == 0, a.last_err
    assert download(a, ptr, 16) == b"A" * 16
    assert a.call("util.ptr_to_bytes", ptr, 16) is None  # the CPU cannot read GPU memory
    assert "GPU" in a.last_err or "gpu" in a.last_err.lower()
    prop, ret = a.call("rt.mem_get_allocation_properties_from_handle", h)
    assert ret == 0 and prop["location"] == {"id": 0, "type": 1}
    assert a.call("rt.unmap_mem", ptr) == 0
    assert a.call("rt.release_mem_address", ptr) == 0
    assert a.call("rt.free_physical", h) == 0


@BOTH_SURFACES
def test_malloc_ipc_and_streams_on_gpu_memory(gpu_actor: Callable[..., Actor]) -> None:
    """aclrtMalloc memory is GPU memory under the CUDA backend: filled on a stream, shared by IPC key, imported in
    another process that reads and writes it; the driver's allocation goes when both let go."""
    a, b = gpu_actor(), gpu_actor()
    assert a.call("get_soc_name") == "vmmshare-cuda"
    ptr, ret = a.call("rt.malloc", MiB2, 0)
    assert ret == 0, a.last_err
    assert driver_allocations(a.pid) == 1
    s, ret = a.call("rt.create_stream")
    assert ret == 0
    assert a.call("rt.memset_async", ptr, MiB2, 0x3C, MiB2, s) == 0, a.last_err
    assert a.call("rt.synchronize_stream", s) == 0, a.last_err
    key, ret = a.call("rt.ipc_mem_get_export_key", ptr, MiB2, 65, 0)
    assert ret == 0, a.last_err
    assert a.call("rt.ipc_mem_set_import_pid", key, [b.pid]) == 0, a.last_err
    q, ret = b.call("rt.ipc_mem_import_by_key", key, 0)
    assert ret == 0, b.last_err
    assert download(b, q, 16) == b"\x3c" * 16
    upload(b, q + 16, b"from the importer")
    assert download(a, ptr + 16, 17) == b"from the importer"
    assert b.call("rt.ipc_mem_close", key) == 0 and a.call("rt.ipc_mem_close", key) == 0
    assert a.call("rt.free", ptr) == 0 and a.call("rt.destroy_stream", s) == 0
    assert driver_allocations(a.pid) == 0 and driver_allocations(b.pid) == 0


@BOTH_SURFACES
def test_host_location_memory_stays_host_memory(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    prop = {**PROP, "location": {"id": 0, "type": 0}}
    h, ret = a.call("rt.malloc_physical", MiB2, prop, 0)
    assert ret == 0, a.last_err
    ptr, ret = a.call("rt.reserve_mem_address", MiB2, 0, 0, 0)  # GPU address space under the CUDA backend
    assert ret == 0
    assert a.call("rt.map_mem", ptr, MiB2, 0, h, 0) == 207000
    assert "reservation" in a.last_err
    assert a.call("rt.release_mem_address", ptr) == 0
    assert a.call("rt.free_physical", h) == 0


@BOTH_SURFACES
@pytest.mark.parametrize("share_type", [DEFAULT, FABRIC])
def test_rules_hold_for_gpu_memory(gpu_actor: Callable[..., Actor], share_type: int) -> None:
    exporter, importer, stranger = gpu_actor(), gpu_actor(), gpu_actor()
    h, ptr = alloc_map(exporter, 4 * MiB2)
    pattern = bytes(range(256)) * 64
    upload(exporter, ptr, pattern)
    sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, share_type)
    assert ret == 0, exporter.last_err
    assert exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, share_type)[-1] == 107000  # rule 9
    own, ret = exporter.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)  # rule 13: allowed
    assert ret == 0, exporter.last_err
    assert exporter.call("rt.free_physical", own) == 0
    assert stranger.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)[-1] == 207006  # rule 11
    assert exporter.call("rt.mem_set_pid_to_shareable_handle_v2", sh, share_type, [importer.pid]) == 0
    ih, ret = importer.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)
    assert ret == 0, importer.last_err
    iptr, ret = importer.call("rt.reserve_mem_address", 4 * MiB2, 0, 0, 0)
    assert importer.call("rt.map_mem", iptr, 4 * MiB2, 0, ih, 0) == 0, importer.last_err
    assert download(importer, iptr, len(pattern)) == pattern  # the same GPU memory (rule 7)
    upload(importer, iptr, b"back" * 8)
    assert download(exporter, ptr, 32) == b"back" * 8
    # rule 14: the exporter frees; new imports are refused, the importer keeps its memory
    assert exporter.call("rt.unmap_mem", ptr) == 0
    assert exporter.call("rt.free_physical", h) == 0
    assert stranger.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)[-1] == 107017
    assert download(importer, iptr, 32) == b"back" * 8
    assert importer.call("rt.unmap_mem", iptr) == 0
    assert importer.call("rt.free_physical", ih) == 0


@BOTH_SURFACES
def test_more_rules_hold_for_gpu_memory(gpu_actor: Callable[..., Actor]) -> None:
    """Rules 5, 6, 8, 11 (no pid validation), 13 (once per process) and 14 (exporter death) with GPU memory."""
    exporter, importer, anyone, late = gpu_actor(), gpu_actor(), gpu_actor(), gpu_actor()
    h, ptr = alloc_map(exporter, 2 * MiB2)
    loc = {"type": 1, "id": 0}
    # rule 5: a READ mapping refuses writes, reads still work; the flags read back
    assert exporter.call("rt.mem_set_access", ptr, 2 * MiB2, [{"flags": 1, "location": loc}]) == 0, exporter.last_err
    assert exporter.call("rt.mem_get_access", ptr + MiB2, loc) == (1, 0)
    assert exporter.call("rt.memset", ptr, 16, 0x11, 16) == 107000
    assert len(download(exporter, ptr, 4)) == 4  # reads still work (a GPU does not promise zeroed memory)
    assert exporter.call("rt.mem_set_access", ptr, 2 * MiB2, [{"flags": 3, "location": loc}]) == 0
    upload(exporter, ptr + MiB2, b"rule 8")
    # rule 6: the reservation is not released while mapped
    assert exporter.call("rt.release_mem_address", ptr) == 107000
    # rule 8: retain and address range inside a GPU mapping
    rh, ret = exporter.call("rt.mem_retain_allocation_handle", ptr + MiB2 + 5)
    assert (rh, ret) == (h, 0), exporter.last_err
    assert exporter.call("rt.mem_get_address_range", ptr + MiB2 + 5) == (ptr, 2 * MiB2, 0)
    assert exporter.call("rt.free_physical", rh) == 0  # the retain's reference
    # rule 11: without pid validation anyone may import
    sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 1, DEFAULT)
    assert ret == 0, exporter.last_err
    ih, ret = anyone.call("rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0)
    assert ret == 0, anyone.last_err
    # rule 13: importing it again gives the same handle, with a reference added
    assert anyone.call("rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0) == (ih, 0)
    assert anyone.call("rt.free_physical", ih) == 0
    iptr, _ = anyone.call("rt.reserve_mem_address", 2 * MiB2, 0, 0, 0)
    assert anyone.call("rt.map_mem", iptr, 2 * MiB2, 0, ih, 0) == 0, anyone.last_err
    # rule 14: the exporter dies: no new imports, the importer keeps the memory
    exporter.kill()
    assert late.call("rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0)[-1] == 107017
    assert download(anyone, iptr + MiB2, 6) == b"rule 8"
    drop(anyone, ih, iptr)
    assert importer.call("rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0)[-1] == 107017


def test_auto_backend_picks_the_gpu(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor(VMMSHARE_BACKEND="auto")
    h, ptr = alloc_map(a)
    assert a.call("util.ptr_to_bytes", ptr, 16) is None and "GPU" in a.last_err  # GPU memory, not a memfd
    drop(a, h, ptr)


def test_host_backend_importer_is_told_to_use_cuda(gpu_actor: Callable[..., Actor], broker: BrokerProc) -> None:
    exporter = gpu_actor()
    host_only = Actor({**broker.env, "VMMSHARE_BACKEND": "host"})
    try:
        h, _ = alloc_map(exporter)
        sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 1, DEFAULT)
        assert ret == 0
        assert host_only.call("rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0)[-1] == 207000
        assert "VMMSHARE_BACKEND=cuda" in host_only.last_err
    finally:
        host_only.kill()


@BOTH_SURFACES
def test_rule_1_gpu_granularity_is_at_least_the_drivers(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    prop = {**PROP, "location": {"id": 0, "type": 1}}
    g, ret = a.call("rt.mem_get_allocation_granularity", prop, 0)
    assert ret == 0 and g >= MiB2 and g % MiB2 == 0
    huge1g, ret = a.call("rt.mem_get_allocation_granularity", {**prop, "memAttr": 17}, 0)  # ACL_HBM_MEM_HUGE1G
    assert (huge1g, ret) == (1 << 30, 0)
    assert a.call("rt.malloc_physical", g + 4096, prop, 0)[-1] == 107000


@BOTH_SURFACES
def test_rule_3_gpu_reservation_at_a_taken_address_is_refused(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    ptr, ret = a.call("rt.reserve_mem_address", 2 * MiB2, 0, 0, 0)
    assert ret == 0
    assert a.call("rt.reserve_mem_address", MiB2, 0, ptr, 0) == (0, 107000)
    assert "not free" in a.last_err
    assert a.call("rt.release_mem_address", ptr) == 0


@BOTH_SURFACES
def test_rule_4_gpu_map_no_access_is_inaccessible_until_set_access(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    h, _ = a.call("rt.malloc_physical", MiB2, {**PROP, "location": {"id": 0, "type": 1}}, 0)
    ptr, _ = a.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
    assert a.call("rt.mem_map_no_access", ptr, MiB2, 0, h, 0) == 0, a.last_err
    host, _ = a.call("rt.malloc_host", 16)
    assert a.call("rt.memcpy", host, 16, ptr, 16, D2H) == 107000 and "not readable" in a.last_err
    loc = {"type": 1, "id": 0}
    assert a.call("rt.mem_set_access", ptr, MiB2, [{"flags": 3, "location": loc}]) == 0
    upload(a, ptr, b"now mapped")
    assert download(a, ptr, 10) == b"now mapped"
    assert a.call("rt.free_host", host) == 0
    drop(a, h, ptr)


@BOTH_SURFACES
def test_rule_5_gpu_access_flags_take_effect_at_once(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    h, ptr = alloc_map(a)
    upload(a, ptr, b"before")
    loc = {"type": 1, "id": 0}
    host, _ = a.call("rt.malloc_host", 16)
    assert a.call("rt.mem_set_access", ptr, MiB2, [{"flags": 1, "location": loc}]) == 0  # READ
    assert a.call("rt.mem_get_access", ptr, loc) == (1, 0)
    assert a.call("rt.memcpy", ptr, 16, host, 16, H2D) == 107000  # no write through a READ mapping
    assert download(a, ptr, 6) == b"before"
    assert a.call("rt.mem_set_access", ptr, MiB2, [{"flags": 0, "location": loc}]) == 0  # NONE
    assert a.call("rt.memcpy", host, 16, ptr, 16, D2H) == 107000  # nor a read through a NONE one
    assert a.call("rt.free_host", host) == 0
    drop(a, h, ptr)


@BOTH_SURFACES
def test_rule_6_gpu_unmap_returns_the_range_to_reserved(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    h, ptr = alloc_map(a)
    assert a.call("rt.release_mem_address", ptr) == 107000  # a mapping is inside
    assert a.call("rt.unmap_mem", ptr) == 0
    assert a.call("rt.map_mem", ptr, MiB2, 0, h, 0) == 0, a.last_err  # the same range, mapped again
    upload(a, ptr, b"again")
    assert download(a, ptr, 5) == b"again"
    drop(a, h, ptr)


@BOTH_SURFACES
def test_rule_10_an_imported_gpu_handle_cannot_be_exported(gpu_actor: Callable[..., Actor]) -> None:
    exporter, importer = gpu_actor(), gpu_actor()
    h, ptr, ih, iptr = share_once(exporter, importer)
    assert importer.call("rt.mem_export_to_shareable_handle_v2", ih, 0, DEFAULT)[-1] == 107000
    drop(importer, ih, iptr)
    drop(exporter, h, ptr)


# ---------------------------------------------------------------- lifetimes, failures and leaks


@BOTH_SURFACES
def test_share_cycles_leak_no_fd_and_no_allocation(gpu_actor: Callable[..., Actor]) -> None:
    exporter, importer = gpu_actor(), gpu_actor()
    h, ptr, ih, iptr = share_once(exporter, importer)  # warm both sides (contexts, broker connection)
    drop(importer, ih, iptr)
    drop(exporter, h, ptr)
    fds = exporter.call("!fd_count"), importer.call("!fd_count")
    for _ in range(20):
        h, ptr, ih, iptr = share_once(exporter, importer)
        drop(exporter, h, ptr)  # the exporter goes first: the importer's memory must outlive it
        upload(importer, iptr, b"still here")
        assert download(importer, iptr, 10) == b"still here"
        drop(importer, ih, iptr)
    assert (exporter.call("!fd_count"), importer.call("!fd_count")) == fds
    if mode() == "fake":
        assert driver_allocations(exporter.pid) == driver_allocations(importer.pid) == 0


@BOTH_SURFACES
def test_importer_keeps_gpu_memory_when_the_exporter_dies(gpu_actor: Callable[..., Actor]) -> None:
    exporter, importer = gpu_actor(), gpu_actor()
    _, ptr, ih, iptr = share_once(exporter, importer, 2 * MiB2)
    pattern = bytes(range(256)) * 16
    upload(exporter, ptr + MiB2, pattern)
    exporter.kill()
    assert download(importer, iptr + MiB2, len(pattern)) == pattern
    drop(importer, ih, iptr)


@BOTH_SURFACES
def test_gpu_memory_is_given_back_when_the_last_holder_dies(gpu_actor: Callable[..., Actor],
                                                             broker: BrokerProc) -> None:
    exporter, importer = gpu_actor(), gpu_actor()
    h, ptr, _, _ = share_once(exporter, importer, 2 * MiB2)
    assert listing(broker)["gpu_used"] == {"0": 2 * MiB2}
    drop(exporter, h, ptr)
    assert listing(broker)["gpu_used"] == {"0": 2 * MiB2}, "the importer still holds it"
    importer.kill()
    listing(broker)  # a connection made after the death: the broker has processed it (settled_fd_count)
    after = listing(broker)
    assert after["gpu_used"] == {} and after["exports"] == []


@BOTH_SURFACES
def test_a_restarted_broker_records_live_gpu_memory_again(gpu_actor: Callable[..., Actor],
                                                          own_broker: BrokerProc) -> None:
    a = gpu_actor(on=own_broker)
    h, ptr = alloc_map(a, 2 * MiB2)
    upload(a, ptr, b"survives")
    own_broker.kill()
    own_broker.start()
    h2, ptr2 = alloc_map(a)  # the client reconnects and charges its live allocations again, as GPU memory
    after = listing(own_broker)
    assert after["gpu_used"] == {"0": 3 * MiB2} and after["used"] == {}, after
    assert download(a, ptr, 8) == b"survives"
    drop(a, h2, ptr2)
    drop(a, h, ptr)
    assert listing(own_broker)["gpu_used"] == {}


@BOTH_SURFACES
def test_rule_16_an_import_of_a_forged_gpu_export_fails_cleanly(gpu_actor: Callable[..., Actor],
                                                                 broker: BrokerProc) -> None:
    """A client hands the broker a pipe as a GPU export: the importer's driver refuses it, and nothing leaks."""
    from vmmshare.wire import local as P

    r, w = os.pipe()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(str(broker.socket))
        sock.send(P.encode(P.ChargeGpu(0, MiB2), 1))
        token = P.decode(sock.recv(P.MAX_FRAME)).message.hold  # type: ignore[attr-defined]
        fields = (token, MiB2, 1, DEFAULT, 0, 1, 0, 0, 5, 1, 0)  # no pid validation; kind 1: a GPU export
        socket.send_fds(sock, [P.encode(P.Export(*fields), 2)], [r])
        shareable = int.from_bytes(P.decode(sock.recv(P.MAX_FRAME)).message.shareable, "little")  # type: ignore[attr-defined]
        a = gpu_actor()
        drop(a, *alloc_map(a))  # connected, context made
        fds = a.call("!fd_count")
        assert a.call("rt.mem_import_from_shareable_handle_v2", shareable, DEFAULT, 0)[-1] == 107000
        assert "cuMemImportFromShareableHandle" in a.last_err, a.last_err
        assert a.call("!fd_count") == fds
        assert a.call("rt.mem_import_from_shareable_handle_v2", shareable, DEFAULT, 0)[-1] == 107000  # again
    finally:
        sock.close()
        os.close(r)
        os.close(w)


@BOTH_SURFACES
def test_failed_gpu_calls_leave_nothing_behind(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    drop(a, *alloc_map(a))  # connected to the broker, the context made
    fds = a.call("!fd_count")
    prop = {**PROP, "location": {"id": 0, "type": 1}}
    assert a.call("rt.malloc_physical", MiB2 + 4096, prop, 0)[-1] == 107000  # not a multiple of the granularity
    bad = {**prop, "location": {"id": 99, "type": 1}}
    assert a.call("rt.malloc_physical", MiB2, bad, 0)[-1] == 107001  # no such device
    h, ptr = alloc_map(a)
    assert a.call("rt.map_mem", ptr, MiB2, 0, h, 0) == 107000  # already mapped
    assert a.call("rt.memcpy", ptr, 16, ptr + MiB2, 16, 3) == 107000  # past the mapping
    assert a.call("rt.mem_import_from_shareable_handle_v2", 12345, DEFAULT, 0)[-1] == 107017
    assert a.call("rt.free_physical", h) == 0  # mapped: the memory stays until the unmap
    upload(a, ptr, b"kept")
    assert download(a, ptr, 4) == b"kept"
    assert a.call("rt.free_physical", h) == 107017  # the handle is gone, though
    assert a.call("rt.unmap_mem", ptr) == 0
    assert a.call("rt.release_mem_address", ptr) == 0
    assert a.call("!fd_count") == fds
    if mode() == "fake":
        assert driver_allocations(a.pid) == 0


# ---------------------------------------------------------------- capacity and devices


def test_device_mem_info_is_the_gpus(broker: BrokerProc) -> None:
    code = textwrap.dedent("""
        import vmmshare, vmmshare.acl as acl
        assert acl.rt.set_device(0) == 0
        with vmmshare.Device(0).allocate(4 << 20):
            free, total, ret = acl.rt.get_mem_info(0)
            assert ret == 0 and vmmshare.Device(0).mem_info() == (free, total), (vmmshare.Device(0).mem_info(), free)
        print("ok")
    """)
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda", "VMMSHARE_DEVICE_MEMORY": "1G"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


@BOTH_SURFACES
@needs_stand_in
def test_rule_2_gpu_out_of_memory_is_207001_and_recovers(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor(FAKECUDA_MEMORY=str(4 * MiB2))
    drop(a, *alloc_map(a))  # connected, context made
    fds = a.call("!fd_count")
    prop = {**PROP, "location": {"id": 0, "type": 1}}
    h, ret = a.call("rt.malloc_physical", 3 * MiB2, prop, 0)
    assert ret == 0, a.last_err
    assert a.call("rt.malloc_physical", 2 * MiB2, prop, 0)[-1] == 207001
    assert a.call("rt.free_physical", h) == 0
    h, ret = a.call("rt.malloc_physical", 4 * MiB2, prop, 0)
    assert ret == 0, a.last_err
    assert a.call("rt.free_physical", h) == 0
    assert a.call("!fd_count") == fds and driver_allocations(a.pid) == 0  # the failed call left nothing


@BOTH_SURFACES
@needs_stand_in
def test_gpu_capacity_is_the_gpus_not_vmmshare_device_memory(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor(FAKECUDA_MEMORY=str(200 << 30), VMMSHARE_DEVICE_MEMORY="1G")
    prop = {**PROP, "location": {"id": 0, "type": 1}}
    h, ret = a.call("rt.malloc_physical", 4 << 30, prop, 0)  # never touched: costs no RAM here
    assert ret == 0, a.last_err
    assert a.call("rt.get_mem_info", 0) == ((200 << 30) - (4 << 30), 200 << 30, 0)
    assert a.call("rt.free_physical", h) == 0
    assert a.call("rt.get_mem_info", 0) == (200 << 30, 200 << 30, 0)


@BOTH_SURFACES
def test_second_device_memory_is_shared_too(gpu_actor: Callable[..., Actor]) -> None:
    exporter, importer = gpu_actor(), gpu_actor()
    count, ret = exporter.call("rt.get_device_count")
    assert ret == 0 and (count == 2 or mode() == "gpu")  # the stand-in has two
    if count < 2:
        pytest.skip("one GPU only")
    assert exporter.call("rt.set_device", 1) == 0 and importer.call("rt.set_device", 1) == 0
    prop = {**PROP, "location": {"id": 1, "type": 1}}
    h, ret = exporter.call("rt.malloc_physical", MiB2, prop, 0)
    assert ret == 0, exporter.last_err
    ptr, _ = exporter.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
    assert exporter.call("rt.map_mem", ptr, MiB2, 0, h, 0) == 0, exporter.last_err
    upload(exporter, ptr, b"device one")
    sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, DEFAULT)
    assert ret == 0
    assert exporter.call("rt.mem_set_pid_to_shareable_handle_v2", sh, DEFAULT, [importer.pid]) == 0
    ih, ret = importer.call("rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0)
    assert ret == 0, importer.last_err
    prop_back, ret = importer.call("rt.mem_get_allocation_properties_from_handle", ih)
    assert ret == 0 and prop_back["location"] == {"id": 1, "type": 1}
    iptr, _ = importer.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
    assert importer.call("rt.map_mem", iptr, MiB2, 0, ih, 0) == 0, importer.last_err
    assert download(importer, iptr, 10) == b"device one"
    drop(importer, ih, iptr)
    drop(exporter, h, ptr)


@BOTH_SURFACES
@pytest.mark.parametrize("peer_path", [True, False], ids=["peers", "no_peers"])
def test_peer_access_is_the_gpus_topology(gpu_actor: Callable[..., Actor], peer_path: bool) -> None:
    if mode() == "gpu" and not peer_path:
        pytest.skip("the stand-in's setting")
    a = gpu_actor(**({} if peer_path else {"FAKECUDA_NO_PEER": "1"}))
    count, _ = a.call("rt.get_device_count")
    if count < 2:
        assert mode() == "gpu", "the CPU stand-in has two devices"
        pytest.skip("one GPU only")
    assert a.call("rt.device_can_access_peer", 0, 0) == (0, 0)
    can, ret = a.call("rt.device_can_access_peer", 0, 1)
    assert ret == 0 and (can == 1 if mode() == "fake" and peer_path else can in (0, 1))
    if mode() == "fake" and not peer_path:
        assert can == 0
    assert a.call("rt.device_enable_peer_access", 1, 0) == (0 if can else 207000)


def test_a_context_made_current_by_other_code_does_not_mislead_the_runtime(broker: BrokerProc) -> None:
    """torch.cuda.set_device(1) / cupy make device 1's context current in the thread; vmmshare's calls on device 0
    must still run in device 0's context, and leave device 1's current for the code that chose it."""
    code = textwrap.dedent("""
        import ctypes, sys
        import vmmshare.acl as acl
        from cuda.bindings import driver as cu
        rt = acl.rt
        if rt.get_device_count()[0] < 2:
            print("one GPU"); sys.exit(0)
        assert rt.set_device(0) == 0
        prop = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
        h, ret = rt.malloc_physical(4 << 20, prop, 0)
        p, _ = rt.reserve_mem_address(4 << 20, 0, 0, 0)
        assert rt.map_mem(p, 4 << 20, 0, h, 0) == 0
        free0 = rt.get_mem_info(0)[0]
        _, dev1 = cu.cuDeviceGet(1)
        _, ctx1 = cu.cuDevicePrimaryCtxRetain(dev1)
        assert cu.cuCtxSetCurrent(ctx1)[0] == 0  # what torch.cuda.set_device(1) does
        assert rt.get_mem_info(0)[0] == free0, "device 1's memory was reported for device 0"
        assert rt.memset(p, 4 << 20, 7, 4 << 20) == 0, acl.get_recent_err_msg()
        buf = ctypes.create_string_buffer(4)
        assert rt.memcpy(ctypes.addressof(buf), 4, p, 4, 2) == 0 and buf.raw == b"\x07" * 4
        assert int(cu.cuCtxGetCurrent()[1]) == int(ctx1), "the other code's context was not given back"
        assert rt.unmap_mem(p) == 0 and rt.release_mem_address(p) == 0 and rt.free_physical(h) == 0
        print("ok")
    """)
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    if out.stdout.strip() == "one GPU":
        assert mode() == "gpu", "the CPU stand-in has two devices"
        pytest.skip("one GPU only")
    assert out.stdout.strip() == "ok"


# ---------------------------------------------------------------- the reliability suites, CI-sized


def test_fuzzed_calls_on_gpu_memory_keep_every_invariant(cuda_env: dict[str, str]) -> None:
    """stress/fuzz_api.py, CI-sized, under the CUDA backend: documented codes only, nothing leaked (see its doc)."""
    sys.path.insert(0, str(HERE.parent / "src" / "vmmshare" / "cli" / "stress"))
    import fuzz_api

    calls = 8_000  # ~110 calls for each of 72 functions
    result = fuzz_api.run(calls, 20261130, seconds=60, hang_guard=180,
                          extra_env={"VMMSHARE_BACKEND": "cuda", **cuda_env})
    assert result["ok"], result["violations"]
    assert result["calls"] == calls, "the time cap cut the fuzz short"
    for name in ("malloc_physical", "map_mem", "memcpy", "memset", "mem_export_to_shareable_handle_v2",
                 "mem_import_from_shareable_handle_v2", "mem_set_access"):
        assert result["ok_per_function"].get(name, 0) > 0, f"{name} never succeeded"


@pytest.mark.slow
def test_sigkill_faults_on_gpu_memory_keep_every_invariant(cuda_env: dict[str, str]) -> None:
    """stress/faults.py, CI-sized, under the CUDA backend: exporter, importer and broker killed at random points."""
    sys.path.insert(0, str(HERE.parent / "src" / "vmmshare" / "cli" / "stress"))
    import faults

    result = faults.run(["exporter", "importer", "broker"], 8, 240, 20261130,
                        backend_env={"VMMSHARE_BACKEND": "cuda", **cuda_env})
    assert not result["violations"] and not result["defects"], result["violations"] + result["defects"]
    kinds = result["kinds"]
    assert {k: v["trials"] for k, v in kinds.items()} == dict.fromkeys(("exporter", "importer", "broker"), 8), (
        "the time cap cut the trials short")
    assert kinds["exporter"]["counters"]["kept_checked_after_kill"] > 0
    assert kinds["importer"]["counters"]["imports_ok"] > 0
    assert kinds["broker"]["counters"]["imports_after_restart"] == 2 * kinds["broker"]["trials"]


# ---------------------------------------------------------------- the surfaces: Pythonic API, DLPack, tools


def test_pythonic_api_on_gpu_memory(broker: BrokerProc) -> None:
    child = textwrap.dedent("""
        import ctypes, sys, vmmshare
        from vmmshare import acl
        print(acl.rt.device_get_bare_tgid()[0], flush=True)
        buf = ctypes.create_string_buffer(8)
        with vmmshare.import_handle(sys.stdin.readline().strip(), device=0) as mem, mem.map() as m:
            assert mem.on_gpu and m.__dlpack_device__() == (2, 0)
            assert acl.rt.memcpy(ctypes.addressof(buf), 8, m.ptr + 8, 8, 2) == 0, acl.get_recent_err_msg()
        print(buf.raw.hex(), flush=True)
    """)
    parent = textwrap.dedent("""
        import subprocess, sys, vmmshare
        from vmmshare import acl
        child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        pid = int(child.stdout.readline())
        with vmmshare.Device(0).allocate(2 << 20) as mem, mem.map() as m:
            assert mem.on_gpu and m.__dlpack_device__() == (2, 0)
            try:
                m.memoryview()
                raise SystemExit("the CPU was given a view of GPU memory")
            except vmmshare.AclError as exc:
                assert "GPU" in str(exc), exc
            assert acl.rt.memset(m.ptr, m.size, 0x5A, m.size) == 0, acl.get_recent_err_msg()
            child.stdin.write(f"{mem.export(pids=[pid])}\\n")
            child.stdin.flush()
            print(child.stdout.readline().strip())
            assert child.wait() == 0
    """)
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda"}
    out = subprocess.run([sys.executable, "-c", parent, child], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "5a" * 8


def test_dlpack_capsule_of_gpu_memory_says_cuda(broker: BrokerProc) -> None:
    """The capsule a CUDA consumer gets, read by hand (DLPack's C layout, both forms): device, pointer, shape."""
    code = textwrap.dedent("""
        import ctypes, struct, vmmshare
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        with vmmshare.Device(0).allocate(2 << 20) as mem, mem.map() as m:
            for versioned in (False, True):
                cap = m.__dlpack__(max_version=(1, 0) if versioned else None)
                p = get(cap, b"dltensor_versioned" if versioned else b"dltensor")
                if versioned:
                    assert struct.unpack("<II", ctypes.string_at(p, 8)) == (1, 0)
                    p += 32  # version, manager_ctx, deleter, flags
                data, dev, dev_id, ndim, code, bits, lanes, shape, _, offset = struct.unpack(
                    "<QiiiBBHQQQ", ctypes.string_at(p, 48))
                assert (data, dev, dev_id, ndim, code, bits, lanes, offset) == (m.ptr, 2, 0, 1, 1, 8, 1, 0)
                assert struct.unpack("<q", ctypes.string_at(shape, 8)) == (2 << 20,)
                del cap  # never consumed: its deleter lets the mapping close
        print("ok")
    """)
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


@needs_real_gpu
def test_dlpack_cuda_with_torch_across_processes(broker: BrokerProc) -> None:
    pytest.importorskip("torch")
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda"}
    child = textwrap.dedent("""
        import sys, torch, vmmshare
        print(vmmshare.acl.rt.device_get_bare_tgid()[0], flush=True)
        with vmmshare.import_handle(sys.stdin.readline().strip(), device=0) as mem, mem.map() as m:
            assert m.__dlpack_device__() == (2, 0)
            t = torch.from_dlpack(m)
            assert t.is_cuda
            print(int(t[:1024].sum().item()), flush=True)
            t[:4] = 9
            torch.cuda.synchronize()
            del t
    """)
    parent = textwrap.dedent("""
        import subprocess, sys, torch, vmmshare
        child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        pid = int(child.stdout.readline())
        mem = vmmshare.Device(0).allocate(2 << 20)
        m = mem.map()
        t = torch.from_dlpack(m)
        t.fill_(1)
        torch.cuda.synchronize()
        h = mem.export(pids=[pid])
        child.stdin.write(f"{h}\\n"); child.stdin.flush()
        total = int(child.stdout.readline())
        assert child.wait() == 0
        assert total == 1024, total
        assert t[:4].tolist() == [9, 9, 9, 9]
        try:
            import cupy
            c = cupy.from_dlpack(m)
            assert int(c[0]) == 9
            del c
        except ImportError:
            pass
        del t
        import gc; gc.collect()
        m.close(); mem.close()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", parent, child], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


GPU_EXAMPLES = sorted((HERE.parent / "examples").glob("gpu_*.py"))


def test_there_is_a_gpu_example() -> None:
    assert GPU_EXAMPLES, "no examples/gpu_*.py: test_gpu_example_runs would be an empty (skipped) parameter set"


@pytest.mark.slow
@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=lambda p: p.stem)
def test_gpu_example_runs(broker: BrokerProc, path: Path) -> None:
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda"}
    out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "shared 8 MiB of GPU memory" in out.stdout, out.stdout


def test_demo_shares_gpu_memory(broker: BrokerProc) -> None:
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda"}
    out = subprocess.run([sys.executable, "-m", "vmmshare.cli", "demo", "--size", "8M"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "8 MiB of GPU memory (CUDA backend) shared" in out.stdout and "all steps behaved" in out.stdout, out.stdout


@pytest.mark.slow
def test_gpu_benchmark_runs(broker: BrokerProc, tmp_path: Path) -> None:
    """`vmmshare bench --gpu`, small: every step of it runs and reports (on the stand-in the numbers mean nothing)."""
    args = ["bench", "--gpu", "--sizes", "2M,4M", "--reps", "3", "--json", str(tmp_path / "b.json")]
    out = subprocess.run([sys.executable, "-m", "vmmshare.cli", *args], env=broker.env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "b.json").read_text())
    assert set(rows) == {"2MiB", "4MiB"}
    for row in rows.values():
        assert row["create_us"] > 0 and row["import_us"] > 0 and row["round_trip_us"] > 0
    assert rows["4MiB"]["d2d_ratio"] > 0


def test_ls_shows_gpu_memory(gpu_actor: Callable[..., Actor], broker: BrokerProc) -> None:
    a = gpu_actor()
    h, ptr = alloc_map(a, 2 * MiB2)
    sh, ret = a.call("rt.mem_export_to_shareable_handle_v2", h, 0, DEFAULT)
    assert ret == 0
    ls = "from vmmshare.cli.commands import main; main(['ls'])"
    out = subprocess.run([sys.executable, "-c", ls], env=broker.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "GPU 0: 4 MiB allocated through vmmshare" in out.stdout, out.stdout
    assert f"{sh:#018x}" in out.stdout and " gpu0 " in out.stdout, out.stdout
    drop(a, h, ptr)


def test_doctor_lists_the_gpus(broker: BrokerProc) -> None:
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda"}
    out = subprocess.run([sys.executable, "-m", "vmmshare.cli", "doctor", "--json"], env=env, capture_output=True,
                         text=True, timeout=60)
    finding = next(f for f in json.loads(out.stdout) if f["item"] == "backend")
    assert finding["status"] == "ok" and "GPU 0:" in finding["detail"], finding
    if mode() == "fake":
        assert "GPU 1: 16384 MiB, granularity 2048 KiB" in finding["detail"], finding


@BOTH_SURFACES
def test_visible_devices_choose_the_gpu(gpu_actor: Callable[..., Actor]) -> None:
    """ASCEND_RT_VISIBLE_DEVICES=1: the process sees one device, 0, which is GPU 1; its memory, copies and peer
    questions are GPU 1's (the stand-in names each GPU's memory)."""
    if mode() != "fake":
        pytest.skip("on a real GPU the node's GPUs are what CUDA_VISIBLE_DEVICES leaves; checked on the stand-in")
    a = gpu_actor(ASCEND_RT_VISIBLE_DEVICES="1")
    count, ret = a.call("rt.get_device_count")
    assert (count, ret) == (1, 0), a.last_err
    assert a.call("rt.get_logic_dev_id_by_user_dev_id", 0) == (1, 0)
    h, ptr = alloc_map(a)
    with open(f"/proc/{a.proc.pid}/maps") as f:
        names = {word for line in f for word in line.split() if word.startswith("/memfd:fakecuda-dev")}
    assert names == {"/memfd:fakecuda-dev1"}, names
    upload(a, ptr, b"on gpu 1")
    assert download(a, ptr, 8) == b"on gpu 1"
    assert a.call("rt.device_can_access_peer", 0, 0) == (0, 0)
    assert a.call("rt.unmap_mem", ptr) == 0 and a.call("rt.release_mem_address", ptr) == 0
    assert a.call("rt.free_physical", h) == 0
