"""`install()`: tensors on vmmshare memory travel through torch.multiprocessing queues and pipes by handle.

torch.multiprocessing registers its own reductions with `multiprocessing.reduction.ForkingPickler` (shared memory
files whose fds travel on a side socket). `install` puts a reduction in front of torch's for the tensor types:
a tensor on vmmshare memory is pickled as its handle (the bytes of a few ints, no fd), any other tensor goes on
to torch's reduction as before.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterable
from multiprocessing.reduction import ForkingPickler
from typing import Any, cast

import torch
from torch.multiprocessing import reductions as torch_reductions  # registers torch's reductions

from ..api.events import Event
from ..errors import InvalidParamError
from ._tensors import _backing_of, _pid_list, reduce_tensor

__all__ = ["install", "installed", "trust", "uninstall"]

_reducers = cast(dict[type, Any], vars(ForkingPickler)["_extra_reducers"])  # the class's table, by type
_lock = threading.Lock()
_saved: dict[type, Callable[..., Any] | None] = {}  # the reducers install() replaced, to put back
_pids: set[int] = set()
_validate = True
_children = True
_event: Event | None = None


def _types() -> list[type]:
    return [torch.Tensor, torch.nn.Parameter, *torch._tensor_classes]


def _trustees() -> list[int]:
    """Who may import what install()'s reduction sends: the pids given, and (unless turned off) this process's
    multiprocessing children and parent, at the moment of pickling."""
    out = set(_pids)
    if _children:
        out.update(p.pid for p in multiprocessing.active_children() if p.pid is not None)
        parent = multiprocessing.parent_process()
        if parent is not None and parent.pid is not None:
            out.add(parent.pid)
    return sorted(out)


def _reduce(t: torch.Tensor) -> Any:
    if _backing_of(t) is None:
        fallback: Callable[..., Any] = (_saved.get(type(t)) or _saved.get(torch.Tensor)
                                        or torch_reductions.reduce_tensor)
        return fallback(t)
    return reduce_tensor(t, pids=_trustees(), validate_pids=_validate, event=_event)


def install(pids: Iterable[int] = (), children: bool = True, validate_pids: bool = True,
            event: Event | None = None) -> None:
    """Send tensors on vmmshare memory through `torch.multiprocessing` (Queue, Pipe, Process arguments) by handle.

    Each export trusts `pids` (host pids, as `bare_pid()` gives them), those added by `trust()`, and with
    `children` this process's multiprocessing children and parent as they are when the tensor is pickled. A
    consumer in another pid namespace must be named by its host pid. `validate_pids=False` lets any process that
    reaches the broker import (the handles are then bearer tokens). With `event`, every tensor sent carries it and
    the receiver waits for its last record before it gets the tensor (record it after writing). Calling it again
    changes these settings."""
    global _validate, _children, _event
    listed = _pid_list(pids)
    if not isinstance(children, bool) or not isinstance(validate_pids, bool):
        raise InvalidParamError("children and validate_pids must be True or False")
    if event is not None and not isinstance(event, Event):
        raise InvalidParamError(f"event must be a vmmshare.Event, got {type(event).__name__}")
    with _lock:
        _pids.clear()
        _pids.update(listed)
        _validate, _children, _event = validate_pids, children, event
        for cls in _types():
            if cls not in _saved:
                _saved[cls] = _reducers.get(cls)
            ForkingPickler.register(cls, _reduce)


def trust(pids: Iterable[int]) -> None:
    """Add host pids to those that install()'s reduction trusts (for tensors pickled from now on)."""
    listed = _pid_list(pids)
    with _lock:
        _pids.update(listed)


def installed() -> bool:
    return _reducers.get(torch.Tensor) is _reduce


def uninstall() -> None:
    """Put torch's own reductions back."""
    global _event
    with _lock:
        for cls, previous in _saved.items():
            if previous is None:
                _reducers.pop(cls, None)
            else:
                _reducers[cls] = previous
        _saved.clear()
        _pids.clear()
        _event = None
