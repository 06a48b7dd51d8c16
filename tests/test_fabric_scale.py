"""The fabric as a supernode uses it (SPEC §8): every server imports every other's handle. What that needs of the
transport: no transfer engine started on the import path (the broker's starts with it, an importing process makes
its own at its first copy only), one link per server pair used both ways, a request that times out failing alone,
and a dead exporter's memory failing fast at every copy."""

from __future__ import annotations

import hashlib
import signal
import time

from conftest import require
from fabric_cluster import TestCluster, cluster_problem
from test_fabric_sharing import IPC, M2, copying, export, fails, import_map, ok, unmap_free

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


def test_every_copy_from_a_killed_broker_fails_within_the_fabric_timeout() -> None:
    """The first copy after the exporter's broker died, and every later one, fail with 507022 within
    VMMSHARE_FABRIC_TIMEOUT (0.5 s here): the engine's own reconnecting takes most of a second per copy."""
    c = TestCluster(2, timeout=0.5)
    try:
        b, ih, rp, buf = copying(c)
        c.brokers[1].signal(signal.SIGKILL)
        took = []
        for _ in range(6):
            start = time.monotonic()
            msg = fails(b, IPC, "rt.memcpy", buf, 4096, rp, 4096, 2)
            took.append(time.monotonic() - start)
            assert "10.77.0.1" in msg
        assert max(took) < 0.5, f"copies from the dead broker took {[round(t, 3) for t in took]} s"
        unmap_free(b, ih, rp)
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.close()
