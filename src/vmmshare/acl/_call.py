"""How every pyACL-style call behaves: errors become return codes plus the recent error message."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, ParamSpec

from .. import constants as C
from ..errors import AclError, set_recent_error

log = logging.getLogger("vmmshare.acl")
P = ParamSpec("P")


def acl_call(*defaults: Any) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    """Wrap a call so it returns ``(*outputs, ret)`` (or just ``ret`` with no outputs) and never raises.

    `defaults` are the outputs returned on failure. A wrong number of arguments or an unexpected
    exception also becomes a code (107000 / 507000) with a message, as the C API would report.
    """

    ok, many = C.ACL_SUCCESS, len(defaults) > 1

    def wrap(fn: Callable[P, Any]) -> Callable[P, Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                out = fn(*args, **kwargs)
            except AclError as exc:
                code, message = exc.code, exc.message
            except TypeError as exc:
                if exc.__traceback__ is None or exc.__traceback__.tb_next is not None:
                    log.exception("internal error in %s", fn.__name__)
                    code, message = C.ACL_ERROR_RT_INTERNAL_ERROR, f"internal error in {fn.__name__}: {exc}"
                else:  # the arguments did not fit the signature
                    code, message = C.ACL_ERROR_RT_PARAM_INVALID, str(exc)
            except Exception as exc:
                log.exception("internal error in %s", fn.__name__)
                code, message = C.ACL_ERROR_RT_INTERNAL_ERROR, f"internal error in {fn.__name__}: {exc!r}"
            else:
                if not defaults:
                    return ok
                return (*out, ok) if many else (out, ok)
            set_recent_error(f"{fn.__name__}: {message}", code)
            if not defaults:
                return code
            return (*defaults, code)

        return call

    return wrap


def code_call(fn: Callable[P, int]) -> Callable[P, int]:
    """Wrap a call whose result is itself an error code (aclrtPeekAtLastError): a bad argument gives its own code,
    with a message, and nothing raises."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> int:
        try:
            return fn(*args, **kwargs)
        except AclError as exc:
            code, message = exc.code, exc.message
        except TypeError as exc:  # the arguments did not fit the signature
            code, message = C.ACL_ERROR_RT_PARAM_INVALID, str(exc)
        set_recent_error(f"{fn.__name__}: {message}")
        return code

    return call
