"""The serve flags checked against each other and against this machine before anything loads or any rank starts:
each problem is one StartupError (or PortInUse) sentence naming the flag and what to do instead.

cli._check_before_start runs them in this order: the flags among themselves (check_flags), the files they name
(check_files), the device (check_device), then the addresses and ports (check_addresses). No model is read here.
"""
from __future__ import annotations

import errno
import socket
import ssl
from pathlib import Path
from typing import Optional

from logitserve.preflight import StartupError

from .gate import PortInUse

DEFAULT_DEMO, DEFAULT_SHAPE = "causal", "demo"


def check_flags(args) -> None:
    """Flags that contradict each other; then --demo and --demo-shape get their defaults (they are None when not
    given, so a --demo beside a --model is seen)."""
    if args.model is not None:
        for flag, value in (("--demo", args.demo), ("--demo-shape", args.demo_shape)):
            if value is not None:
                raise StartupError(f"{flag} {value} and --model {args.model}: {flag} picks the embedded demo, served "
                                   f"only when no --model is given; drop one of the two")
    elif args.step_separator is not None and (args.demo or DEFAULT_DEMO) != "prm":
        raise StartupError(f"--step-separator {args.step_separator!r}: the demo {args.demo or DEFAULT_DEMO} is not a "
                           f"process reward model; add --demo prm, or give a *ForTokenClassification --model")
    args.demo, args.demo_shape = args.demo or DEFAULT_DEMO, args.demo_shape or DEFAULT_SHAPE
    if args.tls_key and not args.tls_cert:
        raise StartupError("--tls-key needs --tls-cert (the certificate chain of that key)")
    if args.tls_cert and not args.tls_key:
        raise StartupError("--tls-cert needs --tls-key (the certificate's private key)")
    if args.tls_client_ca and not args.tls_cert:
        raise StartupError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key: client certificates are checked "
                           "over TLS only")
    ports = {}
    for flag in ("--port", "--http-port", "--metrics-port"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value and value in ports:
            raise StartupError(f"{flag} {value} is {ports[value]} too: gRPC, HTTP and /metrics need a port each; "
                               f"choose another {flag}")
        ports.setdefault(value, flag)


def _readable(flag: str, path: Optional[str], what: str) -> None:
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise StartupError(f"{flag} {path}: no such file; give the path of {what}")
    if not p.is_file():
        raise StartupError(f"{flag} {path}: not a file; give the path of {what}")
    try:
        p.open("rb").close()
    except OSError as e:
        raise StartupError(f"{flag} {path}: cannot be read ({(e.strerror or str(e)).lower()}); give the path of "
                           f"{what} this user may read") from None


def check_files(args) -> None:
    """Every file a flag names exists and reads as what it should be: tokens, PEM certificates and keys."""
    _readable("--auth-token-file", args.auth_token_file, "a file holding the bearer tokens, one per line")
    _readable("--tls-cert", args.tls_cert, "a PEM certificate chain")
    _readable("--tls-key", args.tls_key, "the PEM private key of --tls-cert")
    _readable("--tls-client-ca", args.tls_client_ca, "a PEM bundle of the CA certificates that sign client ones")
    if args.auth_token_file:
        from .security import load_tokens

        try:
            load_tokens(args.auth_token_file)
        except (ValueError, UnicodeDecodeError) as e:
            raise StartupError(str(e) if isinstance(e, ValueError) and str(e).startswith("--") else
                               f"--auth-token-file {args.auth_token_file}: not a text file of tokens ({e})") from None
    if args.tls_cert:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(args.tls_cert, args.tls_key)
        except ssl.SSLError as e:
            raise StartupError(f"--tls-cert {args.tls_cert} --tls-key {args.tls_key}: not a PEM certificate chain and "
                               f"its private key ({e.reason or e}); give the pair the certificate was made with") from None
    if args.tls_client_ca:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=args.tls_client_ca)
        except ssl.SSLError as e:
            raise StartupError(f"--tls-client-ca {args.tls_client_ca}: no PEM CA certificate in it ({e.reason or e})"
                               ) from None


def check_device(device: str) -> None:
    """--device cuda where torch sees no CUDA GPU: said now, not as torch's AssertionError when the model moves."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is built for the CPU only" if torch.version.cuda is None else
               f"torch {torch.__version__} was built for CUDA {torch.version.cuda} but finds no GPU or driver")
        raise StartupError(f"--device cuda: no CUDA GPU here ({why}); use --device cpu, or --device auto to take a "
                           f"GPU where there is one")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET


def check_host(flag: str, host: str) -> None:
    """`host` is an address of this machine (one it can listen on)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host.strip("[]"), 0))
        except socket.gaierror:
            raise StartupError(f"{flag} {host}: neither an address nor a name that resolves here; use 127.0.0.1 "
                               f"(this machine only), 0.0.0.0 (every interface) or one of this machine's addresses"
                               ) from None
        except OSError as e:
            raise StartupError(f"{flag} {host}: not an address of this machine ({(e.strerror or str(e)).lower()}); use "
                               f"127.0.0.1 (this machine only), 0.0.0.0 (every interface) or one of this machine's "
                               f"addresses") from None


def check_port(flag: str, host: str, port: Optional[int]) -> None:
    """host:port can be listened on now: PortInUse when another process holds it, StartupError otherwise."""
    if not port:
        return
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC: TIME_WAIT is no conflict, a listener is
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(f"{flag} {port}: {host}:{port} is in use by another process (another logitserve?); "
                                f"choose another {flag} or stop that process") from None
            if e.errno == errno.EACCES:
                raise StartupError(f"{flag} {port}: this user may not listen on ports below 1024; choose one above "
                                   f"1023") from None
            raise StartupError(f"{flag} {port}: cannot listen on {host}:{port} ({(e.strerror or str(e)).lower()})"
                               ) from None


def check_addresses(args) -> None:
    """--host and --metrics-host are this machine's, and --port, --http-port and --metrics-port are free."""
    check_host("--host", args.host)
    check_port("--port", args.host, args.port)
    check_port("--http-port", args.host, args.http_port)
    if args.metrics_port:
        check_host("--metrics-host", args.metrics_host)
        check_port("--metrics-port", args.metrics_host, args.metrics_port)
