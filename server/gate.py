"""The serving port from the first second: health says NOT_SERVING and every other RPC UNAVAILABLE while loading.

One grpc.aio server binds the port before the model loads (without SO_REUSEPORT, so a port that
another process serves is refused at once) and routes every call through a `Gate`: health is
answered from the start; until `open()` every other method, native, KServe or reflection, gets
UNAVAILABLE saying the model is loading and for how long (retryable, unlike UNIMPLEMENTED); after
it, the services registered on the gate (the generated `add_*_to_server` functions take it as their
`server`) answer as usual.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from .security import TokenAuth, load_tokens, server_credentials

HEALTH_SERVICE = "grpc.health.v1.Health"
SERVICE_NAME = "logitserve.v1.LogitServe"


class Gate(grpc.GenericRpcHandler):
    """Routes calls by service name; stands in for the grpc server in the generated `add_*_to_server`."""

    def __init__(self, always_open: tuple[str, ...] = (HEALTH_SERVICE,)):
        self._services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        self._always_open = always_open
        self._opened = False
        self._started = time.monotonic()
        self._closed_reason: Optional[str] = None

    # -- what the generated add_*_to_server functions call ------------------------------------
    def add_generic_rpc_handlers(self, handlers) -> None:
        """Ignored: the same handlers arrive by service through add_registered_method_handlers."""

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._services[service] = dict(handlers)

    def override(self, service: str, method: str, handler: grpc.RpcMethodHandler) -> None:
        """Replace one registered method's handler (e.g. with another request deserializer)."""
        if method not in self._services.get(service, {}):
            raise KeyError(f"{service}/{method} is not registered")
        self._services[service][method] = handler

    # -- state ---------------------------------------------------------------------------------
    def open(self) -> None:
        """The model is loaded: registered services answer from now on."""
        self._opened = True

    def fail(self, reason: str) -> None:
        """Loading failed: say so to whoever calls until the process exits."""
        self._closed_reason = reason

    @property
    def opened(self) -> bool:
        return self._opened

    def loading_message(self) -> str:
        if self._closed_reason:
            return f"the server failed to load its model and is exiting: {self._closed_reason}"
        return (f"the model is loading (for {time.monotonic() - self._started:.0f} s so far); retry shortly, "
                f"or wait for grpc.health.v1 SERVING")

    # -- grpc.GenericRpcHandler ---------------------------------------------------------------
    def service(self, handler_call_details):
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        if self._opened or service in self._always_open:
            return self._services.get(service, {}).get(method)
        # Streaming both ways: the refusal needs no request message (a bidi client may not have sent one).
        return grpc.stream_stream_rpc_method_handler(self._refuse)

    async def _refuse(self, request_iterator, context) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, self.loading_message())


@dataclass
class Listening:
    """The port, bound and answering before the model loads: health NOT_SERVING, the rest UNAVAILABLE."""

    server: grpc.aio.Server
    port: int
    gate: Gate
    health: health_aio.HealthServicer
    auth: Optional[TokenAuth] = None     # bearer-token checks, when --auth-token-file is set
    http_socket: Optional[socket.socket] = None   # --http-port, bound and listening; served once the model is loaded

    async def close(self) -> None:
        if self.http_socket is not None:
            self.http_socket.close()
        await self.server.stop(0)


class PortInUse(OSError):
    """The serving address cannot be bound (taken by another process, or not this machine's)."""


def _bind(server: grpc.aio.Server, config) -> int:
    """Bind the configured address (SO_REUSEPORT off: a port another process serves is refused, not shared)."""
    credentials = server_credentials(config.security)
    address = f"{config.host}:{config.port}"
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise PortInUse(f"cannot listen on {address}: the port is in use by another process (another logitserve?) "
                      f"or the address is not this machine's; choose another --port or stop that process")
    return port


def _bind_http(config) -> Optional[socket.socket]:
    """--http-port, bound now: a port in use is refused before the model loads, naming the flag."""
    if config.http_port is None:
        return None
    from .http_app import bind

    try:
        return bind(config.host, config.http_port)
    except OSError as e:
        raise PortInUse(f"{e}; choose another --http-port or stop the process that holds it") from None


async def open_port(config) -> Listening:
    """Start the gRPC server on the configured port, and bind --http-port, before anything is loaded."""
    http_socket = _bind_http(config)
    sec = config.security
    auth = TokenAuth(load_tokens(sec.auth_token_file)) if sec.auth_token_file else None
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", config.max_request_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        # clients' keepalive pings (logitserve.client.aio.KEEPALIVE_MIN_S): at most one a second; faster ones strike
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.max_connection_idle_ms", int(config.max_connection_idle_s * 1000)),
        ("grpc.so_reuseport", 0),          # gRPC's default is on: two servers would share the port silently
    ], interceptors=[auth] if auth else None)
    gate = Gate()
    server.add_generic_rpc_handlers((gate,))
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, gate)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        port = _bind(server, config)
    except PortInUse:
        if http_socket is not None:
            http_socket.close()
        raise
    await server.start()
    return Listening(server, port, gate, health_servicer, auth, http_socket)


def check_port_free(host: str, port: Optional[int], flag: str = "--port") -> None:
    """PortInUse unless host:port can be bound now (before starting rank processes that would bind it)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC: TIME_WAIT is no conflict, a listener is
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            raise PortInUse(f"{flag} {port}: cannot listen on {host}:{port}: "
                            f"{e.strerror.lower() if e.strerror else e}; choose another {flag} or stop the process "
                            f"that holds it") from None
