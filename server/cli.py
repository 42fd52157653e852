"""The `logitserve` command: serve and export-demo here; info, query, health, capture in logitserve.client.cli."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
from typing import NoReturn, Optional


class _Parser(argparse.ArgumentParser):
    """An argument error is one line, `logitserve: --flag: what is wrong; see logitserve COMMAND --help`, exit 2."""

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        self.exit(2, f"logitserve: {message}; see `{self.prog} --help`\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Help with one default per flag: `(default: X)` appended unless the help already says its default (or there is
    none to say); wide enough that most flags keep their help on their own line."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=36)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.nargs == 0
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def _serve_parser(sub, formatter) -> None:
    from .serve_flags import add_serve_parser

    add_serve_parser(sub, formatter)


def _export_parser(sub, formatter) -> None:
    from .serve_flags import DEMO_KINDS, DEMO_SHAPES

    e = sub.add_parser("export-demo", help="write the embedded demo model as a Hugging Face directory",
                       formatter_class=formatter)
    e.add_argument("directory", metavar="DIR", help="where to write it (created if missing); serve it with --model DIR")
    e.add_argument("--kind", choices=DEMO_KINDS, default="causal",
                   help="a causal LM, an outcome reward model or a process reward model (as serve --demo)")
    e.add_argument("--shape", choices=DEMO_SHAPES, default="demo", help="its size (as serve --demo-shape)")


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
            lines.append(f"logitserve: serve: {package} does not load with the installed protobuf {protobuf} "
                         f"({str(e).splitlines()[0][:160]}); another install moved protobuf under it (tritonclient "
                         f"pins protobuf < 7). Pin it: pip install {pin}")
    return lines


def _cmd_serve(args, argv: list[str]) -> int:
    code = _check_extras()
    if code is not None:
        return code
    from logitserve.parallel import ParallelConfig

    from .app import serve, serve_rank
    from .gate import PortInUse
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
        print(f"logitserve: serve needs the server extras, missing here: {', '.join(missing)}; install them with: "
              f"{INSTALL_SERVER}", file=sys.stderr)
        return 2
    broken = _broken_extras()
    if broken:
        print("\n".join(broken), file=sys.stderr)
        return 2
    return None


def _check_before_start(args, world_size: int) -> Optional[int]:
    """The checks before any rank starts or the model loads (flags among themselves, the files they name, versions,
    the model directory and its layout, the device, timeouts, addresses and free ports): an exit code, said in one
    line, or None when serving may start (serve_checks says what each checks)."""
    from logitserve.preflight import StartupError, check_layout, check_model_dir, check_quantization, check_versions

    from .gate import PortInUse
    from .launch import under_torchrun
    from .serve_checks import check_addresses, check_device, check_files, check_flags

    try:
        check_flags(args)          # every rank: it fills in --demo's and --demo-shape's defaults
        check_files(args)
        if not under_torchrun():       # once, before any rank starts (under torchrun: every rank checks alike)
            check_versions()
            check_model_dir(args.model)
            check_quantization(args.model)
            check_layout(args.model, args.demo, args.demo_shape, args.tp, args.cp, args.pp)
        check_device(args.device)
        if world_size > 1 and not args.stall_timeout < args.collective_timeout:
            raise StartupError(f"--stall-timeout {args.stall_timeout:g} must be below --collective-timeout "
                               f"{args.collective_timeout:g}: the other ranks wait in a collective while rank 0 "
                               f"waits on a slow reader")
        if not under_torchrun():
            check_addresses(args)      # one line now, before ranks start or gRPC logs its own
    except PortInUse as e:
        print(f"logitserve: {e}", file=sys.stderr)
        return 1
    except StartupError as e:
        print(f"logitserve: {e}", file=sys.stderr)
        return 2
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
        print(f"logitserve: export-demo builds the model with torch and transformers, missing here: "
              f"{', '.join(missing)}; install them with: {INSTALL_SERVER}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    from logitserve.demo import export_demo

    hf_logging.disable_progress_bar()
    print(export_demo(args.directory, args.kind, args.shape))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (docs/gen_reference.py writes docs/reference/cli.md from it)."""
    from logitserve import __version__
    from logitserve.client import cli as client_cli

    formatter = _HelpFormatter
    parser = _Parser(prog="logitserve", formatter_class=formatter,
                     description="A teacher's or reward model's per-token outputs over gRPC.")
    parser.add_argument("--version", action="version", version=f"logitserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands (logitserve COMMAND --help for each)")
    _serve_parser(sub, formatter)
    client_cli.add_parsers(sub, formatter)
    _export_parser(sub, formatter)
    return parser


# 128 + the signal, as the shell reports a command that SIGINT or SIGPIPE stopped
INTERRUPTED, BROKEN_PIPE = 130, 141


def main(argv=None) -> int:
    """Every error one `logitserve: ...` line on stderr (a bug keeps its traceback; --debug keeps them all); Ctrl-C is
    `logitserve: interrupted` and 130; output into a pipe closed early (`| head`) ends quietly with 141."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parser.parse_known_args(argv)
    if extra:                  # said by the command's own parser, which names its --help
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = _run(args, argv)
        sys.stdout.flush()        # here, not at exit: a closed pipe is then caught below
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())    # the interpreter's last flush stays quiet
        return BROKEN_PIPE
    except KeyboardInterrupt:
        print("logitserve: interrupted", file=sys.stderr)
        return INTERRUPTED


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _run(args, argv: list[str]) -> int:
    from logitserve.client import cli as client_cli

    from .logs import configure

    configure(getattr(args, "log_format", "text"))
    commands = {"serve": lambda a: _cmd_serve(a, argv), **client_cli.COMMANDS, "export-demo": _cmd_export}
    try:
        return commands[args.command](args)
    except Exception as e:  # noqa: BLE001 (the client's errors, bad options, start-up failures: one line)
        if getattr(args, "debug", False) or not _explainable(e) or isinstance(e, BrokenPipeError):
            raise
        text = f"{e}" if type(e).__name__ in ("LogitServeError", "ValueError", "StartupError", "PortInUse") else \
            f"{type(e).__name__}: {e}"
        print("logitserve: " + " ".join(text.split()), file=sys.stderr)
        return 1


def _explainable(e: Exception) -> bool:
    """Errors whose message says it all: the client's, bad options, files and ports (a bug keeps its traceback)."""
    return type(e).__name__ in ("LogitServeError", "StartupError", "PortInUse") or isinstance(e, (ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
