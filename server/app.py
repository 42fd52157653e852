"""Server construction (create_server, for tests) apart from serving until stopped (serve)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

import logitserve
from logitserve.engine import Batching, Engine, EngineConfig
from logitserve.layout import Layout, single_process
from logitserve.loading import LoadedModel, content_hash, load_model
from logitserve.parallel import ParallelConfig
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from . import codec
from .scheduler import Scheduler, SchedulerConfig, engine_batch_runner
from .kserve import KServeServicer
from .loading_probe import LoadingProbe
from .metrics import Metrics
from .security import SecurityConfig, TokenAuth, load_tokens, server_credentials
from .servicer import STREAM_WINDOW, LogitServeServicer, StreamLimits

log = logging.getLogger("logitserve.server")
SERVICE_NAME = "logitserve.v1.LogitServe"
KSERVE_SERVICE = "inference.GRPCInferenceService"


@dataclass(frozen=True)
class ModelConfig:
    """Which model to serve and how."""

    path: Optional[str] = None          # a local HF directory; None = the embedded demo
    demo: str = "causal"                # demo kind when path is None: causal | reward
    demo_shape: str = "demo"            # demo shape when path is None: demo | body | 1b (logitserve.demo)
    dtype: str = "fp32"                 # fp32 | bf16 | fp16
    max_seq_len: Optional[int] = None   # default: the model's max_position_embeddings
    device: str = "cpu"                 # single-process serving: cpu | cuda | auto


@dataclass(frozen=True)
class ServerConfig:
    """Network side of the server."""

    host: str = "127.0.0.1"
    port: int = 50051                   # 0 picks a free port
    max_message_bytes: int = 4 << 20    # every response message stays under this
    max_request_bytes: int = 64 << 20   # largest request message accepted
    grace_s: float = 5.0                # drain time on shutdown
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    metrics_port: Optional[int] = None  # Prometheus /metrics over HTTP on this port (0: a free one); None: off
    limits: StreamLimits = field(default_factory=StreamLimits)
    keepalive_s: float = 60.0           # pings on idle connections; a peer silent for keepalive_timeout_s is dropped
    keepalive_timeout_s: float = 20.0
    max_connection_idle_s: float = 3600.0   # a connection with no RPC for this long is closed (GOAWAY)

    def __post_init__(self):
        if self.max_message_bytes < 64 << 10:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be >= {64 << 10}")


def _source(model: ModelConfig) -> tuple[Path, Optional[str]]:
    from logitserve.demo import demo_dir

    if model.path:
        return Path(model.path), None
    shape = "" if model.demo_shape == "demo" else f"-{model.demo_shape}"
    return demo_dir(model.demo, model.demo_shape), f"logitserve-demo-{model.demo}{shape}"


def load(model: ModelConfig) -> LoadedModel:
    """The whole model, in one process."""
    from logitserve.hostmem import peak_rss_mib

    t0 = time.perf_counter()
    path, name = _source(model)
    loaded = load_model(path, dtype=model.dtype, max_seq_len=model.max_seq_len, name=name)
    if model.device != "cpu":
        import torch

        if model.device == "cuda" or torch.cuda.is_available():
            loaded.model.to("cuda")
    log.info("loaded the whole model in %.1f s; peak RSS %.0f MiB", time.perf_counter() - t0, peak_rss_mib())
    return loaded


def load_rank(model: ModelConfig, ctx) -> tuple:
    """This rank's model: its TP shards read straight from disk, or the whole model at tp = 1."""
    from logitserve.parallel import apply_parallelism, hook_cp
    from logitserve.shard_load import load_sharded

    if ctx.tp == 1:
        return apply_parallelism(load(model), ctx)
    path, name = _source(model)
    content = content_hash(path) if ctx.is_root else ""      # only rank 0 reports it
    loaded, shard = load_sharded(path, model.dtype, ctx.device, ctx.tp_rank, ctx.tp, ctx.tp_group,
                                 max_seq_len=model.max_seq_len, name=name, content=content)
    hook_cp(loaded, ctx)
    return loaded, shard


@dataclass
class Running:
    server: grpc.aio.Server
    port: int
    scheduler: Scheduler
    layout: Layout
    health: health_aio.HealthServicer   # asyncio's: a sync Watch would hold a thread that shutdown waits on
    metrics: Optional[Metrics] = None
    metrics_http: Optional[object] = None   # the /metrics HTTP server when --metrics-port is set
    servicer: Optional[LogitServeServicer] = None

    @property
    def metrics_port(self) -> Optional[int]:
        return self.metrics_http.server_port if self.metrics_http is not None else None

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: Optional[float]) -> None:
        """NOT_SERVING and no new request at once; in-flight requests get `grace` seconds to finish."""
        await self.health.enter_graceful_shutdown()
        if self.servicer is not None:
            self.servicer.drain()
        await self.server.stop(grace)
        self.scheduler.shutdown()
        if self.metrics_http is not None:
            self.metrics_http.shutdown()


def memory_estimator(loaded: LoadedModel, config: ServerConfig, vocab_local: int, tp: int = 1, cp: int = 1,
                     pack_tokens: int = 0):
    """job -> estimated peak bytes; refuses to start when no request could ever fit the --memory-budget."""
    from logitserve.memory import ModelDims, estimate_peak_bytes
    from logitserve.spec import Job

    dims = ModelDims.of(loaded.model.config, vocab_local, loaded.head.weight.element_size(), tp, cp)
    window = STREAM_WINDOW * config.max_message_bytes   # encoded messages a stream may hold

    def estimate(job: Job) -> int:   # pack_tokens: a packed body's tokens (Engine.pack_tokens), 0 in exact mode
        return estimate_peak_bytes(job, dims, config.engine.chunk_size, config.scheduler.max_pending, window,
                                   pack_tokens)

    budget = config.scheduler.memory_budget_bytes
    smallest = estimate(Job(sequences=(np.zeros(1, np.int32),), scores=True))
    if budget is not None and pack_tokens and smallest > budget:
        raise ValueError(f"--memory-budget {budget / 2**20:.0f} MiB is under a packed body of {pack_tokens} tokens "
                         f"(~{smallest / 2**20:.0f} MiB; at most --max-batch-tokens): lower --max-batch-tokens "
                         f"or use --batching exact")
    return estimate


async def create_server(loaded: LoadedModel, config: ServerConfig, layout: Optional[Layout] = None,
                        run_batch=None, idle=None, estimate=None, batching: Optional[Batching] = None) -> Running:
    """Build and start a server for a loaded model; `run_batch`, `idle` and `batching` replace the local engine's."""
    layout = layout or single_process(str(loaded.head.weight.device))
    pack_tokens = 0
    if run_batch is None:
        engine = Engine(loaded, config.engine)
        batching, pack_tokens = engine.batching, engine.pack_tokens
        run_batch = engine_batch_runner(engine.batch_steps)
    batching = batching or config.engine.batching
    estimate = estimate or memory_estimator(loaded, config, loaded.vocab_size, pack_tokens=pack_tokens)
    metrics = Metrics()
    scheduler = Scheduler(run_batch, config.scheduler, estimate=estimate, idle=idle, metrics=metrics)
    metrics.bind_scheduler(scheduler)
    info = codec.encode_model_info(loaded, layout, config.max_message_bytes, logitserve.__version__, batching)
    sec = config.security
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", config.max_request_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_connection_idle_ms", int(config.max_connection_idle_s * 1000)),
        ("grpc.so_reuseport", 1),          # beside the loading probe (loading_probe.py) on the same port
    ], interceptors=[TokenAuth(load_tokens(sec.auth_token_file))] if sec.auth_token_file else None)
    servicer = LogitServeServicer(scheduler, info, loaded.limits, config.max_message_bytes, loaded.text, metrics,
                                  config.limits)
    pb_grpc.add_LogitServeServicer_to_server(servicer, server)
    kpb_grpc.add_GRPCInferenceServiceServicer_to_server(
        KServeServicer(scheduler, loaded, logitserve.__version__, servicer, metrics), server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         KSERVE_SERVICE, reflection.SERVICE_NAME), server)
    credentials = server_credentials(sec)
    address = f"{config.host}:{config.port}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {config.host}:{config.port}")
    await server.start()
    http = metrics.serve(config.metrics_port, config.host) if config.metrics_port is not None else None
    running = Running(server, port, scheduler, layout, health_servicer, metrics, http, servicer)
    await running.set_serving(True)
    return running


async def _until_stopped(running: Running, config: ServerConfig, fatal: asyncio.Event) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(fatal.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    # After a lost rank every in-flight request has its UNAVAILABLE already: a short drain flushes it.
    grace = min(config.grace_s, 1.0) if fatal.is_set() else config.grace_s
    log.info("shutting down (grace %.1fs)", grace)
    await running.stop(grace)


def _announce(loaded: LoadedModel, config: ServerConfig, running: Running) -> None:
    log.info("serving %s (%s, %s) tp=%d cp=%d on %s:%d", loaded.name, loaded.content_hash, loaded.architecture,
             running.layout.tp, running.layout.cp, config.host, running.port)
    if running.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", config.host, running.metrics_port)
    print(f"logitserve: serving {loaded.name} on {config.host}:{running.port}", flush=True)


def _loading_probe(config: ServerConfig) -> tuple[LoadingProbe, ServerConfig]:
    """Health NOT_SERVING on the port while loading; the config with the port it bound (for --port 0)."""
    probe = LoadingProbe(config.host, config.port, config.security, SERVICE_NAME)
    print(f"logitserve: loading on {config.host}:{probe.port} (health NOT_SERVING until ready)", flush=True)
    return probe, dataclasses.replace(config, port=probe.port)


async def serve(model: ModelConfig, config: ServerConfig) -> int:
    """One process, one rank: load, serve until SIGINT/SIGTERM, then drain for config.grace_s."""
    probe, config = _loading_probe(config)
    try:
        loaded = load(model)
        running = await create_server(loaded, config)
    finally:
        probe.close()
    _announce(loaded, config, running)
    await _until_stopped(running, config, asyncio.Event())
    return 0


def serve_rank(model: ModelConfig, config: ServerConfig, parallel: ParallelConfig) -> int:
    """This process's rank of a tp x cp server: rank 0 serves gRPC, the others follow. Non-zero on a lost rank."""
    import torch.distributed as dist

    from logitserve.distributed import follow
    from logitserve.parallel import gather_layout, init_parallel

    ctx = init_parallel(parallel)
    probe = None
    try:
        if ctx.is_root:
            probe, config = _loading_probe(config)
        loaded, shard = load_rank(model, ctx)
        engine = Engine(loaded, config.engine, shard, ctx)
        layout = gather_layout(ctx)
        if not ctx.is_root:
            follow(engine, ctx)
            return 0
        return asyncio.run(_serve_root(loaded, engine, ctx, layout, config, probe))
    except Exception:
        log.exception("rank %d failed", ctx.rank)
        return 1
    finally:
        if probe is not None:
            probe.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


async def _serve_root(loaded, engine, ctx, layout: Layout, config: ServerConfig, probe=None) -> int:
    from logitserve.distributed import DistributedRunner

    loop = asyncio.get_running_loop()
    fatal = asyncio.Event()
    runner = DistributedRunner(engine, ctx, on_fatal=lambda reason: loop.call_soon_threadsafe(fatal.set))
    estimate = memory_estimator(loaded, config, engine.shard.size, ctx.tp, ctx.cp, engine.pack_tokens)
    running = await create_server(loaded, config, layout, run_batch=runner.run_batch, idle=runner.heartbeat,
                                  estimate=estimate, batching=engine.batching)
    if probe is not None:
        probe.close()
    _announce(loaded, config, running)

    await _until_stopped(running, config, fatal)   # a lost rank: health goes NOT_SERVING as the server stops
    if runner.failed:
        log.error("exiting: a rank was lost (%s)", runner.failed)
        return 1
    await asyncio.to_thread(runner.stop)
    return 0
