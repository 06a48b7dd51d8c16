"""What the ``vmmshare`` commands share: exit codes, one-line usage errors, output-path checks, a progress line.

No command shows a traceback for a user's mistake: a bad option or VMMSHARE_* variable is one line on stderr and
exit status 2; a closed standard output (``| head``) ends the command quietly with status 141.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn, TextIO

OK = 0
FAILED = 1  # the command ran and did not succeed (a demo step misbehaved, no broker answers, ...)
USAGE = 2  # nothing was done: a bad option, a bad VMMSHARE_* variable, a missing extra
IN_USE = 3  # `vmmshare broker`: another broker already serves the socket path
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as a shell reports it)
PIPE_CLOSED = 141  # standard output was closed early (128 + SIGPIPE, as a shell reports it)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (`prog: message (see prog --help)`) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def plain(doc: str | None) -> str:
    """A docstring as help text: without the reStructuredText double backquotes."""
    return (doc or "").replace("``", "")


def output_problem(path: str) -> str | None:
    """Why the command could not write a file at `path` (None if it could), checked before any long run."""
    if path == "":
        return "the file name is empty"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a folder"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            return f"{path} is not writable"
    elif not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    return None


# ---------------------------------------------------------------- option types: their errors name the option


def sizes_option(text: str) -> list[int]:
    """An option of comma-separated positive sizes (4K,2M,1G)."""
    from .config import parse_size

    try:
        sizes = [parse_size(x) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if min(sizes) <= 0:
        raise argparse.ArgumentTypeError("every size must be positive")
    return sizes


def counts_option(text: str) -> list[int]:
    """An option of comma-separated counts, each at least 1."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError("every count must be at least 1")
    return counts


def count_option(text: str) -> int:
    """An option that counts something: a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def seconds_option(text: str) -> float:
    """An option giving a time: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def check_outputs(ap: argparse.ArgumentParser, **paths: str | None) -> None:
    """Refuse (a usage error) output files that could not be written, before anything is measured."""
    for option, path in paths.items():
        problem = None if path is None else output_problem(path)
        if problem:
            ap.error(f"--{option} {path}: {problem}")


def say_error(prog: str, message: str) -> None:
    """One line on stderr: `prog: message`."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


def environment_ok(prog: str) -> bool:
    """Whether every VMMSHARE_* variable is usable; if not, say which (one line, for `prog`)."""
    from .config import problems

    found = problems()
    if found:
        say_error(prog, str(found[0]))
    return not found


def _silence_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null, so that the interpreter's final flush does not fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def run_main(body: Callable[[], int]) -> int:
    """Run a command's body: a closed stdout ends it quietly (141), Ctrl-C with 130; never a traceback for either."""
    try:
        code = body()
        sys.stdout.flush()  # a pipe closed after the last write fails here, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return PIPE_CLOSED
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):
            print(file=sys.stderr)
        return INTERRUPTED


class Progress:
    """A status line on stderr while a long run works: its current step and the time so far, redrawn twice a
    second. Only on a terminal: when stderr is a file or a pipe nothing is written."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        try:
            self.on = self.stream.isatty()
        except (AttributeError, ValueError):
            self.on = False
        self._text = ""
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.on:
            self._thread = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._write("\r\x1b[K")

    def step(self, text: str) -> None:
        """Show `text` as what is running now."""
        with self._lock:
            self._text = text
            self._draw()

    def print(self, text: str, out: TextIO | None = None) -> None:
        """Print a line of the command's output (stdout), keeping the status line below it."""
        with self._lock:
            self._write("\r\x1b[K")
            print(text, file=sys.stdout if out is None else out, flush=True)
            self._draw()

    def emit(self, data: bytes) -> None:
        """Pass bytes of another process's output through to stdout, keeping the status line below them."""
        with self._lock:
            self._write("\r\x1b[K")
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
            self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                self._draw()

    def _draw(self) -> None:
        if self._text:
            self._write(f"\r\x1b[K{self.label}: {self._text} ({time.monotonic() - self._t0:.0f} s)")

    def _write(self, text: str) -> None:
        if not self.on:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: the run goes on without its status line
            self.on = False
