"""A light `weakref.finalize` for the objects of `_owned.py`: one registry entry and one weak reference each.

It keeps what the API relies on: `alive`, `detach()`, calling it, running at most once (whichever of the garbage
collector, `detach()`, a call or the interpreter's exit comes first), and running at exit the ones still alive,
newest first, as `weakref.finalize` does. The registry is also the list of live objects a forked child tells
(`_inherit.py`), so there is no second set to keep.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

# live finalizers -> the weak reference to their object (whose callback is the finalizer); in creation order
_live: dict[Finalizer, weakref.ref[Any]] = {}
_shutdown = False  # after the exit run, a collected object's finalizer does nothing (the interpreter is going)
_registered = False


class Finalizer:
    """Call `func(*args)` once: when `obj` is garbage-collected, when called, or at exit (unless detached first)."""

    __slots__ = ("args", "func")

    def __init__(self, obj: object, func: Callable[..., object], *args: object) -> None:
        if not _registered:
            _register()
        self.func = func
        self.args = args
        _live[self] = weakref.ref(obj, self)

    def __call__(self, _: object = None) -> Any:
        """Run it now if it is alive (and only then): its result, else None."""
        if _live.pop(self, None) is not None and not _shutdown:
            return self.func(*self.args)
        return None

    def detach(self) -> tuple[Any, Callable[..., object], tuple[object, ...], dict[str, Any]] | None:
        """Kill it without running it: (obj, func, args, kwargs) if it was alive and its object still is, else None."""
        ref = _live.get(self)
        obj = ref() if ref is not None else None
        if obj is not None and _live.pop(self, None) is not None:
            return obj, self.func, self.args, {}
        return None

    def cancel(self) -> bool:
        """`detach()` for its object's own close() (the object is alive): whether it was alive, with nothing built
        for the answer."""
        return _live.pop(self, None) is not None

    @property
    def alive(self) -> bool:
        """Whether it has yet to run (or be detached)."""
        return self in _live


def live_objects() -> Iterator[Any]:
    """The objects whose finalizers are alive (a snapshot: finalizers may come and go meanwhile)."""
    for ref in list(_live.values()):
        obj = ref()
        if obj is not None:
            yield obj


def _register() -> None:
    """Run what is alive at exit, registered with the first finalizer (where `weakref.finalize` registers its own)."""
    global _registered
    _registered = True
    atexit.register(_at_exit)


def _at_exit() -> None:
    """Run every live finalizer, newest first (one made meanwhile runs next); nothing runs after this."""
    global _shutdown
    enabled = gc.isenabled()
    gc.disable()  # a collection now would run finalizers out of order
    try:
        while _live:
            finalizer = next(reversed(_live))
            try:
                finalizer()
            except Exception:
                sys.excepthook(*sys.exc_info())
            _live.pop(finalizer, None)  # (it popped itself; this only guards a finalizer that was not callable)
    finally:
        _shutdown = True
        if enabled:
            gc.enable()
