"""The `logitserve` command: serve and export-demo here; info, query, health, capture in logitserve.client.cli."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import NoReturn, Optional


def _serve_parser(sub, formatter) -> None:
    p = sub.add_parser("serve", help="serve a model (the embedded demo when --model is not given)",
                       formatter_class=formatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback only; 0.0.0.0 for every interface, as in a container)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (native, KServe, health); 0: a free one")
    p.add_argument("--model", default=None, help="local Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--demo", choices=["causal", "reward", "prm"], default="causal",
                   help="embedded demo when no --model: a causal LM, an outcome reward model (sequence "
                        "classifier), a process reward model (token classifier, 2 labels)")
    p.add_argument("--step-separator", default=None, metavar="TOKEN",
                   help="token-classification (process reward) models: the token that ends a step, as the "
                        "vocabulary spells it (e.g. '<extra_0>') or its id, for step_scores requests that name none")
    p.add_argument("--demo-shape", choices=["demo", "body", "1b", "wide", "tiny"], default="demo",
                   help="the demo's shape: demo (lm_head-heavy), body (8 layers, hidden 768), 1b (for GPUs), "
                        "wide (vocab 151936, hidden 1024), tiny (1 layer, hidden 64, vocab 1024: the host's cost alone)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights and activations")
    p.add_argument("--fp8-compute", choices=["auto", "dequantize", "fp8"], default="auto",
                   help="FP8 checkpoints (found from config.json, no flag needed): auto runs the linear layers' GEMMs "
                        "in FP8 on a CUDA GPU that has them (serving bf16) and dequantizes to --dtype at load "
                        "elsewhere; dequantize always dequantizes; fp8 runs FP8 GEMMs wherever torch has them here "
                        "and refuses a weight that cannot (docs/serving.md)")
    p.add_argument("--logprob-chunk-size", type=int, default=512, help="logits rows materialized at a time")
    p.add_argument("--step-target-ms", type=float, default=0.0, metavar="MS",
                   help="a head step holds fewer rows than --logprob-chunk-size when a plain step of that many takes "
                        "longer than MS on this device (measured at start-up: a power of two, at least 16), so a "
                        "queued small request waits about MS for the step in progress, at a cost in throughput on "
                        "a CPU (the head's matmul is slower per row on fewer rows); 0 (default) = the chunk size")
    p.add_argument("--short-step-ms", type=float, default=10.0, metavar="MS",
                   help="the same target for batches that hold a large request while small ones keep coming (one "
                        "arrived or ran between a batch's steps within the last second): their wait for the step in "
                        "progress is about MS; batches go back to full steps when small requests stop; 0 = never "
                        "shorter")
    p.add_argument("--max-seq-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--max-message-bytes", type=int, default=4 << 20, help="every response message stays under this")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads per rank")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (vocab-parallel logits)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (long sequences)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (decoder layers split by parameters; "
                                                     "teachers larger than a node: --tp inside a node, --pp across)")
    p.add_argument("--pp-balance", choices=["compute", "memory"], default="compute",
                   help="--pp: stages balanced by the parameters that compute per token (the embedding, a lookup, "
                        "counts 0) or by all parameters (each rank's memory)")
    p.add_argument("--pp-microbatch-tokens", type=int, default=512,
                   help="--pp: tokens per micro-batch at most (several per batch keep every stage busy)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--collective-timeout", type=float, default=60.0, help="seconds before a collective fails")
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="tokens per batch across all streams (and per packed body); a shared prefix counts once")
    p.add_argument("--batching", choices=["packed", "exact"], default="packed",
                   help="packed: a batch's sequences share one packed body (faster; fp32 within 1e-5 of exact); "
                        "exact: each sequence alone (bitwise batch invariant). CP always runs exact")
    p.add_argument("--min-shared-prefix", type=int, default=64, metavar="N",
                   help="packed: sequences of a batch sharing >= N leading tokens (before any row asked for) "
                        "compute that prefix once; 0 = off")
    p.add_argument("--batch-delay-ms", type=float, default=2.0, help="wait after the first request for others")
    p.add_argument("--share-wait-ms", type=float, default=5.0, metavar="MS",
                   help="packed: a batch whose groups (sequences sharing >= --min-shared-prefix leading tokens) keep "
                        "arriving as separate requests stays open until MS after the latest, at most MS past "
                        "--batch-delay-ms, so their prefix is computed once; 0 = never wait")
    p.add_argument("--interject-after-ms", type=float, default=20.0, metavar="MS",
                   help="a batch running longer than MS runs queued small requests (--interject-tokens) between its "
                        "head steps, so they do not wait out a large one; 0 = never")
    p.add_argument("--interject-tokens", type=int, default=1024, metavar="N",
                   help="small, for --interject-after-ms: at most N work tokens (tokens weighted by filters and "
                        "top-k); at most N such tokens between two steps")
    p.add_argument("--max-queued-tokens", type=int, default=1 << 20,
                   help="tokens waiting or running; past it RESOURCE_EXHAUSTED")
    p.add_argument("--memory-budget", type=_size, default=None,
                   help="refuse requests whose estimated peak is over this, e.g. 2GiB (default: no limit)")
    p.add_argument("--stall-timeout", type=float, default=30.0,
                   help="longest the compute thread waits on one slow reader, and only while no other request waits "
                        "(below --collective-timeout)")
    p.add_argument("--max-buffered-bytes", type=_size, default=256 << 20, metavar="SIZE",
                   help="per request: computed outputs its stream has not read yet (reserved in --memory-budget); "
                        "a reader that lets it fill while others wait loses its request")
    p.add_argument("--max-text-bytes", type=_size, default=1 << 20, metavar="SIZE",
                   help="UTF-8 bytes of one request's texts, checked before tokenizing")
    p.add_argument("--max-request-bytes", type=_size, default=64 << 20, metavar="SIZE",
                   help="largest request message received; lower it for untrusted clients")
    p.add_argument("--max-response-bytes", type=_size, default=1 << 30, metavar="SIZE",
                   help="bytes of one request's outputs, checked before it runs")
    p.add_argument("--max-queued-tokens-per-client", type=int, default=None, metavar="N",
                   help="one client's share of --max-queued-tokens (none given: half of it)")
    p.add_argument("--max-streams-per-client", type=int, default=None, metavar="N",
                   help="Forward streams one client (its bearer token with --auth-token-file, else its peer host) "
                        "holds open (none given: half of --max-streams; never above it)")
    p.add_argument("--max-in-flight", type=int, default=2048, metavar="N",
                   help="requests in flight server-wide, every front-end (gRPC, KServe, HTTP) together")
    p.add_argument("--max-in-flight-per-client", type=int, default=None, metavar="N",
                   help="requests in flight for one client, every front-end together (none given: half of "
                        "--max-in-flight; never above it)")
    p.add_argument("--stream-idle-s", type=float, default=300.0, metavar="S",
                   help="close a Forward stream with no request in flight for this long")
    p.add_argument("--max-head-downloads", type=int, default=2, metavar="N",
                   help="Head downloads (the whole lm_head each) in flight at once, server-wide")
    p.add_argument("--max-head-downloads-per-client", type=int, default=None, metavar="N",
                   help="one client's share of --max-head-downloads (none given: half of it, at least 1)")
    p.add_argument("--head-stall-s", type=float, default=10.0, metavar="S",
                   help="a Head download whose reader takes no message for this long is cut and frees its slot")
    p.add_argument("--no-overlap", action="store_true", help="send each piece before computing the next (for measuring)")
    p.add_argument("--no-malloc-tuning", action="store_true",
                   help="keep glibc's malloc defaults (by default: one arena, no trimming; see logitserve.hostmem)")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA bundle: mTLS, a client without a certificate it signed is refused")
    p.add_argument("--auth-token-file", help="bearer tokens, one per line: every RPC but health needs one")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics over HTTP on this port")
    p.add_argument("--http-port", type=int, default=None, metavar="P",
                   help="also serve vLLM's, SGLang's and TRL's HTTP routes on this port (same host, TLS and tokens)")
    p.add_argument("--http-max-connections", type=int, default=1024, metavar="N",
                   help="open HTTP connections, server-wide; one over is answered 503 and closed at once")
    p.add_argument("--http-max-connections-per-client", type=int, default=None, metavar="N",
                   help="open HTTP connections of one peer host (none given: half of --http-max-connections)")
    p.add_argument("--http-header-timeout-s", type=float, default=10.0, metavar="S",
                   help="a request's line and headers must arrive within this (from the connection or last answer)")
    p.add_argument("--http-body-timeout-s", type=float, default=30.0, metavar="S",
                   help="a request's body must arrive within this of its headers")
    p.add_argument("--http-keepalive-s", type=float, default=5.0, metavar="S",
                   help="an idle kept-alive HTTP connection is closed after this")
    p.add_argument("--http-max-requests-per-connection", type=int, default=1000, metavar="N",
                   help="a kept-alive HTTP connection's last answer says 'connection: close' after this many")
    p.add_argument("--http-send-timeout-s", type=float, default=30.0, metavar="S",
                   help="a client that takes none of its answer's bytes for this long loses its request and "
                        "connection (its bytes leave the memory budget)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name on HTTP (the first; the others are aliases); default: the model's own")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of /metrics (it has no auth; default loopback only)")
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="on SIGTERM: NOT_SERVING and new requests UNAVAILABLE at once, in-flight ones get this long")
    p.add_argument("--max-sequences-per-request", type=int, default=4096, help="sequences in one request")
    p.add_argument("--max-request-tokens", type=int, default=1 << 20, help="tokens in one request")
    p.add_argument("--max-streams", type=int, default=256, help="Forward streams open at once, server-wide")
    p.add_argument("--max-in-flight-per-stream", type=int, default=256, help="requests in flight on one stream")
    p.add_argument("--keepalive-s", type=float, default=60.0, help="ping idle connections; drop peers silent 20 s")
    p.add_argument("--debug", action="store_true", help="tracebacks for start-up errors (one line each without)")
    p.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="json: one object per line, with request_id, status, tokens and seconds per request")


def _size(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for unit, scale in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * scale)
    return int(float(t))


def _export_parser(sub, formatter) -> None:
    e = sub.add_parser("export-demo", help="write the embedded demo model as a Hugging Face directory",
                       formatter_class=formatter)
    e.add_argument("directory")
    e.add_argument("--kind", choices=["causal", "reward", "prm"], default="causal")
    e.add_argument("--shape", choices=["demo", "body", "1b", "wide", "tiny"], default="demo")


# torch first and pinned: with no torch present, pip would pick a multi-GB CUDA build for the extras
INSTALL_SERVER = "pip install torch==2.13.0 && pip install 'logitserve[server]'"
SERVER_MODULES = ("torch", "transformers", "safetensors", "accelerate", "grpc_health", "grpc_reflection",
                  "prometheus_client")


def _missing_server_extras() -> list[str]:
    """The server's dependencies that are not installed (a client-only `pip install logitserve`)."""
    import importlib.util

    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


def _broken_extras() -> list[str]:
    """One line per gRPC extra that is installed but does not load: its generated code needs a newer protobuf
    than the one installed (what adding tritonclient, which pins protobuf < 7, after logitserve does)."""
    import importlib

    lines = []
    for module, package in (("grpc_health.v1.health_pb2", "grpcio-health-checking"),
                            ("grpc_reflection.v1alpha.reflection_pb2", "grpcio-reflection")):
        try:
            importlib.import_module(module)
        except Exception as e:   # noqa: BLE001 (google.protobuf.runtime_version.VersionError, ImportError)
            from google.protobuf import __version__ as protobuf

            pin = f"'{package}<1.82'" if protobuf.startswith("6.") else f"a {package} built for protobuf {protobuf}"
            lines.append(f"logitserve serve: {package} does not load with the installed protobuf {protobuf} "
                         f"({str(e).splitlines()[0][:160]}); another install moved protobuf under it (tritonclient "
                         f"pins protobuf < 7). Pin it: pip install {pin}")
    return lines


def _cmd_serve(args, argv: list[str]) -> int:
    code = _check_extras()
    if code is not None:
        return code
    from logitserve.parallel import ParallelConfig

    from .app import PortInUse, serve, serve_rank
    from .config import ModelConfig
    from .head_rpc import HeadLimits
    from .launch import spawn_local, under_torchrun

    try:
        head_limits = HeadLimits(args.max_head_downloads, args.max_head_downloads_per_client, args.head_stall_s)
        parallel = ParallelConfig(tp=args.tp, cp=args.cp, collective_timeout_s=args.collective_timeout,
                                  device=args.device, pp=args.pp, pp_balance=args.pp_balance)
    except ValueError as e:
        print(f"logitserve: {e}", file=sys.stderr)
        return 2
    code = _check_before_start(args, parallel.world_size)
    if code is not None:
        return code
    if parallel.world_size > 1 and not under_torchrun():
        return spawn_local(argv[1:], parallel.world_size, args.threads)
    _tune_process(args)
    model = ModelConfig(path=args.model, demo=args.demo, demo_shape=args.demo_shape, dtype=args.dtype,
                        max_seq_len=args.max_seq_len, step_separator=args.step_separator,
                        fp8_compute=args.fp8_compute)
    config = _server_config(args, head_limits)
    if under_torchrun():
        # The rank is done and its process groups destroyed; the interpreter's own teardown can still
        # meet a joinable gloo thread and abort ("terminate called without an active exception",
        # seen once in 2x2 at SIGTERM), so leave now with the rank's real exit code.
        _leave(serve_rank(model, config, parallel))
    import dataclasses

    try:
        code = asyncio.run(serve(dataclasses.replace(model, device=args.device), config))
    except PortInUse as e:
        print(f"logitserve: {e}", file=sys.stderr)
        return 1
    # As under torchrun: a compute thread still inside torch at interpreter teardown aborts the process
    # ("terminate called without an active exception"); the server is done, so leave with its exit code.
    _leave(code)


def _check_extras() -> Optional[int]:
    """Exit code 2, said why, when the server's extras are missing or do not load; None when they are fine."""
    missing = _missing_server_extras()
    if missing:
        print(f"logitserve serve needs the server extras, missing here: {', '.join(missing)}.\n"
              f"Install them with: {INSTALL_SERVER}", file=sys.stderr)
        return 2
    broken = _broken_extras()
    if broken:
        print("\n".join(broken), file=sys.stderr)
        return 2
    return None


def _check_before_start(args, world_size: int) -> Optional[int]:
    """The checks before any rank starts (versions, the model directory and its layout, timeouts, free ports):
    an exit code, said why, or None when serving may start."""
    from logitserve.preflight import StartupError, check_layout, check_model_dir, check_quantization, check_versions

    from .app import PortInUse, check_port_free
    from .launch import under_torchrun

    if not under_torchrun():       # once, before any rank starts (under torchrun: every rank checks alike)
        try:
            check_versions()
            check_model_dir(args.model)
            check_quantization(args.model)
            check_layout(args.model, args.demo, args.demo_shape, args.tp, args.cp, args.pp)
        except StartupError as e:
            print(f"logitserve: {e}", file=sys.stderr)
            return 2
    if world_size > 1 and not args.stall_timeout < args.collective_timeout:
        print(f"logitserve: --stall-timeout {args.stall_timeout:g} must be below --collective-timeout "
              f"{args.collective_timeout:g}: the other ranks wait in a collective while rank 0 waits on a slow "
              f"reader", file=sys.stderr)
        return 2
    if not under_torchrun():
        try:
            check_port_free(args.host, args.port)   # one line now, before ranks start or gRPC logs its own
            check_port_free(args.host, args.http_port, "--http-port")
        except PortInUse as e:
            print(f"logitserve: {e}", file=sys.stderr)
            return 1
    return None


def _tune_process(args) -> None:
    """malloc, the GIL's switch interval, torch's threads; no download progress bars."""
    import torch
    from transformers.utils import logging as hf_logging

    serves_on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if not args.no_malloc_tuning and serves_on_cpu:   # tuned for CPU serving's big host tensors; a GPU server's
        from logitserve.hostmem import tune_host_malloc    # host side keeps glibc's defaults

        tune_host_malloc()
    hf_logging.disable_progress_bar()
    # The event loop, the compute thread and the HTTP encoder share the GIL: a thread that wants it waits at most
    # this long for a busy one to let go (Python's default is 5 ms, felt by every small request under load).
    sys.setswitchinterval(0.001)
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)


def _server_config(args, head_limits):
    """The ServerConfig the serve flags describe, one flag to one field."""
    from logitserve.engine import Batching, EngineConfig

    from .admission import ClientLimits
    from .config import SchedulerConfig, ServerConfig, StreamLimits
    from .http_conn import HttpLimits
    from .security import SecurityConfig

    scheduler = SchedulerConfig(max_batch_tokens=args.max_batch_tokens, batch_delay_s=args.batch_delay_ms / 1e3,
                                share_wait_s=args.share_wait_ms / 1e3, interject_after_s=args.interject_after_ms / 1e3,
                                interject_tokens=args.interject_tokens,
                                max_queued_tokens=args.max_queued_tokens, memory_budget_bytes=args.memory_budget,
                                stall_timeout_s=args.stall_timeout, overlap=not args.no_overlap,
                                max_buffered_bytes=args.max_buffered_bytes,
                                max_queued_tokens_per_client=args.max_queued_tokens_per_client)
    engine = EngineConfig(chunk_size=args.logprob_chunk_size, batching=Batching(args.batching),
                          max_pack_tokens=args.max_batch_tokens, min_shared_prefix=args.min_shared_prefix,
                          pp_microbatch_tokens=args.pp_microbatch_tokens,
                          step_target_s=args.step_target_ms / 1e3 if args.step_target_ms > 0 else None,
                          short_step_target_s=args.short_step_ms / 1e3 if args.short_step_ms > 0 else None)
    http = HttpLimits(args.http_max_connections, args.http_max_connections_per_client, args.http_header_timeout_s,
                      args.http_body_timeout_s, args.http_keepalive_s, args.http_max_requests_per_connection,
                      send_timeout_s=args.http_send_timeout_s)
    return ServerConfig(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                        max_request_bytes=args.max_request_bytes, engine=engine, scheduler=scheduler,
                        security=SecurityConfig(args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file),
                        metrics_port=args.metrics_port, http_port=args.http_port, http=http,
                        served_model_names=tuple(args.served_model_name or ()), metrics_host=args.metrics_host,
                        grace_s=args.grace_s, keepalive_s=args.keepalive_s,
                        limits=StreamLimits(args.max_sequences_per_request, args.max_request_tokens,
                                            args.max_streams, args.max_in_flight_per_stream, args.max_text_bytes,
                                            args.max_response_bytes),
                        clients=ClientLimits(args.max_streams_per_client, args.max_in_flight_per_client,
                                             args.stream_idle_s, args.max_in_flight), head=head_limits)


def _leave(code: int) -> NoReturn:
    """Exit now with `code`, logs and output flushed, without the interpreter's teardown (see _cmd_serve)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_export(args) -> int:
    import importlib.util

    missing = [m for m in ("torch", "transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"logitserve export-demo builds the model with torch and transformers, missing here: "
              f"{', '.join(missing)}. Install them with: {INSTALL_SERVER}", file=sys.stderr)
        return 2
    from logitserve.demo import export_demo

    print(export_demo(args.directory, args.kind, args.shape))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (docs/gen_reference.py writes docs/reference/cli.md from it)."""
    from logitserve.client import cli as client_cli

    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="logitserve", formatter_class=formatter,
                                     description="A teacher's or reward model's per-token outputs over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands (logitserve COMMAND --help for each)")
    _serve_parser(sub, formatter)
    client_cli.add_parsers(sub, formatter)
    _export_parser(sub, formatter)
    return parser


def main(argv=None) -> int:
    from logitserve.client import cli as client_cli

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    from .logs import configure

    configure(getattr(args, "log_format", "text"))
    commands = {"serve": lambda a: _cmd_serve(a, argv), **client_cli.COMMANDS, "export-demo": _cmd_export}
    try:
        return commands[args.command](args)
    except Exception as e:  # noqa: BLE001 (the client's errors, bad options, start-up failures: one line)
        if getattr(args, "debug", False) or not _explainable(e):
            raise
        print(f"logitserve: {e}" if type(e).__name__ in ("LogitServeError", "ValueError", "StartupError")
              else f"logitserve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _explainable(e: Exception) -> bool:
    """Errors whose message says it all: the client's, bad options, files and ports (a bug keeps its traceback)."""
    return type(e).__name__ in ("LogitServeError", "StartupError", "PortInUse") or isinstance(e, (ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
