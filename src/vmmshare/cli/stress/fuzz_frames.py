"""Frames for fuzzing the broker protocol: a valid frame of every message type with random values, and the
mutations made of them (bit flips, byte changes, insertions and deletions, truncation and extension, header fields,
type confusion, splices, fd counts), as a reproducible sequence of cases (`generate`) that the decoder fuzzer and
the live one (fuzz_protocol.py, fuzz_live.py) share."""

from __future__ import annotations

import random
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vmmshare.wire import local as P
from vmmshare.wire.local import HEADER, LAYOUTS, MAGIC, MAX_BODY, MAX_FRAME, VERSION, Msg, Tail

U32_MAX = (1 << 32) - 1
MiB2 = 2 << 20


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
