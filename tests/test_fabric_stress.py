"""Faults across servers, CI-sized (the long run is `stress/faults.py --fabric`): SIGKILL of the exporter, the
importer and either broker at random points while the importer reads and writes: no wrong bytes, no hang, no leak.
The seed is fixed (VMMSHARE_STRESS_SEED overrides it); a failure's message carries it and the violations."""

from __future__ import annotations

import os

import pytest

from conftest import require
from fabric_cluster import cluster_problem

require(not cluster_problem(), cluster_problem())


import fabric_faults  # noqa: E402

SEED = int(os.environ.get("VMMSHARE_STRESS_SEED", "20261201"))


@pytest.mark.slow
def test_random_kills_across_servers_leave_no_wrong_bytes_and_no_leak() -> None:
    result = fabric_faults.run(8, SEED)
    assert result["trials"] == 8 and all(n == 2 for n in result["by_victim"].values())
    assert result["violations"] == [], f"seed {SEED}: {result['violations']}"
    assert result["reads"] > 8  # the importers did read through the transport, trial after trial
