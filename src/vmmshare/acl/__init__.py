"""pyACL-compatible surface: ``import vmmshare.acl as acl`` runs code written for Huawei's ``import acl``.

Every call returns its error code last (0 = success), never raises for a bad argument, and leaves a message for
`get_recent_err_msg()` when it fails. pyACL's calls that vmmshare does not provide return 207000 (`_unsupported`).
"""

from __future__ import annotations

import json as _json
import logging as _logging
import os as _os
import struct as _struct

from .. import _process
from .. import constants as _C
from ..constants import *  # noqa: F403  (the C names are module attributes, as in pyACL)
from ..errors import AclError as _AclError
from ..errors import recent_error as _recent_error
from ..errors import set_recent_error as _set_recent_error
from ..wire.props import check_int as _check_int
from . import _unsupported as _stand_in
from . import rt as rt
from . import util as util
from ._call import acl_call as _acl_call

_CONSTANTS = [n for n in dir(_C) if n.isupper() and n.startswith("ACL_")]
_FUNCTIONS = ["app_log", "finalize", "float16_to_float", "float_to_float16", "get_recent_err_msg", "get_soc_name",
              "get_version", "init"]
__all__ = sorted([*_FUNCTIONS, *_stand_in.ACL, "rt", "util", *_CONSTANTS])
_log = _logging.getLogger("vmmshare.acl")


def __dir__() -> list[str]:
    return list(__all__)


@_acl_call()
def init(config_path: str | None = None) -> None:
    """aclInit: optional JSON config file; a second init without finalize fails with 100002."""
    runtime = _process.runtime()
    if runtime.initialized:
        raise _AclError("acl.init was called already: call acl.finalize first", _C.ACL_ERROR_REPEAT_INITIALIZE)
    if config_path is not None and not (isinstance(config_path, str) and config_path == ""):
        if not isinstance(config_path, str) or not _os.path.isfile(config_path):
            raise _AclError(f"config file {config_path!r} does not exist", _C.ACL_ERROR_INVALID_FILE)
        try:
            with open(config_path) as f:
                text = f.read()
            if text.strip():
                _json.loads(text)
        except (OSError, ValueError) as exc:
            raise _AclError(f"config file {config_path!r} is not valid JSON: {exc}",
                            _C.ACL_ERROR_INVALID_FILE) from None
    runtime.initialized = True


@_acl_call()
def finalize() -> None:
    """aclFinalize: ends the init; memory objects stay valid until freed or the process exits."""
    runtime = _process.runtime()
    if not runtime.initialized:
        raise _AclError("acl.finalize without a matching acl.init", _C.ACL_ERROR_REPEAT_FINALIZE)
    runtime.initialized = False


def get_recent_err_msg() -> str:
    """aclGetRecentErrMsg: what the last failed call in this thread said ("" if none failed)."""
    return _recent_error()


@_acl_call(0, 0, 0)
def get_version() -> tuple[int, int, int]:
    """aclrtGetVersion: the version of the ACL interface vmmshare implements (major, minor, patch)."""
    return _C.ACL_MAJOR_VERSION, _C.ACL_MINOR_VERSION, _C.ACL_PATCH_VERSION


def get_soc_name() -> str:
    """aclrtGetSocName: the backend that holds device memory, "vmmshare-host" or "vmmshare-cuda"."""
    try:
        runtime = _process.runtime()
    except _AclError as exc:  # a bad configuration: say so through the recent error, as pyACL returns a str
        _set_recent_error(f"get_soc_name: {exc.message}", exc.code)
        return ""
    return "vmmshare-cuda" if runtime.gpu is not None else "vmmshare-host"


def float16_to_float(value: int) -> float:
    """aclFloat16ToFloat: the IEEE half-precision bits `value` as a float (0.0 for a value that is not 16 bits)."""
    try:
        bits = _check_int("value", value, 0, 0xFFFF)
    except _AclError as exc:
        _set_recent_error(f"float16_to_float: {exc.message}", exc.code)
        return 0.0
    return float(_struct.unpack("<e", bits.to_bytes(2, "little"))[0])


def float_to_float16(value: float) -> int:
    """aclFloatToFloat16: a float as IEEE half-precision bits (out of range: infinity, as C rounds it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _set_recent_error(f"float_to_float16: value must be a float, got {type(value).__name__}",
                          _C.ACL_ERROR_RT_PARAM_INVALID)
        return 0
    try:
        return int.from_bytes(_struct.pack("<e", value), "little")
    except OverflowError:
        return 0xFC00 if value < 0 else 0x7C00


def app_log(level: int, message: str) -> None:
    """aclAppLog: `message` to the `vmmshare.acl` logger (level: 0 debug, 1 info, 2 warning, 3 error)."""
    levels = {0: _logging.DEBUG, 1: _logging.INFO, 2: _logging.WARNING, 3: _logging.ERROR}
    lvl = levels.get(level, _logging.INFO) if isinstance(level, int) else _logging.INFO
    _log.log(lvl, "%s", message)


globals().update(_stand_in.stand_ins("acl", _stand_in.ACL))
