"""Targets of the torch.multiprocessing children in tests/test_torch.py.

A spawned child imports its target's module; this one imports no conftest (which would point the child at a
broker of its own), so the child talks to the test session's broker.
"""

from __future__ import annotations

from typing import Any

import vmmshare.torch as vt


def queue_child(q: Any, back: Any) -> None:
    t = q.get()
    plain = q.get()
    back.put((vt.is_shared(t), t.sum().item(), list(t.shape), t.stride(), plain.sum().item()))
    t += 1
    back.put("done")


def pipe_child(conn: Any) -> None:
    t = conn.recv()
    t.mul_(10)
    conn.send(vt.is_shared(t))


def refused_child(conn: Any) -> None:
    """Receive a tensor and say what happened (the error's code when the import is refused)."""
    try:
        t = conn.recv()
    except Exception as exc:
        conn.send(("refused", getattr(exc, "code", None), str(exc)))
        return
    conn.send(("got", vt.is_shared(t)))
