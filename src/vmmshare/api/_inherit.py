"""Objects a forked child inherits: they let go of the parent's resources there instead of freeing them.

A forked child starts with empty runtime tables (`_process`), so an inherited object's handle or address means
nothing to the child's runtime (or, worse, names a different allocation the child makes later). Each live
object is told at fork: it stops owning what it wrapped, keeps what the child can still use (the memory stays
mapped in the child, MAP_SHARED), and closing it there only lets go.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

_live: weakref.WeakSet[Any] = weakref.WeakSet()


def track(obj: Any) -> None:
    """Tell `obj` (its `_after_fork()`) when this process forks, in the child."""
    _live.add(obj)


def inherited(obj: Any) -> weakref.finalize[Any, Any]:
    """The finalizer an inherited object gets in the child in place of its own: one that frees nothing."""
    return weakref.finalize(obj, _nothing)


def _nothing() -> None:
    """Nothing of the parent's is freed by the child."""


def _in_child() -> None:
    for obj in list(_live):
        with contextlib.suppress(Exception):  # one object's trouble must not stop the others
            obj._after_fork()


os.register_at_fork(after_in_child=_in_child)
