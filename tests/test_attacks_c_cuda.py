"""Attacks on the C library's CUDA backend (clib/cuda.c and its hooks), on the CPU stand-in for the driver (or a real
GPU): what the C surface does where the Python surface, given the same calls, does otherwise."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import CUDA_GATE, require
from procs import PROP, Actor, BrokerProc, MiB2
from test_cuda import (
    BINDINGS,
    NO_BACKEND,
    backend_mode,  # noqa: F401  (the CUDA tests' fixtures)
    broker_env,  # noqa: F401
    cuda_env,  # noqa: F401
    download,
    drop,
    upload,
)

require(BINDINGS, NO_BACKEND, CUDA_GATE)
pytestmark = [pytest.mark.gpu]
HERE = Path(__file__).resolve().parent
SURFACES = pytest.mark.parametrize("surface", ["python", "c"])


@pytest.fixture
def actor(broker: BrokerProc) -> Iterator[Callable[..., Actor]]:
    """`actor(surface, backend="cuda", **env)`: an Actor on `surface` with `backend`."""
    made: list[Actor] = []

    def make(surface: str = "c", backend: str = "cuda", **over: str) -> Actor:
        a = Actor({**broker.env, "VMMSHARE_BACKEND": backend, "VMMSHARE_ACTOR_SURFACE": surface, **over})
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()


def gpu_after_host(host_side: Actor, importer: Actor) -> tuple[str, int, int, int]:
    """In `importer` (a CUDA process), a host mapping (an IPC import of `host_side`'s aclrtMalloc memory, a
    host-backend process) followed end to end by a mapping of GPU memory: (the IPC key, the host mapping's address,
    the GPU handle, its range)."""
    ptr, ret = host_side.call("rt.malloc", MiB2, 0)
    assert ret == 0, host_side.last_err
    assert host_side.call("rt.memset", ptr, MiB2, 0x11, MiB2) == 0, host_side.last_err
    key, ret = host_side.call("rt.ipc_mem_get_export_key", ptr, MiB2, 65, 0)
    assert ret == 0, host_side.last_err
    assert host_side.call("rt.ipc_mem_set_import_pid", key, [importer.pid]) == 0, host_side.last_err
    q, ret = importer.call("rt.ipc_mem_import_by_key", key, 0)
    assert ret == 0, importer.last_err
    h, ret = importer.call("rt.malloc_physical", MiB2, {**PROP, "location": {"id": 0, "type": 1}}, 0)
    assert ret == 0, importer.last_err
    g, ret = importer.call("rt.reserve_mem_address", MiB2, 0, q + MiB2, 0)
    if ret != 0 or g != q + MiB2:
        pytest.skip(f"the GPU range could not be placed after the host mapping: {importer.last_err}")
    assert importer.call("rt.map_mem", g, MiB2, 0, h, 0) == 0, importer.last_err
    return key, q, h, g


def gpu_next_to_host(actor: Callable[..., Actor], surface: str) -> tuple[Actor, int, int, int]:
    """A CUDA process on `surface` with a host mapping followed by a GPU mapping (gpu_after_host): (the process, the
    host mapping's address, the GPU handle, its range)."""
    host_side, importer = actor("c", backend="host"), actor(surface)
    _, q, h, g = gpu_after_host(host_side, importer)
    return importer, q, h, g


@SURFACES
def test_fill_from_host_mapping_into_gpu_mapping(actor: Callable[..., Actor], surface: str) -> None:
    """Rule 7: a host mapping and a GPU mapping end to end are one range. Filled from the host part on, the GPU
    part must be filled by the driver (the CPU cannot address GPU memory): the C library hands the whole range to
    memset(3), which faults on the GPU range."""
    a, q, _h, g = gpu_next_to_host(actor, surface)
    assert a.call("rt.memset", q, 2 * MiB2, 0x22, 2 * MiB2) == 0, a.last_err
    assert download(a, q + MiB2 - 4, 8) == b"\x22" * 8
    assert download(a, g + MiB2 - 4, 4) == b"\x22" * 4


@SURFACES
def test_copy_from_host_into_host_then_gpu_mapping(actor: Callable[..., Actor], surface: str) -> None:
    """The same range as a copy's destination, from an aclrtMallocHost block: memmove(3) in C."""
    a, q, _h, _g = gpu_next_to_host(actor, surface)
    host, ret = a.call("rt.malloc_host", 2 * MiB2)
    assert ret == 0
    a.call("!write_bytes", host + MiB2 - 4, b"spanning")
    assert a.call("rt.memcpy", q, 2 * MiB2, host, 2 * MiB2, 4) == 0, a.last_err
    assert download(a, q + MiB2 - 4, 8) == b"spanning"


@SURFACES
def test_copy_from_host_then_gpu_mapping_to_host(actor: Callable[..., Actor], surface: str) -> None:
    """The range as a copy's source, into an aclrtMallocHost block."""
    a, q, _h, g = gpu_next_to_host(actor, surface)
    upload(a, g, b"gpu part")
    host, ret = a.call("rt.malloc_host", 2 * MiB2)
    assert ret == 0
    assert a.call("rt.memcpy", host, 2 * MiB2, q, 2 * MiB2, 4) == 0, a.last_err
    assert a.call("!read", host + MiB2, 8) == b"gpu part"
    assert a.call("!read", host, 4) == b"\x11" * 4


ARENA = 16 << 40  # where the runtime places host ranges first (VS_ARENA_START, runtime.vmm's arena)


def host_after_gpu(actor: Callable[..., Actor], surface: str) -> tuple[Actor, int, int]:
    """A CUDA process with a GPU mapping at the arena's start and, end to end after it, a host mapping (an IPC
    import of a host-backend process's aclrtMalloc memory, 0x11 bytes): (the process, the GPU range, the host one)."""
    exporter, importer = actor("c", backend="host"), actor(surface)
    h, ret = importer.call("rt.malloc_physical", MiB2, {**PROP, "location": {"id": 0, "type": 1}}, 0)
    assert ret == 0, importer.last_err
    g, ret = importer.call("rt.reserve_mem_address", MiB2, 0, ARENA, 0)
    if ret != 0 or g != ARENA:
        pytest.skip(f"the GPU range could not be placed at the arena's start: {importer.last_err}")
    assert importer.call("rt.map_mem", g, MiB2, 0, h, 0) == 0, importer.last_err
    ptr, ret = exporter.call("rt.malloc", MiB2, 0)
    assert ret == 0, exporter.last_err
    assert exporter.call("rt.memset", ptr, MiB2, 0x11, MiB2) == 0, exporter.last_err
    key, ret = exporter.call("rt.ipc_mem_get_export_key", ptr, MiB2, 65, 0)
    assert ret == 0, exporter.last_err
    assert exporter.call("rt.ipc_mem_set_import_pid", key, [importer.pid]) == 0, exporter.last_err
    q, ret = importer.call("rt.ipc_mem_import_by_key", key, 0)
    assert ret == 0, importer.last_err
    if q != g + MiB2:
        pytest.skip(f"the host mapping is at {q:#x}, not after the GPU range")
    return importer, g, q


@SURFACES
def test_fill_from_gpu_mapping_into_host_mapping(actor: Callable[..., Actor], surface: str) -> None:
    """Rule 7 the other way round: filled from the GPU part on, the C library hands the whole range to one
    cuMemsetD8, which a driver refuses past the GPU allocation (the stand-in: CUDA_ERROR_ILLEGAL_ADDRESS, as a
    device range that runs into host memory faults on a GPU)."""
    a, g, _q = host_after_gpu(actor, surface)
    assert a.call("rt.memset", g, 2 * MiB2, 0x33, 2 * MiB2) == 0, a.last_err
    assert download(a, g + MiB2 - 4, 8) == b"\x33" * 8


@SURFACES
def test_copy_across_gpu_then_host_mapping(actor: Callable[..., Actor], surface: str) -> None:
    """The same range as a copy's destination and, back, as its source (one cuMemcpy each in C)."""
    a, g, _q = host_after_gpu(actor, surface)
    host, ret = a.call("rt.malloc_host", 2 * MiB2)
    assert ret == 0
    a.call("!write_bytes", host + MiB2 - 4, b"spanning")
    assert a.call("rt.memcpy", g, 2 * MiB2, host, 2 * MiB2, 4) == 0, a.last_err
    back, ret = a.call("rt.malloc_host", 2 * MiB2)
    assert ret == 0
    assert a.call("rt.memcpy", back, 2 * MiB2, g, 2 * MiB2, 4) == 0, a.last_err
    assert a.call("!read", back + MiB2 - 4, 8) == b"spanning"


@SURFACES
@pytest.mark.parametrize(("visible", "seen"), [("0,1,5", 2), ("1,9", 1)])
def test_visible_devices_are_read_over_the_gpus(broker: BrokerProc, surface: str, visible: str, seen: int) -> None:
    """ASCEND_RT_VISIBLE_DEVICES under the CUDA backend names GPUs: read as the runtime reads it (ids up to the first
    that is not a device) over the GPUs the driver counts (the stand-in's two), not over VMMSHARE_DEVICES (8). The
    C library read it over 8 and then refused an id past the GPUs that the reading should have stopped at."""
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda", "VMMSHARE_ACTOR_SURFACE": surface,
           "ASCEND_RT_VISIBLE_DEVICES": visible}
    a = Actor(env, device=None)
    try:
        count, ret = a.call("rt.get_device_count")
        if count > 2:
            pytest.skip("written for the stand-in's two GPUs")
        assert (count, ret) == (seen, 0), a.last_err
        assert a.call("rt.set_device", seen - 1) == 0, a.last_err
    finally:
        a.kill()


@SURFACES
def test_gpu_out_of_memory_leaves_no_charge(actor: Callable[..., Actor], broker: BrokerProc, surface: str) -> None:
    """cuMemCreate out of memory (the stand-in's GPUs hold 4 MiB here): 207001 on both surfaces, and the node's GPU
    charge made before the driver was asked goes with the failure."""
    from test_cuda import listing

    a = actor(surface, FAKECUDA_MEMORY=str(2 * MiB2))
    if a.call("rt.get_mem_info", 0)[1] != 2 * MiB2:
        pytest.skip("sizes the stand-in's device memory")
    h, ret = a.call("rt.malloc_physical", 4 * MiB2, {**PROP, "location": {"id": 0, "type": 1}}, 0)
    assert ret == 207001, a.last_err
    assert a.call("rt.malloc", 4 * MiB2, 0)[-1] == 207001, a.last_err
    assert listing(broker)["gpu_used"] == {}
    h, ret = a.call("rt.malloc_physical", 2 * MiB2, {**PROP, "location": {"id": 0, "type": 1}}, 0)
    assert ret == 0, a.last_err
    assert a.call("rt.free_physical", h) == 0


def test_child_forked_while_a_context_is_made_does_not_hang(broker: BrokerProc, tmp_path: Path) -> None:
    """tests/c/gpu_fork_context.c (sanitized): the child of a fork taken while another thread made a GPU's context
    (the stand-in made slow at it) answers its own GPU calls. The C library took the lock of contexts on every call,
    even for a context it had: the child waited on a lock no thread of its would ever let go (the Python surface
    takes it only to make a context)."""
    from test_c_library import cc
    from test_cuda import mode

    if mode() != "fake":
        pytest.skip("slows the stand-in's context creation")
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    exe = cc(tmp_path / "gpu_fork_context", HERE / "c" / "gpu_fork_context.c")
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda", "FAKECUDA_RETAIN_DELAY_MS": "1000",
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
    out = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


@SURFACES
@pytest.mark.parametrize(("value", "ok"), [("cu da", False), ("\tCUDA\n", True), (" auto ", True), ("ho st", False)])
def test_backend_names_are_read_alike(broker: BrokerProc, surface: str, value: str, ok: bool) -> None:
    """VMMSHARE_BACKEND as config.backend reads it: whitespace around the name goes (str.strip()), none inside it
    (the C library dropped every space, anywhere, and kept tabs and newlines)."""
    env = {**broker.env, "VMMSHARE_BACKEND": value,
           "VMMSHARE_ACTOR_SURFACE": surface}
    a = Actor(env, device=None)
    try:
        _count, ret = a.call("rt.get_device_count")
        assert (ret == 0) == ok, a.last_err
    finally:
        a.kill()


@SURFACES
def test_copy_from_another_servers_memory_into_host_then_gpu_mapping(
        shared_fabric: object, tmp_path_factory: pytest.TempPathFactory, surface: str) -> None:
    """Across servers (SPEC §8): another server's memory copied into a local range that runs from a host mapping
    into a GPU mapping (one local part). The C library asked only the part's first byte whether it was GPU memory,
    and had the transfer engine's socket write the whole part straight into it: the GPU half is no memory the
    kernel can write, so the copy failed where the Python surface's (cut at the mappings) succeeds."""
    from fabric_cluster import cluster_problem

    if cluster_problem():
        pytest.skip(cluster_problem())
    import fakecuda
    from test_fabric_sharing import export, import_map

    c: Any = shared_fabric
    gpu_env = {**fakecuda.build(tmp_path_factory.mktemp("fakecuda")), "VMMSHARE_BACKEND": "cuda",
               "VMMSHARE_ACTOR_SURFACE": surface}
    a = c.actor(1)
    host_side = c.actor(2, VMMSHARE_BACKEND="host", VMMSHARE_ACTOR_SURFACE="c")
    b = c.actor(2, **gpu_env)
    _, s, ap = export(a, size=2 * MiB2, pids=[b.pid])
    a.call("!write_bytes", ap + MiB2 - 7, b"across servers")
    ih, rp = import_map(b, s, 2 * MiB2)
    key, q, h, g = gpu_after_host(host_side, b)
    assert b.call("rt.memcpy", q, 2 * MiB2, rp, 2 * MiB2, 4) == 0, b.last_err
    assert download(b, q + MiB2 - 7, 14) == b"across servers"
    assert b.call("rt.unmap_mem", g) == 0 and b.call("rt.release_mem_address", g) == 0
    assert b.call("rt.free_physical", h) == 0
    assert b.call("rt.ipc_mem_close", key) == 0
    assert b.call("rt.unmap_mem", rp) == 0 and b.call("rt.release_mem_address", rp) == 0
    assert b.call("rt.free_physical", ih) == 0


@SURFACES
@pytest.mark.parametrize("shift", [4096, -4096, 3])
def test_overlapping_copy_within_gpu_memory_moves_like_memmove(actor: Callable[..., Actor], surface: str,
                                                              shift: int) -> None:
    """An overlapping copy within GPU memory moves like memmove (docs/rules.md, rule 7), as on the host backend.
    Both surfaces handed it to one cuMemcpy, whose ranges "may not overlap" (the driver's bytes are then whatever
    its copy engine's order leaves; the stand-in refuses such a copy)."""
    a = actor(surface)
    h, ret = a.call("rt.malloc_physical", MiB2, {**PROP, "location": {"id": 0, "type": 1}}, 0)
    assert ret == 0, a.last_err
    ptr, _ = a.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
    assert a.call("rt.map_mem", ptr, MiB2, 0, h, 0) == 0, a.last_err
    pattern = bytes(range(256)) * 64
    base = ptr + 65536
    upload(a, base, pattern)
    assert a.call("rt.memcpy", base + shift, len(pattern), base, len(pattern), 3) == 0, a.last_err
    assert download(a, base + shift, len(pattern)) == pattern
    drop(a, h, ptr)
