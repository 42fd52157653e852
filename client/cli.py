"""The client commands of `logitserve` (info, query, health, capture): grpcio and numpy only, no torch."""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Optional

DEFAULT_PORT = 50051
# Each connection option also comes from the environment, so a shell or a pod spec sets it once.
ENV = {"token": "LOGITSERVE_TOKEN", "token_file": "LOGITSERVE_TOKEN_FILE", "tls_ca": "LOGITSERVE_TLS_CA",
       "tls_cert": "LOGITSERVE_TLS_CERT", "tls_key": "LOGITSERVE_TLS_KEY"}
HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def with_port(address: str) -> str:
    """`host` -> `host:50051`, `[::1]` -> `[::1]:50051`; addresses with a port or a gRPC scheme stay as given."""
    if re.match(r"^[a-z][a-z0-9+.-]*:(//|[^0-9])", address):      # dns:///x, ipv4:..., unix:...
        return address
    if address.startswith("["):
        return address if re.search(r"\]:\d+$", address) else f"{address}:{DEFAULT_PORT}"
    if address.count(":") == 1 and address.rsplit(":", 1)[1].isdigit():
        return address
    return f"{address}:{DEFAULT_PORT}" if ":" not in address else address


def add_connection_args(p: argparse.ArgumentParser, wait: bool = True) -> None:
    g = p.add_argument_group("connection (each also from the environment variable named)")
    g.add_argument("--token", default=os.environ.get(ENV["token"]),
                   help=f"bearer token for a server started with --auth-token-file (${ENV['token']})")
    g.add_argument("--token-file", default=os.environ.get(ENV["token_file"]),
                   help=f"a file holding the bearer token (${ENV['token_file']})")
    g.add_argument("--tls-ca", default=os.environ.get(ENV["tls_ca"]),
                   help=f"PEM CA bundle that signed the server's certificate: connect over TLS (${ENV['tls_ca']})")
    g.add_argument("--tls-cert", default=os.environ.get(ENV["tls_cert"]),
                   help=f"PEM client certificate, for an mTLS server (${ENV['tls_cert']})")
    g.add_argument("--tls-key", default=os.environ.get(ENV["tls_key"]),
                   help=f"PEM private key of --tls-cert (${ENV['tls_key']})")
    if wait:
        g.add_argument("--wait", type=float, default=600.0, metavar="S",
                       help="wait up to S seconds for a server that answers but is still loading its model (0: "
                            "fail at once); where nothing listens, the command fails at once")


def connection_options(args) -> dict:
    """TeacherClient keyword arguments from the connection options; ValueError naming a bad one."""
    token = args.token
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            raise ValueError(f"--token-file {args.token_file}: {getattr(e, 'strerror', None) or 'empty'}") from None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    for flag in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(args, flag)
        if path and not Path(path).is_file():
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file")
    opts = {"token": token or None}
    if args.tls_ca or args.tls_cert:
        opts.update(tls=True, root_certificates=args.tls_ca, certificate_chain=args.tls_cert,
                    private_key=args.tls_key)
    return opts


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """(host, port) of a `host:port` or `[v6]:port` address; None for gRPC target forms (dns:///, ipv4:, unix:)."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]/]+):(\d+)", address)
    if not m:
        return None
    return (m.group(1), int(m.group(2))) if m.group(1) else (m.group(3), int(m.group(4)))


def check_listening(address: str, timeout_s: float = 5.0) -> None:
    """ValueError at once when nothing listens at a host:port address (a refused connection is no server starting:
    the server opens its port before it loads anything)."""
    import socket

    hp = _host_port(address)
    if hp is None:
        return
    host, port = hp
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        raise ValueError(f"nothing listens on {host}:{port}; start the server (logitserve serve --port {port}) or "
                         f"give the address of one") from None
    except socket.gaierror:
        raise ValueError(f"{host}: not an address or a host name that resolves here") from None
    except TimeoutError:
        raise ValueError(f"{host}:{port} accepted no connection within {timeout_s:g} s (a firewall, or no such "
                         f"host on the network?)") from None
    except OSError as e:
        raise ValueError(f"cannot reach {host}:{port} ({(e.strerror or str(e)).lower()})") from None


def _channel(address: str, opts: dict):
    """A blocking channel to `address` with the connection options' TLS (plaintext without)."""
    import grpc

    if not opts.get("tls"):
        return grpc.insecure_channel(address)
    from .aio import _pem

    creds = grpc.ssl_channel_credentials(_pem(opts["root_certificates"]), _pem(opts["private_key"]),
                                         _pem(opts["certificate_chain"]))
    return grpc.secure_channel(address, creds)


def health_status(address: str, opts: dict, timeout_s: float) -> str:
    """The server's grpc.health.v1 status (SERVING, NOT_SERVING while loading or draining, ...); ValueError saying
    why when the address answers no gRPC health check (an HTTP port, TLS expected, another program)."""
    import grpc

    with _channel(address, opts) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                    response_deserializer=None)
        try:
            return HEALTH_STATUS.get(_varint_field_1(check(b"", timeout=timeout_s)), "UNKNOWN")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ValueError(f"{address} answers gRPC but has no health service: not a logitserve server?") from None
            tls = "" if opts.get("tls") else ", or a TLS server (give --tls-ca)"
            raise ValueError(f"{address} does not answer gRPC ({e.code().name}: {' '.join((e.details() or '').split())[:200]}"
                             f"); is it the server's --port (50051 by default), not its --http-port{tls}?") from None


def connect(args):
    """A TeacherClient to args.address once its server is ready: at once an error where nothing listens or the
    address speaks no gRPC; a wait (said on stderr, at most --wait seconds) only while the server answers that it
    is loading."""
    import time

    from . import TeacherClient

    address, opts = with_port(args.address), connection_options(args)
    check_listening(address)
    status = health_status(address, opts, 10.0)
    if status != "SERVING":
        if args.wait <= 0:
            raise ValueError(f"{args.address} is not serving yet (health {status}: loading its model, or "
                             f"stopping); --wait S waits for it")
        print(f"logitserve: {args.address} is not serving yet (health {status}: loading its model); waiting up to "
              f"{args.wait:g} s (--wait)", file=sys.stderr, flush=True)
        deadline = time.monotonic() + args.wait
        while status != "SERVING":
            if time.monotonic() > deadline:
                raise ValueError(f"{args.address} was not serving within {args.wait:g} s (--wait); health {status}")
            time.sleep(0.5)
            check_listening(address)          # a server that died while loading: said at once
            status = health_status(address, opts, 10.0)
    client = TeacherClient(address, **opts)
    try:
        client.wait_ready(30.0)
    except BaseException:
        client.close()
        raise
    return client


def add_parsers(sub, formatter) -> None:
    p = sub.add_parser("info", help="print a server's model info", formatter_class=formatter)
    p.add_argument("address", help=f"host[:port] of the server (port {DEFAULT_PORT} when omitted)")
    add_connection_args(p)
    q = sub.add_parser("query", help="print token logprobs and top-k for some token ids or a text",
                       formatter_class=formatter)
    q.add_argument("address", help=f"host[:port] of the server (port {DEFAULT_PORT} when omitted)")
    given = q.add_mutually_exclusive_group(required=True)
    given.add_argument("--ids", help="token ids separated by commas or spaces, e.g. 1,5,9 or '1 5 9'")
    given.add_argument("--text", help="a text for the server to tokenize with the model's tokenizer")
    q.add_argument("--topk", type=int, default=5, help="top-k next tokens shown per position")
    q.add_argument("--temperature", type=float, default=1.0, help="T in [1e-6, 1e6]: logprobs of z/T")
    add_connection_args(q)
    h = sub.add_parser("health", help="exit 0 when a server's grpc.health.v1 says SERVING (Docker HEALTHCHECK)",
                       formatter_class=formatter)
    h.add_argument("address", nargs="?", default=f"127.0.0.1:{DEFAULT_PORT}", help="host[:port] of the server")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    add_connection_args(h, wait=False)
    c = sub.add_parser("capture", help="capture a teacher's top-k for a jsonl dataset into shards (safetensors, or "
                                       "parquet for Axolotl, DistillKit or Hugging Face datasets)",
                       formatter_class=formatter)
    c.add_argument("address", help=f"host[:port] of the server (port {DEFAULT_PORT} when omitted)")
    c.add_argument("--input", required=True, help='jsonl: {"ids": [...]} or {"text": "..."} per line')
    c.add_argument("--out", required=True, help="directory of shards + manifest.json; a rerun resumes")
    c.add_argument("--topk", type=int, default=64, help="top-k size stored per position")
    c.add_argument("--logprobs", action="store_true", help="also the token logprobs")
    c.add_argument("--format", choices=["safetensors", "axolotl", "distillkit", "hf"], default="safetensors",
                   help="shards on disk: safetensors, or parquet as Axolotl KD v2 rows, DistillKit's compressed rows "
                        "or a Hugging Face dataset (docs/capture.md)")
    c.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="top-k values on disk (safetensors, distillkit)")
    c.add_argument("--temperature", type=float, default=1.0, help="T in [1e-6, 1e6]: outputs of z/T")
    c.add_argument("--shard-samples", type=int, default=256, help="samples per shard file")
    c.add_argument("--batch-samples", type=int, default=16, help="samples per request")
    c.add_argument("--in-flight", type=int, default=4, help="requests on the stream at once")
    c.add_argument("--verify", type=int, default=0, metavar="N", help="then re-check N random samples live")
    c.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    add_connection_args(c)


def parse_ids(text: str) -> list[int]:
    parts = [x for x in re.split(r"[,\s]+", text.strip()) if x]
    bad = next((x for x in parts if not re.fullmatch(r"\d+", x)), None)
    if bad is not None or not parts:
        raise ValueError(f"--ids: {bad!r} is not a token id (non-negative integers, separated by commas or "
                         f"spaces)" if bad is not None else "--ids: no token id given")
    return [int(x) for x in parts]


def cmd_info(args) -> int:
    with connect(args) as c:
        info = c.model_info(timeout=30)
    fields = {k: v for k, v in info.__dict__.items() if k != "ranks"}
    width = max(len(k) for k in fields)
    for key, value in fields.items():
        print(f"{key:>{width}}: {value if value not in ('', None) else '-'}")
    ranks = [dict(r) if not isinstance(r, dict) else r for r in info.ranks]
    if ranks:
        cols = list(ranks[0])
        print("\nranks:")
        print("  " + "  ".join(f"{c:>10}" for c in cols))
        for r in ranks:
            print("  " + "  ".join(f"{str(r.get(c, '')):>10}" for c in cols))
    return 0


def cmd_query(args) -> int:
    """Token, its text (where the server has a tokenizer), logprob and top-k; a warning when --text hit <unk>."""
    from . import LogitServeError

    seq = args.text if args.text is not None else parse_ids(args.ids)
    with connect(args) as c:
        r = c.forward([seq], temperature=args.temperature, logprobs=True, topk=args.topk, topk_as_logprobs=True)
        ids = r.input_ids[0].tolist() if args.text is not None else seq
        try:
            d = c.detokenize(ids)
            words, unk = d.texts, d.unk_token_id
        except LogitServeError as e:       # no tokenizer (FAILED_PRECONDITION): ids only
            if e.code.name != "FAILED_PRECONDITION":
                raise
            words, unk = (), None
    if args.text is not None and unk is not None and unk in ids:
        n = ids.count(unk)
        print(f"logitserve: warning: {n} of the text's {len(ids)} tokens are the unknown token (id {unk}): the "
              f"model's tokenizer does not know those words", file=sys.stderr)
    lp, vals, top = r.logprobs[0], r.topk_values[0], r.topk_ids[0]
    print(f"model {r.model.name} ({r.model.content_hash}), temperature {r.applied.temperature}")
    text_col = f" {'text':>12}" if words else ""
    print(f"{'pos':>4} {'token':>8}{text_col} {'logprob':>10}   top-{args.topk} next tokens (id:logprob)")
    for t, tok in enumerate(ids):
        cells = "  ".join(f"{int(i)}:{v:.3f}" for i, v in zip(top[t], vals[t]))
        word = f" {_shown(words[t]):>12}" if words else ""
        print(f"{t:>4} {tok:>8}{word} {lp[t]:>10.4f}   {cells}")
    return 0


def _shown(text: str) -> str:
    """A token's text in one table cell: quoted, control characters escaped, at most 12 characters."""
    cell = repr(text)
    return cell if len(cell) <= 12 else cell[:11] + "…"


def _varint_field_1(data: bytes) -> int:
    """Field 1 (a varint) of a protobuf message: HealthCheckResponse.status, without grpc_health installed."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        if key == (1 << 3):
            return _varint(data, i)[0]
        if key & 7 == 0:
            i = _varint(data, i)[1]
        elif key & 7 == 2:
            n, i = _varint(data, i)
            i += n
        else:
            break
    return 0


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def cmd_health(args) -> int:
    """grpc.health.v1 Check with an empty request; the response decoded by hand (no grpcio-health-checking)."""
    import grpc

    with _channel(with_port(args.address), connection_options(args)) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                    response_deserializer=None)
        try:
            status = _varint_field_1(check(b"", timeout=args.timeout))
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}", file=sys.stderr)
            return 1
    print(f"{args.address}: {HEALTH_STATUS.get(status, status)}")
    return 0 if status == 1 else 1


def cmd_capture(args) -> int:
    import time

    import importlib.util

    from .capture import CaptureConfig, capture, verify, verify_checksums

    needs = ("safetensors", "tqdm") if args.format == "safetensors" else ("pyarrow", "tqdm")
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        print(f"logitserve capture needs the capture extra ({', '.join(missing)} missing here): "
              f"pip install 'logitserve[capture]'", file=sys.stderr)
        return 2
    if not Path(args.input).is_file():
        raise ValueError(f"--input {args.input}: no such file; give a jsonl file, one {{\"ids\": [...]}} or "
                         f"{{\"text\": \"...\"}} per line")
    cfg = CaptureConfig(topk=args.topk, logprobs=args.logprobs, dtype=args.dtype, temperature=args.temperature,
                        shard_samples=args.shard_samples, batch_samples=args.batch_samples, in_flight=args.in_flight,
                        format=args.format)
    t0 = time.perf_counter()
    with connect(args) as c:
        manifest = capture(c, args.input, args.out, cfg, progress=not args.no_progress)
        took = time.perf_counter() - t0
        shards = sorted(Path(args.out).glob("shard-*.safetensors" if args.format == "safetensors" else
                                            "shard-*.parquet"))
        run = manifest["run"]
        skipped = f", skipped {run['skipped']} captured by an earlier run" if run["skipped"] else ""
        print(f"captured {run['captured']} samples{skipped}; {manifest['input']['samples']} samples into "
              f"{len(shards)} shards in {took:.1f} s ({sum(f.stat().st_size for f in shards) / 2**20:.1f} MiB) "
              f"under {args.out}")
        if args.verify:
            print(f"verified the checksums of {verify_checksums(args.out)} shards")
            if args.format == "safetensors":
                print(f"verified {args.verify} samples against the live teacher: max |diff| "
                      f"{verify(c, args.out, args.verify):.3g}")
    return 0


COMMANDS = {"info": cmd_info, "query": cmd_query, "health": cmd_health, "capture": cmd_capture}
