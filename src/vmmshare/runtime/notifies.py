"""Notifies (aclrtCreateNotify, aclrtRecordNotify, aclrtWaitAndResetNotify, aclrtDestroyNotify) and IPC notifies
(aclrtNotifyGetExportKey, aclrtNotifySetImportPid, its inter-server form, aclrtNotifyImportByKey).

A notify is a flag on a page (`SyncPage`, bit 0 of word 0). A record sets it when its stream gets there; a wait is
a task on its stream that blocks the stream until the flag is set, then clears it (one waiter takes each record).
The page is a memfd charged to the node; `get_export_key` exports it through the broker, with its trustlist (pids
added by `set_import_pid`) or without pid validation (ACL_RT_NOTIFY_EXPORT_FLAG_DISABLE_PID_VALIDATION, 0x2), and
an importer the broker admits maps the same page. As the runtime has it, the exporter waits (on the device where
the notify was made) and the importers record. Every importer is listed on the page as a producer: a wait whose
producers have all exited with the flag still clear fails with 507057 instead of waiting forever.
"""

from __future__ import annotations

import itertools
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import constants as C
from ..errors import AclError, FeatureNotSupportedError, InvalidHandleError, InvalidParamError, NoPermissionError
from ..wire.handles import ShareableHandle
from . import syncshare
from .ipc import KEY_BUFFER, MAX_PIDS_PER_CALL
from .syncpage import DEAD, DEVICE, SyncPage, me

if TYPE_CHECKING:
    from .shared import Shared
    from .streams import Stream

SET = 1
FOREVER = 0xFFFFFFFF
_KEY = re.compile(r"^ntf([0-9a-f]{16})([0-9a-f]{8})$")


def _pending(page: SyncPage) -> bool:
    """A waiter still needs a producer while the flag is clear."""
    return not page.word() & SET


@dataclass(eq=False)
class Notify:
    handle: int
    device: int  # the node device it was made on (an importer's: the exporter's)
    backing: syncshare.Backing
    opened: bool = False  # imported by key (not made here)
    key: str = ""
    pid_validation: bool = True
    users: int = 0
    destroyed: bool = False

    @property
    def page(self) -> SyncPage:
        return self.backing.page


class Notifies:
    """This process's notifies by handle, and how many imports of each key it holds (it is a producer of each)."""

    def __init__(self, s: Shared) -> None:
        self.s = s
        self.live: dict[int, Notify] = {}
        self._opens: dict[int, int] = {}  # broker handle value -> live imports of it here
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    # ------------------------------------------------------------ create, import, destroy

    def create(self, flag: int) -> int:
        """A notify of the current device (107002 without one); `flag` ACL_NOTIFY_DEFAULT or DEVICE_USE_ONLY."""
        if flag not in (C.ACL_NOTIFY_DEFAULT, C.ACL_NOTIFY_DEVICE_USE_ONLY):
            raise InvalidParamError(f"flag={flag:#x}: use ACL_NOTIFY_DEFAULT (0) or ACL_NOTIFY_DEVICE_USE_ONLY (1)")
        devices = self.s.devices
        device = devices.logical(devices.current())
        backing = syncshare.create(self.s, syncshare.MAGIC_NOTIFY)
        backing.page.put(DEVICE, device)
        backing.page.pending = _pending
        return self._add(Notify(0, device, backing))

    def _add(self, n: Notify) -> int:
        with self._lock:
            n.handle = 0x4E00_0000 + next(self._ids)
            self.live[n.handle] = n
        return n.handle

    def check(self, handle: int) -> None:
        """107017 unless `handle` is a live notify of this process."""
        self._live(handle)

    def _live(self, handle: int) -> Notify:
        n = self.live.get(handle)
        if n is None:
            raise InvalidHandleError(f"notify {handle:#x} is not a live notify of this process (destroyed, or a "
                                     "handle of another kind)")
        return n

    def _use(self, handle: int) -> Notify:
        with self._lock:
            n = self._live(handle)
            n.users += 1
            return n

    def _unuse(self, n: Notify) -> None:
        with self._lock:
            n.users -= 1
            done = n.destroyed and n.users == 0
        if done:
            n.backing.close(self.s)

    def destroy(self, handle: int) -> None:
        """Forget the notify; an importer stops being one of its producers; the page goes once no task uses it
        (the exporter's export with it: importers keep theirs)."""
        with self._lock:
            n = self._live(handle)
            del self.live[handle]
            n.destroyed = True
            last_open = False
            if n.opened:
                value = n.backing.value
                self._opens[value] -= 1
                last_open = not self._opens[value]
                if last_open:
                    del self._opens[value]
            done = n.users == 0
        if last_open:
            with n.page.locked():
                n.page.remove_holder(me())
        if done:
            n.backing.close(self.s)

    def close_all(self) -> None:
        with self._lock:
            self.live.clear()
            self._opens.clear()

    # ------------------------------------------------------------ record and wait

    def record(self, handle: int, stream: Stream) -> None:
        """Set the flag when `stream` gets here (and wake the waiter)."""
        n = self._use(handle)
        page = n.page

        def task() -> None:
            try:
                with page.locked():
                    page.set_word((page.word() | SET) & ~DEAD)
            finally:
                self._unuse(n)

        try:
            stream.run_or_submit("record_notify", task)
        except BaseException:
            self._unuse(n)
            raise

    def wait_and_reset(self, handle: int, stream: Stream, timeout: int) -> None:
        """Block `stream` until the flag is set, then clear it; `timeout` seconds (0 or 0xFFFFFFFF: no limit). A
        wait that runs out fails with 107019 and one whose producers all exited with 507057, reported by the
        stream's synchronize. An imported notify is waited on the device where it was made (107000 elsewhere)."""
        n = self._live(handle)
        here = self.s.devices.logical(self.s.devices.current())
        if n.opened and here != n.device:
            raise InvalidParamError(f"notify {handle:#x} was made on device {n.device}: its wait must be delivered "
                                    f"there, not on device {here}")
        limit = None if timeout in (0, FOREVER) else float(timeout)
        n = self._use(handle)
        page = n.page

        def task() -> None:
            stream.interrupts.add(page.kick)
            try:
                while True:
                    got = page.wait(lambda w: bool(w & SET), limit, lambda: stream.aborted)
                    if got != "ready":
                        break
                    with page.locked():
                        w = page.word()
                        if w & SET:  # this waiter takes the record (another may have taken it first)
                            page.set_word(w & ~SET)
                            return
            finally:
                stream.interrupts.discard(page.kick)
                self._unuse(n)
            if got == "timeout":
                raise AclError(f"notify {handle:#x} was not recorded within {timeout} s", C.ACL_ERROR_RT_WAIT_TIMEOUT)
            if got == "dead":
                raise AclError(f"every process that imported notify {handle:#x} exited before recording it: it will "
                               "never be recorded", C.ACL_ERROR_RT_SUSPECT_REMOTE_ERROR)
            raise AclError(f"the stream waiting on notify {handle:#x} was destroyed", C.ACL_ERROR_RT_STREAM_ABORT)

        try:
            stream.submit("wait_and_reset_notify", task)
        except BaseException:
            self._unuse(n)
            raise

    # ------------------------------------------------------------ IPC

    def export_key(self, handle: int, key_len: int, pid_validation: bool) -> str:
        """The key importers name the notify by; its first call exports the page (with or without pid
        validation), later ones with the same flags give the same key."""
        n = self._live(handle)
        if n.opened:
            raise InvalidParamError(f"notify {handle:#x} was imported: only the process that made it exports it")
        if key_len < KEY_BUFFER:
            raise InvalidParamError(f"len={key_len}: the key buffer must hold at least {KEY_BUFFER} characters")
        with self._lock:
            if n.key:
                if n.pid_validation != pid_validation:
                    raise InvalidParamError(f"notify {handle:#x} is exported already with pid validation "
                                            f"{'on' if n.pid_validation else 'off'}: its key is {n.key}")
                return n.key
            value = syncshare.export(self.s, n.backing, pid_validation)
            n.key, n.pid_validation = f"ntf{value:016x}{self.s.config.server_id:08x}", pid_validation
            return n.key

    def _exported(self, handle: int) -> Notify:
        n = self._live(handle)
        if n.opened:
            raise NoPermissionError(f"notify {handle:#x} was imported: only its exporter sets its trustlist")
        if not n.key:
            raise InvalidParamError(f"notify {handle:#x} has no key yet: call notify_get_export_key first")
        if not n.pid_validation:
            raise NoPermissionError(f"notify {handle:#x} was exported with ACL_RT_NOTIFY_EXPORT_FLAG_DISABLE_PID_"
                                    "VALIDATION: it has no trustlist to set")
        return n

    def set_pids(self, handle: int, pids: list[int]) -> None:
        """Trust `pids` (bare tgids of this server) to import the notify."""
        n = self._exported(handle)
        if len(pids) > MAX_PIDS_PER_CALL:
            raise InvalidParamError(f"{len(pids)} pids in one call: at most {MAX_PIDS_PER_CALL}; call again for more")
        self.s.node.set_pids(n.backing.value, C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, pids)

    def set_pids_on_servers(self, handle: int, entries: list[tuple[int, int]]) -> None:
        """Trust (server id, pid) pairs: this server's as `set_pids`, others' through the cross-server transport
        (207000 without one). Every entry is checked before any takes effect."""
        n = self._exported(handle)
        here = self.s.config.server_id
        for sdid, pid in entries:
            if sdid != here:
                self.s.node.set_remote_pids(n.backing.value, C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, sdid, [pid])
        mine = [pid for sdid, pid in entries if sdid == here]
        if mine:
            self.set_pids(handle, mine)

    def import_key(self, text: str) -> int:
        """A notify of this process over the one `text` names; this process becomes one of its producers."""
        m = _KEY.match(text)
        if m is None or int(m.group(1), 16) == 0:
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise InvalidParamError(f"{shown!r} is not a notify key (what notify_get_export_key returned)")
        value, server = int(m.group(1), 16), int(m.group(2), 16)
        if server != self.s.config.server_id:
            raise FeatureNotSupportedError(f"this notify key comes from server {server:#x}, not this one "
                                           f"({self.s.config.server_id:#x}): a notify key names a notify of the "
                                           "server that made it")
        ShareableHandle.default(value)  # (a DEFAULT handle's value)
        backing = syncshare.open_page(self.s, value, syncshare.MAGIC_NOTIFY)
        page = backing.page
        page.pending = _pending
        with page.locked():
            page.add_holder(me())
            w = page.word()
            if w & DEAD:  # a producer again
                page.set_word(w & ~DEAD)
        with self._lock:
            self._opens[value] = self._opens.get(value, 0) + 1
        return self._add(Notify(0, page.get(DEVICE), backing, opened=True, key=text))
