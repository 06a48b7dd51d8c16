#!/usr/bin/env python3
"""Mutation run over the broker ledger's checks: each check is deleted (or inverted) in turn, and the tests of the
sharing rules must fail on every such mutant.

For each mutant the source of its module (``vmmshare/books/ledger.py``, or ``trust.py`` / ``listing.py`` / ``usage.py``
beside it)
is rewritten in place (the test brokers are separate processes that import it), the test files run with
``pytest -x``, and the source is put back, also when the run is interrupted. A mutant is *killed* when some test
fails; the first failing test is reported.

    vmmshare stress mutate_ledger                 # every mutant, the three files in one pytest run
    vmmshare stress mutate_ledger --each-file     # which test of each file catches each mutant
    vmmshare stress mutate_ledger --only self_import --json out.json

Exit status 0 when every mutant was killed, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vmmshare.cli.console import NarrowHelp

ROOT = Path(__file__).resolve().parents[3]  # the source checkout: the mutants are made in its files
BROKER = ROOT / "src" / "vmmshare" / "broker"
FILES = ["tests/test_ledger.py", "tests/test_ledger_limits.py", "tests/test_broker_robustness.py",
         "tests/test_sharing_rules.py"]

# (name, what the check is, the source text, what the mutant has instead[, the module if not ledger.py]); each
# text occurs once in its module
MUTANTS: list[tuple[str, ...]] = [
    ("capacity", "a charge over the device's free capacity (207001)",
     "if m.size > free:", "if False:"),
    ("device_range", "a device id out of range (107001)",
     "if not 0 <= device < len(self.used):", "if False:"),
    ("gpu_range", "a GPU id beyond MAX_GPUS (107001)",
     "if m.device >= MAX_GPUS:", "if False:"),
    ("hold_owner", "a hold used by a client it is not of (107017)",
     "if found is None or found.client is not client:", "if found is None:"),
    ("release_own", "a release of a hold that is not the client's (107017)",
     "        self._own(client, hold)\n        self._release(client, hold)",
     "        self._release(client, hold)"),
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
     " or m.size != memory.size:", ":"),
    ("export_memfd", "an fd that is not the allocation's memfd (107000)",
     "if info is None or info[0] != size:", "if False:"),
    ("export_sealed", "a memfd that is not sealed against resizing (107000)",
     "if seals < 0 or seals & SIZE_SEALS != SIZE_SEALS or seals & WRITE_SEALS:", "if False:"),
    ("refused_export_fd", "a refused export closes the fd it came with",
     "            if fd >= 0:\n                self.close_fd(fd)\n            raise", "            raise"),
    ("revoke_by_importer", "rule 14: an importer revoking the export (207006)",
     "if m.hold in share.importers:", "if False:"),
    ("release_revokes", "rule 14: the exporter's free revokes its export",
     "if share.exporter is client and not self_import:", "if False:"),
    ("revoke_closes_fd", "rule 14: revocation lets the memfd go",
     "        self.close_fd(share.fd)\n        share.fd = -1", "        share.fd = -1"),
    ("unknown_handle", "rule 16: an unknown or revoked handle (107017)",
     "if share is None:\n            raise", "if False:\n            raise"),
    ("share_type_at_import", "an import (or trustlist) of another share type than exported (107000)",
     "if share.share_type != share_type:", "if False:"),
    ("trustlist_exporter_only", "rule 12: the trustlist set by another client (207006), here or across servers",
     "if share.exporter is not client:", "if False:"),
    ("pid_range", "rule 12: pids that are not positive 32-bit ints (107000)",
     "if not valid_pids(unique):\n        return None", "if False:\n        return None", "trust.py"),
    ("trustlist_max", "rule 12: more than 4096 entries, here or across servers (107000)",
     "if listed + new > MAX_TRUSTLIST:", "if False:", "trust.py"),
    ("trustlist_max_both", "rule 12: this server's pids past 4096 with other servers' pids on the list (107000)",
     "check_room(len(trust) + others, new)\n    usage", "check_room(len(trust), new)\n    usage", "trust.py"),
    ("remote_trustlist_max", "rule 12 across servers: other servers' entries past 4096 with this server's (107000)",
     "check_room(len(share.trust) + len(share.remote_trust), len(new))",
     "check_room(len(share.remote_trust), len(new))"),
    ("fabric_secret", "a FABRIC import without the handle's secret (107017)",
     "if share_type == FABRIC and not hmac.compare_digest(secret, share.secret):", "if False:"),
    ("self_import", "rule 13: the exporting process imports its own handle, trustlist or not",
     "own = client is share.exporter", "own = False"),
    ("self_import_by_pid", "rule 13: only the exporting connection skips the trustlist, not any with its pid",
     "own = client is share.exporter", "own = client.pid == share.exporter.pid"),
    ("pid_validation", "rule 11: an export with pid validation imported by anyone (flag inverted)",
     "if not own and not share.flags & C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION:",
     "if not own and share.flags & C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION:"),
    ("trustlist_member", "rule 11: an importer not on the trustlist (207006)",
     "    raise LedgerError(\n        f\"process",
     "    return\n    raise LedgerError(\n        f\"process", "trust.py"),
    ("pid_reuse", "rule 12: a trustlisted pid reused by another process (207006)",
     "if not same_process(share.trust[client.pid], client.identity):", "if False:", "trust.py"),
    ("remote_trust_member", "rule 11 across servers: a remote importer not on the trustlist (207006)",
     "if client.pid in share.trust or (client.server, client.pid) in share.remote_trust:", "if True:", "trust.py"),
    ("reply_as_request", "a reply type sent as a request (507022)",
     "if serve is None:", "if False:"),
    ("stray_fd", "an fd on a request that takes none is closed",
     "            self.close_fd(fd)\n            fd = -1", "            fd = -1"),
    ("listing_hides_handles", "listing: handle values hidden from other users",
     "if viewer.uid in (share.exporter.uid, 0) else", "if True else", "listing.py"),
    ("listing_page_rows", "listing: at most LIST_PAGE items a page",
     "while at < total and len(page_used) + len(page_gpus) + len(rows) < LIST_PAGE:", "while at < total:",
     "listing.py"),
    ("listing_page_bytes", "listing: a page fits one frame",
     "if at > offset and cost > budget:", "if False:", "listing.py"),
    ("listing_not_the_viewer", "listing: the asking connection is not counted among the clients",
     "others = len(self.clients) - (viewer in self.clients)", "others = len(self.clients)"),
    ("unseen_client", "a client the broker sees as pid 0 (207006)",
     "if pid <= 0:\n            raise LedgerError(", "if False:\n            raise LedgerError("),
    ("sender", "a request sent by another process than the connection's (207006)",
     "if sender is not None and sender != client.pid:\n            return", "if False:\n            return"),
    ("fail_closed", "a pid lookup that failed refuses the trustlist (207005)",
     "if failed:\n        pid = min(failed)", "if False:\n        pid = min(failed)", "trust.py"),
    ("never_rebind", "rule 12: a re-added pid keeps its binding, alive or dead (never rebound, never unbound)",
     "[pid for pid in unique if trust.get(pid, NOBODY) == NOBODY]", "list(unique)", "trust.py"),
    ("recharge", "memory an exporter freed is charged to the holder that keeps it alive (VMMSHARE_QUOTA_MEMORY)",
     "elif share is not None and memory.charger is client and not self._still_holds(client, memory, self_import):",
     "elif False:"),
    ("quota_connections", "a user's connections past VMMSHARE_QUOTA_CONNECTIONS (207005)",
     "if tally.connections >= self.quotas.connections:", "if False:", "usage.py"),
    ("quota_exports", "a user's exports past VMMSHARE_QUOTA_EXPORTS (207005)",
     "if exports >= self.quotas.exports:", "if False:", "usage.py"),
    ("quota_holds", "a user's holds past VMMSHARE_QUOTA_HOLDS (207005)",
     "if tally.holds >= self.quotas.holds:", "if False:", "usage.py"),
    ("quota_trustlist", "a user's trustlist entries past VMMSHARE_QUOTA_TRUSTLIST (207005)",
     "if new and held + new > self.quotas.trustlist:", "if False:", "usage.py"),
    ("quota_memory", "a user's device memory past VMMSHARE_QUOTA_MEMORY (207001)",
     "if size > self.memory_quota - charged:", "if False:", "usage.py"),
    ("fd_budget", "the broker's fds past its budget (207005)",
     "if self.fd_budget is not None and self.fds + count > self.fd_budget:", "if False:", "usage.py"),
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
    parser = NarrowHelp(prog="vmmshare stress mutate_ledger", description=__doc__.split("\n\n")[0])
    parser.add_argument("--each-file", action="store_true", help="run each test file on its own for every mutant")
    parser.add_argument("--only", nargs="*", default=None, help="mutant names to run (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one pytest run")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not (ROOT / "tests" / "conftest.py").is_file():
        parser.exit(2, f"{parser.prog}: error: mutants are made in a source checkout's files and caught by its tests; "
                       f"there are none at {ROOT}\n")
    chosen = [m for m in MUTANTS if args.only is None or m[0] in args.only]
    if not chosen:
        parser.error(f"no such mutant; known: {', '.join(m[0] for m in MUTANTS)}")
    modules = {m[4] if len(m) > 4 else "ledger.py" for m in MUTANTS}
    originals = {name: (BROKER / name).read_text() for name in modules}
    for m in MUTANTS:
        where = m[4] if len(m) > 4 else "ledger.py"
        if originals[where].count(m[2]) != 1:
            print(f"{m[0]}: its source text occurs {originals[where].count(m[2])} times in {where}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # restore the source on SIGTERM too
    results: list[dict[str, Any]] = []
    try:
        baseline, _ = run_tests(FILES, args.timeout)
        if baseline:
            print(f"the unmutated ledger fails {baseline}: fix that first", file=sys.stderr)
            return 2
        for entry in chosen:
            name, check, text, mutant = entry[:4]
            module = BROKER / (entry[4] if len(entry) > 4 else "ledger.py")
            module.write_text(originals[module.name].replace(text, mutant))
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
            module.write_text(originals[module.name])
    finally:
        for module_name, text in originals.items():
            (BROKER / module_name).write_text(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    survivors = [r["mutant"] for r in results if not r["killed"]]
    print(f"{len(results) - len(survivors)} of {len(results)} mutants killed" +
          (f"; survived: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
