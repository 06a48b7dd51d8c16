#!/usr/bin/env python3
"""Protocol fuzzing: the broker wire codec on its own, then (``--live``) the same frames against a live broker.

(a) Decoder: random frames and mutations of valid frames of every message type in ``protocol.LAYOUTS`` (bit flips,
    byte changes, insertions and deletions, truncation, extension, header field changes, type confusion, random
    fd counts) go through ``protocol.decode``. The only outcomes allowed are a ``Frame`` (which must re-encode to
    exactly the packet it came from) or a ``ProtocolError``. When ``atheris`` imports, a coverage-guided run of
    libFuzzer over the same decoder follows, in a child process (libFuzzer ends its process when it is done).
(b) ``--live``: the same frames (the first ``--live-frames`` of the sequence) are sent to a broker started for
    the run, over several connections, some with real fds attached (pipe ends, memfds, /dev/null). Every packet
    must get a reply addressed to its request id (an ERROR 507022 for every packet the codec refuses, a documented
    reply or error for the valid ones) or, for an empty packet, a closed connection. Afterwards the broker must be
    alive, serve a real allocate/export/import round trip between two processes, hold no fd it was handed, have
    its fd count back at baseline and its RSS within 5 MiB of baseline.

    vmmshare stress fuzz_protocol --frames 100000 --live --json out.json

Exit status 0 when every invariant held, 1 otherwise. Loops are bounded by count and by ``--seconds``.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmmshare.wire import local as P
from vmmshare.wire.local import HEADER, LAYOUTS, MAGIC, MAX_BODY, MAX_FRAME, VERSION, Frame, Msg, ProtocolError, Tail

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import rawsock  # noqa: E402  (the test side's own packet code)
from stressio import count_option, emit, entry, fraction, prog, readable, seconds_option, whole  # noqa: E402
from vmmshare.cli.console import NarrowHelp, check_outputs  # noqa: E402

U32_MAX = (1 << 32) - 1
MiB2 = 2 << 20
HANG_GUARD = 30.0  # seconds: only a guard against a hang, never part of a result
IPC_ERROR = 507022
INTERNAL = 507000
# what a well-formed request may be refused with (SPEC §4); 507000 would be a bug, anything else unexpected
REQUEST_ERRORS = {107000, 107001, 107017, 207001, 207006}
REPLY_TO = {
    Msg.CHARGE: Msg.TOKEN, Msg.RELEASE: Msg.OK, Msg.MEM_INFO: Msg.MEM, Msg.EXPORT: Msg.EXPORTED,
    Msg.REVOKE: Msg.OK, Msg.SET_PIDS: Msg.OK, Msg.IMPORT: Msg.IMPORTED, Msg.BARE_TGID: Msg.PID,
    Msg.LIST: Msg.LISTING, Msg.CHARGE_GPU: Msg.TOKEN, Msg.REMOTE_IMPORT: Msg.REMOTE_IMPORTED,
    Msg.SET_REMOTE_PIDS: Msg.OK,
}
NOT_CONFIGURED = 207000  # a remote import or remote trust on a broker without the cross-server transport
RSS_LIMIT_KB = 5 * 1024

# ---------------------------------------------------------------- valid frames of every type

_RANGES = {
    "b": (-(1 << 7), (1 << 7) - 1), "B": (0, (1 << 8) - 1), "h": (-(1 << 15), (1 << 15) - 1),
    "H": (0, (1 << 16) - 1), "i": (-(1 << 31), (1 << 31) - 1), "I": (0, U32_MAX),
    "q": (-(1 << 63), (1 << 63) - 1), "Q": (0, (1 << 64) - 1),
}
KINDS = list(Msg)
REQUEST_KINDS = [m for m in Msg if m < 64]


def field_codes(kind: Msg) -> list[tuple[str, int]]:
    """The fixed part of `kind` as (code, n): one entry per value (n bytes for an 's' field)."""
    out: list[tuple[str, int]] = []
    for count, code in re.findall(r"(\d*)([a-zA-Z])", LAYOUTS[kind].fixed.format.lstrip("<")):
        n = int(count or 1)
        out.extend([(code, n)] if code == "s" else [(code, 1)] * n)
    return out


def _int_value(rng: random.Random, code: str) -> int:
    lo, hi = _RANGES[code]
    r = rng.random()
    if r < 0.25:  # small, plausible values: devices, share types, flags, kinds, pids
        return max(lo, min(hi, rng.randrange(-2, 10)))
    if r < 0.40:
        return rng.choice((lo, hi, 0, 1, max(lo, -1)))
    if r < 0.55 and hi >= MiB2:  # sizes
        return rng.randrange(1, 9) * MiB2
    return rng.randint(lo, hi)


def random_values(rng: random.Random, kind: Msg) -> tuple[int | bytes, ...]:
    return tuple(rng.randbytes(n) if code == "s" else _int_value(rng, code) for code, n in field_codes(kind))


_TEXT_ALPHABET = "abcxyz {}[]\":,0123456789éß€😀\u0000\u007f\u0080\u07ff\u0800\uffff"


def random_tail(rng: random.Random, kind: Msg) -> bytes | str | tuple[int, ...]:
    layout = LAYOUTS[kind]
    full = rng.random() < 0.03
    if layout.tail is Tail.U32:
        n = layout.max_tail // 4 if full else rng.choice((0, 0, 1, 2, 3, rng.randrange(64)))
        return tuple(_int_value(rng, "I") for _ in range(n))
    if layout.tail is Tail.TEXT:
        n = layout.max_tail if full else rng.randrange(80)
        return "".join(rng.choice(_TEXT_ALPHABET) for _ in range(n))
    if layout.tail is Tail.BYTES:
        n = layout.max_tail if full else rng.choice((0, 8, 128, rng.randrange(layout.max_tail + 1)))
        data = rng.randbytes(n)
        if n >= 4 and rng.random() < 0.5:
            data = b"VMMF" + data[4:]
        return data
    return b""


def valid_frame(rng: random.Random, kind: Msg) -> tuple[bytes, int]:
    """A random well-formed frame of `kind` and the number of fds it travels with."""
    req = _int_value(rng, "I")
    message = LAYOUTS[kind].build(random_values(rng, kind), random_tail(rng, kind))
    return P.encode(message, req), LAYOUTS[kind].fds


def tail_of(message: P.Message) -> Any:
    """The tail field of a message whose type has one (b"" otherwise)."""
    layout = LAYOUTS[message.TYPE]
    return getattr(message, layout.tail_field) if layout.tail_field else b""


# ---------------------------------------------------------------- mutations


def _with_length(p: bytearray, length: int) -> None:
    if len(p) >= HEADER.size:
        struct.pack_into("<I", p, 8, length & U32_MAX)


def _fix_length(p: bytearray) -> None:
    _with_length(p, len(p) - HEADER.size)


def m_bitflip(rng: random.Random, p: bytearray, nfds: int) -> int:
    if p:
        at = rng.randrange(len(p))
        p[at] ^= 1 << rng.randrange(8)
    return nfds


def m_byte(rng: random.Random, p: bytearray, nfds: int) -> int:
    if p:
        p[rng.randrange(len(p))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    return nfds


def m_truncate(rng: random.Random, p: bytearray, nfds: int) -> int:
    if p:
        del p[rng.randrange(len(p)) :]
    return nfds


def m_extend(rng: random.Random, p: bytearray, nfds: int) -> int:
    r = rng.random()
    if r < 0.05:  # past the frame limit
        p.extend(rng.randbytes(max(1, MAX_FRAME - len(p) + rng.randrange(1, 2048))))
    elif r < 0.10:  # up to exactly the limit
        p.extend(bytes(max(0, MAX_FRAME - len(p))))
    else:
        p.extend(rng.randbytes(rng.choice((1, 2, 3, 4, 8, rng.randrange(1, 64)))))
    return nfds


def m_insert(rng: random.Random, p: bytearray, nfds: int) -> int:
    at = rng.randrange(len(p) + 1)
    p[at:at] = rng.randbytes(rng.randrange(1, 9))
    return nfds


def m_delete(rng: random.Random, p: bytearray, nfds: int) -> int:
    if p:
        at = rng.randrange(len(p))
        del p[at : at + rng.randrange(1, 9)]
    return nfds


def m_magic(rng: random.Random, p: bytearray, nfds: int) -> int:
    if len(p) >= 2:
        p[0:2] = rng.choice((b"BV", b"VA", b"vb", b"\0\0", rng.randbytes(2)))
    return nfds


def m_version(rng: random.Random, p: bytearray, nfds: int) -> int:
    if len(p) >= 3:
        p[2] = rng.choice((0, 2, 255, rng.randrange(256)))
    return nfds


def m_type(rng: random.Random, p: bytearray, nfds: int) -> int:
    """Another message type: any byte, or another valid type (type confusion, the body of one as another)."""
    if len(p) >= 4:
        p[3] = rng.choice(KINDS) if rng.random() < 0.6 else rng.randrange(256)
    return nfds


def m_req(rng: random.Random, p: bytearray, nfds: int) -> int:
    if len(p) >= 8:
        struct.pack_into("<I", p, 4, rng.choice((0, U32_MAX, rng.randrange(1 << 32))))
    return nfds


def m_length(rng: random.Random, p: bytearray, nfds: int) -> int:
    body = len(p) - HEADER.size
    _with_length(p, rng.choice((0, 1, body - 1, body + 1, U32_MAX, MAX_BODY, MAX_BODY + 1, rng.randrange(1 << 32))))
    return nfds


def m_fds(rng: random.Random, p: bytearray, nfds: int) -> int:
    return rng.choice((0, 0, 1, 1, 2, 3, rng.randrange(8)))


def m_splice(rng: random.Random, p: bytearray, nfds: int) -> int:
    """The body of a valid frame of another type behind this header."""
    other, _ = valid_frame(rng, rng.choice(KINDS))
    del p[HEADER.size :]
    p.extend(other[HEADER.size :])
    return nfds


MUTATIONS: dict[str, Callable[[random.Random, bytearray, int], int]] = {
    "bitflip": m_bitflip, "byte": m_byte, "truncate": m_truncate, "extend": m_extend, "insert": m_insert,
    "delete": m_delete, "magic": m_magic, "version": m_version, "type": m_type, "req": m_req,
    "length": m_length, "fds": m_fds, "splice": m_splice,
}
_MUTATION_NAMES = list(MUTATIONS)
_MUTATION_WEIGHTS = [6, 6, 3, 3, 2, 2, 1, 1, 3, 1, 2, 3, 2]


@dataclass
class Case:
    packet: bytes
    nfds: int
    origin: str  # "valid", "mutated", "random", "header+random" ("scripted": see fuzz_live)
    kind: int  # the type the frame was built as (-1 for random bytes)
    ops: tuple[str, ...] = ()
    memfd_size: int | None = None  # scripted EXPORTs: send one memfd of this size


def generate(seed: int, count: int) -> Iterator[Case]:
    """`count` fuzz cases, deterministic for a seed: each message type in turn, mutated in most cases."""
    rng = random.Random(seed)
    for i in range(count):
        r = rng.random()
        if r < 0.05:  # noise
            yield Case(rng.randbytes(rng.choice((0, 1, 11, 12, 13, rng.randrange(300)))), rng.randrange(3),
                       "random", -1)
            continue
        if r < 0.12:  # a plausible header around a random body
            kind = rng.randrange(256) if rng.random() < 0.3 else int(rng.choice(KINDS))
            body = rng.randbytes(rng.randrange(64))
            length = len(body) if rng.random() < 0.8 else rng.randrange(1 << 32)
            req = rng.randrange(1 << 32)
            packet = HEADER.pack(MAGIC, VERSION, kind, req, length) + body
            yield Case(packet, rng.choice((0, 0, 1, rng.randrange(4))), "header+random", kind)
            continue
        kind = KINDS[i % len(KINDS)]
        packet, nfds = valid_frame(rng, kind)
        if r < 0.22:
            yield Case(packet, nfds, "valid", int(kind))
            continue
        p = bytearray(packet)
        ops = tuple(rng.choices(_MUTATION_NAMES, _MUTATION_WEIGHTS, k=rng.choice((1, 1, 1, 2, 2, 3, 5))))
        for op in ops:
            nfds = MUTATIONS[op](rng, p, nfds)
        if rng.random() < 0.3 and "length" not in ops:  # keep the length consistent to reach the body checks
            _fix_length(p)
        yield Case(bytes(p), nfds, "mutated", int(kind), ops)


# ---------------------------------------------------------------- (a) the decoder alone


def _template(message: str) -> str:
    """A ProtocolError message with its numbers and quoted bytes taken out, to count kinds of refusal."""
    message = re.sub(r"b'(?:[^'\\]|\\.)*'|b\"(?:[^\"\\]|\\.)*\"", "B", message)
    message = re.sub(r"0x[0-9a-fA-F]+|\d+", "N", message)
    return re.sub(r"(can't decode byte|invalid (?:start|continuation) byte|unexpected end of data).*",
                  r"\1 …", message)


def check_decode(case: Case) -> tuple[str, Frame | None, str]:
    """('ok', frame, '') | ('refused', None, message) | ('defect', None, what went wrong)."""
    try:
        frame = P.decode(case.packet, case.nfds)
    except ProtocolError as exc:
        message = str(exc)
        if not message.strip():
            return "defect", None, "ProtocolError without a message"
        return "refused", None, message
    except Exception as exc:  # the invariant: nothing but a Frame or a ProtocolError
        return "defect", None, f"{type(exc).__name__}: {exc}"
    if not isinstance(frame, Frame) or not isinstance(frame.message, P.Message):
        return "defect", None, f"decode returned {frame!r}"
    try:
        again = P.encode(frame.message, frame.req)
    except Exception as exc:
        return "defect", None, f"decoded frame does not re-encode: {type(exc).__name__}: {exc}"
    if again != case.packet:
        return "defect", None, "decoded frame re-encodes to different bytes"
    if case.nfds != LAYOUTS[frame.message.TYPE].fds:
        return "defect", None, f"{frame.message.TYPE.name} accepted with {case.nfds} fds"
    return "ok", frame, ""


def fuzz_decoder(seed: int, count: int, seconds: float | None = None) -> dict[str, Any]:
    """Decode `count` cases (stopping early after `seconds`); the result counts outcomes and lists defects."""
    start = time.perf_counter()
    deadline = None if seconds is None else start + seconds
    outcomes: Counter[str] = Counter()
    by_origin: Counter[str] = Counter()
    ok_by_kind: Counter[str] = Counter()
    built_by_kind: Counter[str] = Counter()
    messages: Counter[str] = Counter()
    templates: Counter[str] = Counter()
    defects: list[dict[str, Any]] = []
    done = 0
    for case in generate(seed, count):
        if deadline is not None and done % 1000 == 0 and time.perf_counter() > deadline:
            break
        done += 1
        status, frame, message = check_decode(case)
        outcomes[status] += 1
        by_origin[f"{case.origin}:{status}"] += 1
        if case.kind >= 0 and case.kind in Msg._value2member_map_:
            built_by_kind[Msg(case.kind).name] += 1
        if frame is not None:
            ok_by_kind[frame.message.TYPE.name] += 1
        elif status == "refused":
            messages[message] += 1
            templates[_template(message)] += 1
        else:
            if len(defects) < 50:
                defects.append({"what": message, "packet": case.packet[:256].hex(), "nfds": case.nfds,
                                "origin": case.origin, "ops": list(case.ops)})
    elapsed = time.perf_counter() - start
    return {
        "seed": seed, "frames": done, "requested": count, "seconds": round(elapsed, 3),
        "rate_per_s": round(done / elapsed) if elapsed else None,
        "decoded_ok": outcomes["ok"], "refused": outcomes["refused"], "defects": outcomes["defect"],
        "by_origin": dict(sorted(by_origin.items())),
        "built_by_type": dict(sorted(built_by_kind.items())),
        "decoded_by_type": dict(sorted(ok_by_kind.items())),
        "distinct_error_messages": len(messages),
        "distinct_error_templates": len(templates),
        "top_error_templates": templates.most_common(40),
        "defect_samples": defects,
    }


# ---------------------------------------------------------------- atheris (coverage-guided), in a child


def _atheris_child(runs: int, corpus: str, extra: list[str]) -> None:
    """Runs inside the child: libFuzzer over decode (the protocol module instrumented); exits when done."""
    import importlib

    import atheris  # type: ignore[import-not-found]

    for name in ("vmmshare.wire.local", "vmmshare.wire.framing"):  # imported at the top: load again, instrumented
        sys.modules.pop(name, None)  # (the framing holds the decoder, local.py its table of message types)
    with atheris.instrument_imports(include=["vmmshare.wire.local", "vmmshare.wire.framing"]):
        proto = importlib.import_module("vmmshare.wire.local")

    def one(data: bytes) -> None:
        if not data:
            return
        try:
            frame = proto.decode(data[1:], data[0] & 7)
        except proto.ProtocolError:
            return
        assert proto.encode(frame.message, frame.req) == data[1:]

    atheris.Setup([sys.argv[0], f"-runs={runs}", "-max_len=66000", "-rss_limit_mb=2048", *extra, corpus], one)
    atheris.Fuzz()


def fuzz_atheris(runs: int, seed: int, seconds: float) -> dict[str, Any]:
    """A coverage-guided run of `runs` executions (bounded by `seconds`); {'available': False} without atheris."""
    try:
        import atheris  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return {"available": False}
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="vmmshare-atheris-") as corpus:
        for i, kind in enumerate(KINDS * 3):  # a seed corpus: valid frames of every type
            packet, nfds = valid_frame(rng, kind)
            Path(corpus, f"seed{i}").write_bytes(bytes([nfds]) + packet)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--atheris-child", str(runs), corpus,
               f"-seed={seed & 0x7FFFFFFF or 1}", f"-max_total_time={max(1, int(seconds))}"]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            return {"available": True, "ok": False, "execs": None, "tail": "atheris child did not finish (hang guard)"}
        elapsed = time.perf_counter() - start
    out = proc.stderr
    done = re.search(r"Done (\d+) runs in (\d+) second", out)
    cov = re.findall(r"cov: (\d+) ft: (\d+)", out)
    corp = re.findall(r"corp: (\d+)/", out)
    crashed = proc.returncode != 0 or "Uncaught Python exception" in out
    return {
        "available": True,
        "ok": not crashed and done is not None,
        "runs_requested": runs,
        "execs": int(done.group(1)) if done else None,
        "seconds": round(elapsed, 2),
        "coverage_edges": int(cov[-1][0]) if cov else None,
        "features": int(cov[-1][1]) if cov else None,
        "corpus_entries": int(corp[-1]) if corp else None,
        "returncode": proc.returncode,
        "tail": out[-3000:] if crashed else "",
    }


# ---------------------------------------------------------------- (b) a live broker


class Broker:
    """A broker on its own socket for this run (the procs.py BrokerProc pattern, with its log to a file)."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.socket = folder / "broker.sock"
        self.log_path = folder / "broker.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
        self.env = {**base, **(env or {}), "VMMSHARE_SOCKET": str(self.socket)}
        rfd, wfd = os.pipe()
        cmd = [sys.executable, "-m", "vmmshare.broker", "--socket", str(self.socket), "--ready-fd", str(wfd),
               "--log-level", "WARNING"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, pass_fds=(wfd,), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        os.close(wfd)
        with os.fdopen(rfd, "rb") as r:
            line = r.readline()  # "ready" once it listens; EOF when it failed
        if line != b"ready\n":
            self.proc.kill()
            self.proc.wait(10)
            raise RuntimeError(f"broker failed to start: {self.log_path.read_text()[-2000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def status_kb(self, key: str) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise KeyError(key)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(HANG_GUARD)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(HANG_GUARD)


class Conn:
    """One SOCK_SEQPACKET connection speaking raw frames.

    With `foreign`, a forked helper makes the connection and relays our packets over it: the broker sees
    (SO_PEERCRED, and SCM_CREDENTIALS on each packet) another process, so IMPORT from this connection of a handle
    exported on another one is allowed and the broker's import paths are reached. The helper exits when the
    connection is closed.
    """

    def __init__(self, path: Path, foreign: bool = False) -> None:
        self.helper = 0
        self._hold = -1
        if foreign:
            self.sock, self.helper, self._hold = _connect_from_helper(path)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self.sock.connect(str(path))
        self.sock.settimeout(HANG_GUARD)
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        self.tokens: dict[int, int] = {}  # token -> charged size
        self.req = 1

    @property
    def pid(self) -> int:
        return self.helper or os.getpid()

    def close(self) -> None:
        self.sock.close()
        if self.helper:
            os.close(self._hold)  # the helper reads EOF and exits
            os.waitpid(self.helper, 0)
            self.helper = 0

    def send(self, data: bytes, fds: list[int]) -> bool:
        return rawsock.send(self.sock, data, fds)

    def recv(self) -> tuple[bytes | None, list[int], bool]:
        """(packet, fds, truncated); packet None when the broker closed the connection."""
        return rawsock.recv(self.sock)

    def call(self, message: P.Message, fds: tuple[int, ...] = ()) -> Any:
        """A well-formed request of our own; returns the reply message (any fds it carries are closed)."""
        self.req += 1
        assert self.send(P.encode(message, self.req), list(fds)), "broker closed the connection"
        data, got, _ = self.recv()
        for fd in got:
            os.close(fd)
        assert data is not None, f"the broker closed the connection on a valid {message.TYPE.name}"
        frame = P.decode(data, len(got))
        assert frame.req == self.req, f"reply to {frame.req}, expected {self.req}"
        return frame.message


def _connect_from_helper(path: Path) -> tuple[socket.socket, int, int]:
    """Fork a helper that connects to `path` and relays packets (with their fds) between that connection and the
    socket returned to us, until either side closes; `hold` (returned) is closed to make it leave.

    The broker decides each packet by its sender (SCM_CREDENTIALS), so the helper itself sends them: to the broker
    this connection is another process's in every packet."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    hold_r, hold_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the helper: no Python-level cleanup, just the relay
        try:
            keep = {0, 1, 2, theirs.fileno(), hold_r, ready_w}
            for name in os.listdir("/proc/self/fd"):  # hold no copy of the parent's connections or pipes
                if int(name) not in keep:
                    with contextlib.suppress(OSError):
                        os.close(int(name))
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(str(path))
            os.write(ready_w, b"x")
            os.close(ready_w)
            _relay(theirs, s, hold_r)
        finally:
            os._exit(0)
    theirs.close()
    os.close(hold_r)
    os.close(ready_w)
    try:
        if os.read(ready_r, 1) != b"x":
            os.close(hold_w)
            os.waitpid(pid, 0)
            raise RuntimeError("the helper could not connect to the broker")
    finally:
        os.close(ready_r)
    return ours, pid, hold_w


def _relay(a: socket.socket, b: socket.socket, hold: int) -> None:
    """Pass packets and their fds both ways between `a` and `b` until one side closes or `hold` is closed."""
    peer = {a.fileno(): b, b.fileno(): a}
    poller = select.poll()
    for fd in (a.fileno(), b.fileno(), hold):
        poller.register(fd, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == hold:
                return
            src = a if fd == a.fileno() else b
            data, anc, _, _ = src.recvmsg(4 * MAX_FRAME, socket.CMSG_SPACE(4 * 64))
            fds = array.array("i")
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            if not data and not fds:
                return
            try:
                cmsg = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if fds else []
                peer[fd].sendmsg([data], cmsg)
            except OSError:
                return
            finally:
                for passed in fds:
                    os.close(passed)


def settled_fd_count(broker: Broker) -> int:
    """The broker's fds with one fresh connection open, after it processed every earlier close (two round trips:
    every close before our connect is reported no later than the select pass that serves our second request)."""
    c = Conn(broker.socket)
    try:
        for _ in range(2):
            assert isinstance(c.call(P.BareTgid()), P.Pid)
        return broker.fd_count()
    finally:
        c.close()


def broker_state(broker: Broker, devices: int = 8) -> dict[str, Any]:
    """What the broker holds: free/total per device and the number of exports it lists."""
    c = Conn(broker.socket)
    try:
        mem = {}
        for d in range(devices):
            f = c.call(P.MemInfo(d))
            mem[d] = (f.free, f.total) if isinstance(f, P.Mem) else None
        listing = json.loads(c.call(P.List(0)).page)
        return {"all_free": all(m is not None and m[0] == m[1] for m in mem.values()),
                "exports": len(listing["exports"]), "clients_seen": listing["clients"] + 1}  # + this one's own
    finally:
        c.close()


def round_trip(env: dict[str, str]) -> str:
    """Two real processes through the broker: malloc, map, write, export with a trustlist, import, map, read the
    same bytes. Returns "" on success, else what failed."""
    from procs import PROP, Actor  # the test suite's second-process helper

    exporter, importer = Actor(env), Actor(env)
    try:
        h, ret = exporter.call("rt.malloc_physical", MiB2, PROP, 0)
        if ret:
            return f"malloc_physical {ret}: {exporter.last_err}"
        p, ret = exporter.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        if ret or exporter.call("rt.map_mem", p, MiB2, 0, h, 0):
            return f"reserve/map failed: {exporter.last_err}"
        exporter.call("!write_bytes", p, b"fuzzed, still serving")
        shareable, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, 1)
        if ret:
            return f"export {ret}: {exporter.last_err}"
        if exporter.call("rt.mem_set_pid_to_shareable_handle_v2", shareable, 1, [importer.pid]):
            return f"set_pid: {exporter.last_err}"
        h2, ret = importer.call("rt.mem_import_from_shareable_handle_v2", shareable, 1, 0)
        if ret:
            return f"import {ret}: {importer.last_err}"
        p2, ret = importer.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
        if ret or importer.call("rt.map_mem", p2, MiB2, 0, h2, 0):
            return f"importer map failed: {importer.last_err}"
        got = importer.call("!read", p2, 21)
        if got != b"fuzzed, still serving":
            return f"importer read {got!r}"
        return ""
    finally:
        exporter.close()
        importer.close()


@dataclass
class LiveStats:
    sent: int = 0
    replies: Counter[str] = field(default_factory=Counter)
    error_codes: Counter[int] = field(default_factory=Counter)
    closed_by_broker: int = 0
    closed_on_empty_packet: int = 0
    fds_attached: int = 0
    frames_with_fds: int = 0
    fd_kinds: Counter[str] = field(default_factory=Counter)
    substituted: Counter[str] = field(default_factory=Counter)
    reconnects: int = 0
    abandoned: int = 0
    exported: int = 0
    imported: int = 0
    fuzz_sent: int = 0
    scripted: Counter[str] = field(default_factory=Counter)
    defects: list[dict[str, Any]] = field(default_factory=list)
    internal_messages: Counter[str] = field(default_factory=Counter)

    def defect(self, what: str, case: Case, detail: str = "") -> None:
        if len(self.defects) < 50:
            self.defects.append({"what": what, "detail": detail[:500], "packet": case.packet[:128].hex(),
                                 "nfds": case.nfds, "origin": case.origin, "ops": list(case.ops)})
        else:
            self.defects.append({"what": what})


def _attach_fds(rng: random.Random, n: int, size_hint: int, stats: LiveStats) -> tuple[list[int], list[int]]:
    """`n` fds to send (ours to close after sending) and the read ends of the pipes among them (to check)."""
    fds: list[int] = []
    pipes: list[int] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            rd, wr = os.pipe2(os.O_CLOEXEC)
            fds.append(wr)
            pipes.append(rd)
            stats.fd_kinds["pipe"] += 1
        elif r < 0.85:
            fit = size_hint if size_hint <= 1 << 40 else MiB2  # sparse: a memfd's size costs no memory
            fd = rawsock.sealed_memfd(fit if rng.random() < 0.7 else rng.choice((0, 4096, MiB2)), "fuzz")
            fds.append(fd)
            stats.fd_kinds["memfd"] += 1
        else:
            fds.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            stats.fd_kinds["devnull"] += 1
    return fds, pipes


def _released(read_end: int) -> bool:
    """EOF on a pipe's read end: every copy of the write end (ours and the broker's) is closed."""
    ready, _, _ = select.select([read_end], [], [], 0)
    return bool(ready) and os.read(read_end, 1) == b""


def _substitute(rng: random.Random, case: Case, conn: Conn, exported: list[tuple[int, int, bytes]],
                stats: LiveStats, foreign_pid: int) -> tuple[Case, int]:
    """Now and then, point a valid request at a live object (a token of this connection, a handle exported on
    the node), so the fuzz reaches the broker's real paths. Returns the case to send and the size hint for fds."""
    size_hint = MiB2
    try:
        frame = P.decode(case.packet, case.nfds)
    except ProtocolError:
        return case, size_hint
    kind = frame.message.TYPE
    layout = LAYOUTS[kind]
    values = list(layout.values(frame.message))
    tail = tail_of(frame.message)
    if kind in (Msg.RELEASE, Msg.REVOKE, Msg.EXPORT) and conn.tokens and rng.random() < 0.6:
        token = rng.choice(list(conn.tokens))
        values[0] = token
        size_hint = conn.tokens[token]
        if kind is Msg.EXPORT:  # mostly plausible: right size, flags, share type, a host memfd
            values[1] = size_hint if rng.random() < 0.8 else values[1]
            values[2] = rng.choice((0, 1)) if rng.random() < 0.8 else values[2]
            values[3] = rng.choice((1, 2)) if rng.random() < 0.8 else values[3]
            values[5] = values[5] if rng.random() < 0.2 else 0
            pids = list(tail)[:8]
            if rng.random() < 0.5:
                pids.append(foreign_pid)  # trust the other process
            tail = tuple(pids)
        stats.substituted[kind.name] += 1
    elif kind in (Msg.IMPORT, Msg.SET_PIDS) and exported and rng.random() < 0.6:
        handle, share_type, secret = rng.choice(exported)
        values[0] = handle
        values[1] = share_type if rng.random() < 0.8 else values[1]
        if kind is Msg.IMPORT:
            values[2] = secret if rng.random() < 0.8 else values[2]
        else:
            tail = (*list(tail)[:8], foreign_pid)
        stats.substituted[kind.name] += 1
    else:
        return case, size_hint
    packet = P.encode(layout.build(tuple(values), tail), frame.req)
    return Case(packet, case.nfds, case.origin, case.kind, (*case.ops, "live-object")), size_hint


def _check_reply(case: Case, valid: Frame | None, data: bytes, got: list[int], truncated: bool,
                 stats: LiveStats, conn: Conn, exported: list[tuple[int, int, bytes]]) -> Frame | None:
    """Check one reply against what the packet deserved; returns the decoded reply (None if it did not decode)."""
    if truncated:
        stats.defect("over-long or fd-truncated reply", case)
        return None
    try:
        frame = P.decode(data, len(got))
    except ProtocolError as exc:
        stats.defect("reply does not decode", case, str(exc))
        return None
    reply = frame.message
    stats.replies[reply.TYPE.name] += 1
    if frame.req != P.peek_request_id(case.packet):
        stats.defect("reply addressed to another request id", case, f"{frame.req}")
    code = reply.code if isinstance(reply, P.Error) else 0
    if isinstance(reply, P.Error):
        stats.error_codes[code] += 1
        if not isinstance(reply.message, str) or not reply.message.strip():
            stats.defect("ERROR reply without a message", case)
        if code == INTERNAL:
            stats.internal_messages[reply.message[:300]] += 1
    if valid is None or valid.message.TYPE >= 64:  # the codec refuses it (or it is a reply): 507022 and nothing else
        if not isinstance(reply, P.Error) or code != IPC_ERROR:
            stats.defect("malformed packet not answered with ERROR 507022", case, repr(reply)[:300])
        return frame
    request = valid.message
    expected = REPLY_TO[request.TYPE]
    if isinstance(reply, P.Error):
        if code not in REQUEST_ERRORS and not (code == NOT_CONFIGURED and isinstance(request, (P.RemoteImport,
                                                                                               P.SetRemotePids))):
            stats.defect(f"valid {request.TYPE.name} refused with unexpected code {code}", case, reply.message)
        if code == 107017 and isinstance(request, (P.Import, P.SetPids)):  # revoked (or never was): stop using it
            exported[:] = [e for e in exported if e[0] != request.shareable]
        return frame
    if reply.TYPE is not expected:
        stats.defect(f"{request.TYPE.name} answered with {reply.TYPE.name}", case)
        return frame
    if isinstance(reply, P.Token) and isinstance(request, (P.Charge, P.ChargeGpu)):
        conn.tokens[reply.hold] = request.size
    elif isinstance(reply, P.Ok) and isinstance(request, P.Release):
        conn.tokens.pop(request.hold, None)
    elif isinstance(reply, P.Exported):
        stats.exported += 1
        raw = reply.shareable
        if len(raw) == 8:
            exported.append((int.from_bytes(raw, "little"), 1, bytes(32)))
        elif len(raw) == 128:
            exported.append((int.from_bytes(raw[16:24], "little"), 2, raw[64:96]))
        else:
            stats.defect("EXPORTED tail is neither 8 nor 128 bytes", case, raw.hex())
        del exported[:-64]
    elif isinstance(reply, P.Imported):
        stats.imported += 1
        if len(got) != 1:
            stats.defect("IMPORTED without exactly one fd", case)
        conn.tokens[reply.hold] = reply.size
    return frame


def _with_scripted(cases: Iterator[Case], rng: random.Random, rate: float) -> Iterator[Case | None]:
    """The fuzz cases, with a None (a scripted request goes there) before each one with probability `rate`."""
    for case in cases:
        while rng.random() < rate:
            yield None
        yield case


def _scripted(rng: random.Random, conn: Conn, exported: list[tuple[int, int, bytes]], foreign_pid: int) -> Case:
    """A well-formed request on live objects (charge, export with a memfd, import, trustlist, release, revoke),
    interleaved with the fuzz frames so that the broker holds real state while they arrive."""
    req = rng.randrange(1 << 32)
    r = rng.random()
    token = rng.choice(list(conn.tokens)) if conn.tokens else 0
    if not token or r < 0.3:
        device = rng.choice((-1, *range(8)))
        return Case(P.encode(P.Charge(device, rng.randrange(1, 5) * MiB2), req), 0, "scripted", Msg.CHARGE)
    if r < 0.55:
        size = conn.tokens[token]
        pids = [foreign_pid] if rng.random() < 0.5 else []
        packet = P.encode(P.Export(token, size, rng.choice((0, 1)), rng.choice((1, 2)), 0, 0, 0, 0, 5, 1, 0,
                                   tuple(pids)), req)
        return Case(packet, 1, "scripted", Msg.EXPORT, memfd_size=size if size <= 1 << 40 else MiB2)
    if r < 0.8 and exported:
        handle, share_type, secret = rng.choice(exported)
        return Case(P.encode(P.Import(handle, share_type, secret), req), 0, "scripted", Msg.IMPORT)
    if r < 0.88 and exported:
        handle, share_type, _ = rng.choice(exported)
        return Case(P.encode(P.SetPids(handle, share_type, (foreign_pid, os.getpid())), req), 0,
                    "scripted", Msg.SET_PIDS)
    message = P.Release(token) if rng.random() < 0.6 else P.Revoke(token)
    return Case(P.encode(message, req), 0, "scripted", message.TYPE)


def fuzz_live(broker: Broker, seed: int, count: int, seconds: float | None = None,
              connections: int = 8, scripted_rate: float = 0.03) -> dict[str, Any]:
    """Send the first `count` cases of `generate(seed, ...)` to `broker`, with well-formed requests on live
    objects interleaved (`scripted_rate` per fuzz frame); check every reply, and the broker afterwards."""
    rng = random.Random(seed ^ 0x5EED)
    stats = LiveStats()
    fd_base = settled_fd_count(broker)
    state_before = broker_state(broker)
    rss_base, hwm_base = broker.status_kb("VmRSS"), broker.status_kb("VmHWM")
    held_pipes: list[int] = []  # read ends whose write end the broker kept (a successful EXPORT)
    exported: list[tuple[int, int, bytes]] = []
    # the first connection belongs (as the broker sees it) to another process, so imports can succeed
    conns = [Conn(broker.socket, foreign=i == 0) for i in range(connections)]
    start = time.perf_counter()
    deadline = None if seconds is None else start + seconds
    try:
        for next_case in _with_scripted(generate(seed, count), rng, scripted_rate):
            if deadline is not None and stats.sent % 256 == 0 and time.perf_counter() > deadline:
                break
            i = rng.randrange(len(conns))
            if next_case is None and rng.random() < 0.3:
                i = 0  # the other process's connection: where imports can succeed
            conn = conns[i]
            if next_case is None:
                case, size_hint = _scripted(rng, conn, exported, conns[0].pid), MiB2
                stats.scripted[Msg(case.kind).name] += 1
            else:
                stats.fuzz_sent += 1
                case, size_hint = _substitute(rng, next_case, conn, exported, stats, conns[0].pid)
            try:
                valid: Frame | None = P.decode(case.packet, case.nfds)
            except ProtocolError:
                valid = None
            n = min(case.nfds, 7)  # the case's fd count, as real fds (the kernel takes at most 253 per message)
            if case.memfd_size is not None:
                fds, pipes = [rawsock.sealed_memfd(case.memfd_size, "fuzz-export")], []
            else:
                fds, pipes = _attach_fds(rng, n, size_hint, stats) if n else ([], [])
            stats.fds_attached += len(fds)
            stats.frames_with_fds += bool(fds)
            if n != case.nfds:  # the fd count is part of the packet as the broker sees it
                case = Case(case.packet, n, case.origin, case.kind, case.ops)
                valid = None  # more than one fd never decodes
            sent = conn.send(case.packet, fds)
            for fd in fds:
                os.close(fd)
            stats.sent += 1
            data: bytes | None = None
            got: list[int] = []
            reply: Frame | None = None
            if not sent:
                stats.defect("send failed: the broker had closed the connection", case)
            elif rng.random() < 0.001:  # leave without reading the reply
                stats.abandoned += 1
            else:
                if not select.select([conn.sock], [], [], HANG_GUARD)[0]:
                    stats.defect("no reply within the hang guard", case)
                    break
                data, got, truncated = conn.recv()
                if data is None:
                    if not case.packet and not case.nfds:
                        stats.closed_on_empty_packet += 1  # an empty SEQPACKET record reads as EOF: expected
                    else:
                        stats.closed_by_broker += 1
                else:
                    reply = _check_reply(case, valid, data, got, truncated, stats, conn, exported)
                for fd in got:
                    os.close(fd)
            # the broker answers only after closing every fd it does not keep, so this check needs no waiting;
            # it keeps one only for an EXPORT it accepted (a KIND_GPU export takes any fd of the right size)
            kept = [r for r in pipes if not _released(r)] if data is not None else []
            if kept and not (reply is not None and isinstance(reply.message, P.Exported)):
                stats.defect("the broker kept a pipe fd it was sent", case)
            for r in pipes:
                if r in kept or data is None:
                    held_pipes.append(r)  # checked once every connection is closed
                else:
                    os.close(r)
            if data is None or rng.random() < 0.004:  # connection churn (or the broker closed it)
                conn.close()
                conns[i] = Conn(broker.socket, foreign=i == 0)
                stats.reconnects += 1
            if stats.sent % 2000 == 0 and not broker.alive():
                stats.defect("the broker died", case)
                break
    finally:
        for c in conns:
            c.close()
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {
        "seed": seed, "frames_sent": stats.fuzz_sent, "requested": count, "connections": connections,
        "scripted_requests": dict(stats.scripted), "packets_sent": stats.sent,
        "seconds": round(elapsed, 3), "packets_per_s": round(stats.sent / elapsed) if elapsed else None,
        "replies": dict(stats.replies.most_common()), "error_codes": dict(stats.error_codes.most_common()),
        "closed_on_empty_packet": stats.closed_on_empty_packet, "closed_by_broker": stats.closed_by_broker,
        "reconnects": stats.reconnects, "abandoned_replies": stats.abandoned,
        "frames_with_fds": stats.frames_with_fds, "fds_attached": stats.fds_attached,
        "fd_kinds": dict(stats.fd_kinds), "live_object_substitutions": dict(stats.substituted),
        "exports_made": stats.exported, "imports_made": stats.imported,
        "internal_error_messages": dict(stats.internal_messages),
        "broker_fd_baseline": fd_base, "broker_rss_kb_before": rss_base, "broker_hwm_kb_before": hwm_base,
    }
    # afterwards: alive, serving, no fd kept, fd count and RSS back
    alive = broker.alive()
    result["broker_alive"] = alive
    if alive:
        fd_after = settled_fd_count(broker)
        unreleased = 0
        for r in held_pipes:
            unreleased += not _released(r)
            os.close(r)
        held_pipes = []
        state_after = broker_state(broker)
        result.update({
            "broker_fd_after": fd_after, "pipe_fds_still_held": unreleased,
            "state_before": state_before, "state_after": state_after,
            "broker_rss_kb_after": broker.status_kb("VmRSS"), "broker_hwm_kb_after": broker.status_kb("VmHWM"),
        })
        result["round_trip"] = round_trip(broker.env) or "ok"
        result["broker_fd_after_round_trip"] = settled_fd_count(broker)
        result["broker_rss_kb_after_round_trip"] = broker.status_kb("VmRSS")
        if fd_after != fd_base:
            stats.defects.append({"what": f"broker fd count {fd_base} -> {fd_after}"})
        if result["broker_fd_after_round_trip"] != fd_base:
            stats.defects.append({"what": f"broker fd count {fd_base} -> {result['broker_fd_after_round_trip']} "
                                          "after the round trip"})
        if unreleased:
            stats.defects.append({"what": f"{unreleased} pipe fds still held by the broker after all closed"})
        if not state_after["all_free"] or state_after["exports"]:
            stats.defects.append({"what": f"the broker still holds something: {state_after}"})
        growth = result["broker_rss_kb_after"] - rss_base
        result["broker_rss_growth_kb"] = growth
        if growth >= RSS_LIMIT_KB:
            stats.defects.append({"what": f"broker RSS grew by {growth} kB"})
        if result["round_trip"] != "ok":
            stats.defects.append({"what": f"round trip failed after the fuzz: {result['round_trip']}"})
    else:
        stats.defects.append({"what": f"the broker died (exit {broker.proc.returncode})"})
    for r in held_pipes:
        os.close(r)
    log = broker.log_text()
    result["broker_log_tracebacks"] = log.count("Traceback")
    if log.count("Traceback"):
        result["broker_log_tail"] = log[-3000:]
    result["defects"] = len(stats.defects)
    result["defect_samples"] = stats.defects[:50]
    return result


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--atheris-child"]:
        _atheris_child(int(argv[1]), argv[2], argv[3:])
        return 0
    ap = NarrowHelp(prog=prog(__file__), description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=count_option, default=100_000, help="decoder frames (default 100000)")
    ap.add_argument("--seconds", type=seconds_option, default=None, help="time cap for each phase")
    ap.add_argument("--seed", type=whole, default=20251130)
    ap.add_argument("--live", action="store_true", help="also send the frames to a live broker")
    ap.add_argument("--live-frames", type=count_option, default=None,
                    help="frames sent to the broker (default: all --frames; the first N of the same sequence)")
    ap.add_argument("--connections", type=count_option, default=8)
    ap.add_argument("--scripted-rate", type=fraction, default=0.03,
                    help="well-formed requests on live objects interleaved, per fuzz frame (default 0.03)")
    ap.add_argument("--atheris-runs", type=whole, default=2_000_000, help="coverage-guided execs (0: skip)")
    ap.add_argument("--json", default=None, help="write the results here ('-': stdout, instead of the summary)")
    args = ap.parse_args(argv)
    check_outputs(ap, json=None if args.json == "-" else args.json)
    lines: list[str] = []

    result: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *argv]), "cpus": os.cpu_count()}
    dec = fuzz_decoder(args.seed, args.frames, args.seconds)
    result["decoder"] = dec
    lines.append(f"decoder: {dec['frames']} frames in {dec['seconds']} s ({dec['rate_per_s']}/s): "
          f"{dec['decoded_ok']} decoded, {dec['refused']} refused, {dec['defects']} defects; "
          f"{dec['distinct_error_messages']} distinct ProtocolError messages "
          f"({dec['distinct_error_templates']} kinds)")
    ok = dec["defects"] == 0
    if args.atheris_runs:
        ath = fuzz_atheris(args.atheris_runs, args.seed, args.seconds or 600)
        result["atheris"] = ath
        if ath.get("available"):
            lines.append(f"atheris: {ath['execs']} coverage-guided execs in {ath['seconds']} s, "
                         f"cov {ath['coverage_edges']} ft {ath['features']}, ok={ath['ok']}")
            ok = ok and bool(ath["ok"])
        else:
            lines.append("atheris: not installed, coverage-guided run skipped")
    if args.live:
        folder = Path(tempfile.mkdtemp(prefix="vmmshare-fuzz-"))
        try:
            broker = Broker(folder)
            try:
                live = fuzz_live(broker, args.seed, args.live_frames or args.frames, args.seconds, args.connections,
                                 args.scripted_rate)
            finally:
                broker.stop()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        result["live"] = live
        lines.append(f"live: {live['frames_sent']} fuzz frames + {sum(live['scripted_requests'].values())} scripted "
              f"requests in {live['seconds']} s ({live['packets_per_s']} packets/s) over "
              f"{args.connections} connections, {live['frames_with_fds']} with fds; "
              f"replies {readable(live['replies'])}; "
              f"broker fds {live['broker_fd_baseline']} -> {live.get('broker_fd_after')}, RSS "
              f"{live['broker_rss_kb_before']} -> {live.get('broker_rss_kb_after')} kB; "
              f"exports {live['exports_made']}, imports {live['imports_made']}; "
              f"round trip {readable(live.get('round_trip'))}; {live['defects']} defects")
        ok = ok and live["defects"] == 0
    result["ok"] = ok
    if not ok:  # what went wrong, readably: the defects each part recorded
        for part in ("decoder", "atheris", "live"):
            for sample in (result.get(part) or {}).get("defect_samples", [])[:20]:
                lines.append(f"  {part} defect: {readable(sample)[:400]}")
    emit(lines, result, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    entry(main)
