#!/usr/bin/env python3
"""API fuzzing: random arguments for every function of ``vmmshare.acl.rt``, ``vmmshare.acl.util`` and
``acl.init`` / ``acl.finalize`` / ``acl.get_recent_err_msg`` (found by introspection), in a child process
against a private broker.

Arguments are wrong types, huge and negative ints, random ints, valid-looking and live handles and pointers
(from earlier successful calls, so real objects are hit), random 128-byte FABRIC handles (some with the
``b"VMMF"`` magic, some mutated from real ones), shareable handles exported by a peer process (so imports
succeed), and prop / desc / location dicts with random fields. About half the calls start from a plausible
argument list built on live objects, with one argument corrupted now and then.

Invariants (any violation fails the run):
- every ``ret`` is 0 or a documented code (``DOCUMENTED``); 507000 (an exception escaped validation) is reported
  as a bug with its message, any other code as unexpected;
- a failed call returns neutral outputs (0 / None) and leaves a recent error message naming the call;
- ``acl.util`` functions return a value or None (with a message) and never raise;
- the child never crashes or hangs (the parent's timeout);
- after the fuzzer frees what it knows it created (mappings, then handles, reservations, host blocks,
  streams), ``/proc/self/fd``, ``/proc/self/maps`` and ``runtime().counts()`` are back at their baseline;
  and the broker holds nothing and has its fd count back once the child has gone.

    vmmshare stress fuzz_api --calls 100000 --json out.json

Exit status 0 when every invariant held. Loops are bounded by count and by ``--seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common as c  # noqa: E402
from fuzz_live import Broker, broker_state, settled_fd_count  # noqa: E402
from stressio import count_option, emit, entry, prog, readable, seconds_option, whole  # noqa: E402
from vmmshare.cli.console import NarrowHelp, check_outputs  # noqa: E402

DOCUMENTED = {0, 100000, 100002, 100003, 100037, 107000, 107001, 107002, 107003, 107016, 107017, 207000, 207001,
              207006, 507046, 507047, 507910, 507911}
LOCS = ({"id": 0, "type": 1}, {"id": 0, "type": 0}, {"id": 1, "type": 1}, {"id": 0, "type": 2})
LAST_ERROR = frozenset({"peek_at_last_error", "get_last_error"})  # their ret is an earlier call's code
INTERNAL = 507000
MiB = 1 << 20
MiB2 = 2 * MiB
GiB = 1 << 30
ARENA_START, ARENA_END = 16 << 40, 24 << 40
TOUCH_CAP = 16 * MiB  # most bytes one memcpy / memset / ptr_to_bytes may touch (see below)
DEVICE_MEMORY = "256M"
DEVICES = 8
LIMITS = {"handles": 48, "reservations": 32, "mappings": 32, "host_blocks": 32, "streams": 64, "blocks": 24,
          "ipc_imports": 16, "contexts": 16, "threads": 16, "events": 32, "notifies": 16}
PEER_EXPORTS = 8
PEER_KEYS = 4

# ---------------------------------------------------------------- values of every wrong kind


class Opaque:
    """An arbitrary object."""


class IntSub(int):
    """An int subclass: accepted where an int is (isinstance), so it must behave like one."""


def _wrong_values() -> list[Any]:
    import numpy as np

    return [
        "1", "", "0x7a00", 1.0, 0.0, float("nan"), float("inf"), -1.5, None, True, False, [1], [], (), {},
        {"x": 1}, b"\x01", b"", bytearray(b"x"), memoryview(b"abc"), Opaque(), object(), 1j, range(3),
        np.int64(5), np.float32(2.0), np.zeros(2), Opaque, len, {1, 2}, frozenset(),
        2**64, -(2**64), 2**63, -(2**63), 2**70, -1, 0, 1, IntSub(0), IntSub(2**64),
    ]


HUGE = [2**64, -(2**64), 2**63, -(2**63), 2**70, -1, 2**64 - 1, 2**63 - 1, 2**32, 2**31, -(2**31) - 1]


# ---------------------------------------------------------------- the fuzzer (runs in the child)


class Fuzzer:
    def __init__(self, seed: int, peer: list[tuple[Any, int]], peer_pid: int, tmp: Path,
                 peer_keys: list[str] | None = None) -> None:
        import numpy as np

        import vmmshare.acl as acl
        from vmmshare._process import runtime
        from vmmshare.errors import set_recent_error

        self.np = np
        self.acl = acl
        self.runtime = runtime
        self.set_recent_error = set_recent_error
        self.rng = random.Random(seed)
        self.wrong = _wrong_values()
        self.peer = peer  # (shareable, share type) exported by the peer process
        self.peer_keys = peer_keys or []  # IPC keys of the peer's acl.rt.malloc memory (importable here)
        self.peer_pid = peer_pid
        self.tmp = tmp
        self.server_id = runtime().config.server_id
        self.targets = discover(acl)
        self.sigs = {name: inspect.signature(fn) for name, fn, _ in self.targets}
        self.by_target = {name: (fn, params) for name, fn, params in self.targets}
        # what the fuzzer knows it created (so it can free it in order at the end)
        self.handles: Counter[int] = Counter()  # handle -> references held (malloc/import/retain)
        self.handle_size: dict[int, int] = {}
        self.dead_handles: list[int] = []
        self.reservations: dict[int, int] = {}
        self.dead_reservations: list[int] = []
        self.mappings: dict[int, int] = {}
        self.host_blocks: dict[int, int] = {}
        self.dead_host: list[int] = []  # only ever passed where nothing is written through them
        self.streams: set[int] = set()
        self.made_here: set[int] = set()  # handles malloc_physical gave (exportable, once)
        self.exported: set[int] = set()
        self.blocks: dict[int, int] = {}  # acl.rt.malloc pointer -> size
        self.dead_blocks: list[int] = []
        self.keys: Counter[str] = Counter()  # IPC keys this process exported -> get_export_key calls not closed
        self.key_of: dict[int, str] = {}  # malloc pointer -> its key
        self.ipc_imports: dict[str, list[int]] = {}  # imported key -> [pointer, imports not closed]
        self.contexts: set[int] = set()
        self.threads: set[int] = set()
        self.events: set[int] = set()  # made or opened here, not destroyed
        self.notifies: set[int] = set()
        self.registered: set[int] = set()  # host_register's pointers
        self.shareables: list[tuple[Any, int]] = []  # our exports (importing them is refused: 107000)
        self.keep: list[Any] = []  # objects whose addresses bytes_to_ptr / numpy_to_ptr were given
        # results
        self.calls = 0
        self.per_function: Counter[str] = Counter()
        self.ok_per_function: Counter[str] = Counter()
        self.codes: Counter[int] = Counter()
        self.codes_per_function: dict[str, Counter[int]] = {}
        self.internal: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.defects: list[dict[str, Any]] = []
        self.util_none = 0
        self.util_values = 0
        self.forced = 0
        self.streams_dropped = 0
        self.last: Any = None  # the outcome of the latest call (ret, or the type of a util result)
        self.slowest: tuple[float, str] = (0.0, "")
        self.config_files = self._config_files()

    # ------------------------------------------------------------ values

    def _config_files(self) -> list[str]:
        good, bad, empty = self.tmp / "good.json", self.tmp / "bad.json", self.tmp / "empty.json"
        good.write_text('{"dump": {"dump_list": []}}')
        bad.write_bytes(b"{not json \xff")
        empty.write_text("")
        return [str(good), str(bad), str(empty), str(self.tmp), str(self.tmp / "missing.json"), "", "\0", "/"]

    def anything(self) -> Any:
        r = self.rng.random()
        if r < 0.5:
            return self.rng.choice(self.wrong)
        if r < 0.7:
            return self.rng.choice(HUGE)
        if r < 0.85:
            return self.rng.getrandbits(64)
        return self.rng.randrange(-(2**63), 2**63)

    def some_int(self) -> int:
        r = self.rng.random()
        if r < 0.3:
            return self.rng.randrange(-3, 20)
        if r < 0.5:
            return self.rng.choice(HUGE)
        return self.rng.getrandbits(self.rng.choice((8, 16, 32, 48, 64)))

    def device(self) -> Any:
        r = self.rng.random()
        if r < 0.7:
            return self.rng.choice((0, 0, 0, 1, 2, 7))
        if r < 0.85:
            return self.rng.choice((-1, DEVICES, 1000, 2**31, -(2**31) - 1))
        return self.anything()

    def size(self) -> Any:
        r = self.rng.random()
        if r < 0.45:
            return self.rng.randrange(1, 9) * MiB2
        if r < 0.6 and (self.handle_size or self.reservations or self.mappings):
            pool = [*self.handle_size.values(), *self.reservations.values(), *self.mappings.values()]
            return self.rng.choice(pool)
        if r < 0.75:
            return self.rng.choice((0, 1, 4096, MiB2 - 1, MiB2 + 1, GiB, 2 * GiB, 1 << 40, 1 << 62, 1 << 63,
                                    (1 << 64) - MiB2))
        return self.some_int() if r < 0.9 else self.anything()

    def live_handle(self) -> int | None:
        return self.rng.choice(list(self.handles)) if self.handles else None

    def handle(self) -> Any:
        r = self.rng.random()
        h = self.live_handle()
        if r < 0.6 and h is not None:
            return h
        if r < 0.7 and self.dead_handles:
            return self.rng.choice(self.dead_handles)
        if r < 0.8:
            base = h if h is not None else 0x7A00_0000_0000
            return base + self.rng.choice((1, -1, 64, -64, 1 << 20))
        return self.some_int() if r < 0.9 else self.anything()

    def pointer(self, write: bool = False) -> Any:
        """A pointer argument. Writes go only to memory the runtime manages (mappings, reservations, host blocks
        of the fuzzer, the reservation arena) or to random addresses: a freed host block's address may be reused
        by the interpreter, and writing there would be the fuzzer's own use-after-free, not a runtime bug."""
        rng = self.rng
        r = rng.random()
        if r < 0.3 and self.mappings:
            p, n = rng.choice(list(self.mappings.items()))
            return rng.choice((p, p, p + rng.randrange(n), p + n, p + MiB2))
        if r < 0.45 and self.reservations:
            p, n = rng.choice(list(self.reservations.items()))
            return rng.choice((p, p + rng.randrange(0, n, MiB2), p + rng.randrange(n), p + n))
        if r < 0.6 and self.host_blocks:
            p, n = rng.choice(list(self.host_blocks.items()))
            return rng.choice((p, p + rng.randrange(n)))  # never past the end: the next page may be the heap's
        if r < 0.62 and self.blocks:
            p, n = rng.choice(list(self.blocks.items()))
            return rng.choice((p, p, p + rng.randrange(n)))
        if r < 0.63 and self.ipc_imports:
            return rng.choice([v[0] for v in self.ipc_imports.values()])
        if r < 0.65 and self.dead_reservations:
            return rng.choice(self.dead_reservations)
        if r < 0.7 and self.dead_host and not write:
            return rng.choice(self.dead_host)
        if r < 0.8:
            return rng.randrange(ARENA_START, ARENA_END, rng.choice((1, 4096, MiB2)))
        if r < 0.88:
            return rng.choice((0, None, 1, 4096, -1, 2**64, 2**64 - 1, ARENA_START, ARENA_END))
        if r < 0.95:
            return rng.getrandbits(64)
        return self.anything()

    def touch_count(self) -> Any:
        """A byte count for calls that touch memory: sizes that fit are at most TOUCH_CAP (a mapping can be a
        terabyte of sparse memory; touching it all would fill the machine), sizes that cannot fit are anything."""
        v = self.size() if self.rng.random() < 0.5 else self.rng.choice((0, 1, 8, 4096, 65536, MiB, MiB2))
        if isinstance(v, int) and not isinstance(v, bool) and TOUCH_CAP < v < 2**62:
            v = self.rng.randrange(TOUCH_CAP)
        return v

    def location(self) -> Any:
        rng = self.rng
        r = rng.random()
        if r < 0.6:
            return {"id": self.device(), "type": rng.choice((1, 1, 0, 2, 3, 4, 5))}
        if r < 0.75:
            return rng.choice(({"id": 0}, {"type": 1}, {}, {"id": 0, "type": 1, "extra": 9}, {"id": "0", "type": 1}))
        if r < 0.85:
            return {"id": self.anything(), "type": self.anything()}
        return self.anything()

    def prop(self) -> Any:
        rng = self.rng
        # mostly what the acl layer takes (handle type NONE, an attribute of its table), now and then what it refuses
        p: dict[str, Any] = {"handleType": rng.choice((0, 0, 0, 0, 2)), "allocationType": 0,
                             "memAttr": rng.choice((5, 5, 4, 12, 13, 16, 10, 14, 3, 0, 1, rng.randrange(18))),
                             "location": {"id": rng.choice((0, 0, 1, 7)), "type": rng.choice((1, 1, 1, 0))},
                             "reserve": 0}
        r = rng.random()
        if r < 0.55:
            return p
        if r < 0.7:
            key = rng.choice(list(p))
            p[key] = self.anything() if rng.random() < 0.7 else self.some_int()
        elif r < 0.8:
            del p[rng.choice(list(p))]
        elif r < 0.88:
            p["location"] = self.location()
        elif r < 0.93:
            p[rng.choice(("extra", "HandleType", 5))] = self.anything()
        else:
            return self.anything()
        return p

    def desc_list(self) -> Any:
        rng = self.rng
        r = rng.random()
        if r < 0.7:
            return [{"flags": rng.choice((0, 1, 3, 3, 2, 4, 0xFFFFFFFF)) if rng.random() < 0.9 else self.anything(),
                     "location": self.location() if rng.random() < 0.3 else {"id": 0, "type": 1}}
                    for _ in range(rng.choice((1, 1, 2, 3)))]
        if r < 0.8:
            return rng.choice(([], (), [{}], [None], [{"flags": 3}], [{"location": {"id": 0, "type": 1}}]))
        return self.anything()

    def fabric_bytes(self) -> Any:
        rng = self.rng
        real = [s for s, t in [*self.peer, *self.shareables] if t == 2 and isinstance(s, bytes)]
        r = rng.random()
        if r < 0.4 and real:
            raw = bytearray(rng.choice(real))
            for _ in range(rng.choice((0, 1, 1, 2, 4))):
                raw[rng.randrange(128)] ^= 1 << rng.randrange(8)
            return bytes(raw)
        raw = bytearray(rng.randbytes(128))
        if r < 0.8:
            raw[0:4] = b"VMMF"
            if rng.random() < 0.6:
                raw[4], raw[5] = 1, 2
                raw[6:8] = rng.choice((b"\0\0", b"\1\0", rng.randbytes(2)))
                raw[96:128] = bytes(32) if rng.random() < 0.7 else raw[96:128]
                raw[32:64] = bytes(32) if rng.random() < 0.5 else raw[32:64]
        return bytes(raw[: rng.choice((128, 128, 128, 127, 129, 0, 64))] if rng.random() < 0.2 else raw)

    def shareable(self) -> Any:
        rng = self.rng
        r = rng.random()
        pool = [*self.peer, *self.shareables]
        if r < 0.45 and pool:
            return rng.choice(pool)[0]
        if r < 0.7:
            return self.fabric_bytes()
        if r < 0.85:
            return rng.getrandbits(64)
        return self.anything()

    def share_type(self) -> Any:
        return self.rng.choice((1, 2, 1, 2, 0, 3, 255)) if self.rng.random() < 0.85 else self.anything()

    def pid_list(self) -> Any:
        rng = self.rng
        r = rng.random()
        if r < 0.5:
            pids = (self.peer_pid, os.getpid(), 1, rng.randrange(1, 2**22))
            return [rng.choice(pids) for _ in range(rng.randrange(1, 4))]
        if r < 0.6:
            return list(range(1, rng.choice((4096, 4097)) + 1))
        if r < 0.75:
            return rng.choice(([], [0], [-1], [2**31], [2**32], ["1"], [1.0], [None], [True], (5,)))
        return self.anything()

    def flags(self) -> Any:
        return self.rng.choice((0, 0, 0, 1, 2)) if self.rng.random() < 0.8 else self.some_int()

    def shape(self) -> Any:
        rng = self.rng
        r = rng.random()
        if r < 0.6:
            return tuple(rng.choice((0, 1, 2, 16, 1024, 4096)) for _ in range(rng.randrange(0, 4)))
        if r < 0.75:
            return [rng.choice((1, -1, 2**48, 2**48 + 1, 2**64)) for _ in range(rng.randrange(1, 3))]
        return self.anything()

    def npy_type(self) -> Any:
        np = self.np
        return self.rng.choice((0, 1, 5, 7, 11, 12, 17, 23, 24, 100, -1, 2**40, np.float32, np.uint8, "float32",
                                "u1", "O", "S0", "V8", np.dtype("i4"), object, "complex128", "notatype",
                                [("a", "i4")], None, 1.5))

    def array_like(self) -> Any:
        np = self.np
        return self.rng.choice((np.zeros(4, np.uint8), np.arange(3.0), np.zeros((0,)), np.zeros((2, 2))[:, 0],
                                np.array(5), [1, 2], b"xy", None, "s", 3))

    def data_like(self) -> Any:
        return self.rng.choice((b"", b"abc", bytearray(b"xyz"), bytearray(), memoryview(b"m"), "str", None, 5,
                                [1], bytes(4096)))

    def config_path(self) -> Any:
        return self.rng.choice((None, *self.config_files)) if self.rng.random() < 0.8 else self.anything()

    def key(self) -> Any:
        """An IPC key: ours, the peer's, a mutated or made-up one, or anything."""
        rng = self.rng
        pool = [*self.keys, *self.peer_keys, *self.ipc_imports]
        r = rng.random()
        if r < 0.55 and pool:
            return rng.choice(pool)
        if r < 0.7 and pool:
            k = rng.choice(pool)
            at = rng.randrange(len(k))
            return k[:at] + rng.choice("0123456789abcdefXz ") + k[at + 1:]
        if r < 0.8:
            return rng.randbytes(12).hex()
        return rng.choice(("", "x" * 70, None, "\0", "0" * 24)) if r < 0.9 else self.anything()

    def context(self) -> Any:
        r = self.rng.random()
        if r < 0.6 and self.contexts:
            return self.rng.choice(list(self.contexts))
        return self.rng.choice((0, None, 0xC700_0001, 0xC700_0100)) if r < 0.8 else self.some_int()

    def server_pids(self) -> Any:
        rng = self.rng
        r = rng.random()
        if r < 0.6:
            return [{"sdid": rng.choice((self.server_id, self.server_id, 0, 0x1234)),
                     "pid": self.pid_list() if rng.random() < 0.3 else [self.peer_pid]}
                    for _ in range(rng.choice((1, 1, 2)))]
        if r < 0.8:
            return rng.choice(([], None, [{}], [{"sdid": 0}], [{"pid": [1]}], [{"sdid": 0, "pid": None}], [5]))
        return self.anything()

    def by_name(self, fn: str, name: str) -> Any:
        """A value for parameter `name` of `fn`: mostly of the right kind, sometimes anything."""
        if self.rng.random() < 0.15:
            return self.anything()
        gen: dict[str, Callable[[], Any]] = {
            "device_id": self.device, "peer_device_id": self.device, "stream": self.stream,
            "size": self.touch_count if fn == "ptr_to_bytes" else self.size,
            "ptr": lambda: self.pointer(write=False), "dst": lambda: self.pointer(write=True),
            "src": lambda: self.pointer(write=False), "dev_ptr": lambda: self.pointer(write=fn == "memset"),
            "dest_max": self.size, "max_count": self.size, "count": self.touch_count,
            "kind": lambda: self.rng.choice((0, 1, 2, 3, 4, 5, -1)),
            "value": lambda: self.rng.choice((0, 0x5A, 255, 256, -1, 2**31, -(2**31) - 1)),
            "attr": lambda: self.rng.choice((0, 1, 17, 18, -1)), "option": lambda: self.rng.choice((0, 1, 2, -1)),
            "prop": self.prop, "flags": self.flags, "handle": self.handle,
            "alignment": lambda: self.rng.choice((0, 0, 0, MiB2, 1, GiB)),
            "expect_ptr": lambda: self.rng.choice((0, None, None)) if self.rng.random() < 0.6 else self.pointer(),
            "offset": lambda: self.rng.choice((0, 0, 0, MiB2, 1, -1)), "desc_list": self.desc_list,
            "location": self.location, "handle_type": lambda: self.rng.choice((0, 2, 1, 3, -1)),
            "shareable_handle": self.shareable, "share_type": self.share_type, "pid_list": self.pid_list,
            "shape": self.shape, "npy_type": self.npy_type, "array": self.array_like, "data": self.data_like,
            "config_path": self.config_path, "key": self.key,
            "key_len": lambda: self.rng.choice((65, 65, 128, 24, 0, 1024)),
            "policy": lambda: self.rng.choice((0, 1, 2, 3, 6, 0x100, 0x1002, -1)), "context": self.context,
            "server_pids": self.server_pids, "type": lambda: self.rng.choice((0, 0, 1, -1)),
            "level": lambda: self.rng.choice((0, 0, 1)), "timeout": lambda: self.rng.choice((-1, 0, 10, 1000, -2)),
            "thread_id": lambda: self.rng.choice([*self.threads, 0, 12345]) if self.rng.random() < 0.8 else None,
            "fn": lambda: self.rng.choice((int, len, str, None, 5)), "args": lambda: self.rng.choice((None, 1, "s")),
        }
        return gen.get(name, self.anything)()

    def stream(self) -> Any:
        r = self.rng.random()
        if r < 0.6 and self.streams:
            return self.rng.choice(list(self.streams))
        if r < 0.75:
            return self.rng.choice((0, None, 0x5700_0000, 0x5700_0001))
        return self.some_int() if r < 0.9 else self.anything()

    # ------------------------------------------------------------ plausible argument lists on live objects

    def plausible(self, fn: str) -> list[Any] | None:
        rng = self.rng
        h = self.live_handle()
        if fn in ("map_mem", "mem_map_no_access") and h is not None and self.reservations:
            n = self.handle_size.get(h, MiB2)
            fits = [(p, s) for p, s in self.reservations.items() if s >= n]
            if fits:
                p, s = rng.choice(fits)
                return [p + rng.randrange(0, s - n + 1, MiB2), n, 0, h, 0]
        if fn == "mem_set_access" and self.mappings:
            p, n = rng.choice(list(self.mappings.items()))
            return [p, n, [{"flags": rng.choice((0, 1, 3, 3)), "location": {"id": 0, "type": 1}}]]
        if fn in ("unmap_mem", "mem_get_address_range", "mem_retain_allocation_handle") and self.mappings:
            return [rng.choice(list(self.mappings))]
        if fn == "mem_get_access" and self.mappings:
            return [rng.choice(list(self.mappings)), {"id": 0, "type": 1}]
        if fn == "memcpy":
            blocks = [*self.mappings.items(), *self.host_blocks.items()]
            if len(blocks) >= 1:
                (d, dn), (s, sn) = rng.choice(blocks), rng.choice(blocks)
                n = rng.randrange(0, min(dn, sn, TOUCH_CAP) + 1)
                return [d, dn, s, n, rng.choice((4, 4, 0, 1, 2, 3))]
        if fn == "memset":
            blocks = [*self.mappings.items(), *self.host_blocks.items()]
            if blocks:
                p, n = rng.choice(blocks)
                return [p, n, rng.randrange(256), rng.randrange(0, min(n, TOUCH_CAP) + 1)]
        if fn in ("ptr_to_bytes", "ptr_to_numpy"):
            blocks = [*self.mappings.items(), *self.host_blocks.items()]
            if blocks:
                p, n = rng.choice(blocks)
                k = rng.randrange(0, min(n, 4096) + 1)
                return [p, k] if fn == "ptr_to_bytes" else [p, (k,), self.np.uint8]
        if fn in ("free_physical", "mem_get_allocation_properties_from_handle") and h is not None:
            return [h]
        if fn == "malloc_physical":
            return [rng.randrange(1, 5) * MiB2, self.prop(), 0]
        if fn == "reserve_mem_address":
            return [rng.randrange(1, 9) * MiB2, 0, 0, 0]
        if fn == "release_mem_address" and self.reservations:
            return [rng.choice(list(self.reservations))]
        if fn == "malloc_host":
            return [rng.choice((4096, 65536, MiB, MiB2))]
        if fn == "free_host" and self.host_blocks:
            return [rng.choice(list(self.host_blocks))]
        if fn in ("mem_export_to_shareable_handle_v2", "mem_export_to_shareable_handle") and h is not None:
            fresh = [x for x in self.handles if x in self.made_here and x not in self.exported]
            if fresh and rng.random() < 0.7:  # an export happens once: mostly one that can still succeed
                h = rng.choice(fresh)
            if fn.endswith("v2"):
                return [h, rng.choice((0, 1)), rng.choice((1, 2))]
            return [h, 0, rng.choice((0, 1))]
        if fn == "mem_import_from_shareable_handle_v2" and self.peer:
            s, t = rng.choice(self.peer)
            return [s, t, 0]
        if fn == "mem_import_from_shareable_handle" and self.peer:
            defaults = [s for s, t in self.peer if t == 1]
            if defaults:
                return [rng.choice(defaults), rng.choice((0, 0, 1))]
        if fn in ("mem_set_pid_to_shareable_handle_v2", "mem_set_pid_to_shareable_handle") and self.shareables:
            s, t = rng.choice(self.shareables)
            if fn.endswith("v2"):
                return [s, t, [self.peer_pid]]
            if t == 1:
                return [s, [self.peer_pid]]
        if fn in ("destroy_stream", "synchronize_stream", "destroy_stream_force", "stream_query") and self.streams:
            return [rng.choice(list(self.streams))]
        return self.plausible_more(fn)

    def plausible_more(self, fn: str) -> list[Any] | None:
        """Plausible arguments for aclrtMalloc memory, asynchronous copies, contexts and IPC keys."""
        rng = self.rng
        if fn in ("malloc", "malloc_align32", "malloc_cached"):
            return [rng.choice((1, 4096, MiB, MiB2, 3 * MiB)), rng.choice((0, 1, 2, 5))]
        if fn == "free" and self.blocks:
            return [rng.choice(list(self.blocks))]
        blocks = [*self.mappings.items(), *self.host_blocks.items(), *self.blocks.items()]
        if fn == "memcpy_async" and blocks:
            (d, dn), (s, sn) = rng.choice(blocks), rng.choice(blocks)
            n = rng.randrange(0, min(dn, sn, TOUCH_CAP) + 1)
            return [d, dn, s, n, 4, self.stream()]
        if fn == "memset_async" and blocks:
            p, n = rng.choice(blocks)
            return [p, n, rng.randrange(256), rng.randrange(0, min(n, TOUCH_CAP) + 1), self.stream()]
        if fn == "ipc_mem_get_export_key" and self.blocks:
            p, n = rng.choice(list(self.blocks.items()))
            return [p, n, 65, rng.choice((0, 1))]
        if fn == "ipc_mem_set_import_pid" and self.keys:
            return [rng.choice(list(self.keys)), [self.peer_pid]]
        if fn == "ipc_mem_import_by_key" and self.peer_keys:
            return [rng.choice(self.peer_keys), rng.choice((0, 1))]
        if fn == "ipc_mem_close" and (self.keys or self.ipc_imports):
            return [rng.choice([*self.keys, *self.ipc_imports])]
        if fn == "memcpy_batch" and blocks:
            n = rng.randrange(1, 5)
            pairs = [(rng.choice(blocks), rng.choice(blocks)) for _ in range(n)]
            sizes = [rng.randrange(0, min(dn, sn, 4096) + 1) for (_, dn), (_, sn) in pairs]
            attrs = [{"dstLoc": rng.choice(LOCS), "srcLoc": rng.choice(LOCS)}]
            return [[d for (d, _), _ in pairs], [dn for (_, dn), _ in pairs], [s for _, (s, _) in pairs], sizes, n,
                    attrs, [0], 1]
        if fn in ("destroy_context", "set_context", "set_current_context") and self.contexts:
            return [rng.choice(list(self.contexts))]
        if fn == "create_context":
            return [rng.choice((0, 1))]
        if fn == "stop_thread" and self.threads:
            return [rng.choice(list(self.threads))]
        return None

    # ------------------------------------------------------------ one call

    def pick(self) -> tuple[str, Callable[..., Any], list[str], list[Any] | None]:
        """The next function, and for a forced cleanup call its arguments: when a pool is over its limit, the
        next call frees something (keeps memory bounded), on a live object, in an order that can succeed."""
        over = [k for k, v in LIMITS.items() if len(self._pool(k)) > v]
        if over:
            self.forced += 1
            name, args = self._cleanup_step(over[0])
            fn, params = self.by_target[name]
            return name, fn, params, args
        # set_device now and then keeps a current device most of the time
        name = "set_device" if self.rng.random() < 0.03 else self.rng.choice(self.targets)[0]
        fn, params = self.by_target[name]
        return name, fn, params, None

    def _cleanup_step(self, pool: str) -> tuple[str, list[Any]]:
        rng = self.rng
        if pool == "handles":
            return "free_physical", [rng.choice(list(self.handles))]
        if pool == "host_blocks":
            return "free_host", [rng.choice(list(self.host_blocks))]
        if pool == "streams":
            return "destroy_stream", [rng.choice(list(self.streams))]
        if pool == "blocks":
            return "free", [rng.choice(list(self.blocks))]
        if pool == "ipc_imports":
            return "ipc_mem_close", [rng.choice(list(self.ipc_imports))]
        if pool == "contexts":
            return "destroy_context", [rng.choice(list(self.contexts))]
        if pool == "threads":
            return "stop_thread", [rng.choice(list(self.threads))]
        if pool == "events":
            return "destroy_event", [rng.choice(list(self.events))]
        if pool == "notifies":
            return "destroy_notify", [rng.choice(list(self.notifies))]
        if pool == "reservations":
            busy = {r for r, n in self.reservations.items() for m in self.mappings if r <= m < r + n}
            empty = [r for r in self.reservations if r not in busy]
            if empty:
                return "release_mem_address", [rng.choice(empty)]
        return "unmap_mem", [rng.choice(list(self.mappings))]

    NO_ARITY_FUZZ = frozenset({"get_recent_err_msg"})  # a plain function (no ret to carry an error), as in pyACL

    def _pool(self, kind: str) -> Any:
        return {"handles": self.handles, "reservations": self.reservations, "mappings": self.mappings,
                "host_blocks": self.host_blocks, "streams": self.streams, "blocks": self.blocks,
                "ipc_imports": self.ipc_imports, "contexts": self.contexts, "threads": self.threads,
                "events": self.events, "notifies": self.notifies}[kind]

    def arguments(self, name: str, params: list[str]) -> tuple[list[Any], dict[str, Any]]:
        rng = self.rng
        r = rng.random()
        args = self.plausible(name) if r < 0.5 else None
        if args is None:
            args = [self.by_name(name, p) for p in params] if r < 0.92 else [self.anything() for _ in params]
        elif args and rng.random() < 0.25:  # one argument corrupted
            at = rng.randrange(len(args))
            args[at] = self.by_name(name, params[at]) if rng.random() < 0.5 else self.anything()
        kwargs: dict[str, Any] = {}
        r = rng.random() if name not in self.NO_ARITY_FUZZ else 1.0
        if r < 0.02 and args:
            args.pop()
        elif r < 0.04:
            args.append(self.anything())
        elif r < 0.05 and params and args:
            if rng.random() < 0.5:  # the first argument by name (valid Python)
                kwargs[params[0]] = args.pop(0)
            else:  # an unknown keyword
                kwargs["bogus"] = self.anything()
        # the touching calls, whatever produced their arguments: see touch_count
        if name in ("memcpy", "memset", "memcpy_async", "memset_async") and len(args) >= 4:
            args[3] = self._cap(args[3])
        if name == "ptr_to_bytes" and len(args) >= 2:
            args[1] = self._cap(args[1])
        if name == "memcpy_batch" and args:
            args = self._safe_batch(args)
        if name == "wait_and_reset_notify" and args:
            self._let_wait_pass(args[0])
        if name in ("memcpy", "memset", "memcpy_async", "memset_async") and args and self._unsafe_target(args[0]):
            args[0] = self.pointer(write=True)
            if self._unsafe_target(args[0]):
                args[0] = 0
        return args, kwargs

    def _safe_batch(self, args: list[Any]) -> list[Any]:
        """memcpy_batch writes through its `dsts` list: only the fuzzer's own memory (or NULL) is written, at most
        TOUCH_CAP bytes a pair."""
        owned = [*self.mappings.items(), *self.host_blocks.items(), *self.blocks.items()]
        if isinstance(args[0], (list, tuple)):
            dsts = list(args[0])[:8]
            for i, p in enumerate(dsts):
                if isinstance(p, int) and p and not any(b <= p < b + n for b, n in owned):
                    dsts[i] = self.rng.choice(owned)[0] if owned else 0
            args[0] = dsts
        if len(args) > 3 and isinstance(args[3], (list, tuple)):
            args[3] = [self._cap(v) for v in list(args[3])[:8]]
        return args

    def _let_wait_pass(self, notify: Any) -> None:
        """wait_and_reset_notify holds its stream until the notify is recorded: a live notify of the fuzzer's is
        recorded first, so the wait passes (any other argument fails before anything waits)."""
        if type(notify) is int and notify in self.notifies:
            self.acl.rt.record_notify(notify, 0)

    def _cap(self, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and TOUCH_CAP < v < 2**62:
            return self.rng.randrange(TOUCH_CAP)
        return v

    def _unsafe_target(self, p: Any) -> bool:
        """True for a write target that the runtime would check only against /proc/self/maps and that is not
        the fuzzer's: a freed host block (the interpreter may reuse it). Random 64-bit addresses stay allowed."""
        return isinstance(p, int) and (p in self.dead_host or p in self.dead_blocks)

    def call(self) -> None:
        name, fn, params, forced = self.pick()
        args, kwargs = (forced, {}) if forced is not None else self.arguments(name, params)
        self.set_recent_error("")
        t0 = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # the invariant: nothing escapes
            self.calls += 1
            self.per_function[name] += 1
            self._defect("raised", name, args, kwargs, f"{type(exc).__name__}: {exc}")
            self.last = f"raised {type(exc).__name__}"
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        dt = time.perf_counter() - t0
        if fn.__module__.endswith(".util") or name == "get_recent_err_msg":
            self.last = type(result).__name__
        else:
            self.last = result[-1] if isinstance(result, tuple) else result
        if dt > self.slowest[0]:
            self.slowest = (dt, name)
        self.calls += 1
        self.per_function[name] += 1
        module = fn.__module__
        if name in ("start_thread", "stop_thread"):
            self._check_thread_call(name, args, kwargs, result)
        elif module.endswith(".util"):
            self._check_util(name, args, kwargs, result)
        elif name in LAST_ERROR:
            self.codes_per_function.setdefault(name, Counter())[result] += 1
            if type(result) is not int or result not in DOCUMENTED | {INTERNAL}:
                self._defect("the last error is not a code", name, args, kwargs, repr(result))
        elif name == "get_recent_err_msg":
            if not isinstance(result, str):
                self._defect("get_recent_err_msg returned a non-str", name, args, kwargs, repr(result))
        else:
            self._check_ret(name, args, kwargs, result)

    # ------------------------------------------------------------ checking results

    def _defect(self, what: str, name: str, args: list[Any], kwargs: dict[str, Any], detail: str) -> None:
        if len(self.defects) < 100:
            self.defects.append({"what": what, "call": f"{name}({_short(args, kwargs)})", "detail": detail[:600]})

    def _check_thread_call(self, name: str, args: list[Any], kwargs: dict[str, Any], result: Any) -> None:
        """start_thread -> (thread id, pthread error); stop_thread -> pthread error (0, ESRCH); never raises."""
        code = result[-1] if name == "start_thread" and isinstance(result, tuple) else result
        if type(code) is not int:
            self._defect("a thread call returned no int code", name, args, kwargs, repr(result))
            return
        self.codes_per_function.setdefault(name, Counter())[code] += 1
        if code == 0:
            self.ok_per_function[name] += 1
            if name == "start_thread":
                self.threads.add(result[0])
            elif args:
                self.threads.discard(args[0])

    def _check_util(self, name: str, args: list[Any], kwargs: dict[str, Any], result: Any) -> None:
        want = {"ptr_to_numpy": self.np.ndarray, "numpy_to_ptr": int, "bytes_to_ptr": int, "ptr_to_bytes": bytes,
                "numpy_contiguous_to_ptr": int}
        if result is None:
            self.util_none += 1
            msg = self.acl.get_recent_err_msg()
            if not isinstance(msg, str) or name not in msg:
                self._defect("util returned None without a message naming it", name, args, kwargs, repr(msg))
            self.codes_per_function.setdefault(name, Counter())["None"] += 1  # type: ignore[index]
            return
        self.util_values += 1
        self.ok_per_function[name] += 1
        self.codes_per_function.setdefault(name, Counter())["value"] += 1  # type: ignore[index]
        if not isinstance(result, want[name]):
            self._defect("util returned a value of the wrong type", name, args, kwargs, type(result).__name__)
        if name in ("bytes_to_ptr", "numpy_to_ptr", "numpy_contiguous_to_ptr"):
            self.keep = [*self.keep[-16:], args]  # the pointer is only valid while the object lives

    def _check_ret(self, name: str, args: list[Any], kwargs: dict[str, Any], result: Any) -> None:
        outputs: tuple[Any, ...] = ()
        if isinstance(result, tuple):
            outputs, ret = result[:-1], result[-1]
        else:
            ret = result
        if type(ret) is not int:
            self._defect("ret is not an int", name, args, kwargs, repr(result)[:200])
            return
        self.codes[ret] += 1
        self.codes_per_function.setdefault(name, Counter())[ret] += 1
        if ret == 0:
            self.ok_per_function[name] += 1
            self._track(name, args, kwargs, outputs)
            for v in outputs:
                if not (type(v) is int or isinstance(v, (bytes, dict, str))):
                    self._defect("success output of an odd type", name, args, kwargs, repr(outputs)[:200])
            return
        if name in ("destroy_stream", "destroy_stream_force", "synchronize_stream") and args:
            tracked = type(args[0]) is int and args[0] in self.streams
            gone = tracked and "not a live stream" in self.acl.get_recent_err_msg()
            if gone:  # reset_device(_force) or finalize dropped it: the runtime no longer has it
                self.streams.discard(args[0])
                self.streams_dropped += 1
        msg = self.acl.get_recent_err_msg()
        if not isinstance(msg, str) or not msg.strip() or name not in msg:
            self._defect("failure without a recent error message naming the call", name, args, kwargs, repr(msg))
        if name == "memcpy_batch":  # its failIndex says which pair failed (SIZE_MAX: none did)
            if len(outputs) != 1 or type(outputs[0]) is not int or not 0 <= outputs[0] <= (1 << 64) - 1:
                self._defect("memcpy_batch failed without a failIndex", name, args, kwargs, repr(outputs)[:200])
        elif any(v not in (0, None, "") for v in outputs):
            self._defect("failure with non-neutral outputs", name, args, kwargs, repr(outputs)[:200])
        if ret == INTERNAL:
            self.internal[f"{name}: {msg}"[:400]] += 1
            self._defect("507000: an exception escaped validation", name, args, kwargs, msg)
        elif ret not in DOCUMENTED:
            self.unexpected[f"{name} -> {ret}: {msg}"[:400]] += 1
            self._defect(f"undocumented code {ret}", name, args, kwargs, msg)

    def _track(self, name: str, args: list[Any], kwargs: dict[str, Any], outputs: tuple[Any, ...]) -> None:
        """Follow what a successful call created or destroyed."""
        a = list(self.sigs[name].bind(*args, **kwargs).arguments.values())  # in parameter order
        out = outputs[0] if outputs else None
        if name in ("malloc_physical", "mem_import_from_shareable_handle", "mem_import_from_shareable_handle_v2",
                    "mem_retain_allocation_handle"):
            if name == "malloc_physical":
                self.made_here.add(out)
            self.handles[out] += 1
            with contextlib.suppress(Exception):
                self.handle_size[out] = self.runtime().memory.allocation(out).size
        elif name == "free_physical":
            h = int(a[0])
            self.handles[h] -= 1
            if self.handles[h] <= 0:
                del self.handles[h]
                self.handle_size.pop(h, None)
                self.dead_handles = [*self.dead_handles[-32:], h]
                self.made_here.discard(h)
                self.exported.discard(h)
        elif name in ("reserve_mem_address", "reserve_mem_address_no_uc_memory"):
            self.reservations[out] = int(a[0])
        elif name == "release_mem_address":
            p = int(a[0])
            self.reservations.pop(p, None)
            self.dead_reservations = [*self.dead_reservations[-32:], p]
        elif name in ("map_mem", "mem_map_no_access"):
            self.mappings[int(a[0])] = int(a[1])
        elif name == "unmap_mem":
            self.mappings.pop(int(a[0]), None)
        elif name == "malloc_host":
            if out in self.dead_host:  # the kernel reused a freed block's address: it is not dead any more
                self.dead_host = [d for d in self.dead_host if d != out]
            if int(a[0]) > 64 * MiB:  # a big block: free it again at once (it is never touched)
                self.acl.rt.free_host(out)
            else:
                self.host_blocks[out] = int(a[0])
        elif name == "free_host":
            p = int(a[0])
            self.host_blocks.pop(p, None)
            self.dead_host = [*self.dead_host[-32:], p]
        elif name == "create_stream":
            self.streams.add(out)
        elif name in ("destroy_stream", "destroy_stream_force"):
            self.streams.discard(int(a[0]))
        elif name in ("mem_export_to_shareable_handle", "mem_export_to_shareable_handle_v2"):
            self.exported.add(int(a[0]))
            st = 1 if name == "mem_export_to_shareable_handle" else int(a[2])
            self.shareables = [*self.shareables[-32:], (out, st)]
        else:
            self._track_more(name, a, out)

    def _track_more(self, name: str, a: list[Any], out: Any) -> None:
        """Follow aclrtMalloc blocks, IPC keys and imports, contexts."""
        if name in ("malloc", "malloc_align32", "malloc_cached"):
            self.dead_blocks = [d for d in self.dead_blocks if d != out]
            self.blocks[out] = int(a[0])
        elif name == "free":
            p = int(a[0])
            self.blocks.pop(p, None)
            self.dead_blocks = [*self.dead_blocks[-32:], p]
            key = self.key_of.pop(p, None)
            if key is not None:
                self.keys.pop(key, None)
        elif name == "ipc_mem_get_export_key":
            self.keys[out] += 1
            self.key_of[int(a[0])] = out
        elif name == "ipc_mem_import_by_key":
            self.ipc_imports.setdefault(a[0], [out, 0])[1] += 1
        elif name == "ipc_mem_close":
            key = a[0]
            if key in self.ipc_imports:
                self.ipc_imports[key][1] -= 1
                if self.ipc_imports[key][1] == 0:
                    del self.ipc_imports[key]
            elif key in self.keys:
                self.keys[key] -= 1
                if self.keys[key] <= 0:
                    del self.keys[key]
        elif name == "create_context":
            self.contexts.add(out)
        elif name == "destroy_context":
            self.contexts.discard(int(a[0]))
        elif name in ("create_event", "create_event_with_flag", "create_event_ex_with_flag", "ipc_open_event_handle"):
            self.events.add(out)
        elif name == "destroy_event":
            self.events.discard(int(a[0]))
        elif name in ("create_notify", "notify_import_by_key"):
            self.notifies.add(out)
        elif name == "destroy_notify":
            self.notifies.discard(int(a[0]))
        elif name == "host_register":
            self.registered.add(int(a[0]))
        elif name == "host_unregister":
            self.registered.discard(int(a[0]))

    # ------------------------------------------------------------ cleanup

    def cleanup(self) -> dict[str, int]:
        """Free everything the fuzzer knows it holds, in order; counts the calls that failed."""
        rt = self.acl.rt
        failed: Counter[str] = Counter()
        for key, (_, count) in list(self.ipc_imports.items()):
            for _ in range(count):
                failed["ipc_mem_close"] += rt.ipc_mem_close(key) != 0
        for key, refs in list(self.keys.items()):
            for _ in range(refs):
                failed["ipc_mem_close"] += rt.ipc_mem_close(key) != 0
        for p in list(self.blocks):
            failed["free"] += rt.free(p) != 0
        for p in list(self.mappings):
            failed["unmap_mem"] += rt.unmap_mem(p) != 0
        for h, refs in list(self.handles.items()):
            for _ in range(refs):
                failed["free_physical"] += rt.free_physical(h) != 0
        for p in list(self.reservations):
            failed["release_mem_address"] += rt.release_mem_address(p) != 0
        for p in list(self.host_blocks):
            failed["free_host"] += rt.free_host(p) != 0
        for s in list(self.streams):  # reset_device drops a device's streams: those fail here, harmlessly
            ret = rt.destroy_stream(s)
            if ret == 107003:  # a stream is destroyed in its own context
                with contextlib.suppress(Exception):
                    rt.set_context(self.runtime().devices.stream(s).context)
                ret = rt.destroy_stream(s)
            failed["destroy_stream"] += ret != 0
        for e in list(self.events):
            failed["destroy_event"] += rt.destroy_event(e) != 0
        for n in list(self.notifies):
            failed["destroy_notify"] += rt.destroy_notify(n) != 0
        for p in list(self.registered):  # (host_unregister needs a current device)
            rt.set_device(0)
            failed["host_unregister"] += rt.host_unregister(p) != 0
        for ctx in list(self.contexts):
            failed["destroy_context"] += rt.destroy_context(ctx) != 0
        for t in list(self.threads):
            failed["stop_thread"] += self.acl.util.stop_thread(t) != 0
        if self.runtime().initialized:
            self.acl.finalize()
        self.mappings.clear()
        self.handles.clear()
        self.reservations.clear()
        self.host_blocks.clear()
        self.streams.clear()
        self.made_here.clear()
        self.exported.clear()
        self.blocks.clear()
        self.keys.clear()
        self.key_of.clear()
        self.ipc_imports.clear()
        self.contexts.clear()
        self.threads.clear()
        self.events.clear()
        self.notifies.clear()
        self.registered.clear()
        self.keep.clear()
        return {k: v for k, v in failed.items() if v}


def discover(acl: Any) -> list[tuple[str, Callable[..., Any], list[str]]]:
    """Every public function of acl.rt and acl.util, and acl.init / finalize / get_recent_err_msg."""
    found = []
    for mod in (acl.rt, acl.util):
        for name, fn in sorted(vars(mod).items()):
            if callable(fn) and getattr(fn, "__module__", "") == mod.__name__ and not name.startswith("_"):
                found.append((name, fn, list(inspect.signature(fn).parameters)))
    for name in ("init", "finalize", "get_recent_err_msg"):
        fn = getattr(acl, name)
        found.append((name, fn, list(inspect.signature(fn).parameters)))
    return found


def _short(args: list[Any], kwargs: dict[str, Any]) -> str:
    def one(v: Any) -> str:
        if isinstance(v, (bytes, bytearray)) and len(v) > 16:
            return f"{type(v).__name__}[{len(v)}]({bytes(v[:8]).hex()}…)"
        if isinstance(v, (list, tuple)) and len(v) > 6:
            return f"{type(v).__name__}[{len(v)}]({', '.join(map(one, v[:3]))}, …)"
        r = repr(v)
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 4096:
            r = hex(v)
        return r if len(r) < 200 else r[:200] + "…"

    return ", ".join([*map(one, args), *(f"{k}={one(v)}" for k, v in kwargs.items())])


# ---------------------------------------------------------------- probes


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def maps_lines() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def library_maps() -> int:
    """VMAs the runtime makes: in the reservation arena, or memfd mappings."""
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo = int(parts[0].split("-")[0], 16)
            if ARENA_START <= lo < ARENA_END or (len(parts) > 5 and "memfd:" in parts[5]):
                n += 1
    return n


def _interpreter_vma(line: str) -> bool:
    """A VMA the interpreter's own allocators make and drop as objects come and go (the [heap], anonymous
    read-write private memory outside the reservation arena, such as pymalloc's 1 MiB arenas), as opposed to
    what the runtime makes (arena reservations and mappings, memfd mappings, file mappings)."""
    parts = line.split()
    lo = int(parts[0].split("-")[0], 16)
    path = parts[5] if len(parts) > 5 else ""
    # rw-p: the allocators' memory; ---p: the guard pages of thread stacks and the reserve of the C library's
    # per-thread malloc arenas, which stay (cached) after the stream and start_thread threads that made them end
    return parts[1] in ("rw-p", "---p") and path in ("", "[heap]") and not ARENA_START <= lo < ARENA_END


# ---------------------------------------------------------------- the peer: exports for the fuzzer to import

PEER = r"""
import json, sys
import vmmshare.acl as acl
trust = int(sys.argv[1])
n = int(sys.argv[2])
assert acl.rt.set_device(0) == 0
prop = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
out = []
for i in range(n + 1):
    h, ret = acl.rt.malloc_physical(2 << 20, prop, 0)
    assert ret == 0, acl.get_recent_err_msg()
    st, flags = (1, 2)[i % 2], (i // 2) % 2
    sh, ret = acl.rt.mem_export_to_shareable_handle_v2(h, flags, st)
    assert ret == 0, acl.get_recent_err_msg()
    if not flags:
        assert acl.rt.mem_set_pid_to_shareable_handle_v2(sh, st, [trust]) == 0, acl.get_recent_err_msg()
    if i == n:  # one revoked handle: exported, then freed
        assert acl.rt.free_physical(h) == 0
    out.append([sh.hex() if isinstance(sh, bytes) else sh, st])
keys = []
for i in range(int(sys.argv[3])):  # IPC keys of acl.rt.malloc memory, half of them with a trustlist
    p, ret = acl.rt.malloc(2 << 20, 0)
    assert ret == 0, acl.get_recent_err_msg()
    key, ret = acl.rt.ipc_mem_get_export_key(p, 2 << 20, 65, i % 2)
    assert ret == 0, acl.get_recent_err_msg()
    if i % 2 == 0:
        assert acl.rt.ipc_mem_set_import_pid(key, [trust]) == 0, acl.get_recent_err_msg()
    keys.append(key)
print(json.dumps({"handles": out, "keys": keys}), flush=True)
sys.stdin.read()  # hold the exports until the fuzzer is done
"""


def start_peer() -> tuple[subprocess.Popen[str], list[tuple[Any, int]], list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(os.getpid()), str(PEER_EXPORTS), str(PEER_KEYS)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise RuntimeError(f"the peer exporter failed (exit {proc.returncode})")
    got = json.loads(line)
    handles = [(bytes.fromhex(v) if isinstance(v, str) else v, st) for v, st in got["handles"]]
    return proc, handles, got["keys"]


# ---------------------------------------------------------------- the child


def child_main(calls: int, seconds: float, seed: int, result_path: Path, trace: Path | None) -> int:
    faulthandler.enable()
    import vmmshare.acl as acl
    from vmmshare._process import runtime

    tmp = Path(tempfile.mkdtemp(prefix="vmmshare-fuzzapi-child-"))
    peer, peer_handles, peer_keys = start_peer()
    try:
        fz = Fuzzer(seed, peer_handles, peer.pid, tmp, peer_keys)
        # warm up: connect to the broker, load numpy and every lazy path once, then free it all
        assert acl.rt.set_device(0) == 0
        warm = Fuzzer(seed ^ 1, peer_handles, peer.pid, tmp, peer_keys)
        for _ in range(300):
            warm.call()
        warm.cleanup()
        warmup_defects = warm.defects
        del warm
        gc.collect()
        assert acl.rt.set_device(0) == 0
        base = {"fds": fd_count(), "maps": maps_lines(), "library_maps": library_maps(),
                "counts": runtime().counts()}
        maps_before = Path("/proc/self/maps").read_text().splitlines()
        tracefd = os.open(trace, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if trace else -1
        selftest = os.environ.get("VMMSHARE_FUZZ_SELFTEST", "")  # the harness's own tests: a crash, a hang
        start = time.perf_counter()
        deadline = start + seconds
        while fz.calls < calls and (fz.calls % 256 or time.perf_counter() < deadline):
            if tracefd >= 0:  # the call about to run, written before it runs (survives a crash)
                state, forced = fz.rng.getstate(), fz.forced
                name, _, params, fixed = fz.pick()
                args, kwargs = (fixed, {}) if fixed is not None else fz.arguments(name, params)
                os.write(tracefd, f"{fz.calls} {name}({_short(args, kwargs)})\n".encode())
                fz.rng.setstate(state)
                fz.forced = forced
            fz.call()
            if tracefd >= 0:
                os.write(tracefd, f"  -> {fz.last}\n".encode())
            if selftest and fz.calls == 100:
                _selftest(selftest)
        elapsed = time.perf_counter() - start
        live = {"handles": sum(fz.handles.values()), "reservations": len(fz.reservations),
                "mappings": len(fz.mappings), "host_blocks": len(fz.host_blocks), "streams": len(fz.streams),
                "blocks": len(fz.blocks), "ipc_keys": len(fz.keys), "ipc_imports": len(fz.ipc_imports),
                "contexts": len(fz.contexts)}
        cleanup_failures = fz.cleanup()
        if acl.rt.set_device(0) == 0:
            acl.rt.reset_device_force(0)
            acl.rt.set_device(0)
        gc.collect()
        after = {"fds": fd_count(), "maps": maps_lines(), "library_maps": library_maps(),
                 "counts": runtime().counts()}
        maps_after = Path("/proc/self/maps").read_text().splitlines()
        maps_diff = {"gone": sorted(set(maps_before) - set(maps_after)),
                     "new": sorted(set(maps_after) - set(maps_before))}
        maps_diff["unexplained"] = [line for line in maps_diff["gone"] + maps_diff["new"] if not _interpreter_vma(line)]
        result = {
            "seed": seed, "calls": fz.calls, "requested": calls, "seconds": round(elapsed, 2),
            "rate_per_s": round(fz.calls / elapsed) if elapsed else None, "functions": len(fz.targets),
            "function_names": [t[0] for t in fz.targets],
            "codes": {str(k): v for k, v in sorted(fz.codes.items())},
            "ok_calls": sum(fz.ok_per_function.values()),
            "ok_per_function": dict(sorted(fz.ok_per_function.items())),
            "calls_per_function": dict(sorted(fz.per_function.items())),
            "codes_per_function": {k: {str(c): n for c, n in v.items()}
                                   for k, v in sorted(fz.codes_per_function.items())},
            "util_values": fz.util_values, "util_none": fz.util_none,
            "internal_errors": dict(fz.internal.most_common()), "unexpected_codes": dict(fz.unexpected.most_common()),
            "defects": len(fz.defects), "defect_samples": fz.defects,
            "forced_cleanup_calls": fz.forced, "streams_dropped_by_reset": fz.streams_dropped,
            "live_at_end": live, "cleanup_failures": cleanup_failures,
            "slowest_call": {"seconds": round(fz.slowest[0], 4), "function": fz.slowest[1]},
            "baseline": base, "after": after, "peer_exports": len(peer_handles),
            "warmup_defects": warmup_defects, "maps_diff": maps_diff,
        }
        result_path.write_text(json.dumps(result, indent=2, default=str))
        return 0
    finally:
        if peer.stdin:
            peer.stdin.close()
        peer.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def _selftest(kind: str) -> None:
    """Misbehave on purpose, so the harness's own tests can check that the parent notices."""
    import ctypes

    if kind == "crash":
        faulthandler.disable()
        ctypes.memset(0, 0, 1)  # SIGSEGV: a write to NULL
    elif kind == "hang":
        r, _w = os.pipe()
        os.read(r, 1)  # blocks for good: nobody writes
    elif kind == "leak":
        os.dup(0)  # one fd more at the end than at the baseline


# ---------------------------------------------------------------- the parent


def run(calls: int, seed: int, seconds: float = 600.0, trace: Path | None = None,
        hang_guard: float | None = None, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the fuzz in a child process against a private broker; returns the child's results plus the parent's
    checks, with `result["ok"]` telling whether every invariant held."""
    folder = Path(tempfile.mkdtemp(prefix="vmmshare-fuzzapi-"))
    result: dict[str, Any] = {}
    try:
        broker = Broker(folder, env={"VMMSHARE_DEVICE_MEMORY": DEVICE_MEMORY})
        try:
            broker_fds = settled_fd_count(broker)
            result_path = folder / "result.json"
            env = {**broker.env, "VMMSHARE_DEVICE_MEMORY": DEVICE_MEMORY, "PYTHONFAULTHANDLER": "1",
                   "TMPDIR": str(folder), **(extra_env or {})}  # a crashed child's files go with the folder
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--calls", str(calls), "--seed",
                   str(seed), "--seconds", str(seconds), "--result", str(result_path)]
            if trace:
                cmd += ["--trace", str(trace)]
            guard = hang_guard if hang_guard is not None else seconds + 120
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=guard)
                rc, err = proc.returncode, proc.stderr
            except subprocess.TimeoutExpired as exc:
                rc = "timeout"
                raw = exc.stderr or ""
                err = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            result = json.loads(result_path.read_text()) if result_path.exists() else {}
            result["child_returncode"] = rc
            result["child_stderr_tail"] = err[-4000:]
            result["child_tracebacks"] = err.count("Traceback")
            result["broker_alive"] = broker.alive()
            if broker.alive():
                result["broker_fds"] = {"before": broker_fds, "after": settled_fd_count(broker)}
                result["broker_state_after"] = broker_state(broker)
            result["broker_log_tracebacks"] = broker.log_text().count("Traceback")
        finally:
            broker.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result["ok"] = verdict(result) == []
    result["violations"] = verdict(result)
    return result


def verdict(r: dict[str, Any]) -> list[str]:
    """Every invariant that did not hold, in words."""
    bad = []
    if r.get("child_returncode") != 0:
        bad.append(f"the child did not finish cleanly: exit {r.get('child_returncode')} (crash or hang)")
        return bad
    if r.get("defects"):
        bad.append(f"{r['defects']} defects (see defect_samples)")
    if r.get("warmup_defects"):
        bad.append(f"{len(r['warmup_defects'])} defects during the warm-up (see warmup_defects)")
    if r.get("internal_errors"):
        bad.append(f"507000 internal errors: {list(r['internal_errors'])[:5]}")
    if r.get("unexpected_codes"):
        bad.append(f"undocumented codes: {list(r['unexpected_codes'])[:5]}")
    base, after = r.get("baseline", {}), r.get("after", {})
    for key in ("fds", "library_maps", "counts"):
        if base.get(key) != after.get(key):
            bad.append(f"{key} did not return to baseline: {base.get(key)} -> {after.get(key)}")
    unexplained = r.get("maps_diff", {}).get("unexplained")
    if unexplained:  # a difference in the interpreter's own heap VMAs alone is not the runtime's doing
        bad.append(f"/proc/self/maps did not return to baseline ({base.get('maps')} -> {after.get('maps')} lines): "
                   f"{unexplained[:6]}")
    if r.get("child_tracebacks"):
        bad.append(f"{r['child_tracebacks']} tracebacks on the child's stderr")
    if not r.get("broker_alive"):
        bad.append("the broker died")
    else:
        fds = r.get("broker_fds", {})
        if fds.get("before") != fds.get("after"):
            bad.append(f"broker fds {fds.get('before')} -> {fds.get('after')}")
        state = r.get("broker_state_after", {})
        if not state.get("all_free") or state.get("exports"):
            bad.append(f"the broker still holds something after the child left: {state}")
    if r.get("broker_log_tracebacks"):
        bad.append("tracebacks in the broker log")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = NarrowHelp(prog=prog(__file__), description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=count_option, default=100_000, help="calls to make (default 100000)")
    ap.add_argument("--seconds", type=seconds_option, default=600.0, help="time cap for the fuzz loop (default 600)")
    ap.add_argument("--seed", type=whole, default=20251130)
    ap.add_argument("--json", default=None, help="write the results here ('-': stdout, instead of the summary)")
    ap.add_argument("--trace", type=Path, default=None, help="write each call before it runs (to find a crash)")
    ap.add_argument("--backend", choices=["host", "cuda", "fakecuda"], default="host",
                    help="device memory: host memfds (default), a real GPU, or fakecuda/ (the CPU stand-in for "
                         "the CUDA driver, built with $CC)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    check_outputs(ap, json=None if args.json == "-" else args.json)
    if args.child:
        return child_main(args.calls, args.seconds, args.seed, args.result, args.trace)
    if problem := c.backend_problem(args.backend):
        ap.exit(2, f"{ap.prog}: {problem}\n")
    with c.backend_env(args.backend) as extra:
        r = run(args.calls, args.seed, args.seconds, args.trace, extra_env=extra)
    lines = [f"{r.get('calls')} calls of {r.get('functions')} functions in {r.get('seconds')} s "
             f"({r.get('rate_per_s')}/s), {r.get('ok_calls')} succeeded; codes {readable(r.get('codes'))}",
             f"fds {r.get('baseline', {}).get('fds')} -> {r.get('after', {}).get('fds')}, maps "
             f"{r.get('baseline', {}).get('maps')} -> {r.get('after', {}).get('maps')}, counts back: "
             f"{r.get('baseline', {}).get('counts') == r.get('after', {}).get('counts')}; "
             f"child exit {r.get('child_returncode')}"]
    if r["violations"]:
        lines.append("VIOLATIONS:\n  " + "\n  ".join(r["violations"]))
        lines += [f"  - {d['what']}: {d['call']}\n      {d['detail']}" for d in r.get("defect_samples", [])[:20]]
        if r.get("child_returncode") != 0:
            lines.append(r.get("child_stderr_tail", ""))
    emit(lines, r, args.json)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    entry(main)
