"""Rule 7 across kinds of memory: a local mapping next to a mapping of another server's memory (a FABRIC import)
is one range for memcpy and memset, sync and async, as HCCL's symmetric memory maps every peer's window into one
reservation. The servers are network namespaces of this machine (fabric_cluster.py).
"""

from __future__ import annotations

import os

import pytest

from conftest import require
from fabric_cluster import TestCluster, cluster_problem
from procs import ok

require(not cluster_problem(), cluster_problem())

FABRIC = 2
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
M2 = 2 << 20
PARAM = 107000
DEFAULT_KIND = 4


@pytest.mark.parametrize("surface", ["python", "c"])
def test_rule_7_a_local_mapping_next_to_a_remote_one_is_one_range(shared_fabric: TestCluster, surface: str) -> None:
    """The importer is a Python program, or a C one (the C library through `cacl`)."""
    a, b = shared_fabric.actor(1), shared_fabric.actor(2, VMMSHARE_ACTOR_SURFACE=surface)
    h = ok(a, "rt.malloc_physical", M2, PROP, 0)
    p = ok(a, "rt.reserve_mem_address", M2, 0, 0, 0)
    ok(a, "rt.map_mem", p, M2, 0, h, 0)
    a.call("!write", p, 0x00, M2)
    s = ok(a, "rt.mem_export_to_shareable_handle_v2", h, 0, FABRIC)
    ok(a, "rt.mem_set_pid_to_shareable_handle_v2", s, FABRIC, [b.pid])

    base = ok(b, "rt.reserve_mem_address", 3 * M2, 0, 0, 0)  # local | remote | (unmapped)
    local = ok(b, "rt.malloc_physical", M2, PROP, 0)
    ok(b, "rt.map_mem", base, M2, 0, local, 0)
    far = ok(b, "rt.mem_import_from_shareable_handle_v2", s, FABRIC, 0)
    ok(b, "rt.map_mem", base + M2, M2, 0, far, 0)
    edge = base + M2  # where the local mapping ends and the remote one begins

    data = os.urandom(8192)
    hb = ok(b, "rt.malloc_host", 8192)
    b.call("!write_bytes", hb, data)
    ok(b, "rt.memcpy", edge - 4096, 8192, hb, 8192, DEFAULT_KIND)  # one call, half here and half there
    assert b.call("!read", edge - 4096, 4096) == data[:4096]
    assert a.call("!read", p, 4096) == data[4096:], "the remote half did not reach the exporting server"

    back = ok(b, "rt.malloc_host", 8192)
    ok(b, "rt.memcpy", back, 8192, edge - 4096, 8192, DEFAULT_KIND)
    assert b.call("!read", back, 8192) == data

    ok(b, "rt.memset", edge - 100, 200, 0x3C, 200)
    assert b.call("!read", edge - 100, 100) == b"\x3c" * 100
    assert a.call("!read", p, 101) == b"\x3c" * 100 + data[4196:4197]

    ok(b, "rt.memset_async", edge - 8, 16, 0x5A, 16, 0)
    ok(b, "rt.memcpy_async", back, 32, edge - 16, 32, DEFAULT_KIND, 0)
    ok(b, "rt.synchronize_stream", 0)
    assert b.call("!read", back, 32) == b"\x3c" * 8 + b"\x5a" * 16 + b"\x3c" * 8

    before = a.call("!read", p + M2 - 64, 64)
    result = b.call("rt.memcpy", base + 2 * M2 - 64, 128, hb, 128, DEFAULT_KIND)  # into the unmapped third
    assert result == PARAM and f"{base + 2 * M2:#x}" in b.last_err, (result, b.last_err)
    assert a.call("!read", p + M2 - 64, 64) == before, "a refused copy wrote to the remote memory"

    for q in (base, base + M2):
        ok(b, "rt.unmap_mem", q)
    ok(b, "rt.release_mem_address", base)
    for handle in (local, far):
        ok(b, "rt.free_physical", handle)
    ok(b, "rt.free_host", hb)
    ok(b, "rt.free_host", back)
