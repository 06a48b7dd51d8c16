"""``python -m vmmshare.broker``: run the node broker (what `vmmshare broker` and the auto-start run)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .. import config


def _level(text: str) -> str:
    if text.strip().upper() not in config.LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: use one of {', '.join(config.LOG_LEVELS)}")
    return text.strip().upper()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vmmshare broker", description="Run the node's sharing broker.")
    parser.add_argument("--socket", type=Path, help="socket path (default: $VMMSHARE_SOCKET or the per-user path)")
    parser.add_argument("--idle", type=float, default=None,
                        help="exit after this many seconds with no client and nothing held (default: never)")
    parser.add_argument("--multi-user", action="store_true", help="let other users connect (socket 0666)")
    parser.add_argument("--auto", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready-fd", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", type=_level, default=None,
                        help=f"{', '.join(config.LOG_LEVELS)} (default: $VMMSHARE_LOG, else INFO)")
    args = parser.parse_args(argv)
    fmt = "%(asctime)s broker[%(process)d] %(levelname)s %(message)s"
    try:
        level = args.log_level or config.log_level()
    except config.ConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=level, format=fmt)
    try:
        from .daemon import run  # reads VMMSHARE_BROKER_SPIN_US
    except config.ConfigError as exc:
        logging.getLogger("vmmshare.broker").error("bad configuration: %s", exc)
        return 2
    return run(args.socket, args.idle, args.multi_user, args.ready_fd, args.auto)


if __name__ == "__main__":
    sys.exit(main())
