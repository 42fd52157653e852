"""Start-up and shutdown as a client sees them: UNAVAILABLE (never UNIMPLEMENTED) while the model loads, clients
that wait through it, and SIGTERM past the grace period ending what still runs with UNAVAILABLE and exit 0."""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from helpers import CliServer
from logitserve.client import LogitServeError, TeacherClient
from logitserve.kserve import grpc_predict_v2_pb2 as kpb
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--device", "cpu", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _poll_all(ch: grpc.Channel) -> list[tuple[str, grpc.StatusCode, str]]:
    """One call of each kind of RPC the port serves: (which, code, details)."""
    seq = np.array([1, 2, 3], np.int32)
    req = pb.ForwardRequest(request_id="p", sequences=[pb.Tensor(dtype=pb.INT32, shape=[3], data=seq.tobytes())])
    req.logprobs.SetInParent()
    calls = {
        "ModelInfo": lambda: pb_grpc.LogitServeStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=2),
        "Forward": lambda: list(pb_grpc.LogitServeStub(ch).Forward(iter([req]), timeout=2)),
        "KServe": lambda: kpb_grpc.GRPCInferenceServiceStub(ch).ServerMetadata(kpb.ServerMetadataRequest(), timeout=2),
        "reflection": lambda: list(ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                                    request_serializer=None, response_deserializer=None)(
            iter([b"\x3a\x00"]), timeout=2)),          # list_services = ""
    }
    out = []
    for name, call in calls.items():
        try:
            call()
            out.append((name, grpc.StatusCode.OK, ""))
        except grpc.RpcError as e:
            out.append((name, e.code(), e.details() or ""))
    return out


# Reconnect at once after a refused connection (gRPC's default backoff would skip the loading window).
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 100)]


@pytest.mark.multi_process
@pytest.mark.parametrize("tp", [1, 2])
def test_a_client_polling_from_the_first_second_never_sees_unimplemented(tp):
    port = _free_port()
    proc = _start(port, "--demo-shape", "body", "--tp", str(tp))     # a few seconds of loading
    seen = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=FAST_RECONNECT) as ch:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                round_ = _poll_all(ch)
                seen += round_
                if all(code == grpc.StatusCode.OK for _, code, _ in round_):
                    break
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    codes = {code for _, code, _ in seen}
    assert grpc.StatusCode.UNIMPLEMENTED not in codes, [s for s in seen if s[1] == grpc.StatusCode.UNIMPLEMENTED]
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    loading = [d for _, code, d in seen if "model is loading" in d]
    assert loading, "no call landed while the model loaded"
    assert all(re.search(r"for \d+ s so far", d) for d in loading)
    assert {name for name, code, _ in seen if code == grpc.StatusCode.OK} == {"ModelInfo", "Forward", "KServe",
                                                                             "reflection"}


@pytest.mark.live_server
def test_clients_wait_through_start_up(model_dirs):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    got = {}

    def early_client():            # made before the process even listens
        try:
            with TeacherClient(address, wait_ready=120) as c:
                got["lp"] = c.logprobs([[1, 5, 9]])[0]
        except Exception as e:     # noqa: BLE001 (reported by the assertion below)
            got["error"] = e

    t = threading.Thread(target=early_client)
    t.start()
    time.sleep(0.3)
    proc = _start(port, "--model", str(model_dirs["llama"]))
    try:
        # The CLI waits for a server that answers it is loading (a refused port is said at once: test_cli_errors.py)
        assert proc.stdout.readline().startswith("logitserve: loading on"), "the port opens before the model loads"
        info = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "info", address], capture_output=True,
                              text=True, timeout=120)
        t.join(120)
        assert info.returncode == 0, info.stderr
        assert "vocab_size" in info.stdout
        assert "error" not in got, got.get("error")
        assert got["lp"].shape == (3,) and got["lp"][0] == 0
        with pytest.raises(LogitServeError) as e:   # a server that never comes: the wait ends, saying so
            TeacherClient(f"127.0.0.1:{_free_port()}", wait_ready=1.0)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "not ready within 1 s" in e.value.details
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.mark.live_server
def test_sigterm_past_the_grace_period_ends_requests_with_unavailable_and_exits_zero():
    server = CliServer("--grace-s", "0.3", "--max-response-bytes", "4GiB")   # 2 GB of full logits: long enough
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1000, 2048) for _ in range(8)]
    result = {}
    with TeacherClient(server.address, retries=0) as c:
        def long_request():
            try:
                result["value"] = c.full_logits(seqs)
            except LogitServeError as e:
                result["error"] = e
        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        assert t.is_alive(), "the request finished before SIGTERM: make it longer"
        started = time.monotonic()
        code = server.stop(timeout=60)
        t.join(30)
    assert code == 0, "".join(server.log[-20:])
    assert time.monotonic() - started < 20
    err = result.get("error")
    assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE, result
    assert "grace" in err.details
    assert not any("terminate called" in line for line in server.log)


def _kserve_logprobs(seqs):
    ids = np.stack(seqs).astype(np.int32)
    req = kpb.ModelInferRequest(model_name="")
    req.inputs.add(name="input_ids", datatype="INT32", shape=list(ids.shape))
    req.raw_input_contents.append(ids.tobytes())
    req.outputs.add(name="token_logprobs")
    return req


@pytest.mark.live_server
@pytest.mark.parametrize("grace,ends", [("0.3", "UNAVAILABLE"), ("60", "OK")])
def test_kserve_requests_get_the_grace_period_too(grace, ends):
    """A KServe call in flight at SIGTERM is drained like a native one: it finishes within --grace-s, or is ended
    with UNAVAILABLE once it is over; the process exits 0 either way."""
    server = CliServer("--grace-s", grace, "--demo-shape", "body")
    rng = np.random.default_rng(1)
    req = _kserve_logprobs([rng.integers(3, 32000, 1024) for _ in range(2)])   # ~10 s of the body shape here
    result = {}
    with grpc.insecure_channel(server.address) as ch:
        stub = kpb_grpc.GRPCInferenceServiceStub(ch)

        def call():
            try:
                result["shape"] = tuple(stub.ModelInfer(req, timeout=120).outputs[0].shape)
                result["code"] = "OK"
            except grpc.RpcError as e:
                result["code"], result["details"] = e.code().name, e.details()
        t = threading.Thread(target=call)
        t.start()
        time.sleep(1.0)
        assert t.is_alive(), "the request finished before SIGTERM: make it longer"
        code = server.stop(timeout=120)
        t.join(60)
    assert code == 0, "".join(server.log[-20:])
    assert result["code"] == ends, result
    if ends == "OK":
        assert result["shape"] == (2, 1024)
    else:
        assert "grace" in result["details"]
