"""The ``vmmshare`` command line: broker, ls, demo, bench, stress, doctor, cluster, prefix, version.

Every command except doctor first checks the VMMSHARE_* variables (doctor reports them as findings); exit codes
are those of `console` (0 done, 1 failed, 2 usage or configuration, 3 another broker serves the path).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .. import __version__, config
from .console import (
    FAILED,
    IN_USE,
    OK,
    USAGE,
    Parser,
    Progress,
    environment_ok,
    run_main,
    say_error,
    seconds_option,
    socket_folder_problem,
)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- option types (their errors name the option)


def _level(text: str) -> str:
    if text.strip().upper() not in config.LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: use one of {', '.join(config.LOG_LEVELS)}")
    return text.strip().upper()


def _socket(text: str) -> Path:
    try:
        return config.check_socket_path(text, "--socket")
    except config.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--socket ")) from None


# ---------------------------------------------------------------- ls


def _ls(args: argparse.Namespace, settings: config.Config) -> int:
    from ..client.connection import BrokerClient
    from ..errors import AclError

    client = BrokerClient(settings, autostart=False)
    try:
        listing = client.listing()
    except AclError as exc:
        say_error("vmmshare ls", exc.message)
        return FAILED
    finally:
        client.close()
    if args.json:
        print(json.dumps(listing, indent=2))
        return OK
    rows: list[dict[str, Any]] = listing["exports"]
    print(f"broker pid {listing['broker_pid']}, {listing['clients']} client(s), {len(rows)} export(s)")
    for dev, used in sorted(listing["used"].items(), key=lambda kv: int(kv[0])):
        print(f"  device {dev}: {_size(used)} used of {_size(listing['capacity'])}")
    for dev, used in sorted(listing.get("gpu_used", {}).items(), key=lambda kv: int(kv[0])):
        print(f"  GPU {dev}: {_size(used)} allocated through vmmshare")
    if not rows:
        return OK
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
    return OK


# ---------------------------------------------------------------- broker


def _broker(args: argparse.Namespace, settings: config.Config) -> int:
    from ..broker.__main__ import main as broker_main
    from ..broker.system import answers

    prog = "vmmshare broker"
    path, source = (args.socket, "--socket") if args.socket is not None else (settings.socket_path, "VMMSHARE_SOCKET")
    if config.socket_activated():  # systemd passed the socket: the broker checks it
        pass
    elif problem := socket_folder_problem(path):
        say_error(prog, f"{source} {str(path)!r}: {problem}")
        return USAGE
    elif answers(path):
        say_error(prog, f"a broker already serves {path}: stop it first, or choose another path with --socket")
        return IN_USE
    forward = ["--socket", str(path), "--log-level", args.log_level or settings.log_level]
    if args.idle is not None:
        forward += ["--idle", repr(args.idle)]
    if args.multi_user:
        forward.append("--multi-user")
    return broker_main(forward)


# ---------------------------------------------------------------- stress


STRESS_DIR = Path(__file__).resolve().parent / "stress"  # shipped in the package: a wheel carries them


STRESS_RUNS = ("faults", "fabric_faults", "flood", "fuzz_api", "fuzz_protocol", "identity", "load", "mutate_ledger")


def _stress(argv: list[str]) -> int:
    """Run `vmmshare/cli/stress/NAME.py` with the remaining options; its output passes through this process
    (a closed pipe ends the relay quietly), with a status line on a terminal while it runs."""
    scripts = sorted(p.stem for p in STRESS_DIR.glob("*.py") if p.stem in STRESS_RUNS)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in scripts:
        if argv and argv[0] not in ("-h", "--help"):
            say_error("vmmshare stress", f"unknown run {argv[0]!r}")
        print("usage: vmmshare stress NAME [options]   (NAME --help for its options)\nruns: " + ", ".join(scripts))
        return OK if not argv or argv[0] in ("-h", "--help") else USAGE
    if not environment_ok("vmmshare stress"):
        return USAGE
    import os
    import subprocess

    cmd = [sys.executable, str(STRESS_DIR / f"{argv[0]}.py"), *argv[1:]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    try:
        with Progress(f"vmmshare stress {argv[0]}") as progress:
            progress.step("running")
            for line in proc.stdout:
                progress.emit(line)
    except OSError:  # nobody reads any more, or stdout is full: let the run finish (it cleans up), unheard
        for _ in proc.stdout:
            pass
        raise
    finally:
        proc.stdout.close()
        proc.wait()
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


# ---------------------------------------------------------------- prefix


def _prefix() -> int:
    """Print the CANN-like root of the C interface (headers, libascendcl.so, CMake and pkg-config, set_env.sh)."""
    from ..sdk import SdkError, root

    try:
        print(root())
    except SdkError as exc:
        say_error("vmmshare prefix", str(exc))
        return FAILED
    return OK


# ---------------------------------------------------------------- the command line


def _parser() -> Parser:
    parser = Parser(prog="vmmshare", description="Ascend-style VMM memory sharing on Linux.",
                    epilog="exit status: 0 done, 1 failed, 2 bad usage or configuration, 3 (broker) another broker "
                           "serves the path, 141 output closed early")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print the version")
    b = sub.add_parser("broker", help="run the node broker in the foreground")
    b.add_argument("--socket", type=_socket,
                   help="socket path, at most 107 bytes (default: $VMMSHARE_SOCKET or the per-user path); the "
                        "broker creates its folder, not the folders above it")
    b.add_argument("--idle", type=seconds_option, default=None, metavar="SECONDS",
                   help="exit after this many seconds with no client and nothing held (default: never)")
    b.add_argument("--multi-user", action="store_true", help="let other users connect; the trustlist still decides")
    b.add_argument("--log-level", type=_level, default=None, metavar="LEVEL",
                   help=f"{', '.join(config.LOG_LEVELS)} (default: $VMMSHARE_LOG, else INFO)")
    sub.add_parser("demo", help="three processes share memory, every rule checked on the way (see demo --help)")
    sub.add_parser("bench", help="sharing costs against shared_memory, Pipe and torch, in one run (see bench --help)")
    sub.add_parser("stress", help="the long reliability runs in stress/ (NAME [options]; no NAME lists them)")
    sub.add_parser("cluster", help="a test cluster of servers on this machine, for the fabric (up|down|status|exec)")
    doc = sub.add_parser("doctor", help="what this machine offers, what each slower path costs, and the fix")
    doc.add_argument("--json", action="store_true", help="print the findings as JSON")
    sub.add_parser("prefix", help="print the root to build C programs against (source its set_env.sh; see docs/c.md)")
    ls = sub.add_parser("ls", help="list the exports on this node")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _main(argv: list[str]) -> int:
    asks_help = bool({"-h", "--help"} & set(argv[1:]))
    # bench and demo parse their own options (and --help needs no configuration): check the variables first
    if argv[:1] in (["bench"], ["demo"]) and not asks_help and not environment_ok(f"vmmshare {argv[0]}"):
        return USAGE
    if argv[:1] == ["bench"]:  # its own options and help
        from .bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["stress"]:
        return _stress(argv[1:])
    if argv[:1] == ["cluster"]:  # its own options and help
        if not asks_help and not environment_ok("vmmshare cluster"):  # its servers run with this environment
            return USAGE
        from .cluster import main as cluster_main

        return cluster_main(argv[1:])
    if argv[:1] == ["demo"]:  # its own options and help
        from .demo import main as demo_main

        return demo_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None and not args.version:
        parser.error("give a command (or --version)")
    if args.command == "doctor":
        from .doctor import run as doctor_run

        return doctor_run(args.json)
    if args.command == "prefix":  # needs no configuration: it only names files
        return _prefix()
    prog = f"vmmshare {args.command}" if args.command else "vmmshare"
    if not environment_ok(prog):
        return USAGE
    if args.version or args.command == "version":
        print(f"vmmshare {__version__}")
        return OK
    settings = config.Config.from_env()  # read once (every variable was just found usable), handed down
    if args.command == "broker":
        return _broker(args, settings)
    return _ls(args, settings)


def main(argv: list[str] | None = None) -> int:
    """The `vmmshare` console script."""
    args = sys.argv[1:] if argv is None else argv
    prog = f"vmmshare {args[0]}" if args and not args[0].startswith("-") else "vmmshare"
    return run_main(lambda: _main(args), prog)

