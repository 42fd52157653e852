"""Server construction (create_server, for tests) apart from serving until stopped (serve)."""
from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2 as reflection_v1alpha
from grpc_reflection.v1alpha import reflection_pb2_grpc as reflection_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

import logitserve
from logitserve.cost import cost_of
from logitserve.engine import Batching, Engine
from logitserve.head_export import HeadSource
from logitserve.hostmem import freeze_startup_objects
from logitserve.spec import ModelKind
from logitserve.layout import Layout, single_process
from logitserve.loaded import LoadedModel, content_hash
from logitserve.parallel import ParallelConfig, ParallelContext
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc

from . import codec
from .config import ModelConfig, ServerConfig  # noqa: F401 (re-exported: create_server takes them)
from .scheduler import Scheduler, engine_batch_runner
from .grouping import shareables
from .budget import device_budget, memory_estimator  # noqa: F401 (memory_estimator re-exported)
from .kserve import KServeServicer
from .gate import SERVICE_NAME, Gate, Listening, PortInUse, check_port_free, open_port  # noqa: F401 (re-exported)
from .metrics import Metrics
from .requests import Pipeline
from .servicer import LogitServeServicer
from .servicer import add_to as add_native

log = logging.getLogger("logitserve.server")
KSERVE_SERVICE = "inference.GRPCInferenceService"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _source(model: ModelConfig) -> tuple[Path, Optional[str]]:
    from logitserve.demo import demo_dir

    if model.path:
        return Path(model.path), None
    shape = "" if model.demo_shape == "demo" else f"-{model.demo_shape}"
    return demo_dir(model.demo, model.demo_shape), f"logitserve-demo-{model.demo}{shape}"


def _device(model: ModelConfig) -> str:
    """One process's device: cpu, or cuda when asked or (auto) when there is one."""
    if model.device != "cpu":
        import torch

        if model.device == "cuda" or torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def load_rank(model: ModelConfig, ctx: ParallelContext) -> tuple:
    """This rank's model and its vocab shard, read straight from disk: its TP shards and PP stage; the whole model
    in one process (trivial groups)."""
    from logitserve.loaded import with_step_separator
    from logitserve.loading import load_sharded
    from logitserve.parallel import hook_cp, startup_barrier

    path, name = _source(model)
    # Only rank 0 reports the hash. It reads every weight file (minutes for a 100+ GB teacher), so it runs beside
    # the loading, and the other ranks then wait for it in a barrier with a start-up timeout, not in a model
    # collective whose --collective-timeout it would exceed.
    hashing = ThreadPoolExecutor(1).submit(content_hash, path) if ctx.is_root else None
    loaded, shard = load_sharded(path, model.dtype, ctx.device, ctx.tp_rank, ctx.tp, ctx.tp_group,
                                 max_seq_len=model.max_seq_len, name=name, content="", pp=ctx.pp, stage=ctx.pp_rank,
                                 balance=ctx.config.pp_balance, fp8_compute=model.fp8_compute)
    if hashing is not None:
        loaded = dataclasses.replace(loaded, content_hash=hashing.result())
    if model.step_separator is not None:
        loaded = with_step_separator(loaded, model.step_separator)
    startup_barrier(ctx)
    hook_cp(loaded, ctx)
    return loaded, shard


@dataclass
class Running:
    server: grpc.aio.Server
    port: int
    gate: Gate
    scheduler: Scheduler
    layout: Layout
    health: health_aio.HealthServicer   # asyncio's: a sync Watch would hold a thread that shutdown waits on
    metrics: Optional[Metrics] = None
    metrics_http: Optional[object] = None   # the /metrics HTTP server when --metrics-port is set
    pipeline: Optional[Pipeline] = None
    http: Optional[object] = None           # the HTTP front-end (server/http_app.py) when --http-port is set

    @property
    def http_port(self) -> Optional[int]:
        return self.http.port if self.http is not None else None

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
        if self.pipeline is not None:
            self.pipeline.drain()
            deadline = time.monotonic() + (grace or 0)
            while self.pipeline.in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self.pipeline.end_in_flight()      # what still runs hears UNAVAILABLE, not a bare GOAWAY
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(1.0)     # a second for the streams to send what they hold, the UNAVAILABLE included
        self.scheduler.shutdown()
        await asyncio.to_thread(self.scheduler.join, 10.0)
        if self.metrics_http is not None:
            self.metrics_http.shutdown()


def _add_reflection(gate: Gate, names: tuple[str, ...]) -> None:
    """grpc.reflection v1alpha and v1 (grpcurl and newer tools ask v1 first; the two are wire-identical)."""
    servicer = ReflectionServicer((*names, reflection.SERVICE_NAME))
    reflection_grpc.add_ServerReflectionServicer_to_server(servicer, gate)
    gate.add_registered_method_handlers(REFLECTION_V1, {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_v1alpha.ServerReflectionRequest.FromString,
        response_serializer=reflection_v1alpha.ServerReflectionResponse.SerializeToString)})


async def create_server(loaded: LoadedModel, config: ServerConfig, layout: Optional[Layout] = None,
                        run_batch=None, idle=None, estimate=None, batching: Optional[Batching] = None,
                        listening: Optional[Listening] = None) -> Running:
    """Serve a loaded model on `listening` (a port opened before loading) or on a port opened now;
    `run_batch`, `idle` and `batching` replace the local engine's."""
    layout = layout or single_process(str(loaded.head.weight.device))
    pack_tokens = 0
    if run_batch is None:
        engine = Engine(loaded, config.engine)
        batching, pack_tokens = engine.batching, engine.pack_tokens
        run_batch = engine_batch_runner(engine.batch_steps)
    batching = batching or config.engine.batching
    estimate = estimate or memory_estimator(loaded, config, loaded.vocab_size, pack_tokens=pack_tokens)
    listening = listening or await open_port(config)
    metrics = Metrics()
    min_shared = config.engine.min_shared_prefix if batching is Batching.PACKED else 0
    scheduler = Scheduler(run_batch, config.scheduler, estimate=estimate, idle=idle, metrics=metrics,
                          cost=lambda job: cost_of(job, loaded.vocab_size, loaded.num_labels or 1, loaded.head.in_features),
                          shares=(lambda job: shareables(job, min_shared, loaded.vocab_size)) if min_shared else None)
    metrics.bind_scheduler(scheduler)
    if listening.auth is not None:
        listening.auth.on_failure = metrics.auth_failures.inc
    info = codec.encode_model_info(loaded, layout, config.max_message_bytes, logitserve.__version__, batching,
                                   config.engine.min_shared_prefix)
    gate = listening.gate
    pipeline = Pipeline(scheduler, loaded.limits, loaded.text, metrics, config.limits, config.clients,
                        by_token=listening.auth is not None)
    head = HeadSource(loaded) if loaded.kind is ModelKind.CAUSAL_LM else None
    add_native(LogitServeServicer(pipeline, info, config.max_message_bytes, head, config.head), gate)
    kpb_grpc.add_GRPCInferenceServiceServicer_to_server(
        KServeServicer(pipeline, loaded, logitserve.__version__, config.max_message_bytes), gate)
    _add_reflection(gate, (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                           KSERVE_SERVICE))
    http = metrics.serve(config.metrics_port, config.metrics_host) if config.metrics_port is not None else None
    running = Running(listening.server, listening.port, gate, scheduler, layout, listening.health, metrics, http,
                      pipeline)
    if config.http_port is not None:
        running.http = await _serve_http(loaded, config, pipeline, listening)
    freeze_startup_objects()      # full collections skip start-up's objects (logitserve.hostmem)
    gate.open()
    await running.set_serving(True)
    return running


async def _serve_http(loaded: LoadedModel, config: ServerConfig, pipeline: Pipeline, listening: Listening):
    """The HTTP front-end on the socket open_port bound to config.http_port, sharing the pipeline (and so the
    scheduler) with gRPC."""
    from .http_app import HttpFrontEnd
    from .http_common import Ctx, TokenTexts

    ctx = Ctx(pipeline, loaded, config.served_model_names or (loaded.name,), logitserve.__version__,
              config.limits.max_response_bytes, TokenTexts(loaded.text))
    front = HttpFrontEnd(ctx, config.max_request_bytes, listening.auth, config.http)
    await front.start(listening.http_socket, config.security)
    await asyncio.to_thread(ctx.tables.tables)    # each vocab id's JSON pieces, once (~0.3 s per 32k ids)
    return front


def _stop_on_signals() -> asyncio.Event:
    """SIGINT/SIGTERM set the returned event from now on (installed before the port opens: a signal during
    loading or right after 'serving' is a clean stop, never the default kill)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _until_stopped(running: Running, config: ServerConfig, fatal: asyncio.Event, stop: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(fatal.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    # After a lost rank every in-flight request has its UNAVAILABLE already: a short drain flushes it.
    grace = min(config.grace_s, 1.0) if fatal.is_set() else config.grace_s
    log.info("shutting down (grace %.1fs)", grace)
    await running.stop(grace)


def _announce(loaded: LoadedModel, config: ServerConfig, running: Running) -> None:
    log.info("serving %s (%s, %s) tp=%d cp=%d pp=%d on %s:%d", loaded.name, loaded.content_hash,
             loaded.architecture, running.layout.tp, running.layout.cp, running.layout.pp, config.host, running.port)
    if loaded.kind is ModelKind.CAUSAL_LM:
        log.info("%s", config.head.describe())
    if running.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", config.host, running.metrics_port)
    if running.http_port is not None:
        scheme = "https" if config.security.tls_cert else "http"
        log.info("HTTP (vLLM, SGLang, TRL routes) on %s://%s:%d", scheme, config.host, running.http_port)
    log.info("limits in effect: %s", _limits_line(config, running))
    http = f" (HTTP on port {running.http_port})" if running.http_port is not None else ""
    print(f"logitserve: serving {loaded.name} on {config.host}:{running.port}{http}", flush=True)


def _limits_line(config: ServerConfig, running: Running) -> str:
    """Every server-wide limit with its per-client share, as they are enforced (derived ones included)."""
    c, sc = running.pipeline.clients.limits, config.scheduler
    mib = (lambda b: "off" if b is None else f"{b / 2**20:.0f} MiB")
    parts = [f"--max-in-flight {c.max_in_flight_total} (per client {c.max_in_flight})",
             f"--max-streams {config.limits.max_streams} (per client {c.max_streams})",
             f"--max-queued-tokens {sc.max_queued_tokens} (per client {sc.client_queued_tokens})",
             f"--memory-budget {mib(sc.memory_budget_bytes)} (per client {mib(sc.client_budget_bytes)})"]
    if running.http is not None:
        parts.append(running.http.limits_line())
    return "; ".join(parts)


def _announce_loading(config: ServerConfig, listening: Listening) -> None:
    print(f"logitserve: loading on {config.host}:{listening.port} (health NOT_SERVING, other RPCs UNAVAILABLE "
          f"until ready)", flush=True)


def _warn_insecure(config: ServerConfig) -> None:
    sec = config.security
    if sec.auth_token_file and not sec.tls_cert:
        log.warning("bearer tokens are checked but the port has no TLS: tokens cross the network in clear text; "
                    "add --tls-cert/--tls-key unless this port is reachable only through a trusted proxy")


async def serve(model: ModelConfig, config: ServerConfig) -> int:
    """One process, one rank: open the port, load, serve until SIGINT/SIGTERM, then drain for config.grace_s."""
    from logitserve.parallel import single_rank

    _warn_insecure(config)
    return await _serve(model, config, single_rank(_device(model)))


def serve_rank(model: ModelConfig, config: ServerConfig, parallel: ParallelConfig) -> int:
    """This process's rank of a tp x cp x pp server: rank 0 serves, the others follow. Non-zero on a lost rank."""
    import torch.distributed as dist

    from logitserve.distributed import follow
    from logitserve.parallel import init_parallel

    if not config.scheduler.stall_timeout_s < parallel.collective_timeout_s:
        raise ValueError(f"stall_timeout_s {config.scheduler.stall_timeout_s:g} must be below the collective timeout "
                         f"{parallel.collective_timeout_s:g}: the other ranks wait in a collective meanwhile")
    if model.path is None:   # every rank builds the demo before init: transformers then saves on rank 0 only
        _source(model)
    ctx = init_parallel(parallel)
    try:
        if ctx.is_root:
            _warn_insecure(config)
            return asyncio.run(_serve(model, config, ctx))
        engine, _ = _rank_engine(model, config, ctx)
        freeze_startup_objects()
        follow(engine, ctx)
        return 0
    except PortInUse as e:
        log.error("%s", e)
        return 1
    except Exception:
        log.exception("rank %d failed", ctx.rank)
        return 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _rank_engine(model: ModelConfig, config: ServerConfig, ctx: ParallelContext) -> tuple:
    """(engine, layout) of this rank: every rank runs this, in the same order (it holds collectives)."""
    from logitserve.parallel import gather_layout

    loaded, shard = load_rank(model, ctx)
    engine = Engine(loaded, config.engine, shard, ctx)
    return engine, gather_layout(ctx)


async def _serve(model: ModelConfig, config: ServerConfig, ctx: ParallelContext) -> int:
    """Rank 0, or the only process: open the port, load, serve until a signal (or a lost rank), then drain."""
    stop = _stop_on_signals()
    listening = await open_port(config)
    config = dataclasses.replace(config, port=listening.port)
    _announce_loading(config, listening)
    try:
        engine, layout = await asyncio.to_thread(_rank_engine, model, config, ctx)   # the event loop answers
        if stop.is_set() and ctx.control_group is None:     # health and UNAVAILABLE meanwhile; told to stop
            await listening.close()
            return 0
        running, runner, fatal = await _start(engine, layout, config, ctx, listening)
    except BaseException as e:
        listening.gate.fail(f"{type(e).__name__}: {e}")
        await listening.close()
        raise
    _announce(engine.loaded, config, running)
    await _until_stopped(running, config, fatal, stop)   # a lost rank: health goes NOT_SERVING as the server stops
    if runner is not None and runner.failed:
        log.error("exiting: a rank was lost (%s)", runner.failed)
        return 1
    if runner is not None:
        await asyncio.to_thread(runner.stop)
    return 0


async def _start(engine: Engine, layout: Layout, config: ServerConfig, ctx: ParallelContext,
                 listening: Listening) -> tuple:
    """(the running server, the ranks' runner or None in one process, the event a lost rank sets)."""
    from logitserve.distributed import DistributedRunner

    fatal = asyncio.Event()
    run_batch, idle, runner = engine_batch_runner(engine.batch_steps), None, None
    if ctx.control_group is not None:
        loop = asyncio.get_running_loop()
        runner = DistributedRunner(engine, ctx, on_fatal=lambda reason: loop.call_soon_threadsafe(fatal.set))
        run_batch, idle = runner.run_batch, runner.heartbeat
    config = device_budget(config, ctx.device)        # rank 0's GPU stands for each rank's (equal shards)
    # under PP rank 0 holds no head: the head's share is the last stage's, ceil(V / tp) columns
    loaded = engine.loaded
    vocab_local = engine.shard.size if ctx.pp == 1 else -(-loaded.vocab_size // ctx.tp)
    estimate = memory_estimator(loaded, config, vocab_local, ctx.tp, ctx.cp, engine.pack_tokens, ctx.pp)
    running = await create_server(loaded, config, layout, run_batch=run_batch, idle=idle, estimate=estimate,
                                  batching=engine.batching, listening=listening)
    return running, runner, fatal
