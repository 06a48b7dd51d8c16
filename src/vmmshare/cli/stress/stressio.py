"""What the stress runs share at their edges: option types (a bad value is a usage error, exit 2, naming the
option), the results' one output form, and the Ctrl-C rule (exit 130, no traceback, in every process of a run).

Results: a few readable lines on stdout; `--json FILE` also writes the whole result there as JSON, and `--json -`
puts that JSON on stdout instead (the lines then go to stderr, so that stdout stays parseable).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

from vmmshare.cli.console import count_option, interruptible, run_main, seconds_option


def prog(script: str) -> str:
    """How a run names itself in its messages: as the user started it, `vmmshare stress NAME`."""
    return f"vmmshare stress {Path(script).stem}"


__all__ = ["count_option", "emit", "entry", "even_count", "fraction", "kinds", "prog", "readable", "seconds_option",
           "whole"]


def even_count(text: str) -> int:
    """A count of processes that pair up: a whole number, at least 2, even."""
    value = whole(text)
    if value < 2 or value % 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not an even number of at least 2 (they work in pairs)")
    return value


def whole(text: str) -> int:
    """A whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def fraction(text: str) -> float:
    """A fraction: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction from 0 to 1")
    return value


def kinds(allowed: Iterable[str]) -> Callable[[str], list[str]]:
    """A comma-separated choice of some of `allowed`, at least one, each once."""
    known = tuple(allowed)

    def parse(text: str) -> list[str]:
        chosen = [k.strip() for k in text.split(",") if k.strip()]
        bad = [k for k in chosen if k not in known]
        if bad or not chosen:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad)) or repr(text)}: choose from "
                                             f"{','.join(known)} (comma-separated)")
        return list(dict.fromkeys(chosen))

    return parse


def readable(value: Any) -> str:
    """A result value as a person reads it: a mapping as `key value, ...`, a list comma-separated, no braces."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {readable(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list | tuple):
        return ", ".join(readable(v) for v in value) or "-"
    return str(value)


def emit(lines: Iterable[str], result: dict[str, Any], json_to: str | Path | None) -> None:
    """Report a run: `lines` on stdout, and the JSON of `result` in the `--json` file (with "-", on stdout, the
    lines then going to stderr)."""
    text = json.dumps(result, indent=2, sort_keys=True, default=str)
    to_stdout = str(json_to) == "-"
    for line in lines:
        print(line, file=sys.stderr if to_stdout else sys.stdout, flush=True)
    if to_stdout:
        print(text, flush=True)
    elif json_to:
        try:
            Path(json_to).write_text(text + "\n")
        except OSError as exc:  # a failed write names no file (a full disk): this one is named
            raise OSError(exc.errno, exc.strerror, str(json_to)) from None


def entry(main: Callable[[], int]) -> NoReturn:
    """A run's (or one of its worker processes') `__main__`: Ctrl-C ends it with 130 and a closed stdout with 141,
    never with a traceback. A worker started with Ctrl-C ignored (`Worker`) takes it back here."""
    sys.exit(interruptible(lambda: run_main(main, f"vmmshare stress {Path(sys.argv[0]).stem}")))
