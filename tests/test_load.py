"""Load, CI-sized (the full run is `stress/load.py`: 64 clients x 1,000 cycles, see docs/reliability.md §4).

Eight client processes in four pairs each run fifty export / import / map / free cycles against one broker,
through `vmmshare.acl`: trustlisted imports must succeed and show the partner's marker, imports by a process that
is not on the trustlist must return 207006, nothing else may fail, and once the clients are gone the broker's fds,
the node's capacity and its export table are back where they started. Latencies are measured and reported, never
asserted on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

STRESS = Path(__file__).resolve().parents[1] / "src" / "vmmshare" / "cli" / "stress"

import common as c  # noqa: E402
import load  # noqa: E402

SEED = int(os.environ.get("VMMSHARE_STRESS_SEED", "20240917"))
CLIENTS, CYCLES = 8, 50


@pytest.mark.slow
def test_paired_clients_share_under_load_without_errors_or_leaks(tmp_path: Path) -> None:
    result = load.run(CLIENTS, CYCLES, None, SEED, refuse=0.25, workdir=tmp_path)
    assert result["violations"] == [], f"seed {SEED}: {json.dumps(result['violations'])[:2000]}"
    n = result["counts"]
    assert n["errors"] == 0 and n["data_errors"] == 0
    assert result["cycles_done"] == CLIENTS * CYCLES, "a pair stopped early"
    # both kinds of import happened, and every cycle ended in exactly one of them
    assert n["trusted_ok"] > 0 and n["refused_ok"] > 0
    assert n["trusted_ok"] + n["refused_ok"] == CLIENTS * CYCLES
    lat = result["latency_us"]
    assert lat["export"]["count"] == lat["malloc"]["count"] == lat["free"]["count"] == CLIENTS * CYCLES
    assert lat["import_map"]["count"] == n["trusted_ok"] and lat["import_refused"]["count"] == n["refused_ok"]
    assert result["broker_fds"]["end"] == result["broker_fds"]["baseline"]
    assert result["capacity"]["free_end"] == result["capacity"]["total"]
    assert c.processes_mentioning(str(tmp_path)) == []
