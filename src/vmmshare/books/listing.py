"""The broker's listing (`vmmshare ls`), one page at a time: every page fits one frame, whatever the node holds.

A listing is a sequence of items, cut into pages by bytes and by count: first the devices with memory charged
(`used`), then the GPUs (`gpu_used`), then the exports. Each page carries the node's figures and the offset of the
next page; a row shows its whole trustlist (at most 4,096 pids) and at most LIST_IMPORTERS importers (with their
count), so that the largest row fits a page.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .. import constants as C
from ..wire import local as P
from ..wire.handles import MAX_TRUSTLIST
from .records import KIND_GPU

if TYPE_CHECKING:
    from .records import Client, Share

LIST_PAGE = 100  # items per listing page, at most
LIST_IMPORTERS = 1000  # importers listed per export (importer_count has them all)
LIST_TRUST = MAX_TRUSTLIST  # trustlisted pids listed per export: all of them (a full row still fits a page)
LIST_REMOTE = 500  # remote importers and remote trustlist entries listed per export (each "<server>:<pid>")
_ROOM = 64  # bytes kept free for the page's "next" value and the closing brackets


class Book(Protocol):
    """What a listing page reads of the ledger (which calls it with itself), so that neither imports the other."""

    @property
    def broker_pid(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def used(self) -> Sequence[int]: ...
    @property
    def gpu_used(self) -> Mapping[int, int]: ...
    @property
    def exports(self) -> Mapping[int, Share]: ...


def listing_page(ledger: Book, offset: int, viewer: Client, clients: int) -> str:
    """One page of the listing as JSON, from item number `offset`; `clients` is what the page reports as connected.

    Handle values are shown in full only to the exporter's user (and root): on a multi-user node a handle exported
    without pid validation must not be handed to every user who can list.
    """
    used = [(str(d), u) for d, u in enumerate(ledger.used) if u]
    gpus = [(str(d), u) for d, u in sorted(ledger.gpu_used.items()) if u]
    total = len(used) + len(gpus) + len(ledger.exports)
    head: dict[str, Any] = {"broker_pid": ledger.broker_pid, "capacity": ledger.capacity, "clients": clients,
                            "export_count": len(ledger.exports)}
    page_used: dict[str, int] = {}
    page_gpus: dict[str, int] = {}
    rows: list[str] = []
    budget = P.MAX_BODY - len(json.dumps(head)) - len(', "used": {}, "gpu_used": {}, "exports": []') - _ROOM
    at = offset
    shares = itertools.islice(ledger.exports.values(), max(0, offset - len(used) - len(gpus)), None)
    while at < total and len(page_used) + len(page_gpus) + len(rows) < LIST_PAGE:
        if at < len(used):
            key, value = used[at]
            target: dict[str, int] | None = page_used
            cost = len(json.dumps({key: value})) + 1
        elif at < len(used) + len(gpus):
            key, value = gpus[at - len(used)]
            target = page_gpus
            cost = len(json.dumps({key: value})) + 1
        else:
            row = json.dumps(_row(next(shares), viewer))
            target = None
            cost = len(row) + 1
        if at > offset and cost > budget:
            break
        budget -= cost
        if target is None:
            rows.append(row)
        else:
            target[key] = value
        at += 1
    head["used"] = page_used
    head["gpu_used"] = page_gpus
    head["next"] = at if at < total else None
    return json.dumps(head)[:-1] + ', "exports": [' + ",".join(rows) + "]}"


def _row(share: Share, viewer: Client) -> dict[str, Any]:
    importers = sorted(c.pid for c in share.importers.values())
    row: dict[str, Any] = {
        "handle": f"{share.handle:#018x}" if viewer.uid in (share.exporter.uid, 0) else "(hidden)",
        "share_type": "fabric" if share.share_type == C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC else "default",
        "device": share.memory.device,
        "gpu": share.memory.kind == KIND_GPU,
        "size": share.memory.size,
        "owner_pid": share.exporter.pid,
        "pid_validation": not share.flags & 1,
        "trustlist": sorted(share.trust)[:LIST_TRUST],
        "importers": importers[:LIST_IMPORTERS],
        "importer_count": len(importers),
    }
    remote = sorted(f"{c.server:#x}:{c.pid}" for c in share.importers.values() if c.server is not None)
    if remote or share.remote_trust:  # processes of other servers (SPEC §8), as "<server id>:<pid>"
        row["remote_importers"] = remote[:LIST_REMOTE]
        row["remote_trustlist"] = [f"{s:#x}:{p}" for s, p in sorted(share.remote_trust)[:LIST_REMOTE]]
        row["remote_trust_count"] = len(share.remote_trust)
    return row
