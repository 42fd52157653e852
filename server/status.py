"""The one place where errors become gRPC status codes, and gRPC status codes HTTP ones."""
from __future__ import annotations

import logging

import grpc

from logitserve.errors import InvalidRequest, NotFound, NotSupported, OverLimit, Unavailable

log = logging.getLogger("logitserve.server")

_CODES = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (OverLimit, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (NotSupported, grpc.StatusCode.FAILED_PRECONDITION),
    (NotFound, grpc.StatusCode.NOT_FOUND),
)

# Each gRPC status as HTTP: (status, the OpenAI error type vLLM's server names it with).
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "BadRequestError"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "BadRequestError"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "AuthenticationError"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "PermissionDeniedError"),
    grpc.StatusCode.NOT_FOUND: (404, "NotFoundError"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "RateLimitError"),
    grpc.StatusCode.CANCELLED: (499, "CancelledError"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "TimeoutError"),
}


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) for an exception; anything unexpected is INTERNAL and logged with its traceback."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    log.error("internal error while serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def to_http(code: grpc.StatusCode) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a gRPC status; anything else is 500 InternalServerError."""
    return _HTTP.get(code, (500, "InternalServerError"))
