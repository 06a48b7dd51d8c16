"""The ``vmmshare`` command line: broker, ls, demo, bench, doctor, version."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from . import __version__


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _ls(args: argparse.Namespace) -> int:
    from .broker.client import BrokerClient
    from .config import Config
    from .errors import AclError

    try:
        listing = BrokerClient(Config.from_env(), autostart=False).listing()
    except AclError as exc:
        print(f"vmmshare ls: {exc.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    rows: list[dict[str, Any]] = listing["exports"]
    print(f"broker pid {listing['broker_pid']}, {listing['clients']} client(s), {len(rows)} export(s)")
    for dev, used in sorted(listing["used"].items(), key=lambda kv: int(kv[0])):
        print(f"  device {dev}: {_size(used)} used of {_size(listing['capacity'])}")
    for dev, used in sorted(listing.get("gpu_used", {}).items(), key=lambda kv: int(kv[0])):
        print(f"  GPU {dev}: {_size(used)} allocated through vmmshare")
    if not rows:
        return 0
    head = ("HANDLE", "TYPE", "DEV", "SIZE", "OWNER", "PIDCHECK", "TRUSTLIST", "IMPORTERS")
    table = [head] + [
        (
            r["handle"], r["share_type"], ("gpu" if r.get("gpu") else "") + str(r["device"]),
            _size(r["size"]), str(r["owner_pid"]),
            "on" if r["pid_validation"] else "off",
            ",".join(map(str, r["trustlist"])) or "-", ",".join(map(str, r["importers"])) or "-",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


STRESS_DIR = Path(__file__).resolve().parents[2] / "stress"


def _stress(argv: list[str]) -> int:
    """Run `stress/NAME.py` of a source checkout with the remaining options."""
    scripts = sorted(p.stem for p in STRESS_DIR.glob("*.py") if not p.stem.startswith("_") and p.stem != "common")
    if not scripts:
        print(f"vmmshare stress: no stress scripts at {STRESS_DIR} (they ship with the source checkout)",
              file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in scripts:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"vmmshare stress: unknown run {argv[0]!r}", file=sys.stderr)
        print("usage: vmmshare stress NAME [options]   (NAME --help for its options)\nruns: " + ", ".join(scripts))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    import subprocess

    return subprocess.call([sys.executable, str(STRESS_DIR / f"{argv[0]}.py"), *argv[1:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vmmshare", description="Ascend-style VMM memory sharing on Linux.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    b = sub.add_parser("broker", help="run the node broker in the foreground")
    b.add_argument("--socket", help="socket path (default: $VMMSHARE_SOCKET or the per-user path)")
    b.add_argument("--idle", type=float, default=None, help="exit after this many idle seconds (default: never)")
    b.add_argument("--multi-user", action="store_true", help="let other users connect; the trustlist still decides")
    b.add_argument("--log-level", default=os.environ.get("VMMSHARE_LOG", "INFO"))
    sub.add_parser("stress", help="the long reliability runs in stress/ (NAME [options]; no NAME lists them)")
    sub.add_parser("bench", help="sharing costs against shared_memory, Pipe and torch, in one run (see --help)")
    d = sub.add_parser("demo", help="share memory between three processes and check every rule on the way")
    d.add_argument("--size", default="64M", help="bytes to share (K/M/G suffixes)")
    doc = sub.add_parser("doctor", help="what this machine offers, what each slower path costs, and the fix")
    doc.add_argument("--json", action="store_true")
    ls = sub.add_parser("ls", help="list the exports on this node")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own options
        from .bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["stress"]:
        return _stress(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "version":
        print(f"vmmshare {__version__}")
        return 0
    if args.command == "broker":
        from .broker.__main__ import main as broker_main

        forward = ["--log-level", args.log_level]
        if args.socket:
            forward += ["--socket", args.socket]
        if args.idle is not None:
            forward += ["--idle", str(args.idle)]
        if args.multi_user:
            forward.append("--multi-user")
        return broker_main(forward)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(["--size", args.size])
    if args.command == "doctor":
        from .doctor import run as doctor_run

        return doctor_run(args.json)
    if args.command == "ls":
        return _ls(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
