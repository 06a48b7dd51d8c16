"""`vmmshare cluster`, `vmmshare demo --fabric` and `vmmshare bench --fabric` as a user runs them (root and the
engine needed; CI has both). No timing is asserted: the bench's numbers are for docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require
from fabric_cluster import cluster_problem
from procs import clean_env

require(not cluster_problem(), cluster_problem())

CLI = [sys.executable, "-m", "vmmshare.cli"]


def vmmshare(*args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    # a hang guard only
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=600)


def test_cluster_up_status_exec_down() -> None:
    name = f"c{os.getpid() % 10000}"
    up = vmmshare("cluster", "up", "--name", name, "--servers", "3", "--timeout", "2")
    try:
        assert up.returncode == 0, up.stderr
        assert "server 3:" in up.stdout and "VMMSHARE_FABRIC_ADDR=10.77.0.3" in up.stdout
        status = vmmshare("cluster", "status", "--name", name)
        assert status.returncode == 0 and "VMMSHARE_FABRIC_TIMEOUT=2" in status.stdout
        ran = vmmshare("cluster", "exec", "2", "--name", name, "--", sys.executable, "-c",
                       "import os; print(os.environ['VMMSHARE_SERVER_ID'], os.environ['VMMSHARE_FABRIC_ADDR'])")
        assert ran.returncode == 0 and ran.stdout.split()[1] == "10.77.0.2", ran.stderr
        again = vmmshare("cluster", "up", "--name", name)
        assert again.returncode == 1 and "up already" in again.stderr and "Traceback" not in again.stderr
        key = Path(f"/run/vmmshare-cluster/{name}/cluster.key")
        assert key.stat().st_mode & 0o777 == 0o600 and key.stat().st_size >= 32
    finally:
        down = vmmshare("cluster", "down", "--name", name)
    assert down.returncode == 0 and "is down" in down.stdout
    gone = vmmshare("cluster", "status", "--name", name)
    assert gone.returncode == 1 and "is not up" in gone.stderr
    bad = vmmshare("cluster", "up", "--name", "Bad-Name")
    assert bad.returncode == 2 and "cluster name" in bad.stderr


@pytest.mark.slow
def test_a_cluster_of_64_servers_reaches_every_server_and_leaves_nothing() -> None:
    """Past 33 servers on one bridge, the learned ARP entries (N(N-1)) outgrew the kernel's neighbour table and
    servers stopped reaching each other; `up` refused more than 8. Now every server knows every other as a
    permanent neighbour, up to the /24's 254, and `down` leaves no namespace or folder behind."""
    name = f"b{os.getpid() % 100000}"
    up = vmmshare("cluster", "up", "--name", name, "--servers", "64")
    try:
        assert up.returncode == 0, up.stderr
        for n in (1, 33, 64):
            neigh = subprocess.run(["ip", "-n", f"vmms-{name}-{n}", "neigh", "show", "nud", "permanent"],
                                   capture_output=True, text=True, timeout=60).stdout
            assert len(neigh.splitlines()) == 63, neigh
        server = ("import socket\ns = socket.create_server(('10.77.0.64', 5555))\nprint('up', flush=True)\n"
                  "c, _ = s.accept()\nc.sendall(c.recv(4))")
        listener = subprocess.Popen(["ip", "netns", "exec", f"vmms-{name}-64", sys.executable, "-c", server],
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
            client = ("import socket\nc = socket.create_connection(('10.77.0.64', 5555), timeout=10)\n"
                      "c.sendall(b'ping')\nprint(c.recv(4).decode())")
            ran = vmmshare("cluster", "exec", "1", "--name", name, "--", sys.executable, "-c", client)
            assert ran.returncode == 0 and ran.stdout.strip() == "ping", ran.stderr
        finally:
            listener.kill()
            listener.wait(30)
        status = vmmshare("cluster", "status", "--name", name)
        assert status.returncode == 0 and "server 64:" in status.stdout
    finally:
        down = vmmshare("cluster", "down", "--name", name)
    assert down.returncode == 0 and "is down" in down.stdout
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=60).stdout
    assert f"vmms-{name}-" not in namespaces
    assert not Path(f"/run/vmmshare-cluster/{name}").exists()
    too_many = vmmshare("cluster", "up", "--name", name, "--servers", "255")
    assert too_many.returncode == 2 and "1 to 254 servers" in too_many.stderr


def test_cluster_up_needs_root_and_says_so() -> None:
    env = clean_env()
    out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *CLI, "cluster",
                          "up", "--name", "nr"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "needs root" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_demo_fabric_shares_across_two_servers() -> None:
    out = vmmshare("demo", "--fabric")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "'hello from server 1'" in out.stdout and "'and back from server 2'" in out.stdout
    assert "207006" in out.stdout and "every step behaved" in out.stdout


@pytest.mark.slow
def test_bench_fabric_reports_every_ratio(tmp_path: Path) -> None:
    path = tmp_path / "fabric.json"
    out = vmmshare("bench", "--fabric", "--sizes", "1M,4M", "--reps", "2", "--latency-reps", "20", "--json",
                   str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(path.read_text())
    assert set(res["throughput"]) == {"read 1 MiB", "read 4 MiB", "write 1 MiB", "write 4 MiB"}
    for row in res["throughput"].values():
        assert set(row) == {"vmmshare", "c", "engine", "engine_to_broker", "tcp"} and all(v > 0 for v in row.values())
    assert res["ratios"]["latency_4k_vs_engine"] > 0 and res["import_map_us"]["median"] > 0
    assert res["ratios"]["c_latency_4k_vs_engine"] > 0 and set(res["ratios"]["c_throughput_vs_engine"]) == set(
        res["throughput"])
    assert "4 KiB read latency" in out.stdout and "import + reserve + map" in out.stdout


@pytest.mark.slow
def test_bench_fabric_servers_verifies_every_import_of_both_phases_and_leaves_nothing(tmp_path: Path) -> None:
    """All-to-all on 3 servers: all at once, then paced two at a time (two waves), each server imports and
    byte-checks the other two's shares (6 imports a phase); the figures of each measure and the target lines are
    there, and `cluster down` left no namespace, process or /dev/shm entry of the run."""
    path = tmp_path / "scale.json"
    out = vmmshare("bench", "--fabric", "--servers", "3", "--at-once", "2", "--idle-seconds", "0.5",
                   "--fabric-timeout", "1", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    (res,) = json.loads(path.read_text())
    assert res["servers"] == 3 and res["imports"] == 6, res
    for phase, waves in (("all_at_once", 1), ("paced", 2)):
        ph = res[phase]
        assert ph["verified"] == 6 and ph["failed"] == [] and ph["waves"] == waves, (phase, ph)
        assert 0 < ph["later_ms"]["median"] <= ph["later_ms"]["p99"] <= ph["later_ms"]["max"], (phase, ph)
        assert set(ph["cpu_per_import_ms"]) == {"client", "broker loop", "metadata service"}, ph
    assert res["all_at_once"]["first_ms"]["median"] > 0 and res["paced"]["first_ms"] is None, res
    assert res["paced"]["at_once"] == 2 and res["lone_ms"]["median"] > 0
    assert res["left_behind"] == [], res["left_behind"]
    assert res["idle_brokers_cores"] >= 0 and set(res["idle_cores_by_part"]) >= {"broker loop", "metadata service"}
    assert set(res["targets"]) == {"later_median_paced_vs_lone", "later_p99_paced_ms", "first_import_ms",
                                   "idle_brokers_cores", "killed_broker_slowest_copy_s"}, res["targets"]
    killed = res["killed"]  # server 2's broker killed: both others' copies from it fail, none hangs
    assert killed["copies"] == killed["failed"] == 6 and killed["codes"] == [507022], killed
    assert killed["holds_freed_after_s"] is not None and killed["holds_freed_after_s"] >= killed["lease_s"] / 2
    assert res["targets"]["killed_broker_slowest_copy_s"]["met"], killed
    text = out.stdout
    assert "all at once (3 importing)" in text and "paced (2 at a time)" in text, text
    for line in ("later import median, paced / lone importer's", "later import p99, paced, ms",
                 "first import of a fresh process (the lone one), ms", "idle CPU of all brokers, cores",
                 "killed broker: slowest failed copy from it, s"):
        shown = [row for row in text.splitlines() if line in row]
        assert len(shown) == 1 and shown[0].split()[-1] in ("met", "MISSED"), (line, text)
    assert "cluster down left nothing" in text and "Traceback" not in out.stderr
    assert "killed broker (server 2): 6/6 copies from it failed (codes 507022)" in text, text


@pytest.mark.parametrize("servers", ["1", "255", "4,x", ""])
def test_bench_fabric_servers_refuses_a_count_out_of_range(servers: str) -> None:
    out = vmmshare("bench", "--fabric", "--servers", servers)
    assert out.returncode == 2 and "--servers" in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("at_once", ["0", "-1", "x", "2.5", ""])
def test_bench_fabric_servers_refuses_a_pace_that_is_not_a_count(at_once: str) -> None:
    out = vmmshare("bench", "--fabric", "--servers", "3", "--at-once", at_once)
    assert out.returncode == 2 and "argument --at-once" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "at least 1" in out.stderr or "not a whole number" in out.stderr, out.stderr
    assert out.stdout == "", out.stdout
