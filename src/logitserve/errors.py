"""Domain errors of the core; the server maps each to one gRPC status in one place."""


class LogitServeError(Exception):
    """Base of every error a request can cause."""


class InvalidRequest(LogitServeError, ValueError):
    """The request is malformed or out of a bound (gRPC INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class OverLimit(LogitServeError):
    """The request is valid but over a budget or limit now: retry later (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


class TooLarge(OverLimit):
    """The request is over a fixed per-request limit (size, count, answer bytes): retrying it unchanged can never
    succeed (gRPC RESOURCE_EXHAUSTED saying it is permanent; HTTP 413, which clients do not retry)."""


class Unavailable(LogitServeError):
    """The server cannot serve now: shutting down, or a rank was lost (gRPC UNAVAILABLE)."""


class NotFound(LogitServeError):
    """The request names something this server does not hold, e.g. another model (gRPC NOT_FOUND)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class NotSupported(LogitServeError):
    """The request asks for what this server's model cannot give, e.g. text without a tokenizer
    (gRPC FAILED_PRECONDITION)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
