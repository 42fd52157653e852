"""TLS and mTLS server credentials, and bearer-token auth on every RPC but health (a server interceptor)."""
from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTH_LOG_EVERY_S = 10.0     # failed authentications: one log line per this many seconds, with the count since
log = logging.getLogger("logitserve.security")


@dataclass(frozen=True)
class SecurityConfig:
    tls_cert: Optional[str] = None          # PEM certificate chain of the server
    tls_key: Optional[str] = None           # its PEM private key
    tls_client_ca: Optional[str] = None     # PEM CA bundle: clients must present a certificate it signed (mTLS)
    auth_token_file: Optional[str] = None   # one bearer token per line (blank lines and # comments skipped)

    def __post_init__(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")


def server_credentials(cfg: SecurityConfig) -> Optional[grpc.ServerCredentials]:
    """TLS credentials, requiring a client certificate when a client CA is given; None: plaintext."""
    if not cfg.tls_cert:
        return None
    ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)


def load_tokens(path: str) -> tuple[bytes, ...]:
    tokens = tuple(line.strip().encode() for line in Path(path).read_text().splitlines()
                   if line.strip() and not line.lstrip().startswith("#"))
    if not tokens:
        raise ValueError(f"--auth-token-file {path}: no token in it")
    return tokens


def _matches(token: bytes, tokens: tuple[bytes, ...]) -> bool:
    """Constant time in the token's content: every candidate is compared, no early exit."""
    found = False
    for t in tokens:
        found |= hmac.compare_digest(token, t)
    return found


class TokenAuth(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <token>` on every RPC but health: missing -> UNAUTHENTICATED, wrong -> PERMISSION_DENIED."""

    def __init__(self, tokens: tuple[bytes, ...]):
        self._tokens = tokens
        self.on_failure = None          # callable(), e.g. a Prometheus counter's inc (server.metrics)
        self._unlogged = 0
        self._logged_at = float("-inf")

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        value = dict(details.invocation_metadata or ()).get("authorization", "")
        refusal = self.check(value, details.method, "metadata 'authorization: Bearer <token>'")
        if refusal is not None:
            return _refusal(*refusal)
        return await continuation(details)

    def check(self, authorization: str, where: str, how: str) -> Optional[tuple[grpc.StatusCode, str]]:
        """None for an accepted `authorization` value, else (code, message): missing -> UNAUTHENTICATED, wrong ->
        PERMISSION_DENIED; each failure counted and logged (at most once per AUTH_LOG_EVERY_S). Both front-ends."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            refusal = grpc.StatusCode.UNAUTHENTICATED, f"authorization: this server needs a bearer token ({how})"
        elif not _matches(token.strip().encode(), self._tokens):
            refusal = grpc.StatusCode.PERMISSION_DENIED, "authorization: the bearer token is not accepted"
        else:
            return None
        self._unlogged += 1
        if self.on_failure is not None:
            self.on_failure()
        now = time.monotonic()
        if now - self._logged_at >= AUTH_LOG_EVERY_S:
            log.warning("authentication failed: %s on %s (%d failure(s) since the last line of this kind)",
                        refusal[0].name, where[:128], self._unlogged)
            self._logged_at, self._unlogged = now, 0
        return refusal


def _refusal(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` before reading any request message: a request-streaming
    handler is called as soon as the headers arrive (a unary one only after its whole body), and the
    wire does not tell the two apart, so an unauthenticated 60 MB body is never received, nor parsed."""
    async def refuse(request_iterator, context):
        await context.abort(code, details)

    return grpc.stream_unary_rpc_method_handler(refuse)
