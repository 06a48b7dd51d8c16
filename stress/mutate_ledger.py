#!/usr/bin/env python3
"""Mutation run over the broker ledger's checks: each check is deleted (or inverted) in turn, and the tests of the
sharing rules must fail on every such mutant.

For each mutant the source of ``vmmshare/broker/ledger.py`` is rewritten in place (the test brokers are separate
processes that import it), the test files run with ``pytest -x``, and the source is put back, also when the run is
interrupted. A mutant is *killed* when some test fails; the first failing test is reported.

    .venv/bin/python stress/mutate_ledger.py                 # every mutant, the three files in one pytest run
    .venv/bin/python stress/mutate_ledger.py --each-file     # which test of each file catches each mutant
    .venv/bin/python stress/mutate_ledger.py --only self_import --json out.json

Exit status 0 when every mutant was killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LEDGER = ROOT / "src" / "vmmshare" / "broker" / "ledger.py"
FILES = ["tests/test_ledger.py", "tests/test_broker_robustness.py", "tests/test_sharing_rules.py"]

# (name, what the check is, the source text, what the mutant has instead); each text occurs once in ledger.py
MUTANTS: list[tuple[str, str, str, str]] = [
    ("capacity", "a charge over the device's free capacity (207001)",
     "if m.size > free:", "if False:"),
    ("device_range", "a device id out of range (107001)",
     "if not 0 <= device < len(self.used):", "if False:"),
    ("gpu_range", "a GPU id beyond MAX_GPUS (107001)",
     "if m.device >= MAX_GPUS:", "if False:"),
    ("hold_owner", "a hold used by a client it is not of (107017)",
     "if found is None or found.client is not client:", "if found is None:"),
    ("release_own", "a release of a hold that is not the client's (107017)",
     "        self._own(client, m.hold)\n        self._release(client, m.hold)",
     "        self._release(client, m.hold)"),
    ("export_once", "rule 9: a second export of one allocation (107000)",
     "if memory.share is not None:", "if False:"),
    ("export_flags", "rule 10: export flags other than 0 and 1 (107000)",
     "if m.flags not in (0, 1) or m.share_type", "if m.share_type"),
    ("export_share_type", "rule 10: a share type other than 1 and 2 (107000)",
     "or m.share_type not in (1, 2) or m.memory_kind", "or m.memory_kind"),
    ("export_kind", "an export of another memory kind than charged (107000)",
     "or m.memory_kind != memory.kind:", ":"),
    ("export_no_fd", "an export without an fd (107000)",
     "if fd < 0 or m.size != memory.size", "if m.size != memory.size"),
    ("export_size", "an export whose size is not the allocation's (107000)",
     "or m.size != memory.size or (memory.kind", "or (memory.kind"),
    ("export_memfd", "an fd that is not the allocation's memfd (107000)",
     "(memory.kind == KIND_HOST and self.memfd_size(fd) != m.size)", "False"),
    ("refused_export_fd", "a refused export closes the fd it came with",
     "            if fd >= 0:\n                self.close_fd(fd)\n            raise", "            raise"),
    ("revoke_by_importer", "rule 14: an importer revoking the export (207006)",
     "if m.hold in share.importers:", "if False:"),
    ("release_revokes", "rule 14: the exporter's free revokes its export",
     "if share.exporter is client and hold not in share.importers:", "if False:"),
    ("revoke_closes_fd", "rule 14: revocation lets the memfd go",
     "        self.close_fd(share.fd)\n        share.fd = -1", "        share.fd = -1"),
    ("unknown_handle", "rule 16: an unknown or revoked handle (107017)",
     "if share is None:\n            raise", "if False:\n            raise"),
    ("share_type_at_import", "an import (or trustlist) of another share type than exported (107000)",
     "if share.share_type != share_type:", "if False:"),
    ("trustlist_exporter_only", "rule 12: the trustlist set by another client (207006)",
     "if share.exporter is not client:", "if False:"),
    ("pid_range", "rule 12: pids that are not positive 32-bit ints (107000)",
     "if any(p <= 0 or p > 0x7FFFFFFF for p in pids):", "if False:"),
    ("trustlist_max", "rule 12: more than 4096 pids (107000)",
     "if len(trust) + len(new) > MAX_TRUSTLIST:", "if False:"),
    ("fabric_secret", "a FABRIC import without the handle's secret (107017)",
     "if m.share_type == FABRIC and not hmac.compare_digest(m.secret, share.secret):", "if False:"),
    ("self_import", "rule 13: the exporting process importing its own handle (107000)",
     "if client.pid == share.exporter.pid:", "if False:"),
    ("pid_validation", "rule 11: an export with pid validation imported by anyone (flag inverted)",
     "if not share.flags & C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION:",
     "if share.flags & C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION:"),
    ("trustlist_member", "rule 11: an importer not on the trustlist (207006)",
     "if client.pid not in share.trust:", "if False:"),
    ("pid_reuse", "rule 12: a trustlisted pid reused by another process (207006)",
     "if not same_process(share.trust[client.pid], client.identity):", "if False:"),
    ("reply_as_request", "a reply type sent as a request (507022)",
     "if serve is None:", "if False:"),
    ("stray_fd", "an fd on a request that takes none is closed",
     "            self.close_fd(fd)\n            fd = -1", "            fd = -1"),
    ("listing_hides_handles", "listing: handle values hidden from other users",
     "if viewer.uid in (share.exporter.uid, 0) else", "if True else"),
    ("listing_page_rows", "listing: at most LIST_PAGE rows a page",
     "if len(rows) >= LIST_PAGE:", "if False:"),
    ("listing_page_bytes", "listing: a page fits one frame",
     "if rows and budget - len(row) - 1 < 0:", "if False:"),
]


def run_tests(files: list[str], timeout: float) -> tuple[str, float]:
    """The first failing test of a `pytest -x` run over `files` ('' when all passed), and the seconds it took."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # no compiled mutant left behind
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", *files]
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "(timed out: counted as caught)", time.perf_counter() - start
    elapsed = time.perf_counter() - start
    if out.returncode == 0:
        return "", elapsed
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M)
    return (found.group(1) if found else f"(pytest exit {out.returncode})"), elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--each-file", action="store_true", help="run each test file on its own for every mutant")
    parser.add_argument("--only", nargs="*", default=None, help="mutant names to run (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one pytest run")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only is None or m[0] in args.only]
    if not chosen:
        parser.error(f"no such mutant; known: {', '.join(m[0] for m in MUTANTS)}")
    original = LEDGER.read_text()
    for name, _, text, _ in MUTANTS:
        if original.count(text) != 1:
            print(f"{name}: its source text occurs {original.count(text)} times in {LEDGER}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # restore the source on SIGTERM too
    results: list[dict[str, Any]] = []
    try:
        baseline, _ = run_tests(FILES, args.timeout)
        if baseline:
            print(f"the unmutated ledger fails {baseline}: fix that first", file=sys.stderr)
            return 2
        for name, check, text, mutant in chosen:
            LEDGER.write_text(original.replace(text, mutant))
            caught: dict[str, str] = {}
            groups = [[f] for f in FILES] if args.each_file else [FILES]
            seconds = 0.0
            for group in groups:
                failed, took = run_tests(group, args.timeout)
                seconds += took
                caught[" ".join(group)] = failed
            killed = any(caught.values())
            results.append({"mutant": name, "check": check, "killed": killed, "caught_by": caught,
                            "seconds": round(seconds, 1)})
            first = next((t for t in caught.values() if t), "SURVIVED")
            print(f"{'killed  ' if killed else 'SURVIVED'} {name:24s} {first}", flush=True)
            LEDGER.write_text(original)
    finally:
        LEDGER.write_text(original)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    survivors = [r["mutant"] for r in results if not r["killed"]]
    print(f"{len(results) - len(survivors)} of {len(results)} mutants killed" +
          (f"; survived: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
