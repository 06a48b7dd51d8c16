"""`vmmshare bench` runs end to end (tiny sizes) and writes its JSON and plot; speed itself is not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.alone  # its CPU figures per round trip are a few clock ticks: another test's load can make one 0
def test_bench_runs_and_reports(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "vmmshare.cli", "bench", "--quick", "--sizes", "4K,2M", "--reps", "2",
           "--clients", "1,2", "--seconds", "0.2", "--no-torch", "--json", str(out_json), "--plot", str(out_png)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out_json.read_text())
    row = res["latency"][str(2 << 20)]
    for step in ("allocate", "map", "export_trustlist", "import", "reserve_map", "first_touch", "share",
                 "shm_create", "shm_attach", "pipe"):
        assert row[step]["p10"] <= row[step]["median"] <= row[step]["p90"], step
    assert set(res["throughput"]) == {"1", "2"}
    for point in res["throughput"].values():
        assert point["ops_per_s"] > 0 and point["client_cpu_us"] > 0 and point["broker_cpu_us"] > 0, point
    floor = res["floor"]
    assert 0 < floor["fd_round_trip"]["median"] <= floor["fd_round_trip_mmap"]["median"]
    python_ratios = {"import (request, reply with fd)", "import + reserve + map", "SharedMemory attach"}
    if res["c_floor"]:  # the physical floor, both ends in C, needs the fast path built
        assert set(res["c_floor"]) == {"any_core", "one_core"}
        for c in res["c_floor"].values():
            assert 0 < c["fd_round_trip"]["median"] <= c["fd_round_trip_mmap"]["median"]
        assert set(res["floor_ratios"]) == python_ratios | {f"{k}, vs the C floor" for k in (
            "import", "import + reserve + map", "SharedMemory attach")}
        assert "blocking fd round trip in C, any core" in out.stdout
    else:
        assert set(res["floor_ratios"]) == python_ratios
    c = res["c_share"]  # the C row: the C library's share and its anchors, measured in the same run
    for key in ("c_importer", "c_exporter", "shm_attach", "shm_create", "floor"):
        assert 0 < c[key]["p10"] <= c[key]["median"] <= c[key]["p90"], key
    assert c["importer_vs_floor"] > 0
    assert {"c_importer_2MiB_vs_floor", "c_share_2MiB_vs_3_floors"} <= set(res["targets"])
    assert "The C library: a 2 MiB share between two C processes" in out.stdout
    assert 0 <= res["idle_cpu"] < 1
    assert res["bandwidth"]["read_ratio"] > 0
    assert {"lazy", "prepopulated"} == set(res["bandwidth"]["first_touch"])
    assert "share_2MiB_vs_shm" in res["targets"] and "importer_2MiB_vs_attach" in res["targets"]
    waits = res["waits"]  # the waits pass: 1 client and the most of --clients, idle and busy, spins on and off
    assert waits["clients"] == [1, 2] and set(waits["passes"]) == {"idle", "busy"}
    assert all(set(p) == {"on", "off"} for p in waits["passes"].values())
    assert not Path(waits["started"]["folder"]).exists()
    assert {"spins_win_idle", "spins_do_not_lose_busy", "event_wakeup_vs_pipe"} <= set(res["targets"])
    wake = res["wakeup"]  # the producer/consumer row: an event's record -> wait against a pipe, same run
    for key in ("event_record_to_wait", "pipe_write_to_read"):
        assert 0 < wake[key]["p10"] <= wake[key]["median"] <= wake[key]["p90"], key
    assert "Producer/consumer: how soon does the consumer wake?" in out.stdout
    assert "Do the waits' spins pay" in out.stdout and "spins do not lose busy" in out.stdout
    assert out_png.stat().st_size > 10_000 and out_png.read_bytes()[:4] == b"\x89PNG"
    assert "What does handing memory to another process cost?" in out.stdout and "targets:" in out.stdout
    assert "The floors" in out.stdout and "load average" in out.stdout


def test_bench_rejects_bad_sizes() -> None:
    out = subprocess.run([sys.executable, "-m", "vmmshare.cli", "bench", "--sizes", "lots"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "not a size" in out.stderr


@pytest.mark.parametrize("args, says", [
    (["--sizes", "0"], "--sizes"), (["--sizes", "4K", "--reps", "-1"], "--reps"), (["--clients", "0"], "--clients"),
    (["--seconds", "-1"], "--seconds"), (["--gpu", "--reps", "0"], "--reps"), (["--gpu", "--sizes", "0"], "--sizes"),
])
def test_bench_rejects_bad_numbers_before_starting(args: list[str], says: str) -> None:
    """A bad count or size is an argument error (exit 2), not a traceback from a helper process or a hang."""
    out = subprocess.run([sys.executable, "-m", "vmmshare.cli", "bench", *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
