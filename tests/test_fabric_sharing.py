"""FABRIC handles across servers (SPEC §8, rule 17): the sharing sample flow and every sharing rule, between
"servers" that are network namespaces of this machine, each with its own broker, server id and fabric address.

Needs root and the transfer engine; CI has both, so there these tests must run (VMMSHARE_REQUIRE_ROOT_TESTS).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import require
from fabric_cluster import TestCluster, cluster_problem, eventually
from procs import Actor

require(not cluster_problem(), cluster_problem())

FABRIC, DEFAULT = 2, 1
NO_PID_CHECK = 1
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
HOST_PROP = {**PROP, "location": {"id": 0, "type": 0}}
M2 = 2 << 20
PARAM, BAD_HANDLE, NOT_SUPPORTED, NO_PERMISSION, IPC = 107000, 107017, 207000, 207006, 507022


@pytest.fixture
def fabric() -> Iterator[TestCluster]:
    c = TestCluster(2)
    try:
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.close()


def ok(a: Actor, name: str, *args: Any) -> Any:
    result = a.call(name, *args)
    ret = result[-1] if isinstance(result, tuple) else result
    assert ret == 0, f"{name}{args!r} -> {result!r}: {a.last_err}"
    return result[0] if isinstance(result, tuple) and len(result) == 2 else result[:-1] if isinstance(
        result, tuple) else None


def fails(a: Actor, code: int, name: str, *args: Any) -> str:
    result = a.call(name, *args)
    ret = result[-1] if isinstance(result, tuple) else result
    assert ret == code, f"{name} -> {result!r}, expected {code}: {a.last_err}"
    assert a.last_err, f"{name} failed with {code} but left no message"
    return str(a.last_err)


def export(a: Actor, size: int = M2, flags: int = 0, pids: list[int] | None = None,
           prop: dict[str, Any] | None = None) -> tuple[int, bytes, int]:
    """Allocate, map and export as FABRIC on `a`: (handle, shareable, ptr of the exporter's own mapping)."""
    h = ok(a, "rt.malloc_physical", size, prop or PROP, 0)
    p = ok(a, "rt.reserve_mem_address", size, 0, 0, 0)
    ok(a, "rt.map_mem", p, size, 0, h, 0)
    s = ok(a, "rt.mem_export_to_shareable_handle_v2", h, flags, FABRIC)
    if pids:
        ok(a, "rt.mem_set_pid_to_shareable_handle_v2", s, FABRIC, pids)
    return h, s, p


def import_map(a: Actor, s: bytes, size: int = M2) -> tuple[int, int]:
    h = ok(a, "rt.mem_import_from_shareable_handle_v2", s, FABRIC, 0)
    p = ok(a, "rt.reserve_mem_address", size, 0, 0, 0)
    ok(a, "rt.map_mem", p, size, 0, h, 0)
    return h, p


def unmap_free(a: Actor, h: int, p: int) -> None:
    ok(a, "rt.unmap_mem", p)
    ok(a, "rt.release_mem_address", p)
    ok(a, "rt.free_physical", h)


def served_nothing(c: TestCluster, n: int = 1) -> bool:
    """Server `n`'s broker serves nothing to other servers: no remote importer listed, no memfd mapped."""
    b = c.brokers[n]
    rows = b.listing()["exports"]
    return b.memfd_mappings() == 0 and not any(r.get("remote_importers") for r in rows)


# ---------------------------------------------------------------- the sample flow


def test_the_sharing_sample_flow_across_servers(fabric: TestCluster) -> None:
    """Server 1 exports and trustlists server 2's process by its bare tgid; server 2 imports, maps, and copies in
    every direction between that range and its own memory (malloc_host, malloc, a local VMM mapping), and sets it."""
    a, b = fabric.actor(1), fabric.actor(2)
    tgid = ok(b, "rt.device_get_bare_tgid")
    assert tgid == b.pid
    _, s, ap = export(a, 2 * M2, pids=[tgid])
    assert len(s) == 128 and s[32] == 4  # the endpoint: IPv4, server 1's address
    a.call("!write_bytes", ap, b"written on server 1")
    a.call("!write", ap + M2, 0x5A, M2)

    ih, rp = import_map(b, s, 2 * M2)
    buf = ok(b, "rt.malloc_host", 2 * M2)
    ok(b, "rt.memcpy", buf, 2 * M2, rp, 2 * M2, 4)  # remote -> host
    assert b.call("!read", buf, 19) == b"written on server 1"
    assert b.call("!sha256", buf + M2, M2) == hashlib.sha256(b"\x5a" * M2).hexdigest()

    b.call("!write_bytes", buf, b"back from server 2")
    ok(b, "rt.memcpy", rp + 4096, 64, buf, 18, 1)  # host -> remote (HOST_TO_DEVICE: a remote range is device memory)
    assert a.call("!read", ap + 4096, 18) == b"back from server 2"

    dev = ok(b, "rt.malloc", M2, 0)  # aclrtMalloc memory <-> remote
    ok(b, "rt.memcpy", dev, M2, rp, M2, 3)
    ok(b, "rt.memcpy", rp + M2, M2, dev, M2, 3)
    assert a.call("!read", ap + M2, 19) == b"written on server 1"

    lh = ok(b, "rt.malloc_physical", M2, PROP, 0)  # a local VMM mapping <-> remote
    lp = ok(b, "rt.reserve_mem_address", M2, 0, 0, 0)
    ok(b, "rt.map_mem", lp, M2, 0, lh, 0)
    b.call("!write", lp, 0xC3, M2)
    ok(b, "rt.memcpy", rp, M2, lp, M2, 3)
    assert a.call("!sha256", ap, M2) == hashlib.sha256(b"\xc3" * M2).hexdigest()
    ok(b, "rt.memcpy", rp + 100, 10, rp + M2, 10, 3)  # remote -> remote (through a bounce buffer)
    assert a.call("!read", ap + 100, 10) == b"written on"

    ok(b, "rt.memset", rp + 8, 16, 0x7E, 16)
    assert a.call("!read", ap, 24) == b"\xc3" * 8 + b"\x7e" * 16

    fails(b, PARAM, "rt.memcpy", buf, 64, rp, 64, 0)  # HOST_TO_HOST: the remote side is device memory
    fails(b, PARAM, "rt.memcpy", buf, 64, rp + 2 * M2 - 8, 64, 4)  # runs past the mapping: checked here

    for p in (lp, rp):
        ok(b, "rt.unmap_mem", p)
        ok(b, "rt.release_mem_address", p)
    ok(b, "rt.free_physical", lh)
    ok(b, "rt.free_physical", ih)
    ok(b, "rt.free", dev)
    ok(b, "rt.free_host", buf)
    eventually(lambda: served_nothing(fabric), "server 1 still serves the memory after its importer freed it")


def test_the_pythonic_flow_across_servers(fabric: TestCluster) -> None:
    a = fabric.actor(1)
    importer = fabric.cluster.server(2)
    _, s, ap = export(a, M2, flags=NO_PID_CHECK)
    a.call("!write_bytes", ap, b"pythonic")
    code = f"""
import vmmshare, vmmshare.acl as acl
from vmmshare import FeatureNotSupportedError
with vmmshare.import_handle(bytes.fromhex({s.hex()!r})) as mem, mem.map() as m:
    assert mem.remote and m.remote and not mem.on_gpu
    assert m.read(8) == b"pythonic"
    m.write(b"PY", offset=2)
    m.fill(0x41, size=4, offset=100)
    with vmmshare.Device(0).allocate(1 << 21) as local, local.map() as lm:
        lm.write(b"local bytes")
        m.copy_from(lm, size=11, offset=200)
        lm.copy_from(m, size=8)
        assert lm.read(8) == m.read(8) == b"pyPYonic"
    for view in (lambda: m.numpy(), lambda: m.memoryview(), lambda: m.__dlpack__()):
        try:
            view()
        except FeatureNotSupportedError as exc:
            assert exc.code == 207000 and "another server" in exc.message, exc.message
        else:
            raise AssertionError("a CPU view of remote memory")
    assert acl.util.ptr_to_numpy(m.ptr, (4,), 2) is None
    assert "another server" in acl.get_recent_err_msg()
    assert acl.util.ptr_to_bytes(m.ptr, 4) is None
print("OK")
"""
    out = fabric.run(importer.number, code)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
    assert a.call("!read", ap, 8) == b"pyPYonic"
    assert a.call("!read", ap + 100, 4) == b"AAAA"
    assert a.call("!read", ap + 200, 11) == b"local bytes"
    eventually(lambda: served_nothing(fabric), "the memory is still served after the importer's process ended")
