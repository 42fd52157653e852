"""Server construction (create_server, for tests) apart from serving until stopped (serve)."""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import logitserve
from logitserve.engine import Engine, EngineConfig
from logitserve.layout import Layout, single_process
from logitserve.loading import LoadedModel, load_model
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from . import codec
from .servicer import LogitServeServicer
from .worker import Worker

log = logging.getLogger("logitserve.server")
SERVICE_NAME = "logitserve.v1.LogitServe"


@dataclass(frozen=True)
class ModelConfig:
    """Which model to serve and how."""

    path: Optional[str] = None          # a local HF directory; None = the embedded demo
    demo: str = "causal"                # demo kind when path is None: causal | reward
    dtype: str = "fp32"                 # fp32 | bf16 | fp16
    max_seq_len: Optional[int] = None   # default: the model's max_position_embeddings


@dataclass(frozen=True)
class ServerConfig:
    """Network side of the server."""

    host: str = "127.0.0.1"
    port: int = 50051                   # 0 picks a free port
    max_message_bytes: int = 4 << 20    # every response message stays under this
    max_request_bytes: int = 64 << 20   # largest request message accepted
    grace_s: float = 5.0                # drain time on shutdown
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        if self.max_message_bytes < 64 << 10:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be >= {64 << 10}")


def load(model: ModelConfig) -> LoadedModel:
    from logitserve.demo import demo_dir

    path = model.path or demo_dir(model.demo)
    name = None if model.path else f"logitserve-demo-{model.demo}"
    return load_model(path, dtype=model.dtype, max_seq_len=model.max_seq_len, name=name)


@dataclass
class Running:
    server: grpc.aio.Server
    port: int
    worker: Worker
    health: health.HealthServicer

    async def stop(self, grace: Optional[float]) -> None:
        self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        self.worker.shutdown()


async def create_server(loaded: LoadedModel, config: ServerConfig, layout: Optional[Layout] = None,
                        run=None) -> Running:
    """Build and start a server for a loaded model; `run` replaces the local engine (distributed serving)."""
    layout = layout or single_process(str(loaded.head.weight.device))
    if run is None:
        run = Engine(loaded, config.engine).run
    worker = Worker(run)
    info = codec.encode_model_info(loaded, layout, config.max_message_bytes, logitserve.__version__)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", config.max_request_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ])
    pb_grpc.add_LogitServeServicer_to_server(
        LogitServeServicer(worker, info, loaded.limits, config.max_message_bytes), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot bind {config.host}:{config.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Running(server, port, worker, health_servicer)


async def serve(model: ModelConfig, config: ServerConfig) -> None:
    """Load, serve until SIGINT/SIGTERM, then drain for config.grace_s."""
    loaded = load(model)
    running = await create_server(loaded, config)
    log.info("serving %s (%s, %s) on %s:%d", loaded.name, loaded.content_hash, loaded.architecture,
             config.host, running.port)
    print(f"logitserve: serving {loaded.name} on {config.host}:{running.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down (grace %.1fs)", config.grace_s)
    await running.stop(config.grace_s)
