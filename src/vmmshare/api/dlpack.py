"""DLPack export of a mapping (host memory as kDLCPU, GPU memory as kDLCUDA), with ctypes only.

The capsule holds a DLManagedTensor whose manager keeps the owning object alive until the consumer
(numpy, torch, cupy, ...) calls the deleter, or until the capsule dies unconsumed.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

KDL_CPU = 1
KDL_CUDA = 2
KDL_UINT = 1

_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
DLPACK_VERSION = (1, 0)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


_DELETER_VERSIONED = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER_VERSIONED),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]

_live: dict[int, tuple[Any, ...]] = {}  # manager address -> what it keeps alive
_lock = threading.Lock()


def _on_delete(managed: Any) -> None:
    with _lock:
        _live.pop(ctypes.addressof(managed.contents), None)


_delete = _DELETER(_on_delete)
_delete_versioned = _DELETER_VERSIONED(_on_delete)

_pyapi = ctypes.pythonapi
_pyapi.PyCapsule_New.restype = ctypes.py_object
_pyapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# the destructor sees a capsule whose reference count is already zero: handle it as a bare pointer
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", _pyapi))
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _pyapi))
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _on_capsule_gone(capsule: int) -> None:
    for name in (_NAME, _NAME_VERSIONED):
        if _is_valid(capsule, name):  # never consumed: we still own the tensor
            address = _get_pointer(capsule, name)
            with _lock:
                _live.pop(address, None)


_capsule_gone = _CAPSULE_DESTRUCTOR(_on_capsule_gone)


def _capsule(
    ptr: int, nbytes: int, device_type: int, device_id: int, owner: object, versioned: bool = False
) -> Any:
    """A capsule viewing `nbytes` bytes at `ptr` as a writable 1-D uint8 tensor, keeping `owner` alive.

    `versioned` gives a DLPack 1.0 "dltensor_versioned" capsule, else the legacy "dltensor" one.
    """
    managed: DLManagedTensor | DLManagedTensorVersioned
    if versioned:
        managed = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*DLPACK_VERSION)
        managed.flags = 0  # writable, not a copy
        managed.deleter = _delete_versioned
    else:
        managed = DLManagedTensor()
        managed.deleter = _delete
    shape = (ctypes.c_int64 * 1)(nbytes)
    t = managed.dl_tensor
    t.data = ptr
    t.device = DLDevice(device_type, device_id)
    t.ndim = 1
    t.dtype = DLDataType(KDL_UINT, 8, 1)
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = None  # compact row-major
    t.byte_offset = 0
    address = ctypes.addressof(managed)
    with _lock:
        _live[address] = (managed, shape, owner)
    name = _NAME_VERSIONED if versioned else _NAME
    return _pyapi.PyCapsule_New(address, name, ctypes.cast(_capsule_gone, ctypes.c_void_p))


def live_count() -> int:
    """Capsules handed out and not yet released by their consumer (for tests)."""
    with _lock:
        return len(_live)
