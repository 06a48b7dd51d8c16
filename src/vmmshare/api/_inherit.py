"""Objects a forked child inherits: they let go of the parent's resources there instead of freeing them.

A forked child starts with empty runtime tables (`_process`), so an inherited object's handle or address means
nothing to the child's runtime (or, worse, names a different allocation the child makes later). Each live
object is told at fork: it stops owning what it wrapped, keeps what the child can still use (the memory stays
mapped in the child, MAP_SHARED), and closing it there only lets go.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ._finalize import Finalizer, live_objects


def inherited(obj: Any) -> Finalizer:
    """The finalizer an inherited object gets in the child in place of its own: one that frees nothing (and, alive,
    tells the object again should the child fork)."""
    return Finalizer(obj, _nothing)


def _nothing() -> None:
    """Nothing of the parent's is freed by the child."""


def _in_child() -> None:
    """Tell every object with a live finalizer (`_owned.Owned`'s) that it is inherited."""
    for obj in live_objects():
        with contextlib.suppress(Exception):  # one object's trouble must not stop the others
            obj._after_fork()


os.register_at_fork(after_in_child=_in_child)
