"""The one place where errors become gRPC status codes, and gRPC status codes HTTP ones."""
from __future__ import annotations

import logging

import grpc

from logitserve.errors import InvalidRequest, NotFound, NotSupported, OverLimit, TooLarge, Unavailable

log = logging.getLogger("logitserve.server")

# Said after every TooLarge message: gRPC has one code for "over a limit", and a client must not retry this one.
PERMANENT = "permanent: the same request is refused every time, do not retry it; send less per request"

_CODES = (
    (TooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
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
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "RateLimitError"),      # retry later: a budget, in-flight limits
    grpc.StatusCode.CANCELLED: (499, "CancelledError"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "TimeoutError"),
}
TOO_LARGE = (413, "RequestTooLargeError")       # TooLarge: a body, count or answer over its fixed limit
# Requests no route takes, as Starlette raises them.
ROUTE_ERRORS = {404: "NotFoundError", 405: "MethodNotAllowedError"}


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) for an exception; anything unexpected is INTERNAL and logged with its traceback."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, f"{exc} ({PERMANENT})" if isinstance(exc, TooLarge) else str(exc)
    log.error("internal error while serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def to_http(code: grpc.StatusCode, too_large: bool = False) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a gRPC status, 413 for a TooLarge refusal (`too_large`: 429 would make
    clients retry it); anything else is 500 InternalServerError."""
    if too_large and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return TOO_LARGE
    return _HTTP.get(code, (500, "InternalServerError"))


def route_error(status: int) -> str:
    """The OpenAI error type of a request no route takes (404 unknown path, 405 wrong method)."""
    return ROUTE_ERRORS.get(status, "BadRequestError" if status < 500 else "InternalServerError")
