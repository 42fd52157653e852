"""`logitserve serve`'s flags, grouped by task (model, parallel layout, batching and memory, network and HTTP,
security, limits, observability), each with its help, its unit in the metavar and one default.

Value types raise argparse.ArgumentTypeError with a sentence naming what is accepted, so a bad value is one
`logitserve: --flag VALUE: ...` line (cli._Parser.error). docs/reference/cli.md is generated from this parser.
"""
from __future__ import annotations

import argparse

# The groups in the order `serve --help` prints them; tests/test_cli_errors.py checks each fits one screen.
GROUPS = ("model", "parallel layout", "batching and memory", "network and HTTP", "security", "limits",
          "observability")
DEMO_KINDS = ("causal", "reward", "prm")
DEMO_SHAPES = ("demo", "body", "1b", "wide", "tiny")
_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12, "b": 1}


def size(text: str) -> int:
    """'2GiB', '512MiB', '1e9', '4096' -> bytes."""
    t = text.strip().lower()
    unit = next((u for u in _UNITS if t.endswith(u)), "")
    try:
        value = float(t[: len(t) - len(unit)]) * _UNITS.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: bytes, or a number with a unit (KiB, MiB, GiB, "
                                         f"TiB, kB, MB, GB, TB), e.g. 2GiB or 1e9") from None
    if not 0 <= value < 1 << 62:
        raise argparse.ArgumentTypeError(f"{text!r}: a size is at least 0 bytes")
    return int(value)


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: a whole number from 1 to 65535 (0: any free one)")
    return value


def _number(kind, what: str, lo: float):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value >= lo:          # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r}: {what} of at least {lo:g} is needed")
        return value
    parse.__name__ = what
    return parse


count = _number(int, "a whole number", 0)
positive = _number(int, "a whole number", 1)
seconds = _number(float, "a number of seconds", 0)
millis = _number(float, "a number of milliseconds", 0)


def _model(g) -> None:
    g.add_argument("--model", metavar="DIR", default=None,
                   help="a local Hugging Face model directory (config.json + *.safetensors); without it, --demo")
    g.add_argument("--demo", choices=DEMO_KINDS, default=None,
                   help="the embedded demo model when no --model: a causal LM (the default), an outcome reward model "
                        "(a sequence classifier) or a process reward model (a token classifier)")
    g.add_argument("--demo-shape", choices=DEMO_SHAPES, default=None,
                   help="the demo's size: demo (the default), body (8 layers), 1b (GPUs), wide (vocab 151936), tiny")
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights and activations")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the model runs; auto: a CUDA GPU when torch sees one, else the CPU")
    g.add_argument("--fp8-compute", choices=["auto", "dequantize", "fp8"], default="auto",
                   help="FP8 checkpoints: auto runs FP8 GEMMs on a GPU that has them and dequantizes elsewhere")
    g.add_argument("--step-separator", default=None, metavar="TOKEN",
                   help="process reward models: the token (e.g. '<extra_0>') or id that ends a step")
    g.add_argument("--max-seq-len", type=positive, default=None, metavar="TOKENS",
                   help="longest sequence (default: the model's max_position_embeddings)")


def _parallel(g) -> None:
    g.add_argument("--tp", type=positive, default=1, metavar="N", help="tensor-parallel ranks (vocab-parallel logits)")
    g.add_argument("--cp", type=positive, default=1, metavar="N", help="context-parallel ranks (long sequences)")
    g.add_argument("--pp", type=positive, default=1, metavar="N",
                   help="pipeline stages (--tp inside a node, --pp across nodes)")
    g.add_argument("--pp-balance", choices=["compute", "memory"], default="compute",
                   help="--pp: stages balanced by the parameters computing per token, or by all (memory)")
    g.add_argument("--pp-microbatch-tokens", type=positive, default=512, metavar="TOKENS",
                   help="--pp: tokens per micro-batch at most")
    g.add_argument("--collective-timeout", type=seconds, default=60.0, metavar="S",
                   help="a collective waiting longer fails the server loudly (a lost rank)")
    g.add_argument("--threads", type=positive, default=None, metavar="N",
                   help="torch intra-op threads per rank (default: $OMP_NUM_THREADS, else torch's)")


def _batching(g) -> None:
    g.add_argument("--max-batch-tokens", type=positive, default=16384, metavar="TOKENS",
                   help="tokens per batch across all streams; a shared prefix counts once")
    g.add_argument("--batching", choices=["packed", "exact"], default="packed",
                   help="packed: one packed body per batch (fp32 within 1e-5); exact: bitwise batch invariant")
    g.add_argument("--min-shared-prefix", type=count, default=64, metavar="TOKENS",
                   help="packed: sequences sharing this many leading tokens compute them once; 0: off")
    g.add_argument("--batch-delay-ms", type=millis, default=2.0, metavar="MS",
                   help="wait after a batch's first request for others")
    g.add_argument("--share-wait-ms", type=millis, default=5.0, metavar="MS",
                   help="packed: keep a batch open this long for more of a group sharing a prefix; 0: never")
    g.add_argument("--interject-after-ms", type=millis, default=20.0, metavar="MS",
                   help="a batch running longer lets queued small requests run between its steps; 0: never")
    g.add_argument("--interject-tokens", type=positive, default=1024, metavar="TOKENS",
                   help="small, for --interject-after-ms: at most this many work tokens")
    g.add_argument("--logprob-chunk-size", type=positive, default=512, metavar="ROWS",
                   help="logits rows materialized at a time")
    g.add_argument("--step-target-ms", type=millis, default=0.0, metavar="MS",
                   help="fewer rows per head step when a full one takes longer; 0: the chunk size")
    g.add_argument("--short-step-ms", type=millis, default=10.0, metavar="MS",
                   help="that target while small requests keep arriving beside a large one; 0: never shorter")
    g.add_argument("--max-queued-tokens", type=positive, default=1 << 20, metavar="TOKENS",
                   help="tokens waiting or running; past it RESOURCE_EXHAUSTED")
    g.add_argument("--memory-budget", type=size, default=None, metavar="SIZE",
                   help="refuse requests whose estimated peak is over this, e.g. 4GiB (default: no limit)")
    g.add_argument("--max-buffered-bytes", type=size, default=256 << 20, metavar="SIZE",
                   help="per request: outputs its reader has not taken yet (default: 256MiB)")
    g.add_argument("--stall-timeout", type=seconds, default=30.0, metavar="S",
                   help="longest the compute waits on one slow reader (below --collective-timeout)")
    g.add_argument("--no-overlap", action="store_true", help="send each piece before computing the next (measuring)")
    g.add_argument("--no-malloc-tuning", action="store_true",
                   help="keep glibc's malloc defaults (one arena, no trimming otherwise)")


def _network(g) -> None:
    g.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                   help="address to listen on; 0.0.0.0 for every interface, as in a container")
    g.add_argument("--port", type=port, default=50051, metavar="PORT",
                   help="gRPC port (native, KServe v2, health); 0: a free one")
    g.add_argument("--http-port", type=port, default=None, metavar="PORT",
                   help="also serve vLLM's, SGLang's and TRL's HTTP routes here (default: no HTTP)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's names on HTTP (default: the model's own)")
    g.add_argument("--max-message-bytes", type=size, default=4 << 20, metavar="SIZE",
                   help="every gRPC response message stays under this (default: 4MiB)")
    g.add_argument("--keepalive-s", type=seconds, default=60.0, metavar="S",
                   help="ping idle gRPC connections this often; peers silent 20 s are dropped")
    g.add_argument("--grace-s", type=seconds, default=5.0, metavar="S",
                   help="on SIGTERM: in-flight requests get this long, new ones UNAVAILABLE")
    g.add_argument("--http-max-connections", type=positive, default=1024, metavar="N",
                   help="open HTTP connections, server-wide (one over: 503)")
    g.add_argument("--http-max-connections-per-client", type=positive, default=None, metavar="N",
                   help="open HTTP connections of one peer (default: half of --http-max-connections)")
    g.add_argument("--http-header-timeout-s", type=seconds, default=10.0, metavar="S",
                   help="a request line and headers must arrive within this")
    g.add_argument("--http-body-timeout-s", type=seconds, default=30.0, metavar="S",
                   help="a body must arrive within this of its headers")
    g.add_argument("--http-keepalive-s", type=seconds, default=5.0, metavar="S",
                   help="an idle kept-alive HTTP connection is closed after this")
    g.add_argument("--http-max-requests-per-connection", type=positive, default=1000, metavar="N",
                   help="then 'connection: close'")
    g.add_argument("--http-send-timeout-s", type=seconds, default=30.0, metavar="S",
                   help="a client taking none of its answer this long loses it")


def _security(g) -> None:
    g.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve over TLS (with --tls-key)")
    g.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", metavar="FILE",
                   help="PEM CA bundle: mTLS, clients need a certificate it signed")
    g.add_argument("--auth-token-file", metavar="FILE",
                   help="bearer tokens, one per line: every RPC and HTTP route but health needs one")


def _limits(g) -> None:
    g.add_argument("--max-sequences-per-request", type=positive, default=4096, metavar="N",
                   help="sequences in one request")
    g.add_argument("--max-request-tokens", type=positive, default=1 << 20, metavar="TOKENS",
                   help="tokens in one request")
    g.add_argument("--max-text-bytes", type=size, default=1 << 20, metavar="SIZE",
                   help="UTF-8 bytes of one request's texts (default: 1MiB)")
    g.add_argument("--max-request-bytes", type=size, default=64 << 20, metavar="SIZE",
                   help="largest request message received (default: 64MiB)")
    g.add_argument("--max-response-bytes", type=size, default=1 << 30, metavar="SIZE",
                   help="bytes of one request's outputs, checked before it runs (default: 1GiB)")
    g.add_argument("--max-streams", type=positive, default=256, metavar="N",
                   help="Forward streams open at once, server-wide")
    g.add_argument("--max-streams-per-client", type=positive, default=None, metavar="N",
                   help="streams of one client, by token or peer (default: half of --max-streams)")
    g.add_argument("--max-in-flight", type=positive, default=2048, metavar="N",
                   help="requests in flight server-wide, every front-end together")
    g.add_argument("--max-in-flight-per-client", type=positive, default=None, metavar="N",
                   help="requests in flight of one client (default: half of --max-in-flight)")
    g.add_argument("--max-in-flight-per-stream", type=positive, default=256, metavar="N",
                   help="requests in flight on one stream")
    g.add_argument("--max-queued-tokens-per-client", type=positive, default=None, metavar="TOKENS",
                   help="one client's share of --max-queued-tokens (default: half)")
    g.add_argument("--stream-idle-s", type=seconds, default=300.0, metavar="S",
                   help="close a Forward stream with nothing in flight this long")
    g.add_argument("--max-head-downloads", type=positive, default=2, metavar="N",
                   help="Head downloads (the whole lm_head each) at once")
    g.add_argument("--max-head-downloads-per-client", type=positive, default=None, metavar="N",
                   help="one client's share of them (default: half, at least 1)")
    g.add_argument("--head-stall-s", type=seconds, default=10.0, metavar="S",
                   help="a Head download whose reader takes nothing this long is cut")


def _observability(g) -> None:
    g.add_argument("--metrics-port", type=port, default=None, metavar="PORT",
                   help="Prometheus /metrics over HTTP on this port (default: none)")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDRESS",
                   help="address of /metrics (it has no auth: loopback by default)")
    g.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="json: one object per line, with request_id, status, tokens and seconds")
    g.add_argument("--debug", action="store_true", help="tracebacks for start-up errors (one line each without)")


def add_serve_parser(sub, formatter) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model (the embedded demo when --model is not given)",
                       formatter_class=formatter, usage="%(prog)s [FLAGS]", description="Serve a model over gRPC (and HTTP with --http-port). "
                       "Every flag: docs/reference/cli.md.")
    for title, add in zip(GROUPS, (_model, _parallel, _batching, _network, _security, _limits, _observability)):
        add(p.add_argument_group(title))
    return p
