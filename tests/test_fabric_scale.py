"""The fabric as a supernode uses it (SPEC §8): every server imports every other's handle. What that needs of the
transport: no transfer engine started on the import path (the broker's starts with it, an importing process makes
its own at its first copy only), one link per server pair used both ways, a request that times out failing alone,
and a dead exporter's memory failing fast at every copy."""

from __future__ import annotations

import hashlib

from conftest import require
from fabric_cluster import TestCluster, cluster_problem
from test_fabric_sharing import M2, export, import_map, ok, unmap_free

require(not cluster_problem(), cluster_problem())

ENGINE_LIBRARY = "mooncake"  # the transfer engine's shared object, as /proc/<pid>/maps names it


def engine_loaded(pid: int) -> bool:
    """Whether process `pid` has loaded the transfer engine (its library is mapped)."""
    with open(f"/proc/{pid}/maps") as f:
        return any(ENGINE_LIBRARY in line for line in f)


def test_the_broker_starts_its_engine_with_it_and_an_importer_only_at_its_first_copy(fabric: TestCluster) -> None:
    assert all(engine_loaded(b.pid) for b in fabric.brokers.values()), "a broker starts its engine with it"
    a, b = fabric.actor(1), fabric.actor(2)
    _, s, ap = export(a, pids=[b.pid])
    a.call("!write", ap, 0x5A, M2)
    ih, rp = import_map(b, s)
    assert not engine_loaded(b.pid), "importing and mapping another server's memory started an engine"
    buf = ok(b, "rt.malloc_host", M2)
    ok(b, "rt.memcpy", buf, M2, rp, M2, 2)  # the first copy makes the process's engine
    assert engine_loaded(b.pid)
    assert b.call("!sha256", buf, M2) == hashlib.sha256(b"\x5a" * M2).hexdigest()
    unmap_free(b, ih, rp)
