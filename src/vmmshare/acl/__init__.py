"""pyACL-compatible surface: ``import vmmshare.acl as acl`` runs code written for Huawei's ``import acl``.

Every call returns its error code last (0 = success), never raises for a bad argument, and leaves a
message for `get_recent_err_msg()` when it fails.
"""

from __future__ import annotations

import json
import os

from .. import _process
from ..constants import *  # noqa: F403  (the C names are module attributes, as in pyACL)
from ..constants import ACL_ERROR_INVALID_FILE, ACL_ERROR_REPEAT_FINALIZE, ACL_ERROR_REPEAT_INITIALIZE
from ..errors import AclError, recent_error
from . import rt, util
from ._call import acl_call

__all__ = ["finalize", "get_recent_err_msg", "init", "rt", "util"]


@acl_call()
def init(config_path: str | None = None) -> None:
    """aclInit: optional JSON config file; a second init without finalize fails with 100002."""
    runtime = _process.runtime()
    if runtime.initialized:
        raise AclError("acl.init was called already: call acl.finalize first", ACL_ERROR_REPEAT_INITIALIZE)
    if config_path is not None and not (isinstance(config_path, str) and config_path == ""):
        if not isinstance(config_path, str) or not os.path.isfile(config_path):
            raise AclError(f"config file {config_path!r} does not exist", ACL_ERROR_INVALID_FILE)
        try:
            with open(config_path) as f:
                text = f.read()
            if text.strip():
                json.loads(text)
        except (OSError, ValueError) as exc:
            raise AclError(f"config file {config_path!r} is not valid JSON: {exc}", ACL_ERROR_INVALID_FILE) from None
    runtime.initialized = True


@acl_call()
def finalize() -> None:
    """aclFinalize: ends the init; memory objects stay valid until freed or the process exits."""
    runtime = _process.runtime()
    if not runtime.initialized:
        raise AclError("acl.finalize without a matching acl.init", ACL_ERROR_REPEAT_FINALIZE)
    runtime.initialized = False


def get_recent_err_msg() -> str:
    """aclGetRecentErrMsg: what the last failed call in this thread said ("" if none failed)."""
    return recent_error()
