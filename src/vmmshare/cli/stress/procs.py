"""Real second processes for tests: a dedicated broker per test and `Actor`s that run `vmmshare.acl` calls."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from actor import decode, encode
from cacl import c_name
from zygote import Zygote, ZygoteChild

HERE = Path(__file__).resolve().parent
ACTOR = HERE / "actor.py"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any VMMSHARE_* variable (nor PYTHONFAULTHANDLER, whose dumps would join the
    children's output), plus `extra`: what a child that must see only the settings its test gives it starts with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_") and k != "PYTHONFAULTHANDLER"}
    env.update(extra)
    return env


class BrokerProc:
    """A broker started for one test on its own socket; `env` points clients at it."""

    def __init__(self, folder: Path, *extra: str, env: dict[str, str] | None = None,
                 prefix: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.prefix = prefix  # a command the broker runs under (prlimit, setpriv ...)
        self.socket = folder / "broker.sock"
        self.env = dict(os.environ if env is None else env)
        self.env["VMMSHARE_SOCKET"] = str(self.socket)
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        rfd, wfd = os.pipe()
        cmd = [*self.prefix, sys.executable, "-m", "vmmshare.broker", "--socket", str(self.socket),
               "--ready-fd", str(wfd), "--log-level", "WARNING", *self.extra]
        self.proc = subprocess.Popen(cmd, env=self.env, pass_fds=(wfd,), stdin=subprocess.DEVNULL)
        os.close(wfd)
        with os.fdopen(rfd, "rb") as r:
            line = r.readline()  # the broker writes "ready" once it listens, or closes the pipe on failure
        if line != b"ready\n":
            self.proc.wait(10)
            raise RuntimeError(f"broker failed to start (exit {self.proc.returncode})")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


_ZYGOTES: dict[bool, Zygote] = {}  # without torch, with torch


def start_zygote(env: dict[str, str], torch: bool = False) -> None:
    """From now on, actors without a prefix and `python_c` children are forked by a zygote that has imported
    vmmshare (and, for code that imports torch, torch) already, instead of each starting an interpreter of its own
    (see zygote.py)."""
    if False not in _ZYGOTES:
        _ZYGOTES[False] = Zygote(env)
    if torch and True not in _ZYGOTES:
        _ZYGOTES[True] = Zygote(env, ("torch",))


def stop_zygote() -> None:
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].close()


def zygote_for(env: dict[str, str], code: str = "") -> Zygote | None:
    """The zygote a child with `env` (running `code`) can come from, if any."""
    zygote = _ZYGOTES.get("import torch" in code or "torch," in code) or _ZYGOTES.get(False)
    return zygote if zygote is not None and zygote.fits(env) else None


def python_c(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str] | ZygoteChild:
    """`python -c code` with pipes to its stdin (line-buffered) and stdout, text; stderr is this process's."""
    full = dict(os.environ if env is None else env)
    zygote = zygote_for(full, code)
    if zygote is not None:
        return zygote.spawn({"kind": "code", "code": code}, full)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            bufsize=1, env=full)


class ActorDied(RuntimeError):
    """The actor process exited instead of answering (`returncode` says how)."""

    def __init__(self, pid: int, returncode: int) -> None:
        super().__init__(f"actor {pid} died (exit {returncode})")
        self.returncode = returncode


class Actor:
    """A separate Python process; `call("rt.malloc_physical", size, prop, 0)` runs `acl.rt.malloc_physical`.

    With a `prefix` (unshare, setpriv) the process started is the prefix's; `pid` is the one the actor itself sees.
    """

    def __init__(self, env: dict[str, str], prefix: list[str] | None = None, device: int | None = 0) -> None:
        zygote = None if prefix else zygote_for(env)
        self.proc: subprocess.Popen[str] | ZygoteChild
        if zygote is not None:
            self.proc = zygote.spawn({"kind": "actor"}, env)
        else:
            self.proc = subprocess.Popen([*(prefix or []), sys.executable, str(ACTOR)], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self.proc.pid
        self.last_err = ""
        try:
            if prefix:
                self.pid = self.call("!pid")
            if device is not None:
                assert self.call("rt.set_device", device) == 0, self.last_err
        except BaseException:
            self.kill()
            raise

    def call(self, name: str, *args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"call": name, "args": [encode(a) for a in args]}) + "\n")
        except BrokenPipeError:
            line = ""
        else:
            line = self.proc.stdout.readline()
        if not line:
            raise ActorDied(self.pid, self.proc.wait(10))
        reply = json.loads(line)
        if "exc" in reply:
            raise RuntimeError(f"actor raised {reply['exc']}")
        self.last_err = reply["err"]
        return decode(reply["ok"], tuple)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(10)


def ret_of(result: Any) -> int:
    """The ret of a pyACL call's result: the last value, or the value itself for calls without outputs."""
    return int(result[-1] if isinstance(result, tuple) else result)


def ok(a: Actor, name: str, *args: Any) -> Any:
    """Run `name` in `a`; it must succeed. Its outputs: the one value, a tuple of them, or None."""
    result = a.call(name, *args)
    if ret_of(result) != 0:  # raised, not asserted: the stress runs use this too, and may run with -O
        raise AssertionError(f"{name}{args!r} in pid {a.pid} returned {result!r}: {a.last_err}")
    if not isinstance(result, tuple):
        return None
    return result[0] if len(result) == 2 else result[:-1]


def fails(a: Actor, code: int, name: str, *args: Any, neutral: tuple[Any, ...] = (0, None)) -> str:
    """Run `name` in `a`; it must return `code` with neutral outputs (`neutral`: add "" for calls whose outputs are
    strings) and a recent error message that names the call. Returns that message."""
    result = a.call(name, *args)
    if ret_of(result) != code:
        raise AssertionError(f"{name}{args!r} in pid {a.pid} returned {result!r}, expected {code}: {a.last_err!r}")
    if isinstance(result, tuple) and not all(v in neutral for v in result[:-1]):
        raise AssertionError(f"{name} failed but returned outputs {result!r}")
    if name.rsplit(".", 1)[-1] not in a.last_err and c_name(name) not in a.last_err:  # its pyACL or C name
        raise AssertionError(f"{name} failed with {code} but the message {a.last_err!r} does not name it")
    return a.last_err


def refusal(prefix: list[str]) -> str:
    """Why a command run through `prefix` (such as `unshare --pid --fork`) cannot start here; "" when it can."""
    try:
        # a hang guard only
        out = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        return f"{prefix[0]} is not installed: {exc}"
    if out.returncode != 0:
        return f"{' '.join(prefix)} exits {out.returncode}: {out.stderr.strip()[-300:]}"
    return ""


PROP = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
MiB2 = 2 << 20


def share_and_map(exporter: Actor, importer: Actor, h: int, size: int, share_type: int = 1) -> tuple[int, int, int]:
    """Export `h` with `importer` on the trustlist, then import and map it there: (shareable, handle, ptr)."""
    shareable, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, share_type)
    assert ret == 0, exporter.last_err
    assert exporter.call("rt.mem_set_pid_to_shareable_handle_v2", shareable, share_type, [importer.pid]) == 0
    ih, ret = importer.call("rt.mem_import_from_shareable_handle_v2", shareable, share_type, 0)
    assert ret == 0, importer.last_err
    ptr, ret = importer.call("rt.reserve_mem_address", size, 0, 0, 0)
    assert ret == 0, importer.last_err
    assert importer.call("rt.map_mem", ptr, size, 0, ih, 0) == 0, importer.last_err
    return shareable, ih, ptr


def host_children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (scanning /proc, so it works without CONFIG_PROC_CHILDREN)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2 :].split()[1]) == pid:  # the field after the state: the parent's pid
            out.append(int(name))
    return out
