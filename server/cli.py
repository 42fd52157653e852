"""The `logitserve` command: serve, info, query, export-demo."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model (the embedded demo when --model is not given)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback only; 0.0.0.0 for every interface, as in a container)")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--model", default=None, help="local Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--demo", choices=["causal", "reward"], default="causal", help="embedded demo when no --model")
    p.add_argument("--demo-shape", choices=["demo", "body", "1b"], default="demo",
                   help="the demo's shape: demo (lm_head-heavy), body (8 layers, hidden 768), 1b (for GPUs)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--logprob-chunk-size", type=int, default=512, help="logits rows materialized at a time")
    p.add_argument("--max-seq-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--max-message-bytes", type=int, default=4 << 20, help="every response message stays under this")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads per rank")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (vocab-parallel logits)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (long sequences)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--collective-timeout", type=float, default=60.0, help="seconds before a collective fails")
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="tokens per batch across all streams (and per packed body)")
    p.add_argument("--batching", choices=["packed", "exact"], default="packed",
                   help="packed: a batch's sequences share one packed body (faster; fp32 within 1e-5 of exact); "
                        "exact: each sequence alone (bitwise batch invariant). CP always runs exact")
    p.add_argument("--min-shared-prefix", type=int, default=64, metavar="N",
                   help="packed: sequences of a batch sharing >= N leading tokens (before any row asked for) "
                        "compute that prefix once; 0 = off")
    p.add_argument("--batch-delay-ms", type=float, default=2.0, help="wait after the first request for others")
    p.add_argument("--max-queued-tokens", type=int, default=1 << 20,
                   help="tokens waiting or running; past it RESOURCE_EXHAUSTED")
    p.add_argument("--memory-budget", type=_size, default=None,
                   help="refuse requests whose estimated peak is over this, e.g. 2GiB (default: no limit)")
    p.add_argument("--stall-timeout", type=float, default=30.0,
                   help="longest the compute thread waits on one slow reader, and only while no other request waits "
                        "(default 30; below --collective-timeout)")
    p.add_argument("--max-buffered-bytes", type=_size, default=256 << 20, metavar="SIZE",
                   help="per request: computed outputs its stream has not read yet (default 256MiB, reserved in "
                        "--memory-budget); a reader that lets it fill while others wait loses its request")
    p.add_argument("--max-text-bytes", type=_size, default=1 << 20, metavar="SIZE",
                   help="UTF-8 bytes of one request's texts, checked before tokenizing (default 1MiB)")
    p.add_argument("--max-request-bytes", type=_size, default=64 << 20, metavar="SIZE",
                   help="largest request message received (default 64MiB); lower it for untrusted clients")
    p.add_argument("--max-response-bytes", type=_size, default=1 << 30, metavar="SIZE",
                   help="bytes of one request's outputs, checked before it runs (default 1GiB)")
    p.add_argument("--max-queued-tokens-per-client", type=int, default=None, metavar="N",
                   help="one client's share of --max-queued-tokens (default: half of it)")
    p.add_argument("--max-streams-per-client", type=int, default=128, metavar="N",
                   help="Forward streams one client (bearer token, or peer host without auth) holds open (default 128)")
    p.add_argument("--max-in-flight-per-client", type=int, default=1024, metavar="N",
                   help="requests in flight for one client, all streams and KServe together (default 1024)")
    p.add_argument("--stream-idle-s", type=float, default=300.0, metavar="S",
                   help="close a Forward stream with no request in flight for this long (default 300)")
    p.add_argument("--no-overlap", action="store_true", help="send each piece before computing the next (for measuring)")
    p.add_argument("--no-malloc-tuning", action="store_true",
                   help="keep glibc's malloc defaults (by default: one arena, no trimming; see logitserve.hostmem)")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA bundle: mTLS, a client without a certificate it signed is refused")
    p.add_argument("--auth-token-file", help="bearer tokens, one per line: every RPC but health needs one")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics over HTTP on this port")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of /metrics (it has no auth; default loopback only)")
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="on SIGTERM: NOT_SERVING and new requests UNAVAILABLE at once, in-flight ones get this long")
    p.add_argument("--max-sequences-per-request", type=int, default=4096)
    p.add_argument("--max-request-tokens", type=int, default=1 << 20)
    p.add_argument("--max-streams", type=int, default=256, help="Forward streams open at once, server-wide")
    p.add_argument("--max-in-flight-per-stream", type=int, default=256)
    p.add_argument("--keepalive-s", type=float, default=60.0, help="ping idle connections; drop peers silent 20 s")
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


def _wait_arg(p) -> None:
    p.add_argument("--wait", type=float, default=600.0, metavar="S",
                   help="wait up to S seconds for a server that is still starting (0: fail at once)")


def _connect(args):
    """A TeacherClient to args.address, once the server is ready (saying so on stderr when it waits)."""
    from logitserve.client import LogitServeError, TeacherClient

    client = TeacherClient(args.address)
    try:
        client.wait_ready(0.5)
    except LogitServeError as e:
        if e.code.name not in ("UNAVAILABLE", "DEADLINE_EXCEEDED") or args.wait <= 0.5:
            client.close()
            raise
        print(f"logitserve: {args.address} is not ready yet ({e.details}); waiting up to {args.wait:g} s "
              f"(--wait)", file=sys.stderr, flush=True)
        try:
            client.wait_ready(args.wait)
        except BaseException:
            client.close()
            raise
    return client


def _client_parsers(sub) -> None:
    p = sub.add_parser("info", help="print a server's model info")
    p.add_argument("address")
    _wait_arg(p)
    q = sub.add_parser("query", help="print token logprobs and top-k for some token ids")
    q.add_argument("address")
    _wait_arg(q)
    given = q.add_mutually_exclusive_group(required=True)
    given.add_argument("--ids", help="comma-separated token ids, e.g. 1,2,3")
    given.add_argument("--text", help="a text for the server to tokenize with the model's tokenizer")
    q.add_argument("--topk", type=int, default=5)
    q.add_argument("--temperature", type=float, default=1.0)
    h = sub.add_parser("health", help="exit 0 when a server's grpc.health.v1 says SERVING (for HEALTHCHECK)")
    h.add_argument("address", nargs="?", default="127.0.0.1:50051")
    h.add_argument("--timeout", type=float, default=5.0)
    c = sub.add_parser("capture", help="capture a teacher's top-k for a jsonl dataset into safetensors shards")
    c.add_argument("address")
    _wait_arg(c)
    c.add_argument("--input", required=True, help='jsonl: {"ids": [...]} or {"text": "..."} per line')
    c.add_argument("--out", required=True, help="directory of shards + manifest.json; a rerun resumes")
    c.add_argument("--topk", type=int, default=64)
    c.add_argument("--logprobs", action="store_true", help="also the token logprobs")
    c.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="top-k values on disk")
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--shard-samples", type=int, default=256)
    c.add_argument("--batch-samples", type=int, default=16, help="samples per request")
    c.add_argument("--in-flight", type=int, default=4, help="requests on the stream at once")
    c.add_argument("--verify", type=int, default=0, metavar="N", help="then re-check N random samples live")
    c.add_argument("--no-progress", action="store_true")
    e = sub.add_parser("export-demo", help="write the embedded demo model as a Hugging Face directory")
    e.add_argument("directory")
    e.add_argument("--kind", choices=["causal", "reward"], default="causal")
    e.add_argument("--shape", choices=["demo", "body", "1b"], default="demo")


SERVER_MODULES = ("torch", "transformers", "safetensors", "accelerate", "grpc_health", "grpc_reflection",
                  "prometheus_client")


def _missing_server_extras() -> list[str]:
    """The server's dependencies that are not installed (a client-only `pip install logitserve`)."""
    import importlib.util

    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


def _cmd_serve(args, argv: list[str]) -> int:
    missing = _missing_server_extras()
    if missing:
        print(f"logitserve serve needs the server extras, missing here: {', '.join(missing)}.\n"
              f"Install them with: pip install 'logitserve[server]'  (install torch first to pick its build: "
              f"pip install torch)", file=sys.stderr)
        return 2
    import torch
    from transformers.utils import logging as hf_logging

    from logitserve.engine import Batching, EngineConfig
    from logitserve.parallel import ParallelConfig

    from .app import ModelConfig, PortInUse, ServerConfig, check_port_free, serve, serve_rank
    from .scheduler import SchedulerConfig
    from .security import SecurityConfig
    from .admission import ClientLimits
    from .servicer import StreamLimits
    from .launch import spawn_local, under_torchrun

    parallel = ParallelConfig(tp=args.tp, cp=args.cp, collective_timeout_s=args.collective_timeout,
                              device=args.device)
    if parallel.world_size > 1 and not args.stall_timeout < args.collective_timeout:
        print(f"logitserve: --stall-timeout {args.stall_timeout:g} must be below --collective-timeout "
              f"{args.collective_timeout:g}: the other ranks wait in a collective while rank 0 waits on a slow "
              f"reader", file=sys.stderr)
        return 2
    if not under_torchrun():
        try:
            check_port_free(args.host, args.port)   # one line now, before ranks start or gRPC logs its own
        except PortInUse as e:
            print(f"logitserve: {e}", file=sys.stderr)
            return 1
    if parallel.world_size > 1 and not under_torchrun():
        return spawn_local(argv[1:], parallel.world_size, args.threads)
    if not args.no_malloc_tuning:
        from logitserve.hostmem import tune_host_malloc

        tune_host_malloc()
    hf_logging.disable_progress_bar()
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    model = ModelConfig(path=args.model, demo=args.demo, demo_shape=args.demo_shape, dtype=args.dtype,
                        max_seq_len=args.max_seq_len)
    scheduler = SchedulerConfig(max_batch_tokens=args.max_batch_tokens, batch_delay_s=args.batch_delay_ms / 1e3,
                                max_queued_tokens=args.max_queued_tokens, memory_budget_bytes=args.memory_budget,
                                stall_timeout_s=args.stall_timeout, overlap=not args.no_overlap,
                                max_buffered_bytes=args.max_buffered_bytes,
                                max_queued_tokens_per_client=args.max_queued_tokens_per_client)
    config = ServerConfig(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                          max_request_bytes=args.max_request_bytes,
                          engine=EngineConfig(chunk_size=args.logprob_chunk_size, batching=Batching(args.batching),
                                              max_pack_tokens=args.max_batch_tokens,
                                              min_shared_prefix=args.min_shared_prefix), scheduler=scheduler,
                          security=SecurityConfig(args.tls_cert, args.tls_key, args.tls_client_ca,
                                                  args.auth_token_file), metrics_port=args.metrics_port,
                          metrics_host=args.metrics_host,
                          grace_s=args.grace_s, keepalive_s=args.keepalive_s,
                          limits=StreamLimits(args.max_sequences_per_request, args.max_request_tokens,
                                              args.max_streams, args.max_in_flight_per_stream, args.max_text_bytes,
                                              args.max_response_bytes),
                          clients=ClientLimits(args.max_streams_per_client, args.max_in_flight_per_client,
                                               args.stream_idle_s))
    if under_torchrun():
        code = serve_rank(model, config, parallel)
        # The rank is done and its process groups destroyed; the interpreter's own teardown can still
        # meet a joinable gloo thread and abort ("terminate called without an active exception",
        # seen once in 2x2 at SIGTERM), so leave now with the rank's real exit code.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    import dataclasses

    try:
        code = asyncio.run(serve(dataclasses.replace(model, device=args.device), config))
    except PortInUse as e:
        print(f"logitserve: {e}", file=sys.stderr)
        return 1
    # As under torchrun: a compute thread still inside torch at interpreter teardown aborts the process
    # ("terminate called without an active exception"); the server is done, so leave with its exit code.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_info(args) -> int:
    with _connect(args) as c:
        info = c.model_info(timeout=30)
    for key, value in info.__dict__.items():
        print(f"{key:>20}: {value}")
    return 0


def _cmd_query(args) -> int:
    seq = args.text if args.text is not None else [int(x) for x in args.ids.split(",") if x.strip()]
    with _connect(args) as c:
        r = c.forward([seq], temperature=args.temperature, logprobs=True, topk=args.topk, topk_as_logprobs=True)
    ids = r.input_ids[0].tolist() if args.text is not None else seq
    lp, vals, top = r.logprobs[0], r.topk_values[0], r.topk_ids[0]
    print(f"model {r.model.name} ({r.model.content_hash}), temperature {r.applied.temperature}")
    print(f"{'pos':>4} {'token':>8} {'logprob':>10}   top-{args.topk} next tokens (id:logprob)")
    for t, tok in enumerate(ids):
        cells = "  ".join(f"{int(i)}:{v:.3f}" for i, v in zip(top[t], vals[t]))
        print(f"{t:>4} {tok:>8} {lp[t]:>10.4f}   {cells}")
    return 0


def _cmd_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.address) as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout).status
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.address}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def _cmd_capture(args) -> int:
    import time
    from pathlib import Path

    from logitserve.client.capture import CaptureConfig, capture, verify

    cfg = CaptureConfig(topk=args.topk, logprobs=args.logprobs, dtype=args.dtype, temperature=args.temperature,
                        shard_samples=args.shard_samples, batch_samples=args.batch_samples, in_flight=args.in_flight)
    t0 = time.perf_counter()
    with _connect(args) as c:
        manifest = capture(c, args.input, args.out, cfg, progress=not args.no_progress)
        took = time.perf_counter() - t0
        shards = sorted(Path(args.out).glob("shard-*.safetensors"))
        print(f"captured {manifest['input']['samples']} samples into {len(shards)} shards in {took:.1f} s "
              f"({sum(f.stat().st_size for f in shards) / 2**20:.1f} MiB) under {args.out}")
        if args.verify:
            print(f"verified {args.verify} samples against the live teacher: max |diff| "
                  f"{verify(c, args.out, args.verify):.3g}")
    return 0


def _cmd_export(args) -> int:
    from logitserve.demo import export_demo

    print(export_demo(args.directory, args.kind, args.shape))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="logitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _client_parsers(sub)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    from .logs import configure

    configure(getattr(args, "log_format", "text"))
    commands = {"serve": lambda a: _cmd_serve(a, argv), "info": _cmd_info, "query": _cmd_query,
                "capture": _cmd_capture, "health": _cmd_health,
                "export-demo": _cmd_export}
    try:
        return commands[args.command](args)
    except Exception as e:  # the client's LogitServeError included: one line, not a traceback
        if type(e).__name__ == "LogitServeError":
            print(f"logitserve: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
