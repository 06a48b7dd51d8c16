"""``python -m vmmshare.broker``: run the node broker (what `vmmshare broker` and the auto-start run)."""

from __future__ import annotations

import argparse
import io
import logging
import logging.handlers
import sys
from pathlib import Path

from .. import config
from .daemon import run

LOG_FILE_BYTES = 1 << 20  # a --log-file is rotated at this size, keeping one older file: at most 2 MiB on disk


class _PrivateRotatingLog(logging.handlers.RotatingFileHandler):
    """A size-rotated log that opens its file as the start lock is opened: never through a link, and only a regular
    file of this user (docs/security.md T2)."""

    def _open(self) -> io.TextIOWrapper:
        from os import O_APPEND, O_WRONLY

        from ..sockets.folder import FolderError, open_private

        try:
            return open(open_private(Path(self.baseFilename), O_WRONLY | O_APPEND), "a", encoding="utf-8")
        except FolderError as exc:
            raise OSError(str(exc)) from None


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
    parser.add_argument("--log-file", type=Path, default=None, help=argparse.SUPPRESS)  # the auto-start's broker.log
    args = parser.parse_args(argv)
    fmt = "%(asctime)s broker[%(process)d] %(levelname)s %(message)s"
    try:
        level = args.log_level or config.log_level()
    except config.ConfigError as exc:
        parser.error(str(exc))
    handlers: list[logging.Handler] = []
    if args.log_file is not None:  # rotated, so that a broker started and restarted for months keeps 2 MiB at most
        try:
            handlers.append(_PrivateRotatingLog(args.log_file, maxBytes=LOG_FILE_BYTES, backupCount=1))
        except OSError as exc:
            parser.error(f"--log-file {str(args.log_file)!r}: {exc.strerror or exc}")
    logging.basicConfig(level=level, format=fmt, handlers=handlers or None)
    try:
        settings = config.Config.from_env(broker=True)  # read once, here: everything below is handed it
    except config.ConfigError as exc:
        logging.getLogger("vmmshare.broker").error("bad configuration: %s", exc)
        return 2
    return run(settings, args.socket, args.idle, args.multi_user, args.ready_fd, args.auto)


if __name__ == "__main__":
    sys.exit(main())
