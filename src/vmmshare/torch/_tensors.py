"""Tensors on vmmshare memory, and the reduce/rebuild pair that sends them to another process by handle.

A tensor's storage is one vmmshare allocation mapped in this process and wrapped by DLPack (no copy). The
registry below knows, for every such storage, the allocation behind it and its export; `reduce_tensor` exports
that allocation once (views of one storage share it) and `rebuild_tensor` imports and maps it in the consumer.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._process import runtime
from ..api.events import Event
from ..api.mapping import Mapping
from ..api.memory import Device, import_handle
from ..errors import (
    ContextNullError,
    FeatureNotSupportedError,
    InvalidHandleError,
    InvalidParamError,
    NoPermissionError,
)
from ..wire.handles import ShareableHandle
from ..wire.props import pid_list

log = logging.getLogger(__name__)

__all__ = [
    "bare_pid",
    "empty",
    "empty_like",
    "is_shared",
    "rebuild_tensor",
    "reduce_tensor",
    "share_",
    "zeros",
]

REDUCE_VERSION = 1  # the layout of rebuild_tensor's arguments; a consumer refuses another


@dataclass
class _Backing:
    """The vmmshare memory behind one torch storage in this process: its mapping (held weakly: the storage holds
    it), its export (made once, on first reduce) and the pids already put on the export's trustlist."""

    mapping: weakref.ref[Mapping]
    ptr: int
    size: int
    imported: ShareableHandle | None = None  # the handle this memory was imported from (consumer side)
    export: ShareableHandle | None = None
    validate_pids: bool = True
    trusted: set[int] = field(default_factory=set)

    @property
    def handle(self) -> ShareableHandle | None:
        return self.imported or self.export


_lock = threading.RLock()
_by_ptr: dict[int, _Backing] = {}  # storage data_ptr -> its backing, while the mapping lives
_by_handle: dict[str, _Backing] = {}  # handle text -> backing, for exports made and imports taken here


def _register(mapping: Mapping, imported: ShareableHandle | None = None) -> _Backing:
    backing = _Backing(weakref.ref(mapping), mapping.ptr, mapping.size, imported=imported)
    with _lock:
        _by_ptr[mapping.ptr] = backing
        if imported is not None:
            _by_handle[str(imported)] = backing
    weakref.finalize(mapping, _forget, backing)
    return backing


def _forget(backing: _Backing) -> None:
    """The mapping is gone (its last tensor died): the storage pointer and handle mean nothing here any more."""
    with _lock:
        if _by_ptr.get(backing.ptr) is backing:
            del _by_ptr[backing.ptr]
        handle = backing.handle
        if handle is not None and _by_handle.get(str(handle)) is backing:
            del _by_handle[str(handle)]


def _storage_of(mapping: Mapping) -> torch.UntypedStorage:
    """The mapping as a torch storage, zero-copy (DLPack: the storage keeps the mapping, and so the memory, alive)."""
    try:
        base = torch.utils.dlpack.from_dlpack(mapping)
    except Exception as exc:  # torch refuses in many ways (RuntimeError, AssertionError ...): GPU memory, CPU torch
        raise FeatureNotSupportedError(f"this torch cannot view the memory ({exc}): GPU memory needs a CUDA "
                                       "build of torch") from None
    return base.untyped_storage()


def _backing_of(t: torch.Tensor) -> _Backing | None:
    storage = t.untyped_storage()
    with _lock:
        backing = _by_ptr.get(storage.data_ptr())
    if backing is None or backing.mapping() is None or storage.nbytes() > backing.size:
        return None
    return backing


def is_shared(t: torch.Tensor) -> bool:
    """Whether `t`'s storage is vmmshare memory (so `reduce_tensor` can send it by handle)."""
    return isinstance(t, torch.Tensor) and _backing_of(t) is not None


# ---------------------------------------------------------------- making tensors


def _device(device: Any) -> tuple[torch.device, int, str]:
    """The torch device asked for, and where its memory comes from: (device, vmmshare device, location)."""
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidParamError(f"device {device!r} is not a torch device: {exc}") from None
    if dev.type == "cpu":
        # device memory, where the CPU can address it (the host backend): counted in the device's capacity and
        # listed by `vmmshare ls`, like weights in an NPU's memory; host memory beside GPUs (the CUDA backend)
        if not runtime().device_backend.on_gpu:
            return dev, _current_device(), "device"
        return dev, 0, "host"
    if dev.type == "cuda":
        if not runtime().device_backend.on_gpu:
            raise InvalidParamError(f"device {dev}: GPU tensors need GPU memory, which the host backend does not "
                                    "have: set VMMSHARE_BACKEND=cuda, or use device='cpu'")
        return dev, dev.index or 0, "device"
    raise InvalidParamError(f"device {dev}: vmmshare tensors live on 'cpu' (host memory) or 'cuda:N' (GPU memory "
                            "with VMMSHARE_BACKEND=cuda)")


def _current_device() -> int:
    """This thread's vmmshare device (acl.rt.set_device), else 0."""
    try:
        return runtime().devices.current()
    except ContextNullError:
        return 0


def _dtype(dtype: Any) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise InvalidParamError(f"dtype must be a torch.dtype, such as torch.float32, not {dtype!r}")
    return dtype


def _shape(size: tuple[Any, ...]) -> tuple[int, ...]:
    dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    out = []
    for i, d in enumerate(dims):
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise InvalidParamError(f"size[{i}] must be a non-negative int, got {d!r}")
        out.append(d)
    return tuple(out)


def _allocate(nbytes: int, device: Any) -> tuple[torch.UntypedStorage, torch.device]:
    """A new storage of at least `nbytes` on vmmshare memory (one allocation, rounded up to its granularity)."""
    dev, vdev, location = _device(device)
    memory = Device(vdev).allocate(max(nbytes, 1), location=location)
    mapping = memory.map()
    try:
        storage = _storage_of(mapping)
    except BaseException:
        mapping.close()
        memory.close()
        raise
    _register(mapping)
    return storage, dev


def _on(storage: torch.UntypedStorage, dtype: torch.dtype, shape: Sequence[int], stride: Sequence[int],
        offset: int = 0, requires_grad: bool = False) -> torch.Tensor:
    t = torch.empty(0, dtype=dtype, device=storage.device)
    t.set_(storage, offset, tuple(shape), tuple(stride))
    if requires_grad:
        t.requires_grad_(True)
    return t


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def empty(*size: Any, dtype: torch.dtype | None = None, device: Any = None,
          requires_grad: bool = False) -> torch.Tensor:
    """Like `torch.empty`, on exportable vmmshare memory ("cpu": host memory; "cuda:N" under the CUDA backend)."""
    shape = _shape(size)
    dt = _dtype(dtype)
    storage, _ = _allocate(math.prod(shape) * dt.itemsize, device)
    return _on(storage, dt, shape, _contiguous(shape), 0, requires_grad)


def zeros(*size: Any, dtype: torch.dtype | None = None, device: Any = None,
          requires_grad: bool = False) -> torch.Tensor:
    """Like `torch.zeros`, on exportable vmmshare memory."""
    t = empty(*size, dtype=dtype, device=device)
    t.zero_()
    return t.requires_grad_(True) if requires_grad else t


def empty_like(t: torch.Tensor, *, dtype: torch.dtype | None = None, device: Any = None,
               requires_grad: bool | None = None) -> torch.Tensor:
    """Like `torch.empty_like` (the same shape, and the strides torch would give it), on vmmshare memory."""
    if not isinstance(t, torch.Tensor):
        raise InvalidParamError(f"empty_like takes a tensor, not {type(t).__name__}")
    dt = t.dtype if dtype is None else _dtype(dtype)
    meta = torch.empty_like(t, dtype=dt, device="meta")  # the strides torch chooses, without memory
    extent = 1 + sum((d - 1) * s for d, s in zip(meta.shape, meta.stride(), strict=True)) if meta.numel() else 0
    storage, _ = _allocate(extent * dt.itemsize, t.device if device is None else device)
    grad = t.requires_grad if requires_grad is None else requires_grad
    return _on(storage, dt, meta.shape, meta.stride(), 0, grad)


def share_(t: torch.Tensor) -> torch.Tensor:
    """Move `t`'s storage onto vmmshare memory, in place (like `Tensor.share_memory_()`), and return `t`.

    The whole storage is copied once, so `t`'s storage offset and strides stay as they are; other tensors that
    viewed the old storage keep the old one (share the base tensor first, then take views of it)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidParamError(f"share_ takes a tensor, not {type(t).__name__}")
    if _backing_of(t) is not None:
        return t
    old = t.untyped_storage()
    storage, _ = _allocate(old.nbytes(), t.device)
    n = old.nbytes()
    if n:
        _on(storage, torch.uint8, (n,), (1,)).copy_(_on(old, torch.uint8, (n,), (1,)))
    with torch.no_grad():
        t.set_(storage, t.storage_offset(), t.shape, t.stride())
    return t


# ---------------------------------------------------------------- reduce / rebuild


def bare_pid() -> int:
    """This process's pid as the broker sees it (the host pid, also inside a container's pid namespace): the pid a
    producer puts on its trustlist for this process (SPEC rule 15)."""
    return runtime().sharing.bare_tgid()


def _pid_list(pids: Iterable[int]) -> list[int]:
    """A trustlist argument of the torch surface (empty allowed), checked as every surface checks one."""
    try:
        return pid_list(pids, allow_empty=True)
    except InvalidParamError as exc:
        raise InvalidParamError(f"{exc.message} (host pids: vmmshare.torch.bare_pid() in the consumer)") from None


def _exported(backing: _Backing, pids: list[int], validate_pids: bool) -> ShareableHandle:
    """The handle of `backing`'s memory, exported on first use, with `pids` on its trustlist."""
    mapping = backing.mapping()
    if mapping is None:
        raise InvalidParamError("this tensor's vmmshare memory is gone")
    if backing.imported is not None:  # forwarding memory this process imported: only its exporter sets trust
        if pids and validate_pids:
            raise NoPermissionError(
                "this tensor's memory was imported from another process: only the exporting process can put pids "
                f"on its trustlist (SPEC rule 12); have it trust {pids}, or send reduce_tensor(t) without pids")
        return backing.imported
    with _lock:
        if backing.export is None:
            backing.export = mapping.memory.export(pids=pids, validate_pids=validate_pids)
            backing.validate_pids = validate_pids
            backing.trusted.update(pids)
            _by_handle[str(backing.export)] = backing
            return backing.export
        if not validate_pids and backing.validate_pids:
            raise InvalidParamError("this tensor's memory is already exported with pid validation: pass pids "
                                    "instead of validate_pids=False (a handle exports once, SPEC rule 9)")
        new = [p for p in dict.fromkeys(pids) if p not in backing.trusted]
        if new and backing.validate_pids:
            mapping.memory.allow(new)
            backing.trusted.update(new)
        return backing.export


def reduce_tensor(t: torch.Tensor, pids: Iterable[int] = (), validate_pids: bool = True,
                  event: Event | None = None) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """`(rebuild_tensor, args)`, picklable: `rebuild_tensor(*args)` in another process gives a tensor over the
    same memory, zero-copy, with `t`'s shape, strides, storage offset, dtype and requires_grad.

    `pids` (host pids, as `bare_pid()` gives them) go on the trustlist of the storage's one export; with
    `validate_pids=False` any process that reaches the broker may import it. Keep `t` (or a view of its storage)
    alive until the consumer has rebuilt it: when the last tensor over the memory goes, the export is revoked.

    With `event` (a `vmmshare.Event` the producer records after its writes, as torch_npu sends an IPC event with
    every shared tensor), the consumer's `rebuild_tensor` waits for the event's last record before it returns the
    tensor, so the tensor is safe to read."""
    if not isinstance(t, torch.Tensor):
        raise InvalidParamError(f"reduce_tensor takes a tensor, not {type(t).__name__}")
    if not isinstance(validate_pids, bool):
        raise InvalidParamError(f"validate_pids must be True or False, got {validate_pids!r}")
    if event is not None and not isinstance(event, Event):
        raise InvalidParamError(f"event must be a vmmshare.Event, got {type(event).__name__}")
    listed = _pid_list(pids)
    backing = _backing_of(t)
    if backing is None:
        raise InvalidParamError("this tensor is not on vmmshare memory: make it with vmmshare.torch.empty/zeros/"
                                "empty_like, or move it there first with vmmshare.torch.share_(t)")
    handle = _exported(backing, listed, validate_pids)
    kind = "parameter" if isinstance(t, torch.nn.Parameter) else "tensor"
    args: tuple[Any, ...] = (REDUCE_VERSION, str(handle), str(t.dtype).removeprefix("torch."), tuple(t.shape),
                             tuple(t.stride()), t.storage_offset(), bool(t.requires_grad), kind, str(t.device))
    if event is not None:
        args += (event.handle.hex(),)
    return rebuild_tensor, args


def _storage_for(handle_text: str, device: str) -> torch.UntypedStorage:
    """The storage over the memory `handle_text` names here: the mapping this process already has (its own export,
    or an earlier import still alive), else a new import and mapping."""
    with _lock:
        known = _by_handle.get(handle_text)
        mapping = known.mapping() if known is not None else None
    if mapping is not None:
        return _storage_of(mapping)
    handle = ShareableHandle.parse(handle_text)
    dev = _device(device)[1]
    try:
        memory = import_handle(handle, device=dev)
    except NoPermissionError as exc:
        raise NoPermissionError(f"{exc.message} (this process's host pid is {bare_pid()}: the producer must pass it "
                                "in pids=, or vmmshare.torch.install(pids=...))", exc.code) from None
    except InvalidHandleError as exc:
        raise InvalidHandleError(f"{exc.message} (a producer keeps a tensor it sends alive until the consumer has "
                                 "rebuilt it: its memory, and the handle with it, goes with its last tensor)",
                                 exc.code) from None
    try:
        mapping = memory.map()
    except BaseException:
        memory.close()
        raise
    try:
        storage = _storage_of(mapping)
    except BaseException:
        mapping.close()
        memory.close()
        raise
    _register(mapping, imported=handle)
    return storage


def rebuild_tensor(version: int, handle: str, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...],
                   offset: int, requires_grad: bool, kind: str = "tensor", device: str = "cpu",
                   event: str = "") -> torch.Tensor:
    """The consumer's half of `reduce_tensor`: the tensor over the memory `handle` names (imported and mapped once
    per process, however many tensors view it). Arguments that do not describe a tensor inside that memory are
    refused (107000) before anything is imported, and nothing is kept when the import fails. With `event` (the hex
    of an IPC event's handle), it first waits for the event's last record (AclError 507057 if the producer died
    before its stream got there)."""
    if version != REDUCE_VERSION:
        raise InvalidParamError(f"a tensor reduced by another vmmshare (format {version!r}, this one reads "
                                f"{REDUCE_VERSION}): use the same vmmshare version on both sides")
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(dt, torch.dtype):
        raise InvalidParamError(f"dtype {dtype!r} is not a torch dtype")
    if not isinstance(handle, str):
        raise InvalidParamError(f"handle must be the text of a shareable handle, got {type(handle).__name__}")
    dims = _ints("shape", shape, 0)
    steps = _ints("stride", stride, 0)
    if len(dims) != len(steps):
        raise InvalidParamError(f"shape {dims} and stride {steps} have different lengths")
    (start,) = _ints("offset", (offset,), 0)
    if kind not in ("tensor", "parameter") or not isinstance(requires_grad, bool) or not isinstance(device, str):
        raise InvalidParamError(f"not a reduced tensor: kind {kind!r}, requires_grad {requires_grad!r}")
    extent = (start + 1 + sum((d - 1) * s for d, s in zip(dims, steps, strict=True))) if math.prod(dims) else start
    guard = _event_of(event)
    storage = _storage_for(handle, device)
    if extent * dt.itemsize > storage.nbytes():
        raise InvalidParamError(f"shape {dims}, stride {steps} and offset {start} of {dt} reach byte "
                                f"{extent * dt.itemsize}, past the {storage.nbytes()} bytes the handle holds")
    if guard is not None:
        guard.wait()
    t = _on(storage, dt, dims, steps, start, requires_grad and (dt.is_floating_point or dt.is_complex))
    return torch.nn.Parameter(t, requires_grad=t.requires_grad) if kind == "parameter" else t


_events_held: dict[bytes, Event] = {}  # the events tensors arrived with: opened once per process, kept open


def _event_of(text: object) -> Event | None:
    """The event a reduced tensor carries (opened here once and kept: tensors of one producer share it)."""
    if text == "":
        return None
    if not isinstance(text, str):
        raise InvalidParamError(f"event must be the hex text of an IPC event handle, got {type(text).__name__}")
    try:
        data = bytes.fromhex(text)
    except ValueError:
        raise InvalidParamError("event is not the hex text of an IPC event handle") from None
    with _lock:
        known = _events_held.get(data)
        if known is None or known.closed:
            known = _events_held[data] = Event.open(data)
        return known


def _ints(name: str, values: object, low: int) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)):
        raise InvalidParamError(f"{name} must be a tuple of ints, got {type(values).__name__}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v < 1 << 62:
            raise InvalidParamError(f"{name} {values!r} holds {v!r}: ints from {low} up")
    return tuple(values)
