"""The one place where errors become gRPC status codes."""
from __future__ import annotations

import logging

import grpc

from logitserve.errors import InvalidRequest, NotSupported, OverLimit, Unavailable

log = logging.getLogger("logitserve.server")

_CODES = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (OverLimit, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (NotSupported, grpc.StatusCode.FAILED_PRECONDITION),
)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) for an exception; anything unexpected is INTERNAL and logged with its traceback."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    log.error("internal error while serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
