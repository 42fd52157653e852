"""While the model loads, the serving port already answers grpc.health.v1 with NOT_SERVING (probes see "not ready").

A small synchronous server on its own threads (loading blocks the event loop) binds the port with
SO_REUSEPORT; the real server binds the same port beside it, and the probe server is closed once the
real one is up, so the port never goes unanswered from start to shutdown.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .security import server_credentials


class LoadingProbe:
    def __init__(self, host: str, port: int, security, service: str):
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2, thread_name_prefix="logitserve-loading"),
                                   options=[("grpc.so_reuseport", 1)])
        servicer = health.HealthServicer()
        for name in ("", service):
            servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self._server)
        credentials = server_credentials(security)
        address = f"{host}:{port}"
        self.port = (self._server.add_secure_port(address, credentials) if credentials
                     else self._server.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"cannot bind {address}")
        self._server.start()

    def close(self) -> None:
        """Stop, and wait until the probe's listener is gone, so no connection made afterwards lands on it."""
        self._server.stop(0).wait(10)
