"""`vmmshare ls`: what the node's broker holds, as JSON and as a table; no broker is started for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from procs import PROP, Actor, BrokerProc, MiB2, clean_env, ok

DEFAULT, FABRIC = 1, 2


@pytest.fixture
def actors(broker: BrokerProc) -> Iterator[list[Actor]]:
    made: list[Actor] = []
    yield made
    for a in made:
        a.kill()


def ls(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    # the timeout is a hang guard only; nothing asserts on time
    return subprocess.run(
        [sys.executable, "-m", "vmmshare.cli", "ls", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_ls_shows_an_export_its_trustlist_and_importer(broker: BrokerProc, actors: list[Actor]) -> None:
    e, i, bystander = Actor(broker.env), Actor(broker.env), Actor(broker.env)
    actors += [e, i, bystander]
    h = ok(e, "rt.malloc_physical", MiB2, PROP, 0)
    sh = ok(e, "rt.mem_export_to_shareable_handle_v2", h, 0, DEFAULT)
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", sh, DEFAULT, [i.pid])
    ok(i, "rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0)
    handle = f"{sh:#018x}"

    out = ls(broker.env, "--json")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    assert listing["broker_pid"] == broker.pid
    assert listing["exports"] == [
        {
            "handle": handle,
            "share_type": "default",
            "device": 0,
            "gpu": False,
            "size": MiB2,
            "owner_pid": e.pid,
            "pid_validation": True,
            "trustlist": [i.pid],
            "importers": [i.pid],
            "importer_count": 1,
        }
    ]
    assert listing["used"] == {"0": MiB2}  # exporter and importer share one allocation

    table = ls(broker.env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "1 export(s)" in lines[0]
    row = next(line for line in lines if handle in line)
    cells = row.split()
    assert cells[:5] == [handle, "default", "0", "2", "MiB"]
    assert str(e.pid) in cells and "on" in cells
    assert cells[-2:] == [str(i.pid), str(i.pid)]  # trustlist, importers


def test_ls_lists_fabric_exports_without_pid_validation(broker: BrokerProc, actors: list[Actor]) -> None:
    e, i, j = Actor(broker.env), Actor(broker.env), Actor(broker.env)
    actors += [e, i, j]
    h = ok(e, "rt.malloc_physical", MiB2, PROP, 0)
    fabric = ok(e, "rt.mem_export_to_shareable_handle_v2", h, 1, FABRIC)
    ok(i, "rt.mem_import_from_shareable_handle_v2", fabric, FABRIC, 0)
    ok(j, "rt.mem_import_from_shareable_handle_v2", fabric, FABRIC, 0)
    node_handle = int.from_bytes(fabric[16:24], "little")

    listing = json.loads(ls(broker.env, "--json").stdout)
    (row,) = listing["exports"]
    assert row["handle"] == f"{node_handle:#018x}"
    assert row["share_type"] == "fabric" and row["pid_validation"] is False
    assert row["trustlist"] == [] and row["importers"] == sorted([i.pid, j.pid])

    table = ls(broker.env).stdout
    row_line = next(line for line in table.splitlines() if row["handle"] in line)
    assert "fabric" in row_line.split() and "off" in row_line.split()


def test_ls_forgets_revoked_exports(broker: BrokerProc, actors: list[Actor]) -> None:
    e = Actor(broker.env)
    actors.append(e)
    h = ok(e, "rt.malloc_physical", MiB2, PROP, 0)
    sh = ok(e, "rt.mem_export_to_shareable_handle_v2", h, 0, DEFAULT)
    assert [r["handle"] for r in json.loads(ls(broker.env, "--json").stdout)["exports"]] == [f"{sh:#018x}"]
    ok(e, "rt.free_physical", h)
    listing = json.loads(ls(broker.env, "--json").stdout)
    assert listing["exports"] == [] and listing["used"] == {}
    table = ls(broker.env)
    assert table.returncode == 0 and "0 export(s)" in table.stdout and f"{sh:#018x}" not in table.stdout


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_ls_without_a_broker_fails_and_starts_none(tmp_path: Path, as_json: bool) -> None:
    folder = tmp_path / "nobroker"
    sock = folder / "broker.sock"
    env = {**clean_env(), "VMMSHARE_SOCKET": str(sock)}
    out = ls(env, *(["--json"] if as_json else []))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stdout == ""
    assert "broker" in out.stderr and str(sock) in out.stderr
    assert not folder.exists(), "ls prepared or started a broker"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert str(sock).encode() not in cmdline, f"pid {pid} serves {sock}: ls started a broker"
