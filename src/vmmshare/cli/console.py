"""What the ``vmmshare`` commands share: exit codes, one-line usage errors, output-path checks, a progress line.

No command shows a traceback for a user's mistake: a bad option or VMMSHARE_* variable is one line on stderr and
exit status 2; a closed standard output (``| head``) ends the command quietly with status 141; one that refuses
what is written (a full disk, ``> /dev/full``) ends it with one line on stderr and status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import re
import shutil
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, TextIO

OK = 0
FAILED = 1  # the command ran and did not succeed (a demo step misbehaved, no broker answers, ...)
USAGE = 2  # nothing was done: a bad option, a bad VMMSHARE_* variable, a missing extra
IN_USE = 3  # `vmmshare broker`: another broker already serves the socket path
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as a shell reports it)
PIPE_CLOSED = 141  # standard output was closed early (128 + SIGPIPE, as a shell reports it)


WIDTH = 100  # the most columns a line of help or of a report takes, however wide the terminal


def _hang(line: str) -> int:
    """Where the text of `line` starts: after its indent, and after a list item's mark (`- `, `1. `, `(a) `, or a
    term followed by two spaces)."""
    item = re.match(r"\s*(?:[-*] |\d+\. |\(\w\) |\w+ {2,})", line)
    return len(item.group(0)) if item else len(line) - len(line.lstrip())


def wrap_line(line: str, width: int = WIDTH, hang: int | None = None) -> list[str]:
    """`line` in lines of at most `width` columns (a word longer than a line is cut), each continuation
    indented by `hang` columns (default: where the line's text starts, see `_hang`)."""
    if len(line) <= width:
        return [line]
    hang = _hang(line) if hang is None else hang
    return textwrap.wrap(line, width, subsequent_indent=" " * min(hang, width // 2), break_long_words=True,
                         break_on_hyphens=False) or [line]


def reflow(text: str, width: int = WIDTH) -> list[str]:
    """Text written for a wider page (lists, tables, examples), in lines of at most `width` columns: a line that
    fits stays as it is; one that does not is joined with the lines that continue it (indented to where its text
    starts) and wrapped again, so that a paragraph stays a paragraph."""
    def continues(line: str, hang: int) -> bool:  # indented to the text's start, and no list item of its own
        return bool(line.strip()) and len(line) - len(line.lstrip()) == hang == _hang(line)

    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if len(line) > width:
            while i < len(lines) and continues(lines[i], _hang(line)):
                line, i = f"{line} {lines[i].strip()}", i + 1
        out += wrap_line(line, width)
    return out


class _RawNarrow(argparse.RawDescriptionHelpFormatter):
    """A description and epilog kept as written (lists, tables), their too-long lines wrapped to the width."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(f"{indent}{line}\n" for line in reflow(text, max(width - len(indent), 40)))


class NarrowHelp(argparse.ArgumentParser):
    """An argument parser whose help lines take at most WIDTH columns (fewer on a narrower terminal)."""

    def _get_formatter(self) -> argparse.HelpFormatter:
        width = min(shutil.get_terminal_size().columns, WIDTH) - 2
        cls: Any = _RawNarrow if self.formatter_class is argparse.RawDescriptionHelpFormatter else self.formatter_class
        formatter: argparse.HelpFormatter = cls(prog=self.prog, width=width)
        return formatter


class Parser(NarrowHelp):
    """An argument parser whose errors are one line (`prog: message (see prog --help)`) and exit status 2, and
    whose help lines take at most WIDTH columns."""

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
    from ..config import parse_size

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


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def memory_headroom() -> tuple[int, str] | None:
    """The bytes this process could still fill with memory, and where that bound comes from: /proc/meminfo's
    MemAvailable, or the cgroup's limit less its usage when that is lower (v2, then v1). None if unknown."""
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "available memory (MemAvailable in /proc/meminfo)"))
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage, what in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "cgroup v2"),
                               ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                "/sys/fs/cgroup/memory/memory.usage_in_bytes", "cgroup v1")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 1 << 60:
            found.append((max(0, cap - used), f"room left under this {what} memory limit"))
            break
    return min(found) if found else None


def memory_problem(need: int, what: str) -> str | None:
    """Why this machine cannot back `need` bytes of `what` (None if it can, or if that is unknown), said before a
    byte is touched: past that point the kernel's OOM killer, not an error, would stop the run."""
    room = memory_headroom()
    if room is None or need <= room[0]:
        return None

    def human(n: int) -> str:
        for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if n >= 1 << shift:
                return f"{n / (1 << shift):.1f} {unit}"
        return f"{n} B"

    return (f"{what} needs {human(need)} of memory, and this machine has {human(room[0])} of {room[1]}: "
            "choose a smaller size")


def socket_folder_problem(path: Path) -> str | None:
    """Why a broker could not serve at `path` (None if it can try): a broker, started by hand or on first use,
    creates only the socket's own folder, never the folders above it."""
    folder = path.parent
    if path.is_dir():
        return f"{path} is a folder"
    if folder.exists():
        return None if folder.is_dir() else f"{folder} is not a folder"
    if not folder.parent.is_dir():
        return (f"{folder.parent} does not exist: the broker creates only the socket's own folder ({folder.name}), "
                "so create its parent first")
    return None


def socket_setting_problem() -> str | None:
    """Why the node broker this environment names could never start (None if it could): a configuration error,
    said up front naming the setting, not as a step that failed once the run is under way."""
    from ..config import Config

    path = Config.from_env().socket_path
    if problem := socket_folder_problem(path):
        where = "VMMSHARE_SOCKET" if os.environ.get("VMMSHARE_SOCKET") else "the default socket path"
        return f"{where} {str(path)!r}: {problem}"
    return None


def say_error(prog: str, message: str) -> None:
    """One line on stderr: `prog: message`."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


def environment_ok(prog: str) -> bool:
    """Whether every VMMSHARE_* variable is usable; if not, say which (one line, for `prog`)."""
    from ..config import problems

    found = problems()
    if found:
        say_error(prog, str(found[0]))
    return not found


def silence_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null, so that the interpreter's final flush does not fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write refused for want of room, whatever the file


def _stdout_refuses() -> bool:
    """Whether standard output refuses writes now: what it still holds is tried once more (a failed flush keeps
    it), then an empty write, which a device such as /dev/full refuses too."""
    try:
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), b"")
    except (OSError, ValueError, AttributeError):  # AttributeError: no stdout at all
        return True
    return False


def output_failure(exc: OSError) -> str | None:
    """What a command that failed with `exc` could not write (standard output, or a full disk under a file), as a
    line for the user; None if `exc` is no failed write."""
    if not isinstance(exc, BrokenPipeError) and _stdout_refuses():
        return f"cannot write to standard output: {exc.strerror or exc}"
    if exc.errno in _FULL:
        return f"cannot write {exc.filename or 'its output'}: {exc.strerror}"
    return None


def run_main(body: Callable[[], int], prog: str = "vmmshare") -> int:
    """Run a command's body: a closed stdout ends it quietly (141), Ctrl-C with 130, an output that refuses writes
    (a full disk) with one line naming it and 1; never a traceback for any, even when the interrupt surfaces as
    another error (an import it cut short raises ImportError)."""
    seen: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    ours = threading.current_thread() is threading.main_thread() and previous is signal.default_int_handler

    def on_interrupt(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    if ours:
        signal.signal(signal.SIGINT, on_interrupt)
    try:
        code = body()
        sys.stdout.flush()  # a pipe closed after the last write fails here, not at interpreter exit
        return code
    except BrokenPipeError:
        silence_stdout()
        return PIPE_CLOSED
    except BaseException as exc:
        if not seen and isinstance(exc, OSError) and (failure := output_failure(exc)):
            silence_stdout()  # what it still holds goes nowhere, and the interpreter's last flush cannot fail
            with contextlib.suppress(OSError):
                say_error(prog, failure)
            return FAILED
        if not seen and not isinstance(exc, KeyboardInterrupt):
            raise
        with contextlib.suppress(OSError):
            print(file=sys.stderr)
        return INTERRUPTED
    finally:
        if ours:
            signal.signal(signal.SIGINT, previous)


def quiet_child(target: Callable[..., object], *args: object) -> None:
    """A child process's body (a multiprocessing target, started by `start_child`): Ctrl-C reaches the whole
    foreground process group, and there the parent reports it; the child ends with 130 and no traceback."""
    def body() -> int:
        target(*args)
        return 0

    sys.exit(interruptible(body))


def interruptible(body: Callable[[], int]) -> int:
    """Run a child process's `body` with Ctrl-C taken back (it was ignored while the process started): Ctrl-C
    ends it with 130 and no traceback, even when the interrupt surfaces as another error (an import it broke
    raises ImportError, not KeyboardInterrupt)."""
    seen: list[int] = []

    def on_interrupt(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        return body()
    except BaseException as exc:
        if seen or isinstance(exc, KeyboardInterrupt):
            return INTERRUPTED
        raise


@contextlib.contextmanager
def interrupt_ignored_by_children() -> Iterator[None]:
    """Processes started inside this block begin with Ctrl-C ignored (SIG_IGN survives exec, and Python then
    installs no handler of its own) until their body says otherwise (`quiet_child`, the stress runs' `entry`): a
    Ctrl-C while a child's interpreter is still importing would print a traceback from its start-up. The parent,
    which gets the Ctrl-C too, stops them."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_child(process: Any) -> None:
    """Start a multiprocessing `process` whose target is `quiet_child`, with Ctrl-C ignored until that runs."""
    with interrupt_ignored_by_children():
        process.start()


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
