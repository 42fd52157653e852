"""TLS, mTLS and bearer tokens over real TLS on loopback, with certificates made in the test."""
from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import serve_dir
from logitserve.client import LogitServeError, TeacherClient
from logitserve.server.security import SecurityConfig

pytestmark = pytest.mark.live_server


def _cert(name: str, issuer=None, ca: bool = False):
    """(PEM cert, PEM key, cert, key) for `name`, signed by `issuer` (cert, key) or self-signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject)
         .issuer_name(issuer[0].subject if issuer else subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    cert = b.sign(issuer[1] if issuer else key, hashes.SHA256())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), pem_key, cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_pem, _, ca_cert, ca_key = _cert("logitserve test CA", ca=True)
    other_pem, _, other_cert, other_key = _cert("another CA", ca=True)
    files = {"ca": ca_pem}
    files["server"], files["server_key"], *_ = _cert("server", (ca_cert, ca_key))
    files["client"], files["client_key"], *_ = _cert("student", (ca_cert, ca_key))
    files["rogue"], files["rogue_key"], *_ = _cert("rogue", (other_cert, other_key))
    for name, pem in files.items():
        (d / f"{name}.pem").write_bytes(pem)
    (d / "tokens").write_text("# students\nalpha-token-1\n\nbeta-token-2\n")
    return d


def _serve(model_dirs, pki, **security):
    return serve_dir(model_dirs["llama"], security=SecurityConfig(**{k: str(pki / v) for k, v in security.items()}))


def _ok(address, **kw) -> bool:
    with TeacherClient(address, **kw) as c:
        return c.logprobs([[1, 2, 3]])[0].shape == (3,) and c.model_info().vocab_size > 0


def _code(address, **kw) -> grpc.StatusCode:
    with TeacherClient(address, **kw) as c:
        with pytest.raises(LogitServeError) as e:
            c.model_info(timeout=10)
        with pytest.raises(LogitServeError):
            c.logprobs([[1, 2, 3]])
    return e.value.code


def test_tls_serves_a_client_that_trusts_the_ca_and_refuses_plaintext(model_dirs, pki):
    server = _serve(model_dirs, pki, tls_cert="server.pem", tls_key="server_key.pem")
    try:
        assert _ok(server.address, root_certificates=pki / "ca.pem")
        assert _code(server.address) == grpc.StatusCode.UNAVAILABLE                       # plaintext to a TLS port
        assert _code(server.address, root_certificates=pki / "rogue.pem") == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_mtls_refuses_a_client_without_a_certificate_the_ca_signed(model_dirs, pki):
    server = _serve(model_dirs, pki, tls_cert="server.pem", tls_key="server_key.pem", tls_client_ca="ca.pem")
    try:
        assert _ok(server.address, root_certificates=pki / "ca.pem", certificate_chain=pki / "client.pem",
                   private_key=pki / "client_key.pem")
        assert _code(server.address, root_certificates=pki / "ca.pem") == grpc.StatusCode.UNAVAILABLE
        assert _code(server.address, root_certificates=pki / "ca.pem", certificate_chain=pki / "rogue.pem",
                     private_key=pki / "rogue_key.pem") == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_bearer_tokens_on_every_rpc_but_health(model_dirs, pki):
    server = _serve(model_dirs, pki, tls_cert="server.pem", tls_key="server_key.pem", auth_token_file="tokens")
    ca = pki / "ca.pem"
    try:
        assert _ok(server.address, root_certificates=ca, token="alpha-token-1")
        assert _ok(server.address, root_certificates=ca, token="beta-token-2")
        assert _code(server.address, root_certificates=ca) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(server.address, root_certificates=ca, token="alpha-token-") == grpc.StatusCode.PERMISSION_DENIED
        creds = grpc.ssl_channel_credentials(ca.read_bytes())
        with grpc.secure_channel(server.address, creds) as ch:                            # probes need no token
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def test_a_token_works_over_plaintext_too_and_bad_flags_are_refused(model_dirs, pki):
    server = _serve(model_dirs, pki, auth_token_file="tokens")
    try:
        assert _ok(server.address, token="beta-token-2")
        assert _code(server.address, token="nope") == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop()
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        SecurityConfig(tls_cert="x.pem")
    with pytest.raises(ValueError, match="needs --tls-cert"):
        SecurityConfig(tls_client_ca="ca.pem")


def test_cli_client_commands_reach_a_tls_and_token_server(pki, model_dirs):
    """info, query, health and capture take --token/--token-file and --tls-ca (or their environment variables)."""
    import json
    import os
    import subprocess
    import sys

    from helpers import CliServer

    server = CliServer("--model", str(model_dirs["llama"]), "--tls-cert", str(pki / "server.pem"),
                       "--tls-key", str(pki / "server_key.pem"), "--auth-token-file", str(pki / "tokens"))

    def cli(*args, env=None):
        return subprocess.run([sys.executable, "-m", "logitserve.server.cli", *args], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **(env or {})})
    try:
        ca = ("--tls-ca", str(pki / "ca.pem"))
        info = cli("info", server.address, *ca, "--token", "alpha-token-1")
        assert info.returncode == 0 and "vocab_size" in info.stdout, info.stderr
        (pki / "student-token").write_text("beta-token-2\n")
        q = cli("query", server.address, "--ids", "1,2,3", *ca, "--token-file", str(pki / "student-token"))
        assert q.returncode == 0 and len([x for x in q.stdout.splitlines() if x.split()[:1] == ["2"]]) == 1, q.stderr
        env = {"LOGITSERVE_TLS_CA": str(pki / "ca.pem"), "LOGITSERVE_TOKEN": "alpha-token-1"}
        assert cli("query", server.address, "--ids", "4 5", env=env).returncode == 0
        data = pki / "data.jsonl"
        data.write_text("\n".join(json.dumps({"ids": [1, 2, 3, 4]}) for _ in range(3)) + "\n")
        cap = cli("capture", server.address, "--input", str(data), "--out", str(pki / "cap"), "--topk", "4",
                  "--no-progress", env=env)
        assert cap.returncode == 0 and "captured 3 samples" in cap.stdout, cap.stderr
        health = cli("health", server.address, *ca)
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
        no_token = cli("info", server.address, *ca, "--wait", "0")
        assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr and "Traceback" not in no_token.stderr
        wrong = cli("info", server.address, *ca, "--token", "nope", "--wait", "0")
        assert wrong.returncode == 1 and "PERMISSION_DENIED" in wrong.stderr
    finally:
        server.stop()
