"""The ``vmmshare`` command line and its tools (demo, bench, doctor, cluster, stress); the library never imports it."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The `vmmshare` console script. The command line loads here, not when the script starts: a Ctrl-C while it
    loads ends the command with 130 (as one later does), not with a traceback of the import it cut short."""
    try:
        from .commands import main as run
    except KeyboardInterrupt:
        return 130
    return run(argv)
