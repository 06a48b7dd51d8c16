"""Trustlists, without I/O: binding listed pids to the processes that have them (pid reuse), and who may import.

A local pid is bound to the identity of the process that had it when it was listed (`identify`, handed in by the
server); another server's process is admitted by its pid as its own broker reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .. import constants as C
from ..wire.handles import MAX_TRUSTLIST
from .records import NOBODY, Client, Identity, Lookups, Share, same_process
from .usage import LedgerError, Usage

MAX_PID = 0x7FFFFFFF


def valid_pids(pids: Iterable[int]) -> bool:
    """Whether every pid is a positive 32-bit int (callers pass each pid once: a trustlist can hold 4,096 copies of
    one, and `dict.fromkeys` drops them at C speed)."""
    unique = pids if isinstance(pids, (dict, list)) else dict.fromkeys(pids)
    return not unique or (min(unique) > 0 and max(unique) <= MAX_PID)


def check_room(listed: int, new: int) -> None:
    """Refuse `new` entries on a trustlist that holds `listed` (local and other servers' together) past the cap."""
    if listed + new > MAX_TRUSTLIST:
        raise LedgerError(f"a trustlist holds at most {MAX_TRUSTLIST} pids", C.ACL_ERROR_RT_PARAM_INVALID)


def of_server(client: Client) -> str:
    return "" if client.server is None else f" of server {client.server:#x}"


def look_up(identify: Callable[[int], Identity], pids: Iterable[int], into: Lookups | None = None) -> Lookups:
    """Who has each pid now, or the error that kept it from being known (added to `into`)."""
    found = into if into is not None else Lookups()
    for pid in pids:
        try:
            found.ids[pid] = identify(pid)
        except OSError as exc:
            found.failed[pid] = exc
    return found


def to_look_up(pids: Iterable[int], trust: dict[int, Identity]) -> list[int] | None:
    """The pids of a request that need a lookup, each once, in the request's order (None: a pid is not a positive
    32-bit int): new ones, and entries bound to nothing (no process had the pid when it was listed). An entry
    bound to a process is never looked up again (rule 12: it is never rebound)."""
    unique = dict.fromkeys(pids)
    if not valid_pids(unique):
        return None
    return [pid for pid in unique if trust.get(pid, NOBODY) == NOBODY]


def bind(identify: Callable[[int], Identity], usage: Usage, client: Client, pids: tuple[int, ...],
         trust: dict[int, Identity], found: Lookups | None, others: int = 0) -> dict[int, Identity]:
    """`trust` plus `pids`, each new one bound to the process that had it when the call was received (`found`,
    looked up then by the server; looked up now otherwise); each pid is looked up once.

    Rule 12: an entry bound to a process keeps that binding for good, whether the process lives or died, so that
    re-adding the pid of a process that exited never admits whoever has the pid now; an entry bound to nothing
    (no process had the pid) is bound by a re-add to the process that has it then, and is never made unbound
    again. Any failure to look a pid up refuses the whole request: an entry is never bound to nothing by accident.
    `others`: entries of other servers' processes on the same export, which count toward the same limit."""
    listed = to_look_up(pids, trust)
    if listed is None:
        raise LedgerError("pids must be positive 32-bit ints", C.ACL_ERROR_RT_PARAM_INVALID)
    wanted = set(listed)
    if not wanted:
        return trust  # every pid is bound already: nothing changes
    new = len(wanted.difference(trust))
    check_room(len(trust) + others, new)
    usage.check_trust(client.uid, new)
    got = found if found is not None else Lookups()
    missing = wanted.difference(got.ids, got.failed)
    if missing:
        look_up(identify, missing, got)
    failed = wanted.intersection(got.failed)
    if failed:
        pid = min(failed)
        why = got.failed[pid]
        raise LedgerError(
            f"could not tell which process has pid {pid} ({why.strerror or why}), so it cannot be trusted "
            "safely; the trustlist is unchanged: try again",
            C.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL,
        )
    ids = got.ids
    result = dict(trust)
    result.update({pid: ids[pid] for pid in wanted})
    return result


def admitted(client: Client, share: Share) -> None:
    """Rule 11: `client` is on the trustlist (else 207006). A remote importer is admitted by a pid of the V2
    trustlist (its pid as its own broker reports it: this node cannot bind another server's pid to a process) or by
    its (server id, pid) pair; a local one by its pid, bound to the process that had it when it was listed."""
    if client.server is not None:
        if client.pid in share.trust or (client.server, client.pid) in share.remote_trust:
            return
    elif client.pid in share.trust:
        if not same_process(share.trust[client.pid], client.identity):
            raise LedgerError(
                f"pid {client.pid} was trustlisted for another process that had the same pid (pid reuse)",
                C.ACL_ERROR_RT_NO_PERMISSION,
            )
        return
    raise LedgerError(
        f"process {client.pid}{of_server(client)} is not on the trustlist of {share.handle:#018x}: the exporter "
        "must add it with mem_set_pid_to_shareable_handle(_v2) (ipc_mem_set_import_pid for an IPC key)",
        C.ACL_ERROR_RT_NO_PERMISSION,
    )
