"""`vmmshare bench`'s waits pass (spins on and off, idle and with every core busy) on small settings: what it
reports and that it leaves nothing behind (no CPU hog, no private broker or measuring process, no socket folder);
speed itself is not asserted."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

import pytest

from vmmshare.cli import bench, bench_busy
from vmmshare.config import BROKER_SPIN_US, CLIENT_SPIN_US, socket_path

pytestmark = pytest.mark.alone  # it keeps every core busy for a while: no other test should run beside it


def _descendants(root: int) -> set[int]:
    """Every live process below `root` (children, theirs, and so on), from /proc."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it ended while we looked
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not: it has ended and only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def waits() -> dict[str, Any]:
    before = _descendants(os.getpid())
    res = bench_busy.waits(2, 0.05, [1, 3])
    res["left_behind"] = {pid: _cmdline(pid) for pid in _descendants(os.getpid()) - before}
    return res


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_every_pass_is_measured(waits: dict[str, Any]) -> None:
    """Idle and busy, spins on and off: each a 2 MiB share by step with its anchors, and round trips with 1 and the
    most clients, with their CPU per round trip."""
    cores = len(os.sched_getaffinity(0))
    assert waits["cores"] == waits["hogs"] == cores and waits["size"] == 2 << 20
    assert waits["windows_us"] == {"on": {"client": CLIENT_SPIN_US, "broker": BROKER_SPIN_US},
                                   "off": {"client": 0, "broker": 0}}
    assert set(waits["passes"]) == {"idle", "busy"}
    for load, by_spins in waits["passes"].items():
        assert set(by_spins) == {"on", "off"}, load
        for spins, got in by_spins.items():
            for step in ("import", "reserve_map", "shm_attach", "share", "shm_share"):
                s = got["latency"][step]
                assert 0 < s["p10"] <= s["median"] <= s["p90"], (load, spins, step)
            lat = got["latency"]
            assert math.isclose(got["importer_vs_attach"], (lat["import"]["median"] + lat["reserve_map"]["median"])
                                / lat["shm_attach"]["median"])
            assert set(got["throughput"]) == {"1", "3"}
            for point in got["throughput"].values():
                assert point["ops_per_s"] > 0 and point["client_cpu_us"] >= 0 and point["broker_cpu_us"] >= 0
    assert set(waits["spins_on_vs_off"]) == {"idle", "busy"} and all(v > 0 for v in waits["spins_on_vs_off"].values())
    assert len(waits["started"]["hog_pids"]) == cores and len(waits["started"]["broker_pids"]) == 2


def test_nothing_is_left_behind(waits: dict[str, Any]) -> None:
    """Every hog, private broker and measuring process has ended and been reaped; the socket folder, in a place of
    its own (not the default broker's), is gone."""
    started = waits["started"]
    # multiprocessing's resource tracker starts with the first spawned process and stays for the test process's life
    assert [cmd for cmd in waits["left_behind"].values() if "resource_tracker" not in cmd] == []
    assert not any(map(_alive, started["hog_pids"] + started["broker_pids"]))
    folder = Path(started["folder"])
    assert not folder.exists()
    assert folder != socket_path().parent


def test_the_report_shows_the_four_columns(waits: dict[str, Any]) -> None:
    """The table: rows import … broker CPU, columns idle/busy × spins on/off, narrow, with the targets in words."""
    res = {"latency": {}, "waits": waits}
    res["targets"] = bench.targets(res)
    assert set(res["targets"]) == {"spins_win_idle", "spins_do_not_lose_busy"}
    assert res["targets"]["spins_win_idle"]["target"] == "< 1.0"
    buf = io.StringIO()
    bench.print_report(res, buf)
    text = buf.getvalue()
    assert max(map(len, text.splitlines())) <= 100
    assert "idle, spins on  idle, spins off  busy, spins on  busy, spins off" in text
    for row in ("import", "reserve+map", "importer / attach", "round trips/s, 1 client", "round trips/s, 3 clients",
                "client CPU µs per round trip", "broker CPU µs per round trip"):
        assert any(line.strip().startswith(f"{row} ") for line in text.splitlines()), row
    assert "spins win idle" in text and "spins do not lose busy" in text


def test_hogs_burn_until_the_block_ends_and_an_error_kills_them() -> None:
    class Boom(Exception):
        pass

    seen: list[int] = []
    with pytest.raises(Boom), bench_busy.hogs(2) as pids:
        seen = pids
        assert len(pids) == 2 and all(map(_alive, pids))
        raise Boom
    assert seen and not any(map(_alive, seen))
    assert not _descendants(os.getpid()) & set(seen)


def test_a_private_broker_that_cannot_serve_says_why(tmp_path: Path) -> None:
    """A socket path too long for sun_path: the broker refuses it, and the pass says so (with the broker's own
    reason) instead of waiting; the broker is reaped."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    before = _descendants(os.getpid())
    with pytest.raises(bench_busy.PassError, match=r"did not start .*bytes"), \
            bench_busy.private_brokers(deep, {"on": 200}):
        pytest.fail("a broker served a path too long for a Unix socket")
    assert _descendants(os.getpid()) <= before
