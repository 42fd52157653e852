"""SIGTERM drains: NOT_SERVING and new requests UNAVAILABLE at once, the request in flight completes, exit 0;
request and stream limits answer RESOURCE_EXHAUSTED naming the flag."""
from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import CliServer, serve_dir
from logitserve.client import LogitServeError, TeacherClient, Wanted
from logitserve.server.admission import ClientLimits
from logitserve.server.config import StreamLimits

pytestmark = pytest.mark.live_server


def test_sigterm_lets_the_request_in_flight_finish_and_refuses_new_ones():
    server = CliServer("--logprob-chunk-size", "512", "--grace-s", "60", "--batching", "exact")
    seqs = [np.random.default_rng(1).integers(3, 32000, 4096) for _ in range(6)]       # seconds of work
    result = {}
    with TeacherClient(server.address) as c, TeacherClient(server.address) as late:
        c.logprobs([[1, 2]])
        late.logprobs([[1, 2]])                                     # a stream already open before the SIGTERM
        future = c.submit(seqs, Wanted(logprobs=True))
        time.sleep(1.0)
        assert not future.done(), "the request must still be in flight at SIGTERM"
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(LogitServeError) as refused:
            late.logprobs([[1, 2, 3]])
        with grpc.insecure_channel(server.address) as ch:
            try:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
                result["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as e:
                result["health"] = e.code().name
        r = future.result(timeout=120)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert result["health"] in ("NOT_SERVING", "UNAVAILABLE")
    assert [len(x) for x in r.logprobs] == [4096] * 6 and all(np.isfinite(x[1:]).all() for x in r.logprobs)
    assert server.proc.wait(60) == 0, "".join(server.log[-20:])


def test_request_and_stream_limits_name_the_flag(model_dirs):
    server = serve_dir(model_dirs["llama"], limits=StreamLimits(max_sequences=3, max_request_tokens=40,
                                                                  max_streams=2, max_in_flight=2),
                       clients=ClientLimits(max_streams=2))    # one host here: the server-wide bound, not its share
    try:
        with TeacherClient(server.address) as c:
            for seqs, flag in (([[1, 2]] * 4, "--max-sequences-per-request 3"), ([list(range(1, 30))] * 2,
                                                                                   "--max-request-tokens 40")):
                with pytest.raises(LogitServeError) as e:
                    c.logprobs(seqs)
                assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and flag in e.value.details
            futures = [c.submit([list(range(1, 20))], Wanted(
                logprobs=True)) for _ in range(6)]
            codes = []
            for f in futures:
                try:
                    f.result(timeout=60)
                    codes.append("OK")
                except LogitServeError as e:
                    codes.append(e.code.name)
                    assert "--max-in-flight-per-stream is 2" in e.details
            assert codes.count("OK") >= 2 and set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
            clients = [TeacherClient(server.address) for _ in range(2)]
            try:
                clients[0].logprobs([[1, 2]])                         # c and clients[0]: two streams open
                with pytest.raises(LogitServeError) as e:
                    clients[1].logprobs([[1, 2]])
                assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams" in e.value.details
            finally:
                for x in clients:
                    x.close()
            assert c.logprobs([[1, 2, 3]])[0].shape == (3,)
    finally:
        server.stop()


def test_health_says_not_serving_while_the_model_loads(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "LOGITSERVE_CACHE": str(tmp_path)}               # the body demo is built first: seconds
    proc = subprocess.Popen([sys.executable, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1",
                             "--port", "0", "--demo-shape", "body"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    try:
        for line in proc.stdout:
            if line.startswith("logitserve: loading on"):
                address = line.split()[3]
                with grpc.insecure_channel(address) as ch:
                    seen.append(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                                      timeout=10).status)
            if line.startswith("logitserve: serving"):
                assert line.split()[-1] == address                              # the same port throughout
                with grpc.insecure_channel(address) as ch:
                    seen.append(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                                      timeout=10).status)
                break
        assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
