"""One lifecycle for the Pythonic objects that own something of this process (memory, a mapping, a range).

Each is closed explicitly with `close()` or by a `with` block, freed by its finalizer when it is dropped unclosed,
and, in a forked child, only let go of (the parent frees it; see _inherit.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from . import _inherit
from ._finalize import Finalizer

_O = TypeVar("_O", bound="Owned")


class Owned:
    """What `close()`, `closed`, `with` and fork mean for an object that frees one resource of this process."""

    _finalizer: Finalizer | weakref.finalize[Any, Any]  # (a PoolBuffer's: it is not told at fork, its pool is)
    _forked = False  # inherited by a forked child: what it owns is the parent's, and closing it only lets go

    def _own(self, free: Callable[..., object], *args: object) -> None:
        """Free with `free(*args)` when dropped unclosed (and let go instead in a forked child: a live finalizer's
        object is told at fork)."""
        self._finalizer = Finalizer(self, free, *args)

    def _after_fork(self) -> None:
        """In a forked child: what it owns stays usable here (mapped MAP_SHARED), but it is the parent's to free."""
        if self._finalizer.alive:
            self._finalizer.detach()
            self._finalizer = _inherit.inherited(self)
            self._forked = True

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _busy(self) -> bool:
        """Whether closing now would raise BufferError (views of its memory are alive)."""
        return False

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _O) -> _O:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and self._busy():
            return  # do not mask the error in flight; it goes when its last view does
        self.close()
