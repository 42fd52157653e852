"""The one exception type every failed call raises, carrying the gRPC status code and message."""
from __future__ import annotations

import grpc

_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


class LogitServeError(Exception):
    """A failed RPC or request: `.code` is a grpc.StatusCode, `.details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_code(cls, value: int, details: str) -> "LogitServeError":
        return cls(_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN), details)

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> "LogitServeError":
        return cls(err.code(), err.details() or "")


class ReplicasDisagree(LogitServeError):
    """A TeacherPool's replicas serve different models: `.hashes` maps each address to its content hash."""

    def __init__(self, hashes: dict[str, str], names: dict[str, str]):
        listed = "; ".join(f"{a}: {names.get(a, '?')} content_hash {h}" for a, h in sorted(hashes.items()))
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION,
                         f"replicas serve different models (every replica must serve the same weights): {listed}")
        self.hashes = dict(hashes)


class ClientDeadline(LogitServeError):
    """DEADLINE_EXCEEDED found by the client itself: no answer came back within the request's timeout_s and a grace
    (a hung or partitioned server; a server that is merely slow answers DEADLINE_EXCEEDED itself first). A
    TeacherPool takes its replica out and sends the request to another."""

    def __init__(self, details: str):
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, details)
