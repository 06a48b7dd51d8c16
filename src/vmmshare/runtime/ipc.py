"""The runtime's older sharing API, IPC memory keys (aclrtIpcMem*), on the broker's exports and trustlists.

A key names the broker export of the allocation behind an aclrtMalloc pointer: its DEFAULT handle and the server
it was made on, as 24 hex digits. The exporter's close revokes the export (importers keep their memory); an
importer's import maps the memory at a pointer of its own, and its close unmaps it.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import constants as C
from ..errors import FeatureNotSupportedError, InvalidHandleError, InvalidParamError, NoPermissionError
from ..wire.handles import ShareableHandle, ShareType
from .blocks import IPC, MALLOC
from .tables import Allocation

if TYPE_CHECKING:
    from .blocks import Blocks
    from .shared import Shared
    from .sharing import Sharing
    from .vmm import Vmm

KEY_BUFFER = 65  # the runtime's key buffer: `len` must be at least this (the driver's name size)
MAX_PIDS_PER_CALL = 31  # the driver takes at most this many pids in one aclrtIpcMemSetImportPid
_KEY = re.compile(r"^([0-9a-f]{16})([0-9a-f]{8})$")


@dataclass(frozen=True)
class Key:
    """A parsed IPC key: the node's handle value and the server that made it."""

    value: int
    server: int

    @property
    def text(self) -> str:
        return f"{self.value:016x}{self.server:08x}"


def parse_key(text: str) -> Key:
    """An IPC key's text (what ipc_mem_get_export_key returned); 107000 for anything else."""
    m = _KEY.match(text)
    if m is None or int(m.group(1), 16) == 0:
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise InvalidParamError(f"{shown!r} is not an IPC memory key (24 lower-case hex digits from "
                                "ipc_mem_get_export_key)")
    return Key(int(m.group(1), 16), int(m.group(2), 16))


@dataclass(eq=False)
class Exported:
    key: Key
    alloc: Allocation
    pid_validation: bool
    refs: int = 1  # each get_export_key of the pointer; the exporter's closes count down to the revocation


@dataclass(eq=False)
class Imported:
    ptr: int
    count: int = 1  # each import_by_key of the key in this process; each close drops one


class Ipc:
    """This process's IPC exports and imports by key value, and the attributes set on keys."""

    def __init__(self, s: Shared, memory: Vmm, sharing: Sharing, blocks: Blocks) -> None:
        self.s, self.memory, self.sharing, self.blocks = s, memory, sharing, blocks
        self.exports: dict[int, Exported] = {}
        self.imports: dict[int, Imported] = {}
        self.attrs: dict[str, int] = {}  # key text -> ACL_RT_IPC_MEM_ATTR_ACCESS_LINK value
        self._lock = threading.RLock()  # one import or close of a key at a time (an import waits on the broker)

    def export(self, ptr: int, size: int, pid_validation: bool) -> str:
        """The key of the aclrtMalloc block at `ptr` (`size` bytes of it); exporting it again gives the same key."""
        s = self.s
        with s.lock:
            block = self.blocks.at(ptr, MALLOC)
            if not 0 < size <= block.size:
                raise InvalidParamError(f"size {size} must be in [1, {block.size}], the size acl.rt.malloc gave "
                                        f"{ptr:#x}")
            alloc = block.alloc
            if alloc.exported is not None:
                done = self.exports.get(alloc.exported.value)
                if done is None or done.refs == 0:
                    raise InvalidParamError(f"the IPC key of {ptr:#x} was closed: memory exports once; acl.rt.malloc "
                                            "new memory to share again")
                if done.pid_validation != pid_validation:
                    raise InvalidParamError(f"{ptr:#x} is exported already with pid validation "
                                            f"{'on' if done.pid_validation else 'off'}: its key is {done.key.text}")
                done.refs += 1
                return done.key.text
            shareable = self.sharing.export_alloc(alloc, ShareType.DEFAULT, pid_validation)
            key = Key(shareable.value, s.config.server_id)
            self.exports[key.value] = Exported(key, alloc, pid_validation)
            return key.text

    def set_pids(self, text: str, pids: list[int]) -> None:
        """Add `pids` (of this server) to the trustlist of a key this process exported."""
        key = self._local(parse_key(text))
        if len(pids) > MAX_PIDS_PER_CALL:
            raise InvalidParamError(f"{len(pids)} pids in one call: at most {MAX_PIDS_PER_CALL}; call again for more")
        done = self.exports.get(key.value)
        if done is not None and not done.pid_validation:
            raise NoPermissionError(f"key {text} was exported with ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION: "
                                    "it has no trustlist to set")
        self.sharing.set_pids(ShareableHandle.default(key.value), pids)

    def set_pids_on_servers(self, text: str, entries: list[tuple[int, list[int]]]) -> None:
        """Trust pids per server (aclrtIpcMemImportPidInterServer): this server's as `set_pids`, others' through
        the cross-server transport. Every entry is checked before any takes effect."""
        key = parse_key(text)
        for i, (_, pids) in enumerate(entries):
            if len(pids) > MAX_PIDS_PER_CALL:
                raise InvalidParamError(f"server_pids[{i}] has {len(pids)} pids: at most {MAX_PIDS_PER_CALL} per entry")
        remote = [(sdid, pids) for sdid, pids in entries if sdid != self.s.config.server_id]
        if remote:
            self.trust_remote(key, remote)
        for sdid, pids in entries:
            if sdid == self.s.config.server_id:  # an entry admits its server's pids only
                self.set_pids(text, pids)

    def trust_remote(self, key: Key, entries: list[tuple[int, list[int]]]) -> None:
        """Trust processes of other servers on the key's export, as (server id, pid) pairs: each admits that pid of
        that server only, as its own broker reports it (the broker refuses with 207000 when this node has no
        cross-server transport). The same trustlist path as the VMM calls' `Sharing.set_remote_pids`."""
        self._local(key)
        done = self.exports.get(key.value)
        if done is not None and not done.pid_validation:
            raise NoPermissionError(f"key {key.text} was exported with ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_"
                                    "VALIDATION: it has no trustlist to set")
        for sdid, pids in entries:
            self.sharing.set_remote_pids(ShareableHandle.default(key.value), sdid, pids)

    def import_key(self, text: str, device: int) -> int:
        """Map the memory a key names into this process (on `device`); importing it again gives the same pointer."""
        key = self._local(parse_key(text))
        with self._lock:
            done = self.imports.get(key.value)
            if done is not None:  # the same pointer, if the broker still admits this process to the key
                self._still_admitted(key)
                done.count += 1
                return done.ptr
            alloc = self.sharing.import_alloc(ShareableHandle.default(key.value), device, IPC)
            self.memory.register(alloc)
            ptr = self.blocks.map_new(alloc, alloc.size)
            self.imports[key.value] = Imported(ptr)
            return ptr

    def _still_admitted(self, key: Key) -> None:
        """Ask the broker again, as the runtime opens the key again on each import: a key its exporter closed or
        freed fails with 107017, a trustlist that no longer admits this process with 207006."""
        node = self.s.node
        got = node.import_handle(key.value, C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, b"")
        os.close(got.fd)
        self.s.safe_node_call(node.release, got.node_ref)

    def set_attr(self, text: str, attr: int) -> None:
        self.attrs[parse_key(text).text] = attr

    def close(self, text: str) -> None:
        """An importer's close drops one import (unmapped at the last); the exporter's close revokes the key once
        every get_export_key of it is closed; a key with only an attribute set forgets it."""
        key = parse_key(text)
        s = self.s
        with self._lock, s.lock:
            had_attr = self.attrs.pop(key.text, None) is not None
            done = self.imports.get(key.value)
            if done is not None:
                done.count -= 1
                if done.count == 0:
                    del self.imports[key.value]
                    self.blocks.free(done.ptr, IPC)
                return
            mine = self.exports.get(key.value)
            if mine is not None and mine.refs > 0:
                mine.refs -= 1
                if mine.refs == 0:
                    self.sharing.revoke(mine.alloc)
                return
            if not had_attr:
                raise InvalidHandleError(f"key {text} is not one this process exported or imported (or it was "
                                         "closed already)")

    def forget_block(self, alloc: Allocation) -> None:
        """An aclrtMalloc block is being freed: its key goes with it."""
        if alloc.exported is not None:
            self.exports.pop(alloc.exported.value, None)

    def _local(self, key: Key) -> Key:
        if key.server != self.s.config.server_id:
            raise FeatureNotSupportedError(
                f"this key comes from server {key.server:#x}, not this one ({self.s.config.server_id:#x}): an IPC key "
                "names memory on the server that made it, and carries neither that server's address nor a secret "
                "for the cross-server transport; to share memory across servers, export it as a FABRIC handle"
            )
        return key
