"""Prometheus metrics on --metrics-port, grpc reflection (its own client, as grpcurl uses it), JSON access logs."""
from __future__ import annotations

import json
import re
import urllib.request

import grpc
import numpy as np
import pytest

from helpers import CliServer, serve_dir
from logitserve.client import LogitServeError, TeacherClient

pytestmark = pytest.mark.live_server


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+(?:\{[^}]*\})?) ([-+\d.eE]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_count_requests_tokens_batches_and_memory(model_dirs):
    server = serve_dir(model_dirs["llama"], metrics_port=0)
    try:
        port = server.running.metrics_port
        before = _scrape(port)
        seqs = [np.arange(1, 21), np.arange(1, 11)]
        with TeacherClient(server.address) as c:
            c.forward(seqs, logprobs=True, topk=4)
            c.logprobs(seqs)
            with pytest.raises(LogitServeError):
                c.logprobs([[1, 10 ** 6]])
        after = _scrape(port)
    finally:
        server.stop()
    d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)   # noqa: E731
    assert d('logitserve_requests_total{output="logprobs",status="OK"}') == 2
    assert d('logitserve_requests_total{output="topk",status="OK"}') == 1
    assert d('logitserve_requests_total{output="logprobs",status="INVALID_ARGUMENT"}') == 1
    assert d("logitserve_tokens_total") == 60
    assert d("logitserve_request_seconds_count") == 3 and d("logitserve_request_seconds_sum") > 0
    assert d("logitserve_batch_requests_count") >= 1 and d("logitserve_batch_tokens_sum") == 60
    assert d("logitserve_queue_wait_seconds_count") == 2 and d("logitserve_batch_compute_seconds_count") >= 1
    assert d("logitserve_response_bytes_total") > 30 * 4
    assert after["logitserve_rss_bytes"] > 50e6 and after["logitserve_queue_requests"] == 0
    assert "logitserve_cuda_memory_bytes" in after


def test_reflection_lists_and_describes_the_services(llama_server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(llama_server.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        forward = DescriptorPool(db).FindServiceByName("logitserve.v1.LogitServe")
        assert {"logitserve.v1.LogitServe", "grpc.health.v1.Health"} <= services
        assert {m.name for m in forward.methods} == {"Forward", "ModelInfo", "Detokenize", "Head"}
        assert "texts" in forward.methods_by_name["Forward"].input_type.fields_by_name


def test_json_logs_carry_request_ids():
    server = CliServer("--logprob-chunk-size", "64", "--log-format", "json", "--metrics-port", "0")
    try:
        with TeacherClient(server.address) as c:
            c.logprobs([[1, 5, 9]])
    finally:
        assert server.stop() == 0
    records = [json.loads(line) for line in server.log if line.startswith("{")]
    done = [r for r in records if r.get("logger") == "logitserve.requests"]
    assert done and done[0]["status"] == "OK" and done[0]["tokens"] == 3 and done[0]["request_id"].startswith("r")
    assert any("metrics on http://" in r["msg"] for r in records)
